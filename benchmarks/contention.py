"""SmolLM2 decode and prefill at bucket 1 beside N busy processes, per BLAS
thread setting: how much a busy machine slows the compiled loop.

    python benchmarks/contention.py --busy 2 [--reps 2] [--tokens 32] [--prompt-repeat 16] [--weights quantized]

Each setting runs in a fresh process (the BLAS thread count is read at
import); the busy processes are shell loops, killed at the end. Prints the
median decode and prefill tok/s of each setting and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

RUN = r'''
import json, sys
import mlx_tracer
from mlx_tracer import Generator
gen = Generator.load(weights=sys.argv[3], buckets=(1,))
gen.warmup(buckets=[1], prefill=False)
prompt = " ".join(["Write a short paragraph about the history of Paris."] * int(sys.argv[2]))
gen.generate(prompt, max_tokens=4)  # prefill windows traced, kernels built
gen.engine.reset_stats()
gen.generate(prompt, max_tokens=int(sys.argv[1]))
print(json.dumps({"decode": gen.stats.decode_tps, "prefill": gen.stats.prefill_tps}))
'''

SETTINGS = {
    "2 threads (pinned)": {"MLX_TRACER_BLAS_THREADS": "2"},
    "1 thread (pinned)": {"MLX_TRACER_BLAS_THREADS": "1"},
    "per-phase policy (default)": {},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=0, help="busy processes beside the run")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-repeat", type=int, default=1,
                    help="repeat the prompt sentence N times (1: ~12 prompt tokens, a noisy prefill figure; 16: ~190)")
    ap.add_argument("--weights", default="float32",
                    help="the weight format (float32: the figures before 0.5; quantized: qmm's pool, what auto picks)")
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if k != "MLX_TRACER_BLAS_THREADS"}
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(args.busy)]
    try:
        res = {k: [] for k in SETTINGS}
        load0 = os.getloadavg()
        for _ in range(args.reps):
            for name, env in SETTINGS.items():
                r = subprocess.run([sys.executable, "-c", RUN, str(args.tokens), str(args.prompt_repeat), args.weights], capture_output=True, text=True, env=dict(base, **env))
                if r.returncode != 0:
                    print(r.stderr[-2000:], file=sys.stderr)
                    return 1
                res[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(f"busy processes: {args.busy}; load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
        for name, rs in res.items():
            d = statistics.median(r["decode"] for r in rs)
            p = statistics.median(r["prefill"] for r in rs)
            print(f"{name:28s} decode {d:6.1f} tok/s   prefill {p:6.1f} tok/s")
    finally:
        for h in hogs:
            h.kill()
    return 0


if __name__ == "__main__":
    from mlx_tracer.backend.malloc import reexec

    reexec()  # measure under the malloc the mlx-tracer command runs with (MLX_TRACER_MALLOC=system: glibc)
    sys.exit(main())
