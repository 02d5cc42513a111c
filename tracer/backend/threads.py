"""How many BLAS threads each phase gets, so that a busy machine slows decode
down fairly instead of collapsing it.

OpenBLAS splits every GEMM across its threads and waits for all of them. When
another process holds a core, one of our threads waits for the scheduler and
every small GEMM of a decode step waits with it: on this 2-core machine,
with two busy processes beside it, SmolLM2 decode fell to 0.8 tok/s with 2
threads and ran at 4.5 with 1 (``python benchmarks/contention.py --busy 2``;
see the README's Performance section). Under OpenBLAS's threading, decode
GEMMs (a few rows) gain little from a second thread even on a quiet machine;
split by the shim they gain ~40% (1 pinned thread 20.7 tok/s, 2 threads
29.6), as prefill does.

The policy (``MLX_TRACER_BLAS_THREADS`` unset) where the BLAS shim splits
GEMMs itself (x86-64; :mod:`mlx_tracer.backend.blas`): every phase gets every
core. The shim cuts each large GEMM into shape-fixed chunks (few-row decode
and short prefill GEMMs along the weight rows, into chunks OpenBLAS serves
with its small-matrix kernel) that the caller and sleeping workers pull from
one counter, OpenBLAS running single-threaded; a preempted thread delays
only the chunk it holds, and the bits do not depend on the thread count.
Measured here, A/B against main (OpenBLAS threading, idle-cores policy),
alternating runs, SmolLM2 fp32, bucket 1, ``python benchmarks/contention.py
--busy 0`` and ``--busy 2`` (load average 1.5-3.3 between runs, mostly the
benchmark's own busy loops decaying), default policy, per round:
quiet decode 28.5 / 23.9 / 21.9 tok/s (main 18.8 / 15.8 / 16.1), prefill
236 / 226 / 175 (main 236 / 195 / 197: a ~12-token prompt, noisy; 2 pinned
threads, the same setting here, 250 / 202 / 210); beside two busy processes
decode 11.1 / 14.5 / 12.1 (main 7.0 / 7.6 / 7.4), prefill 100 / 138 / 119
(main 82 / 88 / 89), about 0.5x quiet; OpenBLAS's own 2 threads collapse there
to ~3 tok/s decode and ~22 prefill.

Elsewhere (OpenBLAS threads itself) every phase gets one thread per core that
no other process is using right now (``/proc/loadavg``'s count of runnable
tasks, less this process's own running threads), at least 1, and decode
looks again every ``RECHECK_STEPS`` steps. Measured before the shim split
(same benchmark, load average 0.6 before): quiet, 2 pinned threads decode at
15.5 tok/s and prefill at 209, 1 thread at 13.3 and 148, this policy at 16.2
and 192; beside two busy processes 2 threads collapse to 1.1 and 9.3, 1
thread keeps 7.6 and 76, this policy 6.5 and 67.

Threads change only between steps with nothing in flight, never under a
running GEMM: under the idle-cores policy (:func:`follows_load`) the engine
asks (:func:`apply`) at admission and drains its pipeline every
``RECHECK_STEPS`` decode steps to ask again; elsewhere the count never changes
and it does not ask. ``MLX_TRACER_BLAS_THREADS=N`` pins N
threads for every phase.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from . import blas


def pinned() -> Optional[int]:
    """The thread count the user pinned, if any."""
    v = os.environ.get(blas.ENV_THREADS)
    return int(v) if v and v.isdigit() and int(v) > 0 else None


RECHECK_STEPS = 64  # decode steps between two looks at the machine


def _own_running() -> int:
    """This process's threads that are running or runnable now (this one included)."""
    n = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    n += f.read().rsplit(")", 1)[1].split()[0] == "R"
            except (OSError, IndexError):
                pass
    except OSError:
        return 1
    return max(n, 1)


def _others_running() -> int:
    with open("/proc/loadavg") as f:
        runnable = int(f.read().split()[3].split("/")[0])  # running + runnable tasks, system-wide
    return max(0, runnable - _own_running())


def idle_cores(samples: int = 3, gap_s: float = 0.001) -> int:
    """Cores no other process is running on now: the median of a few snapshots
    a few milliseconds apart (one snapshot catches passing blips)."""
    cores = os.cpu_count() or 1
    seen = []
    try:
        for i in range(samples):
            if i:
                time.sleep(gap_s)
            seen.append(_others_running())
    except (OSError, ValueError, IndexError):
        return cores
    return max(1, cores - sorted(seen)[len(seen) // 2])


def default() -> int:
    """The thread count when none is pinned: every core where the shim splits
    GEMMs (dynamic chunks), else the idle cores."""
    return (os.cpu_count() or 1) if blas.splits() else idle_cores()


def follows_load() -> bool:
    """Whether the thread count follows the machine's load, so that asking
    again can change it: only where OpenBLAS threads itself (the shim is
    loaded but does not split GEMMs) and no count is pinned. Elsewhere the
    count is fixed from the start (pinned, or every core where the shim
    splits), and without the shim there is nothing to set."""
    return pinned() is None and blas.loaded() and not blas.splits()


def apply() -> int:
    """Set (and return) the thread count for the next steps (call it with
    nothing in flight: at admission, and every ``RECHECK_STEPS`` decode steps)."""
    n = pinned() or default()
    blas.set_threads(n)
    return n
