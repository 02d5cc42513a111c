"""Five-bit blocks (adapters/lean/narrow.py, qmm's 5-bit layout): 8-bit
blocks whose integers are all below 32 (GGUF's Q5_K, Q5_0, Q5_1) held in 5
bits a weight.

The contract is *same bits*: ``kernels.narrow5`` packs the integers in the
layout qmm_api.h states (checked against :func:`reference_pack`, numpy);
qmm multiplies the 5-bit blocks to the bits of the 8-bit ones on every ISA
path and contract, every row count (tiles, windows, the dequantized panels)
and scale form; the lean forward holds the form where the kernels read it,
the modules then hold lazy 8-bit expansions of it (the same integers), and
the model's own forward, MLX's ops and a rebind without the kernels still
compute what they did."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_tracer.adapters.lean import narrow, scales
from mlx_tracer.backend import kernels
from mlx_tracer.loading import gguf

from .gguf_files import tiny_kquant_llama
from .helpers import forced_isa, solo_tokens

K = kernels.load()
needs_kernels = pytest.mark.skipif(K is None, reason=f"native kernels unavailable: {kernels.status()}")
PROMPT = [1, 5, 9, 17, 33, 65]


def reference_pack(q: np.ndarray, bits: int = 5) -> np.ndarray:
    """Integers ``q [N, K]`` (< 2 ** bits) in the layout qmm_api.h states, as bytes [N, K / 32 * 4 bits]:
    per block of 32, the low nibbles as a 4-bit block, then the high bits. 5 bits: byte f, bit l:
    weight 8 l + 2 f + 1's fifth bit, bit 4 + l: weight 8 l + 2 f's. 6 bits: byte j, bits 0-1, 2-3,
    4-5, 6-7: the two high bits of weights 2 j, 2 j + 1, 2 j + 16, 2 j + 17."""
    N, Kd = q.shape
    b = q.reshape(N, Kd // 32, 32).astype(np.uint8)
    nibbles = (b[:, :, 0::2] & 15) | ((b[:, :, 1::2] & 15) << 4)
    high = b >> 4
    if bits == 6:
        j = np.arange(8)
        plane = high[:, :, 2 * j] | high[:, :, 2 * j + 1] << 2 | high[:, :, 2 * j + 16] << 4 | high[:, :, 2 * j + 17] << 6
        return np.concatenate([nibbles, plane.astype(np.uint8)], axis=2).reshape(N, -1)
    plane = np.zeros((N, Kd // 32, 4), np.uint8)
    for f in range(4):
        for l in range(4):
            plane[:, :, f] |= (high[:, :, 8 * l + 2 * f + 1] << l) | (high[:, :, 8 * l + 2 * f] << (4 + l))
    return np.concatenate([nibbles, plane], axis=2).reshape(N, -1)


def eight_bit(q: np.ndarray) -> mx.array:
    """Integers ``q [N, K]`` as mx.quantize's 8-bit blocks (uint32 [N, K / 4])."""
    return mx.array(np.ascontiguousarray(q, np.uint8).view(np.uint32))


