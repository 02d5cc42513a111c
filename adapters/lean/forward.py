"""The lean forward of one model: bind, plan, run, finish.

:class:`LeanForward` binds the model's weights (:func:`~.weights.bind`),
then *plans* once per binding which layer implementation serves its steps —
the native kernels (:class:`~.native.NativeLayers`) where they apply (layers
they cannot run, such as a group of mixed formats, on MLX's ops between the
native ones), else MLX's ops (:class:`~.ops.OpsLayers`; a sharded model's
layers, whose o/down all-sum before the residual), for decode and window steps alike —
and runs: embedding, the planned layers, then the final norm and output
head (written once, here, for every path).

Before every step :meth:`LeanForward.refresh` checks the binding's watch
list by identity: weights swapped or modules replaced rebind (the step then
drops its lean traces and traces again), or turn the lean forward off when
the new modules no longer qualify.
"""

from __future__ import annotations

import operator
from typing import Dict, Optional

import mlx.core as mx

from ...caches.storage import KVFormat
from .native import NativeLayers, ops_layers, why_not_native
from .ops import OpsLayers
from .qualify import why_not
from .step_tables import StepTables
from .weights import Binding, bind


class LeanForward:
    """The lean forward of one qualifying model.

    Args:
        model: an mlx-lm model (:func:`~.qualify.why_not` is None).
        native: the native kernels module (``mlx_tracer.backend.kernels.load()``),
            or None for MLX's ops everywhere.
        kv: the caches' K/V storage format (the kernels read every one: float32,
            float16/bfloat16, 4-/8-bit quantized).
    """

    def __init__(self, model, native=None, kv: KVFormat = KVFormat()):
        self.model = model
        self.native = native
        self.kv = kv
        self.generation = 0  # bumped by every (re)bind and re-plan: the step drops its lean traces
        self.active = False
        self.binding: Optional[Binding] = None
        self.layers = self.ops_layers = None  # the planned layers; MLX's ops (the reference)
        self.native_off: Optional[str] = None  # why the steps do not run on the kernels
        self.ops_at: Dict[int, str] = {}  # layers on MLX's ops between native ones: why, by index
        self._set_watch([])
        self.refresh(force=True)

    # ----------------------------------------------------------- binding
    def refresh(self, force: bool = False) -> bool:
        """Rebind if a watched module or array changed; returns whether the lean forward is active."""
        if not force and not any(map(operator.is_not, map(operator.getitem, self._containers, self._keys), self._expected)):
            return self.active
        self.generation += 1
        self.binding, self.active = None, why_not(self.model) is None
        self._set_watch([])
        if self.active:
            n = self.native
            self.binding = bind(self.model, getattr(n, "qmm", None), getattr(n, "superblocks", None), getattr(n, "narrow", None))
            self._set_watch(self.binding.watch)
            self._plan()
        return self.active

    def use_kernels(self, native) -> None:
        """Hand in (or, with None, take away) the native kernels module; rebinds and re-plans."""
        self.native = native
        self.refresh(force=True)

    def _plan(self):
        b = self.binding
        self.ops_layers = OpsLayers(b.layers)  # the reference
        self.native_off = why_not_native(b, self.native, self.kv)
        # the layers the kernels cannot run (mixed formats, sharded, ...) run on the ops between the native ones
        self.ops_at = ops_layers(b) if self.native_off is None else {}
        self.layers = (NativeLayers(b.layers, self.native, b.contract, self.ops_at) if self.native_off is None
                       else self.ops_layers)

    def _set_watch(self, watch):
        # the per-step check runs as C-level map() loops over these three
        self._containers = [c for c, _, _ in watch]
        self._keys = [k for _, k, _ in watch]
        self._expected = [v for _, _, v in watch]

    @property
    def buffers(self) -> Dict[str, Dict[str, mx.array]]:
        """The fused groups' arrays by name (``qkv0``, ``gu0``, ..., ``head``)."""
        return self.binding.buffers() if self.binding is not None else {}

    # ------------------------------------------------------------- graph
    def __call__(self, tokens: mx.array, caches, masks, family_of, decode: bool, want: str,
                 last: Optional[mx.array] = None):
        """Logits of one step over ``tokens [B, L]``: ``want`` is "all"
        (``[B, L, V]``), "last" (at ``last [B]``: ``[B, V]``) or "none" (no
        head: None, for prefill windows). ``decode``: a decode step (L = 1,
        each cache writes one column)."""
        b = self.binding
        B, L = tokens.shape
        h = b.embed(tokens)  # [B, L, hidden]
        h = h.reshape(B * L, h.shape[-1])  # the residual stream, 2-D
        tables = StepTables(caches[0].offset, L, masks, family_of, decode)
        h = self.layers(h, caches, tables)
        if want == "none":
            return None
        h = h.reshape(B, L, -1)
        if want == "last":
            h = mx.take_along_axis(h, last[:, None, None], axis=1)[:, 0, :]  # [B, hidden]
        return b.logits(b.norm(h))
