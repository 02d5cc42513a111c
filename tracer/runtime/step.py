"""The compiled step: one forward of an mlx-lm model over static caches.

``CompiledModel`` wraps a model. Its step is a pure function of arrays::

    tokens [Bk, L] int32, rope offsets [Bk] int32,
    per cache family: mask geometry + write inputs (small int32 arrays),
    per layer: keys/values buffers [Bk, H, S, D],
    sampler state (per-row settings and PRNG keys),
    logits processors (per-row penalties, bias and recent-token windows; when a row has any)
      -> next tokens [Bk], their log-probabilities [Bk], new buffers, new keys
         (and the rows' windows, the top alternatives, when asked for)

traced by ``mx.compile`` once per :class:`TraceKey` (step kind, bucket width
Bk, step length L, capacity of the full layers, sampler kind, processors,
outputs) and
replayed for every later step with those shapes. Under the lean forward
(:mod:`mlx_tracer.adapters.lean`) the weights are constants of the trace:
a call then hands MLX only the step's own arrays (each input costs host time
per call, and a model has hundreds of weight arrays), and weights swapped or
modules replaced are seen before the next step (:meth:`LeanForward.refresh`),
which drops the lean traces: the next step traces again. The model's own forward takes them as inputs
(``inputs=model.state``): other weights of the same shapes reuse its traces.

Two step kinds: **decode** (L = 1) and **window** (L > 1: prefill chunks,
prefill tails padded to the chunk, speculative verify windows). Per step, each
cache family gives one :class:`~mlx_tracer.caches.StepPlan`; each cache hands
its buffers in (``fit``) and takes the new ones back (``commit``).
"""

from __future__ import annotations

import contextlib
import re
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..adapters.contract import probe_layout
from ..adapters.lean import LeanForward, why_not
from ..backend import kernels
from ..backend.jit import check_compiler
from ..adapters.traced import FamilyMasks
from ..caches import DEFAULT_CAPACITIES
from ..caches.batch import StaticKVCache
from ..caches.masks import MaskGeometry
from ..caches.storage import KVFormat, columns
from .options import DEFAULT_BUCKETS  # noqa: F401  (re-exported: the step module named it first)
from .processors import process, slide, verify_windows
from .sampling import sample, top_logprobs
from .speculative import accept, judged


@dataclass(frozen=True)
class TraceKey:
    """What one trace of the step is specialised to."""

    kind: str  # "decode" | "window"
    width: int  # bucket Bk
    length: int  # step length L
    capacity: Optional[int]  # capacity bucket of the full layers (None: no full layer)
    sampler: str = "greedy"  # "greedy" | "sample" | "none"
    logits: bool = False  # the step also returns raw logits
    processors: bool = False  # penalties and logit bias (:mod:`.processors`) before sampling
    top: int = 0  # the step also returns each row's top alternatives (this many)


@dataclass
class StepResult:
    """What one step returns (arrays not evaluated yet).

    A decode step fills ``tokens``/``logprobs`` ``[Bk]`` (and ``keys [Bk, 2]``
    when it sampled, ``window [Bk, W]`` with processors, ``top_tokens`` /
    ``top_logprobs [Bk, top]`` when asked for); ``logits [Bk, V]`` when asked
    for (a window step: at each row's ``last`` query; with processors, the
    processed logits).
    """

    tokens: Optional[mx.array] = None
    logprobs: Optional[mx.array] = None
    keys: Optional[mx.array] = None
    logits: Optional[mx.array] = None
    window: Optional[mx.array] = None
    top_tokens: Optional[mx.array] = None
    top_logprobs: Optional[mx.array] = None
    # (keys, values) per layer: the new buffers, from :meth:`CompiledModel.step_graph` only
    buffers: Optional[List[tuple]] = None

    ROW_ARRAYS = ("tokens", "logprobs", "keys", "logits", "window", "top_tokens", "top_logprobs")

    def arrays(self) -> List[mx.array]:
        return [a for a in (getattr(self, f) for f in self.ROW_ARRAYS) if a is not None]


