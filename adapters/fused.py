"""A lean forward for the compiled step: fewer graph nodes per layer.

Replaying a compiled step costs host time per node of its graph (about 1.5 µs
each here, while the weights a step streams keep the CPU's caches cold), and
on MLX's CPU backend ``mx.fast.rope`` / ``rms_norm`` / attention expand into
their many-node fallbacks. For the llama-style families (mlx-lm's ``llama``,
``mistral``, ``qwen2``, ``qwen3``) this module runs the same layer arithmetic
with fewer nodes:

* **q/k/v and gate/up in one matmul each.** The weights of each group are
  concatenated once along the output axis; the model's own ``q_proj`` /
  ``k_proj`` / ... then hold *views* of the fused buffer, so memory does not
  grow and the eager model computes what it did before. Dense and quantized
  (equal group size, bits and mode) linears fuse; other groups stay apart.
* **RoPE tables built once per forward.** Every layer's rotary embedding
  uses the same positions, so the cosines and sines are computed once (per
  distinct ``nn.RoPE`` setting) and each layer rotates its queries and keys
  together, with the arithmetic of MLX's own fallback.
* **A 2-D residual stream** ``[B * L, hidden]``: no flatten/unflatten around
  each matmul.
* **No output head where no logits are read** (prefill windows), and at each
  row's ``last`` query only where one is.

* **Decode attention as one matmul per key head** (its R query heads as
  rows) with the mask added by it; windows on the fallback's one-row-per-head
  matmuls without its reshapes, the mask laid out once per cache family.
* **Residual sums inside the kernels that read them** (the post-attention
  norm, written out with ``mx.fast.rms_norm``'s fallback arithmetic).

The input norms are the model's own calls (``mx.fast.rms_norm``), and the
caches are the traced caches of :mod:`.traced`, written exactly as the model
would.

The compiled step holds what the lean forward reads (the fused buffers, the
embedding, the norms) as constants of its trace, so a call hands MLX only the
step's own arrays. Before every step :meth:`FusedForward.refresh` checks, by
identity, that every source module, view and called module is still in
place: weights swapped with ``model.update`` / ``load_weights``, or modules
replaced (``nn.quantize``, sharding), rebuild the buffers (the step then
drops its lean traces and traces again), or turn the lean forward off when
the new modules no longer qualify.
"""

from __future__ import annotations

import math
import operator
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

_KINDS = frozenset({"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"})  # mistral is llama's


def _kind_ok(obj, name: str) -> bool:
    mod = type(obj).__module__
    return mod in _KINDS and type(obj).__name__ == name


