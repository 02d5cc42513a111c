"""The two decode systems the benchmark times, on the same contexts.

* **stock** mlx-lm: ``generate_step`` for ``B = 1``, ``BatchGenerator`` for
  ``B > 1``, as a user runs them;
* **tracer**: mlx-tracer's ``Engine`` (compiled decode, traced once per bucket).

Host milliseconds per step are measured the same way for both (:func:`stock_host_ms`,
:func:`tracer_host_ms`): the time of the call that builds one decode step's
graph, from the call until it returns, before any evaluation, over the same
contexts; the median of a few steps, each evaluated before the next is timed.
The bench takes both in one loop (:func:`host_ms`), the systems taking turns
every 8 steps, so that a machine whose speed drifts (this VM's does, by up to
1.5x within a minute) weighs on both alike, and the step after each switch
untimed: in a process where ``mx.clear_cache()`` has run (mlx-lm's decode
loops call it), that step pays for merging the small heap chunks the other
system's evaluation freed (about 1.5x for the tracer's step; a user runs one
system per process).

Peak memory is measured per system, so that one system's peak does not
include another's (:func:`run_peak`): MLX's peak counter is reset before each
run, and what was live then but is not the system's (the other system's
arrays, the bench's contexts) is taken off; the system's own (its weights,
and for the tracer its traces' and engine's arrays) is added back.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, List, Tuple, TypeVar

import mlx.core as mx

from ..interop import batch_serial_caches
from ..runtime.engine import Engine, EngineStats
from .models import copy_caches

T = TypeVar("T")


def param_bytes(model) -> int:
    """Bytes of a model's parameters as held (a quantized layer's blocks, scales and biases)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def stand_in_bytes(model) -> int:
    """Bytes of the modules' stand-ins for forms the lean forward holds
    (superblock scales' float32, 5-bit blocks' 8-bit), evaluated first: lazy
    until the model's own forward runs, then kept, they are what a process
    that runs stock mlx-lm beside the compiled loop holds for stock alone
    (an untied embedding's, which stock's lookups do not compute, evaluated
    here too, so that the count is exact)."""
    from ..adapters.lean import narrow, scales

    arrays = []
    for m in model.modules():
        if (held := scales.held_by(m)) is not None:
            arrays += held.of
        if (held := narrow.held_by(m)) is not None:
            arrays.append(held.of)
    mx.eval(arrays)
    return sum(a.nbytes for a in arrays)


def live_bytes() -> int:
    """MLX memory held by live arrays now, after a garbage collection (the
    arrays of dropped objects in reference cycles are freed first)."""
    gc.collect()
    return mx.get_active_memory()


def run_peak(run: Callable[[], T], owned_bytes: float) -> Tuple[T, float]:
    """``(run(), peak MB)``: the system's peak memory over one run, counted
    apart from any other system in the process: ``owned_bytes`` (what the
    system holds between runs, live before the run starts) plus the most
    that MLX's active memory rose above what was live when the run started
    (MLX's peak counter, reset then). Buffers MLX keeps cached for reuse are
    not counted (they are not active)."""
    before = live_bytes()
    mx.reset_peak_memory()
    out = run()
    return out, (owned_bytes + max(mx.get_peak_memory(), before) - before) / 1e6


def stock_decode(model, contexts: list, first: List[int], tokens: int) -> float:
    """Decode tokens/s of stock mlx-lm (generate_step at B=1, BatchGenerator above)."""
    from mlx_lm.generate import BatchGenerator, generate_step

    if len(contexts) == 1:
        gen = generate_step(mx.array(first[:1]), model, max_tokens=tokens, prompt_cache=copy_caches(contexts[0]))
        next(gen)  # the first step (the 1-token prompt), as any later one
        t0 = time.perf_counter()
        n = sum(1 for _ in gen)
        return n / (time.perf_counter() - t0)
    gen = BatchGenerator(model, max_tokens=tokens)
    gen.insert([[t] for t in first], caches=[copy_caches(c) for c in contexts])
    with gen.stats() as stats:
        while gen.next_generated():
            pass
    gen.close()
    return stats.generation_tokens / stats.decode_time


