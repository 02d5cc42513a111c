"""Leftovers of interrupted writes in the cache folder, and how they are told
from live ones.

A fetch downloads into ``mlx-tracer-fetch-*/`` and extracts into
``.<model>.*.part``; a killed process (SIGKILL, power loss) leaves both
behind. Every writer holds an exclusive ``flock`` while it works: on
``.lock`` inside its fetch folder, on the ``.part`` file itself. So the next
fetch (:func:`sweep`) removes what no live process holds:

* a fetch folder whose ``.lock`` it can lock, or that has no ``.lock`` and is
  older than :data:`STALE_S` (made by an older version, or killed before it
  locked);
* a ``.part`` file it can lock that is older than :data:`GRACE_S` (a brand
  new one may not be locked yet);
* a BLAS-shim build folder or a ``formats.json`` temporary file older than
  :data:`STALE_S`.

Every fetch sweeps, whether the model is there or not (a killed ``fetch
--force`` leaves its leftovers beside a good file). The ages are a margin
for the moments a writer has made a file but not locked it yet (a fetch
folder's ``.lock`` is locked before it gets its name, so it has none); a
minute is ample for that, and ten minutes for kinds no lock protects.

Without ``fcntl`` (not POSIX) only the ages count.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

STALE_S = 10 * 60  # unlocked kinds of leftovers older than this are dead
GRACE_S = 60  # a .part younger than this may belong to a writer not yet locked

FETCH_PREFIX = "mlx-tracer-fetch-"
LOCK_NAME = ".lock"

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None


def hold(fd: int) -> None:
    """Take the exclusive lock a live writer holds on ``fd`` until it closes it."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)


@contextlib.contextmanager
def holding(path: Path):
    """Create ``path`` and hold its lock for the ``with`` block. The file is
    locked under another name and then renamed (the lock stays with it), so
    no sweep ever sees ``path`` unlocked while its writer lives."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        hold(fd)
        os.replace(tmp, path)
        yield
    finally:
        os.close(fd)


def _unheld(path: Path) -> bool:
    """True when no process holds ``path``'s lock (and it still exists)."""
    if fcntl is None:
        return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _age(path: Path) -> float:
    try:
        return time.time() - path.lstat().st_mtime
    except OSError:
        return 0.0


def sweep(folder: Path, model_filename: str) -> list:
    """Remove the dead leftovers in ``folder``; returns their names."""
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for p in entries:
        name = p.name
        if name.startswith(FETCH_PREFIX) and p.is_dir():
            lock = p / LOCK_NAME
            dead = _unheld(lock) if lock.exists() else _age(p) > STALE_S
        elif name.startswith(f".{model_filename}.") and name.endswith(".part"):
            dead = _age(p) > GRACE_S and _unheld(p)
        elif name.startswith(".blas-shim-build-") or (name.startswith(".formats.json.") and name.endswith(".tmp")):
            dead = _age(p) > STALE_S
        else:
            continue
        if dead:
            try:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                removed.append(name)
            except OSError:
                pass
    return removed
