"""FullCache: full-attention KV storage with a fixed capacity per bucket.

The batched counterpart of mlx-lm's ``BatchKVCache`` whose buffers do not
grow per token: ``keys/values [Bk, H, C, D]`` with ``C`` taken from a small
ladder of capacity buckets (64, 128, ..., 512, 576, 640, ...). Column ``c`` holds column-time ``c``;
a row's tokens are the columns ``[left_padding[r], time)``. Writing past the
capacity moves the cache to the next bucket: one reallocation, counted in
``regrows``, never per token.

From ``GROWTH_LEAD`` columns before a rung, a decode step's plan names the
next capacity (``StepPlan.ahead``) and each cache of the family, at its own
column (a few caches a step), makes buffers of that capacity ready
(:mod:`.spare`); the crossing then only copies the columns in.
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .batch import RowSource, StaticKVCache
from .masks import MaskGeometry, full_columns
from .plan import StepPlan
from .rows import RowBook
from .spare import make_ready, put
from .storage import KVFormat, each, first
from .writes import realign_rows, write_columns


def capacity_ladder(smallest: int = 64, largest: int = 32768, per_octave: int = 8) -> tuple:
    """Capacity buckets: multiples of 64 below 512, then ``per_octave`` rungs
    per doubling, so a buffer is at most 1 + 1/per_octave times its live
    columns (attention runs over the whole buffer: on the CPU a decode step's
    attention over 1536 columns costs about twice that over 1025). Each rung
    costs one trace (~50 ms) and one copy when crossed."""
    out, c = [], smallest
    while c < largest:
        out.append(c)
        c += max(64, (1 << (c.bit_length() - 1)) // per_octave)
    return tuple(out) + (largest,)


DEFAULT_CAPACITIES = capacity_ladder()
GROWTH_LEAD = 16  # columns before a full cache's capacity from which its next buffers are made ready

_slots = itertools.count()


def capacity_bucket(tokens: int, capacities: Sequence[int] = DEFAULT_CAPACITIES) -> int:
    """Smallest capacity bucket holding ``tokens`` columns."""
    for c in capacities:
        if c >= tokens:
            return c
    raise ValueError(
        f"{tokens} positions exceed the largest capacity bucket {capacities[-1]}: "
        f"pass capacities=(..., {1 << max(tokens - 1, 1).bit_length()}) or use a shorter prompt"
    )


class FullCache(StaticKVCache):
    """Full-attention batch cache of fixed capacity.

    State (``self.rows``, a RowBook): ``offsets[r]`` = tokens of row r (its
    RoPE offset), ``left_padding[r]`` = first valid column, ``time`` = the
    write column shared by all rows, ``right_padding[r]`` = prompt padding
    written after row r's tokens and rolled out by ``finalize``.
    Invariant: ``offsets[r] == time - right_padding[r] - left_padding[r]``
    (outside ``prepare(left_padding=...)``, where offsets start negative as in
    mlx-lm) and ``time <= capacity``.
    """

    kind = "full"

    def __init__(
        self,
        left_padding: Sequence[int] = (),
        *,
        width: Optional[int] = None,
        capacity: Optional[int] = None,
        capacities: Sequence[int] = DEFAULT_CAPACITIES,
        storage: KVFormat = KVFormat(),
    ):
        super().__init__(RowBook.padded(left_padding), width, storage)
        self.capacities = tuple(sorted(capacities))
        self.capacity = capacity or self.capacities[0]
        self.regrows = 0
        self._slot = next(_slots) % GROWTH_LEAD + 1  # the next rung's buffers made ready with this many columns left

    @property
    def S(self) -> int:
        return self.capacity

    # -------------------------------------------------------------- capacity
    def reserve(self, L: int):
        """Make room for ``L`` more columns, moving to a larger bucket if needed."""
        need = self.rows.time + L
        if need <= self.capacity:
            return False
        self._grow(capacity_bucket(need, self.capacities))
        return True

    def fit(self, plan: StepPlan):
        if plan.capacity > self.capacity:
            self._grow(plan.capacity)
        if plan.ahead is not None and plan.ahead[1] <= self._slot and self.keys is not None:
            self._spare, _ = make_ready(self._spare, self.keys, self.values, self.width, plan.ahead[0])
        return self.keys, self.values

    def _grow(self, new: int):
        if self.keys is not None:
            spare = self.take_spare(self.width, new)
            if spare is not None:
                self.keys, self.values = each(put, spare.keys, self.keys), each(put, spare.values, self.values)
            else:
                pad = [(0, 0), (0, 0), (0, new - self.capacity), (0, 0)]
                self.keys, self.values = (each(lambda a: mx.pad(a, pad), buf) for buf in (self.keys, self.values))
        self.capacity = new
        self.regrows += 1

    # ------------------------------------------------------------------ steps
    def plan(self, L: int) -> StepPlan:
        self.reserve(L)
        T = self.rows.time
        q = mx.array(np.arange(T, T + L, dtype=np.int32))  # [L] query times = their columns
        start = q if L == 1 else mx.array([T], dtype=mx.int32)  # [1] the first column written
        geometry = MaskGeometry(full_columns(self.capacity), q, q, *self._row_inputs())
        return StepPlan(L, self.is_decode(L), self.capacity, self.offset, geometry, (start,), self._ahead(L))

    def _ahead(self, L: int) -> Optional[tuple]:
        """After a decode step within ``GROWTH_LEAD`` columns of the capacity:
        (the next capacity, the columns left)."""
        left = self.capacity - (self.rows.time + L)
        if L != 1 or self.keys is None or left >= GROWTH_LEAD or self.capacity >= self.capacities[-1]:
            return None
        return capacity_bucket(self.capacity + 1, self.capacities), left

    @staticmethod
    def apply(decode, kbuf, vbuf, keys, values, writes):
        (start,) = writes  # [1] int32: the shared write column
        kbuf = write_columns(kbuf, keys, start)  # [Bk, H, C, Dk]
        vbuf = write_columns(vbuf, values, start)  # [Bk, H, C, Dv]
        return kbuf, vbuf, kbuf, vbuf

    def advance(self, plan: StepPlan):
        valid = self.rows.consume(plan.length)
        if not isinstance(valid, int):  # a prepared prompt's padding was written too
            self.rows.right_padding = self.rows.right_padding + (plan.length - valid)

    # --------------------------------------------------------- verify steps
    @staticmethod
    def verify_apply(kbuf, vbuf, keys, values, writes):
        """The forward of a verify window: written like any window (the queries
        attend causally); what stays is decided by :meth:`verify_commit`."""
        return FullCache.apply(False, kbuf, vbuf, keys, values, writes)

    @staticmethod
    def verify_commit(kbuf, vbuf, writes, rejected, strip, size, realign=None):
        """Right-align each row again after a verify window: row r's last
        ``rejected[r]`` columns (refused drafts) fall off its end, and the
        ``strip`` columns every live row holds as left padding are dropped.
        A bucket of one row moves nothing: its write column steps back over
        the refused drafts instead (:meth:`advance_verify`), which the next
        writes overwrite; a realignment would copy every column of every layer.
        ``realign(array, delta)``: one array moved as :func:`realign_rows`
        moves it (the native kernel's, in place; default: MLX's gather)."""
        if first(kbuf).shape[0] == 1:
            return kbuf, vbuf
        delta = rejected - strip  # [Bk] columns each row moves right
        if realign is None:
            return realign_rows(kbuf, delta), realign_rows(vbuf, delta)
        return each(lambda a: realign(a, delta), kbuf), each(lambda a: realign(a, delta), vbuf)

    def advance_verify(self, plan: StepPlan, valid: np.ndarray):
        """Host bookkeeping of :meth:`verify_commit` (``valid[r]``: tokens row r kept)."""
        valid = self.rows.consume(plan.length, valid)
        rejected = plan.length - valid
        if self.width == 1:  # nothing moved: the refused columns are the next ones written
            self.rows.time -= int(rejected[0]) if self.n else 0
            return
        lp = self.rows.left_padding + rejected
        strip = int(lp.min()) if self.n else 0
        self.rows.left_padding = lp - strip
        self.rows.time -= strip

    def finalize(self):
        """Roll each row right by its pending prompt padding so rows end at
        ``time``, and drop the padding columns every row shares (one gather)."""
        rp, lp = self.rows.right_padding, self.rows.left_padding
        strip = int(min(lp + rp)) if self.n else 0
        if (rp.any() or strip) and self.keys is not None:
            shift = np.zeros(self.width, dtype=np.int64)
            shift[: self.n] = rp - strip
            cols = (np.arange(self.capacity)[None, :] - shift[:, None]) % self.capacity  # [Bk, C]
            idx = mx.array(cols.astype(np.int32))[:, None, :, None]
            roll = lambda a: mx.contiguous(mx.take_along_axis(a, idx, axis=2))  # noqa: E731  row-major: see assemble
            self.keys, self.values = each(roll, self.keys), each(roll, self.values)
        self.rows.left_padding = lp + rp - strip
        self.rows.time -= strip
        self.rows.right_padding = np.zeros_like(rp)
        self.rows.pending = None

    def is_trimmable(self) -> bool:
        return True

    def move_rows(self, order) -> bool:
        """:meth:`StaticKVCache.move_rows`; then, when the next
        ``STRIP_MARGIN`` steps would move the buffers to a larger capacity
        anyway and the live rows all hold at least a quarter of it as left
        padding, those columns are dropped instead (one copy, as a growth
        would be; the capacity is kept, so the next ones are far away)."""
        if not super().move_rows(order):
            return False
        rows = self.rows
        strip = int(rows.left_padding.min()) if self.n else 0
        if (self.keys is not None and self.capacity - rows.time <= self.STRIP_MARGIN and strip >= self.capacity // 4
                and not rows.right_padding.any()):
            def shift(a):  # [Bk, H, C, D]: columns strip.. moved to 0.., zeros after
                return mx.concatenate([a[:, :, strip:], mx.zeros((*a.shape[:2], strip, a.shape[3]), a.dtype)], axis=2)

            self.keys, self.values = each(shift, self.keys), each(shift, self.values)
            self.rows = RowBook(rows.offsets, rows.left_padding - strip, rows.time - strip, rows.right_padding)
        return True

    STRIP_MARGIN = 8

    def _relayout_preferred(self, order) -> bool:
        """Rows ``order`` rather laid out again (by ``filter``, which drops the
        padding columns all of them hold) when they would then fit half the
        capacity: rows moved in place keep those columns, so a batch whose
        rows come and go without a bucket change would otherwise only grow."""
        strip = int(self.rows.left_padding[list(order)].min()) if len(order) else self.rows.time
        return self.rows.time - strip + 1 <= self.capacity // 2

    def trim(self, n: int, bypass: bool = False) -> int:
        return self.rows.unconsume(n)

    def size(self) -> int:
        return self.rows.time

    # ------------------------------------------------------------ moving rows
    def _col_mapper(self):
        return _identity

    def _target_col_times(self, time):
        return np.arange(self.capacity)

    def _target_time(self, sources: List[RowSource], capacity: Optional[int] = None) -> int:
        top = max(s.rows.time for s in sources)
        pads = [lp + top - s.rows.time for s in sources for lp in s.rows.left_padding.tolist()]
        time = top - (min(pads) if pads else top)
        self.capacity = max(capacity or 0, capacity_bucket(time + 1, self.capacities))
        return time

    def _serial(self, keys, values, offset):
        """mlx-lm's serial cache of one row: ``KVCache``, or ``QuantizedKVCache`` when quantized."""
        s = self.storage
        cache = QuantizedKVCache(group_size=s.group_size, bits=s.bits) if s.quantized else KVCache()
        if keys is not None:
            cache.keys, cache.values = keys, values
            cache.offset = first(keys).shape[2]
        return cache

    def _serial_source(self, cache) -> RowSource:
        if not isinstance(cache, (KVCache, QuantizedKVCache)):
            raise ValueError(
                f"FullCache can join FullCache batches or mlx-lm KVCache / QuantizedKVCache, not {type(cache).__name__}"
            )
        n = cache.offset if cache.keys is not None else 0
        keys, values = (None if buf is None else each(lambda a: a[..., :n, :], buf) for buf in (cache.keys, cache.values))
        if isinstance(cache, QuantizedKVCache) and keys is not None:
            keys, values = tuple(keys), tuple(values)
        rows = None if keys is None else first(keys).shape[0]
        if rows not in (None, 1):
            raise ValueError(f"a serial {type(cache).__name__} must hold one row, this one holds {rows}")
        return RowSource(keys, values, RowBook([n], [0], n), _identity)

    @classmethod
    def _prototype(cls, sources, capacities: Sequence[int] = DEFAULT_CAPACITIES, storage: Optional[KVFormat] = None, **_):
        storage = cls._storage_of(sources, storage)
        for s in sources:
            if isinstance(s, FullCache):
                return cls(capacities=s.capacities, storage=storage)
        return cls(capacities=capacities, storage=storage)


def _identity(times):
    return times
