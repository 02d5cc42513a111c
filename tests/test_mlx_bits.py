"""MLX's own 2-, 3-, 5- and 6-bit models (``mlx_lm.convert --q-bits B``)
on the native kernels: their blocks repacked when the lean forward binds
(adapters/lean/narrow.py) into qmm's 5- and 6-bit layouts, or MLX's 4-bit
one for 2 and 3 bits.

The oracles: mx.quantize / mx.dequantize for the bit stream MLX stores
(:func:`narrow.mlx_integers` and :func:`narrow.mlx_pack` read and write it),
the same integers as 8-bit blocks for the kernels' results (bit for bit:
the layouts' contract), and mlx-lm's eager decode of the model
(mx.quantized_matmul) for the greedy tokens, in buckets and with continuous
batching."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_tracer.adapters.lean import narrow
from mlx_tracer.adapters.lean.weights import LinearGroup
from mlx_tracer.backend import kernels
from mlx_tracer.loading.weights import apply_format
from mlx_tracer.runtime.engine import Engine
from mlx_tracer.runtime.step import CompiledModel

from .test_lean import compiled_logits
from .test_quantized import PROMPTS, eager_greedy, engine_tokens, quantized_tiny, tied_quantized_llama

K = kernels.load()
needs_kernels = pytest.mark.skipif(K is None, reason=f"native kernels unavailable: {kernels.status()}")
PROMPT = [1, 5, 9, 17, 33, 65]


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_the_bit_stream_is_what_mx_quantize_writes_and_mx_dequantize_reads(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, (7, 256)).astype(np.uint8)
    w = narrow.mlx_pack(mx.array(q), bits)
    assert w.dtype == mx.uint32 and w.shape == (7, 256 * bits // 32)
    ones, zeros = mx.ones((7, 8)), mx.zeros((7, 8))
    assert np.array_equal(np.array(mx.dequantize(w, ones, zeros, group_size=32, bits=bits)), q.astype(np.float32))
    assert np.array_equal(np.array(narrow.mlx_integers(w, bits)), q)
    x = mx.array(rng.normal(size=(5, 128)).astype(np.float32))
    packed, s, b = mx.quantize(x, group_size=32, bits=bits)
    ints = narrow.mlx_integers(packed, bits).astype(mx.float32).reshape(5, 4, 32)
    assert mx.array_equal(ints * s[..., None] + b[..., None], mx.dequantize(packed, s, b, group_size=32, bits=bits).reshape(5, 4, 32)).item()
    assert mx.array_equal(narrow.mlx_pack(narrow.mlx_integers(packed, bits), bits), packed).item()


def _mk(make: str, bits: int):
    if make == "tied":  # the head is the embedding (as SmolLM2's): its lookups and its matmul
        mx.random.seed(7)
        return tied_quantized_llama(mx.bfloat16, bits)
    return quantized_tiny("llama", 64, bits, scales=mx.bfloat16)


def as_blocks(model, to: int):
    """``model`` with each module's integers as MLX's ``to``-bit blocks (the same values)."""
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.bits != to:
            q = narrow.mlx_integers(m.weight, m.bits)
            m.weight, m.bits = (mx.view(q, mx.uint32) if to == 8 else narrow.nibbles(q)), to
    return model


def _group_bits(cm):
    return {f"{n}{s.index}": g.bits for s in cm.lean.binding.layers for n, g in s.groups().items()}


@needs_kernels
@pytest.mark.parametrize("fmt", ["quantized", "quantized-factored", "quantized-split"])
@pytest.mark.parametrize("make", ["llama", "tied"])
@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_mlx_2_3_5_and_6_bit_models_run_on_the_kernels_in_qmm_layouts(bits, make, fmt):
    """Every projection and the head hold qmm's layout of the model's bits
    (2 and 3: MLX's 4-bit blocks), every layer on the native kernels; the
    logits equal those of the same integers as 8-bit blocks bit for bit
    (2 and 3 bits: as 4-bit blocks, what the group holds: the exact and
    factored contracts sum 4-bit blocks in another order than 8-bit ones);
    the model's own forward (mlx-lm's, on the modules' lazy stand-ins) is
    unchanged; its weights' integers too."""
    model = apply_format(_mk(make, bits), fmt)
    ints = {n: np.array(narrow.mlx_integers(m.weight, bits)) for n, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    eager = model(mx.array([PROMPT]))
    cm = CompiledModel(model, fuse=True)
    assert cm.lean.native_off is None and not cm.lean.ops_at
    held_bits = narrow.TO[bits]
    assert set(_group_bits(cm).values()) == {held_bits} and cm.lean.binding.head.bits == held_bits
    assert cm.lean.binding.head.kernel is not None
    held = [m for _, m in model.named_modules() if narrow.held_by(m) is not None]
    assert len(held) == 7 * len(model.layers) + 1  # q, k, v, o, gate, up, down a layer; the head (or tied embedding)
    # the same bits a weight in either layout; 2 and 3 bits: 4 a weight
    assert all(narrow.bytes_saved(m) == m.weight.nbytes * (bits - held_bits) // bits for m in held)
    got = compiled_logits(cm, PROMPT, 6)
    twin = apply_format(as_blocks(_mk(make, bits), 8 if held_bits > 4 else 4), fmt)
    want = compiled_logits(CompiledModel(twin, fuse=True), PROMPT, 6)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    assert mx.array_equal(model(mx.array([PROMPT])), eager).item()  # the modules' own forward, on the stand-ins
    for n, m in model.named_modules():
        if n in ints:
            assert np.array_equal(np.array(narrow.mlx_integers(m.weight, bits)), ints[n]), n


@needs_kernels
@pytest.mark.parametrize("bits", [3, 6])
def test_greedy_tokens_equal_mlx_lm_eager_on_the_3_and_6_bit_model(bits):
    """The oracle: mlx-lm's eager greedy decode of the model as stored, in
    buckets and with rows joining a running batch."""
    model = apply_format(_mk("tied", bits), "quantized-split")
    refs = [eager_greedy(model, p, 10)[0] for p in PROMPTS]
    cm = CompiledModel(model, fuse=True)
    assert _group_bits(cm)["gu0"] == narrow.TO[bits]
    engine = Engine(cm, buckets=(1, 2, 4))
    assert engine_tokens(engine, PROMPTS, 10) == refs
    plan = [(0, 0), (0, 1), (2, 2)]  # (arrival step, prompt): the third joins a running batch
    uids, got, step = {}, {}, 0
    while step < 60 and (engine.has_work() or len(uids) < len(plan)):
        for at, j in plan:
            if at == step:
                uids[engine.add(PROMPTS[j], max_tokens=10)] = j
        for ev in engine.step():
            got.setdefault(uids[ev.uid], []).append(ev.token)
        step += 1
    assert [got[j] for j in range(3)] == refs
    assert engine.stats.joins >= 1

@needs_kernels
def test_without_the_kernels_or_where_qmm_declines_the_blocks_stay_mlx_s():
    """No kernels: nothing repacked (mx.quantized_matmul reads MLX's layout);
    scales and biases of different dtypes (qmm takes one): the group keeps
    its module's blocks and computes what the module does."""
    model = apply_format(_mk("llama", 6), "quantized")
    ops = CompiledModel(model, fuse=True)
    ops.lean.use_kernels(None)
    assert ops.lean.buffers["gu0"]["weight"].shape[1] * 32 == 6 * 64  # K = 64 at 6 bits: MLX's own blocks
    lin = nn.QuantizedLinear(256, 64, bias=False, group_size=64, bits=6)
    lin.scales = lin.scales.astype(mx.float16)
    x = mx.random.normal((3, 256), key=mx.random.key(1))
    want = lin(x)
    g = LinearGroup([lin], K.qmm, narrow=K.narrow)
    assert g.kernel is None and g.bits == 6 and not g.narrowed and narrow.held_by(lin) is None
    assert mx.array_equal(g(x), want).item()


@needs_kernels
def test_a_6_bit_mlx_lm_folder_loads_onto_the_kernels(tmp_path):
    """As a user has it: an mlx-lm folder of a 6-bit model (its config's
    ``quantization``), loaded by the API in the split format; the groups hold
    qmm's 6-bit layout and the greedy text is mlx-lm's own on that folder."""
    from mlx_lm.utils import load as mlx_lm_load

    from mlx_tracer import api

    from .helpers import write_model_dir
    from .tiny_models import _config, tiny_model

    model = tiny_model("llama")
    nn.quantize(model, group_size=64, bits=6)
    cfg = dict(_config("llama"), quantization={"group_size": 64, "bits": 6})
    path = write_model_dir(model, cfg, tmp_path / "six")
    ours, _ = api.load(path, progress=False, weights="quantized-split")
    cm = CompiledModel(ours, fuse=True)
    assert set(_group_bits(cm).values()) == {6} and cm.lean.native_off is None
    ref_model, _ = mlx_lm_load(str(path))
    refs = [eager_greedy(ref_model, p, 8)[0] for p in PROMPTS]
    assert engine_tokens(Engine(cm, buckets=(1, 2, 4)), PROMPTS, 8) == refs
