"""Static-shape batched KV caches (full and ring) and the per-forward mask builder."""

from .batch import StaticKVCache
from .full import DEFAULT_CAPACITIES, FullCache, capacity_bucket
from .masks import MaskGeometry, build_mask
from .plan import StepPlan
from .ring import RingCache
from .rows import RowBook

__all__ = [
    "DEFAULT_CAPACITIES",
    "FullCache",
    "MaskGeometry",
    "RingCache",
    "RowBook",
    "StaticKVCache",
    "StepPlan",
    "build_mask",
    "capacity_bucket",
]
