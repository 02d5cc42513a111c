"""Stopping without cutting answers short: drain, then cut what is left.

When the server is told to stop (SIGTERM or SIGINT, :mod:`.server`), the app
stops taking generation requests (503 with ``Retry-After``; ``/health`` says
"draining"), gives the requests running to the end of a grace period, then
cuts each one still open: :meth:`Shutdown.drain` puts a :class:`~.jobs.Cut`
on its queue, and its handler answers it as it would a timeout (a stream: an
error event and ``data: [DONE]``; a whole answer: 503), cancels it in the
engine and logs one line. Everything runs on the event loop: no locks.
"""

from __future__ import annotations

import asyncio
import time
from typing import Set

from .jobs import Cut

SETTLE_S = 5.0  # after the cut: time for handlers to write their last events


class Shutdown:
    """The app's stop state and its open generation requests (their sessions)."""

    def __init__(self):
        self.draining = False  # no new generation requests
        self.grace = 0.0  # of the drain under way (for the cut's log line)
        self.open: Set[object] = set()  # sessions registered by the handlers
        self._hurry = False

    def opened(self, session):
        self.open.add(session)

    def closed(self, session):
        self.open.discard(session)

    def hurry(self):
        """End the grace period now (a second signal)."""
        self._hurry = True

    async def drain(self, grace: float) -> int:
        """Refuse new requests, wait up to ``grace`` seconds for the open ones,
        cut the rest and wait (briefly) for their handlers to finish; returns
        how many were cut."""
        self.draining, self.grace = True, grace
        await self._settle(time.monotonic() + grace)
        left = list(self.open)
        for session in left:
            session.job.queue.put_nowait(Cut())
        await self._settle(time.monotonic() + SETTLE_S, hurry=False)
        return len(left)

    async def _settle(self, until: float, hurry: bool = True):
        while self.open and time.monotonic() < until and not (hurry and self._hurry):
            await asyncio.sleep(0.02)
