"""Speculative decoding in the bench: plain compiled decode against prompt
lookup on the same requests, greedy, per bucket.

Two workloads: text that quotes its prompt (prompt lookup finds drafts
there) and free text (it mostly does not). Per (workload, bucket): tokens/s
of both (the engine's decode tokens over its decode seconds, the median of
``reps`` runs after a first that traces), the speedup, the share of drafts
accepted, tokens per verify step (all rows together), the verify steps of
the last run and, per window length the policy measured, a verify step's
cost in decode steps of the same bucket (the speculator's own smoothed
timings; plain steps pipelined as it runs them). Both systems must emit the
same tokens: a difference raises :class:`SpeculationChangedTokens`.
Used by ``mlx-tracer bench --spec``, ``benchmarks/speculative.py`` and the
notebook.
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Callable, Dict, List, Sequence, Tuple

PASSAGE = (
    "The Eiffel Tower was built for the 1889 World's Fair in Paris. It is 330 metres tall and was the tallest "
    "man-made structure in the world for 41 years. Gustave Eiffel's company designed and built the tower."
)
WORKLOADS = {
    "quotes its prompt": [f"Repeat this text exactly, word for word: {PASSAGE}",
                          f"Copy the following paragraph without changes: {PASSAGE}",
                          f"Rewrite this with the same words: {PASSAGE}",
                          f"Say it again exactly: {PASSAGE}"],
    "free text": ["Write a short story about a robot.", "Explain how rain forms.",
                  "Describe a day at the beach.", "Why is the sky blue?"],
}
# Prompts the bench does not run, for judging a policy on text it was not tuned on (benchmarks/spec_ceiling.py
# --workload): copying, editing and restating a passage, an email and a piece of code.
_PLANTS = ("Photosynthesis converts light energy into chemical energy. Plants use water and carbon dioxide to make "
           "glucose and release oxygen. It happens mostly in the leaves, inside the chloroplasts.")
_EMAIL = ("Dear team, the meeting on Friday is moved to 3 pm in room 204. Please bring your quarterly reports and the "
          "budget draft. Lunch will be provided.")
_CODE = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\nprint(add(2, 3), mul(4, 5))"
REPLAY_WORKLOADS = {
    **WORKLOADS,
    "edits its prompt": [f"Repeat this text exactly: {_PLANTS}",
                         "Fix the spelling in this text and return it in full: "
                         + _PLANTS.replace("energy", "enrgy", 1),
                         f"Rename the function add to plus in this code and return the full code:\n{_CODE}",
                         f"Copy this email word for word: {_EMAIL}",
                         f"Translate this into formal English, keeping the same details: {_EMAIL}",
                         f"Summarise in one sentence: {_PLANTS}",
                         f"Repeat the following code exactly:\n{_CODE}",
                         f"Write the text again, in capital letters: {_EMAIL}"],
}
SPEC_HEADER = (f"{'workload':<18} {'B':>2} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'accepted':>8} "
               f"{'tok/verify':>10} {'verify':>6} verify/decode by window L")


class SpeculationChangedTokens(AssertionError):
    """Speculative decoding emitted other greedy tokens than plain decoding."""


@dataclass
class SpecRow:
    workload: str
    bucket: int
    plain_tps: float
    spec_tps: float
    acceptance: float  # share of drafts accepted
    tokens_per_verify: float  # all rows of the bucket
    verify_steps: int  # in the last run
    verify_over_decode: Dict[int, float] = field(default_factory=dict)  # window length -> verify step / decode step

    @property
    def speedup(self) -> float:
        return self.spec_tps / self.plain_tps if self.plain_tps else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}


def format_spec_row(r: SpecRow) -> str:
    cost = " ".join(f"L{L}:{c:.2f}" for L, c in sorted(r.verify_over_decode.items())) or "-"
    return (f"{r.workload:<18} {r.bucket:>2} {r.plain_tps:>11.1f} {r.spec_tps:>10.1f} {r.speedup:>6.2f}x "
            f"{r.acceptance:>7.0%} {r.tokens_per_verify:>10.2f} {r.verify_steps:>6} {cost}")


def workload_batches(prompts: Sequence[str], bucket: int) -> List[List[str]]:
    """The batches a bucket runs a workload's prompts in, each ``bucket``
    wide: every prompt at least once, the prompts in turn (a bucket of 1
    runs each alone, one after another; a bucket wider than the workload, one
    batch repeating them)."""
    n = len(prompts)
    return [[prompts[(i + j) % n] for j in range(bucket)] for i in range(0, max(n, 1), bucket)]


def spec_rows(plain, buckets: Sequence[int] = (1, 4), k: int = 4, tokens: int = 64, reps: int = 3,
              policy: str = "auto", workloads: Sequence[str] = tuple(WORKLOADS),
              on_row: Callable[[SpecRow], None] = lambda r: None) -> List[SpecRow]:
    """One :class:`SpecRow` per (workload, bucket) for ``plain``, a
    :class:`~mlx_tracer.Generator` (its model and tokenizer also serve the
    speculative one: prompt lookup, ``k`` drafts, ``policy``). Each bucket
    runs the workload's prompts in :func:`workload_batches` (tokens/s over all
    of them); a bucket wider than a workload's prompts repeats them."""
    from ..generator import Generator

    spec = Generator(plain.model, plain.tokenizer, speculative="prompt-lookup", draft_tokens=k, spec_policy=policy)
    rows = []
    for name in workloads:
        prompts = WORKLOADS[name]
        for B in buckets:
            batches = workload_batches(prompts, B)
            times = {"plain": [], "spec": []}
            outs = {}
            for rep in range(reps + 1):  # the first run traces and builds kernels
                for label, gen in (("plain", plain), ("spec", spec)):
                    gen.engine.reset_stats()
                    res = [c for batch in batches for c in gen.batch_generate(batch, max_tokens=tokens)]
                    if rep:
                        times[label].append(gen.stats.decode_tps)  # over every batch of the run
                    outs[label] = [c.tokens for c in res]
            if outs["plain"] != outs["spec"]:
                raise SpeculationChangedTokens(f"speculative decoding changed greedy tokens ({name}, bucket {B})")
            st = spec.stats
            step_s = spec.engine.speculator.step_s
            decode = step_s.get(("decode", B))
            costs = {key[2]: t / decode for key, t in step_s.items() if key[:2] == ("verify", B) and decode}
            row = SpecRow(name, B, statistics.median(times["plain"]), statistics.median(times["spec"]),
                          st.acceptance, st.tokens_per_verify, st.verify_steps, costs)
            on_row(row)
            rows.append(row)
    return rows


