"""The weights the lean forward reads, bound once per set of model weights.

:func:`bind` walks a qualifying model once and returns a :class:`Binding`:
per layer a :class:`LayerSpec` (its head counts, rotation, norms and four
:class:`LinearGroup` s), the output head, and the *watch list* of every
(container, key, object) the binding read. The compiled step holds these
arrays as constants of its trace, so before each step the forward checks the
watch list by identity: a weight swapped (``model.update`` /
``load_weights``) or a module replaced (``nn.quantize``, sharding) means a
new binding and new traces.

q/k/v and gate/up are concatenated along the output axis into one buffer
each; the model's own ``q_proj`` / ``k_proj`` / ... then hold *views* of it,
so memory does not grow and the model's own forward computes what it did.
A group whose members differ in format (a GGUF Q4_K_M file: Q4_K blocks
beside Q6_K tensors loaded as float16 ``Linear`` s) is a :class:`SplitGroup`:
one matmul per run of members that do fuse, the results concatenated in the
group's order (the layer then reads them as it reads a fused result).

Sharded models (mlx-lm's ``shard()``): an ``AllToShardedLinear`` is
``Linear``'s arithmetic on this rank's rows and fuses like it; a
``ShardedToAllLinear`` (o/down) is a group of its own whose matmul is
all-summed over the module's group before its bias is added, where mlx puts it.

Quantized groups run on the native quantized matmul (``qmm``, handed in by
the runtime) where the residual stream is float32 and the quantization is
one it takes (affine, 4 or 8 bits, groups of 32/64/128; 2, 3, 5 and 6 bits
repacked, and 8-bit blocks of integers below 32 narrowed, by :mod:`.narrow`):
the file's blocks are read as they are, never expanded to float32. Elsewhere they run on
``mx.quantized_matmul``, as mlx-lm does. qmm's contract is *exact* unless
the model carries ``CONTRACT_ATTR = "factored"`` (the ``quantized-factored``
weight format sets it: per group, scale times the sum of q * x plus bias
times the sum of x, as MLX's Metal kernels compute) or ``"fast"`` (the
``quantized-fast`` format: activations in int8 per 32-block, integer dot
products).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import narrow as five
from . import scales as superblock
from .qualify import ARRAYS, SUMMED, runs, table_rope


class Float32RowsEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding whose rows and tied-head products are float32,
    its scales and biases kept as stored (float16 in GGUF and mlx-lm files).

    Each lookup widens the gathered rows' scales and biases to float32 before
    dequantizing (exact: float16 and bfloat16 widen without rounding), so a row
    is ``scale * q + bias`` computed in float32, the residual stream float32;
    as the tied output head it is the same matmul on the widened scales (the
    native ``qmm`` widens them itself, as it reads them). The same values as
    casting the module's scales to float32 once, but the head streams half the
    scale bytes each step (SmolLM2: 3.5 MB instead of 7 of its 35) and holds
    no float32 copy. :func:`widen_rows` turns a ``QuantizedEmbedding`` into one
    in place."""

    def __call__(self, x):
        w, bits = five.rows(self, x)  # (a tied head's held blocks, narrow.py: the rows' own integers)
        held = superblock.held_by(self)
        if held is not None:  # the tied head's superblock scales (scales.py): the rows' own, widened
            return mx.dequantize(w, scales=superblock.expand(held.scales[x]),
                                 biases=superblock.expand(held.biases[x]), group_size=self.group_size, bits=bits,
                                 mode=self.mode)
        biases = self.get("biases")
        return mx.dequantize(w, scales=self["scales"][x].astype(mx.float32),
                             biases=biases[x].astype(mx.float32) if biases is not None else None,
                             group_size=self.group_size, bits=bits, mode=self.mode)

    def as_linear(self, x):
        biases = self.get("biases")
        return mx.quantized_matmul(x, self["weight"], scales=self["scales"].astype(mx.float32),
                                   biases=biases.astype(mx.float32) if biases is not None else None,
                                   transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode)


def widen_rows(e: nn.QuantizedEmbedding) -> nn.QuantizedEmbedding:
    """``e`` as a :class:`Float32RowsEmbedding`, in place (its arrays untouched); returns it."""
    if type(e) is nn.QuantizedEmbedding:
        e.__class__ = Float32RowsEmbedding
    return e


QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding, Float32RowsEmbedding, nn.QuantizedAllToShardedLinear,
             nn.QuantizedShardedToAllLinear)
