"""Penalties, logit bias, top_logprobs and n > 1 in the compiled step, against
mlx-lm: each rule's greedy tokens (and log-probabilities) equal mlx-lm's own
``make_logits_processors`` applied to its eager ``generate_step``, per row in
one batch with different values and one row with none, with a row joining
mid-way; rows with none keep their bits; changing values never retraces;
speculative decoding and a prefix cache change no token; n choices share one
prefill; bad values are refused naming the parameter."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from mlx_tracer.runtime.engine import Engine
from mlx_tracer.runtime.options import MAX_CHOICES, OptionError
from mlx_tracer.runtime.prefix_cache import PrefixCache
from mlx_tracer.runtime.processors import process, window_of
from mlx_tracer.runtime.sampling import SamplingParams

from .tiny_models import VOCAB, tiny_model

STEPS = 24
# longer than the 20-token window, with repeats inside and outside it
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 3, 3, 3, 4, 5, 6, 7, 8, 9, 20, 21, 22]
LATE = [40, 41, 42, 40, 41]  # joins the batch mid-way

# one batch: a row per rule (values the tiny model's greedy answer really reacts to), all of them, and none
RULES = [
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7),
    dict(frequency_penalty=-0.4),
    dict(logit_bias={13: -100.0, 52: 4.0}),
    dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={32: -3.0}),
    {},
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def mlx_lm_reference(model, prompt, rules, steps=STEPS):
    """Greedy tokens and each step's log-probabilities from mlx-lm's eager loop and its processors."""
    toks, lps = [], []
    for tok, logprobs in generate_step(mx.array(prompt), model, max_tokens=steps,
                                       logits_processors=make_logits_processors(**rules)):
        toks.append(int(tok))
        lps.append(np.array(logprobs))
    return toks, lps


def run(eng, requests, late=None, join_at=5):
    """``requests``: (prompt, SamplingParams) added now; ``late``: one added after ``join_at`` steps.
    Returns every request's tokens, log-probabilities and top alternatives, in order."""
    uids = [eng.add(p, max_tokens=STEPS, sampling=s) for p, s in requests]
    out = {u: ([], [], []) for u in uids}
    step = 0
    while eng.has_work():
        if late is not None and step == join_at:
            uids.append(eng.add(late[0], max_tokens=STEPS, sampling=late[1]))
            out[uids[-1]] = ([], [], [])
        for ev in eng.step():
            if ev.token is not None:
                out[ev.uid][0].append(ev.token)
                out[ev.uid][1].append(ev.logprob)
                out[ev.uid][2].append(ev.top_logprobs)
        step += 1
    return [out[u] for u in uids]


def test_each_rule_per_row_equals_mlx_lm_with_a_row_joining_mid_way(model):
    eng = Engine(model, buckets=(1, 2, 4, 8, 16))
    late_rules = dict(presence_penalty=2.0, repetition_penalty=1.2)
    got = run(eng, [(PROMPT, SamplingParams(**r)) for r in RULES], late=(LATE, SamplingParams(**late_rules)))
    for rules, (tokens, logprobs, _) in zip(RULES + [late_rules], got):
        ref_tokens, ref_lps = mlx_lm_reference(model, LATE if rules is late_rules else PROMPT, rules)
        assert tokens == ref_tokens, f"{rules}: {tokens} != mlx-lm's {ref_tokens}"
        want = [lp[t] for lp, t in zip(ref_lps, ref_tokens)]
        assert np.allclose(logprobs, want, atol=1e-4), rules
    # the rules changed the answers (else this test could not fail)
    plain = got[RULES.index({})][0]
    assert all(got[i][0] != plain for i in range(len(RULES) - 1)), [g[0][:8] for g in got]


def test_rows_without_processors_keep_their_bits_and_values_never_retrace(model):
    plain_eng = Engine(model, buckets=(1, 2, 4))
    base = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.8, top_p=0.9, seed=4)]
    plain = run(plain_eng, [(PROMPT, s) for s in base])
    eng = Engine(model, buckets=(1, 2, 4))
    mixed = run(eng, [(PROMPT, s) for s in base[:2]] + [(PROMPT, SamplingParams(temperature=1.0, seed=9,
                                                                                 frequency_penalty=1.0))])
    for i in range(2):
        assert mixed[i][0] == plain[i][0] and mixed[i][1] == plain[i][1], "a row with no processor changed"
    # other values, other rows: the same trace keys, no new trace
    with eng.compiled.no_new_traces():
        again = run(eng, [(PROMPT, SamplingParams(repetition_penalty=1.9, logit_bias={7: 50.0})),
                          (PROMPT, SamplingParams(temperature=1.0, seed=3, presence_penalty=-1.0)),
                          (PROMPT, SamplingParams(temperature=0.5, seed=1, logit_bias={3: -2.0, 4: 1.0}))])
    assert again[0][0] == mlx_lm_reference(model, PROMPT, dict(repetition_penalty=1.9, logit_bias={7: 50.0}))[0]
    assert sum(1 for k in eng.compiled.traces if k.kind == "decode" and k.processors) == 1


