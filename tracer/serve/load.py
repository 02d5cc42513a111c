"""A small load test for ``mlx-tracer serve`` (127.0.0.1 only), and the
engine's own figure to compare it with.

    python -m mlx_tracer.serve.load clients --url http://127.0.0.1:8080 --clients 16 --max-tokens 64
    python -m mlx_tracer.serve.load clients --url http://127.0.0.1:8080 --clients 16 --running 4   # a burst beside 4 streams
    python -m mlx_tracer.serve.load chat --url http://127.0.0.1:8080 --turns 5
    python -m mlx_tracer.serve.load engine --rows 8 --max-tokens 64     # no server: the engine alone

``clients``: concurrent streaming chat clients (threads, standard library
HTTP); prints aggregate completion tokens/s, time to first token (p50, p99)
and the server's own decode figures over the run (from ``/metrics``); with
``--running N``, N long streams start first and the clients arrive together
once they stream: their gaps between tokens during the burst (median,
longest) are printed too.
``chat``: a multi-turn conversation; prints per turn the prompt tokens, the
tokens the prefix cache served, the tokens prefilled and the turn's time. ``engine``: the same
batch decoded by an in-process Generator, no HTTP: the engine's batched
decode tokens/s at that bucket.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from typing import List, Optional
from urllib.parse import urlparse

from .metrics import parse

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue? Explain briefly.",
    "Write a haiku about autumn leaves.", "What is 12 times 12?", "Give me a tip for learning to cook.",
    "Describe a cat in one sentence.", "What does a compiler do? Explain it to a child in a few sentences.",
    "List four planets of the solar system.", "How do plants make food?", "Suggest a name for a goldfish.",
    "What is the boiling point of water at sea level, in Celsius and Fahrenheit?", "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate? Answer in two sentences.", "Translate 'good morning' into Spanish.",
    "Summarize the plot of Cinderella in three sentences, for a reader who has never heard the story before.",
]
TURNS = ["Hi! Can you help me plan a small vegetable garden?", "Which vegetables are easiest for a beginner?",
         "How often should I water them?", "What about pests? Any natural remedies?", "Thanks! Summarize the plan in three bullet points."]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class Server:
    """A server on this machine (refuses any other host)."""

    def __init__(self, url: str):
        u = urlparse(url)
        if u.hostname not in LOOPBACK:
            raise SystemExit(f"load tests target this machine only (127.0.0.1), not {u.hostname!r}")
        self.host, self.port = u.hostname, u.port or 80

    def post(self, path: str, body: dict, on_line=None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=900)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"{path}: HTTP {resp.status}: {resp.read()[:300]!r}")
            if on_line is None:
                return json.loads(resp.read())
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if line.startswith("data: "):
                    on_line(line[6:])
        finally:
            conn.close()

    def metrics(self) -> dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("GET", "/metrics")
            return parse(conn.getresponse().read().decode())
        finally:
            conn.close()


def _percentile(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


class _Stop(Exception):
    """Ends a running stream's read (its connection closes: the server cancels it)."""


