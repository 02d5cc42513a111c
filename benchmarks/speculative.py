"""Plain compiled decode against batched speculative decoding (prompt lookup)
on SmolLM2, greedy: tokens/s of the same requests, interleaved runs.

    python benchmarks/speculative.py [--k 4] [--tokens 64] [--reps 3] [--weights quantized]

Two workloads: text that quotes its prompt (where prompt lookup finds
drafts) and free text (where it mostly does not); buckets 1 and 4. Checks that
both systems emit the same tokens, and prints the acceptance, tokens per
verify step (all rows together), the verify steps of the last rep, the cost
of a verify step of each window length the policy tried against a decode
step of the same bucket (the speculator's own smoothed timings; plain steps
pipelined as it runs them) and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

PASSAGE = (
    "The Eiffel Tower was built for the 1889 World's Fair in Paris. It is 330 metres tall and was the tallest "
    "man-made structure in the world for 41 years. Gustave Eiffel's company designed and built the tower."
)
WORKLOADS = {
    "quotes its prompt": [f"Repeat this text exactly, word for word: {PASSAGE}",
                          f"Copy the following paragraph without changes: {PASSAGE}",
                          f"Rewrite this with the same words: {PASSAGE}",
                          f"Say it again exactly: {PASSAGE}"],
    "free text": ["Write a short story about a robot.", "Explain how rain forms.",
                  "Describe a day at the beach.", "Why is the sky blue?"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--weights", default="quantized", help="weight format (as `mlx-tracer generate --weights`)")
    ap.add_argument("--policy", default="auto", help="spec_policy (auto or always)")
    args = ap.parse_args()
    import mlx_tracer  # noqa: F401  (the fast BLAS binds before mlx)
    from mlx_tracer import Generator

    plain = Generator.load(weights=args.weights)
    spec = Generator(plain.model, plain.tokenizer, speculative="prompt-lookup", draft_tokens=args.k,
                     spec_policy=args.policy)
    load0 = os.getloadavg()[0]
    print(f"weights {args.weights}, policy {args.policy}")
    print(f"{'workload':<18} {'B':>2} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'accepted':>8} {'tok/verify':>10} "
          f"{'verify':>6} verify/decode by window L")
    for name, prompts in WORKLOADS.items():
        for B in (1, 4):
            batch = prompts[:B]
            times = {"plain": [], "spec": []}
            outs = {}
            for rep in range(args.reps + 1):  # the first rep traces and builds kernels
                for label, gen in (("plain", plain), ("spec", spec)):
                    gen.engine.reset_stats()
                    t0 = time.perf_counter()
                    res = gen.batch_generate(batch, max_tokens=args.tokens)
                    dt = time.perf_counter() - t0
                    if rep:
                        times[label].append(gen.stats.decode_tokens / gen.stats.decode_s)
                    outs[label] = [c.tokens for c in res]
            assert outs["plain"] == outs["spec"], "speculative decoding changed greedy tokens"
            p, s = statistics.median(times["plain"]), statistics.median(times["spec"])
            st = spec.stats
            step_s = spec.engine.speculator.step_s
            decode = step_s.get(("decode", B))
            costs = sorted((key[2], t / decode) for key, t in step_s.items() if key[:2] == ("verify", B) and decode)
            cost = " ".join(f"L{L}:{c:.2f}" for L, c in costs) or "-"
            print(f"{name:<18} {B:>2} {p:>11.1f} {s:>10.1f} {s / p:>6.2f}x {st.acceptance:>7.0%} {st.tokens_per_verify:>10.2f} "
                  f"{st.verify_steps:>6} {cost}")
    print(f"load average (1 min): {load0:.2f} before, {os.getloadavg()[0]:.2f} after; k = {args.k}, {args.tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
