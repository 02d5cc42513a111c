"""The native CPU kernels (mlx_tracer.backend.kernels): each computes the
bits of the MLX ops the lean forward otherwise runs (eagerly and inside
mx.compile, on strided views, with padding rows), the lean forward runs a
decode step on them with the same logits as on MLX's ops, cache buffers are
written in place only when nothing else holds them, bad inputs are refused
with a clear error, and MLX_TRACER_KERNELS=0 turns them off. The decode
attention is pinned to its BLAS arithmetic here (MLX's bits); its vector
arithmetic, which ``auto`` picks beside packed projections, is checked in
tests/test_attention.py."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_tracer.adapters.lean import HeadRotation, norm_of_sum, rope_tables
from mlx_tracer.adapters.lean.native import stored
from mlx_tracer.adapters.lean.ops import attention as lean_attention
from mlx_tracer.adapters.lean.ops import quantized_mm
from mlx_tracer.adapters.lean.weights import CONTRACT_ATTR
from mlx_tracer.backend import kernels
from mlx_tracer.caches.storage import KVFormat
from mlx_tracer.runtime.prefill import feed
from mlx_tracer.runtime.step import CompiledModel

from .helpers import assert_decode_writes_in_place
from .tiny_models import tiny_model

K = kernels.load()
LOW = mx.array(mx.finfo(mx.float32).min, mx.float32)


@pytest.fixture(autouse=True)
def blas_attention():
    """MLX's bits in every attention of this module (see the docstring)."""
    if K is None:
        yield
        return
    before = K.attention_mode()
    K.attention_mode("blas")
    try:
        yield
    finally:
        K.attention_mode(before)


def test_the_kernels_build_and_load():
    assert K is not None, kernels.status()
    assert kernels.status().startswith("active")


def same(a, b):
    mx.eval(a, b)
    return a.shape == b.shape and mx.array_equal(a, b).item()


def rotation(B, nq, nk, D, offsets, values=True):
    cos, sin = rope_tables(mx.array(offsets), 1, D, 10000.0, 1.0, mx.float32)
    return HeadRotation(cos, sin, (nq, nk, nk if values else 0), D, D**-0.5)


def linear(n_in, n_out, bias):
    m = nn.Linear(n_in, n_out, bias=bias)
    mx.eval(m.parameters())
    return m


def mm(x, m):
    """x @ m.weight.T (+ bias), as the lean forward's groups compute it."""
    return mx.addmm(m.bias, x, m.weight.T) if "bias" in m else x @ m.weight.T


def attention_ref(q, k, v, bias):
    """The lean forward's decode attention on MLX's ops."""
    B, nk, R, D = q.shape
    scores = mx.addmm(mx.broadcast_to(bias, (B, nk, R, k.shape[2])), q, k.swapaxes(-1, -2))
    return (mx.softmax(scores, axis=-1, precise=True) @ v).reshape(B, nk * R * D)


def norm(n, seed, eps=1e-5):
    m = nn.RMSNorm(n, eps=eps)
    m.weight = mx.random.normal((n,), key=mx.random.key(seed))
    return m


def test_the_kernels_list_their_inputs_once():
    names = dict(K.inputs("layer_in"))
    assert list(names)[:2] == ["h", "act"] and names["h"] and not names["act"] and not names["q_norm"]
    assert [n for n, required in K.inputs("layer_mid") if not required] == [
        "k_scales", "k_biases", "v_scales", "v_biases", "bias", "mask", "w_o_scales", "w_o_biases", "b_o",
        "w_gu_scales", "w_gu_biases", "b_gu"]
    with pytest.raises(ValueError, match="no kernel 'nope'"):
        K.inputs("nope")


@pytest.mark.parametrize("B,nq,nk,D,bias,qk", [(1, 9, 3, 64, False, False), (2, 4, 2, 16, True, False),
                                                (4, 8, 8, 32, False, True), (3, 4, 2, 16, True, True)])
