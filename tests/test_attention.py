"""The layer kernels' decode attention on vector lanes (attend_x86.h, the
portable loops in kernels.cpp): the same bits on every ISA path, the
attention's values up to summation order (a float64 reference and the BLAS
arithmetic), float32 / float16 / bfloat16 keys and values read as stored,
8- and 4-bit packed ones dequantized as MLX does (the values MLX's
dequantize gives, then the same lanes) or, one group a row, factored (a
key's scale and bias once around the stored integers: the keys' products
with the queries in three int8 parts, exact in int32; the values' in the lanes),
masked columns never reaching the result, and ``auto`` picking it exactly
where the layer's projections are packed blocks."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn

from mlx_tracer.backend import kernels

from .helpers import forced_isa

K = kernels.load()
pytestmark = pytest.mark.skipif(K is None, reason="native kernels unavailable")
LOW = float(np.finfo(np.float32).min)
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
SHAPES = [(2, 3, 3, 37, 64), (3, 2, 4, 130, 128), (1, 1, 5, 9, 48), (2, 2, 1, 64, 16), (1, 2, 2, 6, 256),
          (2, 1, 7, 33, 32), (1, 3, 3, 4, 64),
          # many query rows (a verify or prefill window's): AVX2 takes their values a 16-column slice of 4 rows a pass
          (1, 3, 15, 70, 64), (2, 1, 17, 41, 128), (1, 2, 9, 23, 32)]


@pytest.fixture
def mode():
    before = K.attention_mode()
    yield K.attention_mode
    K.attention_mode(before)


def inputs(B, nk, R, S, D, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((B, nk, R, D), dtype=np.float32) / 4)
    bias = np.zeros((B, S), np.float32)
    bias[0, : S // 3] = LOW  # left padding
    bias[-1, -3:] = -np.inf  # columns past a row's end
    bias[-1, 0] = LOW
    bias = mx.array(bias)
    k = mx.array(rng.standard_normal((B, nk, S, D), dtype=np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, nk, S, D), dtype=np.float32)).astype(dtype)
    mx.eval(q, k, v, bias)
    return q, k, v, bias


def reference(q, k, v, bias) -> np.ndarray:
    """softmax(q k^T + bias) v in float64, the keys and values as stored."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k.astype(mx.float32), np.float64)
    v = np.asarray(v.astype(mx.float32), np.float64)
    scores = np.einsum("bhrd,bhsd->bhrs", q, k) + np.asarray(bias, np.float64)[:, None, None, :]
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhrs,bhsd->bhrd", p / p.sum(-1, keepdims=True), v).reshape(-1)


def attend(q, k, v, bias, vector=True) -> np.ndarray:
    return np.asarray(K.decode_attention(q, k, v, bias, vector)[0], np.float32)


def on_every_path(run) -> dict:
    """run() on every ISA path this CPU has (portable and at least one more),
    asserted to give the same bits on each; {path: output}."""
    outs = {}
    for path in ("portable", "avx2", "avx512"):
        try:
            with forced_isa(K, path):
                outs[path] = run()
        except pytest.skip.Exception:
            continue
    assert "portable" in outs and len(outs) >= 2, outs.keys()
    for p, o in outs.items():
        assert np.array_equal(o.view(np.int32), outs["portable"].view(np.int32)), p
    return outs


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_vector_attention_same_bits_on_every_path_and_mlx_values(shape, dtype):
    q, k, v, bias = inputs(*shape, dtype)
    outs = on_every_path(lambda: attend(q, k, v, bias))
    want, blas = reference(q, k, v, bias), attend(q, k, v, bias, vector=False)
    got = outs["portable"]
    # float32 sums in another order: errors as small as the BLAS arithmetic's
    tol = 32 * np.finfo(np.float32).eps * np.abs(want).max()
    assert np.abs(got - want).max() <= tol, (np.abs(got - want).max(), tol)
    assert np.abs(blas - want).max() <= tol


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_masked_columns_never_reach_the_result(dtype):
    """NaN stored in masked columns (a buffer's garbage) leaves the output of
    the visible ones; under the BLAS arithmetic a NaN value poisons it."""
    B, nk, R, S, D = 2, 2, 3, 41, 64
    q, k, v, bias = inputs(B, nk, R, S, D, dtype, seed=3)
    clean = attend(q, k, v, bias)
    masked = np.asarray(bias) != 0  # [B, S]
    kn, vn = np.array(k.astype(mx.float32)), np.array(v.astype(mx.float32))
    kn[np.broadcast_to(masked[:, None, :, None], kn.shape)] = np.nan
    vn[np.broadcast_to(masked[:, None, :, None], vn.shape)] = np.nan
    kd, vd = mx.array(kn).astype(dtype), mx.array(vn).astype(dtype)
    mx.eval(kd, vd)
    dirty = attend(q, kd, vd, bias)
    assert np.isfinite(dirty).all()
    assert np.array_equal(dirty.view(np.int32), clean.view(np.int32))
    assert np.isnan(attend(q, kd, vd, bias, vector=False)).any()


