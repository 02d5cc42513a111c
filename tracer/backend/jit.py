"""Can ``mx.compile`` trace once and run fused kernels here? Asked before a model loads.

Compile-once decode rests on ``mx.compile`` keeping the graph it traced. On
MLX's CPU backend that needs a C++ compiler: MLX fuses elementwise ops into
kernels it writes as C++ and builds with ``g++`` (cached as shared libraries
under ``$TMPDIR/mlx/<version>/cpu``). MLX 0.32 decides once per process, by
running ``g++ --version``, whether the CPU can compile at all; when it cannot
(or ``MLX_DISABLE_COMPILE`` is set, or ``mx.disable_compile()`` was called),
``mx.compile(f)`` silently returns ``f`` itself: nothing is traced, the Python
step runs again on every call and each decode step counts as a new trace. No
MLX mode keeps the traced graph without that compiler (its "no fusion"
compile mode is skipped the same way), so there is no compile-once fallback:
:func:`check_compiler` stops with an error that says what to install.

It probes behaviour rather than guessing from ``PATH``: a one-op function
compiled and called twice must run its Python body once, and a two-op
function (one fused kernel, so one JIT build the first time, cached after)
must evaluate. Both answers are kept for the process. Any failure of the
probe becomes :class:`CompilerUnavailable` naming its cause: a kernel folder
(``$TMPDIR/mlx``) that cannot be written, or a ``g++`` that answers
``--version`` but fails to build (its first line of output).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

ENV_DISABLE = "MLX_DISABLE_COMPILE"

INSTALL_HINT = (
    "install a C++ compiler (Debian/Ubuntu: `apt-get install g++`; Fedora/RHEL: `dnf install gcc-c++`; "
    "Alpine: `apk add g++`), make sure `g++` is on PATH, then run again"
)

_mode = {}


class CompilerUnavailable(RuntimeError):
    """``mx.compile`` cannot trace once here; the message says why and what to do."""


def check_compiler() -> str:
    """The compile mode of this process's default device: ``"gpu"`` or
    ``"cpu-jit"``. Raises :class:`CompilerUnavailable` when ``mx.compile``
    would not keep a trace (every decode step would retrace) or MLX cannot
    build its CPU kernels."""
    if "mode" not in _mode:
        _mode["mode"] = _probe()
    if isinstance(_mode["mode"], CompilerUnavailable):
        raise _mode["mode"]
    return _mode["mode"]


def _probe():
    import mlx.core as mx

    gpu = mx.default_device() == mx.gpu
    calls = []

    def one_op(x):
        calls.append(None)
        return x + 1

    try:  # every call builds kernels on the CPU: any of them can fail
        f = mx.compile(one_op)
        x = mx.zeros((4,), dtype=mx.float32)
        mx.eval(f(x), f(x))
        if len(calls) > 1:
            return CompilerUnavailable(_why_not_traced(gpu))
        mx.eval(mx.compile(lambda a: mx.exp(a * 2.0 + 1.0))(x))
    except Exception as e:  # e.g. "[Compile::eval_cpu] Failed to compile function ...", "filesystem error: ..."
        return CompilerUnavailable(_why_build_failed(e))
    return "gpu" if gpu else "cpu-jit"


def kernel_folder() -> Path:
    """Where MLX keeps its CPU kernels: under C++'s temporary folder, which
    reads these variables in this order (Python's ``tempfile`` would fall
    back to another folder instead of failing)."""
    for name in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        if os.environ.get(name):
            return Path(os.environ[name]) / "mlx"
    return Path("/tmp/mlx")


def _why_build_failed(error: BaseException) -> str:
    """Name the cause of a failed kernel build: an unwritable kernel folder,
    a compiler that fails (its first line of output), or MLX's own words."""
    kernels = kernel_folder()
    try:
        kernels.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="mlx-tracer-probe-", dir=kernels) as tmp:
            compiler_says = _compiler_error(Path(tmp))
    except OSError as e:
        return (
            f"MLX cannot write its compiled CPU kernels under {kernels} ({e.strerror or e}): point TMPDIR at a "
            f"writable folder, e.g. `TMPDIR=$HOME/tmp mlx-tracer ...`"
        )
    if compiler_says is not None:
        return (f"the C++ compiler `g++` ({shutil.which('g++')}) fails to build MLX's CPU kernels: {compiler_says}. "
                f"Fix or reinstall it: {INSTALL_HINT}")
    mlx_says = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    return (f"MLX could not build a compiled CPU kernel ({mlx_says}); check that `g++` works and that {kernels} "
            "is writable (set TMPDIR to move it)")


def _compiler_error(folder: Path):
    """The first line ``g++`` prints when it fails to build a one-line shared
    library in ``folder`` (None: it builds, or there is no g++ to ask)."""
    gxx = shutil.which("g++")
    if gxx is None:
        return None
    src = folder / "probe.cpp"
    src.write_text('extern "C" int mlx_tracer_probe() { return 0; }\n')
    try:
        r = subprocess.run([gxx, "-shared", "-fPIC", str(src), "-o", str(folder / "probe.so")],
                           capture_output=True, text=True, errors="replace", timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return f"running it failed ({e})"
    if r.returncode == 0:
        return None
    lines = [line.strip() for line in (r.stderr + r.stdout).splitlines() if line.strip()]
    return lines[0][:300] if lines else f"it exited with status {r.returncode} and printed nothing"


def _why_not_traced(gpu: bool) -> str:
    if os.environ.get(ENV_DISABLE):
        return (
            f"{ENV_DISABLE} is set, which turns mx.compile off: every decode step would retrace. "
            f"Unset {ENV_DISABLE} to run mlx-tracer."
        )
    if not gpu and shutil.which("g++") is None:
        return (
            "no C++ compiler: MLX's CPU backend builds its compiled kernels with `g++`, which is not on PATH, "
            f"so mx.compile is off and every decode step would retrace. To fix it, {INSTALL_HINT}."
        )
    return (
        "mx.compile is off in this process (mx.disable_compile() was called, or MLX found no usable `g++`): "
        "every decode step would retrace. Call mx.enable_compile(), or check that `g++ --version` runs."
    )
