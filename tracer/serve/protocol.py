"""OpenAI request bodies -> :class:`GenerationSpec`, checked field by field.

Everything that needs no model is checked here, in the HTTP front end, before
a request reaches the engine thread: JSON types, ranges (through the
runtime's own validators; OpenAI's bounds for ``n``, the penalties,
``logit_bias`` and ``top_logprobs``), options this server does not support
(tools, non-text content, ``best_of``: 400 naming the parameter),
text no tokenizer takes (lone surrogates) and unknown parameters (400, as
OpenAI answers). What needs the tokenizer (chat template, prompt length
against the context) is checked by :meth:`~.worker.EngineWorker.tokenize`
beside the event loop, and what needs the engine by the engine thread; each
answers a failure to that request only.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import List, Optional, Union

from ..runtime.options import (
    DEFAULT_MAX_TOKENS, MAX_CHOICES, MAX_TOP_LOGPROBS, OptionError, check_max_tokens, check_stop_strings,
)
from ..runtime.sampling import SamplingParams
from .errors import APIError, bad_request, invalid_option, model_not_found, unsupported

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default

Messages = List[dict]  # [{"role": "system" | "user" | "assistant", "content": str}]


@dataclass
class GenerationSpec:
    """One checked request: what to generate and how to answer."""

    endpoint: str  # "chat" | "completion"
    prompt: Union[Messages, str, List[int]]  # chat messages, or a completion's text or token ids
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=DEFAULT_TEMPERATURE))
    stop: List[str] = field(default_factory=list)
    logprobs: bool = False  # the chosen token's log-probability per token (its top alternatives: sampling.top_logprobs)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    ignore_eos: bool = False  # extension (as vLLM): generate past end-of-sequence tokens
    max_tokens_param: str = "max_tokens"  # the name the request gave it (errors name it back)
    n: int = 1  # choices: completions of the prompt, prefilled once


# parameters read here; the rest of OpenAI's are refused by name below
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream", "stream_options",
           "logprobs", "n", "user", "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos",
           "repetition_penalty"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                   "function_call", "parallel_tool_calls", "response_format", "metadata", "store", "service_tier",
                   "modalities", "audio", "prediction"}
_COMPLETION = _COMMON | {"prompt", "best_of", "echo", "suffix"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def parse_chat(body, served: str) -> GenerationSpec:
    """A ``POST /v1/chat/completions`` body; raises :class:`APIError`."""
    body = _object(body)
    _known(body, _CHAT)
    _refuse_tools(body)
    if _get(body, "response_format", dict) not in (None, {"type": "text"}):
        raise unsupported("response_format", "response_format is not supported: only plain text ({'type': 'text'})")
    if _get(body, "modalities", list) not in (None, ["text"]) or body.get("audio") is not None:
        raise unsupported("modalities", "only text output is supported")
    if body.get("prediction") is not None:
        raise unsupported("prediction", "predicted outputs are not supported")
    if "messages" not in body:
        raise bad_request("missing required parameter 'messages': a list of {'role', 'content'} objects", "messages",
                          "missing_required_parameter")
    messages = _messages(body["messages"])
    top = _int(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    logprobs = bool(_get(body, "logprobs", bool) or False)
    if top and not logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _spec("chat", body, served, messages, _int(body, name, None), logprobs, name, top)


def parse_completion(body, served: str) -> GenerationSpec:
    """A ``POST /v1/completions`` body; raises :class:`APIError`."""
    body = _object(body)
    _known(body, _COMPLETION)
    if _int(body, "best_of", 1, lo=1) != 1:
        raise unsupported("best_of", "best_of > 1 is not supported: one completion per request")
    if _get(body, "echo", bool):
        raise unsupported("echo", "echo is not supported")
    if _get(body, "suffix", str):
        raise unsupported("suffix", "suffix (insertion) is not supported")
    if "prompt" not in body:
        raise bad_request("missing required parameter 'prompt': a string or a list of token ids", "prompt",
                          "missing_required_parameter")
    prompt = _prompt(body["prompt"])
    top = _int(body, "logprobs", None, lo=0, hi=5)  # legacy: the number of alternatives per token
    return _spec("completion", body, served, prompt, _int(body, "max_tokens", None), top is not None, "max_tokens",
                 top or 0)


# ----------------------------------------------------------------- pieces
def _spec(endpoint, body, served, prompt, limit, logprobs, limit_name, top_logprobs=0) -> GenerationSpec:
    model = _get(body, "model", str)
    if model is not None and model != served:
        raise model_not_found(model, served)
    n = _int(body, "n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be 1 to {MAX_CHOICES} (the completions to generate), got {n}", "n")
    try:  # the runtime's own checks, under the names this request gave
        max_tokens = check_max_tokens(DEFAULT_MAX_TOKENS if limit is None else limit, limit_name)
        sampling = SamplingParams(
            temperature=_number(body, "temperature", DEFAULT_TEMPERATURE), top_p=_number(body, "top_p", 1.0),
            min_p=_number(body, "min_p", 0.0), top_k=_int(body, "top_k", 0), seed=_int(body, "seed", None),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            logit_bias=_get(body, "logit_bias", dict), top_logprobs=top_logprobs,
        )
        stop = check_stop_strings(body.get("stop"))
    except OptionError as e:
        raise invalid_option(e) from None
    stream = bool(_get(body, "stream", bool) or False)
    options = _get(body, "stream_options", dict)
    if options is not None and not stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    include_usage = bool(_get(options or {}, "include_usage", bool, "stream_options.include_usage") or False)
    ignore_eos = bool(_get(body, "ignore_eos", bool) or False)
    return GenerationSpec(endpoint, prompt, max_tokens, sampling, stop, logprobs, stream, include_usage, ignore_eos,
                          limit_name, n)


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _known(body: dict, allowed: set):
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0], "unknown_parameter")


def _refuse_tools(body: dict):
    for name in ("tools", "functions"):
        if body.get(name):
            raise unsupported(name, f"{name} (function calling) is not supported by this server")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise unsupported(name, f"{name} is not supported: this server does not call tools")


def _messages(value) -> Messages:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list of {'role', 'content'} objects", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content', got {type(m).__name__}", where)
        role = m.get("role")
        if role in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
            raise unsupported(f"{where}.role", f"{where}: tool messages and tool calls are not supported")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of system, developer, user, assistant; got {role!r}", f"{where}.role")
        out.append({"role": _ROLES[role], "content": _content(m.get("content"), role, where)})
    return out


def _content(content, role: str, where: str) -> str:
    if content is None and role == "assistant":
        return ""
    if isinstance(content, str):
        return _encodable(content, f"{where}.content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise unsupported(f"{where}.content[{j}]", f"{where}.content[{j}]: only text content parts are supported, "
                                                          f"got {kind or type(part).__name__!r}")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{j}].text must be a string", f"{where}.content[{j}].text")
            texts.append(_encodable(part["text"], f"{where}.content[{j}].text"))
        return "".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}",
                      f"{where}.content")


def _prompt(value) -> Union[str, List[int]]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    elif isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        raise unsupported("prompt", f"a batch of {len(value)} prompts is not supported: send one request per prompt")
    if isinstance(value, str):
        if not value:
            raise bad_request("empty prompt: give some text", "prompt")
        return _encodable(value, "prompt")
    if isinstance(value, list):
        if not value:
            raise bad_request("empty prompt: give at least one token id", "prompt")
        if not all(_is_int(t) and t >= 0 for t in value):
            raise bad_request("prompt token ids must be integers >= 0", "prompt")
        return [int(t) for t in value]
    raise bad_request(f"prompt must be a string or a list of token ids, got {type(value).__name__}", "prompt")


def _encodable(text: str, param: str) -> str:
    """``text``, if UTF-8 can encode it (a JSON escape such as ``\\udcff``
    decodes to a lone surrogate, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{param} contains characters that cannot be encoded (lone surrogate "
                          f"{text[e.start]!r} at position {e.start})", param, "invalid_text") from None
    return text


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _get(body: dict, name: str, kind: type, label: Optional[str] = None):
    value = body.get(name)
    if value is None or isinstance(value, kind) and not (kind is not bool and isinstance(value, bool)):
        return value
    want = {bool: "a boolean", str: "a string", dict: "an object", list: "a list"}[kind]
    raise bad_request(f"{label or name} must be {want}, got {type(value).__name__} {value!r}"[:200], label or name)


def _int(body: dict, name: str, default, lo: Optional[int] = None, hi: Optional[int] = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)  # JSON has one number type: 16.0 means 16
    if not _is_int(value):
        raise bad_request(f"{name} must be an integer, got {type(value).__name__} {value!r}"[:200], name)
    if lo is not None and value < lo or hi is not None and value > hi:
        raise bad_request(f"{name} must be in [{lo}, {hi}], got {value}" if hi is not None else f"{name} must be >= {lo}, got {value}", name)
    return int(value)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number, got {type(value).__name__} {value!r}"[:200], name)
    return float(value)


def parse_json_error(exc: Exception) -> APIError:
    return bad_request(f"the request body is not valid JSON: {exc}", None, "invalid_json")


__all__ = ["APIError", "DEFAULT_MAX_TOKENS", "GenerationSpec", "parse_chat", "parse_completion", "parse_json_error"]
