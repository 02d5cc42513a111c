"""The prefix cache on tiny models: continuations from cached keys and values
give the solo tokens, entries are never written, trimming, rings that
wrapped, the byte bound and LRU order."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_tracer.runtime.engine import Engine
from mlx_tracer.runtime.prefix_cache import PrefixCache

from .helpers import solo_tokens
from .tiny_models import tiny_model


class CachedEngine:
    """An engine whose retired rows feed a prefix cache, and whose requests start from it."""

    def __init__(self, model, max_bytes=1 << 30, buckets=(1, 2)):
        self.cache = PrefixCache(max_bytes)
        self.prefix = {}  # uid -> ids its starting caches held
        self.engine = Engine(model, buckets=buckets, on_retire=self._retired)

    def _retired(self, request, caches, tokens):
        held = max(c.offset for c in caches)
        self.cache.store((self.prefix.pop(request.uid, []) + request.context)[:held], caches)

    def add(self, prompt, max_tokens):
        hit = self.cache.lookup(prompt)
        n = hit.tokens if hit else 0
        uid = self.engine.add(prompt[n:], max_tokens=max_tokens, cache=hit.caches if hit else None, stop_ids=())
        self.prefix[uid] = prompt[:n]
        return uid, n

    def run(self):
        out = {}
        for ev in self.engine.run():
            out.setdefault(ev.uid, []).append(ev.token)
        return out


@pytest.mark.parametrize("family", ["llama", "llama_mixed", "qwen3"])
def test_turns_continued_from_the_cache_equal_solo_runs(family):
    model = tiny_model(family)
    eng = CachedEngine(model)
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 100, size=20).tolist()
    uid, n = eng.add(prompt, 6)
    assert n == 0
    history = prompt + eng.run()[uid]
    for tail in ([7, 8], [9, 10, 11]):  # a second and a third turn
        turn = history + tail
        uid, n = eng.add(turn, 5)
        assert n > 0
        out = eng.run()[uid]
        assert out == solo_tokens(model, turn, 5), f"{family}: continuation from {n} cached tokens differs"
        history = turn + out
    assert eng.cache.stats.hit_tokens > 0


def test_one_entry_serves_two_requests_at_once_and_is_never_written():
    model = tiny_model("llama")
    eng = CachedEngine(model)
    prompt = list(range(10, 30))
    uid, _ = eng.add(prompt, 4)
    eng.run()
    (entry,) = eng.cache.entries.values()
    before = [np.array(c.keys) for c in entry.caches]
    a, b = prompt + [5, 6], prompt + [7]
    (ua, na), (ub, nb) = eng.add(a, 6), eng.add(b, 6)  # both from the same entry, decoding together
    assert na == nb == len(prompt)
    out = eng.run()
    assert out[ua] == solo_tokens(model, a, 6) and out[ub] == solo_tokens(model, b, 6)
    assert all(np.array_equal(x, np.array(c.keys)) for x, c in zip(before, entry.caches))


def _kv(n, heads=2, dim=4):
    c = KVCache()
    c.keys = mx.arange(n * heads * dim, dtype=mx.float32).reshape(1, heads, n, dim)
    c.values = c.keys + 1
    c.offset = n
    return c


def test_lookup_trims_copies_and_leaves_one_token_to_feed():
    pc = PrefixCache(1 << 20)
    ids = list(range(1, 11))
    assert pc.store(ids, [_kv(10), _kv(10)])
    assert pc.lookup([50, 51]) is None
    hit = pc.lookup(ids[:6] + [99])
    assert hit.tokens == 6 and all(c.offset == 6 for c in hit.caches)
    hit = pc.lookup(ids)  # the whole entry: one token stays to feed
    assert hit.tokens == 9
    hit = pc.lookup(ids + [3, 4])
    assert hit.tokens == 10
    (entry,) = pc.entries.values()
    assert all(c.offset == 10 for c in entry.caches)  # copies were trimmed, never the entry
    assert pc.stats.hits == 3 and pc.stats.hit_tokens == 6 + 9 + 10 and pc.stats.lookups == 4


def test_byte_bound_evicts_the_least_recently_used_and_longer_entries_replace_their_prefixes():
    per = _kv(10).nbytes
    pc = PrefixCache(2 * per)
    assert pc.store(list(range(10)), [_kv(10)])
    assert pc.store(list(range(100, 110)), [_kv(10)])
    pc.lookup(list(range(12)))  # touch the first: the second is now the least recently used
    assert pc.store(list(range(200, 210)), [_kv(10)])
    assert [int(e.ids[0]) for e in pc.entries.values()] == [0, 200] and pc.stats.evictions == 1
    assert pc.nbytes == 2 * per
    assert not pc.store(list(range(5)), [_kv(5)])  # already served by the entry it starts
    assert not PrefixCache(per - 1).store(list(range(10)), [_kv(10)])  # bigger than the whole bound


def test_a_longer_entry_replaces_the_one_it_extends():
    pc = PrefixCache(1 << 20)
    pc.store(list(range(10)), [_kv(10)])
    pc.store(list(range(14)), [_kv(14)])
    assert [len(e.ids) for e in pc.entries.values()] == [14]


def test_a_wrapped_ring_serves_only_prompts_that_extend_it():
    ring = RotatingKVCache(max_size=4)
    ring.keys = mx.zeros((1, 2, 4, 4))
    ring.values = mx.zeros((1, 2, 4, 4))
    ring.offset, ring._idx = 9, 4  # wrapped: nothing can be cut from it
    pc = PrefixCache(1 << 20)
    pc.store(list(range(9)), [ring])
    assert pc.lookup(list(range(5)) + [50]) is None
    hit = pc.lookup(list(range(12)))
    assert hit.tokens == 9 and hit.caches[0].offset == 9
