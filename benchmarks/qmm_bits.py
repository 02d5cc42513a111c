"""qmm on one matrix shape held as 4-bit, 5-bit and 8-bit blocks of the same 5-bit integers.

    python benchmarks/qmm_bits.py [--n 8192] [--k 2048] [--m 1 8 64] [--matrices 12] [--rounds 7]

``--matrices`` distinct random matrices of integers below 32 (the 4-bit ones
their low nibbles), float16 scales and biases of group 32, each multiplied
once a round under the split contract, the three forms in turns round by
round (so that the weights stream from memory, as in a decode step); prints
the median ms a matrix per form and x rows, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
import numpy as np
from mlx_tracer.backend import kernels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 64], help="x rows")
    ap.add_argument("--matrices", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    K = kernels.load()
    if K is None:
        raise SystemExit(f"native kernels unavailable: {kernels.status()}")
    rng = np.random.default_rng(0)
    N, Kd = args.n, args.k
    s = mx.array((rng.standard_normal((N, Kd // 32)) * 0.01).astype(np.float16))
    b = mx.array((rng.standard_normal((N, Kd // 32)) * 0.01).astype(np.float16))
    forms = {4: [], 5: [], 8: []}
    for _ in range(args.matrices):
        q = rng.integers(0, 32, (N, Kd), dtype=np.uint8)
        w8 = mx.array(q.view(np.uint32))
        forms[8].append(w8)
        forms[5].append(K.narrow5(w8))
        lo = q & 15
        forms[4].append(mx.array(np.ascontiguousarray(lo[:, 0::2] | (lo[:, 1::2] << 4)).view(np.uint32)))
    mx.eval(forms)
    print(f"{args.matrices} matrices {N} x {Kd}, split contract; load average {os.getloadavg()[0]:.2f}")
    for M in args.m:
        x = mx.random.normal((M, Kd))
        times = {bits: [] for bits in forms}
        for _ in range(args.rounds):
            for bits, ws in forms.items():
                t = time.perf_counter()
                for w in ws:
                    mx.eval(K.qmm(x, w, s, b, 32, bits, contract="split"))
                times[bits].append((time.perf_counter() - t) / len(ws) * 1e3)
        cells = ", ".join(f"{bits}-bit {statistics.median(v):.3f}" for bits, v in times.items())
        print(f"{M} x rows: ms a matrix {cells}; load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
