"""``mlx-tracer serve``: the OpenAI-compatible server (:mod:`mlx_tracer.serve`).

Every option is checked, and the address bound, before the model loads: a
bad option or a busy port fails at once (exit 2, one line).
"""

from __future__ import annotations

import argparse
import math
import os

from ..runtime.options import (
    DEFAULT_DRAFT_TOKENS, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_SHUTDOWN_GRACE, PROMPT_LOOKUP, SERVE_BUCKETS, SERVE_PREFILL_STEP_TOKENS, OptionError,
    check_request_bytes, check_shutdown_grace,
)
from . import options as opt
from .commands import load_generator, log

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
API_KEY_ENV = "MLX_TRACER_API_KEY"


def port(text: str) -> int:
    value = opt.non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535 (0: any free port), got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def _checked(check, value):
    try:
        return check(value)
    except OptionError as e:
        raise argparse.ArgumentTypeError(e.reason) from None


def request_bytes(text: str) -> int:
    return _checked(check_request_bytes, opt.positive_int(text))


def grace(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}") from None
    return _checked(check_shutdown_grace, value)


def api_key(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an API key cannot be empty")
    return text


def add_parser(sub, model_args):
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and text completions, streaming, metrics)")
    model_args(s, buckets=SERVE_BUCKETS,
               buckets_help=f"; default {','.join(map(str, SERVE_BUCKETS))}: rows for that many clients at once, "
                            "each width traced at start; a request beyond the widest waits for a row")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=port, default=8080, help="port to listen on (default 8080; 0: any free port)")
    s.add_argument("--max-queue", type=opt.queue_size, default=64,
                   help="most requests waiting for a row (default 64); more are answered 503 with Retry-After")
    s.add_argument("--prefix-cache-mb", type=opt.cache_mib, default=512,
                   help="MiB of keys and values kept for requests sharing a prompt prefix (default 512; 0: off)")
    spec = s.add_mutually_exclusive_group()
    spec.add_argument("--spec", choices=(PROMPT_LOOKUP,), help="speculative decoding: drafts judged by one compiled verify step")
    spec.add_argument("--draft-model", help="speculative decoding with this draft model (GGUF / mlx-lm folder, same tokenizer)")
    s.add_argument("--draft-tokens", type=opt.draft_tokens,
                   help=f"most drafts per row and verify step (k; default {DEFAULT_DRAFT_TOKENS}; needs --spec or --draft-model)")
    s.add_argument("--prefill-step-tokens", type=opt.prefill_step_tokens, default=SERVE_PREFILL_STEP_TOKENS,
                   help=f"with requests running, newcomers' prompts go in windows of at most this many tokens together "
                        f"between decode steps (default {SERVE_PREFILL_STEP_TOKENS}; 0: whole, running streams wait)")
    s.add_argument("--timeout", type=seconds, default=600.0, help="seconds a request may take before it is cancelled (default 600; answered 504)")
    s.add_argument("--max-request-bytes", type=request_bytes, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body in bytes (default {DEFAULT_MAX_REQUEST_BYTES}: 4 MiB); larger ones get 413")
    s.add_argument("--shutdown-grace", type=grace, default=DEFAULT_SHUTDOWN_GRACE,
                   help=f"on SIGTERM/SIGINT, seconds running requests get to finish before they are cut "
                        f"(default {DEFAULT_SHUTDOWN_GRACE:g}); new ones get 503")
    s.add_argument("--api-key", type=api_key, default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set; "
                        "/health and /metrics stay open)")
    s.add_argument("--distributed", action="store_true",
                   help="serve a model sharded over the processes mlx.launch started, e.g. mlx.launch --backend ring "
                        "-n 2 -- mlx-tracer serve --distributed ...; rank 0 serves HTTP (signal it to stop every rank)")
    s.add_argument("--no-warmup", dest="warmup", action="store_false", help="do not trace the buckets before serving")
    s.add_argument("--log-level", choices=LOG_LEVELS, default="warning", help="uvicorn's log level (info: access log too)")
    s.set_defaults(func=serve)


def serve(args) -> int:
    try:
        from ..serve.app import create_app
        from ..serve.server import address, bind, model_id, run
        from ..serve.ranks import Leader
        from ..serve.worker import EngineWorker
        from ..runtime.prefix_cache import PrefixCache
    except ImportError as e:
        log(f"mlx-tracer: error: the server needs the serve extra: pip install 'mlx-tracer[serve]' ({e})")
        return 1
    # only rank 0 of a --distributed run serves HTTP (mlx.launch sets MLX_RANK; the group starts with the load)
    primary = not args.distributed or os.environ.get("MLX_RANK", "0") == "0"
    sock = bind(args.host, args.port) if primary else None  # before the slow load: a busy port fails now
    try:
        prefix_cache = PrefixCache(args.prefix_cache_mb << 20) if args.prefix_cache_mb else None
        gen = load_generator(args, prefix_cache=prefix_cache, prefill_step_tokens=args.prefill_step_tokens)
        if not gen.is_primary:
            return _follow(gen)
        leader = Leader(gen) if args.distributed else None
        worker = EngineWorker(leader or gen, model_id(args.model), max_queue=args.max_queue)
        if args.warmup:
            log(f"tracing buckets {list(gen.engine.buckets)} ...")
        worker.start(warmup=gen.engine.buckets if args.warmup else None)
        if worker.warmup_ms:
            log(f"traced {len(worker.warmup_ms)} step shapes in {sum(worker.warmup_ms.values()):.0f} ms")
        key = args.api_key or os.environ.get(API_KEY_ENV) or None
        try:
            app = create_app(worker, timeout=args.timeout, max_request_bytes=args.max_request_bytes, api_key=key)
            ranks = f"; rank 0 of {gen.world_size}, pid {os.getpid()}: signal it to stop every rank" if args.distributed else ""
            log(f"serving {worker.model_id} at {address(sock)}/v1 (also /health, /metrics)"
                + ("; /v1 needs the API key" if key else "") + "; Ctrl-C stops" + ranks)
            failed = (lambda: leader.stalled() or worker.error and "the engine stopped") if leader else None
            run(app, sock, args.log_level, grace=args.shutdown_grace, stop_when=failed)
        finally:
            stuck = leader and (leader.stalled() or (worker.group_failed and str(worker.error)))
            # the engine thread waits inside MLX on a peer that is gone, or the group failed and MLX may
            # hold a collective that never ends (joining the thread, or exiting normally, could wait for
            # it for good): nothing can end it but exiting
            if stuck:
                log(f"mlx-tracer: error: the sharded server stopped: {stuck}")
                os._exit(1)
            worker.stop()
    finally:
        if sock is not None:
            sock.close()
    if leader and worker.error is not None:  # a rank died (or could not be stopped): exit 1
        log(f"mlx-tracer: error: the sharded server stopped: {worker.error}")
        return 1
    return 0


def _follow(gen) -> int:
    """A rank other than 0 of ``serve --distributed``: rank 0's steps until it stops the group."""
    from ..serve.ranks import follow

    me = f"rank {gen.rank}/{gen.world_size}"
    log(f"mlx-tracer serve: {me}: following rank 0 (it serves HTTP; this rank's pid {os.getpid()})")
    done = follow(gen, log=log)  # a failed peer raises DistributedError: main() reports it, exit 1
    log(f"mlx-tracer serve: {me}: stopped by rank 0 after {done}")
    return 0
