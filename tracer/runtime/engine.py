"""The compile-once decode loop: continuous batching over static caches.

An ``Engine`` ties three parts together: a :class:`Scheduler` (queue,
admission, prefill windows, cancellation), a :class:`RunningBatch` (caches,
bucket, pipeline) and the :class:`CompiledModel`. Each :meth:`Engine.step`:

1. applies cancellations asked for since the last step;
2. when nothing is in flight, admits queued requests: their prompts are
   prefilled through compiled window steps, then joined into the running batch;
3. dispatches decode steps (pipelined: step t+1 starts before step t is read)
   and reads the oldest back as per-request token events;
4. retires rows that finished (stop token, budget, cancel), moving to a smaller
   bucket when one fits.

Once the buckets and lengths in use are traced, steps replay traces: nothing
retraces while requests come and go.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..backend import threads
from ..caches import DEFAULT_CAPACITIES
from .batch import RunningBatch
from .drafters import make_drafter
from .options import check_buckets, check_draft_tokens, check_prefill_chunks
from .prefill import prefill
from .requests import EngineStats, Request, TokenEvent
from .sampling import GREEDY, SamplingParams
from .scheduler import Scheduler
from .speculator import Speculator
from .step import DEFAULT_BUCKETS, CompiledModel, bucket_for

DEFAULT_PREFILL_CHUNKS = (8, 32, 128, 256)  # 256: as fast as 512 here, and Ctrl-C lands within ~1.4 s


class Engine:
    """Continuous batching over one compiled model.

    Args:
        model: an mlx-lm model (or a ready :class:`CompiledModel`).
        buckets: batch-width buckets; the running batch always sits in the
            smallest one that holds its rows.
        prefill_chunks: static window lengths for prefill; a prompt is cut
            greedily into the largest chunks that fit, and a tail shorter than
            the smallest chunk is padded to it.
        capacities: capacity buckets of full-attention caches.
        batched_prefill: prefill newcomers together in one padded batch
            (default on GPUs). On the CPU, quantized matmuls do not reuse
            weights across rows, so each newcomer is prefilled alone (no
            padding waste) and all are joined at once.
        speculative: ``"prompt-lookup"`` (or a drafter object) for batched
            speculative decoding: rows draft tokens that one compiled verify
            step per bucket judges; None (default) decodes one token a step.
        draft_tokens: the most drafts per row and step (``k``; the verify
            window is ``k + 1`` tokens).
        spec_policy: ``"auto"`` runs a verify step only when it is expected to
            emit more tokens per second than a plain step (measured step times,
            each row's recent acceptance); ``"always"`` whenever a row has drafts.
        on_retire: called as ``on_retire(request, caches, tokens)`` for every
            row that leaves the batch (finished or cancelled), before it
            leaves: ``caches`` are owned serial mlx-lm caches of the row (one
            per layer, as ``add(cache=...)`` takes them) and ``tokens`` the ids
            whose keys and values they hold after the ``request.context_len``
            positions of the caches the request started from (0 without
            ``add(cache=...)``). A prefix cache is built on it.
        rng: draws the seeds of unseeded requests (see :class:`Scheduler`).
    """

    def __init__(
        self,
        model,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        prefill_chunks: Sequence[int] = DEFAULT_PREFILL_CHUNKS,
        capacities: Sequence[int] = DEFAULT_CAPACITIES,
        batched_prefill: Optional[bool] = None,
        speculative=None,
        draft_tokens: int = 4,
        spec_policy: str = "auto",
        on_retire: Optional[Callable[[Request, list, List[int]], None]] = None,
        rng: Optional[np.random.Generator] = None,
    ):
        buckets = check_buckets(buckets)  # before the probe forward: bad input fails fast
        drafter = make_drafter(speculative)
        k = check_draft_tokens(draft_tokens, check_prefill_chunks(prefill_chunks)) if drafter else 0
        self.compiled = model if isinstance(model, CompiledModel) else CompiledModel(model, capacities)
        drafter = make_drafter(speculative, self.compiled.vocab_size)
        batched = mx.default_device() == mx.gpu if batched_prefill is None else batched_prefill
        self.scheduler = Scheduler(buckets, prefill_chunks, self.compiled.vocab_size, self.compiled.max_positions, batched,
                                   self.compiled.context_length, rng=rng, lookahead=k)
        self.speculator = Speculator(drafter, k, spec_policy) if drafter else None
        self.on_retire = on_retire
        self.stats = EngineStats()
        self.batch = RunningBatch(self.compiled, buckets, self.stats)

    # ------------------------------------------------------------- requests
    @property
    def buckets(self):
        return self.scheduler.buckets

    @property
    def prefill_chunks(self):
        return self.scheduler.prefill_chunks

    @property
    def vocab_size(self) -> int:
        return self.compiled.vocab_size

    @property
    def max_positions(self) -> Optional[int]:
        """Longest prompt + generation a row can hold (None: ring layers only)."""
        return self.compiled.max_positions

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @stats.setter
    def stats(self, value: EngineStats):  # a fresh EngineStats() starts a new measurement
        self._stats = value
        if hasattr(self, "batch"):
            self.batch.stats = value

    @property
    def rows(self) -> List[Request]:
        """The requests decoding now, in row order."""
        return self.batch.rows

    @property
    def caches(self):
        """The running batch's caches, one per layer (None when no row runs)."""
        return self.batch.caches

    @property
    def queue(self):
        return self.scheduler.queue

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
        context = self.compiled.layout.check_serial(cache) if cache else 0
        return self.scheduler.add(prompt, max_tokens, sampling, stop_ids, cache, context).uid

    def cancel(self, uid: int) -> Request:
        """End a queued or running request: at the next step its row is freed
        and it finishes with ``finish_reason="cancelled"`` (a last event with
        no token). Raises ``KeyError`` for an unknown or finished uid."""
        return self.scheduler.cancel(uid)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ----------------------------------------------------------------- loop
    def step(self) -> List[TokenEvent]:
        """The events of one decode step (and of cancellations since the last).

        Steps are pipelined as in mlx-lm: while step t's tokens are read back
        and processed on the host, step t+1 (fed by step t's tokens on the
        device) is already computing. The pipeline drains before newcomers
        are admitted; rows that finish at step t are filtered out of step t+1.
        """
        events = self.scheduler.drop_cancelled() + self._retire()
        if self.speculator is not None:
            return events + self._speculative_step()
        recheck = threads.follows_load() and self.stats.steps % threads.RECHECK_STEPS == threads.RECHECK_STEPS - 1
        if not self.batch.pipeline:
            if self.stats.steps and self.stats.steps % threads.RECHECK_STEPS == 0:  # (admit() asks too)
                threads.for_decode()  # drained: a safe point to follow the machine's load
            self.admit()
            if not self.batch.rows:
                return events
            self.batch.dispatch()
        if (len(self.batch.pipeline) < 2 and self.batch.needs_more() and not recheck
                and not self.scheduler.must_drain(len(self.batch.rows))):
            self.batch.dispatch()
        events += self.batch.read()
        return events + self._retire()

    def _speculative_step(self) -> List[TokenEvent]:
        """A verify step when the rows' drafts are expected to pay, else a plain
        decode step; never pipelined (the next drafts need this step's tokens)."""
        self.admit()
        if not self.batch.rows:
            return []
        width = self.batch.width
        drafts = self.speculator.drafts(self.batch.rows, width)
        t0 = time.perf_counter()
        if drafts is not None:
            events = self.batch.verify(drafts, self.speculator.k, self.speculator)
            self.speculator.observe("verify", width, time.perf_counter() - t0)
        else:
            self.batch.dispatch()
            events = self.batch.read()
            self.speculator.observe("decode", width, time.perf_counter() - t0)
            self.speculator.plain_step(self.batch.rows)
        return events + self._retire()

    def run(self) -> Iterable[TokenEvent]:
        while self.has_work():
            yield from self.step()

    def admit(self):
        """Prefill queued requests and join them into the running batch now
        (``step`` does this itself; call it to keep admission out of a timing).
        Needs an empty pipeline (between steps)."""
        if self.batch.pipeline:
            raise RuntimeError("admit() needs the decode pipeline drained: call it between steps")
        groups = self.scheduler.admission(len(self.batch.rows))
        if not groups:
            return
        threads.for_prefill()  # nothing is in flight: a safe point to change BLAS threads
        try:
            prefilled = [prefill(self.compiled, g, bucket_for(len(g), self.buckets), self.scheduler.prefill_windows, self.stats)
                         for g in groups]
            new = [r for g in groups for r in g]  # row order = join order
            self.batch.join(new, prefilled)
        finally:
            threads.for_decode()
        self.scheduler.admitted(new)
        for r in new:
            r.cache = None  # the caller's serial caches were only read; drop our reference

    def _retire(self) -> List[TokenEvent]:
        events = [r.cancelled() for r in self.batch.rows if r.cancel_requested and not r.finished]
        keep = [i for i, r in enumerate(self.batch.rows) if not r.finished]
        if len(keep) < len(self.batch.rows):
            for i, r in enumerate(self.batch.rows):
                if r.finished:
                    self.scheduler.finish(r)
                    if self.on_retire is not None:
                        held = int(self.batch.caches[0].rows.offsets[i]) - r.context_len
                        self.on_retire(r, [c.extract(i) for c in self.batch.caches], r.context[:held])
            self.batch.keep(keep)
        return events

    # -------------------------------------------------------------- warmup
    def warmup(self, buckets: Optional[Sequence[int]] = None, prefill: bool = True) -> dict:
        """Trace ahead of time on scratch caches, per bucket: the decode step
        (evaluated once, so MLX's kernel JIT is done too) and, with
        ``prefill``, the prefill windows (traced only: evaluating a long
        window costs a real forward). Returns ``{trace: milliseconds}``."""
        before = dict(self.compiled.trace_ms)
        for b in check_buckets(buckets) if buckets is not None else self.buckets:
            if prefill:
                for L in self.prefill_chunks:
                    self.compiled.step(self.compiled.new_caches(b), mx.zeros((b, L), dtype=mx.int32))
            caches = self.compiled.new_caches(b)
            out = self.compiled.step(caches, mx.zeros((b, 1), dtype=mx.int32))
            mx.eval(out.tokens, [c.state for c in caches])
        return {k: v for k, v in self.compiled.trace_ms.items() if k not in before}
