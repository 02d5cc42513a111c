"""The compiled step: one forward of an mlx-lm model over static caches.

``CompiledModel`` wraps a model. Its step is a pure function of arrays::

    tokens [Bk, L] int32, rope offsets [Bk] int32,
    per cache family: mask geometry + write positions (small int32 arrays),
    per layer: keys/values buffers [Bk, H, S, D],
    sampler state (per-row settings and PRNG keys)
      -> next tokens [Bk], their log-probabilities [Bk], new buffers, new keys

traced by ``mx.compile`` once per (step kind, bucket width Bk, step length L,
capacity of the full layers, sampler kind, outputs) and replayed for every
later step with those shapes. Model weights are implicit inputs of the
compiled function (``inputs=model.state``), so loading other weights of the
same shapes reuses the trace with the new values, and other shapes retrace.

Two step kinds: **decode** (L = 1) and **window** (L > 1: prefill chunks,
prefill tails padded to the chunk, speculative verify windows).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..adapters.contract import LayerLayout, allocate_caches, probe_layout
from ..adapters.traced import FamilyMasks, TracedCache
from ..caches import DEFAULT_CAPACITIES, FullCache, RingCache
from ..caches.batch import StaticKVCache
from ..caches.masks import MaskGeometry
from .sampling import sample

DEFAULT_BUCKETS = (1, 2, 4, 8)


@dataclass(frozen=True)
class TraceKey:
    """What one trace of the step is specialised to."""

    kind: str  # "decode" | "window"
    width: int  # bucket Bk
    length: int  # step length L
    capacity: Optional[int]  # capacity bucket of the full layers (None: no full layer)
    sampler: str = "greedy"  # "greedy" | "sample" | "none"
    logits: bool = False  # the step also returns raw logits


class NewTraceError(AssertionError):
    """Raised by ``CompiledModel.no_new_traces`` when a region traced."""


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """Smallest batch-width bucket holding ``n`` live rows."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"bucket {buckets[-1]} exceeded: {n} live rows; pass buckets=(..., {1 << (n - 1).bit_length()})")


