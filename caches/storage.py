"""How a static cache stores its keys and values: a float dtype, or affine-quantized.

A *buffer* is what a cache keeps for its keys (or its values):

* float: one array ``[Bk, H, S, D]`` (the model's dtype, float16 or bfloat16);
* quantized: mlx-lm's ``QuantizedKVCache`` layout, the tuple
  ``(packed [Bk, H, S, D * bits / 32] uint32, scales [Bk, H, S, D / group],
  biases [Bk, H, S, D / group])``, scales and biases in the model's dtype.

Every cache operation moves whole columns (axis 2) or rows (axis 0), and a
column's quantization depends on that column alone (groups run along ``D``),
so each operation is the same function mapped over a buffer's arrays
(:func:`each`): a quantized column is written once, when its token is, and
never quantized again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import mlx.core as mx
from mlx.utils import tree_map

Buffer = Union[mx.array, Tuple[mx.array, mx.array, mx.array]]

FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
QUANTIZE_GROUP_SIZES = (32, 64, 128)  # what mx.quantize takes
DEFAULT_KV_GROUP_SIZE = 64  # mlx-lm's default


@dataclass(frozen=True)
class KVFormat:
    """The storage format of a cache's K/V.

    ``dtype``: "float32" / "float16" / "bfloat16", or None: as the model
    writes them (the default; float32 for float32 models). ``bits`` (4 or 8):
    quantized in groups of ``group_size`` along the head dimension (then
    ``dtype`` is None: scales and biases take the model's dtype, as mlx-lm's).
    """

    dtype: Optional[str] = None
    bits: Optional[int] = None
    group_size: int = DEFAULT_KV_GROUP_SIZE

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def describe(self) -> str:
        if self.quantized:
            return f"{self.bits}-bit (group {self.group_size})"
        return self.dtype or "the model's dtype"

    def check_dims(self, *dims: int, layer: int = 0):
        """Raise unless every head dimension can be stored in this format."""
        if not self.quantized:
            return
        bad = [d for d in dims if d % self.group_size]
        if bad:
            fits = [g for g in QUANTIZE_GROUP_SIZES if all(d % g == 0 for d in dims)]
            hint = f"pass kv_group_size={fits[0]}" if fits else "use kv_dtype='float16' instead"
            raise ValueError(
                f"kv_group_size {self.group_size} does not divide layer {layer}'s head dimension {bad[0]} "
                f"(quantized K/V come in whole groups along it): {hint}"
            )

    # ------------------------------------------------------------ buffers
    def allocate(self, rows: int, heads: int, columns: int, dim: int, model_dtype) -> Buffer:
        """A zeroed buffer of ``[rows, heads, columns]`` vectors of ``dim`` values
        (quantized zeros: scale and bias 0, so they read back as 0)."""
        shape = (rows, heads, columns)
        if not self.quantized:
            return mx.zeros((*shape, dim), dtype=FLOAT_DTYPES[self.dtype] if self.dtype else model_dtype)
        packed = mx.zeros((*shape, dim * self.bits // 32), dtype=mx.uint32)  # [Bk, H, S, D * bits / 32]
        scales = mx.zeros((*shape, dim // self.group_size), dtype=model_dtype)  # [Bk, H, S, D / group]
        return packed, scales, mx.zeros_like(scales)

    def encode(self, x: mx.array) -> Buffer:
        """New keys or values ``[B, H, L, D]`` (the model's dtype) in this format;
        pure, in the graph of a step."""
        if self.quantized:
            return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))  # [B, H, L, D*bits/32], 2x [B, H, L, D/g]
        if self.dtype is None or x.dtype == FLOAT_DTYPES[self.dtype]:
            return x
        return x.astype(FLOAT_DTYPES[self.dtype])

    def convert(self, buf: Optional[Buffer], source: "KVFormat") -> Optional[Buffer]:
        """Rows stored in ``source``'s format, in this one: float rows are cast or
        quantized; quantized rows must already be in this format."""
        if buf is None:
            return None
        if is_quantized(buf):
            if (source.bits, source.group_size) != (self.bits, self.group_size):
                raise ValueError(
                    f"cannot join {source.describe()} K/V into a cache that stores {self.describe()}: "
                    f"join caches of one format (kv_bits={source.bits}, kv_group_size={source.group_size})"
                )
            return tuple(buf)
        return self.encode(buf)

    def dim(self, buf: Buffer) -> int:
        """The head dimension ``D`` a buffer stores."""
        return buf[0].shape[3] * 32 // self.bits if is_quantized(buf) else buf.shape[3]


def is_quantized(buf: Buffer) -> bool:
    return isinstance(buf, (tuple, list))  # mx.quantize returns a list


def each(fn, buf: Buffer, *others: Buffer) -> Buffer:
    """``fn`` over a buffer's arrays (with the matching arrays of ``others``)."""
    return tree_map(fn, buf, *others)


def first(buf: Buffer) -> mx.array:
    """The buffer's first array: its shape gives rows (axis 0), heads and columns (axis 2)."""
    return buf[0] if is_quantized(buf) else buf


def columns(buf: Buffer) -> int:
    return first(buf).shape[2]


def nbytes(buf: Optional[Buffer]) -> int:
    if buf is None:
        return 0
    return sum(a.nbytes for a in buf) if is_quantized(buf) else buf.nbytes


def column_bytes(buf: Buffer) -> int:
    """Bytes one column of one row takes (all heads)."""
    parts = buf if is_quantized(buf) else (buf,)
    return sum(a.shape[1] * a.shape[3] * a.itemsize for a in parts)


def shapes(buf: Buffer) -> tuple:
    return tuple(tuple(a.shape) for a in buf) if is_quantized(buf) else tuple(buf.shape)


def zeros_rows(like: Buffer, rows: int, columns: int) -> Buffer:
    """Zeroed rows shaped as ``like``'s, with ``columns`` columns."""
    return each(lambda a: mx.zeros((rows, a.shape[1], columns, a.shape[3]), a.dtype), like)


def serial_format(cache) -> KVFormat:
    """The format of a serial mlx-lm cache (anything with ``bits`` is quantized)."""
    bits = getattr(cache, "bits", None)
    if bits is not None:
        return KVFormat(bits=int(bits), group_size=int(cache.group_size))
    return KVFormat()
