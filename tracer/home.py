"""The cache folder (``$MLX_TRACER_HOME``): where it is, and whether it takes writes.

Dependency-free on purpose: the BLAS binding (:mod:`mlx_tracer.backend.blas`)
runs before anything else on ``import mlx_tracer`` and needs the folder to
keep its compiled shim, so this module may import nothing heavier than the
standard library.

Location: ``$MLX_TRACER_HOME``, else ``$XDG_CACHE_HOME/mlx-tracer``, else
``~/.cache/mlx-tracer``. It holds the default model file, the BLAS shim and
``formats.json`` (the measured weight formats).

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


def say_not_caching(d: Path, error: BaseException) -> None:
    """One stderr line per process: the cache folder refused a write."""
    if _refused["said"]:
        return
    _refused["said"] = True
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


def check_kept(path: Path) -> None:
    """Raise OSError unless ``path`` matches the sha256 recorded next to it
    when it was built (loading a damaged shared object can fail or crash the
    process: a truncated ELF faults when mapped)."""
    try:
        want = _digest_file(path).read_text().strip()
    except OSError:
        want = None
    if want != _sha256(path.read_bytes()):
        raise OSError(f"{path} does not match the sha256 recorded when it was built")


def keep_built(out: Path, target: Path) -> None:
    """Move a freshly built ``out`` to ``target`` with its sha256 next to it
    (same file system: each move atomic, never half a file)."""
    digest = _digest_file(out)
    digest.write_text(_sha256(out.read_bytes()) + "\n")
    os.replace(digest, _digest_file(target))
    os.replace(out, target)
