"""Tiny random-init mlx-lm models of several families, built offline in
milliseconds. The output head is scaled up so that greedy choices are far
from ties (a random-init head gives near-uniform logits); heads are untied
where the family allows, since a scaled tied embedding just echoes the
input token."""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

VOCAB = 101
SLIDE = 8  # sliding window of the tiny sliding-attention models


def _config(family: str) -> dict:
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    if family == "llama":
        return dict(base, model_type="llama", num_hidden_layers=3, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if family == "llama_mixed":  # layer_types mixing sliding and full attention
        return dict(
            base, model_type="llama", num_hidden_layers=4, rms_norm_eps=1e-5, sliding_window=SLIDE, tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        )
    if family == "qwen3":
        return dict(
            base, model_type="qwen3", num_hidden_layers=3, rms_norm_eps=1e-6, max_position_embeddings=512,
            head_dim=16, tie_word_embeddings=False, rope_theta=10000.0,
        )
    if family == "gemma3_text":  # sliding layers with a full layer every 2nd
        return dict(
            base, model_type="gemma3_text", num_hidden_layers=4, head_dim=16, num_key_value_heads=1,
            sliding_window=SLIDE, sliding_window_pattern=2, query_pre_attn_scalar=16,
        )
    if family == "olmo3":
        return dict(
            base, model_type="olmo3", num_hidden_layers=4, rms_norm_eps=1e-6, max_position_embeddings=512,
            sliding_window=SLIDE, rope_theta=10000.0,
        )
    if family == "ring_only":  # every layer sliding (see RingOnlyLlama)
        return dict(base, model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, tie_word_embeddings=False)
    raise KeyError(family)


FAMILIES = ["llama", "qwen3", "gemma3_text", "llama_mixed", "olmo3"]


def _ring_only_class():
    from mlx_lm.models import llama
    from mlx_lm.models.cache import RotatingKVCache

    class RingOnlyLlama(llama.Model):
        """A llama whose every layer keeps a sliding window of SLIDE tokens (a
        Mistral-style model): no full-attention layer at all."""

        def make_cache(self):
            return [RotatingKVCache(max_size=SLIDE) for _ in self.layers]

    return RingOnlyLlama


def tiny_model(family: str, seed: int = 0, head_scale: float = 6.0, **config):
    """A tiny random ``family`` model; ``config`` overrides its settings (e.g. ``head_dim=64``)."""
    cfg = dict(_config(family), **config)
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    args = module.ModelArgs.from_dict(cfg)
    mx.random.seed(seed)
    model = (_ring_only_class() if family == "ring_only" else module.Model)(args)

    head = "lm_head.weight" if "lm_head" in model else "embed_tokens.weight"

    def scale(path, w):
        return w * head_scale if path.endswith(head) else w

    model.update(tree_map_with_path(scale, model.parameters()))
    mx.eval(model.parameters())
    return model