QMM_BITS, QMM_GROUPS = (4, 8), (32, 64, 128)
QMM_SCALES = (mx.float16, mx.bfloat16, mx.float32, mx.uint8)  # uint8: superblock scales (scales.py)
CONTRACT_ATTR = "mlx_tracer_qmm_contract"  # a model attribute: qmm's contract (absent: "exact")
QMM_CONTRACTS = ("exact", "factored", "fast", "split")


def _every(forms: list) -> Optional[list]:
    """``forms`` where every member has its form, else None."""
    return None if any(f is None for f in forms) else forms


def _held(mods, forms: List[tuple], hold) -> List[mx.array]:
    """The members' held forms (``forms[i]``: member i's arrays) concatenated
    along rows into one buffer each, every member then given its rows of
    them by ``hold(module, *rows)``; the buffers."""
    bufs = [mx.concatenate(part, axis=0) if len(part) > 1 else part[0] for part in zip(*forms)]
    mx.eval(bufs)
    start = 0
    for m, form in zip(mods, forms):
        n = form[0].shape[0]
        rows = [b[start : start + n] for b in bufs]
        mx.eval(rows)
        hold(m, *rows)
        start += n
    return bufs


class LinearGroup:
    """Linears that read the same input (q/k/v, gate/up) and share one matmul
    (:func:`~.qualify.fusable`), computed as one.

    Its arrays ``p`` are constants of the lean trace: a dense weight as its
    transposed view ``wt`` (the matmul reads the same memory the same way as
    ``x @ weight.T``, with no transpose node), quantized ones as they are.
    ``qmm``: the native quantized matmul, used where it takes the group's
    quantization (:attr:`kernel`), else ``mx.quantized_matmul``; under
    ``contract`` (one of :data:`QMM_CONTRACTS`). ``reduce``: the group a sharded-to-all
    linear all-sums its matmul over (None: no all-sum). ``factor``: the
    kernels' ``superblocks`` (:func:`.scales.factor`; None: float32 scales stay);
    ``narrow``: the kernels' ``narrow`` (:func:`.narrow.narrow`; None: the
    modules' blocks stay as they are). ``bits``: the bits of the blocks the
    group holds (the modules' own, or qmm's 5- or 6-bit layout where it
    holds such blocks of their integers: ``narrowed``).
    """

    def __init__(self, mods, qmm=None, contract: str = "exact", factor=None, narrow=None):
        self.mods = list(mods)
        self.contract = contract
        m0 = self.mods[0]
        self.quant = (m0.group_size, m0.bits, m0.mode) if type(m0) in QUANTIZED else None
        self.bits = self.quant[1] if self.quant is not None else None
        self.narrowed = False  # the group holds qmm's 5- or 6-bit blocks (narrow.py)
        self.reduce = m0.group if type(m0) in SUMMED else None
        self.keys = [k for k in ARRAYS if k in m0]
        self.runs = [self]  # the matmuls of the group: this one
        self.p = self._build(qmm is not None, factor, narrow)
        self.kernel = qmm if qmm is not None and self._qmm_takes() else None

    def _qmm_takes(self) -> bool:
        if self.quant is None or "biases" not in self.p:
            return False
        group_size, bits, mode = self.quant
        return (mode == "affine" and (bits in QMM_BITS or self.narrowed) and group_size in QMM_GROUPS
                and self.p["scales"].dtype in QMM_SCALES and self.p["biases"].dtype == self.p["scales"].dtype)

    def _superblocks(self, kernel: bool, factor) -> Optional[List[tuple]]:
        """Each member's scales and biases in superblock form (:mod:`.scales`:
        the k-quants' float32 ones at 0.75 bits a weight instead of 2, the
        same values), where the native matmul will read them and every
        member has them; else None."""
        if not kernel or self.quant is None or not superblock.enabled():
            return None
        group_size, bits, mode = self.quant
        if group_size != 32 or bits not in QMM_BITS or mode != "affine":
            return None  # (a format qmm does not take keeps its scales: mx.quantized_matmul reads them)
        if any(type(m) not in (nn.QuantizedLinear, Float32RowsEmbedding) for m in self.mods):
            return None  # (sharded linears: their own arrays; a plain QuantizedEmbedding's lookups read its scales)
        return _every([superblock.of_module(m, factor) for m in self.mods])

    def _narrowed(self, kernel: bool, narrow) -> Optional[List[mx.array]]:
        """Each member's weight in qmm's 5- or 6-bit layout (:mod:`.narrow`:
        8-bit blocks of integers below 32, GGUF's Q5 types, as 5 bits, of
        integers below 64 as 6; MLX's 5- and 6-bit blocks repacked), where the
        native matmul will read them and every member has them in one layout;
        else None."""
        if not kernel or self.quant is None:
            return None
        group_size, bits, mode = self.quant
        m0 = self.mods[0]
        if bits not in five.TO or mode != "affine" or group_size not in QMM_GROUPS or "biases" not in m0:
            return None
        if m0["scales"].dtype not in QMM_SCALES or m0["biases"].dtype != m0["scales"].dtype:
            return None  # (qmm will not take the group: mx.quantized_matmul reads the modules' blocks)
        if any(type(m) not in (nn.QuantizedLinear, Float32RowsEmbedding) for m in self.mods):
            return None  # (a plain QuantizedEmbedding's lookups and sharded linears read their own arrays)
        def one_layout(forms):
            return forms if forms is not None and len({f.shape[-1] for f in forms}) == 1 else None

        forms = one_layout(_every([five.of_module(m, narrow) for m in self.mods]))  # 8-bit: 5 bits where all fit
        if forms is None and bits == 8:  # ... else 6 (Q6_K under MLX_TRACER_Q6_K=int6)
            forms = one_layout(_every([five.of_module(m, narrow, 6) for m in self.mods]))
        return forms

    def _build(self, kernel: bool, factor=None, narrow=None) -> Dict[str, mx.array]:
        sb = self._superblocks(kernel, factor)
        w5 = self._narrowed(kernel, narrow)
        keys = [k for k in self.keys if (sb is None or k not in ("scales", "biases")) and (w5 is None or k != "weight")]
        if len(self.mods) > 1:
            fused = {k: mx.concatenate([m[k] for m in self.mods], axis=0) for k in keys}
            mx.eval(fused)
            start = 0
            for m in self.mods:  # the modules hold views of the fused buffer from now on
                n = m["weight"].shape[0]
                for k in keys:
                    m[k] = fused[k][start : start + n]
                start += n
            mx.eval([m[k] for m in self.mods for k in keys])
        else:
            fused = {k: self.mods[0][k] for k in keys}
        if sb is not None:  # one scales and one biases buffer, the modules lazy float32 of their rows
            fused["scales"], fused["biases"] = _held(self.mods, sb, superblock.hold)
        if w5 is not None:  # one buffer of qmm's blocks, the modules lazy blocks of their rows in their own layout
            fused["weight"], = _held(self.mods, [(w,) for w in w5], five.hold)
            self.bits, self.narrowed = five.form_bits(self.mods[0]), True
        if self.quant is None:
            fused["wt"] = fused.pop("weight").T
        mx.eval(fused)
        return fused

    @property
    def outputs(self) -> int:
        """Columns of the group's result."""
        return self.p["wt"].shape[1] if self.quant is None else self.p["weight"].shape[0]

    def dense_f32(self) -> bool:
        """A float32 ``Linear`` (what the layer kernels' matmuls take)."""
        return self.quant is None and all(a.dtype == mx.float32 for a in self.p.values())

    def watch(self) -> List[tuple]:
        return [(m, k, m[k]) for m in self.mods for k in self.keys]

    def __call__(self, x: mx.array) -> mx.array:
        """``x [M, in]`` through the group: ``[M, sum of outputs]``, computed
        as mlx's ``Linear`` / ``QuantizedLinear`` (or their sharded forms) computes each part."""
        p = self.p
        if self.quant is None:
            if self.reduce is None:
                return mx.addmm(p["bias"], x, p["wt"]) if "bias" in p else x @ p["wt"]
            y = x @ p["wt"]  # ShardedToAllLinear: no addmm, the bias comes after the sum
        elif self.kernel is not None:  # 2-D in and out (the head gets [B, L, hidden])
            y = self.kernel(x.reshape(-1, x.shape[-1]), p["weight"], p["scales"], p["biases"], group_size=self.quant[0],
                            bits=self.bits, contract=self.contract).reshape(*x.shape[:-1], -1)
        else:
            group_size, bits, mode = self.quant
            y = mx.quantized_matmul(x, p["weight"], scales=p["scales"], biases=p.get("biases"), transpose=True,
                                    group_size=group_size, bits=bits, mode=mode)
        if self.reduce is not None:
            y = mx.distributed.all_sum(y, group=self.reduce)
        return y + p["bias"] if "bias" in p else y