@needs_kernels
@pytest.mark.parametrize("bits", [5, 6])
def test_narrow_packs_the_stated_layout_and_expand_gives_back_the_8_bit_blocks(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, (37, 320), dtype=np.uint8)
    q[0, :32] = 2**bits - 1  # every high bit set
    q[1, :32] = np.arange(32) % 2 * 16  # the odd weights' fifth bits alone
    q[2, :32] = np.arange(32) // 16 * 32 % 2**bits  # the last 16 weights' sixth bits alone (6 bits)
    w8 = eight_bit(q)
    wn = narrow.narrow(w8, K.narrow, bits)
    assert wn.dtype == mx.uint32 and wn.shape == (37, 320 * bits // 32)
    assert np.array_equal(np.array(wn).view(np.uint8), reference_pack(q, bits))
    assert np.array_equal(np.array(narrow.expand(wn, bits)), np.array(w8))
    assert np.array_equal(np.array(narrow.integers(wn[3:5], bits)), q[3:5])
    assert narrow.narrow(w8[5:9], K.narrow, bits).shape == (4, 10 * bits)  # a view of rows: its own rows
    assert np.array_equal(np.array(narrow.narrow(w8[5:9], K.narrow, bits)), np.array(wn[5:9]))
    if bits == 5:
        assert np.array_equal(np.array(K.narrow5(w8)), np.array(wn))  # the 0.5.30 name


@needs_kernels
@pytest.mark.parametrize("bits", [5, 6])
def test_blocks_with_an_integer_too_wide_are_left_as_they_are(bits):
    q = np.random.default_rng(1).integers(0, 2**bits, (4, 64), dtype=np.uint8)
    q[3, 63] = 2**bits
    assert narrow.narrow(eight_bit(q), K.narrow, bits) is None
    assert narrow.narrow(eight_bit(q[:, :48]), K.narrow, bits) is None  # K = 48: not whole blocks of 32
    assert narrow.narrow(eight_bit(q[:3]), None, bits) is None  # no kernels: nothing would read the form
    with pytest.raises(ValueError, match="uint32"):
        K.narrow(mx.zeros((2, 8), mx.uint8), bits)
    with pytest.raises(ValueError, match="bits must be 5 or 6"):
        K.narrow(eight_bit(q[:3]), 4)


def k_scales(rng, N, G, kind):
    """float32 scales and biases [N, G]: Q5_K's (an fp16 step a superblock
    times 6-bit integers: superblock scales), Q5_1's (one fp16 a group), or
    float16 ones (mlx-lm's)."""
    if kind == "q5_k":
        d = rng.uniform(1e-3, 3e-2, (N, G // 8, 1)).astype(np.float16).astype(np.float32)
        sc, m = rng.integers(0, 64, (N, G // 8, 8)).astype(np.float32), rng.integers(0, 64, (N, G // 8, 8)).astype(np.float32)
        return (d * sc).reshape(N, G), (-(d * m)).reshape(N, G)
    s = rng.uniform(1e-3, 3e-2, (N, G)).astype(np.float16)
    b = (-16 * s.astype(np.float32)).astype(np.float16)
    return (s.astype(np.float32), b.astype(np.float32)) if kind == "q5_1" else (s, b)


@needs_kernels
@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
@pytest.mark.parametrize("contract", ["exact", "factored", "fast", "split"])
@pytest.mark.parametrize("Kd,group,kind,bits", [(2048, 32, "q5_k", 5), (576, 64, "f16", 5), (160, 32, "q5_1", 5),
                                                (96, 32, "f16", 5), (640, 128, "f16", 5), (224, 32, "f16", 5),
                                                (2048, 32, "q5_k", 6), (576, 64, "f16", 6), (160, 32, "q5_1", 6),
                                                (224, 32, "f16", 6)])
def test_qmm_multiplies_5_and_6_bit_blocks_to_the_bits_of_the_8_bit_ones(isa, contract, Kd, group, kind, bits):
    """Every path and contract, decode rows, verify windows and the many-row
    (dequantized panel) path; rows of 1280 / 1536 bytes (read side by side),
    short ones (pipelined), a row's last step of 1 to 3 blocks; float32,
    float16 and superblock scales; integers to 2 ** bits - 1 (6 bits: the
    split contract's two halves' pair sums reach 4 * 63 * 127)."""
    rng = np.random.default_rng(Kd + group + bits)
    N = 133
    q = rng.integers(0, 2**bits, (N, Kd), dtype=np.uint8)
    q[:, :64] = 2**bits - 1  # the widest products
    w8 = eight_bit(q)
    w5 = K.narrow(w8, bits)
    s, b = (mx.array(a) for a in k_scales(rng, N, Kd // group, kind))
    if kind == "q5_k":
        s, b = scales.factor(s, K.superblocks), scales.factor(b, K.superblocks)
        assert s is not None and b is not None
    with forced_isa(K, isa):
        for M in (1, 2, 3, 5, 9, 70):
            x = mx.random.normal((M, Kd), key=mx.random.key(M))
            if M == 1:
                x[0, :64] = 4.0  # x's int8 parts at 127 against them
            want = K.qmm(x, w8, s, b, group, 8, contract=contract)
            got = K.qmm(x, w5, s, b, group, bits, contract=contract)
            assert mx.array_equal(got, want).item(), (isa, M, float(mx.abs(got - want).max()))


@needs_kernels
def test_qmm_refuses_other_bits_and_shapes_saying_what_it_takes():
    x = mx.zeros((1, 64))
    s = mx.ones((4, 2))
    with pytest.raises(ValueError, match=r"bits must be 4, 5 or 6 \(qmm's own layouts"):
        K.qmm(x, mx.zeros((4, 14), mx.uint32), s, s, 32, 7)
    with pytest.raises(ValueError, match=r"w must be uint32 \[N, K \* bits / 32\] = \[N, 10\]"):
        K.qmm(x, mx.zeros((4, 16), mx.uint32), s, s, 32, 5)


def _five_model(tmp_path, weights="as-is"):
    """A Q5_K_M-like model: layer 0's v and down and the head Q6_K (8-bit
    integers to 255), the rest Q5_K, layer 1's o Q5_0 and up Q5_1."""
    from mlx_tracer.loading.weights import apply_format

    path = tmp_path / "five.gguf"
    tiny_kquant_llama(path, seed=3, mixed=True, five=True)
    w, meta = gguf.read_gguf(path)
    model = gguf.build_model(w, meta)
    return model if weights == "as-is" else apply_format(model, weights)


def _group_bits(cm):
    """The bits of the blocks each of a compiled model's layer groups holds, by name (qkv0, ...)."""
    return {f"{n}{s.index}": g.bits for s in cm.lean.binding.layers for n, g in s.groups().items()}


def _eight_then_narrow(model, monkeypatch):
    """``model`` compiled with 8-bit blocks kept (MLX_TRACER_5BIT=0: the
    logits of 8 steps, the weight bytes a step reads), then with the narrow
    forms (on the kernels, every layer): ``(want, eight_bytes, lean, its
    layer groups by name)``."""
    from mlx_tracer.bench.machine import model_costs
    from mlx_tracer.runtime.step import CompiledModel

    from .test_lean import compiled_logits

    monkeypatch.setenv(narrow.ENV, "0")
    plain = CompiledModel(model, fuse=True)
    assert set(_group_bits(plain).values()) == {8}
    want = compiled_logits(plain, PROMPT, 8)
    eight_bytes = model_costs(model, plain.layout)["weight_bytes"]
    monkeypatch.setenv(narrow.ENV, "1")
    lean = CompiledModel(model, fuse=True)
    assert lean.lean.native_off is None and not lean.lean.ops_at
    return want, eight_bytes, lean, {f"{n}{s.index}": g for s in lean.lean.binding.layers for n, g in s.groups().items()}


def _weights(model):
    return {n: np.array(m.weight) for n, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}


@needs_kernels
@pytest.mark.parametrize("weights", ["as-is", "quantized-split"])
def test_the_lean_forward_holds_5_bit_integers_in_5_bit_blocks(tmp_path, monkeypatch, weights):
    """Groups whose every member holds integers below 32 hold 5-bit blocks
    (the kernels read them, layers on the native kernels), the others 8-bit
    ones; the logits equal those of the 8-bit blocks (MLX_TRACER_5BIT=0) bit
    for bit, the model's own forward and the modules' integers are
    unchanged, a rebind reuses the form, and without the kernels the 8-bit
    blocks come back (the same tokens)."""
    from mlx_tracer.bench.machine import model_costs
    from mlx_tracer.runtime.step import CompiledModel

    from .test_lean import compiled_logits

    model = _five_model(tmp_path, weights)
    before = _weights(model)
    eager = model(mx.array([PROMPT]))
    want, eight_bytes, lean, groups = _eight_then_narrow(model, monkeypatch)
    five = sorted(k for k, b in _group_bits(lean).items() if b == 5)
    assert five == ["down1", "gu0", "gu1", "o0", "o1", "qkv1"], five  # not qkv0 (a Q6_K v), down0 (Q6_K), the head
    assert lean.lean.binding.head.bits == 8
    for k in five:  # K * 5 / 32 words a row
        p = groups[k].p
        assert p["weight"].shape[1] * 32 == 5 * groups[k].mods[0].weight.shape[1] * 4
    held = [m for _, m in model.named_modules() if narrow.held_by(m) is not None]
    assert len(held) == 2 + 2 + 2 + 3 + 1  # gu0, gu1, o0 + o1, qkv1, down1
    saved = sum(narrow.bytes_saved(m) for m in held)
    assert saved == sum(m.weight.nbytes * 3 // 8 for m in held)  # 8 bits a weight -> 5
    assert model_costs(model, lean.layout)["weight_bytes"] == eight_bytes - saved
    # the bench's tracer peak leaves out the stand-ins (only a stock run in the same process computes them)
    from mlx_tracer.bench.systems import stand_in_bytes

    f32 = sum(a.nbytes for m in model.modules() if (h := scales.held_by(m)) is not None for a in h.of)
    assert f32 > 0 and stand_in_bytes(model) == sum(m.weight.nbytes for m in held) + f32
    got = compiled_logits(lean, PROMPT, 8)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    assert mx.array_equal(model(mx.array([PROMPT])), eager).item()  # the modules' own forward, on the lazy blocks
    after = _weights(model)
    assert all(np.array_equal(after[k], v) for k, v in before.items())
    # rebinding reuses the held form: no held module's weight (its stand-in) is narrowed again
    stand_ins, asked, real = {id(m.weight) for m in held}, [], narrow.narrow
    with monkeypatch.context() as mp:
        mp.setattr(narrow, "narrow", lambda w, native=None, bits=5: (asked.append(id(w)), real(w, native, bits))[1])
        again = CompiledModel(model, fuse=True)
    assert asked and not stand_ins & set(asked)  # (the 8-bit-only groups are asked again, and decline)
    assert _group_bits(again) == _group_bits(lean)
    assert all(mx.array_equal(a, b).item() for a, b in zip(compiled_logits(again, PROMPT, 8), want))
    ops = CompiledModel(model, fuse=True)
    ops.lean.use_kernels(None)  # MLX's ops: the 8-bit blocks again
    assert ops.lean.buffers["gu1"]["weight"].shape[1] * 4 == 256
    assert [mx.argmax(a).item() for a in compiled_logits(ops, PROMPT, 8)] == [mx.argmax(a).item() for a in want]
    assert solo_tokens(model, PROMPT, 6) == [mx.argmax(a).item() for a in want[:6]]


@needs_kernels
def test_a_group_qmm_does_not_take_keeps_its_8_bit_blocks():
    """Integers below 32 in a linear whose scales and biases differ in dtype
    (qmm takes one dtype for both): mx.quantized_matmul runs it, on its own
    8-bit blocks, and nothing is held."""
    from mlx_tracer.adapters.lean.weights import LinearGroup

    rng = np.random.default_rng(11)
    lin = nn.QuantizedLinear(256, 64, bias=False, group_size=32, bits=8)
    lin.weight = eight_bit(rng.integers(0, 32, (64, 256), dtype=np.uint8))
    lin.scales = mx.array(rng.uniform(1e-3, 1e-2, (64, 8)).astype(np.float16))
    lin.biases = mx.array(rng.uniform(-1e-2, 0, (64, 8)).astype(np.float32))
    x = mx.random.normal((3, 256), key=mx.random.key(1))
    want = lin(x)
    g = LinearGroup([lin], K.qmm, narrow=K.narrow)
    assert g.kernel is None and g.bits == 8 and narrow.held_by(lin) is None
    assert mx.array_equal(g(x), want).item()


@needs_kernels
@pytest.mark.parametrize("weights", ["as-is", "quantized-split"])
def test_the_lean_forward_holds_int6_q6_k_in_6_bit_blocks(tmp_path, monkeypatch, weights):
    """MLX_TRACER_Q6_K=int6 (Q6_K as 8-bit blocks of integers below 64): the
    Q6_K linears (layer 0's v and down, the tied head) and the Q5_K q/k fused
    with that v are held in qmm's 6-bit blocks, the other Q5 ones in 5-bit
    blocks as before, every layer on the
    native kernels; the logits equal those of the same integers in 8-bit
    blocks (MLX_TRACER_5BIT=0) bit for bit, and MLX's ops give the same tokens."""
    from mlx_tracer.bench.machine import model_costs
    from mlx_tracer.runtime.step import CompiledModel

    from .test_lean import compiled_logits

    monkeypatch.setenv("MLX_TRACER_Q6_K", "int6")
    model = _five_model(tmp_path, weights)
    want, eight_bytes, lean, groups = _eight_then_narrow(model, monkeypatch)
    # layer 0's q/k/v: the Q5_K q/k and the Q6_K v are all 8-bit blocks, so one group, in one layout: 6 bits
    assert {k: g.bits for k, g in groups.items()} == {
        "qkv0": 6, "down0": 6, "gu0": 5, "gu1": 5, "o0": 5, "o1": 5, "qkv1": 5, "down1": 5}
    assert lean.lean.binding.head.bits == 6
    six = [m for _, m in model.named_modules() if narrow.form_bits(m) == 6]
    assert len(six) == 5  # q0, k0, v0, down0, the embedding (the tied head)
    saved = sum(narrow.bytes_saved(m) for m in six)
    assert saved == sum(m.weight.nbytes // 4 for m in six)  # 8 bits a weight -> 6
    assert model_costs(model, lean.layout)["weight_bytes"] < eight_bytes - saved
    got = compiled_logits(lean, PROMPT, 8)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    ops = CompiledModel(model, fuse=True)
    ops.lean.use_kernels(None)  # MLX's ops on the modules' 8-bit blocks
    assert [mx.argmax(a).item() for a in compiled_logits(ops, PROMPT, 8)] == [mx.argmax(a).item() for a in want]


@needs_kernels
def test_a_group_of_5_and_6_bit_integers_holds_6_bit_blocks():
    """Fused members whose integers fit 5 bits and 6 bits: one 6-bit layout
    for the group (qmm takes one), the same bits as the 8-bit blocks; a
    member with an integer of 64 or more keeps the group 8-bit."""
    from mlx_tracer.adapters.lean.weights import LinearGroup

    rng = np.random.default_rng(12)
    x = mx.random.normal((3, 256), key=mx.random.key(2))

    def lin(top):
        m = nn.QuantizedLinear(256, 64, bias=False, group_size=32, bits=8)
        m.weight = eight_bit(rng.integers(0, top, (64, 256), dtype=np.uint8))
        m.scales = mx.array(rng.uniform(1e-3, 1e-2, (64, 8)).astype(np.float32))
        m.biases = mx.array(rng.uniform(-1e-2, 0, (64, 8)).astype(np.float32))
        return m

    for tops, bits in (((32, 64), 6), ((64, 32), 6), ((32, 32), 5), ((32, 256), 8)):
        mods = [lin(t) for t in tops]
        want = LinearGroup(mods, K.qmm, contract="split")(x)
        g = LinearGroup(mods, K.qmm, contract="split", narrow=K.narrow)
        assert g.bits == bits and {narrow.form_bits(m) for m in mods} == ({None} if bits == 8 else {bits})
        assert g.p["weight"].shape[1] * 32 == bits * 256
        assert mx.array_equal(g(x), want).item(), tops