def why_not(model) -> Optional[str]:
    """``None`` when ``model`` qualifies for the lean forward, else why not."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return "not on the CPU backend (a GPU runs mx.fast's RoPE, norm and attention as single kernels)"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        return "not a llama-style model (model.model.embed_tokens/layers/norm)"
    if type(model).__module__ not in _KINDS:
        return f"family {type(model).__module__} has no lean forward"
    if getattr(inner, "pipeline_size", 1) != 1:
        return "pipeline-parallel model"
    if not isinstance(inner.embed_tokens, (nn.Embedding, nn.QuantizedEmbedding)):
        return "embedding type"
    args = getattr(model, "args", None)
    tied = getattr(args, "tie_word_embeddings", None)
    if tied is None or (not tied and not isinstance(getattr(model, "lm_head", None), (nn.Linear, nn.QuantizedLinear))):
        return "output head"
    for i, layer in enumerate(inner.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not (_kind_ok(layer, "TransformerBlock") and _kind_ok(attn, "Attention") and _kind_ok(mlp, "MLP")):
            return f"layer {i}: block, attention or MLP is not the family's own"
        for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj), (attn.o_proj,), (mlp.down_proj,)):
            if not _fusable(group):
                return f"layer {i}: projections {[type(m).__name__ for m in group]} cannot share one matmul"
        if _table_rope(attn.rope) is None:
            return f"layer {i}: {type(attn.rope).__name__} (the lean forward rotates with nn.RoPE's non-traditional tables)"
        if attn.n_heads % attn.n_kv_heads:
            return f"layer {i}: query heads not a multiple of key heads"
        if type(layer.input_layernorm) is not nn.RMSNorm or type(layer.post_attention_layernorm) is not nn.RMSNorm:
            return f"layer {i}: norms"
    return None


# ---------------------------------------------------------------- linears
_ARRAYS = ("weight", "scales", "biases", "bias")
_LINEARS = (nn.Linear, nn.QuantizedLinear)


def _fusable(mods) -> bool:
    """Linears that can share one matmul: same type, same arrays, same quantization."""
    t = type(mods[0])
    if t not in _LINEARS or any(type(m) is not t for m in mods):
        return False
    if len({tuple(k for k in _ARRAYS if k in m) for m in mods}) != 1:
        return False
    return t is nn.Linear or len({(m.group_size, m.bits, m.mode) for m in mods}) == 1


class _Group:
    """Linears that read the same input (q/k/v, gate/up), computed as one.

    Its arrays are a compiled-step input: a dense weight as its transposed
    view ``wt`` (so the graph needs no transpose node; the matmul reads the
    same memory the same way as ``x @ weight.T``), quantized ones as they are.
    """

    def __init__(self, mods):
        self.mods = list(mods)
        m0 = self.mods[0]
        self.quant = (m0.group_size, m0.bits, m0.mode) if type(m0) is nn.QuantizedLinear else None
        self.keys = [k for k in _ARRAYS if k in m0]

    def build(self) -> Dict[str, mx.array]:
        """The group's arrays; a group of several is concatenated along the
        output axis once, and its modules then hold views of the result (the
        same values, no extra memory)."""
        if len(self.mods) > 1:
            fused = {k: mx.concatenate([m[k] for m in self.mods], axis=0) for k in self.keys}
            mx.eval(fused)
            start = 0
            for m in self.mods:
                n = m["weight"].shape[0]
                for k in self.keys:
                    m[k] = fused[k][start : start + n]
                start += n
            mx.eval([m[k] for m in self.mods for k in self.keys])
        else:
            fused = {k: self.mods[0][k] for k in self.keys}
        if self.quant is None:
            fused["wt"] = fused.pop("weight").T
        mx.eval(fused)
        return fused

    def watch(self) -> List[tuple]:
        return [(m, k, m[k]) for m in self.mods for k in self.keys]

    def __call__(self, x: mx.array, p: Dict[str, mx.array]) -> mx.array:
        """``x [M, in]`` through the group: ``[M, sum of outputs]``, computed
        as mlx's ``Linear`` / ``QuantizedLinear`` computes each part."""
        if self.quant is None:
            return mx.addmm(p["bias"], x, p["wt"]) if "bias" in p else x @ p["wt"]
        group_size, bits, mode = self.quant
        y = mx.quantized_matmul(x, p["weight"], scales=p["scales"], biases=p.get("biases"), transpose=True,
                                group_size=group_size, bits=bits, mode=mode)
        return y + p["bias"] if "bias" in p else y


# ------------------------------------------------------------------- RoPE
def rope_tables(offsets: mx.array, L: int, dims: int, base: float, scale: float, dtype) -> Tuple[mx.array, mx.array]:
    """cos and sin ``[B, L, 1, dims/2]`` for rows at ``offsets [B]``: the
    arithmetic of MLX's own RoPE fallback (so the rotation is bit-identical)."""
    half = dims // 2
    positions = (mx.arange(L, dtype=mx.float32) + offsets[:, None]) * mx.array(scale, mx.float32)  # [B, L]
    inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(math.log(base) / half, mx.float32))
    theta = positions[:, :, None, None] * inv_freqs  # [B, L, 1, half]
    return mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype)


