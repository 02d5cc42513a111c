"""The peer a CPU user would pick instead: llama.cpp, on the same GGUF file.

An optional column of ``mlx-tracer bench``. llama.cpp runs in a worker
process (:mod:`.peer_worker`, the :mod:`.protocol` every bench worker
speaks) under a Python that has ``llama_cpp`` (llama-cpp-python): this
Python when the ``peer`` extra is installed here (``pip install
--no-binary llama-cpp-python -e ".[peer]"``: built from source, for this
CPU's instruction set), or the one ``--peer-python PATH`` names (a venv
built apart). Its runs take turns with the bench's other systems, run by
run; it decodes with as many threads as the tracer's decode uses.

Where no such Python is found, or a row's model is no GGUF file, the column
is skipped with a note (the table's and the JSON's).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from ..backend.malloc import without_preload
from .protocol import Worker, WorkerError

EXTRA_HINT = ('pip install --no-binary llama-cpp-python -e ".[peer]" (builds llama.cpp for this CPU, about 10 '
              "minutes), or --peer-python PATH to a Python that has llama_cpp")


def peer_threads() -> int:
    """The tracer's decode threads: the pinned count, else every core (the BLAS shim's and kernels' policy)."""
    from ..backend import threads

    return threads.pinned() or os.cpu_count() or 1


class PeerWorker(Worker):
    """llama.cpp in a worker process run by ``python`` (see the module docstring)."""

    def __init__(self, python: str):
        # as its users run it: under the system's malloc, not the one the mlx-tracer command preloads
        super().__init__([python, str(Path(__file__).with_name("peer_worker.py"))], name="llama.cpp",
                         env=without_preload(os.environ))
        self.info = self.ask(op="hello")

    def load(self, path: str, threads: int) -> dict:
        return self.ask(op="load", path=str(path), threads=threads)

    def decode(self, bucket: int, context: int, tokens: int, first: List[int]) -> dict:
        """One run: ``{"tps", "peak_mb", "peak_kind"}`` (see :mod:`.peer_worker`)."""
        return self.ask(op="decode", bucket=bucket, context=context, tokens=tokens, first=list(first))

    def window(self, bucket: int, context: int, lengths: List[int], reps: int = 7) -> dict:
        """ms of one decode call of L tokens a sequence for L = 1 and each of
        ``lengths``: ``{L: ms}`` (see :mod:`.peer_worker`'s ``window``)."""
        res = self.ask(op="window", bucket=bucket, context=context, lengths=list(lengths), reps=reps)
        return {int(n): ms for n, ms in res["ms"].items()}


def start_peer(python: Optional[str]) -> Tuple[Optional[PeerWorker], str]:
    """``(worker, note)``: a started llama.cpp worker and a line saying what runs,
    or ``(None, why it is skipped)``. ``python``: ``--peer-python`` (None: this
    Python, if it has ``llama_cpp``)."""
    if python is None:
        if importlib.util.find_spec("llama_cpp") is None:
            return None, f"llama.cpp: skipped (llama_cpp is not importable by {sys.executable}; {EXTRA_HINT})"
        python = sys.executable
    try:
        worker = PeerWorker(python)
    except OSError as e:
        return None, f"llama.cpp: skipped (cannot run {python}: {e})"
    except WorkerError as e:
        return None, f"llama.cpp: skipped ({_reason(e)}; {EXTRA_HINT})"
    info = worker.info
    isa = [f for f in ("AVX512", "AVX512_VNNI", "AVX_VNNI", "AVX2", "FMA") if f"{f} = 1" in info.get("system_info", "")]
    return worker, (f"llama.cpp: llama-cpp-python {info.get('version')} under {python}, {peer_threads()} threads"
                    f"{' (' + ', '.join(isa) + ')' if isa else ''}")


def _reason(e: WorkerError) -> str:
    return str(e).strip().removeprefix("llama.cpp failed: ").removeprefix("RuntimeError: ")


def gguf_file(name: str, path: Optional[str]) -> Optional[str]:
    """The GGUF file a bench model was loaded from (None: a random model or an mlx-lm folder)."""
    if name != "smollm2":
        return None
    from ..loading import store

    try:
        p = store.resolve_model(path)
    except FileNotFoundError:
        return None
    return str(p) if p.is_file() and p.suffix.lower() == ".gguf" else None
