"""What a user receives from a Generator: token events, completions, streams."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Tuple

if TYPE_CHECKING:
    from .router import EventRouter


@dataclass
class GenerationEvent:
    """One generated token of one request, with its text delta (``token`` is
    None on the last event of a cancelled request)."""

    uid: int
    token: Optional[int]
    text: str
    logprob: Optional[float]
    finish_reason: Optional[str] = None  # None, "stop", "length" or "cancelled"
    top_logprobs: Optional[List[Tuple[int, float]]] = None  # (token id, log-probability), when asked for


@dataclass
class Completion:
    """A finished request."""

    uid: int
    text: str
    tokens: List[int]
    logprobs: List[float]
    finish_reason: str
    prompt_tokens: int
    top_logprobs: List[List[Tuple[int, float]]] = field(default_factory=list)  # per token, when asked for


class TokenStream:
    """The events of one request, as an iterator.

    Closing it before its last event (``break`` out of a ``for``, ``.close()``,
    an exception such as Ctrl-C in the loop body, or dropping it) cancels the
    request: its row is freed at the next step, and other requests lose nothing.
    """

    def __init__(self, router: "EventRouter", uid: int):
        self.router, self.uid, self.done = router, uid, False

    def __iter__(self):
        return self

    def __next__(self) -> GenerationEvent:
        if self.done:
            raise StopIteration
        ev = self.router.next_event(self.uid)
        if ev.finish_reason is not None:
            self.done = True
            self.router.forget(self.uid)
        return ev

    def close(self):
        if not self.done:
            self.done = True
            self.router.abandon(self.uid)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to cancel
            pass
