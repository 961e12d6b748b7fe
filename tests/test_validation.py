"""ION refuses every unsupported configuration, with an actionable reason (CPU only)."""

from __future__ import annotations

import pytest
import torch

from ion_vllm import validation
from ion_vllm.validation import IonUnsupportedError, backend_config_reasons, check_layer

GOOD = dict(
    head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
    use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
    use_per_head_quant_scales=False, device_capability=(9, 0), attn_type="decoder",
)

BAD_BACKEND = [
    # (override, substring of the reason, what the reason tells the user to do)
    (dict(device_capability=(8, 0)), "sm_80", "FLASH_ATTN"),
    (dict(device_capability=(10, 0)), "sm_100", "FLASH_ATTN"),
    (dict(device_capability=(8, 9)), "sm_89", "FLASH_ATTN"),
    (dict(head_size=96), "head size 96", "FLASH_ATTN"),
    (dict(head_size=512), "head size 512", "FLASH_ATTN"),
    (dict(dtype=torch.float32), "float32", "--dtype bfloat16"),
    (dict(kv_cache_dtype="fp8"), "'fp8'", "--kv-cache-dtype auto"),
    (dict(kv_cache_dtype="fp8_e4m3"), "'fp8_e4m3'", "--kv-cache-dtype auto"),
    (dict(kv_cache_dtype="float16"), "differs from the model dtype bfloat16",
     "--kv-cache-dtype auto"),
    (dict(dtype=torch.float16, kv_cache_dtype="bfloat16"), "KV cache dtype bfloat16",
     "--kv-cache-dtype float16"),
    (dict(block_size=16), "--block-size 16", "--block-size 64"),
    (dict(block_size=32), "--block-size 32", "--block-size 64"),
    (dict(block_size=96), "--block-size 96", "--block-size 64"),
    (dict(use_mla=True), "MLA", "FLASH_ATTN"),
    (dict(use_sparse=True), "sparse", "FLASH_ATTN"),
    (dict(attn_type="encoder_only"), "encoder_only", "FLASH_ATTN"),
    (dict(attn_type="encoder"), "'encoder'", "FLASH_ATTN"),
    (dict(attn_type="encoder_decoder"), "encoder_decoder", "FLASH_ATTN"),
    (dict(use_non_causal=True), "non-causal", "FLASH_ATTN"),
    (dict(use_mm_prefix=True), "multimodal", "FLASH_ATTN"),
    (dict(use_per_head_quant_scales=True), "per-head", "--kv-cache-dtype auto"),
    (dict(use_pcp=True), "prefill context parallel", "--prefill-context-parallel-size 1"),
]


def test_good_backend_config_has_no_reasons():
    assert backend_config_reasons(**GOOD) == []
    for ok in (dict(head_size=64), dict(dtype=torch.float16), dict(dtype="bfloat16"),
               dict(kv_cache_dtype="bfloat16"), dict(kv_cache_dtype=None),
               dict(dtype=torch.float16, kv_cache_dtype="float16"),
               dict(block_size=64), dict(block_size=128), dict(use_kv_connector=True),
               dict(has_sink=True), dict(has_sliding_window=True),
               dict(use_batch_invariant=True)):
        assert backend_config_reasons(**{**GOOD, **ok}) == [], ok


@pytest.mark.parametrize("override,what,todo", BAD_BACKEND,
                         ids=[",".join(f"{k}={v}" for k, v in b[0].items())
                              for b in BAD_BACKEND])
def test_bad_backend_config_is_refused_with_reason(override, what, todo):
    reasons = backend_config_reasons(**{**GOOD, **override})
    assert len(reasons) == 1, reasons
    assert what in reasons[0] and todo in reasons[0], reasons[0]
    assert reasons[0].startswith("ION:")


