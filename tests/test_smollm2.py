"""SmolLM2-135M-Instruct end to end through the compiled loop, against
mlx-lm's own stream_generate and batch_generate (greedy, token for token),
as loaded and in the formats the CPU runs by default (`quantized`, and
`quantized-factored` where qmm runs on AVX2, `quantized-split`: what `auto`
times)."""

from __future__ import annotations

import pytest

from mlx_tracer import Generator
from mlx_tracer.loading.store import resolve_model

from .helpers import FRANCE, SYSTEM, model_present

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smol():
    if not model_present():
        pytest.skip("SmolLM2 GGUF not present: run `mlx-tracer fetch` (or ./dev setup)")
    return Generator.load(resolve_model(), weights="as-is", system=SYSTEM)


@pytest.fixture(scope="module")
def packed():
    """SmolLM2 as the CPU runs it by default (the file's blocks on the native
    kernels, their exact contract; ~10x faster a step than MLX's own quantized
    matmul here)."""
    if not model_present():
        pytest.skip("SmolLM2 GGUF not present: run `mlx-tracer fetch` (or ./dev setup)")
    return Generator.load(resolve_model(), weights="quantized", system=SYSTEM)


@pytest.fixture(scope="module")
def factored():
    """The same blocks in qmm's factored contract (what ``auto`` picks where qmm runs on AVX2)."""
    if not model_present():
        pytest.skip("SmolLM2 GGUF not present: run `mlx-tracer fetch` (or ./dev setup)")
    return Generator.load(resolve_model(), weights="quantized-factored", system=SYSTEM)


@pytest.fixture(scope="module")
def split():
    """The same blocks in qmm's split contract (x in 15 bits, integer products; ``auto`` times it too)."""
    if not model_present():
        pytest.skip("SmolLM2 GGUF not present: run `mlx-tracer fetch` (or ./dev setup)")
    return Generator.load(resolve_model(), weights="quantized-split", system=SYSTEM)


def chat_ids(gen, text):
    return gen.encode(text)


def test_france_answer_matches_mlx_lm_stream_generate(smol):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    prompt = chat_ids(smol, FRANCE)
    ref = []
    for r in stream_generate(smol.model, smol.tokenizer, prompt, max_tokens=40, sampler=make_sampler(0.0)):
        if r.finish_reason != "stop":
            ref.append(r.token)
    uid = smol.submit(FRANCE, max_tokens=40)
    for _ in smol.events():
        pass
    out = smol.result(uid)
    assert "Paris" in out.text, out.text
    assert out.tokens == ref
    assert out.text.strip() == "The capital of France is Paris."


def test_four_prompts_match_mlx_lm_batch_generate(smol, packed, factored, split):
    """mlx-lm's batch_generate on the model as loaded (MLX's own quantized
    matmuls) against the loop as the CPU runs it by default (the file's blocks
    on the native kernels, their exact, factored and split contracts): the same
    greedy tokens. (The
    as-loaded format through the loop is checked against mlx-lm by the France
    test above; it costs as much as mlx-lm's run here, ~25 s.)"""
    from mlx_lm import batch_generate

    texts = [FRANCE, "Name three colors.", "Write a haiku about the sea.", "Hi"]
    prompts = [chat_ids(smol, t) for t in texts]
    assert len({len(p) for p in prompts}) == 4  # different lengths: left padding in the batch
    ref = batch_generate(smol.model, smol.tokenizer, prompts, max_tokens=16, return_token_ids=True)
    for gen in (packed, factored, split):
        before = dict(gen.traces)
        outs = gen.batch_generate(prompts, max_tokens=16)
        for o, want in zip(outs, ref.token_ids):
            assert o.tokens == want
        new = {k: n for k, n in gen.traces.items() if n != before.get(k, 0)}
        assert all(n == 1 for n in gen.traces.values()), gen.traces
        assert {k.width for k in new if k.kind == "decode"} <= {1, 2, 4}


def test_continuous_batching_on_smollm2_equals_solo_runs(factored):
    smol = factored
    texts = ["Name three colors.", "What is 2+2?", "Say hello in French."]
    solo = [smol.batch_generate([t], max_tokens=8)[0].tokens for t in texts]
    uids = {smol.submit(texts[0], max_tokens=8): 0}
    got, step = {}, 0
    for ev in smol.events():
        got.setdefault(uids[ev.uid], []).append(ev.token)
        step += 1
        if step == 3:
            uids[smol.submit(texts[1], max_tokens=8)] = 1
        if step == 7:
            uids[smol.submit(texts[2], max_tokens=8)] = 2
    for j in range(3):
        toks = got[j][:-1] if got[j][-1] in smol.tokenizer.eos_token_ids else got[j]
        assert toks == solo[j], f"request {j}"
    for u in uids:
        smol.result(u)
    assert all(n == 1 for n in smol.traces.values())


def test_speculative_decoding_on_smollm2_keeps_the_greedy_tokens(factored):
    """Prompt lookup, and SmolLM2 drafting for itself (the draft-model plumbing):
    the same greedy tokens as plain decoding, with drafts accepted (the
    factored contract, the default where qmm runs on AVX2)."""
    smol = factored
    text = "Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries."
    want = smol.batch_generate([text, FRANCE], max_tokens=12)
    for spec, k in (("prompt-lookup", 4), (smol.model, 2)):
        gen = Generator(smol.model, smol.tokenizer, system=SYSTEM, speculative=spec, draft_tokens=k,
                        spec_policy="always")
        got = gen.batch_generate([text, FRANCE], max_tokens=12)
        assert [c.tokens for c in got] == [c.tokens for c in want], spec
        assert gen.stats.verify_steps > 0 and gen.stats.accepted > 0, gen.summary()
