"""The BLAS shim's own split of cblas_sgemm (tracer/backend/blas_shim.c).

The shim is loaded privately (its names bind nothing here: the suite runs on
MLX's reference BLAS). Its ``cblas_sgemm`` must give the same bits for any
thread count and from call to call (the chunks depend on the shape only), and
match one unsplit ``scipy_cblas_sgemm`` call and numpy within rounding (a
chunk may take another OpenBLAS kernel than the whole call).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from mlx_tracer.backend import blas

pytestmark = pytest.mark.skipif(blas.openblas_path() is None, reason="scipy-openblas32 not installed")

ROW, COL = 101, 102
NT, T = 111, 112
F32P = ctypes.POINTER(ctypes.c_float)
MAX_CHUNKS = 128
SGEMM_ARGS = [ctypes.c_int] * 6 + [ctypes.c_float, F32P, ctypes.c_int, F32P, ctypes.c_int, ctypes.c_float, F32P, ctypes.c_int]


@pytest.fixture(scope="module")
def libs():
    shim = blas.private_shim(blas.openblas_path())
    openblas = ctypes.CDLL(blas.openblas_path())
    for f in (shim.cblas_sgemm, openblas.scipy_cblas_sgemm):
        f.argtypes, f.restype = SGEMM_ARGS, None
    shim.mlx_tracer_blas_plan.argtypes = [ctypes.c_int] * 5 + [ctypes.POINTER(ctypes.c_int)] * 2
    before = shim.mlx_tracer_blas_threads()
    yield shim, openblas
    shim.mlx_tracer_blas_set_threads(before)


def plan(shim, m, n, k, ta=NT, tb=T):
    """The chunks of a row-major call, as (along rows of C, bounds)."""
    by_cols, bounds = ctypes.c_int(), (ctypes.c_int * (MAX_CHUNKS + 1))()
    # the shim works in OpenBLAS's column-major form: C^T = op(B)^T op(A)^T
    count = shim.mlx_tracer_blas_plan(int(tb == T), int(ta == T), n, m, k, ctypes.byref(by_cols), bounds)
    return not by_cols.value, list(bounds[: count + 1])


def counts(shim):
    splits, worker_chunks = ctypes.c_long(), ctypes.c_long()
    shim.mlx_tracer_blas_counts(ctypes.byref(splits), ctypes.byref(worker_chunks))
    return splits.value, worker_chunks.value


class Gemm:
    """One CBLAS sgemm call's arguments over random operands, storage padded
    by ``pad`` beyond each leading dimension."""

    def __init__(self, rng, order, ta, tb, m, n, k, pad=0, alpha=1.0, beta=0.0):
        self.args = (order, ta, tb, m, n, k)
        self.alpha, self.beta = alpha, beta

        def stored(rows, cols):  # a rows x cols matrix in `order`, leading dimension padded
            outer, inner = (rows, cols) if order == ROW else (cols, rows)
            return rng.standard_normal((outer, inner + pad)).astype(np.float32)

        self.a = stored(*((m, k) if ta == NT else (k, m)))
        self.b = stored(*((k, n) if tb == NT else (n, k)))
        self.c0 = stored(m, n)

    def run(self, fn) -> np.ndarray:
        c = self.c0.copy()
        p = lambda x: x.ctypes.data_as(F32P)  # noqa: E731
        fn(*self.args, self.alpha, p(self.a), self.a.shape[1], p(self.b), self.b.shape[1], self.beta, p(c), c.shape[1])
        return c


# (m, n, k): SmolLM2's decode rows under the lean forward (qkv, o, gate/up,
# down, head) and prefill windows, then sizes that are no multiple of
# anything, and shapes near OpenBLAS's switch between its small-matrix and
# blocked kernels.
DECODE_SHAPES = [(1, 960, 576), (1, 576, 576), (1, 3072, 576), (1, 576, 1536), (1, 49152, 576)]
MLX_SHAPES = DECODE_SHAPES + [(4, 3072, 576), (16, 960, 576), (8, 576, 1536), (32, 576, 576), (32, 576, 1536),
                              (256, 576, 576), (256, 3072, 576)]
SHAPES = MLX_SHAPES + [
    (1, 4099, 300), (1, 49152, 64), (2, 600, 800), (1, 1200, 800), (3, 400, 900), (37, 1000, 513), (300, 257, 129),
    (577, 33, 1000), (1000, 3, 999), (3, 1000, 999), (64, 64, 300), (100, 100, 100), (101, 100, 100), (2000, 2, 8),
    (3, 1024, 64), (3, 401, 64), (4, 4096, 64), (1, 4096, 64),  # attention scores: R query heads x S keys
]
TRANSPOSES = [(NT, NT), (NT, T), (T, NT), (T, T)]
CASES = [(0, 1.0, 0.0), (5, 0.75, 0.0), (3, -1.5, 0.5), (0, 1.0, 1.0)]  # pad, alpha, beta


def bits(x):
    return x.view(np.uint32)


def close(got, want, k):
    return np.allclose(got, want, rtol=1e-4, atol=2e-5 * np.sqrt(k) * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("order", [ROW, COL])
@pytest.mark.parametrize("ta,tb", TRANSPOSES)
def test_split_sgemm_matches_unsplit_and_is_thread_count_invariant(libs, m, n, k, order, ta, tb):
    shim, openblas = libs
    rng = np.random.default_rng(m * 7919 + n * 31 + k)
    for pad, alpha, beta in CASES:
        g = Gemm(rng, order, ta, tb, m, n, k, pad, alpha, beta)
        want = g.run(openblas.scipy_cblas_sgemm)
        shim.mlx_tracer_blas_set_threads(1)
        one = g.run(shim.cblas_sgemm)
        assert close(one, want, k), (pad, alpha, beta)
        for threads in (2, 3):
            shim.mlx_tracer_blas_set_threads(threads)
            assert np.array_equal(bits(one), bits(g.run(shim.cblas_sgemm))), (threads, pad, alpha, beta)


def small_kernel(ta, tb, m, n, k):
    """OpenBLAS's small-matrix permit (SkylakeX), column-major form, as the shim mirrors it."""
    if m * n * k > 1e6:
        return False
    if ta:
        return k >= 4 if tb else (m * n <= 1200 and k >= 32)
    return True


