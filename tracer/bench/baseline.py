"""The as-run baseline: stock mlx-lm on MLX's reference BLAS, weights as loaded.

The BLAS binding is fixed per process (it is decided when mlx is first
imported), so the baseline runs in a subprocess started with
``MLX_TRACER_BLAS=0``. The bench keeps one such process, a
:class:`BaselineWorker` (``python -m mlx_tracer.bench --worker``, speaking
:mod:`.protocol`), and asks it for one decode run at a time, between its own
stock and tracer runs of the same row: the systems are timed in turns, so
this VM's drift (up to 1.5x within a minute) weighs on all of them alike.
Each run reports its peak MLX memory too, in this process of its own.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from ..backend.malloc import without_preload
from ..runtime.step import CompiledModel
from .models import load_bench_model, synthetic_context
from .protocol import Worker, serve
from .systems import param_bytes, run_peak, stock_decode


class _AsRun:
    """The baseline's in-process side: one bench model as loaded, its contexts."""

    def __init__(self):
        from ..backend import blas

        assert not blas.status().fast, "the baseline must run on MLX's reference BLAS"
        self.model, self.layouts, self.contexts = None, None, {}

    def load(self, name: str, path: Optional[str]):
        self.model, self.contexts = None, {}
        self.model, _ = load_bench_model(name, path, weights="as-is")
        self.layouts = CompiledModel(self.model).layout

    def decode(self, B: int, C: int, tokens: int) -> float:
        if self.model is None:
            raise ValueError("no model loaded")
        if C not in self.contexts:
            self.contexts[C] = synthetic_context(self.model, self.layouts, C)
        first = [(7 * i + 3) % self.model.args.vocab_size for i in range(B)]
        return run_peak(lambda: stock_decode(self.model, [self.contexts[C]] * B, first, tokens), param_bytes(self.model))

    def handle(self, req: dict) -> dict:
        if req["op"] == "load":
            self.load(req["name"], req["path"])
            return {"ok": True}
        tps, peak = self.decode(req["bucket"], req["context"], req["tokens"])
        return {"tps": tps, "peak_mb": peak}


class BaselineWorker(Worker):
    """A subprocess on MLX's reference BLAS that decodes with stock mlx-lm on
    request: :meth:`load` a bench model (weights as loaded), then
    :meth:`decode` one run. Idle between requests (it waits on its stdin),
    so it takes no CPU from the runs of the parent."""

    def __init__(self):
        super().__init__([sys.executable, "-m", "mlx_tracer.bench", "--worker"], name="the as-run baseline",
                         env=dict(without_preload(os.environ), MLX_TRACER_BLAS="0"))  # stock: glibc's malloc
        self.last_peak_mb: Optional[float] = None

    def load(self, name: str, path: Optional[str] = None):
        self.ask(op="load", name=name, path=path)

    def decode(self, bucket: int, context: int, tokens: int) -> float:
        """Tokens/s of one stock decode run of ``tokens`` tokens per row at
        ``bucket`` rows of ``context`` positions (the loaded model); the run's
        peak MLX memory (MB, :func:`~.systems.run_peak`) in ``last_peak_mb``."""
        reply = self.ask(op="decode", bucket=bucket, context=context, tokens=tokens)
        self.last_peak_mb = reply["peak_mb"]
        return reply["tps"]


def worker_main(stdin=sys.stdin, stdout=sys.stdout):
    """The subprocess side of :class:`BaselineWorker` (:func:`~.protocol.serve`)."""
    serve(_AsRun().handle, stdin, stdout)
