"""``mlx-tracer serve``: the OpenAI-compatible server (:mod:`mlx_tracer.serve`).

Every option is checked, and the address bound, before the model loads: a
bad option or a busy port fails at once (exit 2, one line).
"""

from __future__ import annotations

import argparse
import math
import os

from ..runtime.options import (
    DEFAULT_DRAFT_TOKENS, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_PREFILL_STEP_TOKENS, DEFAULT_SHUTDOWN_GRACE, PROMPT_LOOKUP, OptionError,
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
    model_args(s)
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
    s.add_argument("--prefill-step-tokens", type=opt.prefill_step_tokens, default=DEFAULT_PREFILL_STEP_TOKENS,
                   help=f"with requests running, newcomers' prompts go in windows of at most this many tokens between "
                        f"decode steps (default {DEFAULT_PREFILL_STEP_TOKENS}; 0: whole, running streams wait)")
    s.add_argument("--timeout", type=seconds, default=600.0, help="seconds a request may take before it is cancelled (default 600; answered 504)")
    s.add_argument("--max-request-bytes", type=request_bytes, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body in bytes (default {DEFAULT_MAX_REQUEST_BYTES}: 4 MiB); larger ones get 413")
    s.add_argument("--shutdown-grace", type=grace, default=DEFAULT_SHUTDOWN_GRACE,
                   help=f"on SIGTERM/SIGINT, seconds running requests get to finish before they are cut "
                        f"(default {DEFAULT_SHUTDOWN_GRACE:g}); new ones get 503")
    s.add_argument("--api-key", type=api_key, default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set; "
                        "/health and /metrics stay open)")
    s.add_argument("--no-warmup", dest="warmup", action="store_false", help="do not trace the buckets before serving")
    s.add_argument("--log-level", choices=LOG_LEVELS, default="warning", help="uvicorn's log level (info: access log too)")
    s.set_defaults(func=serve)


def serve(args) -> int:
    try:
        from ..serve.app import create_app
        from ..serve.server import address, bind, model_id, run
        from ..serve.worker import EngineWorker
        from ..runtime.prefix_cache import PrefixCache
    except ImportError as e:
        log(f"mlx-tracer: error: the server needs the serve extra: pip install 'mlx-tracer[serve]' ({e})")
        return 1
    sock = bind(args.host, args.port)  # before the slow load: a busy port fails now
    try:
        prefix_cache = PrefixCache(args.prefix_cache_mb << 20) if args.prefix_cache_mb else None
        gen = load_generator(args, prefix_cache=prefix_cache, prefill_step_tokens=args.prefill_step_tokens)
        worker = EngineWorker(gen, model_id(args.model), max_queue=args.max_queue)
        if args.warmup:
            log(f"tracing buckets {list(gen.engine.buckets)} ...")
        worker.start(warmup=gen.engine.buckets if args.warmup else None)
        if worker.warmup_ms:
            log(f"traced {len(worker.warmup_ms)} step shapes in {sum(worker.warmup_ms.values()):.0f} ms")
        key = args.api_key or os.environ.get(API_KEY_ENV) or None
        try:
            app = create_app(worker, timeout=args.timeout, max_request_bytes=args.max_request_bytes, api_key=key)
            log(f"serving {worker.model_id} at {address(sock)}/v1 (also /health, /metrics)"
                + ("; /v1 needs the API key" if key else "") + "; Ctrl-C stops")
            run(app, sock, args.log_level, grace=args.shutdown_grace)
        finally:
            worker.stop()
    finally:
        sock.close()
    return 0
