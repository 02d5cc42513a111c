"""RoPE for every head of a step at once, with the arithmetic of MLX's fallback.

Every layer's rotary embedding uses the same positions, so the cosines and
sines are computed once per forward (per distinct ``nn.RoPE`` setting) and
each layer rotates its queries and keys together (:class:`HeadRotation`),
rounded exactly as ``mx.fast.rope``'s CPU fallback rounds (so the rotation is
bit-identical to the model's own).
"""

from __future__ import annotations

import math
from typing import Tuple

import mlx.core as mx


def rope_tables(offsets: mx.array, L: int, dims: int, base: float, scale: float, dtype) -> Tuple[mx.array, mx.array]:
    """cos and sin ``[B, L, 1, dims/2]`` for rows at ``offsets [B]``: the
    arithmetic of MLX's own RoPE fallback (so the rotation is bit-identical)."""
    half = dims // 2
    positions = (mx.arange(L, dtype=mx.float32) + offsets[:, None]) * mx.array(scale, mx.float32)  # [B, L]
    inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(math.log(base) / half, mx.float32))
    theta = positions[:, :, None, None] * inv_freqs  # [B, L, 1, half]
    return mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype)


class HeadRotation:
    """RoPE of every head of a projection ``[B * L, H * D]`` in two graph nodes.

    ``x * C + (x @ P) * S``, times a per-head factor: ``P`` swaps the two
    halves of each head (a permutation, so ``x @ P`` is exact), ``C`` is
    ``[cos, cos]`` and ``S`` is ``[-sin, sin]``, which gives
    ``x1 cos - x2 sin`` and ``x2 cos + x1 sin``: MLX's fallback arithmetic,
    rounded the same way. Heads that are not rotated (values) get ``C = 1,
    S = 0``; the factor is the attention scale on query heads (applied after
    the rotation, as the attention fallback does) and 1 elsewhere. Built once
    per forward and shared by every layer with the same head layout. Returns
    ``[B, L, H, D]``, or ``[B, H, 1, D]`` for a decode step (``axis``: the
    heads axis).
    """

    def __init__(self, cos: mx.array, sin: mx.array, heads: Tuple[int, int, int], D: int, qscale: float):
        B, L = cos.shape[:2]
        nq, nk, nv = heads
        rot, keep = nq + nk, nv
        c = mx.concatenate([cos, cos], axis=-1)  # [B, L, 1, D]
        s = mx.concatenate([-sin, sin], axis=-1)
        parts_c = [mx.broadcast_to(c, (B, L, rot, D))]
        parts_s = [mx.broadcast_to(s, (B, L, rot, D))]
        if keep:
            parts_c.append(mx.ones((B, L, keep, D), dtype=c.dtype))
            parts_s.append(mx.zeros((B, L, keep, D), dtype=s.dtype))
        H = rot + keep
        self.C = mx.concatenate(parts_c, axis=2).reshape(B * L * H, D)
        self.S = mx.concatenate(parts_s, axis=2).reshape(B * L * H, D)
        f = mx.array([qscale] * nq + [1.0] * (nk + nv), dtype=cos.dtype)[:, None]  # [H, 1]
        self.F = mx.broadcast_to(f[None], (B * L, H, 1)).reshape(B * L * H, 1)
        half = D // 2
        perm = [(j + half) % D for j in range(D)]  # column j of x @ P is x[perm[j]]
        self.P = (mx.arange(D)[:, None] == mx.array(perm)[None, :]).astype(cos.dtype)  # [D, D]
        # a decode step (L = 1) returns [B, H, 1, D]: the same memory as [B, 1, H, D],
        # in the caches' [batch, heads, time, dim] order (no reshape per head group)
        self.shape = (B, H, 1, D) if L == 1 else (B, L, H, D)
        self.axis = 1 if L == 1 else 2  # the heads axis of the result

    def __call__(self, x: mx.array) -> mx.array:
        x2 = x.reshape(-1, self.shape[-1])  # [B * L * H, D]
        return ((x2 * self.C + (x2 @ self.P) * self.S) * self.F).reshape(self.shape)
