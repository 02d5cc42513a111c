"""A burst of newcomers beside running streams: the running rows' gaps
between tokens and the newcomers' time to first token, with interleaved
prefill (``prefill_step_tokens``) and with newcomers prefilled whole (0).

    python benchmarks/burst.py [--running 4] [--newcomers 16] [--prompt 120] [--tokens 64] [--weights auto]
                               [--settings 64,0] [--cached] [--batched-prefill auto|on|off]

In-process on the engine (no HTTP): the running requests decode first, then
the newcomers are queued together; each engine step's events are stamped
with the wall clock. Prints, per setting, the running rows' median and
longest gap, the newcomers' TTFT p50 / p99 and the aggregate tok/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx_tracer  # noqa: F401  (first: it binds the fast BLAS before mlx loads)
from mlx_tracer import Generator
from mlx_tracer.runtime.engine import Engine
from mlx_tracer.runtime.prefix_cache import PrefixCache


def run(compiled, args, step_tokens):
    cache = PrefixCache(512 << 20) if args.cached else None
    eng = Engine(compiled, buckets=(1, 2, 4, 8, 16, 32), prefill_step_tokens=step_tokens,
                 batched_prefill=args.batched_prefill, prefix_cache=cache)
    prompts = [[(i * 13 + j) % 2000 + 50 for j in range(args.prompt)] for i in range(args.newcomers)]
    if cache is not None:  # the prompts served once before: the burst's prefills continue them
        for p in prompts:
            eng.add(p, max_tokens=1)
        for _ in eng.run():
            pass
    running = [eng.add([100 + i, 7, 8, 9], max_tokens=2000) for i in range(args.running)]
    for _ in range(8):  # the running rows decode before the burst
        eng.step()
    last = {u: time.perf_counter() for u in running}
    gaps = {u: [] for u in running}
    t0 = time.perf_counter()
    new = [eng.add(p, max_tokens=args.tokens) for p in prompts]
    first, tokens = {}, 0
    while any(u in eng.scheduler.requests for u in new):
        events = eng.step()
        now = time.perf_counter()
        for ev in events:
            if ev.token is None:
                continue
            tokens += 1
            if ev.uid in gaps:
                gaps[ev.uid].append(now - last[ev.uid])
                last[ev.uid] = now
            elif ev.uid not in first:
                first[ev.uid] = now - t0
    wall = time.perf_counter() - t0
    for u in running:
        eng.cancel(u)
    for _ in eng.run():
        pass
    all_gaps = sorted(g for v in gaps.values() for g in v)
    ttft = sorted(first.values())
    return {"gap_median_s": statistics.median(all_gaps), "gap_max_s": all_gaps[-1],
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "tok_s": tokens / wall}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", type=int, default=4)
    p.add_argument("--newcomers", type=int, default=16)
    p.add_argument("--prompt", type=int, default=120)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--weights", default="auto")
    p.add_argument("--settings", default="64,0", help="prefill_step_tokens values, in turns")
    p.add_argument("--cached", action="store_true",
                   help="the newcomers' prompts were served before: a prefix cache holds them (as a warmed-up server's)")
    p.add_argument("--batched-prefill", choices=("auto", "on", "off"), default="auto",
                   help="newcomers prefilled together in one padded batch (Engine(batched_prefill=...))")
    args = p.parse_args()
    args.batched_prefill = {"auto": None, "on": True, "off": False}[args.batched_prefill]
    gen = Generator.load(weights=args.weights)
    compiled = gen.engine.compiled
    settings = [int(s) for s in args.settings.split(",")]
    for s in settings:  # trace first: every bucket and window shape the measured runs reach
        run(compiled, argparse.Namespace(**{**vars(args), "tokens": 2}), s)
    print(f"load average {os.getloadavg()[0]:.2f} before; weights {gen.weights}")
    for s in settings:
        r = run(compiled, args, s)
        print(f"prefill_step_tokens={s:<4} running gap median {r['gap_median_s']:.3f} s, longest {r['gap_max_s']:.3f} s "
              f"({r['gap_max_s'] / r['gap_median_s']:.1f}x); newcomers TTFT p50 {r['ttft_p50_s']:.2f} s, "
              f"p99 {r['ttft_p99_s']:.2f} s; {r['tok_s']:.1f} tok/s")
    print(f"load average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    from mlx_tracer.backend.malloc import reexec

    reexec()  # measure under the malloc the mlx-tracer command runs with (MLX_TRACER_MALLOC=system: glibc)
    main()
