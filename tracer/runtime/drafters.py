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

from functools import partial
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .options import DEFAULT_BUCKETS, PROMPT_LOOKUP, speculative_kind


class PromptLookup:
    """n-gram lookup in the row's own context.

    Args:
        ngram: longest suffix to match (tries ``ngram`` down to ``min_ngram``).
        min_ngram: shortest suffix that may propose.
    """

    name = "prompt-lookup"
    LONGEST = 8  # the longest match length reported

    def __init__(self, ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= ngram, got {min_ngram} and {ngram}")
        self.ngram, self.min_ngram = ngram, min_ngram

    cheap = True  # the speculator may look at its drafts to decide whether to stop pipelining plain steps

    def propose(self, context: Sequence[int], k: int) -> List[int]:
        """Up to ``k`` tokens that followed the newest earlier match of the
        context's suffix (empty when nothing matches)."""
        return self.propose_match(context, k)[0]

    def propose_match(self, context: Sequence[int], k: int) -> Tuple[List[int], int]:
        """:meth:`propose`, and how many tokens the match is long: the
        ``ngram`` tried first extended backwards (up to ``LONGEST``) while the
        context before the match and before the suffix agree; a longer match
        predicts a longer accepted run (quoted text)."""
        if k <= 0 or len(context) < 2:
            return [], 0
        ctx = np.asarray(context, dtype=np.int64)
        # the context as 8-byte words: bytes.rfind finds the newest match at C speed (a step's host time counts)
        buf, width = ctx.tobytes(), ctx.itemsize
        for n in range(min(self.ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = buf[-n * width:]
            end = len(buf) - width  # matches lie in the context without its last token
            hit = buf.rfind(suffix, 0, end)
            while hit >= 0 and hit % width:  # straddles two tokens: look further back
                hit = buf.rfind(suffix, 0, hit + len(suffix) - 1)
            if hit >= 0:
                hit //= width
                m = n
                while m < self.LONGEST and hit - (m - n) > 0 and ctx[hit - (m - n) - 1] == ctx[-m - 1]:
                    m += 1
                start = hit + n
                return ctx[start : start + k].tolist(), m
        return [], 0


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

    def __init__(self, model, vocab_size: int, windows=(8, 32), buckets: Sequence[int] = DEFAULT_BUCKETS):
        from .prefill import prefill_windows
        from .step import CompiledModel

        self.compiled = model if isinstance(model, CompiledModel) else CompiledModel(model)
        if self.compiled.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {self.compiled.vocab_size} tokens, the target's {vocab_size}: "
                "a draft model must share the target's tokenizer"
            )
        self.windows = tuple(sorted(windows))
        self.buckets = tuple(buckets)  # the target's: the draft batch takes the target batch's bucket
        self._cut = partial(prefill_windows, chunks=self.windows)
        self.caches = None
        self.uids: List[int] = []
        self.fed: dict = {}  # uid -> context tokens the draft caches hold

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
        from .step import bucket_for

        k = max(ks, default=0)
        if k <= 0 or not rows:
            return [[] for _ in rows]
        width = bucket_for(len(rows), self.buckets)
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


def make_drafter(spec, vocab_size: Optional[int] = None, buckets: Sequence[int] = DEFAULT_BUCKETS):
    """A drafter from the user's ``speculative`` option (checked by
    :func:`~mlx_tracer.runtime.options.speculative_kind`): ``"prompt-lookup"``,
    an mlx-lm model (a draft model; ``vocab_size`` is the target's, ``buckets``
    its batch widths), or an object with ``propose(context, k)`` /
    ``propose_batch(rows, ks)``."""
    kind = speculative_kind(spec)
    if kind == PROMPT_LOOKUP:
        return PromptLookup()
    if kind == "model" and vocab_size is not None:
        return DraftModel(spec, vocab_size, buckets=buckets)
    return spec if kind else None
