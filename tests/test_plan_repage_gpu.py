"""GPU (sm_90) tests of repaged decode plans (``planner.repage``, the builder's
``ION_PLAN_REPAGE``): a plan made for one set of decode lengths, recut for lengths up to two
pages longer or shorter, must run exactly: NaN-poisoned ``out`` against the fp32 reference
(rel err <= 1e-2, rows without work untouched), fused writeback's cache bit-equal to the
reference append at every position < seq_len, with split-KV forced so that recut split
ranges and the combine are exercised."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cute_kernels.reference import (
    default_softmax_scale,
    make_paged_case,
    new_token_slot_mapping,
    reference_kv_append,
    reference_paged_attention,
    relative_error,
    written_rows_mask,
)

from paged_gpu_checks import CHEAP_SPLIT

P = 64


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_repaged_plan_runs_exactly(fused, seed):
    from cute_kernels import kv_append
    from cute_kernels.attention import ion_attention, make_device_plan
    from cute_kernels.planner import CostModel, decode_units, repage

    rng = np.random.default_rng(seed)
    hq, hkv, d = 28, 4, 128
    n = 24
    q_lens = [1] * n
    base_lens = [int(x) for x in rng.integers(300, 9000, size=n)]
    new_lens = [max(1, L + int(rng.integers(-128, 129))) for L in base_lens]
    qsl0 = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    cm = CostModel(head_dim=d, **CHEAP_SPLIT)
    dp = make_device_plan(qsl0, torch.tensor(base_lens, dtype=torch.int32), num_kv_heads=hkv,
                          group_size=hq // hkv, page_size=P, head_dim=d, device="cuda",
                          fresh_kv=fused, cost_model=cm)
    assert int(dp.host.work[:, 7].max()) > 1, "the base plan must split"
    _, units = decode_units(qsl0.numpy(), np.array(new_lens), page_size=P, fresh_kv=fused)
    recut = repage(dp.host, units, group_size=hq // hkv, page_size=P, cost_model=cm)
    assert not np.array_equal(recut.work, dp.host.work)
    dp.upload(recut)

    q, k_cache, v_cache, qsl, sl, bt = make_paged_case(
        100 + seed, q_lens, new_lens, hq, hkv, d, page=P, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(200 + seed)
    key = torch.randn(n, hkv, d, generator=gen).to("cuda", torch.bfloat16)
    value = torch.randn(n, hkv, d, generator=gen).to("cuda", torch.bfloat16)
    scale = default_softmax_scale(d)
    slots = new_token_slot_mapping(qsl, sl, bt, P, total_q=n)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference_kv_append(key, value, ref_k, ref_v, slots)
    ref = reference_paged_attention(q, ref_k, ref_v, qsl, sl, bt, scale)
    dp.partial_o.fill_(float("nan"))
    dp.partial_lse.fill_(float("nan"))
    out = torch.full_like(q, float("nan"))
    if fused:
        ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, dp, key=key, value=value)
    else:
        kv_append(key, value, k_cache, v_cache, slots)
        ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, dp)
    torch.cuda.synchronize()
    rows = written_rows_mask(qsl, sl, n).cuda()
    assert not torch.isnan(out[rows]).any()
    err = relative_error(out, ref, rows)
    assert err <= 1e-2, f"rel err {err:.3e}"
    for b, L in enumerate(new_lens):  # the cache up to seq_len equals the reference append
        pos = torch.arange(L)
        blk = bt.cpu()[b, pos // P].long().cuda()
        row = (pos % P).cuda()
        assert torch.equal(k_cache[blk, :, row], ref_k[blk, :, row])
        assert torch.equal(v_cache[blk, :, row], ref_v[blk, :, row])
