"""Sharded decode: one rank per process over ``mx.distributed``, in lockstep.

Started by ``mlx.launch`` (e.g. ``mlx.launch --backend ring -n 2 python app.py``),
every rank loads the same model, shards it with the model's own mlx-lm
``shard(group)`` (tensor parallel: attention heads and MLP columns split,
one all-sum after each attention and each MLP) and runs the same scheduler on
the same inputs. Each rank traces its own compiled step; the all-sums are
inside the graph, so every trace, cache and in-place guarantee holds per rank.
Caches are sized from the local (sharded) KV heads by the probe forward.

Lockstep needs three things, all here:

* **the same decisions**: the scheduler is deterministic given its inputs;
  seeds of unseeded requests come from one generator seeded identically on
  every rank (:meth:`Lockstep.shared_seed`);
* **a loud failure if ranks ever disagree**: a running checksum of every
  request admitted (prompt, budget, sampler, PRNG key) and every token event,
  compared across ranks every ``check_every`` steps by one tiny
  ``all_gather`` dispatched behind the step (read at the next check, so the
  pipeline never waits for it: a divergence shows within ``2 * check_every``
  steps) and once more when the engine runs dry.
  Requests must be compared, not only tokens: ranks given different prompts
  can still agree on every token (each rank's partial sums are all-summed
  into one shared, wrong result), so the tokens alone may not show it;
* **no silent hang**: a peer that dies closes its sockets and MLX's ring
  backend raises ("connection to a peer was lost"), re-raised here as
  :class:`DistributedError`; a peer that hangs, or one that never connects,
  leaves the others blocked inside a collective forever, so a watchdog
  (:mod:`~mlx_tracer.runtime.watchdog`) kills the rank with a clear message
  when one step (or the group's start) makes no progress for
  ``MLX_TRACER_STEP_TIMEOUT`` seconds (default 300).
"""

from __future__ import annotations

import math
import os
import time
import zlib
from typing import Callable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .requests import TokenEvent
from .watchdog import Watchdog

DEFAULT_STEP_TIMEOUT = 300.0  # s: covers first traces (g++ JIT) and long prefill windows
DEFAULT_CHECK_EVERY = 8  # steps between cross-rank checksum comparisons
ENV_TIMEOUT = "MLX_TRACER_STEP_TIMEOUT"

_BACKEND_TAGS = ("[ring]", "[mpi]", "[nccl]", "[jaccl]", "[distributed]")  # how MLX's collective errors begin
_FINISH_CODES = {None: 0, "stop": 1, "length": 2, "cancelled": 3}
_HASH_MOD = 2_147_483_629  # a prime below 2**31: the checksum fits an int32


class DistributedError(RuntimeError):
    """A collective failed, or the ranks disagree: the run cannot go on."""


# ----------------------------------------------------------------- group
def step_timeout() -> float:
    """Seconds a step may wait on its peers (``$MLX_TRACER_STEP_TIMEOUT``)."""
    raw = os.environ.get(ENV_TIMEOUT)
    if raw is None:
        return DEFAULT_STEP_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{ENV_TIMEOUT} must be a positive number of seconds, got {raw!r}")
    return value


def init_group(timeout: Optional[float] = None) -> mx.distributed.Group:
    """The global group of the ranks ``mlx.launch`` started (backend from its
    environment). Without a launcher there is no group: a clear error.
    A peer that never connects ends the process after ``timeout`` seconds."""
    dog = Watchdog(step_timeout() if timeout is None else timeout, rank=os.environ.get("MLX_RANK", "?"))
    try:
        with dog.guard("starting the distributed group (waiting for every rank to connect)"):
            return mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise DistributedError(
            f"the distributed group could not start ({e}): launch every rank with mlx.launch, "
            "e.g. `mlx.launch --backend ring -n 2 python app.py`"
        ) from e
    finally:
        dog.close()


# --------------------------------------------------------------- sharding
def check_shardable(model, size: int) -> None:
    """Raise ``ValueError`` naming the reason unless mlx-lm's ``model.shard()``
    can split ``model`` over ``size`` ranks (checked on shapes, before any work)."""
    name = type(model).__module__.rsplit(".", 1)[-1] + "." + type(model).__name__
    if not callable(getattr(model, "shard", None)):
        raise ValueError(
            f"{name} has no shard(): mlx-lm implements tensor-parallel sharding only for some model "
            "families (llama, qwen2, qwen3, ...); run this model on one process"
        )
    if size == 1:
        return
    counts = _split_counts(model)
    bad = {what: n for what, n in counts.items() if n % size}
    if bad:
        ok = [d for d in range(1, math.gcd(*counts.values()) + 1) if all(n % d == 0 for n in counts.values())]
        listed = ", ".join(f"{n} {what}" for what, n in bad.items())
        raise ValueError(
            f"{name} cannot be split across {size} ranks: {listed} do not divide by {size}; "
            f"run with a number of ranks that divides them ({', '.join(map(str, ok))})"
        )


