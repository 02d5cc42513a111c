"""The machine under MLX: what must be in place before a model runs well.

* :mod:`mlx_tracer.backend.blas`: binds MLX's CPU matmuls to a fast BLAS; it
  must run before ``mlx.core`` is first imported, so ``import mlx_tracer``
  does it first thing;
* :mod:`mlx_tracer.backend.jit`: whether ``mx.compile`` can trace once here
  (on the CPU it needs ``g++``); :func:`~mlx_tracer.backend.jit.check_compiler`
  runs before a model loads.

Importing this package imports neither module.
"""