class SplitGroup:
    """Linears that read the same input but do not all share one matmul (their
    formats differ): one :class:`LinearGroup` per run of consecutive members
    that do (:func:`~.qualify.runs`), each computed as its modules compute
    it (quantized runs on ``qmm`` where it takes them), the results
    concatenated in the group's order. The native layer kernels take one
    weight per slot: layers with such a group run on MLX's ops."""

    quant = None
    reduce = None
    kernel = None

    def __init__(self, parts, qmm=None, contract: str = "exact", factor=None, narrow=None):
        self.runs = [LinearGroup(run, qmm, contract, factor, narrow) for run in parts]
        self.mods = [m for g in self.runs for m in g.mods]
        self.contract = contract
        # the runs' biases joined (the native layer_in's b_qkv), made once: None unless every run has one
        self.bias = None
        if all("bias" in g.p for g in self.runs):
            self.bias = mx.concatenate([g.p["bias"] for g in self.runs])
            mx.eval(self.bias)

    @property
    def outputs(self) -> int:
        return sum(g.outputs for g in self.runs)

    def dense_f32(self) -> bool:
        return False

    def watch(self) -> List[tuple]:
        return [w for g in self.runs for w in g.watch()]

    def describe(self) -> str:
        """The runs' formats, in order (for the reasons the kernels give)."""
        return " + ".join(_format(g) for g in self.runs)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([g(x) for g in self.runs], axis=-1)


