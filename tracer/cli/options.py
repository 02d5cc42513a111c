"""Argument types of the ``mlx-tracer`` command: each checks one value and
says what was wrong, so that bad input fails (exit 2) before a model loads.
Sizes are bounded by the checks of :mod:`mlx_tracer.runtime.options`."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence, Tuple

from ..runtime.options import (
    DEFAULT_KV_GROUP_SIZE, DEFAULT_PREFILL_CHUNKS, KV_BITS, KV_DTYPES, KV_GROUP_SIZES, MAX_CAPACITY, OptionError, check_buckets, check_cache_bytes, check_draft_tokens,
    check_max_tokens, check_prefill_step_tokens, check_queue_size,
)
from ..runtime.options import MAX_PENALTY, check_logit_bias

MAX_SEED = 2**63 - 1  # mx.random.key takes a uint64; prompt i of a batch uses seed + i


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def _float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value != value:  # NaN
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _int(text, "a positive integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def seed(text: str) -> int:
    value = _int(text, f"an integer seed from 0 to {MAX_SEED}")
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"a seed is an integer from 0 to {MAX_SEED}, got {value}")
    return value


def temperature(text: str) -> float:
    value = _float(text, "a temperature >= 0 (0: greedy)")
    if value < 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a temperature is a finite number >= 0 (0: greedy), got {text}")
    return value


def top_p(text: str) -> float:
    value = _float(text, "a probability in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"top-p is a probability in (0, 1], got {text}")
    return value


def min_p(text: str) -> float:
    value = _float(text, "a probability in [0, 1]")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"min-p is a probability in [0, 1], got {text}")
    return value


def repetition_penalty(text: str) -> float:
    value = _float(text, "a repetition penalty > 0 (1: off)")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"a repetition penalty is a finite number > 0 (1: off), got {text}")
    return value


def penalty(text: str) -> float:
    """``--presence-penalty`` / ``--frequency-penalty``: OpenAI's [-2, 2]."""
    value = _float(text, f"a penalty in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0: off)")
    if not -MAX_PENALTY <= value <= MAX_PENALTY:
        raise argparse.ArgumentTypeError(f"a penalty is in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0: off), got {text}")
    return value


def logit_bias(text: str) -> dict:
    """``--logit-bias '{"123": -100}'``: a JSON object of token ids to biases in [-100, 100]."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of token ids to biases, e.g. '{{\"123\": -100}}', got {text!r}")
    return dict(_checked(check_logit_bias, value))


def _int_list(text: str, lowest: int, what: str) -> Tuple[int, ...]:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected comma-separated {what} such as 1,2,4,8, got {text!r}")
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"empty item in {text!r}: expected comma-separated {what} such as 1,2,4,8")
    values = []
    for x in items:
        try:
            v = int(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what} such as 1,2,4,8, got {text!r}") from None
        if v < lowest:
            raise argparse.ArgumentTypeError(f"{v} in {text!r}: each must be >= {lowest} ({what})")
        values.append(v)
    return tuple(sorted(set(values)))


def positive_ints(text: str) -> Tuple[int, ...]:
    """``1,2,4,8`` -> ``(1, 2, 4, 8)``: sorted, distinct, each > 0, at least one."""
    return _int_list(text, 1, "positive integers")


def non_negative_ints(text: str) -> Tuple[int, ...]:
    return _int_list(text, 0, "integers >= 0")


def _checked(check, value):
    """``check(value)`` of :mod:`mlx_tracer.runtime.options`, its refusal as argparse's."""
    try:
        return check(value)
    except OptionError as e:
        raise argparse.ArgumentTypeError(e.reason) from None


def buckets(text: str) -> Tuple[int, ...]:
    """``--buckets``: positive integers up to the bound of :func:`check_buckets`."""
    return _checked(check_buckets, positive_ints(text))


def prefill_step_tokens(text: str) -> int:
    """``--prefill-step-tokens``: 0 or a window length within the bound of :func:`check_prefill_step_tokens`."""
    return _checked(check_prefill_step_tokens, non_negative_int(text))


