"""``Generator``: a model, its tokenizer and one compiled decode loop, for users.

It turns text into requests (chat template, stop strings, sampling options,
all checked before anything runs), runs the :class:`~mlx_tracer.runtime.engine.Engine`
and routes every token event to its own request: to the request's stream
(:class:`TokenStream`) or to :meth:`Generator.events`. Nothing is dropped when
a consumer stops early; a stream closed early cancels its own request only.
"""

from __future__ import annotations

from functools import partial
from operator import methodcaller
from pathlib import Path
from typing import Iterator, List, Mapping, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from .caches import DEFAULT_CAPACITIES
from .runtime.distributed import Lockstep, init_group, load_sharded, shard_model
from .runtime.engine import Engine, RetireHook
from .runtime.options import (
    DEFAULT_BUCKETS, DEFAULT_DRAFT_TOKENS, DEFAULT_KV_GROUP_SIZE, DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_CHUNKS, DEFAULT_PREFILL_STEP_TOKENS,
    DEFAULT_SPEC_POLICY,
    GeneratorOptions, OptionError, check_capacities, check_generator_options, check_max_tokens, check_stop_strings,
    check_system, check_token_ids, is_draft_path,
)
from .runtime.prefix_cache import PrefixCache
from .runtime.sampling import SamplingParams
from .stream import Completion, GenerationEvent, TokenStream
from .router import EventRouter
from .text import TextStream

Prompt = Union[str, Sequence[int]]


