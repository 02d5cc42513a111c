"""Interleaved prefill (tracer/runtime/admission.py): with rows running, a
newcomer's prompt goes in windows of a bounded count of tokens per engine step, so the running
rows keep getting a token every step; the tokens are those of a solo run,
and a newcomer cancelled while it prefills never joins."""

from __future__ import annotations

import pytest

from mlx_tracer.runtime.engine import Engine
from mlx_tracer.runtime.options import OptionError
from mlx_tracer.runtime.step import CompiledModel

from .tiny_models import tiny_model

LONG = [(7 * i) % 97 + 1 for i in range(150)]


def solo(model, prompt, n):
    eng = Engine(CompiledModel(model), buckets=(1,))
    eng.add(prompt, max_tokens=n)
    return [ev.token for ev in eng.run() if ev.token is not None]


def windows_per_step(compiled, calls):
    step = compiled.step

    def spy(caches, tokens, *a, **k):
        calls.append(tokens.shape[1])
        return step(caches, tokens, *a, **k)

    compiled.step = spy


@pytest.mark.parametrize("step_tokens", [32, 0])
def test_running_rows_get_a_token_every_step_while_a_newcomer_prefills(step_tokens):
    model = tiny_model("llama")
    cm = CompiledModel(model)
    eng = Engine(cm, buckets=(1, 2), prefill_chunks=(8, 32, 128), prefill_step_tokens=step_tokens)
    first = eng.add([1, 2, 3], max_tokens=40)
    early = [ev.token for _ in range(3) for ev in eng.step() if ev.token is not None]
    late = eng.add(LONG, max_tokens=5)
    calls = []
    windows_per_step(cm, calls)
    steps, got = 0, {first: early, late: []}
    while not got[late]:
        before = len(calls)
        events = eng.step()
        steps += 1
        windows = [L for L in calls[before:] if L > 1]
        for ev in events:
            if ev.token is not None:
                got[ev.uid].append(ev.token)
        if step_tokens:
            assert sum(windows) <= step_tokens, windows  # windows of at most step_tokens tokens together a step
            assert any(ev.uid == first and ev.token is not None for ev in events)  # the running row never waits a step
    if step_tokens:
        assert steps >= len(LONG) // step_tokens  # the prompt went in over several steps
    else:
        assert steps <= 3  # prefilled whole
    for ev in eng.run():
        if ev.token is not None:
            got[ev.uid].append(ev.token)
    assert got[late] == solo(model, LONG, 5)
    assert got[first] == solo(model, [1, 2, 3], 40)


