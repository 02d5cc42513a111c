"""The benchmark's models and contexts.

Models: ``smollm2`` (the default GGUF, or ``--model``, through
:func:`mlx_tracer.loading.load_model`), ``llama-h<N>`` and ``qwen3-h<N>``,
random-init 4-layer mlx-lm models of width ``N``. A context of ``C``
positions is random K/V written into mlx-lm prompt caches: decode speed
does not depend on the values, and it spares a long prefill.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx

DEFAULT_MODELS = ("smollm2", "llama-h64", "llama-h256")


RANDOM_FAMILIES = ("llama", "qwen3")  # ``<family>-h<N>``: a random-init 4-layer model of width N


def random_model(family: str, hidden: int, layers: int = 4, vocab: int = 1024, window: Optional[int] = None,
                 seed: int = 0):
    """A random-init mlx-lm ``llama`` or ``qwen3`` (float32; ``hidden / 32``
    query heads and ``hidden / 64`` key/value heads, at least 2 and 1; qwen3
    adds its per-head q/k norms); ``window`` makes every layer sliding."""
    import importlib

    from mlx_lm.models.cache import RotatingKVCache

    if family not in RANDOM_FAMILIES:
        raise ValueError(f"no random {family!r} model: use one of {', '.join(RANDOM_FAMILIES)}")
    heads = _heads(hidden)
    if heads is None:
        raise ValueError(f"width {hidden} makes no whole, even-sized heads: use a multiple of 64")
    module = importlib.import_module(f"mlx_lm.models.{family}")
    common = dict(
        model_type=family, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=4 * hidden,
        num_attention_heads=heads[0], num_key_value_heads=heads[1], rms_norm_eps=1e-5,
        vocab_size=vocab, tie_word_embeddings=False,
    )
    if family == "qwen3":
        common.update(max_position_embeddings=32768, head_dim=hidden // common["num_attention_heads"], rope_theta=10000.0)
    args = module.ModelArgs(**common)

    class Sliding(module.Model):
        def make_cache(self):
            return [RotatingKVCache(max_size=window) for _ in self.layers]

    mx.random.seed(seed)
    model = (Sliding if window else module.Model)(args)
    if family == "qwen3":  # per-head norm weights that are not all ones, as in a trained model
        for layer in model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight = mx.random.uniform(0.5, 1.5, norm.weight.shape)
    mx.eval(model.parameters())
    return model


def random_llama(hidden: int, layers: int = 4, vocab: int = 1024, window: Optional[int] = None, seed: int = 0):
    """A random-init mlx-lm llama (float32); ``window`` makes every layer sliding."""
    return random_model("llama", hidden, layers, vocab, window, seed)


def parse_bench_model(name: str) -> Tuple[str, Optional[int]]:
    """``("smollm2", None)`` or ``(family, width)`` for ``<family>-h<N>``;
    ValueError saying what names exist (checked before any model loads)."""
    if name == "smollm2":
        return name, None
    family, sep, width = name.partition("-h")
    if sep and family in RANDOM_FAMILIES and width.isdigit() and _heads(int(width)) is not None:
        return family, int(width)
    raise ValueError(f"unknown bench model {name!r}: use smollm2 or <family>-h<width> with family "
                     f"{' or '.join(RANDOM_FAMILIES)} and a width of whole even-sized heads, e.g. a multiple of 64 "
                     "(llama-h64, qwen3-h256, ...)")


def _heads(hidden: int) -> Optional[Tuple[int, int]]:
    """(query heads, key/value heads) of a random model of width ``hidden``;
    None where the width makes no whole, even-sized heads."""
    nq, nk = max(hidden // 32, 2), max(hidden // 64, 1)
    if hidden < 4 or hidden % nq or (hidden // nq) % 2 or nq % nk:
        return None
    return nq, nk


def load_bench_model(name: str, path: Optional[str] = None, weights: str = "as-is", log=lambda s: None):
    """``(model, label)`` for a bench model name (``smollm2``, ``llama-h<N>``, ``qwen3-h<N>``)."""
    family, width = parse_bench_model(name)
    if family == "smollm2":
        from ..loading import load_model

        model = load_model(path, weights=weights, log=log)[0]
        name = "SmolLM2-135M" if path is None else Path(path).name  # --model: the file or folder the row ran
        return model, f"{name} {model.mlx_tracer_weights}"
    return random_model(family, width), f"{family} 4x{width} fp32 (random)"


def synthetic_context(model, layouts, context: int, seed: int = 0) -> list:
    """Serial mlx-lm caches holding ``context`` positions of random K/V."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    if context == 0:
        return caches
    rng = mx.random.key(seed)
    for c, l in zip(caches, layouts):
        n = context if l.window is None else min(context, l.window)
        k = mx.random.normal((1, l.kv_heads, n, l.k_dim), key=rng).astype(l.dtype)
        v = mx.random.normal((1, l.kv_heads, n, l.v_dim), key=rng).astype(l.dtype)
        c.update_and_fetch(k, v)
        c.offset = context  # rings: the evicted history counts for RoPE
    mx.eval([c.state for c in caches])
    return caches


def copy_caches(caches):
    """A deep copy of serial mlx-lm caches whose K/V arrays are new arrays."""
    out = copy.deepcopy(caches)
    for c, src in zip(out, caches):
        if src.keys is not None:
            c.keys, c.values = mx.array(src.keys), mx.array(src.values)
    return out
