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


def ring_window(buf: mx.array, new: mx.array, head: mx.array, shift: mx.array, first: mx.array):
    """A window step of ``L`` tokens on a ring of ``W`` columns.

    Returns ``(attend, ring)``: ``attend [B, H, W+L, D]`` is the ring in
    temporal order followed by the new keys (what the queries attend over);
    ``ring [B, H, W, D]`` is the new ring in temporal order, column ``j``
    taken from ``attend`` column ``first + j - shift[r]``, so that each row's
    newest valid token lands on the same column (``shift [B]`` is the prompt
    padding at the end of row r's new keys, ``first`` the column of
    ``attend`` that becomes ring column 0 for a row without padding).
    """
    W, L = buf.shape[2], new.shape[2]
    attend = mx.concatenate([ring_temporal(buf, head, W), new], axis=2)  # [B, H, W+L, D]
    src = mx.arange(W, dtype=mx.int32)[None, :] + (first - shift[:, None])  # [B, W]
    src = mx.clip(src, 0, W + L - 1)
    ring = mx.take_along_axis(attend, src[:, None, :, None], axis=2)  # [B, H, W, D]
    # row-major, as the buffers are everywhere else: gathers lay their output out
    # gathered-axis-first, which would make every later decode copy the ring
    return attend, mx.contiguous(ring)
