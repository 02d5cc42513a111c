"""Benchmark: stock mlx-lm decode against mlx-tracer's compiled loop.

For each model, batch-width bucket ``B`` and context ``C`` the harness gives
every row a context of ``C`` positions (random K/V written into mlx-lm prompt
caches: decode speed does not depend on their values, and it spares a long
prefill), then decodes ``tokens`` tokens with

* **stock** mlx-lm: ``generate_step`` for ``B = 1``, ``BatchGenerator`` for
  ``B > 1``, as a user runs them;
* **tracer**: mlx-tracer's ``Engine`` (compiled decode, traced once per bucket),

in the same process, runs interleaved, the median of ``runs`` runs after a
warm-up run of each (which keeps tracing and MLX's kernel JIT out of the
timings). Host milliseconds per step (building and dispatching the step's
graph, before evaluation) are measured separately for both. The roofline is
this machine's: per-step bytes (weights + live KV) over measured copy
bandwidth, and per-step FLOPs over the measured fp32 GEMM rate.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .runtime.engine import Engine, EngineStats
from .runtime.step import CompiledModel

DEFAULT_MODELS = ("smollm2", "llama-h64", "llama-h256")


# ------------------------------------------------------------------ models
def random_llama(hidden: int, layers: int = 4, vocab: int = 1024, window: Optional[int] = None, seed: int = 0):
    """A random-init mlx-lm llama (float32); ``window`` makes every layer sliding."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import RotatingKVCache

    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=4 * hidden,
        num_attention_heads=max(hidden // 32, 2), num_key_value_heads=max(hidden // 64, 1), rms_norm_eps=1e-5,
        vocab_size=vocab, tie_word_embeddings=False,
    )

    class Sliding(llama.Model):
        def make_cache(self):
            return [RotatingKVCache(max_size=window) for _ in self.layers]

    mx.random.seed(seed)
    model = (Sliding if window else llama.Model)(args)
    mx.eval(model.parameters())
    return model


def load_bench_model(name: str, path: Optional[str] = None, weights: str = "as-is", log=lambda s: None):
    """``(model, label)`` for a bench model name (``smollm2``, ``llama-h<N>``)."""
    if name == "smollm2":
        from .api import load

        model = load(path, weights=weights, log=log)[0]
        return model, f"SmolLM2-135M {model.mlx_tracer_weights}"
    if name.startswith("llama-h"):
        h = int(name[len("llama-h") :])
        return random_llama(h), f"llama 4x{h} fp32 (random)"
    raise ValueError(f"unknown bench model {name!r}: use smollm2, llama-h64, llama-h256, ...")


