"""The console script, run as a user runs it."""

from __future__ import annotations

import subprocess

import pytest

from .helpers import CLI, model_present


def run(*args, timeout=300):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout)


needs_model = pytest.mark.skipif(not model_present(), reason="SmolLM2 GGUF not present: run `mlx-tracer fetch`")


@pytest.mark.model
@needs_model
def test_generate_prints_the_answer_and_a_summary():
    r = run("generate", "What is the capital of France? Answer in one sentence.", "--max-tokens", "16", "--weights", "as-is")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "decode:" in r.stderr and "tok/s" in r.stderr and "traces:" in r.stderr


@pytest.mark.model
@needs_model
def test_generate_batch_and_trace_with_dot(tmp_path):
    r = run("generate", "Hi", "Name a color.", "--max-tokens", "4", "--buckets", "1,2", "--weights", "as-is")
    assert r.returncode == 0, r.stderr
    assert "[0]" in r.stdout and "[1]" in r.stdout
    dot = tmp_path / "decode.dot"
    r = run("trace", "--buckets", "1", "--dot", str(dot), "--weights", "as-is")
    assert r.returncode == 0, r.stderr
    assert "decode       1    1" in r.stdout
    assert dot.exists() and "QuantizedMatmul" in r.stdout


def test_bad_input_gives_clear_errors(tmp_path):
    r = run("generate", "hello", "--model", str(tmp_path / "nope.gguf"))
    assert r.returncode == 2 and "mlx-tracer fetch" in r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    r = run("generate", "hello", "--model", str(bad))
    assert r.returncode == 2 and "not a GGUF" in r.stderr
    r = run("generate", "hello", "--max-tokens", "0")
    assert r.returncode == 2 and "--max-tokens must be > 0" in r.stderr
    r = run("generate", "  ")
    assert r.returncode == 2 and "empty prompt" in r.stderr