def test_layer_in_equals_the_lean_ops(B, nq, nk, D, bias, qk):
    """Down projection + residual, norm, q/k/v, qwen3's per-head norms and RoPE
    against the lean forward's MLX ops, bit for bit (eager and compiled)."""
    mx.random.seed(B + nq)
    hid, F = 64, 96
    N = (nq + 2 * nk) * D
    down, qkv = linear(F, hid, bias), linear(hid, N, bias)
    n_in = norm(hid, 1)
    qn, kn = norm(D, 2, 1e-6), norm(D, 3, 1e-6)
    h, act = mx.random.normal((B, hid)), mx.random.normal((B, F)) * 2
    offsets = list(range(5, 5 + 7 * B, 7))
    rot = rotation(B, nq, nk, D, offsets)
    h1 = h + mm(act, down)
    y = mm(n_in(h1), qkv)
    if qk:  # per-head norms, then the rotation of q and k only (values kept), as the ops path
        heads = mx.split(y.reshape(B, nq + 2 * nk, 1, D), [nq, nq + nk], axis=1)
        q, k = mx.split(rotation(B, nq, nk, D, offsets, values=False)(mx.concatenate([qn(heads[0]), kn(heads[1])], axis=1)),
                        [nq], axis=1)
        v = heads[2]
    else:
        q, k, v = mx.split(rot(y), [nq, nq + nk], axis=1)
    inputs = dict(h=h, act=act, w_down=down.weight.T, b_down=down.get("bias"), norm=n_in.weight, w_qkv=qkv.weight.T,
                  b_qkv=qkv.get("bias"), cos=rot.C, sin=rot.S, scale=rot.F)
    if qk:
        inputs.update(q_norm=qn.weight, k_norm=kn.weight)
    kw = dict(eps=1e-5, nq=nq, nk=nk, D=D, qk_eps=1e-6)
    got = K.layer_in(inputs, **kw)
    assert len(got) == 4
    assert same(got[0], h1) and same(got[1], q.reshape(B, nk, nq // nk, D)) and same(got[2], k) and same(got[3], v)
    compiled = mx.compile(lambda h, act: K.layer_in(dict(inputs, h=h, act=act), **kw))(h, act)
    assert all(same(a, b) for a, b in zip(compiled, got))
    # the first layer: no previous MLP
    first = {k: v for k, v in inputs.items() if k not in ("act", "w_down", "b_down")}
    q0 = K.layer_in(first, **kw)[0]
    assert len(K.layer_in(first, **kw)) == 3
    y0 = mm(n_in(h), qkv)
    if not qk:
        assert same(q0, mx.split(rot(y0), [nq], axis=1)[0].reshape(B, nk, nq // nk, D))
    # a strided view (a transposed array) gives the same as its contiguous copy
    t = mx.contiguous(h.T).T
    assert same(K.layer_in(dict(first, h=t), **kw)[0], q0)


@pytest.mark.parametrize("B,nk,R,D,S,bias", [(1, 3, 3, 64, 128, False), (2, 2, 4, 16, 1024, True), (3, 1, 1, 8, 5, False)])
def test_layer_mid_equals_the_lean_ops(B, nk, R, D, S, bias):
    """Attention, output projection, residual, post-attention norm, gate/up and
    SwiGLU against the lean forward's MLX ops, bit for bit."""
    mx.random.seed(S)
    hid, F = 48, 80
    o, gu = linear(nk * R * D, hid, bias), linear(hid, 2 * F, bias)
    post = norm(hid, 4)
    q = mx.random.normal((B, nk, R, D)) * D**-0.5
    k, v = mx.random.normal((B, nk, S, D)), mx.random.normal((B, nk, S, D))
    mask_bias = mx.where(mx.random.uniform(shape=(B, 1, 1, S)) > 0.3, mx.array(0.0), LOW)
    mask_bias[:, :, :, 0] = 0.0  # every row sees a column
    h = mx.random.normal((B, hid))
    a = mm(attention_ref(q, k, v, mask_bias), o)
    gate, up = mx.split(mm(norm_of_sum(h, a, post), gu), 2, axis=-1)
    inputs = dict(q=q, k=k, v=v, bias=mask_bias, w_o=o.weight.T, b_o=o.get("bias"), h=h, norm=post.weight,
                  w_gu=gu.weight.T, b_gu=gu.get("bias"))
    h2, act = K.layer_mid(inputs, eps=1e-5)
    assert same(h2, h + a) and same(act, nn.silu(gate) * up)
    # keys as a slice of a larger buffer (strided between blocks)
    big = mx.concatenate([k, mx.random.normal((B, nk, 3, D))], axis=2)
    h3, act3 = K.layer_mid(dict(inputs, k=big[:, :, :S]), eps=1e-5)
    assert same(h3, h2) and same(act3, act)


class Packed:
    """A Linear as MLX's packed blocks (mx.quantize), scales and biases in
    ``dtype``: the weight slot ``slot`` of the kernels, and the lean ops'
    matmul for it (qmm's exact contract, then + bias)."""

    def __init__(self, m, group, bits, dtype, contract="exact"):
        self.w, s, b = mx.quantize(m.weight, group_size=group, bits=bits)
        self.s, self.b = s.astype(dtype), b.astype(dtype)
        self.bias, self.group, self.bits, self.contract = m.get("bias"), group, bits, contract

    def slot(self, name):
        return {name: self.w, f"{name}_scales": self.s, f"{name}_biases": self.b}

    def __call__(self, x):
        y = K.qmm(x, self.w, self.s, self.b, group_size=self.group, bits=self.bits, contract=self.contract)
        return y + self.bias if self.bias is not None else y


@pytest.mark.parametrize("B,bits,group,dtype,bias,contract", [
    (1, 4, 32, mx.float16, False, "exact"), (3, 4, 64, mx.float32, True, "exact"), (8, 8, 32, mx.bfloat16, True, "exact"),
    (5, 8, 128, mx.float16, False, "exact"), (1, 4, 32, mx.float16, True, "fast"), (6, 8, 64, mx.float16, False, "fast"),
    (1, 4, 32, mx.float16, True, "factored"), (5, 8, 64, mx.bfloat16, False, "factored"),
    (1, 4, 32, mx.float16, True, "split"), (4, 8, 128, mx.float32, False, "split")])
def test_layer_kernels_on_packed_blocks_equal_the_lean_ops_on_qmm(B, bits, group, dtype, bias, contract):
    """Projections given as packed 4-/8-bit blocks: the bits of the lean ops
    path, which calls qmm for each (then adds the bias), in each contract."""
    mx.random.seed(B + bits)
    nq, nk, D, hid, F = 4, 2, 32, 128, 256
    pack = lambda m: Packed(m, group, bits, dtype, contract)  # noqa: E731
    down, qkv = pack(linear(F, hid, bias)), pack(linear(hid, (nq + 2 * nk) * D, bias))
    o, gu = pack(linear(nq * D, hid, bias)), pack(linear(hid, 2 * F, bias))
    n_in, post = norm(hid, 1), norm(hid, 2)
    h, act = mx.random.normal((B, hid)), mx.random.normal((B, F))
    rot = rotation(B, nq, nk, D, list(range(3, 3 + B)))
    h1 = h + down(act)
    q, k, v = mx.split(rot(qkv(n_in(h1))), [nq, nq + nk], axis=1)
    got = K.layer_in(dict(h=h, act=act, **down.slot("w_down"), b_down=down.bias, norm=n_in.weight, **qkv.slot("w_qkv"),
                          b_qkv=qkv.bias, cos=rot.C, sin=rot.S, scale=rot.F), eps=1e-5, nq=nq, nk=nk, D=D,
                     contract=contract)
    assert same(got[0], h1) and same(got[1], q.reshape(B, nk, nq // nk, D)) and same(got[2], k) and same(got[3], v)
    S = 17
    keys, values = mx.random.normal((B, nk, S, D)), mx.random.normal((B, nk, S, D))
    mask_bias = mx.zeros((B, 1, 1, S))
    a = o(attention_ref(got[1], keys, values, mask_bias))
    gate, up = mx.split(gu(norm_of_sum(h1, a, post)), 2, axis=-1)
    h2, act2 = K.layer_mid(dict(q=got[1], k=keys, v=values, bias=mask_bias, **o.slot("w_o"), b_o=o.bias, h=h1,
                                norm=post.weight, **gu.slot("w_gu"), b_gu=gu.bias), eps=1e-5, contract=contract)
    assert same(h2, h1 + a) and same(act2, nn.silu(gate) * up)


@pytest.mark.parametrize("B,L,nq,nk,D,S,packed", [(1, 5, 9, 3, 64, 40, False), (2, 3, 4, 2, 16, 9, True),
                                                  (3, 8, 4, 4, 32, 20, False)])
def test_window_layers_equal_the_lean_ops(B, L, nq, nk, D, S, packed):
    """A window of L tokens a row (verify, prefill): layer_in writes q/k/v
    heads first ([B, nk, R, L, D], [B, nk, L, D]) and layer_mid attends
    under a boolean mask, both the bits of the lean ops' window path."""
    mx.random.seed(B * L)
    hid, F, R = 64, 96, nq // nk
    qkv, o, gu = linear(hid, (nq + 2 * nk) * D, True), linear(nq * D, hid, False), linear(hid, 2 * F, True)
    if packed:
        qkv, o, gu = (Packed(m, 32, 4, mx.float16) for m in (qkv, o, gu))
        slot = lambda name, m: m.slot(name)  # noqa: E731
    else:
        slot = lambda name, m: {name: m.weight.T}  # noqa: E731
    proj = (lambda m, x: m(x)) if packed else (lambda m, x: mm(x, m))
    bias = (lambda m: m.bias) if packed else (lambda m: m.get("bias"))
    n_in, post = norm(hid, 1), norm(hid, 2)
    h = mx.random.normal((B * L, hid))
    offsets = list(range(4, 4 + 3 * B, 3))
    cos, sin = rope_tables(mx.array(offsets), L, D, 10000.0, 1.0, mx.float32)
    rot = HeadRotation(cos, sin, (nq, nk, nk), D, D**-0.5)
    q, k, v = mx.split(rot(proj(qkv, n_in(h))), [nq, nq + nk], axis=2)  # [B, L, H, D] each
    got = K.layer_in(dict(h=h, norm=n_in.weight, **slot("w_qkv", qkv), b_qkv=bias(qkv), cos=rot.C, sin=rot.S,
                          scale=rot.F), eps=1e-5, nq=nq, nk=nk, D=D, L=L)
    q5 = q.reshape(B, L, nk, R, D).transpose(0, 2, 3, 1, 4)
    assert same(got[0], q5) and same(got[1], k.transpose(0, 2, 1, 3)) and same(got[2], v.transpose(0, 2, 1, 3))
    keys, values = mx.random.normal((B, nk, S, D)), mx.random.normal((B, nk, S, D))
    mask = mx.random.uniform(shape=(B, 1, 1, L, S)) > 0.4
    mask[..., 0] = True  # every query sees a column
    ops_o = lean_attention(q5, keys, values, mask).transpose(0, 3, 1, 2, 4).reshape(B * L, nq * D)
    a = proj(o, ops_o)
    gate, up = mx.split(proj(gu, norm_of_sum(h, a, post)), 2, axis=-1)
    h2, act = K.layer_mid(dict(q=got[0], k=keys, v=values, mask=mask, **slot("w_o", o), b_o=bias(o), h=h,
                               norm=post.weight, **slot("w_gu", gu), b_gu=bias(gu)), eps=1e-5)
    assert same(h2, h + a) and same(act, nn.silu(gate) * up)
    with pytest.raises(ValueError, match=r"needs mask \[B, 1, 1, L, S\], no bias"):
        K.layer_mid(dict(q=got[0], k=keys, v=values, bias=mx.zeros((B, 1, 1, S)), **slot("w_o", o), h=h,
                         norm=post.weight, **slot("w_gu", gu)), eps=1e-5)


@pytest.mark.parametrize("path", ["portable", "avx2", "avx512"])
@pytest.mark.parametrize("contract", ["exact", "factored", "fast", "split"])
def test_packed_layer_kernels_on_every_isa_path(path, contract):
    """The layer kernels' packed projections run qmm on the path it picks:
    forced one by one, each still gives the ops path's bits (on that path)."""
    before = K.qmm_isa()
    try:
        if K.qmm_set_isa(path) != path:
            pytest.skip(f"this CPU has no {path}")
        test_layer_kernels_on_packed_blocks_equal_the_lean_ops_on_qmm(3, 4, 32, mx.float16, True, contract)
        test_window_layers_equal_the_lean_ops(2, 3, 4, 2, 16, 9, True)
    finally:
        K.qmm_set_isa(before)


@pytest.mark.parametrize("path", ["portable", "avx2", "avx512"])
@pytest.mark.parametrize("contract", ["exact", "factored", "fast", "split"])
@pytest.mark.parametrize("B,L,bias", [(1, 1, False), (1, 1, True), (3, 1, True), (2, 5, False), (2, 5, True)])
def test_layer_in_takes_q_k_v_in_two_formats(path, contract, B, L, bias):
    """q/k as 4-bit blocks (float16 scales) beside v as 8-bit ones (float32,
    as a k-quant file's Q6_K): layer_in's w_qkv and w_qkv2 give the bits of
    the lean ops, which run each part's qmm and join the columns (SplitGroup),
    in decode steps and windows, on every ISA path; and the same bits as
    one slot where both parts are one format."""
    before = K.qmm_isa()
    try:
        if K.qmm_set_isa(path) != path:
            pytest.skip(f"this CPU has no {path}")
        mx.random.seed(B * L + 7)
        nq, nk, D, hid = 4, 2, 32, 128
        qk_lin, v_lin = linear(hid, (nq + nk) * D, bias), linear(hid, nk * D, bias)
        qk, v = Packed(qk_lin, 32, 4, mx.float16, contract), Packed(v_lin, 32, 8, mx.float32, contract)
        n_in = norm(hid, 3)
        h = mx.random.normal((B * L, hid))
        cos, sin = rope_tables(mx.array(list(range(2, 2 + 4 * B, 4))), L, D, 10000.0, 1.0, mx.float32)
        rot = HeadRotation(cos, sin, (nq, nk, nk), D, D**-0.5)
        x = n_in(h)
        y = mx.concatenate([qk(x), v(x)], axis=-1)
        b_qkv = mx.concatenate([qk.bias, v.bias]) if bias else None
        kw = dict(eps=1e-5, nq=nq, nk=nk, D=D, L=L, contract=contract)
        base = dict(h=h, norm=n_in.weight, cos=rot.C, sin=rot.S, scale=rot.F)
        got = K.layer_in(dict(base, **qk.slot("w_qkv"), **v.slot("w_qkv2"), b_qkv=b_qkv), **kw)
        if L == 1:  # as test_layer_kernels_on_packed_blocks_equal_the_lean_ops_on_qmm
            q_, k_, v_ = mx.split(rot(y), [nq, nq + nk], axis=1)
            assert same(got[0], q_.reshape(B, nk, nq // nk, D)) and same(got[1], k_) and same(got[2], v_)
        else:  # as test_window_layers_equal_the_lean_ops
            q_, k_, v_ = mx.split(rot(y), [nq, nq + nk], axis=2)  # [B, L, H, D] each
            q5 = q_.reshape(B, L, nk, nq // nk, D).transpose(0, 2, 3, 1, 4)
            assert same(got[0], q5) and same(got[1], k_.transpose(0, 2, 1, 3)) and same(got[2], v_.transpose(0, 2, 1, 3))
        # one format in two parts (rows split anywhere): the bits of one slot
        whole = Packed(linear(hid, (nq + 2 * nk) * D, bias), 32, 4, mx.float16, contract)
        cut = 40
        first = dict(w_qkv=whole.w[:cut], w_qkv_scales=whole.s[:cut], w_qkv_biases=whole.b[:cut])
        second = dict(w_qkv2=whole.w[cut:], w_qkv2_scales=whole.s[cut:], w_qkv2_biases=whole.b[cut:])
        one = K.layer_in(dict(base, **whole.slot("w_qkv"), b_qkv=whole.bias), **kw)
        two = K.layer_in(dict(base, **first, **second, b_qkv=whole.bias), **kw)
        assert all(same(a, b) for a, b in zip(one, two))
    finally:
        K.qmm_set_isa(before)


def test_layer_in_checks_its_second_q_k_v_part():
    nq, nk, D, hid = 2, 1, 8, 64
    rot = rotation(1, nq, nk, D, [3])
    w, s, b = mx.quantize(mx.random.normal(((nq + 2 * nk) * D, hid)), group_size=32, bits=4)
    good = dict(h=mx.ones((1, hid)), norm=mx.ones((hid,)), w_qkv=w[:24], w_qkv_scales=s[:24], w_qkv_biases=b[:24],
                w_qkv2=w[24:], w_qkv2_scales=s[24:], w_qkv2_biases=b[24:], cos=rot.C, sin=rot.S, scale=rot.F)
    kw = dict(eps=1e-5, nq=nq, nk=nk, D=D)
    assert len(K.layer_in(good, **kw)) == 3
    with pytest.raises(ValueError, match=r"layer_in: w_qkv2 with scales must be packed uint32 \[N, 64 bits / 32\]"):
        K.layer_in(dict(good, w_qkv2=w[20:], w_qkv2_scales=s[20:], w_qkv2_biases=b[20:]), **kw)
    with pytest.raises(ValueError, match=r"w_qkv with w_qkv2 must hold fewer than \(nq \+ 2 nk\) D = 32 columns, got 32"):
        K.layer_in(dict(good, w_qkv=w, w_qkv_scales=s, w_qkv_biases=b), **kw)
    with pytest.raises(ValueError, match="w_qkv2_scales and _biases need w_qkv2"):
        K.layer_in(dict({k: v for k, v in good.items() if k != "w_qkv2"}, w_qkv=w, w_qkv_scales=s, w_qkv_biases=b), **kw)


def test_packed_weights_are_checked_with_what_to_pass():
    nq, nk, D, hid = 2, 1, 8, 64
    rot = rotation(1, nq, nk, D, [3])
    w, s, b = mx.quantize(mx.random.normal(((nq + 2 * nk) * D, hid)), group_size=32, bits=4)
    good = dict(h=mx.ones((1, hid)), norm=mx.ones((hid,)), w_qkv=w, w_qkv_scales=s, w_qkv_biases=b, cos=rot.C,
                sin=rot.S, scale=rot.F)
    kw = dict(eps=1e-5, nq=nq, nk=nk, D=D)
    assert len(K.layer_in(good, **kw)) == 3
    with pytest.raises(ValueError, match="need both _scales and _biases"):
        K.layer_in({k: v for k, v in good.items() if k != "w_qkv_biases"}, **kw)
    with pytest.raises(ValueError, match=r"float32 \(a matrix\) or uint32"):
        K.layer_in(dict(good, w_qkv=w.astype(mx.int32)), **kw)
    with pytest.raises(ValueError, match="group of 32, 64 or 128"):
        K.layer_in(dict(good, w_qkv_scales=mx.ones((32, 4)), w_qkv_biases=mx.ones((32, 4))), **kw)
    with pytest.raises(ValueError, match="w_qkv_biases must match"):
        K.layer_in(dict(good, w_qkv_biases=b.astype(mx.float16)), **kw)
    with pytest.raises(ValueError, match="contract must be 'exact', 'fast', 'factored' or 'split'"):
        K.layer_in(good, contract="quick", **kw)


def test_cache_write_equals_slice_update():
    mx.random.seed(5)
    buf, new = mx.random.normal((3, 2, 16, 8)), mx.random.normal((3, 2, 1, 8))
    for c in (0, 7, 15):
        col = mx.array([c], dtype=mx.int32)
        assert same(K.cache_write(buf, new, col), mx.slice_update(buf, new, col, axes=(2,)))
    compiled = mx.compile(lambda b, n, c: K.cache_write(b, n, c))
    col = mx.array([4], dtype=mx.int32)
    assert same(compiled(buf, new, col), mx.slice_update(buf, new, col, axes=(2,)))


def test_a_cache_buffer_still_referenced_is_copied_not_written():
    kbuf = mx.zeros((1, 1, 4, 8))
    before = mx.array(kbuf)
    mx.eval(kbuf, before)
    k = K.cache_write(kbuf, mx.ones((1, 1, 1, 8)), mx.array([2], dtype=mx.int32))
    mx.eval(k)
    assert same(kbuf, before)  # the caller's buffer: untouched
    assert mx.all(k[:, :, 2] == 1).item() and same(k[:, :, :2], before[:, :, :2])
    # a column past the end is clamped to the last one (never a write outside the buffer)
    k9 = K.cache_write(kbuf, mx.ones((1, 1, 1, 8)), mx.array([9], dtype=mx.int32))
    assert same(k9[:, :, 3], k[:, :, 2]) and same(k9[:, :, :3], before[:, :, :3])


def test_bad_inputs_are_refused_with_what_to_pass():
    B, nq, nk, D, hid = 1, 2, 1, 8, 16
    rot = rotation(B, nq, nk, D, [3])
    good = dict(h=mx.ones((B, hid)), norm=mx.ones((hid,)), w_qkv=mx.ones((hid, (nq + 2 * nk) * D)), cos=rot.C,
                sin=rot.S, scale=rot.F)
    kw = dict(eps=1e-5, nq=nq, nk=nk, D=D)
    assert len(K.layer_in(good, **kw)) == 3
    with pytest.raises(ValueError, match="layer_in has no input 'hidden'"):
        K.layer_in(dict(good, hidden=mx.ones((1,))), **kw)
    with pytest.raises(ValueError, match="layer_in needs input 'w_qkv'"):
        K.layer_in({k: v for k, v in good.items() if k != "w_qkv"}, **kw)
    with pytest.raises(ValueError, match="float32"):
        K.layer_in(dict(good, h=mx.ones((B, hid), dtype=mx.float16)), **kw)
    with pytest.raises(ValueError, match=r"w_qkv must be float32 \[16, 32\], got \[16, 24\]"):
        K.layer_in(dict(good, w_qkv=mx.ones((hid, 24))), **kw)
    with pytest.raises(ValueError, match="act and w_down go together"):
        K.layer_in(dict(good, act=mx.ones((B, 4))), **kw)
    with pytest.raises(ValueError, match="q_norm and k_norm go together"):
        K.layer_in(dict(good, q_norm=mx.ones((D,))), **kw)
    with pytest.raises(ValueError, match=r"bias \[B, 1, 1, S\]"):
        K.layer_mid(dict(q=mx.ones((1, 2, 2, 8)), k=mx.ones((1, 2, 5, 8)), v=mx.ones((1, 2, 5, 8)), bias=mx.ones((1, 5)),
                         w_o=mx.ones((32, 16)), h=mx.ones((1, 16)), norm=mx.ones((16,)), w_gu=mx.ones((16, 8))), eps=1e-5)
    with pytest.raises(ValueError, match=r"cache_write needs buf \[B, H, S, D\] and new \[B, H, 1, D\]"):
        K.cache_write(mx.zeros((1, 1, 4, 8)), mx.ones((1, 1, 2, 8)), mx.array([0], dtype=mx.int32))
    with pytest.raises(TypeError):
        K.cache_write([[1.0]], mx.ones((1, 1, 1, 8)), mx.array([0], dtype=mx.int32))  # not an mx.array


def decode_logits(cm, prompts, steps, native):
    """Greedy logits of ``steps`` decode steps after a compiled prefill, in a
    bucket of 4 (two padding rows); native: the layer kernels (True), MLX's
    ops (False), or MLX's ops around the kernels' qmm ("qmm")."""
    cm.lean.use_kernels(K if native else None)
    if native == "qmm":
        cm.lean.layers = cm.lean.ops_layers
    caches = cm.new_caches(4, rows=len(prompts))
    feed(cm, caches, [p[:-1] for p in prompts], lambda n: [n])
    y = mx.array([p[-1] for p in prompts] + [0] * (4 - len(prompts)), dtype=mx.int32)[:, None]
    out = []
    for _ in range(steps):
        logits = cm.step(caches, y, return_logits=True).logits
        out.append(logits)
        y = mx.argmax(logits, axis=-1)[:, None].astype(mx.int32)
    return out, cm


@pytest.mark.parametrize("family,quantize", [("llama", False), ("llama_mixed", False), ("llama", True), ("qwen3", False),
                                             ("qwen3", True), ("llama", "fast"), ("qwen3", "factored"),
                                             ("llama", "split")])
def test_the_lean_decode_on_kernels_equals_it_on_mlx_ops(family, quantize, tmp_path):
    model = tiny_model(family)
    for i, layer in enumerate(model.layers):  # qwen3: per-head norm weights that are not all ones
        if hasattr(layer.self_attn, "q_norm"):
            mx.random.seed(i)
            layer.self_attn.q_norm.weight = mx.random.uniform(0.5, 1.5, layer.self_attn.q_norm.weight.shape)
            layer.self_attn.k_norm.weight = mx.random.uniform(0.5, 1.5, layer.self_attn.k_norm.weight.shape)
    if quantize:  # float32 activations, quantized projections: the kernels read the packed blocks
        nn.quantize(model, group_size=32, bits=4)
    if quantize in ("fast", "factored", "split"):  # what the quantized-fast / -factored / -split formats set
        setattr(model, CONTRACT_ATTR, quantize)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    ops, _ = decode_logits(CompiledModel(model, fuse=True), prompts, 10, native=False)
    got, cm = decode_logits(CompiledModel(model, fuse=True), prompts, 10, native=True)
    if quantize:  # the same bits as MLX's ops around qmm; mx.quantized_matmul's values up to the summation order
        on_qmm, _ = decode_logits(CompiledModel(model, fuse=True), prompts, 10, native="qmm")
        for i, (a, b, c) in enumerate(zip(got, on_qmm, ops)):
            assert same(a, b), f"step {i}: max diff {mx.abs(a - b).max().item()}"
            if quantize != "fast":  # exact and factored: float32 sums; split: x in 15 bits (SPLIT_BOUND)
                tol = 2e-3 if quantize == "split" else 1e-4
                assert mx.allclose(a, c, atol=tol, rtol=tol).item() and mx.array_equal(mx.argmax(a, -1), mx.argmax(c, -1))
    else:
        for i, (a, b) in enumerate(zip(got, ops)):
            assert same(a, b), f"step {i}: max diff {mx.abs(a - b).max().item()}"
    graph = cm.export_decode_graph(str(tmp_path / "g.dot"))
    assert graph["TracerLayerIn"] == graph["TracerLayerMid"] == len(model.layers) and cm.lean.native_off is None
    assert graph["TracerCacheWrite"] == 2 * len(model.layers)
    assert "DynamicSliceUpdate" not in graph and "Softmax" not in graph
    # a greedy step's pick and log-probability in one pass: no row of log-probabilities, no separate argmax
    assert graph["TracerGreedyLogProbs"] == 1 and "TracerLogProbs" not in graph and "ArgReduce" not in graph
    # quantized: the last down projection and the (tied, quantized) head on qmm
    name = {"fast": "TracerQmmFast", "factored": "TracerQmmFactored", "split": "TracerQmmSplit"}.get(quantize, "TracerQmm")
    assert graph.get(name, 0) == (2 if quantize else 0)


def test_env_switch_turns_them_off():
    code = ("import mlx_tracer; from mlx_tracer.backend import kernels; "
            "print(kernels.load() is None, kernels.status())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, MLX_TRACER_KERNELS="0"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True not used: off (MLX_TRACER_KERNELS=0)"



@pytest.mark.parametrize("kv", [None, KVFormat(bits=8)], ids=["float", "8-bit"])
def test_a_pipelined_decode_writes_the_cache_buffers_in_place(kv):
    """The engine builds step t+1 while step t runs, when MLX still holds the
    buffers for step t's attention: cache_write waits for that rather than copying
    (a copy per layer and step cost 25 % at bucket 8, 1024 context). Quantized
    K/V: each of a buffer's three arrays in place (one node each: a node of
    three outputs holds its inputs three times, and MLX would not donate them)."""
    from mlx_tracer.runtime.engine import Engine

    model = tiny_model("llama", head_dim=64)
    engine = Engine(CompiledModel(model, fuse=True, kv=kv), buckets=(2,))
    for p in ([1, 2, 3, 4, 5], [7, 8, 9]):
        engine.add(p, max_tokens=12)
    before = K.cache_writes()
    for _ in engine.run():
        pass
    donated, copied = (b - a for b, a in zip(K.cache_writes(), before))
    arrays = 2 * (3 if kv is not None else 1)  # keys and values, each one array or three
    # a step that changes the batch (a row retiring) may still copy; decode steps must not
    assert copied <= arrays * len(model.layers) and donated >= arrays * len(model.layers) * 8
    assert donated >= 10 * copied


STORED = [KVFormat(dtype="float16"), KVFormat(dtype="bfloat16"), KVFormat(bits=8, group_size=64),
          KVFormat(bits=8, group_size=32), KVFormat(bits=4, group_size=32), KVFormat(bits=4, group_size=128)]


def stored_quantization(fmt):
    return fmt.bits, fmt.group_size


def stored_slots(fmt, k, v):
    """k/v as layer_mid takes them in ``fmt``, and as the lean ops read them."""
    ks, vs = fmt.encode(k), fmt.encode(v)
    return {**stored("k", ks), **stored("v", vs)}, ks, vs


@pytest.mark.parametrize("fmt", STORED, ids=lambda f: f.describe().replace(" ", ""))
@pytest.mark.parametrize("B,nk,R,D,S", [(1, 3, 3, 64, 1024), (2, 2, 4, 128, 37), (3, 1, 1, 128, 5)])
def test_layer_mid_reads_stored_kv_as_the_lean_ops_do(fmt, B, nk, R, D, S):
    """K/V stored as float16/bfloat16 or packed 4-/8-bit: layer_mid's attention
    reads them as stored, with the bits of the lean ops path on the same cache
    (MLX's matmul after its promotion to float32; mx.quantized_matmul), decode
    and windows, on the whole buffer and on a slice of a larger one."""
    if fmt.quantized and D % fmt.group_size:
        pytest.skip("groups run along D")
    mx.random.seed(S + D)
    hid, F = 48, 80
    o, gu, post = linear(nk * R * D, hid, True), linear(hid, 2 * F, False), norm(hid, 4)
    k, v = mx.random.normal((B, nk, S + 3, D)), mx.random.normal((B, nk, S + 3, D))
    slots, ks, vs = stored_slots(fmt, k, v)
    quant = stored_quantization(fmt) if fmt.quantized else None
    rest = dict(w_o=o.weight.T, b_o=o.bias, norm=post.weight, w_gu=gu.weight.T)

    def mlp(h, a):
        gate, up = mx.split(mm(norm_of_sum(h, a, post), gu), 2, axis=-1)
        return h + a, nn.silu(gate) * up

    # decode: q [B, nk, R, D] under an additive bias, as OpsLayers runs it
    q = mx.random.normal((B, nk, R, D)) * D**-0.5
    bias = mx.where(mx.random.uniform(shape=(B, 1, 1, S + 3)) > 0.3, mx.array(0.0), LOW)
    bias[..., 0] = 0.0
    if quant is None:
        want = attention_ref(q, ks, vs, bias)
    else:
        scores = quantized_mm(q, ks, True, quant) + bias
        want = quantized_mm(mx.softmax(scores, axis=-1, precise=True), vs, False, quant).reshape(B, nk * R * D)
    h = mx.random.normal((B, hid))
    got = K.layer_mid(dict(q=q, bias=bias, h=h, **slots, **rest), eps=1e-5)
    assert all(same(a, b) for a, b in zip(got, mlp(h, mm(want, o))))
    # decode over a slice of a larger buffer (strided between blocks)
    sliced = {n: a[:, :, :S] for n, a in slots.items()}
    cut = (lambda b: tuple(a[:, :, :S] for a in b)) if quant else (lambda b: b[:, :, :S])
    if quant is None:
        want = attention_ref(q, cut(ks), cut(vs), bias[..., :S])
    else:
        scores = quantized_mm(q, cut(ks), True, quant) + bias[..., :S]
        want = quantized_mm(mx.softmax(scores, axis=-1, precise=True), cut(vs), False, quant).reshape(B, nk * R * D)
    got = K.layer_mid(dict(q=q, bias=bias[..., :S], h=h, **sliced, **rest), eps=1e-5)
    assert all(same(a, b) for a, b in zip(got, mlp(h, mm(want, o))))
    # a window of L tokens a row under a boolean mask: lean_attention on the stored format
    L = 4
    q5 = mx.random.normal((B, nk, R, L, D)) * D**-0.5
    mask = mx.random.uniform(shape=(B, 1, 1, L, S + 3)) > 0.4
    mask[..., 0] = True
    want = lean_attention(q5, ks, vs, mask, quant).transpose(0, 3, 1, 2, 4).reshape(B * L, nk * R * D)
    hw = mx.random.normal((B * L, hid))
    got = K.layer_mid(dict(q=q5, mask=mask, h=hw, **slots, **rest), eps=1e-5)
    assert all(same(a, b) for a, b in zip(got, mlp(hw, mm(want, o))))


@pytest.mark.parametrize("family,fmt", [
    ("llama", KVFormat(dtype="float16")), ("llama_mixed", KVFormat(dtype="float16")),
    ("qwen3", KVFormat(dtype="bfloat16")), ("llama", KVFormat(bits=8)), ("llama_mixed", KVFormat(bits=8, group_size=32)),
    ("llama_mixed", KVFormat(bits=4, group_size=32)), ("qwen3", KVFormat(bits=8))],
    ids=lambda x: x if isinstance(x, str) else x.describe().replace(" ", ""))
def test_the_lean_decode_on_kernels_reads_stored_kv_as_mlx_ops_do(family, fmt, tmp_path):
    """Caches of every K/V format: the lean forward runs its prefill windows and
    decode steps on the kernels (decode columns written in place by
    cache_write / cache_write_quantized), with the logits of MLX's ops on the
    same caches, bit for bit, rings across their wraps included."""
    model = tiny_model(family, head_dim=64)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    ops, _ = decode_logits(CompiledModel(model, fuse=True, kv=fmt), prompts, 12, native=False)
    got, cm = decode_logits(CompiledModel(model, fuse=True, kv=fmt), prompts, 12, native=True)
    assert cm.lean.native_off is None
    for i, (a, b) in enumerate(zip(got, ops)):
        assert same(a, b), f"step {i}: max diff {mx.abs(a - b).max().item()}"
    graph = cm.export_decode_graph(str(tmp_path / "g.dot"))
    assert graph["TracerLayerIn"] == graph["TracerLayerMid"] == len(model.layers)
    # a quantized buffer's three arrays each written by a node of its own (each can be donated)
    assert graph["TracerCacheWrite"] == (6 if fmt.quantized else 2) * len(model.layers)
    assert not {"Softmax", "QuantizedMatmul", "Quantize", "DynamicSliceUpdate"} & set(graph)


@pytest.mark.parametrize("path", ["portable", "avx2", "avx512"])
def test_packed_kv_reads_on_every_path(path):
    """layer_mid reads stored K/V on the path it picks (F16C widening and
    AVX-512 or AVX2 packed reads, or scalar code): forced one by one, each
    gives the lean ops' bits (decode, windows; float16, bfloat16, 4 and 8 bits)."""
    before = K.kv_isa()
    try:
        if K.kv_set_isa(path) != path:
            pytest.skip(f"this CPU has no {path}")
        for fmt in STORED:
            test_layer_mid_reads_stored_kv_as_the_lean_ops_do(fmt, 2, 2, 4, 128, 37)
            if 64 % fmt.group_size == 0:
                test_layer_mid_reads_stored_kv_as_the_lean_ops_do(fmt, 1, 3, 3, 64, 1024)
    finally:
        K.kv_set_isa(before)


@pytest.mark.parametrize("value", ["portable", "avx2", "avx512", "", "sse9"])
def test_the_environment_forces_the_kv_path_at_load(value):
    """MLX_TRACER_KV_ISA picks the packed K/V path at load (the best the CPU
    has where it names a better one, or nothing, or something unknown: then
    said on stderr)."""
    import os
    import subprocess
    import sys

    before = K.kv_isa()
    best = K.kv_set_isa("avx512")  # the best this CPU has
    K.kv_set_isa(before)
    order = ["portable", "avx2", "avx512"]
    want = best if value not in order else order[min(order.index(value), order.index(best))]
    code = "import mlx_tracer\nfrom mlx_tracer.backend import kernels\nprint(kernels.load().kv_isa())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MLX_TRACER_KV_ISA": value},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [want]
    assert ("portable, avx2 or avx512" in out.stderr) == (value == "sse9")
    with pytest.raises(ValueError, match="portable, avx2 or avx512"):
        K.kv_set_isa("sse9")


@pytest.mark.parametrize("fmt", [KVFormat(), KVFormat(dtype="float16"), KVFormat(bits=8), KVFormat(bits=4, group_size=32)],
                         ids=lambda f: f.describe().replace(" ", ""))
def test_decode_on_kernels_writes_every_kv_format_in_place(fmt):
    """A compiled decode step on the kernels writes its K/V columns into the
    buffers as stored (float: cache_write; quantized: the cache's own write)
    and reads them as stored: no copy of the buffers, no float32 copy of a
    float16 or quantized cache."""
    model = tiny_model("llama", head_dim=64)
    cm = CompiledModel(model, capacities=(8192,), fuse=True, kv=fmt)
    assert cm.lean.native_off is None
    assert_decode_writes_in_place(cm, "the step copied (or widened) the K/V buffers")


def test_stored_kv_are_checked_with_what_to_pass():
    B, nk, R, D, S, hid = 1, 2, 2, 64, 8, 16
    fmt = KVFormat(bits=8)
    k, v = fmt.encode(mx.random.normal((B, nk, S, D))), fmt.encode(mx.random.normal((B, nk, S, D)))
    good = dict(q=mx.ones((B, nk, R, D)), bias=mx.zeros((B, 1, 1, S)), w_o=mx.ones((nk * R * D, hid)),
                h=mx.ones((B, hid)), norm=mx.ones((hid,)), w_gu=mx.ones((hid, 8)), **stored("k", k), **stored("v", v))
    assert len(K.layer_mid(good, eps=1e-5)) == 2
    with pytest.raises(ValueError, match="need k_scales, k_biases, v_scales and v_biases"):
        K.layer_mid({n: a for n, a in good.items() if n != "v_biases"}, eps=1e-5)
    with pytest.raises(ValueError, match="stored alike"):
        K.layer_mid(dict(good, v=mx.ones((B, nk, S, D), dtype=mx.float16)), eps=1e-5)
    with pytest.raises(ValueError, match="scales and biases of packed keys/values must be float32"):
        K.layer_mid(dict(good, k_scales=mx.ones((B, nk, S, 3))), eps=1e-5)
    with pytest.raises(ValueError, match="must be float32"):
        K.layer_mid(dict(good, k_scales=good["k_scales"].astype(mx.float16)), eps=1e-5)
    f16 = mx.zeros((B, nk, S, D), dtype=mx.float16)
    with pytest.raises(ValueError, match="float ones none"):
        K.layer_mid(dict({n: a for n, a in good.items() if not n.startswith(("k", "v"))}, k=f16, v=f16,
                         k_scales=good["k_scales"]), eps=1e-5)
    with pytest.raises(ValueError, match="buf must be float32, float16 or bfloat16"):
        K.cache_write(k[0], mx.ones((B, nk, 1, D // 4)), mx.array([0], dtype=mx.int32))


@pytest.mark.parametrize("bits,group", [(8, 64), (8, 32), (4, 32), (4, 128), (8, 128)])
def test_cache_write_quantized_equals_quantize_and_slice_update(bits, group):
    """A quantized buffer's column written by the kernel: the packed words,
    scales and biases mx.quantize gives, where mx.slice_update puts them,
    on groups of every kind (random, constant, zero, one sign, tiny, huge)."""
    mx.random.seed(bits + group)
    B, H, S, D = 3, 2, 9, 256
    fmt = KVFormat(bits=bits, group_size=group)
    new = mx.random.normal((B, H, 1, D)) * mx.array([1e-30, 1e-3, 1.0, 1e4])[mx.random.randint(0, 4, (B, H, 1, D))]
    new[0, 0, 0, :group] = 0.0  # a zero group
    new[0, 1, 0, :group] = 0.5  # a constant group
    new[1, 0, 0, :group] = mx.abs(new[1, 0, 0, :group])  # one sign each way
    new[1, 1, 0, :group] = -mx.abs(new[1, 1, 0, :group])
    new[2, 0, 0, group:2 * group] = mx.array(-2.0)
    buf = fmt.encode(mx.random.normal((B, H, S, D)))
    want = fmt.encode(new)
    for c in (0, 4, S - 1):
        col = mx.array([c], dtype=mx.int32)
        for a, w, part in zip(buf, want, ("packed", "scales", "biases")):
            got = K.cache_write_quantized(a, new, col, part, bits, group)
            assert same(got, mx.slice_update(a, w, col, axes=(2,))), (part, c)
    with pytest.raises(ValueError, match="part must be 'packed', 'scales' or 'biases'"):
        K.cache_write_quantized(buf[0], new, mx.array([0], dtype=mx.int32), "words", bits, group)
    with pytest.raises(ValueError, match=r"buf \(scales\) must be float32"):
        K.cache_write_quantized(buf[1].astype(mx.float16), new, mx.array([0], dtype=mx.int32), "scales", bits, group)


def test_every_source_the_build_reads_ships_in_the_package():
    """A wheel install compiles the kernels from its package data (0.5.1's
    list had lost logprobs.cpp, qmm_api.h and vmath_x86.h)."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from mlx_tracer.backend import blas

    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "mlx_tracer.backend"]
    needed = [p.name for p in kernels.SOURCES + kernels.HEADERS] + [Path(blas.__file__).with_name("blas_shim.c").name]
    missing = [n for n in needed if not any(fnmatch.fnmatch(n, pat) for pat in patterns)]
    assert not missing, missing


@pytest.mark.skipif(K is None, reason="native kernels unavailable")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.uint32])
def test_realign_moves_columns_as_the_gather_does(dtype):
    """``realign`` (the verify step's right-alignment of a full cache) is
    realign_rows' gather bit for bit: deltas right, left, zero and past the
    capacity; in place where MLX lets go of the buffer, and copied when
    the caller still holds the buffer (which must stay as it was; counted
    by ``realigns()``)."""
    from mlx_tracer.caches.writes import realign_rows

    B, H, C, W = 5, 3, 24, 8
    buf = (mx.random.uniform(shape=(B, H, C, W)) * 1000).astype(dtype)
    delta = mx.array([0, 3, -2, 25, -49], dtype=mx.int32)
    want = realign_rows(buf, delta)
    before = mx.array(buf)
    mx.eval(buf, before, want)
    in_place0, copied0 = K.realigns()
    held = K.realign(buf, delta)  # the caller keeps `buf`: a copy
    mx.eval(held)
    assert K.realigns() == (in_place0, copied0 + 1)
    inter = K.realign(buf + mx.zeros_like(buf), delta)  # an intermediate: in place where MLX lets go of it
    mx.eval(inter)
    assert sum(K.realigns()) == in_place0 + copied0 + 2  # (whether MLX donates it depends on what else holds it)
    compiled = mx.compile(lambda b, d: K.realign(b * 1, d))(buf, delta)
    for got in (held, inter, compiled):
        assert got.dtype == dtype and mx.array_equal(got, want).item()
    assert mx.array_equal(buf, before).item()
    with pytest.raises(ValueError, match="delta must be int32"):
        K.realign(buf, delta.astype(mx.int64))


def test_a_compiler_that_fails_is_named_in_the_kernels_status(tmp_path):
    """The build compiles its units side by side (0.5.11); a unit that fails
    stops it and the status carries the compiler's words, or its exit status
    where it said nothing."""
    code = "import mlx_tracer\nfrom mlx_tracer.backend import kernels\nprint(kernels.load(), kernels.status())"
    loud = tmp_path / "loud-cxx"
    loud.write_text('#!/bin/sh\necho "qmm.cpp:1:1: error: no room" >&2\nexit 1\n')
    loud.chmod(0o755)
    for cxx, said in ((str(loud), "kernel build failed: qmm.cpp:1:1: error: no room"),
                      ("/bin/false", "kernel build failed: /bin/false exited with status 1 on qmm.cpp")):
        home = tmp_path / ("home-" + os.path.basename(cxx))
        home.mkdir()
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "MLX_TRACER_HOME": str(home), "CXX": cxx})
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("None not used: ") and said in r.stdout, r.stdout
        assert not list(home.glob("kernels-*")), "a failed build left files behind"
