"""The compiled step against mlx-lm's eager decode, on tiny random models of
several families: bit-exact logits, greedy tokens equal to BatchGenerator,
trace counts, window steps, sampling, weight swaps and bad input."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from mlx_tracer.adapters import UnsupportedModel
from mlx_tracer.caches import FullCache, RingCache
from mlx_tracer.runtime.engine import Engine
from mlx_tracer.runtime.sampling import SamplingParams, sampler_inputs
from mlx_tracer.runtime.step import CompiledModel, NewTraceError, TraceKey, bucket_for

from .helpers import assert_decode_writes_in_place
from .tiny_models import FAMILIES, SLIDE, VOCAB, tiny_model

PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    [7, 8],
    [9, 10, 11, 40, 41],
    [3] * 20,
    [5],
    [60, 61, 62, 63, 64, 65, 66],
]


def solo_prefill(model, prompts):
    """mlx-lm eager prefill, one serial prompt cache per prompt."""
    solos = []
    for p in prompts:
        c = make_prompt_cache(model)
        mx.eval(model(mx.array([p]), cache=c))
        solos.append(c)
    return solos


def merge_layers(solos, build):
    return [build([s[i] for s in solos]) for i in range(len(solos[0]))]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, tiny_model(request.param)


@pytest.mark.parametrize("live,bucket", [(3, 4), (5, 8)])
def test_decode_logits_are_bit_exact_vs_mlx_lm_eager_batched_decode(family, live, bucket):
    name, model = family
    cm = CompiledModel(model)
    prompts = PROMPTS[:live]
    solos = solo_prefill(model, prompts)
    theirs = merge_layers(solos, lambda cs: cs[0].merge(cs))
    ours = merge_layers(solos, lambda cs: (FullCache if type(cs[0]) is KVCache else RingCache).merge(cs, width=bucket))
    tokens = [p[-1] for p in prompts]
    for step in range(2 * SLIDE + 4):  # crosses the ring wrap of the sliding layers
        ref = model(mx.array(tokens)[:, None], cache=theirs)[:, -1, :]
        padded = mx.array(tokens + [0] * (bucket - live))[:, None]
        out = cm.step(ours, padded, return_logits=True)
        got = out.logits
        assert bool(mx.all(mx.isfinite(got)).item()), "padding rows produced non-finite logits"
        assert mx.array_equal(got[:live], ref), (
            f"{name} step {step}: logits differ from mlx-lm (max {mx.abs(got[:live] - ref).max().item()})"
        )
        tokens = mx.argmax(ref, axis=-1).tolist()
        assert out.tokens[:live].tolist() == tokens
    assert sum(cm.traces.values()) == 1  # one trace served every step


def batch_generator_tokens(model, prompts, max_tokens):
    gen = BatchGenerator(model, max_tokens=max_tokens)
    uids = gen.insert(prompts, max_tokens=max_tokens if isinstance(max_tokens, list) else None)
    out = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
    return [out[u] for u in uids]


def test_greedy_tokens_equal_batch_generator(family):
    name, model = family
    budgets = [24, 9, 17, 30, 3, 12]  # rows leave at different steps: buckets shrink 8 -> 4 -> 2 -> 1
    ref = batch_generator_tokens(model, PROMPTS, budgets)
    eng = Engine(model, buckets=(1, 2, 4, 8))
    uids = [eng.add(p, max_tokens=m) for p, m in zip(PROMPTS, budgets)]
    got = {u: [] for u in uids}
    for ev in eng.run():
        got[ev.uid].append(ev.token)
    for u, want in zip(uids, ref):
        assert got[u] == want, f"{name}: request {u} differs from BatchGenerator"
    widths = {k.width for k in eng.compiled.traces if k.kind == "decode"}
    assert widths == {8, 4, 2, 1}
    assert all(n == 1 for n in eng.compiled.traces.values()), eng.compiled.traces


@pytest.mark.parametrize("name", ["llama_mixed", "ring_only"])
def test_trace_counts_over_300_steps_with_rows_joining_and_leaving(name):
    model = tiny_model(name)
    eng = Engine(model, buckets=(1, 2, 4, 8), prefill_chunks=(16,))
    rng = np.random.default_rng(0)
    steps = 0
    while steps < 300:
        if rng.random() < 0.15 and len(eng.rows) + len(eng.queue) < 8:
            n = int(rng.integers(1, 12))
            eng.add(rng.integers(0, VOCAB, size=n).tolist(), max_tokens=int(rng.integers(5, 60)))
        if not eng.has_work():
            eng.add([1, 2, 3], max_tokens=40)
        eng.step()
        steps += 1
    traces = eng.compiled.traces
    assert all(n == 1 for n in traces.values()), f"a (kind, bucket, L, capacity) traced twice: {traces}"
    decode = [k for k in traces if k.kind == "decode"]
    if name == "ring_only":  # no capacity: exactly one decode trace per bucket
        assert {k.capacity for k in traces} == {None}
        assert len(decode) == len({k.width for k in decode})
    # steady state: the traced buckets serve every further step
    with eng.compiled.no_new_traces():
        for width in sorted({k.width for k in decode}):
            while len(eng.rows) > width or (eng.rows and bucket_for(len(eng.rows), eng.buckets) != width):
                for r in eng.rows[width:]:
                    r.max_tokens = len(r.tokens) + 1
                eng.step()
            for _ in range(2 * SLIDE):
                if not eng.rows:
                    break
                eng.step()


def test_no_new_traces_guard_fails_when_a_region_traces():
    eng = Engine(tiny_model("llama"), buckets=(1, 2))
    eng.add([1, 2, 3], max_tokens=2)
    with pytest.raises(NewTraceError, match="unexpected new traces"):
        with eng.compiled.no_new_traces():
            list(eng.run())


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "ring_only"])
def test_window_step_reproduces_eager_prefill(name):
    model = tiny_model(name)
    cm = CompiledModel(model)
    prompts = [PROMPTS[0] + PROMPTS[3], PROMPTS[2]]  # 33 and 5 tokens: the first wraps the window
    L = 16
    ours = cm.new_caches(2, rows=2)
    for c in ours:
        c.prepare(lengths=[len(p) for p in prompts], right_padding=[48 - len(p) for p in prompts])
    tok = np.zeros((2, 48), dtype=np.int32)
    for i, p in enumerate(prompts):
        tok[i, : len(p)] = p
    last = None
    for start in range(0, 48, L):
        n = [max(0, min(len(p) - start, L)) for p in prompts]
        last = mx.array([max(x - 1, 0) for x in n], dtype=mx.int32)
        out = cm.step(ours, mx.array(tok[:, start : start + L]), return_logits=True, last=last)
        if start == 32:  # the first prompt ends in this window
            eager = model(mx.array([prompts[0]]), cache=make_prompt_cache(model))[:, -1, :]
            assert np.allclose(np.array(out.logits[0]), np.array(eager[0]), atol=1e-4)
    for c in ours:
        c.finalize()
    solos = solo_prefill(model, prompts)
    for layer, (c, s) in enumerate(zip(ours, solos[0])):
        k, v = c.temporal_view(0)
        sk = s.keys[..., : s.offset, :] if isinstance(s, KVCache) else s.keys
        n = k.shape[2]
        assert np.allclose(np.array(k), np.array(sk[..., -n:, :]), atol=1e-4), f"layer {layer} keys"
    assert {k.kind for k in cm.traces} == {"window"} and len(cm.traces) == 1


# ------------------------------------------------------------------ sampling
def sample_run(model, params, n=12):
    eng = Engine(model, buckets=(1, 2, 4))
    uids = [eng.add([1, 2, 3], max_tokens=n, sampling=p) for p in params]
    got = {u: [] for u in uids}
    for ev in eng.run():
        got[ev.uid].append(ev.token)
    return [got[u] for u in uids], eng


def test_sampling_is_reproducible_with_a_seed_and_temperature_zero_is_greedy():
    model = tiny_model("llama", head_scale=0.5)  # flat logits: sampling really samples
    a, _ = sample_run(model, [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=8)])
    b, _ = sample_run(model, [SamplingParams(temperature=1.0, seed=7)])
    assert a[0] == b[0], "a seeded request must not depend on its batch neighbours"
    assert a[0] != a[1], "different seeds should give different samples"
    greedy, _ = sample_run(model, [SamplingParams()])
    mixed, eng = sample_run(model, [SamplingParams(temperature=0.0, seed=3), SamplingParams(temperature=1.0, seed=3)])
    assert mixed[0] == greedy[0]
    assert any(k.sampler == "sample" for k in eng.compiled.traces)
    topk1, _ = sample_run(model, [SamplingParams(temperature=2.0, top_k=1, seed=1)])
    assert topk1[0] == greedy[0]


def test_sampling_filters_restrict_the_support():
    from mlx_tracer.runtime.sampling import sample

    logits = mx.array([[0.0, 3.0, 2.9, 1.0, -1.0]] * 4)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    params = [
        SamplingParams(temperature=1.0, top_k=2, seed=1),
        SamplingParams(temperature=1.0, top_p=0.5, seed=2),
        SamplingParams(temperature=1.0, min_p=0.5, seed=3),
        SamplingParams(temperature=5.0, seed=4),
    ]
    from mlx_tracer.runtime.sampling import initial_key

    s = sampler_inputs(params, [initial_key(p.seed) for p in params], 4)
    seen = [set() for _ in params]
    for _ in range(200):
        toks, s["keys"] = sample(logprobs, s)
        for i, t in enumerate(toks.tolist()):
            seen[i].add(t)
    assert seen[0] == {1, 2}
    assert seen[1] == {1, 2}  # p = 0.47, 0.43, 0.06, ...: the mass ranked above token 2 is 0.47 < 0.5
    assert seen[2] == {1, 2}  # p >= 0.5 * 0.47
    assert len(seen[3]) >= 4  # high temperature reaches the tail


# -------------------------------------------------------------- weights/model
@pytest.mark.parametrize("fuse", [None, False])
def test_swapped_weights_are_used_without_a_stale_trace(fuse):
    model = tiny_model("llama", seed=0)
    cm = CompiledModel(model, fuse=fuse)
    caches = cm.new_caches(1, rows=1)
    a = cm.step(caches, mx.array([[5]]), return_logits=True).logits
    model.update(tiny_model("llama", seed=1).parameters())
    caches = cm.new_caches(1, rows=1)
    b = cm.step(caches, mx.array([[5]]), return_logits=True).logits
    eager = model(mx.array([[5]]))[:, -1, :]
    assert not mx.array_equal(a, b)
    assert np.allclose(np.array(b), np.array(eager), atol=1e-5)
    # the model's own forward takes the weights as inputs: its trace is reused;
    # the lean one holds them as constants: it traced again
    assert sum(cm.traces.values()) == (1 if fuse is False else 2)


def test_compiled_decode_writes_buffers_in_place():
    model = tiny_model("llama")
    cm = CompiledModel(model, capacities=(8192,))
    assert_decode_writes_in_place(cm, "the compiled step copied the KV buffers")


class _WithCaches:
    """Wrap a tiny model so that make_cache returns the given cache kinds."""

    def __init__(self, model, make):
        self.model, self.make = model, make
        self.layers = model.layers

    def make_cache(self):
        return self.make()

    def __call__(self, *a, **k):
        return self.model(*a, **k)


@pytest.mark.parametrize(
    "make,msg",
    [
        (lambda: [KVCache(), ArraysCache(2), KVCache()], "layer 1: cache type ArraysCache"),
        (lambda: [QuantizedKVCache(), KVCache(), KVCache()], "layer 0: cache type QuantizedKVCache"),
        (lambda: [KVCache(), KVCache(), CacheList(KVCache(), KVCache())], "layer 2: cache type CacheList"),
        (lambda: [KVCache(), RotatingKVCache(8, keep=4), KVCache()], "layer 1: RotatingKVCache\\(keep=4\\)"),
    ],
)
def test_unsupported_cache_kinds_are_named(make, msg):
    with pytest.raises(UnsupportedModel, match=msg):
        CompiledModel(_WithCaches(tiny_model("llama"), make))


def test_model_that_skips_its_cache_is_refused():
    model = tiny_model("llama")

    class Shared(_WithCaches):
        def __call__(self, inputs, cache=None):
            return self.model(inputs, cache=[cache[0]] * len(cache))  # every layer writes layer 0's cache

    with pytest.raises(UnsupportedModel, match="layer 0: .* updated 3 times"):
        CompiledModel(Shared(model, model.make_cache if hasattr(model, "make_cache") else lambda: [KVCache()] * 3))


# ------------------------------------------------------------------ bad input
def test_bad_requests_are_refused_and_other_rows_are_unharmed():
    model = tiny_model("llama")
    solo = Engine(model, buckets=(1, 2))
    u = solo.add(PROMPTS[0], max_tokens=10)
    want = [ev.token for ev in solo.run()]

    eng = Engine(model, buckets=(1, 2), capacities=(64, 128))
    uid = eng.add(PROMPTS[0], max_tokens=10)
    eng.step()
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 101\)"):
        eng.add([1, VOCAB + 3], max_tokens=3)
    with pytest.raises(ValueError, match="exceed the largest capacity bucket 128"):
        eng.add([1] * 120, max_tokens=20)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add([], max_tokens=3)
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        eng.add([1], max_tokens=0)
    got = list([r for r in eng.rows if r.uid == uid][0].tokens) + [ev.token for ev in eng.run()]
    assert got == want and not eng.queue


def test_more_live_rows_than_the_largest_bucket():
    with pytest.raises(ValueError, match=r"bucket 8 exceeded: 9 live rows; pass buckets=\(\.\.\., 16\)"):
        bucket_for(9, (1, 2, 4, 8))
    model = tiny_model("llama")
    eng = Engine(model, buckets=(1, 2))
    for i in range(3):
        eng.add([1 + i, 2], max_tokens=4)
    eng.step()
    assert len(eng.rows) == 2 and len(eng.queue) == 1  # the third waits for room
    cm = eng.compiled
    with pytest.raises(ValueError, match="tokens must be"):
        cm.step(eng.caches, mx.zeros((3, 1), dtype=mx.int32))
