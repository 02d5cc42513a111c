"""Per-forward attention masks, built once and shared by every layer of a family.

A forward attends over ``S`` key columns. Each column holds one column-time
(``col_times[c]``; negative for a column never written), each query sits at a
column-time (``query_times[i]``) and each row's valid tokens start at
``first_valid[r]``. That is all a mask needs:

    visible(r, i, c) = first_valid[r] <= col_times[c] <= query_times[i]
                       and col_times[c] > query_times[i] - window

Causality hides later columns, including prompt padding still pending at the
end of a row; ``first_valid`` hides left padding; the window term hides what a
sliding layer no longer sees. A padding row of a bucket (``live[r]`` false)
sees exactly one column: the one its query writes (``own_cols[i]``), so its
softmax is never over an empty set and produces no NaN.

The builders here are plain ``mx`` ops on small int arrays, so a mask can be
built eagerly (``make_mask``) or inside a compiled step from its int32 inputs.
The column layouts of the two cache kinds:

* full cache, any step: column ``c`` holds time ``c``;
* ring, decode: the ring's physical order; column ``c`` holds
  ``time - ((head - c) mod W)`` once ``time`` is written at ``head``;
* ring, window of ``L``: the ring in temporal order (``W`` columns, times
  ``time - W .. time - 1``) followed by the ``L`` new keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import mlx.core as mx
import numpy as np

IntLike = Union[int, mx.array]


@functools.lru_cache(maxsize=64)
def full_columns(capacity: int) -> mx.array:
    """Column times of a full cache buffer: ``[C]`` (one evaluated array per capacity, reused)."""
    out = mx.arange(capacity, dtype=mx.int32)
    mx.eval(out)
    return out


def ring_decode_columns(time: int, head: int, window: int) -> mx.array:
    """Column times of a ring buffer once ``time`` is written at ``head``: ``[W]``
    (built on the host: no graph nodes per step)."""
    c = np.arange(window, dtype=np.int64)
    return mx.array((int(time) - np.mod(int(head) - c, window)).astype(np.int32))


def ring_window_columns(time: IntLike, window: int, L: int) -> mx.array:
    """Column times of a ring in temporal order followed by ``L`` new keys: ``[W + L]``."""
    return mx.concatenate(
        [time - window + mx.arange(window, dtype=mx.int32), time + mx.arange(L, dtype=mx.int32)]
    )


def build_mask(
    col_times: mx.array,  # [S] int32
    query_times: mx.array,  # [L] int32
    first_valid: mx.array,  # [B] int32
    live: mx.array,  # [B] bool
    own_cols: mx.array,  # [L] int32
    window: Optional[int] = None,
) -> mx.array:
    """The boolean attention mask ``[B, 1, L, S]`` of one forward (True = visible)."""
    ct = col_times[None, None, None, :]  # [1, 1, 1, S]
    qt = query_times[None, None, :, None]  # [1, 1, L, 1]
    lo = mx.maximum(first_valid, 0)[:, None, None, None]  # [B, 1, 1, 1]
    visible = (ct >= lo) & (ct <= qt)
    if window is not None:
        visible = visible & (ct > qt - window)
    S = col_times.shape[0]
    own = mx.arange(S, dtype=mx.int32)[None, None, None, :] == own_cols[None, None, :, None]
    return mx.where(live[:, None, None, None], visible, own)  # [B, 1, L, S]


@dataclass
class MaskGeometry:
    """The int inputs of one family's mask for one forward (see module docstring).

    ``col_times``, ``query_times`` and ``own_cols`` depend on the cache kind and
    step length; ``first_valid`` and ``live`` are per bucket row.
    """

    col_times: mx.array
    query_times: mx.array
    own_cols: mx.array
    first_valid: mx.array
    live: mx.array
    window: Optional[int] = None

    def mask(self) -> mx.array:
        return build_mask(
            self.col_times, self.query_times, self.first_valid, self.live, self.own_cols, self.window
        )

    @property
    def arrays(self) -> tuple:
        """The array fields, in order (what a compiled step takes as input)."""
        return (self.col_times, self.query_times, self.own_cols, self.first_valid, self.live)

    @classmethod
    def from_arrays(cls, arrays, window: Optional[int]) -> "MaskGeometry":
        return cls(*arrays, window=window)

    def narrowed(self, window_size: Optional[int]) -> "MaskGeometry":
        """The same geometry seen by a layer with its own (smaller) window."""
        if window_size is None:
            return self
        window = window_size if self.window is None else min(self.window, window_size)
        return MaskGeometry(*self.arrays, window=window)

