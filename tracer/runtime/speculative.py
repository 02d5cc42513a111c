"""Speculative decoding inside the compiled step: judging drafts, per row.

A verify step feeds each row ``[last token, d_1 .. d_k]`` (``L = k + 1``;
rows with fewer drafts are padded and their ``ndraft`` says how many count)
and gets the model's distribution after every position. Each row then takes,
at every position ``j``, the token its own sampler picks there — the argmax
for a greedy row; for a sampled row, the Gumbel-max draw over its filtered,
temperature-scaled logits with the ``j``-th key of its own key chain,
exactly the draw a plain decode step would make at that position — and keeps
the longest prefix of drafts equal to those picks, plus the pick after it (a
correction, or a bonus after the last draft): ``count[r] = accepted + 1``
tokens, 1 .. L.

For a deterministic draft (prompt lookup, a draft model's greedy tokens:
``q`` is one-hot) this is the speculative-sampling rule (Leviathan et al.
2023, Chen et al. 2023): a draft ``d`` is accepted with probability
``p(d) = min(1, p(d) / q(d))``, and on refusal the emitted token is ``p``'s
draw conditioned on not being ``d``, i.e. the normalised residual
``max(0, p - q)``. Because the draws are the plain sampler's own, coupled by
position, a request's tokens with speculation equal its tokens without it
for the same seed (greedy and sampled alike), whatever its neighbours do.
Rows with penalties or a logit bias get ``logprobs`` already processed at
every position with the window a plain step would see there
(:func:`~.processors.verify_windows`), so the same holds for them.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx

from .sampling import filtered_logits


def accept(logprobs: mx.array, tokens: mx.array, ndraft: mx.array, sampler: Optional[dict]) -> Tuple[mx.array, ...]:
    """Judge one verify window.

    Args:
        logprobs: ``[Bk, L, V]`` normalised log-probabilities after each input.
        tokens: ``[Bk, L]`` the inputs: last accepted token, then the drafts.
        ndraft: ``[Bk]`` int32 drafts that count per row (0 .. L - 1).
        sampler: per-row sampler arrays (``sampler_inputs``), None for greedy.

    Returns ``(emitted [Bk, L], count [Bk], logprobs [Bk, L], keys [Bk, 2] or None)``:
    row r's new tokens are ``emitted[r, :count[r]]``; ``keys`` are the rows'
    keys after ``count`` draws.
    """
    Bk, L, V = logprobs.shape
    picks = mx.argmax(logprobs, axis=-1).astype(mx.int32)  # [Bk, L] greedy picks
    chains = None
    if sampler is not None:
        flat = {k: mx.repeat(v, L, axis=0) for k, v in sampler.items() if k != "keys"}  # per (row, position)
        logits = filtered_logits(logprobs.reshape(Bk * L, V), flat).reshape(Bk, L, V)  # [Bk, L, V]
        draws, chains = [], []
        for r in range(Bk):  # the row's key chain: one split per position, as plain decode steps do
            key, row_draws, row_keys = sampler["keys"][r], [], []
            for j in range(L):
                key, use = mx.random.split(key)
                row_draws.append(mx.argmax(logits[r, j] + mx.random.gumbel((V,), key=use)))
                row_keys.append(key)
            draws.append(mx.stack(row_draws))
            chains.append(mx.stack(row_keys))
        hot = sampler["temperature"][:, None] > 0  # [Bk, 1]
        picks = mx.where(hot, mx.stack(draws).astype(mx.int32), picks)  # [Bk, L]
    count = judged(picks, tokens, ndraft)
    lps = mx.take_along_axis(logprobs, picks[:, :, None], axis=-1)[..., 0]  # [Bk, L]
    keys = None
    if chains is not None:  # each row's key after its count draws
        idx = (count - 1)[:, None, None]  # [Bk, 1, 1]
        keys = mx.take_along_axis(mx.stack(chains), mx.broadcast_to(idx, (Bk, 1, 2)), axis=1)[:, 0, :]  # [Bk, 2]
    return picks, count, lps, keys


def judged(picks: mx.array, tokens: mx.array, ndraft: mx.array) -> mx.array:
    """``count [Bk]``: each row's leading drafts equal to its picks (``picks
    [Bk, L]``, the token its sampler takes after each input), + 1."""
    L = tokens.shape[1]
    drafts = tokens[:, 1:]  # [Bk, L-1]
    counts = mx.arange(L - 1, dtype=mx.int32)[None, :] < ndraft[:, None]  # [Bk, L-1] drafts that count
    ok = (drafts == picks[:, :-1]) & counts
    accepted = mx.sum(mx.cumprod(ok.astype(mx.int32), axis=1), axis=1)  # [Bk] leading accepted drafts
    return (accepted + 1).astype(mx.int32)

