"""The native log-softmax (``logprobs`` in mlx_tracer.backend.kernels) gives
the bits of ``x - mx.logsumexp(x, axis=-1, keepdims=True)`` on the CPU, on
every ISA path (its exponentials on vector lanes, or MLX's own), for decode
rows, verify windows, strided views, one-element rows and non-finite logits
(-inf where a processor banned a token, +inf, NaN), eagerly and compiled;
the compiled step uses it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_tracer.backend import kernels

from .helpers import forced_isa

K = kernels.load()
pytestmark = pytest.mark.skipif(K is None, reason=f"native kernels unavailable: {kernels.status()}")


def reference(x: mx.array) -> np.ndarray:
    return np.array(x - mx.logsumexp(x, axis=-1, keepdims=True))


def assert_same_bits(got, want, what=""):
    got, want = np.asarray(got, dtype=np.float32), np.asarray(want, dtype=np.float32)
    assert got.shape == want.shape, what
    bad = got.view(np.uint32) != want.view(np.uint32)
    assert not bad.any(), (what, int(bad.sum()), got[bad][:4], want[bad][:4])


@pytest.fixture(params=["avx512", "avx2", "portable"])
def isa(request):
    with forced_isa(K, request.param) as got:
        yield got


@pytest.mark.parametrize("shape", [(1, 49152), (3, 1000), (2, 5, 77), (4, 1), (8, 33)])
def test_equals_the_mlx_ops_bit_for_bit(isa, shape):
    rng = np.random.default_rng(sum(shape))
    x = mx.array(rng.normal(0, 6, shape).astype(np.float32))
    assert_same_bits(K.logprobs(x), reference(x), (isa, shape))
    assert_same_bits(mx.compile(K.logprobs)(x), reference(x), (isa, shape, "compiled"))


def test_non_finite_rows_and_strided_views(isa):
    rng = np.random.default_rng(3)
    a = rng.normal(0, 3, (6, 200)).astype(np.float32)
    a[0, ::3] = -np.inf  # banned tokens
    a[1, :] = -np.inf  # every token banned
    a[2, 7] = np.inf
    a[3, 11] = np.nan
    a[4, :] = 1e30
    x = mx.array(a)
    assert_same_bits(K.logprobs(x), reference(x), (isa, "non-finite"))
    t = mx.array(rng.normal(0, 3, (50, 4)).astype(np.float32)).T  # a transposed view: rows not contiguous
    assert_same_bits(K.logprobs(t), reference(t), (isa, "strided"))


def test_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match="float32"):
        K.logprobs(mx.zeros((2, 3), dtype=mx.float16))


def test_the_compiled_step_uses_it(tmp_path):
    from mlx_tracer.runtime import step

    x = mx.array(np.random.default_rng(4).normal(0, 4, (2, 300)).astype(np.float32))
    assert_same_bits(step.log_softmax(x), reference(x), "step.log_softmax")
    dot = tmp_path / "graph.dot"
    mx.export_to_dot(str(dot), step.log_softmax(x * 1.0))
    assert "TracerLogProbs" in dot.read_text()
