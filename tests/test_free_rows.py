"""Joins into free rows and rows that leave without a copy of the batch
(issue 27): a newcomer whose tokens fit the running timeline is written into a
free row of the running batch's buffers (``StaticKVCache.place``), and rows
that leave within one bucket are filled by the last rows
(``StaticKVCache.move_rows``); the running rows' K/V are not copied. The
caches hold what today's copying ``join`` / ``filter`` give, the greedy tokens
are those of the copying engine and of solo runs, and no key is traced twice.
(Random sequences against mlx-lm: tests/test_caches_oracle.py, ``join="place"``.)"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_tracer.caches import FullCache, RingCache
from mlx_tracer.caches.storage import KVFormat
from mlx_tracer.runtime.engine import Engine
from mlx_tracer.runtime.step import CompiledModel

from .tiny_models import SLIDE, tiny_model

PROMPT = [(5 * i) % 89 + 2 for i in range(40)]
# (engine step it arrives at, prompt, max_tokens): short prompts join into free
# rows of a running batch, the 30-token one is longer than the timeline when it
# comes (the running rows move: a copying join); budgets differ so that rows
# leave one by one, within a bucket and across buckets
ARRIVALS = [(0, PROMPT[:5], 40), (2, PROMPT[5:9], 30), (6, PROMPT[9:12], 9), (7, PROMPT[12:19], 25),
            (9, PROMPT[:30], 12), (12, PROMPT[19:23], 20), (18, PROMPT[23:26], 6), (20, PROMPT[26:33], 14)]


def serve(cm, in_place: bool, fmt: KVFormat = KVFormat(), arrivals=ARRIVALS):
    """Tokens per arrival of an engine that joins newcomers at the given
    steps (interleaved prefill), with joins/keeps into free rows or copying."""
    eng = Engine(cm, buckets=(1, 2, 4, 8), prefill_chunks=(4, 8), prefill_step_tokens=8,
                 kv_bits=fmt.bits, kv_group_size=fmt.group_size, kv_dtype=fmt.dtype)
    eng.batch.in_place = in_place
    uids, got, step = {}, {}, 0
    while len(uids) < len(arrivals) or eng.has_work():
        for k, (at, prompt, n) in enumerate(arrivals):
            if at == step:
                uids[eng.add(prompt, max_tokens=n)] = k
        for ev in eng.step():
            if ev.token is not None:
                got.setdefault(uids[ev.uid], []).append(ev.token)
        step += 1
    return [got[k] for k in range(len(arrivals))], eng.stats


def solo(cm, prompt, n, fmt: KVFormat = KVFormat()):
    eng = Engine(cm, buckets=(1,), kv_bits=fmt.bits, kv_group_size=fmt.group_size, kv_dtype=fmt.dtype)
    eng.add(prompt, max_tokens=n)
    return [ev.token for ev in eng.run() if ev.token is not None]


CASES = [
    ("llama", KVFormat()),  # full caches
    ("ring_only", KVFormat()),  # rings only: newcomers placed into wrapped rings (window SLIDE)
    ("llama_mixed", KVFormat()),  # rings and a full layer
    ("llama", KVFormat(bits=8)),  # quantized K/V, packed tuples
    ("ring_only", KVFormat(bits=4, group_size=32)),
    ("llama_mixed", KVFormat(dtype="float16")),
]


@pytest.mark.parametrize("family,fmt", CASES, ids=lambda x: x if isinstance(x, str) else x.describe().replace(" ", ""))
def test_joins_into_free_rows_give_the_copying_engines_tokens(family, fmt):
    model = tiny_model(family, **({"head_dim": 64} if fmt.quantized else {}))
    cm = CompiledModel(model, kv=fmt)
    placed, stats = serve(cm, True, fmt)
    copied, before = serve(CompiledModel(model, kv=fmt), False, fmt)
    assert placed == copied
    assert stats.joins_in_place >= 3
    if family != "ring_only":  # the 30-token prompt, longer than the full caches' timeline: a copying join
        assert stats.joins_in_place < stats.joins
    assert before.joins_in_place == 0
    assert all(n == 1 for n in cm.traces.values()), cm.traces  # one trace per key
    if fmt == KVFormat():
        assert placed == [solo(cm, p, n) for _, p, n in ARRIVALS]
    assert max(len(p) for _, p, _ in ARRIVALS) > SLIDE  # rings wrapped before newcomers joined


def test_a_join_into_free_rows_copies_no_running_row_and_traces_nothing_new():
    """The running rows' buffers are written where they are (the join
    allocates the newcomer's row, not the batch), and the step after it
    replays the running bucket's trace."""
    cm = CompiledModel(tiny_model("llama", head_dim=64))
    eng = Engine(cm, buckets=(1, 2, 4, 8), prefill_chunks=(4, 8), prefill_step_tokens=8)
    for k in range(5):
        eng.add(PROMPT[3 * k : 3 * k + 6], max_tokens=30)
    for _ in range(6):
        eng.step()
    assert eng.batch.width == 8 and len(eng.rows) == 5
    join, peaks = eng.batch.join, []

    def measured(reqs, prefilled):
        total = sum(c.nbytes for c in eng.batch.caches)
        mx.eval([c.state for c in eng.batch.caches])
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        join(reqs, prefilled)
        peaks.append((mx.get_peak_memory() - base) / total)

    eng.batch.join = measured
    joins = eng.stats.joins_in_place
    new = eng.add(PROMPT[20:24], max_tokens=4)
    with cm.no_new_traces():  # the 4-token window and the decode of bucket 8 are traced already
        while all(r.uid != new for r in eng.rows):
            eng.step()
        eng.step()
    assert eng.stats.joins_in_place == joins + 1
    assert len(peaks) == 1 and peaks[0] < 0.25, peaks  # the newcomer's row: 1/8 of the buffers


