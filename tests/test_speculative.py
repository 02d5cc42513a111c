"""Batched, compiled speculative decoding on tiny models: greedy output equal
to plain decoding token for token (full caches, rings after they wrapped, a
mixed model), one verify trace per (bucket, k), the sampling rule's output
distribution, and clear errors for bad settings."""

from __future__ import annotations

import contextlib
import copy

import mlx.core as mx
import numpy as np
import pytest

from mlx_tracer import CompiledModel, Generator
from mlx_tracer.runtime.drafters import PromptLookup
from mlx_tracer.runtime.engine import Engine
from mlx_tracer.runtime.sampling import GREEDY, SamplingParams, initial_key, sampler_inputs
from mlx_tracer.runtime.speculative import accept

from .helpers import IdTokenizer
from .tiny_models import SLIDE, VOCAB, tiny_model

# prompts that repeat themselves, so prompt lookup finds drafts; one without
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 9, 3], list(range(1, 30)) * 2, [4], [11, 12, 13, 11, 12]]
ARRIVALS = [0, 0, 3, 7, 12]  # steps at which the requests join


def _run(model, arrivals=ARRIVALS, budget=40, **kw):
    if "speculative" in kw:
        kw.setdefault("spec_policy", "always")  # exercise verify steps whenever there are drafts
    eng = Engine(model, buckets=(1, 2, 4), prefill_chunks=(8, 16), **kw)
    out, uids, step = {}, [], 0
    pending = list(zip(arrivals, PROMPTS))
    while pending or eng.has_work():
        while pending and pending[0][0] <= step:
            uid = eng.add(pending.pop(0)[1], max_tokens=budget)
            uids.append(uid)
            out[uid] = []
        for ev in eng.step():
            out[ev.uid].append(ev.token)
        step += 1
    return [out[u] for u in uids], eng


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "llama_mixed", "ring_only", "qwen3"])
def test_greedy_speculative_equals_plain_decoding_with_continuous_batching(family):
    model = tiny_model(family)
    plain, _ = _run(model)
    spec, eng = _run(model, speculative="prompt-lookup", draft_tokens=4)
    assert spec == plain
    st = eng.stats
    assert st.verify_steps > 0 and 0 < st.accepted < st.drafted  # drafts were both kept and refused
    traces = eng.compiled.traces
    assert all(n == 1 for n in traces.values()), traces
    verify = [k for k in traces if k.kind == "verify"]
    assert {k.length for k in verify} == {5}  # one window length: k + 1
    if family == "ring_only":  # rings: one verify trace per bucket, whatever the context
        assert len(verify) == len({k.width for k in verify})


def test_ring_rollback_after_the_ring_wrapped_is_exact():
    """A ring of SLIDE columns, 60 tokens: verify windows refuse drafts long
    after the ring wrapped, and every token still equals plain decoding."""
    model = tiny_model("ring_only")
    plain, _ = _run(model, budget=60)
    spec, eng = _run(model, budget=60, speculative="prompt-lookup", draft_tokens=3)
    assert spec == plain
    ring = eng.compiled.new_caches(1)[0]
    assert ring.max_size == SLIDE and 60 > 4 * SLIDE
    assert eng.stats.drafted - eng.stats.accepted > 5


def test_no_new_traces_while_rows_switch_between_plain_and_verify_steps():
    cm = CompiledModel(tiny_model("llama_mixed"))
    _run(cm, speculative="prompt-lookup", draft_tokens=4)  # traces every key the second run uses
    with cm.no_new_traces():
        _, again = _run(cm, speculative="prompt-lookup", draft_tokens=4)
    assert again.stats.verify_steps > 0 and again.stats.steps > 0  # both kinds of step ran


def test_the_sampling_rule_keeps_the_target_distribution():
    """Speculative sampling with a one-hot draft: the first emitted token is
    distributed as the target's (filtered, tempered) distribution, whatever
    the draft (accepted with probability p(draft)), and an accepted draft is
    followed by a draw from the next one."""
    V, N = 6, 1500
    logits = mx.array([[1.0, 0.5, 0.0, -0.5, 2.0, -3.0], [0.0, 1.5, 0.3, 0.2, -1.0, 0.4]])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [2, V]
    params = SamplingParams(temperature=0.8, top_k=5)
    s = sampler_inputs([params] * N, [initial_key(i) for i in range(N)], N)
    lp = mx.broadcast_to(logprobs[None], (N, 2, V))
    for draft in (4, 1, 5):
        tokens = mx.array(np.tile([[0, draft]], (N, 1)).astype(np.int32))
        emitted, count, _, keys = accept(lp, tokens, mx.ones((N,), dtype=mx.int32), s)
        want = np.array(mx.softmax(_filtered(logprobs[0], params), axis=-1))
        got = np.bincount(np.array(emitted[:, 0]), minlength=V) / N
        assert np.abs(got - want).sum() / 2 < 0.06, (draft, got, want)
        took = np.array(count) == 2
        assert abs(took.mean() - want[draft]) < 0.05  # accepted with probability p(draft)
        if took.sum() > 150:  # after an accepted draft: the bonus follows the second distribution
            want2 = np.array(mx.softmax(_filtered(logprobs[1], params), axis=-1))
            got2 = np.bincount(np.array(emitted[:, 1])[took], minlength=V) / took.sum()
            assert np.abs(got2 - want2).sum() / 2 < 0.1
    assert keys.shape == (N, 2)


