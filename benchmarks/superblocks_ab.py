"""Superblock scales against float32 ones on a model's own matrices, in one process.

    python benchmarks/superblocks_ab.py MODEL.gguf [--rows 1 8] [--rounds 7]

Binds the model's lean forward (quantized-split), takes every quantized
matrix whose scales it holds as superblocks (adapters/lean/scales.py), and
times ``kernels.qmm`` (split contract) over all of them once with those
superblocks and once with their float32 expansion (the same values),
interleaved round by round; prints the medians, their ratio and both forms'
bytes. The load average before and after is printed beside them: on a busy
machine the ratio is what compares.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
from mlx_tracer import api
from mlx_tracer.adapters.lean import scales
from mlx_tracer.backend import kernels
from mlx_tracer.runtime.step import CompiledModel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="x rows (the bucket)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    K = kernels.load()
    if K is None:
        raise SystemExit(f"native kernels unavailable: {kernels.status()}")
    model, _ = api.load(args.model, progress=False, weights="quantized-split")
    lean = CompiledModel(model, fuse=True).lean
    mats = []
    for p in lean.buffers.values():
        if p["scales"].dtype != mx.uint8:
            continue
        w, Kd = p["weight"], p["scales"].shape[1] * 2 // 3 * 32
        f32 = (scales.expand(p["scales"]), scales.expand(p["biases"]))
        mx.eval(f32)
        mats.append((w, (p["scales"], p["biases"]), f32, Kd, w.shape[1] * 32 // Kd))
    if not mats:
        raise SystemExit(f"{args.model}: no matrix holds superblock scales (float32 k-quant scales only; "
                         f"{scales.ENV}={os.environ.get(scales.ENV, '')!r})")
    mb = lambda i: sum(m[0].nbytes + m[i][0].nbytes + m[i][1].nbytes for m in mats) / 2**20  # noqa: E731
    print(f"{len(mats)} matrices: {mb(1):.0f} MB with superblocks, {mb(2):.0f} MB with float32 scales; "
          f"load average {os.getloadavg()[0]:.2f}")
    for M in args.rows:
        xs = {Kd: mx.random.normal((M, Kd)) for Kd in {m[3] for m in mats}}
        mx.eval(list(xs.values()))

        def run(i):
            t = time.perf_counter()
            for m in mats:
                mx.eval(K.qmm(xs[m[3]], m[0], *m[i], 32, m[4], contract="split"))
            return (time.perf_counter() - t) * 1e3

        run(1), run(2)  # warm-up
        sb, f32 = [], []
        for _ in range(args.rounds):
            f32.append(run(2))
            sb.append(run(1))
        a, b = statistics.median(f32), statistics.median(sb)
        print(f"{M} x rows: every matrix once, median ms: float32 scales {a:.1f}, superblocks {b:.1f} "
              f"({b / a:.3f}x); load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