class HeadRotation:
    """RoPE of every head of a projection ``[B * L, H * D]`` in two graph nodes.

    ``x * C + (x @ P) * S``, times a per-head factor: ``P`` swaps the two
    halves of each head (a permutation, so ``x @ P`` is exact), ``C`` is
    ``[cos, cos]`` and ``S`` is ``[-sin, sin]``, which gives
    ``x1 cos - x2 sin`` and ``x2 cos + x1 sin``: MLX's fallback arithmetic,
    rounded the same way. Heads that are not rotated (values) get ``C = 1,
    S = 0``; the factor is the attention scale on query heads (applied after
    the rotation, as the attention fallback does) and 1 elsewhere. Built once
    per forward and shared by every layer with the same head layout. Returns
    ``[B, L, H, D]``, or ``[B, H, 1, D]`` for a decode step (``axis``: the
    heads axis).
    """

    def __init__(self, cos: mx.array, sin: mx.array, heads: Tuple[int, int, int], D: int, qscale: float):
        B, L = cos.shape[:2]
        nq, nk, nv = heads
        rot, keep = nq + nk, nv
        c = mx.concatenate([cos, cos], axis=-1)  # [B, L, 1, D]
        s = mx.concatenate([-sin, sin], axis=-1)
        parts_c = [mx.broadcast_to(c, (B, L, rot, D))]
        parts_s = [mx.broadcast_to(s, (B, L, rot, D))]
        if keep:
            parts_c.append(mx.ones((B, L, keep, D), dtype=c.dtype))
            parts_s.append(mx.zeros((B, L, keep, D), dtype=s.dtype))
        H = rot + keep
        self.C = mx.concatenate(parts_c, axis=2).reshape(B * L * H, D)
        self.S = mx.concatenate(parts_s, axis=2).reshape(B * L * H, D)
        f = mx.array([qscale] * nq + [1.0] * (nk + nv), dtype=cos.dtype)[:, None]  # [H, 1]
        self.F = mx.broadcast_to(f[None], (B * L, H, 1)).reshape(B * L * H, 1)
        half = D // 2
        perm = [(j + half) % D for j in range(D)]  # column j of x @ P is x[perm[j]]
        self.P = (mx.arange(D)[:, None] == mx.array(perm)[None, :]).astype(cos.dtype)  # [D, D]
        # a decode step (L = 1) returns [B, H, 1, D]: the same memory as [B, 1, H, D],
        # in the caches' [batch, heads, time, dim] order (no reshape per head group)
        self.shape = (B, H, 1, D) if L == 1 else (B, L, H, D)
        self.axis = 1 if L == 1 else 2  # the heads axis of the result

    def __call__(self, x: mx.array) -> mx.array:
        x2 = x.reshape(-1, self.shape[-1])  # [B * L * H, D]
        return ((x2 * self.C + (x2 @ self.P) * self.S) * self.F).reshape(self.shape)


def _table_rope(rope) -> Optional[tuple]:
    """The table key of an ``nn.RoPE`` the tables can serve, else None."""
    if type(rope) is nn.RoPE and not rope.traditional:
        return (rope.dims, float(rope.base), float(rope.scale))
    return None


def attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array) -> mx.array:
    """Grouped-query attention: ``q [B, Hk, R, L, D]`` (already scaled; the R
    query heads of each key head), ``k``/``v [B, Hk, S, D]``, ``mask``
    boolean ``[B, 1, 1, L, S]``; returns ``[B, Hk, R, L, D]``. The matmuls of
    ``mx.fast.scaled_dot_product_attention``'s fallback (one row per query
    head), without its reshapes: the window steps' attention (a decode step
    stacks the R heads, see :meth:`FusedForward.__call__`)."""
    scores = q @ mx.expand_dims(k, 2).swapaxes(-1, -2)  # [B, Hk, R, L, S]
    scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    return mx.softmax(scores, axis=-1, precise=True) @ mx.expand_dims(v, 2)


def _norm_of_sum(h: mx.array, a: mx.array, norm) -> mx.array:
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


