"""Tests of cute_kernels.append_sm90.

CPU: sm_90a compile + PTX checks (16-byte vector global loads/stores), host
validation, compile cache.  GPU (``@pytest.mark.gpu``): bitwise comparison with
``cute_kernels.reference.reference_kv_append``, CUDA-graph capture.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("cutlass")

from cute_kernels import append_sm90 as kv_mod  # noqa: E402
from compile_utils import compile_sm90a  # noqa: E402
from cute_kernels.append_sm90 import (  # noqa: E402
    KVAppendKernel,
    kv_append,
    kv_append_fake_args,
)


# ---------------------------------------------------------------- CPU: PTX
@pytest.mark.parametrize(
    "dtype,head_dim,hkv,page,idx_dtype",
    [
        (torch.bfloat16, 128, 8, 64, torch.int64),  # Llama-style GQA, 1 vector/thread
        (torch.float16, 64, 2, 16, torch.int32),
        (torch.bfloat16, 128, 32, 64, torch.int32),  # 512 vectors -> 2 per thread
        (torch.float16, 64, 40, 64, torch.int64),  # 320 vectors, 256 threads -> guarded tail
        (torch.bfloat16, 256, 8, 64, torch.int32),  # Gemma 2 9B: 256 vectors, 1 a thread
    ],
)
def test_kv_append_compiles_sm90a_with_16B_vectors(dtype, head_dim, hkv, page, idx_dtype):
    kernel = KVAppendKernel(hkv, head_dim, page)
    art = compile_sm90a(
        kernel,
        *kv_append_fake_args(dtype, head_dim, hkv, page, idx_dtype),
        compile_options="--enable-tvm-ffi",
    )
    assert "\n.target sm_90a" in art.ptx
    assert len(art.kernel_names()) == 1
    stores = re.findall(r"\bst\.global[\w.]*", art.ptx)
    loads = re.findall(r"\bld\.global[\w.]*", art.ptx)
    # every global store is a 16-byte vector store: K and V, `iters` each
    assert stores and all(s.startswith("st.global.v4") for s in stores), stores
    assert len(stores) == 2 * kernel.iters
    vec_loads = [x for x in loads if x.startswith("ld.global.v4")]
    assert len(vec_loads) == 2 * kernel.iters
    # the only other global load is the slot index (one per CTA)
    expected_slot_load = {torch.int32: "ld.global.s32", torch.int64: "ld.global.b64"}[idx_dtype]
    others = [x for x in loads if not x.startswith("ld.global.v4")]
    assert len(others) == 1, loads
    assert others[0] == expected_slot_load or others[0].startswith("ld.global.b32"), others
    # negative / out-of-range slots are skipped (signed compare on the slot)
    assert re.search(r"setp\.\w+\.s64", art.ptx)
    ntid = re.search(r"\.reqntid\s+(\d+)", art.ptx)
    assert ntid and int(ntid.group(1)) == kernel.threads


def test_kernel_thread_mapping():
    k = KVAppendKernel(8, 128, 64)
    assert (k.vecs_per_token, k.threads, k.iters, k.needs_guard) == (128, 128, 1, False)
    k = KVAppendKernel(40, 64, 64)
    assert (k.vecs_per_token, k.threads, k.iters, k.needs_guard) == (320, 256, 2, True)


# ---------------------------------------------------------- CPU: validation
def _cpu_args(t=4, hkv=2, d=64, page=16, nb=3, dtype=torch.float16, idx=torch.int64):
    cache = torch.zeros(nb, 2, hkv, page, d, dtype=dtype)
    key = torch.zeros(t, hkv, d, dtype=dtype)
    value = torch.zeros(t, hkv, d, dtype=dtype)
    return key, value, cache[:, 0], cache[:, 1], torch.arange(t, dtype=idx)


def test_validation_rejects_bad_inputs():
    key, value, kc, vc, slots = _cpu_args()
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        kv_append(key.float(), value.float(), kc.float(), vc.float(), slots)
    with pytest.raises(TypeError, match="value dtype"):
        kv_append(key, value.bfloat16(), kc, vc, slots)
    with pytest.raises(TypeError, match="int32 or int64"):
        kv_append(key, value, kc, vc, slots.to(torch.int16))
    with pytest.raises(ValueError, match=r"head_dim D=96"):
        k2, v2, kc2, vc2, s2 = _cpu_args(d=96)
        kv_append(k2, v2, kc2, vc2, s2)
    with pytest.raises(ValueError, match="do not match the cache"):
        kv_append(key[:, :1], value[:, :1], kc, vc, slots)
    with pytest.raises(ValueError, match=r"\[T, Hkv, D\]"):
        kv_append(key[0], value[0], kc, vc, slots)
    with pytest.raises(ValueError, match=r"\[num_blocks, Hkv, P, D\]"):
        kv_append(key, value, kc[0], vc[0], slots)
    with pytest.raises(ValueError, match="slot_mapping has 5 entries"):
        kv_append(key, value, kc, vc, torch.arange(5))
    with pytest.raises(ValueError, match="CUDA"):
        kv_append(key, value, kc, vc, slots)


def test_safe_strides_fixes_size1_dims_only():
    cache = torch.zeros(3, 2, 4, 16, 64, dtype=torch.float16)
    k = cache[:1, 0, :, 3, :]  # [1, 4, 64] with token stride 2*4*16*64, head stride 16*64
    assert kv_mod._safe_strides(k) is k
    base = torch.randn(4 * 64 + 8).to(torch.float16)
    odd = base.as_strided((1, 4, 64), (3, 64, 1))  # size-1 token dim, meaningless odd stride
    fixed = kv_mod._safe_strides(odd)
    assert fixed.stride() == (8, 64, 1)
    assert fixed.data_ptr() == odd.data_ptr()
    assert torch.equal(fixed, odd)


def test_compiled_kernel_is_cached_per_config():
    a = kv_mod.compiled_kv_append(torch.float16, 64, 2, 16, torch.int32)
    b = kv_mod.compiled_kv_append(torch.float16, 64, 2, 16, torch.int32)
    c = kv_mod.compiled_kv_append(torch.float16, 64, 2, 16, torch.int64)
    assert a is b
    assert c is not a


# -------------------------------------------------------------------- GPU
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _make_case(dtype, idx_dtype, head_dim, hkv=4, hq=16, page=64, nb=37, t=150, pad=13,
               seed=0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    # vLLM-style fused qkv projection output, padded to t + pad tokens
    qkv = torch.randn(t + pad, (hq + 2 * hkv) * head_dim, generator=g).to(device, dtype)
    key = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(t + pad, hkv, head_dim)
    value = qkv[:, (hq + hkv) * head_dim:].view(t + pad, hkv, head_dim)
    if t + pad > 1:  # a single-token view counts as contiguous in torch (size-1 dims)
        assert not key.is_contiguous() and not value.is_contiguous()
    cache = torch.full((nb, 2, hkv, page, head_dim), float("nan"), dtype=dtype, device=device)
    slots = torch.randperm(nb * page, generator=g)[:t]
    slots[torch.rand(t, generator=g) < 0.15] = -1  # padding tokens
    slots[0] = nb * page - 1  # last slot of the last page
    if t > 1:
        slots[1] = -1
    return key, value, cache, slots.to(device=device, dtype=idx_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_kv_append_matches_reference(dtype, idx_dtype, head_dim):
    from cute_kernels.reference import reference_kv_append

    key, value, cache, slots = _make_case(dtype, idx_dtype, head_dim)
    ref = cache.clone()
    reference_kv_append(key, value, ref[:, 0], ref[:, 1], slots)
    kv_append(key, value, cache[:, 0], cache[:, 1], slots)
    torch.cuda.synchronize()
    assert torch.equal(_bits(cache), _bits(ref))
    # sanity: something was written and the poison survived elsewhere
    written = (slots >= 0).sum().item()
    assert written > 0
    assert (~torch.isnan(cache[:, 0])).sum().item() == written * key.shape[1] * head_dim


@pytest.mark.gpu
def test_kv_append_single_token_and_empty():
    from cute_kernels.reference import reference_kv_append

    key, value, cache, slots = _make_case(torch.bfloat16, torch.int64, 128, t=1, pad=0)
    slots[0] = 5
    ref = cache.clone()
    reference_kv_append(key, value, ref[:, 0], ref[:, 1], slots)
    kv_append(key, value, cache[:, 0], cache[:, 1], slots)
    kv_append(key, value, cache[:, 0], cache[:, 1], slots[:0])  # no-op
    torch.cuda.synchronize()
    assert torch.equal(_bits(cache), _bits(ref))


@pytest.mark.gpu
def test_kv_append_no_recompile_and_cuda_graph():
    from cute_kernels.reference import reference_kv_append

    key, value, cache, slots = _make_case(torch.bfloat16, torch.int32, 128, t=64, pad=0)
    kv_append(key, value, cache[:, 0], cache[:, 1], slots)  # warm-up / compile
    n_compiled = len(kv_mod._CACHE)

    t, hkv, d = key.shape
    static_kv = torch.empty(t, 2 * hkv * d, dtype=key.dtype, device=key.device)
    s_key = static_kv[:, : hkv * d].view(t, hkv, d)  # non-contiguous static inputs
    s_val = static_kv[:, hkv * d:].view(t, hkv, d)
    s_slots = torch.empty_like(slots)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            kv_append(s_key, s_val, cache[:, 0], cache[:, 1], s_slots)
    torch.cuda.current_stream().wait_stream(stream)
    assert len(kv_mod._CACHE) == n_compiled

    for seed in (1, 2):
        k2, v2, _, sl2 = _make_case(torch.bfloat16, torch.int32, 128, t=64, pad=0, seed=seed)
        cache.fill_(float("nan"))
        ref = cache.clone()
        reference_kv_append(k2, v2, ref[:, 0], ref[:, 1], sl2)
        s_key.copy_(k2)
        s_val.copy_(v2)
        s_slots.copy_(sl2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bits(cache), _bits(ref))
    assert len(kv_mod._CACHE) == n_compiled
