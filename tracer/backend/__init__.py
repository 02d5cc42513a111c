"""The machine under MLX: what must be in place before a model runs well.

* :mod:`mlx_tracer.backend.blas`: binds MLX's CPU matmuls to a fast BLAS; it
  must run before ``mlx.core`` is first imported, so ``import mlx_tracer``
  does it first thing. Importing this package imports nothing else.
"""
