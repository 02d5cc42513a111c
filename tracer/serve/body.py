"""Reading a request's JSON body within bounds, before anything big is held or parsed.

Two limits, each checked before the step it protects:

- **size**: ``Content-Length`` when the client sends one (answered 413 before
  a byte of the body is read), otherwise the bytes counted as a chunked body
  arrives (413 as soon as they pass the limit), so no body past the limit is
  ever held whole;
- **nesting**: Python's JSON parser recurses once per level (100,000 ``[``
  raise ``RecursionError``), so the depth is measured first without recursion:
  strings are cut out by one regular expression, and a running sum of the
  brackets left gives the deepest level (400 past :data:`MAX_JSON_DEPTH`).
"""

from __future__ import annotations

import json
import re

import numpy as np
from starlette.requests import Request

from .errors import too_deep, too_large
from .protocol import parse_json_error

MAX_JSON_DEPTH = 64  # a chat body nests 4 deep; OpenAI's deepest (tool schemas, refused here) rarely pass 10
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)  # one JSON string (possessive: linear time)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (413) once it is known to pass ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth(body: bytes) -> int:
    """How deep arrays and objects nest in a JSON text (0: a scalar), in linear
    time and without recursion. Meant for a guard: on invalid JSON the count
    may be off, and the parser that runs next says what is wrong."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    b = np.frombuffer(brackets, np.uint8)
    steps = (b == ord("[")) | (b == ord("{"))  # the rest are closing brackets
    return int(np.cumsum(steps.astype(np.int32) * 2 - 1).max())


async def read_json(request: Request, max_bytes: int, max_depth: int = MAX_JSON_DEPTH):
    """The request's body parsed as JSON; raises :class:`~.errors.APIError`
    (413 too large, 400 too deep or not JSON)."""
    body = await read_body(request, max_bytes)
    if json_depth(body) > max_depth:
        raise too_deep(max_depth)
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise parse_json_error(e) from None
    except RecursionError:  # only if the guard above miscounted
        raise too_deep(max_depth) from None
