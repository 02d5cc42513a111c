"""The as-run baseline: stock mlx-lm on MLX's reference BLAS, weights as loaded.

The BLAS binding is fixed per process (it is decided when mlx is first
imported), so the baseline runs in a subprocess started with
``MLX_TRACER_BLAS=0``: ``python -m mlx_tracer.bench '<spec JSON>'``, whose
``__main__`` calls :func:`baseline_main` and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from ..runtime.step import CompiledModel
from .models import load_bench_model, synthetic_context
from .systems import stock_decode


def baseline(names: Sequence[str], path: Optional[str], buckets, contexts, tokens: int, runs: int) -> Dict[tuple, List[float]]:
    """Stock mlx-lm as a user runs it (MLX's reference BLAS, weights as loaded),
    in a subprocess, since the BLAS binding is fixed per process.
    Returns ``{(model name, B, C): [tok/s per run]}``."""
    spec = json.dumps({"names": list(names), "path": path, "buckets": list(buckets), "contexts": list(contexts), "tokens": tokens, "runs": runs})
    env = dict(os.environ, MLX_TRACER_BLAS="0")
    r = subprocess.run([sys.executable, "-m", "mlx_tracer.bench", spec], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"baseline run failed: {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {(m, b, c): v for m, b, c, v in out}


def baseline_main(spec: dict):
    """The subprocess side of :func:`baseline`: prints ``[[name, B, C, [tok/s...]], ...]``."""
    from ..backend import blas

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
