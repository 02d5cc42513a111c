"""The measured weight formats: ``<cache dir>/formats.json``.

One entry per *setup*, i.e. everything a decode-speed measurement depends on:
the model file (resolved path, size, mtime), the MLX version, the library
that serves ``cblas_sgemm`` and the core count. An entry records the chosen
format and the timings it was chosen from. The file is

    {"version": 2, "entries": [{"model": ..., "size": ..., "mtime": ...,
      "mlx": ..., "blas": ..., "cores": ..., "format": ...,
      "timings": {"as-is": {"1": ms, "4": ms}, ...}}, ...]}

:func:`list_choices` is the public, structured view (``mlx-tracer info``
prints it); :func:`find` and :func:`record` are what the ``auto`` policy of
:mod:`.weights` uses.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ..home import cache_dir, writable_cache_dir

FILENAME = "formats.json"
VERSION = 2

Timings = Dict[str, Dict[int, float]]  # format -> {batch width: ms per decode step}


@dataclass(frozen=True)
class Setup:
    """What a measured format depends on; equal setups share one entry."""

    model: str  # resolved path of the model file or folder
    size: int
    mtime: int
    mlx: str  # mlx version
    blas: str  # file name of the library serving cblas_sgemm
    cores: int

    @classmethod
    def of(cls, source: Path) -> "Setup":
        import mlx.core as mx

        from ..backend import blas

        st = source.stat()
        lib = blas.status().library or "?"
        return cls(str(source.resolve()), st.st_size, int(st.st_mtime), mx.__version__, os.path.basename(lib), os.cpu_count() or 1)


@dataclass
class FormatChoice:
    """The format chosen for one setup, and the timings behind it."""

    setup: Setup
    format: str
    timings: Timings = field(default_factory=dict)

    def to_json(self) -> dict:
        timings = {f: {str(b): ms for b, ms in t.items()} for f, t in self.timings.items()}
        return {**asdict(self.setup), "format": self.format, "timings": timings}

    @classmethod
    def from_json(cls, entry) -> "FormatChoice":
        """Raises ``ValueError`` (or ``TypeError``/``KeyError``) on an entry of the wrong shape."""
        if not isinstance(entry, dict):
            raise ValueError(f"entry is {type(entry).__name__}, not an object")
        setup = Setup(
            model=_typed(entry, "model", str), size=_typed(entry, "size", int), mtime=_typed(entry, "mtime", int),
            mlx=_typed(entry, "mlx", str), blas=_typed(entry, "blas", str), cores=_typed(entry, "cores", int),
        )
        timings = {
            str(f): {int(b): float(ms) for b, ms in t.items()} for f, t in _typed(entry, "timings", dict).items()
        }
        return cls(setup, _typed(entry, "format", str), timings)


def _typed(entry: dict, key: str, kind: type):
    value = entry[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{key!r} is {value!r}, expected {kind.__name__}")
    return value


def store_path() -> Path:
    return cache_dir() / FILENAME


def list_choices() -> List[FormatChoice]:
    """Every well-formed entry of the store (none when it is missing or unreadable)."""
    try:
        data = json.loads(store_path().read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), list):
        return []
    out = []
    for entry in data["entries"]:
        try:
            out.append(FormatChoice.from_json(entry))
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return out


def find(setup: Setup) -> Optional[FormatChoice]:
    """The recorded choice for ``setup``, if any."""
    return next((c for c in list_choices() if c.setup == setup), None)


def record(choice: FormatChoice) -> bool:
    """Store ``choice`` (replacing its setup's entry), atomically. Returns
    False, having said so once on stderr, when the cache folder is read-only."""
    folder = writable_cache_dir()
    if folder is None:
        return False
    kept = [c for c in list_choices() if c.setup != choice.setup] + [choice]
    text = json.dumps({"version": VERSION, "entries": [c.to_json() for c in kept]}, indent=1)
    tmp = folder / f".{FILENAME}.{os.getpid()}.tmp"
    tmp.write_text(text)
    os.replace(tmp, folder / FILENAME)
    return True