def _format(g: LinearGroup) -> str:
    if g.quant is not None:
        group_size, bits, mode = g.quant
        return f"{mode} {bits}-bit g{group_size}"
    return str(g.p["wt"].dtype).replace("mlx.core.", "")


def linear_group(mods, qmm=None, contract: str = "exact", factor=None, narrow=None):
    """The group of ``mods`` (in order): a :class:`LinearGroup` where they share
    one matmul, else a :class:`SplitGroup` of the runs that do."""
    parts = runs(list(mods))
    if len(parts) == 1:
        return LinearGroup(parts[0], qmm, contract, factor, narrow)
    return SplitGroup(parts, qmm, contract, factor, narrow)


@dataclass
class LayerSpec:
    """One decoder layer as the lean forward reads it."""

    index: int
    nq: int  # query heads
    nk: int  # key/value heads
    D: int  # head dimension
    rope: Tuple[int, float, float]  # nn.RoPE's (dims, base, scale)
    scale: float  # attention scale (applied to queries after the rotation)
    input_norm: nn.RMSNorm
    post_norm: nn.RMSNorm
    qk_norms: Optional[Tuple[nn.RMSNorm, nn.RMSNorm]]  # qwen3's per-head norms, before the rotation
    qkv: "LinearGroup | SplitGroup"
    o: LinearGroup
    gu: "LinearGroup | SplitGroup"
    down: LinearGroup

    @property
    def R(self) -> int:
        """Query heads per key head."""
        return self.nq // self.nk

    def groups(self) -> Dict[str, "LinearGroup | SplitGroup"]:
        return {"qkv": self.qkv, "o": self.o, "gu": self.gu, "down": self.down}

    def split(self) -> List[str]:
        """Names of the groups that do not share one matmul (mixed formats)."""
        return [name for name, g in self.groups().items() if len(g.runs) > 1]

    def sharded(self) -> bool:
        """Whether an o/down projection all-sums over a group (a sharded model)."""
        return any(g.reduce is not None for g in self.groups().values())


