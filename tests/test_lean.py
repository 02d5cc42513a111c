"""The lean forward (mlx_tracer.adapters.lean): which models get it, that it
computes what the model's own forward computes (bit for bit where the
arithmetic is the same, within a stated tolerance for quantized matmuls), that
it follows weight swaps and module replacements, keeps memory flat, and that
its decode graph is smaller."""

from __future__ import annotations

import gc

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_tracer.adapters.lean import why_not
from mlx_tracer.runtime.engine import Engine
from mlx_tracer.runtime.step import CompiledModel

from .tiny_models import FAMILIES, tiny_model

LEAN = {"llama", "qwen3", "llama_mixed"}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 10], [3] * 12]


def tiny_qwen2():
    """A tiny qwen2 (biases on q/k/v, tied head)."""
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=101,
                           rope_theta=10000.0, tie_word_embeddings=True)
    mx.random.seed(3)
    model = qwen2.Model(args)
    model.update(nn.utils.tree_map(lambda w: w * 4 if w.ndim == 2 and w.shape[0] == 101 else w, model.parameters()))
    mx.eval(model.parameters())
    return model


def eager_logits(model, prompt, steps):
    """mlx-lm's eager prefill, then greedy decode: the logits of each decode step."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    out = []
    for _ in range(steps):
        tok = mx.argmax(logits, axis=-1)
        out.append(logits)
        logits = model(tok[:, None], cache=cache)[:, -1, :]
    return out


def compiled_logits(cm, prompt, steps):
    """The same through compiled window + decode steps (bucket 1)."""
    caches = cm.new_caches(1, rows=1)
    r = cm.step(caches, mx.array([prompt]), return_logits=True)
    logits, out = r.logits, []
    for _ in range(steps):
        out.append(logits)
        r = cm.step(caches, mx.argmax(logits, axis=-1)[:, None].astype(mx.int32), return_logits=True)
        logits = r.logits
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_which_families_get_the_lean_forward(family):
    model = tiny_model(family)
    cm = CompiledModel(model)
    assert (cm.lean is not None and cm.lean.active) == (family in LEAN), why_not(model)
    if family not in LEAN:
        with pytest.raises(ValueError, match="fuse=True"):
            CompiledModel(model, fuse=True)
    assert CompiledModel(model, fuse=False).lean is None


@pytest.mark.parametrize("family", sorted(LEAN))
def test_lean_logits_equal_mlx_lm_eager_bit_for_bit(family):
    model = tiny_model(family)
    ref = eager_logits(model, PROMPTS[0], 12)  # before the lean forward fused anything
    cm = CompiledModel(model, fuse=True)
    got = compiled_logits(cm, PROMPTS[0], 12)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert mx.array_equal(a, b), f"{family} step {i}: max diff {mx.abs(a - b).max().item()}"


def test_qwen2_biases_fuse_and_match_eager():
    model = tiny_qwen2()
    ref = eager_logits(model, PROMPTS[0], 8)
    cm = CompiledModel(model, fuse=True)
    assert "bias" in cm.lean.buffers["qkv0"]
    got = compiled_logits(cm, PROMPTS[0], 8)
    for a, b in zip(got, ref):
        assert np.allclose(np.array(a), np.array(b), atol=1e-5)
        assert mx.argmax(a).item() == mx.argmax(b).item()


def test_quantized_projections_fuse_within_tolerance_and_keep_greedy_tokens():
    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    plain = Engine(CompiledModel(model, fuse=False), buckets=(1, 2, 4))
    lean = Engine(CompiledModel(model, fuse=True), buckets=(1, 2, 4))
    assert "scales" in lean.compiled.lean.buffers["qkv0"]
    a = compiled_logits(plain.compiled, PROMPTS[0], 6)
    b = compiled_logits(lean.compiled, PROMPTS[0], 6)
    for x, y in zip(a, b):
        assert np.allclose(np.array(x), np.array(y), atol=1e-4), mx.abs(x - y).max().item()

    def tokens(eng):
        uids = [eng.add(p, max_tokens=10) for p in PROMPTS]
        out = {u: [] for u in uids}
        for ev in eng.run():
            out[ev.uid].append(ev.token)
        return [out[u] for u in uids]

    assert tokens(plain) == tokens(lean)


@pytest.mark.parametrize("family", sorted(LEAN))
def test_groups_of_mixed_formats_run_one_matmul_per_run_bit_for_bit(family):
    """A group whose members differ in format (here a float16 v_proj and
    up_proj beside float32 ones, as a GGUF Q4_K_M file's Q6_K tensors sit beside
    Q4_K) is served: one matmul per run that fuses, concatenated; the kernels
    take one weight per slot, so layer 1 runs on MLX's ops between native
    layers, and the logits equal mlx-lm's bit for bit."""
    model = tiny_model(family)
    layer = model.model.layers[1]
    layer.self_attn.v_proj.weight = layer.self_attn.v_proj.weight.astype(mx.float16)
    layer.mlp.up_proj.weight = layer.mlp.up_proj.weight.astype(mx.float16)
    mx.eval(model.parameters())
    assert why_not(model) is None
    ref = eager_logits(model, PROMPTS[0], 10)
    cm = CompiledModel(model, fuse=True)
    assert {"qkv1.0", "qkv1.1", "gu1.0", "gu1.1", "qkv0", "gu2"} <= set(cm.lean.buffers)
    assert cm.lean.buffers["qkv1.1"]["wt"].dtype == mx.float16
    if cm.lean.native is not None:
        assert cm.lean.native_off is None and list(cm.lean.ops_at) == [1], cm.lean.ops_at
        assert "qkv mixes formats (float32 + float16)" in cm.lean.ops_at[1] and "gu mixes formats" in cm.lean.ops_at[1]
        assert cm.lean.layers.name == "native (layers [1] on mlx-ops)"
    for i, (a, b) in enumerate(zip(compiled_logits(cm, PROMPTS[0], 10), ref)):
        assert mx.array_equal(a, b), f"{family} step {i}: max diff {mx.abs(a - b).max().item()}"


