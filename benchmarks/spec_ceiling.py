"""How much prompt-lookup speculation could buy at a bucket, at best.

    python benchmarks/spec_ceiling.py [--weights W] [--tokens 64] [--ks 4 8 16] [--steps 30]
                                      [--costs 2:1.3,5:2.0,9:2.8,17:4.0] [--bucket 1] [--tree 4]

Generates the plain greedy output of each prompt of a workload of
``benchmarks/speculative.py`` (``mlx_tracer.bench.speculative.WORKLOADS``;
``--workload "edits its prompt"``: eight prompts the bench does not run, to
judge a policy on text it was not tuned on; speculation emits the same
tokens), then replays it against prompt lookup's drafts at every position
(exact: the drafter sees what the engine would) and prints, per prompt:

* **always, k**: verify steps with ``k`` drafts whenever there are drafts
  (the ``always`` policy): steps, tokens per step, the accepted runs;
* **auto, k**: the engine's own policy (``Speculator``, ``auto``) replayed at
  the same costs (``mlx_tracer.bench.speculative.replay_policy``: stepping as
  the engine does, plain steps pipelined while it judges a verify step could
  not pay; one speculator per k learns over the workload, its second pass
  printed): units, speedup and its schedule; and over all prompts. What it
  loses to the oracle is the policy's (it cannot know which drafts hold);
  what the bench measures below this is the engine's time around the steps;
* **oracle**: the fewest decode-step units any policy could spend on that
  output — at each position either a plain step (1) or a verify step of a
  window L (cost c(L), advancing by the drafts it would accept + 1), chosen
  knowing every outcome (dynamic programming over positions) — and the
  speedup it bounds: tokens / units.

c(L) is a verify step of L tokens over a decode step: measured here at
``--bucket`` (1 by default) on the workload's model (the verify step built and evaluated —
it cannot be pipelined — over a pipelined decode step, the next built
while the last computes, as the engine runs them), or given with
``--costs``. A window not measured is priced by linear interpolation. No
real policy reaches the oracle: it pays for refused drafts the oracle
skips. The bucket-1 goal of the speculation issue (2.5x on text that
quotes its prompt) is above this bound wherever the bound says so.

With ``--tree N`` (4 by default; 0: not), the oracle once more with token
trees: each window's L - 1 drafts a tree of the continuations of up to N
earlier matches of the context's suffix, level by level, priced as a window
of L (``oracle_units(..., tree=N)``): how much verifying several candidate
continuations at once could add to prompt lookup.

With ``--bucket B`` (> 1) the costs are a bucket-B verify step's over a
bucket-B decode step, and the workload's prompts run as the bench batches
them (prompt i % count in row i); the batch's bound
(``mlx_tracer.bench.speculative.batch_bound``) is the longest output over
the largest of the rows' oracles: one window serves every row of a verify
step, so no row's schedule beats its own oracle, and plain decode takes as
many steps as the longest output (the bucket-4 goal: 1.5x); the exact
bound (``batch_oracle_units``) searches the one schedule all rows follow,
a window chosen for some rows paid for all. The engine's
policy is replayed on that batch too (``replay_batch``: one window for all
rows a verify step, each row advancing by what its own output confirms).

With ``--peer-python PATH`` (a Python that has llama_cpp, as ``mlx-tracer
bench --peer-python``): llama.cpp's c(L) on the same GGUF file, threads and
context — one decode call of L tokens a sequence, logits for each, over a
decode call of one (its calls are not pipelined) — and the oracle's bound
at those costs on the same outputs: what the same speculation could buy
llama.cpp on this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
from mlx_tracer.runtime.speculator import WINDOWS  # the windows the auto policy chooses among


def measured_costs(model, compiled, context: int, steps: int, bucket: int = 1) -> dict:
    """c(L) for WINDOWS at ``bucket`` over ``context`` positions a row (see module docstring)."""
    from mlx_tracer.bench import synthetic_context
    from mlx_tracer.bench.systems import _tracer_steps

    build, evaluate, verify, dispatch = _tracer_steps(
        compiled, [synthetic_context(model, compiled.layout, context)] * bucket, windows=True)
    for _ in range(3):  # traces and warm-up
        build(), evaluate()
        for L in WINDOWS:
            verify(L)
    decode, windows = [], {L: [] for L in WINDOWS}
    for _ in range(3):  # interleaved rounds: a drift of the machine's speed hits both
        evaluate()
        t0 = time.perf_counter()
        for _ in range(steps):  # pipelined: step t+1 is built while step t computes
            dispatch()
        evaluate()
        decode.append((time.perf_counter() - t0) / steps)
        for L in WINDOWS:
            for _ in range(max(2, steps // 4)):
                t0 = time.perf_counter()
                verify(L)
                windows[L].append(time.perf_counter() - t0)
    d = statistics.median(decode)
    return {L: statistics.median(t) / d for L, t in windows.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--workload", default="quotes its prompt")
    ap.add_argument("--steps", type=int, default=30, help="decode steps a measuring round (3 rounds)")
    ap.add_argument("--costs", default=None, help="c(L) as L:c,... instead of measuring (e.g. 2:1.3,5:2.0,9:2.8)")
    ap.add_argument("--bucket", type=int, default=1, help="rows decoding together (the costs measured at this bucket)")
    ap.add_argument("--peer-python", default=None, help="a Python with llama_cpp: llama.cpp's c(L) on the same file too")
    ap.add_argument("--tree", type=int, default=4,
                    help="the oracle again with token trees of up to this many lookup continuations (0: not)")
    args = ap.parse_args()
    if args.bucket < 1:
        ap.error("--bucket takes B >= 1")
    from mlx_tracer import Generator
    from mlx_tracer.bench.speculative import REPLAY_WORKLOADS as WORKLOADS
    from mlx_tracer.bench.speculative import (batch_bound, batch_oracle_units, oracle_units, replay_always,
                                              replay_batch, replay_policy)
    from mlx_tracer.runtime.drafters import PromptLookup
    from mlx_tracer.runtime.speculator import Speculator

    if args.workload not in WORKLOADS:
        ap.error(f"--workload takes one of {', '.join(map(repr, WORKLOADS))}")
    gen = Generator.load(weights=args.weights, progress=False)
    prompts = WORKLOADS[args.workload]
    contexts = [gen.encode(p) for p in prompts]
    if args.costs:
        costs = {int(L): float(c) for L, c in (kv.split(":") for kv in args.costs.split(","))}
    else:
        costs = measured_costs(gen.model, gen.engine.compiled, max(map(len, contexts)), args.steps, args.bucket)
    print(f"weights {args.weights}, workload {args.workload!r}, {args.tokens} tokens, bucket {args.bucket}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print("c(L), verify step / pipelined decode step: " + " ".join(f"L{L}:{c:.2f}" for L, c in sorted(costs.items())))
    peer_costs = peer_window_costs(args.peer_python, args.bucket, max(map(len, contexts))) if args.peer_python else None
    drafter = PromptLookup()
    windows = sorted(set(costs) | {k + 1 for k in args.ks})
    totals = {"tokens": 0, "oracle": 0.0}
    per_prompt = []  # (tokens, oracle units) of each prompt's output
    outputs = [list(res.tokens) for res in gen.batch_generate(prompts, max_tokens=args.tokens)]
    # the engine's own policy at these costs, one speculator per k learning over the workload as the
    # engine does: its second pass is printed (the first, as the bench's untimed run, teaches it)
    policy = {}
    for k in args.ks:
        spec = Speculator(PromptLookup(), k)
        for rep in range(2):
            policy[k] = [replay_policy(spec, c, o, costs, uid=rep * len(outputs) + j)
                         for j, (c, o) in enumerate(zip(contexts, outputs))]
    for j, (prompt, context, out) in enumerate(zip(prompts, contexts, outputs)):
        print(f"-- {prompt[:40]!r}...: {len(out)} tokens")
        for k in args.ks:
            runs = replay_always(context, out, drafter, k)
            steps = len(out) - sum(runs)
            print(f"   always, k={k:<2}: {steps} steps ({len(out) / steps:.2f} tokens a step), runs {runs}")
        for k in args.ks:
            u, schedule = policy[k][j]
            print(f"   auto, k={k:<4}: {u:.1f} units, {(len(out) - 1) / u:.2f}x: {' '.join(schedule)}")
        units = oracle_units(context, out, drafter, costs, windows)
        per_prompt.append((len(out), units))
        totals["tokens"] += len(out)
        totals["oracle"] += units
        print(f"   oracle: {units:.1f} decode steps' time, {len(out) / units:.2f}x plain decode at most")
    print(f"all prompts: {totals['tokens']} tokens in {totals['oracle']:.1f} decode steps' time at best: "
          f"{totals['tokens'] / totals['oracle']:.2f}x plain decode at most (windows {windows})")
    decoded = sum(len(out) - 1 for out in outputs)  # the first token of each comes from its prefill
    for k in args.ks:
        print(f"the engine's policy (auto, k={k}) at these costs: {decoded} decoded tokens in "
              f"{sum(u for u, _ in policy[k]):.1f} units: {decoded / sum(u for u, _ in policy[k]):.2f}x plain decode")
    if args.tree:
        units = sum(oracle_units(c, o, drafter, costs, windows, tree=args.tree) for c, o in zip(contexts, outputs))
        print(f"oracle with token trees (up to {args.tree} lookup continuations a window): "
              f"{totals['tokens'] / units:.2f}x plain decode at most")
    if args.bucket > 1:
        rows = [per_prompt[i % len(prompts)] for i in range(args.bucket)]
        batch = [i % len(prompts) for i in range(args.bucket)]
        batch_contexts, batch_outputs = [contexts[i] for i in batch], [outputs[i] for i in batch]
        exact = batch_oracle_units(batch_contexts, batch_outputs, drafter, costs, windows)
        print(f"a batch of {args.bucket} (prompt i % {len(prompts)} in row i), one window a verify step: "
              f"{max(t for t, _ in rows) / exact:.2f}x plain decode at most (one schedule for all rows, "
              f"searched; each row's own oracle bounds it at {batch_bound(rows):.2f}x)")
        for k in args.ks:  # the engine's policy on that batch, a speculator learning as above (second pass)
            spec = Speculator(PromptLookup(), k)
            for rep in range(2):
                u, schedule = replay_batch(spec, batch_contexts, batch_outputs, costs, args.bucket,
                                           uid=rep * args.bucket)
            steps = max(map(len, batch_outputs)) - 1
            print(f"the engine's policy (auto, k={k}) on that batch at these costs: {steps} plain steps' tokens in "
                  f"{u:.1f} units: {steps / u:.2f}x plain decode; {' '.join(schedule)}")
    if peer_costs:
        peer = [(len(out), oracle_units(context, out, drafter, peer_costs, windows))
                for context, out in zip(contexts, outputs)]
        n, units = sum(t for t, _ in peer), sum(u for _, u in peer)
        print(f"llama.cpp at its c(L), the same outputs: {units:.1f} decode calls' time at best: "
              f"{n / units:.2f}x its plain decode at most"
              + (f"; a batch of {args.bucket}: {batch_bound([peer[i % len(prompts)] for i in range(args.bucket)]):.2f}x"
                 if args.bucket > 1 else ""))
    return 0


def peer_window_costs(python: str, bucket: int, context: int):
    """llama.cpp's c(L) for WINDOWS on the default model's GGUF file (printed), or None (why, printed)."""
    from mlx_tracer.bench.peer import gguf_file, peer_threads, start_peer

    worker, note = start_peer(python)
    print(note)
    path = gguf_file("smollm2", None)
    if worker is None or path is None:
        if path is None:
            print("llama.cpp: skipped (the default model is no GGUF file here)")
        return None
    try:
        worker.load(path, peer_threads())
        ms = worker.window(bucket, context, list(WINDOWS))
    finally:
        worker.close()
    costs = {L: ms[L] / ms[1] for L in WINDOWS}
    print(f"llama.cpp c(L), a decode call of L tokens a sequence / of one ({ms[1]:.2f} ms, {context} positions): "
          + " ".join(f"L{L}:{c:.2f}" for L, c in sorted(costs.items())))
    return costs


if __name__ == "__main__":
    from mlx_tracer.backend.malloc import reexec

    reexec()  # measure under the malloc the mlx-tracer command runs with (MLX_TRACER_MALLOC=system: glibc)
    raise SystemExit(main())