PACKED = [(8, 64), (4, 64), (8, 32), (4, 32), (8, 128), (4, 128)]


def packed_inputs(B, nk, R, S, D, bits, group, seed=0):
    """inputs() with K/V quantized as mlx-lm's QuantizedKVCache stores them."""
    q, k, v, bias = inputs(B, nk, R, S, D, mx.float32, seed)
    kq, vq = mx.quantize(k, group_size=group, bits=bits), mx.quantize(v, group_size=group, bits=bits)
    mx.eval(kq, vq)
    deq = [mx.dequantize(*t, group_size=group, bits=bits) for t in (kq, vq)]
    mx.eval(deq)
    return q, kq, vq, bias, deq


def attend_packed(q, kq, vq, bias, vector=True) -> np.ndarray:
    out = K.decode_attention(q, kq[0], vq[0], bias, vector, packed=[kq[1], kq[2], vq[1], vq[2]])[0]
    return np.asarray(out, np.float32)


PACKED_CASES = [(shape, bits, group) for shape in [(2, 3, 3, 37, 128), (1, 2, 5, 130, 128), (3, 1, 4, 19, 256),
                                                   (2, 2, 15, 66, 128)] for bits, group in PACKED] + \
    [((2, 3, 3, 37, 64), bits, group) for bits, group in PACKED if group <= 64] + [((1, 1, 2, 5, 32), 4, 32)]


def exact_values(packed, bits, group) -> mx.array:
    """A quantized buffer's values in float64 arithmetic, scale * q + bias
    unrounded (as the factored arithmetic multiplies them), as float32 only
    where exact: returned as a NumPy float64 array."""
    w, scales, biases = packed
    ints = np.asarray(mx.dequantize(w, mx.ones_like(scales), mx.zeros_like(biases), group_size=group, bits=bits),
                      np.float64)
    per = ints.shape[-1] // scales.shape[-1]
    return ints * np.repeat(np.asarray(scales, np.float64), per, -1) + np.repeat(np.asarray(biases, np.float64), per, -1)


