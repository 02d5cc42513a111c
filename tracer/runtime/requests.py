"""The typed state the runtime's parts share: requests, token events, stats, snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from .sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass
class Request:
    """One generation request, from the queue to its last token."""

    uid: int
    prompt: List[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset
    key: np.ndarray  # [2] uint32: the row's PRNG key, advanced by every sampled token
    cache: Optional[list] = None  # serial mlx-lm caches holding context before the prompt
    context_len: int = 0  # positions those caches held (before the prompt)
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    top_logprobs: List[List[Tuple[int, float]]] = field(default_factory=list)  # per token, when asked for
    finish_reason: Optional[str] = None  # one of FINISH_REASONS once finished
    cancel_requested: bool = False  # set by cancel(); applied at the next step
    # prompt tokens before ``prompt`` that the penalties count (a prefix-cache hit's tail)
    history: List[int] = field(default_factory=list)
    # the uid of the first of n choices of one prompt (they share one prefill); None: a lone request
    family: Optional[int] = None

    @property
    def context(self) -> List[int]:
        """Everything the row has seen: prompt and generated tokens."""
        return self.prompt + self.tokens

    @property
    def penalty_context(self) -> List[int]:
        """What the penalties count (they read its last tokens): the whole
        prompt, also a prefix-cache hit's part, and the generated tokens."""
        return self.history + self.prompt + self.tokens

    @property
    def budget(self) -> int:
        """Tokens the request may still generate."""
        return self.max_tokens - len(self.tokens)

    @property
    def next_input(self) -> int:
        return self.tokens[-1] if self.tokens else self.prompt[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, token: int, logprob: float, top: Optional[List[Tuple[int, float]]] = None) -> "TokenEvent":
        """Record a generated token (``top``: its most likely alternatives, when
        asked for); finishes the request on a stop token or at its budget."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            self.top_logprobs.append(top)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"
        return TokenEvent(self.uid, token, logprob, self.finish_reason, top)

    def cancelled(self) -> "TokenEvent":
        """Finish the request as cancelled; its last event carries no token."""
        self.finish_reason = "cancelled"
        return TokenEvent(self.uid, None, None, "cancelled")


@dataclass
class TokenEvent:
    """One generated token of one request (``token`` is None on the final
    event of a cancelled request)."""

    uid: int
    token: Optional[int]
    logprob: Optional[float]
    finish_reason: Optional[str]  # None, "stop", "length" or "cancelled"
    top_logprobs: Optional[List[Tuple[int, float]]] = None  # (token id, log-probability), most likely first


@dataclass
class EngineStats:
    steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    host_s: float = 0.0  # graph build + dispatch of decode steps, before evaluation
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    joins: int = 0
    joins_in_place: int = 0  # of them: newcomers written into free rows, the running rows' K/V not gathered again
    joins_into_ready: int = 0  # of them: into a wider bucket whose buffers were made ready beforehand (caches.spare)
    verify_steps: int = 0  # speculative verify steps
    verify_tokens: int = 0  # tokens they emitted (all rows)
    drafted: int = 0  # drafts judged
    accepted: int = 0  # drafts accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.verify_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * self.host_s / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class EngineSnapshot:
    """What an engine looks like between steps (:meth:`Engine.snapshot`): all
    that the server, the CLI and the benchmark read, copied."""

    traces: Dict[object, int]  # trace key -> traces made (the key has .kind and .width)
    bucket: int  # width of the running batch (0: no row)
    live_rows: int  # requests decoding now
    queued: int  # requests waiting for a row
    stats: EngineStats  # a copy
    prefix_cache: Optional[object] = None  # a PrefixCacheSnapshot, when the engine has a prefix cache

    @property
    def traces_made(self) -> int:
        return sum(self.traces.values())

    def traces_by_kind(self) -> Dict[str, Tuple[int, int]]:
        """kind -> (trace keys, traces made)."""
        out: Dict[str, Tuple[int, int]] = {}
        for key, n in self.traces.items():
            keys, made = out.get(key.kind, (0, 0))
            out[key.kind] = (keys + 1, made + n)
        return out
