"""The decode-loop API on tiny models: continuous batching, stop handling,
mlx-lm-style entry points, local mlx-lm model directories."""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest

from mlx_tracer import Generator, batch_generate, generate, stream_generate
from mlx_tracer.runtime.engine import Engine

from .helpers import IdTokenizer, save_model_dir, solo_tokens
from .tiny_models import VOCAB, tiny_model


@pytest.mark.parametrize("name", ["llama_mixed", "gemma3_text"])
def test_continuous_batching_equals_solo_runs_without_retracing(name):
    model = tiny_model(name)
    rng = np.random.default_rng(3)
    plan = [(0, 5, 30), (0, 12, 20), (3, 7, 25), (9, 1, 12), (15, 30, 18), (15, 2, 9), (22, 11, 14)]  # (arrival step, prompt len, max tokens)
    prompts = [rng.integers(1, VOCAB, size=n).tolist() for _, n, _ in plan]
    eng = Engine(model, buckets=(1, 2, 4, 8), prefill_chunks=(16,))
    uids, got, step = {}, {}, 0
    while step < 200 and (eng.has_work() or len(uids) < len(plan)):
        for j, (at, _, m) in enumerate(plan):
            if at == step:
                uids[eng.add(prompts[j], max_tokens=m)] = j
        for ev in eng.step():
            got.setdefault(uids[ev.uid], []).append(ev.token)
        step += 1
    for j, (_, _, m) in enumerate(plan):
        assert got[j] == solo_tokens(model, prompts[j], m), f"request {j} differs from its solo run"
    traces = eng.compiled.traces
    assert all(n == 1 for n in traces.values()), traces
    assert eng.stats.joins >= 3


def test_generator_streams_text_and_honours_stop_strings_and_tokens():
    model = tiny_model("llama")
    gen = Generator(model, IdTokenizer())
    full = gen.generate("1 2 3", max_tokens=12)
    toks = [int(x) for x in full.strip("<>").split("><")]
    assert len(toks) == 12
    # a stop string in the middle of the stream ends the request there
    stop = f"<{toks[4]}>"
    first = full.index(stop)
    uid = gen.submit("1 2 3", max_tokens=12, stop=[stop])
    events = [ev for ev in gen.events()]
    assert "".join(ev.text for ev in events) == full[:first]
    assert events[-1].finish_reason == "stop"
    assert gen.result(uid).text == full[:first]
    # a stop token ends it and is not part of the text
    out = gen.batch_generate(["1 2 3"], max_tokens=12, stop_tokens=[toks[2]])[0]
    assert out.finish_reason == "stop" and out.tokens == toks[:2]
    assert not gen.engine.has_work()


def test_mlx_lm_style_functions_reuse_one_compiled_loop():
    model, tok = tiny_model("qwen3"), IdTokenizer()
    a = generate(model, tok, [1, 2, 3], max_tokens=6)
    b = "".join(ev.text for ev in stream_generate(model, tok, [1, 2, 3], max_tokens=6))
    outs = batch_generate(model, tok, [[1, 2, 3], [4, 5], [6]], max_tokens=[6, 3, 4], stop_tokens=())
    assert a == b == outs[0].text
    assert [len(o.tokens) for o in outs] == [6, 3, 4]
    from mlx_tracer.api import _generator_for

    traces = _generator_for(model, tok).traces
    assert all(n == 1 for n in traces.values())


def test_cancel_removes_a_request_without_harming_others():
    model = tiny_model("llama")
    want = solo_tokens(model, [5, 6, 7], 10)
    eng = Engine(model, buckets=(1, 2))
    keep = eng.add([5, 6, 7], max_tokens=10)
    drop = eng.add([9, 9], max_tokens=10)
    queued = eng.add([4], max_tokens=10)  # waits: bucket 2 is full
    got, last, step = [], {}, 0
    while eng.has_work():
        events = eng.step()
        step += 1
        got += [ev.token for ev in events if ev.uid == keep]
        last.update({ev.uid: ev for ev in events if ev.finish_reason is not None})
        if step == 2:
            assert eng.cancel(drop).finish_reason is None  # applied at the next step
            eng.cancel(queued)
        if step == 3:
            assert [r.uid for r in eng.rows] == [keep] and not eng.queue  # the row is freed
    assert got == want
    for uid in (drop, queued):
        assert last[uid].finish_reason == "cancelled" and last[uid].token is None
    with pytest.raises(KeyError):
        eng.cancel(12345)
    with pytest.raises(KeyError):
        eng.cancel(drop)  # finished: nothing left to cancel


