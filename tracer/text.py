"""Incremental text of one request: a streaming detokenizer plus stop strings."""

from __future__ import annotations

import copy
from typing import Optional, Sequence


class TextStream:
    """The text a request has produced so far, released in deltas.

    Text that could still become a stop string is held back until it cannot;
    once a stop string appears, the text ends just before it.
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.detok = copy.copy(tokenizer.detokenizer)
        self.detok.reset()
        self.stop = [s for s in stop if s]
        self.text = ""
        self.sent = 0

    def add(self, token: Optional[int], final: bool) -> tuple:
        """Feed one token (None: none) -> ``(delta, hit_stop)``."""
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
