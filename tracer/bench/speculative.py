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

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Sequence

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


def spec_rows(plain, buckets: Sequence[int] = (1, 4), k: int = 4, tokens: int = 64, reps: int = 3,
              policy: str = "auto", workloads: Sequence[str] = tuple(WORKLOADS),
              on_row: Callable[[SpecRow], None] = lambda r: None) -> List[SpecRow]:
    """One :class:`SpecRow` per (workload, bucket) for ``plain``, a
    :class:`~mlx_tracer.Generator` (its model and tokenizer also serve the
    speculative one: prompt lookup, ``k`` drafts, ``policy``). A bucket wider
    than a workload's prompts repeats them."""
    from ..generator import Generator

    spec = Generator(plain.model, plain.tokenizer, speculative="prompt-lookup", draft_tokens=k, spec_policy=policy)
    rows = []
    for name in workloads:
        prompts = WORKLOADS[name]
        for B in buckets:
            batch = [prompts[i % len(prompts)] for i in range(B)]
            times = {"plain": [], "spec": []}
            outs = {}
            for rep in range(reps + 1):  # the first run traces and builds kernels
                for label, gen in (("plain", plain), ("spec", spec)):
                    gen.engine.reset_stats()
                    res = gen.batch_generate(batch, max_tokens=tokens)
                    if rep:
                        times[label].append(gen.stats.decode_tps)
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