def _filtered(logprobs, p: SamplingParams):
    from mlx_tracer.runtime.sampling import filtered_logits

    s = sampler_inputs([p], [initial_key(0)], 1)
    return filtered_logits(logprobs[None], s)[0]


def test_sampled_speculative_tokens_equal_plain_sampling_for_the_same_seed():
    """The draws are the plain sampler's own, coupled by position: with or
    without speculation, alone or beside neighbours, a seed gives the same tokens."""
    model = tiny_model("llama")
    opts = dict(max_tokens=24, temp=0.9, top_k=20)
    plain = Generator(model, IdTokenizer(), chat=False)
    want = [c.tokens for c in plain.batch_generate([PROMPTS[0], PROMPTS[2]], seed=7, **opts)]
    spec = Generator(model, IdTokenizer(), chat=False, speculative="prompt-lookup", draft_tokens=3, spec_policy="always")
    got = [c.tokens for c in spec.batch_generate([PROMPTS[0], PROMPTS[2]], seed=7, **opts)]
    alone = spec.batch_generate([PROMPTS[2]], seed=7, **opts)[0].tokens  # without its neighbour
    assert got == want and alone == want[1]
    assert spec.stats.verify_steps > 0 and spec.stats.accepted > 0 and "speculative:" in spec.summary()


def test_greedy_rows_in_a_sampled_batch_stay_greedy():
    model = tiny_model("llama")
    plain, _ = _run(model, arrivals=[0, 0, 0, 0, 0])
    eng = Engine(model, buckets=(1, 2, 4, 8), prefill_chunks=(8, 16), speculative="prompt-lookup", draft_tokens=4,
                 spec_policy="always")
    uids = [eng.add(p, max_tokens=40, sampling=GREEDY) for p in PROMPTS]
    hot = eng.add(PROMPTS[0], max_tokens=40, sampling=SamplingParams(temperature=1.0, seed=3))
    out = {u: [] for u in uids + [hot]}
    for ev in eng.run():
        out[ev.uid].append(ev.token)
    assert [out[u] for u in uids] == plain


def test_the_policy_does_not_time_a_step_that_traced():
    """The first step of a kind traces (and builds kernels): timing it would
    make verify look many times dearer than it is and the auto policy would
    never verify again (benchmarks/speculative.py read 9.5x)."""
    eng = Engine(tiny_model("llama"), buckets=(1,), prefill_chunks=(8, 16), speculative="prompt-lookup", draft_tokens=4)
    eng.add([5, 6, 7, 5, 6], max_tokens=8)
    traces = eng.compiled.trace_count
    eng.step()  # admission, then the first decode step: it traces
    assert eng.compiled.trace_count > traces and ("decode", 1) not in eng.speculator.step_s
    traces = eng.compiled.trace_count
    eng.step()
    assert eng.compiled.trace_count == traces and ("decode", 1) in eng.speculator.step_s


def test_prompt_lookup_proposes_what_followed_the_newest_match():
    d = PromptLookup(ngram=3)
    assert d.propose([1, 2, 3, 4, 5, 1, 2, 3], 2) == [4, 5]
    assert d.propose([1, 2, 9, 1, 2, 7, 1, 2], 3) == [7, 1, 2]  # newest match first
    assert d.propose([1, 2, 3], 4) == []
    assert d.propose([7, 7], 3) == [7]


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(speculative="prompt-lookup", draft_tokens=0), ValueError, "draft_tokens"),
        (dict(speculative="prompt-lookup", draft_tokens=1.5), TypeError, "draft_tokens"),
        (dict(speculative="prompt-lookup", draft_tokens=16), ValueError, "draft_tokens must be in \\[1, 15\\]"),
        (dict(speculative="medusa"), ValueError, "'prompt-lookup' or"),
        (dict(speculative=3), TypeError, "speculative"),
    ],
)
def test_bad_speculative_settings_get_clear_errors_before_loading(kwargs, error, words):
    with pytest.raises(error, match=words):
        Generator.load("/nonexistent/model.gguf", prefill_chunks=(8, 16), **kwargs)
    with pytest.raises(error, match=words):
        Engine(tiny_model("llama"), prefill_chunks=(8, 16), **kwargs)


@pytest.mark.parametrize("draft_seed, family", [(0, "llama"), (5, "llama"), (0, "llama_mixed")])
def test_a_draft_model_keeps_greedy_output_equal(draft_seed, family):
    """The target drafting for itself (seed 0: every draft accepted) and a
    different random model (seed 5: most refused): tokens equal plain decoding."""
    model = tiny_model(family)
    plain, _ = _run(model)
    draft = tiny_model(family, seed=draft_seed)
    spec, eng = _run(model, speculative=draft, draft_tokens=3)
    assert spec == plain
    st = eng.stats
    assert st.verify_steps > 0
    if draft_seed == 0:  # rings roll the draft back approximately after a wrap (see DraftModel)
        assert st.acceptance > (0.95 if family == "llama" else 0.75) and st.tokens_per_verify > 2
    else:
        assert st.accepted < st.drafted


def test_a_draft_model_with_another_vocabulary_is_refused():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=VOCAB + 5)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        Engine(tiny_model("llama"), speculative=llama.Model(args))


def test_generator_loads_a_draft_model_from_a_path(tmp_path):
    from .helpers import save_model_dir

    target_dir, draft_dir = save_model_dir(tmp_path / "target", "llama"), save_model_dir(tmp_path / "draft", "llama", seed=0)
    gen = Generator.load(str(target_dir), weights="as-is", speculative=str(draft_dir), draft_tokens=3, chat=False,
                         spec_policy="always")
    plain = Generator.load(str(target_dir), weights="as-is", chat=False)
    prompt = PROMPTS[2]
    assert gen.batch_generate([prompt], max_tokens=12)[0].tokens == plain.batch_generate([prompt], max_tokens=12)[0].tokens
    assert gen.stats.verify_steps > 0 and gen.stats.acceptance > 0.9


