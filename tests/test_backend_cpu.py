"""CPU tests of the ION backend glue (``ion_vllm/backend.py``): the backend class as vLLM
queries it (KV layout as vLLM allocates it, block size through vLLM's own logic, supported
sizes, configuration reasons), ``StepPolicy`` (fixed at start-up from the engine config),
the metadata builder (one ``DevicePlan`` per q-tile size sized at the planner's worst case,
the step's tile size, plan reuse, the metadata it builds) and the impl (its refusals, and
forward against the PyTorch reference with the kernels replaced by reference ones).

vLLM configs come from its own CLI parser on a forced CPU platform (``cpu_platform*`` in
conftest.py) and tiny Qwen2 ``config.json`` files written under pytest's tmp dirs."""

from __future__ import annotations

import json
import math
import os
import types

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cute_kernels import planner  # noqa: E402
from cute_kernels import worklist as W  # noqa: E402
from cute_kernels.cost_model import choose_tile_m  # noqa: E402
from cute_kernels.device_plan import grid_ctas  # noqa: E402
from cute_kernels.options import KernelOptions  # noqa: E402
from ion_vllm import backend as backend_mod  # noqa: E402
from ion_vllm.backend import (  # noqa: E402
    IonAttentionBackend,
    IonAttentionImpl,
    IonAttentionMetadataBuilder,
    StepPolicy,
)
from ion_vllm import validation  # noqa: E402
from ion_vllm.validation import IonUnsupportedError  # noqa: E402
from plan_checks import check_plan, qsl_of, seeded  # noqa: E402, F401  (seeded: a fixture)

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "tie_word_embeddings": False,
}
HQ, HKV, D, P = 4, 2, 64, 64
#: heads of the GQA-7 model (a padded group: unpacked prefill tiles apply)
HQ7 = 7 * HKV
DEFAULT = StepPolicy(fresh_kv=True, unpacked=True, tile_ms=(64, 128, 192), allow_split=True)
INVARIANT = StepPolicy(fresh_kv=False, unpacked=False, tile_ms=(64,), allow_split=False)
CPU = torch.device("cpu")


# ------------------------------------------------------------------------- machinery
@pytest.fixture(scope="module")
def make_config(cpu_platform_module, tmp_path_factory):
    """``make_config(*cli_args, gqa7=False, fresh=False)``: a VllmConfig from vLLM's CLI
    parser for the tiny model (4 q / 2 KV heads, d 64) or its GQA-7 twin (14 / 2); configs
    are shared within the module unless ``fresh`` (for a test that mutates one)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = tmp_path_factory.mktemp("models")
    models = {}
    for name, cfg in (("tiny", TINY_QWEN2),
                      ("gqa7", {**TINY_QWEN2, "num_attention_heads": HQ7,
                                "hidden_size": HQ7 * D})):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        models[name] = str(root / name)
    cache = {}

    def make(*extra, gqa7=False, fresh=False):
        key = (gqa7, extra)
        if fresh or key not in cache:
            parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
            args = parser.parse_args(["--model", models["gqa7" if gqa7 else "tiny"],
                                      "--attention-backend", "ION", "--skip-tokenizer-init",
                                      "--load-format", "dummy", *extra])
            cfg = EngineArgs.from_cli_args(args).create_engine_config()
            if fresh:
                return cfg
            cache[key] = cfg
        return cache[key]

    return make


def kv_spec(block_size=P, head_size=D):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=HKV, head_size=head_size,
                             dtype=torch.bfloat16)


def builder_for(cfg, spec=None):
    return IonAttentionMetadataBuilder(spec or kv_spec(), [], cfg, CPU)


def common_metadata(q_lens, seq_lens, block_table, pad_tokens=0, seq_lens_device=None,
                    host_seq_lens="both"):
    """vLLM's per-step metadata; ``host_seq_lens``: which host copies of seq_lens vLLM
    provides ("both", "exact" (``_seq_lens_cpu`` only) or "none")."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from cute_kernels.reference import new_token_slot_mapping

    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    n = int(qsl[-1]) + pad_tokens
    slots = new_token_slot_mapping(qsl, sl, block_table, P, total_q=n)
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl,
        seq_lens=sl.clone() if seq_lens_device is None else seq_lens_device,
        num_reqs=len(q_lens), num_actual_tokens=n, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_table_tensor=block_table, slot_mapping=slots,
        seq_lens_cpu_upper_bound=sl if host_seq_lens == "both" else None,
        _seq_lens_cpu=sl if host_seq_lens != "none" else None)


