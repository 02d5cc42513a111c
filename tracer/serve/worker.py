"""The engine thread: the one thread that touches the model.

:class:`EngineWorker` owns a :class:`~mlx_tracer.generator.Generator` (its
engine, caches, tokenizer and every MLX call) and the prefix cache. The HTTP
front end talks to it through two thread-safe calls, :meth:`submit` and
:meth:`cancel`, which append to an inbox; the thread applies the inbox
between steps (new requests join the running batch at the next step,
cancellations free their rows at the next step) and sends each request's
messages (:mod:`.jobs`) to its own asyncio queue, one
``call_soon_threadsafe`` per step. Nothing the thread does waits for a client.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..generator import Generator
from ..runtime.options import check_buckets
from ..runtime.prefix_cache import PrefixCache
from .errors import APIError, bad_request, internal, queue_full, unavailable
from .jobs import Admitted, Delta, Finished, Job, Rejected
from .metrics import EngineSnapshot, ServerMetrics
from .protocol import GenerationSpec


class EngineWorker:
    """Runs a Generator on its own thread for the HTTP front end.

    Args:
        generator: the model, tokenizer and compiled loop (used by this thread only, once started).
        model_id: the name clients use for the model.
        max_queue: the most accepted requests waiting for a row; one more is answered 503.
        prefix_cache_bytes: byte bound of the prefix cache (0: no prefix cache).
        metrics: where to publish (a new :class:`ServerMetrics` by default).
    """

    def __init__(self, generator: Generator, model_id: str, max_queue: int = 64, prefix_cache_bytes: int = 0,
                 metrics: Optional[ServerMetrics] = None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.gen = generator
        self.model_id = model_id
        self.max_queue = max_queue
        self.metrics = metrics or ServerMetrics()
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        if self.prefix_cache is not None:
            generator.engine.on_retire = self._retired
        engine = generator.engine
        limits = [n for n in (engine.compiled.context_length, engine.max_positions) if n]
        self.context_limit: Optional[int] = min(limits) if limits else None  # positions a request can reach
        self.error: Optional[BaseException] = None  # what stopped the thread, if it failed
        self._inbox: Deque[Tuple[str, Job]] = deque()
        self._wake = threading.Condition()
        self._waiting = 0  # accepted, not yet in a row (under _wake)
        self._stopping = False
        self._jobs: Dict[int, Job] = {}  # engine uid -> job, until finished
        self._prefixes: Dict[int, List[int]] = {}  # uid -> ids of the prefix its caches came with, until it retires
        self._outgoing: List[Tuple[Job, object]] = []
        self._warmup: Tuple[int, ...] = ()
        self.warmup_ms: Dict[object, float] = {}  # trace -> ms, of the warmup
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlx-tracer-engine", daemon=True)

    # ------------------------------------------------------- any thread
    def start(self, warmup: Optional[Sequence[int]] = None) -> "EngineWorker":
        """Start the thread (from then on, only it may use the generator).

        ``warmup``: buckets to trace on the thread before serving (decode
        steps, and the prefill windows of the first bucket, where newcomers
        prefill); returns once they are traced. ``mx.compile`` keeps its traces
        per thread, so tracing on any other thread would not count."""
        self._warmup = check_buckets(warmup) if warmup else ()
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise RuntimeError(f"the engine thread failed to start: {self.error}") from self.error
        return self

    def stop(self, timeout: float = 30.0):
        """Stop the thread; requests still running end with a 503 error."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.error is None

    @property
    def queue_depth(self) -> int:
        return self._waiting

    # -------------------------------------------------- front-end thread
    def submit(self, spec: GenerationSpec, loop, received_at: Optional[float] = None) -> Job:
        """Queue a request (raises :class:`APIError` 503 when full or stopped)."""
        if not self.running:
            raise unavailable("the engine is not running" + (f": {self.error}" if self.error else ""))
        job = Job(spec, loop, time.perf_counter() if received_at is None else received_at)
        with self._wake:
            if self._waiting >= self.max_queue:
                raise queue_full(self._waiting)
            self._waiting += 1
            self._inbox.append(("submit", job))
            self._wake.notify()
        return job

    def cancel(self, job: Job):
        """Stop a request whose client left (applied between steps)."""
        with self._wake:
            self._inbox.append(("cancel", job))
            self._wake.notify()

    # ------------------------------------------------------ engine thread
    def _run(self):
        try:
            if self._warmup:
                made = self.gen.warmup(buckets=self._warmup[:1], prefill=True)
                made.update(self.gen.warmup(buckets=self._warmup, prefill=False))
                self.warmup_ms = made
            self._ready.set()
            while True:
                with self._wake:
                    while not (self._inbox or self._stopping or self.gen.engine.has_work()):
                        self._publish()
                        self._wake.wait()
                    if self._stopping:
                        break
                    inbox = list(self._inbox)
                    self._inbox.clear()
                for kind, job in inbox:
                    self._admit(job) if kind == "submit" else self._cancel(job)
                self._flush()
                if self.gen.engine.has_work():
                    for ev in self.gen.step():
                        self._route(ev)
                self._publish()
                self._flush()
        except BaseException as e:  # the engine's state is unknown now: fail everything, report unhealthy
            self.error = e
            print(f"mlx-tracer serve: the engine thread failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        finally:
            self._ready.set()
            self._shutdown()
            # MLX gives each thread its own streams; left behind, they abort
            # the process at exit ("terminate called without an active exception")
            try:
                mx.synchronize()
                mx.clear_streams()
            except Exception:
                pass

    def _admit(self, job: Job):
        spec = job.spec
        try:
            ids = self._encode(spec)
            total = len(ids) + spec.max_tokens
            if self.context_limit is not None and total > self.context_limit:
                room = self.context_limit - len(ids)
                raise bad_request(
                    f"prompt of {len(ids)} tokens + max_tokens {spec.max_tokens} exceed the model's limit of "
                    f"{self.context_limit} positions: " + (f"lower max_tokens to at most {room}" if room > 0 else "shorten the prompt"),
                    "messages" if spec.endpoint == "chat" else "prompt", "context_length_exceeded")
            hit = self.prefix_cache.lookup(ids) if self.prefix_cache is not None else None
            try:
                uid = self._submit(spec, ids, hit)
            except (ValueError, TypeError):
                if hit is None:
                    raise
                hit, uid = None, self._submit(spec, ids, None)  # the answer never depends on the prefix cache
        except APIError as e:
            return self._reject(job, e)
        except (ValueError, TypeError) as e:
            return self._reject(job, bad_request(str(e), "messages" if spec.endpoint == "chat" else "prompt"))
        except Exception as e:  # a bug: answer this request, keep serving the others
            traceback.print_exc(file=sys.stderr)
            return self._reject(job, internal(f"could not start the request: {type(e).__name__}: {e}"))
        job.uid, job.prompt, job.cached = uid, ids, hit.tokens if hit else 0
        job.stop_ids = frozenset() if spec.ignore_eos else frozenset(self.gen.tokenizer.eos_token_ids)
        self._jobs[uid] = job
        if hit:
            self._prefixes[uid] = ids[: hit.tokens]
        self._send(job, Admitted(len(ids), job.cached))

    def _submit(self, spec: GenerationSpec, ids: List[int], hit) -> int:
        s = spec.sampling
        return self.gen.submit(
            ids[hit.tokens:] if hit else ids, max_tokens=spec.max_tokens, temp=s.temperature, top_p=s.top_p,
            min_p=s.min_p, top_k=s.top_k, seed=s.seed, stop=spec.stop, stop_tokens=[] if spec.ignore_eos else None,
            chat=False, cache=hit.caches if hit else None,
        )

    def _encode(self, spec: GenerationSpec) -> List[int]:
        tok = self.gen.tokenizer
        if spec.endpoint != "chat":
            return self.gen.encode(spec.prompt, chat=False)
        if not getattr(tok, "has_chat_template", False):
            raise bad_request("this model has no chat template: use /v1/completions with a prompt", "messages")
        try:
            ids = tok.apply_chat_template(spec.prompt, add_generation_prompt=True)
        except Exception as e:  # jinja's TemplateError and the like: the messages do not fit the template
            raise bad_request(f"the model's chat template rejected the messages: {e}", "messages") from None
        if hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def _reject(self, job: Job, error: APIError):
        job.done = True
        self._left_queue(job)
        self._send(job, Rejected(error))

    def _cancel(self, job: Job):
        job.abandoned = True
        if job.done or job.uid is None:
            return
        try:
            self.gen.cancel(job.uid)
        except KeyError:  # finished in the engine already; its last event is on its way
            pass

    def _route(self, ev):
        job = self._jobs.get(ev.uid)
        if job is None:
            return
        if not job.started:
            self._left_queue(job)
            if ev.token is not None:
                self.metrics.observe_ttft(time.perf_counter() - job.received_at)
        stop_token = ev.finish_reason == "stop" and ev.token in job.stop_ids
        logprob = None
        if job.spec.logprobs and ev.token is not None and not stop_token:
            logprob = (self.gen.tokenizer.decode([ev.token]), ev.logprob)
        if ev.text or logprob:
            self._send(job, Delta(ev.text, logprob))
        if ev.finish_reason is None:
            return
        completion = self.gen.result(ev.uid)
        del self._jobs[ev.uid]
        job.done = True
        if not (ev.finish_reason == "stop" and not stop_token):  # a stop string's row retires at the next step
            self._prefixes.pop(ev.uid, None)
        self.metrics.count_finished(ev.finish_reason)
        error = unavailable("the server ended the request") if ev.finish_reason == "cancelled" else None
        self._send(job, Finished(ev.finish_reason, len(completion.tokens), error))

    def _retired(self, request, caches, tokens):
        """``Engine(on_retire=...)``: keep a leaving row's caches in the prefix cache.
        (``tokens`` follow the ``request.context_len`` positions of the cached
        prefix the row started from, whose ids this worker kept.)"""
        prefix = self._prefixes.pop(request.uid, [])
        held = max((int(c.offset) for c in caches), default=0)
        ids = prefix[: request.context_len] + list(tokens)
        if held and len(ids) == held:
            self.prefix_cache.store(ids, caches)

    def _left_queue(self, job: Job):
        if not job.started:
            job.started = True
            with self._wake:
                self._waiting -= 1

    def _send(self, job: Job, message):
        if not job.abandoned:
            self._outgoing.append((job, message))

    def _flush(self):
        """Hand this step's messages to their event loops: one call per loop."""
        if not self._outgoing:
            return
        by_loop: Dict[object, List[Tuple[Job, object]]] = {}
        for job, msg in self._outgoing:
            by_loop.setdefault(job.loop, []).append((job, msg))
        self._outgoing = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass

    def _publish(self):
        eng = self.gen.engine
        traces: Dict[str, Tuple[int, int]] = {}
        for key, n in eng.compiled.traces.items():
            keys, made = traces.get(key.kind, (0, 0))
            traces[key.kind] = (keys + 1, made + n)
        s, pc = eng.stats, self.prefix_cache
        snap = EngineSnapshot(
            queue_depth=self._waiting, live_rows=len(eng.rows), bucket=eng.batch.width if eng.rows else 0,
            steps=s.steps, decode_tokens=s.decode_tokens, decode_s=s.decode_s, prefill_tokens=s.prefill_tokens,
            prefill_s=s.prefill_s, traces=traces, healthy=self.error is None and not self._stopping,
        )
        if pc is not None:
            snap.prefix_enabled = True
            snap.prefix_lookups, snap.prefix_hits = pc.stats.lookups, pc.stats.hits
            snap.prefix_hit_tokens, snap.prefix_evictions = pc.stats.hit_tokens, pc.stats.evictions
            snap.prefix_entries, snap.prefix_bytes, snap.prefix_max_bytes = len(pc), pc.nbytes, pc.max_bytes
        self.metrics.publish(snap)

    def _shutdown(self):
        """End every request still known (the thread is leaving)."""
        error = internal(f"the engine failed: {self.error}") if self.error else unavailable("the server is shutting down")
        with self._wake:
            self._stopping = True
            inbox = list(self._inbox)
            self._inbox.clear()
        for kind, job in inbox:
            if kind == "submit":
                self._reject(job, error)
        for job in list(self._jobs.values()):
            self._send(job, Finished("cancelled", 0, error))
        self._jobs.clear()
        try:
            self._publish()
        except Exception:
            pass
        self._flush()


def _deliver(items):
    for job, msg in items:
        job.queue.put_nowait(msg)
