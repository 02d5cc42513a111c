"""Read a llama-architecture GGUF file and build mlx-lm's llama ``Model`` from it.

``mx.load`` reads GGUF natively: Q4_0/Q4_1/Q8_0 tensors come back as MLX
affine-quantized triples (``weight`` packed in uint32, ``scales``, ``biases``;
group size 32), other tensors as plain arrays: other quantized types cast to
float16. Q4_K tensors (most of a Q4_K_M file) are then replaced by exact
affine 4-bit triples too (group 32, float32 scales and biases:
:func:`.gguf_readonly.q4_k_affine`), read from the file's own bytes; Q6_K,
Q5_K and the rest stay MLX's float16 (their 6-/5-bit values, sub-blocks of
16 with int8 scales for Q6_K, have no exact 4-/8-bit affine form). MLX's
reader opens the file for writing, so a file that cannot be written is read
by :mod:`.gguf_readonly` instead, which builds the same arrays. This module

* maps llama.cpp tensor names onto mlx-lm's llama module tree, quantizing each
  layer with the bits / group size read off its triple, so the model runs on
  MLX's quantized matmul with the file's weights as they are;
* undoes llama.cpp's row permutation of ``attn_q`` / ``attn_k`` (made for its
  interleaved RoPE), so mlx-lm's default half-split RoPE is correct.

The tokenizer comes from the same metadata (:mod:`.tokenizer`);
:func:`mlx_tracer.loading.load.load_gguf` puts the two together, and
:mod:`.quant` turns quantized layers back into float ones.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .gguf_readonly import load as readonly_load
from .gguf_readonly import opens_for_writing, scan, with_q4_k

__all__ = [
    "read_gguf", "meta_value", "build_model", "convert_weights", "mlx_name",
    "model_args_from_metadata", "quantize_like", "unpermute_rope_rows",
]

GGUF_MAGIC = b"GGUF"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


# ----------------------------------------------------------------- reading --

def read_gguf(path: Union[str, Path]) -> Tuple[Dict[str, mx.array], dict]:
    """``(weights, metadata)`` of a GGUF file, with clear errors for bad files."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"GGUF file {p} does not exist. Fetch the default model with "
            f"`mlx-tracer fetch` (or `./dev setup`), or pass an existing .gguf file."
        )
    if not p.is_file():
        raise ValueError(f"{p} is not a file; expected a .gguf model file.")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{p} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}). "
            f"Pass a .gguf model file, or an mlx-lm model folder to mlx-lm's loader."
        )
    try:
        if opens_for_writing(p):
            weights, meta = mx.load(str(p), return_metadata=True)
            return with_q4_k(weights, p), meta  # Q4_K as 4-bit blocks, not MLX's float16
        return readonly_load(p)  # MLX's reader would open it for writing (gguf_readonly)
    except Exception as e:  # MLX raises RuntimeError/ValueError on bad data
        cause = _damage(p) or str(e)
        raise ValueError(
            f"{p} could not be read as GGUF ({cause}); it is probably truncated or "
            f"corrupt (or uses a tensor type MLX cannot load). For the default "
            f"model, delete it and fetch it again (`mlx-tracer fetch`)."
        ) from e


# tensor types MLX 0.32's GGUF reader cannot convert ("gguf_tensor_to_f16 failed")
_MLX_CANNOT = {6: "Q5_0", 7: "Q5_1", 11: "Q3_K", 13: "Q5_K"}


def _damage(p: Path):
    """What is wrong with a file MLX could not read, when the layout shows it (else None)."""
    import numpy as np

    try:
        _, tensors = scan(np.memmap(p, dtype=np.uint8, mode="r"))
    except Exception as e:
        return str(e)
    cannot = sorted({_MLX_CANNOT[t] for _, _, t, _, _ in tensors if t in _MLX_CANNOT})
    if cannot:
        return (f"it holds {', '.join(cannot)} tensors, which MLX's GGUF reader cannot load; a file "
                f"quantized to Q4_0, Q4_1, Q8_0, Q4_K (with Q6_K), Q2_K or float loads")
    return None


def meta_value(meta: dict, key: str, default=None):
    """A scalar metadata value as a Python number/str/bool."""
    v = meta.get(key, default)
    if isinstance(v, mx.array):
        v = v.item()
    return v


# ------------------------------------------------------------- model args --