class CompiledModel:
    """An mlx-lm model whose forward over static caches is compiled once per shape.

    Args:
        model: an mlx-lm language model following the adapter contract.
        capacities: capacity buckets of the full-attention caches.
    """

    def __init__(self, model, capacities: Sequence[int] = DEFAULT_CAPACITIES):
        self.model = model
        self.capacities = tuple(capacities)
        self.layouts, self.vocab_size = probe_layout(model, self.capacities)
        self.traces: Counter = Counter()
        self.trace_ms: Dict[TraceKey, float] = {}
        self._specs = [FullCache() if l.window is None else RingCache(l.window) for l in self.layouts]
        families = sorted({l.family for l in self.layouts}, key=str)
        self.families: List[Tuple[str, Optional[int]]] = families
        self._family_of = [families.index(l.family) for l in self.layouts]
        self._first_layer = [self._family_of.index(f) for f in range(len(families))]
        self._fns: Dict[tuple, object] = {}

    # --------------------------------------------------------------- caches
    def new_caches(self, width: int, rows: int = 0, capacity: Optional[int] = None) -> List[StaticKVCache]:
        """Allocated static caches for one batch of bucket ``width`` holding
        ``rows`` empty live rows."""
        return allocate_caches(self.layouts, width, capacity, self.capacities, rows)

    # ---------------------------------------------------------------- traces
    @property
    def trace_count(self) -> int:
        """Traces made so far, all keys together."""
        return sum(self.traces.values())

    @contextlib.contextmanager
    def no_new_traces(self):
        """Assert that the block does not trace (steady state)."""
        before = Counter(self.traces)
        yield
        new = self.traces - before
        if new:
            raise NewTraceError(f"unexpected new traces: {dict(new)}")

    # ------------------------------------------------------------------ step
    def step(
        self,
        caches: List[StaticKVCache],
        tokens: mx.array,
        sampler: Optional[dict] = None,
        return_logits: bool = False,
        last: Optional[mx.array] = None,
        eager: bool = False,
    ) -> dict:
        """Run one compiled step over ``caches`` (one per layer, in lockstep).

        ``tokens [Bk, L]``; ``sampler``: arrays from ``sampler_inputs`` (None:
        greedy). A decode returns ``tokens``/``logprobs`` ``[Bk]`` (and
        ``keys``); a window step returns nothing unless ``return_logits``
        (then ``logits [Bk, V]`` at each row's ``last`` query index). The
        caches adopt the new buffers and advance. ``eager=True`` returns the
        uncompiled, unevaluated outputs and leaves the caches as they were
        (to inspect the graph).
        """
        if len(caches) != len(self.layouts):
            raise ValueError(f"expected {len(self.layouts)} layer caches, got {len(caches)}")
        tokens = mx.array(tokens, dtype=mx.int32) if not isinstance(tokens, mx.array) else tokens.astype(mx.int32)
        if tokens.ndim != 2 or tokens.shape[0] != caches[0].width:
            raise ValueError(f"tokens must be [bucket width {caches[0].width}, L], got {tuple(tokens.shape)}")
        L = tokens.shape[1]
        reps = [caches[i] for i in self._first_layer]
        decode = reps[0].is_decode(L)
        for c in caches:
            if isinstance(c, FullCache):
                c.reserve(L)
        capacity = next((c.capacity for c in reps if isinstance(c, FullCache)), None)
        geoms, inputs = [], []
        for rep in reps:
            g = rep.geometry(L)
            geoms.append({"col_times": g.col_times, "query_times": g.query_times, "own_cols": g.own_cols, "first_valid": g.first_valid, "live": g.live})
            inputs.append(rep.step_inputs(L))
        kind = "decode" if decode else "window"
        sampler_kind = ("greedy" if sampler is None else "sample") if decode else "none"
        key = TraceKey(kind, tokens.shape[0], L, capacity, sampler_kind, return_logits)
        kv = [(c.keys, c.values) for c in caches]
        extra = {}
        if sampler is not None:
            extra["sampler"] = sampler
        if return_logits and not decode:
            extra["last"] = mx.full((tokens.shape[0],), L - 1, dtype=mx.int32) if last is None else last
        args = (tokens, reps[0].offset, geoms, inputs, kv, extra)
        if eager:
            return self._forward(kind, sampler_kind, return_logits, *args)
        n_before = self.traces[key]
        t0 = time.perf_counter()
        out = self._compiled(kind, sampler_kind, return_logits)(*args)
        if self.traces[key] != n_before:
            self.trace_ms[key] = (time.perf_counter() - t0) * 1e3
        del kv
        for c, (k, v) in zip(caches, out.pop("kv")):
            c.adopt(k, v)
            c.advance(L)
        return out

    def export_decode_graph(self, path: str, width: int = 1) -> Counter:
        """Write the decode step's graph (bucket ``width``) as DOT; returns op counts."""
        caches = self.new_caches(width, rows=width)
        out = self.step(caches, mx.zeros((width, 1), dtype=mx.int32), eager=True)
        mx.export_to_dot(path, out["tokens"], *[a for kv in out["kv"] for a in kv])
        with open(path) as f:
            return Counter(m.group(1) for m in re.finditer(r'label ="([A-Za-z_]+)', f.read()))

    def _compiled(self, kind: str, sampler_kind: str, logits: bool):
        sig = (kind, sampler_kind, logits)
        if sig not in self._fns:

            def forward(tokens, offsets, geoms, inputs, kv, extra):
                self._count(kind, sampler_kind, logits, tokens, kv)  # runs only while tracing
                return self._forward(kind, sampler_kind, logits, tokens, offsets, geoms, inputs, kv, extra)

            self._fns[sig] = mx.compile(forward, inputs=self.model.state)
        return self._fns[sig]

    def _count(self, kind, sampler_kind, want_logits, tokens, kv):
        Bk, L = tokens.shape
        capacity = next((kv[i][0].shape[2] for i in self._first_layer if self.families[self._family_of[i]][0] == "full"), None)
        self.traces[TraceKey(kind, Bk, L, capacity, sampler_kind, want_logits)] += 1

    def _forward(self, kind, sampler_kind, want_logits, tokens, offsets, geoms, inputs, kv, extra):
        Bk, L = tokens.shape
        masks = [
            FamilyMasks(MaskGeometry(window=None if fam[1] is None else fam[1], **g), L)
            for fam, g in zip(self.families, geoms)
        ]
        layer_caches = [
            TracedCache(self._specs[i], k, v, offsets, inputs[self._family_of[i]], masks[self._family_of[i]], i)
            for i, (k, v) in enumerate(kv)
        ]
        logits = self.model(tokens, cache=layer_caches)  # [Bk, L, V]
        out = {"kv": [(c.keys, c.values) for c in layer_caches]}
        if kind == "decode":
            last = logits[:, -1, :]  # [Bk, V]
            logprobs = last - mx.logsumexp(last, axis=-1, keepdims=True)
            if sampler_kind == "greedy":
                toks = mx.argmax(logprobs, axis=-1).astype(mx.int32)
            else:
                toks, out["keys"] = sample(logprobs, extra["sampler"])
            out["tokens"] = toks
            out["logprobs"] = mx.take_along_axis(logprobs, toks[:, None], axis=-1)[:, 0]
            if want_logits:
                out["logits"] = logits[:, -1, :]
        elif want_logits:
            idx = extra["last"][:, None, None]
            out["logits"] = mx.take_along_axis(logits, idx, axis=1)[:, 0, :]  # [Bk, V]
        return out
