"""A watchdog process that ends a rank stuck waiting on its peers.

A rank blocked inside a collective on a peer that hangs (or never connects)
waits forever, and nothing in the process can interrupt it: MLX's
``mx.distributed.init`` holds the GIL while it waits for connections, so not
even a Python thread runs. The watchdog is therefore a separate small process:
the rank tells it, through a pipe, when a guarded region (the group's start,
one step) begins and ends; if one runs past its timeout the watchdog prints
what the rank was waiting for and kills it (SIGKILL: its sockets close, so
its peers fail at once instead of waiting in turn). When the rank exits, the
pipe closes and the watchdog exits too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

_WATCHER = r"""
import os, select, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the rank, not for its watchdog
target, deadline, message, buf = int(sys.argv[1]), None, "", b""
while True:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    if select.select([0], [], [], wait)[0]:
        chunk = os.read(0, 65536)
        if not chunk:
            sys.exit(0)  # the rank is gone
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line:  # "<seconds> <message>": a guarded region starts
                seconds, message = line.decode().split(" ", 1)
                deadline = time.monotonic() + float(seconds)
            else:  # an empty line: it ended
                deadline = None
    elif deadline is not None and time.monotonic() >= deadline:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        os.kill(target, signal.SIGKILL)
        sys.exit(0)
"""


class Watchdog:
    """Kills process ``pid`` (default: this one) when a guarded region runs
    longer than ``timeout`` seconds, after printing ``what`` it waited for.

    The watcher process starts at the first :meth:`guard`; guarding a region
    costs two small pipe writes.
    """

    def __init__(self, timeout: float, rank: str = "?", pid: Optional[int] = None):
        self.timeout, self.rank = timeout, rank
        self.pid = os.getpid() if pid is None else pid
        self._proc: Optional[subprocess.Popen] = None

    def guard(self, what: str) -> "_Guarded":
        return _Guarded(self, what)

    def arm(self, what: str):
        message = (f"mlx-tracer rank {self.rank}: {what} made no progress for {self.timeout:g} s: a peer rank is "
                   "stuck, unreachable or never started; killing this rank (raise MLX_TRACER_STEP_TIMEOUT if "
                   "steps are this slow)")
        self._send(f"{self.timeout!r} {' '.join(message.split())}\n")

    def disarm(self):
        self._send("\n")

    def close(self):
        """Stop the watcher process (it also stops by itself when this process exits)."""
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait()
            self._proc = None

    def _send(self, line: str):
        for _ in range(2):
            if self._proc is None:
                self._proc = subprocess.Popen([sys.executable, "-c", _WATCHER, str(self.pid)], stdin=subprocess.PIPE,
                                              start_new_session=True)
            try:
                self._proc.stdin.write(line.encode())
                self._proc.stdin.flush()
                return
            except BrokenPipeError:  # the watcher is gone (it fired on another pid, or was killed): start anew
                self._proc.wait()
                self._proc = None


class _Guarded:
    def __init__(self, dog: Watchdog, what: str):
        self.dog, self.what = dog, what

    def __enter__(self):
        self.dog.arm(self.what)

    def __exit__(self, *exc):
        self.dog.disarm()
        return False
