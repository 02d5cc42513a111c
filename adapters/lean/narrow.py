"""Blocks in qmm's own 5- and 6-bit layouts: a linear's integers held in
the bits they have, not the bits of MLX's layout the kernels would
otherwise need.

Two kinds of linears hold them:

* GGUF's Q5_K, Q5_0 and Q5_1 tensors load as MLX affine 8-bit blocks
  (:mod:`tracer.loading.gguf_readonly`: MLX has no 5-bit layout its CPU
  kernels or this project's read), 8 bits a weight for 5 bits of integer;
  where every integer of the matrix is below 32 it is held as 5-bit blocks,
  else where every one is below 64 (Q6_K loaded under
  ``MLX_TRACER_Q6_K=int6``) as 6-bit ones.
* MLX's own 5- and 6-bit models (``mlx_lm.convert -q --q-bits 5`` or ``6``)
  store blocks in mx.quantize's bit stream, which only mx.quantized_matmul
  reads (on the CPU 10-28x slower than the native kernels on SmolLM2:
  benchmarks/mlx_bits.py); they are repacked into qmm's 5- and 6-bit
  layouts, the same integers. MLX's 2- and 3-bit blocks, which qmm has no
  layout for, are held as MLX's 4-bit blocks of the same integers (more
  bytes than the file's, a fraction of float32's).

The native quantized matmul (``qmm`` and the layer kernels through it)
takes both layouts (``qmm_api.h``'s ``Packed``): a block of 32 weights in 20
or 24 bytes, its low nibbles as a 4-bit block holds them, then a plane of
its high bits. It multiplies them as 4-bit ones, to the same bits as 8-bit
blocks of the same integers under every contract.

Like superblock scales (:mod:`.scales`), the form is found from the arrays
alone when the lean forward binds, so it holds whatever the loading did to
the rows (the rotary permutation of q/k; q/k's 4-bit blocks widened to 8
bits beside an 8-bit v). The group holds the form; each module holds a lazy
:func:`expand` of its rows back to its own layout (MLX's ops, unevaluated),
so nothing holds the module's bytes unless the model's own forward runs
(mlx-lm's; the bench's stock column), which then keeps them. A tied
embedding's lookups gather the rows they need from the form
(:func:`rows`).

``MLX_TRACER_5BIT=0`` keeps GGUF's 8-bit blocks 8-bit, 5- and 6-bit
integers alike (MLX's 5- and 6-bit blocks are repacked either way: the
alternative is mx.quantized_matmul).
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx

from .scales import said, switch

ENV = "MLX_TRACER_5BIT"  # "0": keep 8-bit blocks (the form before 0.5.30; A/B and a way out)
ATTR = "_mlx_tracer_5bit"  # a module attribute (not a parameter): its Held
BLOCK = 32
BITS = (5, 6)  # qmm's own layouts
# The modules' bits a form is made from, and the form's (8: where every integer is below 32; 2 and 3: MLX's
# 4-bit layout, which qmm reads)
TO = {2: 4, 3: 4, 5: 5, 6: 6, 8: 5}


def nibbles(q: mx.array) -> mx.array:
    """Integers ``q`` (uint8 ``[..., K]``, below 16) as mx.quantize's 4-bit
    blocks (uint32 ``[..., K / 8]``: byte i holds weights 2 i and 2 i + 1)."""
    return mx.view(q[..., 0::2] | (q[..., 1::2] << 4), mx.uint32)


def block_bytes(bits: int) -> int:
    """Bytes a block of 32 weights takes in qmm's ``bits``-bit layout."""
    return BLOCK * bits // 8


def narrow(w: mx.array, native=None, bits: int = 5) -> Optional[mx.array]:
    """The ``bits``-bit form (uint32 ``[N, K * bits / 32]``) of 8-bit blocks
    ``w`` (uint32 ``[N, K / 4]``) by ``native`` (the kernels' ``narrow``), or
    None where some integer is ``2 ** bits`` or more, or there is no
    ``native`` (nothing would read the form). ``bits`` 4: MLX's 4-bit
    blocks (asked only for integers below 8: MLX's 2- and 3-bit ones)."""
    if native is None or w.dtype != mx.uint32 or w.ndim != 2 or (w.shape[1] * 4) % BLOCK or w.size == 0:
        return None
    if bits == 4:
        return nibbles(mx.view(w, mx.uint8))
    return native(mx.contiguous(w), bits)