def test_decode_gemms_split_along_the_weight_rows_into_small_kernel_chunks(libs):
    """MLX multiplies x @ W.T: row-major, B transposed. Every decode GEMM of
    SmolLM2 (1 row) is cut along W's rows into chunks OpenBLAS runs with its
    small-matrix kernel (column-major: C^T = W x^T, ta = 1, tb = 0)."""
    shim, _ = libs
    for m, n, k in DECODE_SHAPES + [(4, 3072, 576), (16, 960, 576), (12, 576, 576), (32, 3072, 576)]:
        by_rows, bounds = plan(shim, m, n, k)
        assert not by_rows and len(bounds) > 2, (m, n, k, bounds)
        assert all(small_kernel(1, 0, hi - lo, m, k) for lo, hi in zip(bounds, bounds[1:])), (m, n, k, bounds)


def test_small_gemms_off_the_small_kernel_are_cut_into_small_kernel_pieces(libs):
    """A decode step's attention scores, R query heads against S keys (q @ k.T,
    row-major): too little work to share, but R x S past the small-matrix
    kernel's permit, so OpenBLAS would pack; the shim cuts it along the keys
    into pieces that each take the small kernel, on the caller."""
    shim, _ = libs
    shim.mlx_tracer_blas_set_threads(2)
    for R, S in [(3, 1024), (3, 401), (4, 1000), (2, 1200)]:  # under 2**18 multiply-adds
        by_rows, bounds = plan(shim, R, S, 64)
        assert not by_rows and len(bounds) > 2, (R, S, bounds)
        assert all(small_kernel(1, 0, hi - lo, R, 64) for lo, hi in zip(bounds, bounds[1:])), (R, S, bounds)
        splits0 = counts(shim)[0]
        g = Gemm(np.random.default_rng(S), ROW, NT, T, R, S, 64)
        got = g.run(shim.cblas_sgemm)
        assert counts(shim)[0] == splits0  # ran on the caller: no split was handed to the workers
        assert np.allclose(got, g.a @ g.b.T, rtol=1e-4, atol=1e-4)
    assert plan(shim, 3, 400, 64) == (False, [0, 400])  # within the permit: whole
    assert plan(shim, 3, 1024, 16) == (False, [0, 1024])  # k < 32: no piece would take the small kernel