def test_the_auto_policy_verifies_only_when_it_pays():
    """The rule on given step times: expected tokens per second of a verify
    step against a plain step's, per row acceptance; rows recover toward the prior."""
    from mlx_tracer.runtime.requests import Request
    from mlx_tracer.runtime.speculator import PRIOR, Speculator

    spec = Speculator(PromptLookup(), k=4)
    rows = [Request(i, [1, 2, 3, 1, 2, 3, 1, 2], 50, GREEDY, frozenset(), initial_key(0)) for i in range(2)]
    assert spec.drafts(rows, 2) is None  # no plain step measured yet: decode first
    spec.observe("decode", 2, 0.100)
    assert spec.drafts(rows, 2) is not None  # prior 0.5, guessed cost 1.5x: 2 * (1 + 0.5 * n) / 0.15 > 2 / 0.1
    spec.observe("verify", 2, 0.300)  # measured: a verify step costs 3 plain steps
    for r in rows:
        spec.row(r.uid).accept_rate = 0.3
    assert spec.drafts(rows, 2) is None  # 2 * (1 + 0.3 * n <= 2.2) / 0.3 < 2 / 0.1
    for r in rows:
        spec.row(r.uid).accept_rate = 0.95
    assert spec.drafts(rows, 2) is not None  # 2 * (1 + 0.95 * n) / 0.3 > 20 for n >= 3
    low = spec.row(0).accept_rate = spec.row(1).accept_rate = 0.0
    for _ in range(30):  # a row whose drafts failed is not tried again at once
        spec.plain_step(rows)
    assert spec.row(0).accept_rate < 0.15
    for _ in range(500):
        spec.plain_step(rows)
    assert low < spec.row(0).accept_rate <= PRIOR and abs(spec.row(0).accept_rate - PRIOR) < 0.01


def test_the_auto_policy_keeps_greedy_output_equal():
    model = tiny_model("llama")
    plain, _ = _run(model)
    for drafter in (tiny_model("llama"), tiny_model("llama", seed=5), "prompt-lookup"):
        spec, eng = _run(model, speculative=drafter, draft_tokens=4, spec_policy="auto")
        assert spec == plain and eng.stats.steps > 0


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_greedy_speculative_equals_mlx_lm_generate_step(family):
    from mlx_lm.generate import generate_step

    model = tiny_model(family)
    eng = Engine(model, buckets=(1,), prefill_chunks=(8, 16), speculative="prompt-lookup", draft_tokens=4,
                 spec_policy="always")
    for prompt in (PROMPTS[0], PROMPTS[2]):
        want = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=30, sampler=lambda x: mx.argmax(x, axis=-1))]
        eng.add(prompt, max_tokens=30)
        assert [ev.token for ev in eng.run()] == want
    assert eng.stats.accepted > 0


class NoDrafts:
    """A drafter that never drafts: plain decode steps, one at a time."""

    def propose(self, context, k):
        return []


def test_a_verify_step_leaves_a_wrapped_ring_as_plain_decoding_would():
    """After every verify step (drafts refused, partly and fully accepted), each
    ring layer holds the same keys and values in temporal order, and shows the
    same positions, as a plain decode of the same tokens."""
    model = tiny_model("ring_only")
    prompt = list(range(1, 12)) * 2  # 22 tokens: past the 8-column window before decoding starts
    spec = Engine(model, buckets=(1,), prefill_chunks=(8,), speculative="prompt-lookup", draft_tokens=3, spec_policy="always")
    plain = Engine(model, buckets=(1,), prefill_chunks=(8,), speculative=NoDrafts())  # plain steps
    spec.add(prompt, max_tokens=40)
    plain.add(prompt, max_tokens=40)
    outcomes, compared = set(), 0
    while spec.has_work():
        before = spec.stats.accepted, spec.stats.drafted
        got = [ev.token for ev in spec.step()]
        drafted = spec.stats.drafted - before[1]
        if drafted:
            outcomes.add("none" if spec.stats.accepted == before[0] else "all" if spec.stats.accepted - before[0] == drafted else "part")
        want = []
        while len(want) < len(got):
            want += [ev.token for ev in plain.step()]
        assert got == want
        if not spec.rows:
            break
        if spec.batch.pipeline or plain.batch.pipeline:  # plain steps pipelined: a step in flight is written already
            continue
        compared += 1
        mx.eval([c.state for c in plain.caches], [c.state for c in spec.caches])
        for s, p in zip(spec.caches, plain.caches):
            assert int(s.rows.offsets[0]) == int(p.rows.offsets[0])
            ks, vs = s.temporal_view(0)
            kp, vp = p.temporal_view(0)
            assert ks.shape == kp.shape and ks.shape[2] == SLIDE  # wrapped: a full window of the newest tokens
            assert np.allclose(np.array(ks), np.array(kp), atol=1e-5) and np.allclose(np.array(vs), np.array(vp), atol=1e-5)
    assert {"none", "part"} <= outcomes and compared > 5