@pytest.mark.parametrize("shape,bits,group", PACKED_CASES, ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_vector_attention_reads_packed_blocks_as_mlx_dequantizes_them(shape, bits, group):
    """The vector lanes on packed K/V: the same bits on every ISA path.
    Several groups a row: the bits the same lanes give on float32 K/V
    holding MLX's dequantized values (each value exactly MLX's dequantize,
    then the float path's arithmetic). One group a row (head size = group,
    mlx-lm's default 64 for heads of 64): the factored arithmetic, within a
    few roundings of its float64 value, and not reading a masked key's
    parameters. MLX's quantized_matmul arithmetic (vector=False) agrees up to
    summation order either way."""
    q, kq, vq, bias, (kd, vd) = packed_inputs(*shape, bits, group)
    outs = on_every_path(lambda: attend_packed(q, kq, vq, bias))
    want, mlx_bits = reference(q, kd, vd, bias), attend_packed(q, kq, vq, bias, vector=False)
    tol = 32 * np.finfo(np.float32).eps * np.abs(want).max()
    assert np.abs(outs["portable"] - want).max() <= tol
    assert np.abs(mlx_bits - want).max() <= tol
    if group != shape[-1]:
        same_lanes = attend(q, kd, vd, bias)  # float32 blocks of MLX's dequantized values
        assert np.array_equal(outs["portable"].view(np.int32), same_lanes.view(np.int32))
        return
    # factored: against the float64 attention over the unrounded values scale * q + bias
    exact = reference(q, mx.array(exact_values(kq, bits, group).astype(np.float32)),
                      mx.array(exact_values(vq, bits, group).astype(np.float32)), bias)
    exact64 = _reference64(np.asarray(q, np.float64), exact_values(kq, bits, group), exact_values(vq, bits, group),
                           np.asarray(bias, np.float64))
    # (measured: 0.5-7.5 float32 eps of the largest output on these cases, 0.5.18's float lanes 3-9, MLX's quantized_matmul arithmetic 4-8)
    assert np.abs(outs["portable"] - exact64).max() <= 16 * np.finfo(np.float32).eps * np.abs(exact64).max()
    assert np.abs(exact - exact64).max() <= tol  # (the float32 rounding of the values alone moves it this little)
    # NaN in a masked key's scale, bias and value parameters never reaches the result
    B, nk, R, S, D = shape
    masked = np.asarray(bias) != 0
    dirty = []
    for packed in (kq, vq):
        sc, bi = np.array(packed[1]), np.array(packed[2])
        sel = np.broadcast_to(masked[:, None, :, None], sc.shape)
        sc[sel], bi[sel] = np.nan, np.nan
        dirty.append((packed[0], mx.array(sc), mx.array(bi)))
    got = attend_packed(q, dirty[0], dirty[1], bias)
    assert np.array_equal(got.view(np.int32), outs["portable"].view(np.int32))


def _reference64(q, k, v, bias) -> np.ndarray:
    """reference() on float64 arrays as given (no float32 rounding of K/V)."""
    scores = np.einsum("bhrd,bhsd->bhrs", q, k) + bias[:, None, None, :]
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhrs,bhsd->bhrd", p / p.sum(-1, keepdims=True), v).reshape(-1)


def test_packed_attention_inputs_are_checked():
    q, kq, vq, bias, _ = packed_inputs(1, 1, 2, 8, 64, 8, 64)
    with pytest.raises(ValueError, match="scales and biases"):
        K.decode_attention(q, kq[0], vq[0], bias, True)
    with pytest.raises(ValueError, match="float32"):
        K.decode_attention(q, kq[0], vq[0], bias, True, packed=[kq[1].astype(mx.float16), kq[2], vq[1], vq[2]])


def test_the_mode_is_checked_and_named(mode):
    assert mode() in ("auto", "blas", "vector")
    assert mode("vector") == "vector" and mode() == "vector"
    assert mode("blas") == "blas"
    with pytest.raises(ValueError, match="auto, blas or vector"):
        mode("fast")
    assert mode() == "blas"


def test_bad_inputs_are_refused():
    q, k, v, bias = inputs(1, 2, 3, 8, 64, mx.float32)
    with pytest.raises(ValueError, match="evaluate its inputs"):
        K.decode_attention(q, k, v, mx.zeros((1, 8)) + 1, True)
    wrong = mx.zeros((1, 9))
    mx.eval(wrong)
    with pytest.raises(ValueError, match="bias \\[B, S\\]"):
        K.decode_attention(q, k, v, wrong, True)
    q2, k2, v2, b2 = inputs(1, 1, 1, 4, 40, mx.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        K.decode_attention(q2, k2, v2, b2, True)
    assert np.isfinite(attend(q2, k2, v2, b2, vector=False)).all()  # the BLAS arithmetic serves any D


def layer_mid(packed: bool):
    """One decode layer_mid on random inputs: float32 or packed 4-bit projections."""
    B, nk, R, D, S, hid, F = 2, 3, 3, 64, 70, 576, 128
    rng = np.random.default_rng(7)
    arr = lambda *s: mx.array(rng.standard_normal(s, dtype=np.float32) / 8)  # noqa: E731
    wo, wgu = arr(hid, nk * R * D), arr(2 * F, hid)

    def slot(name, w):
        if not packed:
            return {name: w.T}
        q, scales, biases = mx.quantize(w, group_size=32, bits=4)
        return {name: q, f"{name}_scales": scales, f"{name}_biases": biases}

    bias = np.zeros((B, 1, 1, S), np.float32)
    bias[0, ..., :9] = LOW
    ins = dict(q=arr(B, nk, R, D), k=arr(B, nk, S, D), v=arr(B, nk, S, D), bias=mx.array(bias), h=arr(B, hid),
               norm=mx.ones((hid,)), **slot("w_o", wo), **slot("w_gu", wgu))
    out = K.layer_mid(ins, eps=1e-5)
    mx.eval(out)
    return [np.asarray(o).view(np.int32) for o in out]


@pytest.mark.parametrize("packed", [False, True], ids=["float32", "packed"])
def test_auto_is_vector_beside_packed_projections_and_blas_beside_float32(mode, packed):
    outs = {}
    for m in ("auto", "blas", "vector"):
        mode(m)
        outs[m] = layer_mid(packed)
    assert not all(np.array_equal(a, b) for a, b in zip(outs["blas"], outs["vector"]))  # the check can fail
    want = outs["vector" if packed else "blas"]
    assert all(np.array_equal(a, b) for a, b in zip(outs["auto"], want))


def setting_at_load(var: str, value: str, getter: str):
    """In a fresh process with ``var=value``: (the kernels' ``getter()``, the
    kernels' status line, stderr)."""
    import os
    import subprocess
    import sys

    code = (f"import mlx_tracer\nfrom mlx_tracer.backend import kernels\nprint(kernels.load().{getter}())\n"
            "print(kernels.status())")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, var: value}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    mode, status = out.stdout.splitlines()[:2]
    return mode, status, out.stderr


@pytest.mark.parametrize("value,want", [("blas", "blas"), ("vector", "vector"), ("", "auto"), ("fastest", "auto")])
def test_the_environment_picks_the_mode_at_load(value, want):
    mode, status, err = setting_at_load("MLX_TRACER_ATTENTION", value, "attention_mode")
    assert mode == want and "decode attention" in status
    if value == "fastest":
        assert "auto, blas or vector" in err


@pytest.fixture
def packed_mode():
    before = K.packed_attention()
    yield K.packed_attention
    K.packed_attention(before)


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantized_keeps_mlx_values_in_the_lanes_where_factored_would_run(packed_mode, bits):
    """MLX_TRACER_PACKED_ATTENTION=dequantized (packed_attention): one group a
    row too, the lanes take MLX's dequantized values (the bits of the float32
    path on them, every ISA path); the default factored arithmetic differs
    from them (so the switch is seen) within its bound."""
    q, kq, vq, bias, (kd, vd) = packed_inputs(2, 3, 3, 37, 64, bits, 64)
    assert packed_mode() == "factored"
    factored = attend_packed(q, kq, vq, bias)
    assert packed_mode("dequantized") == "dequantized" and packed_mode() == "dequantized"
    outs = on_every_path(lambda: attend_packed(q, kq, vq, bias))
    assert np.array_equal(outs["portable"].view(np.int32), attend(q, kd, vd, bias).view(np.int32))
    assert not np.array_equal(factored.view(np.int32), outs["portable"].view(np.int32))
    with pytest.raises(ValueError, match="factored or dequantized"):
        packed_mode("exact")
    assert packed_mode() == "dequantized"


@pytest.mark.parametrize("value,want", [("dequantized", "dequantized"), ("", "factored"), ("mlx", "factored")])
def test_the_environment_picks_the_packed_arithmetic_at_load(value, want):
    mode, status, err = setting_at_load("MLX_TRACER_PACKED_ATTENTION", value, "packed_attention")
    assert mode == want and f"quantized K/V of one group a row {want}" in status
    # the factored keys' integer products name their ISA (the fast contract's int8 kernels')
    assert (f"the keys' products in integers: {K.qmm_int8_isa()}" in status) == (want == "factored")
    if value == "mlx":
        assert "factored or dequantized" in err


@pytest.mark.parametrize("bits", [8, 4])
def test_factored_scores_take_any_query_row(bits):
    """The factored scores split each query row into three int8 parts scaled
    by its largest |q| (qmm_api.h's QSplit): a row of zeros, a row with a
    NaN and a row whose values span six orders of magnitude. The same bits
    on every ISA path; zeros give the visible values' mean; a NaN poisons
    its own row only (the other rows' bits as with that row zeroed); the
    wide row within the factored arithmetic's bound of the float64 value."""
    B, nk, R, S, D = 1, 2, 4, 45, 64
    q, kq, vq, bias, _ = packed_inputs(B, nk, R, S, D, bits, 64, seed=5)
    qn = np.array(q)
    qn[0, 0, 0] = 0.0
    qn[0, 0, 2] *= np.logspace(-3, 3, D, dtype=np.float32)[np.random.default_rng(1).permutation(D)] / 100
    zeroed = qn.copy()
    qn[0, 1, 1, 7] = np.nan
    zeroed[0, 1, 1] = 0.0
    q, q0 = mx.array(qn), mx.array(zeroed)
    outs = on_every_path(lambda: attend_packed(q, kq, vq, bias))
    got = outs["portable"].reshape(B, nk, R, D)
    assert np.isnan(got[0, 1, 1]).all() and np.isfinite(np.delete(got.reshape(-1, D), 1 * R + 1, 0)).all()
    clean = attend_packed(q0, kq, vq, bias).reshape(B, nk, R, D)
    rows = [(h, r) for h in range(nk) for r in range(R) if (h, r) != (1, 1)]
    for h, r in rows:
        assert np.array_equal(got[0, h, r].view(np.int32), clean[0, h, r].view(np.int32))
    vals = exact_values(vq, bits, 64)
    visible = np.asarray(bias)[0] == 0
    mean = vals[0, 0, visible].mean(0)
    assert np.abs(got[0, 0, 0] - mean).max() <= 16 * np.finfo(np.float32).eps * np.abs(mean).max()
    exact64 = _reference64(np.asarray(q0, np.float64), exact_values(kq, bits, 64), vals,
                           np.asarray(bias, np.float64)).reshape(B, nk, R, D)
    wide = exact64[0, 0, 2]
    assert np.abs(got[0, 0, 2] - wide).max() <= 16 * np.finfo(np.float32).eps * np.abs(wide).max()


@pytest.mark.parametrize("B,nk,R,L,S", [(1, 3, 3, 5, 70), (1, 1, 2, 40, 96), (2, 2, 3, 9, 33)])
def test_a_windows_attention_gives_each_position_its_decode_steps_bits(B, nk, R, L, S, mode):
    """A verify or prefill window's attention on the vector lanes (layer_mid
    with a mask [B, 1, 1, L, S]) splits each (row, key head) block's
    positions into runs over the threads (here 2-8 runs a block); each
    position's outputs are still the bits of a decode step there (layer_mid
    with that position's queries and its mask as the bias), on every ISA
    path: what lets a verify window judge drafts on the plain decode's
    logits."""
    from .test_kernels import Packed, linear, norm

    mode("vector")
    mx.random.seed(B * L + S)
    D, hid, F = 64, 64, 96
    o = Packed(linear(nk * R * D, hid, False), 32, 4, mx.float16, "split")
    gu = Packed(linear(hid, 2 * F, True), 32, 4, mx.float16, "split")
    post = norm(hid, 2)
    q = mx.random.normal((B, nk, R, L, D)) / 4
    h = mx.random.normal((B * L, hid))
    keys, values = (mx.random.normal((B, nk, S, D)).astype(mx.float16) for _ in range(2))
    mask = mx.random.uniform(shape=(B, 1, 1, L, S)) > 0.4
    mask[..., 0] = True  # every query sees a column
    weights = dict(**o.slot("w_o"), norm=post.weight, **gu.slot("w_gu"), b_gu=gu.bias)

    def run():
        h2, act = K.layer_mid(dict(q=q, k=keys, v=values, mask=mask, h=h, **weights), eps=1e-5, contract="split")
        h2, act = h2.reshape(B, L, hid), act.reshape(B, L, F)
        for pos in range(L):
            bias = mx.where(mask[..., pos, :], mx.array(0.0), mx.array(LOW, mx.float32))  # [B, 1, 1, S]
            step = dict(q=mx.contiguous(q[:, :, :, pos]), k=keys, v=values, bias=bias,
                        h=mx.contiguous(h.reshape(B, L, hid)[:, pos]), **weights)
            h2_pos, act_pos = K.layer_mid(step, eps=1e-5, contract="split")
            assert mx.array_equal(h2[:, pos], h2_pos).item() and mx.array_equal(act[:, pos], act_pos).item(), pos
        return np.asarray(h2).reshape(-1)

    on_every_path(run)
