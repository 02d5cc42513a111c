"""The model commands of ``mlx-tracer``: fetch, generate, trace."""

from __future__ import annotations

import os
import sys
import time


def log(msg: str):
    """Progress and set-up notes: stderr (stdout carries only the results)."""
    print(msg, file=sys.stderr, flush=True)


def _primary(args) -> bool:
    """Whether this process prints: ranks other than 0 of a --distributed run
    (``mlx.launch`` sets MLX_RANK) stay quiet."""
    return not getattr(args, "distributed", False) or os.environ.get("MLX_RANK", "0") == "0"


def load_generator(args, **extra):
    """A Generator for the model options of ``args`` (and ``extra`` Generator
    options, such as a prefix cache), timed, with progress on stderr."""
    from ..api import Generator
    from ..runtime.options import DEFAULT_DRAFT_TOKENS, DEFAULT_SPEC_POLICY
    from . import options as opt

    log = globals()["log"] if _primary(args) else (lambda msg: None)
    kwargs = {"buckets": args.buckets} if getattr(args, "buckets", None) else {}
    kwargs.update(opt.kv_options(args))
    speculative = getattr(args, "draft_model", None) or getattr(args, "spec", None)
    if speculative:
        kwargs.update(speculative=speculative, draft_tokens=args.draft_tokens or DEFAULT_DRAFT_TOKENS,
                      spec_policy=getattr(args, "spec_policy", None) or DEFAULT_SPEC_POLICY)
    if getattr(args, "distributed", False):
        kwargs["distributed"] = True
    t0 = time.perf_counter()  # Generator.load checks the options, then logs "loading ..."
    gen = Generator.load(
        args.model, weights=args.weights, chat=getattr(args, "chat", None), system=getattr(args, "system", None), log=log,
        **kwargs, **extra,
    )
    shards = f", sharded over {gen.world_size} ranks" if gen.world_size > 1 else ""
    log(f"loaded in {time.perf_counter() - t0:.1f} s (weights: {gen.weights}{shards})")
    return gen


def warm(gen, buckets, prefill=True):
    """Trace ``buckets`` ahead of use; ``{trace: ms}`` of the traces made."""
    log = globals()["log"] if gen.is_primary else (lambda msg: None)
    log(f"tracing buckets {list(buckets)} ...")
    traces = {}
    for b in buckets:
        made = gen.warmup(buckets=[b], prefill=prefill)
        traces.update(made)
        log(f"  bucket {b}: {len(made)} traces, {sum(made.values()):.0f} ms")
    return traces


def fetch(args) -> int:
    from ..loading.store import fetch_default_model

    print(fetch_default_model(progress=not args.quiet, force=args.force))
    return 0


def generate(args) -> int:
    if any(not p.strip() for p in args.prompts):
        raise ValueError("empty prompt: give some text")
    gen = load_generator(args)
    from ..runtime.step import bucket_for

    # tokenized and checked now: a prompt past the model's context fails before any trace
    prompts = [gen.check_prompt(p, args.max_tokens) for p in args.prompts]
    if args.warmup:
        # decode traces now, so that decode tokens/s excludes tracing; prefill traces on first use
        warm(gen, [bucket_for(min(len(args.prompts), gen.engine.buckets[-1]), gen.engine.buckets)], prefill=False)
    opts = dict(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k,
                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, logit_bias=args.logit_bias)
    uids = [gen.submit(p, seed=None if args.seed is None else args.seed + i, **opts) for i, p in enumerate(prompts)]
    single, partial, show = len(uids) == 1, False, gen.is_primary  # every rank runs the loop; rank 0 prints
    try:
        for ev in gen.events():
            if single and show:
                print(ev.text, end="", flush=True)
                partial = partial or bool(ev.text)
            elif ev.finish_reason is not None:
                c = gen.result(ev.uid)
                if show:
                    print(f"[{uids.index(ev.uid)}] {c.text}", flush=True)
    except KeyboardInterrupt:
        if partial:
            print(flush=True)  # end the partial line; main() reports the interrupt
        raise
    if show:
        if single:
            print()
        print(gen.summary(), file=sys.stderr)
    return 0


def trace(args) -> int:
    gen = load_generator(args)
    buckets = args.buckets or gen.engine.buckets
    warm(gen, buckets, prefill=args.prefill)
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
