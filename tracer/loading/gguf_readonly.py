"""Read a GGUF file that may not be written: what ``mx.load`` returns, from a read-only map.

MLX's GGUF reader (gguflib, under ``mx.load``) opens the file
``O_RDWR|O_APPEND`` and maps it writable, so a model file the user may read
but not write (a read-only mount, a shared models folder) fails with
"gguf_init failed", which says nothing of the cause. :func:`load` parses the
same layout over a numpy memmap opened read-only (header, metadata, tensor
infos, alignment: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
and builds what ``mx.load(path, return_metadata=True)`` builds, bit for bit,
for the tensor types llama GGUF files use here:

* F32, F16: copied as they are;
* Q4_0, Q4_1, Q8_0: MLX's affine triples (``mlx/io/gguf_quants.cpp``): the
  packed ``<name>`` (uint32), ``<prefix>.scales`` and ``<prefix>.biases``
  (float16), group size 32. Q4_0's bias is ``-8 * scale``, Q8_0's ``-128 *
  scale`` (its int8 weights become ``x ^ 0x80``), Q4_1 stores its bias
  (the block's min) after the scale.

Other types differ from ``mx.load`` on purpose, here and, through
:func:`with_k_quants`, after ``mx.load`` (:func:`mlx_tracer.loading.gguf.read_gguf`):

* **Q4_K** (MLX casts it to float16) becomes an affine 4-bit triple
  (:func:`q4_k_affine`: group 32, float32 scales and biases, exactly
  ggml's values);
* **Q5_0**, **Q5_1**, **Q5_K** (MLX cannot read them) affine 8-bit triples
  of their 5-bit integers (:func:`q5_affine`, :func:`q5_k_affine`: exactly
  ggml's values);
* **Q6_K** (MLX casts it to float16) an affine 8-bit triple
  (:func:`q6_k_affine`: group 32, float32 scales and biases; of each
  group's two sub-blocks of 16, the one with the larger scale exactly
  ggml's values, the other rounded to the group's 256 levels), unless
  ``MLX_TRACER_Q6_K=float16`` asks for MLX's float16 cast, or ``int6`` for
  a triple of integers below 64 (the other sub-block rounded to the
  group's 64 levels), which the lean forward holds in 6-bit blocks.

A file holding any other tensor type (Q2_K, ...) is loaded by
``mx.load`` from a temporary copy instead, said once on stderr, its k-quant
tensors then replaced by their triples. Metadata follows MLX too:
scalars as 0-d arrays of their type, strings as ``str``, arrays as 1-d
arrays or lists of ``str``; float64 values become float32, as MLX's code
means them to (MLX 0.32 itself crashes on them).
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import mlx.core as mx
import numpy as np

HEADER = 24  # magic, version (u32), tensor count (u64), metadata count (u64)
STRING, ARRAY = 8, 9
# metadata value type -> numpy type of its bytes
_VALUES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
BOOL, FLOAT64 = 7, 12
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14
_FLOATS = {F32: "<f4", F16: "<f2"}
_BLOCKS = {Q4_0: (18, 4), Q4_1: (20, 4), Q8_0: (34, 8)}  # bytes per block of 32 weights, bits
_BLOCKS5 = {Q5_0: 22, Q5_1: 24}  # bytes per block of 32 weights: the 5-bit types MLX cannot read, built here
GROUP = 32
QK_K = 256  # weights per k-quant superblock
_SUPER = {10: 84, 11: 110, Q4_K: 144, 13: 176, Q6_K: 210}  # bytes per superblock (Q2_K..Q6_K): sizes, bounds
ENV_Q6_K = "MLX_TRACER_Q6_K"  # "float16": Q6_K tensors as MLX's float16 cast; "int6": triples of 6-bit integers
Q6_K_FORMATS = ("int8", "float16", "int6")
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}

_said = set()  # the temporary-copy notice, once per process


class UnsupportedTypes(ValueError):
    """The file holds tensor types this reader does not build (``types``: their names)."""

    def __init__(self, types):
        super().__init__(f"tensor types {', '.join(types)} are not read here")
        self.types = types


def opens_for_writing(path: Path) -> bool:
    """Whether MLX's reader can open ``path`` the way it does (read-write)."""
    if not os.access(path, os.W_OK):
        return False
    try:
        os.close(os.open(path, os.O_RDWR | os.O_APPEND))
    except OSError as e:
        return e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM)  # others: let MLX report them
    return True