# What speculation could buy at best on one greedy output (benchmarks/spec_ceiling.py).
def cost_of(costs: dict, L: int) -> float:
    """c(L): a verify step of window L in decode steps, from ``costs`` ({L: c}),
    interpolated linearly between its windows (c(1) = 1), extended past the last."""
    if L in costs:
        return costs[L]
    pts = sorted({1: 1.0, **costs}.items())
    for (l0, c0), (l1, c1) in zip(pts, pts[1:]):
        if l0 <= L <= l1:
            return c0 + (c1 - c0) * (L - l0) / (l1 - l0)
    (l0, c0), (l1, c1) = pts[-2], pts[-1]
    return c1 + (c1 - c0) * (L - l1) / (l1 - l0)


def _confirmed(drafts, out, i) -> int:
    """How many of ``drafts``, proposed at position ``i``, ``out`` confirms (the greedy rule)."""
    a = 0
    while a < len(drafts) and i + a < len(out) and drafts[a] == out[i + a]:
        a += 1
    return a


def replay_always(context, out, drafter, k):
    """The accepted drafts of each verify step of the ``always`` policy with
    ``k`` drafts (a verify step wherever ``drafter`` proposes) replaying the
    greedy output ``out`` after ``context``."""
    i, runs = 0, []
    while i < len(out):
        d = drafter.propose(context + out[:i], k)
        a = _confirmed(d, out, i)
        if d:
            runs.append(a)
        i += a + 1
    return runs


