"""The host side of speculative decoding: which rows draft, how many tokens.

Per step, every row may propose up to its own draft length (adapted to how
much of its recent drafts was accepted). The batch runs a verify step only
when the drafts are expected to pay: the expected extra tokens (each row's
recent acceptance share times its drafts) must reach ``min_gain`` per live
row, else it runs a plain decode step. One trace serves every verify step of
a bucket: the window is always ``k + 1`` long and short drafts are padded.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from .requests import Request


class Speculator:
    """Drafting policy of one engine (see module docstring).

    Args:
        drafter: proposes tokens for a row (``propose(context, k)``).
        k: the most drafts per row and step (the verify window is ``k + 1``).
        min_gain: expected extra tokens per live row below which a plain
            decode step runs instead.
    """

    def __init__(self, drafter, k: int, min_gain: float = 0.25):
        self.drafter, self.k, self.min_gain = drafter, k, min_gain

    def drafts(self, rows: Sequence[Request]) -> Optional[List[List[int]]]:
        """Each row's drafts for the next verify step, or None for a plain step."""
        ks = []
        for r in rows:
            if r.draft_len == 0:
                r.draft_len = self.k
            ks.append(max(0, min(r.draft_len, self.k, r.budget - 1)))  # the budget's last token needs no draft
        if hasattr(self.drafter, "propose_batch"):
            out = [list(d)[:n] for d, n in zip(self.drafter.propose_batch(rows, ks), ks)]
        else:
            out = [list(self.drafter.propose(r.context, n))[:n] if n > 0 else [] for r, n in zip(rows, ks)]
        gain = sum(r.accept_rate * len(d) for r, d in zip(rows, out))
        return out if gain >= self.min_gain * len(rows) and any(out) else None

    def update(self, row: Request, drafted: int, accepted: int):
        """Adapt a row's draft length and acceptance share to one verify step."""
        if drafted == 0:
            return
        row.accept_rate = 0.7 * row.accept_rate + 0.3 * (accepted / drafted)
        if accepted == drafted:
            row.draft_len = min(self.k, row.draft_len + 1)
        elif accepted < drafted // 2:
            row.draft_len = max(1, row.draft_len - 1)
