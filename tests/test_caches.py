"""Named cache tests: the seed's regressions, mlx-lm 0.32.2 quirks pinned,
in-place writes, masks of padding rows, and bad input."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from mlx_tracer.caches import FullCache, RingCache, build_mask
from mlx_tracer.caches.storage import KVFormat

from .cache_oracle import D, H, Pair, junk_id, merged_pair, serial_cache, token_id


def rand_kv(B, L, dtype=mx.float32, seed=0):
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((B, H, L, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, H, L, D)).astype(np.float32)).astype(dtype)
    return k, v


# --------------------------------------------------------- seed regressions
@pytest.mark.parametrize("window", [None, 5])
def test_rows_joining_one_at_a_time_are_all_kept(window):
    """Three or more rows joining a running batch one at a time: none is lost (B >= 3)."""
    rng = np.random.default_rng(1)
    pair = merged_pair(rng, window, [9], first_uid=1)
    for j in range(4):
        for _ in range(3):
            pair.decode()
        other = merged_pair(rng, window, [int(rng.integers(1, 12))], first_uid=10 + j)
        other.decode()
        pair.extend(other, width=pair.ours.n + 1)
        assert pair.ours.n == len(pair.uids) == j + 2
    for _ in range(7):
        pair.decode()
    pair.check_rows("after joins")


@pytest.mark.parametrize("window", [None, 6])
def test_join_accepts_serial_caches_and_batches_without_modifying_them(window):
    rng = np.random.default_rng(2)
    hist = {}
    solo = serial_cache(rng, window, 9, 7, hist)
    running = merged_pair(rng, window, [4, 11], first_uid=1)
    for _ in range(3):
        running.decode()
    before_k = np.array(running.ours.keys)
    before_rows = running.ours.rows.copy()
    kind = FullCache if window is None else RingCache
    joined = kind.join([running.ours, solo], width=4)
    assert joined.n == 3 and joined.width == 4
    assert np.array_equal(np.array(running.ours.keys), before_k)
    assert running.ours.rows.offsets.tolist() == before_rows.offsets.tolist()
    for r, (uid, src) in enumerate([(1, running), (2, running), (7, None)]):
        h = (running.hist if src else hist)[uid]
        h = h[-window:] if window else h
        k, _ = joined.temporal_view(r)
        assert np.array_equal(np.array(k[0]), np.stack([t[1] for t in h], axis=1))


def test_extract_after_wrap_is_the_newest_window():
    rng = np.random.default_rng(3)
    W = 5
    pair = merged_pair(rng, W, [3, 13], first_uid=1)
    for _ in range(2 * W + 3):
        pair.decode()
    assert pair.ours.wrapped
    for r in range(2):
        solo = pair.extract_check(r)
        want = pair.hist[pair.uids[r]][-W:]
        assert solo.offset == want[-1][0] + 1
        assert np.array_equal(np.array(solo.values[0]), np.stack([t[2] for t in want], axis=1))


def test_extracted_row_continues_like_a_solo_run():
    """A row extracted from a wrapped batch, continued serially, sees what a solo run sees."""
    rng = np.random.default_rng(4)
    W = 4
    pair = merged_pair(rng, W, [2, 9], first_uid=1)
    for _ in range(7):
        pair.decode()
    mine = pair.ours.extract(0)
    solo = RotatingKVCache(max_size=W)  # the same row's history fed serially
    for pos, k, v in pair.hist[pair.uids[0]]:
        solo.update_and_fetch(mx.array(k)[None, :, None], mx.array(v)[None, :, None])
    for step in range(6):
        k, v = rand_kv(1, 1, seed=100 + step)
        a_k, a_v = mine.update_and_fetch(k, v)
        b_k, b_v = solo.update_and_fetch(k, v)
        ids_a = sorted(np.array(a_v[0, 0, :, 0]).tolist())
        ids_b = sorted(np.array(b_v[0, 0, :, 0]).tolist())
        assert ids_a == ids_b
        q = mx.random.normal((1, 4, 1, D), key=mx.random.key(step))
        oa = mx.fast.scaled_dot_product_attention(q, a_k, a_v, scale=0.3)
        ob = mx.fast.scaled_dot_product_attention(q, b_k, b_v, scale=0.3)
        assert np.allclose(np.array(oa), np.array(ob), atol=1e-5)


def test_trim_refused_after_wrap_unless_bypass():
    W = 4
    c = RingCache(W, [0])
    k, v = rand_kv(1, 6)
    c.update_and_fetch(k, v)  # a window of 6 > W: the ring has wrapped
    assert c.wrapped and not c.is_trimmable()
    with pytest.raises(ValueError, match="wrapped.*bypass=True"):
        c.trim(2)
    assert c.trim(2, bypass=True) == 2
    assert c.rows.offsets.tolist() == [4]
    # The trimmed tips stay invisible: the next decode sees the retained tokens 2, 3 and itself.
    k2, v2 = rand_kv(1, 1, seed=9)
    mask = c.make_mask(1)
    kk, vv = c.update_and_fetch(k2, v2)
    seen = np.array(vv[0, 0])[np.array(mask[0, 0, 0])]
    want = np.concatenate([np.array(v[0, 0, 2:4]), np.array(v2[0, 0])])
    assert np.array_equal(np.sort(seen[:, 1]), np.sort(want[:, 1]))


def test_trim_before_wrap_matches_mlx_lm():
    rng = np.random.default_rng(5)
    pair = merged_pair(rng, 9, [3, 5], first_uid=1)
    pair.decode()
    assert pair.trim(2) == 2
    for _ in range(4):
        pair.decode()


@pytest.mark.parametrize("kind", ["full", "ring"])
def test_rope_offsets_unchanged_by_the_append_within_one_forward(kind):
    c = FullCache([1, 0]) if kind == "full" else RingCache(4, [1, 0])
    c.update_and_fetch(*rand_kv(2, 3))
    offsets = c.offset  # what a model reads once, for q and for k
    before = np.array(offsets).tolist()
    c.update_and_fetch(*rand_kv(2, 1, seed=1))
    assert np.array(offsets).tolist() == before
    assert np.array(c.offset).tolist() == [b + 1 for b in before]


def test_left_padded_prompt_matches_mlx_lm():
    """prepare(left_padding=...) on an empty batch, as BatchGenerator's older path."""
    for W in (None, 4):
        ours = FullCache([2, 0]) if W is None else RingCache(W, [2, 0])
        theirs = BatchKVCache([2, 0]) if W is None else BatchRotatingKVCache(W, [2, 0])
        k, v = rand_kv(2, 5)
        mo, mt = ours.make_mask(5), theirs.make_mask(5)
        ko, vo = ours.update_and_fetch(k, v)
        kt, vt = theirs.update_and_fetch(k, v)
        q = mx.random.normal((2, 4, 5, D), key=mx.random.key(0))
        oo = mx.fast.scaled_dot_product_attention(q, ko, vo, scale=0.3, mask=mo)
        ot = mx.fast.scaled_dot_product_attention(q, kt, vt, scale=0.3, mask=mt)
        assert mx.array_equal(oo[0, :, 2:], ot[0, :, 2:]) and mx.array_equal(oo[1], ot[1])
        assert np.array(ours.offset).tolist() == np.array(theirs.offset).tolist() == [3, 5]
        for _ in range(6):
            k, v = rand_kv(2, 1, seed=_ + 1)
            mo, mt = ours.make_mask(1), theirs.make_mask(1)
            ko, vo = ours.update_and_fetch(k, v)
            kt, vt = theirs.update_and_fetch(k, v)
            q = mx.random.normal((2, 4, 1, D), key=mx.random.key(_))
            oo = mx.fast.scaled_dot_product_attention(q, ko, vo, scale=0.3, mask=mo)
            ot = mx.fast.scaled_dot_product_attention(q, kt, vt, scale=0.3, mask=mt)
            assert mx.array_equal(oo, ot)


