"""The buffer writes of one step, as pure ``mx`` functions of array inputs.

The eager caches call these with int32 arrays made from their host state; the
trace adapters call the same functions with the compiled step's inputs, so a
traced step and an eager one do exactly the same thing to the buffers.
A buffer is one array or a quantized tuple (:mod:`.storage`): each function
moves whole columns, the same way in every array of the buffer.
"""

from __future__ import annotations

import mlx.core as mx

from .storage import Buffer, columns, each


def write_columns(buf: Buffer, new: Buffer, start: mx.array) -> Buffer:
    """``buf [B, H, S, D]`` with ``new [B, H, L, D]`` written at columns
    ``start .. start+L-1`` (``start``: int32 ``[1]``). In place when ``buf``
    has no other reference at evaluation."""
    return each(lambda b, n: mx.slice_update(b, n, start, axes=(2,)), buf, new)


def ring_temporal(buf: Buffer, head: mx.array, window: int) -> Buffer:
    """A ring ``[B, H, W, D]`` in temporal order (oldest first): the column
    after the head is the oldest."""
    order = mx.remainder(head + mx.arange(window, dtype=mx.int32), window)  # [W]
    return each(lambda b: mx.take(b, order, axis=2), buf)


def ring_attend(buf: Buffer, new: Buffer, head: mx.array) -> Buffer:
    """What a window of ``L`` queries on a ring attends over: the ring in
    temporal order followed by the new keys, ``[B, H, W+L, D]``."""
    ring = ring_temporal(buf, head, columns(buf))
    return each(lambda r, n: mx.concatenate([r, n], axis=2), ring, new)


def ring_commit(attend: Buffer, shift: mx.array, first: mx.array, window: int) -> Buffer:
    """The new ring ``[B, H, W, D]`` (temporal order) from a window's ``attend``:
    column ``j`` is ``attend`` column ``first + j - shift[r]``, so each row's
    newest valid token lands on the same column (``shift [B]``: columns at the
    end of row r's new keys that are not its tokens: prompt padding, or drafts
    a verify step rejected; ``first``: the ``attend`` column that becomes ring
    column 0 for a row without such columns)."""
    src = mx.arange(window, dtype=mx.int32)[None, :] + (first - shift[:, None])  # [B, W]
    src = mx.clip(src, 0, columns(attend) - 1)[:, None, :, None]  # [B, 1, W, 1]
    # row-major, as the buffers are everywhere else: gathers lay their output out
    # gathered-axis-first, which would make every later decode copy the ring
    return each(lambda a: mx.contiguous(mx.take_along_axis(a, src, axis=2)), attend)  # [B, H, W, D]


def ring_window(buf: Buffer, new: Buffer, head: mx.array, shift: mx.array, first: mx.array):
    """A window step of ``L`` tokens on a ring of ``W`` columns: ``(attend,
    ring)`` of :func:`ring_attend` and :func:`ring_commit`."""
    attend = ring_attend(buf, new, head)
    return attend, ring_commit(attend, shift, first, columns(buf))


def realign_rows(buf: Buffer, delta: mx.array) -> Buffer:
    """``buf [B, H, C, D]`` with row r's columns moved right by ``delta[r]``
    (left when negative; what falls off one end comes back at the other, where
    it is never visible). One gather: the right-alignment after a verify step."""
    C = columns(buf)
    cols = mx.remainder(mx.arange(C, dtype=mx.int32)[None, :] - delta[:, None], C)[:, None, :, None]  # [B, 1, C, 1]
    return each(lambda b: mx.contiguous(mx.take_along_axis(b, cols, axis=2)), buf)
