"""Drive a mlx-tracer cache and mlx-lm's own batch cache through the same
operations, and compare what they expose after every step.

Every token's value vector carries its identity in channel 0 (``row uid`` and
absolute position), so the set of (row, position) pairs a query sees can be
read off any layout: gather the value column under the mask's True entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from mlx_tracer.caches import FullCache, RingCache

H, HQ, D = 2, 4, 8
POS = 4096  # positions per uid in a token id


def token_id(uid: int, pos: int) -> int:
    return uid * POS + pos + 1


def junk_id(uid: int) -> int:
    return -(uid + 1)


@dataclass
class Deviation:
    """A query where mlx-lm's visible set differs from the analytic one."""

    op: str
    row: int
    query: int
    missing: List[int]
    extra: List[int]
    left_padded: bool  # mlx-lm's left_padding for the row was >= 0 before the update
    rotated: bool  # mlx-lm's ring was rotated before the update
    oldest: int = 0  # the oldest id the query should see


@dataclass
class Pair:
    ours: object
    theirs: object
    window: Optional[int]  # None: full attention
    uids: List[int]
    hist: Dict[int, list] = field(default_factory=dict)  # uid -> [(pos, k[H,D], v[H,D])]
    rng: np.random.Generator = None
    deviations: List[Deviation] = field(default_factory=list)
    checks: int = 0
    placed: int = 0  # joins written into free rows (place)
    placed_wrapped: int = 0  # of them: into a ring that had wrapped
    relaid: bool = False  # a place kept a layout mlx-lm's extend moves (see place)

    # ------------------------------------------------------------------ data
    def _kv(self, uids, valid, L, positions):
        """Random K/V [n, H, L, D] with identity channel; invalid tokens get junk ids."""
        n = len(uids)
        k = self.rng.standard_normal((n, H, L, D)).astype(np.float32)
        v = self.rng.standard_normal((n, H, L, D)).astype(np.float32)
        for r, uid in enumerate(uids):
            for i in range(L):
                v[r, :, i, 0] = token_id(uid, positions[r] + i) if i < valid[r] else junk_id(uid)
        return k, v

    def _padded(self, x, width):
        if width == x.shape[0]:
            return mx.array(x)
        extra = self.rng.standard_normal((width - x.shape[0],) + x.shape[1:]).astype(np.float32)
        return mx.array(np.concatenate([x, extra]))

    def expected(self, uid, pos, first_new):
        """Ids query at ``pos`` must see: the row's history plus this step's tokens up to ``pos``."""
        lo = 0 if self.window is None else max(0, pos - self.window + 1)
        have = {p for p, _, _ in self.hist.get(uid, [])} | set(range(first_new, pos + 1))
        return sorted(token_id(uid, p) for p in range(lo, pos + 1) if p in have)

    # --------------------------------------------------------------- updates
    def update(self, L: int, valid: Optional[List[int]] = None, op: str = "update"):
        n = len(self.uids)
        valid = [L] * n if valid is None else valid
        positions = [int(p) for p in self.ours.rows.offsets]
        theirs_pos = np.array(self.theirs.offset).tolist()
        theirs_lp = np.array(self.theirs.left_padding).tolist()
        theirs_rotated = bool(getattr(self.theirs, "rotated", False))
        k, v = self._kv(self.uids, valid, L, positions)
        width = self.ours.width
        m_o = self.ours.make_mask(L)
        m_t = self.theirs.make_mask(L)
        m_t = m_t if isinstance(m_t, mx.array) else None
        k_o, v_o = self.ours.update_and_fetch(self._padded(k, width), self._padded(v, width))
        k_t, v_t = self.theirs.update_and_fetch(mx.array(k), mx.array(v))
        q = self.rng.standard_normal((width, HQ, L, D)).astype(np.float32)
        out_o = mx.fast.scaled_dot_product_attention(mx.array(q), k_o, v_o, scale=D**-0.5, mask=m_o)
        out_t = mx.fast.scaled_dot_product_attention(mx.array(q[:n]), k_t, v_t, scale=D**-0.5, mask=m_t)
        assert bool(mx.all(mx.isfinite(out_o)).item()), f"{op}: non-finite attention output (padding rows?)"
        ids_o = np.array(v_o[:, 0, :, 0])
        ids_t = np.array(v_t[:, 0, :, 0])
        mo = np.array(m_o)
        mt = None if m_t is None else np.broadcast_to(np.array(m_t), (n, 1, L, ids_t.shape[1]))
        out_o, out_t = np.array(out_o), np.array(out_t)
        for r, uid in enumerate(self.uids):
            assert positions[r] == theirs_pos[r] or valid[r] < L, f"{op}: row {r} offset {positions[r]} vs mlx-lm {theirs_pos[r]}"
            for i in range(valid[r]):
                want = self.expected(uid, positions[r] + i, positions[r])
                got = sorted(int(x) for x in ids_o[r][mo[r, 0, i]])
                assert got == want, f"{op}: ours row {r} query {i}: sees {got}, expected {want}"
                self.checks += 1
                vis_t = ids_t[r] if mt is None else ids_t[r][mt[r, 0, i]]
                if mt is None:  # no mask: causal over everything returned
                    vis_t = ids_t[r][: ids_t.shape[1] - (L - 1 - i)]
                theirs = sorted(int(x) for x in vis_t)
                if theirs != want:
                    self.deviations.append(
                        Deviation(
                            op, r, i, sorted(set(want) - set(theirs)), sorted(set(theirs) - set(want)),
                            theirs_lp[r] >= 0,
                            theirs_rotated,
                            want[0],
                        )
                    )
                    continue
                same = (lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-6)) if self.relaid else np.array_equal
                assert same(out_o[r, :, i], out_t[r, :, i]), (
                    f"{op}: row {r} query {i}: attention output differs from mlx-lm "
                    f"(max {np.abs(out_o[r, :, i] - out_t[r, :, i]).max()})"
                )
        for r, uid in enumerate(self.uids):
            for i in range(valid[r]):
                self.hist.setdefault(uid, []).append((positions[r] + i, k[r, :, i], v[r, :, i]))

    def decode(self):
        self.update(1, op="decode")

    def window_step(self, L):
        self.update(L, op=f"window{L}")

    def prompt(self, lengths: List[int], chunk: int):
        """A right-padded prompt batch: prepare, chunks, finalize (mlx-lm's PromptProcessingBatch.prompt)."""
        top = max(lengths)
        pad = [top - x for x in lengths]
        for c in (self.ours, self.theirs):
            c.prepare(lengths=lengths, right_padding=pad)
        left = list(lengths)
        done = 0
        while done < top:
            L = min(chunk, top - done)
            if top - done - L == 1 or L == 1:  # mlx-lm's ring refuses 1-token prompt chunks
                L = min(L + 1, top - done) if top - done > 1 else L
            valid = [max(0, min(x, L)) for x in left]
            self.update(L, valid, op=f"prompt{L}")
            left = [x - vv for x, vv in zip(left, valid)]
            done += L
        for c in (self.ours, self.theirs):
            c.finalize()
        self.check_rows("finalize")

    # ------------------------------------------------------------ row moves
    def filter(self, keep: List[int], width: Optional[int] = None):
        self.ours.filter(keep, width=width)
        self.theirs.filter(keep)
        self.uids = [self.uids[i] for i in keep]
        self.check_rows("filter")

    def extend(self, other: "Pair", width: Optional[int] = None):
        self.ours.extend(other.ours, width=width)
        self.theirs.extend(other.theirs)
        self.uids += other.uids
        self.hist.update(other.hist)
        self.check_rows("extend")

    def place(self, other: "Pair", width: Optional[int] = None) -> bool:
        """:meth:`extend` through ``ours.place`` (the newcomers written into free
        rows, the live rows not moved) where it fits, else through ``extend``;
        returns whether it was placed."""
        copied = type(self.ours).join([self.ours, other.ours], width=width)  # today's join: the layout to compare
        wrapped = getattr(self.ours, "wrapped", False)
        placed = self.ours.place([other.ours], width=width)
        self.placed_wrapped += placed and wrapped
        if not placed:
            self.ours.extend(other.ours, width=width)
        elif (copied.rows.time, copied.S, getattr(copied, "head", None)) != (
                self.ours.rows.time, self.ours.S, getattr(self.ours, "head", None)):
            # the running rows kept a layout the copying join (and mlx-lm's
            # extend) would have moved (a wrapped ring's rotation, a timeline
            # not stripped): each row holds the same tokens, but attention sums
            # its columns in another order, so from now on it equals mlx-lm's
            # within rounding, not bit for bit
            self.relaid = True
        self.theirs.extend(other.theirs)
        self.uids += other.uids
        self.hist.update(other.hist)
        self.check_rows("place" if placed else "extend")
        return placed

    def trim(self, n: int):
        assert self.ours.is_trimmable() == self.theirs.is_trimmable(), "is_trimmable differs from mlx-lm"
        if not self.ours.is_trimmable():
            return 0
        got = self.ours.trim(n)
        assert got == self.theirs.trim(n)
        for uid in self.uids:
            h = self.hist.get(uid, [])
            top = h[-1][0] + 1 if h else 0
            self.hist[uid] = [t for t in h if t[0] < top - got]
        self.check_rows("trim")
        return got

    # ------------------------------------------------------------------ checks
    def expected_rows(self, uid):
        h = self.hist.get(uid, [])
        if self.window is not None:
            h = h[-self.window :]
        return h

    def check_rows(self, op: str):
        """Each row's keys/values in temporal order, bit for bit, vs history and mlx-lm's extract."""
        assert self.ours.n == len(self.uids)
        for r, uid in enumerate(self.uids):
            want = self.expected_rows(uid)
            k, v = self.ours.temporal_view(r)
            if not want:
                assert k is None or k.shape[2] == 0, f"{op}: row {r} should be empty"
                continue
            assert k is not None and k.shape[2] == len(want), (
                f"{op}: row {r} holds {0 if k is None else k.shape[2]} tokens, expected {len(want)}"
            )
            assert np.array_equal(np.array(k[0]), np.stack([t[1] for t in want], axis=1)), f"{op}: row {r} keys"
            assert np.array_equal(np.array(v[0]), np.stack([t[2] for t in want], axis=1)), f"{op}: row {r} values"
            assert int(self.ours.rows.offsets[r]) == want[-1][0] + 1, f"{op}: row {r} offset"
            self.checks += 1

    def extract_check(self, i: int):
        """extract(i) gives the row's newest tokens as a serial cache, equal to mlx-lm's."""
        mine = self.ours.extract(i)
        want = self.expected_rows(self.uids[i])
        assert mine.offset == (want[-1][0] + 1 if want else int(self.ours.rows.offsets[i]))
        if not want:
            assert mine.keys is None or mine.keys.shape[2] == 0
        else:
            assert np.array_equal(np.array(mine.keys[0]), np.stack([t[1] for t in want], axis=1)), f"extract({i}) keys"
            assert np.array_equal(np.array(mine.values[0]), np.stack([t[2] for t in want], axis=1)), f"extract({i}) values"
        if isinstance(mine, RotatingKVCache) and mine.keys is not None:
            assert mine._idx == mine.keys.shape[2]
        if self.theirs.keys is None:  # mlx-lm 0.32.2 cannot extract from a batch that holds no keys
            return mine
        theirs = self.theirs.extract(i)
        assert type(mine) is type(theirs)
        assert mine.offset == theirs.offset, f"extract({i}) offset {mine.offset} vs mlx-lm {theirs.offset}"
        tk, tv = theirs.keys, theirs.values
        ids = np.array(tv[0, 0, :, 0])
        if (ids < 0).any():
            # mlx-lm 0.32.2 quirk (test_caches.py::test_quirk_mlx_lm_ring_extract_after_right_padded_prompt_returns_padding): right after a right-padded prompt
            # window its ring extract returns prompt padding as tokens.
            self.deviations.append(Deviation("extract", i, -1, [], [int(x) for x in ids if x < 0], False, True))
            keep = mx.array(np.nonzero(ids >= 0)[0].astype(np.int32))
            tk, tv = mx.take(tk, keep, axis=2), mx.take(tv, keep, axis=2)
        if mine.keys is None:
            assert tk.shape[2] == 0, f"extract({i}): ours is empty, mlx-lm holds {tk.shape[2]} tokens"
            return mine
        if isinstance(mine, RotatingKVCache):
            # After a window write mlx-lm's ring holds up to W-1+L tokens; only the
            # newest W are ever visible again. Ours keeps the newest W.
            n = min(tk.shape[2], mine.keys.shape[2])
            tk, tv = tk[..., tk.shape[2] - n :, :], tv[..., tv.shape[2] - n :, :]
            mk, mv = mine.keys[..., mine.keys.shape[2] - n :, :], mine.values[..., mine.values.shape[2] - n :, :]
        else:
            mk, mv = mine.keys, mine.values
        assert mk.shape == tk.shape, f"extract({i}) shape {mk.shape} vs mlx-lm {tk.shape}"
        assert np.array_equal(np.array(mk), np.array(tk)), f"extract({i}) keys differ from mlx-lm"
        assert np.array_equal(np.array(mv), np.array(tv)), f"extract({i}) values differ from mlx-lm"
        return mine