# -------------------------------------------------------- mlx-lm quirks
def test_quirk_mlx_lm_window_after_rotation_hides_a_padded_rows_oldest_key():
    """mlx-lm 0.32.2: once a decode has rotated the ring, an L>1 update builds
    its mask before the concat trims a column, so a row with left padding loses
    its oldest key (its first query sees W-1 keys, not W). Ours shows it."""
    rng = np.random.default_rng(6)
    W = 4
    pair = merged_pair(rng, W, [10, 1], first_uid=1)
    pair.decode()  # rotates mlx-lm's ring
    assert pair.theirs.rotated
    pair.window_step(2)
    devs = [d for d in pair.deviations if d.row == 1]
    assert devs, "mlx-lm no longer hides the padded row's oldest key: drop this quirk"
    assert all(d.missing == [token_id(2, 0)] and not d.extra for d in devs)
    # ours saw everything the analytic mask allows (Pair.update asserts that per query)


def test_quirk_mlx_lm_ring_extract_after_right_padded_prompt_returns_padding():
    """mlx-lm 0.32.2: right after a right-padded prompt on a wrapped ring its
    extract() returns prompt padding as tokens. Ours returns the row's newest
    tokens only."""
    rng = np.random.default_rng(7)
    W = 7
    pair = merged_pair(rng, W, [20, 3], first_uid=1)
    pair.prompt([13, 7], chunk=3)
    pair.filter([1])
    mine = pair.extract_check(0)
    ids = np.array(mine.values[0, 0, :, 0])
    assert (ids > 0).all()
    devs = [d for d in pair.deviations if d.op == "extract"]
    assert devs and devs[0].extra == [junk_id(2)] * len(devs[0].extra), "mlx-lm fixed its extract: drop this quirk"


