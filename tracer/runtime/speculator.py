"""The host side of speculative decoding: which rows draft, when a verify step
pays, and how long its window is.

Per step every row may propose up to its own draft length (adapted to its
recent acceptance); under the auto policy a drafter that says how long a
match its drafts follow (prompt lookup) proposes up to ``k``, and the
pricing below picks the window (a draft length halved by a spurious match
capped the window of a long quote that followed it at 3). A verify step of
window ``L`` (each row's last token and up to ``L - 1`` drafts) runs only
when it is expected to emit more tokens per second than a plain decode
step:

    expected tokens of a verify step = sum over rows of 1 + a(n)
    (n: the row's drafts that fit the window, a(n): the drafts expected
    accepted. Drafts are accepted in runs — a quoted span matches as a
    whole, a spurious match fails at its first draft — so with a drafter
    that says how long a match its drafts follow (prompt lookup), a(n) =
    h * (1 + c + ... + c^(n-1)): h, the chance that the first draft holds,
    and c, that a run that held goes on one more draft, both learned by the
    engine per match length (h times the row's recent share against the
    prior). A share of the drafts accepted prices a window by the windows it
    was learned in: runs that stop after 5 drafts accept 5 of 16 in windows
    of 17, so a share of 0.31 priced 17 best (6 tokens for 3 decode steps'
    cost) where a window of 5 takes as many of them for less. Without
    match lengths, a(n) = p * n, p the row's recent share),

divided by the window's measured time, against ``rows / decode step time``.
Step times are measured per bucket (and window length) as the engine runs;
a window not measured yet is priced between the two measured at that
bucket on either side of it (linearly: a window's cost is mostly fixed, its
columns add less than its first), else from the nearest one measured (its
cost per column beyond the decode step's), or guessed
(``GUESSED_COLUMN_COST`` decode steps a column) before any was; when
choosing among windows, slightly optimistically (``EXPLORE``), so that a
neighbouring length is tried once when it may pay (but a verify step runs
only if the chosen window pays at its plain estimate). The auto policy chooses the window among
``WINDOWS`` (up to ``k + 1``): on a CPU a window's cost grows with its
rows (each costs compute, not only the weights read once), and by steps
where the matmul kernels tile their rows, so the best length depends on the
machine, the bucket and the rows' acceptance. One trace serves every verify
step of a (bucket, window): short drafts are padded. The ``always`` policy
verifies whenever a row has a draft, always in windows of ``k + 1``.

A row's ``p`` moves back toward its prior while it runs plain steps, so a
row whose text starts repeating gets tried again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from .options import SPEC_POLICIES
from .requests import Request

PRIOR = 0.5  # per-draft acceptance assumed for a new row
GUESSED_COLUMN_COST = 0.125  # a verify window's time per column beyond the first, in decode steps, before one is measured
EXPLORE = 0.9  # a window length not measured yet is priced at this share of its estimate
RECOVERY = 0.01  # share of the way back to PRIOR per plain step (a failed row retries after ~30 plain steps)
# by the length of the match drafts follow (1, 2, 3 or more tokens; a drafter that reports it: prompt lookup), the
# chance that the first draft holds, assumed before any is judged, then learned from every verify step of the
# engine; and that a run that held goes on one more draft (as pseudo-counts: 9 went on, 1 stopped). At 4 drafts
# these give 0.15, 0.35 and 0.6 of them accepted.
MATCH_PRIOR = (0.17, 0.41, 0.70)
GOES_ON_PRIOR = (9.0, 1.0)
WINDOWS = (2, 3, 4, 5, 9, 17)  # the verify windows the auto policy chooses among (those <= k + 1, and k + 1)


@dataclass
class DraftState:
    """One row's drafting state, adapted to its acceptance."""

    draft_len: int  # drafts to ask for next
    accept_rate: float = PRIOR  # recent share of drafts accepted


