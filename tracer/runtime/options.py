"""The one owner of options: every default, and every check of engine and request options.

The checks need no model, so they run before a model loads. Each returns the
normalised value or raises :class:`OptionError` (a ``ValueError``), which
names the parameter (``.param``), says what is allowed (``.reason``, also its
message) and, where a client needs one, carries a machine-readable ``.code``.
A value of the wrong type raises :class:`OptionTypeError`, which is a
``TypeError`` as well. Callers check each option once, where it enters (the
Generator, the Engine, the CLI, the server), and hand the checked values on.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

if TYPE_CHECKING:  # the caches import mlx-lm: not before the options are checked
    from ..caches.storage import KVFormat

DEFAULT_BUCKETS = (1, 2, 4, 8)  # batch widths: one trace each, so a few powers of two
# The server's: a server expects many clients at once, and a request beyond the
# widest bucket waits for a row (a burst of 16 beside 4 running streams: TTFT p50
# 5.4-5.6 s with the default widths, ~2 s with room for all 20). Each width is
# traced at start; its caches exist only while a batch that wide runs.
SERVE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32)
# Prefill windows: one trace per length. Longer windows gain little per token
# once a window's GEMMs are large, while an interrupt waits for a whole window.
DEFAULT_PREFILL_CHUNKS = (8, 32, 128, 256)
DEFAULT_MAX_TOKENS = 256  # when a request names none (OpenAI's "until the context is full" would reserve huge caches)
PROMPT_LOOKUP = "prompt-lookup"  # the drafter that needs no second model
DEFAULT_DRAFT_TOKENS = 4
SPEC_POLICIES = ("auto", "always")
DEFAULT_SPEC_POLICY = "auto"
SEED_LIMIT = 2**63
KV_BITS = (4, 8)  # quantized keys and values (mlx-lm's kv_bits)
KV_GROUP_SIZES = (32, 64, 128)  # what mx.quantize takes
DEFAULT_KV_GROUP_SIZE = 64  # mlx-lm's
KV_DTYPES = ("float32", "float16", "bfloat16")
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

# Upper bounds of the size options, checked before anything loads: past them a
# value fails here, not as an OverflowError or an allocation that kills the
# process. Each is far above what is useful, and says why it is where it is.
MAX_BUCKET = 1024  # rows of a batch: every bucket is a trace, and caches for that many rows while it runs
MAX_PREFILL_CHUNK = 8192  # tokens of a prefill window: a trace each, its scores window x capacity per head
# With rows running, a newcomer's prompt goes in windows of at most this many
# tokens, one per engine step: a running stream waits about one such window
# for its next token (0: prefill newcomers whole, the running rows wait).
DEFAULT_PREFILL_STEP_TOKENS = 64
# ... and `mlx-tracer serve`'s: a step of a 32-token window and a decode step
# kept a running stream's longest gap in a 16-client burst at 2.2-2.3x its
# median (64: 2.9-3.3x; one ~40-token chat prompt a step), for a later first
# token (TTFT p50 3.9-4.7 s against 3.4-3.8; 0.5.12, SmolLM2, 2-core Zen 3)
SERVE_PREFILL_STEP_TOKENS = 32
MAX_CAPACITY = 2**20  # positions of a full-attention cache bucket: beyond any context length in reach
MAX_DRAFT_TOKENS = 64  # drafts per row and verify step: acceptance falls off long before
MAX_TOKENS = 2**20  # completion tokens of a request (the model's context length bounds it further)
MAX_QUEUE = 100_000  # requests waiting for a row (each holds its prompt in memory)
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a request body: ~1M tokens of text, far past any context in reach
MAX_REQUEST_BYTES = 1 << 30  # each body in flight is held in memory, then parsed and tokenized
DEFAULT_SHUTDOWN_GRACE = 10.0  # seconds running requests get to finish once the server is told to stop
MAX_SHUTDOWN_GRACE = 3600.0  # past an hour a supervisor has long given up and killed the process


class OptionError(ValueError):
    """A bad option: ``param`` names it, ``reason`` says what is allowed (the message)."""

    def __init__(self, param: str, reason: str, code: Optional[str] = None):
        super().__init__(reason)
        self.param, self.reason, self.code = param, reason, code


class OptionTypeError(OptionError, TypeError):
    """An option of the wrong type (catchable as ``TypeError`` too)."""


@dataclass(frozen=True)
class EngineOptions:
    """Checked engine options (see :func:`check_engine_options`)."""

    buckets: Tuple[int, ...] = DEFAULT_BUCKETS
    prefill_chunks: Tuple[int, ...] = DEFAULT_PREFILL_CHUNKS
    draft_tokens: int = 0  # drafts per row and verify step; 0: not speculative
    spec_policy: str = DEFAULT_SPEC_POLICY
    prefill_step_tokens: int = DEFAULT_PREFILL_STEP_TOKENS  # 0: newcomers prefilled whole
    kv: Optional["KVFormat"] = None  # how the caches store keys and values (None: as the model computes them)


@dataclass(frozen=True)
class GeneratorOptions:
    """Checked Generator options (see :func:`check_generator_options`)."""

    engine: EngineOptions
    chat: Optional[bool] = None
    system: Optional[str] = None


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


# ------------------------------------------------------------ engine options
def check_widths(values, name: str, minimum: int = 1, maximum: Optional[int] = None, why: str = "") -> Tuple[int, ...]:
    """Integers in [minimum, maximum], deduplicated and sorted (bucket widths,
    chunk lengths, capacities); ``why``: the reason for the maximum."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, set, frozenset)):
        raise OptionTypeError(name, f"{name} must be a sequence of integers, e.g. (1, 2, 4, 8); got {values!r}")
    out = set()
    for v in values:
        if not _is_int(v) or v < minimum:
            raise OptionError(name, f"{name} must be integers >= {minimum}, got {v!r} in {tuple(values)!r}")
        if maximum is not None and v > maximum:
            raise OptionError(name, f"{name} must be integers <= {maximum} ({why}), got {v}: pass smaller ones")
        out.add(int(v))
    if not out:
        raise OptionError(name, f"{name} must name at least one width, e.g. (1, 2, 4, 8)")
    return tuple(sorted(out))


