"""mlx-tracer: compile-once LLM decode for MLX.

The import package ``mlx_tracer`` is this folder (``tracer/``); its
sub-packages ``mlx_tracer.caches`` (static-shape KV storage and per-forward
masks) and ``mlx_tracer.adapters`` (what a model sees while it is traced) live
in the top-level folders ``caches/`` and ``adapters/``.
"""

__version__ = "0.1.0"

# First, before anything imports mlx: bind MLX's CPU matmuls to a fast BLAS.
from . import blas as _blas

_blas.activate()

from .api import Completion, GenerationEvent, Generator, batch_generate, generate, load, stream_generate
from .runtime.engine import Engine
from .runtime.sampling import SamplingParams
from .runtime.step import CompiledModel, TraceKey

__all__ = [
    "CompiledModel",
    "Completion",
    "Engine",
    "GenerationEvent",
    "Generator",
    "SamplingParams",
    "TraceKey",
    "batch_generate",
    "generate",
    "load",
    "stream_generate",
]
