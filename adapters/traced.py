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

from typing import Dict, Optional

import mlx.core as mx

from ..caches.batch import StaticKVCache
from ..caches.masks import MaskGeometry


class FamilyMasks:
    """The masks of one cache family (full, or one ring window) for one forward."""

    def __init__(self, geometry: MaskGeometry, L: int):
        self.geometry = geometry
        self.L = L
        self._built: Dict[Optional[int], mx.array] = {}

    def get(self, N: int, window_size: Optional[int]) -> mx.array:
        if N != self.L:
            raise ValueError(f"the model asked for a mask of {N} queries in a step of {self.L} tokens")
        window = self.geometry.window
        if window_size is not None:
            window = window_size if window is None else min(window, window_size)
        if window not in self._built:
            g = self.geometry
            self._built[window] = MaskGeometry(g.col_times, g.query_times, g.own_cols, g.first_valid, g.live, window).mask()
        return self._built[window]


class TracedCache:
    """One layer's cache inside the compiled step (see module docstring).

    Truthy, and without ``bits`` (mlx-lm would pick quantized attention).
    """

    def __init__(self, spec: StaticKVCache, keys: mx.array, values: mx.array, offset: mx.array, inputs: dict, masks: FamilyMasks, layer: int):
        self.spec = spec  # the real cache: static config only (kind, window), never its arrays
        self.keys = keys  # [Bk, H, S, Dk]
        self.values = values  # [Bk, H, S, Dv]
        self.offset = offset  # [Bk] int32: the row's RoPE position
        self.inputs = inputs
        self.masks = masks
        self.layer = layer
        self.updates = 0

    def __bool__(self) -> bool:
        return True

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[0] != self.keys.shape[0] or keys.shape[1] != self.keys.shape[1]:
            raise ValueError(
                f"layer {self.layer}: update of shape {tuple(keys.shape)} does not fit its cache "
                f"{tuple(self.keys.shape)} ([bucket, kv_heads, S, head_dim])"
            )
        self.updates += 1
        k_att, v_att, self.keys, self.values = self.spec.apply_step(self.keys, self.values, keys, values, self.inputs)
        return k_att, v_att

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False, **kwargs):
        return self.masks.get(N, window_size)
