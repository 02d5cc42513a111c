"""Drafters: cheap guesses of a row's next tokens, judged by a verify step.

A drafter proposes up to ``k`` tokens for one row from what the row has seen
(prompt + generated). The default needs no second model:

* :class:`PromptLookup` finds the row's last ``n`` tokens earlier in its own
  context (longest ``n`` first, newest match first) and proposes the tokens
  that followed them there. Text that repeats its input (summaries, code
  edits, extraction, chat that quotes) gains most.
* :class:`DraftModel` runs a smaller model sharing the tokenizer through its
  own static caches and compiled steps (one trace per bucket, as for the
  target) and proposes its greedy continuation.

Both propose deterministic drafts, so the draft distribution ``q`` of the
speculative-sampling rule is one-hot (see :mod:`.speculative`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

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


class DraftModel:
    """A draft model decoding ahead of the target, batched like it.

    Its caches hold, per target row, the row's context except its last token
    (the target's convention). Each call (1) follows the target batch's rows
    (rows that left are filtered out, new rows are prefilled and joined),
    (2) feeds every row what the target accepted since the last call (one
    ragged, right-padded window), (3) runs ``k`` compiled greedy decode steps,
    and (4) drops the ``k`` columns those steps wrote (``trim``: the next call
    feeds what the target kept). On ring layers the trim after a wrap is
    approximate (``bypass``): drafts may get worse, the output never does,
    since the target judges every draft.
    """

    name = "draft-model"

    def __init__(self, model, vocab_size: int, windows=(8, 32)):
        from .step import CompiledModel

        self.compiled = model if isinstance(model, CompiledModel) else CompiledModel(model)
        if self.compiled.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {self.compiled.vocab_size} tokens, the target's {vocab_size}: "
                "a draft model must share the target's tokenizer"
            )
        self.windows = tuple(sorted(windows))
        self.caches = None
        self.uids: List[int] = []
        self.fed: dict = {}  # uid -> context tokens the draft caches hold

    def _cut(self, n: int) -> List[int]:
        out = []
        for c in reversed(self.windows):
            while n >= c:
                out.append(c)
                n -= c
        return out + ([self.windows[0]] if n else [])

    def _follow(self, rows, width: int):
        """Make the draft caches hold the target batch's rows, in its order."""
        from .prefill import feed

        uids = [r.uid for r in rows]
        if uids == self.uids and self.caches is not None and self.caches[0].width == width:
            return
        kept = [i for i, u in enumerate(self.uids) if u in set(uids)]
        if [self.uids[i] for i in kept] != uids[: len(kept)]:  # not the batch's order: start over
            self.caches, self.uids, self.fed, kept = None, [], {}, []
        parts = []
        if self.caches is not None and kept:
            if len(kept) < len(self.uids):
                for c in self.caches:
                    c.filter(kept)
            parts.append(self.caches)
        new = rows[len(kept):]
        if new:
            fresh = self.compiled.new_caches(len(new), rows=len(new))
            feed(self.compiled, fresh, [r.context[:-1] for r in new], self._cut)
            parts.append(fresh)
            for r in new:
                self.fed[r.uid] = len(r.context) - 1
        self.caches = [type(layer[0]).join(layer, width=width) for layer in zip(*parts)]
        self.uids = uids
        self.fed = {u: self.fed[u] for u in uids}

    def propose_batch(self, rows, ks: Sequence[int]) -> List[List[int]]:
        """Up to ``ks[i]`` drafts for each of ``rows`` (the target batch's rows, in order)."""
        import mlx.core as mx

        from .prefill import feed

        k = max(ks, default=0)
        if k <= 0 or not rows:
            return [[] for _ in rows]
        width = 1 << (len(rows) - 1).bit_length()
        self._follow(rows, width)
        feed(self.compiled, self.caches, [r.context[self.fed[r.uid] : -1] for r in rows], self._cut)
        inputs = np.zeros((self.caches[0].width, 1), dtype=np.int32)
        inputs[: len(rows), 0] = [r.context[-1] for r in rows]
        x, steps = mx.array(inputs), []
        for _ in range(k):
            x = self.compiled.step(self.caches, x).tokens[:, None]  # [Bk, 1] greedy
            steps.append(x)
        drafts = np.array(mx.concatenate(steps, axis=1))  # [Bk, k]
        for c in self.caches:
            c.trim(k, bypass=True)
        for r in rows:
            self.fed[r.uid] = len(r.context) - 1
        return [drafts[i, : ks[i]].tolist() for i in range(len(rows))]


def make_drafter(spec, vocab_size: Optional[int] = None):
    """A drafter from the user's ``speculative`` option: ``"prompt-lookup"``,
    an mlx-lm model (a draft model; ``vocab_size`` is the target's), or an
    object with ``propose(context, k)`` / ``propose_batch(rows, ks)``."""
    if spec is None or spec is False:
        return None
    if isinstance(spec, str):
        if spec == "prompt-lookup":
            return PromptLookup()
        raise ValueError(
            f"unknown speculative drafter {spec!r}: use 'prompt-lookup' or pass a draft model (an mlx-lm model "
            "sharing the target's tokenizer)"
        )
    if hasattr(spec, "propose") or hasattr(spec, "propose_batch"):
        return spec
    if hasattr(spec, "layers") and callable(spec):
        if vocab_size is None:  # checked again once the target's vocabulary is known
            return spec
        return DraftModel(spec, vocab_size)
    raise TypeError(
        f"speculative must be 'prompt-lookup', a draft model (mlx-lm model), None or an object with "
        f"propose(context, k); got {type(spec).__name__}"
    )
