"""Prefill speed of SmolLM2 (fp32) for a 1025-token prompt with the largest
prefill window at 512 vs 256 tokens (the window bounds how long Ctrl-C waits).

    python benchmarks/prefill_windows.py
"""

import os
import statistics
import time

import mlx_tracer  # noqa: F401  (first: it binds the fast BLAS before mlx loads)
from mlx_tracer import Generator
from mlx_tracer.runtime.engine import Engine

gen = Generator.load(weights="float32")
prompt = list(range(1000, 1000 + 1025))
compiled = gen.engine.compiled
results = {(8, 32, 128, 512): [], (8, 32, 128, 256): []}
for chunks in results:  # trace the windows and build the kernels first
    eng = Engine(compiled, prefill_chunks=chunks, buckets=(1,))
    eng.add(prompt, max_tokens=1)
    eng.admit()
load = os.getloadavg()[0]
for _ in range(3):
    for chunks in results:
        eng = Engine(compiled, prefill_chunks=chunks, buckets=(1,))
        eng.add(prompt, max_tokens=1)
        t0 = time.perf_counter()
        eng.admit()
        results[chunks].append(time.perf_counter() - t0)
print(f"load average (1 min): {load:.2f} before, {os.getloadavg()[0]:.2f} after")
for chunks, times in results.items():
    print(f"windows {chunks}: median {1024 / statistics.median(times):.1f} tok/s, longest window {max(chunks)} tokens")
