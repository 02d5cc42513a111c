"""Per-step decode time (build + eval, each step evaluated) of SmolLM2 at 1024 context,
per K/V format (float32, float16, 8-bit, 4-bit), on the native kernels (and with
--ops, on MLX's ops too; with --blas, float32/float16 with the kernels' decode
attention on its BLAS arithmetic too, "-blas", beside the default, "-native"),
systems interleaved in blocks of 3 steps in one process.

    python benchmarks/kv_formats.py [BUCKETS=1,8] [STEPS=24] [--ops] [--blas]   (CTX=1024 in the environment)
"""
import os
import statistics
import sys
import time
import mlx_tracer  # noqa: F401  (BLAS first)
import mlx.core as mx
from mlx_tracer.backend import kernels
from mlx_tracer.bench.models import load_bench_model, synthetic_context
from mlx_tracer.bench.systems import _tracer_steps
from mlx_tracer.caches.storage import KVFormat
from mlx_tracer.runtime.step import CompiledModel

buckets = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 24
ctx = int(os.environ.get("CTX", "1024"))
model, label = load_bench_model("smollm2", weights="quantized")
K = kernels.load()
print(label, "attention", K.attention_mode() if K is not None else "-", flush=True)
FMTS = [("f32", KVFormat()), ("f16", KVFormat(dtype="float16")), ("q8", KVFormat(bits=8)), ("q4", KVFormat(bits=4))]
base = CompiledModel(model, fuse=True)
for B in buckets:
    contexts = [synthetic_context(model, base.layout, ctx, seed=i) for i in range(B)]
    systems = []
    for name, fmt in FMTS:
        for native in ((True, False) if "--ops" in sys.argv else (True,)):
            if name == "f32" and not native:
                continue
            cm = CompiledModel(model, fuse=True, kv=fmt)
            if not native:
                cm.lean.use_kernels(None)
            assert (cm.lean.native_off is None) == native, cm.lean.native_off
            systems.append((f"{name}-{'native' if native else 'ops'}", _tracer_steps(cm, contexts)))
            if native and "--blas" in sys.argv and name in ("f32", "f16"):
                systems.append((f"{name}-blas", _tracer_steps(cm, contexts)))
    times = {n: [] for n, _ in systems}
    cpu = {n: [] for n, _ in systems}
    block = 3
    while len(times[systems[-1][0]]) < steps:
        for n, (build, evaluate) in systems:
            if K is not None:
                K.attention_mode("blas" if n.endswith("-blas") else "auto")
            for i in range(block + 1):
                t0, c0 = time.perf_counter(), time.process_time()
                build()
                evaluate()
                if i:
                    times[n].append(time.perf_counter() - t0)
                    cpu[n].append(time.process_time() - c0)
    ref = statistics.median(times["f32-native"])
    for n, _ in systems:
        m = statistics.median(times[n])
        lo = min(times[n])
        print(f"B={B} ctx={ctx} {n:11s} median {1e3 * m:7.2f} ms/step ({B / m:6.1f} tok/s, x{ref / m:.2f} vs f32-native)  min {1e3 * lo:7.2f} ms (x{min(times['f32-native']) / lo:.2f}); CPU median {1e3 * statistics.median(cpu[n]):7.2f} ms (x{statistics.median(cpu['f32-native']) / statistics.median(cpu[n]):.2f})", flush=True)