def test_partly_quantized_groups_keep_greedy_tokens_and_are_exact_on_mlx_ops():
    """q/k quantized beside a float v (layer 0), gate beside a float up (layer 1):
    the quantized runs on qmm (its contract: within tolerance, the same greedy
    tokens); layer 0 on the native kernels (q/k/v in two formats, since
    0.5.33), layer 1 on MLX's ops; without the kernels, on mx.quantized_matmul,
    bit for bit mlx-lm's."""
    model = tiny_model("llama")
    parts = ("layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.1.mlp.gate_proj")
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda path, m: path.endswith(parts))
    mx.eval(model.parameters())
    assert why_not(model) is None
    ref = eager_logits(model, PROMPTS[0], 8)
    lean = CompiledModel(model, fuse=True)
    qkv = lean.lean.binding.layers[0].qkv
    assert [len(r.mods) for r in qkv.runs] == [2, 1] and qkv.runs[0].quant == (32, 4, "affine")
    if lean.lean.native is not None:
        assert qkv.runs[0].kernel is not None and sorted(lean.lean.ops_at) == [1], lean.lean.ops_at
        assert "gu mixes formats" in lean.lean.ops_at[1]
    for a, b in zip(compiled_logits(lean, PROMPTS[0], 8), ref):
        assert np.allclose(np.array(a), np.array(b), atol=1e-4), mx.abs(a - b).max().item()
        assert mx.argmax(a).item() == mx.argmax(b).item()
    ops = CompiledModel(model, fuse=True)
    ops.lean.use_kernels(None)
    for a, b in zip(compiled_logits(ops, PROMPTS[0], 8), ref):
        assert mx.array_equal(a, b), mx.abs(a - b).max().item()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_sharded_model_runs_the_lean_forward_on_the_ops_layers(family):
    """mlx-lm's ``shard()`` (here over a group of one process: the sharded
    linears with an all-sum that sums one rank) is served: all-to-sharded
    linears fuse as Linear, each sharded-to-all one all-sums before its bias,
    on MLX's ops layers (the kernels add o/down into the residual stream);
    bit for bit the sharded model's own logits. 2 ranks: tests/test_distributed.py."""
    model = tiny_qwen2() if family == "qwen2" else tiny_model(family)
    model.shard(mx.distributed.init())
    mx.eval(model.parameters())
    assert type(model.model.layers[0].self_attn.o_proj) is nn.ShardedToAllLinear and why_not(model) is None
    ref = eager_logits(model, PROMPTS[0], 8)
    cm = CompiledModel(model, fuse=True)
    assert cm.lean.layers.name == "mlx-ops" and cm.lean.binding.layers[0].o.reduce is not None
    if cm.lean.native is not None:
        assert cm.lean.native_off.startswith("layer 0: sharded")
    for a, b in zip(compiled_logits(cm, PROMPTS[0], 8), ref):
        assert mx.array_equal(a, b), mx.abs(a - b).max().item()


