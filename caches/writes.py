"""The buffer writes of one step, as pure ``mx`` functions of array inputs.

The eager caches call these with int32 arrays made from their host state; the
trace adapters call the same functions with the compiled step's inputs, so a
traced step and an eager one do exactly the same thing to the buffers.
"""

from __future__ import annotations

import mlx.core as mx


def write_columns(buf: mx.array, new: mx.array, start: mx.array) -> mx.array:
    """``buf [B, H, S, D]`` with ``new [B, H, L, D]`` written at columns
    ``start .. start+L-1`` (``start``: int32 ``[1]``). In place when ``buf``
    has no other reference at evaluation."""
    return mx.slice_update(buf, new, start, axes=(2,))


def ring_temporal(buf: mx.array, head: mx.array, window: int) -> mx.array:
    """A ring ``[B, H, W, D]`` in temporal order (oldest first): the column
    after the head is the oldest."""
    order = mx.remainder(head + mx.arange(window, dtype=mx.int32), window)  # [W]
    return mx.take(buf, order, axis=2)


def ring_attend(buf: mx.array, new: mx.array, head: mx.array) -> mx.array:
    """What a window of ``L`` queries on a ring attends over: the ring in
    temporal order followed by the new keys, ``[B, H, W+L, D]``."""
    return mx.concatenate([ring_temporal(buf, head, buf.shape[2]), new], axis=2)


def ring_commit(attend: mx.array, shift: mx.array, first: mx.array, window: int) -> mx.array:
    """The new ring ``[B, H, W, D]`` (temporal order) from a window's ``attend``:
    column ``j`` is ``attend`` column ``first + j - shift[r]``, so each row's
    newest valid token lands on the same column (``shift [B]``: columns at the
    end of row r's new keys that are not its tokens: prompt padding, or drafts
    a verify step rejected; ``first``: the ``attend`` column that becomes ring
    column 0 for a row without such columns)."""
    src = mx.arange(window, dtype=mx.int32)[None, :] + (first - shift[:, None])  # [B, W]
    src = mx.clip(src, 0, attend.shape[2] - 1)
    ring = mx.take_along_axis(attend, src[:, None, :, None], axis=2)  # [B, H, W, D]
    # row-major, as the buffers are everywhere else: gathers lay their output out
    # gathered-axis-first, which would make every later decode copy the ring
    return mx.contiguous(ring)


def ring_window(buf: mx.array, new: mx.array, head: mx.array, shift: mx.array, first: mx.array):
    """A window step of ``L`` tokens on a ring of ``W`` columns: ``(attend,
    ring)`` of :func:`ring_attend` and :func:`ring_commit`."""
    attend = ring_attend(buf, new, head)
    return attend, ring_commit(attend, shift, first, buf.shape[2])


def realign_rows(buf: mx.array, delta: mx.array) -> mx.array:
    """``buf [B, H, C, D]`` with row r's columns moved right by ``delta[r]``
    (left when negative; what falls off one end comes back at the other, where
    it is never visible). One gather: the right-alignment after a verify step."""
    C = buf.shape[2]
    cols = mx.remainder(mx.arange(C, dtype=mx.int32)[None, :] - delta[:, None], C)  # [B, C]
    return mx.contiguous(mx.take_along_axis(buf, cols[:, None, :, None], axis=2))
