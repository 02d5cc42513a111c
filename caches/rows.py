"""Row bookkeeping shared by the full and the ring cache.

Both cache kinds store a batch of rows that are *right-aligned* on one shared
timeline: every write puts column-time ``time`` (and the ones after it) into
all rows at once, and each row's tokens occupy the times from its left padding
up to ``time``. This module keeps that host-side state (plain ints in numpy
arrays) and the operations on it that do not touch a device buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np


def _ints(values) -> np.ndarray:
    return np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=np.int64)


@dataclass
class RowBook:
    """Where each live row's tokens are.

    Attributes:
        offsets: ``[n]`` absolute position of each row's next token: its RoPE
            offset. For a ring this counts evicted tokens too.
        left_padding: ``[n]`` first column-time holding a valid token of the
            row; earlier times are padding (never visible).
        time: column-time of the next write, shared by every row.
        right_padding: ``[n]`` prompt padding written after a row's last valid
            token and not yet rolled out by ``finalize`` (full caches only).
        pending: ``[n]`` prompt tokens each row still has to write, set by
            ``prepare(lengths=...)``; ``None`` outside a prepared prompt.

    Invariant: ``left_padding[r] <= time - right_padding[r]`` for every row,
    and the row's valid tokens are the times
    ``[left_padding[r], time - right_padding[r])``.
    """

    offsets: np.ndarray
    left_padding: np.ndarray
    time: int = 0
    right_padding: np.ndarray = field(default=None)
    pending: Optional[np.ndarray] = None

    def __post_init__(self):
        self.offsets = _ints(self.offsets)
        self.left_padding = _ints(self.left_padding)
        if self.right_padding is None:
            self.right_padding = np.zeros_like(self.offsets)
        self.right_padding = _ints(self.right_padding)
        if self.pending is not None:
            self.pending = _ints(self.pending)

    @classmethod
    def padded(cls, left_padding: Sequence[int]) -> "RowBook":
        """An empty book whose rows start with ``left_padding`` columns of padding
        (mlx-lm's ``BatchKVCache(left_padding)``: offsets start at ``-pad``)."""
        lp = _ints(left_padding)
        return cls(offsets=-lp, left_padding=lp.copy(), time=0)

    @property
    def n(self) -> int:
        return int(self.offsets.shape[0])

    def copy(self) -> "RowBook":
        return RowBook(
            self.offsets.copy(),
            self.left_padding.copy(),
            self.time,
            self.right_padding.copy(),
            None if self.pending is None else self.pending.copy(),
        )

    def check_row(self, i: int) -> int:
        if not isinstance(i, (int, np.integer)) or not 0 <= i < self.n:
            raise IndexError(f"row {i} is not a live row: the batch has {self.n} live rows (0..{self.n - 1})")
        return int(i)

    # -- operations that move rows -------------------------------------------------
    def select(self, keep: Sequence[int]) -> "RowBook":
        keep = [self.check_row(int(k)) for k in keep]
        return RowBook(
            self.offsets[keep],
            self.left_padding[keep],
            self.time,
            self.right_padding[keep],
            None if self.pending is None else self.pending[keep],
        )

    def shifted(self, delta: int) -> "RowBook":
        """The same rows on a timeline moved by ``delta`` columns."""
        out = self.copy()
        out.time += delta
        out.left_padding += delta
        return out

    @staticmethod
    def concat(books: Sequence["RowBook"]) -> "RowBook":
        """Rows of books that already share one ``time``, in order."""
        times = {b.time for b in books}
        if len(times) != 1:
            raise ValueError(f"cannot concatenate row books at different times {sorted(times)}")
        if any(b.pending is not None for b in books):
            raise ValueError("cannot join a batch with a prepared prompt pending: call finalize() first")
        return RowBook(
            np.concatenate([b.offsets for b in books]),
            np.concatenate([b.left_padding for b in books]),
            times.pop(),
            np.concatenate([b.right_padding for b in books]),
        )

    # -- writes --------------------------------------------------------------------
    def prepare(self, left_padding=None, lengths=None, right_padding=None, empty=True):
        """mlx-lm's ``prepare``: add left padding to an empty batch, or declare
        that the next windows carry right-padded prompts of ``lengths`` tokens."""
        if left_padding is not None:
            if not empty:
                raise ValueError("left padding can only be added to an empty cache (no tokens written yet)")
            lp = self._per_row(left_padding, "left_padding")
            if (lp < 0).any():
                raise ValueError(f"left_padding must be >= 0, got {lp.tolist()}")
            self.left_padding = self.left_padding + lp
            self.offsets = self.offsets - lp
        if right_padding is not None and max(right_padding) > 0:
            if lengths is None:
                raise ValueError("prepare(right_padding=...) needs lengths= (valid prompt tokens per row)")
            self.pending = self._per_row(lengths, "lengths")
            if (self.pending < 0).any():
                raise ValueError(f"lengths must be >= 0, got {self.pending.tolist()}")

    def consume(self, L: int, valid: Optional[np.ndarray] = None):
        """Advance the timeline by a write of ``L`` columns; returns how many of
        them are valid tokens per row (the rest is pending prompt padding, or
        the drafts a verify step rejected when ``valid`` is given): the int
        ``L`` itself when every row wrote all of them."""
        if valid is not None:
            if self.pending is not None:
                raise ValueError("a verify step cannot run while a prepared prompt is pending: call finalize() first")
            valid = _ints(valid)
        elif self.pending is None:
            self.offsets = self.offsets + L  # every row wrote L tokens (the decode path: no per-row array)
            self.time += L
            return L
        else:
            valid = np.minimum(self.pending, L)
            self.pending = self.pending - valid
        self.offsets = self.offsets + valid
        self.time += L
        return valid

    def unconsume(self, n: int) -> int:
        """Drop the last ``n`` columns of every row (``trim``); returns ``n`` capped."""
        n = int(min(max(n, 0), self.time))
        self.time -= n
        self.offsets = self.offsets - n
        return n

    def _per_row(self, values, name) -> np.ndarray:
        arr = _ints(values)
        if arr.shape != (self.n,):
            raise ValueError(f"{name} must give one value per live row ({self.n}), got {len(arr)}")
        return arr
