"""The measuring commands of ``mlx-tracer``: info (this machine's backend, BLAS
and caches) and bench (stock mlx-lm against the compiled loop)."""

from __future__ import annotations

import contextlib
import sys

from .commands import log


def benchmark(args) -> int:
    from .. import bench

    conditions = bench.Conditions.start(args.busy)
    with bench.busy_processes(args.busy):
        out = _bench_tables(args, conditions)
    print(conditions.finish().line())
    if args.json:
        out["meta"]["conditions"] = conditions.as_dict()
        bench.write_json(args.json, out["machine"], out["rows"], out["steady"], out["meta"])
        log(f"wrote {args.json}")
    if args.plot:
        bench.plot(args.plot, out["rows"])
        log(f"wrote {args.plot}")
    return 0


def _bench_tables(args, conditions) -> dict:
    from .. import bench
    from ..runtime.options import check_kv
    from . import options as opt
    from ..backend import blas

    log(f"BLAS: {blas.status().note}")
    log(conditions.line())
    log("measuring this machine (memory bandwidth by size, fp32 GEMM) ...")
    machine = bench.Machine.measure()
    bw = ", ".join(f"{size >> 20} MB {gbps:.1f}" for size, gbps in sorted(machine.copy_gbps.items()))
    log(f"  bandwidth GB/s by size: {bw}; fp32 GEMM {machine.gemm_gflops:.1f} GFLOP/s; "
        f"cores' peak {machine.peak_gflops:.0f} GFLOP/s float32, {machine.int8_rate:.0f} G int8 ops/s "
        "(the roofline's compute ceilings)")
    if args.baseline:
        log("stock mlx-lm as a user runs it (reference BLAS, weights as loaded): a subprocess, runs in turn with the others")
    peer, peer_note = bench.start_peer(args.peer_python) if args.peer else (None, "llama.cpp: skipped (--no-peer)")
    print(peer_note)
    peer_meta = {"ran": False, "note": peer_note, "threads": bench.peer_threads(), "models": {}}
    if peer is not None:
        peer_meta.update(version=peer.info.get("version"), python=peer.info.get("python"),
                         system_info=peer.info.get("system_info"))
    print(bench.UNITS)
    print(bench.HEADER, flush=True)
    rows = []
    with contextlib.ExitStack() as workers:
        if peer is not None:
            workers.enter_context(peer)
        worker = workers.enter_context(bench.BaselineWorker()) if args.baseline else None
        for name in args.models:
            model, label = bench.load_bench_model(name, args.model, weights=args.weights, log=log)
            log(f"{label}: buckets {list(args.buckets)}, contexts {list(args.contexts)}, {args.tokens} tokens x {args.runs} runs")
            if worker is not None:
                worker.load(name, args.model)
            model_peer, note = _peer_for(bench, peer, name, args.model, label)
            if note and peer is not None:
                print(note, flush=True)
            if peer is not None:
                peer_meta["models"][label] = note or "ran"
            rows += bench.bench_model(model, label, args.buckets, args.contexts, args.tokens, args.runs, machine,
                                      on_row=lambda row: print(bench.format_row(row), flush=True), baseline=worker,
                                      kv=check_kv(**opt.kv_options(args)), peer=model_peer, peer_note=note or peer_note,
                                      stock=args.stock)
            peer_meta["ran"] = peer_meta["ran"] or model_peer is not None
            del model  # freed before the next model loads
    steady = None
    if args.steady_steps:
        log(f"steady state: {args.steady_steps} decode steps on a ring model ...")
        steady = bench.steady_state(steps=args.steady_steps)
        print(
            f"steady state ({steady['model']}): step {steady['step_early']}: {steady['tps_early']:.1f} tok/s, "
            f"step {steady['step_late']}: {steady['tps_late']:.1f} tok/s ({steady['late_over_early']:.3f}x), "
            f"traces {steady['traces_at_early']} -> {steady['traces_at_end']}"
        )
    meta = {"tokens": args.tokens, "runs": args.runs, "blas": blas.status().note, "peer": peer_meta,
            "peak_memory": bench.PEAK_MEMORY}
    if args.spec:
        meta["speculative"] = _spec_table(args)
    return {"machine": machine, "rows": rows, "steady": steady, "meta": meta}


def _spec_table(args) -> dict:
    """``--spec``: plain decode against prompt lookup per bucket (bench.speculative), printed as it runs."""
    from .. import bench
    from ..generator import Generator

    log(f"speculative decoding: prompt lookup, k = {args.spec_draft_tokens}, buckets {list(args.buckets)}, "
        f"{args.tokens} tokens x {args.runs} runs, greedy, the auto policy")
    plain = Generator.load(args.model, weights=args.weights, progress=False)
    print(bench.SPEC_HEADER, flush=True)
    rows = bench.spec_rows(plain, args.buckets, args.spec_draft_tokens, args.tokens, args.runs,
                           on_row=lambda r: print(bench.format_spec_row(r), flush=True))
    return {"draft_tokens": args.spec_draft_tokens, "policy": "auto", "drafter": "prompt-lookup",
            "rows": [r.as_dict() for r in rows]}


