"""Drafters: cheap guesses of a row's next tokens, judged by a verify step.

A drafter proposes up to ``k`` tokens for one row from what the row has seen
(prompt + generated). The default needs no second model:

* :class:`PromptLookup` finds the row's last ``n`` tokens earlier in its own
  context (longest ``n`` first, newest match first) and proposes the tokens
  that followed them there. Text that repeats its input (summaries, code
  edits, extraction, chat that quotes) gains most.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np


class PromptLookup:
    """n-gram lookup in the row's own context.

    Args:
        ngram: longest suffix to match (tries ``ngram`` down to ``min_ngram``).
        min_ngram: shortest suffix that may propose.
    """

    name = "prompt-lookup"

    def __init__(self, ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= ngram, got {min_ngram} and {ngram}")
        self.ngram, self.min_ngram = ngram, min_ngram

    def propose(self, context: Sequence[int], k: int) -> List[int]:
        """Up to ``k`` tokens that followed the newest earlier match of the
        context's suffix (empty when nothing matches)."""
        if k <= 0 or len(context) < 2:
            return []
        ctx = np.asarray(context, dtype=np.int64)
        for n in range(min(self.ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            # windows of n tokens that end before the suffix itself starts
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)  # [len-n, n]
            hits = np.nonzero((windows == suffix).all(axis=1))[0]
            hits = hits[hits + n < len(ctx)]
            if hits.size:
                start = int(hits[-1]) + n
                return ctx[start : start + k].tolist()
        return []


def make_drafter(spec):
    """A drafter from the user's ``speculative`` option."""
    if spec is None or spec is False:
        return None
    if isinstance(spec, str):
        if spec == "prompt-lookup":
            return PromptLookup()
        raise ValueError(
            f"unknown speculative drafter {spec!r}: use 'prompt-lookup' (a draft model is not supported yet)"
        )
    if hasattr(spec, "propose"):
        return spec
    raise TypeError(f"speculative must be 'prompt-lookup', None or an object with propose(context, k); got {spec!r}")
