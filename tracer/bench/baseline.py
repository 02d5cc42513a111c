"""The as-run baseline: stock mlx-lm on MLX's reference BLAS, weights as loaded.

The BLAS binding is fixed per process (it is decided when mlx is first
imported), so the baseline runs in a subprocess started with
``MLX_TRACER_BLAS=0``. The bench keeps one such process, a
:class:`BaselineWorker` (``python -m mlx_tracer.bench --worker``), and asks it
for one decode run at a time, between its own stock and tracer runs of the
same row: the three systems are timed in turns, so this VM's drift (up to
1.5x within a minute) weighs on all of them alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Optional

from ..runtime.step import CompiledModel
from .models import load_bench_model, synthetic_context
from .systems import stock_decode


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
        return stock_decode(self.model, [self.contexts[C]] * B, first, tokens)


class BaselineWorker:
    """A subprocess on MLX's reference BLAS that decodes with stock mlx-lm on
    request: :meth:`load` a bench model (weights as loaded), then
    :meth:`decode` one run (tokens/s). Idle between requests (it waits on its
    stdin), so it takes no CPU from the runs of the parent."""

    def __init__(self):
        env = dict(os.environ, MLX_TRACER_BLAS="0")
        self._err = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([sys.executable, "-m", "mlx_tracer.bench", "--worker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)

    def _ask(self, **request):
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self._err.seek(0)
            raise RuntimeError(f"the as-run baseline process ended: {self._err.read()[-2000:]}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the as-run baseline failed: {reply['error']}")
        return reply

    def load(self, name: str, path: Optional[str] = None):
        self._ask(op="load", name=name, path=path)

    def decode(self, bucket: int, context: int, tokens: int) -> float:
        """Tokens/s of one stock decode run of ``tokens`` tokens per row at
        ``bucket`` rows of ``context`` positions (the loaded model)."""
        return self._ask(op="decode", bucket=bucket, context=context, tokens=tokens)["tps"]

    def close(self):
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._err.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def worker_main(stdin=sys.stdin, stdout=sys.stdout):
    """The subprocess side of :class:`BaselineWorker`: one JSON request per
    line in, one JSON reply per line out, until stdin closes."""
    side = _AsRun()
    for line in stdin:
        req = json.loads(line)
        try:
            if req["op"] == "load":
                side.load(req["name"], req["path"])
                reply = {"ok": True}
            else:
                reply = {"tps": side.decode(req["bucket"], req["context"], req["tokens"])}
        except Exception as e:  # reported to the parent, which raises it
            reply = {"error": f"{type(e).__name__}: {e}"}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()