def test_ring_rejects_sink_tokens():
    solo = RotatingKVCache(max_size=8, keep=4)
    solo.update_and_fetch(*rand_kv(1, 3))
    with pytest.raises(ValueError, match="keep"):
        RingCache.merge([solo])


# ----------------------------------------------------------- writes & masks
def test_decode_write_is_in_place():
    c = FullCache([0], capacity=4096, capacities=(4096,)).allocate(8, 128)
    mx.eval(c.keys, c.values)
    c.rows.time = c.rows.offsets[0] = 100
    k, v = mx.random.normal((1, 8, 1, 128)), mx.random.normal((1, 8, 1, 128))
    mx.eval(k, v)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    c.update_and_fetch(k, v)
    mx.eval(c.keys, c.values)
    assert mx.get_peak_memory() - base < c.keys.nbytes // 10, "decode write copied the buffer"
    stale = c.keys  # a stale reference forces a copy: the guard above can fail
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    c.update_and_fetch(k, v)
    mx.eval(c.keys, c.values)
    assert mx.get_peak_memory() - base >= c.keys.nbytes
    del stale


def test_ring_decode_write_is_in_place():
    c = RingCache(2048, [0]).allocate(8, 128)
    mx.eval(c.keys, c.values)
    k, v = mx.random.normal((1, 8, 1, 128)), mx.random.normal((1, 8, 1, 128))
    mx.eval(k, v)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for _ in range(3):
        c.update_and_fetch(k, v)
        mx.eval(c.keys, c.values)
    assert mx.get_peak_memory() - base < c.keys.nbytes // 10


@pytest.mark.parametrize("kind", ["full", "ring"])
@pytest.mark.parametrize("L", [1, 3])
def test_padding_rows_see_exactly_one_column(kind, L):
    c = FullCache([1, 0], width=4) if kind == "full" else RingCache(4, [1, 0], width=4)
    c.update_and_fetch(*rand_kv(4, 5))
    m = np.array(c.make_mask(L))
    assert m.shape[:3] == (4, 1, L)
    assert (m[2:].sum(-1) == 1).all()
    assert (m[:2].sum(-1) >= 1).all()


def test_build_mask_matches_create_causal_mask():
    from mlx_lm.models.base import create_causal_mask

    lp = mx.array([0, 2, 5], dtype=mx.int32)
    for window in (None, 3):
        want = create_causal_mask(4, offset=6, left_padding=lp, window_size=window)
        q = 6 + mx.arange(4, dtype=mx.int32)
        got = build_mask(mx.arange(10, dtype=mx.int32), q, lp, mx.array([True] * 3), q, window)
        assert mx.array_equal(got, want)


def test_capacity_grows_by_bucket_not_per_token():
    c = FullCache([0], capacities=(8, 16, 32))
    for i in range(20):
        c.update_and_fetch(*rand_kv(1, 1, seed=i))
    assert c.capacity == 32 and c.regrows == 2
    assert c.keys.shape[2] == 32


def test_nbytes_and_bytes_for():
    c = RingCache(6, [0, 0]).allocate(H, D, dtype=mx.float16)
    assert c.nbytes == 2 * 2 * H * 6 * D * 2
    per_token = H * D * 2 * 2
    assert c.bytes_for(4) == 4 * per_token
    assert c.bytes_for(100) == 6 * per_token  # capped at the window
    f = FullCache([0], capacity=16).allocate(H, D)
    assert f.bytes_for(100) == 100 * H * D * 4 * 2


