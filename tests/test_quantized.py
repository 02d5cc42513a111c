"""The ``quantized`` weight format: the quantized linears keep the file's
blocks, the residual stream is float32, and the lean forward's matmuls run on
the native quantized matmul (``qmm``, the *exact* contract: each weight
dequantized in float32, float32 sums). The oracle is mlx-lm's own eager
decode of the same model (``mx.quantized_matmul``): greedy tokens equal, in
buckets and with continuous batching, on tiny models and on SmolLM2's file."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_tracer.backend import kernels
from mlx_tracer.loading.quant import float32_activations
from mlx_tracer.loading.weights import CONTRACTS, apply_format
from mlx_tracer.runtime.engine import Engine
from mlx_tracer.runtime.step import CompiledModel

from .helpers import FRANCE, model_present
from .test_lean import eager_logits
from .tiny_models import tiny_model

K = kernels.load()
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 10], [3] * 12]


def quantized_tiny(family: str, group_size: int, bits: int, scales=mx.float16):
    """A tiny model quantized as a GGUF file loads: blocks with ``scales``-typed
    scales and biases (float16, as GGUF stores them), then the quantized format."""
    model = tiny_model(family)
    nn.quantize(model, group_size=group_size, bits=bits)
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            m.scales, m.biases = m.scales.astype(scales), m.biases.astype(scales)
    return float32_activations(model)


def eager_greedy(model, prompt, steps):
    """mlx-lm's greedy tokens (and the last step's logits), from test_lean's eager loop."""
    logits = eager_logits(model, prompt, steps + 1)  # the last: after the steps-th token
    return [mx.argmax(x, axis=-1).item() for x in logits[:steps]], logits[-1]


def engine_tokens(engine, prompts, max_tokens):
    uids = [engine.add(p, max_tokens=max_tokens) for p in prompts]
    out = {u: [] for u in uids}
    for ev in engine.run():
        if ev.token is not None:
            out[ev.uid].append(ev.token)
    return [out[u] for u in uids]


def test_the_format_keeps_the_blocks_and_makes_the_rest_float32():
    model = quantized_tiny("llama", 32, 4)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and attn.q_proj.scales.dtype == mx.float16
    assert model.model.layers[0].input_layernorm.weight.dtype == mx.float32
    assert model.model.embed_tokens(mx.array([[1, 2]])).dtype == mx.float32


def test_the_fast_format_runs_every_quantized_matmul_in_the_fast_contract(tmp_path):
    """``quantized-fast``: the same blocks, qmm's fast contract in the layer
    kernels and for the head (int8 activations: its own values, close to
    exact; their KL is measured by benchmarks/qmm_kl.py, not asserted here)."""
    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    apply_format(model, "quantized-fast")
    cm = CompiledModel(model)
    graph = cm.export_decode_graph(str(tmp_path / "g.dot"))
    assert cm.lean.binding.contract == "fast" and cm.lean.native_off is None
    assert graph["TracerLayerIn"] == len(model.layers) and graph["TracerQmmFast"] == 2 and "TracerQmm" not in graph
    fast = engine_tokens(Engine(cm, buckets=(2,)), PROMPTS[:2], 6)
    apply_format(model, "quantized")  # back to exact: rebinds, same blocks
    exact = CompiledModel(model)
    assert exact.lean.binding.contract == "exact" and [len(t) for t in fast] == [6, 6]


@pytest.mark.parametrize("fmt", ["quantized", "quantized-factored", "quantized-split"])
@pytest.mark.parametrize("family,group_size,bits", [("llama", 32, 4), ("llama", 64, 8), ("qwen3", 32, 4),
                                                    ("llama_mixed", 64, 4)])
def test_greedy_tokens_equal_mlx_lm_eager_on_the_quantized_model(family, group_size, bits, fmt):
    """qmm's exact contract, its factored one and its split one (the
    formats ``auto`` times where qmm runs on AVX2): mlx-lm's greedy tokens,
    in buckets."""
    model = apply_format(quantized_tiny(family, group_size, bits), fmt)
    cm = CompiledModel(model, fuse=True)
    assert cm.lean.binding.contract == CONTRACTS[fmt]
    spec = cm.lean.binding.layers[0]
    assert all(g.kernel is not None for g in spec.groups().values()), "the lean groups must run on qmm"
    assert cm.lean.binding.head is not None and cm.lean.binding.head.kernel is not None
    engine = Engine(cm, buckets=(1, 2, 4))
    got = engine_tokens(engine, PROMPTS, 10)
    for prompt, toks in zip(PROMPTS, got):
        ref, _ = eager_greedy(model, prompt, 10)
        assert toks == ref, (family, prompt)
    with cm.no_new_traces():  # the same shapes again: replayed
        assert engine_tokens(engine, PROMPTS, 10) == got