def model_args_from_metadata(meta: dict, weights: Dict[str, mx.array], path="GGUF"):
    """mlx-lm llama ``ModelArgs`` from ``llama.*`` metadata."""
    from mlx_lm.models.llama import ModelArgs

    arch = meta_value(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{path}: architecture {arch!r} is not supported; only 'llama' GGUF "
            f"files (e.g. SmolLM2) can be loaded."
        )
    if "rope_freqs.weight" in weights:
        raise ValueError(f"{path}: llama3-style rope_freqs scaling is not supported.")

    def need(key):
        v = meta_value(meta, f"llama.{key}")
        if v is None:
            raise ValueError(f"{path}: metadata llama.{key} is missing; the file is incomplete.")
        return v

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv = int(meta_value(meta, "llama.attention.head_count_kv", n_heads))
    head_dim = int(meta_value(meta, "llama.attention.key_length", hidden // n_heads))
    rope_dim = int(meta_value(meta, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial RoPE ({rope_dim} of {head_dim} dims) is not supported.")
    scaling = None
    s_type = meta_value(meta, "llama.rope.scaling.type", "none")
    if s_type == "linear":
        scaling = {"type": "linear", "factor": float(meta_value(meta, "llama.rope.scaling.factor"))}
    elif s_type not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling {s_type!r} is not supported.")
    vocab = meta_value(meta, "llama.vocab_size")
    if vocab is None:
        vocab = weights["token_embd.weight"].shape[0]
    return ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(need("block_count")),
        intermediate_size=int(need("feed_forward_length")),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(meta_value(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=int(vocab),
        max_position_embeddings=meta_value(meta, "llama.context_length"),
        rope_theta=float(meta_value(meta, "llama.rope.freq_base", 10000.0)),
        rope_traditional=False,
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in weights,
        attention_bias=any(k.endswith(".attn_q.bias") for k in weights),
        mlp_bias=any(k.endswith(".ffn_up.bias") for k in weights),
    )


# ----------------------------------------------------------------- weights --

def unpermute_rope_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation along axis 0.

    llama.cpp's converter reorders each head's rows from HF's half-split
    layout ``[h, half, i]`` to the interleaved ``[h, i, half]``. So within a
    head of ``d`` rows, HF row ``j`` is GGUF row ``2 * (j % (d/2)) + j // (d/2)``.
    Works on any array whose axis 0 is the output dim (packed weights,
    scales, biases alike).
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def mlx_name(key: str) -> str:
    m = _BLOCK_RE.match(key)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = _TOP_RE.match(key)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise KeyError(key)


def convert_weights(weights: Dict[str, mx.array], args, path="GGUF") -> Dict[str, mx.array]:
    """GGUF tensors renamed to mlx-lm llama names, q/k rows un-permuted."""
    out, unknown = {}, []
    for key, value in weights.items():
        try:
            name = mlx_name(key)
        except KeyError:
            unknown.append(key)
            continue
        if ".attn_q." in key:
            value = unpermute_rope_rows(value, args.num_attention_heads)
        elif ".attn_k." in key:
            value = unpermute_rope_rows(value, args.num_key_value_heads)
        out[name] = value
    if unknown:
        raise ValueError(f"{path}: unexpected tensors for a llama model: {sorted(unknown)[:8]}")
    return out


def quantize_like(model: nn.Module, weights: Dict[str, mx.array]) -> None:
    """Swap each layer that has ``scales`` in ``weights`` for a quantized one
    whose bits / group size match the packed triple."""

    def predicate(path, module):
        scales = weights.get(f"{path}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            return False
        in_dim = module.weight.shape[1]
        packed = weights[f"{path}.weight"]
        bits = packed.shape[1] * 32 // in_dim
        group = in_dim // scales.shape[1]
        if bits * in_dim != packed.shape[1] * 32 or group * scales.shape[1] != in_dim:
            raise ValueError(f"{path}: packed shape {packed.shape} does not fit {in_dim} inputs")
        return {"group_size": group, "bits": bits, "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)


def build_model(weights: Dict[str, mx.array], meta: dict, path="GGUF"):
    """mlx-lm llama ``Model`` holding the GGUF weights (quantized as stored)."""
    from mlx_lm.models.llama import Model

    args = model_args_from_metadata(meta, weights, path)
    converted = convert_weights(weights, args, path)
    model = Model(args)
    quantize_like(model, converted)
    try:
        model.load_weights(list(converted.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{path}: weights do not fit the llama model built from its metadata: {e}") from e
    model.eval()
    mx.eval(model.parameters())
    return model