# ----------------------------------------------------------------- context
def synthetic_context(model, layouts, context: int, seed: int = 0) -> list:
    """Serial mlx-lm caches holding ``context`` positions of random K/V."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    if context == 0:
        return caches
    rng = mx.random.key(seed)
    for c, l in zip(caches, layouts):
        n = context if l.window is None else min(context, l.window)
        k = mx.random.normal((1, l.kv_heads, n, l.k_dim), key=rng).astype(l.dtype)
        v = mx.random.normal((1, l.kv_heads, n, l.v_dim), key=rng).astype(l.dtype)
        c.update_and_fetch(k, v)
        c.offset = context  # rings: the evicted history counts for RoPE
    mx.eval([c.state for c in caches])
    return caches


def _copy_caches(caches):
    out = copy.deepcopy(caches)
    for c, src in zip(out, caches):
        if src.keys is not None:
            c.keys, c.values = mx.array(src.keys), mx.array(src.values)
    return out


# --------------------------------------------------------------- systems
def stock_decode(model, contexts: list, first: List[int], tokens: int) -> float:
    """Decode tokens/s of stock mlx-lm (generate_step at B=1, BatchGenerator above)."""
    from mlx_lm.generate import BatchGenerator, generate_step

    if len(contexts) == 1:
        gen = generate_step(mx.array(first[:1]), model, max_tokens=tokens, prompt_cache=_copy_caches(contexts[0]))
        next(gen)  # the first step (the 1-token prompt), as any later one
        t0 = time.perf_counter()
        n = sum(1 for _ in gen)
        return n / (time.perf_counter() - t0)
    gen = BatchGenerator(model, max_tokens=tokens)
    gen.insert([[t] for t in first], caches=[_copy_caches(c) for c in contexts])
    with gen.stats() as stats:
        while gen.next_generated():
            pass
    gen.close()
    return stats.generation_tokens / stats.decode_time


def stock_host_ms(model, contexts: list, steps: int = 8) -> float:
    """Median host ms per stock decode step: graph build + dispatch, before eval."""
    from mlx_lm.generate import _merge_caches

    cache = _copy_caches(contexts[0]) if len(contexts) == 1 else _merge_caches([_copy_caches(c) for c in contexts])
    y = mx.zeros((len(contexts), 1), dtype=mx.int32)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(y, cache=cache)[:, -1, :]
        y = mx.argmax(logits, axis=-1)[:, None]
        times.append(time.perf_counter() - t0)
        mx.eval(y, [c.state for c in cache])
    return 1e3 * statistics.median(times[1:])


def tracer_decode(engine: Engine, contexts: list, first: List[int], tokens: int) -> EngineStats:
    engine.stats = EngineStats()
    for c, t in zip(contexts, first):
        engine.add([t], max_tokens=tokens, cache=c)
    engine.admit()  # join the contexts now: admission is not decode time
    engine.stats = EngineStats()
    for _ in engine.run():
        pass
    return engine.stats


# ---------------------------------------------------------------- roofline
@dataclass
class Machine:
    copy_gbps: Dict[int, float]  # memory bandwidth by working-set bytes (cache .. DRAM), see measure()
    gemm_gflops: float  # fp32 GEMM rate (8 x 4096 x 4096)

    @staticmethod
    def _median_s(fn, reps):
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        return statistics.median(t)

    @classmethod
    def measure(cls) -> "Machine":
        """Bandwidth per working-set size: the faster of a copy (read + write)
        and a BLAS GEMV over a matrix of that size (a read stream, as decode
        reads its weights); and the fp32 GEMM rate."""
        bw = {}
        for mb in (1, 4, 16, 64, 256):
            x = mx.random.uniform(shape=(mb * 1024 * 1024 // 4,))
            n = int((mb * 1024 * 1024 // 4) ** 0.5)
            w, v = mx.random.normal((n, n)), mx.random.normal((1, n))
            mx.eval(x, w, v)
            copy = 2 * x.nbytes / cls._median_s(lambda: mx.eval(x + 1.0), 7)
            read = w.nbytes / cls._median_s(lambda: mx.eval(v @ w), 7)
            bw[mb << 20] = max(copy, read) / 1e9
        a, b = mx.random.normal((8, 4096)), mx.random.normal((4096, 4096))
        mx.eval(a, b, a @ b)
        return cls(bw, 2 * 8 * 4096 * 4096 / cls._median_s(lambda: mx.eval(a @ b), 3) / 1e9)

    def bandwidth(self, nbytes: float) -> float:
        """GB/s of a copy the size of ``nbytes`` (the working set of one step),
        interpolated in log size between the measured sizes."""
        sizes = sorted(self.copy_gbps)
        x = np.log2(min(max(nbytes, sizes[0]), sizes[-1]))
        return float(np.interp(x, np.log2(sizes), [self.copy_gbps[s] for s in sizes]))


def model_costs(model, layouts) -> Dict[str, float]:
    """Weight bytes and matmul parameters of one token's forward."""
    from mlx.utils import tree_flatten

    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    params = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            params += m.scales.size * m.group_size
        elif isinstance(m, nn.Linear):
            params += m.weight.size
    if not any(isinstance(m, (nn.Linear, nn.QuantizedLinear)) and "lm_head" in n for n, m in model.named_modules()):
        emb = model.model.embed_tokens if hasattr(model, "model") else None
        if emb is not None:  # tied head: the embedding is the output matmul too
            params += emb.scales.size * emb.group_size if isinstance(emb, nn.QuantizedEmbedding) else emb.weight.size
    kv_per_pos = sum(l.kv_heads * (l.k_dim + l.v_dim) * np.dtype(str(l.dtype).split(".")[-1]).itemsize for l in layouts)
    return {"weight_bytes": weight_bytes, "params": params, "kv_bytes_per_pos": kv_per_pos}