def lookup_continuations(context, k: int, most: int, ngram: int = 3) -> List[List[int]]:
    """Up to ``most`` distinct continuations (``k`` tokens each at most), newest
    first, of every earlier match of the context's longest matching suffix
    (``ngram`` tokens down to 1): the branches a token tree of prompt lookup
    would verify together."""
    for n in range(min(ngram, len(context) - 1), 0, -1):
        suffix, found = list(context[-n:]), []
        for start in range(len(context) - n - 1, -1, -1):
            if list(context[start : start + n]) == suffix:
                cont = list(context[start + n : start + n + k])
                if cont and cont not in found:
                    found.append(cont)
                    if len(found) == most:
                        break
        if found:
            return found
    return []


def _tree_confirmed(branches, nodes: int, out, i) -> int:
    """How far ``out`` from ``i`` runs along a token tree: the prefixes of
    ``branches`` level by level (every branch's first draft, then their
    seconds, ...; newest branch first within a level), up to ``nodes``."""
    tree = set()
    for depth in range(1, max(map(len, branches), default=0) + 1):
        for branch in branches:
            if len(tree) < nodes and len(branch) >= depth:
                tree.add(tuple(branch[:depth]))
    a = 0
    while i + a < len(out) and tuple(out[i : i + a + 1]) in tree:
        a += 1
    return a


def oracle_units(context, out, drafter, costs: dict, windows, tree: int = 0) -> float:
    """The fewest decode-step units any policy could spend on emitting ``out``
    after ``context``: at each position a plain step (1) or a verify step of
    a window L in ``windows`` (``cost_of(costs, L)``, advancing by the drafts
    ``drafter`` proposes there that ``out`` confirms, + 1), chosen knowing
    every outcome (benchmarks/spec_ceiling.py). ``tree``: the window holds a
    token tree of L - 1 drafts instead, the continuations of up to ``tree``
    earlier matches (:func:`lookup_continuations`; priced as a window of L)."""
    n = len(out)

    @lru_cache(maxsize=None)
    def accepted(i, L):
        if tree:
            return _tree_confirmed(lookup_continuations(context + out[:i], L - 1, tree), L - 1, out, i)
        return _confirmed(drafter.propose(context + out[:i], L - 1), out, i)

    best = [0.0] * (n + 1)  # best[i]: units to emit out[i:]
    for i in range(n - 1, -1, -1):
        best[i] = 1.0 + best[i + 1]
        for L in windows:
            j = min(n, i + accepted(i, L) + 1)
            best[i] = min(best[i], cost_of(costs, L) + best[j])
    return best[0]


@dataclass
class _ReplayRow:
    """What the speculator reads of a request."""

    uid: int
    context: List[int]
    budget: int


def replay_policy(speculator, context, out, costs: dict, uid: int = 0) -> Tuple[float, List[str]]:
    """The decode-step units ``speculator`` (the engine's policy, fed the
    step times ``costs`` in decode steps) spends emitting ``out[1:]`` after
    ``context`` + ``out[0]`` (the prefill's token) at bucket 1, stepping as
    the engine does (``Engine._speculative_step``): with no step in flight it
    asks for drafts (a verify step of the chosen window advances by the drafts
    ``out`` confirms + 1); declined, it runs a plain step and dispatches the
    next beside it, and while a plain step is in flight it keeps dispatching
    the next as long as :meth:`~.Speculator.may_pay` (judged on the tokens
    read so far: one behind) says no. Returns the units and the schedule
    (``"."`` a plain step, ``"V5=3/4"`` a verify step of window 5 that
    accepted 3 of 4 drafts). The speculator keeps what it learned: replay a
    workload's outputs through one, as the engine serves them."""
    return replay_batch(speculator, [context], [out], costs, 1, uid)