def build_checked(b, q_lens, seq_lens, bt=None, **kw):
    """One step through ``b.build``: the device buffers hold the host plan, which is an
    exact plan of the batch for the builder's options (``plan_checks.check_plan``)."""
    if bt is None:
        bt = torch.arange(len(q_lens) * 160, dtype=torch.int32).reshape(len(q_lens), 160)
    md = b.build(0, common_metadata(q_lens, seq_lens, bt, **kw))
    dp, host = md.plan, md.plan.host
    assert dp is b.plans[host.tile_m] and dp.num_items == host.n_items
    np.testing.assert_array_equal(dp.work[: dp.num_items].numpy(), host.work)
    np.testing.assert_array_equal(dp.cta_offsets.numpy(), host.cta_offsets)
    assert not dp.work[dp.num_items:].any() and not dp.combine[dp.num_groups:].any()
    p = b.policy
    check_plan(host, qsl_of(q_lens), seq_lens, num_kv_heads=b.num_kv_heads,
               group_size=b.group_size, num_ctas=b.num_ctas[host.tile_m],
               tile_m=host.tile_m, fresh_kv=p.fresh_kv, unpacked=p.unpacked,
               max_splits=b.max_splits if p.allow_split else 1,
               max_partial_rows=b.partial_rows)
    return md


def shares_kv_cache(monkeypatch, cfg):
    """Register attention layers in ``cfg``'s forward context as vLLM's model does, layer
    1 reading layer 0's KV cache (``backend.model_shares_kv_cache`` finds them through
    vLLM's own ``get_layers_from_vllm_config``)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class Layer(AttentionLayerBase):
        def __init__(self, target=None):
            self.kv_sharing_target_layer_name = target

        def get_attn_backend(self):
            return IonAttentionBackend

        def get_kv_cache_spec(self, vllm_config):
            return kv_spec()

    ctx = cfg.compilation_config.static_forward_context
    monkeypatch.setitem(ctx, "model.layers.0.attn", Layer())
    assert not backend_mod.model_shares_kv_cache(cfg)
    monkeypatch.setitem(ctx, "model.layers.1.attn", Layer("model.layers.0.attn"))


# --------------------------------------------------------------------------- backend
def test_backend_identity_and_flags():
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from ion_vllm.registration import BACKEND_NAME

    assert IonAttentionBackend.get_name() == BACKEND_NAME == "ION"
    # vLLM's Attention layer does AttentionBackendEnum[backend.get_name()]
    assert AttentionBackendEnum[IonAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM
    assert IonAttentionBackend.forward_includes_kv_cache_update is True
    assert IonAttentionBackend.accept_output_buffer is True
    assert IonAttentionBackend.get_impl_cls() is IonAttentionImpl
    assert IonAttentionBackend.get_builder_cls() is IonAttentionMetadataBuilder
    assert IonAttentionMetadataBuilder._cudagraph_support is AttentionCGSupport.ALWAYS
    assert IonAttentionMetadataBuilder.reorder_batch_threshold is None
    assert IonAttentionBackend.supports_sink() is True  # gpt-oss
    assert IonAttentionBackend.supports_sliding_window() is True
    for flag in ("is_mla", "is_sparse",
                 "supports_non_causal", "supports_mm_prefix"):
        assert getattr(IonAttentionBackend, flag)() is False, flag
    assert IonAttentionBackend.supports_batch_invariance() is True


def test_fused_output_quantization_is_never_offered():
    """vLLM's attention + quant fusion pass asks the layer's impl first; ION says no to
    every quant key, so the pass leaves the quantization unfused and ``forward`` never
    gets an output scale (its NotImplementedError stays unreachable)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8StaticTensorSym, kNvfp4Dynamic)

    impl = IonAttentionImpl(num_heads=8, head_size=128, scale=0.1, num_kv_heads=2)
    for key in (kFp8StaticTensorSym, kNvfp4Dynamic):
        assert impl.fused_output_quant_supported(key) is False


def test_supported_sizes_and_types():
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionType

    B = IonAttentionBackend
    assert B.get_supported_kernel_block_sizes() == [64]
    assert B.get_supported_head_sizes() == [64, 128, 256]
    assert [B.supports_head_size(d) for d in (64, 128, 256, 96, 512)] == [True, True, True, False, False]
    assert set(B.supported_dtypes) == {torch.float16, torch.bfloat16}
    assert [B.supports_dtype(t) for t in (torch.bfloat16, torch.float16, torch.float32)] == [
        True, True, False]
    assert B.supported_kv_cache_dtypes == ["auto", "bfloat16", "float16"]
    assert [B.supports_kv_cache_dtype(k) for k in ("auto", None, "bfloat16", "fp8")] == [
        True, True, True, False]
    assert [B.supports_block_size(s) for s in (None, 64, 128, 256, 16, 32, 96, 0)] == [
        True, True, True, True, False, False, False, False]
    assert B.supports_compute_capability(DeviceCapability(9, 0))
    assert not B.supports_compute_capability(DeviceCapability(10, 0))
    assert not B.supports_compute_capability(DeviceCapability(8, 0))
    assert B.supports_attn_type(AttentionType.DECODER)
    assert not B.supports_attn_type(AttentionType.ENCODER_ONLY)


