"""The lean forward: the compiled step's layers in fewer graph nodes.

Replaying a compiled step costs host time per node of its graph, and on
MLX's CPU backend ``mx.fast.rope`` / ``rms_norm`` / attention expand into
their many-node fallbacks. For the llama-style families (mlx-lm's ``llama``,
``mistral``, ``qwen2``, ``qwen3``) this package runs the same layer arithmetic
with fewer nodes: q/k/v and gate/up in one matmul each (the model's own
projections become views of the fused buffers), RoPE tables built once per
forward, a 2-D residual stream, and no output head where no logits are read.

* :mod:`.qualify` — which models it serves (:func:`why_not`);
* :mod:`.weights` — the weights bound once per set of model weights, and
  the watch list that sees them swapped;
* :mod:`.rotation`, :mod:`.step_tables` — what every layer of one forward shares;
* :mod:`.ops` — the layers on MLX's ops: the reference;
* :mod:`.native` — decode layers on the native kernels, bit for bit the same;
* :mod:`.forward` — :class:`LeanForward`: binds, plans one layer
  implementation per step kind, runs, and writes the final norm and head once.

The caches are the traced caches of :mod:`..traced`, written exactly as the
model would write them.
"""

from .forward import LeanForward
from .ops import attention, norm_of_sum
from .qualify import why_not
from .rotation import HeadRotation, rope_tables

__all__ = ["HeadRotation", "LeanForward", "attention", "norm_of_sum", "rope_tables", "why_not"]
