"""Which mlx-lm models can be traced, and the static cache each layer gets.

A model qualifies when every layer's mlx-lm cache (``model.make_cache()``, or
one ``KVCache`` per layer) is a plain ``KVCache`` (-> :class:`FullCache`) or a
``RotatingKVCache`` without sink tokens (-> :class:`RingCache`), and each
layer updates its own cache exactly once per forward. :func:`probe_layout`
checks both with one eager forward and learns each layer's KV shapes.

This module is the one owner of the layer -> cache decision: the mlx-lm cache
type -> window mapping is :func:`layer_windows`, and a :class:`LayerLayout`
makes its layer's caches (static, traced, or converted from a serial mlx-lm
cache). Nothing else asks whether a layer has a window.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from ..caches import DEFAULT_CAPACITIES, FullCache, RingCache
from ..caches.batch import StaticKVCache
from ..caches.ring import QuantizedRingRow
from ..caches.storage import KVFormat
from .traced import FamilyMasks, TracedCache


class UnsupportedModel(ValueError):
    """The model or one of its layers does not follow the attention-cache contract."""


@dataclass(frozen=True)
class LayerLayout:
    """The static cache one attention layer needs: its kind (full attention, or
    a ring of ``window`` columns), its KV shapes (known after the probe) and
    how its cache stores them."""

    window: Optional[int]  # None: full attention; else the ring's window
    kv_heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    dtype: mx.Dtype = mx.float32  # the model's K/V dtype
    storage: KVFormat = KVFormat()

    @property
    def cache_class(self) -> type:
        return FullCache if self.window is None else RingCache

    @property
    def kind(self) -> str:
        return self.cache_class.kind  # "full" | "ring"

    @property
    def family(self) -> Tuple[str, Optional[int]]:
        """Layers of one family share their mask and their row bookkeeping."""
        return (self.kind, self.window)

    @property
    def has_capacity(self) -> bool:
        """Whether the cache's columns grow with the context (full attention)."""
        return self.window is None

    def new_cache(self, width: int, rows: int = 0, capacities: Sequence[int] = DEFAULT_CAPACITIES,
                  capacity: Optional[int] = None, allocate: bool = True) -> StaticKVCache:
        """A static cache of bucket ``width`` holding ``rows`` empty live rows
        (zeroed buffers unless ``allocate=False`` or the shapes are unknown)."""
        pad = [0] * rows
        if self.window is None:
            cache = FullCache(pad, width=width, capacities=capacities, capacity=capacity, storage=self.storage)
        else:
            cache = RingCache(self.window, pad, width=width, storage=self.storage)
        if allocate and self.kv_heads:
            cache.allocate(self.kv_heads, self.k_dim, self.v_dim, self.dtype)
        return cache

    def traced(self, kind: str, keys: mx.array, values: mx.array, offset: mx.array, writes: tuple,
               masks: FamilyMasks, layer: int) -> TracedCache:
        """What this layer sees as its cache inside a compiled step of ``kind``
        ("decode", "window" or "verify")."""
        cls = self.cache_class
        apply = cls.verify_apply if kind == "verify" else partial(cls.apply, kind == "decode")
        column = cls.decode_column(writes) if kind == "decode" else None
        return TracedCache(apply, keys, values, offset, writes, masks, layer, column, self.storage)

    def check_serial(self, cache, layer: int):
        """Raise a clear error unless ``cache`` is this layer's serial mlx-lm cache."""
        if self.window is None:
            ok = type(cache) in (KVCache, QuantizedKVCache)
        else:
            ok = type(cache) in (RotatingKVCache, QuantizedRingRow) and cache.max_size == self.window
        if not ok:
            want = "KVCache or QuantizedKVCache" if self.window is None else f"RotatingKVCache(max_size={self.window})"
            raise ValueError(f"cache layer {layer}: expected {want}, got {type(cache).__name__}")

    def from_serial(self, cache, width: int, capacities: Sequence[int] = DEFAULT_CAPACITIES) -> StaticKVCache:
        """A static cache of bucket ``width`` whose one row continues the serial
        mlx-lm cache ``cache`` (read, never modified)."""
        out = self.cache_class.join([cache], width=width, capacities=capacities, storage=self.storage)
        if out.keys is None:
            out.allocate(self.kv_heads, self.k_dim, self.v_dim, self.dtype)
        return out


