"""``mlx-tracer serve`` as a user runs it: options checked before the model
loads, and a real server process on 127.0.0.1 that Ctrl-C stops (SIGTERM with
open streams: tests/test_serve_limits.py)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from .helpers import CLI
from .serve_helpers import save_chat_model_dir


def run(*args, timeout=120):
    return subprocess.run([CLI, "serve", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--port", "70000"], "a port is 0 to 65535"),
    (["--max-queue", "0"], "--max-queue: must be > 0"),
    (["--prefix-cache-mb", "-1"], "--prefix-cache-mb: must be >= 0"),
    (["--timeout", "0"], "expected seconds > 0"),
    (["--max-request-bytes", "10"], "max_request_bytes must be in [1024, "),
    (["--shutdown-grace", "-1"], "shutdown_grace must be in [0, 3600]"),
    (["--api-key", ""], "an API key cannot be empty"),
    (["--buckets", "0"], "must be >= 1"),
    (["--spec", "magic"], "invalid choice"),
    (["--draft-model", "/no/such/draft.gguf"], "that path does not exist"),
    (["--host", "no.such.host.invalid"], "cannot listen on no.such.host.invalid"),
])
def test_bad_options_fail_before_the_model_loads(args, message):
    r = run("--model", "/no/such/model.gguf", *args)  # a load would fail differently
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]  # (argparse's usage lines may come before it)
    assert last.startswith("mlx-tracer") and message in last, r.stderr
    assert "Traceback" not in r.stderr


def test_a_busy_port_fails_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = run("--model", "/no/such/model.gguf", "--port", str(busy.getsockname()[1]))
    assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr, r.stderr


def start_serve(model, *args, env=None):
    """``(process, url, its stderr lines so far)`` of ``python -m mlx_tracer serve``
    on ``model`` and a free port, once it says where it serves (its stderr is a pipe)."""
    env = dict(os.environ, MLX_TRACER_BLAS="0", **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "mlx_tracer", "serve", "--model", str(model), "--port", "0",
                             "--weights", "as-is", *args], stderr=subprocess.PIPE, text=True, env=env)
    url, lines, t0 = None, [], time.monotonic()
    while url is None and time.monotonic() - t0 < 90:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        m = re.search(r"serving tiny at (http://127\.0\.0\.1:\d+)/v1", line)
        url = m.group(1) if m else None
    return proc, url, lines


def stop_process(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stderr.close()


def test_the_servers_connections_send_without_nagles_delay():
    """Connections accepted on the server's socket have TCP_NODELAY as asyncio
    (uvicorn's loop) sets it: it does so only where the socket's proto is
    IPPROTO_TCP, and the socket once had proto 0 — on a kept-alive connection
    a stream's first chunk after its headers then waited for the client's
    delayed ACK (first token ~48 ms instead of ~25 with
    ../shared/peers/serve_load.py on SmolLM2)."""
    import asyncio

    from mlx_tracer.serve.server import bind

    sock = bind("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    seen = []

    class Record(asyncio.Protocol):
        def connection_made(self, transport):
            seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main():
        server = await asyncio.get_running_loop().create_server(Record, sock=sock)
        reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        await reader.read()  # until the server side closes
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    assert seen == [1]


def test_python_m_mlx_tracer_serve_answers_and_stops_on_ctrl_c(tmp_path):
    proc, url, lines = start_serve(save_chat_model_dir(tmp_path / "tiny"), "--buckets", "1,2")
    try:
        assert url, "".join(lines)
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "5 6"}],
                                                           "max_tokens": 3, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0  # drained: nothing was running
    finally:
        stop_process(proc)


def test_the_server_defaults_to_buckets_for_many_clients():
    """`serve` without --buckets gets SERVE_BUCKETS (room for a burst of
    clients: 0.5.10's default widths 1,2,4,8 kept 12 of 20 requests waiting
    for a row); `generate` keeps the engine's default; --buckets still wins."""
    from mlx_tracer.cli import build_parser
    from mlx_tracer.runtime.options import DEFAULT_BUCKETS, SERVE_BUCKETS

    p = build_parser()
    assert tuple(p.parse_args(["serve"]).buckets) == SERVE_BUCKETS
    assert max(SERVE_BUCKETS) >= 32 and SERVE_BUCKETS[: len(DEFAULT_BUCKETS)] == DEFAULT_BUCKETS
    assert tuple(p.parse_args(["serve", "--buckets", "1,2"]).buckets) == (1, 2)
    assert p.parse_args(["generate", "x"]).buckets is None


def test_the_server_prefills_newcomers_in_steps_of_32_tokens_by_default():
    """`serve`'s default budget of newcomers' prompt tokens a step is
    SERVE_PREFILL_STEP_TOKENS (32: a burst's running streams waited at most
    2.2-2.3x their median gap, 2.9-3.3x at 64); the option still wins, and the
    engine's own default is unchanged."""
    from mlx_tracer.cli import build_parser
    from mlx_tracer.runtime.engine import Engine
    from mlx_tracer.runtime.options import DEFAULT_PREFILL_STEP_TOKENS, SERVE_PREFILL_STEP_TOKENS
    import inspect

    p = build_parser()
    assert p.parse_args(["serve"]).prefill_step_tokens == SERVE_PREFILL_STEP_TOKENS == 32
    assert p.parse_args(["serve", "--prefill-step-tokens", "64"]).prefill_step_tokens == 64
    assert inspect.signature(Engine).parameters["prefill_step_tokens"].default == DEFAULT_PREFILL_STEP_TOKENS == 64