def mlx_integers(w: mx.array, bits: int) -> mx.array:
    """The integers (uint8 ``[..., K]``) of mx.quantize's ``bits``-bit blocks
    ``w`` (uint32 ``[..., K * bits / 32]``): a little-endian bit stream, weight
    k at bits ``k * bits`` on (what mx.dequantize reads; tests check it)."""
    lead = w.shape[:-1]
    b = mx.view(w, mx.uint8).reshape(-1, w.shape[-1] * 4 // bits, bits).astype(mx.uint16)  # 8 weights a row
    cols = []
    for t in range(8):
        i, s = divmod(t * bits, 8)
        v = b[:, :, i] if s + bits <= 8 else b[:, :, i] | (b[:, :, i + 1] << 8)
        cols.append((v >> s) & ((1 << bits) - 1))
    return mx.stack(cols, axis=-1).astype(mx.uint8).reshape(*lead, -1)


def mlx_pack(q: mx.array, bits: int) -> mx.array:
    """Integers ``q`` (uint8 ``[..., K]``, below ``2 ** bits``) as mx.quantize's
    ``bits``-bit blocks (uint32 ``[..., K * bits / 32]``)."""
    lead = q.shape[:-1]
    g = q.reshape(-1, q.shape[-1] // 8, 8).astype(mx.uint16)
    out = []
    for i in range(bits):  # byte i: bits 8 i .. 8 i + 7 of each 8 weights' stream
        parts = []
        for t in range(8):
            at = t * bits - 8 * i
            if -bits < at < 8:
                parts.append(g[:, :, t] << at if at >= 0 else g[:, :, t] >> -at)
        byte = parts[0]
        for p in parts[1:]:
            byte = byte | p
        out.append(byte & 0xFF)
    packed = mx.stack(out, axis=-1).astype(mx.uint8).reshape(*lead, -1)
    return mx.view(packed, mx.uint32)


def _high_index(bits: int):
    """For weight k of a block: the byte of its high bits in the plane, and the shift to them."""
    k = mx.arange(BLOCK)
    if bits == 5:
        i = k // 2
        return i % 4, i // 4 + 4 * (1 - k % 2)
    return (k % 16) // 2, 2 * (k % 2) + 4 * (k // 16)


def integers(form: mx.array, bits: int = 5) -> mx.array:
    """The integers (uint8 ``[..., K]``) of qmm's ``bits``-bit blocks ``form``
    (uint32 ``[..., K * bits / 32]``), with MLX's ops: each weight's low
    nibble and its high bits (4 bits: MLX's blocks, the nibbles alone)."""
    lead = form.shape[:-1]
    if bits == 4:
        b = mx.view(form, mx.uint8)
        return mx.stack([b & 15, b >> 4], axis=-1).reshape(*lead, -1)
    b = mx.view(form, mx.uint8).reshape(-1, form.shape[-1] * 4 // block_bytes(bits), block_bytes(bits))
    nib = b[:, :, :16]
    low = mx.stack([nib & 15, nib >> 4], axis=-1).reshape(b.shape[0], -1, BLOCK)  # natural order
    byte, shift = _high_index(bits)
    plane = mx.take(b[:, :, 16:], byte, axis=2)  # [R, blocks, 32]: each weight's byte of high bits
    high = (plane >> shift.astype(mx.uint8)) & ((1 << (bits - 4)) - 1)
    return (low | (high << 4)).reshape(*lead, -1)


def expand(form: mx.array, bits: int = 5, to: int = 8) -> mx.array:
    """Qmm's ``bits``-bit blocks ``form`` in mx.quantize's ``to``-bit layout
    (uint32 ``[..., K * to / 32]``), with MLX's ops."""
    q = integers(form, bits)
    return mx.view(q, mx.uint32) if to == 8 else mlx_pack(q, to)


class Held:
    """A linear's blocks in one of qmm's layouts (its rows of a fused
    group's), their bits, and the array the module itself holds in their
    place: a lazy :func:`expand` to its own layout."""

    __slots__ = ("weight", "of", "bits")

    def __init__(self, weight: mx.array, of: mx.array, bits: int = 5):
        self.weight, self.of, self.bits = weight, of, bits


def enabled() -> bool:
    """Whether 8-bit blocks of integers below 32 take 5-bit ones (below 64:
    6-bit ones) (``$MLX_TRACER_5BIT``: unset or "1" yes, "0" no; anything
    else is an error saying so)."""
    return switch(ENV, "5-bit blocks where 8-bit ones hold integers below 32 (6-bit ones below 64)", "8-bit blocks")


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


def of_module(m, native=None, to: int = 5) -> Optional[mx.array]:
    """``m``'s weight in one of qmm's own layouts: what it holds (while its
    weight is the one :func:`hold` gave it), else its 8-bit blocks narrowed
    to ``to`` (5 or 6) bits (where ``$MLX_TRACER_5BIT`` allows it and every
    integer is below ``2 ** to``), or its MLX 5- or 6-bit blocks repacked, its MLX 2- or 3-bit
    ones as 4-bit blocks (``native``: the
    kernels' ``narrow``, as :func:`narrow`); None where it has none."""
    bits = getattr(m, "bits", None)
    if bits == 8 and not enabled():
        return None
    held = held_by(m)
    if held is not None:
        return held.weight
    if getattr(m, "mode", "affine") != "affine" or bits not in TO:
        return None
    if bits == 8:
        return narrow(m["weight"], native, to)
    return narrow(mx.view(mlx_integers(m["weight"], bits), mx.uint32), native, TO[bits])


def hold(m, weight: mx.array) -> None:
    """Give ``m`` a lazy expansion of ``weight`` (qmm's blocks of its rows)
    to its own layout in place of its own weight (which it then no longer
    keeps alive) and remember both."""
    K = m["weight"].shape[-1] * 32 // m.bits
    bits = weight.shape[-1] * 32 // K
    of = expand(weight, bits, m.bits)
    m["weight"] = of
    object.__setattr__(m, ATTR, Held(weight, of, bits))


def form_bits(m) -> Optional[int]:
    """The bits of the form ``m`` holds (None: none)."""
    held = held_by(m)
    return None if held is None else held.bits


def rows(m, x: mx.array) -> Tuple[mx.array, int]:
    """Rows ``x`` of ``m``'s weight as MLX blocks, and their bits: gathered
    from the form it holds (4 bits: as they are; 5 and 6: as 8-bit blocks of
    their integers, which mx.dequantize reads to the same values as the
    module's own blocks: tests/test_mlx_bits.py checks the lookups against
    them), else from its weight. No repack to the module's bit stream on the
    step's path (a compiled 6-bit lookup took 218 us that way)."""
    held = held_by(m)
    if held is None:
        return m["weight"][x], m.bits
    w = held.weight[x]
    return (w, 4) if held.bits == 4 else (mx.view(integers(w, held.bits), mx.uint32), 8)


def bytes_saved(m) -> int:
    """Bytes fewer than its own blocks that ``m``'s held form takes (0: none held)."""
    held = held_by(m)
    return 0 if held is None else held.of.nbytes - held.weight.nbytes