def test_chunks_cut_at_aligned_bounds(libs):
    shim, _ = libs
    for m, n, k in SHAPES:
        for ta, tb in TRANSPOSES:
            by_rows, bounds = plan(shim, m, n, k, ta, tb)
            side = m if by_rows else n
            assert bounds[0] == 0 and bounds[-1] == side
            if len(bounds) > 2 and min(m, n) > 32:
                assert by_rows == (m > n)  # larger GEMMs: along the longer side
            assert all(lo < hi for lo, hi in zip(bounds, bounds[1:])) and len(bounds) <= MAX_CHUNKS + 1
            assert all(b % 32 == 0 for b in bounds[:-1])
    assert plan(shim, 1, 192, 576) == (False, [0, 192])  # too small to split


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8, 1])
def test_any_thread_count_gives_the_same_bits(libs, threads):
    shim, _ = libs
    rng = np.random.default_rng(7)
    gemms = [Gemm(rng, ROW, NT, T, m, n, k) for m, n, k in MLX_SHAPES]
    shim.mlx_tracer_blas_set_threads(1)
    wants = [g.run(shim.cblas_sgemm) for g in gemms]
    shim.mlx_tracer_blas_set_threads(threads)
    assert shim.mlx_tracer_blas_threads() == threads
    for g, want in zip(gemms, wants):
        for _ in range(3):  # and from call to call
            assert np.array_equal(bits(want), bits(g.run(shim.cblas_sgemm))), g.args


def test_workers_take_chunks_and_small_gemms_stay_unsplit(libs):
    shim, _ = libs
    shim.mlx_tracer_blas_set_threads(2)
    rng = np.random.default_rng(0)
    splits0, _ = counts(shim)
    Gemm(rng, ROW, NT, T, 1, 64, 64).run(shim.cblas_sgemm)
    assert counts(shim)[0] == splits0
    big = Gemm(rng, ROW, NT, T, 128, 2048, 1024)
    _, chunks0 = counts(shim)
    for _ in range(20):
        big.run(shim.cblas_sgemm)
    splits, chunks = counts(shim)
    assert splits == splits0 + 20
    assert chunks > chunks0  # on two cores a worker joins at least sometimes


def test_concurrent_callers_each_get_their_own_result(libs):
    """A second thread calling while a split runs runs the same chunks itself, not a share of the other's job."""
    shim, _ = libs
    rng = np.random.default_rng(1)
    gemms = [Gemm(rng, ROW, NT, T, 16 * (i + 1), 1024, 512) for i in range(3)] + [Gemm(rng, ROW, NT, T, 1, 3072, 576)]
    shim.mlx_tracer_blas_set_threads(1)
    wants = [g.run(shim.cblas_sgemm) for g in gemms]
    shim.mlx_tracer_blas_set_threads(2)
    bad = []

    def hammer(i):
        for _ in range(15):
            if not np.array_equal(bits(gemms[i].run(shim.cblas_sgemm)), bits(wants[i])):
                bad.append(i)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


MLX_VS_NUMPY = r"""
import mlx_tracer, numpy as np, mlx.core as mx
from mlx_tracer.backend import blas
assert blas.status().fast, blas.status()
rng = np.random.default_rng(0)
for threads in (1, 2, 4):
    blas.set_threads(threads)
    for m, n, k in [(1, 576, 576), (1, 3072, 576), (1, 576, 1536), (1, 49152, 64), (32, 1536, 576), (300, 257, 129)]:
        a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
        got = np.array(mx.matmul(mx.array(a), mx.array(b).T))
        want = a.astype(np.float64) @ b.astype(np.float64).T
        assert np.allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(k)), (threads, m, n, k)
        got_t = np.array(mx.matmul(mx.array(a.T).T, mx.array(b.T)))  # transposed operands
        assert np.allclose(got_t, want, rtol=1e-4, atol=1e-4 * np.sqrt(k)), (threads, m, n, k)
print("ok")
"""


def test_mlx_matmuls_through_the_shim_match_numpy():
    env = {k: v for k, v in os.environ.items() if k not in (blas.ENV, blas.ENV_THREADS)}
    r = subprocess.run([sys.executable, "-c", MLX_VS_NUMPY], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
