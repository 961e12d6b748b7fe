"""CPU tests of the plain-PyTorch IonAttention API: input refusal, variant selection and the
graph-safe DevicePlan (static buffers refilled in place every step)."""

import numpy as np
import pytest
import torch

from cute_kernels.attention import DevicePlan, check_inputs
from cute_kernels.planner import plan
from cute_kernels.variants import Variant, group_pad_for, variant_for


def _inputs(**over):
    t = dict(q=torch.randn(5, 8, 128).bfloat16(), k=torch.randn(3, 2, 64, 128).bfloat16(),
             v=torch.randn(3, 2, 64, 128).bfloat16(), out=torch.empty(5, 8, 128).bfloat16(),
             qsl=torch.tensor([0, 5], dtype=torch.int32), sl=torch.tensor([70], dtype=torch.int32),
             bt=torch.tensor([[0, 2]], dtype=torch.int32))
    t.update(over)
    return t["q"], t["k"], t["v"], t["out"], t["qsl"], t["sl"], t["bt"]


def test_refuses_tensors_not_on_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA device"):
        check_inputs(*_inputs())


@pytest.mark.parametrize("dtype,d,g,err", [
    (torch.float32, 128, 7, TypeError),
    (torch.bfloat16, 96, 7, ValueError),
    (torch.bfloat16, 256, 1, ValueError),
    (torch.float16, 64, 9, ValueError),
])
def test_variant_for_refuses_unsupported(dtype, d, g, err):
    with pytest.raises(err):
        variant_for(dtype, d, g)


def test_variant_for_pads_the_gqa_group():
    assert variant_for(torch.bfloat16, 128, 7) == Variant("bfloat16", 128, 8, 64)
    assert variant_for(torch.float16, 64, 1) == Variant("float16", 64, 1, 64)
    assert [group_pad_for(g) for g in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def _plan(q_lens, seq_lens, num_ctas=8, **kw):
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return plan(qsl, np.asarray(seq_lens, np.int32), num_kv_heads=2, group_size=4,
                num_ctas=num_ctas, **kw)


def test_device_plan_refills_the_same_buffers_and_clears_stale_rows():
    big = _plan([1] * 6 + [300], [9000] * 6 + [300], max_partial_rows=4096)
    small = _plan([1, 1], [65, 10])
    assert big.combine.shape[0] > 0, "the long decodes should be split"
    dp = DevicePlan(item_capacity=big.n_items, group_capacity=big.combine.shape[0],
                    partial_rows_capacity=4096, num_ctas=8, head_dim=128, device="cpu",
                    always_combine=True)
    ptrs = [t.data_ptr() for t in (dp.work, dp.cta_offsets, dp.partial_offsets, dp.combine,
                                   dp.partial_o, dp.partial_lse)]
    dp.upload(big)
    np.testing.assert_array_equal(dp.work[: big.n_items].numpy(), big.work[:, :8])
    np.testing.assert_array_equal(dp.partial_offsets[: big.n_items].numpy(), big.partial_offsets)
    np.testing.assert_array_equal(dp.combine[: big.combine.shape[0]].numpy(), big.combine)
    dp.upload(small)
    assert [t.data_ptr() for t in (dp.work, dp.cta_offsets, dp.partial_offsets, dp.combine,
                                   dp.partial_o, dp.partial_lse)] == ptrs
    np.testing.assert_array_equal(dp.work[: small.n_items].numpy(), small.work[:, :8])
    assert not dp.work[small.n_items:].any(), "stale items of the bigger plan must be cleared"
    assert torch.all(dp.partial_offsets[small.n_items:] == -1)
    assert not dp.combine.any(), "no split groups in the small plan: all rows are padding"
    np.testing.assert_array_equal(dp.cta_offsets.numpy(), small.cta_offsets)
    assert dp.num_items == small.n_items and dp.num_groups == 0


def test_device_plan_refuses_plans_beyond_its_capacity():
    p = _plan([1] * 6 + [300], [9000] * 6 + [300], max_partial_rows=4096)
    dp = DevicePlan(item_capacity=p.n_items - 1, group_capacity=64, partial_rows_capacity=4096,
                    num_ctas=8, head_dim=64, device="cpu")
    with pytest.raises(RuntimeError, match="capacity"):
        dp.upload(p)
    dp = DevicePlan(item_capacity=p.n_items, group_capacity=64, partial_rows_capacity=1,
                    num_ctas=8, head_dim=64, device="cpu")
    with pytest.raises(RuntimeError, match="partial rows"):
        dp.upload(p)
    with pytest.raises(ValueError, match="CTAs"):
        DevicePlan(item_capacity=64, group_capacity=64, partial_rows_capacity=4096,
                   num_ctas=4, head_dim=64, device="cpu").upload(p)
