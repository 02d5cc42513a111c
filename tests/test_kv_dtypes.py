"""K/V stored quantized (8/4-bit, mlx-lm's QuantizedKVCache layout) or in half
precision. The oracle is mlx-lm's own eager decode with a serial cache of the
same format per layer (``QuantizedKVCache``; a ``KVCache`` holding float16
arrays): greedy tokens equal in buckets with continuous batching, on the lean
forward and on the model's own forward, speculative verify windows too (their
rollback drops quantized columns), one trace per key. The caches' differential
tests for every format are in test_caches_oracle.py (TypedPair)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from mlx_tracer.adapters.contract import LayerLayout
from mlx_tracer.caches.storage import KVFormat
from mlx_tracer.runtime.engine import Engine
from mlx_tracer.runtime.options import OptionError
from mlx_tracer.runtime.step import CompiledModel

from .helpers import FRANCE, model_present
from .tiny_models import tiny_model

try:
    from mlx_tracer.backend import kernels as _kernels

    KERNELS = _kernels.load()
except Exception:  # pragma: no cover - the kernels' own tests say why
    KERNELS = None


@pytest.fixture(params=["auto", "vector"])
def attention(request):
    """The kernels' decode attention as ``auto`` picks it (beside these float32
    projections: MLX's arithmetic) and on vector lanes (what packed
    projections get: the float path's lanes on MLX's dequantized values)."""
    if request.param == "vector" and KERNELS is None:
        pytest.skip("native kernels unavailable")
    before = KERNELS.attention_mode() if KERNELS is not None else None
    if KERNELS is not None:
        KERNELS.attention_mode(request.param)
    yield request.param
    if KERNELS is not None:
        KERNELS.attention_mode(before)

# three rows of different lengths and budgets: bucket 4, then 2 and 1 as they finish
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9, 10], [5, 6, 7, 5, 6, 7, 5, 6]]
BUDGETS = [12, 6, 9]


class _HalfCache:
    """Wraps an mlx-lm cache so that it stores float16 arrays (what "mlx-lm with a float16 cache" means here)."""

    def __init__(self, cache, dtype):
        self.cache, self.dtype = cache, dtype

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def update_and_fetch(self, keys, values):
        return self.cache.update_and_fetch(keys.astype(self.dtype), values.astype(self.dtype))


def mlx_lm_caches(model, fmt: KVFormat):
    caches = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    if fmt.quantized:
        assert all(type(c) is KVCache for c in caches), "mlx-lm has no quantized rotating cache"
        return [QuantizedKVCache(group_size=fmt.group_size, bits=fmt.bits) for _ in caches]
    return [_HalfCache(c, {"float16": mx.float16, "bfloat16": mx.bfloat16}[fmt.dtype]) for c in caches]


def mlx_lm_greedy(model, prompt, steps, fmt: KVFormat):
    """mlx-lm's eager greedy decode with one serial cache of ``fmt`` per layer."""
    caches = mlx_lm_caches(model, fmt)
    logits = model(mx.array([prompt]), cache=caches)
    out = []
    for _ in range(steps):
        out.append(mx.argmax(logits[0, -1]).item())
        logits = model(mx.array([[out[-1]]]), cache=caches)
    return out


def engine_tokens(engine, prompts=PROMPTS, budgets=BUDGETS):
    uids = [engine.add(p, max_tokens=n) for p, n in zip(prompts, budgets)]
    out = {u: [] for u in uids}
    for ev in engine.run():
        if ev.token is not None:
            out[ev.uid].append(ev.token)
    return [out[u] for u in uids]


def kv_options(fmt: KVFormat) -> dict:
    return dict(kv_bits=fmt.bits, kv_group_size=fmt.group_size, kv_dtype=fmt.dtype)


