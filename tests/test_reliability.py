"""Reliability of the loop on tiny models: cancellation that loses nothing,
streams closed early, bucket and option validation before any work, and a
soak with random arrivals, cancels and leaves."""

from __future__ import annotations

import gc
import weakref

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_tracer import Generator
from mlx_tracer.api import _generator_for
from mlx_tracer.runtime.engine import Engine
from mlx_tracer.runtime.options import MAX_TOKENS

from .helpers import IdTokenizer, solo_tokens
from .tiny_models import VOCAB, tiny_model

NEIGHBOUR = [5, 6, 7]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def neighbour_solo(llama):
    return solo_tokens(llama, NEIGHBOUR, 40)


def _gen(model, **kw):
    return Generator(model, IdTokenizer(), chat=False, **kw)


def _ids(text):
    return [int(t) for t in text.strip("<>").split("><")] if text else []


# ---------------------------------------------------------- 1. cancellation
@pytest.mark.parametrize("how", ["break", "close", "drop", "interrupt"])
def test_abandoned_stream_leaves_the_neighbour_intact_and_frees_its_row(llama, neighbour_solo, how):
    gen = _gen(llama)
    neighbour = gen.submit(NEIGHBOUR, max_tokens=40)
    stream = gen.stream_generate([9, 9, 3], max_tokens=200)
    abandoned = None
    try:
        for i, ev in enumerate(stream):
            abandoned = ev.uid
            if i == 3:
                if how == "break":
                    break
                if how == "close":
                    stream.close()
                    break
                if how == "interrupt":
                    raise KeyboardInterrupt
                if how == "drop":
                    break
    except KeyboardInterrupt:
        pass
    if how in ("drop", "interrupt"):
        del stream
        gc.collect()
    else:
        stream.close()
    assert abandoned is not None
    got = [ev.token for ev in gen.events() if ev.uid == neighbour]
    # the neighbour's tokens delivered before the stream stopped are in its completion too
    assert gen.result(neighbour).tokens == neighbour_solo
    assert len(got) <= len(neighbour_solo)
    assert all(r.uid != abandoned for r in gen.engine.rows)
    assert abandoned not in gen.router.live and not gen.engine.has_work()  # nothing kept


def test_abandoned_stream_row_is_freed_at_the_next_step(llama):
    gen = _gen(llama)
    gen.submit(NEIGHBOUR, max_tokens=40)
    stream = gen.stream_generate([9, 9, 3], max_tokens=200)
    uid = next(stream).uid
    stream.close()
    gen.engine.step()
    assert [r.uid for r in gen.engine.rows] != [] and all(r.uid != uid for r in gen.engine.rows)


def test_events_left_early_lose_nothing(llama, neighbour_solo):
    gen = _gen(llama)
    a = gen.submit(NEIGHBOUR, max_tokens=40)
    b = gen.submit([9, 9, 3], max_tokens=12)
    seen = {a: [], b: []}
    for ev in gen.events():
        seen[ev.uid].append(ev.token)
        if len(seen[a]) == 5:
            break  # an events() consumer that stops mid-step
    for ev in gen.events():
        seen[ev.uid].append(ev.token)
    assert seen[a] == neighbour_solo
    assert seen[b] == solo_tokens(llama, [9, 9, 3], 12)


def test_generator_cancel_finishes_the_request_as_cancelled(llama, neighbour_solo):
    gen = _gen(llama)
    keep = gen.submit(NEIGHBOUR, max_tokens=40)
    drop = gen.submit([9, 9, 3], max_tokens=100)
    queued_drop = None
    last = {}
    for i, ev in enumerate(gen.events()):
        if ev.finish_reason:
            last[ev.uid] = ev
        if i == 6:
            gen.cancel(drop)
            queued_drop = gen.submit([4, 4], max_tokens=10)
            gen.cancel(queued_drop)
    assert last[drop].finish_reason == "cancelled" and last[drop].token is None
    assert last[queued_drop].finish_reason == "cancelled"
    done = gen.result(drop)
    assert done.finish_reason == "cancelled" and 0 < len(done.tokens) < 100
    assert gen.result(keep).tokens == neighbour_solo
    with pytest.raises(KeyError):
        gen.cancel(drop)


def test_generate_interrupted_cancels_its_request(llama, monkeypatch):
    gen = _gen(llama)
    real = gen.engine.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(gen.engine, "step", flaky)
    with pytest.raises(KeyboardInterrupt):
        gen.generate([9, 9, 3], max_tokens=50)
    monkeypatch.setattr(gen.engine, "step", real)
    assert gen.generate(NEIGHBOUR, max_tokens=40) == "".join(f"<{t}>" for t in solo_tokens(llama, NEIGHBOUR, 40))
    assert not gen.router.live and not gen.engine.has_work()


