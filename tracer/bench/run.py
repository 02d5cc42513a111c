"""The benchmark runs: per model, bucket ``B`` and context ``C``, stock mlx-lm
and the compiled loop in the same process, runs interleaved, the median of
``runs`` runs after a warm-up run of each (which keeps tracing and MLX's
kernel JIT out of the timings); and the steady-state check of a long decode.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from ..runtime.engine import Engine
from ..runtime.step import CompiledModel
from .machine import Machine, model_costs, roofline_tps
from .models import random_llama, synthetic_context
from .systems import host_ms, stock_decode, tracer_decode


@dataclass
class BenchRow:
    """One (model, bucket, context) configuration: tokens/s of each system
    (medians, and the runs), host ms per step, traces, peak memory, roofline."""

    model: str
    bucket: int
    context: int
    stock_tps: float
    tracer_tps: float
    ratio: float
    stock_host_ms: float
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

    @property
    def speedup(self) -> Optional[float]:
        return None if not self.baseline_tps else self.tracer_tps / self.baseline_tps


def bench_model(model, label: str, buckets: Sequence[int], contexts: Sequence[int], tokens: int, runs: int, machine: Machine, on_row: Callable[["BenchRow"], None] = lambda r: None, baseline=None) -> List[BenchRow]:
    """Time every (context, bucket) of one model; ``on_row`` sees each row as it is done.
    ``baseline``: a :class:`~.baseline.BaselineWorker` with this model loaded: its
    as-run decode runs take turns with the stock and tracer runs of each row."""
    compiled = CompiledModel(model)
    costs = model_costs(model, compiled.layout)
    file_bytes = getattr(model, "mlx_tracer_file_bytes", costs["weight_bytes"])  # as loaded, before a format change
    rows = []
    for C in contexts:
        ctx = synthetic_context(model, compiled.layout, C)
        for B in buckets:
            contexts_b = [ctx] * B
            first = [(7 * i + 3) % compiled.vocab_size for i in range(B)]
            engine = Engine(compiled, buckets=(B,))
            known = set(compiled.trace_ms)
            if baseline is not None:
                baseline.decode(B, C, 4)
            stock_decode(model, contexts_b, first, 4)  # warm-up runs: tracing and kernel JIT
            tracer_decode(engine, contexts_b, first, 4)
            warm = {k: ms for k, ms in compiled.trace_ms.items() if k not in known and k.kind == "decode"}
            traces_before = sum(compiled.traces.values())
            b_runs, s_runs, t_runs, t_host, peak = [], [], [], [], 0.0
            for _ in range(runs):  # the systems in turns, so that drift weighs on each alike
                if baseline is not None:
                    b_runs.append(baseline.decode(B, C, tokens))
                s_runs.append(stock_decode(model, contexts_b, first, tokens))
                mx.reset_peak_memory()
                st = tracer_decode(engine, contexts_b, first, tokens)
                peak = max(peak, mx.get_peak_memory() / 1e6)
                t_runs.append(st.decode_tps)
                t_host.append(st.host_ms_per_step)
            traces = sum(compiled.traces.values())
            assert traces == traces_before, "the timed runs retraced"
            s, t = statistics.median(s_runs), statistics.median(t_runs)
            host = host_ms(model, compiled, contexts_b)
            roof = roofline_tps(costs, compiled.layout, machine, B, C, weight_bytes=file_bytes)
            fmt_roof = roofline_tps(costs, compiled.layout, machine, B, C)
            row = BenchRow(
                label, B, C, s, t, t / s, host[0], host[1],
                len(warm),  # decode traces this configuration made (the timed runs made none)
                max(warm.values(), default=float("nan")), peak, roof, 100 * t / roof, fmt_roof, 100 * t / fmt_roof,
                s_runs, t_runs, engine_host_ms=statistics.median(t_host),
            )
            if b_runs:
                row.baseline_runs, row.baseline_tps = b_runs, statistics.median(b_runs)
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
