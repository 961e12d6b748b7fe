"""planner.plan_reuse_key: batches with equal keys must get equal plans (the backend then
reuses the previous step's plan and skips its upload), and a key must change whenever the
plan could.  Randomized over mixed batches, every tile size, fused and page plans."""

import numpy as np
import pytest

from cute_kernels import planner as P


def _qsl(q_lens):
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


def _assert_same_plan(a, b):
    np.testing.assert_array_equal(a.work, b.work)
    np.testing.assert_array_equal(a.cta_offsets, b.cta_offsets)
    np.testing.assert_array_equal(a.partial_offsets, b.partial_offsets)
    np.testing.assert_array_equal(a.combine, b.combine)
    np.testing.assert_array_equal(a.item_cost, b.item_cost)
    assert a.partial_rows == b.partial_rows and a.num_splits_max == b.num_splits_max
    assert a.modeled_us == b.modeled_us


def _random_batch(rng, n):
    q, s = [], []
    for _ in range(n):
        r = rng.random()
        if r < 0.6:  # decode
            L = int(rng.integers(1, 20000))
            q.append(1), s.append(L)
        elif r < 0.8:  # prefill chunk, maybe with context
            ql = int(rng.integers(2, 3000))
            q.append(ql), s.append(ql + int(rng.integers(0, 8000)))
        elif r < 0.9:  # no new tokens
            q.append(0), s.append(int(rng.integers(0, 5000)))
        else:  # one new token over an empty cache row (first token of a prompt)
            q.append(1), s.append(1)
    return q, s


