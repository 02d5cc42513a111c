"""What every layer of one forward shares: rotations, decode biases, window masks.

Built lazily on first use inside the trace and kept for the rest of the
forward, so each table is one set of graph nodes however many layers read it.
Masks come per cache *family* (full attention, or one ring window): the
:class:`~mlx_tracer.adapters.FamilyMasks` the step built once.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx

from .rotation import HeadRotation, rope_tables
from .weights import LayerSpec


class StepTables:
    """The shared tables of one forward of ``L`` tokens per row.

    Args:
        offsets: ``[B]`` int32 RoPE positions of each row's first token.
        L: tokens per row in this step.
        masks: per cache family, its masks of this forward.
        family_of: per layer, its family's index into ``masks``.
        decode: a decode step (L = 1; each cache writes the one column its
            ``column`` names); else a window of L tokens per row.
    """

    def __init__(self, offsets: mx.array, L: int, masks: Sequence, family_of: Sequence[int], decode: bool = False):
        self.offsets, self.L, self.masks, self.family_of, self.decode = offsets, L, masks, family_of, decode
        self._rotations: Dict[tuple, HeadRotation] = {}
        self._biases: Dict[tuple, mx.array] = {}
        self._masks: Dict[int, mx.array] = {}

    def rotation(self, spec: LayerSpec, dtype, rotate_values: bool = True) -> HeadRotation:
        """The rotation (in ``dtype``) of a layer's ``[q, k, v]`` heads (values kept;
        ``rotate_values=False``: of ``[q, k]`` only, for qwen3's per-head norms
        between projection and rotation)."""
        heads = (spec.nq, spec.nk, spec.nk if rotate_values else 0)
        key = (spec.rope, heads, spec.D, spec.scale, dtype)
        if key not in self._rotations:
            cos, sin = rope_tables(self.offsets, self.L, *spec.rope, dtype)
            self._rotations[key] = HeadRotation(cos, sin, heads, spec.D, spec.scale)
        return self._rotations[key]

    def bias(self, layer: int, dtype, heads: Optional[Tuple[int, int]] = None) -> mx.array:
        """A decode step's additive mask for ``layer``'s family: 0 where visible,
        the dtype's lowest value elsewhere (what mlx's attention fallback puts
        there; a visible score plus 0 is the score, so the softmax is the same).
        ``[B, 1, 1, S]`` in ``dtype``, or broadcast to ``[B, nk, R, S]`` for ``heads = (nk, R)``.
        Every row sees at least one column (padding rows their own)."""
        family = self.family_of[layer]
        rows = (family, dtype, None)
        if rows not in self._biases:
            mask = self.masks[family].get(1, None)  # [B, 1, 1, S]
            low = mx.array(mx.finfo(dtype).min, dtype)
            self._biases[rows] = mx.where(mask, mx.array(0, dtype), low)
        key = (family, dtype, heads)
        if key not in self._biases:
            bias = self._biases[rows]
            self._biases[key] = mx.broadcast_to(bias, (bias.shape[0], *heads, bias.shape[-1]))
        return self._biases[key]

    def mask(self, layer: int) -> mx.array:
        """``layer``'s family mask for a window step, ``[B, 1, 1, L, S]`` (broadcast over key and query heads)."""
        family = self.family_of[layer]
        if family not in self._masks:
            self._masks[family] = mx.expand_dims(self.masks[family].get(self.L, None), 2)
        return self._masks[family]