def test_validate_configuration_reasons():
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionType

    good = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=64,
                use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
                use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
                attn_type=AttentionType.DECODER)
    V = IonAttentionBackend.validate_configuration
    assert V(**good) == [] and V(**good, use_batch_invariant=True, use_kv_connector=True) == []
    reasons = V(**{**good, "head_size": 80, "block_size": 16, "use_mla": True},
                has_sliding_window=True, use_pcp=True)
    assert len(reasons) == 4 and all(r.startswith("ION:") for r in reasons)
    for what in ("head size 80", "--block-size 16", "MLA", "context parallel"):
        assert any(what in r for r in reasons), what


def test_kv_cache_layout_as_vllm_allocates_it():
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    nb = 10
    shape = IonAttentionBackend.get_kv_cache_shape(nb, P, HKV, D)
    assert shape == (nb, 2, HKV, P, D)
    assert IonAttentionBackend.get_kv_cache_block_dim(P, HKV, D) == 0
    order = IonAttentionBackend.get_kv_cache_stride_order()
    assert order == (0, 1, 2, 3, 4)
    assert IonAttentionBackend.get_kv_cache_stride_order(include_num_layers_dimension=True) == (
        0, 1, 2, 3, 4, 5)
    assert not IonAttentionBackend.indexes_kv_by_block_stride()
    for bad in (16, 128):
        with pytest.raises(ValueError, match="64 tokens"):
            IonAttentionBackend.get_kv_cache_shape(nb, bad, HKV, D)
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
    cfg = make_config(fresh=True)
    assert not cfg.cache_config.user_specified_block_size
    Platform.update_block_size_for_backend(cfg)
    assert cfg.cache_config.block_size == 64
    cfg = make_config("--block-size", "128", fresh=True)
    Platform.update_block_size_for_backend(cfg)
    assert cfg.cache_config.block_size == 128
    # vLLM splits a 128-token KV block into 64-token kernel pages for ION
    assert select_common_block_size(128, [IonAttentionBackend]) == 64
    assert select_common_block_size(64, [IonAttentionBackend]) == 64


# ------------------------------------------------------------------------ StepPolicy
def test_step_policy_default(make_config):
    cfg = make_config()
    assert not backend_mod.batch_invariant_mode()
    assert not backend_mod.model_shares_kv_cache(cfg)
    assert not backend_mod.mixed_batches_run_full_graphs(cfg)
    assert StepPolicy.for_engine(cfg) == DEFAULT
    with pytest.raises(AttributeError):
        DEFAULT.fresh_kv = False  # fixed at start-up


