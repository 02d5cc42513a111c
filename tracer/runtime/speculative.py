"""Speculative decoding inside the compiled step: judging drafts, per row.

A verify step feeds each row ``[last token, d_1 .. d_k]`` (``L = k + 1``;
rows with fewer drafts are padded and their ``ndraft`` says how many count)
and gets the model's distribution after every position. Row r then keeps the
longest prefix of its drafts that the target accepts, plus one token of the
target's own (the correction at the first refusal, or a bonus after the last
draft): ``count[r] = accepted + 1`` tokens, 1 .. L.

* Greedy rows accept ``d_j`` when it is the argmax after position ``j - 1``:
  the output equals greedy decoding token for token.
* Sampled rows use the speculative-sampling rule (Leviathan et al. 2023,
  Chen et al. 2023) with a one-hot draft distribution (prompt lookup): accept
  ``d_j`` with probability ``p(d_j)`` under the row's filtered, temperature-
  scaled distribution ``p``; at the first refusal draw from ``p`` with ``d_j``
  removed and renormalised (the residual ``max(0, p - q)``); after the last
  accepted draft draw the bonus from ``p``. The output distribution equals
  that of plain sampling. The draws use the row's own PRNG key.
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
    row r's new tokens are ``emitted[r, :count[r]]``.
    """
    Bk, L, V = logprobs.shape
    drafts = tokens[:, 1:]  # [Bk, L-1]
    pos = mx.arange(L - 1, dtype=mx.int32)[None, :]  # [1, L-1]
    counts = pos < ndraft[:, None]  # [Bk, L-1] drafts that count
    greedy = mx.argmax(logprobs, axis=-1).astype(mx.int32)  # [Bk, L]
    keys = None
    if sampler is None:
        ok = (drafts == greedy[:, :-1]) & counts
        emitted = greedy  # accepted drafts equal the argmax they matched
    else:
        flat = {k: mx.repeat(v, L, axis=0) for k, v in sampler.items() if k != "keys"}  # per (row, position)
        logits = filtered_logits(logprobs.reshape(Bk * L, V), flat).reshape(Bk, L, V)  # [Bk, L, V] scaled, filtered
        p = mx.softmax(logits, axis=-1)  # [Bk, L, V]
        p_draft = mx.take_along_axis(p[:, :-1, :], drafts[:, :, None], axis=-1)[..., 0]  # [Bk, L-1]
        uniforms, gumbels, next_keys = [], [], []
        for r in range(Bk):
            nxt, use = mx.random.split(sampler["keys"][r])
            ku, kg = mx.random.split(use)
            uniforms.append(mx.random.uniform(shape=(L - 1,), key=ku))
            gumbels.append(mx.random.gumbel((L, V), key=kg))
            next_keys.append(nxt)
        u, g = mx.stack(uniforms), mx.stack(gumbels)  # [Bk, L-1], [Bk, L, V]
        sampled_ok = (u < p_draft) & counts
        # the draw at each position: from p, with that position's draft removed
        # where a draft counts (used only at the first refusal: the residual)
        vocab = mx.arange(V, dtype=mx.int32)[None, None, :]
        drop = mx.concatenate([drafts, mx.full((Bk, 1), -1, dtype=mx.int32)], axis=1)  # [Bk, L]
        drop = mx.where(mx.concatenate([counts, mx.zeros((Bk, 1), dtype=mx.bool_)], axis=1), drop, -1)
        residual = mx.where(vocab == drop[:, :, None], -mx.inf, logits)
        draws = mx.argmax(residual + g, axis=-1).astype(mx.int32)  # [Bk, L]
        hot = sampler["temperature"][:, None] > 0  # [Bk, 1]
        ok = mx.where(hot, sampled_ok, (drafts == greedy[:, :-1]) & counts)
        keys = mx.stack(next_keys)
    accepted = mx.sum(mx.cumprod(ok.astype(mx.int32), axis=1), axis=1)  # [Bk] leading accepted drafts
    if sampler is not None:
        at = mx.arange(L, dtype=mx.int32)[None, :]
        own = mx.where(hot, draws, greedy)  # [Bk, L] the target's own token at each position
        emitted = mx.where(at < accepted[:, None], tokens_shift(tokens), own)
    count = (accepted + 1).astype(mx.int32)
    lps = mx.take_along_axis(logprobs, emitted[:, :, None], axis=-1)[..., 0]  # [Bk, L]
    return emitted, count, lps, keys


def tokens_shift(tokens: mx.array) -> mx.array:
    """``[Bk, L]`` drafts moved to the positions that emit them (``d_j`` at ``j - 1``)."""
    return mx.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
