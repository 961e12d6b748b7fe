"""CPU tests of the two-consumer-warpgroup kernel (``IonAttentionSm90(consumers=2)``: 128-row
q tiles, warpgroup 0 = TMA producer, warpgroups 1/2 = consumers of rows 0-63 / 64-127 that
share every K/V stage; one 384-thread CTA per SM) and of ``tile_m=128`` plans.

* Planner with ``tile_m=128``: an independent checker demands that the items cover every
  (request, q head, new token, KV page) exactly once (packed tiles of 128 // Gp tokens,
  unpacked tiles of 128 tokens, split-KV), no phantom page, and that the split-KV partial
  rows of 128-row tiles are laid out as the combine pass reads them (``base + s * ntok * Gp
  + t * Gp + g``, disjoint, inside ``partial_rows``); ``worst_case_items(tile_m=128)``
  bounds random plans; ``DevicePlan`` records ``tile_m`` and refuses the other kind.
* sm_90a compile of every consumers=2 variant (bf16/fp16 x D 64/128 x Gp 1/2/4/8) from fake
  tensors: wgmma, TMA, setmaxnreg 24/240, 384 threads, one CTA per SM, no local memory in
  the PTX, no spill in the SASS; the K/V/Q *empty* barriers count 8 arrivals (lane 0 of the 4
  warps of each of the 2 consumer warpgroups: a stage is refilled only when both consumers
  released it) where the default kernel counts 4; fused-writeback / unpacked_prefill
  variants with consumers=2 too.
* The default kernels' PTX is byte-identical (``//`` comment lines aside) to the build
  before consumers=2 existed: SHA-256 prefixes pinned from commit 2c51a4d.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re

import numpy as np
import pytest

from cute_kernels.planner import (
    W_QHEAD,
    CostModel,
    next_pow2,
    plan,
    worst_case_items,
)

P = 64
TM = 128
CHEAP_SPLIT_MODEL = CostModel(item_overhead_us=0.01, split_item_overhead_us=0.0,
                              combine_launch_us=0.0)


def qsl_of(q_lens):
    return np.concatenate([[0], np.cumsum(np.asarray(q_lens, dtype=np.int64))]).astype(np.int32)


def check_plan_128(p, q_lens, seq_lens, *, hkv, g, tm=TM):
    """Exact once-only coverage of (request, q head, token, page) by the items of a
    tile_m=128 (or ``tm``) plan, plus the split-KV partial-row layout of its tiles."""
    assert p.tile_m == tm
    gp = next_pow2(g)
    tpt = tm // gp
    q = np.asarray(q_lens)
    sl = np.asarray(seq_lens)
    seen = {}
    groups = {}
    used_rows = np.zeros(max(p.partial_rows, 1), dtype=np.int64)
    for i, row in enumerate(p.work.tolist()):
        b, h, t0, nt, p0, p1, s, ns, qh = row
        assert q[b] > 0 and sl[b] > 0, f"item {i}: phantom request"
        assert 0 <= h < hkv and 0 <= p0 < p1 and 0 <= s < ns
        ctx = int(sl[b] - q[b])
        if qh < 0:
            assert 1 <= nt <= tpt and t0 % tpt == 0 and t0 + nt <= q[b], f"item {i}: tokens"
            heads = list(range(h * g, h * g + g))
        else:
            assert qh < g and 1 <= nt <= tm and t0 % tm == 0 and t0 + nt <= q[b]
            assert ns == 1 and p.partial_offsets[i] == -1, f"item {i}: unpacked split"
            heads = [h * g + qh]
        last_pos = ctx + t0 + nt - 1
        assert p1 <= last_pos // P + 1, f"item {i}: page past the causal bound (phantom)"
        for hh in heads:
            for t in range(t0, t0 + nt):
                for pg in range(p0, p1):
                    if pg * P <= ctx + t:
                        key = (b, hh, t, pg)
                        assert key not in seen, f"items {seen[key]} and {i} both cover {key}"
                        seen[key] = i
        if ns > 1:
            groups.setdefault((b, h, t0), []).append((s, ns, nt, int(p.partial_offsets[i])))
            off = int(p.partial_offsets[i])
            # the kernel's consumer w writes rows off + 64*(w-1) + r, r = t*Gp + g < 64
            rows = off + np.arange(nt * gp)
            assert rows.min() >= 0 and rows.max() < p.partial_rows
            used_rows[rows] += 1
        else:
            assert p.partial_offsets[i] == -1
    expect = set()
    for b, (ql, L) in enumerate(zip(q_lens, seq_lens)):
        if ql == 0 or L == 0:
            continue
        for hh in range(hkv * g):
            for t in range(ql):
                for pg in range((L - ql + t) // P + 1):
                    expect.add((b, hh, t, pg))
    assert set(seen) == expect, f"uncovered: {sorted(expect - set(seen))[:3]}"
    assert (used_rows <= 1).all(), "split partial rows overlap"
    # combine groups: (b, h, tok0, ntok, S, base); split s at base + s * ntok * Gp
    comb = {(int(c[0]), int(c[1]), int(c[2])): c for c in p.combine}
    assert set(comb) == set(groups)
    for key, parts in groups.items():
        c = comb[key]
        assert sorted(x[0] for x in parts) == list(range(int(c[4])))
        for s, ns, nt, off in parts:
            assert ns == c[4] and nt == c[3] and off == c[5] + s * nt * gp
    return groups


def random_batch(rng, n_max=6):
    q_lens, seq_lens = [], []
    for _ in range(int(rng.integers(1, n_max + 1))):
        kind = int(rng.integers(0, 5))
        if kind == 0:
            ql, L = 1, int(rng.integers(1, 600))
        elif kind == 1:
            ql = int(rng.integers(64, 400))
            L = ql + int(rng.integers(1, 200))
        elif kind == 2:
            ql = int(rng.integers(1, 300))
            L = ql
        elif kind == 3:
            ql, L = 0, int(rng.integers(0, 150))
        else:
            ql = int(rng.choice([63, 64, 65, 127, 128, 129, 255, 256, 257]))
            L = ql + int(rng.choice([0, 1, 63, 64, 100]))
        q_lens.append(ql)
        seq_lens.append(L)
    return q_lens, seq_lens


@pytest.mark.parametrize("g", [1, 3, 7, 8])
def test_tile_m_128_plan_covers_every_triple_once(g):
    rng = np.random.default_rng(40 + g)
    got_split = got_unpacked = 0
    for trial in range(8):
        q_lens, seq_lens = random_batch(rng)
        if trial % 2 == 0:
            q_lens.append(1)  # a long decode row: split-KV
            seq_lens.append(int(rng.integers(1500, 3000)))
        if trial % 3 == 0:
            q_lens.append(384)
            seq_lens.append(384 + int(rng.integers(0, 130)))
        qsl, sl = qsl_of(q_lens), np.asarray(seq_lens, np.int32)
        for cm, nc, unp in ((None, 132, False), (CHEAP_SPLIT_MODEL, 16, False),
                            (CHEAP_SPLIT_MODEL, 16, True)):
            p = plan(qsl, sl, num_kv_heads=2, group_size=g, num_ctas=nc, cost_model=cm,
                     max_splits=8, tile_m=TM, unpacked_prefill=unp)
            groups = check_plan_128(p, q_lens, seq_lens, hkv=2, g=g)
            got_split += bool(groups)
            got_unpacked += int((p.work[:, W_QHEAD] >= 0).sum())
            bound = worst_case_items(len(q_lens), max(1, sum(q_lens)), max(1, max(seq_lens)),
                                     2, g, tile_m=TM, max_splits=8, unpacked_prefill=unp)
            assert p.n_items <= bound
    assert got_split > 0
    if g in (3, 7):
        assert got_unpacked > 0


def test_checker_rejects_corrupted_plans():
    q_lens, seq_lens = [1, 300, 100], [8000, 340, 100]
    p = plan(qsl_of(q_lens), np.asarray(seq_lens, np.int32), num_kv_heads=2, group_size=7,
             num_ctas=8, tile_m=TM, cost_model=CHEAP_SPLIT_MODEL)
    check_plan_128(p, q_lens, seq_lens, hkv=2, g=7)
    sp = int(np.flatnonzero(p.work[:, 7] > 1)[0])
    pk = int(np.flatnonzero(p.work[:, 0] == 1)[0])

    def corrupt(fn, po=None):
        w = p.work.copy()
        fn(w)
        return dataclasses.replace(p, work=w, partial_offsets=(p.partial_offsets if po is None
                                                               else po))

    po = p.partial_offsets.copy()
    po[sp] += 1
    bad = [
        corrupt(lambda w: w.__setitem__((pk, 3), w[pk, 3] - 1)),  # token dropped
        corrupt(lambda w: w.__setitem__((pk, 5), w[pk, 5] + 1)),  # phantom page
        corrupt(lambda w: w.__setitem__((pk, 2), w[pk, 2] + 64)),  # 64-row tile offset
        corrupt(lambda w: None, po),  # partial rows shifted
        dataclasses.replace(p, work=p.work[1:], partial_offsets=p.partial_offsets[1:]),
    ]
    for c in bad:
        with pytest.raises(AssertionError):
            check_plan_128(c, q_lens, seq_lens, hkv=2, g=7)


def test_tile_m_128_halves_the_prefill_tiles():
    one = qsl_of([8192])
    a = plan(one, np.asarray([8192], np.int32), num_kv_heads=4, group_size=7, num_ctas=132,
             tile_m=TM)
    b = plan(one, np.asarray([8192], np.int32), num_kv_heads=4, group_size=7, num_ctas=264)
    assert a.n_items * 2 == b.n_items == 4 * 1024 and a.tile_m == 128 and b.tile_m == 64
    # K/V page streams: halved (a 16-token tile's two 8-token halves end in the same page)
    assert (a.work[:, 5] - a.work[:, 4]).sum() * 2 == (b.work[:, 5] - b.work[:, 4]).sum()
    assert a.work[:, 3].max() == 16  # Gp = 8: 16 tokens per 128-row tile


def test_device_plan_records_tile_m():
    from cute_kernels.attention import DevicePlan, make_device_plan

    qsl, sl = qsl_of([1, 256]), np.asarray([900, 296], np.int32)
    p128 = plan(qsl, sl, num_kv_heads=2, group_size=7, num_ctas=8, tile_m=TM)
    p64 = plan(qsl, sl, num_kv_heads=2, group_size=7, num_ctas=8)
    kw = dict(item_capacity=256, group_capacity=16, partial_rows_capacity=4096, num_ctas=8,
              head_dim=128, device="cpu")
    d128 = DevicePlan(tile_m=TM, **kw)
    assert d128.tile_m == 128 and d128.consumers == 2
    d128.upload(p128)
    np.testing.assert_array_equal(d128.work[:p128.n_items].numpy(), p128.work[:, :8])
    with pytest.raises(RuntimeError, match="tile_m"):
        d128.upload(p64)
    d64 = DevicePlan(**kw)
    assert d64.tile_m == 64 and d64.consumers == 1
    with pytest.raises(RuntimeError, match="tile_m"):
        d64.upload(p128)
    with pytest.raises(ValueError, match="tile_m"):
        DevicePlan(tile_m=96, **kw)
    md = make_device_plan(qsl, sl, num_kv_heads=2, group_size=7, page_size=P, head_dim=128,
                          device="cpu", num_ctas=8, tile_m=TM)
    assert md.tile_m == 128 and np.array_equal(md.work.numpy(), p128.work[:, :8])
    mu = make_device_plan(qsl, sl, num_kv_heads=2, group_size=7, page_size=P, head_dim=128,
                          device="cpu", num_ctas=8, tile_m=TM, unpacked_prefill=True)
    assert mu.tile_m == 128 and mu.unpacked and (mu.host.work[:, W_QHEAD] >= 0).any()


# ----------------------------------------------------------------------- sm_90a compile

cutlass = pytest.importorskip("cutlass")

from cute_kernels import attention  # noqa: E402
from cute_kernels.compile_utils import compile_sm90a  # noqa: E402
from cute_kernels.variants import ALL_VARIANTS  # noqa: E402


def _vid(v):
    return "-".join(str(x) for x in v)


def _sass(cubin):
    from test_fused_writeback_cpu import _sass as sass_of  # nvdisasm lookup, shared

    return sass_of(cubin)


def _ptx_sha(ptx):
    """PTX hash without comments and without the programmatic-dependent-launch trigger
    (one ``griddepcontrol.launch_dependents`` added to every attention kernel on
    2026-12-01; ``test_default_ptx_unchanged`` checks it is there exactly once), so the
    pins below still prove everything else byte-identical."""
    lines = [ln for ln in ptx.splitlines() if not ln.lstrip().startswith("//")
             and "griddepcontrol.launch_dependents" not in ln]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _barrier_init_counts(ptx):
    """Arrival counts of every mbarrier.init (the count is a register set by a mov)."""
    movs = dict(re.findall(r"mov\.(?:b|u|s)32\s+(%r\d+),\s*(\d+);", ptx))
    counts = []
    for arg in re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*([^;]+);", ptx):
        arg = arg.strip()
        counts.append(int(arg) if arg.isdigit() else int(movs[arg]))
    return sorted(counts)


def _check_no_spills(art):
    assert not art.has("st.local") and not art.has("ld.local"), "local-memory spill in PTX"
    sass = _sass(art.cubin)
    if sass is not None:
        assert "HGMMA" in sass and "UTMALDG" in sass
        assert "STL" not in sass and "LDL" not in sass, "ptxas spilled registers"


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=[_vid(v) for v in ALL_VARIANTS])
def test_two_consumer_variant_compiles_for_sm90a(variant):
    art = compile_sm90a(attention.make_kernel(variant, consumers=2),
                        *attention.fake_args(variant), compile_options="--enable-tvm-ffi",
                        keep_cubin=True)
    assert art.has("wgmma.mma_async") and art.has("cp.async.bulk.tensor")
    assert art.has("setmaxnreg.dec.sync.aligned.u32 \t24;")
    assert art.has("setmaxnreg.inc.sync.aligned.u32 \t240;")
    assert ".reqntid 384, 1, 1" in art.ptx and ".minnctapersm 1" in art.ptx
    _check_no_spills(art)
    # Q (2 boxes of 64 rows), K, V: one TMA load site per 64 columns of D each
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.shared::c\w+\.global", art.ptx))
    assert loads == 4 * (variant.head_dim // 64)
    # Q: 2 stages, K and V: kv_stages_for (4 over 64-token pages since 2026-12-02): full
    # barriers count 1 (the TMA thread), empty barriers 8
    n = 2 + 2 * attention.kv_stages_for(2, variant.page_size)
    assert _barrier_init_counts(art.ptx) == [1] * n + [8] * n


def test_default_kernel_empty_barriers_count_4():
    v = ALL_VARIANTS[7]
    art = compile_sm90a(attention.make_kernel(v), *attention.fake_args(v),
                        compile_options="--enable-tvm-ffi")
    assert _barrier_init_counts(art.ptx) == [1] * 6 + [4] * 6
    assert ".reqntid 256, 1, 1" in art.ptx


@pytest.mark.parametrize("unpacked,fused", [(True, False), (False, True), (True, True)],
                         ids=["unpacked", "fused", "fused-unpacked"])
@pytest.mark.parametrize("vi", [1, 7, 12], ids=["bf16-64-2", "bf16-128-8", "fp16-128-1"])
def test_two_consumer_option_variants_compile(vi, unpacked, fused):
    v = ALL_VARIANTS[vi]
    if fused:
        art = compile_sm90a(attention.make_fused_kernel(v, unpacked, consumers=2),
                            *attention.fused_fake_args(v, unpacked),
                            compile_options="--enable-tvm-ffi", keep_cubin=True)
        stores = len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared::cta", art.ptx))
        assert stores == 2 * (v.head_dim // 64), "fresh K/V writeback stores"
        assert art.count(r"st\.global\.b16") >= 2, "straddle rows by plain stores"
        assert art.has("setmaxnreg.dec.sync.aligned.u32 \t40;")
        assert art.has("setmaxnreg.inc.sync.aligned.u32 \t232;")
    else:
        art = compile_sm90a(attention.make_kernel(v, unpacked, consumers=2),
                            *attention.fake_args(v, unpacked),
                            compile_options="--enable-tvm-ffi", keep_cubin=True)
        assert art.has("setmaxnreg.inc.sync.aligned.u32 \t240;")
    assert art.has("wgmma.mma_async") and ".reqntid 384, 1, 1" in art.ptx
    n = 2 + 2 * attention.kv_stages_for(2, v.page_size)
    assert _barrier_init_counts(art.ptx) == [1] * n + [8] * n
    _check_no_spills(art)


def test_bad_configurations_are_refused():
    from cute_kernels.attention_sm90 import IonAttentionSm90

    with pytest.raises(ValueError, match="consumers"):
        IonAttentionSm90(cutlass.BFloat16, 128, 8, consumers=4)
    with pytest.raises(ValueError, match="ctas_per_sm"):
        IonAttentionSm90(cutlass.BFloat16, 128, 8, consumers=2, ctas_per_sm=2)
    k = IonAttentionSm90(cutlass.BFloat16, 128, 8, consumers=2)
    assert (k.threads, k.ctas_per_sm, k.tokens_per_tile) == (384, 1, 16)
    # the register split fills the 64K file at 384 threads (168 registers at entry)
    assert 128 * k.producer_regs + 256 * k.consumer_regs <= 65536 // 384 // 8 * 8 * 384
    with pytest.raises(ValueError, match="consumers"):
        attention.make_kernel(ALL_VARIANTS[0], consumers=4)


# PTX of default kernels built at commit 2c51a4d (before consumers=2 existed), `//` lines
# dropped: the option must leave every existing variant byte-identical.  The fused pins
# were re-taken when the fused kernel's straddle rows moved from a TMA store at a negative
# row coordinate (illegal instruction on the H200) to plain stores; the plain and unpacked
# pins are still those of 2c51a4d, so that fix left the non-fused kernels untouched.  The
# unpacked pins were re-taken on 2026-12-03 (v18): split unpacked items write chunked
# partial rows (GPU-validated: tests/test_unpacked_split_gpu.py, 30 passed on the H200);
# the plain and fused pins stay, so v18 left the default kernels byte-identical.  The fused
# pins were re-taken on 2026-12-03 (nineteenth session): the fused kernels decide once an
# item which KV units need the element-wise mask (planner.fresh_mask_units; GPU-validated:
# 146 GPU tests and three 500-case fused sweeps, bench/results/2026-12-03-h200/session19).
_PINNED = [
    (7, "plain", "74374d45f914f370"), (7, "unpacked", "2773b85e181d198e"),
    (7, "fused", "ce96bd72b70f48c7"), (0, "plain", "786cd00480acf914"),
    (0, "fused", "78c062c1c267ae0f"), (12, "unpacked", "ea7159f6abf5216a"),
]


@pytest.mark.parametrize("vi,kind,sha", _PINNED, ids=[f"{a}-{b}" for a, b, _ in _PINNED])
def test_default_ptx_unchanged(vi, kind, sha):
    v = ALL_VARIANTS[vi]
    if kind == "fused":
        art = compile_sm90a(attention.make_fused_kernel(v), *attention.fused_fake_args(v),
                            compile_options="--enable-tvm-ffi")
    else:
        u = kind == "unpacked"
        art = compile_sm90a(attention.make_kernel(v, u), *attention.fake_args(v, u),
                            compile_options="--enable-tvm-ffi")
    assert _ptx_sha(art.ptx) == sha
    assert art.ptx.count("griddepcontrol.launch_dependents;") == 1