def _peer_for(bench, peer, name: str, path, label: str):
    """``(peer, None)`` with the GGUF file of bench model ``name`` loaded in
    llama.cpp, or ``(None, why not)`` (no peer: its own note says why)."""
    if peer is None:
        return None, None
    gguf = bench.gguf_file(name, path)
    if gguf is None:
        return None, f"llama.cpp: skipped for {label} (not a GGUF file; the peer runs the same file as the others)"
    try:
        peer.load(gguf, bench.peer_threads())
    except bench.WorkerError as e:
        return None, f"llama.cpp: skipped for {label} ({e})"
    return peer, None


def info(args) -> int:
    import os
    import tempfile

    from ..backend import malloc

    if getattr(args, "malloc_path", False):
        lib = malloc.wanted()
        if lib is None:
            print("mlx-tracer: no malloc to preload (not Linux, cmeel-mimalloc not installed, or "
                  f"{malloc.ENV}=system)", file=sys.stderr)
            return 1
        print(lib)
        return 0

    import mlx.core as mx
    from importlib import metadata

    from .. import bench
    from ..backend import blas, kernels
    from ..loading import format_cache, store
    from ..loading.gguf_readonly import q6_k_describe
    from ..adapters.lean import narrow, scales
    from ..loading.weights import available_memory

    gpu = "metal" if mx.metal.is_available() else ("cuda" if getattr(mx, "cuda", None) and mx.cuda.is_available() else "none")
    print(f"backend      {mx.default_device()} (mlx {mx.__version__}, mlx-lm {metadata.version('mlx-lm')}); GPU: {gpu}")
    st = blas.status()
    print(f"BLAS         {st.note}")
    print(f"             cblas_sgemm from {st.library}")
    print(f"kernels      {kernels.status()}")
    print(f"             {scales.describe()}")
    print(f"             {narrow.describe()}")
    print(f"             {q6_k_describe()}")
    print(f"malloc       {malloc.status()}")
    m = bench.Machine.measure(sizes_mb=(1, 256))  # the two sizes it prints
    rate = "fast" if m.gemm_gflops > 10 else "reference-class"
    print(f"             measured fp32 GEMM 8x4096x4096: {m.gemm_gflops:.1f} GFLOP/s ({rate}); "
          f"bandwidth {m.bandwidth(1 << 20):.1f} GB/s at 1 MB, {m.bandwidth(256 << 20):.1f} GB/s at 256 MB")
    mem = available_memory()
    print(f"memory       {mem / 2**30:.1f} GiB available" if mem else "memory       unknown")
    path = store.default_model_path()
    ok = store.is_valid_model_file(path)
    print(f"model        {path} ({'present' if ok else 'missing: run mlx-tracer fetch'})")
    choices = format_cache.list_choices()
    env = format_cache.environment()
    here = [c for c in choices if c.setup.environment == env]
    if here:
        for c in here:
            s = c.setup
            ms = ", ".join(f"{f} " + "/".join(f"{t[b]:.0f}" for b in sorted(t)) for f, t in c.timings.items())
            widths = "/".join(str(b) for b in sorted({b for t in c.timings.values() for b in t}))
            load = "unknown load" if c.load_avg is None else f"load average {c.load_avg:.1f}"
            note = "; provisional: timed on a busy machine, measured again when quiet" if c.measured_busy else ""
            print(f"weights      {c.format} for {s.model} [mlx {s.mlx}|{s.blas}|{s.cores} cores] "
                  f"(ms/step at B={widths}: {ms}; {load}{note})")
    else:
        print("weights      auto not measured yet for this MLX/BLAS/core count (the first `mlx-tracer generate` "
              "measures and caches it)")
    if len(choices) > len(here):
        print(f"             {len(choices) - len(here)} more in {format_cache.store_path()}, measured under another "
              "MLX version, BLAS build or core count (not used here)")
    lean = "on" if mx.default_device().type == mx.DeviceType.cpu else "off (not the CPU backend)"
    print(f"forward      lean {lean} for llama/mistral/qwen2/qwen3 (q/k/v and gate/up fused, RoPE tables once per step; "
          "sharded models and layers of mixed formats on its ops layers); other families run their own forward")
    kdir = os.path.join(os.environ.get("TMPDIR", tempfile.gettempdir()), "mlx", mx.__version__, "cpu")
    files = [os.path.join(kdir, f) for f in os.listdir(kdir)] if os.path.isdir(kdir) else []
    size = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    print(f"kernel cache {kdir}: {len(files)} files, {size / 2**20:.1f} MB (MLX's CPU JIT, kept between runs)")
    print("traces       per process (mx.compile keeps none on disk); `mlx-tracer trace` lists them")
    return 0
