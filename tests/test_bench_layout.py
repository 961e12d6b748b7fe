"""Each backend's cache built by the kernel bench holds the same logical K/V
(CPU tensors; no GPU needed)."""

import math

import pytest

torch = pytest.importorskip("torch")

from ion_vllm.bench import kernel_runner as kr  # noqa: E402
from ion_vllm.bench import kernel_suite as ks  # noqa: E402

CASE = ks.Case("layout", (1, 3, 2), (70, 20, 130), hq=4, hkv=2, d=64, fa_page=16)


def _gather_nhd(kc, bt, kv_len, page):
    t = torch.arange(kv_len)
    return kc[bt[t // page].long(), t % page]          # [L, Hkv, D]


def test_logical_data_deterministic_and_random():
    q1, k1, v1 = kr.logical_qkv(CASE, 0, "cpu")
    q2, k2, v2 = kr.logical_qkv(CASE, 0, "cpu")
    q3, k3, _ = kr.logical_qkv(CASE, 1, "cpu")
    assert torch.equal(q1, q2) and torch.equal(k1, k2) and torch.equal(v1, v2)
    assert not torch.equal(k1, k3) and not torch.equal(q1, q3)
    assert q1.shape == (6, 4, 64) and k1.shape == (220, 2, 64)
    assert q1.dtype == torch.bfloat16
    assert 0.8 < k1.float().std().item() < 1.2 and k1.abs().sum() > 0


def test_page_assignment_is_a_permutation():
    bt, tp, to, n = kr.page_assignment(CASE, 16, 0)
    assert n == math.ceil(70 / 16) + math.ceil(20 / 16) + math.ceil(130 / 16)
    used = [int(bt[b, j]) for b, kv in enumerate(CASE.kv_lens) for j in range(math.ceil(kv / 16))]
    assert sorted(used) == list(range(n))
    assert used != sorted(used)  # shuffled like a fragmented allocator
    assert tp.shape == to.shape == (CASE.total_kv,)


@pytest.mark.parametrize("rot", [0, 1])
def test_all_layouts_hold_same_logical_kv(rot):
    _, k_log, v_log = kr.logical_qkv(CASE, rot, "cpu")
    q_i, k_i, v_i, bt_i = kr.ion_cache(CASE, rot, "cpu")
    q_f, k_f, v_f, bt_f = kr.fa_cache(CASE, rot, "cpu")
    q_t, k_t, v_t, bt_t = kr.triton_cache(CASE, rot, "cpu")
    assert torch.equal(q_i, q_f) and torch.equal(q_i, q_t)
    assert k_i.shape[1:] == (2, 64, 64)          # HND: [nb, Hkv, P=64, D]
    assert k_i.stride(2) == 64                   # page rows contiguous (TMA box)
    assert k_f.shape[1:] == (16, 2, 64)          # NHD: [nb, P=16, Hkv, D]
    assert k_t.shape[1:] == (16, 2, 64) and k_t.stride(2) == 128  # K|V packed
    t0 = 0
    for b, kv in enumerate(CASE.kv_lens):
        want_k, want_v = k_log[t0:t0 + kv], v_log[t0:t0 + kv]
        t = torch.arange(kv)
        ion_k = k_i[bt_i[b, t // 64].long(), :, t % 64]
        ion_v = v_i[bt_i[b, t // 64].long(), :, t % 64]
        assert torch.equal(ion_k, want_k) and torch.equal(ion_v, want_v)
        assert torch.equal(_gather_nhd(k_f, bt_f[b], kv, 16), want_k)
        assert torch.equal(_gather_nhd(v_f, bt_f[b], kv, 16), want_v)
        assert torch.equal(_gather_nhd(k_t, bt_t[b], kv, 16), want_k)
        assert torch.equal(_gather_nhd(v_t, bt_t[b], kv, 16), want_v)
        t0 += kv


def test_ion_layout_matches_reference_semantics():
    """The ION cache + block table, read by the project's reference, give the
    causal attention of the logical data (so ION and FA compute the same thing)."""
    ref_mod = pytest.importorskip("cute_kernels.reference")
    q, k, v, bt = kr.ion_cache(CASE, 0, "cpu")
    _, k_log, v_log = kr.logical_qkv(CASE, 0, "cpu")
    qsl = torch.tensor(CASE.query_start_loc(), dtype=torch.int32)
    sl = torch.tensor(CASE.kv_lens, dtype=torch.int32)
    scale = CASE.d ** -0.5
    got = ref_mod.reference_paged_attention(q, k, v, qsl, sl, bt, scale)
    g = CASE.hq // CASE.hkv
    t0 = 0
    for b, (ql, kv) in enumerate(zip(CASE.q_lens, CASE.kv_lens)):
        s0 = CASE.query_start_loc()[b]
        kk = k_log[t0:t0 + kv].float().repeat_interleave(g, dim=1)   # [L, Hq, D]
        vv = v_log[t0:t0 + kv].float().repeat_interleave(g, dim=1)
        qq = q[s0:s0 + ql].float()
        s = torch.einsum("ihd,lhd->hil", qq, kk) * scale
        pos = torch.arange(kv)
        qpos = kv - ql + torch.arange(ql)
        s = s.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        want = torch.einsum("hil,lhd->ihd", s.softmax(-1), vv)
        torch.testing.assert_close(got[s0:s0 + ql], want, rtol=1e-4, atol=1e-4)
        t0 += kv


def test_rel_err():
    a = torch.ones(4, 2, 8)
    assert kr.rel_err(a, a) == 0.0
    assert abs(kr.rel_err(a * 1.01, a) - 0.01) < 1e-6
    bad = a.clone()
    bad[0, 0, 0] = float("nan")
    assert kr.rel_err(bad, a) == float("inf")


def test_fused_qkv_layout_gives_engine_strided_views_of_the_same_values():
    # q / key / value of a "fused" case are views at the qkv projection's column offsets
    # (row stride (hq + 2 hkv) * D), hold the separate case's values, and the kernels'
    # TMA rules (unit last stride, 16-byte strides and base) hold
    sep = ks.Case("lay", (1, 3, 2), (70, 20, 130), hq=4, hkv=2, d=64)
    fus = ks.Case("lay", (1, 3, 2), (70, 20, 130), hq=4, hkv=2, d=64, qkv_layout="fused")
    row = (4 + 2 * 2) * 64
    for build in (kr.ion_cache, kr.fa_cache, kr.triton_cache):
        q_s, q_f = build(sep, 0, "cpu")[0], build(fus, 0, "cpu")[0]
        assert q_s.is_contiguous() and torch.equal(q_s, q_f)
        assert q_f.stride() == (row, 64, 1) and not q_f.is_contiguous()
        assert torch.empty_like(q_f).is_contiguous()  # outputs stay dense
    k_s, v_s, slots_s = kr.new_token_rows(sep, 0, "cpu")
    k_f, v_f, slots_f = kr.new_token_rows(fus, 0, "cpu")
    assert torch.equal(k_s, k_f) and torch.equal(v_s, v_f) and torch.equal(slots_s, slots_f)
    for t, col in ((k_f, 4), (v_f, 6)):
        assert t.stride() == (row, 64, 1)
        base = t.untyped_storage().data_ptr()
        assert t.data_ptr() - base == col * 64 * t.element_size()
        assert all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])
