"""Trace adapters: cache-like objects an unmodified mlx-lm model accepts inside mx.compile."""

from .contract import LayerLayout, ModelLayout, UnsupportedModel, layer_windows, probe_layout
from .traced import FamilyMasks, TracedCache

__all__ = [
    "FamilyMasks",
    "LayerLayout",
    "ModelLayout",
    "TracedCache",
    "UnsupportedModel",
    "layer_windows",
    "probe_layout",
]