def replay_batch(speculator, contexts, outs, costs: dict, width: int, uid: int = 0) -> Tuple[float, List[str]]:
    """:func:`replay_policy` for rows decoding together in a bucket of
    ``width`` (``costs``: its steps, in its decode steps): a plain step
    advances every row still decoding by one token, a verify step of the
    window the speculator chooses for all of them each by what its own
    output confirms + 1; a row leaves when its output is done. The units
    against the longest output's plain steps bound what the bench's batch
    can gain. Rows that left are not replaced by a narrower bucket (the
    engine re-buckets; its steps then get cheaper than replayed). The
    schedule's verify steps list each row's ``accepted/drafted``, in order."""
    rows = [_ReplayRow(uid + j, list(c) + list(o[:1]), len(o) - 1) for j, (c, o) in enumerate(zip(contexts, outs))]
    at = [1] * len(rows)  # each row's next position in its output
    units, schedule, in_flight = 0.0, [], False
    while True:
        live = [j for j in range(len(rows)) if at[j] < len(outs[j])]
        if not live:
            break
        for j in live:  # the tokens read so far
            rows[j].context, rows[j].budget = list(contexts[j]) + list(outs[j][: at[j]]), len(outs[j]) - at[j]
        batch = [rows[j] for j in live]
        if in_flight:  # a step computes; the host judges on the tokens before it: pipelined on while no verify pays
            drafts, pipelined = None, not speculator.may_pay(batch, width)
        else:  # declined: a plain step, the next dispatched beside it
            drafts, pipelined = speculator.drafts(batch, width), True
        if drafts is None:
            units += 1.0
            speculator.plain_step(batch)
            speculator.observe("decode", width, 1.0)
            schedule.append(".")
            for j in live:
                at[j] += 1
            in_flight = pipelined and any(at[j] < len(outs[j]) for j in live)
            continue
        L = speculator.window
        units += cost_of(costs, L)
        speculator.observe("verify", width, cost_of(costs, L), L)
        judged = []
        for j, d in zip(live, drafts):
            accepted = _confirmed(d, outs[j], at[j])
            speculator.update(rows[j], len(d), accepted)
            judged.append(f"{accepted}/{len(d)}")
            at[j] += accepted + 1
        schedule.append(f"V{L}={','.join(judged)}")
    for r in rows:
        speculator.forget(r.uid)
    return units, schedule


def batch_oracle_units(contexts, outs, drafter, costs: dict, windows) -> float:
    """The fewest decode-step units any policy could spend on a batch emitting
    ``outs`` (after ``contexts``) together: one schedule every row follows,
    each step either plain (1: every row still decoding advances by one) or a
    verify step of a window L in ``windows`` (``cost_of(costs, L)``: each row
    advances by the drafts ``drafter`` proposes it there that its output
    confirms, + 1), found knowing every outcome by a shortest-path search
    over the rows' positions. :func:`oracle_units` is its one-row case;
    rows that finish stay in the bucket's costs (as in :func:`batch_bound`,
    which this tightens: a window chosen for some rows is paid for all)."""
    n = tuple(len(o) for o in outs)

    @lru_cache(maxsize=None)
    def advanced(j, i, L):  # row j's position after a verify step of window L at position i
        return min(n[j], i + _confirmed(drafter.propose(list(contexts[j]) + list(outs[j][:i]), L - 1), outs[j], i) + 1)

    start = tuple(0 for _ in outs)
    best, heap = {start: 0.0}, [(0.0, start)]
    while heap:
        units, at = heapq.heappop(heap)
        if at == n:
            return units
        if units > best[at]:
            continue
        steps = [(1.0, tuple(min(m, i + 1) for m, i in zip(n, at)))]
        steps += [(cost_of(costs, L), tuple(i if i == m else advanced(j, i, L) for j, (m, i) in enumerate(zip(n, at))))
                  for L in windows]
        for cost, there in steps:
            if units + cost < best.get(there, float("inf")):
                best[there] = units + cost
                heapq.heappush(heap, (units + cost, there))
    return 0.0  # no rows


def batch_bound(rows) -> float:
    """The most speculation could speed up a batch decoding together, from
    each row's ``(tokens, oracle units)`` (:func:`oracle_units` with the
    bucket's window costs): plain decode takes as many steps as the longest
    output; a batch's verify steps are one schedule that every row follows
    (one window for all), so each row's own oracle spends no more than the
    batch does, and the batch needs at least the largest of them. Rows
    leaving early (a narrower bucket after) are not modelled."""
    return max(t for t, _ in rows) / max(u for _, u in rows)
