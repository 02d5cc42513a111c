"""Superblock scales (adapters/lean/scales.py, qmm's ScaleType::sb): a
k-quant's float32 scales and biases held as a float32 step per 8 groups
times an int8 multiplier per group, 0.75 bits a weight instead of 2.

The contract is *same bits*: the search (``kernels.superblocks``, checked
against :func:`reference_form`, a numpy version of it) keeps a form only where
``step * multiplier`` rounds back to every original float32 (signed zeros
included); qmm reads it on every ISA path and contract to the same bits as
the float32 scales it replaced; the lean forward gives its quantized groups
that form where the native matmul reads them, the modules then hold lazy
float32 expansions of it (the same values), and the model's own forward,
MLX's ops and a rebind without the kernels still compute what they did."""

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


def bits_of(a) -> np.ndarray:
    return np.array(a, np.float32).view(np.uint32)


def reference_form(a: np.ndarray):
    """The superblock form of float32 ``a [N, G]`` by the search scales.py
    states, in numpy (the native one's reference), or None."""
    N, G = a.shape
    x = np.ascontiguousarray(a, np.float32).reshape(-1, scales.SUPER)
    n, bits = x.shape[0], x.reshape(-1, scales.SUPER).view(np.uint32)
    top = x[np.arange(n), np.abs(x).argmax(axis=1)]
    step, mult, todo = np.zeros(n, np.float32), np.zeros((n, scales.SUPER), np.int8), np.arange(n)
    for k in (63, 127, 128) + tuple(k for k in range(128, 0, -1) if k not in (63, 127, 128)):
        for sign in (1, -1):
            d = (top[todo] / np.float32(sign * k)).astype(np.float32)
            with np.errstate(divide="ignore", invalid="ignore"):
                q = np.rint(x[todo] / d[:, None])
            q[~np.isfinite(q)] = 0
            ok = ((q >= -128) & (q <= 127)).all(axis=1)
            q = np.clip(q, -128, 127).astype(np.int8)  # as stored: no -0, the product's sign is the step's
            ok &= ((d[:, None] * q.astype(np.float32)).view(np.uint32) == bits[todo]).all(axis=1)
            step[todo[ok]], mult[todo[ok]] = d[ok], q[ok]
            todo = todo[~ok]
    if todo.size:
        return None
    return np.concatenate([mult.reshape(N, G).view(np.uint8), step.reshape(N, G // scales.SUPER).view(np.uint8)], axis=1)


def form(a):
    """The native search's form of float32 ``a`` (numpy or mx), through scales.factor as bind calls it."""
    return scales.factor(mx.array(a) if isinstance(a, np.ndarray) else a, K.superblocks)


def k_scales(rng, N, G, kind):
    """float32 scales and biases [N, G] as the k-quant loaders build them (gguf_readonly)."""
    shape = (N, G // 8, 8)
    d = rng.uniform(-3e-2, 3e-2, (N, G // 8, 1)).astype(np.float16).astype(np.float32)
    if kind == "q4_k":  # d * sc, -(dmin * m): 6-bit sc and m, one of each at 63 (the quantizer's top)
        dmin = np.abs(rng.uniform(0, 1e-2, d.shape).astype(np.float16).astype(np.float32))
        sc, m = rng.integers(0, 64, shape).astype(np.float32), rng.integers(0, 64, shape).astype(np.float32)
        sc[:, :, 3], m[:, :, 5], m[:, :, 6] = 63, 63, 0  # m = 0: a bias of -0.0
        return (d * sc).reshape(N, G), (-(dmin * m)).reshape(N, G)
    if kind == "q6_k":  # (d / 4) * sc and (-32 d) * sc, int8 sc (-128 where the quantizer puts its largest)
        sc = rng.integers(-128, 128, shape).astype(np.float32)
        sc[:, :, 0] = -128
        return (d / np.float32(4) * sc).reshape(N, G), (d * np.float32(-32) * sc).reshape(N, G)
    if kind == "tiny":  # float16 subnormal steps
        sc = rng.integers(0, 64, shape).astype(np.float32)
        d = (rng.integers(1, 1024, d.shape) * np.float32(2.0 ** -24)).astype(np.float32)
        return (d * sc).reshape(N, G), (-(d * sc)).reshape(N, G)
    raise ValueError(kind)


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "tiny"])
def test_factor_and_expand_give_back_every_bit(kind):
    s, b = k_scales(np.random.default_rng(0), 37, 64, kind)
    for a in (s, b):
        sb = form(a)
        assert sb is not None and sb.dtype == mx.uint8 and sb.shape == (37, 64 * 3 // 2)
        assert np.array_equal(bits_of(scales.expand(sb)), a.view(np.uint32))
    if kind == "q4_k":
        assert (b.view(np.uint32) == 0x80000000).any()  # -0.0 biases were there to keep
    assert scales.factor(mx.array(s), None) is None  # no kernels: nothing would read the form


@needs_kernels
def test_values_with_no_superblock_form_are_left_as_they_are():
    rng = np.random.default_rng(1)
    assert form(rng.standard_normal((4, 64)).astype(np.float32)) is None
    s, _ = k_scales(rng, 4, 64, "q4_k")
    assert form(s[:, :60]) is None  # G not a multiple of 8
    assert form(mx.array(s).astype(mx.float16)) is None  # float16 scales stay (already 0.5 bits)
    mixed = s.copy()
    mixed[2, 9] = np.float32(0.1234567)  # one value off its superblock's steps
    assert form(mixed) is None and reference_form(mixed) is None
    zeros = np.zeros((2, 16), np.float32)
    zeros[1] = -0.0  # a superblock of +0.0 and one of -0.0: a step of that sign each
    got = form(zeros)
    assert got is not None and np.array_equal(bits_of(scales.expand(got)), zeros.view(np.uint32))
    zeros[1, 3] = 0.0  # +0.0 among -0.0: no one step gives both
    assert form(zeros) is None and reference_form(zeros) is None


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "tiny", "normal"])
def test_the_native_search_finds_what_the_reference_finds(kind):
    """kernels.superblocks (C++, what bind uses) and the numpy reference: the
    same form where there is one, and None alike where not."""
    rng = np.random.default_rng(5)
    arrays = (rng.standard_normal((6, 32)).astype(np.float32),) if kind == "normal" else k_scales(rng, 29, 32, kind)
    for a in arrays:
        mine, native = reference_form(a), form(a)
        assert (mine is None) == (native is None) == (kind == "normal")
        if mine is not None:
            assert np.array_equal(mine, np.array(native))
    with pytest.raises(ValueError, match="float32"):
        K.superblocks(mx.zeros((2, 8), mx.float16))
    if kind == "q4_k":  # a strided view reads as its copy
        a = mx.array(arrays[0])
        assert np.array_equal(np.array(K.superblocks(a[:, :16])), np.array(K.superblocks(mx.array(arrays[0][:, :16]))))


# Each held form's on/off variable (superblock scales; 5-bit blocks, adapters/lean/narrow.py): the form,
# what info says with it unset and with 0.
SETTINGS = [
    pytest.param(scales, "MLX_TRACER_SUPERBLOCKS", "k-quant scales as superblocks (MLX_TRACER_SUPERBLOCKS=0: float32)",
                 "k-quant scales float32 (MLX_TRACER_SUPERBLOCKS=0)", id="superblocks"),
    pytest.param(narrow, "MLX_TRACER_5BIT",
                 "5-bit integers (GGUF's Q5_K/Q5_0/Q5_1) in 5-bit blocks (MLX_TRACER_5BIT=0: 8-bit)",
                 "5-bit integers in 8-bit blocks (MLX_TRACER_5BIT=0)", id="5bit"),
]


@pytest.mark.parametrize("form,env,on,off", SETTINGS)
def test_the_setting_is_checked_and_info_says_which(monkeypatch, form, env, on, off):
    assert form.ENV == env
    monkeypatch.setenv(env, "0")
    assert not form.enabled()
    assert form.describe() == off
    monkeypatch.setenv(env, "yes")
    with pytest.raises(ValueError, match=f"{env}='yes': expected 1"):
        form.enabled()
    assert form.describe().startswith(f"{env}='yes': expected 1")
    monkeypatch.delenv(env)
    assert form.enabled() and form.describe() == on


@needs_kernels
@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
@pytest.mark.parametrize("contract", ["exact", "factored", "fast", "split"])
@pytest.mark.parametrize("bits,kind,Kd", [(4, "q4_k", 512), (8, "q6_k", 2048), (8, "q4_k", 256)])
def test_qmm_reads_superblock_scales_to_the_bits_of_float32_ones(isa, contract, bits, kind, Kd):
    """Every path and contract, decode rows, verify windows and the many-row
    (dequantized panel) path: the same bits as the float32 scales."""
    rng = np.random.default_rng(bits + Kd)
    N = 301
    s, b = (mx.array(a) for a in k_scales(rng, N, Kd // 32, kind))
    w = mx.array(rng.integers(0, 2 ** 32, (N, Kd * bits // 32), dtype=np.uint64).astype(np.uint32))
    ss, bb = form(s), form(b)
    with forced_isa(K, isa):
        for M in (1, 2, 3, 9, 70):
            x = mx.random.normal((M, Kd), key=mx.random.key(M))
            want = K.qmm(x, w, s, b, 32, bits, contract=contract)
            assert mx.array_equal(K.qmm(x, w, ss, bb, 32, bits, contract=contract), want).item(), (isa, M)


@needs_kernels
def test_qmm_refuses_superblock_scales_of_the_wrong_shape():
    rng = np.random.default_rng(3)
    s, b = (mx.array(a) for a in k_scales(rng, 8, 16, "q4_k"))
    w = mx.zeros((8, 512 * 4 // 32), mx.uint32)
    ss, bb = form(s), form(b)
    x = mx.zeros((1, 512))
    with pytest.raises(ValueError, match=r"superblock scales and biases must be \[N, K / group_size \* 3 / 2\]"):
        K.qmm(x, w, ss[:, :-4], bb[:, :-4], 32, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        K.qmm(mx.zeros((1, 128)), mx.zeros((8, 16), mx.uint32), ss[:, :6], bb[:, :6], 32, 4)
    with pytest.raises(ValueError, match="biases must have the scales' dtype"):
        K.qmm(x, w, ss, b, 32, 4)


def _mixed_model(tmp_path):
    path = tmp_path / "mixed.gguf"
    tiny_kquant_llama(path, seed=1, mixed=True)
    weights, meta = gguf.read_gguf(path)
    return gguf.build_model(weights, meta)


@needs_kernels
def test_the_lean_forward_holds_k_quant_scales_as_superblocks(tmp_path, monkeypatch):
    """The Q4_K_M-like model: every quantized group the kernels run holds
    uint8 superblock scales (the head too), the modules lazy float32 of the
    same bits; tokens equal the float32 scales' (MLX_TRACER_SUPERBLOCKS=0),
    the model's own forward still computes what it did, and a rebind (on the
    kernels or without them) keeps every value."""
    from mlx_tracer.runtime.step import CompiledModel

    from .test_lean import compiled_logits

    model = _mixed_model(tmp_path)
    before = {k: np.array(v) for k, v in _scale_arrays(model).items()}
    eager = model(mx.array([PROMPT]))
    monkeypatch.setenv(scales.ENV, "0")
    plain = CompiledModel(model, fuse=True)
    assert all(a.dtype == mx.float32 for p in plain.lean.buffers.values() for k, a in p.items() if k in ("scales", "biases"))
    want = compiled_logits(plain, PROMPT, 8)
    from mlx_tracer.bench.machine import model_costs

    f32_bytes = model_costs(model, plain.layout)["weight_bytes"]
    monkeypatch.setenv(scales.ENV, "1")
    lean = CompiledModel(model, fuse=True)
    bufs = lean.lean.buffers
    # the bench's weight bytes: the held superblocks at their own bytes (G * 3/2 a row, not float32's G * 4)
    saved = sum(a.size // 3 * 2 * 4 - a.nbytes for p in bufs.values() for k, a in p.items() if k in ("scales", "biases"))
    assert saved > 0 and model_costs(model, lean.layout)["weight_bytes"] == f32_bytes - saved
    assert set(bufs) >= {"qkv0.0", "qkv0.1", "gu0", "down0", "o1", "head"}  # layer 0: q/k, then v (0.5.33)
    assert all(p["scales"].dtype == mx.uint8 and p["biases"].dtype == mx.uint8 for p in bufs.values()), \
        {k: p["scales"].dtype for k, p in bufs.items()}
    held = [m for _, m in model.named_modules() if getattr(m, scales.ATTR, None) is not None]
    assert len(held) == 2 * 7 + 1
    got = compiled_logits(lean, PROMPT, 8)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    assert mx.array_equal(model(mx.array([PROMPT])), eager).item()  # the modules' own forward, on the lazy scales
    after = _scale_arrays(model)
    assert all(np.array_equal(bits_of(after[k]), v.view(np.uint32)) for k, v in before.items())
    again = CompiledModel(model, fuse=True)  # rebinding reuses the held form (the modules' arrays are its stand-ins)
    assert all(mx.array_equal(a, b).item() for a, b in zip(compiled_logits(again, PROMPT, 8), want))
    ops = CompiledModel(model, fuse=True)
    ops.lean.use_kernels(None)  # MLX's ops: the float32 values again
    assert ops.lean.buffers["qkv0.0"]["scales"].dtype == mx.float32
    assert [mx.argmax(a).item() for a in compiled_logits(ops, PROMPT, 8)] == [mx.argmax(a).item() for a in want]
    assert solo_tokens(model, PROMPT, 6) == [mx.argmax(a).item() for a in want[:6]]


def _scale_arrays(model):
    return {f"{n}.{k}": m[k] for n, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)
            for k in ("scales", "biases")}


@needs_kernels
def test_a_tied_head_reads_superblocks_and_its_lookups_gather_their_rows(tmp_path, monkeypatch):
    """Without an output tensor the Q4_K embedding is the head too: the head
    group holds superblock scales, and the embedding's lookups (the lean
    forward's and the model's own) widen the gathered rows' superblocks: the
    same tokens and logits as the float32 scales."""
    from mlx_tracer.loading.weights import apply_format
    from mlx_tracer.runtime.step import CompiledModel

    from .test_lean import compiled_logits

    path = tmp_path / "tied.gguf"
    tiny_kquant_llama(path, seed=2)
    weights, meta = gguf.read_gguf(path)
    for k in [k for k in weights if k.startswith("output.")]:
        weights.pop(k)
    model = apply_format(gguf.build_model(weights, meta), "quantized-split")
    assert model.args.tie_word_embeddings
    eager = model(mx.array([PROMPT]))
    monkeypatch.setenv(scales.ENV, "0")
    want = compiled_logits(CompiledModel(model, fuse=True), PROMPT, 8)
    monkeypatch.delenv(scales.ENV)
    lean = CompiledModel(model, fuse=True)
    assert lean.lean.buffers["head"]["scales"].dtype == mx.uint8
    assert scales.held_by(model.model.embed_tokens) is not None
    got = compiled_logits(lean, PROMPT, 8)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    assert mx.array_equal(model(mx.array([PROMPT])), eager).item()


@pytest.mark.parametrize("form,env,on,off", SETTINGS)
def test_load_model_checks_the_setting_before_the_path(tmp_path, monkeypatch, form, env, on, off):
    """A bad setting is refused before the model is looked at (the file
    here does not exist), and by the CLI with exit status 2."""
    import subprocess
    import sys

    from mlx_tracer.loading.load import load_model

    monkeypatch.setenv(env, "2")
    with pytest.raises(ValueError, match=f"{env}='2': expected 1"):
        load_model(tmp_path / "missing.gguf", progress=False, weights="as-is")
    run = subprocess.run([sys.executable, "-m", "mlx_tracer", "generate", "hi", "--model", str(tmp_path / "missing.gguf")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and f"{env}='2'" in run.stderr, (run.returncode, run.stderr[-500:])


@needs_kernels
@pytest.mark.parametrize("bits,group", [(6, 32), (4, 64)])
def test_a_format_qmm_does_not_take_keeps_its_float32_scales(bits, group):
    """Factorable float32 scales on a linear the kernels do not run (6 bits, or
    group 64: one superblock step would serve 512 weights) stay float32:
    mx.quantized_matmul reads them."""
    from mlx_tracer.adapters.lean.weights import LinearGroup

    rng = np.random.default_rng(7)
    lin = nn.QuantizedLinear(512, 64, bias=False, group_size=group, bits=bits)
    s, b = k_scales(rng, 64, 512 // group, "q4_k")
    lin.scales, lin.biases = mx.array(s), mx.array(b)
    x = mx.random.normal((2, 512), key=mx.random.key(0))
    want = lin(x)
    g = LinearGroup([lin], K.qmm, factor=K.superblocks)
    assert g.p["scales"].dtype == mx.float32 and scales.held_by(lin) is None
    assert (g.kernel is None) == (bits == 6)
    np.testing.assert_allclose(np.array(g(x)), np.array(want), rtol=1e-5, atol=1e-4)  # (qmm: sums in its order)
