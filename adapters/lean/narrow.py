"""Five-bit blocks: a linear's 8-bit blocks whose integers are all below 32
held in 5 bits a weight, the same integers.

GGUF's Q5_K, Q5_0 and Q5_1 tensors load as MLX affine 8-bit blocks
(:mod:`tracer.loading.gguf_readonly`: MLX has no 5-bit layout its CPU
kernels or this project's read), 8 bits a weight for 5 bits of integer. The
native quantized matmul (``qmm`` and the layer kernels through it) also
takes blocks in a 5-bit layout of its own (``qmm_api.h``'s ``Packed``): a
block of 32 weights in 20 bytes, its low nibbles as a 4-bit block holds
them, then its fifth bits. It multiplies them as 4-bit ones, to the same
bits as the 8-bit blocks under every contract.

Like superblock scales (:mod:`.scales`), the form is found from the arrays
alone when the lean forward binds (an 8-bit matrix whose every integer is
below 32, by the kernels' ``narrow5``), so it holds whatever the loading
did to the rows (the rotary permutation of q/k; q/k's 4-bit blocks widened
to 8 bits beside an 8-bit v). The group holds the 5-bit form; each module
holds a lazy :func:`expand` of its rows back to 8-bit blocks (MLX's ops,
unevaluated), so nothing holds the 8-bit bytes unless the model's own
forward runs (mlx-lm's; the bench's stock column), which then keeps them.

``MLX_TRACER_5BIT=0`` keeps the 8-bit blocks.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .scales import said, switch

ENV = "MLX_TRACER_5BIT"  # "0": keep 8-bit blocks (the form before 0.5.30; A/B and a way out)
ATTR = "_mlx_tracer_5bit"  # a module attribute (not a parameter): its Held
BLOCK, BLOCK_BYTES = 32, 20


def narrow(w: mx.array, native=None) -> Optional[mx.array]:
    """The 5-bit form (uint32 ``[N, K * 5 / 32]``) of 8-bit blocks ``w``
    (uint32 ``[N, K / 4]``) by ``native`` (the kernels' ``narrow5``), or None
    where some integer is 32 or more, or there is no ``native`` (nothing
    would read the form)."""
    if native is None or w.dtype != mx.uint32 or w.ndim != 2 or (w.shape[1] * 4) % BLOCK or w.size == 0:
        return None
    return native(mx.contiguous(w))


def _fifth_index():
    """For weight k of a block: the byte (0-3) of its fifth bits and the bit in it."""
    k = mx.arange(BLOCK)
    i = k // 2
    l, f = i // 4, i % 4
    return f, l + 4 * (1 - k % 2)


def expand(w5: mx.array) -> mx.array:
    """The 8-bit blocks (uint32 ``[N, K / 4]``, mx.quantize's layout) of the
    5-bit form ``w5``, with MLX's ops: each weight's low nibble and fifth bit."""
    N = w5.shape[0]
    b = mx.view(w5, mx.uint8).reshape(N, -1, BLOCK_BYTES)
    nib = b[:, :, :16]
    low = mx.stack([nib & 15, nib >> 4], axis=-1).reshape(N, -1, BLOCK)  # natural order
    byte, bit = _fifth_index()
    plane = mx.take(b[:, :, 16:], byte, axis=2)  # [N, blocks, 32]: each weight's byte of fifth bits
    fifth = (plane >> bit.astype(mx.uint8)) & 1
    q = (low | (fifth << 4)).reshape(N, -1)
    return mx.view(q, mx.uint32).reshape(N, -1)


class Held:
    """A linear's 5-bit blocks (its rows of a fused group's) and the 8-bit
    array the module itself holds in their place: a lazy :func:`expand`."""

    __slots__ = ("weight", "of")

    def __init__(self, weight: mx.array, of: mx.array):
        self.weight, self.of = weight, of


def enabled() -> bool:
    """Whether linears take 5-bit blocks (``$MLX_TRACER_5BIT``: unset or "1"
    yes, "0" no; anything else is an error saying so)."""
    return switch(ENV, "5-bit blocks where 8-bit ones hold integers below 32", "8-bit blocks")


def describe() -> str:
    """How 8-bit blocks of 5-bit integers are held (``mlx-tracer info``), or what is wrong with the setting."""
    return said(enabled, f"5-bit integers (GGUF's Q5_K/Q5_0/Q5_1) in 5-bit blocks ({ENV}=0: 8-bit)",
                f"5-bit integers in 8-bit blocks ({ENV}=0)")


def held_by(m) -> Optional[Held]:
    """What :func:`hold` gave ``m``, while its weight is still that stand-in."""
    held = getattr(m, ATTR, None)
    if held is not None and held.of is m.get("weight"):
        return held
    return None


def of_module(m, native=None) -> Optional[mx.array]:
    """``m``'s weight in 5-bit form: what it holds (while its weight is the
    one :func:`hold` gave it), else narrowed from its 8-bit blocks (``native``:
    as :func:`narrow`); None where it has none."""
    held = held_by(m)
    if held is not None:
        return held.weight
    if getattr(m, "bits", None) != 8 or getattr(m, "mode", "affine") != "affine":
        return None
    return narrow(m["weight"], native)


def hold(m, weight: mx.array) -> None:
    """Give ``m`` a lazy 8-bit expansion of 5-bit ``weight`` in place of its
    own (which it then no longer keeps alive) and remember it."""
    of = expand(weight)
    m["weight"] = of
    object.__setattr__(m, ATTR, Held(weight, of))


def bytes_saved(m) -> int:
    """Bytes fewer than its 8-bit blocks that ``m``'s held 5-bit form takes (0: none held)."""
    held = held_by(m)
    return 0 if held is None else held.of.nbytes - held.weight.nbytes
