"""Sharded decode on 1 vs N ranks: tok/s, and each step split into compute and collective.

    python benchmarks/bench_distributed.py                                  # 1 rank
    python benchmarks/bench_distributed.py --ranks 2                        # 2 ranks on 127.0.0.1
    mlx.launch --backend ring -n 2 python benchmarks/bench_distributed.py   # the same, through mlx.launch

``--ranks N`` starts the ranks itself with the variables mlx.launch sets
(MLX_RANK, MLX_HOSTFILE): mlx.launch's own I/O loop busy-polls (measured
here: ~1.4 of the 2 cores while the ranks run), which would be timed too.

It decodes ``--batch`` greedy rows of a random llama for ``--tokens`` tokens
(median of ``--runs`` timed runs after a warm one), on N > 1 ranks three
ways, run interleaved so that a busy moment of a shared machine hits each
alike: ``real`` (the all-sums of the sharded layers in the graph, lockstep
check every ``DEFAULT_CHECK_EVERY`` steps), ``stub`` (traced with every
``mx.distributed.all_sum`` replaced by the identity: the same per-rank
compute with no communication, so ``real - stub`` is the step's collective
time) and ``check_every_step``. Only rank 0 prints (one JSON line with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx_tracer  # noqa: F401  (first: it binds the fast BLAS before mlx loads)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_tracer.runtime.distributed import DEFAULT_CHECK_EVERY, Lockstep, init_group, shard_model
from mlx_tracer.runtime.engine import Engine


def tiny_llama(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, seed: int = 0):
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5,
                           vocab_size=vocab, tie_word_embeddings=False)
    mx.random.seed(seed)  # the same weights on every rank
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def decode_run(engine: Engine, step, batch: int, tokens: int) -> tuple:
    """(tok/s, ms per step) of ``batch`` rows decoding ``tokens`` tokens after a 16-token prompt."""
    rng = np.random.default_rng(0)
    for _ in range(batch):
        engine.add(rng.integers(1, engine.vocab_size, size=16).tolist(), max_tokens=tokens)
    engine.admit()  # prefill stays out of the decode timing
    engine.reset_stats()
    while engine.has_work():
        step(engine)
    s = engine.stats
    return s.decode_tps, 1e3 * s.decode_s / s.steps


class Config:
    """One way to run the decode: an engine (traced and warmed) and its step function."""

    def __init__(self, name: str, model, group, args, check_every: int = DEFAULT_CHECK_EVERY, stub: bool = False):
        self.name, self.args, self.runs = name, args, []
        real_all_sum = mx.distributed.all_sum
        if stub:  # traced without the all-sums: replays never call them
            mx.distributed.all_sum = lambda x, *a, **k: x
        try:
            sharded = group is not None and group.size() > 1
            lock = Lockstep(group, check_every=check_every) if sharded and not stub else None
            self.step = (lambda e: e.step()) if lock is None else lock.step
            self.engine = Engine(model, buckets=(args.batch,), prefill_chunks=(16,))
            self.run()  # traces, kernel builds
            self.runs.clear()
        finally:
            mx.distributed.all_sum = real_all_sum

    def run(self):
        self.runs.append(decode_run(self.engine, self.step, self.args.batch, self.args.tokens))
        assert all(n == 1 for n in self.engine.compiled.traces.values()), "a timed run traced"

    def result(self) -> dict:
        return {"tok_s": statistics.median(r[0] for r in self.runs), "ms_step": statistics.median(r[1] for r in self.runs)}


def collective_latency(op, group, shape, reps: int = 200) -> float:
    """Median µs of one eager collective ``op`` (all_sum, all_gather) of a float32 array of ``shape``."""
    x = mx.ones(shape)
    mx.eval(op(x, group=group))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(op(x, group=group))
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def spawn_ranks(n: int, port: int) -> int:
    """Run this script as ``n`` ranks on 127.0.0.1 (ring backend); returns the worst exit status."""
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[f"127.0.0.1:{port + r}"] for r in range(n)], f)
    argv, skip = [], False
    for a in sys.argv[1:]:  # the same options, less --ranks
        if skip or a == "--ranks" or a.startswith("--ranks="):
            skip = a == "--ranks"
            continue
        argv.append(a)
    procs = [subprocess.Popen([sys.executable, __file__, *argv], env=dict(os.environ, MLX_RANK=str(r), MLX_HOSTFILE=f.name))
             for r in range(n)]
    try:
        return max(abs(p.wait()) for p in procs)
    finally:
        for p in procs:
            p.kill()
        os.unlink(f.name)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=101)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--ranks", type=int, default=0, help="start this many ranks on 127.0.0.1 (without mlx.launch)")
    p.add_argument("--port", type=int, default=42323, help="first ring port of --ranks")
    args = p.parse_args()
    if args.ranks:
        return spawn_ranks(args.ranks, args.port)
    launched = "MLX_RANK" in os.environ
    group = init_group() if launched else None
    size, rank = (group.size(), group.rank()) if group is not None else (1, 0)

    row = {"ranks": size, "hidden": args.hidden, "layers": args.layers, "batch": args.batch, "tokens": args.tokens,
           "load_before": os.getloadavg()}
    model = tiny_llama(args.hidden, args.layers, args.heads, args.kv_heads, args.vocab)
    configs = []
    if size > 1:
        shard_model(model, group)
        configs.append(Config("stub", model, group, args, stub=True))
        configs.append(Config("check_every_step", model, group, args, check_every=1))
    configs.append(Config("real", model, group, args))
    for _ in range(args.runs):  # interleaved, so that a busy moment hits every configuration alike
        for c in configs:
            c.run()
    row.update({c.name: c.result() for c in configs})
    if size > 1:
        row["collective_ms_step"] = row["real"]["ms_step"] - row["stub"]["ms_step"]
        row["check_ms_step"] = row["check_every_step"]["ms_step"] - row["real"]["ms_step"]
        row["all_sum_us"] = collective_latency(mx.distributed.all_sum, group, (args.batch, 1, args.hidden))
        row["all_gather_us"] = collective_latency(mx.distributed.all_gather, group, (1, 2))
        row["all_sums_per_step"] = 2 * args.layers
    row["load_after"] = os.getloadavg()
    if rank == 0:
        print(json.dumps(row) if args.json else "\n".join(f"{k}: {v}" for k, v in row.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
