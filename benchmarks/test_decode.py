"""Decode throughput, stock mlx-lm vs mlx-tracer, per model and bucket."""

from __future__ import annotations

import pytest

from mlx_tracer import bench
from mlx_tracer.runtime.engine import Engine

from .conftest import BUCKETS, CONTEXT, MODELS, TOKENS


@pytest.mark.parametrize("system", ["stock", "tracer"])
@pytest.mark.parametrize("B", BUCKETS)
@pytest.mark.parametrize("name", MODELS)
def test_decode(benchmark, loaded, name, B, system):
    model, label, compiled, ctx = loaded(name)
    first = [(7 * i + 3) % compiled.vocab_size for i in range(B)]
    contexts = [ctx] * B
    if system == "stock":
        run = lambda: bench.stock_decode(model, contexts, first, TOKENS)  # noqa: E731
    else:
        engine = Engine(compiled, buckets=(B,))
        run = lambda: bench.tracer_decode(engine, contexts, first, TOKENS).decode_tps  # noqa: E731
    run()  # warm-up: traces and kernel JIT stay out of the timing
    before = sum(compiled.traces.values())
    benchmark.group = f"{label} B={B} ctx={CONTEXT}"
    benchmark.extra_info.update(model=label, bucket=B, context=CONTEXT, tokens=TOKENS)
    tps = benchmark.pedantic(run, rounds=3, iterations=1)
    benchmark.extra_info["tok_per_s"] = tps
    assert tps > 0
    assert sum(compiled.traces.values()) == before, "decode retraced after warm-up"
