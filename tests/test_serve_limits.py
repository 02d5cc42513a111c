"""The server under hostile or heavy input and at shutdown, live on 127.0.0.1:
body size (413) and JSON nesting (400) limits, tokenization beside the engine
thread, the API key, text no tokenizer takes, each response counted once, and
a graceful drain on SIGTERM (in process and as a real ``mlx-tracer serve``)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest

from mlx_tracer import Generator
from mlx_tracer.serve import BackgroundServer, EngineWorker, create_app
from mlx_tracer.serve.body import json_depth
from mlx_tracer.serve.metrics import parse

from .serve_helpers import metrics, save_chat_model_dir, wait_for
from .test_serve_cli import start_serve, stop_process

KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "5 6 7"}]
LONG = [21, 22]  # with ignore_eos: runs until max_tokens or a cancel
MAX_BYTES = 64 << 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model_dir(tmp_path_factory.mktemp("limits") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir):
    """A server with an API key and a 64 KiB body limit."""
    gen = Generator.load(model_dir, progress=False, weights="as-is", buckets=(1, 2))
    worker = EngineWorker(gen, "tiny").start()
    try:
        with BackgroundServer(create_app(worker, max_request_bytes=MAX_BYTES, api_key=KEY)) as s:
            yield s.url, worker
    finally:
        worker.stop()


def post(url, path, body, **kw):
    kw.setdefault("headers", AUTH)
    if isinstance(body, (bytes, str)) or hasattr(body, "__iter__") and not isinstance(body, dict):
        kw["headers"] = dict(kw["headers"], **{"content-type": "application/json"})
        return httpx.post(url + path, content=body, timeout=30, **kw)
    return httpx.post(url + path, json=body, timeout=30, **kw)


def error(r, status):
    assert r.status_code == status, r.text
    return r.json()["error"]


def count(url, path, code):
    return metrics(url).get(f'mlx_tracer_http_requests_total{{path="{path}",code="{code}"}}', 0)


class Stream:
    """A raw streamed completion read on a thread: its lines and the longest gap between them."""

    def __init__(self, url, body, headers=AUTH):
        self.lines, self.gaps, self.status = [], [], None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url, dict(body, stream=True), headers), daemon=True)
        self.thread.start()

    def _read(self, url, body, headers):
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
                self.status = r.status_code
                last = None
                for line in r.iter_lines():
                    now = time.perf_counter()
                    if line:
                        self.gaps.append(now - last if last else 0.0)
                        self.lines.append(line)
                        last = now
                        self.first.set()
        finally:
            self.first.set()

    def join(self, timeout=60):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        return self

    def events(self):
        return [json.loads(line[6:]) for line in self.lines if line.startswith("data: {")]


# ------------------------------------------------------------------ limits
def test_json_depth_counts_brackets_outside_strings():
    assert json_depth(b"1") == 0 and json_depth(b"{}") == 1
    assert json_depth(b'{"a": [1, {"b": "[[[[\\"[[{"}]}') == 3
    assert json_depth(b"[" * 100_000) == 100_000
    assert json_depth(b"[" + b"[]," * 100_000 + b"[]]") == 2


def test_an_oversize_body_gets_413_before_it_is_read_and_a_running_stream_goes_on(server):
    url, _ = server
    stream = Stream(url, {"prompt": LONG, "max_tokens": 400, "ignore_eos": True, "temperature": 0})
    assert stream.first.wait(30)
    big = json.dumps({"prompt": "5 " * MAX_BYTES}).encode()
    err = error(post(url, "/v1/completions", big), 413)  # Content-Length says so
    assert err["code"] == "request_too_large" and str(MAX_BYTES) in err["message"]
    chunks = (big[i:i + 4096] for i in range(0, len(big), 4096))  # chunked: no Content-Length, counted as it comes
    assert error(post(url, "/v1/completions", chunks), 413)["code"] == "request_too_large"
    stream.join()
    assert stream.status == 200 and stream.lines[-1] == "data: [DONE]"
    assert sum(1 for e in stream.events() if e["choices"] and e["choices"][0]["text"]) == 400
    assert post(url, "/v1/completions", {"prompt": "5", "max_tokens": 1}).status_code == 200


def test_deep_nesting_answers_400_and_every_error_is_counted_once(server):
    url, worker = server
    before = count(url, "/v1/chat/completions", 400)
    err = error(post(url, "/v1/chat/completions", b'{"messages": ' + b"[" * 50_000), 400)
    assert err["code"] == "json_too_deep" and "64 levels" in err["message"]
    assert error(post(url, "/v1/chat/completions", b'{"messages": ' + b"[" * 60 + b"]" * 60 + b"}"), 400)["param"] == "messages[0]"
    assert count(url, "/v1/chat/completions", 400) == before + 2

    def broken(spec):
        raise RuntimeError("a bug")

    worker.tokenize = broken  # a handler that fails: Starlette answers 500, and it is counted once
    try:
        assert post(url, "/v1/completions", {"prompt": "5", "max_tokens": 1}).status_code == 500
    finally:
        del worker.tokenize
    assert count(url, "/v1/completions", 500) == 1


def test_a_long_prompt_is_tokenized_beside_the_engine_thread(model_dir):
    gen = Generator.load(model_dir, progress=False, weights="as-is", buckets=(1, 2))
    worker = EngineWorker(gen, "tiny").start()
    try:
        with BackgroundServer(create_app(worker)) as s:  # the default 4 MiB limit
            stream = Stream(s.url, {"prompt": LONG, "max_tokens": 30000, "ignore_eos": True}, headers={})
            assert stream.first.wait(30)
            t0 = time.perf_counter()
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "5 6 7 8 " * 400_000, "max_tokens": 2}, timeout=60)
            took = time.perf_counter() - t0
            n = len(stream.gaps)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert stream.thread.is_alive(), "the stream ended before the long prompt was tokenized"
            gap = max(stream.gaps[1:n])
            assert gap < 1.0, f"a stream chunk waited {gap:.2f} s while a prompt was tokenized for {took:.2f} s"
            s.stop(grace=0)  # cut the stream (else uvicorn would wait for it)
    finally:
        worker.stop()
    assert stream.join().lines[-1] == "data: [DONE]"


# -------------------------------------------------------------------- key
def test_the_api_key_guards_v1_and_leaves_health_and_metrics_open(server):
    url, _ = server
    body = {"messages": CHAT, "max_tokens": 2}
    err = error(post(url, "/v1/chat/completions", body, headers={}), 401)
    assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
    r = post(url, "/v1/chat/completions", body, headers={"Authorization": "Bearer wrong"})
    assert error(r, 401)["message"] == "incorrect API key provided" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(model="tiny", messages=CHAT)
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2).usage.completion_tokens <= 2
    assert [m.id for m in c.models.list().data] == ["tiny"]
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
    assert count(url, "/v1/chat/completions", 401) >= 3


# ------------------------------------------------------------------ small
def test_lone_surrogates_and_n_0_answer_400_naming_the_parameter(server):
    url, _ = server  # (as JSON escapes: the openai client cannot even send a lone surrogate)
    err = error(post(url, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "ab\\udcff"}]}'), 400)
    assert err["param"] == "messages[0].content" and "lone surrogate" in err["message"] and "position 2" in err["message"]
    err = error(post(url, "/v1/completions", b'{"prompt": "\\ud800 5"}'), 400)
    assert err["param"] == "prompt" and "cannot be encoded" in err["message"] and "TextEncodeInput" not in err["message"]
    err = error(post(url, "/v1/chat/completions", {"messages": CHAT, "n": 0}), 400)
    assert err["param"] == "n" and err["message"].startswith("n must be 1")


# --------------------------------------------------------------- shutdown
def test_a_drain_lets_nothing_new_in_and_cuts_what_outlives_the_grace(model_dir):
    gen = Generator.load(model_dir, progress=False, weights="as-is", buckets=(1, 2))
    worker = EngineWorker(gen, "tiny").start()
    server = BackgroundServer(create_app(worker)).start()
    url = server.url
    try:
        whole = {}
        waiting = threading.Thread(target=lambda: whole.setdefault("r", httpx.post(
            url + "/v1/completions", json={"prompt": LONG, "max_tokens": 30000, "ignore_eos": True}, timeout=60)))
        waiting.start()
        stream = Stream(url, {"prompt": LONG, "max_tokens": 30000, "ignore_eos": True}, headers={})
        assert stream.first.wait(30)
        wait_for(lambda: metrics(url)["mlx_tracer_live_rows"] == 2, what="two running requests")
        stopper = threading.Thread(target=server.stop, kwargs={"grace": 1.0})
        stopper.start()
        wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 503, what="draining")
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "draining"
        r = httpx.post(url + "/v1/completions", json={"prompt": "5", "max_tokens": 1}, timeout=10)
        assert error(r, 503)["code"] == "shutting_down" and int(r.headers["retry-after"]) >= 1
        stopper.join(30)
        waiting.join(30)
        stream.join()
        assert error(whole["r"], 503)["code"] == "shutting_down"
        assert stream.lines[-1] == "data: [DONE]" and stream.events()[-1]["error"]["code"] == "shutting_down"
        wait_for(lambda: parse(worker.metrics.render())["mlx_tracer_live_rows"] == 0, what="the rows to be freed")
    finally:
        server.stop()
        worker.stop()


def test_sigterm_drains_a_real_server_cuts_what_outlives_the_grace_and_exits_0(model_dir):
    proc, url, lines = start_serve(model_dir, "--buckets", "1,2,4", "--no-warmup", "--shutdown-grace", "5",
                                   env={"MLX_TRACER_API_KEY": KEY})
    try:
        assert url and "needs the API key" in lines[-1], "".join(lines)
        short = [Stream(url, {"prompt": LONG, "max_tokens": 600, "ignore_eos": True}) for _ in range(2)]
        long = Stream(url, {"prompt": LONG, "max_tokens": 30000, "ignore_eos": True})
        for s in short + [long]:
            assert s.first.wait(30)
        proc.send_signal(signal.SIGTERM)
        for s in short + [long]:
            s.join(30)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
    finally:
        stop_process(proc)
    assert "SIGTERM: taking no new requests; 3 running get up to 5 s" in err, err
    for s in short:  # finished within the grace
        assert s.lines[-1] == "data: [DONE]" and s.events()[-1]["choices"][0]["finish_reason"] == "length", s.lines[-3:]
    assert long.lines[-1] == "data: [DONE]" and long.events()[-1]["error"]["code"] == "shutting_down"
    assert err.count("cut streamed request") == 1 and "Traceback" not in err and "CancelledError" not in err, err
