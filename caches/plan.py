"""The plan of one step: what a cache family contributes to a forward of L tokens.

A step of ``L`` tokens over a batch touches every layer's cache, but all the
layers of one family (full attention, or one ring window) share their row
bookkeeping, so one plan serves them all. It is built once per family and
step by :meth:`~mlx_tracer.caches.batch.StaticKVCache.plan`, and carries

* the trace-key parts (``decode``, ``capacity``): a different value is a
  different trace;
* the per-row RoPE offsets ``[Bk]`` int32;
* the mask geometry (small int32 arrays, see :mod:`.masks`);
* the write inputs: int32 arrays that place the new K/V in the buffers, read
  by the cache kind's pure in-graph step (``FullCache.apply`` /
  ``RingCache.apply``).

Each cache then hands its buffers to the step (``fit``) and takes the new ones
back (``commit``): two calls per cache and step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx

from .masks import MaskGeometry


@dataclass(frozen=True)
class StepPlan:
    """One family's inputs of one step of ``length`` tokens (see module docstring)."""

    length: int
    decode: bool  # a one-token decode write (else a window: prefill chunk, verify window)
    capacity: Optional[int]  # full caches: buffer columns for this step; rings: None
    offsets: mx.array  # [Bk] int32 RoPE offsets (padding rows: 0)
    geometry: MaskGeometry
    writes: Tuple[mx.array, ...]  # int32 arrays read by the kind's pure step
    # full caches: (the capacity the family crosses into within a few steps,
    # columns left before it): its caches make the larger buffers ready
    # beforehand (not a trace-key part)
    ahead: Optional[Tuple[int, int]] = None

    @property
    def arrays(self) -> tuple:
        """The plan's array inputs of a compiled step: ``(mask arrays, writes)``."""
        return self.geometry.arrays, self.writes
