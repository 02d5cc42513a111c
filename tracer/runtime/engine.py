"""The compile-once decode loop: continuous batching over static caches.

An ``Engine`` owns a :class:`CompiledModel`, one running batch (a static cache
per layer, in a batch-width bucket) and a queue of requests. Each
:meth:`Engine.step`:

1. admits queued requests: their prompts (all but the last token) are
   prefilled together through compiled window steps of static chunk lengths
   (right-padded tails), then joined into the running batch;
2. runs one compiled decode step over the running batch (the newcomers' input
   is their last prompt token, as in mlx-lm), and reads the tokens back;
3. retires rows that hit a stop token or their token budget (filtering them
   out, moving to a smaller bucket when one fits).

Once the buckets and lengths in use are traced, steps replay traces: nothing
retraces while requests come and go.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Iterable, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..caches import DEFAULT_CAPACITIES, FullCache, RingCache
from ..caches.batch import StaticKVCache
from .sampling import GREEDY, SamplingParams, initial_key, sampler_inputs
from .step import DEFAULT_BUCKETS, CompiledModel, bucket_for

DEFAULT_PREFILL_CHUNKS = (8, 32, 128, 512)


@dataclass
class Request:
    uid: int
    prompt: List[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset
    key: np.ndarray
    cache: Optional[list] = None  # serial mlx-lm caches holding context before the prompt
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None

    @property
    def next_input(self) -> int:
        return self.tokens[-1] if self.tokens else self.prompt[-1]


@dataclass
class TokenEvent:
    """One generated token of one request."""

    uid: int
    token: int
    logprob: float
    finish_reason: Optional[str]  # None, "stop" or "length"


@dataclass
class EngineStats:
    steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    host_s: float = 0.0  # graph build + dispatch of decode steps, before evaluation
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    joins: int = 0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * self.host_s / self.steps if self.steps else 0.0


class Engine:
    """Continuous batching over one compiled model.

    Args:
        model: an mlx-lm model (or a ready :class:`CompiledModel`).
        buckets: batch-width buckets; the running batch always sits in the
            smallest one that holds its rows.
        prefill_chunks: static window lengths for prefill; a prompt is cut
            greedily into the largest chunks that fit, and a tail shorter than
            the smallest chunk is padded to it.
        batched_prefill: prefill newcomers together in one padded batch
            (default on GPUs). On the CPU, quantized matmuls do not reuse
            weights across rows, so each newcomer is prefilled alone (no
            padding waste) and all are joined at once.
        capacities: capacity buckets of full-attention caches.
    """

    def __init__(
        self,
        model,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        prefill_chunks: Sequence[int] = DEFAULT_PREFILL_CHUNKS,
        capacities: Sequence[int] = DEFAULT_CAPACITIES,
        batched_prefill: Optional[bool] = None,
    ):
        self.batched_prefill = mx.default_device() == mx.gpu if batched_prefill is None else batched_prefill
        self.compiled = model if isinstance(model, CompiledModel) else CompiledModel(model, capacities)
        self.buckets = tuple(sorted(buckets))
        self.prefill_chunks = tuple(sorted(prefill_chunks))
        if min(self.prefill_chunks) < 2:
            raise ValueError("prefill chunks must be >= 2 tokens (1-token steps are decode steps)")
        self.queue: Deque[Request] = deque()
        self.rows: List[Request] = []
        self._inflight: Optional[dict] = None  # a dispatched decode step not yet read
        self._last_read = 0.0
        self.caches: Optional[List[StaticKVCache]] = None
        self.stats = EngineStats()
        self._uids = itertools.count()

    # ------------------------------------------------------------- requests
    @property
    def vocab_size(self) -> int:
        return self.compiled.vocab_size

    @property
    def max_positions(self) -> Optional[int]:
        """Longest prompt + generation a row can hold (None: ring layers only)."""
        has_full = any(l.window is None for l in self.compiled.layouts)
        return self.compiled.capacities[-1] if has_full else None

    def add(
        self,
        prompt: Sequence[int],
        max_tokens: int = 256,
        sampling: SamplingParams = GREEDY,
        stop_ids: Iterable[int] = (),
        cache: Optional[Sequence] = None,
    ) -> int:
        """Queue a request; returns its uid. Validates before touching any state.

        ``cache``: optional serial mlx-lm caches (one per layer, as from
        ``make_prompt_cache`` after a forward) holding context that precedes
        ``prompt``; the request continues from them instead of prefilling it.
        """
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt: give at least one token")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        context = self._check_context(cache)
        limit = self.max_positions
        if limit is not None:
            # + 1: the pipelined loop may compute one speculative step past the last token
            need = context + self._padded_prefill(len(prompt) - 1) + 1 + max_tokens + 1
            if need > limit:
                raise ValueError(
                    f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} exceed the largest capacity bucket "
                    f"{limit}: shorten the prompt, lower max_tokens or pass larger capacities"
                )
        uid = next(self._uids)
        self.queue.append(
            Request(uid, prompt, int(max_tokens), sampling, frozenset(stop_ids), initial_key(sampling.seed), list(cache) if cache else None)
        )
        return uid

    def _check_context(self, cache) -> int:
        """Positions held by a request's starting caches (validated)."""
        if not cache:
            return 0
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        layouts = self.compiled.layouts
        if len(cache) != len(layouts):
            raise ValueError(f"cache has {len(cache)} layers, the model has {len(layouts)}")
        for i, (c, l) in enumerate(zip(cache, layouts)):
            ok = type(c) is KVCache if l.window is None else type(c) is RotatingKVCache and c.max_size == l.window
            if not ok:
                want = "KVCache" if l.window is None else f"RotatingKVCache(max_size={l.window})"
                raise ValueError(f"cache layer {i}: expected {want}, got {type(c).__name__}")
        return max(int(c.offset) for c in cache)

    def has_work(self) -> bool:
        return bool(self.queue or self.rows)

    def _prefill_windows(self, n: int) -> List[int]:
        """Window lengths covering ``n`` prompt tokens: greedy largest chunks,
        a short tail padded to the smallest chunk."""
        out = []
        for c in reversed(self.prefill_chunks):
            while n >= c:
                out.append(c)
                n -= c
        if n:
            out.append(self.prefill_chunks[0])
        return out

    def _padded_prefill(self, n: int) -> int:
        return sum(self._prefill_windows(n))

    # ----------------------------------------------------------------- loop
    def step(self) -> List[TokenEvent]:
        """Emit the tokens of one decode step.

        Steps are pipelined as in mlx-lm: while step t's tokens are read back
        and processed on the host, step t+1 (fed by step t's tokens on the
        device) is already computing. The pipeline drains before newcomers
        are admitted; rows that finish at step t are filtered out of step t+1.
        """
        if self._inflight is None:
            self._admit()
            if not self.rows:
                return []
            self._inflight = self._dispatch(None)
        cur, self._inflight = self._inflight, None
        if self._may_continue():
            self._inflight = self._dispatch(cur)
        events = self._read(cur)
        self._retire()
        return events

    def run(self) -> Iterable[TokenEvent]:
        while self.has_work():
            yield from self.step()

    # --------------------------------------------------------------- admit
    def admit(self):
        """Prefill queued requests and join them into the running batch now
        (``step`` does this itself; call it to keep admission out of a timing)."""
        self._admit()

    def _admit(self):
        room = self.buckets[-1] - len(self.rows)
        if not self.queue or room <= 0:
            return
        new = [self.queue.popleft() for _ in range(min(room, len(self.queue)))]
        fresh = [r for r in new if r.cache is None]
        groups = ([fresh] if self.batched_prefill and fresh else [[r] for r in fresh]) + [[r] for r in new if r.cache is not None]
        new = [r for g in groups for r in g]  # row order = join order
        prefilled = [self._prefill(g) for g in groups]
        width = bucket_for(len(self.rows) + len(new), self.buckets)
        if self.caches is not None:
            self.stats.joins += 1
            prefilled.insert(0, self.caches)
        self.caches = [type(layer[0]).join(layer, width=width) for layer in zip(*prefilled)]
        mx.eval([c.state for c in self.caches])  # the join's copies belong to admission, not to decode
        self.rows += new

    def _prefill(self, reqs: List[Request]) -> List[StaticKVCache]:
        """Caches of ``reqs`` holding all but their last prompt token."""
        t0 = time.perf_counter()
        width = bucket_for(len(reqs), self.buckets)
        caches = self._start_caches(reqs, width)
        lengths = [len(r.prompt) - 1 for r in reqs]
        top = max(lengths)
        if top == 0:
            return caches
        windows = self._prefill_windows(top)
        padded = sum(windows)
        tokens = np.zeros((width, padded), dtype=np.int32)
        for i, r in enumerate(reqs):
            tokens[i, : lengths[i]] = r.prompt[:-1]
        for c in caches:
            c.prepare(lengths=lengths, right_padding=[padded - n for n in lengths])
        done = 0
        for L in windows:
            self.compiled.step(caches, mx.array(tokens[:, done : done + L]))
            done += L
        for c in caches:
            c.finalize()
        mx.eval([c.state for c in caches])
        self.stats.prefill_tokens += sum(lengths)
        self.stats.prefill_s += time.perf_counter() - t0
        return caches

    def _start_caches(self, reqs: List[Request], width: int) -> List[StaticKVCache]:
        if reqs[0].cache is None:
            return self.compiled.new_caches(width, rows=len(reqs))
        serial, reqs[0].cache = reqs[0].cache, None  # converted once; the caller's caches are only read
        caches = []
        for s, layout in zip(serial, self.compiled.layouts):
            kind = FullCache if layout.window is None else RingCache
            c = kind.join([s], width=width, capacities=self.compiled.capacities)
            if c.keys is None:
                c.allocate(layout.kv_heads, layout.k_dim, layout.v_dim, layout.dtype)
            caches.append(c)
        return caches

    # -------------------------------------------------------------- decode
    def _may_continue(self) -> bool:
        """Whether to dispatch the next step before reading the current one."""
        if self.queue and len(self.rows) < self.buckets[-1]:
            return False  # drain first: newcomers are admitted between steps
        return any(len(r.tokens) + 1 < r.max_tokens for r in self.rows)

    def _dispatch(self, prev: Optional[dict]) -> dict:
        """Build and start one decode step; its inputs come from the host, or
        from the previous step's outputs on the device (``prev``)."""
        t0 = time.perf_counter()
        width = self.caches[0].width
        greedy = all(r.sampling.greedy for r in self.rows)
        if prev is None:
            inputs = np.zeros((width, 1), dtype=np.int32)
            inputs[: len(self.rows), 0] = [r.next_input for r in self.rows]
            inputs = mx.array(inputs)
            keys = None if greedy else [r.key for r in self.rows]
        else:
            inputs = prev["tokens"][:, None]
            keys = prev.get("keys")
        sampler = None if greedy else sampler_inputs([r.sampling for r in self.rows], keys, width)
        out = self.compiled.step(self.caches, inputs, sampler)
        out["host_s"] = time.perf_counter() - t0  # graph build + dispatch
        out["t0"] = t0
        # (on the CPU, async_eval waits while MLX's task queue is full: that is not host time)
        mx.async_eval(out["tokens"], out["logprobs"], out.get("keys", out["tokens"]), [c.state for c in self.caches])
        return out

    def _read(self, out: dict) -> List[TokenEvent]:
        """Wait for a dispatched step and turn its tokens into events."""
        tokens = out["tokens"].tolist()
        logprobs = out["logprobs"].tolist()
        if "keys" in out:
            keys = np.array(out["keys"])
            for i, r in enumerate(self.rows):
                r.key = keys[i]
        events = []
        for i, r in enumerate(self.rows):
            tok = int(tokens[i])
            r.tokens.append(tok)
            r.logprobs.append(float(logprobs[i]))
            if tok in r.stop_ids:
                r.finish_reason = "stop"
            elif len(r.tokens) >= r.max_tokens:
                r.finish_reason = "length"
            events.append(TokenEvent(r.uid, tok, float(logprobs[i]), r.finish_reason))
        now = time.perf_counter()
        self.stats.steps += 1
        self.stats.decode_tokens += len(self.rows)
        self.stats.host_s += out["host_s"]
        self.stats.decode_s += now - max(out["t0"], self._last_read)
        self._last_read = now
        return events

    def cancel(self, uid: int, reason: str = "stop") -> Request:
        """Finish a request now (queued or running): its row leaves the batch."""
        for r in list(self.queue):
            if r.uid == uid:
                self.queue.remove(r)
                r.finish_reason = reason
                return r
        for r in self.rows:
            if r.uid == uid:
                r.finish_reason = r.finish_reason or reason
                self._retire()
                return r
        raise KeyError(f"no queued or running request {uid}")

    def _retire(self):
        keep = [i for i, r in enumerate(self.rows) if r.finish_reason is None]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.caches = self._inflight = None
            return
        width = bucket_for(len(keep), self.buckets)
        for c in self.caches:
            c.filter(keep, width=width)
        if self._inflight is not None:  # the step in flight computed finished rows too: drop them
            idx = mx.array(keep, dtype=mx.int32)
            for name in ("tokens", "logprobs", "keys"):
                if name in self._inflight:
                    x = self._inflight[name][idx]
                    pad = [(0, width - len(keep))] + [(0, 0)] * (x.ndim - 1)
                    self._inflight[name] = mx.pad(x, pad) if width > len(keep) else x

    # -------------------------------------------------------------- warmup
    def warmup(self, buckets: Optional[Sequence[int]] = None, prefill: bool = True) -> dict:
        """Trace ahead of time on scratch caches, per bucket: the decode step
        (evaluated once, so MLX's kernel JIT is done too) and, with
        ``prefill``, the prefill windows (traced only: evaluating a long
        window costs a real forward). Returns ``{trace: milliseconds}``."""
        before = dict(self.compiled.trace_ms)
        for b in buckets or self.buckets:
            if prefill:
                for L in self.prefill_chunks:
                    self.compiled.step(self.compiled.new_caches(b), mx.zeros((b, L), dtype=mx.int32))
            caches = self.compiled.new_caches(b)
            out = self.compiled.step(caches, mx.zeros((b, 1), dtype=mx.int32))
            mx.eval(out["tokens"], [c.state for c in caches])
        return {k: v for k, v in self.compiled.trace_ms.items() if k not in before}