def _stock_steps(model, contexts: list):
    """One stock decode step per call: ``(build, evaluate)`` (mlx-lm's caches)."""
    cache = copy_caches(contexts[0]) if len(contexts) == 1 else batch_serial_caches([copy_caches(c) for c in contexts])
    y = mx.zeros((len(contexts), 1), dtype=mx.int32)

    def build():
        nonlocal y
        logits = model(y, cache=cache)[:, -1, :]
        y = mx.argmax(logits, axis=-1)[:, None]

    return build, lambda: mx.eval(y, [c.state for c in cache])


def _tracer_steps(compiled, contexts: list, windows: bool = False):
    """One compiled decode step per call: ``(build, evaluate)`` (``CompiledModel.step``:
    the step's plan, the compiled call that replays its graph, the caches' bookkeeping).
    With ``windows``, a third: ``verify(L)``, one verify step of ``L`` tokens a row
    on the same caches, no draft accepted (evaluated: the caches advance one column),
    and a fourth: ``dispatch()``, ``build()`` then its arrays handed to MLX to compute
    while the host goes on (``mx.async_eval``: the engine's pipelined decode)."""
    serial = [copy_caches(c) for c in contexts]
    caches = [
        layout.cache_class.join([s[i] for s in serial], width=len(contexts), capacities=compiled.capacities,
                                storage=layout.storage)
        for i, layout in enumerate(compiled.layout)
    ]
    y = mx.zeros((len(contexts), 1), dtype=mx.int32)

    def build():
        nonlocal y
        y = compiled.step(caches, y).tokens[:, None]

    def verify(L: int):
        nonlocal y
        out = compiled.verify(caches, mx.concatenate([y, mx.zeros((len(contexts), L - 1), dtype=mx.int32)], axis=1),
                              [0] * len(contexts))
        y = out.tokens[:, :1]

    def dispatch():
        build()
        mx.async_eval(y, [c.state for c in caches])

    if windows:
        return build, lambda: mx.eval(y, [c.state for c in caches]), verify, dispatch
    return build, lambda: mx.eval(y, [c.state for c in caches])


def _timed(systems, steps: int, block: int = 8) -> List[float]:
    """Median ms of each system's build call, each step evaluated before the
    next is timed. The systems take turns in blocks of ``block`` timed steps,
    each block after one untimed step (the first block's traces, and the
    step after a switch, which pays for the other system's leftovers on the
    C heap: see ``docs/design.md``, "Host time per step")."""
    times = [[] for _ in systems]
    while len(times[-1]) < steps:
        for (build, evaluate), t in zip(systems, times):
            for i in range(min(block, steps - len(t)) + 1):
                t0 = time.perf_counter()
                build()
                if i:
                    t.append(time.perf_counter() - t0)
                evaluate()
    return [1e3 * statistics.median(t) for t in times]


def stock_host_ms(model, contexts: list, steps: int = 8) -> float:
    """Median host ms per stock decode step: graph build + dispatch, before eval."""
    return _timed([_stock_steps(model, contexts)], steps)[0]


def tracer_host_ms(compiled, contexts: list, steps: int = 8) -> float:
    """Median host ms per compiled decode step, before eval, as :func:`stock_host_ms` times stock's."""
    return _timed([_tracer_steps(compiled, contexts)], steps)[0]


def host_ms(model, compiled, contexts: list, steps: int = 40) -> tuple:
    """``(stock, tracer)`` median host ms per decode step, taken in one loop
    in which the systems take turns (see the module docstring)."""
    return tuple(_timed([_stock_steps(model, contexts), _tracer_steps(compiled, contexts)], steps))


def tracer_decode(engine: Engine, contexts: list, first: List[int], tokens: int) -> EngineStats:
    """Decode ``tokens`` tokens per context with the compiled loop; the
    engine's stats of the decode alone (admission excluded)."""
    engine.reset_stats()
    for c, t in zip(contexts, first):
        engine.add([t], max_tokens=tokens, cache=c)
    engine.admit()  # join the contexts now: admission is not decode time
    engine.reset_stats()
    for _ in engine.run():
        pass
    return engine.stats
