"""Admission: newcomers' prompts prefilled and joined into the running batch.

With no row running, queued requests are prefilled at once and joined (no one
waits on them). With rows running, a prefill would stall every running
stream for its whole length, so it is *interleaved*: a :class:`PrefillJob`
runs windows of at most ``step_tokens`` tokens (all the rows of a window's
bucket counted) per engine step, between the running rows' decode steps, so
a running stream's gap between two tokens grows by about that much prefill,
not by every newcomer's prompt. A job takes the queue's leading prefill
groups (first come, first served) whose prompts fit the budget together —
at least the first: a burst of requests whose prompts the prefix cache
holds joins in one step, not one join per step — and when their prompts are
in, the decode pipeline drains and their rows join at the next step
boundary, and the next job starts. A request cancelled while its job runs
is left out of the join.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

from ..caches.batch import StaticKVCache
from .batch import RunningBatch
from .prefill import feed_windows, fork_rows, forked, prefill, prefill_windows, start_caches
from .requests import Request
from .scheduler import Scheduler
from .step import CompiledModel, bucket_for


def lead_rows(group: Sequence[Request]) -> List[Request]:
    """The rows a group prefills: the choices of one prompt, once."""
    return list(group[:1]) if forked(group) else list(group)


def window_tokens(group: Sequence[Request], buckets: Sequence[int]) -> int:
    """The tokens a group's prefill windows compute, all its bucket's rows
    counted (padding to the windows' lengths aside)."""
    lead = lead_rows(group)
    return bucket_for(len(lead), buckets) * max(len(r.prompt) - 1 for r in lead)


class PrefillJob:
    """Groups of newcomers prefilled in join order, in windows that take at
    most ``step_tokens`` tokens together (a window's every row counted; one
    window at least) per :meth:`advance`."""

    def __init__(self, compiled: CompiledModel, groups: Sequence[Sequence[Request]], buckets: Sequence[int],
                 windows, batch: RunningBatch, step_tokens: int = 0):
        self.groups = [list(g) for g in groups]
        self.caches: List[List[StaticKVCache]] = []
        self.done = False
        self.step_tokens = step_tokens
        self._batch = batch  # its stats are the engine's (reset_stats swaps them)
        self._steps = self._run(compiled, buckets, windows)
        self._next: Optional[int] = None  # the tokens of the window the job runs next, once known

    def _run(self, compiled, buckets, windows):
        """Yields each window's tokens before running it (resumed: runs it)."""
        for g in self.groups:
            lead = lead_rows(g)
            caches = start_caches(compiled, lead, bucket_for(len(lead), buckets))
            for L in feed_windows(compiled, caches, [r.prompt[:-1] for r in lead], windows):
                yield L * caches[0].width
            if len(lead) < len(g):
                fork_rows(caches, len(g), bucket_for(len(g), buckets))
            self.caches.append(caches)
            self._batch.stats.prefill_tokens += sum(len(r.prompt) - 1 for r in lead)

    def advance(self) -> None:
        """The next windows (evaluated) while they fit ``step_tokens``
        together (the first whatever its size); marks the job done after its last."""
        t0 = time.perf_counter()
        spent = 0
        try:
            if self._next is None:
                self._next = next(self._steps)
            while not spent or spent + self._next <= self.step_tokens:
                spent += self._next
                self._next = next(self._steps)
        except StopIteration:
            self.done = True
        self._batch.stats.prefill_s += time.perf_counter() - t0

    def finish(self) -> None:
        while not self.done:
            self.advance()


class Admission:
    """Who joins the running batch, and when (see the module docstring).

    Args:
        step_tokens: the longest window an interleaved prefill runs per
            engine step (the prefill chunks up to it are used); 0: no
            interleaving, newcomers are prefilled whole at admission.
    """

    def __init__(self, compiled: CompiledModel, scheduler: Scheduler, batch: RunningBatch, step_tokens: int):
        self.compiled, self.scheduler, self.batch = compiled, scheduler, batch
        self.step_tokens = step_tokens
        self.job: Optional[PrefillJob] = None

    def interleave(self) -> None:
        """With rows running: start a job for the queued requests there is room
        for, or run one more window of the job in progress."""
        if self.job is None and self.batch.rows and self.step_tokens:
            groups = self._job_groups()
            if groups:
                # a window's tokens, over all the rows of its bucket, within the step's budget
                width = max(bucket_for(len(lead_rows(g)), self.scheduler.buckets) for g in groups)
                chunks = ([c for c in self.scheduler.prefill_chunks if c * width <= self.step_tokens]
                          or [min(self.scheduler.prefill_chunks)])
                self.job = PrefillJob(self.compiled, groups, self.scheduler.buckets,
                                      lambda n: prefill_windows(n, chunks), self.batch, self.step_tokens)
        if self.job is not None and not self.job.done:
            self.job.advance()

    def _job_groups(self) -> List[List[Request]]:
        """The queue's leading groups (first come first) whose prefills fit one
        step's budget together; the first whatever its length."""
        take, spent = [], 0
        for g in self.scheduler.admission(len(self.batch.rows)):
            cost = window_tokens(g, self.scheduler.buckets)
            if take and spent + cost > self.step_tokens:
                break
            take.append(g)
            spent += cost
        return take

    def ready(self) -> bool:
        """Whether :meth:`admit` would join without prefilling more than a
        window: no job in progress, or its prompt is in. (A pipeline that
        drained for another reason — a row about to finish, a thread
        recheck — must not make the job run its remaining windows at once.)"""
        return self.job is None or self.job.done

    def must_drain(self) -> bool:
        """Whether the decode pipeline should drain for a join at the next step."""
        if self.job is not None:
            return self.job.done
        if self.batch.rows and self.step_tokens:
            # queued requests go in through a job that the next step starts
            # beside a step in flight: nothing to drain for yet (draining here,
            # right after a join, made the next step refill the pipeline, two
            # decode steps, on top of the new job's first window)
            return False
        return self.scheduler.must_drain(len(self.batch.rows))

    def admit(self) -> List[Request]:
        """Join what is ready now (needs an empty pipeline): a job's rows
        (finished first if need be), or the queued requests there is room for,
        prefilled at once. Returns the requests that joined."""
        if self.job is not None:
            job, self.job = self.job, None
            job.finish()
            groups, prefilled = job.groups, job.caches
        else:
            groups = self.scheduler.admission(len(self.batch.rows))
            stats = self.batch.stats  # the engine's current stats (reset_stats swaps them)
            if len(groups) > 1 and any(r.cache is not None for g in groups for r in g):
                return self._admit_each(groups, stats)
            prefilled = [prefill(self.compiled, g, self.scheduler.buckets, self.scheduler.prefill_windows, stats)
                         for g in groups]
        new, ready = [], []
        for g, caches in zip(groups, prefilled):
            live = self._live(g, caches)
            if live:
                new += live
                ready.append(caches)
        if new:
            self.batch.join(new, ready)
        return self._admitted(new)

    def _live(self, group: List[Request], caches: List[StaticKVCache]) -> List[Request]:
        """The group's requests not cancelled while it prefilled (the caches keep only their rows)."""
        live = [i for i, r in enumerate(group) if not r.finished]
        if live and len(live) < len(group):
            for c in caches:
                c.filter(live, width=bucket_for(len(live), self.scheduler.buckets))
        return [group[i] for i in live]

    def _admitted(self, new: List[Request]) -> List[Request]:
        if new:
            self.scheduler.admitted(new)
        for r in new:
            r.cache = None  # the caller's serial caches were only read; drop our reference
        return new

    def _admit_each(self, groups: List[List[Request]], stats) -> List[Request]:
        """Groups continuing serial caches (one request each, at its own
        length), each prefilled and joined before the next is started, into a
        batch of the bucket they all need: at most one group's caches live
        beside the batch (SmolLM2, 8 contexts of 1024: the admission's peak
        above the contexts 471 -> 310 MB), the later groups written into its
        free rows where they fit its timeline."""
        width = bucket_for(len(self.batch.rows) + sum(len(g) for g in groups), self.scheduler.buckets)
        new = []
        for g in groups:
            caches = prefill(self.compiled, g, self.scheduler.buckets, self.scheduler.prefill_windows, stats)
            live = self._live(g, caches)
            if live:
                self.batch.join(live, [caches], width=width)
                new += live
            del caches  # not held while the next group prefills
        return self._admitted(new)
