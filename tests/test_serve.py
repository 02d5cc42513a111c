"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official
``openai`` client and raw HTTP: answers equal the Generator's, concurrency,
disconnects, bad requests, back-pressure, the prefix cache.

The reference answers are computed up front by a separate Generator on the
same model, before any server thread runs (one thread uses MLX at a time).
"""

from __future__ import annotations

import threading

import httpx
import numpy as np
import openai
import pytest

from mlx_tracer import Generator
from mlx_tracer.runtime.options import OptionError, check_context_length
from mlx_tracer.runtime.prefix_cache import PrefixCache

from .helpers import FRANCE, SYSTEM, model_present
from .serve_helpers import metrics, running_server, save_chat_model_dir, wait_for

CHAT = [{"role": "system", "content": "9 8"}, {"role": "user", "content": "5 6 7"}]
NEIGHBOUR = [11, 12, 13]  # a completion running beside others
LONG = [21, 22]  # a completion that runs until cancelled (ignore_eos)
rng = np.random.default_rng(7)
SIXTEEN = [(rng.integers(1, 100, size=int(n)).tolist(), int(m))
           for n, m in zip(rng.integers(2, 40, size=16), rng.integers(3, 20, size=16))]
TURN2_USER = "31 32 33"
SEEDED = dict(temperature=1.0, top_p=0.9, seed=1234)


class Refs:
    """Solo greedy (or seeded) completions of the reference Generator, computed up front."""

    def __init__(self, gen: Generator):
        self.gen, self.done = gen, {}

    def ids(self, messages):
        return list(self.gen.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def add(self, ids, max_tokens, **kw):
        key = (tuple(ids), max_tokens, tuple(sorted(kw.items())))
        if key not in self.done:
            uid = self.gen.submit(list(ids), max_tokens=max_tokens, chat=False, **kw)
            list(self.gen.events())
            self.done[key] = self.gen.result(uid)
        return self.done[key]

    def __call__(self, ids, max_tokens, **kw):
        return self.done[(tuple(ids), max_tokens, tuple(sorted(kw.items())))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model_dir(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def refs(model_dir):
    gen = Generator.load(model_dir, progress=False, weights="as-is")
    r = Refs(gen)
    chat_ids = r.ids(CHAT)
    r.add(chat_ids, 12)
    r.add(chat_ids, 12, temp=SEEDED["temperature"], top_p=SEEDED["top_p"], seed=SEEDED["seed"])
    r.add(r.gen.encode("5 6 7", chat=False), 6)
    r.add(NEIGHBOUR, 30)
    for ids, m in SIXTEEN:
        r.add(ids, m)
    first = r.add(chat_ids, 8)
    r.add(r.ids(CHAT + [{"role": "assistant", "content": first.text}, {"role": "user", "content": TURN2_USER}]), 8)
    return r


@pytest.fixture(scope="module")
def server(model_dir, refs):
    gen = Generator.load(model_dir, progress=False, weights="as-is", prefix_cache=PrefixCache(1 << 20))
    with running_server(gen, warmup=(1, 2)) as (url, worker):
        yield url, worker


def client(url, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60, **kw)


# ------------------------------------------------------------ answers
def test_chat_and_completions_equal_the_generator_whole_and_streamed(server, refs):
    url, _ = server
    c = client(url)
    ref = refs(refs.ids(CHAT), 12)
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(refs.ids(CHAT)) and r.usage.completion_tokens == len(ref.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(c.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.tokens)
    assert all(ch.usage is None for ch in chunks[:-1])

    text_ref = refs(refs.gen.encode("5 6 7", chat=False), 6)
    r = c.completions.create(model="tiny", prompt="5 6 7", max_tokens=6, temperature=0)
    assert r.choices[0].text == text_ref.text and r.usage.completion_tokens == len(text_ref.tokens)
    r = c.completions.create(model="tiny", prompt=refs.gen.encode("5 6 7", chat=False), max_tokens=6, temperature=0)
    assert r.choices[0].text == text_ref.text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="5 6 7", max_tokens=6,
                                                                         temperature=0, stream=True))
    assert streamed == text_ref.text


def test_raw_stream_ends_with_done(server):
    url, _ = server
    body = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_stop_strings_seeds_and_logprobs(server, refs):
    url, _ = server
    c = client(url)
    ref = refs(refs.ids(CHAT), 12)
    stop = ref.text.split()[1]
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, stop=[stop, "no such"])
    assert r.choices[0].message.content == ref.text[: ref.text.index(stop)] and r.choices[0].finish_reason == "stop"

    seeded = refs(refs.ids(CHAT), 12, temp=SEEDED["temperature"], top_p=SEEDED["top_p"], seed=SEEDED["seed"])
    alone = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, **SEEDED).choices[0].message.content
    assert alone == seeded.text
    out = {}
    threads = [threading.Thread(target=lambda: out.setdefault("seeded", c.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=12, **SEEDED).choices[0].message.content))]
    threads += [threading.Thread(target=c.completions.create, kwargs=dict(model="tiny", prompt=NEIGHBOUR, max_tokens=30))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out["seeded"] == seeded.text  # a seed gives the same text whatever runs beside it

    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, logprobs=True)
    got = r.choices[0].logprobs.content
    assert [t.token for t in got] == [refs.gen.tokenizer.decode([t]) for t in ref.tokens]
    assert np.allclose([t.logprob for t in got], ref.logprobs, atol=1e-5)
    r = c.completions.create(model="tiny", prompt=NEIGHBOUR, max_tokens=30, temperature=0, logprobs=0)
    assert len(r.choices[0].logprobs.token_logprobs) == r.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs" and "[0, 20]" in e.value.body["message"]


# -------------------------------------------------------- concurrency
def test_sixteen_concurrent_clients_equal_their_solo_runs_without_retracing(server, refs):
    url, worker = server
    c = client(url)
    got = {}

    def run(i):
        ids, m = SIXTEEN[i]
        if i % 2:
            stream = c.completions.create(model="tiny", prompt=ids, max_tokens=m, temperature=0, stream=True)
            got[i] = "".join(ch.choices[0].text for ch in stream)
        else:
            got[i] = c.completions.create(model="tiny", prompt=ids, max_tokens=m, temperature=0).choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (ids, m) in enumerate(SIXTEEN):
        assert got.get(i) == refs(ids, m).text, f"client {i} differs from its solo run"
    wait_for(lambda: metrics(url)["mlx_tracer_live_rows"] == 0, what="the batch to empty")
    traces = worker.gen.traces
    assert all(n == 1 for n in traces.values()), traces
    m = metrics(url)
    for kind in ("decode", "window"):
        assert m[f'mlx_tracer_traces_total{{kind="{kind}"}}'] == m[f'mlx_tracer_trace_keys{{kind="{kind}"}}']


def test_a_client_that_disconnects_mid_stream_frees_its_row_and_the_neighbour_loses_nothing(server, refs):
    url, _ = server
    c = client(url)
    before = metrics(url).get('mlx_tracer_requests_finished_total{reason="cancelled"}', 0)
    out = {}
    neighbour = threading.Thread(target=lambda: out.setdefault("text", "".join(
        ch.choices[0].text for ch in c.completions.create(model="tiny", prompt=NEIGHBOUR, max_tokens=30, temperature=0, stream=True))))
    stream = c.completions.create(model="tiny", prompt=LONG, max_tokens=3000, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    neighbour.start()
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert metrics(url)["mlx_tracer_live_rows"] >= 1
    stream.close()  # the client goes away
    wait_for(lambda: metrics(url).get('mlx_tracer_requests_finished_total{reason="cancelled"}', 0) == before + 1,
             what="the cancel to show in /metrics")
    neighbour.join(60)
    assert out["text"] == refs(NEIGHBOUR, 30).text
    wait_for(lambda: metrics(url)["mlx_tracer_live_rows"] == 0, what="the rows to be freed")
    with pytest.raises(httpx.ReadTimeout):  # a client of a whole answer that gives up waiting
        httpx.post(url + "/v1/completions", json={"prompt": LONG, "max_tokens": 3000, "ignore_eos": True}, timeout=0.5)
    wait_for(lambda: metrics(url).get('mlx_tracer_requests_finished_total{reason="cancelled"}', 0) == before + 2,
             what="the second cancel")
    wait_for(lambda: metrics(url)["mlx_tracer_live_rows"] == 0, what="its row to be freed")


def test_the_load_scripts_burst_beside_running_streams_measures_both_and_frees_every_row(server):
    """``python -m mlx_tracer.serve.load clients --running N``: the running
    streams stream before the clients arrive, their gaps during the burst are
    counted, and closing them afterwards frees their rows."""
    from mlx_tracer.serve.load import Server, burst

    url, _ = server
    before = metrics(url).get('mlx_tracer_requests_finished_total{reason="cancelled"}', 0)
    r = burst(Server(url), clients=3, max_tokens=4, running=2, running_tokens=2000)
    assert r["tokens"] == 3 * 4 and len(r["ttft"]) == 3 and all(0 < t < r["wall"] for t in r["ttft"])
    assert r["running_tokens"] >= 2 and len(r["gaps"]) >= 2 and all(g > 0 for g in r["gaps"])
    wait_for(lambda: metrics(url).get('mlx_tracer_requests_finished_total{reason="cancelled"}', 0) == before + 2,
             what="the running streams' cancels")
    wait_for(lambda: metrics(url)["mlx_tracer_live_rows"] == 0, what="their rows to be freed")


# -------------------------------------------------------- bad requests
@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"model": "tiny"}, 400, "messages"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "1"}]}, 400, "messages[0].role"),
    ({"messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ({"messages": CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    ({"messages": CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 10**9}, 400, "max_tokens"),
    ({"messages": CHAT, "top_p": 0}, 400, "top_p"),
    ({"messages": CHAT, "seed": -1}, 400, "seed"),
    ({"messages": CHAT, "stop": [1, 2]}, 400, "stop"),
    ({"messages": CHAT, "n": 200}, 400, "n"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]"),
    ({"messages": CHAT, "frobnicate": 1}, 400, "frobnicate"),
    ({"messages": CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"messages": CHAT, "model": "gpt-4o"}, 404, "model"),
])
def test_bad_chat_requests_get_a_clear_4xx_and_the_server_keeps_serving(server, body, status, param):
    url, _ = server
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + "/v1/chat/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param, err
    ok = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_bad_completion_requests_and_oversize_prompts(server):
    url, _ = server
    for body, param in [({"prompt": ""}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
                        ({"prompt": "1", "echo": True}, "echo"), ({"prompt": "1", "logprobs": 6}, "logprobs"),
                        ({"prompt": [500]}, "prompt"), ({"prompt": list(range(1, 100)) * 400}, "prompt")]:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body if len(str(body)) < 80 else param, r.text)
    assert "context" in r.json()["error"]["message"] or "exceed" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/nope", timeout=10).status_code == 404
    assert httpx.get(url + "/v1/chat/completions", timeout=10).status_code == 405
    assert httpx.post(url + "/v1/completions", json={"prompt": "5", "max_tokens": 1}, timeout=30).status_code == 200


def test_context_length_is_refused_by_the_runtimes_own_check_with_its_param_and_code(server):
    url, worker = server
    ids = list(range(1, 100)) * 400
    r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 5}, timeout=30)
    with pytest.raises(OptionError) as want:
        check_context_length(len(ids), 5, worker.context_limit, param="prompt", limit_name="position limit")
    assert r.status_code == 400 and r.json()["error"] == {"message": str(want.value), "type": "invalid_request_error",
                                                          "param": "prompt", "code": "context_length_exceeded"}
    r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 10**6}, timeout=30)
    with pytest.raises(OptionError) as want:  # within the bound of every budget (2**20), past this model's context
        check_context_length(None, 10**6, worker.context_limit, max_param="max_completion_tokens")
    assert r.status_code == 400 and r.json()["error"]["message"] == str(want.value)
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("max_completion_tokens", "context_length_exceeded")


def test_health_models_and_metrics(server):
    url, _ = server
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok", "model": "tiny"}
    assert [m.id for m in client(url).models.list().data] == ["tiny"]
    text = httpx.get(url + "/metrics", timeout=10).text
    for name in ("http_requests_total", "requests_finished_total", "queue_depth", "live_rows", "batch_bucket",
                 "decode_tokens_per_second", "prefill_tokens_per_second", "time_to_first_token_seconds_bucket",
                 "traces_total", "prefix_cache_hit_tokens_total"):
        assert f"mlx_tracer_{name}" in text, name
    assert 'mlx_tracer_http_requests_total{path="/v1/chat/completions",code="400"}' in text


# -------------------------------------------------------- prefix cache
def test_a_second_chat_turn_reuses_the_first_turns_keys_and_values(server, refs):
    url, _ = server
    c = client(url)
    first = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0).choices[0].message.content
    assert first == refs(refs.ids(CHAT), 8).text
    turn2 = CHAT + [{"role": "assistant", "content": first}, {"role": "user", "content": TURN2_USER}]
    before = metrics(url)
    r = c.chat.completions.create(model="tiny", messages=turn2, max_tokens=8, temperature=0)
    after = metrics(url)
    ids = refs.ids(turn2)
    assert r.choices[0].message.content == refs(ids, 8).text  # the same tokens as without the cache
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(refs.ids(CHAT)) and r.usage.prompt_tokens == len(ids)
    assert after["mlx_tracer_prefix_cache_hit_tokens_total"] - before["mlx_tracer_prefix_cache_hit_tokens_total"] == cached
    prefilled = after["mlx_tracer_prefill_tokens_total"] - before["mlx_tracer_prefill_tokens_total"]
    assert prefilled == len(ids) - cached - 1  # only the new tail (the last token feeds the first decode step)


# ---------------------------------------------- back-pressure, timeouts, eviction
def test_full_queue_answers_503_with_retry_after_and_the_prefix_cache_stays_within_its_bound(model_dir, refs):
    gen = Generator.load(model_dir, progress=False, weights="as-is", buckets=(1,), prefix_cache=PrefixCache(20_000))
    with running_server(gen, max_queue=1) as (url, worker):
        c = client(url)
        running = c.completions.create(model="tiny", prompt=LONG, max_tokens=3000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
        next(iter(running))  # it holds the only row
        out = {}
        waiting = threading.Thread(target=lambda: out.setdefault("text", c.completions.create(
            model="tiny", prompt=NEIGHBOUR, max_tokens=30, temperature=0).choices[0].text))
        waiting.start()
        wait_for(lambda: metrics(url)["mlx_tracer_queue_depth"] == 1, what="a queued request")
        r = httpx.post(url + "/v1/completions", json={"prompt": "5", "max_tokens": 1}, timeout=30)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        running.close()
        waiting.join(60)
        assert out["text"] == refs(NEIGHBOUR, 30).text
        for i in range(4):  # ~13 positions of 768 bytes each: two entries fit in 20 kB
            c.completions.create(model="tiny", prompt=[40 + i] * 10, max_tokens=4, temperature=0)
        m = metrics(url)
        assert m["mlx_tracer_prefix_cache_evictions_total"] > 0
        assert 0 < m["mlx_tracer_prefix_cache_bytes"] <= 20_000
        assert m['mlx_tracer_http_requests_total{path="/v1/completions",code="503"}'] == 1


def test_a_request_past_the_timeout_is_cancelled(model_dir):
    gen = Generator.load(model_dir, progress=False, weights="as-is", buckets=(1,))
    with running_server(gen, timeout=0.5) as (url, worker):
        body = {"prompt": LONG, "max_tokens": 20000}
        r = httpx.post(url + "/v1/completions", json=dict(body, ignore_eos=True), timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        with pytest.raises(openai.APIError, match="timeout"):
            for _ in client(url).completions.create(model="tiny", stream=True, extra_body={"ignore_eos": True}, **body):
                pass
        wait_for(lambda: metrics(url).get('mlx_tracer_requests_finished_total{reason="cancelled"}') == 2,
                 what="both cancels")
        wait_for(lambda: metrics(url)["mlx_tracer_live_rows"] == 0, what="the row to be freed")


def test_a_speculative_server_gives_the_same_greedy_answers(model_dir, refs):
    gen = Generator.load(model_dir, progress=False, weights="as-is", speculative="prompt-lookup", draft_tokens=3,
                         prefix_cache=PrefixCache(1 << 20))
    with running_server(gen) as (url, _):
        c = client(url)
        got = {}
        threads = [threading.Thread(target=lambda i=i: got.setdefault(i, c.completions.create(
            model="tiny", prompt=SIXTEEN[i][0], max_tokens=SIXTEEN[i][1], temperature=0).choices[0].text)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [got[i] for i in range(4)] == [refs(*SIXTEEN[i]).text for i in range(4)]
        first = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0).choices[0].message.content
        turn2 = CHAT + [{"role": "assistant", "content": first}, {"role": "user", "content": TURN2_USER}]
        r = c.chat.completions.create(model="tiny", messages=turn2, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == refs(refs.ids(turn2), 8).text
        assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_an_engine_failure_answers_500_and_health_turns_503(model_dir):
    gen = Generator.load(model_dir, progress=False, weights="as-is", buckets=(1,))

    def broken_step():
        raise RuntimeError("boom")

    gen.step = broken_step
    with running_server(gen) as (url, worker):
        r = httpx.post(url + "/v1/completions", json={"prompt": "5", "max_tokens": 2}, timeout=30)
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        r = httpx.post(url + "/v1/completions", json={"prompt": "5", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
        assert metrics(url)["mlx_tracer_engine_healthy"] == 0


# ------------------------------------------------------------- SmolLM2
needs_model = pytest.mark.skipif(not model_present(), reason="SmolLM2 GGUF not present: run `mlx-tracer fetch`")


@pytest.mark.model
@needs_model
def test_smollm2_answers_over_http_and_reuses_the_conversation():
    gen = Generator.load(progress=False, weights="as-is", prefix_cache=PrefixCache(64 << 20))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FRANCE}]
    with running_server(gen, model_id="SmolLM2-135M-Instruct") as (url, _):
        c = client(url)
        r = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16, temperature=0)
        answer = r.choices[0].message.content
        assert "Paris" in answer and r.choices[0].finish_reason == "stop"
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16, temperature=0, stream=True))
        assert streamed == answer
        turn2 = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
        r = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=turn2, max_tokens=16, temperature=0)
        assert "Rome" in r.choices[0].message.content
        assert r.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens // 2
