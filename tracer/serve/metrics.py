"""Server metrics in Prometheus' text exposition format (version 0.0.4).

Two writers, one lock: the HTTP front end counts answered requests by path
and status; the engine thread publishes an :class:`ServerSnapshot` after
every step (it owns the engine, so nothing else reads the engine's own
objects) and observes time to first token. ``GET /metrics`` renders both.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "mlx_tracer"


class Histogram:
    """Counts per bucket (rendered cumulatively, as Prometheus ``le`` buckets)."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float):
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


@dataclass
class ServerSnapshot:
    """What the engine thread publishes after each step."""

    queue_depth: int = 0  # accepted requests not yet in a row
    live_rows: int = 0
    bucket: int = 0  # batch width in use (0: no row)
    steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    traces: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # kind -> (trace keys, traces made)
    prefix_enabled: bool = False
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    prefix_entries: int = 0
    prefix_bytes: int = 0
    prefix_max_bytes: int = 0
    prefix_evictions: int = 0
    healthy: bool = True


class ServerMetrics:
    """Counters of one server, safe to update from the front end and the engine thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.http: Counter = Counter()  # (path, status code) -> responses
        self.finished: Counter = Counter()  # finish reason -> requests
        self.ttft = Histogram(TTFT_BUCKETS)
        self.engine = ServerSnapshot()

    def count_response(self, path: str, status: int):
        with self.lock:
            self.http[(path, status)] += 1

    def count_finished(self, reason: str):
        with self.lock:
            self.finished[reason] += 1

    def observe_ttft(self, seconds: float):
        with self.lock:
            self.ttft.observe(seconds)

    def publish(self, snapshot: ServerSnapshot):
        with self.lock:
            self.engine = snapshot

    # -------------------------------------------------------------- render
    def render(self) -> str:
        with self.lock:
            e, http, finished = self.engine, dict(self.http), dict(self.finished)
            ttft = (list(self.ttft.counts), self.ttft.sum, self.ttft.count)
        out: List[str] = []

        def metric(name, kind, help_text, samples):
            out.append(f"# HELP {PREFIX}_{name} {help_text}")
            out.append(f"# TYPE {PREFIX}_{name} {kind}")
            for labels, value in samples:
                out.append(f"{PREFIX}_{name}{_labels(labels)} {_num(value)}")

        metric("http_requests_total", "counter", "HTTP responses by path and status code.",
               [({"path": p, "code": str(c)}, n) for (p, c), n in sorted(http.items())])
        metric("requests_finished_total", "counter", "Generation requests finished, by reason (stop, length, cancelled).",
               [({"reason": r}, n) for r, n in sorted(finished.items())])
        metric("queue_depth", "gauge", "Accepted requests waiting for a row.", [({}, e.queue_depth)])
        metric("live_rows", "gauge", "Requests decoding in the running batch.", [({}, e.live_rows)])
        metric("batch_bucket", "gauge", "Batch-width bucket in use (0: idle).", [({}, e.bucket)])
        metric("decode_steps_total", "counter", "Decode (and verify) steps read back.", [({}, e.steps)])
        for phase, tokens, seconds in (("decode", e.decode_tokens, e.decode_s), ("prefill", e.prefill_tokens, e.prefill_s)):
            metric(f"{phase}_tokens_total", "counter", f"Tokens through {phase}.", [({}, tokens)])
            metric(f"{phase}_seconds_total", "counter", f"Seconds spent in {phase}.", [({}, seconds)])
            metric(f"{phase}_tokens_per_second", "gauge", f"{phase.capitalize()} tokens per second of {phase} time, since start.",
                   [({}, tokens / seconds if seconds else 0.0)])
        counts, total, n = ttft
        cumulative, samples = 0, []
        for bound, c in zip(TTFT_BUCKETS + (float("inf"),), counts):
            cumulative += c
            samples.append(({"le": "+Inf" if bound == float("inf") else _num(bound)}, cumulative))
        out.append(f"# HELP {PREFIX}_time_to_first_token_seconds Seconds from a request's arrival to its first token.")
        out.append(f"# TYPE {PREFIX}_time_to_first_token_seconds histogram")
        out += [f"{PREFIX}_time_to_first_token_seconds_bucket{_labels(l)} {v}" for l, v in samples]
        out += [f"{PREFIX}_time_to_first_token_seconds_sum {_num(total)}", f"{PREFIX}_time_to_first_token_seconds_count {n}"]
        metric("trace_keys", "gauge", "Distinct compiled-step shapes (trace keys), by step kind.",
               [({"kind": k}, keys) for k, (keys, _) in sorted(e.traces.items())])
        metric("traces_total", "counter", "Traces made, by step kind (equal to trace_keys while nothing retraces).",
               [({"kind": k}, made) for k, (_, made) in sorted(e.traces.items())])
        if e.prefix_enabled:
            metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache instead of prefilled.",
                   [({}, e.prefix_hit_tokens)])
            metric("prefix_cache_lookups_total", "counter", "Prefix-cache lookups by result.",
                   [({"result": "hit"}, e.prefix_hits), ({"result": "miss"}, e.prefix_lookups - e.prefix_hits)])
            metric("prefix_cache_entries", "gauge", "Entries in the prefix cache.", [({}, e.prefix_entries)])
            metric("prefix_cache_bytes", "gauge", "Bytes of keys and values in the prefix cache.", [({}, e.prefix_bytes)])
            metric("prefix_cache_max_bytes", "gauge", "The prefix cache's byte bound.", [({}, e.prefix_max_bytes)])
            metric("prefix_cache_evictions_total", "counter", "Entries evicted to keep the byte bound.", [({}, e.prefix_evictions)])
        metric("engine_healthy", "gauge", "1 while the engine thread runs.", [({}, int(e.healthy))])
        return "\n".join(out) + "\n"


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def parse(text: str) -> Dict[str, float]:
    """``{'name{labels}': value}`` of a rendered exposition (for tests and the load script)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