@pytest.mark.parametrize("fuse", [None, False], ids=["lean", "model"])
@pytest.mark.parametrize("family,fmt", [
    ("llama", KVFormat(bits=8)),
    ("qwen3", KVFormat(bits=8)),
    ("llama", KVFormat(bits=4, group_size=32)),
    ("llama", KVFormat(bits=4)),  # one group a head of 64: the vector attention's factored arithmetic
    ("llama", KVFormat(dtype="float16")),
    ("llama_mixed", KVFormat(dtype="float16")),  # rings and a full layer
], ids=lambda x: x if isinstance(x, str) else x.describe().replace(" ", ""))
def test_greedy_tokens_equal_mlx_lm_with_a_cache_of_the_same_format(family, fmt, fuse, attention):
    model = tiny_model(family, head_dim=64)
    want = [mlx_lm_greedy(model, p, n, fmt) for p, n in zip(PROMPTS, BUDGETS)]
    cm = CompiledModel(model, fuse=fuse, kv=fmt)
    engine = Engine(cm, buckets=(1, 2, 4), prefill_chunks=(8, 16), prefill_step_tokens=0)
    assert engine_tokens(engine) == want
    assert all(n == 1 for n in cm.traces.values()), cm.traces  # one trace per key in this format
    with cm.no_new_traces():
        assert engine_tokens(Engine(cm, buckets=(1, 2, 4), prefill_chunks=(8, 16), prefill_step_tokens=0)) == want
    if cm.lean is not None and cm.lean.native is not None:
        assert cm.lean.native_off is None  # the native kernels read every format


@pytest.mark.parametrize("family", ["llama", "ring_only"])
def test_speculative_rollback_drops_quantized_columns(family, attention):
    """Verify windows over 8-bit K/V refuse drafts (a ring long after it wrapped
    too): every token equals plain decoding with the same caches, and mlx-lm's
    where it has the cache (full attention)."""
    model = tiny_model(family, head_dim=64)
    prompts, budgets = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 9, 3], [11, 12, 13, 11, 12]], [30, 20, 25]
    cm = CompiledModel(model, kv=KVFormat(bits=8))
    plain = engine_tokens(Engine(cm, buckets=(1, 2, 4), prefill_chunks=(8, 16)), prompts, budgets)
    spec_engine = Engine(cm, buckets=(1, 2, 4), prefill_chunks=(8, 16), speculative="prompt-lookup", draft_tokens=3,
                         spec_policy="always")
    assert engine_tokens(spec_engine, prompts, budgets) == plain
    st = spec_engine.stats
    assert st.verify_steps > 0 and 0 < st.accepted < st.drafted
    assert all(n == 1 for n in cm.traces.values()), cm.traces
    if family == "llama":
        assert plain == [mlx_lm_greedy(model, p, n, KVFormat(bits=8)) for p, n in zip(prompts, budgets)]


def test_a_serial_quantized_cache_continues_in_the_engine_and_retires_quantized():
    """``add(cache=...)`` with mlx-lm's QuantizedKVCache rows; retiring rows come
    back as QuantizedKVCache (what a prefix cache stores)."""
    model, fmt = tiny_model("llama", head_dim=64), KVFormat(bits=8)
    prompt, n = [1, 2, 3, 4, 5, 6, 7, 8, 9], 8
    want = mlx_lm_greedy(model, prompt, n, fmt)
    caches = mlx_lm_caches(model, fmt)
    model(mx.array([prompt[:-1]]), cache=caches)
    retired = []
    engine = Engine(model, buckets=(1, 2), kv_bits=8, on_retire=lambda r, cs, toks: retired.append(cs))
    uid = engine.add([prompt[-1]], max_tokens=n, cache=caches)
    assert [ev.token for ev in engine.run() if ev.uid == uid and ev.token is not None] == want
    (row,) = retired
    assert all(type(c) is QuantizedKVCache and c.bits == 8 and c.offset == len(prompt) + n - 1 for c in row)


