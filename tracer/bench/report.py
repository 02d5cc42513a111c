"""The benchmark's outputs: the table, the JSON record, the plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import List, Optional

from .machine import Machine
from .run import BenchRow


HEADER = (
    f"{'model':<26} {'B':>2} {'ctx':>5} {'as-run':>7} {'stock':>7} {'tracer':>7} {'llama':>7} {'vs as-run':>9} "
    f"{'vs stock':>8} {'vs llama':>8} {'host ms s/t':>11} {'traces':>6} {'trace ms':>8} {'peak MB s/t':>11} "
    f"{'llama MB':>8} {'roof file':>9} {'roof fmt':>8}"
)
UNITS = ("(tok/s: as-run = stock mlx-lm with MLX's reference BLAS and weights as loaded; stock = same process and weights "
         "as tracer; llama = llama.cpp on the same GGUF file, same threads. peak MB s/t: MLX's peak memory of stock / "
         "tracer, each counted apart; llama MB: the llama.cpp worker's resident-set high-water mark, VmHWM)")
# How each system's peak memory is measured (the JSON's meta)
PEAK_MEMORY = {
    "stock_peak_mb": "MLX peak memory over a run, counted apart from the other systems in the process "
                     "(weights + the most the run allocated above what was live; bench contexts excluded)",
    "peak_mb": "the tracer's, measured as stock_peak_mb is (its traces' and engine's arrays included)",
    "baseline_peak_mb": "as stock_peak_mb, in the as-run baseline's own process",
    "peer_peak_mb": "the llama.cpp worker process's resident-set high-water mark (VmHWM of /proc/self/status, "
                    "reset per run through /proc/self/clear_refs; peer_peak_kind says when ru_maxrss was used "
                    "instead): the mapped file's pages, KV, buffers and the worker's Python",
}


def _cell(x: Optional[float], width: int, fmt: str = ".1f", suffix: str = "") -> str:
    return f"{format(x, fmt) + suffix:>{width}}" if x else f"{'-':>{width}}"


def format_row(r: BenchRow) -> str:
    peaks = f"{_cell(r.stock_peak_mb, 0, '.0f')}/{_cell(r.peak_mb, 0, '.0f')}"
    roof_file = f"{r.tracer_roofline_pct:>8.1f}%" + ("!" if r.tracer_roofline_pct > 100 else "")
    return (
        f"{r.model:<26} {r.bucket:>2} {r.context:>5} {_cell(r.baseline_tps, 7)} {_cell(r.stock_tps, 7)} {r.tracer_tps:>7.1f} "
        f"{_cell(r.peer_tps, 7)} {_cell(r.speedup, 9, '.2f', 'x')} {_cell(r.ratio, 8, '.2f', 'x')} {_cell(r.vs_peer, 8, '.2f', 'x')} "
        f"{_cell(r.stock_host_ms, 5)}/{r.tracer_host_ms:<5.2f} {r.traces:>6} {r.first_trace_ms:>8.0f} {peaks:>11} "
        f"{_cell(r.peer_peak_mb, 8, '.0f')} {roof_file} {r.format_roofline_pct:>7.1f}%"
    )


def write_json(path: str, machine: Machine, rows: List[BenchRow], steady: Optional[dict], meta: dict):
    with open(path, "w") as f:
        json.dump({"machine": asdict(machine), "meta": meta, "rows": [asdict(r) for r in rows], "steady_state": steady}, f, indent=2)


def plot(path: str, rows: List[BenchRow]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.model, r.context) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.4), squeeze=False)
    for ax, (m, c) in zip(axes[0], groups):
        rs = sorted((r for r in rows if r.model == m and r.context == c), key=lambda r: r.bucket)
        b = [r.bucket for r in rs]
        if any(r.baseline_tps for r in rs):
            ax.plot(b, [r.baseline_tps or float("nan") for r in rs], "^:", color="gray", label="stock mlx-lm, as run")
        if any(r.stock_tps for r in rs):
            ax.plot(b, [r.stock_tps or float("nan") for r in rs], "o-", label="stock mlx-lm")
        ax.plot(b, [r.tracer_tps for r in rs], "s-", label="mlx-tracer")
        if any(r.peer_tps for r in rs):
            ax.plot(b, [r.peer_tps or float("nan") for r in rs], "d--", label="llama.cpp")
        ax.set_xscale("log", base=2)
        ax.set_xticks(b, [str(x) for x in b])
        ax.set_title(f"{m}\ncontext {c}", fontsize=9)
        ax.set_xlabel("batch bucket")
        ax.set_ylabel("decode tok/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
