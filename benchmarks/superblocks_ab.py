"""A held form against the one it replaces on a model's own matrices, in one process.

    python benchmarks/superblocks_ab.py MODEL.gguf [--form superblocks|5bit] [--rows 1 8] [--rounds 7]

Binds the model's lean forward (quantized-split), takes every quantized
matrix it holds in the form (``superblocks``: scales held as superblocks,
adapters/lean/scales.py; ``5bit``: integers below 32 held as 5-bit blocks,
adapters/lean/narrow.py), and times ``kernels.qmm`` (split contract) over
all of them once in that form and once in the one it replaces (float32
scales; 8-bit blocks: the same values), interleaved round by round; prints
the medians, their ratio and both forms' bytes. The load average before and
after is printed beside them: on a busy machine the ratio is what compares.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
from mlx_tracer import api
from mlx_tracer.adapters.lean import narrow, scales
from mlx_tracer.backend import kernels
from mlx_tracer.runtime.step import CompiledModel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--form", choices=("superblocks", "5bit"), default="superblocks")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="x rows (the bucket)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    K = kernels.load()
    if K is None:
        raise SystemExit(f"native kernels unavailable: {kernels.status()}")
    model, _ = api.load(args.model, progress=False, weights="quantized-split")
    lean = CompiledModel(model, fuse=True).lean
    mx.eval(lean.buffers)
    print(f"bound: {mx.get_active_memory() / 1e6:.0f} MB of MLX arrays held "
          f"({scales.ENV}={os.environ.get(scales.ENV, '')!r}, {narrow.ENV}={os.environ.get(narrow.ENV, '')!r})")
    b = lean.binding
    groups = [r for s in b.layers for g in s.groups().values() for r in g.runs] + ([b.head] if b.head else [])
    # each: (its x's K, then per form the qmm operands w, scales, biases, bits); [1] the held form, [2] the other
    mats = []
    for g in groups:
        p = g.p
        if g.kernel is None:
            continue
        Kd = g.mods[0].weight.shape[1] * 32 // g.quant[1]
        if args.form == "superblocks" and p["scales"].dtype == mx.uint8:
            f32 = (scales.expand(p["scales"]), scales.expand(p["biases"]))
            mx.eval(f32)
            mats.append((Kd, (p["weight"], p["scales"], p["biases"], g.bits), (p["weight"], *f32, g.bits)))
        elif args.form == "5bit" and g.bits == 5:
            eight = narrow.expand(p["weight"])
            mx.eval(eight)
            mats.append((Kd, (p["weight"], p["scales"], p["biases"], 5), (eight, p["scales"], p["biases"], 8)))
    env = scales.ENV if args.form == "superblocks" else narrow.ENV
    if not mats:
        raise SystemExit(f"{args.model}: no matrix holds {args.form} ({env}={os.environ.get(env, '')!r})")
    names = ("superblocks", "float32 scales") if args.form == "superblocks" else ("5-bit blocks", "8-bit blocks")
    mb = lambda i: sum(a.nbytes for m in mats for a in m[i][:3]) / 2**20  # noqa: E731
    print(f"{len(mats)} matrices: {mb(1):.0f} MB with {names[0]}, {mb(2):.0f} MB with {names[1]}; "
          f"load average {os.getloadavg()[0]:.2f}")
    for M in args.rows:
        xs = {Kd: mx.random.normal((M, Kd)) for Kd in {m[0] for m in mats}}
        mx.eval(list(xs.values()))

        def run(i):
            t = time.perf_counter()
            for m in mats:
                w, sc, bi, bits = m[i]
                mx.eval(K.qmm(xs[m[0]], w, sc, bi, 32, bits, contract="split"))
            return (time.perf_counter() - t) * 1e3

        run(1), run(2)  # warm-up
        held, other = [], []
        for _ in range(args.rounds):
            other.append(run(2))
            held.append(run(1))
        a, b = statistics.median(other), statistics.median(held)
        print(f"{M} x rows: every matrix once, median ms: {names[1]} {a:.1f}, {names[0]} {b:.1f} "
              f"({b / a:.3f}x); load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
