"""Weight formats chosen for the backend, at load time.

Formats: ``as-is`` (as loaded: a GGUF's 4/8-bit blocks stay quantized),
``float32`` (every quantized layer dequantized, scales and biases cast to
fp32 first), ``float32-blocks`` (transformer blocks dequantized, the
quantized embedding/head kept). ``auto``:

* on a GPU backend: ``as-is``;
* on the CPU: ``as-is`` and ``float32`` (or ``float32-blocks`` when fp32
  weights would take more than half of the available RAM) are each timed on
  one decode step at batch 1 and 4, and the faster (geometric mean of ms per
  token) wins if it beats ``as-is`` by more than 10% (it costs up to 4x the
  memory). The decision is
  cached per model file, MLX version, BLAS and core count in
  ``<cache dir>/formats.json``, so it is measured once, not guessed. With
  MLX's reference BLAS ``as-is`` wins (its fp32 GEMM is slow); with the fast
  BLAS ``float32`` does (MLX's CPU 4-bit matmul does not reuse weights across
  rows).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

FORMATS = ("auto", "as-is", "float32", "float32-blocks")


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown weights format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return fmt


def is_quantized(model) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def apply_format(model, fmt: str):
    """Convert ``model`` in place to ``fmt`` (not ``auto``); returns it."""
    from .gguf import dequantize_model

    check_format(fmt)
    if fmt == "float32":
        dequantize_model(model, mx.float32)
    elif fmt == "float32-blocks":
        dequantize_model(model, mx.float32, select=lambda path: ".layers." in f".{path}")
    return model


def float32_bytes(model) -> int:
    n = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            n += m.scales.size * m.group_size * 4
    return n + sum(v.nbytes for k, v in tree_flatten(model.parameters()) if not k.endswith(("scales", "biases")))


def available_memory() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def decode_step_ms(model, B: int, context: int = 16, reps: int = 2) -> float:
    """Median ms of one eager decode step at batch ``B`` over ``context`` tokens."""
    import copy

    from mlx_lm.generate import _merge_caches
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, context), dtype=mx.int32), cache=cache))
    batch = _merge_caches([copy.deepcopy(cache) for _ in range(B)]) if B > 1 else cache
    y = mx.zeros((B, 1), dtype=mx.int32)
    mx.eval(model(y, cache=batch))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(model(y, cache=batch))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _key(source: Path) -> str:
    from . import blas

    st = source.stat()
    lib = blas.status().library or "?"
    return f"{source.resolve()}|{st.st_size}|{int(st.st_mtime)}|mlx {mx.__version__}|{os.path.basename(lib)}|{os.cpu_count()}"


def choose_format(model, source: Optional[Path], reload, log=lambda s: None) -> tuple:
    """Resolve ``auto``: ``(model in the chosen format, format, timings)``.

    ``reload()`` gives a fresh as-loaded model (the float conversions are in place).
    """
    if mx.default_device() == mx.gpu or not is_quantized(model):
        return model, "as-is", {}
    from .model_store import cache_dir

    store = cache_dir() / "formats.json"
    key = _key(source) if source is not None else None
    known: Dict[str, dict] = {}
    if key is not None and store.exists():
        try:
            known = json.loads(store.read_text())
        except (OSError, ValueError):
            known = {}
    if key in known:
        fmt = known[key]["format"]
        return (apply_format(model, fmt) if fmt != "as-is" else model), fmt, known[key]["ms"]
    avail = available_memory()
    fits = avail is None or float32_bytes(model) < avail // 2
    # fp32 everywhere when it fits; else blocks only (the head stays quantized)
    candidates = ["as-is", "float32" if fits else "float32-blocks"]
    timings = {}
    for fmt in candidates:
        m = model if fmt == "as-is" else apply_format(reload(), fmt)
        log(f"timing weights format {fmt} ...")
        timings[fmt] = {B: decode_step_ms(m, B) for B in (1, 4)}
        del m
    score = {f: statistics.geometric_mean([v[1] / 1, v[4] / 4]) for f, v in timings.items()}  # ms per token
    fmt = min(score, key=score.get)
    if score[fmt] > score["as-is"] / 1.1:  # 4x the memory is worth it only when clearly faster
        fmt = "as-is"
    if key is not None:
        known[key] = {"format": fmt, "ms": timings}
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, store)
    return (model if fmt == "as-is" else apply_format(reload(), fmt)), fmt, timings
