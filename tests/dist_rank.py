"""One rank of the sharded-model tests (tests/test_distributed.py starts them).

    MLX_RANK=r MLX_HOSTFILE=hosts.json python tests/dist_rank.py main OUT BAD_DIR MODEL_DIR...
    MLX_RANK=r MLX_HOSTFILE=hosts.json python tests/dist_rank.py die|hang OUT MODEL_DIR
    mlx.launch --backend ring -n 2 -- python tests/dist_rank.py generate OUT MODEL_DIR

``main``: the unsplittable model in ``BAD_DIR`` must fail clearly; then, per
model directory, continuous batching (greedy tokens per request), trace
counts, a steady-state rerun under ``no_new_traces``, sampling (seeded and
unseeded), in-place decode writes and a logits trace. Each rank writes
``OUT/<model>.rank<r>.json`` (+ ``.npy`` logits). ``die``/``hang``: rank 1
exits / stops after a few decode steps; rank 0 must not hang. ``generate``:
a user's script (rank 0 prints).

The functions used by both sides (the request plan, the logits trace) live
here so that the single-process reference runs exactly the same steps.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import mlx_tracer  # noqa: F401  (before mlx: it picks the BLAS; the tests pin MLX_TRACER_BLAS=0)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

OPTIONS = dict(chat=False, weights="as-is", buckets=(1, 2, 4), prefill_chunks=(8, 16))
# (arrival step, prompt length, max tokens): requests join a running batch at different steps
PLAN = [(0, 5, 16), (0, 12, 10), (3, 7, 14), (6, 1, 8), (9, 17, 8)]


def prompts(vocab: int):
    rng = np.random.default_rng(3)
    return [rng.integers(1, vocab, size=n).tolist() for _, n, _ in PLAN]


def run_plan(engine, step) -> list:
    """Greedy tokens per request of PLAN, with arrivals at their steps; ``step(engine)`` runs one step."""
    ps = prompts(engine.vocab_size)
    uids, got, n = {}, [[] for _ in PLAN], 0
    while n < 500 and (engine.has_work() or len(uids) < len(PLAN)):
        for j, (at, _, m) in enumerate(PLAN):
            if at == n:
                uids[engine.add(ps[j], max_tokens=m)] = j
        for ev in step(engine):
            got[uids[ev.uid]].append(ev.token)
        n += 1
    return got


def logits_trace(compiled, steps: int = 12) -> np.ndarray:
    """Logits ``[1 + steps, 2, V]`` of a 2-row window step (prompts of 11 and
    16 tokens) and the greedy decode steps after it (past the sliding window)."""
    ps = [list(range(3, 14)), list(range(20, 36))]
    caches = compiled.new_caches(2, rows=2)
    for c in caches:
        c.prepare(lengths=[len(p) for p in ps], right_padding=[16 - len(p) for p in ps])
    tok = np.zeros((2, 16), dtype=np.int32)
    for i, p in enumerate(ps):
        tok[i, : len(p)] = p
    last = mx.array([len(p) - 1 for p in ps], dtype=mx.int32)
    out = [compiled.step(caches, mx.array(tok), return_logits=True, last=last).logits]
    for c in caches:
        c.finalize()
    for _ in range(steps):
        nxt = mx.argmax(out[-1], axis=-1).astype(mx.int32)[:, None]  # [2, 1]
        out.append(compiled.step(caches, nxt, return_logits=True).logits)
        mx.eval(out[-1], [c.state for c in caches])
    return np.stack([np.array(x) for x in out])


def in_place_growth(model) -> float:
    """Peak memory growth of a decode step over 8192-column buffers, as a fraction of their bytes."""
    from mlx_tracer.runtime.step import CompiledModel

    cm = CompiledModel(model, capacities=(8192,))
    caches = cm.new_caches(1, rows=1)
    mx.eval(cm.step(caches, mx.array([[1]])).tokens, [c.state for c in caches])
    total = sum(c.nbytes for c in caches)
    worst = 0
    for t in range(3):
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out = cm.step(caches, mx.array([[t + 2]]))
        mx.eval(out.tokens, [c.state for c in caches])
        worst = max(worst, mx.get_peak_memory() - base)
    return worst / total


def forward_in_use(compiled) -> dict:
    """Which forward the compiled step runs: the lean one (on which layers, and
    why not on the native kernels) or the model's own."""
    lean = compiled.lean
    if lean is None or not lean.active:
        return {"lean": False}
    return {"lean": True, "layers": lean.layers.name, "native_off": lean.native_off}


def own_forward_equal(model, trace: np.ndarray) -> bool:
    """Whether ``trace`` (the lean forward's logits) equals, bit for bit, the
    model's own (sharded) forward compiled over the same steps."""
    from mlx_tracer.runtime.step import CompiledModel

    return bool(np.array_equal(logits_trace(CompiledModel(model, fuse=False)), trace))


def _traces(compiled) -> dict:
    return {repr(k): n for k, n in compiled.traces.items()}


