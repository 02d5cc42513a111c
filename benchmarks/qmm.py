"""Milliseconds per call of the native quantized matmul (``qmm``, its exact
and/or fast contract) against ``mx.quantized_matmul`` and the float32
``x @ W.T`` that the fast BLAS serves, at SmolLM2-135M's projection shapes
(or Llama-3.2-1B's: ``--model llama-1b``).

    python benchmarks/qmm.py [--m 1 8 40 256] [--reps 15] [--bits 4] [--group 32]
                             [--contract exact|fast|factored|both|all] [--chain 1] [--threads N]
                             [--model smollm2|llama-1b] [--isa avx2 avx512 ...]

Weights are random, quantized with ``mx.quantize`` (scales and biases cast
to float16, as GGUF's and mlx-lm's are; ``--bits 5|6``: random integers in
qmm's own 5- or 6-bit blocks, ``kernels.narrow``, with the references on
MLX's 8-bit blocks of the same integers); ``--isa`` names qmm's ISA paths
to time in turns, a column each (default: the one this CPU runs); each cell is the median of
``--reps`` evaluated calls after warmup. Each call reads its weights from
memory, as a decode step does (a step reads every matrix of the model once,
far more than the caches hold): the calls rotate over enough copies of the
weights to exceed ``--stream-mb`` of float32 (``--stream-mb 0``: one copy,
read from the caches where it fits; with ``--no-reference``, which keeps
no float32 copies, of the quantized weights as stored). ``--chain C`` evaluates C calls (on C
copies) as one graph and reports the time per call: a decode step's nodes
run back to back, without the few tens of microseconds one ``mx.eval``
costs. The machine's load average is printed with the table: on a shared
machine the figures are rough.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
from mlx_tracer.backend import kernels

# (name, N, K): x [M, K] @ W.T with W [N, K], per model (q/k/v and gate/up fused, as the lean layers run them)
MODELS = {
    "smollm2": (("qkv", 960, 576), ("o", 576, 576), ("gate/up", 3072, 576), ("down", 576, 1536), ("head", 49152, 576)),
    "llama-1b": (("qkv", 3072, 2048), ("o", 2048, 2048), ("gate/up", 16384, 2048), ("down", 2048, 8192),
                 ("head", 128256, 2048)),
}
SHAPES = MODELS["smollm2"]


def timed(fn, copies: int, reps: int, warmup: int, chain: int) -> float:
    """Median ms of an evaluated call fn(i), i rotating over the copies;
    `chain` calls a graph, the time divided among them."""
    def step(i):
        return [fn((i * chain + c) % copies) for c in range(chain)]

    for i in range(warmup):
        mx.eval(step(i))
    times = []
    for i in range(reps):
        t = time.perf_counter()
        mx.eval(step(i))
        times.append((time.perf_counter() - t) / chain)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 40, 256], help="rows of x")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bits", type=int, default=4, choices=(4, 5, 6, 8))
    ap.add_argument("--group", type=int, default=32, choices=(32, 64, 128))
    ap.add_argument("--contract", default="exact", choices=("exact", "fast", "factored", "split", "both", "all"),
                    help="qmm's contract(s): both = exact and fast")
    ap.add_argument("--chain", type=int, default=1, help="calls evaluated as one graph")
    ap.add_argument("--threads", type=int, default=0, help="qmm's threads (0: its default)")
    ap.add_argument("--stream-mb", type=float, default=128, help="float32 weights to rotate over (0: one copy)")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip mx.quantized_matmul and fp32 x @ W.T (slow at many rows on the CPU)")
    ap.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], help="which of " + ", ".join(s[0] for s in SHAPES))
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS), help="whose projection shapes")
    ap.add_argument("--isa", nargs="+", default=[None], help="qmm's ISA paths, timed in turns (default: this CPU's best)")
    args = ap.parse_args()
    K = kernels.load()
    if K is None:
        raise SystemExit(f"the native kernels are off: {kernels.status()}")
    if args.threads:
        K.qmm_set_threads(args.threads)
    contracts = {"both": ("exact", "fast"), "all": ("exact", "factored", "fast", "split")}.get(args.contract, (args.contract,))
    isas = [K.qmm_isa() if i is None else i for i in args.isa]
    for isa in isas:
        if K.qmm_set_isa(isa) != isa:
            raise SystemExit(f"this CPU has no {isa} path (it runs {K.qmm_isa()})")
    columns = [(c, isa) for c in contracts for isa in isas]
    narrow = args.bits in (5, 6)
    print(f"qmm: {'/'.join(isas)}, {K.qmm_threads()} threads; {args.bits}-bit, group {args.group}, float16 scales; "
          f"weights streamed over {args.stream_mb:g} MB; {args.chain} call(s) a graph; "
          f"load average {os.getloadavg()[0]:.2f} before")
    heads = " ".join(f"{isa + ' ' + c:>12}" for c, isa in columns)
    gains = " ".join(f"{c:>6}" for c, _ in columns)
    # without the references, the speed-ups are against the first contract listed
    label = f"speed-up vs {f'qmm {contracts[0]}' if args.no_reference else 'fp32'}:"
    print(f"{'shape':>8} {'N':>6} {'K':>5} {'M':>4} | {heads} {'quantized_matmul':>16} {'fp32 x@W.T':>10} | "
          f"{label} {gains}")
    for name, N, Kd in MODELS[args.model]:
        if name not in args.shapes:
            continue
        stored = N * Kd * args.bits / 8 + 2 * 2 * N * Kd / args.group  # packed weights, float16 scales and biases
        copies = max(args.chain, math.ceil(args.stream_mb * 2**20 / (stored if args.no_reference else 4 * N * Kd)))
        Ws, qs = [], []
        refs = []  # the references' quantized weights (8-bit blocks of the same integers where narrow)
        for i in range(copies):
            W = mx.random.normal((N, Kd), key=mx.random.key(i)) * 0.05
            w, s, b = mx.quantize(W, args.group, 8 if narrow else args.bits)
            if narrow:  # the same scales and biases over random integers below 2 ** bits
                ints = mx.random.randint(0, 2**args.bits, (N, Kd), key=mx.random.key(i)).astype(mx.uint8)
                w = ints.reshape(N, Kd // 4, 4).view(mx.uint32).reshape(N, Kd // 4)  # MLX's 8-bit packing
                W = mx.dequantize(w, s, b, args.group, 8)
            s, b = s.astype(mx.float16), b.astype(mx.float16)
            if not args.no_reference:
                Ws.append(W)
                refs.append((w, s, b))
            qs.append((K.narrow(w, args.bits) if narrow else w, s, b))
            mx.eval(Ws[-1:], refs[-1:], qs[-1])
        for M in args.m:
            x = mx.random.normal((M, Kd), key=mx.random.key(copies))
            mx.eval(x)
            run = dict(copies=copies, reps=args.reps, warmup=args.warmup, chain=args.chain)
            q = []
            for c, isa in columns:
                K.qmm_set_isa(isa)
                q.append(timed(lambda i: K.qmm(x, *qs[i], args.group, args.bits, contract=c), **run))
            qm = math.nan if args.no_reference else timed(
                lambda i: mx.quantized_matmul(x, *refs[i], True, args.group, 8 if narrow else args.bits), **run)
            f = math.nan if args.no_reference else timed(lambda i: x @ Ws[i].T, **run)
            cells = " ".join(f"{t:10.3f}" for t in q)
            ups = " ".join(f"{(q[0] if args.no_reference else f) / t:5.2f}x" for t in q)
            print(f"{name:>8} {N:>6} {Kd:>5} {M:>4} | {cells} {qm:16.3f} {f:10.3f} | {'':{len(label)}} {ups}")
    print(f"load average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    from mlx_tracer.backend.malloc import reexec

    reexec()  # measure under the malloc the mlx-tracer command runs with (MLX_TRACER_MALLOC=system: glibc)
    main()
