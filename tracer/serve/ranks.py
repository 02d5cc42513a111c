"""One server over a sharded model: rank 0 serves HTTP and decides, every rank runs the same steps.

Under ``mlx.launch`` (``mlx.launch --backend ring -n 2 -- mlx-tracer serve
--distributed ...``) every rank loads the same sharded
:class:`~mlx_tracer.generator.Generator` (:mod:`mlx_tracer.runtime.distributed`).
Only rank 0 runs the HTTP front end and the engine thread
(:class:`~.worker.EngineWorker`), to which it hands a :class:`Leader` in
place of the Generator. The Leader makes each call of the worker that changes
the generator (``submit``, ``cancel``, ``warmup``, ``step``) and records it;
before each call that runs collectives (``step``, ``warmup``) it sends the
calls recorded since the last one to every rank as one small payload
(:func:`~mlx_tracer.runtime.distributed.rank0_bytes`). The other ranks run
:func:`follow`: wait for the next payload, make the same calls in the same
order (a submit must give the uid it gave on rank 0, or fail the same way),
step. So every admission (prompt, budget, sampler, seed; unseeded requests
draw from the generator's shared generator of seeds in the same order), every
cancellation and every step reach every rank identically, while the engine
knows nothing of ranks; Lockstep's checksum (inside ``Generator.step``) still
compares every rank's requests and tokens.

Idle: the engine thread waits for work at most :data:`HEARTBEAT_S` seconds,
then steps anyway (a step with nothing to do), so rank 0 sends a payload at
least that often, marked idle when there is nothing to do. MLX's ring backend
waits in a collective by polling its sockets (about a quarter of a core here),
so after an idle payload the other ranks sleep one beat before they wait for
the next: an idle server costs a few collectives a second and no polling, and a
request that arrives then waits at most one beat longer for its first step.
Their watchdog (``MLX_TRACER_STEP_TIMEOUT``) never takes an idle server for a
stuck one, and a rank that dies while the server is idle is noticed within a beat.

Stopping: the engine thread ends with :meth:`Leader.close`: a stop payload
(the other ranks return from :func:`follow`) or, when rank 0 failed for
another reason than its peers, the reason (they raise it). A peer that dies
makes rank 0's next collective fail: the worker ends every open request with
an error, and ``mlx-tracer serve`` stops the HTTP server and exits 1. Often,
though, MLX's ring backend logs the lost peer and leaves the collective
waiting for good; then :meth:`Leader.stalled` says so once the engine thread
has waited ``MLX_TRACER_STEP_TIMEOUT`` seconds, and the CLI cuts the open
requests (error event, ``[DONE]``) and exits 1; the watchdog process, moved
:data:`STALL_MARGIN_S` later, stays the last resort.

The payload is a pickle: the ranks are one program started together, and
already trust each other with every tensor they exchange.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from ..runtime.distributed import DistributedError, Lockstep, rank0_bytes

STALL_MARGIN_S = 15.0  # after the stall limit: when the watchdog process ends rank 0, should the server not end itself
HEARTBEAT_S = 0.1  # the longest rank 0 stays silent while idle (and the others' nap after an idle payload)
ORDERS, IDLE, STOP, ABORT = 1, 2, 3, 4  # payload tags (IDLE: orders, then nothing to do)
_COLLECTIVE = ("warmup", "step")  # calls every rank must make together
_LOCAL = ("submit", "submit_choices", "cancel")  # calls that change only this rank's state (checked by their outcome)


@dataclass(frozen=True)
class Raised:
    """The outcome of a call that raised (by the exception's type name)."""

    error: str


@dataclass
class Order:
    """One generator call rank 0 made, and what came of it (for ``submit``:
    the uid, or :class:`Raised`), for the other ranks to make in turn."""

    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    outcome: Any = None


class Leader:
    """Rank 0's Generator as the server's engine thread sees it (see the
    module docstring): the calls the worker makes, sent to every rank.

    Use it from one thread only (the engine thread), like the Generator.
    ``result`` is not sent: every rank takes the result of each request that
    finished itself (the worker does so for every finished request)."""

    heartbeat_s = HEARTBEAT_S

    def __init__(self, generator):
        if generator.lockstep is None:
            raise ValueError("Leader serves a sharded Generator: load it with Generator.load(..., distributed=True)")
        if not generator.is_primary:
            raise ValueError(f"the Leader runs on rank 0, not on rank {generator.rank}: the other ranks run follow()")
        self.gen = generator
        self.lockstep: Lockstep = generator.lockstep
        self.engine = generator.engine
        self.tokenizer = generator.tokenizer
        self.sent = 0  # payloads sent
        self._orders: List[Order] = []
        self.stall_s = self.lockstep.watchdog.timeout  # a collective waiting longer: a lost peer (stalled())
        self.lockstep.watchdog.timeout = self.stall_s + STALL_MARGIN_S  # the server ends itself first

    def stalled(self) -> Optional[str]:
        """Why the engine thread is stuck waiting on a peer (any thread may ask), or None."""
        return self.lockstep.stalled(self.stall_s)

    # ---------------------------------------------- read-only: this rank only
    def encode(self, *args, **kwargs) -> List[int]:
        return self.gen.encode(*args, **kwargs)

    def cached_tokens(self, uid: int) -> int:
        return self.gen.cached_tokens(uid)

    def result(self, uid: int):
        return self.gen.result(uid)

    # ------------------------------------------------- made on every rank
    def submit(self, prompt: Sequence[int], *args, **kwargs) -> int:
        return self._local(Order("submit", (list(prompt), *args), kwargs))

    def submit_choices(self, prompt: Sequence[int], *args, **kwargs) -> List[int]:
        return self._local(Order("submit_choices", (list(prompt), *args), kwargs))

    def cancel(self, uid: int):
        self._local(Order("cancel", (uid,)))

    def warmup(self, buckets: Optional[Sequence[int]] = None, prefill: bool = True) -> dict:
        self._orders.append(Order("warmup", (None if buckets is None else list(buckets), prefill)))
        self._send(ORDERS)
        return self.gen.warmup(buckets, prefill)

    def step(self):
        """One step on every rank (with nothing to do: a heartbeat)."""
        self._orders.append(Order("step"))
        self._send(ORDERS if self.engine.has_work() else IDLE)
        return self.gen.step()

    def close(self, error: Optional[BaseException] = None):
        """Stop the other ranks: cleanly, or (``error``) failing with rank 0's
        reason. Nothing to send when the group itself failed (a
        :class:`DistributedError`): the others notice on their own."""
        if isinstance(error, DistributedError):
            return
        self._orders = []
        if error is None:
            self._send(STOP)
        else:
            self._send(ABORT, f"{type(error).__name__}: {error}".encode())

    def _local(self, order: Order):
        self._orders.append(order)
        try:
            order.outcome = getattr(self.gen, order.method)(*order.args, **order.kwargs)
        except Exception as e:  # the others must fail the same way (the worker answers the client)
            order.outcome = Raised(type(e).__name__)
            raise
        return order.outcome

    def _send(self, tag: int, data: Optional[bytes] = None):
        if data is None:
            data = pickle.dumps(self._orders, protocol=pickle.HIGHEST_PROTOCOL)
        self._orders = []
        self.lockstep.collective("sending the next step's requests and cancellations to the other ranks",
                                 rank0_bytes, self.lockstep.group, tag, data)
        self.sent += 1


@dataclass
class FollowerStats:
    """What a rank other than 0 did in :func:`follow`."""

    steps: int = 0  # that had work
    requests: int = 0
    cancelled: int = 0
    live_rows: int = 0  # when it stopped

    def __str__(self) -> str:
        return (f"{self.steps} steps, {self.requests} requests ({self.cancelled} cancelled), "
                f"{self.live_rows} rows live at the end")


def follow(generator, log=lambda msg: None) -> FollowerStats:
    """Run a rank other than 0 of a sharded server: make rank 0's calls on
    ``generator`` as they come, until rank 0 stops the group (then return
    what was done) or fails (then raise :class:`DistributedError`).

    On the main thread, SIGINT and SIGTERM do not end the rank at once: rank 0
    decides when every rank stops (Ctrl-C under ``mlx.launch`` reaches every
    rank; rank 0 drains, then stops the others). A second signal ends it."""
    lock: Lockstep = generator.lockstep
    if lock is None or generator.is_primary:
        raise ValueError("follow() runs on the ranks other than 0 of a sharded Generator (distributed=True)")
    me = f"rank {lock.rank}/{lock.size}"
    stats = FollowerStats()
    with _rank0_decides(me, log):
        while True:
            tag, data = lock.collective("waiting for rank 0's next step", rank0_bytes, lock.group)
            if tag == STOP:
                stats.live_rows = generator.engine.snapshot().live_rows
                return stats
            if tag == ABORT:
                raise DistributedError(f"{me}: rank 0 failed ({data.decode(errors='replace')}); stopping too")
            if tag not in (ORDERS, IDLE):
                raise DistributedError(f"{me}: rank 0 sent an unknown message (tag {tag}): is every rank the same version?")
            for order in pickle.loads(data):
                _replay(generator, order, stats, me)
            if tag == IDLE:
                time.sleep(HEARTBEAT_S)  # rank 0 has nothing to do: nap instead of polling in the collective


def _replay(gen, order: Order, stats: FollowerStats, me: str):
    if order.method in _COLLECTIVE:
        busy = gen.engine.has_work()
        got = getattr(gen, order.method)(*order.args, **order.kwargs)
        if order.method == "step":
            stats.steps += busy
            for ev in got:
                if ev.finish_reason is not None:
                    stats.cancelled += ev.finish_reason == "cancelled"
                    gen.result(ev.uid)  # as rank 0's worker takes each finished request's result
        return
    if order.method not in _LOCAL:
        raise DistributedError(f"{me}: rank 0 asked for {order.method!r}, which ranks do not repeat: "
                               "is every rank the same version?")
    try:
        got = getattr(gen, order.method)(*order.args, **order.kwargs)
    except Exception as e:  # rank 0 failed the same way (it answered its client)
        got = Raised(type(e).__name__)
    if got != order.outcome:
        raise DistributedError(f"{me}: {order.method} gave {got!r} here and {order.outcome!r} on rank 0: the ranks' "
                               "generators differ (same model, options and version on every rank?)")
    if not isinstance(got, Raised) and order.method != "cancel":
        stats.requests += len(got) if isinstance(got, list) else 1


@contextlib.contextmanager
def _rank0_decides(me: str, log):
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    seen = []

    def handler(sig, frame):
        if seen:
            raise KeyboardInterrupt
        seen.append(sig)
        log(f"mlx-tracer serve: {me}: {signal.Signals(sig).name}: rank 0 decides when every rank stops "
            "(signal rank 0 to drain and stop the group); a second signal ends this rank now")

    handled = (signal.SIGINT, signal.SIGTERM)
    original = {sig: signal.signal(sig, handler) for sig in handled}
    try:
        yield
    finally:
        for sig, h in original.items():
            signal.signal(sig, h)