@pytest.mark.parametrize("family", ["llama_mixed", "ring_only"])
def test_a_verify_steps_books_advance_once_a_family_as_each_cache_alone_would(monkeypatch, family):
    """A verify step advances each family's row books once and hands the result
    to the family's other caches (StaticKVCache.advance_verify_all): every
    cache's book (offsets, left padding, time; a ring's head) equals what its
    own advance_verify leaves, over continuous batching (rows joining and
    leaving, buckets 1-4) with drafts refused, partly and fully kept."""
    from mlx_tracer.caches.batch import StaticKVCache

    real = StaticKVCache.advance_verify_all
    took = []

    def checked(caches, plans, valid):
        alone = []
        for c, plan in zip(caches, plans):
            twin = copy.copy(c)  # the same buffers; its own book
            twin.rows = c.rows.copy()
            twin.advance_verify(plan, np.asarray(valid)[: c.n])
            alone.append(twin)
        real(caches, plans, valid)
        took.append(sum(c.rows.offsets is caches[0].rows.offsets for c in caches[1:]))
        for c, twin in zip(caches, alone):
            got, want = c.rows, twin.rows
            assert got.time == want.time and got.offsets.tolist() == want.offsets.tolist()
            assert got.left_padding.tolist() == want.left_padding.tolist()
            assert getattr(c, "head", None) == getattr(twin, "head", None)

    monkeypatch.setattr(StaticKVCache, "advance_verify_all", staticmethod(checked))
    spec, eng = _run(tiny_model(family), speculative="prompt-lookup", draft_tokens=4)
    assert eng.stats.verify_steps == len(took) > 0 and 0 < eng.stats.accepted < eng.stats.drafted
    assert max(took) > 0  # the family's first book served the others