# ---------------------------------------------------------------- builders
def serial_cache(rng, window: Optional[int], length: int, uid: int, hist: dict, concat_prob=0.3):
    """A serial mlx-lm cache fed ``length`` tokens in random chunks (so rings
    reach every state: growing, concatenated, wrapped)."""
    c = KVCache() if window is None else RotatingKVCache(max_size=window)
    pos = 0
    while pos < length:
        L = 1 if rng.random() > concat_prob else int(rng.integers(2, max(3, min(length - pos, 2 * (window or 8)) + 1)))
        L = min(L, length - pos)
        k = rng.standard_normal((1, H, L, D)).astype(np.float32)
        v = rng.standard_normal((1, H, L, D)).astype(np.float32)
        v[0, :, :, 0] = [token_id(uid, pos + i) for i in range(L)]
        c.update_and_fetch(mx.array(k), mx.array(v))
        for i in range(L):
            hist.setdefault(uid, []).append((pos + i, k[0, :, i], v[0, :, i]))
        pos += L
    return c


def merged_pair(rng, window: Optional[int], lengths: List[int], first_uid: int, width: Optional[int] = None) -> Pair:
    hist: dict = {}
    uids = list(range(first_uid, first_uid + len(lengths)))
    solos = [serial_cache(rng, window, n, u, hist) for n, u in zip(lengths, uids)]
    if window is None:
        ours, theirs = FullCache.merge(solos, width=width), BatchKVCache.merge(solos)
    else:
        ours, theirs = RingCache.merge(solos, width=width), BatchRotatingKVCache.merge(solos)
    pair = Pair(ours, theirs, window, uids, hist, rng)
    pair.check_rows("merge")
    return pair


