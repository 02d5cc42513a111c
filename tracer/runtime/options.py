"""Checks of user options that need no model, so they run before a model loads.

Each returns the normalised value or raises ``ValueError``/``TypeError`` with
a message that says what is allowed.
"""

from __future__ import annotations

import numbers
from typing import List, Optional, Sequence, Tuple, Union

SEED_LIMIT = 2**63


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_widths(values, name: str, minimum: int = 1) -> Tuple[int, ...]:
    """Positive integers, deduplicated and sorted (bucket widths, chunk lengths)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, set, frozenset)):
        raise TypeError(f"{name} must be a sequence of integers, e.g. (1, 2, 4, 8); got {values!r}")
    out = set()
    for v in values:
        if not _is_int(v) or v < minimum:
            raise ValueError(f"{name} must be integers >= {minimum}, got {v!r} in {tuple(values)!r}")
        out.add(int(v))
    if not out:
        raise ValueError(f"{name} must name at least one width, e.g. (1, 2, 4, 8)")
    return tuple(sorted(out))


def check_buckets(buckets) -> Tuple[int, ...]:
    return check_widths(buckets, "buckets")


def check_prefill_chunks(chunks) -> Tuple[int, ...]:
    # 1-token steps are decode steps: a prefill window holds at least 2
    return check_widths(chunks, "prefill_chunks", minimum=2)


def check_max_tokens(max_tokens) -> int:
    if not _is_int(max_tokens):
        raise TypeError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    return int(max_tokens)


def check_token_ids(tokens, vocab_size: Optional[int] = None, what: str = "prompt") -> List[int]:
    """A non-empty list of integer token ids (within the vocabulary when known)."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) and not hasattr(tokens, "tolist"):
        raise TypeError(f"{what} must be a string or a sequence of integer token ids, got {type(tokens).__name__}")
    tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    bad = [t for t in tokens if not _is_int(t)]
    if bad:
        raise TypeError(f"{what} token ids must be integers, got {bad[:3]!r}")
    if not tokens:
        raise ValueError(f"empty {what}: give at least one token")
    tokens = [int(t) for t in tokens]
    if vocab_size is not None:
        out = [t for t in tokens if not 0 <= t < vocab_size]
        if out:
            raise ValueError(f"token ids {out[:5]} are outside the vocabulary [0, {vocab_size})")
    return tokens


def check_stop_strings(stop: Union[None, str, Sequence[str]]) -> List[str]:
    """``stop``: one string or a sequence of strings (OpenAI's convention)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (Sequence, set, frozenset)):
        raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    stop = list(stop)
    bad = [s for s in stop if not isinstance(s, str)]
    if bad:
        raise TypeError(f"stop must be a string or a list of strings, got {bad[0]!r}")
    return [s for s in stop if s]


def check_seed(seed) -> Optional[int]:
    if seed is None:
        return None
    if not _is_int(seed):
        raise TypeError(f"seed must be an integer in [0, 2**63) or None, got {seed!r}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return int(seed)


def check_draft_tokens(k, prefill_chunks: Tuple[int, ...]) -> int:
    """Drafts per row and verify step: 1 .. (largest prefill window - 1)."""
    if not _is_int(k):
        raise TypeError(f"draft_tokens must be a positive integer, got {k!r}")
    if not 1 <= k < max(prefill_chunks):
        raise ValueError(
            f"draft_tokens must be in [1, {max(prefill_chunks) - 1}] (a verify window of k + 1 tokens is no longer "
            f"than the largest prefill window {max(prefill_chunks)}), got {k}"
        )
    return int(k)
