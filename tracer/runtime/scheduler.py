"""The scheduler: which requests run when.

It owns the queue and every request not yet finished, validates new requests,
decides admission (how many queued requests join the running batch, and in
which prefill groups), cuts prompts into static prefill windows, and applies
cancellations. It holds no arrays: the running batch and the compiled step do
the work it decides.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import replace
from typing import Deque, Dict, Iterable, List, Optional, Sequence

import numpy as np

from .options import (
    CONTEXT_LENGTH_EXCEEDED, DEFAULT_MAX_TOKENS, SEED_LIMIT, OptionError, OptionTypeError, check_choices,
    check_context_length, check_max_tokens, check_token_ids,
)
from .prefill import prefill_windows
from .requests import Request, TokenEvent
from .sampling import GREEDY, SamplingParams, initial_key


class Scheduler:
    """Queue, admission, prefill windows and cancellation of one engine.

    Args:
        buckets: batch-width buckets, checked (positive, deduplicated, sorted:
            :func:`~mlx_tracer.runtime.options.check_engine_options`).
        prefill_chunks: static prefill window lengths, checked (>= 2, sorted).
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        max_positions: positions a row can hold (None: unbounded).
        context_length: the model's own context length (None: not stated).
        lookahead: speculative drafts per step (a verify window writes them too).
        batched_prefill: prefill newcomers together in one padded batch, or
            each alone (see :class:`~mlx_tracer.runtime.engine.Engine`).
        rng: draws the seeds of requests that give none (default: fresh
            entropy per request); ranks in lockstep pass identically seeded ones.
    """

    def __init__(self, buckets: Sequence[int], prefill_chunks: Sequence[int], vocab_size: int,
                 max_positions: Optional[int], batched_prefill: bool, context_length: Optional[int] = None,
                 rng: Optional[np.random.Generator] = None, lookahead: int = 0):
        self.buckets = tuple(buckets)
        self.prefill_chunks = tuple(prefill_chunks)
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.context_length = context_length
        self.lookahead = lookahead  # columns a verify step may write past a row's last token
        self.batched_prefill = batched_prefill
        self.rng = rng
        self.queue: Deque[Request] = deque()
        self.requests: Dict[int, Request] = {}  # queued or running, until finished
        self._uids = itertools.count()

    # ------------------------------------------------------------- requests
    def add(self, prompt: Sequence[int], max_tokens: int = DEFAULT_MAX_TOKENS, sampling: SamplingParams = GREEDY,
            stop_ids: Iterable[int] = (), cache: Optional[Sequence] = None, context: int = 0) -> Request:
        """Validate and queue a request; ``context``: positions its starting
        caches already hold. Nothing changes when validation fails."""
        return self.enqueue(check_token_ids(prompt, self.vocab_size), max_tokens, sampling, stop_ids, cache, context)

    def enqueue(self, prompt: List[int], max_tokens: int, sampling: SamplingParams, stop_ids: Iterable[int],
                cache: Optional[Sequence] = None, context: int = 0) -> Request:
        """:meth:`add` for a prompt already checked (:func:`check_token_ids`)."""
        return self.enqueue_choices(prompt, 1, max_tokens, sampling, stop_ids, cache, context)[0]

    def enqueue_choices(self, prompt: List[int], n: int, max_tokens: int, sampling: SamplingParams,
                        stop_ids: Iterable[int], cache: Optional[Sequence] = None, context: int = 0) -> List[Request]:
        """Queue ``n`` choices of one checked prompt: ``n`` requests, one
        family (admitted together, prefilled once). Choice ``i`` samples with
        seed ``seed + i`` (when the request gives one)."""
        n = check_choices(n, self.buckets[-1])
        max_tokens = check_max_tokens(max_tokens)
        if not isinstance(sampling, SamplingParams):
            raise OptionTypeError("sampling", f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if sampling.logit_bias:
            check_token_ids([t for t, _ in sampling.logit_bias], self.vocab_size, what="logit_bias")
        stop_ids = frozenset(check_token_ids(list(stop_ids), what="stop_ids")) if stop_ids else frozenset()
        self.check_room(len(prompt), max_tokens, context)
        out: List[Request] = []
        for i in range(n):
            params = sampling if i == 0 or sampling.seed is None else replace(sampling, seed=(sampling.seed + i) % SEED_LIMIT)
            req = Request(next(self._uids), prompt, max_tokens, params, stop_ids, initial_key(params.seed, self.rng),
                          list(cache) if cache else None)
            req.context_len = context
            req.family = out[0].uid if out else (req.uid if n > 1 else None)
            out.append(req)
        for req in out:
            self.queue.append(req)
            self.requests[req.uid] = req
        return out

    def check_room(self, prompt_tokens: int, max_tokens: int, context: int = 0) -> None:
        """Whether a prompt of ``prompt_tokens`` after ``context`` cached
        positions and ``max_tokens`` fit a row: the model's context length and
        the largest capacity bucket (raises ``OptionError``)."""
        check_context_length(prompt_tokens, max_tokens, self.context_length, context)
        if self.max_positions is not None:
            # + 1: the pipelined loop may compute one step past the last token
            need = context + self.padded_prefill(prompt_tokens - 1) + 1 + max_tokens + 1 + self.lookahead
            if need > self.max_positions:
                raise OptionError(
                    "prompt", f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} exceed the largest capacity "
                              f"bucket {self.max_positions}: shorten the prompt, lower max_tokens or pass larger capacities",
                    CONTEXT_LENGTH_EXCEEDED)

    def has_work(self) -> bool:
        return bool(self.requests)

    def cancel(self, uid: int) -> Request:
        """Ask to end a queued or running request; it finishes as "cancelled" at the next step."""
        req = self.requests.get(uid)
        if req is None:
            raise KeyError(f"no queued or running request {uid}")
        req.cancel_requested = True
        return req

    def drop_cancelled(self) -> List[TokenEvent]:
        """Finish the cancelled requests still in the queue."""
        gone = [r for r in self.queue if r.cancel_requested]
        events = []
        for r in gone:
            self.queue.remove(r)
            self.finish(r)
            events.append(r.cancelled())
        return events

    def finish(self, req: Request) -> None:
        """Forget a request that finished (or is finishing now)."""
        self.requests.pop(req.uid, None)

    # ------------------------------------------------------------ admission
    def admission(self, running: int) -> List[List[Request]]:
        """The queued requests to admit next to ``running`` rows, as prefill
        groups in join order: first come, first served, the choices of one
        prompt all or none (one group: :func:`~.prefill.forked`). They stay
        queued until :meth:`admitted`."""
        groups: List[List[Request]] = []
        fresh: Optional[List[Request]] = None  # batched prefill: the fresh lone requests, one group
        for unit in self._fitting_units(self.buckets[-1] - running):
            if self.batched_prefill and len(unit) == 1 and unit[0].cache is None:
                if fresh is None:
                    fresh = []
                    groups.append(fresh)
                fresh.append(unit[0])
            else:
                groups.append(unit)
        return groups

    def _fitting_units(self, room: int) -> List[List[Request]]:
        """The queue's leading units that fit ``room`` rows: a lone request, or
        the choices of one prompt still queued (they are queued side by side)."""
        units: List[List[Request]] = []
        for r in self.queue:  # stops at the first unit that does not fit
            if units and r.family is not None and units[-1][0].family == r.family:
                units[-1].append(r)
            else:
                units.append([r])
            if sum(map(len, units)) > room:
                units[-1].pop()
                if not units[-1] or units[-1][0].family is not None:  # no unit is split
                    units.pop()
                break
        return units

    def admitted(self, reqs: Sequence[Request]):
        for r in reqs:
            self.queue.remove(r)

    def must_drain(self, running: int) -> bool:
        """Whether queued requests wait for room that the next step boundary gives."""
        return bool(self._fitting_units(self.buckets[-1] - running))

    # -------------------------------------------------------- prefill windows
    def prefill_windows(self, n: int) -> List[int]:
        """Window lengths covering ``n`` prompt tokens: greedy largest chunks,
        a short tail padded to the smallest chunk."""
        return prefill_windows(n, self.prefill_chunks)

    def padded_prefill(self, n: int) -> int:
        return sum(self.prefill_windows(n))