def max_tokens(text: str) -> int:
    return _checked(check_max_tokens, positive_int(text))


def draft_tokens(text: str) -> int:
    """``--draft-tokens`` against the default prefill windows (the command line sets no others)."""
    return _checked(lambda k: check_draft_tokens(k, DEFAULT_PREFILL_CHUNKS), positive_int(text))


def contexts(text: str) -> Tuple[int, ...]:
    """``bench --contexts``: prompt lengths, each within a capacity bucket's bound."""
    values = non_negative_ints(text)
    if values[-1] > MAX_CAPACITY:
        raise argparse.ArgumentTypeError(f"each must be <= {MAX_CAPACITY} (the largest capacity bucket), got {values[-1]}")
    return values


def queue_size(text: str) -> int:
    return _checked(check_queue_size, positive_int(text))


def cache_mib(text: str) -> int:
    """``--prefix-cache-mb``: MiB, within the machine's memory."""
    value = non_negative_int(text)
    _checked(lambda n: check_cache_bytes(n, "the prefix cache"), value << 20)
    return value


def add_kv_args(parser) -> None:
    """``--kv-bits`` / ``--kv-group-size`` / ``--kv-dtype``: how the caches store keys and values."""
    parser.add_argument("--kv-bits", type=int, choices=KV_BITS,
                        help="store keys and values quantized to this many bits (mlx-lm's QuantizedKVCache layout)")
    parser.add_argument("--kv-group-size", type=int, choices=KV_GROUP_SIZES, default=DEFAULT_KV_GROUP_SIZE,
                        help=f"values per quantization group with --kv-bits (default {DEFAULT_KV_GROUP_SIZE})")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES,
                        help="store keys and values in this float dtype (default: the model's)")


def kv_options(args) -> dict:
    """The K/V storage options of ``args`` as Generator/Engine keywords (checked there, before the model loads)."""
    return dict(kv_bits=getattr(args, "kv_bits", None), kv_group_size=getattr(args, "kv_group_size", DEFAULT_KV_GROUP_SIZE),
                kv_dtype=getattr(args, "kv_dtype", None))


def kv_conflict(args) -> Optional[str]:
    """The complaint about K/V storage flags that do not go together (None: they do)."""
    o = kv_options(args)
    if o["kv_bits"] is not None and o["kv_dtype"] is not None:
        return (f"--kv-bits {o['kv_bits']} and --kv-dtype {o['kv_dtype']} exclude each other (quantized keys and values "
                "keep their scales in the model's dtype): pass one of them")
    if o["kv_bits"] is None and o["kv_group_size"] != DEFAULT_KV_GROUP_SIZE:
        return f"--kv-group-size {o['kv_group_size']} needs --kv-bits 4 or 8 (it sizes the quantization groups)"
    return None


def spec_option_without_spec(args) -> Optional[str]:
    """The complaint about a speculative-decoding option given without
    ``--spec`` or ``--draft-model`` (None: none is)."""
    if getattr(args, "spec", None) or getattr(args, "draft_model", None):
        return None
    for flag, dest in (("--draft-tokens", "draft_tokens"), ("--spec-policy", "spec_policy")):
        if getattr(args, dest, None) is not None:
            return f"pass --spec prompt-lookup (or a draft model) to use {flag}"
    return None


def names(text: str) -> Tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return items


def bench_models(text: str) -> Tuple[str, ...]:
    """``--models``: names the bench knows, checked before any model loads."""
    from ..bench.models import parse_bench_model

    items = names(text)
    for name in items:
        try:
            parse_bench_model(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return items


def undecodable_argument(argv: Sequence[str]):
    """The first argument that is not valid UTF-8 (Python keeps its bad bytes
    as lone surrogates), as ``(index, byte)``; None when all are."""
    for i, arg in enumerate(argv):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as e:
            ch = arg[e.start]
            return i, (ord(ch) - 0xDC00 if 0xDC80 <= ord(ch) <= 0xDCFF else None)
    return None