def check_buckets(buckets, name: str = "buckets") -> Tuple[int, ...]:
    return check_widths(buckets, name, 1, MAX_BUCKET, "every bucket is a trace, and caches for that many rows")


def check_prefill_chunks(chunks) -> Tuple[int, ...]:
    # 1-token steps are decode steps: a prefill window holds at least 2
    return check_widths(chunks, "prefill_chunks", 2, MAX_PREFILL_CHUNK,
                        "every window is a trace, and its attention scores grow with its length")


def check_capacities(capacities) -> Tuple[int, ...]:
    """Capacity buckets of full-attention caches (positions)."""
    return check_widths(capacities, "capacities", 1, MAX_CAPACITY, "no model in reach holds more positions")


def check_draft_tokens(k, prefill_chunks: Tuple[int, ...]) -> int:
    """Drafts per row and verify step: 1 .. min(largest prefill window - 1, MAX_DRAFT_TOKENS)."""
    if not _is_int(k):
        raise OptionTypeError("draft_tokens", f"draft_tokens must be a positive integer, got {k!r}")
    top = min(max(prefill_chunks) - 1, MAX_DRAFT_TOKENS)
    if not 1 <= k <= top:
        why = (f"at most {MAX_DRAFT_TOKENS}: drafts that long are almost never all accepted" if top == MAX_DRAFT_TOKENS
               else f"a verify window of k + 1 tokens is no longer than the largest prefill window {max(prefill_chunks)}")
        raise OptionError("draft_tokens", f"draft_tokens must be in [1, {top}] ({why}), got {k}")
    return int(k)


def check_spec_policy(policy) -> str:
    if policy not in SPEC_POLICIES:
        raise OptionError("spec_policy", f"spec_policy must be one of {SPEC_POLICIES}, got {policy!r}")
    return policy


def is_draft_path(speculative) -> bool:
    """Whether ``speculative`` names a draft model's file or folder (the Generator loads it)."""
    return isinstance(speculative, Path) or isinstance(speculative, str) and speculative != PROMPT_LOOKUP