@dataclass
class VerifyResult:
    """What a verify step returns: row r keeps ``tokens[r, :count[r]]``."""

    tokens: mx.array  # [Bk, L] int32
    count: mx.array  # [Bk] int32, 1 .. L
    logprobs: mx.array  # [Bk, L]
    keys: Optional[mx.array] = None  # [Bk, 2] when it sampled
    top_tokens: Optional[mx.array] = None  # [Bk, L, top] when asked for
    top_logprobs: Optional[mx.array] = None  # [Bk, L, top]


class NewTraceError(AssertionError):
    """Raised by ``CompiledModel.no_new_traces`` when a region traced."""


def log_softmax(logits: mx.array) -> mx.array:
    """``logits - logsumexp(logits)`` over the last axis: the native kernel
    where it is built (the same bits, its exponentials on vector lanes), else
    those MLX ops."""
    native = kernels.load()
    if native is not None and logits.dtype == mx.float32:
        return native.logprobs(logits)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def greedy_logprobs(logits: mx.array) -> Tuple[mx.array, mx.array]:
    """Each row's argmax over ``log_softmax(logits)`` (int32) and its
    log-probability there: the native kernel's one pass where it is built
    (the same bits, no row of log-probabilities written), else those ops."""
    native = kernels.load()
    if native is not None and logits.dtype == mx.float32:
        return tuple(native.greedy_logprobs(logits))
    logprobs = log_softmax(logits)
    picks = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    return picks, mx.take_along_axis(logprobs, picks[..., None], axis=-1)[..., 0]


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
        fuse: run the lean forward of :mod:`mlx_tracer.adapters.lean`
            (q/k/v and gate/up fused into one matmul each, RoPE tables once
            per step): ``None`` (default) where the model's family has one,
            ``True`` to require it, ``False`` for the model's own forward
            (whose logits equal mlx-lm's eager ones bit for bit).
        kv: how every cache stores its keys and values
            (:class:`~mlx_tracer.caches.storage.KVFormat`: float16/bfloat16,
            or 8/4-bit quantized; None: as the model computes them).
    """

    def __init__(self, model, capacities: Sequence[int] = DEFAULT_CAPACITIES, fuse: Optional[bool] = None,
                 kv: Optional[KVFormat] = None):
        check_compiler()  # without it mx.compile would silently retrace every step
        self.model = model
        self.capacities = tuple(capacities)
        self.kv = kv = kv or KVFormat()
        self.layout = probe_layout(model, self.capacities, kv)
        reason = why_not(model) if fuse is not False else "fuse=False"
        if fuse is True and reason is not None:
            raise ValueError(f"fuse=True: {type(model).__name__} has no lean forward ({reason}); pass fuse=None or False")
        self.lean: Optional[LeanForward] = LeanForward(model, kernels.load(), kv) if reason is None else None
        self.traces: Counter = Counter()
        self.trace_ms: Dict[TraceKey, float] = {}
        self._fns: Dict[tuple, object] = {}
        self._tracing: Optional[TraceKey] = None  # the key of the call in progress

    @property
    def vocab_size(self) -> int:
        return self.layout.vocab_size

    @property
    def max_positions(self) -> Optional[int]:
        """Longest prompt + generation a row can hold (None: ring layers only)."""
        return self.capacities[-1] if self.layout.has_capacity else None

    @property
    def context_length(self) -> Optional[int]:
        """The model's own context length (``max_position_embeddings``), when it states one."""
        n = getattr(getattr(self.model, "args", None), "max_position_embeddings", None)
        return int(n) if isinstance(n, int) and n > 0 else None

    # --------------------------------------------------------------- caches
    def new_caches(self, width: int, rows: int = 0, capacity: Optional[int] = None) -> List[StaticKVCache]:
        """Allocated static caches for one batch of bucket ``width`` holding
        ``rows`` empty live rows."""
        return self.layout.new_caches(width, rows, self.capacities, capacity)

    @property
    def verify_rows(self) -> Optional[int]:
        """The most rows (bucket x window) a verify step may multiply while
        each keeps the bits of the decode step at its position, or None
        (no limit): qmm's exact and factored contracts sum a row alike up
        to ``qmm_tile_rows()`` rows (64) and in sgemm panels above; its fast
        and split contracts, the BLAS and MLX's ops at any count."""
        b = self.lean.binding if self.lean is not None and self.lean.active else None
        if b is None or b.contract in ("fast", "split") or not b.uses_qmm:
            return None
        return kernels.load().qmm_tile_rows()

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
        processors: Optional[dict] = None,
        top: int = 0,
    ) -> StepResult:
        """Run one compiled step over ``caches`` (one per layer, in lockstep).

        ``tokens [Bk, L]``; ``sampler``: arrays from ``sampler_inputs`` (None:
        greedy). A decode fills ``tokens``/``logprobs`` (and ``keys``); a
        window step returns nothing unless ``return_logits`` (then ``logits``
        at each row's ``last`` query index). ``processors``: arrays from
        :func:`~.processors.processor_inputs` (a decode step then returns the
        slid ``window``); ``top``: a decode step returns each row's ``top``
        most likely tokens too. The caches adopt the new buffers and advance.
        """
        return self._step(caches, tokens, sampler, return_logits, last, processors, top, eager=False)

    def step_graph(self, caches: List[StaticKVCache], tokens: mx.array, sampler: Optional[dict] = None,
                   return_logits: bool = False, last: Optional[mx.array] = None, processors: Optional[dict] = None,
                   top: int = 0) -> StepResult:
        """The step :meth:`step` would run, built eagerly (not compiled, not
        evaluated), to inspect its graph: the outputs and, in ``buffers``, the
        new keys/values per layer. The caches stay as they were."""
        return self._step(caches, tokens, sampler, return_logits, last, processors, top, eager=True)

    def _step(self, caches, tokens, sampler, return_logits, last, processors, top, eager: bool) -> StepResult:
        tokens = self._check(caches, tokens)
        Bk, L = tokens.shape
        plans = [caches[i].plan(L) for i in self.layout.representatives]
        decode = plans[0].decode
        kind = "decode" if decode else "window"
        sampler_kind = ("greedy" if sampler is None else "sample") if decode else "none"
        extra = {}
        if sampler is not None:
            extra["sampler"] = sampler
        if processors is not None and decode:
            extra["processors"] = processors
        if return_logits and not decode:
            extra["last"] = mx.full((Bk,), L - 1, dtype=mx.int32) if last is None else last
        out, new_kv = self._run(kind, sampler_kind, return_logits, caches, tokens, plans, extra, eager,
                                top=self._top(top) if decode else 0)
        if eager:
            return StepResult(**out, buffers=new_kv)
        # the trace returns the shapes fit() handed in: committed unchecked
        StaticKVCache.commit_all(caches, [plans[f] for f in self.layout.family_of], new_kv)
        return StepResult(**out)

    def verify(self, caches: List[StaticKVCache], tokens: mx.array, ndraft, sampler: Optional[dict] = None,
               processors: Optional[dict] = None, top: int = 0) -> VerifyResult:
        """A speculative verify step: ``tokens [Bk, k+1]`` = each row's last
        token and its drafts (``ndraft [Bk]`` of them count). Judges the drafts
        in the graph (:mod:`.speculative`), commits only each row's accepted
        columns, and returns what each row keeps. ``processors``/``top`` as
        for :meth:`step`: every position is processed with the window a plain
        decode step would see there. Traced once per (bucket, k+1, capacity,
        sampler kind, processors, top). Evaluates the step (the host needs the counts)."""
        tokens = self._check(caches, tokens)
        Bk, L = tokens.shape
        if L < 2:
            raise ValueError("a verify window holds the last token and at least one draft (L >= 2)")
        plans = [caches[i].plan(L) for i in self.layout.representatives]
        if plans[0].decode:
            raise ValueError("verify needs the prepared prompt finalized first")
        extra = {"ndraft": mx.array(ndraft, dtype=mx.int32)}
        if sampler is not None:
            extra["sampler"] = sampler
        if processors is not None:
            extra["processors"] = processors
        out, new_kv = self._run("verify", "greedy" if sampler is None else "sample", False, caches, tokens, plans, extra,
                                top=self._top(top))
        result = VerifyResult(**out)
        # the buffers adopted before evaluation, as a decode step's (the window's writes then find the old ones
        # unshared and run in place), without adopt's checks: the trace returns the shapes fit handed in
        for c, (k, v) in zip(caches, new_kv):
            c.keys, c.values = k, v
        mx.eval(*[a for a in (result.count, result.tokens, result.logprobs, result.keys, result.top_tokens,
                              result.top_logprobs) if a is not None])
        StaticKVCache.advance_verify_all(caches, [plans[f] for f in self.layout.family_of], np.array(result.count))
        return result

    def _check(self, caches, tokens) -> mx.array:
        if len(caches) != len(self.layout):
            raise ValueError(f"expected {len(self.layout)} layer caches, got {len(caches)}")
        if not isinstance(tokens, mx.array):
            tokens = mx.array(tokens, dtype=mx.int32)
        elif tokens.dtype != mx.int32:
            tokens = tokens.astype(mx.int32)
        if tokens.ndim != 2 or tokens.shape[0] != caches[0].width:
            raise ValueError(f"tokens must be [bucket width {caches[0].width}, L], got {tuple(tokens.shape)}")
        return tokens

    def _top(self, top: int) -> int:
        """Alternatives a step returns: ``top`` (0: none), at most the vocabulary."""
        return min(int(top), self.vocab_size) if top else 0

    def _run(self, kind, sampler_kind, want_logits, caches, tokens, plans, extra, eager=False, top: int = 0):
        """One call of the compiled function of ``kind`` (traced on first use
        of its :class:`TraceKey`): ``(outputs, new buffers per layer)``."""
        Bk, L = tokens.shape
        kv = [caches[i].fit(plans[f]) for i, f in enumerate(self.layout.family_of)]
        capacity = next((p.capacity for p in plans if p.capacity is not None), None)
        procs = "processors" in extra
        key = TraceKey(kind, Bk, L, capacity, sampler_kind, want_logits, procs, top)
        args = (tokens, plans[0].offsets, [p.arrays for p in plans], kv, extra)
        if self.lean is not None:
            generation = self.lean.generation
            self.lean.refresh()  # weights swapped or modules replaced since the last step
            if self.lean.generation != generation:  # the lean traces hold the old weights as constants
                self._fns = {sig: fn for sig, fn in self._fns.items() if not sig[-1]}
        if eager:
            return self._forward(kind, sampler_kind, want_logits, top, *args)
        self._tracing = key
        t0 = time.perf_counter()
        out = self._compiled(kind, sampler_kind, want_logits, procs, top)(*args)
        if self._tracing is None:  # the call traced
            self.trace_ms[key] = (time.perf_counter() - t0) * 1e3
        self._tracing = None
        return out

    def export_decode_graph(self, path: str, width: int = 1) -> Counter:
        """Write the decode step's graph (bucket ``width``) as DOT; returns op counts."""
        caches = self.new_caches(width, rows=width)
        graph = self.step_graph(caches, mx.zeros((width, 1), dtype=mx.int32))
        mx.export_to_dot(path, graph.tokens, *[a for pair in graph.buffers for a in pair])
        with open(path) as f:
            return Counter(m.group(1) for m in re.finditer(r'label ="([A-Za-z_]+)', f.read()))

    def _compiled(self, kind: str, sampler_kind: str, logits: bool, procs: bool = False, top: int = 0):
        lean = self.lean is not None and self.lean.active
        sig = (kind, sampler_kind, logits, procs, top, lean)  # lean last: a weight refresh drops those
        if sig not in self._fns:
            # the function refers to its owner weakly: a closure over self would
            # make a cycle (self._fns -> function -> self) that keeps the model's
            # memory until Python's cyclic collector happens to run
            owner = weakref.ref(self)

            def forward(*args):
                me = owner()
                me.traces[me._tracing] += 1  # runs only while tracing
                me._tracing = None
                return me._forward(kind, sampler_kind, logits, top, *args)

            # lean: the weights are constants of the trace (see the module doc);
            # the model's own forward: inputs
            self._fns[sig] = mx.compile(forward) if lean else mx.compile(forward, inputs=[self.model.state])
        return self._fns[sig]

    def _forward(self, kind, sampler_kind, want_logits, top, tokens, offsets, plans, kv, extra):
        Bk, L = tokens.shape
        decode = kind == "decode"
        masks = [
            FamilyMasks(MaskGeometry.from_arrays(geometry, self.layout.family_window(f)), L)
            for f, (geometry, _) in enumerate(plans)
        ]
        layer_caches = [
            layout.traced(kind, k, v, offsets, plans[f][1], masks[f], i)
            for i, (layout, f, (k, v)) in enumerate(zip(self.layout, self.layout.family_of, kv))
        ]
        lean = self.lean is not None and self.lean.active
        if lean:
            want = "all" if kind != "window" else ("last" if want_logits else "none")
            logits = self.lean(tokens, layer_caches, masks, self.layout.family_of, decode, want, extra.get("last"))
        else:
            logits = self.model(tokens, cache=layer_caches)  # [Bk, L, V]
        out = {}
        procs = extra.get("processors")
        if kind == "verify":
            V = logits.shape[-1]
            if procs is not None:  # each position with the window a plain step would see there
                flat = {k: mx.repeat(v, L, axis=0) for k, v in procs.items() if k != "window"}  # [Bk*L, ...]
                flat["window"] = verify_windows(procs["window"], tokens).reshape(Bk * L, -1)  # [Bk*L, W]
                logits = process(logits.reshape(Bk * L, V), flat).reshape(Bk, L, V)
            if extra.get("sampler") is None and not top:  # greedy: the picks alone, no [Bk, L, V] written
                emitted, lps = greedy_logprobs(logits)  # [Bk, L] each
                count, keys = judged(emitted, tokens, extra["ndraft"]), None
            else:
                logprobs = log_softmax(logits)  # [Bk, L, V]
                emitted, count, lps, keys = accept(logprobs, tokens, extra["ndraft"], extra.get("sampler"))
            out.update(tokens=emitted, count=count, logprobs=lps)
            if keys is not None:
                out["keys"] = keys
            if top:
                ids, vals = top_logprobs(logprobs.reshape(Bk * L, V), top)
                out["top_tokens"], out["top_logprobs"] = ids.reshape(Bk, L, top), vals.reshape(Bk, L, top)
            rejected = L - count  # [Bk] window columns each row does not keep
            strips = []
            for family in masks:  # per family: left padding every live row holds afterwards
                g = family.geometry
                strips.append(mx.min(mx.where(g.live, g.first_valid + rejected, 2**30)))
            native = kernels.load()
            realign = None if native is None else native.realign  # in place, rows that keep their columns untouched
            new_kv = [
                layout.cache_class.verify_commit(c.keys, c.values, plans[f][1], rejected, strips[f], columns(k),
                                                 realign=realign)
                for layout, f, c, (k, _) in zip(self.layout, self.layout.family_of, layer_caches, kv)
            ]
            return out, new_kv
        new_kv = [(c.keys, c.values) for c in layer_caches]
        if decode:
            last = logits[:, -1, :]  # [Bk, V]
            if procs is not None:
                last = process(last, procs)
            if sampler_kind == "greedy" and not top:  # the picks alone, no [Bk, V] of log-probabilities written
                toks, out["logprobs"] = greedy_logprobs(last)  # [Bk], [Bk]
            else:
                logprobs = log_softmax(last)
                if sampler_kind == "greedy":
                    toks = mx.argmax(logprobs, axis=-1).astype(mx.int32)
                else:
                    toks, out["keys"] = sample(logprobs, extra["sampler"])
                out["logprobs"] = mx.take_along_axis(logprobs, toks[:, None], axis=-1)[:, 0]  # [Bk]
            out["tokens"] = toks  # [Bk]
            if procs is not None:
                out["window"] = slide(procs["window"], toks)  # [Bk, W]: the next step's
            if top:
                out["top_tokens"], out["top_logprobs"] = top_logprobs(logprobs, top)  # [Bk, top]
            if want_logits:
                out["logits"] = last
        elif want_logits and lean:
            out["logits"] = logits  # [Bk, V]: the lean forward read only each row's last query
        elif want_logits:
            idx = extra["last"][:, None, None]  # [Bk, 1, 1]
            out["logits"] = mx.take_along_axis(logits, idx, axis=1)[:, 0, :]  # [Bk, V]
        return out, new_kv
