"""Quantized layers and their float twins.

A GGUF's Q4/Q8 blocks load as MLX affine-quantized layers
(``QuantizedLinear``, ``QuantizedEmbedding``: packed ``weight``, ``scales``,
``biases``). :func:`dequantize_model` swaps them for float ``Linear`` /
``Embedding`` layers holding exactly ``mx.dequantize`` of the triple (scales
and biases cast to float32 first), which is what the weight formats of
:mod:`.weights` are made of.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from ..adapters.lean.weights import widen_rows

QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


def is_quantized(model) -> bool:
    """Whether any layer of ``model`` is quantized."""
    return any(isinstance(m, QUANTIZED) for _, m in model.named_modules())


def float32_bytes(model) -> int:
    """Bytes of ``model``'s parameters once every quantized layer is float32."""
    n = 0
    for _, m in model.named_modules():
        if isinstance(m, QUANTIZED):
            n += m.scales.size * m.group_size * 4
    return n + sum(v.nbytes for k, v in tree_flatten(model.parameters()) if not k.endswith(("scales", "biases")))


def dequantize_model(model: nn.Module, dtype=mx.float32, select=None) -> nn.Module:
    """Replace quantized Linear/Embedding layers by float ones, in place.

    Each weight is ``mx.dequantize`` of its triple with scales and biases cast
    to float32 first, then cast to ``dtype``. ``select(path)`` (optional)
    chooses which layers, by module path. Returns ``model``.
    """

    def to_float(q):
        return mx.dequantize(
            q.weight, q.scales.astype(mx.float32), q.biases.astype(mx.float32),
            group_size=q.group_size, bits=q.bits, mode=q.mode,
        ).astype(dtype)

    def swap(path, m):
        if select is not None and not select(path):
            return m
        if isinstance(m, nn.QuantizedLinear):
            new = nn.Linear(m.scales.shape[1] * m.group_size, m.weight.shape[0], bias="bias" in m)
            if "bias" in m:
                new.bias = m.bias
        elif isinstance(m, nn.QuantizedEmbedding):
            new = nn.Embedding(m.num_embeddings, m.dims)
        else:
            return m
        new.weight = to_float(m)
        return new

    leaves = tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    mx.eval(model.parameters())
    return model


def float32_activations(model: nn.Module) -> nn.Module:
    """The ``quantized`` format, in place: quantized linears and embeddings
    keep their packed weights, scales and biases as loaded (the file's
    blocks); everything else becomes float32, and a quantized embedding
    returns float32 rows (:class:`~mlx_tracer.adapters.lean.weights.Float32RowsEmbedding`:
    its scales widened as each row is read), so that the residual stream is
    float32 (what the native quantized matmul takes). Returns ``model``."""
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedEmbedding):
            widen_rows(m)
        keep = ("weight", "scales", "biases") if isinstance(m, QUANTIZED) else ()
        for k, v in list(m.items()):
            if isinstance(v, mx.array) and k not in keep and mx.issubdtype(v.dtype, mx.floating) and v.dtype != mx.float32:
                m[k] = v.astype(mx.float32)
    mx.eval(model.parameters())
    return model