class ModelLayout:
    """The layer layouts of one model, grouped into cache families.

    A family (full attention, or one ring window) shares one mask and one step
    plan per forward; ``representatives[f]`` is its first layer.
    """

    def __init__(self, layers: Sequence[LayerLayout], vocab_size: int):
        self.layers = list(layers)
        self.vocab_size = vocab_size
        self.families: List[Tuple[str, Optional[int]]] = sorted({l.family for l in self.layers}, key=str)
        self.family_of = [self.families.index(l.family) for l in self.layers]
        self.representatives = [self.family_of.index(f) for f in range(len(self.families))]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    @property
    def has_capacity(self) -> bool:
        """Whether some layer's positions are bounded by a capacity (full attention)."""
        return any(l.has_capacity for l in self.layers)

    def family_window(self, f: int) -> Optional[int]:
        return self.layers[self.representatives[f]].window

    def new_caches(self, width: int, rows: int = 0, capacities: Sequence[int] = DEFAULT_CAPACITIES,
                   capacity: Optional[int] = None) -> List[StaticKVCache]:
        """Zeroed static caches, one per layer, ready for a compiled step."""
        return [l.new_cache(width, rows, capacities, capacity) for l in self.layers]

    def check_serial(self, caches: Sequence) -> int:
        """Validate serial mlx-lm caches (one per layer); returns the positions they hold."""
        if len(caches) != len(self.layers):
            raise ValueError(f"cache has {len(caches)} layers, the model has {len(self.layers)}")
        for i, (c, l) in enumerate(zip(caches, self.layers)):
            l.check_serial(c, i)
        return max(int(c.offset) for c in caches)

    def from_serial(self, caches: Sequence, width: int, capacities: Sequence[int] = DEFAULT_CAPACITIES) -> List[StaticKVCache]:
        return [l.from_serial(c, width, capacities) for l, c in zip(self.layers, caches)]


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


def probe_layout(model, capacities: Sequence[int] = DEFAULT_CAPACITIES, storage: KVFormat = KVFormat()) -> ModelLayout:
    """One eager forward of a single token through static caches: checks the
    contract and records each layer's KV shape and dtype, and the vocabulary
    size (the logits' last dimension). Every layer's cache then stores its
    K/V in ``storage`` (checked against the head dimensions)."""
    protos = [LayerLayout(w) for w in layer_windows(model)]
    caches = [p.new_cache(1, capacities=capacities, allocate=False) for p in protos]
    calls = [0] * len(caches)
    for i, c in enumerate(caches):
        c.update_and_fetch = _counting(c.update_and_fetch, calls, i)
    try:
        out = model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
        mx.eval(out)
    except Exception as e:  # the model's own error, with the context it lacks
        raise UnsupportedModel(f"{type(model).__name__} failed a forward with mlx-tracer's static caches: {e}") from e
    layers = []
    for i, (p, c, n) in enumerate(zip(protos, caches, calls)):
        if n != 1:
            raise UnsupportedModel(
                f"layer {i}: its cache ({type(c).__name__}) was updated {n} times in one forward; mlx-tracer needs "
                "each attention layer to call update_and_fetch on its own cache exactly once"
            )
        storage.check_dims(c.keys.shape[3], c.values.shape[3], layer=i)
        layers.append(replace(p, kv_heads=c.keys.shape[1], k_dim=c.keys.shape[3], v_dim=c.values.shape[3], dtype=c.keys.dtype,
                              storage=storage))
    return ModelLayout(layers, out.shape[-1])


def _counting(fn, calls, i):
    def wrapped(keys, values):
        calls[i] += 1
        return fn(keys, values)

    return wrapped
