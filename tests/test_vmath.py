"""The layer kernels' vector math (``vmath_x86.h``: softmax's exponentials and
SwiGLU on 8 or 16 lanes) gives MLX's bits on every ISA path: ``mx.exp`` and
``(a * mx.sigmoid(a)) * b`` element for element, over dense random values,
the half-integer boundaries of its rounding (x * log2(e) = k + 1/2 and its
neighbours), the +-88 cut-offs, zeros, denormals, infinities and NaN. The
portable path has none (the kernels run MLX's one-lane functors there)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_tracer.backend import kernels

from .helpers import forced_isa

K = kernels.load()
pytestmark = pytest.mark.skipif(K is None, reason=f"native kernels unavailable: {kernels.status()}")


def values() -> np.ndarray:
    rng = np.random.default_rng(7)
    halves = (np.arange(-260, 260) * 0.5 / 1.442695).astype(np.float32)  # x * log2(e) near k + 1/2
    near = [np.nextafter(halves, np.float32(d)) for d in (np.inf, -np.inf)]
    near2 = [np.nextafter(n, np.float32(d)) for n, d in zip(near, (np.inf, -np.inf))]
    special = [np.nan, np.inf, -np.inf, 88.0, -88.0, 88.00001, -88.00001, 87.99999, -87.99999, 0.0, -0.0, 1e-40,
               -1e-40, 1e-30, 3e38, -3e38, 0.5, -0.5]
    return np.concatenate([rng.uniform(-100, 100, 20000), rng.normal(0, 4, 20000), halves, *near, *near2,
                           special, rng.uniform(-1, 1, 1003)]).astype(np.float32)


def same_bits(got, want) -> np.ndarray:
    got = np.asarray(got, dtype=np.float32)
    return got.view(np.uint32) == np.asarray(want, dtype=np.float32).view(np.uint32)


@pytest.fixture(params=["avx512", "avx2"])
def isa(request):
    with forced_isa(K, request.param) as got:
        yield got


@pytest.mark.parametrize("shift", [0.0, 3.25, -17.5])
def test_exp_is_mlx_exp_bit_for_bit(isa, shift):
    a = values()
    for n in (a.size, 1, 7, 15, 17, 33):  # every tail length the lanes leave
        got = K.vector_math("exp", a[:n].tolist(), [], shift)
        want = np.array(mx.exp(mx.array(a[:n]) - shift))
        ok = same_bits(got, want)
        assert ok.all(), (isa, shift, n, a[:n][~ok][:5], np.asarray(got)[~ok][:5], want[~ok][:5])


def test_swiglu_is_mlx_silu_times_up_bit_for_bit(isa):
    a = values()
    b = np.random.default_rng(8).normal(0, 2, a.size).astype(np.float32)
    for n in (a.size, 5, 16, 31):
        got = K.vector_math("swiglu", a[:n].tolist(), b[:n].tolist())
        x, y = mx.array(a[:n]), mx.array(b[:n])
        want = np.array((x * mx.sigmoid(x)) * y)
        ok = same_bits(got, want)
        assert ok.all(), (isa, n, a[:n][~ok][:5])


def test_portable_path_has_no_vector_math_and_names_are_checked():
    before = K.qmm_isa()
    try:
        assert K.qmm_set_isa("portable") == "portable"
        assert K.vector_math("exp", [1.0, 2.0]) is None
    finally:
        K.qmm_set_isa(before)
    with pytest.raises(Exception, match="'exp' or 'swiglu'"):
        K.vector_math("tanh", [1.0])
    with pytest.raises(Exception, match="one length"):
        K.vector_math("swiglu", [1.0, 2.0], [1.0])
