"""The benchmark's outputs: the table, the JSON record, the plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import List, Optional

from .machine import Machine
from .run import BenchRow


HEADER = (
    f"{'model':<26} {'B':>2} {'ctx':>5} {'as-run':>7} {'stock':>7} {'tracer':>7} {'vs as-run':>9} {'vs stock':>8} "
    f"{'host ms s/t':>11} {'traces':>6} {'trace ms':>8} {'peak MB':>7} {'roof file':>9} {'roof fmt':>8}"
)
UNITS = "(tok/s: as-run = stock mlx-lm with MLX's reference BLAS and weights as loaded; stock = same process and weights as tracer)"


def format_row(r: BenchRow) -> str:
    base = f"{r.baseline_tps:>7.1f}" if r.baseline_tps else f"{'-':>7}"
    up = f"{r.speedup:>8.2f}x" if r.speedup else f"{'-':>9}"
    return (
        f"{r.model:<26} {r.bucket:>2} {r.context:>5} {base} {r.stock_tps:>7.1f} {r.tracer_tps:>7.1f} {up} {r.ratio:>7.2f}x "
        f"{r.stock_host_ms:>5.1f}/{r.tracer_host_ms:<5.2f} {r.traces:>6} {r.first_trace_ms:>8.0f} {r.peak_mb:>7.0f} "
        f"{r.tracer_roofline_pct:>8.1f}% {r.format_roofline_pct:>7.1f}%"
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
        ax.plot(b, [r.stock_tps for r in rs], "o-", label="stock mlx-lm")
        ax.plot(b, [r.tracer_tps for r in rs], "s-", label="mlx-tracer")
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
