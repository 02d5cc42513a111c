"""The running batch: the rows that decode together, their caches and the step pipeline.

Decode is pipelined as in mlx-lm: step t+1 is dispatched (fed by step t's
tokens, still on the device) before step t is read back. The pipeline is a
queue of dispatched steps; a step leaves it only once it has been read, so an
interrupt (Ctrl-C) while waiting for a step leaves the batch consistent: the
next read waits for the same step again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..caches.batch import StaticKVCache
from .options import MAX_TOP_LOGPROBS
from .processors import bias_buffer, processor_inputs, window_of
from .requests import EngineStats, Request, TokenEvent
from .sampling import sampler_inputs
from .step import CompiledModel, StepResult, bucket_for


@dataclass
class InflightStep:
    """A dispatched decode step that has not been read yet."""

    result: StepResult
    host_s: float  # graph build + dispatch
    t0: float  # when dispatch began


READY_PER_STEP = 4  # caches a step that start building a wider bucket's buffers (make_ready)


class RunningBatch:
    """Rows in one batch-width bucket, decoding in lockstep (see module docstring)."""

    def __init__(self, compiled: CompiledModel, buckets: Sequence[int], stats: EngineStats):
        self.compiled = compiled
        self.buckets = tuple(buckets)
        self.stats = stats
        self.rows: List[Request] = []
        self.caches: Optional[List[StaticKVCache]] = None
        self.pipeline: Deque[InflightStep] = deque()
        self._last_read = 0.0
        self.last_step_s = 0.0  # wall time the step read last took (after the one read before it)
        self._bias: tuple = (None, None)  # (what it was built for, the [Bk, V] logit-bias buffer)
        # joins and leaves write into free rows / move only the rows that move
        # where they can (False: every row laid out again, as 0.5.1 did)
        self.in_place = True
        self._readying = False  # some caches may hold buffers made ready for a wider bucket (make_ready)

    @property
    def width(self) -> int:
        return self.caches[0].width if self.caches else 0

    # ------------------------------------------------------------ rows
    def make_ready(self, width: Optional[int]) -> None:
        """Newcomers will widen the batch to ``width`` rows: a few more caches
        (``READY_PER_STEP``) start building buffers of that width, so that the
        join copies its rows into memory already touched (caches.spare); None:
        no widening in sight, drop them."""
        if not self.caches or (width is None and not self._readying):
            return
        self._readying = width is not None
        started = 0
        for c in self.caches:
            started += c.make_ready(width)
            if started == READY_PER_STEP:
                return

    def join(self, reqs: List[Request], prefilled: List[List[StaticKVCache]], width: Optional[int] = None):
        """Add ``reqs`` (with their prefilled caches, in order) to the batch.
        Only between steps: the pipeline must be empty. ``width``: a bucket
        to make the batch at least (more rows are about to join). The
        layers' joins are evaluated a few MB at a time (LayerJoins); into a new
        batch, the prefilled caches are taken over: each entry of the lists
        in ``prefilled`` is released (None) once its layer is joined, so
        that the admission holds a group's copy twice, not every layer's."""
        assert not self.pipeline, "join while a step is in flight"
        width = max(bucket_for(len(self.rows) + len(reqs), self.buckets), width or 0)
        joins = LayerJoins()
        if self.caches is None:
            # one group prefilled at this very bucket becomes the batch as it is: its
            # caches are fresh buffers of their own (a prefill's, or a serial cache's
            # copy), so a join would only copy them again (a lone request's first
            # token on SmolLM2 with the prefix cache's hit: ~27 -> ~20 ms)
            adopt = len(prefilled) == 1 and all(c.width == width for c in prefilled[0])
            caches = []
            for i, layer in enumerate(zip(*prefilled)):
                caches.append(joins.add(layer[0] if adopt else type(layer[0]).join(layer, width=width)))
                del layer  # (the tuple holds the layer's prefilled caches too)
                for p in prefilled:
                    p[i] = None
        else:
            # Newcomers whose tokens fit the running timeline are written into
            # free rows (StaticKVCache.place): the running rows' K/V are not
            # copied (in the bucket they are in) or copied once (into a wider
            # one). Else every row is laid out again. Each cache decides on its
            # row book alone, so the caches of one family decide alike.
            layers = list(zip(self.caches, zip(*prefilled)))
            hits = sum(c.spare_hits for c in self.caches)
            placed = [c.placement(new, width=width) if self.in_place else None for c, new in layers]
            caches = [c if p is not None else joins.add(type(c).join([c, *new], width=width))
                      for (c, new), p in zip(layers, placed)]
            for c, p in zip(self.caches, placed):  # nothing changed before this (lazy arrays only)
                if p is not None:
                    c.adopt_placement(p)
            self.stats.joins += 1
            self.stats.joins_in_place += all(p is not None for p in placed)
            self.stats.joins_into_ready += sum(c.spare_hits for c in self.caches) > hits
        self.caches, self.rows = caches, self.rows + list(reqs)
        mx.eval([c.state for c in caches])  # the join's copies belong to admission, not to decode

    def keep(self, keep: List[int]):
        """Keep only rows ``keep``, moving to the smallest bucket that holds
        them; steps in flight drop the other rows too. Rows leaving in
        ascending ``keep``: the last rows take the places of those that left
        (see :func:`_fill_holes`), in this bucket or a narrower one (whose
        buffers are then views of the first rows); else (or with
        ``in_place`` off) every row is copied, in order."""
        if not keep:
            self.rows, self.caches = [], None
            self.pipeline.clear()
            return
        width = bucket_for(len(keep), self.buckets)
        if self.in_place and width <= self.width:
            # the rows that stay where they are are not copied: the last rows
            # move into the rows that left (their order changes), and each
            # cache moves only those (StaticKVCache.move_rows); a narrower
            # bucket is then the buffers' first rows (StaticKVCache.narrow:
            # views, no copy; a copy of every row cost 0.1-0.2 s at 16-20 rows)
            keep = _fill_holes(keep)
            for c in self.caches:
                if not c.move_rows(keep):
                    c.filter(keep, width=width)
                elif not c.narrow(width):  # (cannot fail after move_rows: its rows are 0 .. len(keep)-1)
                    c.filter(list(range(len(keep))), width=width)
        else:
            for c in self.caches:
                c.filter(keep, width=width)
        self.rows = [self.rows[i] for i in keep]
        idx = mx.array(keep, dtype=mx.int32)
        for step in self.pipeline:
            r = step.result
            for name in r.ROW_ARRAYS:
                if getattr(r, name) is not None:
                    setattr(r, name, _rows(getattr(r, name), idx, width))

    # ------------------------------------------------- per-row step inputs
    def _processors(self, width: int, windows=None) -> Optional[dict]:
        """The rows' logits-processor arrays (None when no row has a penalty or
        a bias); ``windows``: the newest step's (on the device), else the rows' own."""
        if not any(r.sampling.processes_logits for r in self.rows):
            return None
        params = [r.sampling for r in self.rows]
        built_for = (width, tuple(p.logit_bias for p in params))
        if self._bias[0] != built_for:  # rebuilt when the rows or their biases change, not every step
            self._bias = (built_for, bias_buffer(params, width, self.compiled.vocab_size))
        if windows is None:
            windows = [window_of(r.penalty_context) for r in self.rows]
        return processor_inputs(params, windows, self._bias[1], width)

    def _top(self) -> int:
        """Alternatives the step returns: the most any row asks for, as one static size."""
        return MAX_TOP_LOGPROBS if any(r.sampling.top_logprobs for r in self.rows) else 0

    # ---------------------------------------------------------- decode
    def dispatch(self):
        """Build and start one decode step. Its inputs come from the host when
        nothing is in flight, else from the newest step's outputs on the device."""
        t0 = time.perf_counter()
        width = self.width
        greedy = all(r.sampling.greedy for r in self.rows)
        windows = None
        if not self.pipeline:
            inputs = np.zeros((width, 1), dtype=np.int32)
            inputs[: len(self.rows), 0] = [r.next_input for r in self.rows]
            inputs = mx.array(inputs)
            keys = None if greedy else [r.key for r in self.rows]
        else:
            prev = self.pipeline[-1].result
            inputs, keys, windows = prev.tokens[:, None], prev.keys, prev.window
        sampler = None if greedy else sampler_inputs([r.sampling for r in self.rows], keys, width)
        result = self.compiled.step(self.caches, inputs, sampler, processors=self._processors(width, windows),
                                    top=self._top())
        host_s = time.perf_counter() - t0
        # (on the CPU, async_eval waits while MLX's task queue is full: that is not host time)
        mx.async_eval(*result.arrays(), [c.state for c in self.caches])
        self.pipeline.append(InflightStep(result, host_s, t0))

    def read(self) -> List[TokenEvent]:
        """Wait for the oldest step in flight and turn its tokens into events."""
        step = self.pipeline[0]
        tokens = step.result.tokens.tolist()  # waits for the step
        logprobs = step.result.logprobs.tolist()
        keys = None if step.result.keys is None else np.array(step.result.keys)
        top = _top_lists(step.result.top_tokens, step.result.top_logprobs)
        self.pipeline.popleft()
        events = []
        for i, r in enumerate(self.rows):
            if keys is not None:
                r.key = keys[i]
            alts = top[i][: r.sampling.top_logprobs] if top and r.sampling.top_logprobs else None
            events.append(r.accept(int(tokens[i]), float(logprobs[i]), alts))
        now = time.perf_counter()
        self.stats.steps += 1
        self.stats.decode_tokens += len(self.rows)
        self.stats.host_s += step.host_s
        self.last_step_s = now - max(step.t0, self._last_read)  # this step's share of the wall time
        self.stats.decode_s += self.last_step_s
        self._last_read = now
        return events

    def verify(self, drafts: List[List[int]], k: int, speculator) -> List[TokenEvent]:
        """One speculative verify step (nothing may be in flight): each row feeds
        its last token and drafts; it keeps what the target accepts plus one
        token of its own. Returns every row's new tokens as events."""
        assert not self.pipeline, "verify while a step is in flight"
        t0 = time.perf_counter()
        width, L = self.width, k + 1
        tokens = np.zeros((width, L), dtype=np.int32)  # [Bk, k+1]: last token, drafts, padding
        ndraft = np.zeros(width, dtype=np.int32)
        for i, (r, d) in enumerate(zip(self.rows, drafts)):
            tokens[i, 0] = r.next_input
            tokens[i, 1 : 1 + len(d)] = d
            ndraft[i] = len(d)
        greedy = all(r.sampling.greedy for r in self.rows)
        sampler = None if greedy else sampler_inputs([r.sampling for r in self.rows], [r.key for r in self.rows], width)
        out = self.compiled.verify(self.caches, mx.array(tokens), ndraft, sampler, processors=self._processors(width),
                                   top=self._top())
        emitted, count, logprobs = np.array(out.tokens), np.array(out.count), np.array(out.logprobs)
        keys = None if out.keys is None else np.array(out.keys)
        top = _top_lists(out.top_tokens, out.top_logprobs)
        events = []
        for i, r in enumerate(self.rows):
            if keys is not None:
                r.key = keys[i]
            speculator.update(r, int(ndraft[i]), int(count[i]) - 1)
            self.stats.drafted += int(ndraft[i])
            self.stats.accepted += int(count[i]) - 1
            for j in range(int(count[i])):
                alts = top[i][j][: r.sampling.top_logprobs] if top and r.sampling.top_logprobs else None
                events.append(r.accept(int(emitted[i, j]), float(logprobs[i, j]), alts))
                if r.finished:
                    break
        now = time.perf_counter()
        self.stats.verify_steps += 1
        self.stats.verify_tokens += len(events)
        self.stats.decode_tokens += len(events)
        self.stats.decode_s += now - max(t0, self._last_read)
        self._last_read = now
        return events

    def needs_more(self) -> bool:
        """Whether some row still needs a token after the steps in flight."""
        ahead = len(self.pipeline)
        return any(len(r.tokens) + ahead < r.max_tokens for r in self.rows)


