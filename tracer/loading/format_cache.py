"""The measured weight formats: ``<cache dir>/formats.json``.

One entry per *setup*, i.e. everything a decode-speed measurement depends on:
the model file (resolved path, size, mtime), the MLX version, the library
that serves ``cblas_sgemm`` and the core count. An entry records the chosen
format, the timings it was chosen from, the 1-minute load average while they
were taken (see the re-measure rule in :mod:`.weights`) and when. The file is

    {"version": 2, "entries": [{"model": ..., "size": ..., "mtime": ...,
      "mlx": ..., "blas": ..., "cores": ..., "format": ...,
      "timings": {"as-is": {"1": ms, "4": ms}, ...},
      "load_avg": 0.4, "measured_at": 1767225600.0}, ...]}

The file is checked on every read: an unreadable file, one of another shape
(``[]``, ``null``, an old layout) or an entry that does not validate (no
``format``, a format without timings, a negative time) is dropped, and the
file is rewritten with what remained, so one bad write cannot stop a later
load. :func:`list_choices` is the public, structured view (``mlx-tracer
info`` prints the entries that apply to this process in full, the others as
a count); :func:`find` and :func:`record` serve the ``auto`` policy, and a
write drops the entries that can never apply again (model file gone, BLAS
shim build pruned).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..home import cache_dir, say_not_caching, writable_cache_dir

FILENAME = "formats.json"
VERSION = 2
CHOSEN = ("as-is", "quantized", "quantized-factored", "quantized-split", "float32", "float32-blocks")  # what ``auto`` can resolve to

Timings = Dict[str, Dict[int, float]]  # format -> {batch width: ms per decode step}

_reported = set()  # formats files whose problems were said (once per process)


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
        st = source.stat()
        return cls(str(source.resolve()), st.st_size, int(st.st_mtime), *environment())

    @property
    def environment(self) -> Tuple[str, str, int]:
        return self.mlx, self.blas, self.cores


def environment() -> Tuple[str, str, int]:
    """This process's part of a setup: the MLX version, the file name of the
    library serving ``cblas_sgemm`` and the core count. ``mlx-tracer info``
    shows the entries measured under it (the ones ``auto`` can use here)."""
    import mlx.core as mx

    from ..backend import blas

    return mx.__version__, os.path.basename(blas.status().library or "?"), os.cpu_count() or 1


@dataclass
class FormatChoice:
    """The format chosen for one setup, the timings behind it, and how busy
    the machine was while they were taken."""

    setup: Setup
    format: str
    timings: Timings = field(default_factory=dict)
    load_avg: Optional[float] = None  # 1-minute load average while timing (None: unknown)
    measured_at: Optional[float] = None  # unix time

    @property
    def measured_busy(self) -> bool:
        """Timed while more runnable tasks than cores competed (or unknown)."""
        return self.load_avg is None or self.load_avg > self.setup.cores

    def to_json(self) -> dict:
        timings = {f: {str(b): ms for b, ms in t.items()} for f, t in self.timings.items()}
        return {**asdict(self.setup), "format": self.format, "timings": timings,
                "load_avg": self.load_avg, "measured_at": self.measured_at}

    @classmethod
    def from_json(cls, entry) -> "FormatChoice":
        """Raises ``ValueError`` naming what is wrong with an entry."""
        if not isinstance(entry, dict):
            raise ValueError(f"entry is {type(entry).__name__}, not an object")
        setup = Setup(
            model=_field(entry, "model", str), size=_field(entry, "size", int), mtime=_field(entry, "mtime", int),
            mlx=_field(entry, "mlx", str), blas=_field(entry, "blas", str), cores=_field(entry, "cores", int),
        )
        fmt = _field(entry, "format", str)
        if fmt not in CHOSEN:
            raise ValueError(f"format {fmt!r} is not one of {CHOSEN}")
        timings = {}
        for name, per_batch in _field(entry, "timings", dict).items():
            if name not in CHOSEN or not isinstance(per_batch, dict) or not per_batch:
                raise ValueError(f"timings of {name!r} are {per_batch!r}")
            timings[name] = {_batch(b): _ms(ms) for b, ms in per_batch.items()}
        if "as-is" not in timings or fmt not in timings:
            raise ValueError(f"timings cover {sorted(timings)}, not as-is and {fmt}")
        load_avg = entry.get("load_avg")
        if load_avg is not None and (not _is_number(load_avg) or load_avg < 0):
            raise ValueError(f"load_avg is {load_avg!r}")
        measured_at = entry.get("measured_at")
        if measured_at is not None and not _is_number(measured_at):
            raise ValueError(f"measured_at is {measured_at!r}")
        return cls(setup, fmt, timings, load_avg, measured_at)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _field(entry: dict, key: str, kind: type):
    if key not in entry:
        raise ValueError(f"no {key!r}")
    value = entry[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{key!r} is {value!r}, expected {kind.__name__}")
    return value


def _batch(b) -> int:
    if not (isinstance(b, str) and b.isdigit() and int(b) > 0):
        raise ValueError(f"batch width {b!r}")
    return int(b)


def _ms(ms) -> float:
    if not _is_number(ms) or ms <= 0:
        raise ValueError(f"time {ms!r} ms")
    return float(ms)


def store_path() -> Path:
    return cache_dir() / FILENAME


def _read() -> Tuple[List[FormatChoice], List[str]]:
    """The valid entries, and what was wrong with the file (empty: nothing)."""
    path = store_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return [], []
    except (OSError, ValueError) as e:
        return [], [f"unreadable ({e})"]
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), list):
        return [], [f"not a version-{VERSION} formats file ({type(data).__name__})"]
    choices, problems = [], []
    for i, entry in enumerate(data["entries"]):
        try:
            choices.append(FormatChoice.from_json(entry))
        except ValueError as e:
            problems.append(f"entry {i}: {e}")
    return choices, problems


def list_choices() -> List[FormatChoice]:
    """Every valid entry of the store (none when it is missing). A file with
    invalid content is rewritten with the valid entries only (said once)."""
    choices, problems = _read()
    if problems:
        healed = _write(choices)
        path = str(store_path())
        if path not in _reported:
            _reported.add(path)
            outcome = "rebuilt it with the valid entries" if healed else "ignoring what does not validate"
            print(f"[mlx-tracer] {path}: {'; '.join(problems)[:300]}: {outcome}", file=sys.stderr, flush=True)
    return choices


def find(setup: Setup) -> Optional[FormatChoice]:
    """The recorded choice for ``setup``, if any."""
    return next((c for c in list_choices() if c.setup == setup), None)


def record(choice: FormatChoice) -> bool:
    """Store ``choice`` (replacing its setup's entry), dropping the entries
    that can never apply again (:func:`is_orphan`). Returns False, having
    said so once on stderr, when the cache folder cannot be written."""
    FormatChoice.from_json(choice.to_json())  # never write what a read would drop
    kept = [c for c in list_choices() if c.setup != choice.setup and not is_orphan(c)]
    return _write(kept + [choice])


def is_orphan(choice: FormatChoice) -> bool:
    """The entry's model file is gone, or it names a BLAS shim build that the
    cache folder no longer has (old builds are pruned: :mod:`mlx_tracer.home`)."""
    shim = choice.setup.blas
    if shim.startswith("blas-shim-") and not (cache_dir() / shim).exists():
        return True
    return not os.path.exists(choice.setup.model)



def _write(choices: List[FormatChoice]) -> bool:
    folder = writable_cache_dir()
    if folder is None:
        return False
    text = json.dumps({"version": VERSION, "entries": [c.to_json() for c in choices]}, indent=1)
    tmp = folder / f".{FILENAME}.{os.getpid()}.tmp"
    try:
        tmp.write_text(text)
        os.replace(tmp, folder / FILENAME)  # atomic: a reader sees the old file or the new one
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        say_not_caching(folder, e)
        return False
    return True
