"""The HTTP front end: a Starlette app over an :class:`~.worker.EngineWorker`.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (whole
answers or server-sent events ending with ``data: [DONE]``), ``GET
/v1/models``, ``GET /health``, ``GET /metrics``.

A handler reads the body within its bounds (:mod:`.body`), checks it
(:mod:`.protocol`), tokenizes the prompt on a worker thread, hands the request
to the engine thread and waits on the request's own queue for its messages
(:mod:`.jobs`), racing two things: the client going away (an
``http.disconnect`` on the ASGI receive channel) and the server's timeout.
Either cancels the request in the engine (its row is freed at the next step;
other requests lose nothing); so does the end of the shutdown grace
(:mod:`.shutdown`). Handlers never touch the model: no MLX call runs on the
event loop. With an API key, ``/v1/*`` needs it (:mod:`.middleware`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import AsyncIterator, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..runtime.options import DEFAULT_MAX_REQUEST_BYTES, OptionError, check_context_length, check_request_bytes
from .body import read_json
from .errors import APIError, invalid_option, shutting_down, timed_out
from .jobs import Admitted, Cut, Delta, Finished, Job, Rejected
from .middleware import CountResponses, RequireKey
from .protocol import GenerationSpec, parse_chat, parse_completion
from .responses import DONE, Choice, ResponseWriter, Usage, sse
from .shutdown import Shutdown
from .worker import EngineWorker


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


class ClientWatch:
    """Watches one request's ASGI receive channel for ``http.disconnect``
    (start it after the body has been read)."""

    def __init__(self, request: Request):
        self.gone = asyncio.ensure_future(self._listen(request.receive))

    @staticmethod
    async def _listen(receive):
        while (await receive())["type"] != "http.disconnect":
            pass

    def close(self):
        self.gone.cancel()


class Session:
    """One generation request on the front end: its job, its client and its
    deadline; registered with the server's :class:`~.shutdown.Shutdown` while open."""

    def __init__(self, worker: EngineWorker, job: Job, watch: ClientWatch, deadline: Optional[float],
                 timeout: Optional[float], shutdown: Shutdown, name: str):
        self.worker, self.job, self.watch = worker, job, watch
        self.deadline, self.timeout = deadline, timeout
        self.shutdown, self.name = shutdown, name
        self.finished = False
        self.tokens = 0  # deltas read
        shutdown.opened(self)

    async def next(self):
        """The job's next message; cancels the job and raises when the client
        left (:class:`ClientGone`), the deadline passed (504) or the server
        stops (503: the shutdown grace ran out)."""
        queue = self.job.queue
        left = None if self.deadline is None else self.deadline - time.perf_counter()
        if not queue.empty() and not self.watch.gone.done() and (left is None or left > 0):
            return self._seen(queue.get_nowait())
        get = asyncio.ensure_future(queue.get())
        done, _ = await asyncio.wait({get, self.watch.gone}, timeout=None if left is None else max(0.0, left),
                                     return_when=asyncio.FIRST_COMPLETED)
        if get in done and not self.watch.gone.done():
            return self._seen(get.result())
        get.cancel()
        self.abandon()
        if self.watch.gone.done():
            raise ClientGone()
        raise timed_out(self.timeout)

    def _seen(self, msg):
        if isinstance(msg, Cut):
            self.abandon()
            kind = "streamed" if self.job.spec.stream else "whole"
            print(f"mlx-tracer serve: shutting down: cut {kind} request {self.name} after {self.tokens} tokens "
                  f"(the {self.shutdown.grace:g} s grace ran out)", file=sys.stderr, flush=True)
            raise shutting_down()
        if isinstance(msg, Delta):
            self.tokens += 1
        if isinstance(msg, (Finished, Rejected)):
            self.finished = True
        return msg

    def abandon(self):
        """Nobody will read this job any more: cancel it unless it is over."""
        if not self.finished:
            self.finished = True
            self.worker.cancel(self.job)

    def close(self):
        self.abandon()
        self.watch.close()
        self.shutdown.closed(self)


