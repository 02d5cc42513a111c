"""A request in flight between the HTTP front end and the engine thread, and
the messages the engine thread sends it.

A :class:`Job` is created by a handler (event-loop thread) and then worked on
by the engine thread. Ownership of its fields is split, never shared:

- the handler owns ``queue`` (it only reads it) and the fields set at creation;
- the engine thread owns everything under "engine thread" below, and puts
  messages on ``queue`` only through ``loop.call_soon_threadsafe``.

Messages, in order: one :class:`Admitted` or :class:`Rejected`; then, after
``Admitted``, one :class:`Delta` per generated token and a :class:`Finished`
per choice (``index``: which of the request's ``n``; a Finished with an
``error`` ends them all).
The queue is unbounded: the engine thread never waits for a slow client. The
front end itself may put one :class:`Cut` (on its own loop) when the server
stops before the request is over (:mod:`.shutdown`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import List, Optional

from .errors import APIError
from .protocol import GenerationSpec
from .responses import TokenLogprob


@dataclass
class Admitted:
    """The request passed the engine thread's checks and is queued for a row."""

    prompt_tokens: int
    cached_tokens: int  # of them, served by the prefix cache


@dataclass
class Rejected:
    """The request cannot run (answered before the response starts)."""

    error: APIError


@dataclass
class Delta:
    """One token's text (possibly empty: held back or a stop token) of choice
    ``index`` and, when asked for, the token's log-probability (and alternatives)."""

    text: str
    logprob: Optional[TokenLogprob] = None
    index: int = 0


@dataclass
class Finished:
    """The request is over: ``reason`` is "stop", "length", or "cancelled"
    (then ``error`` says why, when the server ended it)."""

    reason: str
    completion_tokens: int
    error: Optional[APIError] = None
    index: int = 0  # the choice


@dataclass
class Cut:
    """The server is stopping and the shutdown grace ran out (put by the front end)."""


Message = object  # one of Admitted, Rejected, Delta, Finished, Cut


@dataclass
class Job:
    """One request's generation (see module docstring for who owns what)."""

    spec: GenerationSpec
    loop: asyncio.AbstractEventLoop
    received_at: float  # time.perf_counter() when the request arrived
    prompt: List[int] = field(default_factory=list)  # the whole prompt's token ids (tokenized by the front end)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # engine thread
    uids: List[int] = field(default_factory=list)  # the engine's request id of each choice, once submitted
    finished: int = 0  # choices finished
    cached: int = 0  # leading prompt tokens that came from the prefix cache
    stop_ids: frozenset = frozenset()
    started: bool = False  # got its first event (left the queue)
    abandoned: bool = False  # the front end stopped listening: deliver nothing more
    done: bool = False
