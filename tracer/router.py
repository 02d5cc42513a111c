"""Routing: every token event of the engine goes to its own request.

The engine emits the events of all running rows per step. The router turns
each into a :class:`GenerationEvent` (text delta, stop strings) and delivers
it to that request's stream, or to the shared outbox that
``Generator.events()`` drains — all events of a step before any is handed
out, so a consumer that stops early (a ``break``, Ctrl-C) costs no other
request a token. A request nobody will read any more (a closed stream) is
cancelled and forgotten once it finished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional

from .runtime.requests import TokenEvent
from .stream import Completion, GenerationEvent
from .text import TextStream


@dataclass
class _Live:
    """A request the router still tracks (until its result is taken)."""

    uid: int
    prompt_tokens: int
    text: TextStream
    streamed: bool = False  # its events go to its own stream, not to events()
    pending: Deque[GenerationEvent] = field(default_factory=deque)  # delivered, not yet consumed
    completion: Optional[Completion] = None
    discard: bool = False  # nobody will read it (a closed stream): forget it once finished
    cancelled: bool = False  # cancel() was called: it finishes as "cancelled" at the next step
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    top_logprobs: List[list] = field(default_factory=list)


class EventRouter:
    """Delivers the engine's events to their requests (see module docstring).

    Args:
        engine: the :class:`~mlx_tracer.runtime.engine.Engine` (for cancels).
        step: runs one engine step and returns its events.
    """

    def __init__(self, engine, step: Callable[[], List[TokenEvent]]):
        self.engine = engine
        self.step = step
        self.live: Dict[int, _Live] = {}
        self.outbox: Deque[GenerationEvent] = deque()  # events of requests that are not streamed

    def track(self, uid: int, prompt_tokens: int, text: TextStream, streamed: bool):
        self.live[uid] = _Live(uid, prompt_tokens, text, streamed=streamed)

    def pump(self):
        """One engine step; every event goes to its request (none dropped)."""
        for ev in self.step():
            self.route(ev)

    def route(self, ev: TokenEvent):
        live = self.live.get(ev.uid)
        if live is None or live.completion is not None:
            return  # e.g. the "cancelled" echo of a request a stop string already ended
        reason = ev.finish_reason
        if reason == "cancelled":
            delta, _ = live.text.add(None, True)
        else:
            stop_token = reason == "stop"
            delta, hit = live.text.add(None if stop_token else ev.token, reason is not None)
            if hit and reason is None:
                reason = "stop"
                self.engine.cancel(ev.uid)
            if not stop_token:  # a stop token ends the request and is not part of it
                live.tokens.append(ev.token)
                live.logprobs.append(ev.logprob)
                if ev.top_logprobs is not None:
                    live.top_logprobs.append(ev.top_logprobs)
        if reason is not None:
            live.completion = Completion(ev.uid, live.text.text, live.tokens, live.logprobs, reason, live.prompt_tokens,
                                         live.top_logprobs)
        if live.discard:
            if reason is not None:
                del self.live[ev.uid]
            return
        event = GenerationEvent(ev.uid, ev.token, delta, ev.logprob, reason, ev.top_logprobs)
        (live.pending if live.streamed else self.outbox).append(event)

    def next_event(self, uid: int) -> GenerationEvent:
        """The next event of a streamed request (running the loop until there is one)."""
        live = self.live[uid]
        while not live.pending:
            self.pump()
        return live.pending.popleft()

    def finished(self, uid: int) -> bool:
        return self.live[uid].completion is not None

    def cancel(self, uid: int):
        """End ``uid`` at the next step (``KeyError`` when it is unknown or finished)."""
        self.engine.cancel(uid)
        if uid in self.live:
            self.live[uid].cancelled = True

    def result(self, uid: int) -> Completion:
        """The completion of a finished request (and forget it). A cancelled
        one finishes at the next step: that step runs here (the events it
        gives other requests are delivered as usual)."""
        live = self.live.get(uid)
        if live is None:
            raise KeyError(f"no request {uid} (unknown, or its result was already taken)")
        while live.completion is None and live.cancelled and self.engine.has_work():
            self.pump()
        if live.completion is None:
            raise ValueError(f"request {uid} has not finished: run events() until its last event, or cancel it first")
        del self.live[uid]
        return live.completion

    def forget(self, uid: int):
        self.live.pop(uid, None)

    def abandon(self, uid: int):
        """Nobody will read ``uid`` any more: cancel it if it runs, forget it when done."""
        live = self.live.get(uid)
        if live is None:
            return
        if live.completion is not None:
            del self.live[uid]
            return
        live.discard = True
        live.pending.clear()
        try:
            self.engine.cancel(uid)
        except KeyError:  # finished in the engine already; its last event is on its way
            pass