def roofline_tps(costs, layouts, machine: Machine, B: int, context: int) -> float:
    live = sum(min(context, l.window or context) for l in layouts) / len(layouts)
    bytes_step = costs["weight_bytes"] + B * live * costs["kv_bytes_per_pos"]
    attn_flops = sum(4 * min(context, l.window or context) * l.kv_heads * l.k_dim for l in layouts)
    flops_step = B * (2 * costs["params"] + attn_flops)
    t = max(bytes_step / (machine.bandwidth(bytes_step) * 1e9), flops_step / (machine.gemm_gflops * 1e9))
    return B / t


# ------------------------------------------------------------------- bench
@dataclass
class BenchRow:
    model: str
    bucket: int
    context: int
    stock_tps: float
    tracer_tps: float
    ratio: float
    stock_host_ms: float
    tracer_host_ms: float
    traces: int
    first_trace_ms: float
    peak_mb: float
    roofline_tps: float
    tracer_roofline_pct: float
    stock_runs: List[float] = field(default_factory=list)
    tracer_runs: List[float] = field(default_factory=list)
    baseline_tps: Optional[float] = None  # stock mlx-lm as a user runs it: reference BLAS, weights as loaded
    baseline_runs: List[float] = field(default_factory=list)

    @property
    def speedup(self) -> Optional[float]:
        return None if not self.baseline_tps else self.tracer_tps / self.baseline_tps


def bench_model(model, label: str, buckets: Sequence[int], contexts: Sequence[int], tokens: int, runs: int, machine: Machine, on_row: Callable[["BenchRow"], None] = lambda r: None) -> List[BenchRow]:
    compiled = CompiledModel(model)
    costs = model_costs(model, compiled.layouts)
    rows = []
    for C in contexts:
        ctx = synthetic_context(model, compiled.layouts, C)
        for B in buckets:
            contexts_b = [ctx] * B
            first = [(7 * i + 3) % compiled.vocab_size for i in range(B)]
            engine = Engine(compiled, buckets=(B,))
            known = set(compiled.trace_ms)
            stock_decode(model, contexts_b, first, 4)  # warm-up runs: tracing and kernel JIT
            tracer_decode(engine, contexts_b, first, 4)
            warm = {k: ms for k, ms in compiled.trace_ms.items() if k not in known and k.kind == "decode"}
            traces_before = sum(compiled.traces.values())
            s_runs, t_runs, t_host, peak = [], [], [], 0.0
            for _ in range(runs):
                s_runs.append(stock_decode(model, contexts_b, first, tokens))
                mx.reset_peak_memory()
                st = tracer_decode(engine, contexts_b, first, tokens)
                peak = max(peak, mx.get_peak_memory() / 1e6)
                t_runs.append(st.decode_tps)
                t_host.append(st.host_ms_per_step)
            traces = sum(compiled.traces.values())
            assert traces == traces_before, "the timed runs retraced"
            s, t = statistics.median(s_runs), statistics.median(t_runs)
            roof = roofline_tps(costs, compiled.layouts, machine, B, C)
            row = BenchRow(
                label, B, C, s, t, t / s, stock_host_ms(model, contexts_b), statistics.median(t_host),
                len(warm),  # decode traces this configuration made (the timed runs made none)
                max(warm.values(), default=float("nan")), peak, roof, 100 * t / roof, s_runs, t_runs,
            )
            on_row(row)
            rows.append(row)
    return rows


HEADER = (
    f"{'model':<26} {'B':>2} {'ctx':>5} {'as-run':>7} {'stock':>7} {'tracer':>7} {'vs as-run':>9} {'vs stock':>8} "
    f"{'host ms s/t':>11} {'traces':>6} {'trace ms':>8} {'peak MB':>7} {'roofline':>8}"
)
UNITS = "(tok/s: as-run = stock mlx-lm with MLX's reference BLAS and weights as loaded; stock = same process and weights as tracer)"


def format_row(r: BenchRow) -> str:
    base = f"{r.baseline_tps:>7.1f}" if r.baseline_tps else f"{'-':>7}"
    up = f"{r.speedup:>8.2f}x" if r.speedup else f"{'-':>9}"
    return (
        f"{r.model:<26} {r.bucket:>2} {r.context:>5} {base} {r.stock_tps:>7.1f} {r.tracer_tps:>7.1f} {up} {r.ratio:>7.2f}x "
        f"{r.stock_host_ms:>5.1f}/{r.tracer_host_ms:<5.2f} {r.traces:>6} {r.first_trace_ms:>8.0f} {r.peak_mb:>7.0f} "
        f"{r.tracer_roofline_pct:>7.1f}%"
    )