# ------------------------------------------------------ other storage formats
class TypedPair(Pair):
    """A :class:`Pair` (ours in float32 against mlx-lm) with a third cache,
    ``typed``, that stores its K/V in ``fmt`` (half precision or quantized)
    and gets every operation the other two get. Quantization and casts work
    column by column, so after every operation ``typed`` must hold exactly
    ``fmt.encode`` of what the float32 cache holds: compared bit for bit on
    each row's tokens, through attention (mlx-lm's ``scaled_dot_product_attention``,
    which reads a cache with ``bits`` quantized) and on ``extract`` (against
    mlx-lm's own ``KVCache.to_quantized`` for full caches). The float32 cache
    itself is checked against mlx-lm as in :class:`Pair`."""

    typed: object = None
    fmt: object = None

    def update(self, L: int, valid: Optional[List[int]] = None, op: str = "update"):
        from mlx_lm.models.base import scaled_dot_product_attention

        mask = self.ours.make_mask(L)
        assert np.array_equal(np.array(self.typed.make_mask(L)), np.array(mask)), f"{op}: typed mask differs"
        seen = {}
        plain = self.ours.update_and_fetch

        def spy(k, v):
            seen["in"], seen["out"] = (k, v), plain(k, v)
            return seen["out"]

        self.ours.update_and_fetch = spy
        try:
            super().update(L, valid, op)
        finally:
            del self.ours.update_and_fetch
        k_t, v_t = self.typed.update_and_fetch(*seen["in"])
        k_o, v_o = seen["out"]
        q = self.rng.standard_normal((self.ours.width, HQ, L, D)).astype(np.float32)
        # one query array each: mlx-lm's quantized attention scales its queries in place
        out_t = scaled_dot_product_attention(mx.array(q), k_t, v_t, self.typed, scale=D**-0.5, mask=mask)
        out_r = scaled_dot_product_attention(mx.array(q), self.fmt.encode(k_o), self.fmt.encode(v_o), self.typed,
                                             scale=D**-0.5, mask=mask)
        # equal_nan: the identity channel's ids overflow float16 (inf), never real keys and values
        assert np.array_equal(np.array(out_t), np.array(out_r), equal_nan=True), (
            f"{op}: typed attention differs from the encoded float32 cache's")

    def prompt(self, lengths: List[int], chunk: int):
        self.typed.prepare(lengths=lengths, right_padding=[max(lengths) - x for x in lengths])
        super().prompt(lengths, chunk)

    def filter(self, keep: List[int], width: Optional[int] = None):
        self.typed.filter(keep, width=width)
        super().filter(keep, width)

    def extend(self, other: "TypedPair", width: Optional[int] = None):
        self.typed.extend(other.typed, width=width)
        super().extend(other, width)

    def place(self, other: "TypedPair", width: Optional[int] = None) -> bool:
        placed = self.typed.place([other.typed], width=width)
        if not placed:
            self.typed.extend(other.typed, width=width)
        assert super().place(other, width) == placed, "the typed twin decided otherwise than the float32 cache"
        return placed

    def trim(self, n: int):
        if self.ours.is_trimmable():
            self.typed.trim(n)
        return super().trim(n)

    def check_rows(self, op: str):
        if op == "finalize":
            self.typed.finalize()
        super().check_rows(op)
        t, o = self.typed.rows, self.ours.rows
        assert t.time == o.time and np.array_equal(t.offsets, o.offsets) and np.array_equal(t.left_padding, o.left_padding)
        for r in range(self.ours.n):
            want, got = self.ours.temporal_view(r), self.typed.temporal_view(r)
            for w, g in zip(want, got):
                assert (w is None) == (g is None), f"{op}: row {r}: typed emptiness differs"
                if w is not None:
                    _assert_same(g, self.fmt.encode(w), f"{op}: row {r}")

    def extract_check(self, i: int):
        mine = super().extract_check(i)
        typed = self.typed.extract(i)
        assert typed.offset == mine.offset and getattr(typed, "bits", None) == self.fmt.bits
        if mine.keys is None:
            assert typed.keys is None
            return mine
        if isinstance(mine, KVCache) and self.fmt.quantized:  # mlx-lm's own conversion of the float32 row
            want = mine.to_quantized(group_size=self.fmt.group_size, bits=self.fmt.bits)
            assert want.offset == typed.offset
            _assert_same(typed.keys, want.keys, f"extract({i}) keys vs mlx-lm")
            _assert_same(typed.values, want.values, f"extract({i}) values vs mlx-lm")
        _assert_same(typed.keys, self.fmt.encode(mine.keys), f"extract({i}) keys")
        return mine


