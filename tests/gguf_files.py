"""Small GGUF files written byte by byte, with the tensor types ``mx.save_gguf``
cannot write (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; the k-quants Q4_K, Q5_K and
Q6_K), for the read-only reader's and the k-quant tests."""

from __future__ import annotations

import struct

import numpy as np

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, I8 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 24
_BLOCK = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34}
QK_K = 256
_SUPER = {Q4_K: 144, Q5_K: 176, Q6_K: 210}  # bytes per superblock of 256 weights


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


_ARRAY_TYPES = {np.dtype("u1"): 0, np.dtype("i1"): 1, np.dtype("u2"): 2, np.dtype("i2"): 3, np.dtype("u4"): 4,
                np.dtype("i4"): 5, np.dtype("f4"): 6, np.dtype("bool"): 7, np.dtype("u8"): 10, np.dtype("i8"): 11,
                np.dtype("f8"): 12}


def _value(v) -> bytes:
    """Type and bytes of one metadata value."""
    if isinstance(v, str):
        return struct.pack("<I", 8) + _string(v)
    if isinstance(v, list):
        return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(_string(s) for s in v)
    a = np.asarray(v)
    t = _ARRAY_TYPES[a.dtype]
    if a.ndim == 0:
        return struct.pack("<I", t) + a.astype(a.dtype.newbyteorder("<")).tobytes()
    return struct.pack("<IIQ", 9, t, a.size) + a.astype(a.dtype.newbyteorder("<")).tobytes()


def random_blocks(ttype: int, shape, rng) -> bytes:
    """Valid random data of a quantized tensor: finite float16 scales (and
    Q4_1 / Q5_1 mins), random weight bytes."""
    n = int(np.prod(shape)) // 32
    blocks = rng.integers(0, 256, size=(n, _BLOCK[ttype]), dtype=np.uint8)
    blocks[:, :2] = rng.uniform(0.001, 0.05, n).astype("<f2").view(np.uint8).reshape(n, 2)
    if ttype in (Q4_1, Q5_1):
        blocks[:, 2:4] = rng.uniform(-0.2, 0.0, n).astype("<f2").view(np.uint8).reshape(n, 2)
    return blocks.tobytes()


def random_superblocks(ttype: int, shape, rng, d=None, dmin=(1.5e-3, 4.5e-3)) -> bytes:
    """Valid random data of a Q4_K, Q5_K or Q6_K tensor (last dimension a multiple
    of 256): random scale and quant bytes, finite float16 super-scales drawn
    from ``d`` (Q4_K, Q5_K: ``d`` at bytes 0-1, ``dmin`` at 2-3; Q6_K: ``d`` at its
    last two bytes, after 128 + 64 quant bytes and 16 int8 scales). The
    default ranges give weights of mean about 0 and magnitude about 0.1."""
    d = d or ((2e-4, 6e-4) if ttype == Q4_K else (1e-4, 3e-4) if ttype == Q5_K else (3e-5, 9e-5))
    assert shape[-1] % QK_K == 0, shape
    n = int(np.prod(shape)) // QK_K
    blocks = rng.integers(0, 256, size=(n, _SUPER[ttype]), dtype=np.uint8)
    half = lambda lo_hi: rng.uniform(*lo_hi, n).astype("<f2").view(np.uint8).reshape(n, 2)  # noqa: E731
    if ttype in (Q4_K, Q5_K):
        blocks[:, 0:2], blocks[:, 2:4] = half(d), half(dmin)
    else:
        blocks[:, 208:210] = half(d)
    return blocks.tobytes()


