"""The native quantized matmul (``qmm`` in mlx_tracer.backend.kernels): on
every ISA path it equals x @ dequantize(w).T in float32 up to the order of
summation, dequantizes each weight to the bits MLX's float32 dequantize
computes, reads strided views, gives the same bits with 1 and 2 threads and
inside mx.compile, and refuses bad inputs with a clear error. Its fast
contract (x in int8 per 32-block, integer dot products) stays within
FAST_BOUND of the exact result on every path, with the same guarantees of
determinism. Its factored contract (per group, scale * sum(q x) + bias *
sum(x)) stays within BOUND, computes the arithmetic qmm.cpp states for it
(checked against a plain reimplementation here) and the same bits on every
path. Its split contract (x in 15 bits a 32-block, as an int8 part and an
int8 remainder, the fast contract's integer products) stays within
SPLIT_BOUND, with x's bytes checked against the stated quantization, and
the fast contract's guarantees of determinism."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_tracer.backend import kernels

from .helpers import forced_isa

K = kernels.load()
PATHS = ("portable", "avx2", "avx512")
# (M, N, K, group): decode rows, verify windows and prefill on both sides of the
# few-row threshold; N no multiple of a tile, K multiples of the group.
CASES = ((1, 576, 576, 32), (2, 1000, 64, 64), (3, 51, 2048, 128), (5, 576, 1536, 64), (8, 1000, 576, 32),
         (17, 51, 1024, 128), (64, 576, 256, 32), (257, 1000, 2048, 64))
# |qmm - exact| <= BOUND * sum_k |x_k w_k| for each output (float32 sums of up
# to 2048 products: the worst case of a blocked float32 sum is ~K/16 * 2^-24).
BOUND = 1e-5
# The fast contract: |fast - exact| <= FAST_BOUND * sum_k |x_k w_k| (x rounded
# to int8 per 32-block, an error up to max|x| / 254 an element; measured over
# CASES: at most 3.9e-3, for 4 and 8 bits alike, before and after the 4-lane
# float order of qmm_fast.h).
FAST_BOUND = 1e-2
# The split contract: x in 15 bits a block (int8 and an int8 remainder at
# 1/128 of its scale), an error up to max|x| / 32512 an element: 1/128 of
# the fast contract's, so FAST_BOUND / 128 (measured over CASES: ~1e-5).
SPLIT_BOUND = FAST_BOUND / 128

pytestmark = pytest.mark.skipif(K is None, reason=f"native kernels unavailable: {kernels.status()}")


@pytest.fixture
def isa(request):
    """Forces an ISA path for one test (skipped where the CPU lacks it)."""
    with forced_isa(K, request.param) as got:
        yield got


@pytest.fixture
def threads():
    before = K.qmm_threads()
    yield K.qmm_set_threads
    K.qmm_set_threads(before)


def quantized(N, Kd, group, bits, dtype, seed=0):
    W = mx.random.normal((N, Kd), key=mx.random.key(seed))
    w, s, b = mx.quantize(W, group, bits)
    s, b = s.astype(dtype), b.astype(dtype)
    mx.eval(w, s, b)
    return w, s, b


def dequantized(w, s, b, group, bits):
    """The contract's weights: MLX's float32 dequantize of float32 scales and biases."""
    return mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group, bits, dtype=mx.float32)


@functools.lru_cache(maxsize=None)
def case(i: int, bits: int, dtype_name: str):
    """CASES[i]'s inputs, the exact result x @ W.T in float64 and sum_k |x_k w_k|
    (W: the contract's weights), shared by the ISA paths."""
    M, N, Kd, group = CASES[i]
    w, s, b = quantized(N, Kd, group, bits, getattr(mx, dtype_name), seed=i)
    x = mx.random.normal((M, Kd), key=mx.random.key(100 + i))
    X, W = np.array(x, np.float64), np.array(dequantized(w, s, b, group, bits), np.float64)
    return (x, w, s, b), X @ W.T, np.abs(X) @ np.abs(W).T


@pytest.mark.parametrize("isa", PATHS, indirect=True)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("contract,bound", [("exact", BOUND), ("factored", BOUND), ("fast", FAST_BOUND),
                                            ("split", SPLIT_BOUND)])
def test_qmm_is_within_its_contract_of_the_float32_dequantized_matmul(isa, bits, dtype, contract, bound):
    for i, (M, N, Kd, group) in enumerate(CASES):
        args, exact, magnitude = case(i, bits, dtype)
        y = K.qmm(*args, group, bits, contract=contract)
        assert y.shape == (M, N) and y.dtype == mx.float32
        err = float((np.abs(np.array(y, np.float64) - exact) / magnitude).max())
        assert err <= bound, f"{isa} {contract} M={M} N={N} K={Kd} group={group} bits={bits}: {err:.2e}"


@pytest.mark.parametrize("isa", PATHS, indirect=True)
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (4, 128), (8, 32)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_each_weight_is_mlx_float32_dequantize_bit_for_bit(isa, bits, group, dtype):
    """Rows of the identity pick single weights out: no sum, so the outputs are
    the dequantized weights themselves (few-row and panel paths). Widened
    float16/bfloat16 scales take one fused multiply-add (their products with
    q are exact in float32), float32 ones the product rounded, then the bias:
    MLX's bits either way."""
    Kd = 256
    w, s, b = quantized(40, Kd, group, bits, getattr(mx, dtype))
    want = np.array(dequantized(w, s, b, group, bits)).T  # [K, N]
    eye = mx.eye(Kd)
    for r0, rows in ((0, 1), (5, 8), (64, 3), (0, Kd)):
        got = np.array(K.qmm(eye[r0:r0 + rows], w, s, b, group, bits))
        assert np.array_equal(got, want[r0:r0 + rows]), (isa, r0, rows)


def test_float16_scales_are_widened_not_computed_in_float16():
    """mx.dequantize with float16 scales computes in float16; qmm in float32."""
    w, s, b = quantized(64, 256, 32, 4, mx.float16)
    in_f16 = np.array(mx.dequantize(w, s, b, 32, 4, dtype=mx.float32))
    in_f32 = np.array(dequantized(w, s, b, 32, 4))
    got = np.array(K.qmm(mx.eye(256), w, s, b, 32, 4)).T
    assert np.array_equal(got, in_f32) and not np.array_equal(got, in_f16)


@pytest.mark.parametrize("isa", PATHS, indirect=True)
@pytest.mark.parametrize("contract", ["exact", "factored", "fast", "split"])
@pytest.mark.parametrize("group,bits", [(32, 8), (32, 4), (64, 4)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_scales_read_in_place_or_widened_give_the_same_bits(isa, contract, group, bits, dtype):
    """float32 scales are read where they lie (group 32: every contract; a
    quantized embedding's head or Q4_K's blocks), float16/bfloat16 ones
    widened (the exact contract's few-row tiles: 16 weight rows at a time,
    rows left over past the last 16 and x rows past one tile of 8 too):
    the same values give the same bits either way."""
    w, s, b = quantized(301, 576, group, bits, getattr(mx, dtype), seed=3)
    x = mx.random.normal((9, 576), key=mx.random.key(4))
    for M in (1, 2, 3, 9):
        got = K.qmm(x[:M], w, s.astype(mx.float32), b.astype(mx.float32), group, bits, contract=contract)
        assert mx.array_equal(got, K.qmm(x[:M], w, s, b, group, bits, contract=contract)).item()


@pytest.mark.parametrize("M", [3, 40])
def test_strided_views_read_as_their_dense_copies(M):
    Kd, group, bits = 128, 32, 4
    w, s, b = quantized(70, Kd, group, bits, mx.float16)
    big = mx.random.normal((M + 2, 3 * Kd), key=mx.random.key(7))
    dense = mx.contiguous(big[1:M + 1, 5:5 + Kd])
    want = np.array(K.qmm(dense, w, s, b, group, bits))
    views = {
        "row stride": big[1:M + 1, 5:5 + Kd],
        "column stride": big[1:M + 1, : 2 * Kd : 2],
        "transposed": mx.contiguous(big[1:M + 1, 5:5 + Kd].T).T,
    }
    for name, x in views.items():
        ref = np.array(K.qmm(mx.contiguous(x), w, s, b, group, bits))
        assert np.array_equal(np.array(K.qmm(x, w, s, b, group, bits)), ref), name
    assert np.array_equal(np.array(K.qmm(views["row stride"], w, s, b, group, bits)), want)
    wide = lambda a: mx.repeat(a, 2, axis=1)[:, ::2]  # noqa: E731  (same values, column stride 2)
    got = K.qmm(dense, wide(w), wide(s), wide(b), group, bits)
    assert np.array_equal(np.array(got), want)


@pytest.mark.parametrize("contract", ["exact", "factored", "fast", "split"])
@pytest.mark.parametrize("M,N,Kd,bits", [(1, 3000, 576, 4), (8, 1000, 1536, 4), (40, 700, 576, 4), (3, 900, 800, 8)])
def test_one_and_two_threads_give_the_same_bits(threads, contract, M, N, Kd, bits):
    w, s, b = quantized(N, Kd, 32, bits, mx.float16)
    x = mx.random.normal((M, Kd), key=mx.random.key(3))
    outs = []
    for n in (1, 2, 1, 2):
        threads(n)
        outs.append(np.array(K.qmm(x, w, s, b, 32, bits, contract=contract)))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("isa", PATHS, indirect=True)
@pytest.mark.parametrize("contract", ["exact", "factored", "fast", "split"])
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (4, 64), (8, 128)])
def test_a_row_has_the_same_bits_at_every_m_up_to_the_tile_threshold(isa, contract, bits, group):
    """A verify window multiplies its k + 1 positions as M rows where decode
    steps multiply one: each output must be the decode step's, bit for bit, at
    every M the tiles serve (1..64; every tile size and remainder), on every
    path (the fast contract at every M)."""
    w, s, b = quantized(77, 384, group, bits, mx.float16, seed=7)
    x = mx.random.normal((64, 384), key=mx.random.key(8))
    alone = np.concatenate([np.array(K.qmm(x[i:i + 1], w, s, b, group, bits, contract=contract)) for i in range(64)])
    for M in (2, 3, 4, 5, 6, 7, 8, 9, 12, 20, 40, 64):
        got = np.array(K.qmm(x[:M], w, s, b, group, bits, contract=contract))
        assert np.array_equal(got, alone[:M]), (isa, contract, bits, M)


def unpacked(w, bits):
    """The integers q [N, K] of mx.quantize's words: weight i at bits
    bits * (i % (32 / bits)) of word i / (32 / bits)."""
    words = np.array(w).astype(np.uint64)
    per = 32 // bits
    shifts = (bits * np.arange(per)).astype(np.uint64)
    return ((words[:, :, None] >> shifts) & np.uint64(2**bits - 1)).reshape(words.shape[0], -1).astype(np.int64)


def factored_reference(x, w, s, b, group, bits):
    """qmm.cpp's factored contract, operation by operation, in numpy float32
    (fused multiply-adds exact in long double, then rounded once): per block
    of 32, four vectors of 8 lanes (4 bits: lane l < 4 of vector j weight
    8 l + j, lane l + 4 weight 8 l + j + 4; q times 2^e and x times 2^-e, e
    from {0, 0, 8, 8} and {16, 16, 24, 24}; 8 bits: vector i, lane l weight
    8 i + l), each x row and weight row with two accumulators a group, etc."""
    f32, ld = np.float32, np.longdouble
    fma = lambda a, b, c: (a.astype(ld) * b.astype(ld) + c.astype(ld)).astype(f32)  # noqa: E731
    X = np.array(x, f32)                      # [M, K]
    Q = unpacked(w, bits).astype(f32)         # [N, K]
    S, B = np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32))  # [N, G]
    M, Kd = X.shape
    lanes, e = np.zeros((4, 8), np.int64), np.zeros((4, 8), np.int64)
    for j in range(4):
        for lane in range(8):
            if bits == 4:
                lanes[j, lane] = 8 * lane + j if lane < 4 else 8 * (lane - 4) + j + 4
                e[j, lane] = (0, 0, 8, 8)[j] if lane < 4 else (16, 16, 24, 24)[j]
            else:
                lanes[j, lane] = 8 * j + lane
    up, down = np.ldexp(f32(1), e).astype(f32), np.ldexp(f32(1), -e).astype(f32)
    acc = np.zeros((M, Q.shape[0], 8), f32)
    for g in range(Kd // group):
        ga = [None, None]
        for t in range(group // 32):
            k0 = g * group + 32 * t
            for v in range(4):
                qv = (Q[:, k0 + lanes[v]] * up[v])[None]          # [1, N, 8]
                xv = (X[:, k0 + lanes[v]] * down[v])[:, None]     # [M, 1, 8]
                ga[v & 1] = (qv * xv).astype(f32) if t == 0 and v < 2 else fma(qv, xv, ga[v & 1])
        acc = fma(S[None, :, g, None], (ga[0] + ga[1]).astype(f32), acc)
    sums = np.zeros((M, Kd // group), f32)
    for g in range(Kd // group):
        t = np.zeros(M, f32)
        for k in range(g * group, (g + 1) * group):
            t = (t + X[:, k]).astype(f32)
        sums[:, g] = t
    bias = np.zeros((M, Q.shape[0]), f32)
    for g in range(Kd // group):
        bias = (bias + (B[None, :, g] * sums[:, g, None]).astype(f32)).astype(f32)
    a = acc
    total = ((a[..., 0] + a[..., 4]) + (a[..., 2] + a[..., 6])) + ((a[..., 1] + a[..., 5]) + (a[..., 3] + a[..., 7]))
    return (total.astype(f32) + bias).astype(f32)


@pytest.mark.parametrize("isa", PATHS, indirect=True)
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (8, 128), (4, 128)])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_factored_contract_computes_its_stated_arithmetic_bit_for_bit(isa, bits, group, dtype):
    w, s, b = quantized(37, 256, group, bits, getattr(mx, dtype), seed=bits + group)
    x = mx.random.normal((5, 256), key=mx.random.key(group))
    for M in (1, 5):
        got = np.array(K.qmm(x[:M], w, s, b, group, bits, contract="factored"))
        assert np.array_equal(got, factored_reference(x[:M], w, s, b, group, bits)), (isa, M)


def int8_reference(x, w, s, b, group, bits, split):
    """qmm.cpp's fast (split=False) or split contract, operation by operation
    in numpy (float32 roundings; fused multiply-adds exact in float64 or long
    double, then rounded once): x quantized per 32-block (d = max|x| / 127,
    xq = round(x * (127 / max|x|)), ties to even; split: the remainder r =
    fma(-d, xq, x), xr = round(r * (128 * 127 / max|x|)), T = 128 xq + xr
    at scale d / 128), each block's exact integer sum with the weights'
    integers times (s * d) into lane block % 4, then the groups' biases
    times their sums of d * float(sum of T) into lane group % 4, the lanes
    added as (0 + 1) + (2 + 3)."""
    f32, f64, ld = np.float32, np.float64, np.longdouble
    X = np.array(x, f32)                                  # [M, K]
    Q = unpacked(w, bits)                                 # [N, K] int64
    S, B = np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32))  # [N, G]
    M, Kd = X.shape
    nb, per = Kd // 32, group // 32
    blocks = X.reshape(M, nb, 32)
    amax = np.abs(blocks).max(-1, keepdims=True).astype(f32)
    inv = np.where(amax > 0, f32(127) / np.where(amax > 0, amax, f32(1)), f32(0)).astype(f32)
    d = (amax / f32(127)).astype(f32)
    xq = np.rint((blocks * inv).astype(f32)).astype(np.int64)
    if split:
        r = (blocks.astype(f64) - d.astype(f64) * xq.astype(f64)).astype(f32)  # fma(-d, xq, x): exact in float64
        xr = np.rint((r * (inv * f32(128)).astype(f32)).astype(f32)).astype(np.int64)
        xq, d = 128 * xq + xr, (d * f32(2.0**-7)).astype(f32)
    T = np.einsum("nbk,mbk->mnb", Q.reshape(-1, nb, 32), xq)          # [M, N, blocks] exact
    sd = (S[None, :, np.arange(nb) // per] * d[:, None, :, 0]).astype(f32)                       # [M, N, blocks]
    lanes = np.zeros((M, Q.shape[0], 4), f32)
    for blk in range(nb):
        a = lanes[..., blk % 4]
        lanes[..., blk % 4] = (T[..., blk].astype(f32).astype(ld) * sd[..., blk].astype(ld) + a.astype(ld)).astype(f32)
    xsum = (d[..., 0] * xq.sum(-1).astype(f32)).astype(f32)          # [M, blocks]: d * float(sum)
    G = nb // per
    xg = np.zeros((M, G), f32)
    for g in range(G):
        v = xsum[:, g * per]
        for t in range(1, per):
            v = (v + xsum[:, g * per + t]).astype(f32)
        xg[:, g] = v
    for g in range(G):
        a = lanes[..., g % 4]
        lanes[..., g % 4] = (B[None, :, g].astype(ld) * xg[:, None, g].astype(ld) + a.astype(ld)).astype(f32)
    return ((lanes[..., 0] + lanes[..., 1]).astype(f32) + (lanes[..., 2] + lanes[..., 3]).astype(f32)).astype(f32)


@pytest.mark.parametrize("isa", PATHS, indirect=True)
@pytest.mark.parametrize("contract", ["fast", "split"])
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (8, 128), (4, 128)])
def test_the_fast_and_split_contracts_compute_their_stated_arithmetic_bit_for_bit(isa, contract, bits, group):
    # 352 = 11 blocks of 32, 160 = 5, 320 = 10: a last step of 3, 1 or 2 blocks (its float16 scales and
    # biases gathered in part); 8352 = 65 steps and 1 block: one x row's tiles read a row in segments of
    # 64 steps (qmm_fast.h's kSeg), the last one short, or (AVX2: rows of >= 1 KB; VNNI: any) a quad's rows
    # side by side; 2048 at groups 64 and 128: their scales widened, not read in place, side by side; 576 at
    # group 64: a last step of 2 blocks (AVX2's tiles of 2-5 rows: a full step's first pair) beside widened scales
    for Kd in (384, 352, 160, 320, 8352) if group == 32 else (384, 2048) + ((576,) if group == 64 else ()):
        w, s, b = quantized(37, Kd, group, bits, mx.float16, seed=bits + group)
        x = mx.random.normal((5, Kd), key=mx.random.key(group)) * mx.array([1.0, 1e-3, 40.0, 1.0, 0.5])[:, None]
        for M in (1, 5):
            got = np.array(K.qmm(x[:M], w, s, b, group, bits, contract=contract))
            want = int8_reference(x[:M], w, s, b, group, bits, split=contract == "split")
            assert np.array_equal(got, want), (isa, contract, Kd, M, np.abs(got - want).max())


@pytest.mark.parametrize("isa", PATHS, indirect=True)
@pytest.mark.parametrize("contract", ["fast", "split"])
@pytest.mark.parametrize("bits", [4, 8])
def test_x_blocks_of_zeros_subnormals_and_extremes_are_quantized_as_stated(isa, contract, bits):
    # AVX2 quantizes a 32-block of x on vectors (qmm_ops_x86.h's x_block), the portable path and a
    # block with an infinity or NaN a value at a time: the same bytes, so the reference's bits
    Kd = 256  # 8 blocks a row
    w, s, b = quantized(37, Kd, 32, bits, mx.float16, seed=bits)
    rows = np.random.default_rng(bits).standard_normal((6, Kd)).astype(np.float32)
    rows[0, :32] = 0.0  # a block of zeros (max |x| = 0: its scale 0)
    rows[0, 32:64] = -0.0
    rows[1, :32] *= np.float32(1e-39)  # subnormals beside a tiny normal maximum
    rows[1, 5] = np.float32(-2e-30)
    rows[1, 32:64] = np.float32(3e30) * np.sign(rows[1, 32:64])  # large magnitudes (the outputs still finite)
    rows[2, 64:96] = 0.0
    rows[2, 70] = np.float32(-1e-30)  # alone in a block of zeros: it becomes -127
    rows[3] *= np.float32(1e6)
    rows[4, 96:128] = np.linspace(-1.0, 1.0, 32, dtype=np.float32)  # ties at x * inv = k + 0.5
    rows[5, 128:160] = np.float32(np.nan)
    x = mx.array(rows)
    got = np.array(K.qmm(x, w, s, b, 32, bits, contract=contract))
    want = int8_reference(x[:5], w, s, b, 32, bits, split=contract == "split")
    assert np.isfinite(got[:5]).all() and np.array_equal(got[:5], want), (isa, contract, bits)
    assert np.isnan(got[5]).all()


@pytest.mark.parametrize("contract", ["fast", "factored", "split"])
@pytest.mark.parametrize("bits", [4, 8])
def test_fast_factored_and_split_contracts_give_the_same_bits_on_every_isa_path(contract, bits):
    """Their float32 order is one definition (qmm_fast.h, qmm_factored.h;
    the fast and split contracts' integer sums are exact, their x the same
    bytes on every path): each path computes the same
    bits, any M (tiles of x rows; the factored contract up to 64 rows, the
    exact contract's panels above), N (quads of weight rows) and K (a last
    step of fewer than 4 blocks)."""
    before = K.qmm_isa()
    try:
        for i, (M, N, Kd, group) in enumerate(CASES + ((9, 37, 320, 64), (1, 5, 96, 32))):
            if contract == "factored" and M > K.qmm_tile_rows():
                continue
            w, s, b = quantized(N, Kd, group, bits, mx.float16, seed=i)
            x = mx.random.normal((M, Kd), key=mx.random.key(50 + i))
            outs = {}
            for name in PATHS:
                if K.qmm_set_isa(name) == name:
                    outs[name] = np.array(K.qmm(x, w, s, b, group, bits, contract=contract))
            first = next(iter(outs.values()))
            for name, got in outs.items():
                assert np.array_equal(got, first), (name, M, N, Kd, group)
    finally:
        K.qmm_set_isa(before)


@pytest.mark.parametrize("contract", ["exact", "factored", "fast", "split"])
def test_compiled_equals_eager(contract):
    w, s, b = quantized(300, 256, 64, 8, mx.bfloat16)
    f = lambda x: K.qmm(x, w, s, b, 64, 8, contract=contract) * 2.0 + 1.0  # noqa: E731
    cf = mx.compile(f)
    for M in (1, 8, 17):
        x = mx.random.normal((M, 256), key=mx.random.key(M))
        assert np.array_equal(np.array(cf(x)), np.array(f(x))), M


def test_the_four_contracts_are_distinct_graph_nodes():
    """One compiled function calling each must not merge them (is_equivalent)."""
    w, s, b = quantized(64, 256, 32, 4, mx.float16)
    x = mx.random.normal((2, 256), key=mx.random.key(5))
    contracts = ("exact", "factored", "fast", "split")
    outs = mx.compile(lambda x: [K.qmm(x, w, s, b, 32, 4, contract=c) for c in contracts])(x)
    for c, got in zip(contracts, outs):
        assert np.array_equal(np.array(got), np.array(K.qmm(x, w, s, b, 32, 4, contract=c))), c
    assert len({np.array(o).tobytes() for o in outs}) == 4


@pytest.mark.parametrize("contract", ["fast", "split"])
def test_fast_and_split_contracts_read_strided_views_and_non_finite_x(contract):
    Kd, group, bits = 320, 64, 4  # 10 blocks: a partial last superblock of 8
    w, s, b = quantized(37, Kd, group, bits, mx.float16)
    big = mx.random.normal((5, 2 * Kd), key=mx.random.key(11))
    view = big[1:4, 3:3 + Kd]
    want = np.array(K.qmm(mx.contiguous(view), w, s, b, group, bits, contract=contract))
    assert np.array_equal(np.array(K.qmm(view, w, s, b, group, bits, contract=contract)), want)
    x = mx.contiguous(view) * mx.array([1.0, float("inf"), 1.0])[:, None]
    got = np.array(K.qmm(x, w, s, b, group, bits, contract=contract))
    assert np.array_equal(got[[0, 2]], want[[0, 2]]) and np.isnan(got[1]).all()


def test_bad_inputs_are_refused_with_what_was_wrong():
    w, s, b = quantized(64, 128, 32, 4, mx.float16)
    x = mx.zeros((2, 128))
    bad = [
        (lambda: K.qmm(x.astype(mx.float16), w, s, b, 32, 4), "x must be float32"),
        (lambda: K.qmm(x, w.astype(mx.int32), s, b, 32, 4), "w must be uint32"),
        (lambda: K.qmm(mx.zeros((2, 96)), w, s, b, 32, 4), r"w must be uint32 \[N, K \* bits / 32\] = \[N, 12\]"),
        (lambda: K.qmm(x, w, s[:, :2], b, 32, 4), "scales and biases must be"),
        (lambda: K.qmm(x, w, s, b.astype(mx.float32), 32, 4), "biases must have the scales' dtype"),
        (lambda: K.qmm(x, w, s.astype(mx.int32), b.astype(mx.int32), 32, 4), "scales must be float16"),
        (lambda: K.qmm(x, w, s, b, 32, 3), r"bits must be 4, 5 or 6 \(qmm.s own layouts: qmm_api.h\) or 8, got 3"),
        (lambda: K.qmm(x, w, s, b, 16, 4), "group_size must be 32, 64 or 128, got 16"),
        (lambda: K.qmm(mx.zeros((2, 100)), w, s, b, 32, 4), "K = 100 is not a multiple of group_size 32"),
        (lambda: K.qmm(mx.zeros((128,)), w, s, b, 32, 4), r"x must be float32 \[M, K\]"),
    ]
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(ValueError, match="no ISA path 'sse9'"):
        K.qmm_set_isa("sse9")
    with pytest.raises(ValueError, match="contract must be 'exact', 'fast', 'factored' or 'split', got 'fastest'"):
        K.qmm(x, w, s, b, 32, 4, contract="fastest")


def run_with(env: dict) -> subprocess.CompletedProcess:
    code = ("import mlx_tracer; from mlx_tracer.backend import kernels; K = kernels.load(); "
            "print(K.qmm_isa(), K.qmm_threads())")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_the_environment_forces_a_path_and_the_thread_count():
    best = run_with({"MLX_TRACER_QMM_ISA": ""})
    assert best.returncode == 0, best.stderr
    best_isa = best.stdout.split()[0]
    assert best_isa in PATHS and best.stdout.split()[1] == str(len(os.sched_getaffinity(0)))
    # unset or empty: the best path the CPU has, without a word (on a CPU
    # without AVX-512 0.5.10 said "MLX_TRACER_QMM_ISA= is not supported" at
    # every start)
    unset = subprocess.run([sys.executable, "-c", "import mlx_tracer; from mlx_tracer.backend import kernels; "
                            "print(kernels.load().qmm_isa())"], capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if k != "MLX_TRACER_QMM_ISA"})
    assert unset.stdout.split() == [best_isa] and "MLX_TRACER_QMM_ISA" not in unset.stderr, unset.stderr
    assert "MLX_TRACER_QMM_ISA" not in best.stderr, best.stderr
    if best_isa != PATHS[-1]:  # a path better than the CPU has: said, and the best it has serves
        beyond = run_with({"MLX_TRACER_QMM_ISA": PATHS[-1]})
        assert beyond.stdout.split()[0] == best_isa
        assert f"MLX_TRACER_QMM_ISA={PATHS[-1]} is not supported by this CPU; using {best_isa}" in beyond.stderr
    for name in PATHS[: PATHS.index(best_isa) + 1]:
        out = run_with({"MLX_TRACER_QMM_ISA": name, "MLX_TRACER_QMM_THREADS": "3"})
        assert out.stdout.split() == [name, "3"], out.stderr
    unknown = run_with({"MLX_TRACER_QMM_ISA": "sse9"})
    assert unknown.stdout.split()[0] == best_isa
    assert "MLX_TRACER_QMM_ISA=sse9 is not one of portable" in unknown.stderr and f"using {best_isa}" in unknown.stderr


def test_the_integer_kernels_in_use_are_named():
    """``qmm_int8_isa`` (what ``mlx-tracer info`` prints beside the path)
    names the fast and split contracts' integer kernels: VNNI's on the
    AVX-512 path where the CPU has it (its flags in /proc/cpuinfo), else
    AVX2's there, the path's own on the others."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    want = {"avx512": "avx512-vnni" if "avx512_vnni" in flags else "avx2", "avx2": "avx2", "portable": "portable"}
    before, seen = K.qmm_isa(), 0
    try:
        for name in PATHS:
            if K.qmm_set_isa(name) == name:
                assert K.qmm_int8_isa() == want[name], name
                seen += 1
    finally:
        K.qmm_set_isa(before)
    assert seen >= 1
    assert f"(integer products: {K.qmm_int8_isa()})" in kernels.status()