class Speculator:
    """Drafting policy of one engine (see module docstring).

    Args:
        drafter: proposes tokens (``propose(context, k)`` per row, or
            ``propose_batch(rows, ks)`` for the whole batch).
        k: the most drafts per row and step (the longest verify window is ``k + 1``).
        policy: ``"auto"`` (a verify step when it is expected to pay, in the
            window expected to pay most) or ``"always"`` (whenever some row
            has a draft, in windows of ``k + 1``: to measure or test).
        max_rows: the most rows (bucket width x window) a verify step may
            take, or None: windows are shortened to fit, and a bucket too wide
            for a window of 2 does not speculate (``CompiledModel.verify_rows``:
            past it a verify row would not have its decode step's bits).

    After :meth:`drafts` returned drafts, :attr:`window` is the verify window
    they are for.
    """

    POLICIES = SPEC_POLICIES

    def __init__(self, drafter, k: int, policy: str = "auto", max_rows: Optional[int] = None):
        self.drafter, self.k, self.policy = drafter, k, policy  # checked by options.check_engine_options
        self.max_rows = max_rows
        self.windows = sorted({L for L in WINDOWS if L <= k + 1} | {k + 1}) if policy == "auto" else [k + 1]
        self.window = k + 1
        # ("decode", width) -> smoothed seconds per plain step (pipelined as the engine runs them);
        # ("verify", width, L) -> smoothed seconds per verify step of window L
        self.step_s: Dict[tuple, float] = {}
        self.rows: Dict[int, DraftState] = {}  # request uid -> its state, while it runs
        self.by_match = list(MATCH_PRIOR)  # chance that the first draft holds, by the length of the match they follow
        self.goes_on = [list(GOES_ON_PRIOR) for _ in MATCH_PRIOR]  # (went on, stopped) counts of held runs, likewise
        self._matches: Dict[int, int] = {}  # uid -> match length of its drafts now being verified

    def row(self, uid: int) -> DraftState:
        """The drafting state of request ``uid`` (a new row starts at ``k`` drafts and the prior)."""
        state = self.rows.get(uid)
        if state is None:
            state = self.rows[uid] = DraftState(self.k)
        return state

    def forget(self, uid: int):
        """A row that left the batch."""
        self.rows.pop(uid, None)

    def longest(self, width: int) -> int:
        """The longest verify window at bucket ``width``: ``k + 1``, or what
        ``max_rows`` leaves (below 2: no verify step at that width)."""
        return self.k + 1 if self.max_rows is None else min(self.k + 1, self.max_rows // width)

    def _caps(self, rows: Sequence[Request], width: int) -> List[int]:
        # the budget's last token needs no draft
        most = self.longest(width) - 1
        return [max(0, min(self._wanted(r), most, r.budget - 1)) for r in rows]

    def _wanted(self, row: Request) -> int:
        """Drafts to ask ``row`` for: its draft length, or ``k`` where the auto
        policy prices drafts by the length of the match they follow (the
        window is then chosen by that price: after a spurious match failed,
        the row's halved length would cap the window of a long quote)."""
        if self.policy == "auto" and self._priced_by_match:
            return self.k
        return self.row(row.uid).draft_len

    @property
    def _priced_by_match(self) -> bool:
        """Whether :meth:`_propose` asks the drafter for match lengths."""
        return not hasattr(self.drafter, "propose_batch") and hasattr(self.drafter, "propose_match")

    def drafts(self, rows: Sequence[Request], width: int) -> Optional[List[List[int]]]:
        """Each row's drafts for the next verify step (at most ``window - 1``
        each), or None for a plain step."""
        ks = self._caps(rows, width)
        if not any(ks) or not self._worth_drafting(rows, ks, width):
            return None
        out, matches = self._propose(rows, ks)
        L = self._choose(rows, [len(d) for d in out], width, matches) if any(out) else None
        if L is None:
            return None
        self.window = L
        self._matches = {r.uid: m for r, m in zip(rows, matches)} if matches else {}
        return [d[: L - 1] for d in out]

    def _propose(self, rows, ks):
        """Each row's drafts, and the lengths of the matches they follow (None
        when the drafter does not say)."""
        if hasattr(self.drafter, "propose_batch"):
            return [list(d)[:n] for d, n in zip(self.drafter.propose_batch(rows, ks), ks)], None
        if self._priced_by_match:
            pairs = [self.drafter.propose_match(r.context, n) if n > 0 else ([], 0) for r, n in zip(rows, ks)]
            return [list(d)[:n] for (d, _), n in zip(pairs, ks)], [m for _, m in pairs]
        return [list(self.drafter.propose(r.context, n))[:n] if n > 0 else [] for r, n in zip(rows, ks)], None

    @property
    def cheap(self) -> bool:
        """Whether the drafter is cheap enough to ask every step (prompt
        lookup): :meth:`may_pay` then looks at its drafts, and a plain step
        chosen on its drafts is as good as a check."""
        return bool(getattr(self.drafter, "cheap", False))

    def may_pay(self, rows: Sequence[Request], width: int) -> bool:
        """Whether a verify step could pay now, judged without drafting (the
        rows' draft lengths and acceptance only): the engine keeps plain
        steps pipelined while it cannot. With a drafter that says it is
        ``cheap`` (prompt lookup), its drafts are looked at too."""
        ks = self._caps(rows, width)
        if not any(ks) or not self._worth_drafting(rows, ks, width):
            return False
        if not self.cheap:
            return True
        out, matches = self._propose(rows, ks)
        return any(out) and self._choose(rows, [len(d) for d in out], width, matches) is not None

    def _worth_drafting(self, rows, ks, width) -> bool:
        """Whether to ask the drafter: a dear one only when its drafts could
        pay at the rows' recent shares; a cheap one whenever a plain step has
        been measured. Its drafts are judged on their match lengths, which
        the rows' shares alone cannot see: a row whose last verify step failed
        (its share down, its draft length halved) on a spurious match would
        otherwise never again be looked at while it quotes a long span."""
        if self.cheap and self.policy == "auto":
            return self.longest(width) >= 2 and ("decode", width) in self.step_s
        return self._choose(rows, ks, width) is not None

    def _accepted(self, state: DraftState, match: Optional[int], n: int) -> float:
        """The drafts of ``n`` a row's verify step is expected to accept (see
        the module docstring): the first-draft chance for a match that long,
        scaled by the row's own recent share against the prior (both are
        evidence: free text fails with short matches, a row that quotes keeps
        its run going), times the expected run; without a match length, the
        row's share of ``n``."""
        if n <= 0:
            return 0.0
        if match is None:
            return state.accept_rate * n
        i = min(max(match, 1), len(self.by_match)) - 1
        first = min(1.0, state.accept_rate / PRIOR * self.by_match[i])
        went_on, stopped = self.goes_on[i]
        c = went_on / (went_on + stopped)
        return first * (n if c >= 1.0 else (1.0 - c**n) / (1.0 - c))

    def _choose(self, rows, ns, width, matches=None) -> Optional[int]:
        """The window expected to emit the most tokens per second, or None
        when a plain step is expected to emit more."""
        cap = self.longest(width)
        if cap < 2:
            return None
        longest = min(max(ns) + 1, cap)
        if self.policy == "always":
            return cap
        decode = self.step_s.get(("decode", width))
        if decode is None:  # measure a plain step first
            return None
        states = [(self.row(r.uid), matches[i] if matches else None) for i, r in enumerate(rows)]

        def tokens(L):  # expected tokens of a verify step of window L
            return sum(1 + self._accepted(st, m, min(n, L - 1)) for (st, m), n in zip(states, ns))

        best, best_rate = None, 0.0
        for L in self.windows:  # the window expected to pay most (a length not measured yet: priced optimistically)
            if L > cap:
                break
            rate = tokens(L) / self.cost(width, L, EXPLORE)
            if rate > best_rate:
                best, best_rate = L, rate
            if L >= longest:  # a longer window adds no drafts
                break
        # and whether it pays, at its estimate (exploring never turns a plain step into a verify step)
        return best if tokens(best) / self.cost(width, best) > len(rows) / decode else None

    def cost(self, width: int, L: int, unmeasured: float = 1.0) -> float:
        """The expected seconds of a verify step of window ``L`` at bucket
        ``width`` (see module docstring), times ``unmeasured`` where it was
        not measured; needs a measured decode step."""
        measured = self.step_s.get(("verify", width, L))
        if measured is not None:
            return measured
        decode = self.step_s[("decode", width)]
        known = sorted((key[2], s) for key, s in self.step_s.items() if key[0] == "verify" and key[1] == width)
        below = [m for m in known if m[0] < L]
        above = [m for m in known if m[0] > L]
        if below and above:  # between two measured windows: most of a window's cost is fixed, not per column
            (L0, s0), (L1, s1) = below[-1], above[0]
            return unmeasured * (s0 + (s1 - s0) * (L - L0) / (L1 - L0))
        if known:
            L0, s0 = min(known, key=lambda m: (abs(m[0] - L), m[0]))
            per_column = max(0.0, s0 - decode) / (L0 - 1)
        else:
            per_column = GUESSED_COLUMN_COST * decode
        return unmeasured * (decode + per_column * (L - 1))

    def observe(self, kind: str, width: int, seconds: float, window: Optional[int] = None):
        """A step of ``kind`` ("decode" or "verify", of ``window``: ``k + 1``
        when not given) at ``width`` took ``seconds``."""
        key = ("decode", width) if kind == "decode" else ("verify", width, window or self.k + 1)
        old = self.step_s.get(key)
        self.step_s[key] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def plain_step(self, rows: Sequence[Request]):
        for r in rows:
            state = self.rows.get(r.uid)
            if state is not None:
                state.accept_rate += RECOVERY * (PRIOR - state.accept_rate)

    def update(self, row: Request, drafted: int, accepted: int):
        """Adapt a row's draft length and acceptance to one verify step: the
        length doubles after a step that accepted every draft (a quoted span
        goes on) and halves (to 2 at least) after one that accepted less than
        half. For the match length its drafts followed, the engine learns
        whether the first draft held and, if it did, how far the run went."""
        if drafted == 0:
            return
        state = self.row(row.uid)
        state.accept_rate = 0.7 * state.accept_rate + 0.3 * (accepted / drafted)
        match = self._matches.get(row.uid)
        if match:
            i = min(match, len(self.by_match)) - 1
            self.by_match[i] = 0.9 * self.by_match[i] + 0.1 * (accepted > 0)
            if accepted > 0:  # the run held: drafts 2 .. accepted went on; it stopped before the end or not
                went_on, stopped = self.goes_on[i]
                self.goes_on[i] = [0.9 * went_on + (accepted - 1), 0.9 * stopped + (accepted < drafted)]
        if accepted == drafted:
            state.draft_len = min(self.k, max(state.draft_len, drafted) * 2)
        elif accepted < drafted // 2:
            state.draft_len = max(min(2, self.k), min(state.draft_len, drafted) // 2)