# ------------------------------------------------------ the caches themselves
H, D = 2, 64


def serial(rng, n, window=None):
    """A serial mlx-lm cache of ``n`` random tokens."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    c = KVCache() if window is None else RotatingKVCache(max_size=window)
    if n:
        c.update_and_fetch(mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32)),
                           mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32)))
    return c


def decode(cache, rng, steps):
    for _ in range(steps):
        k = mx.array(rng.standard_normal((cache.width, H, 1, D)).astype(np.float32))
        cache.update_and_fetch(k, k + 1)
    mx.eval(cache.state)


def running_batch(kind, fmt, rng, width=16):
    """A batch of 5 rows of bucket ``width`` that decoded past its window (rings: wrapped)."""
    window = None if kind is FullCache else 64
    rows = [serial(rng, n, window) for n in (90, 4, 70, 9, 75)]
    batch = kind.merge(rows, width=width, storage=fmt)
    decode(batch, rng, 12)
    return batch, window


def rows_of(cache):
    """Each live row's tokens (temporal order) and offset, as the host sees them."""
    out = []
    for r in range(cache.n):
        k, v = cache.temporal_view(r)
        conv = lambda a: [np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x)  # noqa: E731
                          for x in (a if isinstance(a, tuple) else () if a is None else (a,))]
        out.append((int(cache.rows.offsets[r]), conv(k), conv(v)))
    return out


def same_rows(a, b):
    assert len(a) == len(b)
    for (oa, ka, va), (ob, kb, vb) in zip(a, b):
        assert oa == ob
        for x, y in zip(ka + va, kb + vb):
            assert np.array_equal(x, y)


KINDS = [FullCache, RingCache]
FORMATS = [KVFormat(), KVFormat(bits=8), KVFormat(dtype="bfloat16")]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.describe().replace(" ", ""))
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_place_holds_what_the_copying_join_holds_and_copies_no_running_row(kind, fmt):
    rng = np.random.default_rng(0)
    batch, window = running_batch(kind, fmt, rng)
    newcomers = kind.merge([serial(rng, n, window) for n in (40, 0, 11)], width=4, storage=fmt)
    mx.eval(newcomers.state)
    want = kind.join([batch, newcomers], width=16)
    mx.eval(want.state)
    assert kind is FullCache or batch.wrapped
    total = batch.nbytes
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    assert batch.place([newcomers])
    mx.eval(batch.state)
    # the 3 newcomers' rows (3/16 of the buffers) only: the buffers were written in place
    assert mx.get_peak_memory() - base < total // 4
    assert batch.n == 8 and batch.width == 16
    same_rows(rows_of(batch), rows_of(want))
    # and they decode alike
    for c in (batch, want):
        decode(c, np.random.default_rng(1), 20)
    same_rows(rows_of(batch), rows_of(want))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_place_declines_what_does_not_fit_and_changes_nothing(kind):
    rng = np.random.default_rng(2)
    batch, window = running_batch(kind, KVFormat(), rng)
    before = rows_of(batch)
    too_many = kind.merge([serial(rng, 3, window) for _ in range(12)], width=16)
    assert not batch.place([too_many])  # 17 rows in a bucket of 16
    if kind is FullCache:
        longer = kind.merge([serial(rng, batch.rows.time + 1)], width=1)
        assert not batch.place([longer])  # longer than the timeline: the running rows would move
    same_rows(rows_of(batch), before)
    assert batch.n == 5
    assert batch.place([too_many], width=32) and batch.width == 32 and batch.n == 17  # a wider bucket: one copy