def test_module_level_generators_do_not_keep_models_alive():
    model = tiny_model("llama")
    tok = IdTokenizer()
    gen = _generator_for(model, tok)
    assert _generator_for(model, tok) is gen  # one compiled loop per model
    ref = weakref.ref(model)
    del model, gen
    gc.collect()
    assert ref() is None


# ------------------------------------------------------------ 2. buckets
@pytest.mark.parametrize("buckets", [(0,), (-1, 2), (), (1.5,), "1,2", (1, True)])
def test_bad_bucket_widths_are_refused_at_construction(llama, buckets):
    with pytest.raises((ValueError, TypeError), match="buckets"):
        Engine(llama, buckets=buckets)
    with pytest.raises((ValueError, TypeError), match="buckets"):
        Generator.load("/nonexistent/model.gguf", buckets=buckets)  # checked before loading


def test_bucket_widths_are_deduplicated_and_sorted(llama):
    assert Engine(llama, buckets=[4, 1, 2, 2]).buckets == (1, 2, 4)
    with pytest.raises(ValueError, match="prefill_chunks"):
        Engine(llama, prefill_chunks=(1, 8))


# --------------------------------------------------------- 5. input checks
@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(prompt=[1.7, 52.9]), TypeError, "integers"),
        (dict(prompt=[1, 2], max_tokens=2.5), TypeError, "max_tokens"),
        (dict(prompt=[1, 2], max_tokens=None), TypeError, "max_tokens"),
        (dict(prompt=[1, 2], max_tokens=0), ValueError, "max_tokens"),
        (dict(prompt=[1, 2], temp=float("nan")), ValueError, "temperature"),
        (dict(prompt=[1, 2], temp=-1), ValueError, "temperature"),
        (dict(prompt=[1, 2], top_p=0), ValueError, "top_p"),
        (dict(prompt=[1, 2], min_p=1), ValueError, "min_p"),
        (dict(prompt=[1, 2], top_k=1.5), TypeError, "top_k"),
        (dict(prompt=[1, 2], seed=-1), ValueError, "seed"),
        (dict(prompt=[1, 2], seed=1.5), TypeError, "seed"),
        (dict(prompt=[1, 2], stop=[3]), TypeError, "stop"),
        (dict(prompt=[]), ValueError, "empty"),
        (dict(prompt="   "), ValueError, "empty"),
        (dict(prompt=[VOCAB]), ValueError, "vocabulary"),
    ],
)
def test_bad_options_get_clear_errors_and_change_nothing(llama, kwargs, error, words):
    gen = _gen(llama)
    keep = gen.submit(NEIGHBOUR, max_tokens=5)
    before = (len(gen.engine.queue), dict(gen.router.live))
    prompt = kwargs.pop("prompt")
    with pytest.raises(error, match=words):
        gen.submit(prompt, **kwargs)
    assert (len(gen.engine.queue), dict(gen.router.live)) == before
    assert gen.generate(NEIGHBOUR, max_tokens=5) and gen.result(keep).tokens == solo_tokens(llama, NEIGHBOUR, 5)


def test_a_stop_string_is_one_string_not_a_set_of_characters(llama):
    gen = _gen(llama)
    pieces = ["<" + p for p in gen.generate(NEIGHBOUR, max_tokens=12).split("<")[1:]]
    i = next(i for i, p in enumerate(pieces) if i > 0 and p not in pieces[:i])
    out = gen.generate(NEIGHBOUR, max_tokens=12, stop=pieces[i])  # a str, as OpenAI's API allows
    assert out == "".join(pieces[:i])  # as a set of characters, "<" would have stopped it at once


def test_prompt_past_the_models_context_length_is_refused():
    model = tiny_model("qwen3")  # max_position_embeddings = 512
    gen = _gen(model)
    with pytest.raises(ValueError, match="context length 512: lower max_tokens to at most 12"):
        gen.submit(list(range(1, 101)) * 5, max_tokens=20)
    with pytest.raises(ValueError, match="context length 512: shorten the prompt"):
        gen.submit([1] * 600, max_tokens=1)
    assert not gen.engine.has_work()


# ------------------------------------------------- property-based API check
_option = st.one_of(st.none(), st.integers(-3, 70), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3))
_prompt = st.one_of(
    st.lists(st.integers(-2, VOCAB + 2), max_size=6),
    st.lists(st.floats(0, 10), min_size=1, max_size=3),
    st.text(max_size=6),
)