def test_backend_validate_configuration_matches_vllm_selector_signature():
    """Call it exactly the way vLLM 0.26's CUDA platform does."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from ion_vllm.backend import IonAttentionBackend

    good = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16,
                                   kv_cache_dtype="auto", block_size=None)
    assert IonAttentionBackend.validate_configuration(
        device_capability=DeviceCapability(9, 0), **good._asdict()) == []
    reasons = IonAttentionBackend.validate_configuration(
        device_capability=DeviceCapability(8, 6),
        **good._replace(head_size=80, kv_cache_dtype="fp8", block_size=16,
                        has_sliding_window=True)._asdict())
    joined = "\n".join(reasons)
    for what in ("sm_86", "head size 80", "'fp8'", "--block-size 16"):
        assert what in joined
    assert len(reasons) == 4  # sliding windows are supported


GOOD_LAYER = dict(num_heads=28, num_kv_heads=4, head_size=128)

BAD_LAYER = [
    (dict(num_heads=68, num_kv_heads=4), "GQA ratio 17"),
    (dict(num_heads=128, num_kv_heads=4), "GQA ratio 32"),
    (dict(num_heads=30, num_kv_heads=4), "not a multiple"),
    (dict(head_size=80), "head size 80"),
    (dict(alibi_slopes=[0.5] * 28), "ALiBi"),
    (dict(sliding_window=0), "sliding window (0)"),
    (dict(logits_soft_cap=-1.0), "soft cap"),
    (dict(kv_cache_dtype="fp8_e5m2"), "fp8_e5m2"),
    (dict(attn_type="encoder_decoder"), "encoder_decoder"),
]


def test_good_layers_pass():
    for ok in (GOOD_LAYER, dict(num_heads=32, num_kv_heads=32, head_size=64),
               dict(num_heads=32, num_kv_heads=4, head_size=128),
               dict(num_heads=7, num_kv_heads=1, head_size=64),
               dict(GOOD_LAYER, logits_soft_cap=0.0), dict(GOOD_LAYER, has_sinks=True),
               dict(GOOD_LAYER, sliding_window=4096), dict(GOOD_LAYER, sliding_window=128),
               dict(GOOD_LAYER, logits_soft_cap=50.0),  # Gemma 2
               dict(num_heads=16, num_kv_heads=8, head_size=256, logits_soft_cap=50.0,
                    sliding_window=4096),  # Gemma 2 9B's local layers
               dict(num_heads=8, num_kv_heads=4, head_size=256, sliding_window=1024)):
        assert validation.layer_config_reasons(**ok) == [], ok
        check_layer(**ok)


@pytest.mark.parametrize("override,what", BAD_LAYER, ids=[b[1] for b in BAD_LAYER])
def test_bad_layer_is_refused(override, what):
    with pytest.raises(IonUnsupportedError) as err:
        check_layer(**{**GOOD_LAYER, **override})
    assert len(err.value.reasons) == 1
    assert what in str(err.value)


def test_rules_follow_the_kernel_options():
    """The backend's rules are the kernels' compile options, defined once."""
    from cute_kernels import options

    assert validation.SUPPORTED_HEAD_SIZES == options.SUPPORTED_HEAD_DIMS == (64, 128, 256)
    assert validation.SUPPORTED_DTYPES == options.SUPPORTED_DTYPES == ("bfloat16", "float16")
    assert validation.KERNEL_BLOCK_SIZE == options.PAGE_SIZE == 64
    assert validation.MAX_GQA_RATIO == options.MAX_GROUP == 16
    for g in range(1, 17):  # every ratio the rules accept has a kernel group pad
        assert validation.gqa_reason(4 * g, 4) is None
        options.group_pad_for(g)


def test_capability_forms_and_block_sizes():
    from vllm.platforms.interface import DeviceCapability

    for ok in ((9, 0), 90, DeviceCapability(9, 0)):
        assert validation.compute_capability_reason(ok) is None, ok
    assert "sm_80" in validation.compute_capability_reason(80)
    assert "no GPU capability" in validation.compute_capability_reason(None)
    assert validation.dtype_name("torch.float16") == validation.dtype_name(torch.float16)
    for bad in (0, -64, 32, 100):
        assert "--block-size 64" in validation.block_size_reason(bad), bad
    assert validation.block_size_reason(None) is None and validation.block_size_reason(192) is None
