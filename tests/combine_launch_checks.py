"""Helper shared by the CPU tests of the split-KV combine options (imported by test modules;
this file holds no tests): which combine kernel ``ion_attention`` launches for a plan."""

from __future__ import annotations

import torch

from cute_kernels import attention


def launched_combines(monkeypatch, plan_options: list[dict]) -> list[tuple]:
    """For each entry of ``plan_options`` (``make_device_plan`` keyword arguments), plan a
    batch whose long row splits (9000 keys on 8 CTAs), run ``ion_attention`` on CPU tensors
    with the kernels stubbed out, and record the ``(rows, pdl)`` it asked
    ``_compiled_combine`` for. Returns one entry per plan."""
    launched = []

    def fake_combine(variant, rows=False, pdl=False):
        launched.append((rows, pdl))
        return lambda *a: None

    monkeypatch.setattr(attention, "_compiled_combine", fake_combine)
    monkeypatch.setattr(attention, "_compiled", lambda *a, **k: (lambda *x: None))
    # CPU tensors: skip the CUDA-device check, keep everything after it
    monkeypatch.setattr(attention, "check_inputs", lambda *a, **k: (2, 8, 2, 128, 64))
    for options in plan_options:
        qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
        sl = torch.tensor([9000, 300], dtype=torch.int32)
        plan = attention.make_device_plan(qsl, sl, num_kv_heads=2, group_size=4, page_size=64,
                                          head_dim=128, device="cpu", num_ctas=8, **options)
        for key, value in options.items():
            assert getattr(plan, key) is value
        assert plan.num_groups > 0  # 9000 keys on 8 CTAs split
        q = torch.randn(2, 8, 128, dtype=torch.bfloat16)
        cache = torch.randn(200, 2, 64, 128, dtype=torch.bfloat16)
        bt = torch.arange(2 * 150, dtype=torch.int32).reshape(2, 150) % 200
        attention.ion_attention(q, cache, cache.clone(), torch.empty_like(q), qsl, sl, bt,
                                0.1, plan)
    return launched