class _Cursor:
    """Reads little-endian values off the mapped file, never past its end."""

    def __init__(self, buf: np.ndarray):
        self.buf, self.off = buf, 0

    def take(self, n: int) -> np.ndarray:
        if n < 0 or self.off + n > self.buf.size:
            raise ValueError(f"the file ends at byte {self.buf.size}, inside a field at byte {self.off}: it is truncated")
        out = self.buf[self.off:self.off + n]
        self.off += n
        return out

    def uint(self, size: int) -> int:
        return int.from_bytes(self.take(size).tobytes(), "little")

    def string(self) -> str:
        return self.take(self.uint(8)).tobytes().decode("utf-8")

    def values(self, vtype: int, n: int) -> np.ndarray:
        if vtype not in _VALUES:
            raise ValueError(f"unknown metadata value type {vtype} at byte {self.off}")
        dt = np.dtype(_VALUES[vtype])
        out = self.take(n * dt.itemsize).view(dt)
        if vtype == BOOL:
            return out != 0
        return out.astype(np.float32) if vtype == FLOAT64 else out


def _metadata(cur: _Cursor, count: int) -> Tuple[dict, int]:
    meta, alignment = {}, 32
    for _ in range(count):
        key, vtype = cur.string(), cur.uint(4)
        if vtype == STRING:
            value = cur.string()
        elif vtype == ARRAY:
            etype, n = cur.uint(4), cur.uint(8)
            if etype == ARRAY:
                raise ValueError(f"metadata {key}: nested arrays are not supported")
            value = [cur.string() for _ in range(n)] if etype == STRING else mx.array(cur.values(etype, n))
        else:
            scalar = cur.values(vtype, 1)
            value = mx.array(scalar.reshape(()))
            if key == "general.alignment" and vtype == 4:
                alignment = int(scalar[0])
        meta.setdefault(key, value)  # as MLX: the first of a repeated key stays
    return meta, alignment


def scan(buf: np.ndarray) -> Tuple[dict, List[tuple]]:
    """``(metadata, [(name, shape, type, start, size)])`` of a mapped file,
    every tensor's bytes checked to lie inside it. Raises ``ValueError``
    naming what is wrong."""
    if buf.size < HEADER or buf[:4].tobytes() != b"GGUF":
        raise ValueError("it does not start with a GGUF header")
    cur = _Cursor(buf)
    cur.take(4)
    version, n_tensors, n_kv = cur.uint(4), cur.uint(8), cur.uint(8)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    meta, alignment = _metadata(cur, n_kv)
    infos = []
    for _ in range(n_tensors):
        name, ndim = cur.string(), cur.uint(4)
        dims = [cur.uint(8) for _ in range(ndim)]
        infos.append((name, tuple(reversed(dims)), cur.uint(4), cur.uint(8)))
    data = cur.off + (-cur.off) % alignment
    tensors = []
    for name, shape, ttype, offset in infos:
        count = int(np.prod(shape, dtype=np.uint64))
        if ttype in _BLOCKS or ttype in _BLOCKS5:
            if shape[-1] % GROUP:
                raise ValueError(f"tensor {name}: last dimension {shape[-1]} is not a multiple of {GROUP}")
            size = count // GROUP * (_BLOCKS[ttype][0] if ttype in _BLOCKS else _BLOCKS5[ttype])
        elif ttype in _SUPER:
            if not shape or shape[-1] % QK_K:
                raise ValueError(f"tensor {name} ({TYPE_NAMES[ttype]}): its rows ({shape[-1] if shape else 0} "
                                 f"weights) are not whole superblocks of {QK_K}; the file is corrupt")
            size = count // QK_K * _SUPER[ttype]
        else:
            size = count * np.dtype(_FLOATS.get(ttype, "u1")).itemsize  # other types: checked by the caller
        start = data + offset
        if ttype in _FLOATS or ttype in _BLOCKS or ttype in _BLOCKS5 or ttype in _SUPER:
            if start + size > buf.size:
                raise ValueError(f"tensor {name} ends at byte {start + size}, past the end of the file "
                                 f"({buf.size} bytes): it is truncated")
        tensors.append((name, shape, ttype, start, size))
    return meta, tensors


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def tensor_types(path: Path) -> set:
    """The tensor types of a GGUF file, read past its metadata without
    decoding it (a vocabulary's ~10^5 strings skipped by their lengths:
    milliseconds, where :func:`scan` takes ~0.4 s); an empty set for a
    file this walk cannot follow (:func:`scan` then names what is wrong)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _walk_types(m)
    except (OSError, ValueError, struct.error, KeyError):
        return set()


def _walk_types(m) -> set:
    if m[:4] != b"GGUF":
        raise ValueError("not GGUF")
    n_tensors, n_kv = struct.unpack_from("<QQ", m, 8)
    off = HEADER
    u64 = struct.Struct("<Q").unpack_from
    u32 = struct.Struct("<I").unpack_from
    for _ in range(n_kv):
        off += 8 + u64(m, off)[0]  # the key
        (vtype,) = u32(m, off)
        off += 4
        if vtype == STRING:
            off += 8 + u64(m, off)[0]
        elif vtype == ARRAY:
            etype, n = u32(m, off)[0], u64(m, off + 4)[0]
            off += 12
            if n > len(m) - off:  # each element takes a byte at least: a corrupt count
                raise ValueError("array past the end")
            if etype == STRING:
                for _ in range(n):
                    off += 8 + u64(m, off)[0]
            else:
                off += n * _SCALAR_SIZES[etype]
        else:
            off += _SCALAR_SIZES[vtype]
    types = set()
    for _ in range(n_tensors):
        off += 8 + u64(m, off)[0]  # the name
        (ndim,) = u32(m, off)
        off += 4 + 8 * ndim
        types.add(u32(m, off)[0])
        off += 12  # type, offset
    return types


def tensor_bytes(path: Path) -> int:
    """The bytes the file's tensors take as it stores them (their data, no
    header, metadata or alignment padding): what any reader of their
    blocks must at least read."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    return sum(int(size) for *_, size in scan(buf)[1])


