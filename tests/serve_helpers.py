"""Helpers of the server tests: a tiny chat model folder and an in-process
server (engine thread + uvicorn thread on 127.0.0.1, a free port) that is
always stopped."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

import httpx

from mlx_tracer.serve.metrics import parse

from .helpers import save_model_dir

# A chat template in the tiny WordLevel vocabulary (tokens are "0".."100",
# "0" is end-of-sequence): role markers 1 (system), 2 (user), 3 (assistant),
# 4 ends a turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}1 {% elif m['role'] == 'user' %}2 {% else %}3 {% endif %}"
    "{{ m['content'] }} 4 "
    "{% endfor %}"
    "{% if add_generation_prompt %}3 {% endif %}"
)


def save_chat_model_dir(path, family: str = "llama", seed: int = 0):
    """:func:`save_model_dir` plus a chat template."""
    save_model_dir(path, family, seed)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return path


@contextmanager
def running_server(gen, model_id: str = "tiny", warmup=None, timeout=600.0, **worker_kw):
    """``(url, worker)`` of a server on ``gen``, stopped on exit."""
    from mlx_tracer.serve import BackgroundServer, EngineWorker, create_app

    worker = EngineWorker(gen, model_id, **worker_kw).start(warmup=warmup)
    try:
        with BackgroundServer(create_app(worker, timeout=timeout)) as server:
            yield server.url, worker
    finally:
        worker.stop()


def metrics(url: str) -> dict:
    return parse(httpx.get(url + "/metrics", timeout=10).text)


def wait_for(predicate, timeout: float = 20.0, what: str = "a condition"):
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
