"""The host side of speculative decoding: which rows draft, and when a verify step pays.

Per step every row may propose up to its own draft length (adapted to its
recent acceptance). A verify step runs only when it is expected to emit more
tokens per second than a plain decode step:

    expected tokens of a verify step = sum over rows of 1 + p * n
    (n: the row's drafts, p: the share of its recent drafts accepted; drafts
    are accepted in runs — a quoted span matches as a whole — so the share
    predicts the count better than an independent per-draft chance would),

divided by the verify step's measured time, against ``rows / decode step
time``. Both step times are measured per bucket as the engine runs (the
first verify of a bucket is tried at a guessed cost). A row's ``p`` moves
back toward its prior while it runs plain steps, so a row whose text starts
repeating gets tried again. One trace serves every verify step of a bucket:
the window is always ``k + 1`` long and short drafts are padded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from .options import SPEC_POLICIES
from .requests import Request

PRIOR = 0.5  # per-draft acceptance assumed for a new row
GUESSED_VERIFY_COST = 1.5  # verify step time / decode step time before it is measured
RECOVERY = 0.01  # share of the way back to PRIOR per plain step (a failed row retries after ~30 plain steps)


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
        k: the most drafts per row and step (the verify window is ``k + 1``).
        policy: ``"auto"`` (a verify step when it is expected to pay) or
            ``"always"`` (whenever some row has a draft: to measure or test).
    """

    POLICIES = SPEC_POLICIES

    def __init__(self, drafter, k: int, policy: str = "auto"):
        self.drafter, self.k, self.policy = drafter, k, policy  # checked by options.check_engine_options
        self.step_s: Dict[tuple, float] = {}  # (kind, width) -> smoothed seconds per step
        self.rows: Dict[int, DraftState] = {}  # request uid -> its state, while it runs

    def row(self, uid: int) -> DraftState:
        """The drafting state of request ``uid`` (a new row starts at ``k`` drafts and the prior)."""
        state = self.rows.get(uid)
        if state is None:
            state = self.rows[uid] = DraftState(self.k)
        return state

    def forget(self, uid: int):
        """A row that left the batch."""
        self.rows.pop(uid, None)

    def drafts(self, rows: Sequence[Request], width: int) -> Optional[List[List[int]]]:
        """Each row's drafts for the next verify step, or None for a plain step."""
        # the budget's last token needs no draft
        ks = [max(0, min(self.row(r.uid).draft_len, self.k, r.budget - 1)) for r in rows]
        if not any(ks) or not self._worth_trying(rows, ks, width):
            return None
        if hasattr(self.drafter, "propose_batch"):
            out = [list(d)[:n] for d, n in zip(self.drafter.propose_batch(rows, ks), ks)]
        else:
            out = [list(self.drafter.propose(r.context, n))[:n] if n > 0 else [] for r, n in zip(rows, ks)]
        if not any(out) or not self._worth_trying(rows, [len(d) for d in out], width):
            return None
        return out

    def _worth_trying(self, rows, ns, width) -> bool:
        if self.policy == "always":
            return True
        expected = sum(1 + self.row(r.uid).accept_rate * n for r, n in zip(rows, ns))
        decode = self.step_s.get(("decode", width))
        verify = self.step_s.get(("verify", width))
        if decode is None:  # measure a plain step first
            return False
        verify = verify if verify is not None else GUESSED_VERIFY_COST * decode
        return expected / verify > len(rows) / decode

    def observe(self, kind: str, width: int, seconds: float):
        """A step of ``kind`` ("decode" or "verify") at ``width`` took ``seconds``."""
        old = self.step_s.get((kind, width))
        self.step_s[(kind, width)] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def plain_step(self, rows: Sequence[Request]):
        for r in rows:
            state = self.rows.get(r.uid)
            if state is not None:
                state.accept_rate += RECOVERY * (PRIOR - state.accept_rate)

    def update(self, row: Request, drafted: int, accepted: int):
        """Adapt a row's draft length and acceptance to one verify step."""
        if drafted == 0:
            return
        state = self.row(row.uid)
        state.accept_rate = 0.7 * state.accept_rate + 0.3 * (accepted / drafted)
        if accepted == drafted:
            state.draft_len = min(self.k, state.draft_len + 1)
        elif accepted < drafted // 2:
            state.draft_len = max(1, state.draft_len - 1)