def baseline(names: Sequence[str], path: Optional[str], buckets, contexts, tokens: int, runs: int) -> Dict[tuple, List[float]]:
    """Stock mlx-lm as a user runs it (MLX's reference BLAS, weights as loaded),
    in a subprocess, since the BLAS binding is fixed per process.
    Returns ``{(model name, B, C): [tok/s per run]}``."""
    import os
    import subprocess
    import sys

    spec = json.dumps({"names": list(names), "path": path, "buckets": list(buckets), "contexts": list(contexts), "tokens": tokens, "runs": runs})
    env = dict(os.environ, MLX_TRACER_BLAS="0")
    r = subprocess.run([sys.executable, "-m", "mlx_tracer.bench", spec], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"baseline run failed: {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {(m, b, c): v for m, b, c, v in out}


def _baseline_main(spec: dict):
    from . import blas

    assert not blas.status().fast, "the baseline must run on MLX's reference BLAS"
    out = []
    for name in spec["names"]:
        model, _ = load_bench_model(name, spec["path"], weights="as-is")
        layouts = CompiledModel(model).layouts
        for C in spec["contexts"]:
            ctx = synthetic_context(model, layouts, C)
            for B in spec["buckets"]:
                first = [(7 * i + 3) % model.args.vocab_size for i in range(B)]
                stock_decode(model, [ctx] * B, first, 4)
                out.append([name, B, C, [stock_decode(model, [ctx] * B, first, spec["tokens"]) for _ in range(spec["runs"])]])
    print(json.dumps(out))


def steady_state(steps: int = 2000, window: int = 256, hidden: int = 64, probe: Optional[int] = None) -> dict:
    """Decode tokens/s of a ring model around step ``probe`` and around step
    ``steps``: no drift from retraces or growing buffers."""
    probe = probe or min(100, steps // 4)
    engine = Engine(random_llama(hidden, window=window), buckets=(1,))
    engine.warmup(prefill=False)
    engine.add([1, 2, 3], max_tokens=steps + probe)
    times, traces = [], None
    for i in range(steps + probe):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        if i == probe:
            traces = sum(engine.compiled.traces.values())
    early = 1 / statistics.median(times[probe // 2 : probe + probe // 2])
    late = 1 / statistics.median(times[steps - probe // 2 : steps + probe // 2])
    return {
        "model": f"llama 4x{hidden} fp32, all layers sliding (window {window})",
        "step_early": probe, "tps_early": early, "step_late": steps, "tps_late": late,
        "late_over_early": late / early,
        "traces_at_early": traces, "traces_at_end": sum(engine.compiled.traces.values()),
    }


def write_json(path: str, machine: Machine, rows: List[BenchRow], steady: Optional[dict], meta: dict):
    with open(path, "w") as f:
        json.dump({"machine": asdict(machine), "meta": meta, "rows": [asdict(r) for r in rows], "steady_state": steady}, f, indent=2)


def plot(path: str, rows: List[BenchRow]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.model, r.context) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.4), squeeze=False)
    for ax, (m, c) in zip(axes[0], groups):
        rs = sorted((r for r in rows if r.model == m and r.context == c), key=lambda r: r.bucket)
        b = [r.bucket for r in rs]
        if any(r.baseline_tps for r in rs):
            ax.plot(b, [r.baseline_tps or float("nan") for r in rs], "^:", color="gray", label="stock mlx-lm, as run")
        ax.plot(b, [r.stock_tps for r in rs], "o-", label="stock mlx-lm")
        ax.plot(b, [r.tracer_tps for r in rs], "s-", label="mlx-tracer")
        ax.set_xscale("log", base=2)
        ax.set_xticks(b, [str(x) for x in b])
        ax.set_title(f"{m}\ncontext {c}", fontsize=9)
        ax.set_xlabel("batch bucket")
        ax.set_ylabel("decode tok/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # python -m mlx_tracer.bench '<spec>': the baseline worker
    import sys

    _baseline_main(json.loads(sys.argv[1]))
