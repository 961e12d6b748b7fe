"""``planner.plan_reuse_key``: batches with equal keys get equal plans (the backend then
reuses the last step's plan and skips its upload), and the key changes whenever the plan
could.  Random mixed batches from a fresh, recorded seed (``plan_checks.seeded``), every
q-tile size, fused-writeback and page plans, packed and unpacked tiling."""

import numpy as np
import pytest

from cute_kernels import planner as P
from cute_kernels import worklist as W
from plan_checks import check_plan, plans_equal, qsl_of, seeded  # noqa: F401  (seeded: a fixture)

PAGE = 64


def _random_batch(rng, n):
    q, s = [], []
    for _ in range(n):
        r = rng.random()
        if r < 0.6:  # decode
            q.append(1), s.append(int(rng.integers(1, 20000)))
        elif r < 0.8:  # prefill chunk, maybe over a context
            ql = int(rng.integers(2, 3000))
            q.append(ql), s.append(ql + int(rng.integers(0, 8000)))
        elif r < 0.9:  # no new tokens
            q.append(0), s.append(int(rng.integers(0, 5000)))
        else:  # the first token of a prompt
            q.append(1), s.append(1)
    return q, s


def _same_key_neighbour(rng, q, s, fresh):
    """Every decode row's seq_len moved within the range where its single tile reads the
    same pages (fresh_kv: units); prefill rows stay, phantoms get any length."""
    s2 = list(s)
    for i, (ql, L) in enumerate(zip(q, s)):
        if ql == 1 and L > 0:
            ctx = L - 1
            if fresh:  # units = ceil(ctx / P) + 1: ctx in ((u - 1)P, uP]
                u = -(-ctx // PAGE)
                lo, hi = (0, 0) if u == 0 else ((u - 1) * PAGE + 1, u * PAGE)
            else:  # pages = ctx // P + 1: ctx in [kP, kP + P - 1]
                k = ctx // PAGE
                lo, hi = k * PAGE, k * PAGE + PAGE - 1
            s2[i] = int(rng.integers(lo, hi + 1)) + 1
        elif ql == 0:
            s2[i] = int(rng.integers(0, 5000))
    return s2


def _units(fresh):
    """Pages (fresh_kv: KV units) the tile of a decode row of ``n`` tokens reads."""
    return (lambda n: -(-(n - 1) // PAGE) + 1) if fresh else (lambda n: (n - 1) // PAGE + 1)


@pytest.mark.parametrize("unpacked", [False, True], ids=["packed", "unpacked"])
@pytest.mark.parametrize("fresh", [False, True], ids=["pages", "fresh"])
@pytest.mark.parametrize("tile_m", [64, 128, 192])
def test_equal_keys_give_equal_plans(seeded, tile_m, fresh, unpacked):
    rng = seeded.rng()
    kw = dict(num_kv_heads=4, group_size=7, page_size=PAGE, fresh_kv=fresh,
              unpacked_prefill=unpacked, tile_m=tile_m, num_ctas=132 if tile_m > 64 else 264,
              max_partial_rows=256 * 264)
    moved = 0
    for _ in range(8):
        q, s = _random_batch(rng, int(rng.integers(1, 40)))
        s2 = _same_key_neighbour(rng, q, s, fresh)
        with seeded.case(q=q, s=s, s2=s2):
            k1 = P.plan_reuse_key(qsl_of(q), np.array(s, np.int32), page_size=PAGE, fresh_kv=fresh)
            k2 = P.plan_reuse_key(qsl_of(q), np.array(s2, np.int32), page_size=PAGE,
                                  fresh_kv=fresh)
            assert k1 is not None and k1 == k2
            a = P.plan(qsl_of(q), np.array(s, np.int32), **kw)
            assert plans_equal(a, P.plan(qsl_of(q), np.array(s2, np.int32), **kw))
        moved += s != s2
    with seeded.case(moved=moved):
        assert moved >= 5  # the neighbours really moved seq_lens


def test_an_equal_key_plan_is_exact_for_the_new_lengths(seeded):
    """The reused plan passes the full checker for the neighbour's lengths."""
    rng = seeded.rng()
    kw = dict(num_kv_heads=2, group_size=3, num_ctas=40, tile_m=128, fresh_kv=True,
              unpacked_prefill=True)
    q, s = _random_batch(rng, 12)
    s = [min(L, 3000) if ql <= 1 else L for ql, L in zip(q, s)]
    q = [min(ql, 400) for ql in q]
    s = [max(L, ql) if ql else L for ql, L in zip(q, s)]
    s2 = _same_key_neighbour(rng, q, s, True)
    with seeded.case(q=q, s=s, s2=s2):
        reused = P.plan(qsl_of(q), np.array(s, np.int32), **kw)
        check_plan(reused, qsl_of(q), s2, num_kv_heads=2, group_size=3, num_ctas=40,
                   tile_m=128, fresh_kv=True, unpacked=True)


@pytest.mark.parametrize("fresh", [False, True], ids=["pages", "fresh"])
def test_key_changes_when_a_decode_row_crosses_a_page(fresh):
    """One more page for one decode row changes what its tile reads: a new key, and the
    plan gives that row one more page (unit)."""
    q = [1] * 8
    units = _units(fresh)
    for L in (64, 65, 128, 129, 4096, 4097):
        a = [1000 + 64 * i for i in range(8)]
        b = list(a)
        a[3], b[3] = L, L + 1
        ka = P.plan_reuse_key(qsl_of(q), np.array(a), page_size=PAGE, fresh_kv=fresh)
        kb = P.plan_reuse_key(qsl_of(q), np.array(b), page_size=PAGE, fresh_kv=fresh)
        assert (ka == kb) == (units(L) == units(L + 1)), L
        for lens in (a, b):
            p = P.plan(qsl_of(q), np.array(lens), num_kv_heads=2, group_size=4, fresh_kv=fresh)
            assert int(p.work[p.work[:, W.REQ] == 3][:, W.P1].max()) == units(lens[3])


def test_prefill_rows_key_on_their_exact_length():
    q = [100, 1]
    assert P.plan_reuse_key(qsl_of(q), np.array([300, 70])) != P.plan_reuse_key(
        qsl_of(q), np.array([301, 70]))
    # q_len is part of the key: the same lengths split differently into new tokens differ
    k = [P.plan_reuse_key(qsl_of(q), np.array(s)) for q, s in
         (([1, 1], [70, 70]), ([2], [70]), ([0, 2], [70, 70]), ([2, 0], [70, 70]))]
    assert len(set(k)) == len(k)
    # phantoms (no new token or no KV) count as 0, whatever their length
    assert P.plan_reuse_key(qsl_of([0, 1]), np.array([5, 70])) == P.plan_reuse_key(
        qsl_of([0, 1]), np.array([900, 70]))


def test_refused_batches_have_no_key():
    assert P.plan_reuse_key(np.array([0, 5]), np.array([3])) is None  # seq_len < q_len
    assert P.plan_reuse_key(np.array([1, 5]), np.array([9])) is None  # qsl[0] != 0
    assert P.plan_reuse_key(np.array([0, 5, 4]), np.array([9, 9])) is None  # negative q
    assert P.plan_reuse_key(np.array([0, 5]), np.array([9, 9])) is None  # shapes
    assert P.plan_reuse_key(np.array([0, 1]), np.array([2 ** 31])) is None  # int32
    assert P.plan_reuse_key(np.array([0, 1]), np.array([-1])) is None  # negative seq_len
    assert P.plan_reuse_key(np.array([0, 1]), np.array([9]), page_size=0) is None
    assert P.plan_reuse_key(np.array([0]), np.array([], dtype=np.int32)) is not None
    for args in ((np.array([0, 5]), np.array([3])), (np.array([0, 1]), np.array([2 ** 31]))):
        with pytest.raises((ValueError, OverflowError)):  # plan raises as usual
            P.plan(*args, num_kv_heads=1, group_size=1)
