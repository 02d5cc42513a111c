"""How many BLAS threads each phase gets, so that a busy machine slows decode
down fairly instead of collapsing it.

OpenBLAS splits every GEMM across its threads and waits for all of them. When
another process holds a core, one of our threads waits for the scheduler and
every small GEMM of a decode step waits with it: on this 2-core machine,
with two busy processes beside it, SmolLM2 decode fell to 0.8 tok/s with 2
threads and ran at 4.5 with 1 (``python benchmarks/contention.py --busy 2``;
see the README's Performance section). Decode GEMMs (a few rows) are
bound by reading the weights, so a second thread buys little even on a quiet
machine, while prefill GEMMs (hundreds of rows) scale with cores.

The policy (``MLX_TRACER_BLAS_THREADS`` unset):

* **decode**: 1 thread;
* **prefill**: one thread per core that no other process is using right now
  (``/proc/loadavg``'s count of runnable tasks, less this process's own),
  at least 1.

Threads change only between steps with nothing in flight (the engine calls
:func:`for_prefill` / :func:`for_decode` at admission, where its pipeline is
drained), never under a running GEMM. ``MLX_TRACER_BLAS_THREADS=N`` pins N
threads for every phase.
"""

from __future__ import annotations

import os
from typing import Optional

from . import blas


def pinned() -> Optional[int]:
    """The thread count the user pinned, if any."""
    v = os.environ.get(blas.ENV_THREADS)
    return int(v) if v and v.isdigit() and int(v) > 0 else None


def idle_cores() -> int:
    """Cores no other process is running on right now (a snapshot)."""
    cores = os.cpu_count() or 1
    try:
        with open("/proc/loadavg") as f:
            runnable = int(f.read().split()[3].split("/")[0])  # running + runnable tasks, this reader included
    except (OSError, ValueError, IndexError):
        return cores
    return max(1, cores - max(0, runnable - 1))


def for_prefill() -> int:
    """Set (and return) the thread count of a prefill phase."""
    n = pinned() or idle_cores()
    blas.set_threads(n)
    return n


def for_decode() -> int:
    """Set (and return) the thread count of decode steps."""
    n = pinned() or 1
    blas.set_threads(n)
    return n