def test_drafts_past_a_stop_token_or_the_budget_are_cut_where_plain_decoding_stops():
    model = tiny_model("llama")
    plain, _ = _run(model, budget=40)
    for i, toks in enumerate(plain):
        stop = toks[len(toks) // 2]  # a token the row emits mid-way
        eng = Engine(model, buckets=(1,), prefill_chunks=(8, 16), speculative="prompt-lookup", draft_tokens=4,
                     spec_policy="always")
        eng.add(PROMPTS[i], max_tokens=40, stop_ids=[stop])
        got = [ev.token for ev in eng.run()]
        assert got == toks[: toks.index(stop) + 1]
    for budget in (1, 2, 7):
        eng = Engine(model, buckets=(1,), prefill_chunks=(8, 16), speculative="prompt-lookup", draft_tokens=4,
                     spec_policy="always")
        eng.add(PROMPTS[2], max_tokens=budget)
        assert [ev.token for ev in eng.run()] == plain[2][:budget]


def test_the_module_level_functions_take_speculative_options():
    from mlx_tracer import batch_generate, generate
    from mlx_tracer.api import _generator_for

    model, tok = tiny_model("llama"), IdTokenizer()
    plain = generate(model, tok, PROMPTS[2], max_tokens=20)
    assert generate(model, tok, PROMPTS[2], max_tokens=20, speculative="prompt-lookup", draft_tokens=3, spec_policy="always") == plain
    spec = _generator_for(model, tok, speculative="prompt-lookup", draft_tokens=3, spec_policy="always")
    assert spec is not _generator_for(model, tok) and spec.stats.verify_steps > 0  # one loop per options
    outs = batch_generate(model, tok, [PROMPTS[0], PROMPTS[2]], max_tokens=10, speculative="prompt-lookup", draft_tokens=3)
    assert outs[1].text == plain[: len(outs[1].text)]


class FixedDrafts:
    """A drafter that proposes ``k`` copies of token 1 (no match length: the row's share decides)."""

    def propose(self, context, k):
        return [1] * k


def test_the_auto_policy_chooses_the_window_by_measured_costs():
    """Windows among WINDOWS up to k + 1: the one expected to emit the most
    tokens per second; a length not measured yet is tried when it may pay
    most, and priced from its measured neighbour."""
    from mlx_tracer.runtime.requests import Request
    from mlx_tracer.runtime.speculator import Speculator

    spec = Speculator(FixedDrafts(), k=4)
    assert spec.windows == [2, 3, 4, 5]
    assert Speculator(FixedDrafts(), k=12).windows == [2, 3, 4, 5, 9, 13]
    assert Speculator(FixedDrafts(), k=4, policy="always").windows == [5]
    row = Request(0, [1, 2, 3], 50, GREEDY, frozenset(), initial_key(0))
    spec.row(0).accept_rate = 0.9
    spec.observe("decode", 1, 0.100)
    spec.observe("verify", 1, 0.120, 2)  # a column costs 0.02 s...
    spec.observe("verify", 1, 0.300, 5)  # ...until the fifth: the matmuls' row tiles
    drafts = spec.drafts([row], 1)
    assert spec.window == 3 and drafts == [[1, 1]]  # unmeasured, priced between L=2 and L=5: (1 + 1.8) / 0.162 beats both
    spec.observe("verify", 1, 0.400, 3)  # measured: dear
    assert spec.drafts([row], 1) == [[1]] and spec.window == 2  # (1 + 0.9) / 0.12 > (1 + 3.6) / 0.3
    spec.row(0).accept_rate = 0.1
    assert spec.drafts([row], 1) is None  # (1 + 0.1) / 0.12 < 1 / 0.1


def test_a_rows_draft_length_doubles_after_full_acceptance_and_halves_after_misses():
    from mlx_tracer.runtime.requests import Request
    from mlx_tracer.runtime.speculator import Speculator

    spec = Speculator(FixedDrafts(), k=12, policy="always")
    rows = [Request(i, [1, 2, 3], 50, GREEDY, frozenset(), initial_key(0)) for i in range(2)]
    spec.row(0).draft_len = spec.row(1).draft_len = 3
    spec.update(rows[0], 3, 3)
    spec.update(rows[1], 3, 0)
    assert spec.row(0).draft_len == 6 and spec.row(1).draft_len == 2  # per row; halved, at least 2
    assert [len(d) for d in spec.drafts(rows, 2)] == [6, 2]
    spec.update(rows[0], 6, 6)
    spec.update(rows[0], 12, 12)
    assert spec.row(0).draft_len == 12  # at most k
    spec.update(rows[0], 12, 7)
    assert spec.row(0).draft_len == 12  # half or more accepted: kept
    rows[1].max_tokens = 2
    assert [len(d) for d in spec.drafts(rows, 2)] == [12, 1]  # the budget's last token needs no draft


def test_the_auto_policy_learns_which_matches_pay():
    """Prompt lookup reports how long a match its drafts follow: drafts after
    short matches that keep failing are declined, long ones still verified."""
    from mlx_tracer.runtime.requests import Request
    from mlx_tracer.runtime.speculator import Speculator

    spec = Speculator(PromptLookup(), k=4)
    spec.observe("decode", 1, 0.100)
    spec.observe("verify", 1, 0.130, 5)
    short = Request(0, [7, 1, 2, 3, 4, 5, 6, 8, 9, 1], 50, GREEDY, frozenset(), initial_key(0))  # matches [1]
    long = Request(1, [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4], 50, GREEDY, frozenset(), initial_key(0))  # matches [1 .. 4]
    assert PromptLookup().propose_match(short.context, 4) == ([2, 3, 4, 5], 1)
    assert PromptLookup().propose_match(long.context, 4) == ([5, 6, 9, 1], 4)
    assert spec.drafts([short], 1) is not None  # the prior share of a 1-token match: worth a try
    for _ in range(30):
        spec.drafts([short], 1)
        spec.update(short, 4, 0)
        spec.row(0).accept_rate = 0.5  # the row itself keeps its prior: the match length decides
    assert spec.drafts([short], 1) is None and spec.drafts([long], 1) is not None
    assert not spec.may_pay([short], 1) and spec.may_pay([long], 1)


def test_sampled_output_is_equal_under_the_auto_policy():
    model = tiny_model("llama")
    opts = dict(max_tokens=24, temp=0.9, top_k=20)
    want = [c.tokens for c in Generator(model, IdTokenizer(), chat=False).batch_generate([PROMPTS[0], PROMPTS[2]], seed=7, **opts)]
    spec = Generator(model, IdTokenizer(), chat=False, speculative="prompt-lookup", draft_tokens=4, spec_policy="auto")
    for _ in range(2):  # the second run with step times measured
        assert [c.tokens for c in spec.batch_generate([PROMPTS[0], PROMPTS[2]], seed=7, **opts)] == want


def _events(model, **kw):
    """Each request's (token, log-probability) pairs, as _run schedules them."""
    if "speculative" in kw:
        kw.setdefault("spec_policy", "always")
    kw.setdefault("prefill_chunks", (8, 16))
    eng = Engine(model, buckets=(1, 2, 4), **kw)
    uids = [eng.add(p, max_tokens=24) for p in PROMPTS[:3]]
    out = {u: [] for u in uids}
    for ev in eng.run():
        if ev.token is not None:
            out[ev.uid].append((ev.token, ev.logprob))
    return [out[u] for u in uids], eng


@pytest.fixture
def kernel_paths():
    """Sets the native kernels' attention mode and ISA path for one test; restores both."""
    from mlx_tracer.backend import kernels

    from .helpers import forced_isa

    K = kernels.load()
    if K is None:
        pytest.skip("native kernels unavailable")
    before = K.attention_mode()
    with contextlib.ExitStack() as stack:
        stack.callback(K.attention_mode, before)

        def use(attention, isa):
            K.attention_mode(attention)
            stack.enter_context(forced_isa(K, isa))

        yield use


@pytest.mark.parametrize("fmt,attention,isa", [("quantized", "vector", "avx512"), ("quantized", "vector", "avx2"),
                                                ("quantized", "vector", "portable"), ("quantized", "blas", "avx512"),
                                                ("quantized-fast", "vector", "avx512"),
                                                ("quantized-fast", "vector", "portable"),
                                                ("quantized-fast", "blas", "avx512"),
                                                ("quantized-factored", "vector", "avx2"),
                                                ("quantized-factored", "vector", "portable"),
                                                ("quantized-split", "vector", "avx2"),
                                                ("quantized-split", "blas", "portable")])
def test_verify_windows_on_packed_weights_judge_the_plain_steps_logits_bit_for_bit(kernel_paths, fmt, attention, isa):
    """On the layer kernels with packed weights (each qmm contract, decode
    attention on vector lanes or BLAS, each ISA path): every accepted token of
    a verify window carries the log-probability plain decoding gives it, bit
    for bit (the window's attention computes each position as the decode step
    there; qmm's tiles sum a row alike at every M)."""
    from mlx_tracer.loading.weights import CONTRACTS, apply_format

    from .test_quantized import quantized_tiny

    kernel_paths(attention, isa)
    model = quantized_tiny("llama", 32, 4)
    apply_format(model, fmt)
    cm = CompiledModel(model)
    assert cm.lean.binding.contract == CONTRACTS[fmt]
    # the fast and split contracts' tiles sum a row alike at any M: no cap on a window's rows
    assert (cm.verify_rows is None) == (fmt in ("quantized-fast", "quantized-split"))
    plain, _ = _events(cm)
    spec, eng = _events(cm, speculative="prompt-lookup", draft_tokens=4)
    assert eng.stats.verify_steps > 0 and eng.stats.accepted > 0
    assert spec == plain  # tokens and float log-probabilities, exactly


def test_verify_windows_stay_within_the_rows_that_keep_decode_bits(kernel_paths):
    """qmm's exact contract sums a row alike up to ``qmm_tile_rows()`` rows
    (sgemm panels above): long drafts in a wide bucket are verified in
    windows cut to fit (bucket x window <= 64), with decode's bits."""
    from mlx_tracer.backend import kernels
    from mlx_tracer.loading.weights import apply_format

    from .test_quantized import quantized_tiny

    kernel_paths("vector", "avx512")
    model = quantized_tiny("llama", 32, 4)
    apply_format(model, "quantized")
    cm = CompiledModel(model)
    assert cm.verify_rows == kernels.load().qmm_tile_rows() == 64
    plain, _ = _events(cm, prefill_chunks=(8, 32))
    spec, eng = _events(cm, speculative="prompt-lookup", draft_tokens=30, prefill_chunks=(8, 32))
    verify = [k for k in cm.traces if k.kind == "verify"]
    assert verify and max(k.width * k.length for k in verify) <= 64 < 4 * 31
    assert any(k.width == 4 for k in verify)  # the wide bucket verified too, in a shorter window
    assert spec == plain


def test_the_speculator_cuts_windows_to_max_rows():
    from mlx_tracer.runtime.speculator import Speculator

    s = Speculator(PromptLookup(), 8, "always", max_rows=12)
    assert [s.longest(w) for w in (1, 2, 4, 8, 16)] == [9, 6, 3, 1, 0]
    assert Speculator(PromptLookup(), 8, "always").longest(16) == 9


def test_a_row_whose_verify_failed_is_still_judged_on_its_drafts_match():
    """With a cheap drafter (prompt lookup) the drafts themselves are judged,
    never the row's recent share alone: a row whose last verify step failed
    on a spurious match (share down, draft length halved to 2) still
    verifies when it goes on to quote a long span. (Judged on the share
    alone first, such a row was declined before its drafts were looked at,
    step after step, while its share recovered.) Nor does its halved draft
    length cap the window: the match's price chooses it among all up to
    ``k + 1`` (capped, the quote was verified in windows of 3). A drafter
    that reports no match lengths keeps the cap.
    A window not measured is priced between the measured ones around it."""
    from mlx_tracer.runtime.requests import Request
    from mlx_tracer.runtime.speculator import EXPLORE, Speculator

    spec = Speculator(PromptLookup(), k=16)
    spec.observe("decode", 1, 0.100)
    spec.observe("verify", 1, 0.154, 2)
    spec.observe("verify", 1, 0.176, 4)
    assert spec.cost(1, 3) == pytest.approx(0.165) and spec.cost(1, 3, EXPLORE) == pytest.approx(0.165 * EXPLORE)
    quoting = Request(0, [5, 6, 7, 8, 9, 10, 11, 12, 13, 3, 5, 6, 7, 8, 9], 50, GREEDY, frozenset(), initial_key(0))
    assert PromptLookup().propose_match(quoting.context, 2) == ([10, 11], 5)
    spec.by_match[-1] = 0.9  # learned: the first draft after a long match held 9 times in 10
    state = spec.row(0)
    state.accept_rate, state.draft_len = 0.25, 2  # after verify steps that accepted none of their drafts
    # on its share alone: (1 + 0.25 * 2) / 0.165 < 1 / 0.1; on the match, a(n) = 0.45 (1 - 0.9^n) / 0.1 drafts of
    # the 10 it follows: window 5, unmeasured (0.1 + 4 * 0.076 / 3 s, explored at 0.9 of it), (1 + 1.55) / 0.181
    # beats 3's (1 + 0.855) / (0.9 * 0.165), 4's (1 + 1.22) / 0.176 and 9's (1 + 2.56) / (0.9 * 0.303), and pays at
    # its estimate: 2.55 / 0.201 > 1 / 0.1
    assert spec.drafts([quoting], 1) == [[10, 11, 12, 13]] and spec.window == 5
    assert spec.may_pay([quoting], 1)
    capped = Speculator(Unmatched(), k=16)  # no match lengths: the row's draft length caps its drafts
    capped.observe("decode", 1, 0.100)
    capped.observe("verify", 1, 0.154, 2)
    capped.observe("verify", 1, 0.176, 4)
    capped.row(0).accept_rate, capped.row(0).draft_len = 0.9, 2
    assert capped.drafts([quoting], 1) == [[10, 11]] and capped.window == 3
    nothing = Request(1, [5, 6, 7, 8], 50, GREEDY, frozenset(), initial_key(0))  # no match: nothing to judge
    assert spec.drafts([nothing], 1) is None and not spec.may_pay([nothing], 1)


class Unmatched:
    """Prompt lookup's drafts without the length of the match they follow."""

    def propose(self, context, k):
        return PromptLookup().propose(context, k)


class MatchDrafts:
    """A drafter that proposes ``k`` copies of token 1 after a match of ``match`` tokens."""

    def __init__(self, match):
        self.match = match

    def propose_match(self, context, k):
        return [1] * k, self.match


def test_the_auto_policy_prices_long_windows_by_how_far_runs_go():
    """Drafts after a match are accepted in runs: a run that holds but stops
    after five drafts makes a window of 17 not worth its cost, whatever
    window the runs were seen in (a window is priced by how far runs go, not
    by the share of drafts accepted in the windows verified so far: 5 of 16
    priced 17 as the best); runs that go on make it the best."""
    from mlx_tracer.runtime.requests import Request
    from mlx_tracer.runtime.speculator import Speculator

    row = Request(0, [1, 2, 3], 100, GREEDY, frozenset(), initial_key(0))
    costs = {2: 0.11, 3: 0.12, 4: 0.13, 5: 0.14, 9: 0.20, 17: 0.32}

    def trained(accepted_of_16):
        spec = Speculator(MatchDrafts(3), k=16)
        spec.observe("decode", 1, 0.100)
        for L, s in costs.items():
            spec.observe("verify", 1, s, L)
        for _ in range(40):  # verify steps of 16 drafts, each accepting this many
            spec._matches = {row.uid: 3}
            spec.update(row, 16, accepted_of_16)
            spec.row(row.uid).accept_rate = 0.5  # the match length decides, not the row
            spec.row(row.uid).draft_len = 16
        return spec

    stops = trained(5)  # the first drafts hold, the run stops after five: a window of 5 or 9 takes as many
    assert stops.drafts([row], 1) is not None and stops.window <= 9, stops.window  # (a share of 5/16 chose 17)
    goes_on = trained(16)
    assert goes_on.drafts([row], 1) is not None and goes_on.window == 17
    fails = trained(0)  # the first draft never holds: plain steps
    assert fails.drafts([row], 1) is None


class _ScriptedDrafter:
    """Proposes, at position i of the output, the drafts scripted for i."""

    def __init__(self, context_len, script):
        self.n0, self.script = context_len, script

    def propose(self, context, k):
        return list(self.script.get(len(context) - self.n0, []))[:k]


def test_the_speculation_ceiling_replays_always_and_prices_an_oracle_policy():
    from mlx_tracer.bench.speculative import cost_of, oracle_units, replay_always

    costs = {2: 1.5, 5: 2.0, 9: 3.0}
    assert cost_of(costs, 5) == 2.0 and cost_of(costs, 1) == 1.0
    assert cost_of(costs, 3) == pytest.approx(1.5 + 0.5 / 3)  # between L2 and L5
    assert cost_of(costs, 17) == pytest.approx(3.0 + 8 * 0.25)  # past L9: the last slope
    out = list(range(10))
    # position 0: 4 right drafts; position 5: a wrong one; position 6: 2 right, then wrong
    drafter = _ScriptedDrafter(3, {0: [0, 1, 2, 3, 99], 5: [42], 6: [6, 7, 55]})
    # always with k=4: verify at 0 (4 accepted: 5 tokens), at 5 (refused: 1 token), at 6 (2 accepted), plain at 9
    assert replay_always([7, 8, 9], out, drafter, 4) == [4, 0, 2]
    # oracle: verify L5 at 0 (2.0, to position 5), plain at 5 (1), verify L3 at 6 (2 accepted:
    # cost_of(3) -> position 9), plain at 9 (1): 2.0 + 1 + 1.5 + 0.5 / 3 + 1
    assert oracle_units([7, 8, 9], out, drafter, costs, [2, 3, 5, 9]) == pytest.approx(2.0 + 1 + 1.5 + 0.5 / 3 + 1)
    # free text: no draft ever holds, so the oracle never verifies: one unit a token
    assert oracle_units([7, 8, 9], out, _ScriptedDrafter(3, {i: [99] for i in range(10)}), costs, [2, 5]) == 10.0


def test_a_batch_speculation_ceiling_is_the_longest_output_over_the_largest_oracle():
    from mlx_tracer.bench.speculative import batch_bound

    # one row quotes (12 tokens for 4 units), one does not (10 tokens, 10 units): plain decode takes 12
    # steps, the batch at least 10 units (the second row gains nothing from any window): 1.2x at most
    assert batch_bound([(12, 4.0), (10, 10.0)]) == pytest.approx(1.2)
    # rows that all quote alike bound the batch as one row does
    assert batch_bound([(12, 4.0)] * 4) == pytest.approx(3.0)


def test_the_policy_replay_steps_as_the_engine_does():
    """``replay_policy`` drives the engine's speculator over a known output at
    given window costs: a plain step is measured first (and the next is
    dispatched beside it), verify steps advance by what the output confirms,
    the speculator learns across requests, and dear windows are declined."""
    from mlx_tracer.bench.speculative import replay_policy
    from mlx_tracer.runtime.speculator import Speculator

    context = [50, 51] + list(range(1, 21)) + [60]
    out = list(range(1, 21)) + [70, 71, 72]  # quotes the context, then goes its own way

    def emitted(schedule):
        return sum(1 if s == "." else int(s.split("=")[1].split("/")[0]) + 1 for s in schedule)

    spec = Speculator(PromptLookup(), 8)
    cheap = {L: 1.01 for L in (2, 3, 4, 5, 9)}
    units, schedule = replay_policy(spec, context, out, cheap)
    assert schedule == [".", ".", "V9=8/8", "V9=8/8", ".", "."] and units == pytest.approx(4 + 2 * 1.01)
    units, schedule = replay_policy(spec, context, out, cheap, uid=1)  # measured: it verifies at once
    assert schedule[0] == "V9=8/8" and emitted(schedule) == len(out) - 1 and units < 6
    dear = Speculator(PromptLookup(), 8)
    replay_policy(dear, context, out, {L: 10.0 for L in (2, 3, 4, 5, 9)})  # tries a window once, learns its cost
    units, schedule = replay_policy(dear, context, out, {L: 10.0 for L in (2, 3, 4, 5, 9)}, uid=1)
    assert set(schedule) == {"."} and units == len(out) - 1


def test_a_batch_replay_shares_each_verify_window_and_lets_rows_leave():
    """``replay_batch`` (spec_ceiling.py --bucket B): one window a verify step
    for every row still decoding, each row advancing by what its own output
    confirms + 1; a row whose output is done leaves; plain steps advance
    every row."""
    from mlx_tracer.bench.speculative import replay_batch
    from mlx_tracer.runtime.speculator import Speculator

    context = [50, 51] + list(range(1, 21)) + [60]
    quotes = list(range(1, 21)) + [70, 71, 72]  # quotes the context, then goes its own way
    leaves = [1, 2, 3, 4, 90, 91]  # quotes four tokens, then stops
    spec = Speculator(PromptLookup(), 8)
    cheap = {L: 1.01 for L in (2, 3, 4, 5, 9)}
    units, schedule = replay_batch(spec, [context, context], [quotes, leaves], cheap, 2)
    assert schedule[:2] == [".", "."]  # a plain step measured first, the next dispatched beside it
    units, schedule = replay_batch(spec, [context, context], [quotes, leaves], cheap, 2, uid=2)  # measured
    # 3 of the second row's 4 drafts hold, then its last token needs no draft (0/0) and it leaves
    assert schedule == ["V9=8/8,3/4", "V9=8/8,0/0", "V4=1/3", ".", "."]
    assert units == pytest.approx(3 * 1.01 + 2)
    need = [len(quotes) - 1, len(leaves) - 1]  # each row's tokens after its first (the prefill's)
    for step in schedule:  # the rows still decoding, in order, each advanced by its own count
        live = [j for j in range(2) if need[j] > 0]
        judged = ["0/0"] * len(live) if step == "." else step.split("=")[1].split(",")
        assert len(judged) == len(live)
        for j, jd in zip(live, judged):
            need[j] -= int(jd.split("/")[0]) + 1
    assert need == [0, 0]
    assert spec.rows == {}  # every row forgotten


def test_a_batch_oracle_pays_every_window_for_all_its_rows():
    """``batch_oracle_units``: one schedule for the whole batch, searched; on one
    row it is the row's own oracle; rows that quote at different times pay
    for each other's windows, so the batch needs more than its dearest row
    alone (the per-row bound, ``batch_bound``, is looser)."""
    from mlx_tracer.bench.speculative import batch_bound, batch_oracle_units, oracle_units

    drafter = PromptLookup()
    context = [50, 51] + list(range(1, 21)) + [60]
    early = list(range(1, 21)) + list(range(70, 80))  # quotes the context first, then its own 10 tokens
    late = list(range(80, 90)) + list(range(1, 21))  # its own 10 tokens first, then the quote
    costs, windows = {2: 1.2, 5: 1.5, 9: 2.0}, [2, 5, 9]
    alone = [oracle_units(context, out, drafter, costs, windows) for out in (early, late)]
    for out, units in zip((early, late), alone):
        assert batch_oracle_units([context], [out], drafter, costs, windows) == pytest.approx(units)
    both = batch_oracle_units([context, context], [early, late], drafter, costs, windows)
    assert both > max(alone) + 1.0  # (18.0 against 15.2 and 16.0)
    assert len(early) / both < batch_bound([(len(early), alone[0]), (len(late), alone[1])])
    assert batch_oracle_units([context, context], [early, early], drafter, costs, windows) == pytest.approx(alone[0])


def test_a_token_tree_of_lookup_continuations_verifies_older_matches_too():
    """The oracle with token trees: the continuations of every earlier match
    (newest first), verified together; one branch is plain prompt lookup's."""
    from mlx_tracer.bench.speculative import lookup_continuations, oracle_units

    context = [1, 2, 7, 8, 9, 3, 1, 2, 5, 6, 4, 1, 2]  # "1 2" went on "5 6", and before that "7 8 9"
    assert lookup_continuations(context, 3, 4) == [[5, 6, 4], [7, 8, 9]]
    assert lookup_continuations(context, 3, 1) == [PromptLookup().propose(context, 3)]
    assert lookup_continuations([1, 2, 3], 2, 4) == []
    out = [7, 8, 0, 0]  # the older continuation holds for two tokens
    costs, lookup = {5: 1.5}, PromptLookup()
    # plain prompt lookup: 5 6 4 fails (a plain step), then "2 7" proposes 8 9 3 (8 holds), then a plain step
    assert oracle_units(context, out, lookup, costs, [5]) == pytest.approx(1 + 1.5 + 1)
    assert oracle_units(context, out, lookup, costs, [5], tree=1) == pytest.approx(1 + 1.5 + 1)
    # a tree of 4 drafts over 2 branches (5, 7, then 5 6, 7 8): 7 8 hold at once, then a plain step
    assert oracle_units(context, out, lookup, costs, [5], tree=2) == pytest.approx(1.5 + 1)


def test_each_bucket_of_the_speculation_bench_runs_every_prompt():
    from mlx_tracer.bench.speculative import workload_batches

    p = ["a", "b", "c", "d"]
    assert workload_batches(p, 1) == [["a"], ["b"], ["c"], ["d"]]
    assert workload_batches(p, 2) == [["a", "b"], ["c", "d"]]
    assert workload_batches(p, 3) == [["a", "b", "c"], ["d", "a", "b"]]
    assert workload_batches(p, 4) == [p]
    assert workload_batches(p, 8) == [p + p]
