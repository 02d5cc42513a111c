"""Import costs and the package's public names, each in a fresh interpreter
(what a module imports is only visible before anything else imported it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import mlx_tracer

HEAVY = ("mlx_tracer.runtime", "mlx_tracer.api", "mlx_tracer.loading", "mlx_tracer.bench", "mlx_tracer.cli")


def fresh(code: str, **env) -> dict:
    """Run ``code`` in a new interpreter with the fast BLAS allowed; it prints one JSON line."""
    e = dict(os.environ)
    e.pop("MLX_TRACER_BLAS", None)  # the suite pins the reference BLAS; a user's import does not
    e.update(env)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=e)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_importing_caches_loads_no_runtime_loader_or_tools_and_binds_the_fast_blas():
    out = fresh(
        "import json, sys\n"
        "import mlx_tracer.caches\n"
        "mods = sorted(m for m in sys.modules if m.startswith('mlx_tracer'))\n"
        "from mlx_tracer.backend import blas\n"
        "print(json.dumps({'modules': mods, 'fast': blas.status().fast}))\n"
    )
    leaked = [m for m in out["modules"] if m.startswith(HEAVY)]
    assert not leaked, f"import mlx_tracer.caches imported {leaked}"
    assert out["fast"], "the fast BLAS is not active after import mlx_tracer.caches"


def test_importing_the_package_imports_only_the_blas_binding():
    out = fresh("import json, sys\nimport mlx_tracer\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith(('mlx', 'numpy')))))")
    assert out == ["mlx_tracer", "mlx_tracer.backend", "mlx_tracer.backend.blas", "mlx_tracer.home"], out


def test_public_names_resolve_on_first_use():
    out = fresh(
        "import json, sys\n"
        "from mlx_tracer import Generator\n"
        "import mlx_tracer\n"
        "print(json.dumps({'gen': Generator.__module__, 'api': 'mlx_tracer.api' in sys.modules,"
        " 'engine_loaded': 'mlx_tracer.runtime.engine' in sys.modules, 'all': mlx_tracer.__all__,"
        " 'dir': [n for n in mlx_tracer.__all__ if n not in dir(mlx_tracer)]}))\n"
    )
    assert out["gen"] == "mlx_tracer.generator" and out["api"]
    assert not out["dir"], f"names in __all__ missing from dir(): {out['dir']}"
    assert {"Generator", "Engine", "SamplingParams", "CompiledModel", "TraceKey", "load", "generate"} <= set(out["all"])


def test_every_public_name_resolves_and_unknown_names_fail():
    for name in mlx_tracer.__all__:
        assert getattr(mlx_tracer, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mlx_tracer.nope  # noqa: B018
    from mlx_tracer import bench  # a sub-package, not a lazy name

    assert bench.Machine.__module__ == "mlx_tracer.bench.machine"