@pytest.mark.parametrize("width", [16, 4], ids=["same-bucket", "narrower"])
@pytest.mark.parametrize("fmt", FORMATS[:2], ids=lambda f: f.describe().replace(" ", ""))
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_move_rows_holds_what_filter_holds_and_copies_only_the_moved_rows(kind, fmt, width):
    """Rows 1 and 3 of 5 leave (row 4 takes row 1's place), in the same
    bucket (16) or for a narrower one (4: then ``narrow``, the buffers views
    of their first rows, nothing allocated); the caches hold what the
    copying filter gives, and decode on alike."""
    rng = np.random.default_rng(3)
    batch, _ = running_batch(kind, fmt, rng)
    order = [0, 4, 2]
    want = kind.join([batch], width=16)
    want.filter(order, width=width)
    mx.eval(want.state)
    total = batch.nbytes
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    assert batch.move_rows(order) and batch.narrow(width)
    mx.eval(batch.state)
    assert mx.get_peak_memory() - base < total // 8  # one row of 16 moved, none copied
    assert batch.width == width and batch.n == 3
    same_rows(rows_of(batch), rows_of(want))
    for c in (batch, want):
        decode(c, np.random.default_rng(4), 20)
    same_rows(rows_of(batch), rows_of(want))
    assert not batch.narrow(2) and batch.width == width  # 3 live rows do not fit 2: nothing changes


def test_move_rows_drops_shared_padding_instead_of_growing():
    """Rows that leave a full cache about to grow, leaving a quarter of it
    as padding every row holds: those columns go (one copy), the capacity stays."""
    rng = np.random.default_rng(6)
    batch = FullCache.merge([serial(rng, 100), serial(rng, 60)], width=2)
    decode(batch, rng, 22)
    assert (batch.capacity, batch.rows.time) == (128, 122)
    want = FullCache.join([batch], width=2)
    want.filter([1], width=2)
    assert batch.move_rows([1])
    assert (batch.capacity, batch.rows.time) == (128, 82)  # the 40 columns row 1 never had
    same_rows(rows_of(batch), rows_of(want))
    for c in (batch, want):
        decode(c, np.random.default_rng(7), 30)
    same_rows(rows_of(batch), rows_of(want))
    assert batch.capacity == 128  # 112 columns: no growth


def test_rows_leaving_within_a_bucket_copy_only_the_rows_that_move():
    """In the engine (buffers the compiled step returned, a step in flight):
    a row leaving 7 rows of bucket 8 moves the last row into its place."""
    eng, uids, peak = rows_leave(7, [0, 2, 3, 4, 5, 6])
    assert peak < 1 / 4  # one row of 8 moved
    assert eng.batch.width == 8 and [r.uid for r in eng.batch.rows] == [uids[i] for i in (0, 6, 2, 3, 4, 5)]


def rows_leave(rows: int, keep):
    """An engine decoding ``rows`` rows of bucket 8 (a step in flight) that keeps
    rows ``keep``: ``(engine, the rows' uids before, peak memory of the keep
    as a share of the caches)``."""
    cm = CompiledModel(tiny_model("llama", head_dim=64))
    eng = Engine(cm, buckets=(1, 2, 4, 8), prefill_chunks=(4, 8), prefill_step_tokens=8)
    for k in range(rows):
        eng.add([3 + k] + PROMPT[:40], max_tokens=40)
    for _ in range(14):
        eng.step()
    batch = eng.batch
    assert len(batch.rows) == rows and batch.width == 8 and batch.pipeline
    uids = [r.uid for r in batch.rows]
    mx.eval([c.state for c in batch.caches])
    total = sum(c.nbytes for c in batch.caches)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    batch.keep(list(keep))
    mx.eval([c.state for c in batch.caches])
    return eng, uids, (mx.get_peak_memory() - base) / total


def test_rows_leaving_for_a_narrower_bucket_copy_no_row_and_write_in_place():
    """In the engine: 5 rows of bucket 8 leaving 3 (bucket 4) move one row and
    copy none; the decode steps after it write the narrowed buffers in place
    (the kernels' cache_writes: all donated, none copied)."""
    from mlx_tracer.backend import kernels

    K = kernels.load()
    if K is None:
        pytest.skip(f"native kernels unavailable: {kernels.status()}")
    eng, uids, peak = rows_leave(5, [1, 2, 4])
    batch = eng.batch
    assert peak < 1 / 4  # one row of 8 moved
    assert batch.width == 4 and [r.uid for r in batch.rows] == [uids[i] for i in (4, 1, 2)]
    donated, copied = K.cache_writes()
    for _ in range(6):
        eng.step()
    assert K.cache_writes()[1] == copied  # written where they lie
    assert K.cache_writes()[0] >= donated + 5 * 2 * len(batch.caches)


