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
from dataclasses import replace
from typing import Callable, Iterable, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..backend import threads
from ..caches import DEFAULT_CAPACITIES
from .batch import RunningBatch
from .drafters import make_drafter
from .options import (
    DEFAULT_BUCKETS, DEFAULT_DRAFT_TOKENS, DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_CHUNKS, DEFAULT_PREFILL_STEP_TOKENS,
    DEFAULT_KV_GROUP_SIZE, DEFAULT_SPEC_POLICY, PENALTY_CONTEXT, EngineOptions, OptionError,
    check_buckets, check_capacities, check_engine_options, check_max_tokens, check_token_ids,
)
from .admission import Admission
from .prefix_cache import PrefixCache, PrefixReuse
from .requests import EngineSnapshot, EngineStats, Request, TokenEvent
from .sampling import GREEDY, SamplingParams
from .scheduler import Scheduler
from .speculator import Speculator
from .step import CompiledModel, bucket_for

RetireHook = Callable[[Request, list, List[int]], None]


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
            (default on GPUs). On the CPU each newcomer is prefilled alone (no
            padding waste) and all are joined at once: prefill there is bound
            by arithmetic, about as many tokens a second at every window
            size, and a padded batch of a burst made every newcomer wait for
            the whole batch (``benchmarks/burst.py --batched-prefill on``:
            more tokens a second and a shorter p99, a later p50).
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
            ``add(cache=...)``).
        rng: draws the seeds of unseeded requests (see :class:`Scheduler`).
        prefill_step_tokens: with rows running, newcomers' prompts go in
            windows of at most this many tokens together per step (a
            window's every row counted), between the running rows' decode
            steps (:mod:`.admission`); 0: prefilled whole before decoding goes on.
        prefix_cache: a :class:`PrefixCache` the engine looks every new
            prompt up in (``add`` without ``cache=``: a hit continues from its
            caches) and stores every retiring row in.
        kv_bits, kv_group_size, kv_dtype: how the caches store keys and
            values (mlx-lm's names): ``kv_bits`` 4 or 8 quantizes them in
            groups of ``kv_group_size`` (mlx-lm's ``QuantizedKVCache``
            layout); ``kv_dtype`` "float16"/"bfloat16" halves them; neither:
            as the model computes them.

    Options are checked by :func:`~mlx_tracer.runtime.options.check_engine_options`
    (:class:`~mlx_tracer.runtime.options.OptionError` names the bad one);
    :meth:`from_options` takes options checked already.
    """

    def __init__(
        self,
        model,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        prefill_chunks: Sequence[int] = DEFAULT_PREFILL_CHUNKS,
        capacities: Sequence[int] = DEFAULT_CAPACITIES,
        batched_prefill: Optional[bool] = None,
        speculative=None,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        spec_policy: str = DEFAULT_SPEC_POLICY,
        on_retire: Optional[RetireHook] = None,
        rng: Optional[np.random.Generator] = None,
        prefix_cache: Optional[PrefixCache] = None,
        prefill_step_tokens: int = DEFAULT_PREFILL_STEP_TOKENS,
        kv_bits: Optional[int] = None,
        kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
        kv_dtype: Optional[str] = None,
    ):
        # checked before the probe forward: bad input fails fast
        options = check_engine_options(buckets, prefill_chunks, speculative, draft_tokens, spec_policy,
                                       prefill_step_tokens=prefill_step_tokens, kv_bits=kv_bits,
                                       kv_group_size=kv_group_size, kv_dtype=kv_dtype)
        self._build(model, options, speculative, capacities, batched_prefill, on_retire, rng, prefix_cache)

    @classmethod
    def from_options(cls, model, options: EngineOptions, speculative=None, capacities: Sequence[int] = DEFAULT_CAPACITIES,
                     batched_prefill: Optional[bool] = None, on_retire: Optional[RetireHook] = None,
                     rng: Optional[np.random.Generator] = None, prefix_cache: Optional[PrefixCache] = None) -> "Engine":
        """An engine on options checked already (a Generator checks them before its model loads)."""
        engine = cls.__new__(cls)
        engine._build(model, options, speculative, capacities, batched_prefill, on_retire, rng, prefix_cache)
        return engine

    def _build(self, model, options: EngineOptions, speculative, capacities, batched_prefill, on_retire, rng, prefix_cache):
        if isinstance(model, CompiledModel) and options.kv is not None and options.kv != model.kv:
            raise OptionError("kv_bits", f"the CompiledModel stores K/V as {model.kv.describe()}, the options ask for "
                                         f"{options.kv.describe()}: pass kv=... to CompiledModel, or the model itself")
        self.compiled = model if isinstance(model, CompiledModel) else CompiledModel(model, check_capacities(capacities),
                                                                                    kv=options.kv)
        drafter = make_drafter(speculative, self.compiled.vocab_size, options.buckets) if options.draft_tokens else None
        batched = mx.default_device() == mx.gpu if batched_prefill is None else batched_prefill
        self.scheduler = Scheduler(options.buckets, options.prefill_chunks, self.compiled.vocab_size,
                                   self.compiled.max_positions, batched, self.compiled.context_length, rng=rng,
                                   lookahead=options.draft_tokens)
        self.speculator = (Speculator(drafter, options.draft_tokens, options.spec_policy,
                                      max_rows=self.compiled.verify_rows) if drafter else None)
        self.on_retire = on_retire
        self.prefixes = PrefixReuse(prefix_cache) if prefix_cache is not None else None
        self.batch = RunningBatch(self.compiled, options.buckets, EngineStats())
        self.admission = Admission(self.compiled, self.scheduler, self.batch, options.prefill_step_tokens)

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
    def max_context(self) -> Optional[int]:
        """Positions a request can reach (prompt + generation; None: no limit):
        the model's context length or the largest capacity, the smaller."""
        limits = [n for n in (self.compiled.context_length, self.max_positions) if n]
        return min(limits) if limits else None

    @property
    def stats(self) -> EngineStats:
        return self.batch.stats

    def reset_stats(self) -> EngineStats:
        """Start a new measurement: fresh counters from now on (returns them)."""
        self.batch.stats = EngineStats()
        return self.batch.stats

    @property
    def prefix_cache(self) -> Optional[PrefixCache]:
        return self.prefixes.cache if self.prefixes is not None else None

    def snapshot(self) -> EngineSnapshot:
        """A copy of what the engine looks like now (traces, batch, queue, stats, prefix cache)."""
        return EngineSnapshot(
            traces=dict(self.compiled.traces), bucket=self.batch.width, live_rows=len(self.batch.rows),
            queued=len(self.scheduler.queue), stats=replace(self.batch.stats),
            prefix_cache=self.prefix_cache.snapshot() if self.prefixes is not None else None,
        )

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
        max_tokens: int = DEFAULT_MAX_TOKENS,
        sampling: SamplingParams = GREEDY,
        stop_ids: Iterable[int] = (),
        cache: Optional[Sequence] = None,
    ) -> int:
        """Queue a request; returns its uid. Validates before touching any state.

        ``cache``: optional serial mlx-lm caches (one per layer, as from
        ``make_prompt_cache`` after a forward) holding context that precedes
        ``prompt``; the request continues from them instead of prefilling it.
        Without them, an engine with a prefix cache continues from the
        longest cached prefix of ``prompt`` (see :meth:`cached_tokens`).
        The penalties of ``sampling`` count the tokens of ``prompt`` (all of
        them, also those a prefix cache serves), not those of ``cache``.
        """
        return self.add_choices(prompt, 1, max_tokens, sampling, stop_ids, cache)[0]

    def add_choices(
        self,
        prompt: Sequence[int],
        n: int,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        sampling: SamplingParams = GREEDY,
        stop_ids: Iterable[int] = (),
        cache: Optional[Sequence] = None,
    ) -> List[int]:
        """Queue ``n`` completions of one prompt (as :meth:`add`); returns their
        uids. They join the batch together (``n`` must fit the largest bucket),
        from one prefill: the prompt's row is prefilled once and copied. Choice
        ``i`` samples with seed ``sampling.seed + i`` (when given)."""
        if cache or self.prefixes is None:
            context = self.compiled.layout.check_serial(cache) if cache else 0
            prompt = check_token_ids(prompt, self.vocab_size)
            return [r.uid for r in self.scheduler.enqueue_choices(prompt, n, max_tokens, sampling, stop_ids, cache, context)]
        prompt = check_token_ids(prompt, self.vocab_size)  # before the lookup
        hit = self.prefixes.lookup(prompt)
        try:
            reqs = self.scheduler.enqueue_choices(prompt[hit.tokens:] if hit else prompt, n, max_tokens, sampling,
                                                  stop_ids, hit.caches if hit else None,
                                                  self.compiled.layout.check_serial(hit.caches) if hit else 0)
        except ValueError:  # an OptionError, or caches check_serial refuses
            if hit is None:
                raise
            hit, reqs = None, self.scheduler.enqueue_choices(prompt, n, max_tokens, sampling, stop_ids)  # never depend on the cache
        for req in reqs:
            if hit:
                req.history = prompt[: hit.tokens][-PENALTY_CONTEXT:]  # the penalties count the whole prompt
            self.prefixes.started(req.uid, prompt, hit)
        return [r.uid for r in reqs]

    def check_room(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise the ``OptionError`` :meth:`add` would raise for a prompt of
        ``prompt_tokens`` tokens and ``max_tokens`` that cannot fit a row
        (the model's context length, the largest capacity); queues nothing."""
        self.scheduler.check_room(prompt_tokens, check_max_tokens(max_tokens))

    def cached_tokens(self, uid: int) -> int:
        """Prompt tokens of a queued or running request served from the prefix cache."""
        return self.prefixes.cached(uid) if self.prefixes is not None else 0

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
        are admitted, and while requests wait to join it is not refilled (one
        decode step a step; see below); rows that finish at step t are
        filtered out of step t+1.
        """
        events = self._drop_cancelled() + self._retire()
        if self.speculator is not None:
            return events + self._speculative_step()
        # where the BLAS thread count follows the load, drain every RECHECK_STEPS steps to ask again
        follows = threads.follows_load()
        recheck = follows and self.stats.steps % threads.RECHECK_STEPS == threads.RECHECK_STEPS - 1
        self.batch.make_ready(self._width_soon())
        was_done = self.admission.job is not None and self.admission.job.done
        self.admission.interleave()  # one window of newcomers' prompts beside the running rows
        windows_now = self.admission.job is not None and not was_done
        if not self.batch.pipeline:
            if follows and self.stats.steps and self.stats.steps % threads.RECHECK_STEPS == 0:  # (admit() asks too)
                threads.apply()  # drained: a safe point to change BLAS threads
            # a job still prefilling goes on at one budget of windows a step, whatever
            # drained; one whose last windows ran in this step joins at the next (a
            # step with a budget of prefill and a join in it stalled the running rows
            # for both)
            if self.admission.ready() and not (windows_now and self.batch.rows):
                self.admit()
            if not self.batch.rows:
                return events
            self.batch.dispatch()
        # a second step in flight (pipelined: the host builds step t+1 while step t
        # computes) only while no request waits to join: a dispatch returns when
        # its step is nearly done (MLX bounds the tasks in flight), so refilling
        # a drained pipeline costs a step of two decode steps, and during a
        # burst every join drains it (a running stream's gap was two decode
        # steps at every join, instead of one)
        if (len(self.batch.pipeline) < 2 and self.batch.needs_more() and not recheck
                and not self.admission.must_drain() and not self._admission_waits()):
            self.batch.dispatch()
        events += self.batch.read()
        return events + self._retire()

    def _speculative_step(self) -> List[TokenEvent]:
        """A verify step when the rows' drafts are expected to pay, else plain
        decode steps, pipelined as without speculation for as long as the
        speculator judges (on the rows' tokens read so far, one step behind)
        that a verify step could not pay; the pipeline then drains, and the
        next step drafts on every token. Under the ``always`` policy plain
        steps are not pipelined (every token is looked at for drafts)."""
        spec, batch = self.speculator, self.batch
        declined = False
        if not batch.pipeline:
            self.admit()
            if not batch.rows:
                return []
            width = batch.width
            drafts = spec.drafts(batch.rows, width)
            if drafts is not None:
                traces, t0 = self.compiled.trace_count, time.perf_counter()
                events = batch.verify(drafts, spec.window - 1, spec)
                if self.compiled.trace_count == traces:  # a step that traced timed its trace, not the step
                    spec.observe("verify", width, time.perf_counter() - t0, spec.window)
                return events + self._retire()
            declined = True
        width = batch.width
        traces = self.compiled.trace_count
        if not batch.pipeline:
            batch.dispatch()
        plain = declined and spec.cheap  # a cheap drafter's drafts were just judged on these very tokens
        if (spec.policy == "auto" and len(batch.pipeline) < 2 and batch.needs_more() and not self._admission_waits()
                and (plain or not spec.may_pay(batch.rows, width))):
            batch.dispatch()  # pipelined: fed by the step in flight, on the device
        events = batch.read()
        spec.plain_step(batch.rows)
        if self.compiled.trace_count == traces:  # the step read, and the one dispatched beside it, did not trace
            spec.observe("decode", width, batch.last_step_s)
        return events + self._retire()

    def _width_soon(self) -> Optional[int]:
        """The bucket the running batch widens to next, if requests waiting
        to join (queued or prefilling) will widen it; else None."""
        rows, width = len(self.batch.rows), self.batch.width
        if not rows or width >= self.scheduler.buckets[-1]:
            return None
        if rows + len(self.scheduler.queue) <= width:  # (a prefill job's requests are queued until they join)
            return None
        return bucket_for(width + 1, self.scheduler.buckets)

    def _admission_waits(self) -> bool:
        """Whether requests wait to be admitted (admission needs the pipeline drained)."""
        return self.admission.job is not None or bool(self.scheduler.admission(len(self.batch.rows)))

    def run(self) -> Iterable[TokenEvent]:
        while self.has_work():
            yield from self.step()

    def admit(self):
        """Prefill queued requests and join them into the running batch now
        (``step`` does this itself; call it to keep admission out of a timing).
        Needs an empty pipeline (between steps)."""
        if self.batch.pipeline:
            raise RuntimeError("admit() needs the decode pipeline drained: call it between steps")
        if self.admission.job is None and not self.scheduler.admission(len(self.batch.rows)):
            return
        if threads.follows_load():
            threads.apply()  # nothing is in flight: a safe point to change BLAS threads
        self.admission.admit()

    def _drop_cancelled(self) -> List[TokenEvent]:
        events = self.scheduler.drop_cancelled()
        if self.prefixes is not None:
            for ev in events:
                self.prefixes.forget(ev.uid)
        return events

    def _retire(self) -> List[TokenEvent]:
        events = [r.cancelled() for r in self.batch.rows if r.cancel_requested and not r.finished]
        keep = [i for i, r in enumerate(self.batch.rows) if not r.finished]
        if len(keep) < len(self.batch.rows):
            for i, r in enumerate(self.batch.rows):
                if r.finished:
                    self._retired(i, r)
            self.batch.keep(keep)
        return events

    def _retired(self, i: int, r: Request):
        """Row ``i`` (request ``r``) leaves: hand its caches to the hook and the
        prefix cache (each its own copies: the hook may write them)."""
        self.scheduler.finish(r)
        if self.speculator is not None:
            self.speculator.forget(r.uid)
        held = int(self.batch.caches[0].rows.offsets[i]) - r.context_len
        if self.on_retire is not None:
            self.on_retire(r, [c.extract(i) for c in self.batch.caches], r.context[:held])
        if self.prefixes is not None:
            self.prefixes.retired(r.uid, r.context_len, [c.extract(i) for c in self.batch.caches], r.context[:held])

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
