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
did (123 % at bucket 8), since the step's kernels beat that GEMM. A quantized
layer's matmul may run as int8 dot products (the *fast* contract, as
llama.cpp does): its multiply-adds count against the cores' int8 rate, four
times the float32 one (a 32-bit lane holds four int8 products per
instruction: VNNI's ``vpdpbusd``, AVX2's ``vpmaddubsw``). Float and int8
work share the same vector units, so their times add.

The bytes a step reads are the weights as stored (a quantized layer's
packed blocks, scales and biases, never their float32 expansion; an untied
embedding table is not read, only a row per token, so it is not counted)
plus the live K/V; the FLOPs are 2 per matmul weight per token (each weight
once: a tied embedding counts once, as the head) plus attention's over the
live positions. Both are what any implementation must at least do, so the
bound is one no system can beat.

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


INT8_PER_FP32 = 4  # int8 multiply-adds per float32 FMA lane and instruction (module docstring)


@dataclass
class Machine:
    copy_gbps: Dict[int, float]  # memory bandwidth by working-set bytes (cache .. DRAM), see measure()
    gemm_gflops: float  # fp32 GEMM rate (8 x 4096 x 4096), measured: what one plain GEMM reaches
    peak_gflops: float = 0.0  # the cores' peak float32 rate (peak_gflops()): the roofline's FLOP ceiling
    int8_gops: float = 0.0  # the cores' peak int8 rate (ops/s; 0: INT8_PER_FP32 x peak_gflops), quantized layers' ceiling

    @property
    def float_rate(self) -> float:
        """GFLOP/s the roofline divides float work by: the cores' peak (or a measured rate above it)."""
        return max(self.peak_gflops, self.gemm_gflops)

    @property
    def int8_rate(self) -> float:
        """G int8 ops/s the roofline divides quantized layers' work by."""
        return max(self.int8_gops, INT8_PER_FP32 * self.float_rate)

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
    def measure(cls, sizes_mb=(1, 4, 16, 64, 256)) -> "Machine":
        """Bandwidth per working-set size (``sizes_mb``, MB): the faster of a
        copy (read + write) and a BLAS GEMV over a matrix of that size (a read
        stream, as decode reads its weights); and the fp32 GEMM rate. Each the
        best of a few timings (a ceiling). All five sizes take ~10 s on a
        2-core Zen 3; ``mlx-tracer info``, which prints two, measures those."""
        bw = {}
        for mb in sizes_mb:
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
        peak = max(gemm, peak_gflops())
        return cls(bw, gemm, peak, INT8_PER_FP32 * peak)

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


def _is_embedding(m) -> bool:
    return isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))


def model_costs(model, layouts) -> Dict[str, float]:
    """What one token's decode step must at least read and compute (module docstring):

    * ``weight_bytes``: the parameters as stored (superblock scales and 5-bit
      blocks at their bytes), less an untied embedding
      table (``untied_embed_bytes``, which a step reads a row of);
    * ``params``: matmul weights, each once (a tied embedding as the head),
      of which ``quantized_params`` are a quantized layer's (int8-able);
    * ``kv_bytes_per_pos``: K/V bytes per position over all layers."""
    from mlx.utils import tree_flatten

    from ..adapters.lean import narrow as five
    from ..adapters.lean import scales as superblock

    # as stored: a k-quant's scales held as superblocks and 5-bit integers as 5-bit blocks (the lean
    # forward's, once bound) at their own bytes
    saved = sum(superblock.bytes_saved(m) + five.bytes_saved(m) for m in model.modules())
    all_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters())) - saved
    params = quantized = 0
    head = False
    for name, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            n = m.scales.size * m.group_size
            params, quantized = params + n, quantized + n
        elif isinstance(m, nn.Linear):
            params += m.weight.size
        else:
            continue
        head = head or name.split(".")[-1] == "lm_head"
    emb = next((m for n, m in model.named_modules() if _is_embedding(m) and n.split(".")[-1] == "embed_tokens"), None)
    if emb is None:
        emb = next((m for _, m in model.named_modules() if _is_embedding(m)), None)
    untied = 0
    if emb is not None:
        if head:  # untied: the step reads B rows of the table, not the table
            untied = sum(v.nbytes for _, v in tree_flatten(emb.parameters()))
        else:  # tied: the embedding is the output matmul too
            n = emb.scales.size * emb.group_size if isinstance(emb, nn.QuantizedEmbedding) else emb.weight.size
            params += n
            quantized += n if isinstance(emb, nn.QuantizedEmbedding) else 0
    kv_per_pos = sum(l.kv_heads * (l.k_dim + l.v_dim) * l.dtype.size for l in layouts)
    return {"weight_bytes": all_bytes - untied, "untied_embed_bytes": untied, "params": params,
            "quantized_params": quantized, "kv_bytes_per_pos": kv_per_pos}


def roofline_tps(costs, layouts, machine: Machine, B: int, context: int, weight_bytes: Optional[float] = None) -> float:
    """The machine's best tokens/s for one decode step of ``B`` rows over
    ``context`` positions, reading ``weight_bytes`` of weights (default: the
    format the model is in): ``B`` over the slower of the step's bytes over
    the bandwidth and its arithmetic over the cores' peak (module docstring)."""
    live = sum(min(context, l.window or context) for l in layouts) / len(layouts)
    weights = costs["weight_bytes"] if weight_bytes is None else weight_bytes
    bytes_step = weights + B * live * costs["kv_bytes_per_pos"]
    attn_flops = sum(4 * min(context, l.window or context) * l.kv_heads * l.k_dim for l in layouts)
    quantized = costs.get("quantized_params", 0)
    float_flops = B * (2 * (costs["params"] - quantized) + attn_flops)
    int8_ops = B * 2 * quantized
    compute_s = float_flops / (machine.float_rate * 1e9) + int8_ops / (machine.int8_rate * 1e9)
    t = max(bytes_step / (machine.bandwidth(bytes_step) * 1e9), compute_s)
    return B / t
