"""Prefill: newcomers' prompts through compiled window steps, into fresh caches.

A prompt (all but its last token, which the first decode step consumes, as in
mlx-lm) is cut into static windows chosen by the scheduler; each window is a
compiled step, evaluated before the next is built, so an interrupt lands
within one window and a long prompt never becomes one huge graph.

The ``n`` choices of one prompt (a *forked* group) are prefilled once: the
first choice's row is prefilled alone, then copied into ``n`` rows.
"""

from __future__ import annotations

import time
from typing import Callable, List, Sequence

import mlx.core as mx
import numpy as np

from ..caches.batch import StaticKVCache
from .requests import EngineStats, Request
from .step import CompiledModel, bucket_for


def prefill_windows(n: int, chunks: Sequence[int]) -> List[int]:
    """Window lengths covering ``n`` tokens: greedy largest of ``chunks``
    (sorted), a short tail padded to the smallest."""
    out = []
    for c in reversed(chunks):
        while n >= c:
            out.append(c)
            n -= c
    if n:
        out.append(chunks[0])
    return out


def forked(reqs: Sequence[Request]) -> bool:
    """Whether ``reqs`` are choices of one prompt (prefilled once, then copied)."""
    return len(reqs) > 1 and reqs[0].family is not None and all(r.family == reqs[0].family for r in reqs)


def fork_rows(caches: List[StaticKVCache], n: int, width: int) -> List[StaticKVCache]:
    """Row 0 of ``caches`` copied into ``n`` rows of bucket ``width``, in place."""
    for c in caches:
        c.filter([0] * n, width=width)
    return caches


def prefill(compiled: CompiledModel, reqs: Sequence[Request], buckets: Sequence[int],
            windows: Callable[[int], List[int]], stats: EngineStats) -> List[StaticKVCache]:
    """Caches (the bucket of ``buckets`` that holds ``reqs``) of ``reqs``
    holding all but their last prompt token, after any context in their
    starting serial caches; a forked group's prompt is prefilled once."""
    t0 = time.perf_counter()
    lead = list(reqs[:1]) if forked(reqs) else list(reqs)
    caches = start_caches(compiled, lead, bucket_for(len(lead), buckets))
    stats.prefill_tokens += feed(compiled, caches, [r.prompt[:-1] for r in lead], windows)
    if len(lead) < len(reqs):
        fork_rows(caches, len(reqs), bucket_for(len(reqs), buckets))
    stats.prefill_s += time.perf_counter() - t0
    return caches


def feed(compiled: CompiledModel, caches: List[StaticKVCache], seqs: Sequence[Sequence[int]],
         windows: Callable[[int], List[int]]) -> int:
    """Write ``seqs[r]`` (ragged, possibly empty) after each live row's tokens,
    through compiled window steps of the lengths ``windows`` picks (right-padded
    to them); returns the tokens fed."""
    for _ in feed_windows(compiled, caches, seqs, windows):
        pass
    return sum(len(s) for s in seqs)


def start_caches(compiled: CompiledModel, reqs: Sequence[Request], width: int) -> List[StaticKVCache]:
    """Fresh caches (bucket ``width``) for ``reqs``, or the continuation of a
    request's starting serial mlx-lm caches (one request per group)."""
    if reqs[0].cache is not None:
        # one row, padded to the bucket only when prompt tokens must go through
        # window steps of that width: a long serial cache padded to a bucket of
        # 8 holds 8 rows' memory (SmolLM2, 8 rows of 1024 positions joining
        # one by one: 4.5 GB at the peak for a 0.42 GB batch)
        caches = compiled.layout.from_serial(reqs[0].cache, 1, compiled.capacities)
        if width > 1 and len(reqs[0].prompt) > 1:
            for c in caches:
                c.filter([0], width=width)
        return caches
    return compiled.new_caches(width, rows=len(reqs))


def feed_windows(compiled: CompiledModel, caches: List[StaticKVCache], seqs: Sequence[Sequence[int]],
                 windows: Callable[[int], List[int]]):
    """:func:`feed`, one window at a time: a generator that yields each
    window's length before running it (resumed: runs the window step and
    evaluates it; after the last, the caches' finalize), so that its caller
    may run other steps in between and knows what the next window costs."""
    lengths = [len(s) for s in seqs]
    top = max(lengths, default=0)
    if top == 0:
        return
    plan = windows(top)
    padded = sum(plan)
    tokens = np.zeros((caches[0].width, padded), dtype=np.int32)  # [Bk, padded] right-padded rows
    for i, s in enumerate(seqs):
        tokens[i, : lengths[i]] = s
    for c in caches:
        c.prepare(lengths=lengths, right_padding=[padded - n for n in lengths])
    done = 0
    for L in plan:
        yield L
        compiled.step(caches, mx.array(tokens[:, done : done + L]))
        mx.eval([c.state for c in caches])
        done += L
    for c in caches:
        c.finalize()
    mx.eval([c.state for c in caches])
