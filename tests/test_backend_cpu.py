"""CPU tests of the ION backend glue: KV layout as vLLM allocates it, block-size choice
through vLLM's own logic, the metadata builder's plan buffers, and the impl's plumbing
(cache write + attention call + test-only fault) checked against the PyTorch reference."""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ion_vllm.backend import (  # noqa: E402
    FAULT_INJECT_ENV,
    IonAttentionBackend,
    IonAttentionImpl,
    IonAttentionMetadataBuilder,
    fault_block_table,
)

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "tie_word_embeddings": False,
}
HQ, HKV, D, P = 4, 2, 64, 64



@pytest.fixture
def make_config(cpu_platform, tmp_path):
    model = tmp_path / "tiny-qwen2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_QWEN2))

    def make(*extra):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--model", str(model), "--attention-backend", "ION",
                                  "--skip-tokenizer-init", "--load-format", "dummy",
                                  *extra])
        return EngineArgs.from_cli_args(args).create_engine_config()

    return make


def kv_spec(block_size=P):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=HKV, head_size=D,
                             dtype=torch.bfloat16)


def common_metadata(q_lens, seq_lens, block_table, pad_tokens=0, seq_lens_device=None,
                    page=P):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from cute_kernels.reference import new_token_slot_mapping

    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    n = int(qsl[-1]) + pad_tokens
    slots = new_token_slot_mapping(qsl, sl, block_table, page, total_q=n)
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl,
        seq_lens=sl.clone() if seq_lens_device is None else seq_lens_device,
        num_reqs=len(q_lens), num_actual_tokens=n, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_table_tensor=block_table,
        slot_mapping=slots, seq_lens_cpu_upper_bound=sl, _seq_lens_cpu=sl)


def coverage_from_work(work, q_lens, seq_lens, group_size=None, tile_m=64):
    """(b, h, token) -> pages read, from a contract work list; the split items of a token
    must tile its page range exactly once, in order.  A 9-column list may hold unpacked
    items (col 8 = q head g >= 0): then each of the ``group_size`` q heads of the token must
    be covered that way, instead of once by a packed item (col 8 = -1)."""
    pieces = {}
    for row in work.tolist():
        b, h, t0, nt, p0, p1, split, nsplit = row[:8]
        assert len(row) in (8, 9)
        qh = row[8] if len(row) == 9 else -1
        assert 0 <= split < nsplit and p0 < p1
        if qh >= 0:
            assert nt <= tile_m  # an unpacked tile is one q head x <= tile_m tokens
        for t in range(t0, t0 + nt):
            pieces.setdefault((b, h, t, qh), []).append((split, nsplit, p0, p1))
    by_token = {}
    for (b, h, t, qh), parts in pieces.items():
        parts.sort()
        assert [s for s, _, _, _ in parts] == list(range(parts[0][1])), f"{b, h, t}: {parts}"
        for (_, _, _, a1), (_, _, b0, _) in zip(parts, parts[1:]):
            assert a1 == b0, f"{b, h, t}: split ranges not contiguous {parts}"
        by_token.setdefault((b, h, t), {})[qh] = (parts[0][2], parts[-1][3])
    cov = {}
    for key, heads in by_token.items():
        if set(heads) != {-1}:
            assert group_size and set(heads) == set(range(group_size)), (key, sorted(heads))
        assert len(set(heads.values())) == 1, (key, heads)
        cov[key] = next(iter(heads.values()))
    expected = {}
    for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        for h in range(HKV):
            for t in range(ql):
                expected[(b, h, t)] = sl - ql + t  # last KV position it attends to
    assert set(cov) == set(expected)
    for key, last_pos in expected.items():
        p0, p1 = cov[key]
        assert p0 == 0 and p1 * P > last_pos, (key, p0, p1, last_pos)
    return cov


