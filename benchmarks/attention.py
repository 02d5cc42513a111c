"""The decode attention of the layer kernels alone, per K/V dtype and arithmetic.

    python benchmarks/attention.py [--rows 8] [--context 1152] [--layers 30] [--heads 3] [--group 3] [--dim 64]

One call covers ``layers`` layers' worth of (row, key head) blocks (distinct
memory, so the K/V stream from DRAM as in a decode step), SmolLM2's shapes
by default (3 key heads, 3 query heads each, head size 64, 1152 columns: the
capacity bucket of a 1024-token context). Prints the median ms of a call
and the K/V bytes it read per second, for the BLAS path (MLX's bits) and
the vector path, float32 / float16 / bfloat16 K/V, and 8-/4-bit packed K/V
(group 64, float32 scales: MLX's quantized_matmul arithmetic, "mlx", and the
vector path: with heads of 64, one group a row, the factored arithmetic,
its keys' products in integers; ``MLX_TRACER_PACKED_ATTENTION=dequantized``
puts MLX's dequantized values in the float lanes instead).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
from mlx_tracer.backend import kernels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1152)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=3, help="key heads")
    ap.add_argument("--group", type=int, default=3, help="query heads per key head")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    K = kernels.load()
    if K is None:
        raise SystemExit(f"native kernels unavailable: {kernels.status()}")
    rng = np.random.default_rng(0)
    B, nk, R, S, D = args.rows * args.layers, args.heads, args.group, args.context, args.dim
    q = mx.array(rng.standard_normal((B, nk, R, D), dtype=np.float32) / 8)
    bias = mx.zeros((B, S), dtype=mx.float32)
    print(f"{args.layers} layers x {args.rows} rows, {nk} key heads x {R}, {S} columns, D {D}; "
          f"qmm ISA {K.qmm_isa()}, {K.qmm_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        k = mx.array(rng.standard_normal((B, nk, S, D), dtype=np.float32)).astype(dtype)
        v = mx.array(rng.standard_normal((B, nk, S, D), dtype=np.float32)).astype(dtype)
        mx.eval(q, k, v, bias)
        gb = (k.nbytes + v.nbytes) / 1e9
        for vector in (False, True):
            _, ns = K.decode_attention(q, k, v, bias, vector, args.repeat)
            print(f"  {str(dtype).split('.')[-1]:9s} {'vector' if vector else 'blas':6s} {ns / 1e6:8.2f} ms "
                  f"{gb / (ns / 1e9):6.1f} GB/s of K/V")
        del k, v
    k = mx.array(rng.standard_normal((B, nk, S, D), dtype=np.float32))
    v = mx.array(rng.standard_normal((B, nk, S, D), dtype=np.float32))
    for bits in (8, 4):  # mlx-lm's QuantizedKVCache layout, group 64 (or the head size if smaller)
        group = min(64, D)
        kq, vq = mx.quantize(k, group_size=group, bits=bits), mx.quantize(v, group_size=group, bits=bits)
        mx.eval(kq, vq)
        gb = sum(a.nbytes for a in (*kq, *vq)) / 1e9
        for vector in (False, True):
            _, ns = K.decode_attention(q, kq[0], vq[0], bias, vector, args.repeat, packed=[kq[1], kq[2], vq[1], vq[2]])
            print(f"  {f'{bits}-bit':9s} {'vector' if vector else 'mlx':6s} {ns / 1e6:8.2f} ms "
                  f"{gb / (ns / 1e9):6.1f} GB/s of K/V")
        del kq, vq
    return 0


if __name__ == "__main__":
    from mlx_tracer.backend.malloc import reexec

    reexec()  # measure under the malloc the mlx-tracer command runs with (MLX_TRACER_MALLOC=system: glibc)
    raise SystemExit(main())
