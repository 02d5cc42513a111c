"""This machine's roofline: measured memory bandwidth and the cores' peak FLOP rate.

Per decode step, bytes (weights + live KV) over the bandwidth measured at
that working-set size, and FLOPs over the cores' peak rate: the slower
bound gives the best tokens/s the machine allows.

The FLOP ceiling is physical, not one library's: cores x the most float32
FLOPs one core's widest FMA units can issue per cycle (AVX-512: two 16-lane
FMA units, 64; AVX2 with FMA: two 8-lane units, 32; else 16) x the clock the
kernel reports (a VM reports its nominal clock; boost clocks above it are
covered by counting two FMA units where some cores have one). A row can
therefore never read above 100 %; dividing by one plain GEMM's measured rate
did (123 % at bucket 8), since the step's kernels beat that GEMM.

The bandwidth is the machine's, not one library's: per working-set size the
fastest of a STREAM-like read with every core (numpy sums over one slice per
thread; numpy releases the GIL), MLX's copy and a BLAS GEMV (a read stream,
as decode reads its weights). Two ceilings per row: one for the bytes of the
weight format the bench ran (fp32 after ``auto`` on SmolLM2) and one for the
bytes of the model file as loaded (its 4-bit blocks): a format that reads
more bytes than the file needs is not the machine's limit, so the headline
percentage is against the file's ceiling.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def peak_gflops() -> float:
    """The cores' peak float32 GFLOP/s from their ISA and clock (module docstring)."""
    flags, mhz = set(), 0.0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags" and not flags:
                    flags = set(value.split())
                elif key.strip() == "cpu MHz":
                    mhz = max(mhz, float(value))
    except (OSError, ValueError):
        pass
    per_cycle = 64 if "avx512f" in flags else 32 if {"avx2", "fma"} <= flags else 16
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores * per_cycle * (mhz or 4000.0) / 1e3  # no clock known: 4 GHz, a generous one


@dataclass
class Machine:
    copy_gbps: Dict[int, float]  # memory bandwidth by working-set bytes (cache .. DRAM), see measure()
    gemm_gflops: float  # fp32 GEMM rate (8 x 4096 x 4096), measured: what one plain GEMM reaches
    peak_gflops: float = 0.0  # the cores' peak float32 rate (peak_gflops()): the roofline's FLOP ceiling

    @staticmethod
    def _best_s(fn, reps):
        """The fastest of ``reps`` timings: a ceiling is the best rate the
        machine showed (a median taken while this VM drifted once put a
        bench row at 101 % of its ceiling)."""
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        return min(t)

    @classmethod
    def measure(cls) -> "Machine":
        """Bandwidth per working-set size: the faster of a copy (read + write)
        and a BLAS GEMV over a matrix of that size (a read stream, as decode
        reads its weights); and the fp32 GEMM rate. Each the best of a few
        timings (a ceiling)."""
        bw = {}
        for mb in (1, 4, 16, 64, 256):
            x = mx.random.uniform(shape=(mb * 1024 * 1024 // 4,))
            n = int((mb * 1024 * 1024 // 4) ** 0.5)
            w, v = mx.random.normal((n, n)), mx.random.normal((1, n))
            mx.eval(x, w, v)
            copy = 2 * x.nbytes / cls._best_s(lambda: mx.eval(x + 1.0), 7)
            read = w.nbytes / cls._best_s(lambda: mx.eval(v @ w), 7)
            bw[mb << 20] = max(copy, read, cls._stream_read(x.nbytes)) / 1e9
        a, b = mx.random.normal((8, 4096)), mx.random.normal((4096, 4096))
        mx.eval(a, b, a @ b)
        gemm = 2 * 8 * 4096 * 4096 / cls._best_s(lambda: mx.eval(a @ b), 5) / 1e9
        return cls(bw, gemm, max(gemm, peak_gflops()))

    @classmethod
    def _stream_read(cls, nbytes: int) -> float:
        """Bytes/s of reading ``nbytes`` with one thread per core (each sums its slice)."""
        from concurrent.futures import ThreadPoolExecutor

        cores = os.cpu_count() or 1
        a = np.ones(nbytes // 4, dtype=np.float32)
        parts = np.array_split(a, cores)
        reps = max(1, (64 << 20) // nbytes)  # small sets: repeat so a timing is not all thread overhead
        with ThreadPoolExecutor(cores) as pool:
            def read_all():
                list(pool.map(lambda p: [p.sum() for _ in range(reps)], parts))

            read_all()
            return reps * a.nbytes / cls._best_s(read_all, 5)

    def bandwidth(self, nbytes: float) -> float:
        """GB/s of a copy the size of ``nbytes`` (the working set of one step),
        interpolated in log size between the measured sizes."""
        sizes = sorted(self.copy_gbps)
        x = np.log2(min(max(nbytes, sizes[0]), sizes[-1]))
        return float(np.interp(x, np.log2(sizes), [self.copy_gbps[s] for s in sizes]))


def model_costs(model, layouts) -> Dict[str, float]:
    """Weight bytes and matmul parameters of one token's forward."""
    from mlx.utils import tree_flatten

    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    params = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            params += m.scales.size * m.group_size
        elif isinstance(m, nn.Linear):
            params += m.weight.size
    if not any(isinstance(m, (nn.Linear, nn.QuantizedLinear)) and "lm_head" in n for n, m in model.named_modules()):
        emb = model.model.embed_tokens if hasattr(model, "model") else None
        if emb is not None:  # tied head: the embedding is the output matmul too
            params += emb.scales.size * emb.group_size if isinstance(emb, nn.QuantizedEmbedding) else emb.weight.size
    kv_per_pos = sum(l.kv_heads * (l.k_dim + l.v_dim) * np.dtype(str(l.dtype).split(".")[-1]).itemsize for l in layouts)
    return {"weight_bytes": weight_bytes, "params": params, "kv_bytes_per_pos": kv_per_pos}


def roofline_tps(costs, layouts, machine: Machine, B: int, context: int, weight_bytes: Optional[float] = None) -> float:
    """The machine's best tokens/s for one decode step of ``B`` rows over
    ``context`` positions, reading ``weight_bytes`` of weights (default: the
    format the model is in)."""
    live = sum(min(context, l.window or context) for l in layouts) / len(layouts)
    weights = costs["weight_bytes"] if weight_bytes is None else weight_bytes
    bytes_step = weights + B * live * costs["kv_bytes_per_pos"]
    attn_flops = sum(4 * min(context, l.window or context) * l.kv_heads * l.k_dim for l in layouts)
    flops_step = B * (2 * costs["params"] + attn_flops)
    flops = max(machine.peak_gflops, machine.gemm_gflops)
    t = max(bytes_step / (machine.bandwidth(bytes_step) * 1e9), flops_step / (flops * 1e9))
    return B / t
