"""The one owner of options (runtime/options.py): typed errors naming the
parameter, the server's 400 body taken from them as they are, the context
check shared by the generator and the server; and the engine's narrow
surface: snapshot(), reset_stats(), hooks given at construction."""

from __future__ import annotations

import dataclasses

import pytest

from mlx_tracer import Generator
from mlx_tracer.runtime.engine import Engine
from mlx_tracer.runtime.options import (
    CONTEXT_LENGTH_EXCEEDED, OptionError, OptionTypeError, check_context_length, check_engine_options, check_max_tokens,
)
from mlx_tracer.runtime.prefix_cache import PrefixCache
from mlx_tracer.runtime.sampling import SamplingParams
from mlx_tracer.serve.errors import invalid_option
from mlx_tracer.serve.protocol import parse_chat

from .helpers import IdTokenizer, solo_tokens
from .tiny_models import tiny_model

CHAT = [{"role": "user", "content": "x"}]


def _raised(f, *args, **kwargs) -> OptionError:
    with pytest.raises(OptionError) as e:
        f(*args, **kwargs)
    return e.value


@pytest.mark.parametrize("call, param, is_type_error", [
    (lambda: check_engine_options(buckets=(0,)), "buckets", False),
    (lambda: check_engine_options(buckets="1,2"), "buckets", True),
    (lambda: check_engine_options(prefill_chunks=(1, 8)), "prefill_chunks", False),
    (lambda: check_engine_options(speculative="prompt-lookup", draft_tokens=1.5), "draft_tokens", True),
    (lambda: check_engine_options(spec_policy="sometimes"), "spec_policy", False),
    (lambda: check_engine_options(speculative=3), "speculative", True),
    (lambda: check_max_tokens(0), "max_tokens", False),
    (lambda: check_max_tokens(2.5, "max_completion_tokens"), "max_completion_tokens", True),
    (lambda: SamplingParams(top_p=0), "top_p", False),
    (lambda: SamplingParams(seed=1.5), "seed", True),
])
def test_an_option_error_names_its_parameter_and_keeps_the_builtin_classes(call, param, is_type_error):
    e = _raised(call)
    assert e.param == param and str(e) == e.reason and param in e.reason
    assert isinstance(e, ValueError) and isinstance(e, TypeError) == is_type_error
    assert isinstance(e, OptionTypeError) == is_type_error


def test_the_servers_400_body_is_the_errors_own_param_message_and_code():
    e = OptionError("top_k", "top_k must be >= 0 (0 = off), got -1", "some_code")
    assert invalid_option(e).body() == {"error": {"message": e.reason, "type": "invalid_request_error",
                                                  "param": "top_k", "code": "some_code"}}
    with pytest.raises(Exception) as got:
        parse_chat({"messages": CHAT, "max_completion_tokens": 0}, "m")
    want = _raised(check_max_tokens, 0, "max_completion_tokens")
    assert (got.value.status, got.value.param, got.value.message) == (400, "max_completion_tokens", str(want))
    with pytest.raises(Exception) as got:
        parse_chat({"messages": CHAT, "top_p": 2}, "m")
    assert (got.value.param, got.value.message) == ("top_p", str(_raised(SamplingParams, top_p=2.0)))


def test_the_generator_refuses_a_long_prompt_through_the_shared_context_check():
    gen = Generator(tiny_model("qwen3"), IdTokenizer(), chat=False)  # max_position_embeddings = 512
    e = _raised(gen.submit, list(range(1, 101)) * 5, max_tokens=20)
    assert (e.param, e.code) == ("prompt", CONTEXT_LENGTH_EXCEEDED)
    assert str(e) == str(_raised(check_context_length, 500, 20, 512))
    e = _raised(check_context_length, None, 600, 512, max_param="max_completion_tokens")  # the server, before tokenizing
    assert (e.param, e.code) == ("max_completion_tokens", CONTEXT_LENGTH_EXCEEDED) and "no room" in str(e)
    check_context_length(10, 10, None)  # no limit


def test_snapshot_and_reset_stats():
    model = tiny_model("llama")
    eng = Engine(model, buckets=(1, 2))
    empty = eng.snapshot()
    assert (empty.bucket, empty.live_rows, empty.queued, empty.stats.steps, empty.prefix_cache) == (0, 0, 0, 0, None)
    eng.add([1, 2, 3], max_tokens=8)
    eng.add([4, 5], max_tokens=3)
    assert eng.snapshot().queued == 2
    eng.step()
    snap = eng.snapshot()
    assert (snap.bucket, snap.live_rows, snap.queued) == (2, 2, 0)
    assert snap.traces == eng.compiled.traces and snap.traces_made == sum(eng.compiled.traces.values())
    assert snap.traces_by_kind()["decode"][0] == len({k for k in snap.traces if k.kind == "decode"})
    steps = snap.stats.steps
    list(eng.run())
    assert snap.stats.steps == steps and eng.stats.steps > steps  # a copy
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.bucket = 4
    fresh = eng.reset_stats()
    assert eng.stats is fresh and fresh.steps == 0
    eng.add([1, 2, 3], max_tokens=4)
    list(eng.run())
    assert eng.stats.decode_tokens == eng.snapshot().stats.decode_tokens > 0  # the batch counts into the new stats
    with pytest.raises(AttributeError):
        eng.stats = fresh  # no setter: reset_stats() is the way


def test_hooks_are_given_at_construction():
    model = tiny_model("llama")
    kept = {}
    gen = Generator(model, IdTokenizer(), chat=False, on_retire=lambda r, caches, toks: kept.setdefault(r.uid, list(toks)))
    out = gen.batch_generate([[5, 6, 7], [1, 2]], max_tokens=4)
    assert sorted(kept) == sorted(c.uid for c in out)
    assert kept[out[0].uid][:3] == [5, 6, 7] and out[0].tokens == solo_tokens(model, [5, 6, 7], 4)


def test_a_prefix_cache_given_at_construction_serves_a_shared_prefix():
    model = tiny_model("llama")
    gen = Generator(model, IdTokenizer(), chat=False, prefix_cache=PrefixCache(1 << 30))
    first = list(range(10, 30))
    gen.generate(first, max_tokens=4)
    uid = gen.submit(first + [7, 8], max_tokens=6)
    assert gen.cached_tokens(uid) > 0
    list(gen.events())
    assert gen.result(uid).tokens == solo_tokens(model, first + [7, 8], 6)
    assert gen.engine.snapshot().prefix_cache.stats.hits == 1