def speculative_kind(spec, paths: bool = False) -> Optional[str]:
    """What the ``speculative`` option names: None (off), ``"prompt-lookup"``,
    ``"path"`` (a draft model to load; only where ``paths``), ``"model"`` (an
    mlx-lm draft model) or ``"drafter"`` (an object with ``propose``)."""
    if spec is None or spec is False:
        return None
    if paths and is_draft_path(spec):
        if not Path(spec).expanduser().exists():
            raise OptionError("speculative",
                              f"speculative={str(spec)!r}: give 'prompt-lookup' or the path of a draft model (a .gguf file "
                              "or an mlx-lm model folder sharing the target's tokenizer); that path does not exist")
        return "path"
    if isinstance(spec, str):
        if spec == PROMPT_LOOKUP:
            return spec
        raise OptionError("speculative", f"unknown speculative drafter {spec!r}: use 'prompt-lookup' or pass a draft "
                                         "model (an mlx-lm model sharing the target's tokenizer)")
    if hasattr(spec, "propose") or hasattr(spec, "propose_batch"):
        return "drafter"
    if hasattr(spec, "layers") and callable(spec):
        return "model"
    raise OptionTypeError("speculative", f"speculative must be 'prompt-lookup', a draft model (mlx-lm model), None or an "
                                         f"object with propose(context, k); got {type(spec).__name__}")


def check_prefill_step_tokens(n) -> int:
    """The longest interleaved prefill window: 0 (off) or 2 .. MAX_PREFILL_CHUNK tokens."""
    if not _is_int(n):
        raise OptionTypeError("prefill_step_tokens", f"prefill_step_tokens must be an integer, got {n!r}")
    if n != 0 and not 2 <= n <= MAX_PREFILL_CHUNK:
        raise OptionError("prefill_step_tokens", f"prefill_step_tokens must be 0 (prefill newcomers whole) or in "
                                                 f"[2, {MAX_PREFILL_CHUNK}], got {n}")
    return int(n)


def check_kv(kv_bits=None, kv_group_size=DEFAULT_KV_GROUP_SIZE, kv_dtype=None) -> Optional["KVFormat"]:
    """How the caches store keys and values, with mlx-lm's names: ``kv_bits``
    (4 or 8: affine-quantized in groups of ``kv_group_size`` = 32, 64 or 128
    along the head dimension) or ``kv_dtype`` ("float32", "float16",
    "bfloat16"); neither: as the model computes them. Whether a model's head
    dimension takes the group size is checked when its layers are probed.
    Returns None for the default (the caches as today)."""
    if kv_bits is not None:
        if not _is_int(kv_bits):
            raise OptionTypeError("kv_bits", f"kv_bits must be 4 or 8 (or None: not quantized), got {kv_bits!r}")
        if kv_bits not in KV_BITS:
            raise OptionError("kv_bits", f"kv_bits must be 4 or 8 (or None: not quantized), got {kv_bits}")
    if not _is_int(kv_group_size) or kv_group_size not in KV_GROUP_SIZES:
        raise OptionError("kv_group_size", f"kv_group_size must be 32, 64 or 128 (what mx.quantize takes), got {kv_group_size!r}")
    if kv_bits is None and kv_group_size != DEFAULT_KV_GROUP_SIZE:
        raise OptionError("kv_group_size", f"kv_group_size {kv_group_size} needs kv_bits (4 or 8): it sizes the groups of "
                                           "quantized keys and values")
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise OptionError("kv_dtype", f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or None: the model's), "
                                      f"got {kv_dtype!r}")
    if kv_bits is not None and kv_dtype is not None:
        raise OptionError("kv_dtype", f"kv_bits={kv_bits} and kv_dtype={kv_dtype!r} exclude each other (quantized keys "
                                      "and values keep their scales in the model's dtype): pass one of them")
    if kv_bits is None and kv_dtype is None:
        return None
    from ..caches.storage import KVFormat

    return KVFormat(dtype=kv_dtype, bits=None if kv_bits is None else int(kv_bits), group_size=int(kv_group_size))