def test_local_mlx_lm_model_directory(tmp_path):
    """Generator.load of a directory goes through mlx_lm.load (offline)."""
    save_model_dir(tmp_path, "llama")
    gen = Generator.load(tmp_path, chat=False)
    out = gen.batch_generate([[1, 2, 3]], max_tokens=8)[0]
    assert out.tokens == solo_tokens(tiny_model("llama"), [1, 2, 3], 8)[: len(out.tokens)]


def test_bad_paths_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="mlx-tracer fetch"):
        Generator.load(tmp_path / "missing.gguf")
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="corrupt|truncated"):
        Generator.load(bad)
    gen = Generator(tiny_model("llama"), IdTokenizer())
    with pytest.raises(ValueError, match="empty prompt"):
        gen.submit("")
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        gen.submit("1 2", max_tokens=0)
    assert not gen.engine.has_work()


@pytest.mark.parametrize("name", ["llama", "llama_mixed"])
def test_request_continues_from_an_mlx_lm_prompt_cache(name):
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_model(name)
    context, prompt = list(range(10, 40)), [7, 8, 9]
    want = solo_tokens(model, context + prompt, 12)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([context]), cache=cache))
    offsets = [c.offset for c in cache]
    eng = Engine(model, buckets=(1, 2))
    other = eng.add([3, 4], max_tokens=12)  # joins the same batch, prefilled from tokens
    uid = eng.add(prompt, max_tokens=12, cache=cache)
    got = [ev.token for ev in eng.run() if ev.uid == uid]
    assert got == want
    assert [c.offset for c in cache] == offsets  # the caller's caches are only read
    with pytest.raises(ValueError, match="cache has 1 layers"):
        eng.add(prompt, cache=cache[:1])


def test_rows_continuing_serial_caches_join_without_bucket_sized_copies():
    """Each request continuing a serial cache holds one row until the join
    (padded to the bucket only to feed prompt tokens): joining 8 long
    contexts one by one peaks near the batch's own size, not 8 batches'."""
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_model("llama")
    eng = Engine(model, buckets=(8,))
    caches = []
    for i in range(8):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([list(range(1 + i, 301 + i))]), cache=cache))
        caches.append(cache)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    for c in caches:
        eng.add([5], max_tokens=2, cache=c)
    eng.admit()
    batch = sum(c.nbytes for c in eng.batch.caches)
    # measured 3.0x (the rows, the batch, the join's copies); 12x when each row was padded to 8 first
    assert mx.get_peak_memory() - before < 4 * batch


@pytest.mark.parametrize("owner", ["generator", "engine, model's own forward"])
def test_a_dropped_loop_frees_its_model_without_the_cyclic_collector(owner):
    """Dropping the last reference to a Generator, or to an Engine and its
    CompiledModel, frees the model at once: no reference cycle waits for
    Python's cyclic collector, which runs at an arbitrary later point (a
    server or a bench that moves on to another model would free the first
    one's weights in the middle of other work)."""
    import gc
    import weakref

    from mlx_tracer import CompiledModel

    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        model = tiny_model("llama")
        if owner == "generator":
            loop = Generator(model, IdTokenizer())
            assert loop.generate([1, 2, 3], max_tokens=3)
            for ev in loop.stream_generate([4, 5], max_tokens=2):
                pass
            del ev
            assert loop.engine.compiled.lean is not None  # the lean forward
        else:
            loop = Engine(CompiledModel(model, fuse=False), buckets=(1,))
            loop.add([1, 2, 3], max_tokens=3)
            assert len(list(loop.run())) == 3
        ref_model, ref_loop = weakref.ref(model), weakref.ref(loop)
        del model, loop
        assert ref_loop() is None, f"the {owner} outlived its last reference"
        assert ref_model() is None, f"the model outlived its {owner}"
    finally:
        if was_enabled:
            gc.enable()


