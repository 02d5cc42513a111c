"""Differential tests: FullCache / RingCache against mlx-lm's BatchKVCache /
BatchRotatingKVCache on seeded random operation sequences.

Per live query we compare the visible (row, position) set with the analytic
one and with mlx-lm's, the attention output of a random GQA query bit for bit
with mlx-lm's, and after every row move each row's keys/values in temporal
order bit for bit. Where mlx-lm 0.32.2 deviates from the analytic truth the
deviation is recorded and must be one of the named quirks (see
the test_quirk_* tests in test_caches.py); ours must always match the analytic truth.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlx_tracer.caches.storage import KVFormat

from . import cache_oracle
from .cache_oracle import merged_pair, typed_pair_maker

SEEDS = range(60)


def run_random_ops(seed: int, window, make_pair=merged_pair, join: str = "extend"):
    """``make_pair(rng, window, lengths, first_uid)``: the pair (or a subclass,
    as tests/test_kv_dtypes.py's) every operation runs on. ``join="place"``:
    the ``extend`` ops write the newcomers into free rows where they fit
    (``Pair.place``; the same random sequence), and ``pair.placed`` counts them."""
    rng = np.random.default_rng(seed)
    W = window
    span = 3 * (W or 12)
    pair = make_pair(rng, W, [int(x) for x in rng.integers(0, span, size=int(rng.integers(1, 5)))], first_uid=1)
    next_uid = 100
    ops = []
    for _ in range(int(rng.integers(8, 16))):
        op = rng.choice(["decode", "decode", "decode", "window", "prompt", "filter", "extend", "extract", "trim"])
        n = len(pair.uids)
        ops.append(str(op))
        if op == "decode":
            for _ in range(int(rng.integers(1, 2 * (W or 6)))):
                pair.decode()
        elif op == "window":
            pair.window_step(int(rng.integers(2, (W or 8) + 4)))
        elif op == "prompt":
            lengths = [int(x) for x in rng.integers(0, 2 * (W or 8), size=n)]
            if max(lengths) < 2:  # mlx-lm's ring refuses a 1-token prompt chunk
                lengths[0] = 2
            pair.prompt(lengths, chunk=int(rng.integers(2, (W or 8) + 3)))
        elif op == "filter" and n > 1:
            keep = sorted(rng.choice(n, size=int(rng.integers(1, n)), replace=False).tolist())
            pair.filter(keep, width=len(keep) + int(rng.integers(0, 3)))
        elif op == "extend":
            other = make_pair(rng, W, [int(x) for x in rng.integers(0, span, size=int(rng.integers(1, 4)))], first_uid=next_uid)
            next_uid += 100
            if rng.random() < 0.5:  # the other batch decodes a little first, as in BatchGenerator
                for _ in range(int(rng.integers(1, 4))):
                    other.decode()
            width = n + other.ours.n + int(rng.integers(0, 3))
            if join == "place":
                # as a running batch grows: in its own bucket when the newcomers fit it, else a wider one
                pair.placed += pair.place(other, width=max(width, pair.ours.width))
            else:
                pair.extend(other, width=width)
        elif op == "extract":
            pair.extract_check(int(rng.integers(0, n)))
        elif op == "trim":
            pair.trim(int(rng.integers(1, 4)))
    return pair, ops


@pytest.mark.parametrize("seed", SEEDS)
def test_full_cache_matches_batch_kv_cache(seed):
    pair, ops = run_random_ops(seed, None)
    assert pair.checks > 0
    assert pair.deviations == [], f"mlx-lm full cache deviated from analytic truth: {pair.deviations[:3]} ops={ops}"


@pytest.mark.parametrize("window", [4, 7, 16])
@pytest.mark.parametrize("seed", SEEDS)
def test_ring_cache_matches_batch_rotating_kv_cache(seed, window):
    pair, ops = run_random_ops(seed, window)
    assert pair.checks > 0
    check_ring_deviations(pair, ops)


def check_ring_deviations(pair, ops):
    for d in pair.deviations:
        # The analytic deviations mlx-lm 0.32.2 is allowed: see the test_quirk_* tests in test_caches.py.
        if d.op == "extract":
            assert d.extra and not d.missing  # prompt padding extracted as tokens
            continue
        assert d.op.startswith(("window", "prompt")) and d.rotated and d.left_padded and d.missing == [d.oldest] and not d.extra, (
            f"unexpected mlx-lm deviation {d} in ops {ops}"
        )


KV_FORMATS = [KVFormat(bits=8, group_size=64), KVFormat(bits=4, group_size=32), KVFormat(dtype="float16"),
              KVFormat(dtype="bfloat16")]


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fmt", KV_FORMATS, ids=lambda f: f.describe().replace(" ", ""))
def test_caches_in_every_kv_format_hold_what_float32_holds(fmt, seed, window, monkeypatch):
    """Merge, extract, filter, extend, trim, prompts and ring wraps with a
    quantized or half-precision twin of the float32 cache (see TypedPair):
    merged from mlx-lm's QuantizedKVCache / float16 KVCache rows, extracted
    back equal to mlx-lm's conversion of the float32 row."""
    monkeypatch.setattr(cache_oracle, "D", 64)  # quantization groups run along D: a head of 64
    pair, ops = run_random_ops(seed, window, typed_pair_maker(fmt))
    assert pair.checks > 0 and pair.typed.storage == fmt


@pytest.mark.parametrize("window", [None, 4, 7, 16])
@pytest.mark.parametrize("seed", range(30))
def test_joins_into_free_rows_match_mlx_lm(seed, window):
    """The random sequences above with every ``extend`` a ``place`` where the
    newcomers fit the running timeline: rows, attention and extracts stay
    those of mlx-lm's batch caches (and of the analytic truth)."""
    pair, ops = run_random_ops(seed, window, join="place")
    assert pair.checks > 0
    if window is None:
        assert pair.deviations == [], f"mlx-lm full cache deviated from analytic truth: {pair.deviations[:3]} ops={ops}"
    else:
        check_ring_deviations(pair, ops)


@pytest.mark.parametrize("window", [None, 7])
def test_those_sequences_do_join_into_free_rows(window):
    """The sequences above place newcomers into free rows (a ring: after it wrapped too)."""
    pairs = [run_random_ops(seed, window, join="place")[0] for seed in range(12)]
    assert sum(p.placed for p in pairs) >= 8
    if window is not None:
        assert sum(p.placed_wrapped for p in pairs) >= 4


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fmt", KV_FORMATS[:3], ids=lambda f: f.describe().replace(" ", ""))
def test_joins_into_free_rows_in_every_kv_format(fmt, seed, window, monkeypatch):
    """Placed rows of a quantized or half-precision cache hold what the float32 cache's do."""
    monkeypatch.setattr(cache_oracle, "D", 64)
    pair, ops = run_random_ops(seed, window, typed_pair_maker(fmt), join="place")
    assert pair.checks > 0 and pair.typed.storage == fmt
