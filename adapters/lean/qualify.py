"""Which models the lean forward serves, and which linears share one matmul.

The lean forward re-writes the layer arithmetic of mlx-lm's llama-style
families (``llama``, ``mistral`` — llama's module —, ``qwen2``, ``qwen3``), so
it takes a model only when every module it replaces is the family's own:
another block, attention, projection or norm type would compute something
else. :func:`why_not` says which part disqualifies a model.

Projections are computed as their own type computes them: mlx's ``Linear``
and ``QuantizedLinear``, and the tensor-parallel linears mlx-lm's
``shard()`` puts in their place (``AllToShardedLinear`` computes what
``Linear`` does on its rows; ``ShardedToAllLinear`` multiplies, all-sums
over its group, then adds the bias; likewise their quantized twins). A group
the lean forward would fuse (q/k/v, gate/up) whose members differ in format
(a GGUF Q4_K_M file's Q4_K and Q6_K tensors) is computed as runs of
consecutive members that can share one matmul (:func:`runs`).
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn

KINDS = frozenset({"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"})  # mistral is llama's
ARRAYS = ("weight", "scales", "biases", "bias")  # what a linear holds, in the order groups concatenate them
DENSE = (nn.Linear, nn.AllToShardedLinear)  # x @ weight.T (+ bias, by addmm)
QUANT = (nn.QuantizedLinear, nn.QuantizedAllToShardedLinear)  # mx.quantized_matmul (+ bias)
SUMMED = (nn.ShardedToAllLinear, nn.QuantizedShardedToAllLinear)  # the matmul, all_sum over the group, + bias
LINEARS = DENSE + QUANT + SUMMED  # the projections the lean forward computes
PROJECTIONS = tuple(("self_attn", k) for k in ("q_proj", "k_proj", "v_proj", "o_proj")) + tuple(
    ("mlp", k) for k in ("gate_proj", "up_proj", "down_proj"))


def _kind_ok(obj, name: str) -> bool:
    return type(obj).__module__ in KINDS and type(obj).__name__ == name


def fusable(mods) -> bool:
    """Linears that can share one matmul: same type, same arrays of the same
    dtypes, same quantization; an all-summed (sharded-to-all) linear only alone
    (a ring all-sum of a concatenation may sum in another order)."""
    t = type(mods[0])
    if t not in LINEARS or any(type(m) is not t for m in mods) or (t in SUMMED and len(mods) > 1):
        return False
    if len({tuple((k, m[k].dtype) for k in ARRAYS if k in m) for m in mods}) != 1:
        return False
    return t in DENSE or t in SUMMED or len({(m.group_size, m.bits, m.mode) for m in mods}) == 1


def runs(mods) -> List[list]:
    """``mods`` (one group, in order) as maximal runs of consecutive linears
    that can share one matmul: one run where the group fuses whole."""
    out = [[mods[0]]]
    for m in mods[1:]:
        if fusable(out[-1] + [m]):
            out[-1].append(m)
        else:
            out.append([m])
    return out


def table_rope(rope) -> Optional[tuple]:
    """``(dims, base, scale)`` of an ``nn.RoPE`` the lean forward's tables can
    serve (non-traditional), else None."""
    if type(rope) is nn.RoPE and not rope.traditional:
        return (rope.dims, float(rope.base), float(rope.scale))
    return None


def why_not(model) -> Optional[str]:
    """``None`` when ``model`` qualifies for the lean forward, else why not."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return "not on the CPU backend (a GPU runs mx.fast's RoPE, norm and attention as single kernels)"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        return "not a llama-style model (model.model.embed_tokens/layers/norm)"
    if type(model).__module__ not in KINDS:
        return f"family {type(model).__module__} has no lean forward"
    if getattr(inner, "pipeline_size", 1) != 1:
        return "pipeline-parallel model"
    if not isinstance(inner.embed_tokens, (nn.Embedding, nn.QuantizedEmbedding)):
        return "embedding type"
    args = getattr(model, "args", None)
    tied = getattr(args, "tie_word_embeddings", None)
    if tied is None or (not tied and not isinstance(getattr(model, "lm_head", None), LINEARS)):
        return "output head"
    for i, layer in enumerate(inner.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not (_kind_ok(layer, "TransformerBlock") and _kind_ok(attn, "Attention") and _kind_ok(mlp, "MLP")):
            return f"layer {i}: block, attention or MLP is not the family's own"
        for parent, name in PROJECTIONS:
            m = getattr(attn if parent == "self_attn" else mlp, name, None)
            if type(m) not in LINEARS:
                return (f"layer {i}: {name} is a {type(m).__name__} (the lean forward computes mlx's Linear, "
                        "QuantizedLinear and their sharded forms)")
        if table_rope(attn.rope) is None:
            return f"layer {i}: {type(attn.rope).__name__} (the lean forward rotates with nn.RoPE's non-traditional tables)"
        if attn.n_heads % attn.n_kv_heads:
            return f"layer {i}: query heads not a multiple of key heads"
        if type(layer.input_layernorm) is not nn.RMSNorm or type(layer.post_attention_layernorm) is not nn.RMSNorm:
            return f"layer {i}: norms"
    return None