def test_fusing_keeps_the_models_own_output_and_memory():
    model = tiny_model("llama")
    x = mx.array([PROMPTS[0]])
    before = model(x)
    mx.eval(before)
    mx.synchronize()
    gc.collect()  # other tests' models are not counted
    base = mx.get_active_memory()
    cm = CompiledModel(model, fuse=True)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (64, 64) and attn.k_proj.weight.shape == (32, 64)
    assert mx.array_equal(model(x), before)  # the modules hold views of the fused buffers: same values
    # no second copy of the fused weights stays alive (the originals were released): here
    # ~50 KB grow, against ~340 KB when the original q/k/v/gate/up arrays are kept
    fused_bytes = sum(a.nbytes for k, b in cm.lean.buffers.items() if k.startswith(("qkv", "gu")) for a in b.values())
    assert mx.get_active_memory() - base < 0.5 * fused_bytes


def test_swapped_weights_and_replaced_modules_rebuild_the_fused_buffers():
    model = tiny_model("llama", seed=0)
    cm = CompiledModel(model, fuse=True)
    caches = cm.new_caches(1, rows=1)
    a = cm.step(caches, mx.array([[5]]), return_logits=True).logits
    model.update(tiny_model("llama", seed=1).parameters())
    b = cm.step(cm.new_caches(1, rows=1), mx.array([[5]]), return_logits=True).logits
    assert not mx.array_equal(a, b)
    assert mx.array_equal(b, model(mx.array([[5]]))[:, -1, :])
    # the lean trace holds the weights as constants: the swap traced once more, then no more
    assert sum(cm.traces.values()) == 2
    with cm.no_new_traces():
        cm.step(cm.new_caches(1, rows=1), mx.array([[5]]), return_logits=True)
    # a module the lean forward calls itself (a norm), replaced: read from its new place
    norm = nn.RMSNorm(64, eps=1e-5)
    norm.weight = mx.random.uniform(0.5, 1.5, (64,), key=mx.random.key(3))
    model.model.layers[1].post_attention_layernorm = norm
    d = cm.step(cm.new_caches(1, rows=1), mx.array([[5]]), return_logits=True).logits
    assert not mx.array_equal(b, d) and mx.array_equal(d, model(mx.array([[5]]))[:, -1, :])
    nn.quantize(model, group_size=32, bits=4)  # modules replaced: rebuilt as quantized groups
    mx.eval(model.parameters())
    c = cm.step(cm.new_caches(1, rows=1), mx.array([[5]]), return_logits=True).logits
    assert "scales" in cm.lean.buffers["qkv0"]
    assert np.allclose(np.array(c), np.array(model(mx.array([[5]]))[:, -1, :]), atol=1e-4)


def test_a_model_that_stops_qualifying_falls_back_to_its_own_forward():
    model = tiny_model("llama")
    cm = CompiledModel(model, fuse=True)
    cm.step(cm.new_caches(1, rows=1), mx.array([[5]]))

    class Scaled(nn.Module):  # a projection wrapper the lean forward does not know
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x):
            return self.inner(x) * 0.5

    for layer in model.model.layers:
        layer.self_attn.o_proj = Scaled(layer.self_attn.o_proj)
    got = cm.step(cm.new_caches(1, rows=1), mx.array([[5]]), return_logits=True).logits
    assert not cm.lean.active
    assert mx.array_equal(got, model(mx.array([[5]]))[:, -1, :])


def test_window_logits_at_last_equal_the_model_path():
    model = tiny_model("llama_mixed")
    lean, plain = CompiledModel(model, fuse=True), CompiledModel(model, fuse=False)
    last = mx.array([6, 1, 3, 0], dtype=mx.int32)
    toks = mx.array([[1, 2, 3, 4, 5, 6, 7], [9, 10, 0, 0, 0, 0, 0], [3, 3, 3, 3, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0]], dtype=mx.int32)
    outs = []
    for cm in (lean, plain):
        caches = cm.new_caches(4, rows=4)
        outs.append(cm.step(caches, toks, return_logits=True, last=last).logits)
    assert outs[0].shape == (4, 101)
    assert np.allclose(np.array(outs[0]), np.array(outs[1]), atol=1e-5)


def test_the_lean_decode_graph_is_smaller(tmp_path):
    # 3 layers, before compile's fusion: 461 nodes on the model's forward, 256 on the lean one
    lean = sum(CompiledModel(tiny_model("llama"), fuse=True).export_decode_graph(str(tmp_path / "l.dot")).values())
    plain = sum(CompiledModel(tiny_model("llama"), fuse=False).export_decode_graph(str(tmp_path / "p.dot")).values())
    assert lean < 0.6 * plain, (lean, plain)