def test_newcomers_queued_together_each_go_in_one_bounded_window_a_step():
    """Several newcomers at once: after one joins, the pipeline drains while
    the next waits; the next one's job must still go on one window a step
    (0.5.0 ran all but its first window in the step after that drain: in a
    burst of 16 newcomers running streams waited up to 7x their median gap)."""
    model = tiny_model("llama")
    cm = CompiledModel(model)
    eng = Engine(cm, buckets=(1, 2, 4), prefill_chunks=(8, 32, 128), prefill_step_tokens=32)
    first = eng.add([1, 2, 3], max_tokens=80)
    for _ in range(3):
        eng.step()
    late = [eng.add(LONG[k:] + LONG[:k], max_tokens=5) for k in (0, 50, 100)]
    calls = []
    windows_per_step(cm, calls)
    steps, got = 0, {u: [] for u in late}
    while not all(got.values()):  # until each newcomer has its first token
        before = len(calls)
        events = eng.step()
        steps += 1
        windows = [L for L in calls[before:] if L > 1]
        assert sum(windows) <= 32, (steps, windows)
        assert any(ev.uid == first and ev.token is not None for ev in events)  # the running row never waits a step
        for ev in events:
            if ev.uid in got and ev.token is not None:
                got[ev.uid].append(ev.token)
    assert steps >= 3 * (len(LONG) // 32)  # every prompt went in over several steps
    for ev in eng.run():
        if ev.uid in got and ev.token is not None:
            got[ev.uid].append(ev.token)
    for k, u in zip((0, 50, 100), late):
        assert got[u] == solo(model, LONG[k:] + LONG[:k], 5)


def test_a_newcomer_cancelled_while_it_prefills_never_joins():
    model = tiny_model("llama")
    eng = Engine(CompiledModel(model), buckets=(1, 2), prefill_chunks=(8, 32), prefill_step_tokens=8)
    first = eng.add([1, 2, 3], max_tokens=30)
    events = eng.step()
    late = eng.add(LONG, max_tokens=5)
    events += eng.step() + eng.step()
    assert eng.admission.job is not None and not eng.admission.job.done
    eng.cancel(late)
    for ev in eng.run():
        assert all(r.uid != late for r in eng.rows)
        events.append(ev)
    late_events = [ev for ev in events if ev.uid == late]
    assert [ev.finish_reason for ev in late_events] == ["cancelled"] and late_events[0].token is None
    assert [ev.token for ev in events if ev.uid == first and ev.token is not None] == solo(model, [1, 2, 3], 30)


def test_the_step_window_is_an_option_checked_before_anything_runs():
    with pytest.raises(OptionError, match=r"prefill_step_tokens must be 0 .* or in \[2, 8192\]"):
        Engine(tiny_model("llama"), prefill_step_tokens=1)


def test_a_burst_the_prefix_cache_holds_joins_in_one_step_with_the_tokens_of_solo_runs():
    """Newcomers whose prompts the prefix cache holds (a warmed-up server's
    burst) have nothing left to prefill but their last token: one job takes
    them all, within the step's budget, and they join together (0.5.4 joined
    one of them per step boundary: in a burst of 15, the last one's first
    token came 15 joins later)."""
    from mlx_tracer.runtime.prefix_cache import PrefixCache

    model = tiny_model("llama")
    cm = CompiledModel(model)
    eng = Engine(cm, buckets=(1, 2, 4, 8), prefill_chunks=(8, 32), prefill_step_tokens=32,
                 prefix_cache=PrefixCache(64 << 20))
    prompts = [LONG[k:k + 20] for k in (0, 30, 60, 90, 120)]
    for p in prompts:  # served once: the cache holds them
        eng.add(p, max_tokens=1)
    for _ in eng.run():
        pass
    first = eng.add([1, 2, 3], max_tokens=60)
    for _ in range(3):
        eng.step()
    late = [eng.add(p, max_tokens=6) for p in prompts]
    assert all(eng.cached_tokens(u) == 19 for u in late)
    first_step, got, steps = {}, {u: [] for u in late}, 0
    while not all(got.values()):
        events = eng.step()
        steps += 1
        assert any(ev.uid == first and ev.token is not None for ev in events)  # the running row never waits a step
        for ev in events:
            if ev.uid in got and ev.token is not None:
                first_step.setdefault(ev.uid, steps)
                got[ev.uid].append(ev.token)
    assert len(set(first_step.values())) == 1, first_step  # joined together
    assert steps <= 3, steps
    for ev in eng.run():
        if ev.uid in got and ev.token is not None:
            got[ev.uid].append(ev.token)
    for p, u in zip(prompts, late):
        assert got[u] == solo(model, p, 6)


def test_while_newcomers_wait_a_step_runs_one_decode_step_and_no_join_beside_windows():
    """A dispatch returns only when its step is nearly done (MLX bounds the
    tasks in flight), so a step that refilled the drained pipeline after a
    join ran two decode steps for one token: while requests wait to join,
    every step runs one; and a job whose last windows ran in a step joins at
    the next (not after a budget of prefill in the same step). The tokens are
    those of solo runs."""
    model = tiny_model("llama")
    cm = CompiledModel(model)
    eng = Engine(cm, buckets=(1, 2, 4, 8), prefill_chunks=(8, 32), prefill_step_tokens=32)
    first = eng.add([1, 2, 3], max_tokens=150)
    for _ in range(4):
        eng.step()
    prompts = [LONG[k : k + 20] for k in (0, 20, 40, 60, 80)]
    late = [eng.add(p, max_tokens=5) for p in prompts]
    calls = []
    windows_per_step(cm, calls)
    got, joins = {u: [] for u in late}, 0
    while eng.scheduler.queue:
        before, joined = len(calls), eng.stats.joins
        events = eng.step()
        decodes = [L for L in calls[before:] if L == 1]
        windows = [L for L in calls[before:] if L > 1]
        if eng.scheduler.queue:  # (the step that joins the last one refills the pipeline)
            assert len(decodes) <= 1, calls[before:]  # (0: the step read the one in flight)
        if eng.stats.joins > joined:
            joins += 1
            assert not windows, calls[before:]
        assert any(ev.uid == first and ev.token is not None for ev in events)
        for ev in events:
            if ev.uid in got and ev.token is not None:
                got[ev.uid].append(ev.token)
    assert joins == len(late)
    for ev in eng.run():
        if ev.uid in got and ev.token is not None:
            got[ev.uid].append(ev.token)
    assert [got[u] for u in late] == [solo(model, p, 5) for p in prompts]
