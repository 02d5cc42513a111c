"""What the full and the ring cache share: buffers of a fixed shape, bucket
rows, the mlx-lm cache protocol, and moving rows between batches.

A cache owns ``keys [Bk, H, S, Dk]`` and ``values [Bk, H, S, Dv]`` whose shape
does not change while it decodes: ``Bk`` is the batch-width bucket (rows
``n..Bk-1`` are inert padding rows), ``S`` the capacity (full) or the window
(ring); in a float dtype or quantized (the cache's :class:`~.storage.KVFormat`:
then each is mlx-lm's ``(packed, scales, biases)`` tuple, and the cache has
``bits`` and ``group_size``, so mlx-lm's attention reads it quantized).
Row positions live in a :class:`~mlx_tracer.caches.rows.RowBook`.
The two kinds differ only in how column-times map to physical columns; they
implement the hooks at the bottom of :class:`StaticKVCache`.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .assemble import RowSource, assemble, gather_columns
from .plan import StepPlan
from .rows import RowBook
from .spare import Spare, make_ready, put
from .storage import Buffer, KVFormat, column_bytes, each, first, serial_format, shapes
from .storage import nbytes as buffer_bytes


def _alike(a: np.ndarray, b: np.ndarray) -> bool:
    """The same array, or equal ones (a book's small per-row arrays)."""
    return a is b or (a.shape == b.shape and bool((a == b).all()))


class StaticKVCache:
    """Shared machinery of :class:`FullCache` and :class:`RingCache` (see module doc)."""

    kind = "static"

    def __init__(self, rows: RowBook, width: Optional[int] = None, storage: KVFormat = KVFormat()):
        self.rows = rows
        self.storage = storage
        if storage.quantized:  # mlx-lm's scaled_dot_product_attention asks for these
            self.bits, self.group_size = storage.bits, storage.group_size
        self.keys: Optional[Buffer] = None
        self.values: Optional[Buffer] = None
        self._width = max(width or 0, rows.n)
        self._spare: Optional[Spare] = None  # zeroed buffers of the shape this cache moves to next (.spare)
        self.spare_hits = 0  # moves that found their buffers ready

    # ------------------------------------------------------------------ spare buffers
    def make_ready(self, width: Optional[int]) -> bool:
        """Buffers of ``width`` rows made ready for a join that widens the batch
        (:mod:`.spare`); True if they were started now. None: drop them. Buffers
        made ready for a capacity the cache is about to cross stay (that move
        is certain and near)."""
        spare = self._spare
        if spare is not None and spare.shape[0] == self.width and spare.shape[1] > self.S:
            return False
        if width is None or self.keys is None or width <= self.width:
            self._spare = None
            return False
        self._spare, started = make_ready(spare, self.keys, self.values, width, self.S)
        return started

    def take_spare(self, width: int, S: int) -> Optional[Spare]:
        """The ready buffers if they are those of shape ``(width, S)`` for the
        buffers as they are now (else None); the cache holds them no longer."""
        spare, self._spare = self._spare, None
        if spare is None or not spare.fits(self.keys, self.values, width, S):
            return None
        self.spare_hits += 1
        return spare

    # ------------------------------------------------------------------ shape
    @property
    def width(self) -> int:
        """Batch-width bucket: rows in the buffers (live + padding)."""
        return first(self.keys).shape[0] if self.keys is not None else self._width

    @property
    def n(self) -> int:
        """Live rows."""
        return self.rows.n

    @property
    def S(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def allocate(self, heads: int, k_dim: int, v_dim: Optional[int] = None, dtype=mx.float32):
        """Create the zeroed buffers now (a compiled step needs them before its
        first trace); ``dtype``: the model's (the storage format may differ)."""
        v_dim = k_dim if v_dim is None else v_dim
        self.storage.check_dims(k_dim, v_dim)
        self.keys = self.storage.allocate(self.width, heads, self.S, k_dim, dtype)
        self.values = self.storage.allocate(self.width, heads, self.S, v_dim, dtype)
        return self

    def _check_update(self, keys: mx.array, values: mx.array):
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError(
                f"keys/values must be [batch, kv_heads, L, head_dim], got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        B, H, L, _ = keys.shape
        if values.shape[:3] != keys.shape[:3]:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} disagree on batch/heads/length")
        if B != self.width:
            raise ValueError(
                f"update has {B} rows but the cache holds {self.width} (live {self.n} in bucket {self.width}); "
                "pass one row per bucket row"
            )
        if self.keys is not None:
            want = (first(self.keys).shape[1], self.storage.dim(self.keys), self.storage.dim(self.values))
            got = (H, keys.shape[3], values.shape[3])
            if want != got:
                raise ValueError(
                    f"update has (kv_heads, k_dim, v_dim) = {got}, the cache was built for {want}: "
                    "one cache per attention layer"
                )
            stored = first(self.keys).dtype if self.storage == KVFormat() else keys.dtype  # a format casts on write
            if keys.dtype != stored or values.dtype != stored:
                raise ValueError(
                    f"update dtype {keys.dtype}/{values.dtype} differs from the cache's {self.keys.dtype}: "
                    "cast the model or allocate the cache with the model's dtype"
                )
        elif keys.dtype != values.dtype:
            raise ValueError(f"keys dtype {keys.dtype} differs from values dtype {values.dtype}")
        return L

    # ----------------------------------------------------------- mlx-lm protocol
    @property
    def offset(self) -> mx.array:
        """Per-row RoPE offsets ``[Bk]`` int32 (padding rows: 0)."""
        offsets = self.rows.offsets
        if len(offsets) == self.width:  # a full bucket: no padding rows
            return mx.array(offsets, dtype=mx.int32)
        out = np.zeros(self.width, dtype=np.int32)
        out[: len(offsets)] = offsets
        return mx.array(out)

    @property
    def left_padding(self) -> mx.array:
        out = np.zeros(self.width, dtype=np.int32)
        out[: self.n] = self.rows.left_padding
        return mx.array(out)

    @property
    def state(self):
        return self.keys, self.values

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return buffer_bytes(self.keys) + buffer_bytes(self.values)

    def bytes_for(self, tokens: int) -> int:
        """Bytes one row holds for ``tokens`` more positions (capped at the window for rings)."""
        if self.keys is None:
            return 0
        per_col = column_bytes(self.keys) + column_bytes(self.values)
        return per_col * self._cap_tokens(int(tokens))

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False, **kwargs):
        """The mask of the update of ``N`` tokens that comes next (mlx-lm calls this first)."""
        return self.plan(N).geometry.narrowed(window_size).mask()

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write ``keys``/``values`` ``[Bk, H, L, D]`` and return what the layer attends over."""
        L = self._check_update(keys, values)
        if self.keys is None:
            self.allocate(keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        plan = self.plan(L)
        kbuf, vbuf = self.fit(plan)
        keys, values = self.storage.encode(keys), self.storage.encode(values)  # [Bk, H, L, D] as stored
        k_att, v_att, kbuf, vbuf = self.apply(plan.decode, kbuf, vbuf, keys, values, plan.writes)
        self.commit(plan, kbuf, vbuf)
        return k_att, v_att

    def is_decode(self, L: int) -> bool:
        """Whether an update of ``L`` tokens is a decode write (else a window)."""
        return L == 1 and self.rows.pending is None

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        self.rows.prepare(left_padding, lengths, right_padding, empty=self.rows.time == 0)

    # -------------------------------------------------------------- one step
    def fit(self, plan: StepPlan) -> Tuple[mx.array, mx.array]:
        """The buffers a step of ``plan`` writes (full caches grow to its capacity)."""
        return self.keys, self.values

    def commit(self, plan: StepPlan, keys: mx.array, values: mx.array):
        """Take the buffers a step of ``plan`` returned and advance the rows."""
        self.adopt(keys, values)
        self.advance(plan)

    @staticmethod
    def commit_all(caches: Sequence["StaticKVCache"], plans: Sequence[StepPlan], new_kv: Sequence[tuple]):
        """:meth:`commit` for the caches of one compiled step, ``plans[i]``
        being cache i's family plan, without :meth:`adopt`'s shape checks (the
        trace returns the shapes ``fit`` handed in). A decode step's row books advance alike
        in every cache of a family (they move in lockstep), so the first cache
        of each family advances its own and the others take its new offsets
        array (books never change their arrays in place)."""
        shared = {}
        for c, plan, (k, v) in zip(caches, plans, new_kv):
            c.keys, c.values = k, v
            rows = c.rows
            done = shared.get(id(plan))
            if done is not None and plan.decode and rows.pending is None and rows.time == done[0] - 1:
                rows.offsets, rows.time = done[1], done[0]
                c._advanced(plan)
                continue
            c.advance(plan)
            if plan.decode:
                shared[id(plan)] = (rows.time, rows.offsets)

    def _advanced(self, plan: StepPlan):
        """The cache kind's own bookkeeping of a decode step whose row book was advanced for it."""

    @staticmethod
    def advance_verify_all(caches: Sequence["StaticKVCache"], plans: Sequence[StepPlan], valid: np.ndarray):
        """:meth:`advance_verify` for the caches of one verify step, ``plans[i]``
        being cache i's family plan and ``valid`` the rows' kept tokens (live
        rows first), a family's books advanced once. The caches of a family
        whose books stand alike (the same time and the same
        offsets and left padding: after a step they share the arrays, which
        books never change in place) move alike, so the first of them runs
        :meth:`advance_verify` and the others take its new books
        (:meth:`_verify_twin`, :meth:`_took_verify`); any other cache runs its
        own. On SmolLM2's 30 layers this was ~0.3 ms of host time a verify
        step, spent while the cores wait for the step to be built or read."""
        valid = np.asarray(valid)
        done = {}  # id(plan) -> (cache, time, offsets, left padding) before, of the family's first cache
        for c, plan in zip(caches, plans):
            rows = c.rows
            first_c = done.get(id(plan))
            if (first_c is not None and rows.pending is None and rows.time == first_c[1]
                    and _alike(rows.offsets, first_c[2]) and _alike(rows.left_padding, first_c[3])
                    and c._verify_twin(first_c[0])):
                src = first_c[0].rows
                rows.offsets, rows.left_padding, rows.time = src.offsets, src.left_padding, src.time
                c._took_verify(first_c[0])
                continue
            if first_c is None:
                done[id(plan)] = (c, rows.time, rows.offsets, rows.left_padding)
            c.advance_verify(plan, valid[: c.n])

    def _verify_twin(self, other: "StaticKVCache") -> bool:
        """Whether a verify step moves this cache's book as it moves ``other``'s,
        their books standing alike (:meth:`advance_verify_all`; a step's caches
        share the batch's width): the same kind."""
        return type(self) is type(other)

    def _took_verify(self, other: "StaticKVCache"):
        """The cache kind's own state after a verify step, as ``other``'s (its
        twin, :meth:`_verify_twin`), whose book this cache took."""

    def commit_verify(self, plan: StepPlan, keys: mx.array, values: mx.array, valid):
        """Take the buffers a verify step returned; row r kept ``valid[r]`` of its
        window's tokens (its last input and the drafts it accepted)."""
        self.adopt(keys, values)
        self.advance_verify(plan, np.asarray(valid)[: self.n])

    # ------------------------------------------------------------- adopt / views
    def adopt(self, keys: mx.array, values: mx.array):
        """Take ownership of buffers a compiled step returned (same shapes, no column moves)."""
        have = None if self.keys is None else (shapes(self.keys), shapes(self.values))
        if have is None or (shapes(keys), shapes(values)) != have:
            raise ValueError(f"adopt needs buffers shaped {have}, got {shapes(keys)} / {shapes(values)}")
        if first(keys).dtype != first(self.keys).dtype:
            raise ValueError(f"adopt needs dtype {first(self.keys).dtype}, got {first(keys).dtype}")
        self.keys, self.values = keys, values

    def temporal_view(self, i: int) -> Tuple[mx.array, mx.array]:
        """Row ``i``'s valid keys and values ``[1, H, n, D]`` in temporal order."""
        i = self.rows.check_row(i)
        start = max(int(self.rows.left_padding[i]), self._retained_start())
        stop = self.rows.time - int(self.rows.right_padding[i])
        if self.keys is None or stop <= start:
            return None, None
        cols = mx.array(self._col_mapper()(np.arange(start, stop)).astype(np.int32))
        return tuple(each(lambda a: mx.take(a[i : i + 1], cols, axis=2), buf) for buf in (self.keys, self.values))

    def extract(self, i: int):
        """Row ``i`` as a fresh, owned serial mlx-lm cache."""
        i = self.rows.check_row(i)
        if self.rows.pending is not None:
            raise ValueError("cannot extract a row while a prepared prompt is pending: call finalize() first")
        k, v = self.temporal_view(i)
        if k is not None:
            k, v = each(mx.contiguous, k), each(mx.contiguous, v)
        return self._serial(k, v, int(self.rows.offsets[i]))

    # ------------------------------------------------------------ moving rows
    def filter(self, keep: Sequence[int], width: Optional[int] = None):
        """Keep only rows ``keep`` (in that order), in place."""
        keep = [self.rows.check_row(int(k)) for k in keep]
        src = self._as_source()
        idx = mx.array(keep, dtype=mx.int32)

        def rows(a):
            return a[idx] if keep else a[:0]

        src = RowSource(
            None if src.keys is None else each(rows, src.keys),
            None if src.values is None else each(rows, src.values),
            src.rows.select(keep),
            src.col_of_time,
            self,
        )
        self._assemble([src], width)

    def move_rows(self, order: Sequence[int]) -> bool:
        """Keep only rows ``order`` (distinct live rows; new row ``j`` is old row
        ``order[j]``) in this bucket *without laying the timeline out again*:
        a row with ``order[j] == j`` stays where it is, only the rows that move
        are copied (gathered and evaluated first, then written into their new
        rows in place). What :meth:`filter` does, minus its copy of every row;
        the columns all live rows hold as padding are kept (``filter`` drops
        them). Returns False and changes nothing where this cache would rather
        be laid out again (:meth:`_relayout_preferred`: a full cache that would
        fit half its capacity)."""
        order = [self.rows.check_row(int(i)) for i in order]
        if len(set(order)) != len(order) or self.rows.pending is not None or self._relayout_preferred(order):
            return False
        moves = [(j, i) for j, i in enumerate(order) if i != j]
        if moves and self.keys is not None:
            src = mx.array([i for _, i in moves], dtype=mx.int32)
            moved_k = each(lambda a: mx.take(a, src, axis=0), self.keys)  # [moves, H, S, D]
            moved_v = each(lambda a: mx.take(a, src, axis=0), self.values)
            mx.eval(moved_k, moved_v)  # evaluated: they no longer hold the buffers, which are then written in place

            def put(buf, moved):
                for m, (j, _) in enumerate(moves):
                    buf = mx.slice_update(buf, moved[m : m + 1], mx.array([j], dtype=mx.int32), axes=(0,))
                return buf

            self.keys, self.values = each(put, self.keys, moved_k), each(put, self.values, moved_v)
        self.rows = self.rows.select(order)
        return True

    def narrow(self, width: int) -> bool:
        """Move to the narrower bucket ``width`` without copying: the live rows
        are rows ``0 .. n-1`` (after :meth:`move_rows`), so the buffers become
        views of their first ``width`` rows, the rows past them dropped. The
        memory stays that of the wider buffers until the batch is laid out
        again (a join that widens, :meth:`filter`); a decode step writes the
        views in place as it writes whole buffers. Returns False and changes
        nothing where the live rows do not fit ``width`` or a prompt is pending."""
        width = int(width)
        if self.rows.pending is not None or not self.rows.n <= width <= self.width:
            return False
        if self.keys is not None and width < self.width:
            self.keys = each(lambda a: a[:width], self.keys)
            self.values = each(lambda a: a[:width], self.values)
        self._width = width
        return True

    def _relayout_preferred(self, order: Sequence[int]) -> bool:
        """Whether rows ``order`` should rather be laid out again (see :meth:`move_rows`)."""
        return False

    def extend(self, other, width: Optional[int] = None):
        """Append the rows of ``other`` (a batch of the same kind or a serial cache), in place."""
        self._assemble([self._as_source(), self._source_of(other)], width)

    def place(self, sources: Sequence, width: Optional[int] = None) -> bool:
        """Append the rows of ``sources`` (batches of this kind or serial caches,
        as :meth:`join` takes them) after the live rows, in place, *without
        moving the live rows*: each newcomer's columns are gathered onto this
        batch's timeline as it is (``time``, and a ring's ``head``) and written
        into the free rows ``n..`` of the buffers. ``width``: the bucket
        afterwards (default the current one); in the current bucket only the
        newcomers' rows are written (the buffers are updated in place), a
        wider one copies the live rows once into the wider buffers (no gather
        of their columns).

        Only when every newcomer's tokens fit the timeline (a full cache: a row
        of at most ``time`` tokens; a ring: at most the columns it retains)
        and the rows fit ``width``: else returns False and changes nothing
        (:meth:`join` then lays every row out again). Sources are read, never
        modified. See :meth:`placement` to decide for several caches first."""
        placed = self.placement(sources, width)
        if placed is None:
            return False
        self.adopt_placement(placed)
        return True

    def placement(self, sources: Sequence, width: Optional[int] = None) -> Optional[tuple]:
        """What :meth:`place` would make (None: it would return False), to be
        taken by :meth:`adopt_placement`; nothing changes before that (the
        new buffers are lazy: until adopted, this cache's own are untouched)."""
        if self.keys is None or self.rows.pending is not None:
            return None
        width = self.width if width is None else int(width)
        if width < self.width:
            return None
        time, lo = self.rows.time, max(0, self._retained_start())
        srcs, books = [], []
        for s in sources:
            if isinstance(s, StaticKVCache) and s.rows.pending is not None:
                return None  # join raises the error
            src = self._source_of(s)
            book = src.rows.shifted(time - src.rows.time)
            holds = book.left_padding < book.time - book.right_padding  # rows with a token
            if (book.left_padding[holds] < lo).any():
                return None  # a newcomer longer than the timeline: the live rows would have to move
            srcs.append(src)
            books.append(book)
        n, k = self.n, sum(b.n for b in books)
        if n + k > width:
            return None
        if k == 0:
            return self.keys, self.values, self.rows, width
        col_times = self._target_col_times(time)  # [S] column -> column-time, as the buffers are now
        parts_k, parts_v = [], []
        for s in srcs:
            if s.rows.n:
                k_s, v_s = gather_columns(s, time, col_times, self.keys, self.values, self.S)  # [k_s, H, S, D]
                parts_k.append(k_s)
                parts_v.append(v_s)
        new_k = each(lambda *a: mx.concatenate(a, axis=0) if len(a) > 1 else a[0], *parts_k)
        new_v = each(lambda *a: mx.concatenate(a, axis=0) if len(a) > 1 else a[0], *parts_v)
        if width == self.width:
            # rows n..n+k-1; once adopted, the old buffers' only references are
            # this graph's, so slice_update writes them where they are
            at = mx.array([n], dtype=mx.int32)
            put_all = lambda b, x: mx.slice_update(b, x, at, axes=(0,))  # noqa: E731
        else:  # one copy of the live rows, row-major (see assemble)
            spare = self.take_spare(width, self.S)
            if spare is not None:  # into buffers made ready beforehand (caches.spare)
                def into(s, b, x):
                    return put(put(s, b[:n]), x, n)

                keys, values = each(into, spare.keys, self.keys, new_k), each(into, spare.values, self.values, new_v)
                return keys, values, RowBook.concat([self.rows] + books), width

            def put_all(b, x):
                parts = [b[:n], x] + ([mx.zeros((width - n - k, *b.shape[1:]), b.dtype)] if width > n + k else [])
                return mx.concatenate(parts, axis=0)
        return each(put_all, self.keys, new_k), each(put_all, self.values, new_v), RowBook.concat([self.rows] + books), width

    def adopt_placement(self, placed: tuple):
        """Take what :meth:`placement` made."""
        self.keys, self.values, self.rows, self._width = placed

    @classmethod
    def join(cls, sources: Sequence, width: Optional[int] = None, **kwargs):
        """A new batch of the rows of ``sources`` (batches or serial caches), in
        order. Sources are read, never modified."""
        if not sources:
            raise ValueError("join needs at least one source cache")
        proto = cls._prototype(sources, **kwargs)
        proto._assemble([proto._source_of(s) for s in sources], width)
        return proto

    @classmethod
    def merge(cls, caches: Sequence, width: Optional[int] = None, **kwargs):
        """mlx-lm's ``merge``: a batch from serial caches, left-padded to the longest."""
        return cls.join(caches, width=width, **kwargs)

    def _source_of(self, other) -> RowSource:
        """``other``'s rows as a source, in this cache's storage format."""
        if isinstance(other, StaticKVCache):
            if type(other) is not type(self):
                raise ValueError(f"cannot join a {type(other).__name__} into a {type(self).__name__}")
            self._check_compatible(other)
            if other.rows.pending is not None:
                raise ValueError("cannot join a batch with a prepared prompt pending: call finalize() first")
            src, fmt = other._as_source(), other.storage
        else:
            src, fmt = self._serial_source(other), serial_format(other)
        if fmt != self.storage:
            src.keys, src.values = self.storage.convert(src.keys, fmt), self.storage.convert(src.values, fmt)
        return src

    @staticmethod
    def _storage_of(sources: Sequence, storage: Optional[KVFormat]) -> KVFormat:
        """A join's storage format: ``storage``, else its first batch's, else its first serial cache's."""
        if storage is not None:
            return storage
        batch = next((s for s in sources if isinstance(s, StaticKVCache)), None)
        return batch.storage if batch is not None else serial_format(sources[0])

    def _as_source(self) -> RowSource:
        rows = self.rows.copy()
        rows.left_padding = np.maximum(rows.left_padding, self._retained_start())
        keys = None if self.keys is None else each(lambda a: a[: self.n], self.keys)
        values = None if self.values is None else each(lambda a: a[: self.n], self.values)
        return RowSource(keys, values, rows, self._col_mapper(), self)

    def _assemble(self, sources: List[RowSource], width: Optional[int], **target):
        assemble(self, sources, width, **target)

    # ------------------------------------------------------------------- hooks
    def _cap_tokens(self, tokens: int) -> int:
        return tokens

    def _retained_start(self) -> int:
        return 0

    def _col_mapper(self) -> Callable[[np.ndarray], np.ndarray]:  # pragma: no cover - abstract
        """Column-time -> physical column, for the buffers as they are now."""
        raise NotImplementedError

    def _target_col_times(self, time: int) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _target_time(self, sources: List[RowSource], **target) -> int:  # pragma: no cover
        raise NotImplementedError

    def _check_compatible(self, other):
        pass

    def plan(self, L: int) -> StepPlan:  # pragma: no cover - abstract
        """The family plan of the next update of ``L`` tokens (see :mod:`.plan`)."""
        raise NotImplementedError

    @staticmethod
    def apply(decode: bool, kbuf, vbuf, keys, values, writes):  # pragma: no cover - abstract
        """The kind's pure in-graph step: ``(keys_to_attend, values_to_attend,
        new_kbuf, new_vbuf)`` from the buffers, the new ``keys``/``values`` and a
        plan's ``writes``. Pure in its array arguments, so it runs eagerly or
        inside a compiled step; needs no cache instance."""
        raise NotImplementedError

    @staticmethod
    def decode_column(writes) -> mx.array:
        """The int32 ``[1]`` column a decode step's ``apply`` writes in every
        row (both kinds: ``write_columns`` at ``writes[0]``)."""
        return writes[0]

    def advance(self, plan: StepPlan):  # pragma: no cover - abstract
        """Host bookkeeping after a step of ``plan`` was applied."""
        raise NotImplementedError

    def _serial(self, keys, values, offset):  # pragma: no cover - abstract
        raise NotImplementedError

    def _serial_source(self, cache) -> RowSource:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def _prototype(cls, sources, **kwargs) -> "StaticKVCache":  # pragma: no cover
        raise NotImplementedError

    def _row_inputs(self) -> Tuple[mx.array, mx.array]:
        """``(first_valid [Bk] int32, live [Bk] bool)``, rebuilt only when the
        rows' padding or count changed (a step's host inputs are reused)."""
        key = (self.width, self.n, self.rows.left_padding.tobytes())
        cached = getattr(self, "_row_inputs_cache", None)
        if cached is None or cached[0] != key:
            fv = np.zeros(self.width, dtype=np.int32)
            fv[: self.n] = self.rows.left_padding
            live = np.zeros(self.width, dtype=bool)
            live[: self.n] = True
            cached = self._row_inputs_cache = (key, (mx.array(fv), mx.array(live)))
        return cached[1]
