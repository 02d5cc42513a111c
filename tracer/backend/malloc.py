"""mimalloc under the ``mlx-tracer`` command: the process's malloc, preloaded.

Why. MLX builds and schedules every step's graph on the calling thread
(the compiled call's replay, ``eval``, each primitive's ``eval_cpu``: output
buffers, array descriptors, vectors) and its stream thread frees most of it
after the step ran. glibc's malloc handles that pattern badly: a freed chunk
lands in the freeing thread's cache or in the allocating arena's bins, so the
building thread finds its own cache empty and takes ``_int_malloc``'s slow
path (sorting the unsorted bin, ``malloc_consolidate``) step after step.
``perf`` on a bucket-1 SmolLM2 decode put about half of the Python thread's
time there, and on two cores that thread shares a core with qmm's worker.
Under mimalloc (free lists per page, a cross-thread free is one atomic push)
the host's time per step fell from 1.9-2.4 to 1.1-1.3 ms (the engine's own
``host ms/step``); see the README's *Performance* for decode figures.

How. A process picks its malloc when it starts: the dynamic loader binds
``malloc`` to the first library in its global scope that defines it, and
glibc is there before any Python runs, so loading mimalloc later changes
nothing (unlike the BLAS, :mod:`.blas`, whose symbols MLX binds when it
loads). So :func:`reexec` starts the command again, the same process id and
arguments (``os.execv``), with mimalloc in ``LD_PRELOAD``; it runs first in
the ``mlx-tracer`` command, before any model loads, and at most once
(``MLX_TRACER_MALLOC_PRELOADED`` marks the second start).

* mimalloc comes from the PyPI wheel ``cmeel-mimalloc`` (a Linux dependency
  of mlx-tracer; ~0.5 MB);
* ``MLX_TRACER_MALLOC=system`` (or ``0``) keeps glibc's; a path to a shared
  library (e.g. jemalloc's) preloads that one instead; a malloc the user
  already preloaded (``LD_PRELOAD``) stays unless such a path is given;
* the Python API cannot change the malloc of a running interpreter: start
  it with ``LD_PRELOAD=$(mlx-tracer info --malloc-path)`` for the same effect
  (:func:`status` says what serves ``malloc`` in this process, read with
  ``dladdr``, never assumed);
* mimalloc returns emptied pages to the system after 10 s (``PURGE_DELAY_MS``;
  its own default, 10 ms, made each decode step fault pages back in);
  ``MIMALLOC_PURGE_DELAY`` in the environment wins;
* Linux only (elsewhere the system's malloc stays).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from .dl import defining_library

ENV = "MLX_TRACER_MALLOC"
MARK = "MLX_TRACER_MALLOC_PRELOADED"  # set in the environment of the second start
OFF = ("0", "off", "no", "false", "system", "glibc")
# mimalloc gives freed pages back to the system 10 ms after they empty (its default); each step then faulted
# ~1 page back in (bucket-1 decode 109 vs 113-123 tok/s with a longer delay). 10 s: a decode loop keeps its pages,
# an idle server still returns them. MIMALLOC_PURGE_DELAY set by the user wins.
PURGE_DELAY_MS = "10000"


def mimalloc_path() -> Optional[str]:
    """``libmimalloc.so`` of the installed cmeel-mimalloc wheel, if any."""
    try:
        from importlib import metadata

        dist = metadata.distribution("cmeel-mimalloc")
        for f in dist.files or ():
            name = str(f)
            if "/lib/libmimalloc.so" in name and not name.endswith(".so"):  # the versioned file, not the dev link
                return os.path.realpath(str(dist.locate_file(f)))
    except Exception:
        pass
    return None


def wanted() -> Optional[str]:
    """The library the command should run under: ``MLX_TRACER_MALLOC``'s
    path, else mimalloc; None where it stays glibc's (switched off, not
    Linux, nothing installed). A path that is not a file is an error that
    says what to do."""
    choice = os.environ.get(ENV, "").strip()
    if choice.lower() in OFF or not sys.platform.startswith("linux"):
        return None
    if choice:
        if not os.path.isfile(choice):
            raise FileNotFoundError(
                f"{ENV}={choice!r} is not a file: give the path of a malloc library (e.g. libjemalloc.so.2), "
                f"or {ENV}=system for glibc's"
            )
        return os.path.realpath(choice)
    return mimalloc_path()


def serving() -> Optional[str]:
    """The file whose ``malloc`` this process calls."""
    return defining_library("malloc")


def reexec() -> None:
    """Start this command again under :func:`wanted`'s malloc if it does not
    run under it yet (see the module docstring); returns where nothing is to
    be done or the start is refused (the command then runs as it is)."""
    lib = wanted()
    if lib is None or MARK in os.environ or not getattr(sys, "orig_argv", None):
        return
    now = serving()
    if now == lib or (not os.environ.get(ENV, "").strip() and now and not _is_glibc(now)):
        return  # already there, or the user preloaded a malloc of their own (MLX_TRACER_MALLOC=PATH overrides it)
    env = dict(os.environ)
    env["LD_PRELOAD"] = lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    env[MARK] = lib
    if "mimalloc" in os.path.basename(lib):
        env.setdefault("MIMALLOC_PURGE_DELAY", PURGE_DELAY_MS)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return


def without_preload(env: dict) -> dict:
    """``env`` for a child that should run under the system malloc (a peer
    measured beside mlx-tracer): the preload :func:`reexec` added removed."""
    env = dict(env)
    lib = env.pop(MARK, None)
    if lib and env.get("LD_PRELOAD"):
        rest = [p for p in env["LD_PRELOAD"].split(":") if p and p != lib]
        if rest:
            env["LD_PRELOAD"] = ":".join(rest)
        else:
            del env["LD_PRELOAD"]
    return env


def _is_glibc(lib: str) -> bool:
    return os.path.basename(lib).startswith("libc.so")


def status() -> str:
    """One line: which malloc serves this process, and how to change it."""
    lib = serving()
    if lib is None:
        return "unknown"
    if _is_glibc(lib):
        why = (f"{ENV}={os.environ[ENV]}" if os.environ.get(ENV, "").strip().lower() in OFF
               else "the mlx-tracer command preloads mimalloc; the Python API needs LD_PRELOAD"
               if mimalloc_path() else "cmeel-mimalloc is not installed")
        return f"glibc ({why})"
    name = "mimalloc" if "mimalloc" in os.path.basename(lib) else os.path.basename(lib)
    how = "preloaded by the mlx-tracer command" if os.environ.get(MARK) == lib else "preloaded by the user"
    return f"{name} ({lib}); {how}"
