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


def greedy_reference(x: mx.array):
    lp = K.logprobs(x)
    picks = mx.argmax(lp, axis=-1).astype(mx.int32)
    return np.array(picks), np.array(mx.take_along_axis(lp, picks[..., None], axis=-1)[..., 0])


def test_greedy_picks_equal_argmax_over_the_logprobs_bit_for_bit(isa):
    """``greedy_logprobs``: mx.argmax over logprobs(x) and the log-probability
    there, the same bits, also where rounding x - lse makes a smaller logit's
    value equal the largest's (MLX takes the first), with NaN (MLX's argmax
    takes the first NaN), infinities, banned rows, views and under compile."""
    rng = np.random.default_rng(7)
    a = rng.normal(0, 6, (12, 3000)).astype(np.float32)
    a[0, ::3] = -np.inf
    a[1, :] = -np.inf
    a[2, 7] = np.inf
    a[2, 900] = np.inf
    a[3, 11] = np.nan
    a[3, 2000] = np.nan
    a[4, :] = 1e30
    a[5, 100] = a[5, 50] = a[5].max() + 1  # a tie: the first wins
    top = np.float32(30.0)  # rows whose lse is large: x - lse rounds neighbours of the top together
    a[6] = top - rng.uniform(0, 1e-5, 3000).astype(np.float32)
    a[6, 1500] = top
    a[7, :] = 0.0
    a[8, -1] = a[8].max() + 3  # the last token
    a[9, 0] = np.nan
    for x in (mx.array(a), mx.array(a.reshape(3, 4, 3000)), mx.array(rng.normal(0, 3, (50, 4)).astype(np.float32)).T):
        picks, lps = K.greedy_logprobs(x)
        want_picks, want_lps = greedy_reference(x)
        assert picks.dtype == mx.int32 and picks.shape == x.shape[:-1]
        assert np.array_equal(np.array(picks), want_picks), (isa, np.array(picks), want_picks)
        assert_same_bits(lps, want_lps, (isa, "greedy"))
        c_picks, c_lps = mx.compile(K.greedy_logprobs)(x)
        assert np.array_equal(np.array(c_picks), want_picks)
        assert_same_bits(c_lps, want_lps, (isa, "greedy compiled"))
    rounded = np.array(K.logprobs(mx.array(a[6:7])))[0]
    assert (rounded == rounded.max()).sum() > 1  # the rounding case above is real: several equal maxima
    with pytest.raises(ValueError, match="float32"):
        K.greedy_logprobs(mx.zeros((2, 3), dtype=mx.float16))