def test_processors_are_exact_on_neutral_rows_and_count_the_window():
    V = 40
    logits = mx.array(np.random.default_rng(0).normal(size=(2, V)).astype(np.float32))
    window = mx.array(np.stack([window_of([1, 1, 2]), window_of(list(range(30)) + [5, 5, 5])]))
    p = {"window": window, "bias": mx.zeros((2, V)), "repetition": mx.array([1.0, 1.0]),
         "presence": mx.array([0.0, 0.0]), "frequency": mx.array([0.0, 2.0])}
    out = np.array(process(logits, p))
    assert np.array_equal(out[0], np.array(logits[0]))  # bit for bit
    # row 1's window is its last 20 tokens (13 .. 29, 5, 5, 5): token 5 counted 3 times, tokens 0 .. 12 not at all
    counts = np.zeros(V)
    counts[13:30] = 1
    counts[5] = 3
    assert np.allclose(out[1], np.array(logits[1]) - 2.0 * counts)


def test_top_logprobs_are_mlx_lms_processed_distribution(model):
    eng = Engine(model, buckets=(1, 2))
    rules = dict(presence_penalty=1.0)
    (tokens, lps, tops), (_, _, none) = run(eng, [(PROMPT, SamplingParams(top_logprobs=5, **rules)), (LATE, SamplingParams())])
    assert none == [None] * STEPS
    ref_tokens, ref_lps = mlx_lm_reference(model, PROMPT, rules)
    assert tokens == ref_tokens
    for top, lp, ref in zip(tops, lps, ref_lps):
        assert len(top) == 5
        ids = [t for t, _ in top]
        assert ids == list(np.argsort(-ref)[:5])
        assert np.allclose([v for _, v in top], ref[ids], atol=1e-4)
        assert top[0][1] == pytest.approx(lp)  # greedy: the pick is the most likely


def test_speculative_decoding_applies_the_processors_at_every_position(model):
    rules = [dict(repetition_penalty=1.4), dict(frequency_penalty=0.5, logit_bias={13: -5.0}), {}]
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], PROMPT, [9, 9, 3, 9, 9]]
    reqs = [(p, SamplingParams(top_logprobs=2, **r)) for p, r in zip(prompts, rules)]
    plain = run(Engine(model, buckets=(1, 2, 4)), reqs)
    eng = Engine(model, buckets=(1, 2, 4), speculative="prompt-lookup", spec_policy="always")
    spec = run(eng, reqs)
    assert eng.stats.verify_steps > 0
    assert [s[0] for s in spec] == [p[0] for p in plain]
    for s, p in zip(spec, plain):
        assert [[t for t, _ in top] for top in s[2]] == [[t for t, _ in top] for top in p[2]]
    for (tokens, _, _), p, r in zip(spec, prompts, rules):
        assert tokens == mlx_lm_reference(model, p, r)[0]


def test_a_prefix_cache_hit_still_counts_the_whole_prompt(model):
    rules = dict(presence_penalty=2.0, repetition_penalty=1.5)
    eng = Engine(model, buckets=(1, 2), prefix_cache=PrefixCache(1 << 26))
    run(eng, [(PROMPT[:-3], SamplingParams())])  # stores the prompt's first part
    uid_tokens = run(eng, [(PROMPT, SamplingParams(**rules))])[0][0]
    assert eng.prefix_cache.snapshot().stats.hits == 1
    assert uid_tokens == mlx_lm_reference(model, PROMPT, rules)[0]


