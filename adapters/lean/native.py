"""The lean layers on the native kernels: 4 graph nodes a layer in decode.

The same arithmetic as :class:`~.ops.OpsLayers`, bit for bit, on the
primitives of ``mlx_tracer.backend.kernels`` (handed in by the runtime:
adapters import nothing but caches), for decode steps (L = 1) and windows of
L tokens a row (verify, prefill) alike:

* ``layer_in``: the previous layer's down projection and residual, the input
  norm, q/k/v, qwen3's per-head norms and the rotation;
* the cache write: in a decode step ``cache_write`` twice, the new key and
  value at the step's column, in place (what the cache's ``update_and_fetch``
  does with MLX's ops); in a window the cache's own ``update_and_fetch``
  (its columns and, for a ring, what the window attends differ by cache);
* ``layer_mid``: attention (a decode step's additive bias, a window's mask),
  the output projection and residual, the post-attention norm, gate/up and
  SwiGLU.

The residual stream is carried as ``h`` plus the last MLP's activation; the
last layer's down projection and residual are MLX ops. The kernels' inputs
are passed by name (the names the kernels module lists in ``inputs(kernel)``).

A projection is a float32 matrix (the group's ``wt``) or the file's packed
4-/8-bit blocks (``weight``, ``scales``, ``biases``), which the kernels
multiply with the quantized matmul the ops path calls for the same group
(``qmm``, under the binding's contract): the same bits either way.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import mlx.core as mx

from .step_tables import StepTables
from .weights import Binding, LayerSpec, LinearGroup


def why_not_native(binding: Binding, kernels) -> Optional[str]:
    """``None`` when the kernels can run this binding's decode steps, else why not."""
    if kernels is None:
        return "no native kernels"
    f32 = mx.float32
    if binding.activation_dtype != f32:
        return f"{binding.activation_dtype} activations (the kernels are float32)"
    for s in binding.layers:
        if not all(g.dense_f32() or g.kernel is not None for g in s.groups().values()):
            return (f"layer {s.index}: projections neither float32 nor quantized as the kernels take them "
                    "(affine, 4 or 8 bits, groups of 32/64/128)")
        norms = [s.input_norm, s.post_norm, *(s.qk_norms or ())]
        if any(n.weight.dtype != f32 for n in norms):
            return f"layer {s.index}: norms not float32"
        if s.qk_norms is not None and s.qk_norms[0].eps != s.qk_norms[1].eps:
            return f"layer {s.index}: q and k norms of different eps"
    return None


def weight(slot: str, g: LinearGroup) -> Dict[str, mx.array]:
    """A group as the kernels' weight slot ``slot`` takes it: its float32
    matrix, or its packed blocks with their scales and biases."""
    if g.quant is None:
        return {slot: g.p["wt"]}
    return {slot: g.p["weight"], f"{slot}_scales": g.p["scales"], f"{slot}_biases": g.p["biases"]}


class NativeLayers:
    """The decoder layers of a step on the native layer kernels."""

    name = "native"

    def __init__(self, layers: List[LayerSpec], kernels, contract: str = "exact"):
        self.layers = layers
        self.K = kernels
        self.contract = contract  # qmm's, for packed projections

    def __call__(self, h: mx.array, caches, t: StepTables) -> mx.array:
        """``h [B * L, hidden]`` through every layer (writing each layer's cache)."""
        K, L = self.K, t.L
        act = None  # the previous layer's MLP activation
        for s, cache in zip(self.layers, caches):
            rot = t.rotation(s, h.dtype)
            inputs = dict(h=h, norm=s.input_norm.weight, **weight("w_qkv", s.qkv), b_qkv=s.qkv.p.get("bias"),
                          cos=rot.C, sin=rot.S, scale=rot.F)
            if act is not None:
                prev = self.layers[s.index - 1].down
                inputs.update(act=act, **weight("w_down", prev), b_down=prev.p.get("bias"))
            qk_eps = 0.0
            if s.qk_norms is not None:
                inputs.update(q_norm=s.qk_norms[0].weight, k_norm=s.qk_norms[1].weight)
                qk_eps = s.qk_norms[0].eps
            outs = K.layer_in(inputs, eps=s.input_norm.eps, nq=s.nq, nk=s.nk, D=s.D, qk_eps=qk_eps, L=L,
                              contract=self.contract)
            if act is not None:
                h, *outs = outs  # h + down, to the bit
            q, k, v = outs  # [B, nk, R, D] ([B, nk, R, L, D] in a window), [B, nk, L, D] x 2
            if t.decode:
                keys = K.cache_write(cache.keys, k, cache.column)
                values = K.cache_write(cache.values, v, cache.column)
                cache.written(keys, values)
                seen = dict(bias=t.bias(s.index, h.dtype))  # [B, 1, 1, S]
            else:
                keys, values = cache.update_and_fetch(k, v)  # [B, nk, S, D]: what the window attends
                seen = dict(bias=t.bias(s.index, h.dtype)) if L == 1 else dict(mask=t.mask(s.index))
            h, act = K.layer_mid(dict(q=q, k=keys, v=values, **seen, **weight("w_o", s.o), b_o=s.o.p.get("bias"), h=h,
                                      norm=s.post_norm.weight, **weight("w_gu", s.gu), b_gu=s.gu.p.get("bias")),
                                 eps=s.post_norm.eps, contract=self.contract)  # h + a, silu(gate) * up
        return h + self.layers[-1].down(act)  # (h + a) + down, as the ops compute it
