"""RingCache: sliding-window KV storage written in place.

The batched counterpart of mlx-lm's ``BatchRotatingKVCache`` with buffers of
the window's size from the start: ``keys/values [Bk, H, W, D]``. A decode
writes one column at ``head`` and the ring wraps; a window step of ``L``
tokens attends over the ring in temporal order followed by the new keys
(``W + L`` columns, since query 0 still needs the ``W - 1`` keys before it)
and then commits the newest ``W`` tokens of each row back into the ring, in
temporal order, so that each row's newest token lands on the same column.
Column layouts match mlx-lm's, so attention sums the live keys in the same
order and gives the same bits.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from .batch import RowSource, StaticKVCache
from .full import _identity
from .masks import MaskGeometry, ring_decode_columns, ring_window_columns
from .plan import StepPlan
from .rows import RowBook
from .storage import KVFormat, each, first
from .storage import nbytes as buffer_bytes
from .writes import ring_attend, ring_commit, ring_window, write_columns


class RingCache(StaticKVCache):
    """Sliding-window batch cache of ``W = max_size`` columns.

    State: ``self.rows`` (a RowBook: per-row ``offsets`` = absolute positions,
    evicted tokens included; ``left_padding`` = first valid column-time;
    ``time`` = the shared column-time of the next write) and ``head``, the
    column the next decode writes. Column ``c`` holds column-time
    ``time - 1 - ((head - 1 - c) mod W)``; times before ``time - W`` are gone.
    Invariant: each row's valid tokens are the times
    ``[max(left_padding[r], time - W), time)``; rows never hold prompt padding
    at their end (a window step realigns them as it commits).
    """

    kind = "ring"

    def __init__(self, max_size: int, left_padding: Sequence[int] = (), *, width: Optional[int] = None,
                 storage: KVFormat = KVFormat()):
        if max_size < 1:
            raise ValueError(f"ring window must be >= 1, got {max_size}")
        super().__init__(RowBook.padded(left_padding), width, storage)
        self.max_size = int(max_size)
        self.head = 0

    @property
    def S(self) -> int:
        return self.max_size

    @property
    def wrapped(self) -> bool:
        """Whether the ring has evicted columns (mlx-lm: ``_offset >= max_size``)."""
        return self.rows.time >= self.max_size

    # ------------------------------------------------------------------ steps
    def plan(self, L: int) -> StepPlan:
        W, T = self.max_size, self.rows.time
        fv, live = self._row_inputs()
        if self.is_decode(L):
            head = mx.array([self.head], dtype=mx.int32)  # [1] the column written
            geometry = MaskGeometry(ring_decode_columns(T, self.head, W), mx.array([T], dtype=mx.int32), head, fv, live, W)
            return StepPlan(L, True, None, self.offset, geometry, (head,))
        q = T + mx.arange(L, dtype=mx.int32)  # [L] query times
        geometry = MaskGeometry(ring_window_columns(T, W, L), q, W + mx.arange(L, dtype=mx.int32), fv, live, W)
        shift = np.zeros(self.width, dtype=np.int32)  # [Bk] prompt padding at the end of each row's new keys
        if self.rows.pending is not None:
            shift[: self.n] = L - np.minimum(self.rows.pending, L)
        writes = (mx.array(self.head, dtype=mx.int32), mx.array(shift), mx.array(max(W - T, L), dtype=mx.int32))
        return StepPlan(L, False, None, self.offset, geometry, writes)

    @staticmethod
    def apply(decode, kbuf, vbuf, keys, values, writes):
        if decode:
            (head,) = writes  # [1]: write in place at the ring's head
            kbuf = write_columns(kbuf, keys, head)  # [Bk, H, W, Dk]
            vbuf = write_columns(vbuf, values, head)
            return kbuf, vbuf, kbuf, vbuf
        head, shift, first = writes
        k_att, kbuf = ring_window(kbuf, keys, head, shift, first)  # [Bk, H, W+L, Dk], [Bk, H, W, Dk]
        v_att, vbuf = ring_window(vbuf, values, head, shift, first)
        return k_att, v_att, kbuf, vbuf

    # --------------------------------------------------------- verify steps
    @staticmethod
    def verify_apply(kbuf, vbuf, keys, values, writes):
        """The forward of a verify window: the queries attend over the ring and
        the new keys; nothing is committed before the drafts are judged."""
        head = writes[0]
        k_att, v_att = ring_attend(kbuf, keys, head), ring_attend(vbuf, values, head)  # [Bk, H, W+L, D]
        return k_att, v_att, k_att, v_att

    @staticmethod
    def verify_commit(katt, vatt, writes, rejected, strip, size, realign=None):
        """Commit only each row's accepted columns of the ``W + L`` window: a
        refused draft never overwrote anything, so rollback is exact after a wrap
        (``realign``: unused, a ring's commit is a gather of its own)."""
        first = writes[2]
        return ring_commit(katt, rejected, first, size), ring_commit(vatt, rejected, first, size)

    def advance_verify(self, plan: StepPlan, valid: np.ndarray):
        self.advance(plan, valid)

    def advance(self, plan: StepPlan, valid: Optional[np.ndarray] = None):
        W, T, L = self.max_size, self.rows.time, plan.length
        if plan.decode:
            self.rows.consume(1)
            self._advanced(plan)
            return
        valid = self.rows.consume(L, valid)
        self.rows.left_padding = np.maximum(self.rows.left_padding, T - W) + (L - valid)
        self.head = 0 if T + L >= W else T + L

    def _advanced(self, plan: StepPlan):
        self.head = (self.head + 1) % self.max_size

    def _verify_twin(self, other) -> bool:
        return super()._verify_twin(other) and self.max_size == other.max_size

    def _took_verify(self, other):
        self.head = other.head  # a window's commit sets it from the time, the window and W alone

    def finalize(self):
        """Rows are realigned at every window step; this ends the prepared prompt."""
        self.rows.pending = None

    def is_trimmable(self) -> bool:
        return not self.wrapped

    def trim(self, n: int, bypass: bool = False) -> int:
        """Drop the last ``n`` tokens. Refused once the ring has wrapped (they
        evicted older tokens) unless ``bypass`` (speculative rollback of the
        newest tips: the window then holds ``W - n`` tokens until refilled)."""
        if self.wrapped and not bypass:
            raise ValueError(
                f"ring of window {self.max_size} has wrapped (time {self.rows.time}): its newest tokens evicted "
                "older ones and cannot be trimmed; pass bypass=True to drop speculative tips anyway"
            )
        self.rows.left_padding = np.maximum(self.rows.left_padding, self.rows.time - self.max_size)
        n = self.rows.unconsume(n)
        self.head = (self.head - n) % self.max_size
        return n

    def size(self) -> int:
        return min(self.rows.time, self.max_size)

    # ------------------------------------------------------------ moving rows
    def _cap_tokens(self, tokens: int) -> int:
        return min(tokens, self.max_size)

    def _retained_start(self) -> int:
        return max(0, self.rows.time - self.max_size)

    def _col_mapper(self):
        head, time, W = self.head, self.rows.time, self.max_size
        return lambda times: (head - (time - np.asarray(times))) % W

    def _target_col_times(self, time):
        c = np.arange(self.max_size)
        return time - 1 - ((self.head - 1 - c) % self.max_size)

    def _target_time(self, sources: List[RowSource]) -> int:
        W = self.max_size
        batches = [s.batch for s in sources]
        if all(b is not None and b.wrapped for b in batches) and len({b.head for b in batches}) == 1:
            # Same physical rotation everywhere: keep the columns where they are.
            self.head = batches[0].head
            return max(s.rows.time for s in sources)
        # Otherwise lay every row out in temporal order, right-aligned.
        time = max(min(s.rows.time, W) for s in sources)
        self.head = time % W
        return time

    def _check_compatible(self, other):
        if other.max_size != self.max_size:
            raise ValueError(f"cannot join rings of different windows ({self.max_size} and {other.max_size})")

    def _serial(self, keys, values, offset):
        s = self.storage
        cache = QuantizedRingRow(self.max_size, s.group_size, s.bits) if s.quantized else RotatingKVCache(max_size=self.max_size)
        if keys is not None:
            cache.keys, cache.values = keys, values
            cache._idx = first(keys).shape[2]  # temporal order: the write head sits at the end
        cache.offset = offset
        return cache

    def _serial_source(self, cache) -> RowSource:
        if not isinstance(cache, RotatingKVCache):
            raise ValueError(
                f"RingCache can join RingCache batches or mlx-lm RotatingKVCache, not {type(cache).__name__}"
            )
        if cache.max_size != self.max_size:
            raise ValueError(
                f"cannot join rings of different windows ({self.max_size} and {cache.max_size}): "
                "one RingCache per window size"
            )
        if cache.keep:
            raise ValueError(
                f"RotatingKVCache(keep={cache.keep}) keeps sink tokens, which RingCache does not support; "
                "build the serial cache with keep=0 (what the models' make_cache uses)"
            )
        n = min(cache.offset, cache.max_size) if cache.keys is not None else 0
        keys = values = None
        if cache.keys is not None:
            if first(cache.keys).shape[0] != 1:
                raise ValueError(f"a serial RotatingKVCache must hold one row, this one holds {first(cache.keys).shape[0]}")
            newest = (lambda a: a[..., -n:, :]) if n else (lambda a: a[..., :0, :])
            keys = each(newest, _serial_temporal(cache, cache.keys))
            values = each(newest, _serial_temporal(cache, cache.values))
        return RowSource(keys, values, RowBook([cache.offset], [0], n), _identity)

    @classmethod
    def _prototype(cls, sources, max_size: Optional[int] = None, storage: Optional[KVFormat] = None, **_):
        sizes = {s.max_size for s in sources if hasattr(s, "max_size")}
        if max_size is not None:
            sizes.add(max_size)
        if len(sizes) != 1:
            raise ValueError(
                f"cannot merge rings of different windows {sorted(sizes)}: one RingCache per window size"
                if sizes
                else "RingCache.merge needs ring sources (or max_size=)"
            )
        return cls(sizes.pop(), storage=cls._storage_of(sources, storage))


def _serial_temporal(cache: RotatingKVCache, v):
    """A serial mlx-lm ring's buffer in temporal order (keep=0). Reads mlx-lm
    0.32's ``_idx`` (its write head): the one private field this needs."""
    idx = cache._idx
    if idx == first(v).shape[2]:
        return tuple(v) if isinstance(v, list) else v
    if idx < cache.offset:
        return each(lambda a: mx.concatenate([a[..., idx:, :], a[..., :idx, :]], axis=2), tuple(v) if isinstance(v, list) else v)
    return each(lambda a: a[..., :idx, :], v)


class QuantizedRingRow(RotatingKVCache):
    """One row of a quantized :class:`RingCache` as a serial cache (what
    ``extract`` returns): its newest ``max_size`` tokens in temporal order,
    keys and values as ``(packed, scales, biases)``. mlx-lm has no quantized
    rotating cache, so this one carries a row between batches (a prefix
    cache, ``join``, ``trim``) but does not decode on its own."""

    def __init__(self, max_size: int, group_size: int, bits: int):
        super().__init__(max_size)
        self.group_size, self.bits = group_size, bits

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.max_size, self._idx, self.group_size, self.bits

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.max_size, self._idx, self.group_size, self.bits = v
        self.keep = 0

    def update_and_fetch(self, keys, values):
        raise NotImplementedError(
            "a quantized ring row decodes only inside a batch: join it into one "
            "(RingCache.merge([row]) or an Engine with the same kv_bits)"
        )

    @property
    def nbytes(self) -> int:
        return buffer_bytes(self.keys) + buffer_bytes(self.values)
