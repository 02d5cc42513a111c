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

The policy (``MLX_TRACER_BLAS_THREADS`` unset): every phase gets one thread
per core that no other process is using right now (``/proc/loadavg``'s count
of runnable tasks, less this process's own running threads), at least 1.
Measured here (SmolLM2 fp32, bucket 1, ``python benchmarks/contention.py
--busy 0`` and ``--busy 2``; load average 0.6 before): quiet, 2 pinned
threads decode at 15.5 tok/s and prefill at 209, 1 thread at 13.3 and 148,
this policy at 16.2 and 192; beside two busy processes 2 threads collapse to
1.1 and 9.3, 1 thread keeps 7.6 and 76, this policy 6.5 and 67 (0.40x and
0.35x its quiet speed, where three processes share two cores).

Since the BLAS shim splits each large GEMM itself into shape-fixed chunks
that idle-sleeping workers pull from a counter (:mod:`mlx_tracer.backend.blas`;
OpenBLAS runs single-threaded), a preempted thread delays only its own chunk.
Measured here, A/B against the OpenBLAS-threaded shim, alternating runs
(SmolLM2 fp32, bucket 1, 32 tokens, median of 2; another engineer's jobs
kept the load average at 2-4 throughout, so "busy 0" was not quiet):
2 pinned threads with busy 0: decode 8.0 -> 9.5 tok/s, prefill 15 -> 129;
busy 1: 5.1 -> 9.9 and 59 -> 119; busy 2: 1.2 -> 7.3 and 9.6 -> 76. This
policy (which picks 1 thread beside two busy processes, so the split does
not run) stayed within noise: busy 2 decode 3.8 -> 3.9, prefill 73 -> 48;
busy 1 9.9 -> 9.4, 122 -> 138. With the split, 2 threads beat this policy
beside busy processes; the policy is unchanged for now. Quiet (load
average 1.1-1.6, 3 alternating runs each) the split costs a little: decode
15.0 -> 13.7 tok/s with 2 threads (14.2 -> 13.7 with this policy), prefill
195 -> 175 (194 -> 172), mostly the decode MLP's 1 x 1536 x 576 GEMMs, which
OpenBLAS threaded and the shim must leave whole to keep the bits.

Threads change only between steps with nothing in flight, never under a
running GEMM: the engine asks at admission (:func:`for_prefill`, then
:func:`for_decode`) and, while decoding, drains its pipeline every
``RECHECK_STEPS`` steps to ask again. ``MLX_TRACER_BLAS_THREADS=N`` pins N
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
    """Whether the thread count follows the machine's load (so decode drains
    every ``RECHECK_STEPS`` steps to ask again): not where it is pinned or
    where the shim splits GEMMs (then it is every core)."""
    return pinned() is None and not blas.splits()


def for_prefill() -> int:
    """Set (and return) the thread count of a prefill phase."""
    n = pinned() or default()
    blas.set_threads(n)
    return n


def for_decode() -> int:
    """Set (and return) the thread count of decode steps."""
    n = pinned() or default()
    blas.set_threads(n)
    return n