def test_joining_a_long_serial_context_converts_one_layer_at_a_time(monkeypatch):
    """A request continuing a long fp32 serial cache into fp16 caches: the
    join evaluates its layers a few MB at a time (here: each, the tiny
    model's layers being smaller than that) and releases each prefilled
    layer once it is joined, so the admission's peak stays near the batch's
    own K/V (it was every layer's conversion and copy at once: SmolLM2 at
    1024 positions, bucket 1, +62 MB for 26.5 MB of K/V; then +31), and
    the converted layers become the batch, not copied once more."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_tracer.runtime import batch as batch_module

    monkeypatch.setattr(batch_module, "JOIN_EVAL_BYTES", 1)

    model = tiny_model("llama", num_hidden_layers=12)
    cache = make_prompt_cache(model)
    for i, c in enumerate(cache):
        kv = mx.random.normal((1, 2, 1000, 16), key=mx.random.key(i))
        c.update_and_fetch(kv, kv + 1)
    mx.eval([c.state for c in cache])
    eng = Engine(model, buckets=(1,), kv_dtype="float16")
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    eng.add([5], max_tokens=2, cache=cache)
    eng.admit()
    batch = sum(c.nbytes for c in eng.batch.caches)
    rise = mx.get_peak_memory() - before
    # measured 1.17x: the converted layers become the batch (1.4x when the batch
    # joined them again, 2.9x when every layer was joined in one evaluation)
    assert rise < 1.3 * batch, (rise, batch)


def _inside_batch_joins(monkeypatch) -> list:
    """A flag, ``[True]`` while ``RunningBatch.join`` runs (patched for the test)."""
    from mlx_tracer.runtime import batch as batch_module

    inside, real_join = [False], batch_module.RunningBatch.join

    def join(self, *a, **k):
        inside[0] = True
        try:
            return real_join(self, *a, **k)
        finally:
            inside[0] = False

    monkeypatch.setattr(batch_module.RunningBatch, "join", join)
    return inside


def test_a_group_prefilled_at_the_batch_bucket_becomes_the_batch_uncopied(monkeypatch):
    """Into an empty batch, one group prefilled at the batch's bucket (a lone
    request, fresh or continuing a serial cache as a prefix-cache hit does)
    is taken as it is: no layer is joined (copied) again; its tokens are the
    solo decode's. A request joining beside it is joined as before."""
    from mlx_lm.models.cache import make_prompt_cache

    joined, inside = [], _inside_batch_joins(monkeypatch)
    model = tiny_model("llama")
    eng = Engine(model, buckets=(1, 2))
    cache_class = type(eng.compiled.layout[0].new_cache(1, 0, eng.compiled.capacities))
    real_cache_join = cache_class.join.__func__

    def cache_join(cls, *a, **k):
        joined.extend([1] if inside[0] else [])
        return real_cache_join(cls, *a, **k)

    monkeypatch.setattr(cache_class, "join", classmethod(cache_join))
    want = solo_tokens(model, [3, 4, 5, 6], 5)

    uid = eng.add([3, 4, 5, 6], max_tokens=5)
    eng.admit()
    assert joined == [] and len(eng.batch.caches) == len(eng.compiled.layout)
    got = [ev.token for ev in eng.run() if ev.uid == uid]
    assert got == want

    serial = make_prompt_cache(model)
    mx.eval(model(mx.array([[3, 4, 5]]), cache=serial))
    uid = eng.add([6], max_tokens=5, cache=serial)  # the prompt's last token after a serial cache of the rest
    eng.admit()
    assert joined == []
    assert [ev.token for ev in eng.run() if ev.uid == uid] == want

    uids = []
    for _ in range(2):  # two serial continuations: each prefilled at bucket 1, the batch's bucket is 2
        serial = make_prompt_cache(model)
        mx.eval(model(mx.array([[3, 4, 5]]), cache=serial))
        uids.append(eng.add([6], max_tokens=5, cache=serial))
    eng.admit()
    assert len(joined) == len(eng.compiled.layout), "the first row, prefilled at bucket 1, is joined into bucket 2"
    got = {u: [] for u in uids}
    for ev in eng.run():
        got[ev.uid].append(ev.token)
    assert list(got.values()) == [want, want]


def test_a_join_evaluates_its_layers_a_few_mb_at_a_time(monkeypatch):
    """LayerJoins evaluates the layers joined so far once they hold
    JOIN_EVAL_BYTES: a short prompt's join is one evaluation (one a layer
    cost ~7 of the ~30 ms of a lone request's first step on SmolLM2)."""
    from mlx_tracer.runtime import batch as batch_module

    evals, joining = [], _inside_batch_joins(monkeypatch)
    real_eval = batch_module.mx.eval

    def counted_eval(*a):
        evals.extend([1] if joining[0] else [])
        return real_eval(*a)

    monkeypatch.setattr(batch_module.mx, "eval", counted_eval)
    model = tiny_model("llama", num_hidden_layers=6)
    eng = Engine(model, buckets=(1,), kv_dtype="float16")
    per_layer = None

    def joins_for_one_request():
        nonlocal per_layer
        evals.clear()
        eng.add([5, 6, 7], max_tokens=1)
        eng.admit()
        per_layer = eng.batch.caches[0].nbytes
        n = len(evals)
        while eng.has_work():
            eng.step()
        return n

    assert joins_for_one_request() == 1  # the layers' joins, with the join's own final evaluation
    monkeypatch.setattr(batch_module, "JOIN_EVAL_BYTES", 2 * per_layer)  # every second layer: 3 groups of 6 layers
    assert joins_for_one_request() == 1 + 3
