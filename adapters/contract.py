"""Which mlx-lm models can be traced, and the static caches they get.

A model qualifies when every layer's mlx-lm cache (``model.make_cache()``, or
one ``KVCache`` per layer) is a plain ``KVCache`` (-> :class:`FullCache`) or a
``RotatingKVCache`` without sink tokens (-> :class:`RingCache`), and each
layer updates its own cache exactly once per forward. :func:`probe_layout`
checks both with one eager forward and learns each layer's KV shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..caches import DEFAULT_CAPACITIES, FullCache, RingCache
from ..caches.batch import StaticKVCache


class UnsupportedModel(ValueError):
    """The model or one of its layers does not follow the attention-cache contract."""


@dataclass(frozen=True)
class LayerLayout:
    """The static cache one attention layer needs."""

    window: Optional[int]  # None: full attention; else the ring's window
    kv_heads: int
    k_dim: int
    v_dim: int
    dtype: mx.Dtype

    @property
    def family(self):
        return ("full", None) if self.window is None else ("ring", self.window)


def layer_windows(model) -> List[Optional[int]]:
    """Per layer: ``None`` for full attention, the window for a sliding layer."""
    if hasattr(model, "make_cache"):
        caches = model.make_cache()
    elif hasattr(model, "layers"):
        caches = [KVCache() for _ in model.layers]
    else:
        raise UnsupportedModel(f"{type(model).__name__} has neither make_cache() nor layers: not an mlx-lm language model")
    windows = []
    for i, c in enumerate(caches):
        if type(c) is KVCache:
            windows.append(None)
        elif type(c) is RotatingKVCache and not c.keep:
            windows.append(c.max_size)
        elif type(c) is RotatingKVCache:
            raise UnsupportedModel(
                f"layer {i}: RotatingKVCache(keep={c.keep}) keeps sink tokens, which mlx-tracer's ring cache does not support"
            )
        else:
            raise UnsupportedModel(
                f"layer {i}: cache type {type(c).__name__} is not supported; mlx-tracer compiles layers whose mlx-lm "
                "cache is KVCache or RotatingKVCache (SSM ArraysCache, QuantizedKVCache, ChunkedKVCache and CacheList "
                "layers run only in eager mlx-lm)"
            )
    return windows


def new_caches(windows: Sequence[Optional[int]], width: int, capacities: Sequence[int] = DEFAULT_CAPACITIES, rows: int = 0) -> List[StaticKVCache]:
    """Static caches (buffers allocated lazily) of bucket ``width`` holding
    ``rows`` empty live rows."""
    pad = [0] * rows
    return [FullCache(pad, width=width, capacities=capacities) if w is None else RingCache(w, pad, width=width) for w in windows]


def probe_layout(model, capacities: Sequence[int] = DEFAULT_CAPACITIES) -> Tuple[List[LayerLayout], int]:
    """One eager forward of a single token through static caches: checks the
    contract and records each layer's KV shape and dtype, and the vocabulary
    size (the logits' last dimension)."""
    windows = layer_windows(model)
    caches = new_caches(windows, 1, capacities)
    calls = [0] * len(caches)
    for i, c in enumerate(caches):
        c.update_and_fetch = _counting(c.update_and_fetch, calls, i)
    try:
        out = model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
        mx.eval(out)
    except Exception as e:  # the model's own error, with the context it lacks
        raise UnsupportedModel(f"{type(model).__name__} failed a forward with mlx-tracer's static caches: {e}") from e
    layouts = []
    for i, (c, n) in enumerate(zip(caches, calls)):
        if n != 1:
            raise UnsupportedModel(
                f"layer {i}: its cache ({type(c).__name__}) was updated {n} times in one forward; mlx-tracer needs "
                "each attention layer to call update_and_fetch on its own cache exactly once"
            )
        layouts.append(LayerLayout(windows[i], c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype))
    return layouts, out.shape[-1]


def allocate_caches(
    layouts: Sequence[LayerLayout], width: int, capacity: Optional[int] = None,
    capacities: Sequence[int] = DEFAULT_CAPACITIES, rows: int = 0,
) -> List[StaticKVCache]:
    """Zeroed static caches of bucket ``width`` with ``rows`` empty live rows,
    ready for a compiled step."""
    caches = new_caches([l.window for l in layouts], width, capacities, rows)
    for c, l in zip(caches, layouts):
        if capacity is not None and isinstance(c, FullCache):
            c.capacity = capacity
        c.allocate(l.kv_heads, l.k_dim, l.v_dim, l.dtype)
    return caches


def _counting(fn, calls, i):
    def wrapped(keys, values):
        calls[i] += 1
        return fn(keys, values)

    return wrapped
