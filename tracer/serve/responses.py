"""OpenAI response bodies: chat completions and text completions, whole or
as stream chunks, with ``usage``, ``n`` choices and the chosen tokens'
log-probabilities (with their top alternatives when asked for)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

LOGPROB_FLOOR = -9999.0  # JSON has no -inf (OpenAI reports -9999.0 too)


@dataclass
class TokenLogprob:
    """One generated token's text and log-probability, and its most likely
    alternatives ``(text, log-probability)``, most likely first (empty: not asked for)."""

    token: str
    logprob: float
    top: List[Tuple[str, float]] = field(default_factory=list)


@dataclass
class Choice:
    """One finished choice of a whole (not streamed) answer."""

    text: str
    finish_reason: str
    logprobs: Optional[List[TokenLogprob]] = None  # None: not asked for


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class ResponseWriter:
    """Bodies of one request's response: the same id, creation time and model on each."""

    endpoint: str  # "chat" | "completion"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if not self.id:
            self.id = ("chatcmpl-" if self.endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]

    @property
    def _object(self) -> str:
        return "chat.completion" if self.endpoint == "chat" else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}

    # ---------------------------------------------------------- whole bodies
    def completion(self, choices: List[Choice], usage: Usage) -> dict:
        """The whole answer: ``choices`` in index order."""
        out = []
        for i, c in enumerate(choices):
            lps = c.logprobs
            if self.endpoint == "chat":
                out.append({"index": i, "message": {"role": "assistant", "content": c.text},
                            "logprobs": None if lps is None else chat_logprobs(lps), "finish_reason": c.finish_reason})
            else:
                out.append({"index": i, "text": c.text, "logprobs": None if lps is None else text_logprobs(lps),
                            "finish_reason": c.finish_reason})
        return dict(self._head(self._object), choices=out, usage=usage.body())

    # ---------------------------------------------------------- stream chunks
    def chunk(self, text: str, finish_reason: Optional[str] = None, logprobs: Optional[List[TokenLogprob]] = None,
              first: bool = False, offset: int = 0, usage: bool = False, index: int = 0) -> dict:
        """A stream chunk of choice ``index``; ``usage=True`` adds ``"usage": null`` (include_usage streams)."""
        if self.endpoint == "chat":
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text or not finish_reason else {})
            choice = {"index": index, "delta": delta, "logprobs": None if not logprobs else chat_logprobs(logprobs),
                      "finish_reason": finish_reason}
            out = dict(self._head("chat.completion.chunk"), choices=[choice])
        else:
            choice = {"index": index, "text": text, "logprobs": None if not logprobs else text_logprobs(logprobs, offset),
                      "finish_reason": finish_reason}
            out = dict(self._head("text_completion"), choices=[choice])
        if usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        """The last chunk of an include_usage stream: no choices, the usage."""
        obj = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        return dict(self._head(obj), choices=[], usage=usage.body())


def chat_logprobs(items: List[TokenLogprob]) -> dict:
    return {"content": [dict(_chat_token(i.token, i.logprob), top_logprobs=[_chat_token(t, lp) for t, lp in i.top])
                        for i in items]}


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def text_logprobs(items: List[TokenLogprob], offset: int = 0) -> dict:
    """Legacy completions' shape: ``top_logprobs`` is one ``{text: log-probability}`` per token (None: not asked for)."""
    offsets, at = [], offset
    for i in items:
        offsets.append(at)
        at += len(i.token)
    top = [{t: _finite(lp) for t, lp in i.top} for i in items] if any(i.top for i in items) else None
    return {"tokens": [i.token for i in items], "token_logprobs": [_finite(i.logprob) for i in items],
            "top_logprobs": top, "text_offset": offsets}


def _finite(lp: float) -> float:
    return max(float(lp), LOGPROB_FLOOR) if lp == lp else LOGPROB_FLOOR


def sse(data) -> bytes:
    """One server-sent event carrying ``data`` (a dict as JSON, or a string as is)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode("utf-8")


DONE = sse("[DONE]")
