"""The native CPU kernels (mlx_tracer.backend.kernels): each computes the
bits of the MLX ops it replaces (eagerly and inside mx.compile, on strided
views, with padding rows), the lean forward runs a decode step on them with
the same logits as on MLX's ops, bad inputs are refused with a clear error,
and MLX_TRACER_KERNELS=0 turns them off."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_tracer.adapters.fused import HeadRotation, _norm_of_sum, rope_tables
from mlx_tracer.backend import kernels
from mlx_tracer.runtime.prefill import feed
from mlx_tracer.runtime.step import CompiledModel

from .tiny_models import tiny_model

K = kernels.load()
LOW = mx.array(mx.finfo(mx.float32).min, mx.float32)


def test_the_kernels_build_and_load():
    assert K is not None, kernels.status()
    assert kernels.status().startswith("active")


def same(a, b):
    mx.eval(a, b)
    return a.shape == b.shape and mx.array_equal(a, b).item()


@pytest.mark.parametrize("n", [64, 576, 960])
def test_norms_equal_mlx_bit_for_bit(n):
    mx.random.seed(n)
    h, a, w = mx.random.normal((3, n)), mx.random.normal((3, n)) * 4, mx.random.normal((n,))
    norm = nn.RMSNorm(n, eps=1e-5)
    norm.weight = w
    (y,) = K.rms_norm(h, w, 1e-5)
    assert same(y, norm(h)) and same(y, mx.compile(norm)(h))
    s, y = K.add_rms_norm(h, a, w, 1e-5)
    assert same(s, h + a) and same(y, _norm_of_sum(h, a, norm))
    s2, y2 = mx.compile(lambda h, a: K.add_rms_norm(h, a, w, 1e-5))(h, a)
    assert same(s2, s) and same(y2, y)
    # a strided view (a transposed array) gives the same as its contiguous copy
    t = mx.random.normal((n, 3)).T
    assert same(K.rms_norm(t, w, 1e-5)[0], norm(mx.contiguous(t)))


def rotation(B, nq, nk, D, offsets):
    cos, sin = rope_tables(mx.array(offsets), 1, D, 10000.0, 1.0, mx.float32)
    return HeadRotation(cos, sin, (nq, nk, nk), D, D**-0.5)


@pytest.mark.parametrize("B,nq,nk,D", [(1, 9, 3, 64), (2, 4, 2, 16), (4, 8, 8, 32)])
def test_rope_split_and_swiglu_equal_mlx(B, nq, nk, D):
    mx.random.seed(B + nq)
    rot = rotation(B, nq, nk, D, list(range(5, 5 + 7 * B, 7)))
    y = mx.random.normal((B, (nq + 2 * nk) * D))
    q, k, v = mx.split(rot(y), [nq, nq + nk], axis=rot.axis)
    got = K.rope_split(y, rot.C, rot.S, rot.F, B, nq, nk, D)
    assert same(got[0], q.reshape(B, nk, nq // nk, D)) and same(got[1], k) and same(got[2], v)
    # qwen3's per-head norms before the rotation, as the lean forward's MLX path computes them
    qn, kn = nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D, eps=1e-6)
    qn.weight, kn.weight = mx.random.normal((D,)), mx.random.normal((D,))
    heads = mx.split(y.reshape(B, nq + 2 * nk, 1, D), [nq, nq + nk], axis=1)
    cos, sin = rope_tables(mx.array(list(range(5, 5 + 7 * B, 7))), 1, D, 10000.0, 1.0, mx.float32)
    rot_qk = HeadRotation(cos, sin, (nq, nk, 0), D, D**-0.5)
    q, k = mx.split(rot_qk(mx.concatenate([qn(heads[0]), kn(heads[1])], axis=1)), [nq], axis=1)
    got = K.rope_split(y, rot.C, rot.S, rot.F, B, nq, nk, D, q_norm=qn.weight, k_norm=kn.weight, qk_eps=1e-6)
    assert same(got[0], q.reshape(B, nk, nq // nk, D)) and same(got[1], k) and same(got[2], heads[2])
    gu = mx.random.normal((B, 6 * D))
    gate, up = mx.split(gu, 2, axis=-1)
    assert same(K.swiglu(gu), nn.silu(gate) * up)
    assert same(mx.compile(K.swiglu)(gu), mx.compile(lambda g: nn.silu(g[:, : 3 * D]) * g[:, 3 * D :])(gu))


def attention_ref(q, k, v, bias):
    B, nk, R, D = q.shape
    scores = mx.addmm(mx.broadcast_to(bias, (B, nk, R, k.shape[2])), q, k.swapaxes(-1, -2))
    return (mx.softmax(scores, axis=-1, precise=True) @ v).reshape(B, nk * R * D)


@pytest.mark.parametrize("B,nk,R,D,S", [(1, 3, 3, 64, 128), (2, 2, 4, 16, 1024), (3, 1, 1, 8, 5)])
def test_decode_attention_equals_mlx(B, nk, R, D, S):
    mx.random.seed(S)
    q = mx.random.normal((B, nk, R, D)) * D**-0.5
    k, v = mx.random.normal((B, nk, S, D)), mx.random.normal((B, nk, S, D))
    bias = mx.where(mx.random.uniform(shape=(B, 1, 1, S)) > 0.3, mx.array(0.0), LOW)
    bias[:, :, :, 0] = 0.0  # every row sees a column
    assert same(K.decode_attention(q, k, v, bias), attention_ref(q, k, v, bias))
    # keys as a slice of a larger buffer (strided between blocks)
    big = mx.random.normal((B, nk, S + 3, D))
    assert same(K.decode_attention(q, big[:, :, :S], v, bias), attention_ref(q, big[:, :, :S], v, bias))


def linear(n_in, n_out, bias):
    m = nn.Linear(n_in, n_out, bias=bias)
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("bias", [False, True])
def test_layer_kernels_equal_their_parts(bias):
    """layer_in / layer_mid against the small kernels and MLX matmuls / slice_update."""
    mx.random.seed(7)
    B, nq, nk, D, hid, F, S = 2, 4, 2, 16, 64, 96, 32
    N = (nq + 2 * nk) * D
    down, qkv, o, gu = linear(F, hid, bias), linear(hid, N, bias), linear(nq * D, hid, bias), linear(hid, 2 * F, bias)
    w_in, w_post = mx.random.normal((hid,)), mx.random.normal((hid,))
    h, act = mx.random.normal((B, hid)), mx.random.normal((B, F))
    kbuf, vbuf = mx.random.normal((B, nk, S, D)), mx.random.normal((B, nk, S, D))
    col = mx.array([5], dtype=mx.int32)
    rot = rotation(B, nq, nk, D, [5, 9])
    mx.eval(h, act, kbuf, vbuf, w_in, w_post)

    def mm(x, m):
        return mx.addmm(m.bias, x, m.weight.T) if bias else x @ m.weight.T

    def b_of(m):
        return m.bias if bias else None

    # reference: the small kernels with MLX's matmuls and slice_update
    h1, x = K.add_rms_norm(h, mm(act, down), w_in, 1e-5)
    q, k, v = K.rope_split(mm(x, qkv), rot.C, rot.S, rot.F, B, nq, nk, D)
    k_ref = mx.slice_update(kbuf, k, col, axes=(2,))
    v_ref = mx.slice_update(vbuf, v, col, axes=(2,))
    bias_rows = mx.zeros((B, 1, 1, S))
    a = mm(K.decode_attention(q, k_ref, v_ref, bias_rows), o)
    h2_ref, x2 = K.add_rms_norm(h1, a, w_post, 1e-5)
    act_ref = K.swiglu(mm(x2, gu))

    got = K.layer_in(h, act, down.weight.T, b_of(down), w_in, 1e-5, qkv.weight.T, b_of(qkv), rot.C, rot.S, rot.F,
                     nq, nk, D, kbuf, vbuf, col)
    assert len(got) == 4
    h_new, q2, k2, v2 = got
    assert same(h_new, h1) and same(q2, q) and same(k2, k_ref) and same(v2, v_ref)
    h2, act2 = K.layer_mid(q2, k2, v2, bias_rows, o.weight.T, b_of(o), h_new, w_post, 1e-5, gu.weight.T, b_of(gu))
    assert same(h2, h2_ref) and same(act2, act_ref)
    # the first layer: no previous MLP
    q3, k3, v3 = K.layer_in(h, None, None, None, w_in, 1e-5, qkv.weight.T, b_of(qkv), rot.C, rot.S, rot.F, nq, nk, D,
                            kbuf, vbuf, col)
    q_ref = K.rope_split(mm(K.rms_norm(h, w_in, 1e-5)[0], qkv), rot.C, rot.S, rot.F, B, nq, nk, D)[0]
    assert same(q3, q_ref)


def test_a_cache_buffer_still_referenced_is_copied_not_written():
    mx.random.seed(1)
    B, nq, nk, D, hid = 1, 2, 1, 8, 16
    qkv = linear(hid, (nq + 2 * nk) * D, False)
    rot = rotation(B, nq, nk, D, [3])
    kbuf, vbuf = mx.zeros((B, nk, 4, D)), mx.zeros((B, nk, 4, D))
    before = mx.array(kbuf)
    mx.eval(kbuf, vbuf, before)
    _, k, _ = K.layer_in(mx.ones((B, hid)), None, None, None, mx.ones((hid,)), 1e-5, qkv.weight.T, None, rot.C, rot.S,
                         rot.F, nq, nk, D, kbuf, vbuf, mx.array([2], dtype=mx.int32))
    mx.eval(k)
    assert same(kbuf, before)  # the caller's buffer: untouched
    assert mx.any(k[:, :, 2] != 0).item() and same(k[:, :, :2], before[:, :, :2])
    # a column past the end is clamped to the last one (never a write outside the buffer)
    _, k9, _ = K.layer_in(mx.ones((B, hid)), None, None, None, mx.ones((hid,)), 1e-5, qkv.weight.T, None, rot.C, rot.S,
                          rot.F, nq, nk, D, kbuf, vbuf, mx.array([9], dtype=mx.int32))
    assert same(k9[:, :, 3], k[:, :, 2]) and same(k9[:, :, :3], before[:, :, :3])


def test_bad_inputs_are_refused_with_what_to_pass():
    with pytest.raises(ValueError, match="float32"):
        K.swiglu(mx.ones((2, 4), dtype=mx.float16))
    with pytest.raises(ValueError, match=r"swiglu needs \[M, 2F\]"):
        K.swiglu(mx.ones((2, 3)))
    with pytest.raises(ValueError, match="weight must be"):
        K.rms_norm(mx.ones((2, 8)), mx.ones((4,)), 1e-5)
    with pytest.raises(ValueError, match="bias \\[B, 1, 1, S\\]"):
        K.decode_attention(mx.ones((1, 2, 2, 8)), mx.ones((1, 2, 5, 8)), mx.ones((1, 2, 5, 8)), mx.ones((1, 5)))
    with pytest.raises(TypeError):
        K.swiglu([[1.0, 2.0]])  # not an mx.array


def decode_logits(cm, prompts, steps, native):
    """Greedy logits of ``steps`` decode steps after a compiled prefill, in a
    bucket of 4 (two padding rows), kernels on or off."""
    cm.fused.native = K if native else None
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
                                             ("qwen3", True)])
def test_the_lean_decode_on_kernels_equals_it_on_mlx_ops(family, quantize, tmp_path):
    model = tiny_model(family)
    for i, layer in enumerate(model.layers):  # qwen3: per-head norm weights that are not all ones
        if hasattr(layer.self_attn, "q_norm"):
            mx.random.seed(i)
            layer.self_attn.q_norm.weight = mx.random.uniform(0.5, 1.5, layer.self_attn.q_norm.weight.shape)
            layer.self_attn.k_norm.weight = mx.random.uniform(0.5, 1.5, layer.self_attn.k_norm.weight.shape)
    if quantize:  # float32 activations, quantized projections: the small kernels between MLX's matmuls
        nn.quantize(model, group_size=32, bits=4)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    ops, _ = decode_logits(CompiledModel(model, fuse=True), prompts, 10, native=False)
    got, cm = decode_logits(CompiledModel(model, fuse=True), prompts, 10, native=True)
    for i, (a, b) in enumerate(zip(got, ops)):
        assert same(a, b), f"step {i}: max diff {mx.abs(a - b).max().item()}"
    graph = cm.export_decode_graph(str(tmp_path / "g.dot"))
    if quantize:
        assert graph["TracerDecodeAttention"] == len(model.layers) and graph["TracerLayerIn"] == 0
    else:
        assert graph["TracerLayerIn"] == graph["TracerLayerMid"] == len(model.layers)
        assert "DynamicSliceUpdate" not in graph and "Softmax" not in graph


def test_env_switch_turns_them_off():
    code = ("import mlx_tracer; from mlx_tracer.backend import kernels; "
            "print(kernels.load() is None, kernels.status())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, MLX_TRACER_KERNELS="0"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True not used: off (MLX_TRACER_KERNELS=0)"



def test_a_pipelined_decode_writes_the_cache_buffers_in_place():
    """The engine builds step t+1 while step t runs, when MLX still holds the
    buffers for step t's attention: layer_in waits for that rather than copying
    (a copy per layer and step cost 25 % at bucket 8, 1024 context)."""
    from mlx_tracer.runtime.engine import Engine

    model = tiny_model("llama")
    engine = Engine(CompiledModel(model, fuse=True), buckets=(2,))
    for p in ([1, 2, 3, 4, 5], [7, 8, 9]):
        engine.add(p, max_tokens=12)
    before = K.cache_writes()
    for _ in engine.run():
        pass
    donated, copied = (b - a for b, a in zip(K.cache_writes(), before))
    # a step that changes the batch (a row retiring) may still copy; decode steps must not
    assert copied <= 2 * len(model.layers) and donated >= 2 * len(model.layers) * 8 and donated >= 10 * copied