@dataclass
class Binding:
    """Everything the lean forward reads of one set of model weights."""

    layers: List[LayerSpec]
    norm: nn.RMSNorm  # the final norm
    head: Optional[LinearGroup]  # a dense head (or tied dense embedding) as a group; None: the module's own call
    head_module: nn.Module  # the tied embedding or lm_head
    tied: bool
    embed: nn.Module
    watch: List[tuple] = field(default_factory=list)
    contract: str = "exact"  # qmm's, for every quantized group

    @property
    def uses_qmm(self) -> bool:
        """Whether some projection or the head runs on the native quantized matmul."""
        groups = [g for s in self.layers for g in s.groups().values()] + ([self.head] if self.head is not None else [])
        return any(run.kernel is not None for g in groups for run in getattr(g, "runs", [g]))

    @property
    def activation_dtype(self):
        """The residual stream's dtype (what the embedding returns)."""
        return _embedding_dtype(self.embed)

    def buffers(self) -> Dict[str, Dict[str, mx.array]]:
        """The groups' arrays by name (``qkv0``, ..., ``head``; a split group's
        runs as ``qkv0.0``, ``qkv0.1``, ...)."""
        out = {}
        for s in self.layers:
            for name, g in s.groups().items():
                if len(g.runs) == 1:
                    out[f"{name}{s.index}"] = g.p
                else:
                    out.update({f"{name}{s.index}.{j}": r.p for j, r in enumerate(g.runs)})
        if self.head is not None:
            out["head"] = self.head.p
        return out

    def logits(self, h: mx.array) -> mx.array:
        """The output head on normed ``h [..., hidden]``."""
        if self.head is not None:
            return self.head(h)
        return self.head_module.as_linear(h) if self.tied else self.head_module(h)


def _embedding_dtype(e):
    if isinstance(e, Float32RowsEmbedding):
        return mx.float32
    return e.scales.dtype if isinstance(e, nn.QuantizedEmbedding) else e.weight.dtype


def bind(model, qmm=None, factor=None, narrow=None) -> Binding:
    """The binding of a qualifying model (:func:`~.qualify.why_not` is None).
    ``qmm``: the native quantized matmul (float32 activations only), under
    the model's ``CONTRACT_ATTR`` ("exact" if it has none); ``factor``: the
    kernels' ``superblocks`` (:func:`.scales.factor`); ``narrow``: their
    ``narrow`` (:func:`.narrow.narrow`)."""
    contract = getattr(model, CONTRACT_ATTR, "exact")
    if contract not in QMM_CONTRACTS:
        raise ValueError(f"{CONTRACT_ATTR} must be one of {QMM_CONTRACTS}, got {contract!r}")
    inner = model.model
    tied = bool(model.args.tie_word_embeddings)
    norms = [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if _embedding_dtype(inner.embed_tokens) != mx.float32 or any(n.weight.dtype != mx.float32 for n in norms):
        qmm = None  # it takes float32 x: the residual stream must stay float32
    watch = [(model, "model", inner), (inner, "layers", inner.layers)]
    specs = []
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        watch += [(inner.layers, i, layer), (layer, "self_attn", attn), (layer, "mlp", mlp)]
        groups = {}
        for name, parent, keys in (("qkv", attn, ("q_proj", "k_proj", "v_proj")), ("o", attn, ("o_proj",)),
                                   ("gu", mlp, ("gate_proj", "up_proj")), ("down", mlp, ("down_proj",))):
            group = groups[name] = linear_group([parent[k] for k in keys], qmm, contract, factor, narrow)
            watch += [(parent, k, m) for k, m in zip(keys, group.mods)] + group.watch()
        nq, nk = attn.n_heads, attn.n_kv_heads
        qk = (attn.q_norm, attn.k_norm) if "q_norm" in attn else None
        specs.append(LayerSpec(i, nq, nk, groups["qkv"].outputs // (nq + 2 * nk), table_rope(attn.rope), attn.scale,
                               layer.input_layernorm, layer.post_attention_layernorm, qk, **groups))
        # the modules the lean forward calls itself
        watch += [(layer, "input_layernorm", layer.input_layernorm), (layer, "post_attention_layernorm", layer.post_attention_layernorm)]
        watch += [(attn, k, attn[k]) for k in ("q_norm", "k_norm") if k in attn]
    head_module = inner.embed_tokens if tied else model.lm_head
    head_types = (nn.Linear, nn.Embedding) + ((nn.QuantizedLinear, nn.QuantizedEmbedding, Float32RowsEmbedding)
                                              if qmm is not None else ())
    head = LinearGroup([head_module], qmm, contract, factor, narrow) if type(head_module) in head_types else None
    if isinstance(head_module, Float32RowsEmbedding) and head is not None and head.kernel is None:
        head = None  # a format qmm does not take: the module's own float32 arithmetic (as_linear)
    watch += [(inner, "embed_tokens", inner.embed_tokens), (inner, "norm", inner.norm)]
    if not tied:
        watch.append((model, "lm_head", model.lm_head))
    if head is not None:
        watch += head.watch()
    return Binding(specs, inner.norm, head, head_module, tied, inner.embed_tokens, watch, contract)
