"""Compile-once needs MLX's CPU JIT (g++): without it mlx-tracer stops at model
load with an error that names the package, instead of retracing every step.
Each case runs in a fresh interpreter with a fresh MLX kernel cache ($TMPDIR)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import CLI

BIN = str(Path(sys.executable).parent)  # python and mlx-tracer, no compiler


def run(args, tmp_path, strip_compilers=True, **extra):
    env = dict(os.environ, TMPDIR=str(tmp_path), **extra)
    if strip_compilers:
        env["PATH"] = BIN
        env.pop("CC", None)
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


CHECK = "from mlx_tracer.backend.jit import check_compiler\nprint(check_compiler())"


def test_with_a_compiler_mx_compile_traces_once(tmp_path):
    r = run([sys.executable, "-c", CHECK], tmp_path, strip_compilers=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "cpu-jit"
    assert list((tmp_path / "mlx").rglob("*.so")), "the probe built no kernel in the fresh kernel cache"


@pytest.mark.skipif(sys.platform != "linux", reason="MLX's CPU JIT runs g++ on Linux")
def test_without_a_compiler_the_check_names_the_package(tmp_path):
    r = run([sys.executable, "-c", CHECK], tmp_path)
    assert r.returncode != 0
    assert "CompilerUnavailable" in r.stderr and "g++" in r.stderr and "apt-get install g++" in r.stderr


def test_without_a_compiler_generate_stops_before_loading(tmp_path):
    r = run([CLI, "generate", "Hi", "--max-tokens", "2", "--weights", "as-is"], tmp_path)
    assert r.returncode == 1, r.stderr
    lines = [line for line in r.stderr.splitlines() if not line.startswith(("loading", "[mlx-tracer]"))]
    assert len(lines) == 1 and lines[0].startswith("mlx-tracer: error: no C++ compiler"), r.stderr
    assert "apt-get install g++" in lines[0] and "Traceback" not in r.stderr
    assert "loaded in" not in r.stderr and r.stdout == ""


def test_mlx_disable_compile_is_named(tmp_path):
    r = run([sys.executable, "-c", CHECK], tmp_path, strip_compilers=False, MLX_DISABLE_COMPILE="1")
    assert r.returncode != 0 and "MLX_DISABLE_COMPILE is set" in r.stderr
