"""Trace adapters: cache-like objects an unmodified mlx-lm model accepts inside mx.compile."""

from .contract import LayerLayout, UnsupportedModel, allocate_caches, layer_windows, new_caches, probe_layout
from .traced import FamilyMasks, TracedCache

__all__ = [
    "FamilyMasks",
    "LayerLayout",
    "TracedCache",
    "UnsupportedModel",
    "allocate_caches",
    "layer_windows",
    "new_caches",
    "probe_layout",
]
