"""Old location of :mod:`mlx_tracer.loading.store`, kept only because
tests/test_smollm2.py still imports these two names from here; delete it
once that test imports ``mlx_tracer.loading.store``."""

from .loading.store import is_valid_model_file, resolve_model

__all__ = ["is_valid_model_file", "resolve_model"]
