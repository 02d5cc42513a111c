"""The lean layers on MLX's ops: the reference every other path must match.

Per layer (``h [B * L, hidden]``, the residual stream as a 2-D matrix, so no
flatten/unflatten around each matmul):

* q/k/v in one matmul, rotated together by the step's shared table
  (:class:`~.rotation.HeadRotation`); qwen3's per-head norms before it;
* **decode** (L = 1): attention as one matmul per key head, its R query heads
  as the rows, with the additive mask added by the matmul (``addmm``);
  **windows** (L > 1): the matmuls of ``mx.fast.scaled_dot_product_attention``'s
  fallback (one row per query head) without its reshapes;
* quantized caches (the cache has ``bits``, as mlx-lm asks): both attention
  matmuls are ``mx.quantized_matmul`` on the stored columns, as in mlx-lm's
  quantized attention; no float copy of the cache is made. float16/bfloat16
  caches are read by the same matmuls as float32 ones (promoted to the
  activations' dtype, as ``mx.fast.scaled_dot_product_attention`` does);
* the post-attention norm with the residual sum formed inside it
  (:func:`norm_of_sum`); gate/up in one matmul; SwiGLU; down; residual.

Every value is what the model's own forward computes, to the bit where the
arithmetic is the same (``tests/test_fused.py``).
"""

from __future__ import annotations

from typing import List

import mlx.core as mx
import mlx.nn as nn

from .step_tables import StepTables
from .weights import LayerSpec


def attention(q: mx.array, k, v, mask: mx.array, quant=None) -> mx.array:
    """Grouped-query attention: ``q [B, Hk, R, L, D]`` (already scaled; the R
    query heads of each key head), ``k``/``v [B, Hk, S, D]``, ``mask``
    boolean ``[B, 1, 1, L, S]``; returns ``[B, Hk, R, L, D]``: the matmuls of
    ``mx.fast.scaled_dot_product_attention``'s fallback, without its reshapes
    (``quant = (bits, group_size)``: k/v are quantized buffers, read as mlx-lm's
    quantized attention reads them)."""
    if quant is None:
        scores = q @ mx.expand_dims(k, 2).swapaxes(-1, -2)  # [B, Hk, R, L, S]
    else:
        k = tuple(mx.expand_dims(a, 2) for a in k)  # [B, Hk, 1, S, D*bits/32], 2x [B, Hk, 1, S, D/group]
        scores = quantized_mm(q, k, True, quant)  # [B, Hk, R, L, S]
    scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    probs = mx.softmax(scores, axis=-1, precise=True)
    if quant is None:
        return probs @ mx.expand_dims(v, 2)
    return quantized_mm(probs, tuple(mx.expand_dims(a, 2) for a in v), False, quant)  # [B, Hk, R, L, D]


def quantized_mm(x: mx.array, buf, transpose: bool, quant) -> mx.array:
    """``x @ buf.T`` (``transpose``) or ``x @ buf`` for a quantized buffer ``(packed, scales, biases)``."""
    bits, group_size = quant
    return mx.quantized_matmul(x, *buf, transpose=transpose, group_size=group_size, bits=bits)


def stored_quantization(cache):
    """``(bits, group_size)`` of a cache whose K/V are quantized, else None
    (mlx-lm's rule: a cache with ``bits`` is quantized)."""
    return (cache.bits, cache.group_size) if hasattr(cache, "bits") else None


def norm_of_sum(h: mx.array, a: mx.array, norm) -> mx.array:
    """``norm(h + a)`` for an ``nn.RMSNorm``: the arithmetic of
    ``mx.fast.rms_norm``'s fallback, with the residual sum formed inside each
    of the two kernels that read it (``h + a`` and ``a + h``: distinct nodes,
    so compile fuses each into its reader rather than keeping a sum node).
    The MLP's residual forms it a third way (``h - (-a)``). Every form gives
    the same bits; the norm's own call where the dtypes differ."""
    w = norm.weight
    if h.dtype != w.dtype or a.dtype != h.dtype:
        return norm(h + a)
    f32 = mx.float32
    ms = mx.mean(mx.square((h + a).astype(f32)), -1, keepdims=True)
    return ((a + h).astype(f32) * mx.rsqrt(ms + mx.array(norm.eps, f32))).astype(h.dtype) * w


class OpsLayers:
    """The decoder layers on MLX's ops, for decode and window steps alike."""

    name = "mlx-ops"

    def __init__(self, layers: List[LayerSpec]):
        self.layers = layers

    def __call__(self, h: mx.array, caches, t: StepTables) -> mx.array:
        """``h [B * L, hidden]`` through every layer (writing each layer's cache)."""
        for s, cache in zip(self.layers, caches):
            h = self.layer(s, h, cache, t)
        return h

    @staticmethod
    def layer(s: LayerSpec, h: mx.array, cache, t: StepTables) -> mx.array:
        """``h [B * L, hidden]`` through the one layer ``s`` (writing its cache)."""
        B, L = t.offsets.shape[0], t.L
        nq, nk, R, D = s.nq, s.nk, s.R, s.D
        y = s.qkv(s.input_norm(h))  # [B * L, (nq + 2 nk) * D]
        heads = (B, nq + 2 * nk, 1, D) if L == 1 else (B, L, nq + 2 * nk, D)
        if s.qk_norms is not None:  # qwen3: per-head norms before the rotation
            rot = t.rotation(s, y.dtype, rotate_values=False)
            q, k, v = mx.split(y.reshape(heads), [nq, nq + nk], axis=rot.axis)
            qk = mx.concatenate([s.qk_norms[0](q), s.qk_norms[1](k)], axis=rot.axis)
            q, k = mx.split(rot(qk), [nq], axis=rot.axis)
        else:
            rot = t.rotation(s, y.dtype)
            q, k, v = mx.split(rot(y), [nq, nq + nk], axis=rot.axis)
        if L == 1:
            # decode: k/v are [B, nk, 1, D] already; the R query heads of each
            # key head as the rows of one matmul, the mask added by it
            k, v = cache.update_and_fetch(k, v)
            quant, bias = stored_quantization(cache), t.bias(s.index, y.dtype, (nk, R))
            if quant is None:
                scores = mx.addmm(bias, q.reshape(B, nk, R, D), k.swapaxes(-1, -2))  # [B, nk, R, S]
                o = (mx.softmax(scores, axis=-1, precise=True) @ v).reshape(B, nq * D)
            else:  # the stored columns as they are: [B, nk, R, S], then [B, nk, R, D]
                scores = quantized_mm(q.reshape(B, nk, R, D), k, True, quant) + bias
                o = quantized_mm(mx.softmax(scores, axis=-1, precise=True), v, False, quant).reshape(B, nq * D)
        else:
            # heads first: q [B, nk, R, L, D] (R query heads per key head), k/v [B, nk, L, D]
            q = q.reshape(B, L, nk, R, D).transpose(0, 2, 3, 1, 4)
            k, v = cache.update_and_fetch(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
            o = attention(q, k, v, t.mask(s.index), stored_quantization(cache))  # [B, nk, R, L, D]
            o = o.transpose(0, 3, 1, 2, 4).reshape(B * L, nq * D)
        a = s.o(o)
        gate, up = mx.split(s.gu(norm_of_sum(h, a, s.post_norm)), 2, axis=-1)
        h = (h - (-a)) + s.down(nn.silu(gate) * up)  # (h + a) + down, to the bit
        return h
