"""Buffers made ready before a cache needs them (on the CPU).

A cache that moves to larger buffers — a full cache crossing into its next
capacity, a batch widening into the next bucket — used to allocate them in
the step that needed them, and on the CPU that step paid the new memory's
first touch: at 20 rows of SmolLM2 (bucket 24, float32 K/V) a decode step
crossing 64 -> 128 -> 192 -> 256 columns took 200-560 ms against a 140 ms
median, a stall of every stream in the batch. So when the move is in sight
the caches build zeroed buffers of the new shape beforehand, a few caches a
step (the first touch of all of them in one step cost as much as the move
had), on a CPU stream of this thread's own (:func:`side_stream`); the move
then only copies its rows or columns in, with the same bits as building the
buffers then (zeros where nothing is written).
"""

from __future__ import annotations

import threading
from typing import Optional, Tuple

import mlx.core as mx

from .storage import Buffer, each, is_quantized

_side = threading.local()  # MLX's streams belong to the thread that made them


def side_stream():
    """This thread's CPU stream spare buffers are built on (None off the CPU:
    there the device allocates, and no host thread touches pages)."""
    if mx.default_device() != mx.cpu:
        return None
    if getattr(_side, "stream", None) is None:
        _side.stream = mx.new_stream(mx.cpu)
    return _side.stream


def arrays(buf: Buffer) -> tuple:
    return tuple(buf) if is_quantized(buf) else (buf,)


def reshaped(a: mx.array, width: int, S: int) -> tuple:
    """``a``'s shape with ``width`` rows (axis 0) and ``S`` columns (axis 2)."""
    return (width, a.shape[1], S) + tuple(a.shape[3:])


class Spare:
    """A cache's zeroed keys and values of one shape ``(width, S)``, building on the side stream."""

    def __init__(self, keys: Buffer, values: Buffer, width: int, S: int, stream):
        self.shape = (width, S)
        self.keys, self.values = (each(lambda a: mx.zeros(reshaped(a, width, S), a.dtype, stream=stream), buf)
                                  for buf in (keys, values))
        mx.async_eval(*self.arrays())

    def arrays(self) -> tuple:
        return arrays(self.keys) + arrays(self.values)

    def fits(self, keys: Buffer, values: Buffer, width: int, S: int) -> bool:
        """Whether these are the buffers of shape ``(width, S)`` for ``keys``/``values`` as they are now."""
        if self.shape != (width, S):
            return False
        return all(s.shape == reshaped(a, width, S) and s.dtype == a.dtype
                   for spare, buf in ((self.keys, keys), (self.values, values))
                   for s, a in zip(arrays(spare), arrays(buf)))


def make_ready(spare: Optional[Spare], keys: Buffer, values: Buffer, width: int, S: int) -> Tuple[Optional[Spare], bool]:
    """``(the spare for shape (width, S), whether it was started now)``:
    ``spare`` if it is that one already; None where there is no side stream."""
    if spare is not None and spare.fits(keys, values, width, S):
        return spare, False
    stream = side_stream()
    if stream is None or keys is None:
        return None, False
    return Spare(keys, values, width, S, stream), True


def put(spare: mx.array, a: mx.array, rows: int = 0) -> mx.array:
    """``a`` written into ``spare`` from row ``rows`` on, over its first columns
    (the spare's own buffer: it is updated in place)."""
    spare[rows : rows + a.shape[0], :, : a.shape[2]] = a
    return spare