def builds_k_quants(path: Path) -> bool:
    """Whether the file holds k-quant tensors this module builds (Q4_K; Q6_K
    unless ``$MLX_TRACER_Q6_K=float16``), which ``mx.load`` would first cast
    to float16 only for them to be replaced."""
    return any(_built(t) is not None for t in tensor_types(path))


def _quantized(raw: np.ndarray, shape: tuple, ttype: int):
    """MLX's (weight, scales, biases) of one Q4_0/Q4_1/Q8_0 tensor."""
    block, bits = _BLOCKS[ttype]
    blocks = raw.reshape(-1, block)  # (n blocks, bytes per block)
    groups = shape[:-1] + (shape[-1] // GROUP,)
    scales = np.ascontiguousarray(blocks[:, :2]).view("<f2").reshape(groups)
    if ttype == Q4_1:
        biases = np.ascontiguousarray(blocks[:, 2:4]).view("<f2").reshape(groups)
    else:
        biases = scales * np.float16(-8 if ttype == Q4_0 else -128)
    if bits == 4:
        qs = blocks[:, block - 16:]  # 16 bytes of nibbles after the scale (Q4_0) or scale and min (Q4_1)
        w = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # (n, 32): weights 0-15 low nibbles, 16-31 high
        packed = w[:, 0::2] | (w[:, 1::2] << 4)  # (n, 16): two weights a byte, the first in the low nibble
    else:
        packed = blocks[:, 2:34] ^ 0x80  # int8 -> uint8 (+128)
    weight = np.ascontiguousarray(packed, dtype=np.uint8).view("<u4").reshape(shape[:-1] + (shape[-1] * bits // 32,))
    return mx.array(weight), mx.array(scales), mx.array(biases)


def q4_k_affine(raw: np.ndarray, shape: tuple) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLX affine 4-bit triple (packed uint32, float32 scales, float32 biases;
    group 32) of one Q4_K tensor's bytes ``raw``, equal to ggml's dequantization.

    A Q4_K superblock (144 bytes, 256 weights) is fp16 ``d``, fp16 ``dmin``,
    12 bytes of 6-bit scales ``sc`` and mins ``m`` of its 8 sub-blocks of 32
    (ggml's ``get_scale_min_k4``: sub-blocks 0-3 in the low 6 bits of bytes
    0-3 / 4-7; 4-7 in the nibbles of bytes 8-11, high 2 bits in the top bits of
    bytes 0-3 / 4-7), then 128 bytes of quants: each 32-byte chunk ``c`` holds
    sub-block ``2c`` in its low nibbles and ``2c + 1`` in its high ones. Weight
    ``d*sc * q - dmin*m`` is the affine group's ``scale * q + bias`` with
    ``scale = d*sc`` and ``bias = -(dmin*m)``, both exact in float32 (an fp16
    times a 6-bit integer). MLX packs weight ``i`` of a row at bits
    ``4*(i%8)`` of word ``i/8``: byte ``k`` holds weights ``2k`` (low nibble)
    and ``2k+1``.
    """
    if not shape or shape[-1] % QK_K:
        raise ValueError(f"a Q4_K tensor's rows must be whole superblocks of {QK_K} weights, not {shape[-1] if shape else 0}")
    b = np.asarray(raw, dtype=np.uint8).reshape(-1, _SUPER[Q4_K])  # (n superblocks, 144)
    n = b.shape[0]
    d = np.ascontiguousarray(b[:, 0:2]).view("<f2").astype(np.float32)  # (n, 1)
    dmin = np.ascontiguousarray(b[:, 2:4]).view("<f2").astype(np.float32)
    sc, m = _k_scales(b[:, 4:16])  # (n, 8) sub-block scales and mins
    scales = d * sc.astype(np.float32)
    biases = -(dmin * m.astype(np.float32))
    qs = b[:, 16:].reshape(n, 4, 16, 2)  # chunk, pair of bytes
    even, odd = qs[..., 0], qs[..., 1]  # quants 2k and 2k+1 of both sub-blocks of a chunk
    first = (even & 0x0F) | (odd << 4)  # sub-block 2c: low nibbles (uint8: the shift drops odd's high one)
    second = (even >> 4) | (odd & 0xF0)  # sub-block 2c+1: high nibbles
    packed = np.stack([first, second], axis=2).reshape(n, QK_K // 2)
    groups = tuple(shape[:-1]) + (shape[-1] // GROUP,)
    weight = np.ascontiguousarray(packed).view("<u4").reshape(tuple(shape[:-1]) + (shape[-1] // 8,))
    return weight, scales.reshape(groups), biases.reshape(groups)


def q6_k_format() -> str:
    """How Q6_K tensors load: ``"int8"`` (:func:`q6_k_affine`, the default),
    ``"float16"`` (MLX's cast) or ``"int6"`` (:func:`q6_k_affine` with
    ``levels=64``), from ``$MLX_TRACER_Q6_K``."""
    v = os.environ.get(ENV_Q6_K, "").strip().lower() or Q6_K_FORMATS[0]
    if v not in Q6_K_FORMATS:
        raise ValueError(f"{ENV_Q6_K}={v!r}: expected one of {', '.join(Q6_K_FORMATS)} (int8: 8-bit blocks the "
                         "quantized kernels run; float16: MLX's float16 cast of the file's values; int6: 6-bit "
                         "blocks, fewer bytes, a coarser rounding of half the sub-blocks)")
    return v


Q6_K_SAID = {"int8": "GGUF Q6_K as 8-bit blocks (MLX_TRACER_Q6_K=int6: 6-bit blocks, a coarser rounding; "
                     "float16: MLX's cast)",
             "int6": "GGUF Q6_K as 6-bit blocks, half its sub-blocks rounded to the other's step "
                     "(MLX_TRACER_Q6_K=int6; unset: 8-bit blocks)",
             "float16": "GGUF Q6_K as MLX's float16 cast, on MLX's ops (MLX_TRACER_Q6_K=float16; unset: 8-bit blocks)"}


def q6_k_describe() -> str:
    """How Q6_K tensors load (``mlx-tracer info``), or what is wrong with ``$MLX_TRACER_Q6_K``."""
    try:
        return Q6_K_SAID[q6_k_format()]
    except ValueError as e:
        return str(e)


def q6_k_affine(raw: np.ndarray, shape: tuple, levels: int = 256) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLX affine 8-bit triple (packed uint32, float32 scales, float32 biases;
    group 32) of one Q6_K tensor's bytes ``raw``; ``levels`` 64: of integers
    below 64 (``MLX_TRACER_Q6_K=int6``, below).

    A Q6_K superblock (210 bytes, 256 weights): 128 bytes of low nibbles
    ``ql``, 64 bytes of high 2-bit pairs ``qh``, 16 int8 scales ``sc`` of
    sub-blocks of 16, fp16 ``d``; weight ``d*sc[j] * (q - 32)``, ``q`` in
    0..63 (ggml's ``dequantize_row_q6_K``: in each half of 128 weights, weight
    ``32 k + l`` takes its low 4 bits from nibble ``k // 2`` of ``ql[l + 32 *
    (k % 2)]`` and its high 2 from bits ``2 k`` of ``qh[l]``).

    MLX's groups have one scale per 32 weights (no groups of 16), so each group
    of two sub-blocks takes its step from the one whose scale ``s`` is larger in
    magnitude (the first on a tie): ``scale = s / 4``, ``bias = -32 s``, whose
    weights are then ``4 q`` exactly, the same values as ggml's (``(s/4) * 4q``
    and its sum with the bias are exact in float32: an fp16 times an int8 is 18
    bits, times 6 more bits of q). The other sub-block's weights (scale ``s'``,
    ``|s'| <= |s|``) are rounded to the nearest of those 256 levels: an error
    of at most ``|s| / 8`` (a quarter of a Q6_K step of the coarser sub-block
    halved; ``|s| / 4`` for the one level past the top when ``s' = -s`` and
    ``q = 0``); none where ``4 s' / s`` is a whole number (equal scales, or
    one half or a quarter of the other). 10 bits a weight (Q6_K: 6.56; MLX's
    float16 cast: 16).

    ``levels=64`` (``int6``) takes the group's step as ``s`` itself: ``scale
    = s``, ``bias = -32 s``, the larger sub-block's integers ``q`` (exactly
    ggml's values again), the other's rounded to the nearest of those 64
    levels (at most ``|s| / 2`` off, the clipped level past the top ``|s|``),
    so that every integer is below 64 and the lean forward holds the matrix
    in qmm's 6-bit blocks (``adapters/lean/narrow.py``): 6.75 bits a weight
    with superblock scales, against the 8-bit form's 8.75, for up to 4x the
    rounding of the smaller-scale sub-block.
    """
    if levels not in (64, 256):
        raise ValueError(f"q6_k_affine: levels must be 64 or 256, not {levels}")
    if not shape or shape[-1] % QK_K:
        raise ValueError(f"a Q6_K tensor's rows must be whole superblocks of {QK_K} weights, not {shape[-1] if shape else 0}")
    b = np.asarray(raw, dtype=np.uint8).reshape(-1, _SUPER[Q6_K])  # (n superblocks, 210)
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 2, 32)  # half, low/high 32 bytes of the half's 64, l
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)  # (n, 16)
    d = np.ascontiguousarray(b[:, 208:210]).view("<f2").astype(np.float32)  # (n, 1)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # (n, 2, 4, 32): k = 0, 1 low nibbles; 2, 3 high ones
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3  # bits 2k, 2k+1 of qh[l]
    q = (low | (high << 4)).reshape(n, 8, 2, 16).astype(np.float32)  # group, its two sub-blocks, weight
    s = (d * sc).reshape(n, 8, 2)  # each sub-block's scale: exact (fp16 times int8)
    first = np.abs(s[:, :, 0]) >= np.abs(s[:, :, 1])
    big = np.where(first, s[:, :, 0], s[:, :, 1])  # (n, 8): the group's step is big / per
    per = np.float32(levels // 64)  # levels a Q6_K step of the larger sub-block: 4 (8 bits) or 1 (6 bits)
    # levels in the group's step: per s / big (exactly per on the sub-block it comes from) times q - 32
    ratio = np.divide(per * s, big[:, :, None], out=np.zeros(s.shape, np.float32), where=big[:, :, None] != 0)
    ints = np.rint(ratio[..., None] * (q - np.float32(32)))
    ints += levels // 2
    packed = np.clip(ints, 0, levels - 1, out=ints).astype(np.uint8).reshape(n, QK_K)
    groups = tuple(shape[:-1]) + (shape[-1] // GROUP,)
    scales = (big / per).astype(np.float32)
    biases = (big * np.float32(-32)).astype(np.float32)
    return _as_bytes(packed, shape), scales.reshape(groups), biases.reshape(groups)


def _as_bytes(levels: np.ndarray, shape: tuple) -> np.ndarray:
    """Integers 0..255 a weight, in row order, as MLX's 8-bit packed uint32 words."""
    return np.ascontiguousarray(levels, dtype=np.uint8).view("<u4").reshape(tuple(shape[:-1]) + (shape[-1] // 4,))


def q5_affine(raw: np.ndarray, shape: tuple, ttype: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLX affine 8-bit triple (group 32, float32 scales and biases) of one
    Q5_0 or Q5_1 tensor, exactly ggml's values. A block of 32 weights is fp16
    ``d`` (Q5_1: then fp16 ``m``), 4 bytes ``qh`` (bit ``j`` of that
    little-endian word: weight ``j``'s fifth bit), 16 bytes of nibbles (byte
    ``j``: weight ``j`` low, ``j + 16`` high); weight ``d * (q - 16)``
    (Q5_0) or ``d * q + m`` (Q5_1), q in 0..31 — MLX's ``scale * q + bias``
    with ``scale = d`` and ``bias = -16 d`` or ``m``, exact in float32. MLX
    has no 5-bit type the kernels take (and its GGUF reader cannot read
    these), so the integers sit in 8-bit blocks: 10 bits a weight (the
    file's 5.5 / 6)."""
    size = _BLOCKS5[ttype]
    b = np.asarray(raw, dtype=np.uint8).reshape(-1, size)
    d = np.ascontiguousarray(b[:, 0:2]).view("<f2").astype(np.float32)[:, 0]
    at = 2 if ttype == Q5_0 else 4
    bias = np.float32(-16) * d if ttype == Q5_0 else np.ascontiguousarray(b[:, 2:4]).view("<f2").astype(np.float32)[:, 0]
    high = np.ascontiguousarray(b[:, at:at + 4]).view("<u4")  # (n, 1)
    fifth = ((high >> np.arange(32, dtype=np.uint32)[None, :]) & 1).astype(np.uint8) << 4
    nib = b[:, at + 4:at + 20]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=1) | fifth
    groups = tuple(shape[:-1]) + (shape[-1] // GROUP,)
    return _as_bytes(q, shape), d.reshape(groups), bias.astype(np.float32).reshape(groups)


def _k_scales(sb: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K / Q5_K superblock's 12 bytes
    (ggml's ``get_scale_min_k4``), each (n, 8)."""
    lo, mid, hi = sb[:, 0:4], sb[:, 4:8], sb[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, m


def q5_k_affine(raw: np.ndarray, shape: tuple) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLX affine 8-bit triple (group 32, float32 scales and biases) of one
    Q5_K tensor, exactly ggml's values. A superblock (176 bytes, 256 weights)
    is fp16 ``d``, fp16 ``dmin``, Q4_K's 12 bytes of 6-bit scales and mins of
    8 sub-blocks of 32, 32 bytes ``qh``, 128 bytes of nibbles: each 32-byte
    chunk ``c`` holds sub-block ``2c`` in its low nibbles and ``2c + 1`` in
    its high ones, their fifth bits in bits ``2c`` / ``2c + 1`` of ``qh[l]``
    (ggml's ``dequantize_row_q5_K``). Weight ``d*sc * q - dmin*m`` as in
    :func:`q4_k_affine`, q in 0..31, in 8-bit blocks: 10 bits a weight (the
    file's 5.5)."""
    if not shape or shape[-1] % QK_K:
        raise ValueError(f"a Q5_K tensor's rows must be whole superblocks of {QK_K} weights, not {shape[-1] if shape else 0}")
    b = np.asarray(raw, dtype=np.uint8).reshape(-1, _SUPER[Q5_K])
    n = b.shape[0]
    d = np.ascontiguousarray(b[:, 0:2]).view("<f2").astype(np.float32)
    dmin = np.ascontiguousarray(b[:, 2:4]).view("<f2").astype(np.float32)
    sc, m = _k_scales(b[:, 4:16])
    qh = b[:, 16:48][:, None, None, :]  # (n, 1, 1, 32)
    qs = b[:, 48:176].reshape(n, 4, 1, 32)  # chunk, l
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # (n, 4, 2, 32): sub-blocks 2c, 2c + 1
    bit = 2 * np.arange(4, dtype=np.uint8)[None, :, None, None] + np.arange(2, dtype=np.uint8)[None, None, :, None]
    q = low | (((qh >> bit) & 1) << 4)
    groups = tuple(shape[:-1]) + (shape[-1] // GROUP,)
    scales = (d * sc.astype(np.float32)).reshape(groups)
    biases = (-(dmin * m.astype(np.float32))).reshape(groups)
    return _as_bytes(q.reshape(n, QK_K), shape), scales, biases


def _built(ttype: int):
    """The triple builder of a type this module builds instead of ``mx.load``
    (which casts Q4_K / Q6_K to float16 and cannot read the 5-bit types), or
    None: mx.load's arrays stand."""
    if ttype == Q4_K:
        return q4_k_affine
    if ttype == Q5_K:
        return q5_k_affine
    if ttype in _BLOCKS5:
        return lambda raw, shape: q5_affine(raw, shape, ttype)
    if ttype == Q6_K and q6_k_format() != "float16":
        return q6_k_affine if q6_k_format() == "int8" else lambda raw, shape: q6_k_affine(raw, shape, levels=64)
    return None


def _put_triple(weights: dict, name: str, triple) -> None:
    prefix = name[: -len(".weight")]  # as MLX: the name less 7 characters
    for key, value in zip((name, f"{prefix}.scales", f"{prefix}.biases"), triple):
        if key in weights:
            raise ValueError(f"tensor {key} appears twice")
        weights[key] = mx.array(value)


def with_k_quants(weights: Dict[str, mx.array], path: Path) -> Dict[str, mx.array]:
    """``mx.load``'s ``weights`` of ``path`` with each Q4_K tensor (float16
    there) replaced by its exact affine triple (:func:`q4_k_affine`), and each
    Q6_K tensor by its 8-bit one (:func:`q6_k_affine`, unless
    ``$MLX_TRACER_Q6_K`` is ``float16``). Changes ``weights`` in place and
    returns it."""
    if not any(v.dtype == mx.float16 for v in weights.values()):
        return weights  # MLX returns k-quant tensors as float16: none here
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    for name, shape, ttype, start, size in scan(buf)[1]:
        build = _built(ttype)
        if build is None:
            continue
        if name not in weights or weights[name].dtype != mx.float16:
            raise ValueError(f"tensor {name} ({TYPE_NAMES[ttype]}) is not among MLX's float16 tensors of the file")
        del weights[name]
        _put_triple(weights, name, build(buf[start:start + size], shape))
    return weights


def read(path: Path) -> Tuple[Dict[str, mx.array], dict]:
    """``(weights, metadata)`` as ``mx.load`` gives them, the file opened
    read-only, but k-quant tensors as their affine triples (:func:`with_k_quants`).
    Raises :class:`UnsupportedTypes` for tensor types not covered,
    ``ValueError`` for a damaged file."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    meta, tensors = scan(buf)
    other = sorted({TYPE_NAMES.get(t, str(t)) for _, _, t, _, _ in tensors
                    if t not in _FLOATS and t not in _BLOCKS and _built(t) is None})
    if other:
        raise UnsupportedTypes(other)
    weights = {}

    def put(name, value):
        if name in weights:
            raise ValueError(f"tensor {name} appears twice")
        weights[name] = value

    for name, shape, ttype, start, size in tensors:
        raw = buf[start:start + size]
        if ttype in _FLOATS:
            put(name, mx.array(raw.view(_FLOATS[ttype]).reshape(shape)))
        elif (build := _built(ttype)) is not None:
            _put_triple(weights, name, build(raw, shape))
        else:
            weight, scales, biases = _quantized(raw, shape, ttype)
            put(name, weight)
            prefix = name[: -len(".weight")]  # as MLX: the name less 7 characters
            put(f"{prefix}.scales", scales)
            put(f"{prefix}.biases", biases)
    return weights, meta


def load(path: Path) -> Tuple[Dict[str, mx.array], dict]:
    """:func:`read`, or, for a file with other tensor types, ``mx.load`` of a
    temporary copy (said once on stderr) with its k-quant tensors as triples
    (:func:`with_k_quants`)."""
    try:
        return read(path)
    except UnsupportedTypes as e:
        if path not in _said:
            _said.add(path)
            print(f"[mlx-tracer] {path} cannot be opened for writing, which MLX's GGUF reader needs, and holds "
                  f"{', '.join(e.types)} tensors that mlx-tracer's read-only reader does not cover: loading a "
                  "temporary copy", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="mlx-tracer-gguf-") as tmp:
        copy = Path(tmp) / path.name
        shutil.copyfile(path, copy)
        weights, meta = mx.load(str(copy), return_metadata=True)
    return with_k_quants(weights, path), meta