def _same_key_neighbour(rng, q, s, page, fresh):
    """Move every decode row's seq_len within its page bucket (the key keeps the pages a
    decode tile reads); prefill rows and phantoms stay."""
    s2 = list(s)
    for i, (ql, L) in enumerate(zip(q, s)):
        if ql == 1 and L > 0:
            ctx = L - 1
            if fresh:  # units = ceil(ctx / P) + 1: ctx in ((u-1)P, uP]
                u = -(-ctx // page)
                lo, hi = (0, 0) if u == 0 else ((u - 1) * page + 1, u * page)
            else:  # pages = ctx // P + 1: ctx in [kP, kP + P - 1]
                k = ctx // page
                lo, hi = k * page, k * page + page - 1
            s2[i] = int(rng.integers(lo, hi + 1)) + 1
        elif ql == 0:
            s2[i] = int(rng.integers(0, 5000))  # a phantom's length does not matter
    return s2


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("tile_m,unpacked", [(64, False), (64, True), (128, True), (192, True)])
def test_equal_keys_give_equal_plans(fresh, tile_m, unpacked):
    rng = np.random.default_rng(1000 + tile_m + 7 * fresh + 3 * unpacked)
    kw = dict(num_kv_heads=4, group_size=7, page_size=64, fresh_kv=fresh,
              unpacked_prefill=unpacked, tile_m=tile_m,
              num_ctas=132 if tile_m > 64 else 264, max_partial_rows=1 << 22)
    checked = 0
    for _ in range(30):
        q, s = _random_batch(rng, int(rng.integers(1, 40)))
        s2 = _same_key_neighbour(rng, q, s, 64, fresh)
        k1 = P.plan_reuse_key(_qsl(q), np.array(s, np.int32), page_size=64, fresh_kv=fresh)
        k2 = P.plan_reuse_key(_qsl(q), np.array(s2, np.int32), page_size=64, fresh_kv=fresh)
        assert k1 is not None and k1 == k2
        _assert_same_plan(P.plan(_qsl(q), np.array(s, np.int32), **kw),
                          P.plan(_qsl(q), np.array(s2, np.int32), **kw))
        checked += s != s2
    assert checked >= 25  # the neighbours really moved seq_lens


@pytest.mark.parametrize("fresh", [False, True])
def test_key_changes_when_a_decode_row_crosses_a_page(fresh):
    """One more page for one decode row changes what its tile reads: a new key, and plan
    gives that row one more page."""
    q = [1] * 8
    for L in (64, 65, 128, 129, 4096, 4097):
        base = [1000 + 64 * i for i in range(8)]
        a, b = base.copy(), base.copy()
        a[3], b[3] = L, L + 1
        ka = P.plan_reuse_key(_qsl(q), np.array(a), page_size=64, fresh_kv=fresh)
        kb = P.plan_reuse_key(_qsl(q), np.array(b), page_size=64, fresh_kv=fresh)
        units = (lambda n: -(-(n - 1) // 64) + 1) if fresh else (lambda n: (n - 1) // 64 + 1)
        assert (ka == kb) == (units(L) == units(L + 1)), L
        pa = P.plan(_qsl(q), np.array(a), num_kv_heads=2, group_size=4, fresh_kv=fresh)
        pb = P.plan(_qsl(q), np.array(b), num_kv_heads=2, group_size=4, fresh_kv=fresh)
        read = lambda p: int(p.work[p.work[:, 0] == 3][:, 5].max())  # noqa: E731
        assert read(pa) == units(L) and read(pb) == units(L + 1)


def test_prefill_rows_key_on_their_exact_length():
    q = [100, 1]
    k1 = P.plan_reuse_key(_qsl(q), np.array([300, 70]), page_size=64)
    k2 = P.plan_reuse_key(_qsl(q), np.array([301, 70]), page_size=64)
    assert k1 != k2
    # q_len is part of the key: the same lengths split differently into new tokens differ
    assert P.plan_reuse_key(_qsl([1, 1]), np.array([70, 70])) != P.plan_reuse_key(
        _qsl([2]), np.array([70])) != P.plan_reuse_key(_qsl([0, 2]), np.array([70, 70]))


def test_refused_batches_have_no_key():
    assert P.plan_reuse_key(np.array([0, 5]), np.array([3])) is None  # seq_len < q_len
    assert P.plan_reuse_key(np.array([1, 5]), np.array([9])) is None  # qsl[0] != 0
    assert P.plan_reuse_key(np.array([0, 5, 4]), np.array([9, 9])) is None  # negative q
    assert P.plan_reuse_key(np.array([0, 5]), np.array([9, 9])) is None  # shapes
    assert P.plan_reuse_key(np.array([0, 1]), np.array([2 ** 31])) is None  # int32
    assert P.plan_reuse_key(np.array([0]), np.array([], dtype=np.int32)) is not None


# ----------------------------------------------------------------------------- repage
def _decode_batch(rng, n):
    q = [int(x) for x in rng.choice([0, 1, 1, 1, 1], size=n)]
    s = [int(rng.integers(1, 20000)) if x else int(rng.integers(0, 300)) for x in q]
    return q, s


@pytest.mark.parametrize("seed", range(6))
def test_repage_is_an_exact_plan_of_the_new_lengths(seed):
    """Every request moved up to 2 pages either way: the repaged plan passes the planner's
    full checker for the new lengths (exact page coverage, contiguous splits, workspace,
    combine list, costs, CTA order), with base's items, CTAs and groups."""
    from test_planner import check_plan

    rng = np.random.default_rng(seed)
    kw = dict(num_kv_heads=3, group_size=4, page_size=64, num_ctas=int(rng.integers(8, 300)))
    q, s = _decode_batch(rng, int(rng.integers(1, 48)))
    base = P.plan(_qsl(q), np.array(s), **kw)
    moved = 0
    for _ in range(20):
        s2 = [L if not ql else max(1, L + int(rng.integers(-128, 129))) for ql, L in zip(q, s)]
        dec = P.decode_units(_qsl(q), np.array(s2), page_size=64)
        assert dec is not None and dec[0] == np.array(q, np.int64).tobytes()
        splits = np.zeros(len(q), np.int64)
        np.maximum.at(splits, base.work[:, 0], base.work[:, 7])
        if np.any(dec[1] < splits):
            with pytest.raises(ValueError):
                P.repage(base, dec[1], group_size=4, page_size=64)
            continue
        r = P.repage(base, dec[1], group_size=4, page_size=64)
        check_plan(r, _qsl(q), np.array(s2), **kw)
        np.testing.assert_array_equal(r.cta_offsets, base.cta_offsets)
        np.testing.assert_array_equal(r.combine, base.combine)
        np.testing.assert_array_equal(r.partial_offsets, base.partial_offsets)
        np.testing.assert_array_equal(r.work[:, [0, 1, 2, 3, 6, 7, 8]],
                                      base.work[:, [0, 1, 2, 3, 6, 7, 8]])
        moved += not np.array_equal(r.work, base.work)
    assert moved >= 5


def test_repage_fused_units_cover_each_tile_once():
    rng = np.random.default_rng(7)
    q, s = _decode_batch(rng, 40)
    kw = dict(num_kv_heads=4, group_size=7, page_size=64, fresh_kv=True, num_ctas=264)
    base = P.plan(_qsl(q), np.array(s), **kw)
    s2 = [L + 130 if ql else L for ql, L in zip(q, s)]  # every row 2-3 units longer
    dec = P.decode_units(_qsl(q), np.array(s2), page_size=64, fresh_kv=True)
    r = P.repage(base, dec[1], group_size=7, page_size=64)
    for (b, h), items in _by_tile(r.work).items():
        items.sort()
        assert items[0][0] == 0 and items[-1][1] == dec[1][b]
        assert all(a[1] == c[0] for a, c in zip(items, items[1:]))
        assert all(a[0] < a[1] for a in items)
    assert {(b, h) for b, h in _by_tile(r.work)} == {
        (b, h) for b in range(len(q)) if q[b] and s2[b] for h in range(4)}


def _by_tile(work):
    out = {}
    for row in work.tolist():
        out.setdefault((row[0], row[1]), []).append((row[4], row[5]))
    return out


def test_repage_refuses_prefill_plans_and_decode_units_refuses_prefill_batches():
    p = P.plan(_qsl([100, 1]), np.array([300, 70]), num_kv_heads=2, group_size=4)
    with pytest.raises(ValueError):
        P.repage(p, np.array([5, 2]), group_size=4)
    assert P.decode_units(_qsl([100, 1]), np.array([300, 70])) is None
    assert P.decode_units(np.array([0, 5]), np.array([3])) is None
    q, u = P.decode_units(_qsl([1, 0, 1]), np.array([65, 9, 1]), page_size=64)
    assert u.tolist() == [2, 0, 1]
    q, u = P.decode_units(_qsl([1, 0, 1]), np.array([65, 9, 1]), page_size=64, fresh_kv=True)
    assert u.tolist() == [2, 0, 1]  # ctx 64: one cache page + the fresh tile
