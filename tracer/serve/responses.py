"""OpenAI response bodies: chat completions and text completions, whole or
as stream chunks, with ``usage`` and the chosen tokens' log-probabilities."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

LOGPROB_FLOOR = -9999.0  # JSON has no -inf (OpenAI reports -9999.0 too)


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
    def completion(self, text: str, finish_reason: str, usage: Usage,
                   logprobs: Optional[List[Tuple[str, float]]] = None) -> dict:
        if self.endpoint == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None if logprobs is None else chat_logprobs(logprobs), "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None if logprobs is None else text_logprobs(logprobs),
                      "finish_reason": finish_reason}
        return dict(self._head(self._object), choices=[choice], usage=usage.body())

    # ---------------------------------------------------------- stream chunks
    def chunk(self, text: str, finish_reason: Optional[str] = None, logprobs: Optional[List[Tuple[str, float]]] = None,
              first: bool = False, offset: int = 0, usage: bool = False) -> dict:
        """A stream chunk; ``usage=True`` adds ``"usage": null`` (include_usage streams)."""
        if self.endpoint == "chat":
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text or not finish_reason else {})
            choice = {"index": 0, "delta": delta, "logprobs": None if not logprobs else chat_logprobs(logprobs),
                      "finish_reason": finish_reason}
            out = dict(self._head("chat.completion.chunk"), choices=[choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None if not logprobs else text_logprobs(logprobs, offset),
                      "finish_reason": finish_reason}
            out = dict(self._head("text_completion"), choices=[choice])
        if usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        """The last chunk of an include_usage stream: no choices, the usage."""
        obj = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        return dict(self._head(obj), choices=[], usage=usage.body())


def chat_logprobs(items: List[Tuple[str, float]]) -> dict:
    return {"content": [{"token": t, "logprob": _finite(lp), "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                        for t, lp in items]}


def text_logprobs(items: List[Tuple[str, float]], offset: int = 0) -> dict:
    offsets, at = [], offset
    for t, _ in items:
        offsets.append(at)
        at += len(t)
    return {"tokens": [t for t, _ in items], "token_logprobs": [_finite(lp) for _, lp in items],
            "top_logprobs": None, "text_offset": offsets}


def _finite(lp: float) -> float:
    return max(float(lp), LOGPROB_FLOOR) if lp == lp else LOGPROB_FLOOR


def sse(data) -> bytes:
    """One server-sent event carrying ``data`` (a dict as JSON, or a string as is)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode("utf-8")


DONE = sse("[DONE]")