class Generator:
    """A model, its tokenizer and one compiled decode loop.

    Args:
        model, tokenizer: an mlx-lm model and its (mlx-lm wrapped) tokenizer.
        buckets: batch-width buckets (default 1, 2, 4, 8).
        prefill_chunks: static prefill window lengths.
        prefill_step_tokens: with rows running, newcomers are prefilled in
            windows of at most this many tokens together between decode steps (0: whole;
            see :class:`~mlx_tracer.runtime.engine.Engine`).
        capacities: capacity buckets of full-attention caches.
        chat: apply the tokenizer's chat template to string prompts
            (default: when the tokenizer has one).
        system: the system message of chat prompts.
        speculative: ``"prompt-lookup"`` for batched speculative decoding
            (see :class:`~mlx_tracer.runtime.engine.Engine`); None: off.
        draft_tokens: the most drafts per row and verify step.
        spec_policy: ``"auto"`` (verify steps when they pay) or ``"always"``.
        distributed: run as one rank of a sharded model (see
            :mod:`mlx_tracer.runtime.distributed`): ``True`` joins the group
            ``mlx.launch`` started, or pass an ``mx.distributed.Group``. The
            model is sharded in place (unless it already is); every rank must
            then get the same requests in the same order, and only
            :attr:`is_primary` (rank 0) should print.
        on_retire, prefix_cache: as on :class:`~mlx_tracer.runtime.engine.Engine`
            (a prefix cache serves string and token prompts alike).
        kv_bits, kv_group_size, kv_dtype: the caches' K/V storage, as on
            :class:`~mlx_tracer.runtime.engine.Engine` (e.g. ``kv_bits=8``).

    Options are checked once, before anything runs
    (:func:`~mlx_tracer.runtime.options.check_generator_options`).
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
        speculative=None,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        spec_policy: str = DEFAULT_SPEC_POLICY,
        distributed: Union[bool, "mx.distributed.Group"] = False,
        on_retire: Optional[RetireHook] = None,
        prefix_cache: Optional[PrefixCache] = None,
        prefill_step_tokens: int = DEFAULT_PREFILL_STEP_TOKENS,
        kv_bits: Optional[int] = None,
        kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
        kv_dtype: Optional[str] = None,
    ):
        options = check_generator_options(buckets, prefill_chunks, chat, system, speculative, draft_tokens, spec_policy,
                                          prefill_step_tokens, kv_bits, kv_group_size, kv_dtype)
        capacities = check_capacities(capacities)
        if is_draft_path(speculative):
            from .loading import load_model

            speculative = load_model(speculative, weights="as-is")[0]
        self._build(model, tokenizer, options, speculative, capacities, distributed, on_retire, prefix_cache)

    def _build(self, model, tokenizer, options: GeneratorOptions, speculative, capacities=DEFAULT_CAPACITIES,
               distributed=False, on_retire=None, prefix_cache=None):
        self.model = model
        self.tokenizer = tokenizer
        self.lockstep: Optional[Lockstep] = None
        engine_kwargs = dict(speculative=speculative, capacities=capacities, on_retire=on_retire, prefix_cache=prefix_cache)
        if distributed is False:
            self.engine = Engine.from_options(model, options.engine, **engine_kwargs)
        else:
            group = init_group() if distributed is True else distributed
            shard_model(model, group)
            self.lockstep = lock = Lockstep(group)
            rng = np.random.default_rng(lock.shared_seed())
            self.engine = lock.collective("probing the sharded model", Engine.from_options, model, options.engine,
                                          rng=rng, **engine_kwargs)
        self.chat = getattr(tokenizer, "has_chat_template", False) if options.chat is None else options.chat
        self.system = options.system
        # engine.step looked up at each call, with no closure over self: the model's
        # memory goes when the Generator does, not at the next cyclic collection
        step = partial(methodcaller("step"), self.engine) if self.lockstep is None else partial(self.lockstep.step, self.engine)
        self.router = EventRouter(self.engine, step)

    @classmethod
    def load(cls, path: Optional[Union[str, Path]] = None, progress: bool = True, weights: str = "auto",
             distributed: bool = False, speculative=None, capacities: Sequence[int] = DEFAULT_CAPACITIES,
             on_retire: Optional[RetireHook] = None, prefix_cache: Optional[PrefixCache] = None,
             log=lambda s: None, **options) -> "Generator":
        """Load a model (see :func:`~mlx_tracer.api.load`; ``weights="auto"`` by
        default) into a Generator. The options are checked before the model loads.
        ``distributed=True``: one rank of a sharded model started by
        ``mlx.launch`` (a model ``shard()`` cannot split fails with a
        ``ValueError`` before any work)."""
        from .loading import load_model

        checked = check_generator_options(speculative=speculative, **options)
        capacities = check_capacities(capacities)
        log(f"loading {path or 'the default model (SmolLM2-135M-Instruct)'} ...")
        kwargs = dict(capacities=capacities, on_retire=on_retire, prefix_cache=prefix_cache)
        if distributed:
            if is_draft_path(speculative):
                raise OptionError("speculative", "a draft model is not supported with distributed=True yet: "
                                                 "use speculative='prompt-lookup'")
            model, tokenizer, group = load_sharded(load_model, path, progress=progress, weights=weights, log=log)
            return cls._from_options(model, tokenizer, checked, speculative, distributed=group, **kwargs)
        model, tokenizer = load_model(path, progress=progress, weights=weights, log=log)
        if is_draft_path(speculative):  # the draft model in the target's weight format
            speculative = load_model(speculative, progress=progress, weights=model.mlx_tracer_weights, log=log)[0]
        return cls._from_options(model, tokenizer, checked, speculative, **kwargs)

    @classmethod
    def _from_options(cls, model, tokenizer, options: GeneratorOptions, speculative, **kwargs) -> "Generator":
        gen = cls.__new__(cls)
        gen._build(model, tokenizer, options, speculative, **kwargs)
        return gen

    @property
    def is_primary(self) -> bool:
        """Whether this process prints: always, except on ranks other than 0 of a sharded model."""
        return self.lockstep is None or self.lockstep.is_primary

    @property
    def rank(self) -> int:
        return 0 if self.lockstep is None else self.lockstep.rank

    @property
    def world_size(self) -> int:
        """Ranks the model is sharded over (1: not sharded)."""
        return 1 if self.lockstep is None else self.lockstep.size

    @property
    def weights(self) -> str:
        return getattr(self.model, "mlx_tracer_weights", "as-is")

    # -------------------------------------------------------------- prompts
    def encode(self, prompt: Prompt, chat: Optional[bool] = None, system: Optional[str] = None) -> List[int]:
        """Token ids of a prompt: strings through the chat template (when on)."""
        if not isinstance(prompt, str):
            return check_token_ids(prompt, self.engine.vocab_size)
        if not prompt.strip():
            raise OptionError("prompt", "empty prompt: give some text")
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

    def check_prompt(self, prompt: Prompt, max_tokens: int = DEFAULT_MAX_TOKENS, chat: Optional[bool] = None,
                     system: Optional[str] = None) -> List[int]:
        """The token ids of ``prompt`` (as :meth:`encode`), after checking that
        they and ``max_tokens`` fit a row (the model's context length, the
        largest capacity): a prompt that cannot run is refused here, before
        any trace. Raises ``OptionError`` as :meth:`submit` would."""
        ids = self.encode(prompt, chat, check_system(system))
        self.engine.check_room(len(ids), max_tokens)
        return ids

    # ------------------------------------------------------------- requests
    def submit(
        self,
        prompt: Prompt,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temp: float = 0.0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        top_k: int = 0,
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = (),
        stop_tokens: Optional[Sequence[int]] = None,
        chat: Optional[bool] = None,
        system: Optional[str] = None,
        cache: Optional[Sequence] = None,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Optional[Mapping[int, float]] = None,
        top_logprobs: int = 0,
        _streamed: bool = False,
    ) -> int:
        """Queue a request (it joins the running batch at the next step).
        ``stop``: a string or a list of strings that end the text.
        ``cache``: serial mlx-lm caches holding the context before ``prompt``
        (see :meth:`Engine.add <mlx_tracer.runtime.engine.Engine.add>`).
        ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
        ``logit_bias`` ``{token id: bias}``: mlx-lm's logits processors (see
        :class:`~mlx_tracer.runtime.sampling.SamplingParams`); ``top_logprobs``:
        alternatives per token in the events and the completion (0 .. 20)."""
        return self.submit_choices(
            prompt, 1, max_tokens=max_tokens, temp=temp, top_p=top_p, min_p=min_p, top_k=top_k, seed=seed, stop=stop,
            stop_tokens=stop_tokens, chat=chat, system=system, cache=cache, repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, logit_bias=logit_bias,
            top_logprobs=top_logprobs, _streamed=_streamed)[0]

    def submit_choices(
        self,
        prompt: Prompt,
        n: int,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temp: float = 0.0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        top_k: int = 0,
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = (),
        stop_tokens: Optional[Sequence[int]] = None,
        chat: Optional[bool] = None,
        system: Optional[str] = None,
        cache: Optional[Sequence] = None,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Optional[Mapping[int, float]] = None,
        top_logprobs: int = 0,
        _streamed: bool = False,
    ) -> List[int]:
        """Queue ``n`` completions of one prompt (as :meth:`submit`; prefilled
        once, see :meth:`Engine.add_choices <mlx_tracer.runtime.engine.Engine.add_choices>`);
        returns their uids, choice 0 first. Choice ``i`` samples with ``seed + i``."""
        sampling = SamplingParams(temperature=temp, top_p=top_p, min_p=min_p, top_k=top_k, seed=seed,
                                  repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                  frequency_penalty=frequency_penalty, logit_bias=logit_bias, top_logprobs=top_logprobs)
        stop = check_stop_strings(stop)
        # token prompts and max_tokens are checked by engine.add, before it changes anything
        tokens = self.encode(prompt, chat, check_system(system)) if isinstance(prompt, str) else prompt
        stops = self.tokenizer.eos_token_ids if stop_tokens is None else stop_tokens
        uids = self.engine.add_choices(tokens, n, max_tokens, sampling, stops, cache=cache)
        for uid in uids:
            self.router.track(uid, len(tokens), TextStream(self.tokenizer, stop), streamed=_streamed)
        return uids

    def cancel(self, uid: int):
        """End a queued or running request: its row is freed at the next step
        and it finishes with ``finish_reason="cancelled"`` (:meth:`result`
        gives its completion at once)."""
        self.router.cancel(uid)

    def events(self) -> Iterator[GenerationEvent]:
        """Run the loop until every submitted request is done, yielding each
        token of the requests submitted with :meth:`submit` (streams get their
        own). Leaving the loop early loses nothing: the next call goes on."""
        while True:
            if self.router.outbox:
                yield self.router.outbox.popleft()
            elif self.engine.has_work():
                self.router.pump()
            else:
                return

    def step(self) -> List[GenerationEvent]:
        """One engine step; returns the events it gave requests submitted with
        :meth:`submit` (streams get their own). For a loop that does other
        work between steps, such as a server's engine thread."""
        if self.engine.has_work():
            self.router.pump()
        events = list(self.router.outbox)
        self.router.outbox.clear()
        return events

    def result(self, uid: int) -> Completion:
        """The completion of a finished or cancelled request (and forget it)."""
        return self.router.result(uid)

    # ------------------------------------------------------------ mlx-lm style
    def stream_generate(self, prompt: Prompt, **kwargs) -> TokenStream:
        """The events of one request as they come; closing the stream early cancels it."""
        return TokenStream(self.router, self.submit(prompt, _streamed=True, **kwargs))

    def generate(self, prompt: Prompt, **kwargs) -> str:
        return self._run([self.submit(prompt, _streamed=True, **kwargs)])[0].text

    def batch_generate(self, prompts: Sequence[Prompt], max_tokens: Union[int, Sequence[int]] = DEFAULT_MAX_TOKENS,
                       **kwargs) -> List[Completion]:
        budgets = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        if len(budgets) != len(prompts):
            raise ValueError(f"max_tokens has {len(budgets)} entries for {len(prompts)} prompts")
        for m in budgets:
            check_max_tokens(m)
        uids = []
        try:
            for p, m in zip(prompts, budgets):
                uids.append(self.submit(p, max_tokens=m, _streamed=True, **kwargs))
        except BaseException:
            for u in uids:
                self.router.abandon(u)
            raise
        return self._run(uids)

    def _run(self, uids: List[int]) -> List[Completion]:
        """Run until the requests ``uids`` finish; an exception (Ctrl-C) cancels them."""
        try:
            while not all(self.router.finished(u) for u in uids):
                self.router.pump()
        except BaseException:
            for u in uids:
                self.router.abandon(u)
            raise
        return [self.result(u) for u in uids]

    # ---------------------------------------------------------------- stats
    def warmup(self, buckets: Optional[Sequence[int]] = None, prefill: bool = True) -> dict:
        """Trace ahead of time; returns ``{trace: ms}`` of the traces it made."""
        if self.lockstep is not None:
            return self.lockstep.collective("warmup", self.engine.warmup, buckets, prefill)
        return self.engine.warmup(buckets, prefill)

    @property
    def traces(self):
        return self.engine.snapshot().traces

    @property
    def stats(self):
        return self.engine.stats

    def cached_tokens(self, uid: int) -> int:
        """Prompt tokens of a queued or running request served from the prefix cache."""
        return self.engine.cached_tokens(uid)

    def summary(self) -> str:
        snap = self.engine.snapshot()
        s, traces = snap.stats, snap.traces
        widths = sorted({k.width for k in traces if k.kind == "decode"})
        return (
            f"prompt: {s.prefill_tokens} tokens, {s.prefill_tps:.1f} tok/s | "
            f"decode: {s.decode_tokens} tokens, {s.decode_tps:.1f} tok/s, {s.host_ms_per_step:.2f} host ms/step | "
            + (f"speculative: {s.acceptance:.0%} of {s.drafted} drafts accepted, "
               f"{s.tokens_per_verify:.2f} tokens per verify step | " if s.verify_steps else "")
            + f"traces: {snap.traces_made} (decode buckets {widths}) | "
            f"peak memory {mx.get_peak_memory() / 1e9:.3f} GB"
        )


check_options = check_generator_options  # the name the CLI and older callers use
