"""Test-session setup.

Bit-exactness against mlx-lm is defined with MLX's own (reference) BLAS: an
optimized BLAS blocks its sums by matrix size, so results shift by an ulp
between batch widths and buffer lengths. The in-process suite therefore pins
the reference BLAS (``MLX_TRACER_BLAS=0``) before mlx_tracer (and so mlx) is
imported; tests/test_fast_path.py checks the fast BLAS in subprocesses.
"""

import os

os.environ.setdefault("MLX_TRACER_BLAS", "0")

import mlx_tracer  # noqa: E402,F401  (before anything imports mlx)