JOIN_EVAL_BYTES = 4 << 20  # a join's layers are evaluated in groups of about this many bytes of K/V


class LayerJoins:
    """Each layer's join evaluated once the layers joined since the last
    evaluation hold ``JOIN_EVAL_BYTES`` of K/V (RunningBatch.join): the
    copies and format conversions of a long context's join live a group of
    layers at a time, not every layer's at once (admission's peak), and a
    short one is evaluated with the rest of the join, not a layer at a time
    (an evaluation costs ~0.2 ms: one a layer was 7 of the ~30 ms a lone
    request's first step took on SmolLM2's 30 layers)."""

    def __init__(self):
        self.pending: List[StaticKVCache] = []
        self.bytes = 0

    def add(self, cache: StaticKVCache) -> StaticKVCache:
        self.pending.append(cache)
        self.bytes += cache.nbytes
        if self.bytes >= JOIN_EVAL_BYTES:
            mx.eval([c.state for c in self.pending])
            self.pending, self.bytes = [], 0
        return cache


def _fill_holes(keep: List[int]) -> List[int]:
    """Rows ``keep`` (ascending) reordered so that as many as can stay where
    they are: the rows beyond ``len(keep)`` fill, in order, the places of rows
    that left. Any other order is returned as it is."""
    m = len(keep)
    if any(a >= b for a, b in zip(keep, keep[1:])):
        return list(keep)
    kept = set(keep)
    order = list(range(m))
    for j, i in zip([j for j in range(m) if j not in kept], [i for i in keep if i >= m]):
        order[j] = i
    return order


def _top_lists(ids: Optional[mx.array], lps: Optional[mx.array]):
    """``[..., k]`` alternatives as nested lists of ``(token id, log-probability)``
    pairs, one list per row (and position); None when not asked for."""
    if ids is None:
        return None

    def pairs(a, b):
        return [pairs(x, y) for x, y in zip(a, b)] if isinstance(a[0], list) else list(zip(a, b))

    return pairs(ids.tolist(), lps.tolist())


def _rows(x: mx.array, idx: mx.array, width: int) -> mx.array:
    """Rows ``idx`` of ``x``, zero-padded to ``width`` rows."""
    x = x[idx]
    n = idx.shape[0]
    return mx.pad(x, [(0, width - n)] + [(0, 0)] * (x.ndim - 1)) if width > n else x
