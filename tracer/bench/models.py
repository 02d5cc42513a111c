"""The benchmark's models and contexts.

Models: ``smollm2`` (the default GGUF, or ``--model``, through
:func:`mlx_tracer.loading.load_model`) and ``llama-h<N>``, a random-init
4-layer mlx-lm llama of width ``N``. A context of ``C`` positions is random
K/V written into mlx-lm prompt caches: decode speed does not depend on the
values, and it spares a long prefill.
"""

from __future__ import annotations

import copy
from typing import Optional

import mlx.core as mx

DEFAULT_MODELS = ("smollm2", "llama-h64", "llama-h256")


def random_llama(hidden: int, layers: int = 4, vocab: int = 1024, window: Optional[int] = None, seed: int = 0):
    """A random-init mlx-lm llama (float32); ``window`` makes every layer sliding."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import RotatingKVCache

    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=4 * hidden,
        num_attention_heads=max(hidden // 32, 2), num_key_value_heads=max(hidden // 64, 1), rms_norm_eps=1e-5,
        vocab_size=vocab, tie_word_embeddings=False,
    )

    class Sliding(llama.Model):
        def make_cache(self):
            return [RotatingKVCache(max_size=window) for _ in self.layers]

    mx.random.seed(seed)
    model = (Sliding if window else llama.Model)(args)
    mx.eval(model.parameters())
    return model


def load_bench_model(name: str, path: Optional[str] = None, weights: str = "as-is", log=lambda s: None):
    """``(model, label)`` for a bench model name (``smollm2``, ``llama-h<N>``)."""
    if name == "smollm2":
        from ..loading import load_model

        model = load_model(path, weights=weights, log=log)[0]
        return model, f"SmolLM2-135M {model.mlx_tracer_weights}"
    if name.startswith("llama-h"):
        h = int(name[len("llama-h") :])
        return random_llama(h), f"llama 4x{h} fp32 (random)"
    raise ValueError(f"unknown bench model {name!r}: use smollm2, llama-h64, llama-h256, ...")


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