def check_engine_options(buckets=DEFAULT_BUCKETS, prefill_chunks=DEFAULT_PREFILL_CHUNKS, speculative=None,
                         draft_tokens=DEFAULT_DRAFT_TOKENS, spec_policy=DEFAULT_SPEC_POLICY,
                         paths: bool = False, prefill_step_tokens=DEFAULT_PREFILL_STEP_TOKENS,
                         kv_bits=None, kv_group_size=DEFAULT_KV_GROUP_SIZE, kv_dtype=None) -> EngineOptions:
    """Every engine option at once (``paths``: ``speculative`` may be a draft model's path)."""
    buckets = check_buckets(buckets)
    spec_policy = check_spec_policy(spec_policy)
    chunks = check_prefill_chunks(prefill_chunks)
    k = check_draft_tokens(draft_tokens, chunks) if speculative_kind(speculative, paths) else 0
    return EngineOptions(buckets, chunks, k, spec_policy, check_prefill_step_tokens(prefill_step_tokens),
                         check_kv(kv_bits, kv_group_size, kv_dtype))


def check_generator_options(buckets=DEFAULT_BUCKETS, prefill_chunks=DEFAULT_PREFILL_CHUNKS, chat=None, system=None,
                            speculative=None, draft_tokens=DEFAULT_DRAFT_TOKENS,
                            spec_policy=DEFAULT_SPEC_POLICY,
                            prefill_step_tokens=DEFAULT_PREFILL_STEP_TOKENS,
                            kv_bits=None, kv_group_size=DEFAULT_KV_GROUP_SIZE, kv_dtype=None) -> GeneratorOptions:
    """A Generator's options, without a model (``speculative`` may be a draft model's path)."""
    engine = check_engine_options(buckets, prefill_chunks, speculative, draft_tokens, spec_policy, paths=True,
                                  prefill_step_tokens=prefill_step_tokens, kv_bits=kv_bits,
                                  kv_group_size=kv_group_size, kv_dtype=kv_dtype)
    if chat is not None and not isinstance(chat, bool):
        raise OptionTypeError("chat", f"chat must be True, False or None, got {chat!r}")
    return GeneratorOptions(engine, chat, check_system(system))


# ----------------------------------------------------------- request options
def check_system(system) -> Optional[str]:
    if system is not None and not isinstance(system, str):
        raise OptionTypeError("system", f"system must be a string, got {type(system).__name__}")
    return system


def check_max_tokens(max_tokens, name: str = "max_tokens") -> int:
    """``name``: what the caller calls it (the server's ``max_completion_tokens``)."""
    if not _is_int(max_tokens):
        raise OptionTypeError(name, f"{name} must be a positive integer, got {max_tokens!r}")
    if max_tokens <= 0:
        raise OptionError(name, f"{name} must be > 0, got {max_tokens}")
    if max_tokens > MAX_TOKENS:
        raise OptionError(name, f"{name} must be <= {MAX_TOKENS} (2**20; the model's context length bounds it "
                                f"further), got {max_tokens}", CONTEXT_LENGTH_EXCEEDED)  # no model holds that many
    return int(max_tokens)


