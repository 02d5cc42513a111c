"""pytest-benchmark suite: stock mlx-lm decode vs mlx-tracer's compiled loop.

Run:  ./dev test benchmarks --benchmark-enable      (not part of the default run)
CI runs it once with BENCH_SMOKE=1 and --benchmark-disable (seconds) so it cannot rot.
"""

from __future__ import annotations

import os

import pytest

from mlx_tracer import bench
from mlx_tracer.loading.store import is_valid_model_file, resolve_model
from mlx_tracer.runtime.step import CompiledModel

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
TOKENS = 4 if SMOKE else 32
CONTEXT = 32 if SMOKE else 128


def _smollm2_present() -> bool:
    try:
        return is_valid_model_file(resolve_model())
    except FileNotFoundError:
        return False


MODELS = ["llama-h64"] if SMOKE else ["llama-h64", "llama-h256"] + (["smollm2"] if _smollm2_present() else [])
BUCKETS = [1, 2] if SMOKE else [1, 4, 8]


@pytest.fixture(scope="session")
def loaded():
    cache = {}

    def get(name):
        if name not in cache:
            model, label = bench.load_bench_model(name)
            compiled = CompiledModel(model)
            ctx = bench.synthetic_context(model, compiled.layout, CONTEXT)
            cache[name] = (model, label, compiled, ctx)
        return cache[name]

    return get