@pytest.fixture(scope="module")
def busy(llama):
    """A Generator with a long neighbour request running, shared by the examples."""
    gen = _gen(llama)
    uid = gen.submit(NEIGHBOUR, max_tokens=300)
    return gen, uid, solo_tokens(llama, NEIGHBOUR, 300), []


@settings(max_examples=60, deadline=None)
@given(
    prompt=_prompt,
    max_tokens=st.one_of(_option, st.sampled_from([MAX_TOKENS, MAX_TOKENS + 1, 2**40, 2**70])),  # past the bound: refused
    temp=_option,
    top_p=_option,
    top_k=_option,
    min_p=_option,
    seed=_option,
    stop=st.one_of(st.none(), st.text(max_size=4), st.lists(st.one_of(st.text(max_size=3), st.integers()), max_size=2)),
)
def test_any_api_input_returns_or_fails_clearly_and_never_touches_a_neighbour(busy, prompt, max_tokens, temp, top_p, top_k, min_p, seed, stop):
    gen, neighbour, solo, seen = busy
    opts = dict(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, stop=stop)
    opts = {k: v for k, v in opts.items() if v is not None}
    budget = opts.get("max_tokens")
    if isinstance(budget, int) and not isinstance(budget, bool) and budget <= MAX_TOKENS:
        opts["max_tokens"] = min(budget, 3)
    queued, live = len(gen.engine.queue), set(gen.router.live)
    try:
        uid = gen.submit(prompt, **opts)
    except (ValueError, TypeError) as e:
        assert str(e)  # says what is wrong
        assert len(gen.engine.queue) == queued and set(gen.router.live) == live  # refused before touching anything
    else:
        assert isinstance(uid, int) and uid in gen.router.live
    gen.router.pump()  # the loop goes on between calls
    while gen.router.outbox:
        ev = gen.router.outbox.popleft()
        if ev.uid == neighbour:
            seen.append(ev.token)
        elif ev.finish_reason is not None:
            assert ev.finish_reason in ("stop", "length")
            assert gen.result(ev.uid).finish_reason == ev.finish_reason
    assert seen == solo[: len(seen)]
    assert len(seen) < len(solo)  # the neighbour was running all along


# ------------------------------------------------------------------ soak
def test_soak_1000_steps_with_arrivals_cancels_and_leaves():
    model = tiny_model("llama_mixed")
    eng = Engine(model, buckets=(1, 2, 4), prefill_chunks=(8,), capacities=(64, 128))
    rng = np.random.default_rng(1)
    live, cancelled, finished, memory = set(), 0, 0, []
    for step in range(1000):
        if rng.random() < 0.2 and len(eng.queue) < 4:
            prompt = rng.integers(0, VOCAB, size=int(rng.integers(1, 10))).tolist()
            live.add(eng.add(prompt, max_tokens=int(rng.integers(1, 30))))
        if live and rng.random() < 0.05:
            uid = int(rng.choice(sorted(live)))
            eng.cancel(uid)
        for ev in eng.step():
            if ev.finish_reason is not None:
                live.discard(ev.uid)
                finished += 1
                cancelled += ev.finish_reason == "cancelled"
        if step in (200, 999):
            gc.collect()
            memory.append(mx.get_active_memory())
    for _ in eng.run():
        pass
    assert cancelled > 10 and finished > 100
    assert all(n == 1 for n in eng.compiled.traces.values()), eng.compiled.traces  # bounded by keys used
    assert len(eng.scheduler.requests) == 0
    assert memory[1] <= memory[0] * 1.5 + (1 << 20), memory


def test_retired_rows_hand_their_caches_to_on_retire_and_a_continuation_matches(llama):
    """The hook a prefix cache builds on: a finished row's serial caches and
    token ids; continuing a longer prompt from them gives the solo tokens."""
    kept = {}
    eng = Engine(llama, buckets=(1, 2), on_retire=lambda r, caches, toks: kept.setdefault(r.uid, (caches, toks)))
    first = eng.add(NEIGHBOUR, max_tokens=6)
    out = [ev.token for ev in eng.run()]
    caches, toks = kept[first]
    assert toks == (NEIGHBOUR + out)[: len(toks)] and len(toks) >= len(NEIGHBOUR)
    follow = NEIGHBOUR + out + [7, 8]
    assert len(toks) < len(follow)
    eng.add(follow[len(toks):], max_tokens=5, cache=caches)
    assert [ev.token for ev in eng.run()] == solo_tokens(llama, follow, 5)