# ----------------------------------------------------------------------------- backend
def test_backend_identity_and_flags():
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert IonAttentionBackend.get_name() == "ION"
    # vLLM's Attention layer does AttentionBackendEnum[backend.get_name()]
    assert AttentionBackendEnum[IonAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM
    assert IonAttentionBackend.forward_includes_kv_cache_update is True
    assert IonAttentionBackend.get_impl_cls() is IonAttentionImpl
    assert IonAttentionBackend.get_builder_cls() is IonAttentionMetadataBuilder
    assert IonAttentionMetadataBuilder._cudagraph_support is AttentionCGSupport.ALWAYS
    assert not IonAttentionBackend.is_mla() and not IonAttentionBackend.supports_sink()


def test_kv_cache_layout_as_vllm_allocates_it():
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    nb = 10
    shape = IonAttentionBackend.get_kv_cache_shape(nb, P, HKV, D)
    assert shape == (nb, 2, HKV, P, D)
    assert IonAttentionBackend.get_kv_cache_block_dim(P, HKV, D) == 0
    order = IonAttentionBackend.get_kv_cache_stride_order()
    assert order == (0, 1, 2, 3, 4)
    assert not IonAttentionBackend.indexes_kv_by_block_stride()
    with pytest.raises(ValueError):
        IonAttentionBackend.get_kv_cache_shape(nb, 16, HKV, D)

    spec = kv_spec()
    raw = torch.zeros(nb * spec.page_size_bytes, dtype=torch.int8)
    cache = _reshape_attention_kv_cache(raw, spec, shape, order, nb, None)
    assert cache.shape == (nb, 2, HKV, P, D) and cache.is_contiguous()
    k, v = cache[:, 0], cache[:, 1]
    # one page of one KV head is one contiguous [P, D] box (one TMA box)
    assert k.stride() == (2 * HKV * P * D, P * D, D, 1)
    assert v.data_ptr() - k.data_ptr() == HKV * P * D * 2


def test_block_size_choice_goes_through_vllm(make_config, monkeypatch):
    from vllm.platforms.interface import Platform
    from vllm.v1.worker.utils import select_common_block_size

    monkeypatch.setattr(Platform, "_find_non_ssm_backend",
                        classmethod(lambda cls, cfg: IonAttentionBackend))
    cfg = make_config()
    assert not cfg.cache_config.user_specified_block_size
    Platform.update_block_size_for_backend(cfg)
    assert cfg.cache_config.block_size == 64

    cfg = make_config("--block-size", "128")
    Platform.update_block_size_for_backend(cfg)
    assert cfg.cache_config.block_size == 128
    # vLLM splits a 128-token KV block into 64-token kernel pages for ION
    assert select_common_block_size(128, [IonAttentionBackend]) == 64
    assert select_common_block_size(64, [IonAttentionBackend]) == 64
    assert IonAttentionBackend.supports_block_size(128)
    assert not IonAttentionBackend.supports_block_size(32)


# ----------------------------------------------------------------------------- builder
def test_builder_plans_once_into_persistent_buffers(make_config):
    from cute_kernels import planner

    cfg = make_config("--max-num-seqs", "8", "--max-num-batched-tokens", "512")
    builder = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert builder.group_size == 2 and builder.num_kv_heads == HKV
    assert builder.item_capacity == planner.worst_case_items(
        8, 512, cfg.model_config.max_model_len, HKV, 2, page_size=P,
        max_splits=builder.max_splits)
    work_ptr, cta_ptr = builder.plan.work.data_ptr(), builder.plan.cta_offsets.data_ptr()
    comb_ptr, po_ptr = builder.plan.combine.data_ptr(), builder.plan.partial_o.data_ptr()

    # mixed batch: long prefill, chunk continuation, decodes, a padded empty request
    q_lens, seq_lens = [100, 40, 1, 1, 0], [100, 300, 129, 64, 0]
    bt = torch.arange(5 * 8, dtype=torch.int32).reshape(5, 8)
    md = builder.build(0, common_metadata(q_lens, seq_lens, bt, pad_tokens=6))
    plan = md.plan
    assert plan.work.data_ptr() == work_ptr and plan.cta_offsets.data_ptr() == cta_ptr
    assert plan.combine.data_ptr() == comb_ptr and plan.partial_o.data_ptr() == po_ptr
    assert plan.always_combine  # graph-safe: the combine launch is always captured
    assert plan.host.partial_rows <= builder.partial_rows
    assert plan.num_ctas == builder.num_ctas and plan.cta_offsets.shape == (plan.num_ctas + 1,)
    assert int(plan.cta_offsets[-1]) == plan.num_items == plan.host.n_items
    assert torch.all(plan.cta_offsets[1:] >= plan.cta_offsets[:-1])
    work = plan.work[: plan.num_items]
    assert (plan.host.work[:, 8] == -1).all()  # no unpacked items (G = Gp = 2)
    np.testing.assert_array_equal(work.numpy(), plan.host.work[:, : plan.work_cols])
    coverage_from_work(work, q_lens, seq_lens)
    first_items = plan.num_items
    assert md.num_actual_tokens == 148 and md.slot_mapping.shape == (148,)
    assert md.block_table is bt

    # next step, smaller batch: same buffers, stale rows cleared
    q_lens2, seq_lens2 = [1, 1], [101, 301]
    md2 = builder.build(0, common_metadata(q_lens2, seq_lens2, bt[:2]))
    assert md2.plan.work.data_ptr() == work_ptr
    assert md2.plan.num_items < first_items
    coverage_from_work(md2.plan.work[: md2.plan.num_items], q_lens2, seq_lens2)
    assert not md2.plan.work[md2.plan.num_items:].any()
    assert not md2.plan.combine[md2.plan.num_groups:].any()
    assert torch.all(md2.plan.partial_offsets[md2.plan.num_items:] == -1)
    assert int(md2.plan.cta_offsets[-1]) == md2.plan.num_items


def test_builder_plans_from_host_seq_lens(make_config, monkeypatch):
    """The plan must come from vLLM's host copies (no device sync), not the device tensor."""
    # a page plan (kv_append + attention), whose work items count whole cache pages
    monkeypatch.setenv("ION_FUSED_KV_WRITEBACK", "0")
    cfg = make_config("--max-num-seqs", "4")
    builder = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    bt = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    wrong_device_copy = torch.tensor([5], dtype=torch.int32)
    md = builder.build(0, common_metadata([1], [200], bt, seq_lens_device=wrong_device_copy))
    work = md.plan.work[: md.plan.num_items]
    assert md.plan.num_items == HKV
    assert set(work[:, 5].tolist()) == {4}  # ceil(200 / 64) pages, from the host copy


# ----------------------------------------------------------------------------- impl
def reference_kernels(calls):
    """cute_kernels API backed by the PyTorch reference (CPU), recording the calls."""
    from cute_kernels.reference import reference_kv_append, reference_paged_attention

    def kv_append(key, value, k_cache, v_cache, slot_mapping):
        calls.append(("kv_append", key.shape[0]))
        reference_kv_append(key, value, k_cache, v_cache, slot_mapping)

    def ion_attention(q, k_cache, v_cache, out, qsl, seq_lens, block_table, scale, plan=None,
                      key=None, value=None, experimental_pages=False):
        # the backend opts into the kernel API's experimental pages exactly when its plans
        # count pages other than 64 tokens
        assert experimental_pages == (getattr(plan, "page_size", 64) != 64)
        rows = int(qsl[-1])
        if key is not None:  # fused KV writeback: the launch itself writes the new K/V
            from cute_kernels.reference import new_token_slot_mapping

            assert plan.fresh_kv, "fused call with a page plan"
            calls.append(("ion_attention+kv", q.shape[0], plan))
            slots = new_token_slot_mapping(qsl, seq_lens, block_table, k_cache.shape[2],
                                           total_q=q.shape[0])
            reference_kv_append(key, value, k_cache, v_cache, slots)
        else:
            assert plan is None or not plan.fresh_kv, "plain call with a fused plan"
            calls.append(("ion_attention", q.shape[0], plan))
        ref = reference_paged_attention(q[:rows], k_cache, v_cache, qsl, seq_lens,
                                        block_table, scale)
        out[:rows] = ref.to(out.dtype)

    return types.SimpleNamespace(kv_append=kv_append, ion_attention=ion_attention)


def run_impl_case(make_config, monkeypatch, fault: bool, fused: bool | None = False,
                  page: int = P):
    """``fused``: ION_FUSED_KV_WRITEBACK=1 (True) or 0 (False), or unset (None: the
    default, fused)."""
    from cute_kernels.reference import make_paged_case, reference_paged_attention

    import ion_vllm.backend as backend_mod

    if fused is None:
        monkeypatch.delenv(backend_mod.FUSED_KV_ENV, raising=False)
        fused = True
    else:
        monkeypatch.setenv(backend_mod.FUSED_KV_ENV, "1" if fused else "0")
    if fault:
        monkeypatch.setenv(FAULT_INJECT_ENV, "swap_kv_page")
    else:
        monkeypatch.delenv(FAULT_INJECT_ENV, raising=False)
    calls = []
    monkeypatch.setattr(backend_mod, "_cute_kernels", lambda: reference_kernels(calls))

    q_lens, seq_lens, pad = [70, 1, 3], [150, 90, 3], 5
    case = make_paged_case(7, q_lens, seq_lens, HQ, HKV, D, page=page, pad_rows=pad)
    n = case.q.shape[0]
    kv_cache = torch.stack([case.k_cache, case.v_cache], dim=1).contiguous()
    truth = kv_cache.clone()
    # new tokens' K/V: from the truth cache; overwrite those slots with garbage so the
    # impl must write them itself
    cm = common_metadata(q_lens, seq_lens, case.block_table, pad_tokens=pad, page=page)
    slots = cm.slot_mapping
    key = torch.randn(n, HKV, D).to(torch.bfloat16)
    value = torch.randn(n, HKV, D).to(torch.bfloat16)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            truth[s // page, 0, :, s % page] = key[i]
            truth[s // page, 1, :, s % page] = value[i]
            kv_cache[s // page, :, :, s % page] = 1e4

    builder = IonAttentionMetadataBuilder(kv_spec(page), [], make_config(),
                                          torch.device("cpu"))
    md = builder.build(0, cm)
    impl = IonAttentionImpl(HQ, D, 0.125, HKV)
    # query as a strided view, like q out of a fused qkv projection
    qkv = torch.cat([case.q.reshape(n, -1), torch.zeros(n, 2 * HKV * D,
                                                        dtype=torch.bfloat16)], dim=1)
    query = qkv[:, : HQ * D].view(n, HQ, D)
    assert not query.is_contiguous()
    output = torch.full((n, HQ, D), 7.0, dtype=torch.bfloat16)
    impl.forward(None, query, key, value, kv_cache, md, output)

    if fused:
        assert md.plan.fresh_kv and [c[0] for c in calls] == ["ion_attention+kv"]
        assert calls[0][2] is md.plan
    else:
        assert not md.plan.fresh_kv
        assert [c[0] for c in calls] == ["kv_append", "ion_attention"]
        assert calls[1][2] is md.plan
    torch.testing.assert_close(kv_cache, truth, rtol=0, atol=0)  # cache writes correct
    rows = int(cm.query_start_loc_cpu[-1])
    assert torch.all(output[rows:] == 7.0)  # padding rows untouched
    ref = reference_paged_attention(case.q[:rows], truth[:, 0], truth[:, 1],
                                    cm.query_start_loc, cm.seq_lens, case.block_table, 0.125)
    return output[:rows].float(), ref, q_lens


def test_impl_writes_cache_then_attends(make_config, monkeypatch):
    out, ref, _ = run_impl_case(make_config, monkeypatch, fault=False)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_fused_kv_writeback_switch_uses_one_launch(make_config, monkeypatch):
    """ION_FUSED_KV_WRITEBACK=1: the builder plans KV units and forward makes one call that
    writes the cache and attends (no kv_append); the cache and output are the same as with
    ION_FUSED_KV_WRITEBACK=0 (kv_append, then the attention)."""
    out, ref, _ = run_impl_case(make_config, monkeypatch, fault=False, fused=True)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_fused_kv_writeback_env_checks(monkeypatch):
    import ion_vllm.backend as backend_mod

    monkeypatch.setenv(backend_mod.FUSED_KV_ENV, "maybe")
    with pytest.raises(ValueError, match="ION_FUSED_KV_WRITEBACK"):
        backend_mod.fused_kv_writeback()
    monkeypatch.setenv(backend_mod.FUSED_KV_ENV, "1")
    with pytest.raises(ValueError, match="shares the KV cache"):
        IonAttentionImpl(HQ, D, 0.125, HKV, kv_sharing_target_layer_name="layers.0.attn")
    monkeypatch.setenv(backend_mod.FUSED_KV_ENV, "0")
    assert not backend_mod.fused_kv_writeback()
    IonAttentionImpl(HQ, D, 0.125, HKV, kv_sharing_target_layer_name="layers.0.attn")
    # the default (unset) is on, and a KV-sharing layer is accepted: its builder falls
    # back to kv_append (test_fused_default_falls_back_where_it_cannot_run)
    monkeypatch.delenv(backend_mod.FUSED_KV_ENV)
    assert backend_mod.fused_kv_writeback() and not backend_mod.fused_kv_writeback_requested()
    IonAttentionImpl(HQ, D, 0.125, HKV, kv_sharing_target_layer_name="layers.0.attn")


def test_fused_kv_writeback_is_the_default(make_config, monkeypatch):
    """Unset, ION_FUSED_KV_WRITEBACK is on: the builder plans KV units, and forward makes one
    launch that writes the cache and attends (no kv_append), with the right cache and
    output."""
    import ion_vllm.backend as backend_mod

    monkeypatch.delenv(backend_mod.FUSED_KV_ENV, raising=False)
    assert IonAttentionMetadataBuilder(kv_spec(), [], make_config(),
                                       torch.device("cpu")).fresh_kv
    out, ref, _ = run_impl_case(make_config, monkeypatch, fault=False, fused=None)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_fused_default_falls_back_where_it_cannot_run(make_config, monkeypatch):
    """The default fused writeback turns itself off, with kv_append instead, for 128-token
    pages and for models with KV-sharing layers; an explicit ION_FUSED_KV_WRITEBACK=1 is
    refused there with the reason."""
    import types

    import ion_vllm.backend as backend_mod
    from ion_vllm import validation

    cfg = make_config()
    monkeypatch.delenv(backend_mod.FUSED_KV_ENV, raising=False)
    assert not backend_mod.model_shares_kv_cache(cfg)
    # a model whose second layer reads the first layer's cache
    shared = types.SimpleNamespace(kv_sharing_target_layer_name="model.layers.0.attn")
    with monkeypatch.context() as m:
        m.setattr("vllm.config.get_layers_from_vllm_config",
                  lambda config, layer_type, names=None: {"model.layers.1.attn": shared})
        assert backend_mod.model_shares_kv_cache(cfg)
        assert not IonAttentionMetadataBuilder(kv_spec(), [], cfg,
                                               torch.device("cpu")).fresh_kv
        m.setenv(backend_mod.FUSED_KV_ENV, "1")
        with pytest.raises(ValueError, match="KV-sharing layers"):
            IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    # 128-token pages
    monkeypatch.delenv(backend_mod.FUSED_KV_ENV, raising=False)
    monkeypatch.setenv(validation.EXPERIMENTAL_PAGE_ENV, "128")
    cfg = make_config()
    assert not IonAttentionMetadataBuilder(kv_spec(128), [], cfg, torch.device("cpu")).fresh_kv


def test_fused_kv_writeback_is_off_under_batch_invariance(make_config, monkeypatch):
    """Fused fresh tiles start at the chunk's first new token, so a row's KV tiling would
    depend on chunking: under VLLM_BATCH_INVARIANT=1 the builder keeps kv_append + pages."""
    import ion_vllm.backend as backend_mod

    monkeypatch.setenv(backend_mod.FUSED_KV_ENV, "1")
    cfg = make_config("--max-num-seqs", "4")
    assert IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu")).fresh_kv
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert not b.fresh_kv and not b.allow_split


def test_fused_kv_writeback_keeps_128_row_prefill_tiles(cpu_platform, tmp_path, monkeypatch):
    """ION_FUSED_KV_WRITEBACK=1 with the default tile policy: a prefill-only step is planned
    with 128-row tiles and KV units (fresh_kv), a decode step with 64-row tiles, both for
    the fused call."""
    import ion_vllm.backend as backend_mod

    monkeypatch.setenv(backend_mod.FUSED_KV_ENV, "1")
    monkeypatch.delenv(backend_mod.UNPACKED_PREFILL_ENV, raising=False)
    monkeypatch.delenv(backend_mod.PREFILL_TILE_M_ENV, raising=False)
    cfg = _gqa7_config(tmp_path, "--max-num-batched-tokens", "2048", "--max-num-seqs", "8")
    b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert b.fresh_kv and b.tile_m_auto and b.plan128 is not None
    bt = torch.arange(4 * 32, dtype=torch.int32).reshape(4, 32)
    md = b.build(0, common_metadata([2048], [2048], bt[:1]))
    assert md.plan is b.plan128 and md.plan.tile_m == 128 and md.plan.fresh_kv
    assert md.plan.host.fresh_kv and md.plan.num_items > 0
    md = b.build(0, common_metadata([1, 1], [700, 9], bt[:2]))
    assert md.plan is b.plan and md.plan.tile_m == 64 and md.plan.fresh_kv


def test_fault_injection_breaks_attention_of_request_0(make_config, monkeypatch):
    out, ref, q_lens = run_impl_case(make_config, monkeypatch, fault=True)
    err = (out - ref).abs().amax(dim=(1, 2))
    assert err[: q_lens[0]].max() > 0.1  # request 0 (2+ pages) is wrong
    assert err[q_lens[0]:].max() < 2e-2  # other requests are untouched


def test_fault_block_table_and_env_checks(monkeypatch):
    bt = torch.tensor([[5, 9, 2], [1, 3, 4]], dtype=torch.int32)
    broken = fault_block_table(bt)
    assert broken.tolist() == [[1, 9, 2], [1, 3, 4]]  # request 0 reads request 1's page
    assert bt.tolist() == [[5, 9, 2], [1, 3, 4]]  # vLLM's table is not modified
    assert fault_block_table(bt[:1]).tolist() == [[9, 5, 2]]
    monkeypatch.setenv(FAULT_INJECT_ENV, "nonsense")
    with pytest.raises(ValueError, match="swap_kv_page"):
        IonAttentionImpl(HQ, D, 0.125, HKV)
    monkeypatch.delenv(FAULT_INJECT_ENV)
    assert not IonAttentionImpl(HQ, D, 0.125, HKV).fault_swap_kv_page


def test_profiling_run_without_metadata_zeroes_output():
    impl = IonAttentionImpl(HQ, D, 0.125, HKV)
    out = torch.ones(3, HQ, D, dtype=torch.bfloat16)
    q = torch.ones(3, HQ, D, dtype=torch.bfloat16)
    kv = torch.ones(3, HKV, D, dtype=torch.bfloat16)
    impl.forward(None, q, kv, kv, torch.empty(0), None, out)
    assert not out.any()


def test_batch_invariant_mode_plans_without_split(make_config, monkeypatch):
    """VLLM_BATCH_INVARIANT=1: ION is selectable (vLLM asks supports_batch_invariance) and
    its builder never splits a row's KV range, so a row's reduction order is batch-free."""
    cfg = make_config("--max-num-seqs", "4")
    bt = torch.arange(4 * 160, dtype=torch.int32).reshape(4, 160)
    q_lens, seq_lens = [1, 1, 1, 1], [8192, 9000, 10000, 7000]
    split = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    md = split.build(0, common_metadata(q_lens, seq_lens, bt))
    assert md.plan.host.partial_rows > 0  # control: these long decodes do split by default

    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionType

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert IonAttentionBackend.supports_batch_invariance()
    assert IonAttentionBackend.validate_configuration(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=64,
        use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
        attn_type=AttentionType.DECODER, use_batch_invariant=True) == []
    inv = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert not inv.allow_split and IonAttentionMetadataBuilder.allow_split
    md = inv.build(0, common_metadata(q_lens, seq_lens, bt))
    assert md.plan.host.partial_rows == 0 and md.plan.num_groups == 0
    assert md.plan.num_items == len(q_lens) * HKV  # one item per (request, KV head)


def _gqa7_config(tmp_path, *extra):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    model = tmp_path / "gqa7"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(
        {**TINY_QWEN2, "num_attention_heads": 7 * HKV, "num_key_value_heads": HKV,
         "hidden_size": 7 * HKV * D}))
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(model), "--attention-backend", "ION",
                              "--skip-tokenizer-init", "--load-format", "dummy", *extra])
    return EngineArgs.from_cli_args(args).create_engine_config()


def test_unpacked_prefill_switch(cpu_platform, tmp_path, monkeypatch):
    """Unpacked prefill tiles are on by default (GQA 7): the builder plans long prefill rows
    one q head x 64 tokens (work col 8 >= 0) into a 9-column device work list; decode rows
    stay packed.  ION_UNPACKED_PREFILL=0 keeps the packed kernels' 8 columns."""
    import ion_vllm.backend as backend_mod

    cfg = _gqa7_config(tmp_path)
    bt = torch.arange(2 * 8, dtype=torch.int32).reshape(2, 8)
    q_lens, seq_lens = [1, 256], [300, 300]

    monkeypatch.setenv(backend_mod.UNPACKED_PREFILL_ENV, "0")
    plain = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert plain.group_size == 7 and plain.plan.work.shape[1] == 8
    assert not plain.tile_m_auto and plain.plan128 is None  # 128-row tiles need unpacked
    md = plain.build(0, common_metadata(q_lens, seq_lens, bt))
    assert not md.plan.unpacked

    monkeypatch.delenv(backend_mod.UNPACKED_PREFILL_ENV, raising=False)
    b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert b.unpacked and b.plan.work.shape[1] == 9
    md = b.build(0, common_metadata(q_lens, seq_lens, bt))
    w = md.plan.work[: md.plan.num_items].numpy()
    # decode streaming 0.14 of the prefill MMA time (<= M128_MAX_DECODE_FRACTION): 128 rows
    assert md.plan.unpacked and md.plan.tile_m == 128
    assert set(w[w[:, 0] == 0, 8].tolist()) == {-1}  # the decode row: packed
    assert set(w[w[:, 0] == 1, 8].tolist()) == set(range(7))  # 256-token prefill: unpacked
    monkeypatch.setenv(backend_mod.UNPACKED_PREFILL_ENV, "yes")
    with pytest.raises(ValueError, match="ION_UNPACKED_PREFILL"):
        backend_mod.unpacked_prefill()


def test_prefill_tile_m_per_step(cpu_platform, tmp_path, monkeypatch):
    """ION_PREFILL_TILE_M=auto (default): a prefill-only step is planned with 128-row tiles
    into the builder's second DevicePlan (one CTA per SM); a step with decode rows, and a
    uniform decode step, into the 64-row plan.  Each keeps its own persistent buffers."""
    import ion_vllm.backend as backend_mod
    from cute_kernels import planner

    monkeypatch.delenv(backend_mod.UNPACKED_PREFILL_ENV, raising=False)
    monkeypatch.delenv(backend_mod.PREFILL_TILE_M_ENV, raising=False)
    cfg = _gqa7_config(tmp_path, "--max-num-batched-tokens", "2048", "--max-num-seqs", "8")
    b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert b.tile_m_auto and b.plan128 is not None
    assert b.plan128.tile_m == 128 and b.plan128.num_ctas * 2 == b.plan.num_ctas
    bt = torch.arange(4 * 32, dtype=torch.int32).reshape(4, 32)
    ptr64, ptr128 = b.plan.work.data_ptr(), b.plan128.work.data_ptr()

    md = b.build(0, common_metadata([2048], [2048], bt[:1]))      # prefill only
    assert md.plan is b.plan128 and md.plan.work.data_ptr() == ptr128
    assert md.plan.host.tile_m == 128 and md.plan.host.num_ctas == b.num_ctas128
    assert md.plan.unpacked and (md.plan.host.work[:, 8] >= 0).any()
    coverage_from_work(md.plan.work[: md.plan.num_items], [2048], [2048],
                       group_size=7, tile_m=128)

    q_lens, seq_lens = [1, 1, 1, 512], [1900, 1900, 1900, 512]   # decode-heavy mix
    assert planner.choose_tile_m(np.cumsum([0] + q_lens), seq_lens, num_q_heads=28,
                                 num_kv_heads=HKV, head_dim=D) == 64
    md = b.build(0, common_metadata(q_lens, seq_lens, bt))
    assert md.plan is b.plan and md.plan.work.data_ptr() == ptr64 and md.plan.tile_m == 64
    md = b.build(0, common_metadata([1, 1], [700, 9], bt[:2]))    # uniform decode
    assert md.plan is b.plan

    monkeypatch.setenv(backend_mod.PREFILL_TILE_M_ENV, "64")
    fixed = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert not fixed.tile_m_auto and fixed.plan128 is None
    assert fixed.build(0, common_metadata([2048], [2048], bt[:1])).plan.tile_m == 64
    monkeypatch.setenv(backend_mod.PREFILL_TILE_M_ENV, "96")
    with pytest.raises(ValueError, match="ION_PREFILL_TILE_M"):
        backend_mod.prefill_tile_m_auto()


def test_prefill_tile_m_192_per_step(cpu_platform, tmp_path, monkeypatch):
    """ION_PREFILL_TILE_M=auto: a prefill step with enough 192-row tiles to balance
    (planner.M192_MIN_TILES_PER_CTA a CTA) is planned with 192-row tiles into a third
    DevicePlan (one CTA per SM); a 2048-token prefill, with too few, keeps 128-row tiles;
    ION_PREFILL_TILE_M=128 never plans 192, and page pairs (a 128-row option) turn 192 off."""
    import ion_vllm.backend as backend_mod
    from cute_kernels import planner

    monkeypatch.delenv(backend_mod.UNPACKED_PREFILL_ENV, raising=False)
    monkeypatch.delenv(backend_mod.PREFILL_TILE_M_ENV, raising=False)
    monkeypatch.delenv(backend_mod.KV_PAIR_ENV, raising=False)
    cfg = _gqa7_config(tmp_path, "--max-num-batched-tokens", "8192", "--max-num-seqs", "8")
    b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert b.tile_m_192 and b.plan192 is not None and b.consumer_kinds() == (1, 2, 3)
    assert b.plan192.tile_m == 192 and b.plan192.consumers == 3
    assert b.plan192.num_ctas == b.plan128.num_ctas
    bt = torch.arange(4 * 160, dtype=torch.int32).reshape(4, 160)
    md = b.build(0, common_metadata([8192], [8192], bt[:1]))
    assert md.plan is b.plan192 and md.plan.host.tile_m == 192
    assert md.plan.host.num_ctas == b.num_ctas128
    coverage_from_work(md.plan.work[: md.plan.num_items], [8192], [8192],
                       group_size=7, tile_m=192)
    tiles = -(-8192 // 192) * 28
    assert tiles >= planner.M192_MIN_TILES_PER_CTA * b.num_ctas128
    assert b.build(0, common_metadata([1024], [1024], bt[:1])).plan is b.plan128
    assert b.build(0, common_metadata([1, 1], [700, 9], bt[:2])).plan is b.plan
    # every step is counted by its tile size; ION_PLAN_STATS_EVERY=N logs the counts
    assert b.steps_by_tile_m == {64: 1, 128: 1, 192: 1} and b.plan_stats_every == 0
    monkeypatch.setenv(backend_mod.PLAN_STATS_ENV, "2")
    logged = []
    monkeypatch.setattr(backend_mod.logger, "info",
                        lambda msg, *a, **kw: logged.append(msg % a))
    s = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    for q_lens, seq_lens in (([8192], [8192]), ([1, 1], [700, 9]), ([1, 1], [701, 10])):
        s.build(0, common_metadata(q_lens, seq_lens, bt[: len(q_lens)]))
    stats = [m for m in logged if "steps by q-tile rows" in m]
    assert stats == ["ION: 2 steps by q-tile rows {64: 1, 192: 1}; plans made 2, reused 0, "
                     "repaged 0"]
    for bad in ("-1", "x"):
        monkeypatch.setenv(backend_mod.PLAN_STATS_ENV, bad)
        with pytest.raises(ValueError, match=backend_mod.PLAN_STATS_ENV):
            backend_mod.plan_stats_every()
    monkeypatch.delenv(backend_mod.PLAN_STATS_ENV)

    monkeypatch.setenv(backend_mod.PREFILL_TILE_M_ENV, "128")
    only128 = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert only128.tile_m_auto and not only128.tile_m_192 and only128.plan192 is None
    assert only128.build(0, common_metadata([8192], [8192], bt[:1])).plan.tile_m == 128
    monkeypatch.delenv(backend_mod.PREFILL_TILE_M_ENV)
    monkeypatch.setenv(backend_mod.KV_PAIR_ENV, "1")
    pairs = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert pairs.kv_pair and not pairs.tile_m_192 and pairs.plan192 is None


def test_prefill_tile_m_stays_64_when_mixed_batches_run_full_graphs(cpu_platform, tmp_path,
                                                                    monkeypatch):
    """In cudagraph_mode FULL vLLM captures mixed batches as FULL graphs: the kernel
    variant baked in at capture must not change per step, so only 64-row tiles are used."""
    import ion_vllm.backend as backend_mod

    monkeypatch.delenv(backend_mod.PREFILL_TILE_M_ENV, raising=False)
    monkeypatch.delenv(backend_mod.UNPACKED_PREFILL_ENV, raising=False)
    from vllm.config import CUDAGraphMode

    # the CPU platform turns CUDA graphs off while finalizing the config: set the mode the
    # GPU would keep afterwards
    cfg = _gqa7_config(tmp_path)
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    assert not backend_mod.mixed_batches_run_full_graphs(cfg)
    assert IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu")).tile_m_auto
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    assert backend_mod.mixed_batches_run_full_graphs(cfg)
    b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert b.unpacked and not b.tile_m_auto and b.plan128 is None


def test_row_combine_switch(cpu_platform, tmp_path, monkeypatch):
    """The row-parallel combine is the default (unset or ION_ROW_COMBINE=1) for both of the
    builder's device plans; ION_ROW_COMBINE=0 gives the group combine; any other value is
    refused."""
    import ion_vllm.backend as backend_mod

    cfg = _gqa7_config(tmp_path)
    bt = torch.arange(2 * 8, dtype=torch.int32).reshape(2, 8)
    for env in (None, "1"):
        if env is None:
            monkeypatch.delenv(backend_mod.ROW_COMBINE_ENV, raising=False)
        else:
            monkeypatch.setenv(backend_mod.ROW_COMBINE_ENV, env)
        b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
        assert b.row_combine and b.plan.row_combine
        assert b.plan128 is None or b.plan128.row_combine
        assert b.build(0, common_metadata([1, 256], [300, 300], bt)).plan.row_combine
    monkeypatch.setenv(backend_mod.ROW_COMBINE_ENV, "0")
    b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert not b.row_combine and not b.plan.row_combine
    assert b.plan128 is None or not b.plan128.row_combine
    assert not b.build(0, common_metadata([1, 256], [300, 300], bt)).plan.row_combine
    monkeypatch.setenv(backend_mod.ROW_COMBINE_ENV, "maybe")
    with pytest.raises(ValueError, match="ION_ROW_COMBINE"):
        backend_mod.row_combine()


@pytest.mark.parametrize("env, attr, default, bad", [
    ("LAZY_RESCALE_ENV", "lazy_rescale", False, "yes"),
    ("PDL_COMBINE_ENV", "pdl_combine", False, "2"),
    ("LANE_COMBINE_ENV", "lane_combine", True, "on"),
    ("PIN_PV_WAIT_ENV", "pin_pv_wait", False, "sure"),
])
def test_plan_switches(cpu_platform, tmp_path, monkeypatch, env, attr, default, bad):
    """ION_LAZY_RESCALE (lazy-rescaling kernels) and ION_PDL_COMBINE (combine by
    programmatic dependent launch) and ION_PIN_PV_WAIT (the PV wait pinned after the
    softmax) are off unless set to 1; ION_LANE_COMBINE (split-parallel combine) is on
    unless set to 0.  When on, every device plan of the builder carries the
    option; any value other than 0/1 is refused."""
    import ion_vllm.backend as backend_mod

    name = getattr(backend_mod, env)
    cfg = _gqa7_config(tmp_path)
    bt = torch.arange(2 * 8, dtype=torch.int32).reshape(2, 8)
    monkeypatch.delenv(backend_mod.ROW_COMBINE_ENV, raising=False)
    for value, on in ((None, default), ("0", False), ("1", True)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
        assert getattr(b, attr) is on and bool(getattr(b.plan, attr)) is on
        assert b.plan128 is None or bool(getattr(b.plan128, attr)) is on
        assert bool(getattr(b.build(0, common_metadata([1, 256], [300, 300], bt)).plan,
                            attr)) is on
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        getattr(backend_mod, attr)()


def test_kv_pair_switch(cpu_platform, tmp_path, monkeypatch):
    """ION_KV_PAIR=1 gives the builder's 128-row plans (prefill-dominated steps) the page-pair
    kernels, fused writeback included; its 64-row plans never; unset or 0, no plan has them.
    Where 128-row tiles do not run (ION_PREFILL_TILE_M=64) the switch is ignored."""
    import ion_vllm.backend as backend_mod

    cfg = _gqa7_config(tmp_path)
    bt = torch.arange(2 * 32, dtype=torch.int32).reshape(2, 32)
    for name in (backend_mod.PREFILL_TILE_M_ENV, backend_mod.UNPACKED_PREFILL_ENV,
                 backend_mod.FUSED_KV_ENV):
        monkeypatch.delenv(name, raising=False)
    for value, on in ((None, False), ("0", False), ("1", True)):
        if value is None:
            monkeypatch.delenv(backend_mod.KV_PAIR_ENV, raising=False)
        else:
            monkeypatch.setenv(backend_mod.KV_PAIR_ENV, value)
        b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
        assert b.tile_m_auto and b.kv_pair is on
        assert b.plan128.kv_pair is on and not b.plan.kv_pair
        md = b.build(0, common_metadata([2048], [2048], bt[:1]))
        assert md.plan is b.plan128 and md.plan.kv_pair is on
        assert not b.build(0, common_metadata([1, 1], [300, 9], bt)).plan.kv_pair
    monkeypatch.setenv(backend_mod.PREFILL_TILE_M_ENV, "64")
    b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert not b.kv_pair and b.plan128 is None
    monkeypatch.setenv(backend_mod.KV_PAIR_ENV, "two")
    with pytest.raises(ValueError, match="ION_KV_PAIR"):
        backend_mod.kv_pair()


def test_lane_combine_takes_precedence(cpu_platform, tmp_path, monkeypatch):
    """By default the plans launch the split-parallel combine, although the row combine is
    on by default too; ION_LANE_COMBINE=0 gives the row combine back."""
    import ion_vllm.backend as backend_mod
    from cute_kernels.attention import combine_kind

    cfg = _gqa7_config(tmp_path)
    monkeypatch.delenv(backend_mod.ROW_COMBINE_ENV, raising=False)
    monkeypatch.delenv(backend_mod.LANE_COMBINE_ENV, raising=False)
    b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert combine_kind(b.plan) == "lanes"
    monkeypatch.setenv(backend_mod.LANE_COMBINE_ENV, "0")
    b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert combine_kind(b.plan) is True


def test_experimental_128_token_pages_switch(make_config, monkeypatch):
    """ION_EXPERIMENTAL_PAGE=128: vLLM picks 128-token blocks through the backend's kernel
    block size, the cache shape and the builder's plans use 128-token pages on one CTA per
    SM, and the forward call opts into the kernel API's experimental pages.  Fused
    writeback with 128-token pages and bad values are refused; unset, nothing changes."""
    from vllm.platforms.interface import Platform
    from vllm.v1.worker.utils import select_common_block_size

    import ion_vllm.backend as backend_mod
    from ion_vllm import validation

    monkeypatch.setattr(Platform, "_find_non_ssm_backend",
                        classmethod(lambda cls, cfg: IonAttentionBackend))
    monkeypatch.delenv(validation.EXPERIMENTAL_PAGE_ENV, raising=False)
    assert IonAttentionBackend.get_supported_kernel_block_sizes() == [64]

    monkeypatch.setenv(validation.EXPERIMENTAL_PAGE_ENV, "128")
    assert IonAttentionBackend.get_supported_kernel_block_sizes() == [128]
    cfg = make_config()
    Platform.update_block_size_for_backend(cfg)
    assert cfg.cache_config.block_size == 128
    assert select_common_block_size(256, [IonAttentionBackend]) == 128
    assert IonAttentionBackend.supports_block_size(256)
    assert not IonAttentionBackend.supports_block_size(64)
    assert IonAttentionBackend.get_kv_cache_shape(10, 128, HKV, D) == (10, 2, HKV, 128, D)
    with pytest.raises(ValueError, match="hold 128 tokens"):
        IonAttentionBackend.get_kv_cache_shape(10, 64, HKV, D)

    b = IonAttentionMetadataBuilder(kv_spec(128), [], cfg, torch.device("cpu"))
    assert b.page_size == 128 and b.plan.page_size == 128
    assert b.num_ctas == 2 * backend_mod._HOPPER_SMS_DEFAULT  # two CTAs per SM, one KV stage
    with pytest.raises(ValueError, match="block size of 128"):
        IonAttentionMetadataBuilder(kv_spec(64), [], cfg, torch.device("cpu"))
    bt = torch.arange(2 * 80, dtype=torch.int32).reshape(2, 80)  # helper slots count 64-pages
    md = b.build(0, common_metadata([1, 300], [5000, 300], bt))
    assert md.plan.page_size == 128
    w = md.plan.host.work[: md.plan.num_items]
    assert w[w[:, 0] == 0][:, 5].max() == -(-5000 // 128)  # pages of 128 tokens

    monkeypatch.setenv(backend_mod.FUSED_KV_ENV, "1")
    with pytest.raises(ValueError, match="needs 64-token pages"):
        IonAttentionMetadataBuilder(kv_spec(128), [], cfg, torch.device("cpu"))
    monkeypatch.delenv(backend_mod.FUSED_KV_ENV)
    for bad in ("96", "256", "big"):
        monkeypatch.setenv(validation.EXPERIMENTAL_PAGE_ENV, bad)
        with pytest.raises(ValueError, match="ION_EXPERIMENTAL_PAGE"):
            validation.kernel_block_size()
    from ion_vllm.bench import e2e
    assert e2e.resolve_backend("ION+p128") == ("ION", {validation.EXPERIMENTAL_PAGE_ENV: "128"})

    # forward on a cache of 128-token pages (reference kernels stand in for the GPU ones)
    monkeypatch.setenv(validation.EXPERIMENTAL_PAGE_ENV, "128")
    out, ref, _ = run_impl_case(make_config, monkeypatch, fault=False, page=128)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_vec_straddle_switch_reaches_every_device_plan(make_config, monkeypatch):
    """ION_VEC_STRADDLE (fused writeback on): unset or 1 gives every DevicePlan of the
    builder the 16-byte copy (the default since the nineteenth session), 0 the element-wise
    one, ``auto`` the per-step choice; without fused writeback there is no straddle copy; a
    bad value is refused."""
    import ion_vllm.backend as backend_mod

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    cfg = make_config("--max-num-seqs", "8")
    spec128 = FullAttentionSpec(block_size=P, num_kv_heads=HKV, head_size=128,
                                dtype=torch.bfloat16)
    for env, want in ((None, True), ("auto", "auto"), ("1", True), ("0", False)):
        if env is None:
            monkeypatch.delenv(backend_mod.VEC_STRADDLE_ENV, raising=False)
        else:
            monkeypatch.setenv(backend_mod.VEC_STRADDLE_ENV, env)
        b = IonAttentionMetadataBuilder(spec128, [], cfg, torch.device("cpu"))
        plans = [p for p in (b.plan, b.plan128, b.plan192) if p is not None]
        assert b.fresh_kv and b.vec_straddle == want and len(plans) >= 2
        assert all(p.vec_straddle_mode == want and p.vec_straddle is (want is True)
                   for p in plans), env
        # head size 64 runs the element-wise copy whatever the switch says (64 is not in
        # attention.VEC_STRADDLE_HEAD_DIMS)
        assert IonAttentionMetadataBuilder(kv_spec(), [], cfg,
                                           torch.device("cpu")).vec_straddle is False
    monkeypatch.setenv(backend_mod.FUSED_KV_ENV, "0")
    assert not IonAttentionMetadataBuilder(kv_spec(), [], cfg,
                                           torch.device("cpu")).vec_straddle
    monkeypatch.setenv(backend_mod.VEC_STRADDLE_ENV, "yes")
    with pytest.raises(ValueError, match=backend_mod.VEC_STRADDLE_ENV):
        backend_mod.vec_straddle()



def test_skip_idle_switch_reaches_the_large_tile_plans(make_config, monkeypatch):
    """ION_SKIP_IDLE=1: the 128- and 192-row DevicePlans run the kernels whose idle
    warpgroups skip their MMAs; the 64-row plan (one warpgroup, never idle) does not."""
    import ion_vllm.backend as backend_mod

    cfg = make_config("--max-num-seqs", "8")
    monkeypatch.delenv(backend_mod.SKIP_IDLE_ENV, raising=False)
    b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert not b.skip_idle and not b.plan128.skip_idle
    monkeypatch.setenv(backend_mod.SKIP_IDLE_ENV, "1")
    b = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    large = [p for p in (b.plan128, b.plan192) if p is not None]
    assert b.skip_idle and large and all(p.skip_idle for p in large)
    assert not b.plan.skip_idle
    monkeypatch.setenv(backend_mod.SKIP_IDLE_ENV, "2")
    with pytest.raises(ValueError, match=backend_mod.SKIP_IDLE_ENV):
        backend_mod.skip_idle()


def build_checked(builder, bt, q_lens, seq_lens):
    """One step through ``builder.build``: the device work list must equal the host plan's
    and cover the batch exactly (``coverage_from_work``); returns the metadata."""
    md = builder.build(0, common_metadata(q_lens, seq_lens, bt[: len(q_lens)]))
    work = md.plan.work[: md.plan.num_items]
    np.testing.assert_array_equal(work.numpy(), md.plan.host.work[:, : md.plan.work_cols])
    coverage_from_work(work, q_lens, seq_lens)
    return md


def test_builder_reuses_the_plan_of_an_equal_key(make_config, monkeypatch):
    """Decode steps whose rows stay inside their pages reuse the last plan and skip the
    upload; a row crossing a page, another batch in between, or ION_PLAN_REUSE=0 plan again,
    and the device buffers always hold the plan of the step."""
    cfg = make_config("--max-num-seqs", "8")
    builder = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert builder.reuse_plans
    bt = torch.arange(4 * 8, dtype=torch.int32).reshape(4, 8)
    q = [1, 1, 1, 1]

    def step(seq_lens, q_lens=q):
        return build_checked(builder, bt, q_lens, seq_lens)

    # md.plan is the builder's one DevicePlan: keep each step's host plan object
    h1 = step([100, 200, 300, 70]).plan.host
    assert (builder.plans_made, builder.plans_reused) == (1, 0)
    h2 = step([101, 201, 301, 71]).plan.host  # every row inside its page: same key
    assert (builder.plans_made, builder.plans_reused) == (1, 1)
    assert h2 is h1
    # row 3: 129 cached tokens (3 cache pages, the last holding one) + the new one: the
    # fused plan's tile reads one KV unit more
    h3 = step([102, 202, 302, 130]).plan.host
    assert (builder.plans_made, builder.plans_reused) == (2, 1)
    units3 = lambda h: int(h.work[h.work[:, 0] == 3][:, 5].max())  # noqa: E731
    assert h3 is not h1 and units3(h3) == units3(h1) + 1 == 4
    # another batch in between: the builder keeps the last plan of a tile size only, so
    # the earlier key is planned again (an equal plan, a new object)
    step([50, 60], q_lens=[1, 1])
    h5 = step([103, 203, 303, 131]).plan.host
    assert builder.plans_made == 4 and h5 is not h3
    np.testing.assert_array_equal(h5.work, h3.work)
    # a reused plan whose buffers were overwritten meanwhile is uploaded again
    other = builder.run_planner(np.array([0, 1, 2], np.int32), np.array([50, 60], np.int32))
    builder.upload_plan(other)
    assert builder.plan.host is other
    h6 = step([104, 204, 304, 132]).plan.host  # step() checks the buffers hold h6
    assert h6 is h5 and builder.plans_reused == 2 and builder.plan.host is h5
    monkeypatch.setenv("ION_PLAN_REUSE", "0")
    b2 = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert not b2.reuse_plans
    for sl in ([100, 200, 300, 70], [101, 201, 301, 71]):
        b2.build(0, common_metadata(q, sl, bt))
    assert (b2.plans_made, b2.plans_reused) == (2, 0)


def test_builder_repages_decode_plans_within_the_drift(make_config, monkeypatch):
    """ION_PLAN_REPAGE=1: decode-only steps of the base plan's requests, each within
    REPAGE_MAX_DRIFT pages of it, run the base plan recut for their lengths; beyond that, or
    with another batch, the planner runs.  The device buffers hold each step's plan."""
    from ion_vllm.backend import REPAGE_MAX_DRIFT

    monkeypatch.setenv("ION_PLAN_REPAGE", "1")
    cfg = make_config("--max-num-seqs", "8")
    builder = IonAttentionMetadataBuilder(kv_spec(), [], cfg, torch.device("cpu"))
    assert builder.repage_plans
    bt = torch.arange(4 * 16, dtype=torch.int32).reshape(4, 16)
    q = [1, 1, 1, 1]

    def step(seq_lens, q_lens=q):
        return build_checked(builder, bt, q_lens, seq_lens).plan.host

    base = step([100, 200, 300, 70])
    assert (builder.plans_made, builder.plans_repaged) == (1, 0)
    r1 = step([100 + 64, 200 + 64, 300 + 64, 70 + 64])  # one page more each: recut
    assert (builder.plans_made, builder.plans_repaged) == (1, 1)
    np.testing.assert_array_equal(r1.cta_offsets, base.cta_offsets)
    assert step([100 + 65, 200 + 65, 300 + 65, 70 + 65]) is r1  # same key: reused
    grow = 64 * (REPAGE_MAX_DRIFT + 1)
    step([100 + grow, 200, 300, 70])  # row 0 drifted too far: planned
    assert builder.plans_made == 2
    step([50, 60], q_lens=[1, 1])  # other requests: planned (a new base)
    step([100, 200, 300, 70], q_lens=[1, 1, 0, 1])  # another new-token vector: planned
    assert (builder.plans_made, builder.plans_repaged) == (4, 1)
    monkeypatch.setenv("ION_PLAN_REUSE", "0")
    assert not IonAttentionMetadataBuilder(kv_spec(), [], cfg,
                                           torch.device("cpu")).repage_plans