def test_step_policy_under_batch_invariance(make_config, monkeypatch):
    """Split-KV, unpacked tiling and 128/192-row tiles would make a row's reduction order
    depend on the batch, fresh tiles on the chunking: kv_append, packed 64-row tiles, no
    split."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert backend_mod.batch_invariant_mode()
    assert StepPolicy.for_engine(make_config()) == INVARIANT
    shares_kv_cache(monkeypatch, make_config())
    assert StepPolicy.for_engine(make_config()) == INVARIANT


def test_step_policy_for_a_model_with_kv_sharing_layers(make_config, monkeypatch):
    """A layer that reads another layer's cache gets no key/value: kv_append instead of
    eager writeback, the rest as by default."""
    cfg = make_config()
    shares_kv_cache(monkeypatch, cfg)
    assert backend_mod.model_shares_kv_cache(cfg)
    assert StepPolicy.for_engine(cfg) == StepPolicy(
        fresh_kv=False, unpacked=True, tile_ms=(64, 128, 192), allow_split=True)
    assert not builder_for(cfg).policy.fresh_kv


def test_step_policy_under_full_cuda_graphs_for_mixed_batches(make_config):
    """In cudagraph_mode FULL vLLM captures mixed batches in FULL graphs: the kernel baked
    in at capture must not change per step, so only 64-row tiles run."""
    from vllm.config import CUDAGraphMode

    # the CPU platform turns CUDA graphs off while finalizing the config: set the mode the
    # GPU would keep
    cfg = make_config(fresh=True)
    for mode, wide in ((CUDAGraphMode.FULL_AND_PIECEWISE, True), (CUDAGraphMode.PIECEWISE, True),
                       (CUDAGraphMode.FULL_DECODE_ONLY, True), (CUDAGraphMode.NONE, True),
                       (CUDAGraphMode.FULL, False)):
        cfg.compilation_config.cudagraph_mode = mode
        assert backend_mod.mixed_batches_run_full_graphs(cfg) is not wide, mode
        want = DEFAULT if wide else StepPolicy(True, True, (64,), True)
        assert StepPolicy.for_engine(cfg) == want, mode
    b = builder_for(cfg)
    assert set(b.plans) == {64}
    assert build_checked(b, [2048], [2048]).plan.tile_m == 64
    # a config whose mode cannot be read is treated as the strict case
    assert backend_mod.mixed_batches_run_full_graphs(types.SimpleNamespace())


# ------------------------------------------------------------------- builder sizing
def test_builder_at_head_size_256_runs_64_and_128_row_tiles(make_config):
    """A head-size-256 layer group (Gemma 2 / 3): no 192-row kernels, one CTA an SM, and a
    prefill-heavy step gets 128 rows."""
    b = builder_for(make_config(), kv_spec(head_size=256))
    assert b.policy.tile_ms == (64, 128) and set(b.plans) == {64, 128}
    assert b.num_ctas == {64: grid_ctas(CPU, 64, 256), 128: grid_ctas(CPU, 128, 256)}
    assert grid_ctas(CPU, 64, 256) == grid_ctas(CPU, 64) // 2
    assert all(dp.partial_o.shape[1] == 256 for dp in b.plans.values())
    assert b.step_tile_m(np.array([0, 8192]), np.array([8192])) == 128
    assert {o.tile_m for o in b.kernel_options(torch.bfloat16)} == {64, 128}


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
def test_builder_sizes_one_device_plan_per_tile_size(make_config, monkeypatch, invariant):
    if invariant:
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    cfg = make_config("--max-num-seqs", "8", "--max-num-batched-tokens", "512", gqa7=True)
    b = builder_for(cfg)
    p = b.policy
    assert p == (INVARIANT if invariant else DEFAULT)
    assert (b.num_q_heads, b.num_kv_heads, b.group_size, b.head_size) == (HQ7, HKV, 7, D)
    assert (b.max_num_reqs, b.max_num_tokens) == (8, 512)
    assert b.max_seq_len_bound == cfg.model_config.max_model_len  # no speculative tokens
    assert set(b.plans) == set(p.tile_ms) and b.num_ctas == {
        tm: grid_ctas(CPU, tm) for tm in p.tile_ms}
    # the split-KV workspace: 256 rows a CTA of the 64-row grid, for every tile size
    assert b.partial_rows == (256 * grid_ctas(CPU, 64) if p.allow_split else 0)
    shape = (8, 512, b.max_seq_len_bound, HKV, 7)
    for tm, dp in b.plans.items():
        assert dp.tile_m == tm and dp.num_ctas == b.num_ctas[tm] and dp.device == CPU
        assert dp.item_capacity == planner.worst_case_items(
            *shape, tile_m=tm, max_splits=16 if p.allow_split else 1, fresh_kv=p.fresh_kv,
            unpacked_prefill=p.unpacked)
        assert dp.group_capacity == (planner.worst_case_groups(*shape) if p.allow_split else 1)
        assert dp.partial_rows_capacity == b.partial_rows
        assert dp.always_combine is p.allow_split  # a captured launch serves any later batch
        assert dp.partial_o.shape == (max(1, b.partial_rows), D)
    assert b.kernel_options(torch.bfloat16) == tuple(
        KernelOptions("bfloat16", D, 8, tm, p.fresh_kv) for tm in p.tile_ms)
    assert b.plans_made == b.plans_reused == 0 and not b.use_cascade_attention()


def test_tensor_parallel_builder_sizes_plans_for_its_rank_s_heads(make_config):
    """--tensor-parallel-size 2 through vLLM's parser: each rank's builder sees its own
    share of the heads (vLLM's per-rank KV spec and head count: GQA-7's 14 q / 2 KV heads
    become 7 / 1), and its plan buffers and kernels are those of that share, not of the
    whole model; the KV tier's config passes through to every rank."""
    tp = make_config("--tensor-parallel-size", "2", "--max-num-seqs", "8",
                     "--max-num-batched-tokens", "512", gqa7=True)
    assert (tp.parallel_config.tensor_parallel_size, tp.parallel_config.world_size) == (2, 2)
    hq, hkv = (tp.model_config.get_num_attention_heads(tp.parallel_config),
               tp.model_config.get_num_kv_heads(tp.parallel_config))
    assert (hq, hkv) == (HQ7 // 2, HKV // 2)
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    rank_spec = FullAttentionSpec(block_size=P, num_kv_heads=hkv, head_size=D,
                                  dtype=torch.bfloat16)
    b = builder_for(tp, rank_spec)
    assert (b.num_q_heads, b.num_kv_heads, b.group_size) == (7, 1, 7)
    one = builder_for(make_config("--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                                  gqa7=True))
    assert b.kernel_options(torch.bfloat16) == one.kernel_options(torch.bfloat16)
    for tm, dp in b.plans.items():  # work items scale with the rank's KV heads
        assert dp.item_capacity == planner.worst_case_items(
            8, 512, b.max_seq_len_bound, 1, 7, tile_m=tm, max_splits=16,
            fresh_kv=True, unpacked_prefill=True)
        assert dp.item_capacity < one.plans[tm].item_capacity
    # a rank refuses what it cannot run by its own ratio, and says it is per GPU
    reasons = validation.layer_config_reasons(num_heads=2 * 17, num_kv_heads=2, head_size=D)
    assert len(reasons) == 1 and "GQA ratio 17" in reasons[0] and "per GPU" in reasons[0]
    assert "--tensor-parallel-size does not help" in reasons[0]


def test_builder_refuses_other_block_sizes_and_compiles_nothing_on_cpu(make_config,
                                                                       monkeypatch):
    import cute_kernels.attention as attention

    def no_compile(*a, **k):
        raise AssertionError("precompile on a CPU builder")

    monkeypatch.setattr(attention, "precompile", no_compile)
    builder_for(make_config())  # fine: kernels are compiled only for a CUDA device
    with pytest.raises(ValueError, match="block size of 64"):
        builder_for(make_config(), kv_spec(block_size=128))


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
def test_step_tile_m_is_the_cost_models_choice(make_config, monkeypatch, seeded, invariant):
    if invariant:
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    b = builder_for(make_config("--max-num-batched-tokens", "8192", gqa7=True))
    kw = dict(num_q_heads=HQ7, num_kv_heads=HKV, head_dim=D, num_ctas=grid_ctas(CPU, 128))
    fixed = {(8192,): 192, (1024,): 128, (1, 1): 64}
    for q_lens, want in fixed.items():
        sl = [max(q, 700) for q in q_lens]
        assert b.step_tile_m(qsl_of(q_lens), np.array(sl)) == (64 if invariant else want)
    rng = seeded.rng()
    for _ in range(30):
        n = int(rng.integers(1, 8))
        q = rng.choice([1, 1, 3, 64, 300, 2048], size=n)
        sl = q + rng.integers(0, 20000, size=n)
        with seeded.case(q=q.tolist(), sl=sl.tolist()):
            want = 64 if invariant else choose_tile_m(qsl_of(q), sl, **kw)
            assert b.step_tile_m(qsl_of(q), sl) == want


# ---------------------------------------------------------------------------- build
def test_build_plans_into_persistent_buffers(make_config):
    cfg = make_config("--max-num-seqs", "8", "--max-num-batched-tokens", "512")
    b = builder_for(cfg)
    assert b.group_size == 2 and b.policy == DEFAULT
    ptrs = {tm: [t.data_ptr() for t in (dp.work, dp.cta_offsets, dp.partial_offsets,
                                        dp.combine, dp.partial_o, dp.partial_lse)]
            for tm, dp in b.plans.items()}
    # a mixed batch: prompt, chunk continuation, decodes, a padded empty request
    q_lens, seq_lens = [100, 40, 1, 1, 0], [100, 300, 129, 64, 0]
    bt = torch.arange(5 * 8, dtype=torch.int32).reshape(5, 8)
    cm = common_metadata(q_lens, seq_lens, bt, pad_tokens=6)
    md = build_checked(b, q_lens, seq_lens, bt, pad_tokens=6)
    assert (md.num_actual_tokens, md.num_reqs, md.max_query_len, md.max_seq_len) == (
        148, 5, 100, 300)
    assert md.slot_mapping.shape == (148,) and (md.slot_mapping[142:] == -1).all()
    assert md.block_table is bt and md.causal is True
    torch.testing.assert_close(md.query_start_loc, cm.query_start_loc)
    torch.testing.assert_close(md.seq_lens, cm.seq_lens)
    assert md.plan.fresh_kv is True and md.plan.host.fresh_kv
    first, first_items = md.plan, md.plan.num_items
    # next step, a smaller batch: same buffers, stale rows cleared (build_checked)
    md2 = build_checked(b, [1, 1], [101, 301], bt[:2])
    assert md2.plan is first and md2.plan.num_items < first_items
    for tm, dp in b.plans.items():
        assert [t.data_ptr() for t in (dp.work, dp.cta_offsets, dp.partial_offsets, dp.combine,
                                       dp.partial_o, dp.partial_lse)] == ptrs[tm]


@pytest.mark.parametrize("host", ["both", "exact", "none"])
def test_build_plans_from_host_seq_lens(make_config, host):
    """The plan comes from vLLM's host copy of seq_lens (no device sync): the upper bound
    when given, else the exact copy; only without either from the device tensor."""
    b = builder_for(make_config("--max-num-seqs", "4"))
    bt = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    device_copy = torch.tensor([5 if host != "none" else 200], dtype=torch.int32)
    md = b.build(0, common_metadata([1], [200], bt, seq_lens_device=device_copy,
                                    host_seq_lens=host))
    work = md.plan.host.work
    # a fused plan's decode tile reads ceil(199 / 64) cache pages + its fresh tile
    assert int(work[:, W.P1].max()) == -(-199 // 64) + 1
    check_plan(md.plan.host, qsl_of([1]), [200], num_kv_heads=HKV, group_size=2,
               num_ctas=b.num_ctas[64], fresh_kv=True, unpacked=True,
               max_partial_rows=b.partial_rows)


def test_build_with_unpacked_prefill_and_wide_tiles(make_config):
    """GQA 7: a long prefill row is tiled one q head x tile_m tokens (col QHEAD >= 0) and
    the decode row stays packed, in the DevicePlan of the step's tile size."""
    b = builder_for(make_config("--max-num-batched-tokens", "8192", "--max-num-seqs", "8",
                                gqa7=True))
    for q_lens, seq_lens, tile_m in (([1, 256], [300, 300], None), ([8192], [8192], 192),
                                     ([1024], [1024], 128), ([1, 1], [700, 9], 64)):
        md = build_checked(b, q_lens, seq_lens)
        want = tile_m or b.step_tile_m(qsl_of(q_lens), np.array(seq_lens))
        assert md.plan.tile_m == want and md.plan is b.plans[want]
        w = md.plan.host.work
        for r, ql in enumerate(q_lens):
            heads = set(w[w[:, W.REQ] == r, W.QHEAD].tolist())
            assert heads == ({-1} if ql < want else set(range(7))), (q_lens, r, heads)


def test_batch_invariant_builds_never_split(make_config, monkeypatch):
    """VLLM_BATCH_INVARIANT=1: long decodes that split by default get one item per
    (request, KV head), a prefill step keeps packed 64-row tiles; kv_append plans (pages)."""
    cfg = make_config("--max-num-seqs", "4", "--max-num-batched-tokens", "2048")
    q_lens, seq_lens = [1, 1, 1, 1], [8192, 9000, 10000, 7000]
    assert build_checked(builder_for(cfg), q_lens, seq_lens).plan.host.partial_rows > 0
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    b = builder_for(cfg)
    md = build_checked(b, q_lens, seq_lens)
    assert md.plan.host.partial_rows == 0 and md.plan.num_groups == 0
    assert md.plan.num_items == len(q_lens) * HKV and not md.plan.fresh_kv
    md = build_checked(b, [2048], [2048])
    assert md.plan.tile_m == 64 and (md.plan.host.work[:, W.QHEAD] == -1).all()


# ----------------------------------------------------------------------- plan reuse
def test_builder_reuses_the_plan_of_an_equal_key(make_config):
    """Decode steps whose rows stay inside their pages reuse the last plan and skip the
    upload; a row crossing a page or another batch in between plans again; a reused plan
    whose buffers were overwritten meanwhile is uploaded again.  The device buffers always
    hold the step's plan."""
    b = builder_for(make_config("--max-num-seqs", "8"))
    dp = b.plans[64]
    uploads = []
    real_upload = dp.upload
    dp.upload = lambda hp: uploads.append(hp) or real_upload(hp)
    q = [1, 1, 1, 1]

    def step(seq_lens, q_lens=q):
        return build_checked(b, q_lens, seq_lens).plan.host

    h1 = step([100, 200, 300, 70])
    assert (b.plans_made, b.plans_reused, len(uploads)) == (1, 0, 1)
    h2 = step([101, 201, 301, 71])  # every row inside its page: same key
    assert h2 is h1 and (b.plans_made, b.plans_reused, len(uploads)) == (1, 1, 1)
    # row 3: 129 cached tokens (3 pages, the last holding one) + the new one: the fused
    # plan's tile reads one KV unit more
    h3 = step([102, 202, 302, 130])
    assert h3 is not h1 and (b.plans_made, b.plans_reused, len(uploads)) == (2, 1, 2)
    def units(h):  # KV units row 3's tile reads
        return int(h.work[h.work[:, W.REQ] == 3][:, W.P1].max())

    assert units(h3) == units(h1) + 1 == 4
    # another batch in between: only the last plan of a tile size is kept, so the earlier
    # key is planned again (an equal plan, a new object)
    step([50, 60], q_lens=[1, 1])
    h5 = step([103, 203, 303, 131])
    assert b.plans_made == 4 and h5 is not h3 and len(uploads) == 4
    np.testing.assert_array_equal(h5.work, h3.work)
    # the buffers overwritten meanwhile: the reused plan is uploaded again
    other = b.run_planner(np.array([0, 1, 2], np.int32), np.array([50, 60], np.int32))
    b.upload_plan(other)
    assert dp.host is other and len(uploads) == 5
    h6 = step([104, 204, 304, 132])
    assert h6 is h5 and b.plans_reused == 2 and dp.host is h5 and len(uploads) == 6


def test_plan_reuse_is_per_tile_size(make_config):
    """A 192-row prefill step in between does not evict the 64-row decode plan: each tile
    size keeps its last plan and its own buffers."""
    b = builder_for(make_config("--max-num-batched-tokens", "8192", gqa7=True))
    h1 = build_checked(b, [1, 1], [700, 900]).plan.host
    assert build_checked(b, [8192], [8192]).plan.tile_m == 192
    h3 = build_checked(b, [1, 1], [701, 901]).plan.host
    assert h3 is h1 and (b.plans_made, b.plans_reused) == (2, 1)
    assert b.plans[64].host is h1


# ------------------------------------------------------------------------------ impl
BAD_LAYERS = [
    (dict(sliding_window=-1), "sliding window"),
    (dict(logits_soft_cap=float("nan")), "soft cap"),
    (dict(alibi_slopes=[0.1] * 8), "ALiBi"),
    (dict(num_heads=256, num_kv_heads=8), "GQA ratio 32"),
    (dict(num_heads=136, num_kv_heads=8), "GQA ratio 17"),
    (dict(num_heads=12, num_kv_heads=8), "not a multiple"),
    (dict(head_size=96), "head size 96"),
    (dict(kv_cache_dtype="fp8"), "'fp8'"),
    (dict(attn_type="encoder"), "'encoder'"),
]


@pytest.mark.parametrize("override,what", BAD_LAYERS, ids=[w for _, w in BAD_LAYERS])
def test_impl_refuses_layers_it_cannot_run(override, what):
    kw = {**dict(num_heads=8, head_size=128, scale=0.1, num_kv_heads=8), **override}
    with pytest.raises(IonUnsupportedError, match=what) as err:
        IonAttentionImpl(**kw)
    assert len(err.value.reasons) == 1 and "ION" in str(err.value)


def test_impl_accepts_what_it_can_run():
    impl = IonAttentionImpl(num_heads=28, head_size=128, scale=0.088, num_kv_heads=4)
    assert impl.num_queries_per_kv == 7 and impl.scale == pytest.approx(0.088)
    assert IonAttentionImpl(8, 64, 0.1).num_kv_heads == 8  # num_kv_heads defaults to Hq
    IonAttentionImpl(8, 64, 0.1, 8, logits_soft_cap=0.0)
    assert IonAttentionImpl(8, 64, 0.1, 8, logits_soft_cap=50.0).softcap == 50.0
    shared = IonAttentionImpl(HQ, D, 0.125, HKV, kv_sharing_target_layer_name="layers.0.attn")
    assert shared.kv_sharing_target_layer_name == "layers.0.attn"


def reference_kernels(calls):
    """The kernel API ``forward`` uses, backed by the PyTorch reference, recording calls."""
    from cute_kernels.reference import (
        new_token_slot_mapping,
        reference_kv_append,
        reference_paged_attention,
    )

    def kv_append(key, value, k_cache, v_cache, slot_mapping):
        calls.append(("kv_append", key.shape[0], None))
        reference_kv_append(key, value, k_cache, v_cache, slot_mapping)

    def ion_attention(q, k_cache, v_cache, out, qsl, seq_lens, block_table, scale, plan=None,
                      key=None, value=None, softcap=0.0, sinks_log2=None, window=0):
        rows = int(qsl[-1])
        if key is not None:  # eager writeback: the launch itself writes the new K/V
            assert plan.fresh_kv, "fused call with a page plan"
            calls.append(("ion_attention+kv", q.shape[0], plan))
            slots = new_token_slot_mapping(qsl, seq_lens, block_table, k_cache.shape[2],
                                           total_q=q.shape[0])
            reference_kv_append(key, value, k_cache, v_cache, slots)
        else:
            assert not plan.fresh_kv, "plain call with a fused plan"
            calls.append(("ion_attention", q.shape[0], plan))
        sinks = None if sinks_log2 is None else sinks_log2 / math.log2(math.e)
        assert plan.window == window, "the builder planned for another window"
        ref = reference_paged_attention(q[:rows], k_cache, v_cache, qsl, seq_lens,
                                        block_table, scale, softcap=softcap, sinks=sinks,
                                        window=window or None)
        out[:rows] = ref.to(out.dtype)

    from cute_kernels.attention import sink_log2

    return types.SimpleNamespace(kv_append=kv_append, ion_attention=ion_attention,
                                 sink_log2=sink_log2)


@pytest.mark.parametrize("policy", ["default", "batch-invariant", "kv-sharing", "window",
                                    "sinks"])
def test_forward_writes_the_cache_and_attends(make_config, monkeypatch, policy):
    """forward over a padded mixed batch: the default makes one launch that writes the new
    K/V and attends; batch invariance runs kv_append, then the attention; a KV-sharing
    layer (its target wrote the cache) only attends.  The cache and the output equal the
    reference's, padding rows stay untouched."""
    from cute_kernels.reference import make_paged_case, reference_paged_attention

    if policy == "batch-invariant":
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    if policy == "kv-sharing":
        shares_kv_cache(monkeypatch, make_config())
    calls = []
    monkeypatch.setattr(backend_mod, "_kernels", lambda: reference_kernels(calls))
    q_lens, seq_lens, pad = [70, 1, 3], [150, 90, 3], 5
    case = make_paged_case(7, q_lens, seq_lens, HQ, HKV, D, page=P, pad_rows=pad)
    n = case.q.shape[0]
    kv_cache = torch.stack([case.k_cache, case.v_cache], dim=1).contiguous()
    truth = kv_cache.clone()
    cm = common_metadata(q_lens, seq_lens, case.block_table, pad_tokens=pad)
    key = torch.randn(n, HKV, D).to(torch.bfloat16)
    value = torch.randn(n, HKV, D).to(torch.bfloat16)
    for i, s in enumerate(cm.slot_mapping.tolist()):
        if s >= 0:  # the truth holds the new K/V; the cache garbage where they go
            truth[s // P, 0, :, s % P] = key[i]
            truth[s // P, 1, :, s % P] = value[i]
            if policy != "kv-sharing":
                kv_cache[s // P, :, :, s % P] = 1e4
    if policy == "kv-sharing":
        kv_cache = truth.clone()  # the target layer wrote the new K/V already
    window = 40 if policy == "window" else None  # a local layer: its own KV group
    spec = None
    if window:
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        spec = SlidingWindowSpec(block_size=P, num_kv_heads=HKV, head_size=D,
                                 dtype=torch.bfloat16, sliding_window=window)
    md = builder_for(make_config(), spec).build(0, cm)
    assert md.plan.window == (window or 0)
    target = "model.layers.0.attn" if policy == "kv-sharing" else None
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]) if policy == "sinks" else None
    impl = IonAttentionImpl(HQ, D, 0.125, HKV, kv_sharing_target_layer_name=target,
                            sliding_window=window, sinks=sinks)
    # query as a strided view, like q out of a fused qkv projection
    qkv = torch.cat([case.q.reshape(n, -1), torch.zeros(n, 2 * HKV * D, dtype=torch.bfloat16)],
                    dim=1)
    query = qkv[:, : HQ * D].view(n, HQ, D)
    assert not query.is_contiguous()
    output = torch.full((n, HQ, D), 7.0, dtype=torch.bfloat16)
    assert impl.forward(None, query, key, value, kv_cache, md, output) is output

    want = {"batch-invariant": ["kv_append", "ion_attention"],
            "kv-sharing": ["ion_attention"]}.get(policy, ["ion_attention+kv"])
    assert [c[0] for c in calls] == want
    # every launch gets the step's num_actual_tokens rows (padding slots are -1)
    assert calls[-1][2] is md.plan and all(c[1] == n == md.num_actual_tokens for c in calls)
    torch.testing.assert_close(kv_cache, truth, rtol=0, atol=0)  # cache writes correct
    rows = int(cm.query_start_loc_cpu[-1])
    assert torch.all(output[rows:] == 7.0)  # padding rows untouched
    ref = reference_paged_attention(case.q[:rows], truth[:, 0], truth[:, 1],
                                    cm.query_start_loc, cm.seq_lens, case.block_table, 0.125,
                                    window=window, sinks=sinks)
    torch.testing.assert_close(output[:rows].float(), ref, rtol=2e-2, atol=2e-2)
    if window or sinks is not None:  # the feature changed the answer
        plain = reference_paged_attention(case.q[:rows], truth[:, 0], truth[:, 1],
                                          cm.query_start_loc, cm.seq_lens, case.block_table,
                                          0.125)
        assert (ref - plain).abs().max() > 0.05


def test_forward_without_metadata_and_refused_output_quantization():
    impl = IonAttentionImpl(HQ, D, 0.125, HKV)
    out = torch.ones(3, HQ, D, dtype=torch.bfloat16)
    q = torch.ones(3, HQ, D, dtype=torch.bfloat16)
    kv = torch.ones(3, HKV, D, dtype=torch.bfloat16)
    impl.forward(None, q, kv, kv, torch.empty(0), None, out)  # profiling run: zeros
    assert not out.any()
    with pytest.raises(NotImplementedError, match="quantization"):
        impl.forward(None, q, kv, kv, torch.empty(0), None, out, output_scale=torch.ones(1))
