"""The engine thread: the one thread that touches the model.

:class:`EngineWorker` owns a :class:`~mlx_tracer.generator.Generator` (its
engine, caches, prefix cache, tokenizer and every MLX call). The HTTP
front end tokenizes each prompt on a thread of its own (:meth:`tokenize`,
which uses the tokenizer only) and talks to it through two thread-safe calls,
:meth:`submit` and :meth:`cancel`, which append to an inbox; the thread applies the inbox
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
from typing import Deque, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from ..generator import Generator
from ..runtime.distributed import DistributedError
from ..runtime.options import OptionError, check_buckets, check_context_length, check_queue_size
from .errors import APIError, bad_request, internal, invalid_option, queue_full, unavailable
from .jobs import Admitted, Delta, Finished, Job, Rejected
from .metrics import ServerMetrics, ServerSnapshot
from .protocol import GenerationSpec
from .responses import TokenLogprob
from .ranks import Leader


class EngineWorker:
    """Runs a Generator on its own thread for the HTTP front end.

    Args:
        generator: the model, tokenizer and compiled loop (used by this thread only,
            once started); built with ``prefix_cache=PrefixCache(n)`` for a prefix cache.
        model_id: the name clients use for the model.
        max_queue: the most accepted requests waiting for a row; one more is answered 503.
        metrics: where to publish (a new :class:`ServerMetrics` by default).
        prefix_cache_bytes: moved to the Generator (``Generator.load(prefix_cache=PrefixCache(n))``).

    Rank 0 of a sharded model passes a :class:`~.ranks.Leader` of its
    Generator: every call that changes the generator then reaches every rank,
    and the thread steps at least every ``Leader.heartbeat_s`` seconds (idle:
    a step with nothing to do); when the thread ends, the Leader stops the
    other ranks.
    """

    def __init__(self, generator: Union[Generator, Leader], model_id: str, max_queue: int = 64, prefix_cache_bytes: int = 0,
                 metrics: Optional[ServerMetrics] = None):
        max_queue = check_queue_size(max_queue)
        if prefix_cache_bytes:
            raise TypeError("EngineWorker(prefix_cache_bytes=n) moved to the Generator: build it with "
                            "prefix_cache=PrefixCache(n) (mlx_tracer.runtime.prefix_cache), e.g. Generator.load(prefix_cache=...)")
        self.gen = generator
        self.model_id = model_id
        self.max_queue = max_queue
        self.metrics = metrics or ServerMetrics()
        self.context_limit: Optional[int] = generator.engine.max_context  # positions a request can reach
        self.error: Optional[BaseException] = None  # what stopped the thread, if it failed
        self._inbox: Deque[Tuple[str, Job]] = deque()
        self._wake = threading.Condition()
        self._waiting = 0  # accepted, not yet in a row (under _wake)
        self._stopping = False
        self._jobs: Dict[int, Job] = {}  # engine uid -> job, until finished
        self._outgoing: List[Tuple[Job, object]] = []
        self._warmup: Tuple[int, ...] = ()
        self.warmup_ms: Dict[object, float] = {}  # trace -> ms, of the warmup
        self._ready = threading.Event()
        self._leader = generator if isinstance(generator, Leader) else None
        self._idle_s = None if self._leader is None else self._leader.heartbeat_s  # the longest wait for work
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
    def group_failed(self) -> bool:
        """Whether the thread stopped because the ranks' group failed (a
        sharded server whose peer died): MLX may then hold a collective
        that never ends, so nothing may wait on MLX's streams any more."""
        return isinstance(self.error, DistributedError)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.error is None

    @property
    def queue_depth(self) -> int:
        return self._waiting

    def tokenize(self, spec: GenerationSpec) -> List[int]:
        """The request's prompt as token ids, checked against the model's
        position limit; raises :class:`APIError` (400) naming the prompt.

        Any thread: it uses the tokenizer only (encoding is thread-safe, and
        its Rust encoder lets go of the GIL), never MLX. The front end calls it
        beside its event loop, so a long prompt stalls neither the engine
        thread nor the other requests' streams."""
        prompt = "messages" if spec.endpoint == "chat" else "prompt"  # what this request calls its prompt
        try:
            ids = self._encode(spec)
            check_context_length(len(ids), spec.max_tokens, self.context_limit, param=prompt,
                                 max_param=spec.max_tokens_param, limit_name="position limit")
        except OptionError as e:
            raise invalid_option(e, prompt if e.param == "prompt" else None) from None
        except (ValueError, TypeError) as e:  # text the tokenizer refuses (protocol.py catches lone surrogates first)
            raise bad_request(f"the tokenizer could not encode the {prompt} ({type(e).__name__})", prompt) from None
        return ids

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

    # -------------------------------------------------- front-end thread
    def submit(self, spec: GenerationSpec, ids: List[int], loop, received_at: Optional[float] = None) -> Job:
        """Queue a request whose prompt :meth:`tokenize` gave ``ids`` (raises
        :class:`APIError` 503 when full or stopped)."""
        if not self.running:
            raise unavailable("the engine is not running" + (f": {self.error}" if self.error else ""))
        job = Job(spec, loop, time.perf_counter() if received_at is None else received_at, list(ids))
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
                        if not self._wake.wait(self._idle_s):
                            break  # (sharded) idle for a beat: the step below tells the other ranks all is well
                    if self._stopping:
                        break
                    inbox = list(self._inbox)
                    self._inbox.clear()
                for kind, job in inbox:
                    self._admit(job) if kind == "submit" else self._cancel(job)
                self._flush()
                for ev in self.gen.step():  # (nothing to do: no step, or a sharded server's heartbeat)
                    self._route(ev)
                self._publish()
                self._flush()
        except BaseException as e:  # the engine's state is unknown now: fail everything, report unhealthy
            self.error = e
            why = str(e) if isinstance(e, DistributedError) else f"\n{traceback.format_exc()}"  # (a peer's fate: no traceback)
            print(f"mlx-tracer serve: the engine thread failed: {why}", file=sys.stderr, flush=True)
        finally:
            self._ready.set()
            self._shutdown()
            if self._leader is not None:
                self._close_leader()
            # MLX gives each thread its own streams; left behind, they abort
            # the process at exit ("terminate called without an active exception").
            # Not after the group failed: a collective still queued (the
            # lockstep's checksum) may wait for the dead peer for good, and
            # the server exits at once then (``mlx-tracer serve``)
            if not self.group_failed:
                try:
                    mx.synchronize()
                    mx.clear_streams()
                except Exception:
                    pass

    def _close_leader(self):
        try:
            self._leader.close(self.error)
        except DistributedError as e:  # a peer went away as the server stopped
            self.error = self.error or e
            print(f"mlx-tracer serve: could not stop the other ranks: {e}", file=sys.stderr, flush=True)

    def _admit(self, job: Job):
        spec, ids = job.spec, job.prompt
        prompt = "messages" if spec.endpoint == "chat" else "prompt"
        try:
            s = spec.sampling
            uids = self.gen.submit_choices(
                ids, spec.n, max_tokens=spec.max_tokens, temp=s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k,
                seed=s.seed, stop=spec.stop, stop_tokens=[] if spec.ignore_eos else None, chat=False,
                repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty, logit_bias=dict(s.logit_bias) or None, top_logprobs=s.top_logprobs)
        except APIError as e:
            return self._reject(job, e)
        except OptionError as e:
            return self._reject(job, invalid_option(e, prompt if e.param == "prompt" else None))
        except (ValueError, TypeError) as e:
            return self._reject(job, bad_request(str(e), prompt))
        except Exception as e:  # a bug: answer this request, keep serving the others
            traceback.print_exc(file=sys.stderr)
            return self._reject(job, internal(f"could not start the request: {type(e).__name__}: {e}"))
        job.uids, job.cached = list(uids), self.gen.cached_tokens(uids[0])
        job.stop_ids = frozenset() if spec.ignore_eos else frozenset(self.gen.tokenizer.eos_token_ids)
        for uid in uids:
            self._jobs[uid] = job
        self._send(job, Admitted(len(ids), job.cached))

    def _reject(self, job: Job, error: APIError):
        job.done = True
        self._left_queue(job)
        self._send(job, Rejected(error))

    def _cancel(self, job: Job):
        job.abandoned = True
        if job.done:
            return
        for uid in job.uids:
            if uid in self._jobs:
                try:
                    self.gen.cancel(uid)
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
        index = job.uids.index(ev.uid)  # the choice
        stop_token = ev.finish_reason == "stop" and ev.token in job.stop_ids
        logprob = None
        if job.spec.logprobs and ev.token is not None and not stop_token:
            decode = self.gen.tokenizer.decode
            logprob = TokenLogprob(decode([ev.token]), ev.logprob, [(decode([t]), lp) for t, lp in ev.top_logprobs or ()])
        if ev.text or logprob:
            self._send(job, Delta(ev.text, logprob, index))
        if ev.finish_reason is None:
            return
        completion = self.gen.result(ev.uid)
        del self._jobs[ev.uid]
        job.finished += 1
        job.done = job.finished == len(job.uids)
        self.metrics.count_finished(ev.finish_reason)
        error = unavailable("the server ended the request") if ev.finish_reason == "cancelled" else None
        self._send(job, Finished(ev.finish_reason, len(completion.tokens), error, index))

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
        e = self.gen.engine.snapshot()
        s, pc = e.stats, e.prefix_cache
        snap = ServerSnapshot(
            queue_depth=self._waiting, live_rows=e.live_rows, bucket=e.bucket, steps=s.steps,
            decode_tokens=s.decode_tokens, decode_s=s.decode_s, prefill_tokens=s.prefill_tokens, prefill_s=s.prefill_s,
            traces=e.traces_by_kind(), healthy=self.error is None and not self._stopping,
        )
        if pc is not None:
            snap.prefix_enabled = True
            snap.prefix_lookups, snap.prefix_hits = pc.stats.lookups, pc.stats.hits
            snap.prefix_hit_tokens, snap.prefix_evictions = pc.stats.hit_tokens, pc.stats.evictions
            snap.prefix_entries, snap.prefix_bytes, snap.prefix_max_bytes = pc.entries, pc.nbytes, pc.max_bytes
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
        for job in {id(j): j for j in self._jobs.values()}.values():  # one message per request, whatever its n
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