def tied_quantized_llama(scales, bits=4):
    """A tiny llama whose output head is its quantized embedding (as SmolLM2's file), quantized_tiny's way."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=101,
                           tie_word_embeddings=True)
    model = llama.Model(args)
    mx.eval(model.parameters())
    nn.quantize(model, group_size=32, bits=bits)
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            m.scales, m.biases = m.scales.astype(scales), m.biases.astype(scales)
    return float32_activations(model)


@pytest.mark.parametrize("scales", [mx.float16, mx.bfloat16])
def test_the_embedding_keeps_its_stored_scales_and_gives_float32_rows_and_head(scales):
    """The quantized format keeps a quantized embedding's scales as stored (the
    tied head streams them every step) and widens them as it reads: rows and
    head products equal those of float32 copies of the scales, bit for bit,
    on MLX's ops and on qmm."""
    model = tied_quantized_llama(scales)
    e = model.model.embed_tokens
    assert e.scales.dtype == scales and e.biases.dtype == scales
    s32, b32 = e.scales.astype(mx.float32), e.biases.astype(mx.float32)
    ids = mx.array([[0, 5, 3, 100]])
    rows = e(ids)
    assert rows.dtype == mx.float32
    assert mx.array_equal(rows, mx.dequantize(e.weight[ids], s32[ids], b32[ids], group_size=32, bits=4)).item()
    x = mx.random.normal((3, 64), key=mx.random.key(1))
    want = mx.quantized_matmul(x, e.weight, s32, b32, transpose=True, group_size=32, bits=4)
    assert mx.array_equal(e.as_linear(x), want).item()
    cm = CompiledModel(model, fuse=True)
    head = cm.lean.binding.head
    assert head is not None and head.p["scales"].dtype == scales  # no float32 copy for the head to stream
    if K is not None:
        assert head.kernel is not None
        for contract in ("exact", "fast"):
            head.contract = contract
            ref = K.qmm(x, e.weight, s32, b32, 32, 4, contract=contract)
            assert mx.array_equal(head(x), ref).item(), contract
        head.contract = "exact"
    ops = CompiledModel(model, fuse=True)
    ops.lean.use_kernels(None)
    assert mx.array_equal(ops.lean.binding.logits(x), want).item()  # MLX's ops: the widened scales' matmul
    tokens, _ = eager_greedy(model, PROMPTS[0], 6)
    assert engine_tokens(Engine(cm, buckets=(1, 2)), [PROMPTS[0]], 6) == [tokens]


def test_an_embedding_head_qmm_does_not_take_keeps_its_float32_arithmetic(monkeypatch):
    """3-bit blocks, not repacked (the repack of MLX's 2-/3-/5-/6-bit blocks
    for qmm declined, as where no kernel takes a format): the lean forward
    leaves the tied head to the module, whose matmul runs on the widened
    scales (bits of float32 ones)."""
    from mlx_tracer.adapters.lean import narrow

    monkeypatch.setattr(narrow, "TO", {8: 5})
    model = tied_quantized_llama(mx.float16, bits=3)
    e = model.model.embed_tokens
    cm = CompiledModel(model, fuse=True)
    assert cm.lean.binding.head is None
    x = mx.random.normal((3, 64), key=mx.random.key(2))
    want = mx.quantized_matmul(x, e.weight, e.scales.astype(mx.float32), e.biases.astype(mx.float32), transpose=True,
                               group_size=32, bits=3)
    assert mx.array_equal(cm.lean.binding.logits(x), want).item()


def test_logits_stay_within_the_contract_of_mlx_lm():
    """The logits of a compiled decode equal mlx-lm's up to the summation order
    and MLX's float16 rounding of dequantized weights (mx.quantized_matmul
    dequantizes fp16 scales in fp16; qmm in float32)."""
    model = quantized_tiny("llama", 32, 4)
    _, ref = eager_greedy(model, PROMPTS[0], 6)
    cm = CompiledModel(model, fuse=True)
    caches = cm.new_caches(1, rows=1)
    r = cm.step(caches, mx.array([PROMPTS[0]]), return_logits=True)
    logits = r.logits
    for _ in range(6):
        logits = cm.step(caches, mx.argmax(logits, axis=-1)[:, None].astype(mx.int32), return_logits=True).logits
    scale = float(mx.abs(ref).max())
    assert np.allclose(np.array(logits), np.array(ref), atol=2e-3 * scale), float(mx.abs(logits - ref).max())


def test_without_kernels_the_format_runs_mlx_ops_with_the_same_tokens():
    model = quantized_tiny("llama", 32, 4)
    lean = CompiledModel(model, fuse=True)
    ops = CompiledModel(model, fuse=True)
    ops.lean.use_kernels(None)
    assert ops.lean.binding.layers[0].qkv.kernel is None
    a = engine_tokens(Engine(lean, buckets=(1, 2, 4)), PROMPTS, 8)
    b = engine_tokens(Engine(ops, buckets=(1, 2, 4)), PROMPTS, 8)
    assert a == b


def test_float16_activations_do_not_use_qmm():
    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    model.set_dtype(mx.float16)
    cm = CompiledModel(model, fuse=True)
    assert cm.lean.binding.layers[0].qkv.kernel is None  # qmm takes float32 x only


@pytest.mark.model
@pytest.mark.parametrize("fmt", ["quantized", "quantized-factored", "quantized-split"])
def test_smollm2_in_the_quantized_format_answers_as_mlx_lm_does(fmt):
    if not model_present():
        pytest.skip("SmolLM2 GGUF not present: run `mlx-tracer fetch` (or ./dev setup)")
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from mlx_tracer import Generator
    from mlx_tracer.loading.store import resolve_model

    gen = Generator.load(resolve_model(), weights=fmt)
    assert gen.engine.compiled.lean.binding.layers[0].qkv.kernel is not None
    prompt = gen.encode(FRANCE)
    ref = [r.token for r in stream_generate(gen.model, gen.tokenizer, prompt, max_tokens=24, sampler=make_sampler(0.0))
           if r.finish_reason != "stop"]
    uid = gen.submit(FRANCE, max_tokens=24)
    for _ in gen.events():
        pass
    out = gen.result(uid)
    assert out.tokens == ref
    assert out.text.strip() == "The capital of France is Paris."
