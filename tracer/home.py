"""The cache folder (``$MLX_TRACER_HOME``): where it is, and whether it takes writes.

Dependency-free on purpose: the BLAS binding (:mod:`mlx_tracer.backend.blas`)
runs before anything else on ``import mlx_tracer`` and needs the folder to
keep its compiled shim, so this module may import nothing heavier than the
standard library.

Location: ``$MLX_TRACER_HOME``, else ``$XDG_CACHE_HOME/mlx-tracer``, else
``~/.cache/mlx-tracer``. It holds the default model file, the BLAS shim, the
CPU kernels and ``formats.json`` (the measured weight formats).

A folder that cannot be written (read-only mount, wrong owner) is not an
error: everything that caches asks :func:`writable_cache_dir` first and runs
without caching when it returns ``None``; the first such refusal prints one
line on stderr, later ones nothing.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

ENV_HOME = "MLX_TRACER_HOME"

_refused = {"said": False}


def cache_dir() -> Path:
    """The cache folder (not created here)."""
    home = os.environ.get(ENV_HOME)
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mlx-tracer"


def writable_cache_dir() -> Optional[Path]:
    """The cache folder, created if needed, when files can be written in it;
    else ``None`` (after saying so once on stderr)."""
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=d)
        os.close(fd)
        os.unlink(probe)
        return d
    except OSError as e:
        say_not_caching(d, e)
        return None


_SAID = "MLX_TRACER_SAID_NOT_CACHING"  # the folder already reported: a command started again under mimalloc keeps quiet


def say_not_caching(d: Path, error: BaseException) -> None:
    """One stderr line per command: the cache folder refused a write (a
    process the command started again, :mod:`mlx_tracer.backend.malloc`,
    inherits that it was said)."""
    if _refused["said"] or os.environ.get(_SAID) == str(d):
        return
    _refused["said"] = True
    os.environ[_SAID] = str(d)
    reason = getattr(error, "strerror", None) or str(error)
    print(
        f"[mlx-tracer] cache folder {d} is not writable ({reason}): running without caching "
        f"(set {ENV_HOME} to a writable folder to keep the BLAS shim and weight formats)",
        file=sys.stderr,
        flush=True,
    )


# --------------------------------------------------- compiled files kept here
def _digest_file(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


# Every change of a compiled file's source, compiler input or MLX version
# names a new file (the key is in the name), so old builds would pile up:
# a build unused for this long is removed when another of its kind is built.
STALE_DAYS = 30
_DAY = 86400.0


def check_kept(path: Path) -> None:
    """Raise OSError unless ``path`` matches the sha256 recorded next to it
    when it was built (loading a damaged shared object can fail or crash the
    process: a truncated ELF faults when mapped). A good file is marked used
    (its mtime, at most once a day) so that :func:`prune_stale` keeps it."""
    try:
        want = _digest_file(path).read_text().strip()
    except OSError:
        want = None
    if want != _sha256(path.read_bytes()):
        raise OSError(f"{path} does not match the sha256 recorded when it was built")
    _mark_used(path)


def _mark_used(path: Path) -> None:
    import time

    try:
        if time.time() - path.stat().st_mtime > _DAY:
            os.utime(path)
    except OSError:
        pass  # a read-only folder: nothing is pruned there either


def keep_built(out: Path, target: Path, kind: str) -> None:
    """Move a freshly built ``out`` to ``target`` with its sha256 next to it
    (same file system: each move atomic, never half a file), then remove the
    builds of the same ``kind`` (file-name prefix) unused for STALE_DAYS."""
    digest = _digest_file(out)
    digest.write_text(_sha256(out.read_bytes()) + "\n")
    os.replace(digest, _digest_file(target))
    os.replace(out, target)
    prune_stale(target, kind)


def prune_stale(keep: Path, kind: str, days: float = STALE_DAYS) -> list:
    """Remove files in ``keep``'s folder named ``kind*`` (with their sha256
    files) whose mtime is older than ``days``; ``keep`` itself stays. A build
    that some process still loads is marked used at each load (at most a day
    old), so only builds nothing has loaded for ``days`` go. Returns the
    removed paths; a file that cannot be removed is left."""
    import time

    cutoff = time.time() - days * _DAY
    removed = []
    for f in keep.parent.glob(kind + "*"):
        if f == keep or f.name.endswith(".sha256") or not f.is_file():
            continue
        try:
            if f.stat().st_mtime >= cutoff:
                continue
            f.unlink()
            removed.append(f)
            _digest_file(f).unlink(missing_ok=True)
        except OSError:
            continue
    # old digests whose build is gone (an older version removed builds alone;
    # a fresh one may be another process's build, its file about to move in)
    for d in keep.parent.glob(kind + "*.sha256"):
        try:
            if not d.with_name(d.name[: -len(".sha256")]).exists() and d.stat().st_mtime < cutoff:
                d.unlink()
        except OSError:
            continue
    return removed