# ------------------------------------------------------------- bad input
@pytest.mark.parametrize("kind", ["full", "ring"])
def test_bad_updates_raise_clear_errors_and_leave_the_cache_intact(kind):
    c = FullCache([0, 0]) if kind == "full" else RingCache(4, [0, 0])
    c.update_and_fetch(*rand_kv(2, 2))
    keys_before = np.array(c.keys)
    rows_before = c.rows.offsets.tolist()
    with pytest.raises(ValueError, match="kv_heads"):
        c.update_and_fetch(mx.zeros((2, H + 1, 1, D)), mx.zeros((2, H + 1, 1, D)))
    with pytest.raises(ValueError, match="dtype"):
        c.update_and_fetch(*rand_kv(2, 1, dtype=mx.float16))
    with pytest.raises(ValueError, match="rows"):
        c.update_and_fetch(*rand_kv(3, 1))
    with pytest.raises(ValueError, match=r"\[batch, kv_heads, L, head_dim\]"):
        c.update_and_fetch(mx.zeros((2, H, D)), mx.zeros((2, H, D)))
    assert np.array_equal(np.array(c.keys), keys_before) and c.rows.offsets.tolist() == rows_before


def test_merge_of_rings_with_different_windows_is_refused():
    a, b = RotatingKVCache(max_size=4), RotatingKVCache(max_size=8)
    for c in (a, b):
        c.update_and_fetch(*rand_kv(1, 2))
    with pytest.raises(ValueError, match="different windows"):
        RingCache.merge([a, b])
    with pytest.raises(ValueError, match="different windows"):
        RingCache.merge([a]).extend(RingCache.merge([b]))


def test_bucket_overflow_and_padding_row_extract_are_refused():
    solos = [KVCache() for _ in range(3)]
    for s in solos:
        s.update_and_fetch(*rand_kv(1, 2))
    with pytest.raises(ValueError, match="bucket 2 exceeded: 3 live rows"):
        FullCache.merge(solos, width=2)
    c = FullCache.merge(solos, width=4)
    with pytest.raises(IndexError, match="row 3 is not a live row"):
        c.extract(3)
    with pytest.raises(IndexError, match="not a live row"):
        c.filter([0, 5])
    assert c.n == 3  # the refused filter changed nothing


def test_full_cache_refuses_positions_past_its_largest_capacity():
    c = FullCache([0], capacities=(8, 16))
    c.update_and_fetch(*rand_kv(1, 12))
    with pytest.raises(ValueError, match="exceed the largest capacity bucket 16"):
        c.update_and_fetch(*rand_kv(1, 8))
    assert c.rows.time == 12


def _row_major(a) -> bool:
    return np.array(a, copy=False).flags["C_CONTIGUOUS"]


@pytest.mark.parametrize("window", [None, 5])
def test_buffers_stay_row_major_after_every_row_move(window):
    """mx.take lays its output out gathered-axis-first; a buffer left that way
    makes every later attention copy it (a 40% slower decode step was measured)."""
    rng = np.random.default_rng(8)
    pair = merged_pair(rng, window, [3, 9, 12], first_uid=1, width=4)
    other = merged_pair(rng, window, [5], first_uid=20)

    def check(op):
        mx.eval(pair.ours.keys, pair.ours.values)
        assert _row_major(pair.ours.keys) and _row_major(pair.ours.values), f"not row-major after {op}"

    check("merge")
    pair.decode()
    check("decode")
    pair.prompt([4, 7, 2], chunk=3)
    check("prompt + finalize")
    pair.filter([0, 2], width=2)
    check("filter")
    pair.extend(other, width=4)
    check("extend")
    pair.window_step(4)
    check("window")


def _decode_across_rungs(monkeypatch, side: bool, storage, narrow_at=None):
    """A full cache of 4 rows decoding one column at a time across two rungs
    (32 -> 64 -> 128), with the side stream on or off; ``narrow_at``: keep two
    rows at that column (a wider cache's ready buffers no longer fit)."""
    from mlx_tracer.caches import spare

    monkeypatch.setattr(spare, "side_stream", spare.side_stream if side else (lambda: None))
    def kv(B, L, seed):  # head dimension 64: a whole group of quantized K/V
        rng = np.random.default_rng(seed)
        return tuple(mx.array(rng.standard_normal((B, 2, L, 64)).astype(np.float32)) for _ in "kv")

    c = FullCache([0, 3, 1, 5], width=4, capacities=(32, 64, 128), storage=storage)
    c.update_and_fetch(*kv(4, 9, 1))  # a window: no ready buffers asked for
    steps = []
    for i in range(70):
        if i == narrow_at:
            c.filter([0, 2], width=2)
        k, v = c.update_and_fetch(*kv(c.width, 1, 100 + i))
        steps.append((k, v))
    mx.eval(steps)
    return c, steps


@pytest.mark.parametrize("storage", [KVFormat(), KVFormat(dtype="float16"), KVFormat(bits=8)],
                         ids=["float32", "float16", "8-bit"])
