"""Read a llama-architecture GGUF file and build mlx-lm's llama ``Model`` from it.

``mx.load`` reads GGUF natively: Q4_0/Q4_1/Q8_0 tensors come back as MLX
affine-quantized triples (``weight`` packed in uint32, ``scales``, ``biases``;
group size 32), other tensors as plain arrays: other quantized types cast to
float16. The k-quants of a Q4_K_M file are then replaced by affine triples
read from the file's own bytes (group 32, float32 scales and biases): Q4_K
by exact 4-bit ones (:func:`.gguf_readonly.q4_k_affine`), Q5_0/Q5_1/Q5_K
(which MLX cannot read) by exact 8-bit ones, Q6_K by 8-bit ones
(:func:`.gguf_readonly.q6_k_affine`: its sub-blocks of 16 with int8 scales
have no exact form in MLX's groups of 32; half of each group exact, the
other rounded to a quarter step; ``MLX_TRACER_Q6_K=float16`` keeps MLX's
float16 cast); Q2_K stays MLX's float16. Gate and up, which the lean
forward fuses, are widened to 8 bits where they then differ only in bits
(:func:`unify_fused_groups`), values unchanged; q/k/v keep their formats
(q/k Q4_K beside a Q6_K v: the layer kernels take q/k/v in two). MLX's
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
import numpy as np

from .gguf_readonly import load as readonly_load
from .gguf_readonly import UnsupportedTypes, builds_k_quants, opens_for_writing, q6_k_format, scan, with_k_quants
from .gguf_readonly import read as read_own

__all__ = [
    "read_gguf", "meta_value", "build_model", "convert_weights", "mlx_name",
    "model_args_from_metadata", "quantize_like", "unify_fused_groups", "unpermute_rope_rows",
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
    q6_k_format()  # a bad $MLX_TRACER_Q6_K says so before anything is read
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{p} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}). "
            f"Pass a .gguf model file, or an mlx-lm model folder to mlx-lm's loader."
        )
    try:
        if not opens_for_writing(p):
            return readonly_load(p)  # MLX's reader would open it for writing (gguf_readonly)
        if builds_k_quants(p):
            # built from the file's bytes: MLX's reader would first cast each k-quant tensor to float16
            # (Llama-3.2-1B's Q4_K_M: 10 of 20 s, and a float16 copy of the model in memory) to be replaced
            try:
                return read_own(p)
            except UnsupportedTypes:  # types only MLX converts (Q2_K): its reader, then the triples
                pass
        weights, meta = mx.load(str(p), return_metadata=True)
        return with_k_quants(weights, p), meta  # Q4_K, Q6_K as 4-/8-bit blocks, not MLX's float16
    except Exception as e:  # MLX raises RuntimeError/ValueError on bad data
        cause = _damage(p) or str(e)
        raise ValueError(
            f"{p} could not be read as GGUF ({cause}); it is probably truncated or "
            f"corrupt (or uses a tensor type MLX cannot load). For the default "
            f"model, delete it and fetch it again (`mlx-tracer fetch`)."
        ) from e


# tensor types MLX 0.32's GGUF reader cannot convert ("gguf_tensor_to_f16 failed") and this package does not build
_MLX_CANNOT = {11: "Q3_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
               22: "IQ2_S", 23: "IQ4_XS", 29: "IQ1_M"}  # (Q5_0, Q5_1, Q5_K: built by gguf_readonly)


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
                f"quantized to Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K (Q4_K_M, Q5_K_M, ...), Q2_K or float "
                f"loads")
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


# the groups unify_fused_groups widens to one format: gate/up (q/k/v not: the layer kernels take two formats there)
QKV_GROUP = ("self_attn", ("q_proj", "k_proj", "v_proj"))
_FUSED_GROUPS = (("mlp", ("gate_proj", "up_proj")),)


def _nibbles_to_bytes(packed: mx.array) -> mx.array:
    """A 4-bit packed matrix (MLX's order: weight ``2k`` in the low nibble of
    byte ``k`` of its row, ``2k + 1`` in the high one) as the 8-bit packed
    matrix of the same integers (weight ``k`` in byte ``k``)."""
    p = np.array(packed).view(np.uint8)
    w = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[0], -1)
    return mx.array(np.ascontiguousarray(w).view("<u4"))


def unify_fused_groups(weights: Dict[str, mx.array], args) -> Dict[str, mx.array]:
    """Give gate and up (which the lean forward fuses, and the native
    layer_mid takes as one weight) one quantized format where they differ
    only in bits (4 and 8) or in their scales' float type, by widening: 4-bit
    blocks become 8-bit blocks of the same integers, float16 scales and biases
    float32, so every weight keeps its value exactly. q/k/v are left as they
    are: a Q4_K_M file's layers whose ``attn_v`` is Q6_K (8-bit blocks,
    :func:`.gguf_readonly.q6_k_affine`) beside Q4_K ``attn_q`` / ``attn_k``
    run q/k and v as two matmuls of their own formats inside the native
    layer_in (``w_qkv``, ``w_qkv2``; before 0.5.33 q/k were widened too, at
    8.75 bits a weight against 4.75: the 1B-shaped Q4_K_M file's 8 such
    layers, 21 MB more of the 780 MB a step read).
    Changes ``weights`` in place and returns it. The groups are
    ``_FUSED_GROUPS`` (with ``QKV_GROUP`` added, q/k/v as before 0.5.33)."""
    hidden = args.hidden_size
    for i in range(args.num_hidden_layers):
        for parent, names in _FUSED_GROUPS:
            prefixes = [f"model.layers.{i}.{parent}.{n}" for n in names]
            if not all(f"{p}.scales" in weights for p in prefixes):
                continue
            bits = [weights[f"{p}.weight"].shape[-1] * 32 // hidden for p in prefixes]
            groups = {hidden // weights[f"{p}.scales"].shape[-1] for p in prefixes}
            dtypes = {weights[f"{p}.scales"].dtype for p in prefixes} | {weights[f"{p}.biases"].dtype for p in prefixes}
            if len(groups) != 1 or not set(bits) <= {4, 8} or (len(set(bits)) == 1 and len(dtypes) == 1):
                continue
            for p, b in zip(prefixes, bits):
                if b == 4 and 8 in bits:
                    weights[f"{p}.weight"] = _nibbles_to_bytes(weights[f"{p}.weight"])
                if len(dtypes) > 1:
                    for k in ("scales", "biases"):
                        weights[f"{p}.{k}"] = weights[f"{p}.{k}"].astype(mx.float32)
    return weights


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
    converted = unify_fused_groups(convert_weights(weights, args, path), args)
    model = Model(args)
    quantize_like(model, converted)
    try:
        model.load_weights(list(converted.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{path}: weights do not fit the llama model built from its metadata: {e}") from e
    model.eval()
    mx.eval(model.parameters())
    return model
