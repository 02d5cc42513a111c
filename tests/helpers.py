"""Helpers shared by several test modules (test modules never import each other)."""

from __future__ import annotations

import sys
from pathlib import Path

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
FRANCE = "What is the capital of France? Answer in one sentence."

# the console script of the environment running the tests
CLI = str(Path(sys.executable).parent / "mlx-tracer")


def model_present() -> bool:
    """Whether the SmolLM2 GGUF (or $MLX_TRACER_MODEL) is there and valid."""
    from mlx_tracer.loading.store import is_valid_model_file, resolve_model

    try:
        return is_valid_model_file(resolve_model())
    except FileNotFoundError:
        return False
