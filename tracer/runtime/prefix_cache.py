"""A prefix cache: the keys and values of finished rows, reused by later
requests that start with the same tokens.

Requests often share a prefix with an earlier one: the same system prompt, or
a multi-turn chat that sends its whole history again each turn. The engine
given one (``Engine(prefix_cache=...)``) looks each new prompt up when it is
added (:class:`PrefixReuse`) and stores every row that leaves the batch.
:meth:`PrefixCache.store` keeps a row's owned serial mlx-lm caches with the
token ids whose keys and values they hold; :meth:`PrefixCache.lookup` finds
the entry sharing the longest prefix with a new prompt and returns *copies* of
its caches trimmed to that prefix, which the request continues from.

Invariants:
  - an entry's arrays are never written: a lookup returns new cache objects
    over the same arrays, and the engine only reads the caches it is given, so
    one entry can serve any number of requests, at once or in turn;
  - at least one prompt token is left to feed (the first decode step needs
    the logits of the last prompt token);
  - ``nbytes`` (the sum of the entries' cache bytes) stays within
    ``max_bytes``; the least recently used entries go first;
  - no entry's ids are a prefix of another trimmable entry's ids (the longer
    one serves every prefix the shorter one could).

A cache that cannot be trimmed (an mlx-lm ring that has wrapped) serves only
prompts that extend its whole token sequence.

Lookup compares the prompt with every entry (vectorised): the byte bound keeps
the entries few (tens to hundreds), so a scan is cheap next to one prefill window and needs no
index to keep consistent.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from .options import check_cache_bytes


@dataclass
class PrefixEntry:
    """The serial caches of one finished row and the ids they hold."""

    ids: np.ndarray  # [n] int64: tokens whose keys and values the caches hold
    caches: list  # one serial mlx-lm cache per layer, never written
    nbytes: int
    trimmable: bool  # whether shorter prefixes can be cut from it


@dataclass
class PrefixHit:
    """What :meth:`PrefixCache.lookup` found: caches holding ``tokens`` prompt tokens."""

    tokens: int
    caches: list  # fresh cache objects, owned by the caller


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0  # prompt tokens served from the cache (not prefilled)
    stored: int = 0
    evictions: int = 0


@dataclass(frozen=True)
class PrefixCacheSnapshot:
    """A prefix cache's counters and size at one moment (for metrics)."""

    stats: PrefixCacheStats  # a copy
    entries: int
    nbytes: int
    max_bytes: int


class PrefixCache:
    """An LRU of finished rows' serial caches, bounded in bytes (see module docstring).

    Args:
        max_bytes: the most bytes of keys and values kept (0: keep nothing).
        min_tokens: the shortest shared prefix worth reusing.
    """

    def __init__(self, max_bytes: int, min_tokens: int = 1):
        max_bytes = check_cache_bytes(max_bytes)
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.max_bytes = int(max_bytes)
        self.min_tokens = int(min_tokens)
        self.entries: "OrderedDict[int, PrefixEntry]" = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.stats = PrefixCacheStats()
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self.entries)

    # ------------------------------------------------------------- lookup
    def lookup(self, prompt: Sequence[int]) -> Optional[PrefixHit]:
        """Copies of the caches sharing the longest prefix with ``prompt``,
        trimmed to it (leaving at least one prompt token); None if none does."""
        self.stats.lookups += 1
        best, best_n = None, 0
        want = np.asarray(prompt, dtype=np.int64)
        limit = len(want) - 1
        for key, entry in self.entries.items():
            n = min(_shared(entry.ids, want), limit)
            if n < len(entry.ids) and not entry.trimmable:
                continue
            if n >= best_n:  # ties go to the most recently used (later in the order)
                best, best_n = key, n
        if best is None or best_n < self.min_tokens:
            return None
        entry = self.entries[best]
        self.entries.move_to_end(best)
        caches = [type(c).from_state(c.state) for c in entry.caches]  # new objects over the same arrays
        if best_n < len(entry.ids):
            trim_prompt_cache(caches, len(entry.ids) - best_n)
        self.stats.hits += 1
        self.stats.hit_tokens += best_n
        return PrefixHit(best_n, caches)

    # -------------------------------------------------------------- store
    def store(self, ids: Sequence[int], caches: List) -> bool:
        """Keep ``caches`` (owned serial caches, one per layer) holding the keys
        and values of ``ids``. Returns whether they were kept."""
        ids = np.asarray(ids, dtype=np.int64)
        nbytes = sum(c.nbytes for c in caches)
        if len(ids) < self.min_tokens or nbytes > self.max_bytes:
            return False
        trimmable = can_trim_prompt_cache(caches)
        for key, entry in list(self.entries.items()):
            if len(entry.ids) >= len(ids) and _shared(entry.ids, ids) == len(ids) and (entry.trimmable or len(entry.ids) == len(ids)):
                self.entries.move_to_end(key)  # an entry already serves every prefix of ids
                return False
            if trimmable and len(entry.ids) < len(ids) and _shared(entry.ids, ids) == len(entry.ids):
                self._drop(key)  # the new entry serves every prefix this one did
        # evaluate now: a lazy copy would keep the batch's old buffers alive
        mx.eval([a for c in caches for a in (c.keys, c.values) if a is not None])
        self.entries[next(self._ids)] = PrefixEntry(ids, list(caches), nbytes, trimmable)
        self.nbytes += nbytes
        self.stats.stored += 1
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
            self.stats.evictions += 1
        return True

    def snapshot(self) -> PrefixCacheSnapshot:
        return PrefixCacheSnapshot(replace(self.stats), len(self.entries), self.nbytes, self.max_bytes)

    def clear(self):
        self.entries.clear()
        self.nbytes = 0

    def _drop(self, key: int):
        self.nbytes -= self.entries.pop(key).nbytes


class PrefixReuse:
    """A prefix cache serving one engine's requests: looked up when a request
    is added, fed by its row when it retires. It remembers, per request, the
    ids of the prefix its starting caches held, since the engine sees only
    the rest of the prompt.
    """

    def __init__(self, cache: PrefixCache):
        self.cache = cache
        self.prefixes: Dict[int, List[int]] = {}  # uid -> ids its starting caches held, until it finishes

    def lookup(self, prompt: List[int]) -> Optional[PrefixHit]:
        return self.cache.lookup(prompt)

    def started(self, uid: int, prompt: List[int], hit: Optional[PrefixHit]):
        if hit is not None:
            self.prefixes[uid] = prompt[: hit.tokens]

    def cached(self, uid: int) -> int:
        """Prompt tokens of request ``uid`` served from the cache (0 without a hit)."""
        return len(self.prefixes.get(uid, ()))

    def retired(self, uid: int, context_len: int, caches: list, tokens: Sequence[int]):
        """Keep a leaving row's caches: they hold ``tokens`` after the
        ``context_len`` positions of the prefix the row started from."""
        prefix = self.prefixes.pop(uid, [])
        held = max((int(c.offset) for c in caches), default=0)
        ids = prefix[:context_len] + list(tokens)
        if held and len(ids) == held:
            self.cache.store(ids, caches)

    def forget(self, uid: int):
        """A request that finished without a row (cancelled while queued)."""
        self.prefixes.pop(uid, None)


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two id arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
