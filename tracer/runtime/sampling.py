"""Token sampling inside the compiled step, with per-row settings.

Every row of a batch carries its own temperature, top-k, top-p, min-p and
PRNG key, as ``[Bk]`` arrays: requests with different settings share one
trace. The filters follow mlx-lm's ``make_sampler`` order of meaning (they are
applied to the unscaled log-probabilities, then the temperature scales what
is left); the draw is Gumbel-max with the row's own key, so a request's
samples depend on its seed and its logits only, not on which rows it shares
the batch with. Temperature 0 is greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from .options import check_logits_processing, check_sampling


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampler. ``temperature=0`` is greedy; ``top_k=0``,
    ``top_p=1`` and ``min_p=0`` switch their filter off.

    Logits processors (:mod:`.processors`, mlx-lm's ``make_logits_processors``
    with its context sizes of 20 tokens), applied to the logits before the
    sampler: ``logit_bias`` ``{token id: bias}`` (kept as sorted pairs),
    ``repetition_penalty`` (1: off), ``presence_penalty`` and
    ``frequency_penalty`` (0: off). ``top_logprobs``: the most likely
    alternatives to report per token (0 .. 20; not a sampling setting, but it
    travels with the row).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    seed: Optional[int] = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Union[None, Mapping[int, float], Tuple[Tuple[int, float], ...]] = ()
    top_logprobs: int = 0

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.min_p, self.top_k, self.seed)
        bias = check_logits_processing(self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
                                       self.logit_bias, self.top_logprobs)
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Whether a logits processor (a penalty or a bias) changes this row's logits."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or bool(self.logit_bias))


GREEDY = SamplingParams()


def initial_key(seed: Optional[int], rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """A row's PRNG key ``[2] uint32`` from its seed (if None: a seed drawn
    from ``rng``, fresh entropy by default)."""
    if seed is None:
        seed = int((rng or np.random.default_rng()).integers(0, 2**63))
    return np.array(mx.random.key(seed)).astype(np.uint32)


def sampler_inputs(params: Sequence[SamplingParams], keys, width: int) -> dict:
    """The per-row sampler arrays of a step of bucket ``width`` (padding rows
    greedy). ``keys``: one ``[2]`` key per live row, or a ``[width, 2]``
    device array (a previous step's output)."""
    pad = width - len(params)
    params = list(params) + [GREEDY] * pad
    if not isinstance(keys, mx.array):
        keys = mx.array(np.stack(list(keys) + [np.zeros(2, np.uint32)] * pad).astype(np.uint32))
    return {
        "temperature": mx.array([p.temperature for p in params], dtype=mx.float32),
        "top_k": mx.array([p.top_k for p in params], dtype=mx.int32),
        "top_p": mx.array([p.top_p for p in params], dtype=mx.float32),
        "min_p": mx.array([p.min_p for p in params], dtype=mx.float32),
        "keys": keys,
    }


def filtered_logits(logprobs: mx.array, s: dict) -> mx.array:
    """``[B, V]`` logits of each row's sampling distribution: top-k, top-p and
    min-p applied to the unscaled log-probabilities (filtered tokens: -inf),
    then divided by the row's temperature."""
    B, V = logprobs.shape
    srt = mx.sort(logprobs, axis=-1)[:, ::-1]  # [B, V] descending
    k = mx.where(s["top_k"] > 0, mx.minimum(s["top_k"], V), V) - 1  # [B]
    kth = mx.take_along_axis(srt, k[:, None], axis=-1)  # [B, 1]
    p = mx.exp(srt)
    before = mx.cumsum(p, axis=-1) - p  # probability mass ranked above each token
    n_p = mx.sum(before < s["top_p"][:, None], axis=-1)  # [B] >= 1
    pth = mx.take_along_axis(srt, mx.maximum(n_p - 1, 0)[:, None], axis=-1)  # [B, 1]
    mth = srt[:, :1] + mx.log(mx.maximum(s["min_p"], 1e-30))[:, None]  # [B, 1]
    keep = logprobs >= mx.maximum(mx.maximum(kth, pth), mth)
    return mx.where(keep, logprobs / mx.maximum(s["temperature"], 1e-6)[:, None], -mx.inf)


def sample(logprobs: mx.array, s: dict):
    """Tokens ``[B]`` and next keys ``[B, 2]`` from normalized ``logprobs [B, V]``."""
    B, V = logprobs.shape
    scaled = filtered_logits(logprobs, s)
    draws: List[mx.array] = []
    next_keys: List[mx.array] = []
    for r in range(B):
        nxt, use = mx.random.split(s["keys"][r])
        draws.append(mx.argmax(scaled[r] + mx.random.gumbel((V,), key=use)))
        next_keys.append(nxt)
    sampled = mx.stack(draws)
    tokens = mx.where(s["temperature"] > 0, sampled, mx.argmax(logprobs, axis=-1))
    return tokens.astype(mx.int32), mx.stack(next_keys)


def top_logprobs(logprobs: mx.array, k: int) -> Tuple[mx.array, mx.array]:
    """The ``k`` most likely tokens of each row of ``logprobs [N, V]``, most
    likely first: ``(ids [N, k] int32, log-probabilities [N, k])``."""
    ids = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]  # [N, k] unordered
    vals = mx.take_along_axis(logprobs, ids, axis=-1)  # [N, k]
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1).astype(mx.int32), mx.take_along_axis(vals, order, axis=-1)
