"""The benchmark runs: per model, bucket ``B`` and context ``C``, stock mlx-lm
and the compiled loop in the same process, runs interleaved, the median of
``runs`` runs after a warm-up run of each (which keeps tracing and MLX's
kernel JIT out of the timings); and the steady-state check of a long decode.
Two systems take their turns from worker processes: stock mlx-lm as run
(:mod:`.baseline`) and llama.cpp on the same GGUF file (:mod:`.peer`).
Each system's peak memory is its own (:func:`~.systems.run_peak`; llama.cpp's
is its worker's resident-set high-water mark).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from ..caches import capacity_bucket
from ..runtime.engine import Engine
from ..runtime.step import CompiledModel
from .machine import Machine, model_costs, roofline_tps
from .models import random_llama, synthetic_context
from .systems import (host_ms, live_bytes, param_bytes, run_peak, stand_in_bytes, stock_decode, tracer_decode,
                      tracer_host_ms)


@dataclass
class BenchRow:
    """One (model, bucket, context) configuration: tokens/s of each system
    (medians, and the runs), host ms per step, traces, peak memory, roofline."""

    model: str
    bucket: int
    context: int
    stock_tps: Optional[float]  # None: skipped (--no-stock), with ratio and stock_host_ms
    tracer_tps: float
    ratio: Optional[float]
    stock_host_ms: Optional[float]
    tracer_host_ms: float
    traces: int
    first_trace_ms: float
    peak_mb: float
    roofline_tps: float
    tracer_roofline_pct: float  # against the ceiling of the model file's bytes (the headline)
    format_roofline_tps: float = 0.0  # ceiling for the bytes of the weight format that ran
    format_roofline_pct: float = 0.0
    stock_runs: List[float] = field(default_factory=list)
    tracer_runs: List[float] = field(default_factory=list)
    baseline_tps: Optional[float] = None  # stock mlx-lm as a user runs it: reference BLAS, weights as loaded
    baseline_runs: List[float] = field(default_factory=list)
    engine_host_ms: Optional[float] = None  # the engine's own host ms per step (its loop around the step included)
    kv: str = "the model's dtype"  # how the tracer's caches stored K/V
    kv_mb: float = 0.0  # the tracer's K/V buffers at this bucket and context (from their shapes)
    # peak memory per system, each measured apart (``peak_mb`` is the tracer's): MLX's peak over the run
    # (run_peak) for stock and as-run, llama.cpp's worker's resident-set high-water mark (peer_peak_kind)
    stock_peak_mb: Optional[float] = None
    baseline_peak_mb: Optional[float] = None
    peer_tps: Optional[float] = None  # llama.cpp on the same GGUF file, same threads (None: skipped, see peer_note)
    peer_runs: List[float] = field(default_factory=list)
    peer_peak_mb: Optional[float] = None
    peer_peak_kind: Optional[str] = None
    peer_note: Optional[str] = None

    @property
    def vs_peer(self) -> Optional[float]:
        return None if not self.peer_tps else self.tracer_tps / self.peer_tps

    @property
    def speedup(self) -> Optional[float]:
        return None if not self.baseline_tps else self.tracer_tps / self.baseline_tps


def bench_model(model, label: str, buckets: Sequence[int], contexts: Sequence[int], tokens: int, runs: int, machine: Machine, on_row: Callable[["BenchRow"], None] = lambda r: None, baseline=None, kv=None, peer=None, peer_note: Optional[str] = None, stock: bool = True) -> List[BenchRow]:
    """Time every (context, bucket) of one model; ``on_row`` sees each row as it is done.
    ``stock``: False skips stock mlx-lm (its cells None).
    ``baseline``: a :class:`~.baseline.BaselineWorker` with this model loaded: its
    as-run decode runs take turns with the stock and tracer runs of each row.
    ``kv``: the tracer caches' :class:`~mlx_tracer.caches.storage.KVFormat` (None: as the model computes).
    ``peer``: a :class:`~.peer.PeerWorker` with this model's GGUF file loaded, its runs in turn with the
    others' (None: skipped, ``peer_note`` saying why)."""
    compiled = CompiledModel(model, kv=kv)
    costs = model_costs(model, compiled.layout)
    # the file's bytes a step reads (as loaded before a format change, at most the GGUF file's own tensor
    # bytes: the loader widens k-quants' scales and Q6_K): less an untied embedding table, at least its
    # size as loaded (a format only widens), so the bound stays one that no system can beat
    file_bytes = getattr(model, "mlx_tracer_file_bytes", None)
    file_bytes = costs["weight_bytes"] if file_bytes is None else max(0, file_bytes - costs["untied_embed_bytes"])
    stock_owned = param_bytes(model)  # stock keeps nothing else between runs
    rows = []
    for C in contexts:
        ctx = None
        held = live_bytes()
        ctx = synthetic_context(model, compiled.layout, C)
        ctx_bytes = live_bytes() - held  # the bench's, not a system's: each copies it into caches of its own
        for B in buckets:
            contexts_b = [ctx] * B
            first = [(7 * i + 3) % compiled.vocab_size for i in range(B)]
            engine = Engine(compiled, buckets=(B,))
            known = set(compiled.trace_ms)
            if baseline is not None:
                baseline.decode(B, C, 4)
            if stock:
                stock_decode(model, contexts_b, first, 4)  # warm-up runs: tracing and kernel JIT
            tracer_decode(engine, contexts_b, first, 4)
            if peer is not None:
                peer.decode(B, C, 4, first)  # and llama.cpp's context for this row, prefilled
            warm = {k: ms for k, ms in compiled.trace_ms.items() if k not in known and k.kind == "decode"}
            traces_before = sum(compiled.traces.values())
            # weights, traces, engine: all that is live but the contexts and the stand-ins of held forms
            # (float32 scales, 8-bit blocks) that only the stock runs' own forward computed
            tracer_owned = live_bytes() - ctx_bytes - (stand_in_bytes(model) if stock else 0)
            b_runs, s_runs, t_runs, t_host, p_runs = [], [], [], [], []
            peak = s_peak = b_peak = p_peak = 0.0
            p_kind = None
            for _ in range(runs):  # the systems in turns, so that drift weighs on each alike
                if baseline is not None:
                    b_runs.append(baseline.decode(B, C, tokens))
                    b_peak = max(b_peak, baseline.last_peak_mb or 0.0)
                if stock:
                    tps, pk = run_peak(lambda: stock_decode(model, contexts_b, first, tokens), stock_owned)
                    s_runs.append(tps)
                    s_peak = max(s_peak, pk)
                st, pk = run_peak(lambda: tracer_decode(engine, contexts_b, first, tokens), tracer_owned)
                peak = max(peak, pk)
                t_runs.append(st.decode_tps)
                t_host.append(st.host_ms_per_step)
                if peer is not None:
                    r = peer.decode(B, C, tokens, first)
                    p_runs.append(r["tps"])
                    p_peak, p_kind = max(p_peak, r["peak_mb"]), r["peak_kind"]
            traces = sum(compiled.traces.values())
            assert traces == traces_before, "the timed runs retraced"
            s, t = (statistics.median(s_runs) if stock else None), statistics.median(t_runs)
            host = host_ms(model, compiled, contexts_b) if stock else (None, tracer_host_ms(compiled, contexts_b))
            roof = roofline_tps(costs, compiled.layout, machine, B, C, weight_bytes=file_bytes)
            fmt_roof = roofline_tps(costs, compiled.layout, machine, B, C)
            row = BenchRow(
                label, B, C, s, t, t / s if stock else None, host[0], host[1],
                len(warm),  # decode traces this configuration made (the timed runs made none)
                max(warm.values(), default=float("nan")), peak, roof, 100 * t / roof, fmt_roof, 100 * t / fmt_roof,
                s_runs, t_runs, engine_host_ms=statistics.median(t_host),
            )
            row.stock_peak_mb = s_peak if stock else None
            if b_runs:
                row.baseline_runs, row.baseline_tps = b_runs, statistics.median(b_runs)
                row.baseline_peak_mb = b_peak
            if p_runs:
                row.peer_runs, row.peer_tps, row.peer_peak_mb, row.peer_peak_kind = p_runs, statistics.median(p_runs), p_peak, p_kind
            else:
                row.peer_note = peer_note
            row.kv = compiled.kv.describe()
            capacity = capacity_bucket(C + tokens + 1, compiled.capacities)  # shapes only: nothing is allocated
            row.kv_mb = sum(c.nbytes for c in compiled.layout.new_caches(B, B, compiled.capacities, capacity)) / 1e6
            on_row(row)
            rows.append(row)
    return rows


def steady_state(steps: int = 2000, window: int = 256, hidden: int = 64, probe: Optional[int] = None) -> dict:
    """Decode tokens/s of a ring model around step ``probe`` and around step
    ``steps``: no drift from retraces or growing buffers."""
    probe = probe or min(100, steps // 4)
    engine = Engine(random_llama(hidden, window=window), buckets=(1,))
    engine.warmup(prefill=False)
    engine.add([1, 2, 3], max_tokens=steps + probe)
    times, traces = [], None
    for i in range(steps + probe):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        if i == probe:
            traces = engine.snapshot().traces_made
    early = 1 / statistics.median(times[probe // 2 : probe + probe // 2])
    late = 1 / statistics.median(times[steps - probe // 2 : steps + probe // 2])
    return {
        "model": f"llama 4x{hidden} fp32, all layers sliding (window {window})",
        "step_early": probe, "tps_early": early, "step_late": steps, "tps_late": late,
        "late_over_early": late / early,
        "traces_at_early": traces, "traces_at_end": engine.snapshot().traces_made,
    }