def _chat_body(text: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def burst(server: "Server", clients: int, max_tokens: int, running: int = 0, running_tokens: int = 1024,
          settle_s: float = 120.0) -> dict:
    """``clients`` streaming chat requests sent together, beside ``running``
    streams started first (each asks for ``running_tokens`` and is ended by
    closing its connection once the burst is over). Returns the newcomers'
    figures (``tokens``, ``wall``, ``ttft`` list, seconds) and, with running
    streams, ``gaps``: every interval between two of their content chunks
    that ends during the burst (the one across its start included)."""
    results: List[Optional[dict]] = [None] * clients
    errors: List[BaseException] = []
    stop = threading.Event()
    stamps: List[List[float]] = [[] for _ in range(running)]

    def newcomer(i: int):
        t0, first, usage = time.perf_counter(), None, None

        def line(data):
            nonlocal first, usage
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()

        try:
            server.post("/v1/chat/completions", _chat_body(QUESTIONS[i % len(QUESTIONS)], max_tokens), line)
            results[i] = {"start": t0, "ttft": first - t0, "end": time.perf_counter(), "tokens": usage["completion_tokens"]}
        except BaseException as e:  # reported after the run
            errors.append(e)

    def runner(i: int):
        def line(data):
            if stop.is_set():
                raise _Stop
            if data != "[DONE]":
                chunk = json.loads(data)
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    stamps[i].append(time.perf_counter())

        try:
            text = "Tell me a long story about a lighthouse keeper, in many chapters. " + QUESTIONS[i % len(QUESTIONS)]
            server.post("/v1/chat/completions", _chat_body(text, running_tokens), line)
            if not stop.is_set():
                errors.append(RuntimeError(f"a running stream ended before the burst was over "
                                           f"({len(stamps[i])} tokens): raise --running-tokens"))
        except _Stop:
            pass
        except BaseException as e:
            errors.append(e)

    runners = [threading.Thread(target=runner, args=(i,), daemon=True) for i in range(running)]
    for t in runners:
        t.start()
    t_wait = time.perf_counter()
    while any(len(s) < 4 for s in stamps) and not errors:  # every running stream streams before the burst
        if time.perf_counter() - t_wait > settle_s:
            raise RuntimeError(f"the running streams did not start streaming within {settle_s:.0f} s")
        time.sleep(0.01)
    threads = [threading.Thread(target=newcomer, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t1 = time.perf_counter()
    stop.set()
    for t in runners:
        t.join(60)
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed; the first: {errors[0]!r}") from errors[0]
    done = [r for r in results if r]
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if t0 < b <= t1]
    return {"tokens": sum(r["tokens"] for r in done), "wall": t1 - t0, "ttft": [r["ttft"] for r in done],
            "gaps": gaps, "running_tokens": sum(1 for s in stamps for b in s if t0 < b <= t1)}


def clients(args) -> int:
    server = Server(args.url)
    n = args.clients
    before = server.metrics()
    r = burst(server, n, args.max_tokens, running=args.running, running_tokens=args.running_tokens)
    after = server.metrics()
    tokens, wall, ttft = r["tokens"], r["wall"], r["ttft"]
    d_tok = after["mlx_tracer_decode_tokens_total"] - before["mlx_tracer_decode_tokens_total"]
    d_s = after["mlx_tracer_decode_seconds_total"] - before["mlx_tracer_decode_seconds_total"]
    p_tok = after["mlx_tracer_prefill_tokens_total"] - before["mlx_tracer_prefill_tokens_total"]
    p_s = after["mlx_tracer_prefill_seconds_total"] - before["mlx_tracer_prefill_seconds_total"]
    beside = f", beside {args.running} running streams" if args.running else ""
    print(f"{len(ttft)}/{n} streaming clients, {args.max_tokens} tokens each{beside}: {tokens} completion tokens in {wall:.2f} s")
    print(f"  aggregate (client side, wall clock): {tokens / wall:.1f} tok/s")
    print(f"  time to first token: p50 {_percentile(ttft, 0.5) * 1e3:.0f} ms, p99 {_percentile(ttft, 0.99) * 1e3:.0f} ms, "
          f"max {max(ttft) * 1e3:.0f} ms")
    if args.running:
        g = r["gaps"]
        med, top = statistics.median(g), max(g)
        print(f"  running streams during the burst: {r['running_tokens']} tokens; gap between tokens median "
              f"{med * 1e3:.0f} ms, longest {top * 1e3:.0f} ms ({top / med:.1f}x the median)")
    print(f"  engine over the run: decode {d_tok:.0f} tokens in {d_s:.2f} s = {d_tok / d_s if d_s else 0:.1f} tok/s; "
          f"prefill {p_tok:.0f} tokens in {p_s:.2f} s")
    return 0


def chat(args) -> int:
    server = Server(args.url)
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'prefilled':>9} {'ms':>8}")
    total = 0
    for i, text in enumerate(TURNS[: args.turns]):
        messages.append({"role": "user", "content": text})
        before = server.metrics()
        t0 = time.perf_counter()
        r = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": args.max_tokens, "temperature": 0})
        ms = (time.perf_counter() - t0) * 1e3
        after = server.metrics()
        prefilled = after["mlx_tracer_prefill_tokens_total"] - before["mlx_tracer_prefill_tokens_total"]
        total += prefilled
        usage = r["usage"]
        print(f"{i + 1:>4} {usage['prompt_tokens']:>7} {usage['prompt_tokens_details']['cached_tokens']:>7} "
              f"{prefilled:>9.0f} {ms:>8.0f}")
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    print(f"prefilled over {args.turns} turns: {total:.0f} tokens")
    return 0


def engine(args) -> int:
    from ..generator import Generator

    gen = Generator.load(args.model, progress=False, weights=args.weights, buckets=(1, 2, 4, 8, 16) if args.rows > 8 else (1, 2, 4, 8))
    gen.warmup(buckets=gen.engine.buckets[:1], prefill=True)
    gen.warmup(prefill=False)
    for i in range(args.rows):
        gen.submit(QUESTIONS[i % len(QUESTIONS)], max_tokens=args.max_tokens, stop_tokens=[], system="")
    gen.engine.reset_stats()  # measure this batch only
    t0 = time.perf_counter()
    list(gen.events())
    wall = time.perf_counter() - t0
    s = gen.stats
    print(f"engine alone, {args.rows} rows x {args.max_tokens} tokens: decode {s.decode_tokens} tokens, {s.decode_tps:.1f} tok/s "
          f"(engine time); {s.decode_tokens / wall:.1f} tok/s wall incl. prefill of {s.prefill_tokens} tokens")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_tracer.serve.load", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("clients", help="concurrent streaming clients")
    c.add_argument("--url", default="http://127.0.0.1:8080")
    c.add_argument("--clients", type=int, default=16)
    c.add_argument("--max-tokens", type=int, default=64)
    c.add_argument("--running", type=int, default=0,
                   help="streams started (and streaming) before the clients arrive; their gaps between tokens "
                        "during the burst are reported")
    c.add_argument("--running-tokens", type=int, default=1024, help="max_tokens of each running stream")
    c.set_defaults(func=clients)
    t = sub.add_parser("chat", help="a multi-turn chat: prefill per turn")
    t.add_argument("--url", default="http://127.0.0.1:8080")
    t.add_argument("--turns", type=int, default=5, choices=range(1, len(TURNS) + 1))
    t.add_argument("--max-tokens", type=int, default=48)
    t.set_defaults(func=chat)
    e = sub.add_parser("engine", help="the engine alone (no server): batched decode tok/s")
    e.add_argument("--model")
    e.add_argument("--weights", default="auto")
    e.add_argument("--rows", type=int, default=8)
    e.add_argument("--max-tokens", type=int, default=64)
    e.set_defaults(func=engine)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
