"""What one attention layer sees as its cache while the step is traced.

An unmodified mlx-lm model calls, per attention layer::

    q = rope(q, offset=cache.offset); k = rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    mask = create_attention_mask(h, cache, window_size=...)  # -> cache.make_mask

``TracedCache`` answers those calls with arrays of the compiled step: the
offset is its int32 ``[Bk]`` input, the write happens in the graph on the
layer's static buffers, and the mask is its family's, built in the graph once
per forward (per window size) and shared by every layer of that family.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import mlx.core as mx

from ..caches.masks import MaskGeometry
from ..caches.storage import KVFormat, first, shapes


class FamilyMasks:
    """The masks of one cache family (full, or one ring window) for one forward."""

    def __init__(self, geometry: MaskGeometry, L: int):
        self.geometry = geometry  # the family's, with its own window
        self.L = L
        self._built: Dict[Optional[int], mx.array] = {}

    def get(self, N: int, window_size: Optional[int]) -> mx.array:
        if N != self.L:
            raise ValueError(f"the model asked for a mask of {N} queries in a step of {self.L} tokens")
        g = self.geometry.narrowed(window_size)
        if g.window not in self._built:
            self._built[g.window] = g.mask()  # [Bk, 1, L, S]
        return self._built[g.window]


class TracedCache:
    """One layer's cache inside the compiled step (see module docstring).

    ``apply`` is the cache kind's pure step (``FullCache.apply`` /
    ``RingCache.apply`` with the step's ``decode`` flag bound) and ``writes``
    its inputs from the family plan. Truthy; it has ``bits`` and
    ``group_size`` exactly when its K/V are quantized (mlx-lm's attention
    then reads them with ``quantized_matmul``), and writes new K/V in its
    ``storage`` format.
    """

    def __init__(self, apply: Callable, keys, values, offset: mx.array, writes: tuple, masks: FamilyMasks,
                 layer: int, column: Optional[mx.array] = None, storage: KVFormat = KVFormat()):
        self.apply = apply
        self.column = column  # a decode step: the int32 [1] column it writes in every row (else None)
        self.storage = storage
        if storage.quantized:
            self.bits, self.group_size = storage.bits, storage.group_size
        self.keys = keys  # [Bk, H, S, Dk] (quantized: (packed, scales, biases))
        self.values = values  # [Bk, H, S, Dv]
        self.offset = offset  # [Bk] int32: the row's RoPE position
        self.writes = writes
        self.masks = masks
        self.layer = layer
        self.updates = 0

    def __bool__(self) -> bool:
        return True

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        buf = first(self.keys)
        if keys.shape[0] != buf.shape[0] or keys.shape[1] != buf.shape[1]:
            raise ValueError(
                f"layer {self.layer}: update of shape {tuple(keys.shape)} does not fit its cache "
                f"{tuple(buf.shape)} ([bucket, kv_heads, S, head_dim])"
            )
        self.updates += 1
        keys, values = self.storage.encode(keys), self.storage.encode(values)  # [Bk, H, L, D] as stored
        k_att, v_att, self.keys, self.values = self.apply(self.keys, self.values, keys, values, self.writes)
        return k_att, v_att

    def written(self, keys: mx.array, values: mx.array):
        """Take the buffers a kernel returned after writing this decode step's
        keys and values at :attr:`column` itself (what ``update_and_fetch``
        does with MLX ops)."""
        if self.column is None or shapes(keys) != shapes(self.keys) or shapes(values) != shapes(self.values):
            raise ValueError(f"layer {self.layer}: a written cache needs a decode step and buffers shaped as its own")
        self.updates += 1
        self.keys, self.values = keys, values

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False, **kwargs):
        return self.masks.get(N, window_size)
