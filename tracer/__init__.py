"""mlx-tracer: compile-once LLM decode for MLX.

The import package ``mlx_tracer`` is this folder (``tracer/``); its
sub-packages ``mlx_tracer.caches`` (static-shape KV storage and per-forward
masks) and ``mlx_tracer.adapters`` (what a model sees while it is traced) live
in the top-level folders ``caches/`` and ``adapters/``.

Importing the package (or any sub-package) binds MLX's CPU matmuls to a fast
BLAS first (:mod:`mlx_tracer.backend.blas`: it must happen before mlx is
imported) and nothing else: the public names below load their modules on
first use, so ``import mlx_tracer.caches`` does not pull in the runtime, the
model loaders or the benchmark.
"""

from importlib import import_module as _import_module

__version__ = "0.5.39"

# First, before anything imports mlx: bind MLX's CPU matmuls to a fast BLAS.
from .backend import blas as _blas

_blas.activate()

# public name -> the module that defines it (relative to this package)
_EXPORTS = {
    "Completion": ".api",
    "GenerationEvent": ".api",
    "Generator": ".api",
    "batch_generate": ".api",
    "generate": ".api",
    "load": ".api",
    "stream_generate": ".api",
    "TokenStream": ".api",
    "Engine": ".runtime.engine",
    "SamplingParams": ".runtime.sampling",
    "CompiledModel": ".runtime.step",
    "TraceKey": ".runtime.step",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
