"""The lean layers on the native kernels: 4 graph nodes a layer in decode.

The same arithmetic as :class:`~.ops.OpsLayers`, bit for bit, on the
primitives of ``mlx_tracer.backend.kernels`` (handed in by the runtime:
adapters import nothing but caches), for decode steps (L = 1) and windows of
L tokens a row (verify, prefill) alike:

* ``layer_in``: the previous layer's down projection and residual, the input
  norm, q/k/v, qwen3's per-head norms and the rotation;
* the cache write: in a decode step ``cache_write`` twice, the new key and
  value at the step's column, in place (what the cache's ``update_and_fetch``
  does with MLX's ops: the cast to a float16/bfloat16 buffer's dtype; for
  quantized K/V ``cache_write_quantized`` once per array of the buffer,
  each quantizing the column as ``mx.quantize`` does); in a window the
  cache's own ``update_and_fetch`` (its columns and, for a ring, what the
  window attends differ by cache);
* ``layer_mid``: attention (a decode step's additive bias, a window's mask)
  over the K/V as stored (float16/bfloat16 widened one (row, key head) block
  at a time, as MLX's matmul promotes them; packed 4-/8-bit columns read as
  ``mx.quantized_matmul`` reads them: no float32 copy of the cache), the
  output projection and residual, the post-attention norm, gate/up and SwiGLU.

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

from ...caches.storage import KVFormat, is_quantized
from .ops import OpsLayers
from .step_tables import StepTables
from .weights import Binding, LayerSpec, LinearGroup


def why_not_native(binding: Binding, kernels, kv: KVFormat = KVFormat()) -> Optional[str]:
    """``None`` when the kernels can run this binding's steps with caches of
    format ``kv``, else why not."""
    if kernels is None:
        return "no native kernels"
    if kv.quantized and kv.bits not in (4, 8):
        return f"K/V stored as {kv.describe()} (the kernels read 4- or 8-bit K/V)"
    if binding.activation_dtype != mx.float32:
        return f"{binding.activation_dtype} activations (the kernels are float32)"
    reasons = ops_layers(binding)
    if len(reasons) == len(binding.layers):  # no layer for the kernels: the first one's reason
        return next(iter(reasons.values()))
    return None


def ops_layers(binding: Binding) -> Dict[int, str]:
    """The layers the kernels cannot run, by index, with why: where
    :func:`why_not_native` is None these run on MLX's ops between the native
    ones (:class:`NativeLayers`' ``ops``)."""
    return {s.index: why for s in binding.layers if (why := why_not_native_layer(s)) is not None}


def why_not_native_layer(s: LayerSpec) -> Optional[str]:
    """``None`` when the kernels can run layer ``s`` (float32 activations), else why not."""
    f32 = mx.float32
    if s.sharded():
        return (f"layer {s.index}: sharded (the kernels add the o/down projections into the residual stream; "
                "the all-sum goes between)")
    split = [n for n in s.split() if not (n == "qkv" and two_part_qkv(s.qkv))]
    if split:
        return (f"layer {s.index}: {', '.join(f'{n} mixes formats ({s.groups()[n].describe()})' for n in split)}"
                " (the kernels take one weight per slot, two formats in q/k/v's)")
    if not all(run.dense_f32() or run.kernel is not None for g in s.groups().values() for run in g.runs):
        return (f"layer {s.index}: projections neither float32 nor quantized as the kernels take them "
                "(affine, 4 or 8 bits, or 2, 3, 5 and 6 repacked, 8-bit blocks of integers below 32 held as 5; "
                "groups of 32/64/128)")
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


def two_part_qkv(g) -> bool:
    """Whether q/k/v in two formats (a :class:`SplitGroup` of two runs: a
    k-quant file's Q4_K q/k beside a Q6_K v) fit layer_in's slots ``w_qkv``
    and ``w_qkv2``: two runs, each a float32 matrix or blocks qmm takes,
    each with a bias or neither."""
    return (len(g.runs) == 2 and all(r.dense_f32() or r.kernel is not None for r in g.runs)
            and len({"bias" in r.p for r in g.runs}) == 1)


def qkv_weights(g) -> Dict[str, mx.array]:
    """q/k/v as layer_in takes them: one group's ``w_qkv`` and ``b_qkv``, or
    a two-format group's runs as ``w_qkv`` (the first run's columns) and
    ``w_qkv2`` (the rest), their biases joined."""
    if len(g.runs) == 1:
        return dict(**weight("w_qkv", g), b_qkv=g.p.get("bias"))
    first, second = g.runs
    return dict(**weight("w_qkv", first), **weight("w_qkv2", second), b_qkv=g.bias)


PARTS = ("packed", "scales", "biases")  # a quantized buffer's arrays, as storage.KVFormat keeps them


def writable(cache) -> bool:
    """Whether ``cache_write`` / ``cache_write_quantized`` write this cache's
    decode columns: float K/V, or quantized with float32 scales and biases."""
    return not is_quantized(cache.keys) or cache.keys[1].dtype == mx.float32


def write(K, cache, buf, new: mx.array):
    """``buf`` (keys or values) with ``new [B, nk, 1, D]`` (float32) written at
    the decode step's column, in place: cast to a float buffer's dtype, or
    quantized as ``mx.quantize`` does, one node per array of the buffer."""
    if not is_quantized(buf):
        return K.cache_write(buf, new, cache.column)
    return tuple(K.cache_write_quantized(a, new, cache.column, part, cache.bits, cache.group_size)
                 for a, part in zip(buf, PARTS))


def stored(slot: str, buf) -> Dict[str, mx.array]:
    """Cached keys or values as layer_mid's slot ``slot`` takes them: a float
    array (float32, float16 or bfloat16), or a quantized buffer's packed
    columns with their scales and biases."""
    if not is_quantized(buf):
        return {slot: buf}
    packed, scales, biases = buf
    return {slot: packed, f"{slot}_scales": scales, f"{slot}_biases": biases}


class NativeLayers:
    """The decoder layers of a step on the native layer kernels; those whose
    index is in ``ops`` (the keys of :func:`ops_layers`: a group of mixed
    formats, ...) on MLX's ops (:meth:`~.ops.OpsLayers.layer`), with the
    residual stream completed before each as the ops complete it."""

    def __init__(self, layers: List[LayerSpec], kernels, contract: str = "exact", ops=()):
        self.layers = layers
        self.K = kernels
        self.contract = contract  # qmm's, for packed projections
        self.ops = frozenset(ops)
        self.name = "native" if not self.ops else f"native (layers {sorted(self.ops)} on mlx-ops)"

    def __call__(self, h: mx.array, caches, t: StepTables) -> mx.array:
        """``h [B * L, hidden]`` through every layer (writing each layer's cache)."""
        K, L = self.K, t.L
        act = None  # the previous layer's MLP activation
        for s, cache in zip(self.layers, caches):
            if s.index in self.ops:
                if act is not None:  # the previous layer's down and residual: (h + a) + down, as the ops add them
                    h, act = h + self.layers[s.index - 1].down(act), None
                h = OpsLayers.layer(s, h, cache, t)
                continue
            rot = t.rotation(s, h.dtype)
            inputs = dict(h=h, norm=s.input_norm.weight, **qkv_weights(s.qkv), cos=rot.C, sin=rot.S, scale=rot.F)
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
            if t.decode and writable(cache):  # written in place by the kernels, as stored
                keys, values = write(K, cache, cache.keys, k), write(K, cache, cache.values, v)
                cache.written(keys, values)
                seen = dict(bias=t.bias(s.index, h.dtype))  # [B, 1, 1, S]
            else:
                keys, values = cache.update_and_fetch(k, v)  # [B, nk, S, D]: what the step attends
                seen = dict(bias=t.bias(s.index, h.dtype)) if L == 1 else dict(mask=t.mask(s.index))
            h, act = K.layer_mid(dict(q=q, **stored("k", keys), **stored("v", values), **seen, **weight("w_o", s.o),
                                      b_o=s.o.p.get("bias"), h=h,
                                      norm=s.post_norm.weight, **weight("w_gu", s.gu), b_gu=s.gu.p.get("bias")),
                                 eps=s.post_norm.eps, contract=self.contract)  # h + a, silu(gate) * up
        return h if act is None else h + self.layers[-1].down(act)  # (h + a) + down, as the ops compute it