def main_scenario(out: Path, bad: str, dirs):
    from mlx_tracer import Generator
    from mlx_tracer.runtime.distributed import shard_model, sharded_size
    from mlx_tracer.runtime.step import NewTraceError

    rank = None
    try:
        Generator.load(bad, distributed=True, **OPTIONS)
        bad_error = None
    except ValueError as e:
        bad_error = f"{type(e).__name__}: {e}"
    for d in dirs:
        t0 = time.perf_counter()
        gen = Generator.load(d, distributed=True, **OPTIONS)
        rank, lock = gen.rank, gen.lockstep
        res = {"rank": rank, "size": gen.world_size, "primary": gen.is_primary, "bad_error": bad_error,
               "sharded_size": sharded_size(gen.model),
               "kv_heads": [layer.kv_heads for layer in gen.engine.compiled.layout]}
        res["phase_s"] = {"load": time.perf_counter() - t0}
        res["forward"] = forward_in_use(gen.engine.compiled)
        q_proj = gen.model.layers[0].self_attn.q_proj
        res["reshard_noop"] = shard_model(gen.model, lock.group) is gen.model and gen.model.layers[0].self_attn.q_proj is q_proj
        res["tokens"] = run_plan(gen.engine, lock.step)
        res["phase_s"]["plan"] = time.perf_counter() - t0
        res["traces"] = _traces(gen.engine.compiled)
        try:
            with gen.engine.compiled.no_new_traces():
                res["steady_tokens"] = run_plan(gen.engine, lock.step)
            res["steady"] = "ok"
        except NewTraceError as e:
            res["steady"] = str(e)
        ps = prompts(gen.engine.vocab_size)[:3]
        res["seeded"] = [c.tokens for c in gen.batch_generate(ps, max_tokens=8, temp=0.9, seed=11)]
        res["unseeded"] = [c.tokens for c in gen.batch_generate(ps, max_tokens=8, temp=1.0)]
        res["phase_s"]["sampling"] = time.perf_counter() - t0
        res["checks"] = lock.checks
        res["in_place_growth"] = in_place_growth(gen.model)
        res["phase_s"]["in_place"] = time.perf_counter() - t0
        trace = logits_trace(gen.engine.compiled)
        np.save(out / f"{Path(d).name}.rank{rank}.npy", trace)
        res["own_forward_equal"] = own_forward_equal(gen.model, trace)
        res["phase_s"]["own_forward"] = time.perf_counter() - t0
        res["seconds"] = time.perf_counter() - t0
        (out / f"{Path(d).name}.rank{rank}.json").write_text(json.dumps(res))
        if gen.is_primary:
            print(f"PRIMARY {Path(d).name}: {gen.summary()}", flush=True)
    res["diverged"] = diverge(gen)
    (out / f"{Path(d).name}.rank{rank}.json").write_text(json.dumps(res))


def diverge(gen):
    """Each rank asks for something else (same lengths, so the steps still
    match; the tokens even agree: the all-sums mix the ranks' inputs): the
    lockstep check must fail on every rank."""
    from mlx_tracer.runtime.distributed import DistributedError

    engine, lock = gen.engine, gen.lockstep
    engine.add([1 + gen.rank, 2, 3], max_tokens=3 * lock.check_every)
    start = lock.steps
    try:
        while engine.has_work():
            lock.step(engine)
    except DistributedError as e:
        return {"error": str(e), "steps": lock.steps - start}
    return None


def failure_scenario(kind: str, out: Path, model_dir: str):
    """Rank 1 dies (``die``) or stops answering (``hang``) after a few steps; rank 0 runs on."""
    from mlx_tracer import Generator

    gen = Generator.load(model_dir, distributed=True, **OPTIONS)
    for i, ev in enumerate(gen.stream_generate([1, 2, 3], max_tokens=1000)):
        if i == 5:  # traces and kernel builds are done: from here on a step takes milliseconds
            gen.lockstep.watchdog.timeout = float(os.environ["RANK_TEST_TIMEOUT"])
        if gen.rank == 1 and i == 20:
            if kind == "die":
                os._exit(3)
            time.sleep(3600)  # stuck: the test kills it
    print("rank", gen.rank, "finished without noticing", flush=True)


def generate_scenario(model_dir: str):
    """What a user's script does: load, generate, print on rank 0 only."""
    from mlx_tracer import Generator

    gen = Generator.load(model_dir, distributed=True, **OPTIONS)
    out = gen.batch_generate([[1, 2, 3]], max_tokens=6)[0]
    if gen.is_primary:
        print(f"PRIMARY {out.tokens}", flush=True)


if __name__ == "__main__":
    kind, out = sys.argv[1], Path(sys.argv[2])
    if kind == "main":
        main_scenario(out, sys.argv[3], sys.argv[4:])
    elif kind == "generate":
        generate_scenario(sys.argv[3])
    else:
        failure_scenario(kind, out, sys.argv[3])
