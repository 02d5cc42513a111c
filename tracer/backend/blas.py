"""A fast BLAS for MLX's CPU backend, loaded before MLX is.

MLX's Linux CPU wheel calls ``cblas_sgemm`` (and ``cblas_dgemm``,
``cblas_cgemm``: nothing else of BLAS) from a bundled *reference* BLAS, about
1.5 GFLOP/s here. Loading an optimized BLAS that defines those symbols into
the process with ``RTLD_GLOBAL`` *before* the first ``import mlx.core`` makes
MLX bind to it instead (extension modules bind their symbols when they load:
afterwards it is too late).

The BLAS is OpenBLAS from the PyPI wheel ``scipy-openblas32`` (8 MB, no
system libraries needed; a Linux dependency of mlx-tracer). Its symbols carry
a ``scipy_`` prefix, so a shim (``blas_shim.c``, compiled once with the
system C compiler, which MLX's CPU backend needs for its own kernel JIT
anyway) exports the plain names. ``MLX_TRACER_BLAS=0`` switches this off;
``MLX_TRACER_BLAS_THREADS`` pins the thread count; otherwise
:mod:`mlx_tracer.backend.threads` picks it (every core where the shim splits
GEMMs, else the idle cores per phase).

The shim's ``cblas_sgemm`` splits a large GEMM itself (on x86-64; elsewhere
it forwards and OpenBLAS threads): OpenBLAS runs single-threaded, the call
is cut into up to 64 row or column ranges of C, fixed by the shape alone,
and the calling thread and ``threads - 1`` workers pull them from one atomic
counter; idle workers sleep on a futex after a 20 us spin. OpenBLAS's own
threading splits statically and spins until every thread is done, so beside
busy processes one preempted thread stalled every GEMM; here it delays only
the chunk it holds. A chunk is one OpenBLAS call on sub-matrices; the chunks
depend on the shape alone, and one thread runs the same chunks in turn, so
the bits are the same whatever the thread count and from run to run
(tests/test_blas.py), though not the bits of one unsplit call. Few-row GEMMs
(decode) are cut along the weight rows into chunks that OpenBLAS serves with
its small-matrix kernel (4-5x faster per row than its blocked one on these
shapes). Measured on this 2-core machine: see :mod:`mlx_tracer.backend.threads`.

The shim is kept in the cache folder (:mod:`mlx_tracer.home`) as
``blas-shim-<key>.so`` with its sha256 next to it. A kept file that does not
match it (junk, 0 bytes, truncated) is rebuilt before it is loaded, rather
than crashing dlopen or pinning the reference BLAS; a cache folder that takes no writes gets a process-private build in a
temporary folder (and one stderr line saying nothing is cached).

``import mlx_tracer`` (and so the ``mlx-tracer`` command, and any import of a
sub-package such as ``mlx_tracer.caches``) activates it first thing; this
module and :mod:`mlx_tracer.home` are all that path imports. :func:`status`
reports which library really serves ``cblas_sgemm`` in this process, read
with ``dladdr``, never assumed.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..home import cache_dir, check_kept, keep_built, writable_cache_dir

ENV = "MLX_TRACER_BLAS"
ENV_THREADS = "MLX_TRACER_BLAS_THREADS"

_state = {"tried": False, "loaded": None, "error": None, "late": False, "threads": None, "rebuilt": None}


@dataclass
class BlasStatus:
    library: Optional[str]  # the shared object that serves cblas_sgemm in this process
    fast: bool  # an optimized BLAS (not MLX's bundled reference BLAS)
    threads: Optional[int]
    note: str


SHIM_SOURCE = Path(__file__).with_name("blas_shim.c")  # the shim: forwarding, and cblas_sgemm's own split


def openblas_path() -> Optional[str]:
    """The ``libscipy_openblas.so`` of the installed scipy-openblas32, if any."""
    try:
        from importlib import metadata

        dist = metadata.distribution("scipy-openblas32")
        for f in dist.files or ():
            if str(f).endswith("lib/libscipy_openblas.so"):
                return str(dist.locate_file(f))
    except Exception:
        pass
    return None


def shim_file(openblas: str) -> Path:
    """Where the shim for ``openblas`` is kept: the cache folder, one file per
    shim source and OpenBLAS location."""
    import hashlib

    key = hashlib.sha1((SHIM_SOURCE.read_text() + os.path.realpath(openblas)).encode()).hexdigest()[:12]
    return cache_dir() / f"blas-shim-{key}.so"


def _open_shim(path: Path, verify: bool = True, mode: int = ctypes.RTLD_GLOBAL) -> ctypes.CDLL:
    """dlopen the shim. A kept shim is first checked against the sha256
    written next to it when it was built: dlopen of a damaged file can fail,
    or crash the process (a truncated ELF faults when mapped), so a mismatch
    raises OSError before it gets that far."""
    if verify:
        check_kept(path)
    lib = ctypes.CDLL(str(path), mode=mode)
    if not hasattr(lib, "cblas_sgemm"):
        raise OSError(f"{path} defines no cblas_sgemm")
    return lib


def _build_shim(openblas: str, target: Path, mode: int = ctypes.RTLD_GLOBAL) -> ctypes.CDLL:
    """Compile the shim into ``target`` (atomically, its sha256 next to it)
    and load it. A cache folder that takes no writes gets a process-private
    copy instead, built in a temporary folder removed once it is loaded."""
    import shutil
    import subprocess
    import tempfile

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise OSError("no C compiler (cc/gcc/clang) to build the BLAS shim; set CC or install one")
    folder = writable_cache_dir()  # None: read-only (said once on stderr)
    with tempfile.TemporaryDirectory(prefix=".blas-shim-build-", dir=folder) as tmp:
        src, out = os.path.join(tmp, "shim.c"), Path(tmp) / target.name
        shutil.copyfile(SHIM_SOURCE, src)
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", src, "-o", str(out)], check=True, capture_output=True)
        if folder is None:
            return _open_shim(out, verify=False, mode=mode)  # stays mapped after the folder is gone
        keep_built(out, target, "blas-shim-")
    return _open_shim(target, mode=mode)


def _load_shim(openblas: str, mode: int = ctypes.RTLD_GLOBAL) -> ctypes.CDLL:
    """The cached shim, or a new one when it is missing or broken."""
    target = shim_file(openblas)
    if target.exists():
        try:
            return _open_shim(target, mode=mode)
        except OSError as e:  # a corrupt cached shim must not pin the reference BLAS: rebuild it
            _state["rebuilt"] = str(e)
    return _build_shim(openblas, target, mode=mode)


def private_shim(openblas: str) -> ctypes.CDLL:
    """The shim (built if need be) loaded without exporting its names, so
    that it binds nothing in this process: for tests that call its
    ``cblas_sgemm`` directly, next to OpenBLAS's own ``scipy_cblas_sgemm``."""
    ctypes.CDLL(openblas, mode=ctypes.RTLD_GLOBAL)  # only scipy_-prefixed names: the shim's calls resolve here
    return _load_shim(openblas, mode=ctypes.RTLD_LOCAL)


