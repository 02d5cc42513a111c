"""Logits processors inside the compiled step: logit bias and mlx-lm's penalties, per row.

The rules are mlx-lm's ``make_logits_processors`` (``mlx_lm.sample_utils``),
applied in its order to the raw logits of each row, before the
log-softmax and the sampler (so the reported log-probabilities are those of
the processed distribution, as in mlx-lm):

1. ``logit_bias``: ``logits[t] += bias[t]``;
2. ``repetition_penalty`` p: each token present in the window, ``l < 0 ? l * p : l / p``;
3. ``presence_penalty`` a: each token present in the window, ``l - a``;
4. ``frequency_penalty`` f: each token, ``l - f * (its count in the window)``.

The window is the row's last :data:`~.options.PENALTY_CONTEXT` (20) tokens
of its context — the prompt (all of it, also the part a prefix cache
served) and the tokens generated so far, up to and including the token the
step consumes — as mlx-lm's ``generate_step`` counts them.

Every row carries its own values as ``[Bk]`` arrays and its window as a
``[Bk, W]`` array (``-1``: no token yet), so requests with different values
share one trace; the decode step returns each row's window slid by the token
it picked, so pipelined steps stay on the device. The bias is a dense
``[Bk, V]`` buffer. A row with no processor (bias 0, penalties 1/0/0) gets
its logits back bit for bit; batches in which no row has one do not run
this at all (their trace is the plain one).
"""

from __future__ import annotations

from typing import Dict, Sequence

import mlx.core as mx
import numpy as np

from .options import PENALTY_CONTEXT
from .sampling import SamplingParams

NO_TOKEN = -1  # an empty slot of a window


def window_of(context: Sequence[int], size: int = PENALTY_CONTEXT) -> np.ndarray:
    """A row's window ``[size] int32``: its last ``size`` tokens, left-filled with :data:`NO_TOKEN`."""
    out = np.full(size, NO_TOKEN, dtype=np.int32)
    tail = list(context)[-size:]
    if tail:
        out[size - len(tail):] = tail
    return out


def bias_buffer(params: Sequence[SamplingParams], width: int, vocab: int) -> mx.array:
    """``[width, vocab] float32``: each row's logit bias (padding rows: 0)."""
    out = np.zeros((width, vocab), dtype=np.float32)
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            out[i, t] = b
    return mx.array(out)


def processor_inputs(params: Sequence[SamplingParams], windows, bias: mx.array, width: int) -> Dict[str, mx.array]:
    """The per-row processor arrays of a step of bucket ``width`` (padding rows:
    no processor). ``windows``: one ``[W]`` window per live row, or a
    ``[width, W]`` device array (a previous step's output); ``bias``: from
    :func:`bias_buffer`."""
    pad = width - len(params)
    if not isinstance(windows, mx.array):
        windows = mx.array(np.stack(list(windows) + [window_of(())] * pad))
    params = list(params) + [SamplingParams()] * pad
    return {
        "window": windows,  # [Bk, W] int32
        "bias": bias,  # [Bk, V]
        "repetition": mx.array([p.repetition_penalty for p in params], dtype=mx.float32),  # [Bk]
        "presence": mx.array([p.presence_penalty for p in params], dtype=mx.float32),  # [Bk]
        "frequency": mx.array([p.frequency_penalty for p in params], dtype=mx.float32),  # [Bk]
    }


def process(logits: mx.array, p: Dict[str, mx.array]) -> mx.array:
    """``logits [N, V]`` after each row's bias and penalties (see the module
    docstring); ``p`` holds ``[N]`` values, ``[N, W]`` windows and an
    ``[N, V]`` bias."""
    N, V = logits.shape
    window = p["window"]  # [N, W]
    valid = window >= 0
    flat = (mx.arange(N, dtype=mx.int32)[:, None] * V + mx.where(valid, window, 0)).reshape(-1)  # [N * W] into [N * V]
    counts = mx.zeros((N * V,), dtype=mx.float32).at[flat].add(valid.astype(mx.float32).reshape(-1)).reshape(N, V)
    present = counts > 0  # [N, V]
    dtype = logits.dtype
    logits = logits + p["bias"].astype(dtype)
    rep = p["repetition"].astype(dtype)[:, None]  # [N, 1]
    logits = mx.where(present, mx.where(logits < 0, logits * rep, logits / rep), logits)
    logits = mx.where(present, logits - p["presence"].astype(dtype)[:, None], logits)
    return mx.where(present, logits - (counts * p["frequency"][:, None]).astype(dtype), logits)


def slide(window: mx.array, tokens: mx.array) -> mx.array:
    """``window [Bk, W]`` with ``tokens [Bk]`` appended (the oldest dropped)."""
    return mx.concatenate([window[:, 1:], tokens[:, None].astype(window.dtype)], axis=1)


def verify_windows(window: mx.array, tokens: mx.array) -> mx.array:
    """The window at each position of a verify step: ``window [Bk, W]`` holds
    the row's last token (the window's first input), ``tokens [Bk, L]`` that
    token and the drafts; position ``j`` sees the drafts before it, as a plain
    decode step would after accepting them. Returns ``[Bk, L, W]``."""
    W, L = window.shape[1], tokens.shape[1]
    seq = mx.concatenate([window, tokens[:, 1:]], axis=1)  # [Bk, W + L - 1]
    return mx.stack([seq[:, j : j + W] for j in range(L)], axis=1)
