"""MLX's own 5- and 6-bit models on the CPU: qmm's layouts against mx.quantized_matmul.

    python benchmarks/mlx_bits.py [--model FILE] [--bits 5 6] [--group 64] [--buckets 1 8] [--rounds 5]

A model as ``mlx_lm.convert -q --q-bits B --q-group-size G`` writes it
from a bfloat16 checkpoint: the model file (default: SmolLM2's GGUF)
dequantized to bfloat16, then ``nn.quantize`` at B bits
(make_mlx_lm_model.py's ``requantize``), in the ``quantized-split`` format.
Two copies are compiled: one the lean forward binds as 0.5.31 does (its
blocks repacked into qmm's 5- or 6-bit layout, adapters/lean/narrow.py),
one as 0.5.30 did (the repack declined: mx.quantized_matmul reads MLX's
layout, the layers on MLX's ops). Each compiled decode step (the loop's)
is timed from ``--context`` cached positions on (a round's steps add
theirs) at each bucket, the two copies taking turns round by round; prints the medians, their ratio, and
the weight bytes each holds (the model's arrays). The load average before and after is
printed beside them: on a busy machine the ratio is what compares.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
from mlx_tracer import api
from mlx_tracer.adapters.lean import narrow
from mlx_tracer.backend import kernels
from mlx_tracer.loading.weights import apply_format
from make_mlx_lm_model import requantize  # (this folder: the script runs with it on sys.path)
from mlx_tracer.runtime.step import CompiledModel


def build(path: str, bits: int, group: int):
    model, _ = api.load(path, progress=False, weights="as-is")
    return apply_format(requantize(model, bits, group), "quantized-split")


def compiled(model, repack: bool):
    saved = narrow.TO
    narrow.TO = saved if repack else {8: 5}  # (8: GGUF's 5-bit integers, not what this compares)
    try:
        cm = CompiledModel(model, fuse=True)
        mx.eval(cm.lean.buffers)
    finally:
        narrow.TO = saved
    return cm


def weight_bytes(model) -> int:
    """The model's arrays' bytes, a held form's at its own (narrow.py; 5 and 6 bits: the same as MLX's)."""
    from mlx.utils import tree_flatten

    held = sum(narrow.bytes_saved(m) for m in model.modules())
    return sum(v.nbytes for _, v in tree_flatten(model.parameters())) - held


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model file or folder (default: SmolLM2's GGUF)")
    ap.add_argument("--bits", type=int, nargs="+", default=[5, 6])
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8, help="decode steps a round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if kernels.load() is None:
        raise SystemExit(f"native kernels unavailable: {kernels.status()}")
    path = args.model  # None: the default model (api.load)
    for bits in args.bits:
        cms = {"qmm layout": compiled(build(path, bits, args.group), True),
               "mx.quantized_matmul": compiled(build(path, bits, args.group), False)}
        for name, cm in cms.items():
            off = cm.lean.native_off or (f"{len(cm.lean.ops_at)} layers on MLX's ops" if cm.lean.ops_at else "all native")
            print(f"{bits}-bit, group {args.group}, {name}: weights {weight_bytes(cm.model) / 1e6:.1f} MB, layers: {off}")
        for B in args.buckets:
            state = {}
            for name, cm in cms.items():
                caches = cm.new_caches(B, rows=B)
                cm.step(caches, mx.zeros((B, args.context), dtype=mx.int32))
                state[name] = caches
            times = {name: [] for name in cms}
            y = mx.zeros((B, 1), dtype=mx.int32)
            load0 = os.getloadavg()[0]
            for r in range(args.rounds + 1):
                for name, cm in cms.items():
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        mx.eval(cm.step(state[name], y).tokens)
                    if r:  # the first round traces and warms
                        times[name].append(1e3 * (time.perf_counter() - t0) / args.steps)
            med = {name: statistics.median(t) for name, t in times.items()}
            a, b = med["qmm layout"], med["mx.quantized_matmul"]
            print(f"  bucket {B}: qmm layout {a:.2f} ms a step, mx.quantized_matmul {b:.2f} ms ({b / a:.2f}x), "
                  f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