def test_move_rows_leaves_half_empty_full_caches_to_filter():
    """A full cache whose remaining rows would fit half its capacity is laid out again."""
    rng = np.random.default_rng(5)
    rows = [serial(rng, n) for n in (100, 3)]
    batch = FullCache.merge(rows, width=2)
    decode(batch, rng, 2)
    assert batch.capacity >= 128
    assert not batch.move_rows([1])
    assert batch.n == 2


def test_serial_caches_admitted_together_join_one_by_one_with_the_tokens_of_solo_runs():
    """Requests continuing serial mlx-lm caches, admitted at once, are
    prefilled and joined one after another into a batch of the bucket they
    all need (the later ones written into its free rows), so that one row's
    caches live beside the batch during admission, not all of them; each row
    decodes as it does alone."""
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_model("llama", head_dim=64)
    cm = CompiledModel(model, fuse=True)
    contexts = []
    for i, n in enumerate([1500, 1200, 900, 1400]):  # rows of different lengths: a timeline they all fit
        c = make_prompt_cache(model)
        model(mx.array([[(7 * j + i) % 89 + 2 for j in range(n)]]), cache=c)
        mx.eval([x.state for x in c])
        contexts.append(c)
    firsts = [3, 11, 17, 29]
    want = []
    for c, t in zip(contexts, firsts):
        eng = Engine(cm, buckets=(1,))
        eng.add([t], max_tokens=8, cache=c)
        want.append([ev.token for ev in eng.run() if ev.token is not None])
    eng = Engine(cm, buckets=(1, 2, 4))
    uids = [eng.add([t], max_tokens=8, cache=c) for c, t in zip(contexts, firsts)]
    eng.admit()
    # the first row made the batch at bucket 4, the other three were written into its free rows
    assert eng.batch.width == 4 and (eng.stats.joins, eng.stats.joins_in_place) == (3, 3)
    got = {u: [] for u in uids}
    for ev in eng.run():
        if ev.token is not None:
            got[ev.uid].append(ev.token)
    assert [got[u] for u in uids] == want


@pytest.mark.parametrize("family,fmt", [("llama", KVFormat()), ("llama_mixed", KVFormat(bits=8))],
                         ids=["full", "mixed-8bit"])
def test_joins_that_widen_the_batch_copy_into_buffers_made_ready(monkeypatch, family, fmt):
    """While requests wait to join, the caches make buffers of the next bucket
    ready a few a step (caches.spare: the first touch of new memory had made a
    widening join a stall of every running row); the joins that widen copy the
    running rows into them, with the tokens of an engine that does not."""
    from mlx_tracer.caches import spare

    model = tiny_model(family, **({"head_dim": 64} if fmt.quantized else {}))
    ready, stats = serve(CompiledModel(model, kv=fmt), True, fmt)
    monkeypatch.setattr(spare, "side_stream", lambda: None)
    plain, before = serve(CompiledModel(model, kv=fmt), True, fmt)
    assert ready == plain
    assert stats.joins_into_ready >= 1 and before.joins_into_ready == 0


@pytest.mark.parametrize("fmt", [KVFormat(), KVFormat(bits=8)], ids=["float32", "8-bit"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_a_widening_place_uses_buffers_made_ready_only_for_its_width(kind, fmt):
    """Buffers made ready for the next bucket (caches.spare): a place into
    that bucket copies the live rows into them; one into another bucket does
    not use them. Both hold what the copying join holds."""
    for ready, width in ((16, 16), (16, 32)):
        rng = np.random.default_rng(0)
        batch, window = running_batch(kind, fmt, rng, width=8)  # 5 rows
        newcomers = kind.merge([serial(rng, n, window) for n in (40, 11, 3, 20)], width=4, storage=fmt)
        mx.eval(newcomers.state)
        want = kind.join([batch, newcomers], width=width)
        mx.eval(want.state)
        assert batch.make_ready(ready)
        assert batch.place([newcomers], width=width)
        mx.eval(batch.state)
        assert batch.width == width and batch.spare_hits == (ready == width)
        assert batch._spare is None  # not held after the move
        same_rows(rows_of(batch), rows_of(want))
