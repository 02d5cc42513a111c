"""Running the app: uvicorn on a socket bound before the model loads, in the
foreground (``mlx-tracer serve``) or on a background thread (tests, notebooks)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Optional

import uvicorn

GRACEFUL_S = 5.0  # on Ctrl-C, open streams get this long before they are cut


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one); raises
    ValueError naming the address when it cannot be had."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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


def run(app, sock: socket.socket, log_level: str = "warning"):
    """Serve ``app`` on ``sock`` until interrupted (Ctrl-C)."""
    uvicorn.Server(_config(app, log_level)).run(sockets=[sock])


class BackgroundServer:
    """``app`` served on a thread, on 127.0.0.1 and a free port by default::

        with BackgroundServer(create_app(worker)) as server:
            httpx.get(server.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = bind(host, port)
        self.url = address(self.sock)
        self.server = uvicorn.Server(_config(app, log_level))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="mlx-tracer-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0):
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
