"""Moving rows between batches: the one rebuild behind join, extend and filter.

Every source row is laid out on a new shared timeline, right-aligned: the
target picks the new time and column layout (its kind's hooks), and each
source's columns are gathered into place in one ``mx.take`` per source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional

import mlx.core as mx
import numpy as np

from .rows import RowBook
from .storage import Buffer, each, first, zeros_rows

if TYPE_CHECKING:
    from .batch import StaticKVCache


@dataclass
class RowSource:
    """Rows of one join source, seen on that source's own timeline."""

    keys: Optional[Buffer]  # [n, H, S_src, Dk] or None when empty, in the target's format
    values: Optional[Buffer]  # [n, H, S_src, Dv]
    rows: RowBook  # left_padding already clamped to what the buffer retains
    col_of_time: Callable[[np.ndarray], np.ndarray]  # source time -> source column
    batch: Optional["StaticKVCache"] = None  # the running batch it came from


def gather_columns(s: RowSource, time: int, col_times: np.ndarray, like_k: Buffer, like_v: Buffer, S: int):
    """Source ``s``'s rows as ``[n, H, S, D]`` keys and values on a target
    timeline at ``time`` whose columns hold ``col_times`` (one ``mx.take`` per
    array; zeros, shaped as ``like_k`` / ``like_v``, for a source without buffers)."""
    if s.keys is None:
        return zeros_rows(like_k, s.rows.n, S), zeros_rows(like_v, s.rows.n, S)
    src_cols = np.asarray(s.col_of_time(col_times - (time - s.rows.time)))
    n = first(s.keys).shape[2]
    shift = shifted_run(src_cols, n)
    if shift is not None:  # the source's columns moved as one block: a slice and a pad, no gather
        lo, hi, d = shift
        pad = [(0, 0), (0, 0), (lo, len(src_cols) - hi), (0, 0)]
        move = lambda a: mx.pad(a[:, :, lo + d: hi + d], pad)  # noqa: E731
        return each(move, s.keys), each(move, s.values)
    idx = mx.array(np.clip(src_cols, 0, n - 1).astype(np.int32))
    return each(lambda a: mx.take(a, idx, axis=2), s.keys), each(lambda a: mx.take(a, idx, axis=2), s.values)


def shifted_run(src_cols: np.ndarray, n: int):
    """``(lo, hi, d)`` where target column ``j`` reads source column ``j + d``
    for every ``j`` (one shift), ``lo .. hi`` being the target columns whose
    source column exists (``0 <= j + d < n``, at least one); None for any
    other mapping. The columns outside ``lo .. hi`` hold no position of the
    row (before its first or after its last: masked), so zeros serve there as
    well as the clipped gather's copies of the edge columns did. (``mx.pad``
    writes a new buffer even where it pads nothing: the target never shares
    the source's memory.)"""
    if len(src_cols) == 0:
        return None
    d = int(src_cols[0])
    if not np.array_equal(src_cols, np.arange(d, d + len(src_cols))):
        return None
    lo, hi = max(0, -d), min(len(src_cols), n - d)
    return (lo, hi, d) if lo < hi else None


def assemble(target: "StaticKVCache", sources: List[RowSource], width: Optional[int], **layout):
    """Rebuild ``target``'s buffers from ``sources`` (rows of batches or serial
    caches), right-aligned on one new timeline, in order."""
    if any(s.rows.pending is not None for s in sources):
        raise ValueError("cannot move rows while a prepared prompt is pending: call finalize() first")
    n = sum(s.rows.n for s in sources)
    width = n if width is None else int(width)
    if width < n:
        raise ValueError(f"bucket {width} exceeded: {n} live rows; pass a larger width")
    time = target._target_time(sources, **layout)
    col_times = target._target_col_times(time)  # [S] new column -> new time
    parts_k, parts_v, books = [], [], []
    proto = next((s for s in sources if s.keys is not None), None)
    for s in sources:
        books.append(s.rows.shifted(time - s.rows.time))
        if proto is not None and s.rows.n:
            k, v = gather_columns(s, time, col_times, proto.keys, proto.values, target.S)
            parts_k.append(k)
            parts_v.append(v)
    target.rows = RowBook.concat(books) if books else target.rows.select([])
    target.rows.time = time
    if proto is None:
        target.keys = target.values = None
        target._width = width
        return
    if width > n:
        parts_k.append(zeros_rows(proto.keys, width - n, target.S))
        parts_v.append(zeros_rows(proto.values, width - n, target.S))
    # Row-major buffers: mx.take lays its output out gathered-axis-first, and
    # a buffer in that layout is copied by every later attention (measured:
    # +40% per decode step at 1024 columns); in-place writes keep the layout.
    target.keys = each(lambda *a: mx.contiguous(mx.concatenate(a, axis=0) if len(a) > 1 else a[0]), *parts_k)
    target.values = each(lambda *a: mx.contiguous(mx.concatenate(a, axis=0) if len(a) > 1 else a[0]), *parts_v)
    target._width = width