def test_quantized_rings_join_extract_and_rejoin():
    """mlx-lm has no quantized rotating cache: a quantized ring row extracts to
    a QuantizedRingRow that joins a batch again, float32 rings are quantized on
    join, and decoding one on its own is refused clearly."""
    layout = LayerLayout(8, kv_heads=2, k_dim=64, v_dim=64, storage=KVFormat(bits=4))
    serial = RotatingKVCache(max_size=8)
    serial.update_and_fetch(mx.random.normal((1, 2, 11, 64)), mx.random.normal((1, 2, 11, 64)))
    batch = layout.from_serial(serial, width=2)
    row = batch.extract(0)
    assert row.bits == 4 and row.offset == 11 and row.keys[0].shape == (1, 2, 8, 8)
    again = type(batch).join([row, batch], width=2)
    assert again.storage == layout.storage and again.n == 2
    for a, b in zip(again.temporal_view(0)[0], batch.temporal_view(0)[0]):
        assert mx.array_equal(a, b)
    with pytest.raises(NotImplementedError, match="join it into one"):
        row.update_and_fetch(mx.zeros((1, 2, 1, 64)), mx.zeros((1, 2, 1, 64)))
    with pytest.raises(ValueError, match="cannot join 4-bit"):
        type(batch).join([row], width=1, storage=KVFormat(bits=8))


def test_memory_of_each_format_at_smollm2_shape():
    """SmolLM2-135M's caches (30 layers, 3 KV heads of 64) at bucket 8 and 1024
    positions, from the buffers' shapes: 8-bit <= 0.3x float32, 4-bit <= 0.17x."""
    def mb(fmt):
        layout = LayerLayout(None, kv_heads=3, k_dim=64, v_dim=64, storage=fmt)
        return 30 * layout.new_cache(8, rows=8, capacity=1024).nbytes / 2**20

    fp32, fp16, q8, q4 = mb(KVFormat()), mb(KVFormat(dtype="float16")), mb(KVFormat(bits=8)), mb(KVFormat(bits=4))
    assert fp32 == 360.0 and fp16 == 180.0
    assert q8 / fp32 <= 0.3 and q4 / fp32 <= 0.17, (q8 / fp32, q4 / fp32)


def test_bad_formats_fail_before_work_with_what_to_do():
    with pytest.raises(OptionError, match="exclude each other"):
        Engine(tiny_model("llama"), kv_bits=8, kv_dtype="float16")
    with pytest.raises(OptionError, match="kv_bits must be 4 or 8"):
        Engine(tiny_model("llama"), kv_bits=6)
    with pytest.raises(ValueError, match="use kv_dtype='float16' instead"):  # head dim 16: no group fits
        Engine(tiny_model("llama"), kv_bits=8)
    with pytest.raises(ValueError, match="pass kv_group_size=32"):
        Engine(tiny_model("llama", head_dim=32), kv_bits=8)
    cm = CompiledModel(tiny_model("llama", head_dim=64), kv=KVFormat(bits=8))
    with pytest.raises(OptionError, match="stores K/V as 8-bit"):
        Engine(cm, kv_bits=4)


@pytest.mark.model
def test_smollm2_with_8bit_kv_answers_as_mlx_lm_does():
    if not model_present():
        pytest.skip("SmolLM2 GGUF not present: run `mlx-tracer fetch` (or ./dev setup)")
    from mlx_tracer import Generator
    from mlx_tracer.loading.store import resolve_model

    gen = Generator.load(resolve_model(), weights="quantized", kv_bits=8, progress=False)
    prompt = gen.encode(FRANCE)
    want = mlx_lm_greedy(gen.model, prompt, 16, KVFormat(bits=8))
    uid = gen.submit(FRANCE, max_tokens=16)
    for _ in gen.events():
        pass
    out = gen.result(uid)
    assert out.tokens == want[: len(out.tokens)]
    assert "Paris" in out.text


def test_the_command_line_checks_the_kv_flags_before_loading():
    import subprocess

    from .helpers import CLI

    for argv, says in ((["generate", "hi", "--kv-bits", "8", "--kv-dtype", "float16"], "exclude each other"),
                       (["serve", "--kv-group-size", "32"], "needs --kv-bits"), (["bench", "--kv-bits", "3"], "invalid choice")):
        r = subprocess.run([CLI, *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)


def test_mlx_lm_style_functions_take_kv_bits():
    from mlx_tracer import generate

    from .helpers import IdTokenizer

    model = tiny_model("llama", head_dim=64)
    text = generate(model, IdTokenizer(), PROMPTS[0], max_tokens=BUDGETS[0], kv_bits=8)
    assert text == "".join(f"<{t}>" for t in mlx_lm_greedy(model, PROMPTS[0], BUDGETS[0], KVFormat(bits=8)))