def check_token_ids(tokens, vocab_size: Optional[int] = None, what: str = "prompt") -> List[int]:
    """A non-empty list of integer token ids (within the vocabulary when known)."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) and not hasattr(tokens, "tolist"):
        raise OptionTypeError(what, f"{what} must be a string or a sequence of integer token ids, got {type(tokens).__name__}")
    tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    bad = [t for t in tokens if not _is_int(t)]
    if bad:
        raise OptionTypeError(what, f"{what} token ids must be integers, got {bad[:3]!r}")
    if not tokens:
        raise OptionError(what, f"empty {what}: give at least one token")
    tokens = [int(t) for t in tokens]
    if vocab_size is not None:
        out = [t for t in tokens if not 0 <= t < vocab_size]
        if out:
            raise OptionError(what, f"token ids {out[:5]} are outside the vocabulary [0, {vocab_size})")
    return tokens


def check_stop_strings(stop: Union[None, str, Sequence[str]]) -> List[str]:
    """``stop``: one string or a sequence of strings (OpenAI's convention)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (Sequence, set, frozenset)):
        raise OptionTypeError("stop", f"stop must be a string or a list of strings, got {type(stop).__name__}")
    stop = list(stop)
    bad = [s for s in stop if not isinstance(s, str)]
    if bad:
        raise OptionTypeError("stop", f"stop must be a string or a list of strings, got {bad[0]!r}")
    return [s for s in stop if s]


def check_seed(seed) -> Optional[int]:
    if seed is None:
        return None
    if not _is_int(seed):
        raise OptionTypeError("seed", f"seed must be an integer in [0, 2**63) or None, got {seed!r}")
    if not 0 <= seed < SEED_LIMIT:
        raise OptionError("seed", f"seed must be in [0, 2**63), got {seed}")
    return int(seed)


# ------------------------------------------------------------ server sizes
def machine_memory() -> Optional[int]:
    """Bytes of physical memory (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_queue_size(n, name: str = "max_queue") -> int:
    """Requests that may wait for a row: 1 .. MAX_QUEUE."""
    if not _is_int(n):
        raise OptionTypeError(name, f"{name} must be a positive integer, got {n!r}")
    if not 1 <= n <= MAX_QUEUE:
        raise OptionError(name, f"{name} must be in [1, {MAX_QUEUE}] (each waiting request holds its prompt), got {n}")
    return int(n)


def check_request_bytes(n, name: str = "max_request_bytes") -> int:
    """Bytes a request body may have: 1 KiB .. MAX_REQUEST_BYTES."""
    if not _is_int(n):
        raise OptionTypeError(name, f"{name} must be an integer number of bytes, got {n!r}")
    if not 1024 <= n <= MAX_REQUEST_BYTES:
        raise OptionError(name, f"{name} must be in [1024, {MAX_REQUEST_BYTES}] bytes (1 KiB to 1 GiB: each body is "
                                f"held in memory), got {n}")
    return int(n)


def check_shutdown_grace(seconds, name: str = "shutdown_grace") -> float:
    """Seconds running requests get to finish at shutdown: 0 .. MAX_SHUTDOWN_GRACE."""
    if not isinstance(seconds, numbers.Real) or isinstance(seconds, bool) or not math.isfinite(seconds):
        raise OptionTypeError(name, f"{name} must be a finite number of seconds, got {seconds!r}")
    if not 0 <= seconds <= MAX_SHUTDOWN_GRACE:
        raise OptionError(name, f"{name} must be in [0, {MAX_SHUTDOWN_GRACE:g}] seconds (0: cut at once), got {seconds}")
    return float(seconds)


def check_cache_bytes(n, name: str = "max_bytes") -> int:
    """Bytes a cache may keep: 0 .. the machine's memory."""
    if not _is_int(n):
        raise OptionTypeError(name, f"{name} must be an integer number of bytes, got {n!r}")
    if n < 0:
        raise OptionError(name, f"{name} must be >= 0 bytes (0: off), got {n}")
    ram = machine_memory()
    if ram is not None and n > ram:
        raise OptionError(name, f"{name} must be at most {ram} bytes ({ram >> 20} MiB, this machine's memory), "
                                f"got {n} ({n >> 20} MiB): pass a size that fits in memory")
    return int(n)


def check_sampling(temperature, top_p, min_p, top_k, seed) -> None:
    """A sampler's settings (:class:`~mlx_tracer.runtime.sampling.SamplingParams` checks itself with this)."""
    for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
            raise OptionError(name, f"{name} must be a finite number, got {v!r}")
    if not _is_int(top_k):
        raise OptionTypeError("top_k", f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if temperature < 0:
        raise OptionError("temperature", f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise OptionError("top_p", f"top_p must be in (0, 1], got {top_p}")
    if not 0 <= min_p < 1:
        raise OptionError("min_p", f"min_p must be in [0, 1), got {min_p}")
    if top_k < 0:
        raise OptionError("top_k", f"top_k must be >= 0 (0 = off), got {top_k}")
    check_seed(seed)


# Logits processors and outputs of a request (mlx-lm's make_logits_processors; OpenAI's bounds)
PENALTY_CONTEXT = 20  # tokens the penalties look back over (mlx-lm's repetition/presence/frequency_context_size)
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's [-2, 2]
MAX_LOGIT_BIAS = 100.0  # a logit_bias value: OpenAI's [-100, 100] (+-100 bans or forces a token)
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's bound); the step returns this many whenever a row asks
MAX_CHOICES = 128  # n: completions of one prompt (OpenAI's bound); each is a row, so the largest bucket bounds it too


def _real(name: str, v) -> float:
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
        raise OptionTypeError(name, f"{name} must be a finite number, got {v!r}")
    return float(v)


def check_logits_processing(repetition_penalty, presence_penalty, frequency_penalty, logit_bias,
                            top_logprobs) -> Tuple[Tuple[int, float], ...]:
    """The penalties, logit bias and top_logprobs of a request (SamplingParams
    checks itself with this); returns ``logit_bias`` as sorted ``(token id, bias)``
    pairs. Token ids are checked against the vocabulary when the request is queued."""
    if _real("repetition_penalty", repetition_penalty) <= 0:
        raise OptionError("repetition_penalty", f"repetition_penalty must be > 0 (1 = off; > 1 discourages repeats), "
                                                f"got {repetition_penalty}")
    for name, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not -MAX_PENALTY <= _real(name, v) <= MAX_PENALTY:
            raise OptionError(name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), got {v}")
    if not _is_int(top_logprobs):
        raise OptionTypeError("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise OptionError("top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    return check_logit_bias(logit_bias)


def check_logit_bias(logit_bias) -> Tuple[Tuple[int, float], ...]:
    """``{token id: bias}`` (None: none) -> sorted ``(id, bias)`` pairs; ids are
    integers >= 0 (or, from JSON, strings of them), biases in [-100, 100]."""
    if logit_bias is None:
        return ()
    items = logit_bias.items() if hasattr(logit_bias, "items") else logit_bias
    if isinstance(items, (str, bytes)) or not isinstance(items, (Sequence, type({}.items()))):
        raise OptionTypeError("logit_bias", f"logit_bias must map token ids to numbers, e.g. {{50256: -100}}; "
                                            f"got {type(logit_bias).__name__}")
    out = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise OptionTypeError("logit_bias", f"logit_bias must map token ids to numbers, got the item {item!r}")
        key, value = item
        tid = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not _is_int(tid) or tid < 0:
            raise OptionError("logit_bias", f"logit_bias keys must be token ids (integers >= 0, or their strings), got {key!r}")
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
            raise OptionTypeError("logit_bias", f"logit_bias[{key!r}] must be a finite number, got {value!r}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise OptionError("logit_bias", f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                            f"got {value} for token {key!r}")
        out[int(tid)] = float(value)
    return tuple(sorted(out.items()))


def check_choices(n, largest_bucket: Optional[int] = None) -> int:
    """``n``: completions of one prompt, 1 .. MAX_CHOICES, and no more than the
    largest bucket (the choices decode side by side, one row each)."""
    if not _is_int(n):
        raise OptionTypeError("n", f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    if not 1 <= n <= MAX_CHOICES:
        raise OptionError("n", f"n must be in [1, {MAX_CHOICES}] (completions of the prompt), got {n}")
    if largest_bucket is not None and n > largest_bucket:
        raise OptionError("n", f"n must be <= {largest_bucket}, the largest batch bucket (each choice is a row), got "
                               f"{n}: ask for fewer or run with larger buckets")
    return int(n)


def check_context_length(prompt_tokens: Optional[int], max_tokens: int, limit: Optional[int], context: int = 0,
                         param: str = "prompt", max_param: str = "max_tokens", limit_name: str = "context length"):
    """Whether ``context`` cached positions + a prompt of ``prompt_tokens`` +
    ``max_tokens`` fit the model's ``limit`` of positions (None: no limit).
    ``prompt_tokens=None`` (not tokenized yet): whether ``max_tokens`` leaves
    room for any prompt. ``param``/``max_param``: what the caller calls the
    prompt and the budget; ``limit_name``: what the limit is."""
    if limit is None:
        return
    if prompt_tokens is None:
        if max_tokens >= limit:
            raise OptionError(max_param, f"{max_param} {max_tokens} leaves no room for a prompt: the model holds {limit} "
                                         "positions (prompt + completion)", CONTEXT_LENGTH_EXCEEDED)
        return
    if context + prompt_tokens + max_tokens > limit:
        room = limit - context - prompt_tokens
        raise OptionError(param, f"prompt of {prompt_tokens} tokens + {max_param} {max_tokens} exceed the model's "
                                 f"{limit_name} {limit}: "
                                 + (f"lower {max_param} to at most {room}" if room > 0 else "shorten the prompt"),
                          CONTEXT_LENGTH_EXCEEDED)
