"""Running the app: uvicorn on a socket bound before the model loads, in the
foreground (``mlx-tracer serve``) or on a background thread (tests, notebooks).

In the foreground, SIGTERM and SIGINT drain the app before uvicorn stops
(:class:`DrainingServer`, :mod:`.shutdown`); a second signal cuts at once."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import uvicorn

from ..runtime.options import DEFAULT_SHUTDOWN_GRACE, check_shutdown_grace

GRACEFUL_S = 5.0  # after the app drained: uvicorn's own wait for connections to close


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one); raises
    ValueError naming the address when it cannot be had."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        # proto named: asyncio turns Nagle's algorithm off only on sockets whose proto
        # is IPPROTO_TCP (accepted ones inherit the listener's; with proto 0 a stream's
        # first chunk after its headers waited for the client's delayed ACK on a
        # kept-alive connection: ~25 ms more to the first token); TCP_NODELAY on the
        # listener too, which Linux passes to accepted sockets, for loops that do not set it
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except (OSError, UnicodeError) as e:
        raise ValueError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}; "
                         "pick another --port or --host") from None
    return sock


def address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def model_id(path: Optional[str], default: str = "SmolLM2-135M-Instruct") -> str:
    """The name clients use for a model: its file name without ``.gguf``, or its folder's name."""
    if not path:
        return default
    p = Path(path).expanduser()
    return p.stem if p.suffix.lower() == ".gguf" else p.resolve().name


def _config(app, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=log_level, access_log=log_level in ("info", "debug", "trace"), lifespan="off",
                          timeout_graceful_shutdown=GRACEFUL_S)


class DrainingServer(uvicorn.Server):
    """uvicorn that, on SIGTERM or SIGINT, first drains the app
    (``app.shutdown.drain(grace)``: no new requests, the running ones finish
    or are cut with an error) and then stops. Unlike uvicorn it does not raise
    the signal again once stopped, so a drained server exits 0.

    ``stop_when``: polled every 0.1 s on the event loop; a reason (a string)
    stops the server at once: no new requests, the open ones cut (a sharded
    server whose engine failed or waits on a lost peer: :mod:`.ranks`)."""

    def __init__(self, config: uvicorn.Config, grace: float = DEFAULT_SHUTDOWN_GRACE,
                 stop_when: Optional[Callable[[], Optional[str]]] = None):
        super().__init__(config)
        self.stop_when = stop_when
        self.app_shutdown = config.app.shutdown  # the app is create_app's (uvicorn has a shutdown method)
        self.grace = check_shutdown_grace(grace)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._drain: Optional[asyncio.Task] = None

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def on_tick(self, counter: int) -> bool:
        if self.stop_when is not None and self._drain is None:
            why = self.stop_when()
            if why:  # no grace: the engine will not finish the open requests
                self._drain = self._loop.create_task(self._drain_then_exit(why, grace=0.0))
        return await super().on_tick(counter)

    def handle_exit(self, sig, frame):
        # a signal handler runs between two bytecodes of the loop's thread: hand over to the loop
        self.drain_soon(signal.Signals(sig).name)

    def drain_soon(self, why: str = "stop"):
        """Drain, then stop (any thread; before the loop runs: stop at once).
        A second call cuts the open requests without waiting out the grace."""
        if self._loop is None:
            self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self._begin_drain, why)

    def _begin_drain(self, why: str):
        if self._drain is None:
            self._drain = self._loop.create_task(self._drain_then_exit(why))
        else:
            self.app_shutdown.hurry()

    async def _drain_then_exit(self, why: str, grace: Optional[float] = None):
        grace = self.grace if grace is None else grace
        try:
            if not grace:
                print(f"mlx-tracer serve: {why}: stopping; cutting the {len(self.app_shutdown.open)} running requests",
                      file=sys.stderr, flush=True)
                await self.app_shutdown.drain(0.0)
                return
            print(f"mlx-tracer serve: {why}: taking no new requests; {len(self.app_shutdown.open)} running get up to "
                  f"{self.grace:g} s to finish (a second signal cuts them now)", file=sys.stderr, flush=True)
            await self.app_shutdown.drain(self.grace)
        finally:
            self.should_exit = True


def run(app, sock: socket.socket, log_level: str = "warning", grace: float = DEFAULT_SHUTDOWN_GRACE,
        stop_when: Optional[Callable[[], Optional[str]]] = None):
    """Serve ``app`` (from :func:`~.app.create_app`) on ``sock`` until SIGTERM or
    SIGINT (or ``stop_when`` gives a reason), then drain it for up to ``grace``
    seconds (:class:`DrainingServer`)."""
    DrainingServer(_config(app, log_level), grace, stop_when).run(sockets=[sock])


class BackgroundServer:
    """``app`` (from :func:`~.app.create_app`) served on a thread, on 127.0.0.1
    and a free port by default::

        with BackgroundServer(create_app(worker)) as server:
            httpx.get(server.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = bind(host, port)
        self.url = address(self.sock)
        self.server = DrainingServer(_config(app, log_level))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="mlx-tracer-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0, grace: Optional[float] = None):
        """Stop serving; with ``grace``, drain first as on a signal (running
        requests get ``grace`` seconds, then are cut)."""
        if grace is not None and self.server.started and self.thread.is_alive():
            self.server.grace = check_shutdown_grace(grace)
            self.server.drain_soon()
        else:
            self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