def _assert_same(got, want, what: str):
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    assert len(got) == len(want), f"{what}: {len(got)} arrays vs {len(want)}"
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        assert np.array_equal(np.array(g.astype(mx.float32) if g.dtype == mx.bfloat16 else g),
                              np.array(w.astype(mx.float32) if w.dtype == mx.bfloat16 else w)), f"{what} differs"


def serial_in_format(cache, fmt):
    """A serial mlx-lm cache's row as a user would hand it in ``fmt``: mlx-lm's
    ``to_quantized`` for a quantized full cache, the float16/bfloat16 arrays in
    a ``KVCache``; rings stay float32 (mlx-lm has no quantized rotating cache:
    the join quantizes them)."""
    if isinstance(cache, RotatingKVCache) or cache.keys is None:
        return cache
    if fmt.quantized:
        return cache.to_quantized(group_size=fmt.group_size, bits=fmt.bits)
    out = KVCache()
    out.keys, out.values = fmt.encode(cache.keys), fmt.encode(cache.values)
    out.offset = cache.offset
    return out


def typed_pair_maker(fmt):
    """``make_pair`` for test_caches_oracle.run_random_ops: merged pairs with a typed twin."""

    def make(rng, window: Optional[int], lengths: List[int], first_uid: int, width: Optional[int] = None) -> TypedPair:
        hist: dict = {}
        uids = list(range(first_uid, first_uid + len(lengths)))
        solos = [serial_cache(rng, window, n, u, hist) for n, u in zip(lengths, uids)]
        cls, batch = (FullCache, BatchKVCache) if window is None else (RingCache, BatchRotatingKVCache)
        pair = TypedPair(cls.merge(solos, width=width), batch.merge(solos), window, uids, hist, rng)
        pair.fmt = fmt
        pair.typed = cls.merge([serial_in_format(s, fmt) for s in solos], width=width, storage=fmt)
        pair.check_rows("merge")
        return pair

    return make
