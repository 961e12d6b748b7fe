"""ION's batch invariance on the GPU: with split-KV off (what the backend plans under
VLLM_BATCH_INVARIANT=1), a token's attention output must be bit-identical whatever batch,
chunking or CTA it is computed in.  The KV-tier preemption check compares an offloading
run against a recomputing run token for token; it relies on this property.

All batches read one paged cache that already holds every token, so only the batch
layout differs between the runs.
"""

import pytest
import torch

from cute_kernels.reference import (
    default_softmax_scale,
    make_paged_case,
    reference_paged_attention,
    relative_error,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HQ, HKV, D = 28, 4, 128


def _run(q_rows, case, reqs, *, allow_split):
    """Attention for the batch ``reqs`` = [(request index in ``case``, first new position,
    q_len)], with q taken from ``q_rows[request][position]``.  Returns {(req, pos): out row}."""
    from cute_kernels import ion_attention, make_device_plan

    qs, qsl, sl, bt = [], [0], [], []
    for r, first, n in reqs:
        qs.append(q_rows[r][first:first + n])
        qsl.append(qsl[-1] + n)
        sl.append(first + n)  # the batch sees the request up to its last new token
        bt.append(case.block_table[r])
    q = torch.cat(qs).contiguous()
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    sl_t = torch.tensor(sl, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))  # poisoned
    plan = make_device_plan(qsl_t, sl_t, num_kv_heads=HKV, group_size=HQ // HKV, page_size=64,
                            head_dim=D, device=q.device, allow_split=allow_split)
    ion_attention(q, case.k_cache, case.v_cache, out, qsl_t.cuda(), sl_t.cuda(),
                  torch.stack(bt).contiguous(), default_softmax_scale(D), plan)
    torch.cuda.synchronize()
    rows = {}
    for (r, first, n), a in zip(reqs, qsl):
        for i in range(n):
            rows[(r, first + i)] = out[a + i]
    ref = reference_paged_attention(q, case.k_cache, case.v_cache, qsl_t.cuda(), sl_t.cuda(),
                                    torch.stack(bt).contiguous(), default_softmax_scale(D))
    return rows, relative_error(out, ref), plan.host.partial_rows


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seed", [0, 1])
def test_token_output_is_batch_invariant_without_split(seed):
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(700, 9000, (6,), generator=g)]
    lens[0] = 8191  # one long row: split-KV would pick it up
    case = make_paged_case(seed, [1] * len(lens), lens, HQ, HKV, D, device="cuda")
    # one q vector per (request, position): batches differ only in how rows are grouped
    q_rows = [torch.randn(n, HQ, D, generator=g).to(torch.bfloat16).cuda() for n in lens]

    last = {r: n - 1 for r, n in enumerate(lens)}
    # batch A: every request as one decode row of its last token
    a, err_a, _ = _run(q_rows, case, [(r, last[r], 1) for r in range(len(lens))],
                       allow_split=False)
    # batch B: request 0's last 150 tokens as a prefill chunk (the last token is now a
    # prefill row in a q tile with others), other requests in a different order, some as
    # chunks that end at their last token
    b_reqs = [(3, last[3] - 40, 41), (0, last[0] - 149, 150), (5, last[5], 1),
              (1, last[1] - 7, 8), (2, last[2], 1), (4, last[4] - 63, 64)]
    b, err_b, _ = _run(q_rows, case, b_reqs, allow_split=False)
    # batch C: request 0's chunk shifted by 3 tokens (q-tile boundaries move), alone
    c, err_c, _ = _run(q_rows, case, [(0, last[0] - 146, 147)], allow_split=False)

    assert max(err_a, err_b, err_c) <= 1e-2, (err_a, err_b, err_c)
    for key in a:
        assert torch.equal(a[key], b[key]), f"decode vs chunk differs for {key}"
    for key, row in c.items():
        assert torch.equal(row, b[key]), f"chunking differs for {key}"
    assert not any(torch.isnan(v).any() for v in b.values())


@pytest.mark.gpu
@needs_cuda
def test_split_plan_really_splits_here():
    """Control for the test above: on the same shapes the default plan does split, so the
    invariance test exercises the no-split path on purpose, not by accident."""
    lens = [8191, 3000, 5000]
    case = make_paged_case(7, [1] * 3, lens, HQ, HKV, D, device="cuda")
    q_rows = [torch.randn(n, HQ, D).to(torch.bfloat16).cuda() for n in lens]
    _, err, partial_rows = _run(q_rows, case, [(r, n - 1, 1) for r, n in enumerate(lens)],
                                allow_split=True)
    assert partial_rows > 0 and err <= 1e-2