def test_a_decode_step_crossing_a_rung_finds_its_buffers_ready(monkeypatch, storage):
    """The next capacity's zeroed buffers are built a few steps before a decode
    step crosses into it (the first touch of new memory had made that step a
    stall of every row): the crossing uses them, with the bits mx.pad gives."""
    ours, got = _decode_across_rungs(monkeypatch, True, storage)
    plain, want = _decode_across_rungs(monkeypatch, False, storage)
    assert ours.capacity == plain.capacity == 128 and ours.regrows == plain.regrows == 2
    assert ours.spare_hits == 2 and plain.spare_hits == 0
    assert ours._spare is None  # nothing held after the crossing
    for (k, v), (k0, v0) in zip(got, want):
        for a, b in zip(tree_flatten((k, v)), tree_flatten((k0, v0))):
            assert mx.array_equal(a[1], b[1])


def test_buffers_made_ready_for_other_rows_are_not_used(monkeypatch):
    """Rows leave at the crossing, the next capacity's buffers made ready for
    4 rows: they are not used (the rows are laid out again at the new
    capacity); the next rung's are made ready for the 2 rows. Same bits."""
    at = 32 - 9  # the step that writes column 32 (the initial window wrote 9)
    ours, got = _decode_across_rungs(monkeypatch, True, KVFormat(), narrow_at=at)
    plain, want = _decode_across_rungs(monkeypatch, False, KVFormat(), narrow_at=at)
    assert ours.width == 2 and (ours.capacity, ours.regrows) == (plain.capacity, plain.regrows) == (128, 1)
    assert ours.spare_hits == 1  # the second rung, made ready for the 2 rows
    for (k, v), (k0, v0) in zip(got, want):
        assert mx.array_equal(k, k0) and mx.array_equal(v, v0)


def test_buffers_are_made_ready_on_any_thread(monkeypatch):
    """MLX's streams belong to the thread that made them: a cache stepped on
    another thread (the server's engine thread) makes its own side stream."""
    import threading

    _decode_across_rungs(monkeypatch, True, KVFormat())  # this thread's side stream first
    out = {}
    t = threading.Thread(target=lambda: out.update(c=_decode_across_rungs(monkeypatch, True, KVFormat())[0]))
    t.start()
    t.join()
    assert out["c"].spare_hits == 2


@pytest.mark.parametrize("bits", [None, 8])
def test_a_shifted_block_of_columns_moves_by_slice_and_pad_as_the_gather_would(bits):
    """gather_columns moves a source whose columns land on the target as one
    shifted block with a slice and a pad instead of a gather (a lone request's
    join: ~4 ms of its first token on SmolLM2's 30 layers): the columns that
    exist in the source hold exactly what the gather put there, the others
    (no position of the row: masked) zeros; any other mapping still gathers."""
    from mlx_tracer.caches.assemble import RowSource, gather_columns, shifted_run
    from mlx_tracer.caches.rows import RowBook

    n = 10
    k = mx.random.normal((2, H, n, 64))  # (64 values a head: a quantization group fits)
    v = k + 1
    if bits:
        k, v = mx.quantize(k, group_size=32, bits=bits), mx.quantize(v, group_size=32, bits=bits)
    src_time = 10
    for d, S in ((-6, 16), (-1, 16), (0, 16), (3, 16), (9, 16), (0, n)):  # target column j reads source column j + d
        cols = np.arange(S)
        src = RowSource(k, v, RowBook(offsets=[src_time] * 2, left_padding=[0, 0], time=src_time), lambda t: t)
        time = src_time - d  # col_of_time(cols - (time - src_time)) = cols + d
        lo, hi = max(0, -d), min(S, n - d)
        assert shifted_run(cols + d, n) == (lo, hi, d)
        got_k, got_v = gather_columns(src, time, cols, None, None, S)
        idx = mx.array(np.clip(cols + d, 0, n - 1).astype(np.int32))
        for got, buf in ((got_k, k), (got_v, v)):
            for g, b in zip(got if bits else [got], buf if bits else [buf]):
                want = mx.take(b, idx, axis=2)
                assert g.shape == want.shape and g.dtype == want.dtype
                assert mx.array_equal(g[:, :, lo:hi], want[:, :, lo:hi])
                assert not mx.any(g[:, :, :lo]).item() and not mx.any(g[:, :, hi:]).item()
        if S == n and d == 0:  # the source's own layout: a copy, not the source's buffer
            for g, b in zip(got_k if bits else [got_k], k if bits else [k]):
                assert np.asarray(g).__array_interface__["data"][0] != np.asarray(b).__array_interface__["data"][0]
    assert shifted_run(np.array([0, 1, 3, 4]), 8) is None  # not one shift
    assert shifted_run(np.arange(20, 36), n) is None  # no source column at all