def test_n_choices_share_one_prefill_and_sample_as_seed_plus_i(model):
    eng = Engine(model, buckets=(1, 2, 4))
    hot = SamplingParams(temperature=1.5, seed=11)
    uids = eng.add_choices(PROMPT, 3, max_tokens=8, sampling=hot)
    greedy = eng.add_choices(LATE, 2, max_tokens=8)
    got = {u: [] for u in uids + greedy}
    for ev in eng.run():
        got[ev.uid].append(ev.token)
    assert eng.stats.prefill_tokens == len(PROMPT) - 1 + len(LATE) - 1  # each prompt prefilled once
    solo = Engine(model, buckets=(1,))
    for i, u in enumerate(uids):
        ref = solo.add(PROMPT, max_tokens=8, sampling=SamplingParams(temperature=1.5, seed=11 + i))
        assert got[u] == [ev.token for ev in solo.run() if ev.uid == ref]
    assert len({tuple(got[u]) for u in uids}) > 1  # the choices differ
    assert got[greedy[0]] == got[greedy[1]] == mlx_lm_reference(model, LATE, {}, 8)[0]
    with pytest.raises(OptionError, match="largest batch bucket") as e:
        eng.add_choices(PROMPT, 5)
    assert e.value.param == "n"
    for bad in (0, MAX_CHOICES + 1):
        with pytest.raises(OptionError, match=r"n must be in \[1, 128\]"):
            eng.add_choices(PROMPT, bad)
    assert not eng.has_work()


def test_choices_wait_for_room_together_and_keep_first_come_first_served(model):
    eng = Engine(model, buckets=(1, 2, 4))
    first = eng.add(PROMPT, max_tokens=6)
    for _ in range(2):
        eng.step()
    family = eng.add_choices(LATE, 4, max_tokens=3)  # needs the whole bucket: waits for `first`
    after = eng.add([7, 8, 9], max_tokens=3)  # behind the family, though it would fit now
    seen = []
    while eng.has_work():
        eng.step()
        seen.append({r.uid for r in eng.rows})
    assert all(not set(family) & s or set(family) <= s for s in seen)  # all choices or none
    assert any(set(family) <= s for s in seen)
    assert not any(after in s and first in s for s in seen)  # `after` did not overtake the choices


@pytest.mark.parametrize("kw,param", [
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=1.5), "top_logprobs"),
])
def test_bad_values_are_refused_naming_the_parameter(kw, param):
    with pytest.raises(OptionError) as e:
        SamplingParams(**kw)
    assert e.value.param == param and param in str(e.value)


def test_logit_bias_keys_are_normalised_and_checked_against_the_vocabulary(model):
    assert SamplingParams(logit_bias={"7": 1, 3: -2.5}).logit_bias == ((3, -2.5), (7, 1.0))
    assert not SamplingParams(logit_bias={}).processes_logits
    eng = Engine(model, buckets=(1,))
    with pytest.raises(OptionError, match="outside the vocabulary") as e:
        eng.add(PROMPT, sampling=SamplingParams(logit_bias={VOCAB: 1.0}))
    assert e.value.param == "logit_bias" and not eng.has_work()


# ------------------------------------------------------------------- CLI
@pytest.mark.parametrize("args,message", [
    (["--repetition-penalty", "0"], "argument --repetition-penalty: a repetition penalty is a finite number > 0"),
    (["--presence-penalty", "2.5"], "argument --presence-penalty: a penalty is in [-2, 2]"),
    (["--frequency-penalty", "x"], "argument --frequency-penalty: expected a penalty"),
    (["--logit-bias", "[1]"], "argument --logit-bias: expected a JSON object of token ids to biases"),
    (["--logit-bias", '{"5": 101}'], "logit_bias values must be in [-100, 100], got 101 for token '5'"),
    (["--logit-bias", '{"-5": 1}'], "logit_bias keys must be token ids"),
])
def test_cli_refuses_bad_values_before_the_model_loads(args, message, capsys):
    from mlx_tracer.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "5 6", "--model", "/nonexistent/model.gguf", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_generate_hands_the_values_to_the_generator(model, monkeypatch, capsys):
    from mlx_tracer import Generator
    from mlx_tracer.cli import build_parser, commands

    from .helpers import IdTokenizer

    gen = Generator(model, IdTokenizer(), buckets=(1,))
    monkeypatch.setattr(commands, "load_generator", lambda args: gen)
    rules = dict(repetition_penalty=1.5, frequency_penalty=0.7, logit_bias={13: -100.0})
    args = build_parser().parse_args(["generate", " ".join(map(str, PROMPT)), "--max-tokens", "8", "--no-warmup",
                                      "--repetition-penalty", "1.5", "--frequency-penalty", "0.7",
                                      "--logit-bias", '{"13": -100}'])
    assert commands.generate(args) == 0
    want = mlx_lm_reference(model, PROMPT, rules, 8)[0]
    assert capsys.readouterr().out.strip() == "".join(f"<{t}>" for t in want)