def _split_counts(model) -> dict:
    """What ``shard()`` divides among ranks (gcd over layers): attention heads,
    KV heads, MLP columns, and quantization groups of the input dimensions it
    splits (o_proj, down_proj)."""
    counts = {}

    def add(what, n):
        counts[what] = math.gcd(counts.get(what, 0), n)

    for layer in getattr(model, "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for what, names in (("attention heads", ("n_heads", "num_heads")), ("KV heads", ("n_kv_heads", "num_key_value_heads"))):
            n = next((getattr(attn, a) for a in names if isinstance(getattr(attn, a, None), int)), None)
            if n is not None:
                add(what, n)
        down = getattr(mlp, "down_proj", None)
        if hasattr(down, "weight"):
            packed = 32 // down.bits if hasattr(down, "bits") else 1  # quantized weights pack 32/bits values per word
            add("MLP columns", down.weight.shape[-1] * packed)
        for lin in (getattr(attn, "o_proj", None), down):
            if hasattr(lin, "group_size"):  # a quantized input dimension splits by whole groups
                add("quantization groups", lin.scales.shape[-1])
    if not counts:
        args = getattr(model, "args", None)
        for what, a in (("attention heads", "num_attention_heads"), ("KV heads", "num_key_value_heads")):
            if isinstance(getattr(args, a, None), int):
                add(what, getattr(args, a))
    return counts


_SHARDED = (nn.AllToShardedLinear, nn.ShardedToAllLinear, nn.QuantizedAllToShardedLinear, nn.QuantizedShardedToAllLinear)


def sharded_size(model) -> int:
    """The number of ranks ``model`` is sharded over (1: not sharded), read off its sharded layers."""
    return next((m.group.size() for m in model.modules() if isinstance(m, _SHARDED)), 1)


def shard_model(model, group: mx.distributed.Group):
    """Check, then shard ``model`` in place over ``group`` with its own
    ``shard()``; a model already sharded over this group's size is left as is."""
    size, done = group.size(), sharded_size(model)
    if done != 1:
        if done == size:
            return model
        raise ValueError(f"the model is already sharded over {done} ranks, not {size}: load it again")
    check_shardable(model, size)
    if size > 1:
        model.shard(group)
        mx.eval(model.parameters())
    return model


# --------------------------------------------------------------- lockstep
class Lockstep:
    """Runs engine steps of one rank in lockstep with its peers (see the
    module docstring): guarded by the watchdog, collective failures made
    clear, and token events compared across ranks.

    Args:
        group: the ranks' group (``init_group()``).
        check_every: steps between checksum comparisons (0: only when the
            engine runs dry).
        timeout: seconds one step may take (default ``$MLX_TRACER_STEP_TIMEOUT``).
    """

    def __init__(self, group: mx.distributed.Group, check_every: int = DEFAULT_CHECK_EVERY, timeout: Optional[float] = None):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.check_every = check_every
        self.watchdog = Watchdog(step_timeout() if timeout is None else timeout, rank=f"{self.rank}/{self.size}")
        self.steps = 0
        self.checksum = 0  # over every request and event so far, in order
        self._next_uid = 0  # requests below this uid are in the checksum
        self._pending: Optional[mx.array] = None  # the last dispatched comparison [size, 2]
        self.checks = 0
        self.waiting: Optional[Tuple[str, float]] = None  # (what, since when) while inside collective()

    @property
    def is_primary(self) -> bool:
        """Rank 0: the one that prints."""
        return self.rank == 0

    def collective(self, what: str, fn: Callable, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` (which waits on peers) under the
        watchdog, with a failed collective re-raised as :class:`DistributedError`."""
        outer, self.waiting = self.waiting, (what, time.monotonic())
        try:
            with self.watchdog.guard(what):
                return fn(*args, **kwargs)
        except RuntimeError as e:
            if isinstance(e, DistributedError) or not str(e).startswith(_BACKEND_TAGS):
                raise
            raise DistributedError(
                f"rank {self.rank}/{self.size}: {what} failed: {e}; another rank probably died "
                f"(lost {self.peers()}: see its output)"
            ) from e
        finally:
            self.waiting = outer

    def stalled(self, seconds: float) -> Optional[str]:
        """What this rank has been waiting on its peers for, longer than
        ``seconds`` (None: nothing). Any thread may ask: a collective lets go of
        the GIL while it waits, and when a peer dies MLX's ring backend
        sometimes leaves it waiting for good instead of raising."""
        waiting = self.waiting
        if waiting is None or time.monotonic() - waiting[1] <= seconds:
            return None
        return (f"rank {self.rank}/{self.size}: {waiting[0]} made no progress for {seconds:g} s: lost {self.peers()} "
                "(it died or hangs: see its output)")

    def peers(self) -> str:
        """The other ranks, in words (``"rank 1"``; ``"one of ranks 0, 2, 3"``)."""
        others = [r for r in range(self.size) if r != self.rank]
        return f"rank {others[0]}" if len(others) == 1 else "one of ranks " + ", ".join(map(str, others))

    def shared_seed(self) -> int:
        """One random seed, equal on every rank (rank 0's, all-summed)."""
        mine = int(np.random.default_rng().integers(0, 2**31 - 1))
        return self.collective("agreeing on a seed", rank0_value, self.group, mine)

    def step(self, engine) -> List[TokenEvent]:
        """One ``engine.step()`` in lockstep; raises :class:`DistributedError`
        when the ranks' events have diverged."""
        for req in engine.queue:  # uids only grow: the new ones are the requests added since the last step
            if req.uid >= self._next_uid:
                self.checksum = _fold(self.checksum, _request_values(req))
                self._next_uid = req.uid + 1
        events = self.collective(f"decode step {self.steps}", engine.step)
        self.steps += 1
        for ev in events:
            self.checksum = _fold(self.checksum, (ev.uid, -1 if ev.token is None else ev.token, _FINISH_CODES[ev.finish_reason]))
        if not engine.has_work():
            self.collective("comparing tokens across ranks", self.verify)
        elif self.check_every and self.steps % self.check_every == 0:
            self.collective("comparing tokens across ranks", self._dispatch_check)
        return events

    def verify(self):
        """Compare every rank's checksum now (waits for the steps in flight)."""
        self._dispatch_check()
        self._read_check()

    def _dispatch_check(self):
        self._read_check()  # the previous comparison: finished long ago
        mine = mx.array([self.steps % _HASH_MOD, self.checksum], dtype=mx.int32)
        self._pending = mx.distributed.all_gather(mine[None], group=self.group)  # [size, 2]
        mx.async_eval(self._pending)

    def _read_check(self):
        if self._pending is None:
            return
        seen = np.array(self._pending)  # [size, 2] (step, checksum) per rank
        self._pending = None
        self.checks += 1
        if (seen != seen[0]).any():
            raise DistributedError(
                f"ranks disagree on their requests or generated tokens (rank {self.rank} sees (step, checksum) "
                f"per rank {seen.tolist()}): every rank must get the same requests in the same order"
            )


def _fold(h: int, values) -> int:
    for x in values:
        h = (h * 1_000_003 + int(x) + 7) % _HASH_MOD
    return h


def _request_values(req) -> list:
    """What must be equal about a request on every rank, as integers."""
    sampler = zlib.crc32(repr(req.sampling).encode())  # (str hashes differ between processes)
    return [req.uid, req.max_tokens, sampler, *req.key.tolist(), len(req.prompt), *req.prompt]


def rank0_value(group: mx.distributed.Group, value: int) -> int:
    """Rank 0's int32 ``value``, on every rank."""
    mine = value if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array([mine], dtype=mx.int32), group=group).item())


def rank0_text(group: mx.distributed.Group, text: str, size: int = 64) -> str:
    """Rank 0's short ``text`` (at most ``size`` bytes), on every rank."""
    raw = np.zeros(size, dtype=np.int32)
    if group.rank() == 0:
        data = text.encode()[:size]
        raw[: len(data)] = list(data)
    summed = np.array(mx.distributed.all_sum(mx.array(raw), group=group))
    return bytes(summed[summed > 0].astype(np.uint8).tolist()).decode()


def rank0_bytes(group: mx.distributed.Group, tag: int = 0, data: bytes = b"") -> Tuple[int, bytes]:
    """Rank 0's ``(tag, data)`` on every rank (the others' arguments are
    ignored): one all-sum of ``[tag, len(data)]``, then, when there are bytes,
    one of the bytes (``uint8``, zeros from every other rank)."""
    head = np.array([tag, len(data)] if group.rank() == 0 else [0, 0], dtype=np.int32)
    tag, n = np.array(mx.distributed.all_sum(mx.array(head), group=group)).tolist()
    if n == 0:
        return tag, b""
    raw = np.frombuffer(data, dtype=np.uint8) if group.rank() == 0 else np.zeros(n, dtype=np.uint8)
    return tag, np.array(mx.distributed.all_sum(mx.array(raw), group=group)).tobytes()


def load_sharded(load: Callable, path, progress: bool = True, weights: str = "auto", log=lambda s: None):
    """``(model, tokenizer, group)``: start the group, load the model on every
    rank with ``load`` (the API's loader: the runtime loads nothing itself),
    agree on rank 0's weight format, check and shard the model."""
    group = init_group()
    model, tokenizer = load(path, progress=progress, weights=weights, log=log)
    check_shardable(model, group.size())  # every rank raises the same error, before any work
    chosen = getattr(model, "mlx_tracer_weights", weights)
    dog = Watchdog(step_timeout(), rank=f"{group.rank()}/{group.size()}")
    try:
        with dog.guard("agreeing on the weights format"):
            agreed = rank0_text(group, chosen)
    finally:
        dog.close()
    if agreed != chosen:  # "auto" measured differently on this rank: take rank 0's format
        model, tokenizer = load(path, progress=progress, weights=agreed, log=log)
    return shard_model(model, group), tokenizer, group