def activate() -> bool:
    """Load the fast BLAS process-wide if mlx is not imported yet. Returns
    whether it is loaded; warns (once) when mlx was imported first."""
    if _state["tried"]:
        return _state["loaded"] is not None
    _state["tried"] = True
    if os.environ.get(ENV, "").lower() in ("0", "off", "false", "no"):
        return False
    openblas = openblas_path()
    if openblas is None:
        return False
    if "mlx.core" in sys.modules:
        _state["late"] = True
        warnings.warn(
            "mlx was imported before mlx_tracer: the fast BLAS is NOT active and MLX's CPU matmuls use its "
            "reference BLAS. Import mlx_tracer (or call mlx_tracer.backend.blas.activate()) before mlx, or run the "
            "`mlx-tracer` command.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    try:
        ctypes.CDLL(openblas, mode=ctypes.RTLD_GLOBAL)  # the shim's scipy_ names resolve here
        threads = int(os.environ.get(ENV_THREADS) or os.cpu_count() or 1)
        shim = _load_shim(openblas)  # sets OpenBLAS to one thread where it splits GEMMs itself
        shim.mlx_tracer_blas_set_threads(threads)
        _state["lib"] = shim
    except Exception as e:  # a broken BLAS must never stop the package from importing
        _state["error"] = str(e)
        warnings.warn(f"fast BLAS not active ({e}); MLX uses its reference BLAS", RuntimeWarning, stacklevel=3)
        return False
    _state["loaded"] = openblas
    _state["threads"] = threads
    return True


def loaded() -> bool:
    """Whether the shim (and the fast BLAS behind it) is loaded in this process."""
    return _state.get("lib") is not None


def splits() -> bool:
    """Whether the loaded shim splits fp32 GEMMs itself (else OpenBLAS threads, or no shim)."""
    return _state.get("lib") is not None and bool(_state["lib"].mlx_tracer_blas_splits())


def set_threads(n: int) -> None:
    """Split each large fp32 GEMM across ``n`` threads (the caller included)
    from now on (no-op without the fast BLAS). Call it between evaluated
    steps; a GEMM already running keeps the count it started with."""
    if _state.get("lib") is not None and n != _state["threads"]:
        _state["lib"].mlx_tracer_blas_set_threads(int(n))
        _state["threads"] = int(n)


def _sgemm_library() -> Optional[str]:
    """The file defining the ``cblas_sgemm`` MLX binds to: the global scope's,
    if any (it precedes MLX's own dependencies), else MLX's bundled BLAS."""
    import mlx.core  # noqa: F401  (MLX's own BLAS must be loaded to be seen)

    from .dl import defining_library  # not at import: `import mlx_tracer` loads only this module and home

    lib = defining_library("cblas_sgemm")
    if lib is not None:
        return lib
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libblas" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def status() -> BlasStatus:
    lib = _sgemm_library()
    fast = _state["loaded"] is not None and lib is not None and "libblas" not in os.path.basename(lib)
    if fast:
        pinned = os.environ.get(ENV_THREADS)
        split = _state["lib"].mlx_tracer_blas_splits()
        default = "all cores, every phase" if split else "threads per phase: the idle cores"
        threads = f"{pinned} threads (pinned by {ENV_THREADS})" if pinned else default
        how = "large fp32 GEMMs split by the shim into shape-fixed chunks" if split else "OpenBLAS threading"
        note = f"OpenBLAS (scipy-openblas32) via shim, {threads}; {how}"
    elif _state["late"]:
        note = "mlx was imported before mlx_tracer: reference BLAS (import mlx_tracer first)"
    elif _state["error"]:
        note = f"reference BLAS: {_state['error']}"
    elif openblas_path() is None or os.environ.get(ENV, "").lower() in ("0", "off", "false", "no"):
        note = f"reference BLAS (no scipy-openblas32 installed, or {ENV}=0)"
    else:
        note = "reference BLAS"
    return BlasStatus(lib, fast, _state.get("threads") if fast else None, note)
