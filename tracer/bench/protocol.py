"""The bench's worker processes: one JSON request per line in, one JSON reply per line out.

Two systems run outside the bench's own process: stock mlx-lm on MLX's
reference BLAS (:mod:`.baseline`; the BLAS binding is fixed per process) and
llama.cpp (:mod:`.peer`, possibly under another Python that has
``llama_cpp``). Both are a :class:`Worker` here: the parent sends a request
(``{"op": ..., ...}``) and reads the reply, one run at a time between its
own runs, so every system is timed in turns; the worker waits on its stdin
in between, taking no CPU. :func:`serve` is the worker's side.

Standard library only, and no import of the package: the llama.cpp worker
loads this file by path under a Python that has neither mlx nor mlx-tracer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile


class WorkerError(RuntimeError):
    """A worker refused a request (``failed: <its reason>``) or ended (``process ended: <its stderr>``)."""


class Worker:
    """A subprocess answering requests (:func:`serve` on its side); ``name``
    says which system in errors. ``argv`` as for ``subprocess.Popen``; it
    raises OSError there when the program cannot be started."""

    def __init__(self, argv, name: str, env=None):
        self.name = name
        self._err = tempfile.TemporaryFile(mode="w+")
        try:
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                          text=True, env=env)
        except OSError:
            self._err.close()
            raise

    def ask(self, **request) -> dict:
        """The reply to one request; WorkerError if the worker refused it or ended."""
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError, ValueError):
            line = ""
        if not line:
            self._err.seek(0)
            raise WorkerError(f"{self.name} process ended: {self._err.read()[-2000:]}")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"{self.name} failed: {reply['error']}")
        return reply

    @property
    def process(self) -> subprocess.Popen:
        return self._proc

    def close(self):
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc.stdout.close()
        self._err.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve(handle, stdin=None, stdout=None):
    """The worker's loop: ``handle(request) -> reply`` (dicts) for each line of
    ``stdin`` until it closes; an exception becomes ``{"error": ...}`` and the
    loop goes on (the parent raises it as a :class:`WorkerError`)."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    for line in stdin:
        try:
            reply = handle(json.loads(line))
        except Exception as e:  # reported to the parent, which raises it
            reply = {"error": f"{type(e).__name__}: {e}"}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()
