"""The conditions a bench ran under: the machine's load, and busy neighbours on purpose.

On a 2-core machine one busy neighbour changes results several-fold, so every
table records the 1-minute load average before and after the run and warns
when the machine was not quiet: a load above 0.5 before the run (someone else
was running), or above the core count + 0.5 after it (the bench itself uses
at most the cores). ``--busy N`` starts N spinning processes for the run, to
measure exactly that case.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import asdict, dataclass, field
from typing import List, Optional


@dataclass
class Conditions:
    cores: int
    busy: int  # spinning processes the bench started beside itself
    load_before: float
    load_after: Optional[float] = None
    notes: List[str] = field(default_factory=list)

    @classmethod
    def start(cls, busy: int = 0) -> "Conditions":
        return cls(os.cpu_count() or 1, busy, os.getloadavg()[0])

    def finish(self) -> "Conditions":
        self.load_after = os.getloadavg()[0]
        return self

    @property
    def quiet(self) -> bool:
        after = self.load_after if self.load_after is not None else 0.0
        return self.busy == 0 and self.load_before <= 0.5 and after <= self.cores + 0.5

    def line(self) -> str:
        after = "" if self.load_after is None else f", {self.load_after:.2f} after"
        text = f"load average (1 min): {self.load_before:.2f} before{after}, {self.cores} cores"
        if self.busy:
            text += f"; {self.busy} busy processes started beside the run on purpose"
        elif not self.quiet:
            text += "; WARNING: the machine was not quiet, these figures are not comparable with a quiet run"
        return text

    def as_dict(self) -> dict:
        return dict(asdict(self), quiet=self.quiet)


@contextlib.contextmanager
def busy_processes(n: int):
    """``n`` processes spinning on a core each, for the duration of the block."""
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]
    try:
        yield hogs
    finally:
        for h in hogs:
            h.kill()
            h.wait()