def write_gguf(path, tensors: dict, meta: dict, alignment: int = 32) -> None:
    """``tensors``: name -> (ggml type, shape in MLX order, data bytes)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
    for k, v in meta.items():
        out += _string(k) + _value(v)
    offset, datas = 0, []
    for name, (ttype, shape, data) in tensors.items():
        offset += (-offset) % alignment
        out += _string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *reversed(shape))
        out += struct.pack("<IQ", ttype, offset)
        datas.append((offset, data))
        offset += len(data)
    out += b"\0" * ((-len(out)) % alignment)
    base = len(out)
    for off, data in datas:
        out += b"\0" * (base + off - len(out)) + data
    with open(path, "wb") as f:
        f.write(bytes(out))


def tiny_quantized_llama(path, seed: int = 0) -> None:
    """A 2-layer llama whose layers are Q4_0, Q4_1 and Q8_0, its norms F32
    and F16, with metadata of every kind but float64, on which MLX 0.32's
    reader crashes (no tokenizer: the tests use token ids)."""
    rng = np.random.default_rng(seed)
    V, D, F, H, KV, L = 96, 64, 96, 4, 2, 2
    hd = D // H

    def floats(shape, dtype):
        return (1 + 0.1 * rng.standard_normal(shape)).astype(dtype).tobytes()

    tensors = {"token_embd.weight": (Q8_0, (V, D), random_blocks(Q8_0, (V, D), rng)),
               "output_norm.weight": (F32, (D,), floats(D, "<f4")),
               "output.weight": (Q4_1, (V, D), random_blocks(Q4_1, (V, D), rng))}
    kinds = {"attn_q": (Q4_0, (H * hd, D)), "attn_k": (Q4_1, (KV * hd, D)), "attn_v": (Q8_0, (KV * hd, D)),
             "attn_output": (Q4_1, (D, H * hd)), "ffn_gate": (Q4_0, (F, D)), "ffn_up": (Q8_0, (F, D)),
             "ffn_down": (Q4_1, (D, F))}
    for i in range(L):
        for part, (t, shape) in kinds.items():
            tensors[f"blk.{i}.{part}.weight"] = (t, shape, random_blocks(t, shape, rng))
        tensors[f"blk.{i}.attn_norm.weight"] = (F16, (D,), floats(D, "<f2"))
        tensors[f"blk.{i}.ffn_norm.weight"] = (F32, (D,), floats(D, "<f4"))
    u32 = np.uint32
    meta = {
        "general.architecture": "llama", "general.name": "tiny", "general.alignment": u32(64),
        "llama.embedding_length": u32(D), "llama.block_count": u32(L), "llama.feed_forward_length": u32(F),
        "llama.attention.head_count": u32(H), "llama.attention.head_count_kv": u32(KV),
        "llama.rope.dimension_count": u32(hd), "llama.rope.freq_base": np.float32(10000.0),
        "llama.context_length": u32(256), "llama.attention.layer_norm_rms_epsilon": np.float32(1e-5),
        "llama.vocab_size": np.uint64(V), "x.int8": np.int8(-3), "x.uint16": np.uint16(7), "x.int64": np.int64(-9),
        "x.bool": np.bool_(True), "x.strings": ["a", "béta", ""], "x.ints": np.arange(5, dtype=np.int32),
        "x.floats": np.linspace(0, 1, 4, dtype=np.float32), "x.flags": np.array([True, False]),
    }
    write_gguf(path, tensors, meta, alignment=64)


def tiny_kquant_llama(path, seed: int = 0, mixed: bool = False, five: bool = False) -> None:
    """A 2-layer llama (hidden 256, ffn 512: rows of whole superblocks) whose
    linears and embedding are Q4_K, norms F32. ``mixed``: as a Q4_K_M file
    mixes them, layer 0's ``attn_v`` and ``ffn_down`` and the output head
    are Q6_K (so layer 0's q/k/v group mixes Q4_K and Q6_K), layer 1's Q4_K.
    ``five``: Q5_K instead of Q4_K (a Q5_K_M file with ``mixed``), and layer
    1's ``attn_output`` Q5_0, its ``ffn_up`` Q5_1."""
    rng = np.random.default_rng(seed)
    V, D, F, H, KV, L = 96, 256, 512, 4, 2, 2
    hd = D // H

    def floats(shape):
        return (1 + 0.1 * rng.standard_normal(shape)).astype("<f4").tobytes()

    def tensor(t, shape):
        if t == Q4_K and five:
            t = Q5_K
        return (t, shape, random_blocks(t, shape, rng) if t in _BLOCK else random_superblocks(t, shape, rng))

    tensors = {"token_embd.weight": tensor(Q4_K, (V, D)), "output_norm.weight": (F32, (D,), floats(D)),
               "output.weight": tensor(Q6_K if mixed else Q4_K, (V, D))}
    shapes = {"attn_q": (H * hd, D), "attn_k": (KV * hd, D), "attn_v": (KV * hd, D), "attn_output": (D, H * hd),
              "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}
    for i in range(L):
        for part, shape in shapes.items():
            t = Q6_K if mixed and i == 0 and part in ("attn_v", "ffn_down") else Q4_K
            if five and i == 1 and part in ("attn_output", "ffn_up"):
                t = Q5_0 if part == "attn_output" else Q5_1
            tensors[f"blk.{i}.{part}.weight"] = tensor(t, shape)
        tensors[f"blk.{i}.attn_norm.weight"] = (F32, (D,), floats(D))
        tensors[f"blk.{i}.ffn_norm.weight"] = (F32, (D,), floats(D))
    u32 = np.uint32
    meta = {
        "general.architecture": "llama", "general.name": "tiny-kquant", "general.alignment": u32(32),
        "llama.embedding_length": u32(D), "llama.block_count": u32(L), "llama.feed_forward_length": u32(F),
        "llama.attention.head_count": u32(H), "llama.attention.head_count_kv": u32(KV),
        "llama.rope.dimension_count": u32(hd), "llama.rope.freq_base": np.float32(10000.0),
        "llama.context_length": u32(256), "llama.attention.layer_norm_rms_epsilon": np.float32(1e-5),
        "llama.vocab_size": np.uint64(V),
    }
    write_gguf(path, tensors, meta)
