"""ASGI middleware around the routes: counting responses, and the API key."""

from __future__ import annotations

import hmac
from typing import Optional

from starlette.responses import JSONResponse

from .errors import unauthorized

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class CountResponses:
    """Counts responses by route and status code, each once: a handler that
    fails before its response starts counts as the 500 the app answers."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        path = path if path in ROUTES else "/v1/models/{name}" if path.startswith("/v1/models/") else "other"
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.count_response(path, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:  # Starlette's error middleware sends its 500 through counting_send first
                self.metrics.count_response(path, 500)
            raise


class RequireKey:
    """Answers 401 to a ``/v1/*`` request without ``Authorization: Bearer <key>``
    (what OpenAI's clients send); ``/health`` and ``/metrics`` stay open. The
    key is compared in constant time. ``key=None``: everything is open."""

    def __init__(self, app, key: Optional[str]):
        self.app = app
        self.key = key.encode("utf-8") if key else None

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            return await self.app(scope, receive, send)
        given = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                given = token.strip() if scheme.lower() == b"bearer" else b""
        if given is None:
            error = unauthorized("missing API key: send the header 'Authorization: Bearer <key>' "
                                 "(this server was started with --api-key)")
        elif not hmac.compare_digest(given, self.key):
            error = unauthorized("incorrect API key provided")
        else:
            return await self.app(scope, receive, send)
        response = JSONResponse(error.body(), status_code=error.status, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