class EventStream(Response):
    """A ``text/event-stream`` response fed by an async iterator of encoded events.
    It owns its session: closing the stream early (client gone) cancels the job."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], session: Session):
        self.events, self.session = events, session
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send):
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (ClientGone, OSError):
            pass
        finally:
            self.session.close()


class ServerApp:
    """The ASGI app of :func:`create_app`, with its :class:`~.shutdown.Shutdown`
    (``await app.shutdown.drain(grace)`` stops it gracefully; :mod:`.server` does on a signal)."""

    def __init__(self, asgi, shutdown: Shutdown):
        self.asgi, self.shutdown = asgi, shutdown

    async def __call__(self, scope, receive, send):
        await self.asgi(scope, receive, send)


def create_app(worker: EngineWorker, timeout: Optional[float] = 600.0,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, api_key: Optional[str] = None) -> ServerApp:
    """The ASGI app serving ``worker`` (started and stopped by the caller).
    ``timeout``: seconds a request may take from arrival (None: no limit);
    ``max_request_bytes``: the largest body (413 past it); ``api_key``: what
    ``/v1/*`` requests must send as ``Authorization: Bearer <key>`` (None: open)."""
    metrics = worker.metrics
    max_request_bytes = check_request_bytes(max_request_bytes)
    shutdown = Shutdown()

    async def chat_completions(request: Request):
        return await generate(request, parse_chat)

    async def completions(request: Request):
        return await generate(request, parse_completion)

    async def generate(request: Request, parse):
        received = time.perf_counter()
        if shutdown.draining:
            raise shutting_down()
        spec: GenerationSpec = parse(await read_json(request, max_request_bytes), worker.model_id)
        try:  # before tokenizing: a budget that leaves no room for any prompt
            check_context_length(None, spec.max_tokens, worker.context_limit, max_param=spec.max_tokens_param)
        except OptionError as e:
            raise invalid_option(e) from None
        ids = await asyncio.to_thread(worker.tokenize, spec)  # beside the loop: a long prompt stalls no stream
        if shutdown.draining:
            raise shutting_down()
        job = worker.submit(spec, ids, asyncio.get_running_loop(), received)
        deadline = None if timeout is None else received + timeout
        writer = ResponseWriter(spec.endpoint, worker.model_id)
        session = Session(worker, job, ClientWatch(request), deadline, timeout, shutdown, writer.id)
        try:
            first = await session.next()
            if isinstance(first, Rejected):
                raise first.error
            assert isinstance(first, Admitted), first
            usage = Usage(first.prompt_tokens, 0, first.cached_tokens)
            if spec.stream:
                stream = EventStream(_stream(session, spec, writer, usage), session)
                session = None  # the stream owns it now
                return stream
            return await _whole(session, spec, writer, usage)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; counted in the metrics
        finally:
            if session is not None:
                session.close()

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [_model_card(worker)]})

    async def model(request: Request):
        name = request.path_params["name"]
        if name != worker.model_id:
            raise APIError(404, f"The model {name!r} does not exist: this server serves {worker.model_id!r}",
                           "invalid_request_error", "model", "model_not_found")
        return JSONResponse(_model_card(worker))

    async def health(request: Request):
        if shutdown.draining:
            return JSONResponse({"status": "draining", "model": worker.model_id}, status_code=503)
        if worker.running:
            return JSONResponse({"status": "ok", "model": worker.model_id})
        return JSONResponse({"status": "unavailable", "error": str(worker.error or "stopped")}, status_code=503)

    async def metrics_text(request: Request):
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    async def api_error(request: Request, exc: APIError):
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else "http_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, message, "invalid_request_error", None, kind).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={APIError: api_error, HTTPException: http_error})
    return ServerApp(CountResponses(RequireKey(app, api_key), metrics), shutdown)


async def _whole(session: Session, spec: GenerationSpec, writer: ResponseWriter, usage: Usage) -> JSONResponse:
    texts = [[] for _ in range(spec.n)]
    logprobs = [[] if spec.logprobs else None for _ in range(spec.n)]
    reasons = [None] * spec.n
    while None in reasons:
        msg = await session.next()
        if isinstance(msg, Delta):
            texts[msg.index].append(msg.text)
            if msg.logprob is not None and logprobs[msg.index] is not None:
                logprobs[msg.index].append(msg.logprob)
        elif isinstance(msg, Finished):
            if msg.error is not None:
                raise msg.error
            usage.completion_tokens += msg.completion_tokens
            reasons[msg.index] = msg.reason
    choices = [Choice("".join(t), r, lp) for t, r, lp in zip(texts, reasons, logprobs)]
    return JSONResponse(writer.completion(choices, usage))


async def _stream(session: Session, spec: GenerationSpec, writer: ResponseWriter, usage: Usage) -> AsyncIterator[bytes]:
    with_usage = spec.include_usage
    if spec.endpoint == "chat":
        for i in range(spec.n):
            yield sse(writer.chunk("", first=True, usage=with_usage, index=i))
    offsets = [0] * spec.n  # completions' text_offset, per choice
    open_choices = spec.n
    while True:
        try:
            msg = await session.next()
        except APIError as e:  # timeout or shutdown: the response has started, so an error event ends it
            yield sse(e.body())
            yield DONE
            return
        if isinstance(msg, Delta):
            lp = [msg.logprob] if msg.logprob is not None else None
            yield sse(writer.chunk(msg.text, logprobs=lp, offset=offsets[msg.index], usage=with_usage, index=msg.index))
            offsets[msg.index] += len(msg.text)
        elif isinstance(msg, Finished):
            if msg.error is not None:
                yield sse(msg.error.body())
                yield DONE
                return
            yield sse(writer.chunk("", finish_reason=msg.reason, usage=with_usage, index=msg.index))
            usage.completion_tokens += msg.completion_tokens
            open_choices -= 1
            if open_choices:
                continue
            if with_usage:
                yield sse(writer.usage_chunk(usage))
            yield DONE
            return


def _model_card(worker: EngineWorker) -> dict:
    return {"id": worker.model_id, "object": "model", "created": 0, "owned_by": "mlx-tracer"}
