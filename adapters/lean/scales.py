"""Superblock scales: float32 scales (or biases) held as a float32 step per
8 groups times an int8 multiplier per group, the same values bit for bit.

GGUF's k-quants load as MLX affine blocks of group 32 whose float32 scales
are products of one fp16 step per 256 weights and a 6-bit (Q4_K, Q5_K) or
int8 (Q6_K) integer per group (:mod:`tracer.loading.gguf_readonly`):
``d * sc`` and ``-(dmin * m)`` for Q4_K / Q5_K, ``(d / 4) * sc`` and
``(-32 d) * sc`` for Q6_K's 8-bit blocks. As float32 they take 2 bits a
weight for scales and biases together; as steps and multipliers 0.75, the
file's own bytes give or take. The native quantized matmul (``qmm``, and the
layer kernels through it) reads them in that form (``qmm_api.h``'s
``ScaleType::sb``) and forms each scale as ``step * multiplier`` in float32,
the one rounding :func:`factor` checked reproduces the original's bits.

The form is a uint8 array ``[N, G * 3 / 2]``: each row's G int8 multipliers,
then its ``G / 8`` float32 steps as little-endian bytes.

:func:`factor` finds the form from the float32 values alone (no hint from
the loader, so it holds whatever the loading did to the rows: the rotary
permutation of q/k, the widening of fused groups), or says there is none,
with the native kernels' ``superblocks`` (qmm.cpp; the tests hold a numpy
reference of the same search): a step per superblock is tried as the
superblock's largest value over a multiplier k (63 first: the k-quants'
scales and mins reach it in every superblock; then 127, 128, then every k,
either sign), kept where every value of the superblock is ``step * m`` for
an integer ``-128 <= m <= 127``, its bits (signed zeros included) equal.
:func:`expand` is the inverse, with MLX's ops.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import mlx.core as mx

SUPER = 8  # groups a step serves (qmm.cpp's kSbGroups)
ENV = "MLX_TRACER_SUPERBLOCKS"  # "0": keep float32 scales (the form before 0.5.29; A/B and a way out)
FIRST = (63, 127, 128)  # the multipliers k-quant superblocks' largest values have


def factor(a: mx.array, native=None) -> Optional[mx.array]:
    """The superblock form (uint8 ``[N, G * 3 / 2]``) of float32 ``a [N, G]``
    (``G`` a multiple of 8) found by ``native`` (the kernels module's
    ``superblocks``: Llama-3.2-1B's 67M scales and biases in ~0.1 s), or
    None where it has none or there is no ``native`` (no kernels: nothing
    would read the form)."""
    if native is None or a.dtype != mx.float32 or a.ndim != 2 or a.shape[1] % SUPER or a.size == 0:
        return None
    return native(a)


def expand(sb: mx.array) -> mx.array:
    """The float32 ``[..., G]`` values of superblock scales ``sb [..., G * 3 / 2]``,
    with MLX's ops: ``step * multiplier``, one rounding, as the kernels compute them."""
    lead, G = sb.shape[:-1], sb.shape[-1] * 2 // 3
    rows = sb.reshape(-1, sb.shape[-1])
    N = rows.shape[0]
    mult = mx.view(rows[:, :G], mx.int8).astype(mx.float32).reshape(N, G // SUPER, SUPER)
    step = mx.view(mx.contiguous(rows[:, G:]), mx.float32).reshape(N, G // SUPER, 1)
    return (step * mult).reshape(*lead, G)


ATTR = "_mlx_tracer_superblocks"  # a module attribute (not a parameter): its Held


class Held:
    """A linear's superblock scales and biases (its rows of a fused group's),
    and the float32 arrays the module itself holds in their place: lazy
    :func:`expand` s of them, computed only if something runs the module's
    own forward (then held as float32 from there on, as before)."""

    __slots__ = ("scales", "biases", "of")

    def __init__(self, scales: mx.array, biases: mx.array, of: Tuple[mx.array, mx.array]):
        self.scales, self.biases, self.of = scales, biases, of


def switch(env: str, one: str, zero: str) -> bool:
    """A held form's on/off variable ``env``: unset or "1" on, "0" off;
    anything else an error saying what 1 (``one``) and 0 (``zero``) mean."""
    v = os.environ.get(env, "").strip() or "1"
    if v not in ("0", "1"):
        raise ValueError(f"{env}={v!r}: expected 1 ({one}) or 0 ({zero})")
    return v == "1"


def enabled() -> bool:
    """Whether linears take superblock scales (``$MLX_TRACER_SUPERBLOCKS``:
    unset or "1" yes, "0" no; anything else is an error saying so)."""
    return switch(ENV, "superblock scales where float32 ones factor", "float32 scales")


def said(enabled, on: str, off: str) -> str:
    """``on`` or ``off`` as ``enabled()`` says, or what is wrong with its variable."""
    try:
        return on if enabled() else off
    except ValueError as e:
        return str(e)


def describe() -> str:
    """How k-quant scales are held (``mlx-tracer info``), or what is wrong with the setting."""
    return said(enabled, f"k-quant scales as superblocks ({ENV}=0: float32)", f"k-quant scales float32 ({ENV}=0)")


def held_by(m) -> Optional[Held]:
    """What :func:`hold` gave ``m``, while its scales and biases are still those stand-ins."""
    held = getattr(m, ATTR, None)
    if held is not None and held.of[0] is m.get("scales") and held.of[1] is m.get("biases"):
        return held
    return None


def of_module(m, native=None) -> Optional[Tuple[mx.array, mx.array]]:
    """``m``'s scales and biases in superblock form: what it holds (while its
    arrays are the ones :func:`hold` gave it), else factored from its float32
    ones (``native``: as :func:`factor`); None where they have none."""
    held = held_by(m)
    if held is not None:
        return held.scales, held.biases
    if "biases" not in m:
        return None
    s = factor(m["scales"], native)
    b = factor(m["biases"], native) if s is not None else None
    return (s, b) if b is not None else None


def hold(m, scales: mx.array, biases: mx.array) -> None:
    """Give ``m`` lazy float32 expansions of superblock ``scales`` / ``biases``
    in place of its own (which it then no longer keeps alive) and remember them."""
    of = (expand(scales), expand(biases))
    m["scales"], m["biases"] = of
    object.__setattr__(m, ATTR, Held(scales, biases, of))


def bytes_saved(m) -> int:
    """Bytes fewer than its float32 scales and biases that ``m``'s held superblock form takes (0: none held)."""
    held = held_by(m)
    return 0 if held is None else sum(a.nbytes for a in held.of) - held.scales.nbytes - held.biases.nbytes
