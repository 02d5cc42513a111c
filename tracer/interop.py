"""Where mlx-tracer's tools meet mlx-lm's cache API, through public names only.

mlx-lm keeps a request's context as a list of per-layer caches (``KVCache``,
``RotatingKVCache``, ...). Timing stock mlx-lm at batch ``B`` needs ``B`` such
lists joined into one list of batch caches; mlx-lm's public classmethods
``KVCache.merge`` / ``RotatingKVCache.merge`` do that per layer (to
``BatchKVCache`` / ``BatchRotatingKVCache``, left-padded to the longest row).
The weight-format timing (:mod:`mlx_tracer.loading.weights`) and the
benchmark (:mod:`mlx_tracer.bench`) both go through :func:`batch_serial_caches`.
"""

from __future__ import annotations

from typing import List, Sequence


def batch_serial_caches(requests: Sequence[Sequence]) -> List:
    """One batch cache per layer from ``requests``: a list (one entry per
    request, in row order) of per-layer mlx-lm cache lists, all of the same
    model. The inputs are not modified."""
    if not requests:
        raise ValueError("no caches to batch: give at least one request's cache list")
    layers = len(requests[0])
    if any(len(r) != layers for r in requests):
        raise ValueError(f"cache lists of different lengths {[len(r) for r in requests]}: not one model's caches")
    batch = []
    for i in range(layers):
        kind = type(requests[0][i])
        merge = getattr(kind, "merge", None)
        if merge is None:
            raise TypeError(f"layer {i}: mlx-lm's {kind.__name__} cannot be batched (it has no merge)")
        batch.append(merge([r[i] for r in requests]))
    return batch