# ---------------------------------------------------------------- forward
class FusedForward:
    """The lean forward of one qualifying model (see the module docstring)."""

    def __init__(self, model, native=None):
        self.model = model
        # the native kernels module (mlx_tracer.backend.kernels, handed in by
        # the runtime: adapters import nothing but caches), or None: MLX's ops
        self.native = native
        # the fused buffers (constants of the lean trace, like the embedding
        # and norms it calls); `generation` counts the rebuilds
        self.buffers: Dict[str, Dict[str, mx.array]] = {}
        self.generation = 0
        self.active = False
        self._set_watch([])
        self.refresh(force=True)

    # -- weights
    def refresh(self, force: bool = False) -> bool:
        """Rebuild the fused buffers if a source module or array changed;
        returns whether the lean forward is active."""
        if not force and not any(map(operator.is_not, map(operator.getitem, self._containers, self._keys), self._expected)):
            return self.active
        self.buffers.clear()
        self.generation += 1
        self._set_watch([])
        self.active = why_not(self.model) is None
        if not self.active:
            return False
        inner = self.model.model
        self.layers = list(inner.layers)
        self.groups = []
        watch = [(self.model, "model", inner), (inner, "layers", inner.layers)]
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            watch += [(inner.layers, i, layer), (layer, "self_attn", attn), (layer, "mlp", mlp)]
            names = {"qkv": (attn, ("q_proj", "k_proj", "v_proj")), "o": (attn, ("o_proj",)),
                     "gu": (mlp, ("gate_proj", "up_proj")), "down": (mlp, ("down_proj",))}
            groups = {}
            for name, (parent, keys) in names.items():
                group = groups[name] = _Group([parent[k] for k in keys])
                watch += [(parent, k, m) for k, m in zip(keys, group.mods)]
                self.buffers[f"{name}{i}"] = group.build()
                watch += group.watch()
            self.groups.append(groups)
        head = inner.embed_tokens if self.model.args.tie_word_embeddings else self.model.lm_head
        self.head = _Group([head]) if type(head) in (nn.Linear, nn.Embedding) else None
        slots = [(inner, "embed_tokens"), (inner, "norm")] + ([] if self.model.args.tie_word_embeddings else [(self.model, "lm_head")])
        for layer in self.layers:
            slots += [(layer, "input_layernorm"), (layer, "post_attention_layernorm")]
            slots += [(layer.self_attn, k) for k in ("q_norm", "k_norm") if k in layer.self_attn]
        watch += [(parent, k, parent[k]) for parent, k in slots]  # the modules the lean forward calls
        if self.head is not None:
            self.buffers["head"] = self.head.build()
            watch += self.head.watch()
        self._set_watch(watch)
        return True

    def _set_watch(self, watch: List[tuple]):
        # the per-step check runs as C-level map() loops over these three
        self._containers = [c for c, _, _ in watch]
        self._keys = [k for _, k, _ in watch]
        self._expected = [v for _, _, v in watch]

    # -- graph
    def __call__(self, tokens: mx.array, caches, masks, family_of, want: str, last: Optional[mx.array] = None):
        """Logits of the step: ``want`` is "all" ([B, L, V]), "last" (at
        ``last [B]``: [B, V]) or "none" (no head: None)."""
        model, inner = self.model, self.model.model
        B, L = tokens.shape
        h = inner.embed_tokens(tokens)  # [B, L, hidden]
        h = h.reshape(B * L, h.shape[-1])
        offsets = caches[0].offset
        shared = {}  # per forward: rotations per head layout, masks per family
        if L == 1 and self._kernels(h):
            return self._decode_kernels(h, caches, masks, family_of, want, shared)
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            attn, g, b = layer.self_attn, self.groups[i], self.buffers
            nq, nk = attn.n_heads, attn.n_kv_heads
            R = nq // nk
            y = g["qkv"](layer.input_layernorm(h), b[f"qkv{i}"])  # [B * L, (nq + 2 nk) * D]
            D = y.shape[-1] // (nq + 2 * nk)
            rope = _table_rope(attn.rope)
            heads = (B, nq + 2 * nk, 1, D) if L == 1 else (B, L, nq + 2 * nk, D)
            if hasattr(attn, "q_norm"):  # qwen3: per-head norms before the rotation
                rot = self._rotation(shared, rope, offsets, L, (nq, nk, 0), D, attn.scale, y.dtype)
                q, k, v = mx.split(y.reshape(heads), [nq, nq + nk], axis=rot.axis)
                qk = mx.concatenate([attn.q_norm(q), attn.k_norm(k)], axis=rot.axis)
                q, k = mx.split(rot(qk), [nq], axis=rot.axis)
            else:
                rot = self._rotation(shared, rope, offsets, L, (nq, nk, nk), D, attn.scale, y.dtype)
                q, k, v = mx.split(rot(y), [nq, nq + nk], axis=rot.axis)
            if L == 1:
                # decode: k/v are [B, nk, 1, D] already; the R query heads of each
                # key head as the rows of one matmul, the mask added by it
                k, v = cache.update_and_fetch(k, v)
                scores = mx.addmm(self._bias(shared, masks, family_of[i], nk, R, y.dtype), q.reshape(B, nk, R, D), k.swapaxes(-1, -2))
                o = (mx.softmax(scores, axis=-1, precise=True) @ v).reshape(B, nq * D)
            else:
                # heads first: q [B, nk, R, L, D] (R query heads per key head), k/v [B, nk, L, D]
                q = q.reshape(B, L, nk, R, D).transpose(0, 2, 3, 1, 4)
                k, v = cache.update_and_fetch(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
                o = attention(q, k, v, self._mask(shared, masks, family_of[i], L))  # [B, nk, R, L, D]
                o = o.transpose(0, 3, 1, 2, 4).reshape(B * L, nq * D)
            a = g["o"](o, b[f"o{i}"])
            gate, up = mx.split(g["gu"](_norm_of_sum(h, a, layer.post_attention_layernorm), b[f"gu{i}"]), 2, axis=-1)
            h = (h - (-a)) + g["down"](nn.silu(gate) * up, b[f"down{i}"])  # (h + a) + down, to the bit
        if want == "none":
            return None
        h = h.reshape(B, L, -1)
        if want == "last":
            h = mx.take_along_axis(h, last[:, None, None], axis=1)[:, 0, :]  # [B, hidden]
        h = inner.norm(h)
        if self.head is not None:
            return self.head(h, self.buffers["head"])
        if model.args.tie_word_embeddings:
            return inner.embed_tokens.as_linear(h)
        return model.lm_head(h)

    def _kernels(self, h: mx.array):
        """The native kernels module when this forward can run a decode step
        on it (float32 throughout; per-head norms of one eps), else None."""
        if self.native is None:
            return None
        f32 = mx.float32
        inner = self.model.model
        if h.dtype != f32 or inner.norm.weight.dtype != f32:
            return None
        for layer in self.layers:
            if layer.input_layernorm.weight.dtype != f32 or layer.post_attention_layernorm.weight.dtype != f32:
                return None
            attn = layer.self_attn
            if hasattr(attn, "q_norm") and (attn.q_norm.weight.dtype != f32 or attn.k_norm.weight.dtype != f32
                                            or attn.q_norm.eps != attn.k_norm.eps):
                return None
        return self.native

    def _decode_kernels(self, h, caches, masks, family_of, want: str, shared):
        """A decode step (L = 1) on the native kernels (:mod:`mlx_tracer.backend.kernels`):
        the same arithmetic as :meth:`__call__`, bit for bit, in fewer nodes.
        With dense float32 projections a layer is ``layer_in`` (the previous
        MLP's down projection and residual, the norm, q/k/v, RoPE and the
        cache writes) and ``layer_mid`` (attention, output projection,
        residual, norm, gate/up, SwiGLU): 2 nodes instead of 27. Otherwise
        (quantized projections) the norms, RoPE, attention and SwiGLU are
        kernels between MLX's matmuls: 11 nodes. The residual stream is
        carried as ``h`` plus the MLP's output, summed inside the next norm."""
        K = self.native
        inner, B = self.model.model, h.shape[0]
        offsets = caches[0].offset
        dense = self._dense_f32()
        carry = act = None  # the previous MLP's output (or, dense, its activation)
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            attn, g, b = layer.self_attn, self.groups[i], self.buffers
            nq, nk = attn.n_heads, attn.n_kv_heads
            norm, post = layer.input_layernorm, layer.post_attention_layernorm
            bias = self._bias(shared, masks, family_of[i], None, None, h.dtype)  # [B, 1, 1, S]
            qk = {}  # qwen3: the per-head norms, applied by the kernel before the rotation
            if hasattr(attn, "q_norm"):
                qk = dict(q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight, qk_eps=attn.q_norm.eps)
            if dense and getattr(cache, "column", None) is not None:
                qkv = b[f"qkv{i}"]
                D = qkv["wt"].shape[1] // (nq + 2 * nk)
                rot = self._rotation(shared, _table_rope(attn.rope), offsets, 1, (nq, nk, nk), D, attn.scale, h.dtype)
                down = b[f"down{i - 1}"] if act is not None else {}
                outs = K.layer_in(h, act, down.get("wt"), down.get("bias"), norm.weight, norm.eps, qkv["wt"],
                                  qkv.get("bias"), rot.C, rot.S, rot.F, nq, nk, D, cache.keys, cache.values, cache.column, **qk)
                if act is not None:
                    h, *outs = outs  # h + down, to the bit
                q, k, v = outs  # the queries, the buffers with this step's keys and values written
                cache.written(k, v)
                o, gu = b[f"o{i}"], b[f"gu{i}"]
                h, act = K.layer_mid(q, k, v, bias, o["wt"], o.get("bias"), h, post.weight, post.eps, gu["wt"],
                                     gu.get("bias"))  # h + a, silu(gate) * up
                continue
            if carry is None:
                (x,) = K.rms_norm(h, norm.weight, norm.eps)
            else:
                h, x = K.add_rms_norm(h, carry, norm.weight, norm.eps)  # h + down, to the bit
            y = g["qkv"](x, b[f"qkv{i}"])  # [B, (nq + 2 nk) * D]
            D = y.shape[-1] // (nq + 2 * nk)
            rot = self._rotation(shared, _table_rope(attn.rope), offsets, 1, (nq, nk, nk), D, attn.scale, y.dtype)
            q, k, v = K.rope_split(y, rot.C, rot.S, rot.F, B, nq, nk, D, **qk)  # [B, nk, R, D], [B, nk, 1, D] x 2
            k, v = cache.update_and_fetch(k, v)
            a = g["o"](K.decode_attention(q, k, v, bias), b[f"o{i}"])  # [B, nq * D] -> [B, hidden]
            h, x = K.add_rms_norm(h, a, post.weight, post.eps)  # h + a
            carry = g["down"](K.swiglu(g["gu"](x, b[f"gu{i}"])), b[f"down{i}"])
        if act is not None:
            carry = self.groups[-1]["down"](act, self.buffers[f"down{len(self.layers) - 1}"])
        if want == "none":
            return None
        norm = inner.norm
        if carry is None:
            (h,) = K.rms_norm(h, norm.weight, norm.eps)
        else:
            _, h = K.add_rms_norm(h, carry, norm.weight, norm.eps)
        if want == "all":
            h = h.reshape(B, 1, -1)
        if self.head is not None:
            return self.head(h, self.buffers["head"])
        if self.model.args.tie_word_embeddings:
            return inner.embed_tokens.as_linear(h)
        return self.model.lm_head(h)

    def _dense_f32(self) -> bool:
        """Whether every projection is a float32 ``Linear`` (the layer kernels' matmuls)."""
        f32 = mx.float32
        return all(grp.quant is None and all(buf[k].dtype == f32 for k in grp.keys if k != "weight") and buf["wt"].dtype == f32
                   for i, groups in enumerate(self.groups) for name, grp in groups.items()
                   for buf in (self.buffers[f"{name}{i}"],))

    @staticmethod
    def _rotation(shared, rope, offsets, L, heads, D, scale, dtype) -> HeadRotation:
        key = ("rot", rope, heads, D, scale, dtype)
        if key not in shared:
            cos, sin = rope_tables(offsets, L, *rope, dtype)
            shared[key] = HeadRotation(cos, sin, heads, D, scale)
        return shared[key]

    @staticmethod
    def _bias(shared, masks, family: int, nk: int, R: int, dtype) -> mx.array:
        """A decode step's additive mask ``[B, nk, R, S]``: 0 where visible, the
        dtype's lowest value elsewhere (the value mlx's attention fallback puts
        there; a visible score plus 0 is the score, so the softmax is the
        same). Every row sees at least one column (padding rows their own).
        ``nk = None``: the rows ``[B, 1, 1, S]``, not broadcast."""
        key = ("bias", family, nk, R, dtype)
        if key not in shared:
            rows = ("bias", family, None, None, dtype)
            if rows not in shared:
                mask = masks[family].get(1, None)  # [B, 1, 1, S]
                low = mx.array(mx.finfo(dtype).min, dtype)
                shared[rows] = mx.where(mask, mx.array(0, dtype), low)
            bias = shared[rows]
            shared[key] = bias if nk is None else mx.broadcast_to(bias, (bias.shape[0], nk, R, bias.shape[-1]))
        return shared[key]

    @staticmethod
    def _mask(shared, masks, family: int, L: int) -> mx.array:
        """The family's mask ``[B, 1, 1, L, S]`` (broadcast over key and query heads)."""
        key = ("mask", family)
        if key not in shared:
            shared[key] = mx.expand_dims(masks[family].get(L, None), 2)
        return shared[key]
