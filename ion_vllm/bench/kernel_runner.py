"""GPU side of the kernel A/B benchmark: data setup per backend, timing, ceilings.

Every backend sees the same logical K/V/q values (generated from per-rotation
seeds) scattered into its own paged layout:

* ``ion``    : ``cute_kernels.ion_attention``, cache ``[num_blocks, 2, Hkv, P, D]``
               (HND pages, P = 64), plan from ``cute_kernels.planner.plan`` built once,
               outside the timed region.
* ``fa3``    : ``vllm.vllm_flash_attn.flash_attn_varlen_func(fa_version=3)``, cache
               ``[2, num_blocks, P, Hkv, D]`` (NHD), FA3 scheduler metadata built once
               outside the timed region (vLLM's builder does the same: ``aot_schedule``).
* ``fa4``    : the same call with ``fa_version=4`` (FA4 CuTeDSL, sm90 path).
* ``triton`` : ``vllm.v1.attention.ops.triton_unified_attention.unified_attention``,
               cache ``[num_blocks, P, Hkv, 2*D]`` split into K/V views, with the 3D
               (split-softmax) buffers vLLM's TritonAttention builder allocates.
"""

from __future__ import annotations

import math
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .kernel_suite import Case, flops, min_bytes, rotations

BACKENDS = ("ion", "ion-auto", "ion-auto-rc", "ion-auto-gc", "ion-auto-p128", "ion-auto-lr",
            "ion-auto-pdl", "ion-auto-lc", "ion-auto-kp", "ion-auto-append", "ion-auto-fused",
            "ion-auto-fused-kp", "ion-auto-s2", "ion-auto-fused-s2", "ion-auto-fused-wf",
            "ion-auto-pp", "ion-auto-fused-pp", "ion-auto-np", "ion-auto-fused-np",
            "ion-auto-pin", "ion-auto-fused-pin", "ion-auto-c3", "ion-auto-fused-c3",
            "ion-auto-nsu", "ion-auto-fused-nsu", "ion-auto-fused-t128",
            "ion-auto-fused-t192", "ion-auto-fused-vs", "ion-auto-fused-novs", "ion-auto-fused-si",
            "ion-auto-fused-vs-si", "ion-auto-fused-vs64",
            "ion-unpacked",
            "ion-m128", "ion-m128-unpacked", "fa3", "fa3-layer", "fa4", "triton")
H200_L2_BYTES = 50 * 1024 * 1024


class BackendUnavailable(RuntimeError):
    """The backend cannot run at all here (import failure, unsupported GPU)."""


# --------------------------------------------------------------------------- data

def _torch_dtype(name: str):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _seed(case: Case, rot: int, salt: int) -> int:
    h = 0
    for ch in case.name:
        h = (h * 131 + ord(ch)) % (2 ** 31)
    return (h + 7919 * rot + 104729 * salt) % (2 ** 31)


def logical_qkv(case: Case, rot: int, device):
    """q ``[total_q, Hq, D]`` and logical K/V ``[total_kv, Hkv, D]`` for a rotation
    (request-major, token order), standard normal, deterministic per (case, rot)."""
    import torch
    dt = _torch_dtype(case.dtype)
    out = []
    for salt, shape in ((0, (case.total_q, case.hq, case.d)),
                        (1, (case.total_kv, case.hkv, case.d)),
                        (2, (case.total_kv, case.hkv, case.d))):
        g = torch.Generator(device=device)
        g.manual_seed(_seed(case, rot, salt))
        out.append(torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dt))
    return out


def qkv_views(case: Case, *, q=None, key=None, value=None):
    """``q`` / ``key`` / ``value`` (``[T, H, D]``) as the engine hands them over when
    ``case.qkv_layout == "fused"``: each copied into its columns of a ``[T, (hq + 2 hkv)
    * D]`` buffer (q at 0, key at hq*D, value at (hq + hkv)*D, as a fused qkv projection
    lays them out) and returned as a strided view of it; the same tensors otherwise.
    Each input gets its own buffer: the strides, the base alignment and the bytes read are
    the engine's; only q and K/V rows are not interleaved in one allocation.  Returns
    the tuple of the given tensors, in q, key, value order."""
    import torch
    given = [(0, q), (case.hq, key), (case.hq + case.hkv, value)]
    out = []
    for col_heads, t in given:
        if t is None:
            continue
        if case.qkv_layout != "fused":
            out.append(t)
            continue
        T, H, D = t.shape
        buf = torch.zeros((T, (case.hq + 2 * case.hkv) * D), dtype=t.dtype, device=t.device)
        view = buf[:, col_heads * D:(col_heads + H) * D].view(T, H, D)
        view.copy_(t)
        out.append(view)
    return tuple(out)


def page_assignment(case: Case, page: int, rot: int):
    """Block table ``[B, max_pages]`` (int32, numpy) with the physical pages of each
    request drawn from a seeded permutation (a fragmented allocator), plus the
    physical page and in-page offset of every logical KV token (request-major)."""
    n_pages = case.num_pages(page)
    perm = np.random.default_rng(_seed(case, rot, 3 + page)).permutation(n_pages).astype(np.int32)
    max_pages = max(math.ceil(k / page) for k in case.kv_lens)
    bt = np.zeros((case.batch, max_pages), dtype=np.int32)
    tok_page = np.empty(case.total_kv, dtype=np.int64)
    tok_off = np.empty(case.total_kv, dtype=np.int64)
    p0 = t0 = 0
    for b, kv in enumerate(case.kv_lens):
        npg = math.ceil(kv / page)
        bt[b, :npg] = perm[p0:p0 + npg]
        t = np.arange(kv)
        tok_page[t0:t0 + kv] = bt[b, t // page]
        tok_off[t0:t0 + kv] = t % page
        p0 += npg
        t0 += kv
    return bt, tok_page, tok_off, n_pages


@dataclass
class Prepared:
    """One rotation of one backend: ``call()`` runs the attention, writing ``out``."""
    call: Callable[[], object]
    out: object
    #: ION's (k_cache, v_cache) views, for variants that also write the cache
    kv_cache: object = None


def _common_meta(case: Case, device):
    import torch
    qsl = torch.tensor(case.query_start_loc(), dtype=torch.int32, device=device)
    seq_lens = torch.tensor(case.kv_lens, dtype=torch.int32, device=device)
    return qsl, seq_lens


# --------------------------------------------------------------------------- backends

def _ion_plan(case: Case, device, **plan_options):
    """The ION device plan, built the way vLLM's ION metadata builder does once per
    step: host planner (``cute_kernels.planner.plan``) over host copies of
    query_start_loc / seq_lens, uploaded by ``cute_kernels.make_device_plan``.
    ``plan_options``: extra planner switches (``unpacked_prefill=True``)."""
    try:
        import cute_kernels
        make_device_plan = cute_kernels.make_device_plan
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailable(f"cute_kernels.make_device_plan import failed: {e!r}") from e
    qsl = np.asarray(case.query_start_loc(), dtype=np.int32)
    sl = np.asarray(case.kv_lens, dtype=np.int32)
    return make_device_plan(qsl, sl, num_kv_heads=case.hkv, group_size=case.hq // case.hkv,
                            page_size=case.ion_page, head_dim=case.d, device=device,
                            **plan_options)


def stale_cache(shape, dtype, device):
    """A paged cache whose every slot holds a finite value before the case's K/V are
    written into it, as in a serving engine: vLLM allocates the cache zeroed and a slot
    then only ever holds K/V of earlier requests.  Slots past a request's seq_len in its
    last page are read by the kernels (masked), and with ``torch.empty`` they held
    whatever freed memory held, NaN bit patterns included: 0 * NaN in P V made some
    outputs non-finite (H200, session 18) although no valid key was wrong.  Random, not
    zero, so that a kernel that used such a slot unmasked would be visibly wrong."""
    import torch
    return torch.empty(shape, dtype=dtype, device=device).normal_()


def ion_cache(case: Case, rot: int, device):
    """q, K/V views of ION's vLLM cache ``[num_blocks, 2, Hkv, P, D]`` and the block table."""
    import torch
    P = case.ion_page
    q, k_log, v_log = logical_qkv(case, rot, device)
    bt_np, tp, to, n_pages = page_assignment(case, P, rot)
    cache = stale_cache((n_pages, 2, case.hkv, P, case.d), q.dtype, device)
    k, v = cache[:, 0], cache[:, 1]
    tp_t = torch.from_numpy(tp).to(device)
    to_t = torch.from_numpy(to).to(device)
    k[tp_t, :, to_t] = k_log
    v[tp_t, :, to_t] = v_log
    q, = qkv_views(case, q=q)
    return q, k, v, torch.from_numpy(bt_np).to(device)


def fa_cache(case: Case, rot: int, device):
    """q, K/V of FlashAttention's vLLM cache ``[2, num_blocks, P, Hkv, D]`` (NHD) and
    the block table, at the FA page size."""
    import torch
    P = case.fa_page
    q, k_log, v_log = logical_qkv(case, rot, device)
    bt_np, tp, to, n_pages = page_assignment(case, P, rot)
    cache = stale_cache((2, n_pages, P, case.hkv, case.d), q.dtype, device)
    slot = torch.from_numpy(tp * P + to).to(device)
    cache[0].view(n_pages * P, case.hkv, case.d)[slot] = k_log
    cache[1].view(n_pages * P, case.hkv, case.d)[slot] = v_log
    q, = qkv_views(case, q=q)
    return q, cache[0], cache[1], torch.from_numpy(bt_np).to(device)


def triton_cache(case: Case, rot: int, device):
    """q, K/V views of TritonAttention's cache, physically ``[num_blocks, P, Hkv, 2*D]``
    with K in the first and V in the second half of the last dim, and the block table."""
    import torch
    P = case.fa_page
    q, k_log, v_log = logical_qkv(case, rot, device)
    bt_np, tp, to, n_pages = page_assignment(case, P, rot)
    cache = stale_cache((n_pages, P, case.hkv, 2 * case.d), q.dtype, device)
    slot = torch.from_numpy(tp * P + to).to(device)
    flat = cache.view(n_pages * P, case.hkv, 2 * case.d)
    flat[slot, :, :case.d] = k_log
    flat[slot, :, case.d:] = v_log
    kc, vc = cache.split(case.d, dim=-1)
    q, = qkv_views(case, q=q)
    return q, kc, vc, torch.from_numpy(bt_np).to(device)


def prepare_ion(case: Case, rot: int, device, shared: dict, **plan_options) -> Prepared:
    import torch
    try:
        import cute_kernels
        attn = cute_kernels.ion_attention
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailable(f"cute_kernels.ion_attention import failed: {e!r}") from e
    if "ion_plan" not in shared:
        shared["ion_plan"] = _ion_plan(case, device, **plan_options)
    plan = shared["ion_plan"]
    q, k, v, bt = ion_cache(case, rot, device)
    qsl, seq_lens = _common_meta(case, device)
    out = torch.empty_like(q)
    scale = case.d ** -0.5

    # 128-token pages are an experiment of the kernel API (variants.EXPERIMENTAL_PAGE_SIZES)
    exp = case.ion_page != 64

    def call():
        return attn(q, k, v, out, qsl, seq_lens, bt, scale, plan=plan, experimental_pages=exp)

    return Prepared(call, out, kv_cache=(k, v))


def _flash_attn_func():
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailable(f"vllm.vllm_flash_attn import failed: {e!r}") from e
    return flash_attn_varlen_func


def _check_fa_version(ver: int):
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import fa_version_unsupported_reason
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailable(f"vllm.vllm_flash_attn import failed: {e!r}") from e
    reason = fa_version_unsupported_reason(ver)
    if reason:
        raise BackendUnavailable(f"FA{ver} unsupported: {reason}")


def _prepare_fa(case: Case, rot: int, device, shared: dict, ver: int) -> Prepared:
    import torch
    fa = _flash_attn_func()
    _check_fa_version(ver)
    q, kc, vc, bt = fa_cache(case, rot, device)
    qsl, seq_lens = _common_meta(case, device)
    out = torch.empty_like(q)
    scale = case.d ** -0.5
    sched = None
    if ver == 3:
        if "fa3_sched" not in shared:
            from vllm.vllm_flash_attn.flash_attn_interface import get_scheduler_metadata
            shared["fa3_sched"] = get_scheduler_metadata(
                batch_size=case.batch, max_seqlen_q=case.max_q, max_seqlen_k=case.max_kv,
                num_heads_q=case.hq, num_heads_kv=case.hkv, headdim=case.d,
                cache_seqlens=seq_lens, qkv_dtype=q.dtype, cu_seqlens_q=qsl,
                page_size=case.fa_page, causal=True, window_size=(-1, -1), num_splits=0)
        sched = shared["fa3_sched"]

    def call():
        return fa(q=q, k=kc, v=vc, out=out, cu_seqlens_q=qsl, max_seqlen_q=case.max_q,
                  seqused_k=seq_lens, max_seqlen_k=case.max_kv, softmax_scale=scale,
                  causal=True, block_table=bt, scheduler_metadata=sched,
                  fa_version=ver, num_splits=0)

    return Prepared(call, out, kv_cache=(kc, vc))


def prepare_fa3(case, rot, device, shared):
    return _prepare_fa(case, rot, device, shared, 3)


def prepare_fa3_layer(case, rot, device, shared):
    """What one vLLM FLASH_ATTN layer launches: ``reshape_and_cache_flash`` of the step's
    new K/V rows into the paged cache, then FA3 (both timed).  The counterpart of
    ``ion-auto-fused``, whose one launch does both; ``fa3`` times the attention alone."""
    import torch
    try:
        from vllm._custom_ops import reshape_and_cache_flash
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailable(f"vllm reshape_and_cache_flash import failed: {e!r}") from e
    prep = _prepare_fa(case, rot, device, shared, 3)
    key, value, slots = new_token_rows(case, rot, device, page=case.fa_page)
    # the caches _prepare_fa attends over (this rotation's)
    kc, vc = prep.kv_cache
    one = torch.ones((), dtype=torch.float32, device=device)
    attend = prep.call

    def call():
        reshape_and_cache_flash(key, value, kc, vc, slots, "auto", one, one)
        return attend()

    return Prepared(call, prep.out, kv_cache=(kc, vc))


def prepare_fa4(case, rot, device, shared):
    return _prepare_fa(case, rot, device, shared, 4)


def prepare_triton(case: Case, rot: int, device, shared: dict) -> Prepared:
    import torch
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailable(f"triton unified_attention import failed: {e!r}") from e
    q, kc, vc, bt = triton_cache(case, rot, device)
    qsl, seq_lens = _common_meta(case, device)
    out = torch.empty_like(q)
    scale = case.d ** -0.5
    if "triton_bufs" not in shared:
        # Same sizing as vLLM's TritonAttentionMetadataBuilder (no cudagraph capture).
        thr = 128 // case.hkv
        segs = 16
        dpad = 1 << (case.d - 1).bit_length()
        shared["triton_bufs"] = (
            thr, segs,
            torch.empty((thr, case.hq, segs, dpad), dtype=torch.float32, device=device),
            torch.empty((thr, case.hq, segs), dtype=torch.float32, device=device),
            torch.empty((thr, case.hq, segs), dtype=torch.float32, device=device),
            torch.ones(1, dtype=torch.float32, device=device).expand(case.batch, case.hkv),
        )
    thr, segs, so, sm, se, descale = shared["triton_bufs"]

    def call():
        return unified_attention(
            q=q, k=kc, v=vc, out=out, cu_seqlens_q=qsl, max_seqlen_q=case.max_q,
            seqused_k=seq_lens, max_seqlen_k=case.max_kv, softmax_scale=scale, causal=True,
            window_size=(-1, -1), block_table=bt, softcap=0, q_descale=None,
            k_descale=descale, v_descale=descale, seq_threshold_3D=thr,
            num_par_softmax_segments=segs, softmax_segm_output=so, softmax_segm_max=sm,
            softmax_segm_expsum=se)

    return Prepared(call, out)


def prepare_ion_unpacked(case: Case, rot: int, device, shared: dict) -> Prepared:
    """ION with unpacked prefill tiles (``unpacked_prefill=True`` plan and kernel variant;
    v4 candidate, not yet the backend's default)."""
    return prepare_ion(case, rot, device, shared, unpacked_prefill=True)


def prepare_ion_m128(case: Case, rot: int, device, shared: dict) -> Prepared:
    """ION with 128-row q tiles on two consumer warpgroups sharing each K/V page
    (``tile_m=128`` plan, ``consumers=2`` kernel, 1 CTA/SM; v4 candidate 2)."""
    return prepare_ion(case, rot, device, shared, tile_m=128)


def prepare_ion_m128_unpacked(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-m128`` plus unpacked prefill tiles (one q head x 128 tokens)."""
    return prepare_ion(case, rot, device, shared, tile_m=128, unpacked_prefill=True)


def auto_plan_options(case: Case, allow_192: bool = True) -> dict:
    """What the vLLM backend plans with by default (``ION_UNPACKED_PREFILL=1``,
    ``ION_PREFILL_TILE_M=auto``, ``ION_LANE_COMBINE=1``): unpacked prefill tiles, 128-row
    tiles when ``cute_kernels.planner.choose_tile_m`` rates the batch prefill-dominated
    (192-row ones where its prefill rows make enough tiles, as the backend's ``auto`` does
    since 2026-12-02; results recorded before 2026-12-03 ran 128 there, which
    ``ion-auto-c3`` forced to 192), and the split-parallel combine (since the ninth
    session; results recorded before it measured ``ion-auto`` with the row combine, i.e.
    today's ``ion-auto-rc``).  ``allow_192=False``: the 64/128 policy, which the 128-row
    experiments (page pairs, K/V stages, ping-pong, 128-token pages, ``-c3``) build on."""
    from cute_kernels.planner import choose_tile_m

    tile_m = choose_tile_m(np.asarray(case.query_start_loc(), dtype=np.int32),
                           np.asarray(case.kv_lens, dtype=np.int32), num_q_heads=case.hq,
                           num_kv_heads=case.hkv, head_dim=case.d, allow_192=allow_192)
    return {"unpacked_prefill": True, "tile_m": tile_m, "row_combine": True,
            "lane_combine": True}


def prepare_ion_auto(case: Case, rot: int, device, shared: dict) -> Prepared:
    """ION as the vLLM backend runs it by default (``auto_plan_options``; since the fourth
    session's H200 run that includes the row-parallel combine).  Results recorded before
    that change (2026-11-29, ``session4/kernel-ab`` and earlier) measured ``ion-auto``
    with the group combine, i.e. today's ``ion-auto-gc``."""
    return prepare_ion(case, rot, device, shared, **auto_plan_options(case))


def prepare_ion_auto_rc(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` with the row-parallel combine (``CombineRowsSm90``; the backend's
    ``ION_LANE_COMBINE=0``, its default from the fourth to the eighth session, when this
    name meant ``ion-auto``)."""
    return prepare_ion(case, rot, device, shared, **dict(auto_plan_options(case),
                                                         lane_combine=False))


def prepare_ion_auto_gc(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` with the group-per-CTA combine (``CombineSm90``; the backend's
    ``ION_LANE_COMBINE=0 ION_ROW_COMBINE=0``, its default before the fourth session)."""
    return prepare_ion(case, rot, device, shared, **dict(auto_plan_options(case),
                                                         lane_combine=False,
                                                         row_combine=False))


def prepare_ion_auto_p128(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` over a cache of 128-token pages: 128-row K/V tiles, one TMA box and
    one QK^T of m64n128k16 wgmmas per stage, half the per-tile softmax / rescale / barrier
    overhead of 64-token pages.  An experiment (``experimental_pages``; the vLLM backend
    runs 64-token pages): it measures whether wider KV tiles close the prefill gap to FA3.
    Since the fifth session it runs one K/V stage with two CTAs per SM
    (``attention.kv_stages_for``); ``session5/kernel-ab`` measured the earlier two-stage,
    one-CTA form.  Its output is checked against FA3 like every backend's
    (``rel_err_vs_fa3``)."""
    import dataclasses

    c128 = dataclasses.replace(case, ion_page=128)
    return prepare_ion(c128, rot, device, shared, **auto_plan_options(c128, allow_192=False))


def prepare_ion_auto_lr(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` on the lazy-rescaling kernel variants (``lazy_rescale=True`` plans;
    the backend's ``ION_LAZY_RESCALE=1``): a row keeps its running max, and O is not
    rescaled, until a page raises the max past 2^8 in P.  An experiment aimed at the
    prefill gap: it removes most per-page O rescales (64 multiplies a thread per 64-key
    page) and the per-row correction exp2."""
    return prepare_ion(case, rot, device, shared,
                       **dict(auto_plan_options(case), lazy_rescale=True))


def prepare_ion_auto_pdl(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` with the split-KV combine launched by programmatic dependent launch
    (``pdl_combine=True`` plans; the backend's ``ION_PDL_COMBINE=1``): the combine grid is
    scheduled while the attention grid runs and waits for it on the GPU, so the gap
    between the two kernels hides under the attention's tail.  Cases without splits launch
    no combine and run exactly ``ion-auto``."""
    return prepare_ion(case, rot, device, shared,
                       **dict(auto_plan_options(case), pdl_combine=True))


def prepare_ion_auto_lc(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` with the split-parallel combine (``lane_combine=True`` plans; the
    backend's ``ION_LANE_COMBINE=1``): lane s of a row's warp loads split s, and all of a
    row's loads are in flight at once, instead of the row combine's chain of unrolled-x4
    loops.  The backend's default since the ninth session, so the same as ``ion-auto``;
    the name stays for the recorded results that use it."""
    return prepare_ion(case, rot, device, shared,
                       **dict(auto_plan_options(case), lane_combine=True))


def prepare_ion_auto_kp(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` with page pairs on its 128-row tiles (``kv_pair=True`` plans, kernel
    ``IonAttentionSm90(consumers=2, kv_pair=True)``): a K/V stage holds two 64-token pages,
    so QK^T is a 64 x 128 tile and the softmax reductions, O rescale and pipeline waits
    run once per 128 keys.  An experiment aimed at the prefill gap (the vLLM backend runs
    it only under ``ION_KV_PAIR=1``; 2.5% slower on prefill at full clock on the H200).
    Steps that ``choose_tile_m`` gives 64-row tiles run exactly ``ion-auto``."""
    opts = auto_plan_options(case, allow_192=False)
    return prepare_ion(case, rot, device, shared,
                       **dict(opts, kv_pair=opts["tile_m"] == 128))


def new_token_rows(case: Case, rot: int, device, page: int | None = None):
    """This step's new K/V rows ``[total_q, Hkv, D]`` (each request's last ``q_len`` logical
    tokens, request-major like q) and their ION cache slots (``page * P + offset``, int64):
    what vLLM hands the backend as key / value / slot_mapping.  The cache ``ion_cache``
    builds already holds these tokens, so writing them again changes nothing and every
    variant's output stays comparable.  ``page``: the slots of that page size's cache
    instead (``fa_cache`` at ``case.fa_page``)."""
    import torch
    P = case.ion_page if page is None else int(page)
    _, k_log, v_log = logical_qkv(case, rot, device)
    _, tok_page, tok_off, _ = page_assignment(case, P, rot)
    idx, t0 = [], 0
    for q, kv in zip(case.q_lens, case.kv_lens):
        idx.extend(range(t0 + kv - q, t0 + kv))
        t0 += kv
    sel = np.asarray(idx, dtype=np.int64)
    slots = torch.from_numpy(tok_page[sel] * P + tok_off[sel]).to(device)
    i = torch.from_numpy(sel).to(device)
    key, value = qkv_views(case, key=k_log[i].contiguous(), value=v_log[i].contiguous())
    return key, value, slots


def prepare_ion_auto_append(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` as one vLLM layer runs it under ``ION_FUSED_KV_WRITEBACK=0`` (the
    default until the eighth session): ``kv_append`` of the step's new K/V rows, then the
    attention (both launches timed).  Compare with ``ion-auto-fused``; FA3's timing holds
    no cache write."""
    import cute_kernels

    prep = prepare_ion(case, rot, device, shared, **auto_plan_options(case))
    key, value, slots = new_token_rows(case, rot, device)
    k_cache, v_cache = prep.kv_cache

    def call():
        cute_kernels.kv_append(key, value, k_cache, v_cache, slots)
        return prep.call()

    return Prepared(call, prep.out)


def prepare_ion_auto_fused(case: Case, rot: int, device, shared: dict,
                           **extra_plan_options) -> Prepared:
    """Fused KV writeback (the backend's default ``ION_FUSED_KV_WRITEBACK=1``, i.e. what one
    vLLM layer runs by default since the ninth session): one launch reads the
    step's new K/V from key / value, writes them into the cache and attends (a
    ``fresh_kv`` plan with ``ion-auto``'s options, 128-row tiles included)."""
    import torch
    try:
        import cute_kernels
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailable(f"cute_kernels import failed: {e!r}") from e
    if "ion_plan" not in shared:
        shared["ion_plan"] = _ion_plan(case, device, fresh_kv=True,
                                       **dict(auto_plan_options(case), **extra_plan_options))
    plan = shared["ion_plan"]
    q, k, v, bt = ion_cache(case, rot, device)
    qsl, seq_lens = _common_meta(case, device)
    key, value, _ = new_token_rows(case, rot, device)
    out = torch.empty_like(q)
    scale = case.d ** -0.5

    def call():
        return cute_kernels.ion_attention(q, k, v, out, qsl, seq_lens, bt, scale, plan=plan,
                                          key=key, value=value)

    return Prepared(call, out)


def prepare_ion_auto_fused_kp(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` with page pairs on its 128-row tiles (``kv_pair=True`` fresh_kv
    plans): the default layer's one launch with 128-key S tiles.  An experiment (22%
    slower on prefill than ``ion-auto-fused`` on the H200)."""
    tile_m = auto_plan_options(case, allow_192=False)["tile_m"]
    return prepare_ion_auto_fused(case, rot, device, shared, kv_pair=tile_m == 128,
                                  tile_m=tile_m)


def prepare_ion_auto_s2(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` with two K/V stages on its 128-row tiles (``kv_stages=2`` plans,
    kernel ``IonAttentionSm90(consumers=2, kv_stages=2)``), the depth before 2026-12-02:
    the producer may load two 64-token pages ahead of the consumers instead of the
    default four.  For A/B runs; steps that ``choose_tile_m`` gives 64-row tiles run
    exactly ``ion-auto``."""
    opts = auto_plan_options(case, allow_192=False)
    return prepare_ion(case, rot, device, shared,
                       **dict(opts, kv_stages=2 if opts["tile_m"] == 128 else None))


def prepare_ion_auto_fused_s2(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` with two K/V stages on its 128-row tiles (``kv_stages=2``
    fresh_kv plans): the default layer as it was before 2026-12-02."""
    tile_m = auto_plan_options(case, allow_192=False)["tile_m"]
    return prepare_ion_auto_fused(case, rot, device, shared, tile_m=tile_m,
                                  kv_stages=2 if tile_m == 128 else None)


def prepare_ion_auto_fused_wf(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` planned without the planner's final local search
    (``planner.plan(refine=False)``: the water-filled assignment alone, the planner before
    2026-12-02).  The A/B of that search, on the default layer."""
    return prepare_ion_auto_fused(case, rot, device, shared, refine_balance=False)


def _pingpong_option(case: Case, on: bool) -> dict:
    """Plan option of the ping-pong A/B backends: ``pingpong=on`` on 128-row plans (the
    only kernels that have it), nothing on 64-row ones (they run ``ion-auto``'s kernels)."""
    tile_m = auto_plan_options(case, allow_192=False)["tile_m"]
    return {"pingpong": on, "tile_m": 128} if tile_m == 128 else {"tile_m": tile_m}


def prepare_ion_auto_pp(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` with warpgroup ping-pong on its 128-row tiles (``pingpong=True`` plans,
    kernel ``IonAttentionSm90(consumers=2, pingpong=True)``): the two consumer warpgroups
    take turns issuing their MMAs through two named barriers, so one warpgroup's softmax
    runs under the other's MMAs (FA3's warp scheduler barriers).  An experiment: 2-3%
    slower on prefill on the H200, 4-5% fused (``ion-auto-fused-pp``).  Steps that
    ``choose_tile_m`` gives 64-row tiles run exactly ``ion-auto``."""
    return prepare_ion(case, rot, device, shared,
                       **dict(auto_plan_options(case, allow_192=False), **_pingpong_option(case, True)))


def prepare_ion_auto_fused_pp(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` with warpgroup ping-pong on its 128-row tiles."""
    return prepare_ion_auto_fused(case, rot, device, shared, **_pingpong_option(case, True))


def prepare_ion_auto_np(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` without warpgroup ping-pong on its 128-row tiles (``pingpong=False``):
    the other side of the A/B, whatever ``attention.PINGPONG_DEFAULT`` is."""
    return prepare_ion(case, rot, device, shared,
                       **dict(auto_plan_options(case, allow_192=False), **_pingpong_option(case, False)))


def prepare_ion_auto_fused_np(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` without warpgroup ping-pong on its 128-row tiles."""
    return prepare_ion_auto_fused(case, rot, device, shared, **_pingpong_option(case, False))


def prepare_ion_auto_pin(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` on the kernels with the pinned PV wait (``pin_pv_wait=True`` plans, the
    64/128 policy it was measured with; the backend's ``ION_PIN_PV_WAIT=1``): the steady state waits for its previous
    O += P V after the softmax in the SASS too, so the softmax runs under that PV."""
    return prepare_ion(case, rot, device, shared,
                       **dict(auto_plan_options(case, allow_192=False), pin_pv_wait=True))


def prepare_ion_auto_fused_pin(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` on the kernels with the pinned PV wait."""
    # an experiment on the 64/128-row kernels (measured there, thirteenth session)
    tile_m = auto_plan_options(case, allow_192=False)["tile_m"]
    return prepare_ion_auto_fused(case, rot, device, shared, pin_pv_wait=True, tile_m=tile_m)


def _c3_tile_m(case: Case) -> int:
    """``ion-auto``'s tile size with 192 in place of 128: the three-consumer kernels run the
    steps ``choose_tile_m`` gives 128-row tiles; 64-row steps are unchanged."""
    tile_m = auto_plan_options(case, allow_192=False)["tile_m"]
    return 192 if tile_m == 128 else tile_m


def prepare_ion_auto_c3(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` with 192-row q tiles where it runs 128-row ones (``tile_m=192`` plans,
    kernel ``IonAttentionSm90(consumers=3)``: three consumer warpgroups share every K/V
    stage, 512 threads, one CTA per SM; bench/notes.md v17, an experiment)."""
    return prepare_ion(case, rot, device, shared,
                       **dict(auto_plan_options(case), tile_m=_c3_tile_m(case)))


def prepare_ion_auto_fused_c3(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` with 192-row q tiles where it runs 128-row ones."""
    return prepare_ion_auto_fused(case, rot, device, shared, tile_m=_c3_tile_m(case))


def prepare_ion_auto_nsu(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto`` planned without splitting unpacked items (``split_unpacked=False``: the
    planner before v18, 2026-12-03), for the A/B of that change."""
    return prepare_ion(case, rot, device, shared,
                       **dict(auto_plan_options(case), split_unpacked=False))


def prepare_ion_auto_fused_nsu(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` planned without splitting unpacked items (the planner before v18)."""
    return prepare_ion_auto_fused(case, rot, device, shared, split_unpacked=False)


def _forced_tile_m(case: Case, tile_m: int) -> int:
    """``tile_m`` on steps with prefill rows (``PREFILL_ROW_TOKENS`` new tokens or more),
    whatever ``choose_tile_m``'s decode fraction says; 64 on decode-only steps."""
    from cute_kernels.planner import PREFILL_ROW_TOKENS
    return tile_m if max(case.q_lens) >= PREFILL_ROW_TOKENS else 64


def prepare_ion_auto_fused_t128(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` on 128-row tiles wherever the step has a prefill row: what the
    auto policy would run with a higher ``M128_MAX_DECODE_FRACTION`` (mixed steps)."""
    return prepare_ion_auto_fused(case, rot, device, shared, tile_m=_forced_tile_m(case, 128))


def prepare_ion_auto_fused_t192(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` on 192-row tiles wherever the step has a prefill row."""
    return prepare_ion_auto_fused(case, rot, device, shared, tile_m=_forced_tile_m(case, 192))


def prepare_ion_auto_fused_vs(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` pinned to the kernels whose straddle copy moves 16-byte chunks
    (``ION_VEC_STRADDLE=1``).  The same kernels as the default since the nineteenth
    session; from the eighteenth until then the default (``auto``) ran them only on steps
    with a straddling fresh tile (a prefill row whose context is not a page multiple)."""
    return prepare_ion_auto_fused(case, rot, device, shared, vec_straddle=True)


def prepare_ion_auto_fused_novs(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` always on the element-wise straddle copy (``ION_VEC_STRADDLE=0``;
    the default before the eighteenth session, and on steps without a straddling tile
    until the nineteenth)."""
    return prepare_ion_auto_fused(case, rot, device, shared, vec_straddle=False)


def prepare_ion_auto_fused_si(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` on the kernels whose idle consumer warpgroups issue no wgmma
    (``ION_SKIP_IDLE=1``; an experiment): differs only on 128/192-row plans, where decode
    rows and chunk tails leave warpgroups without a token."""
    return prepare_ion_auto_fused(case, rot, device, shared, skip_idle=True)


def prepare_ion_auto_fused_vs_si(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused`` with both experiments of the seventeenth session
    (``ION_VEC_STRADDLE=1 ION_SKIP_IDLE=1``)."""
    return prepare_ion_auto_fused(case, rot, device, shared, vec_straddle=True,
                                  skip_idle=True)


def prepare_ion_auto_fused_vs64(case: Case, rot: int, device, shared: dict) -> Prepared:
    """``ion-auto-fused-vs`` that also runs the 16-byte straddle copy at head size 64: the
    D = 64 kernels compile it spill-free (a 48-register producer), but plans run it only
    at ``attention.VEC_STRADDLE_HEAD_DIMS`` (128) until it has run on a Hopper GPU.  This
    backend sets the one plan it builds to those kernels, so that an interleaved run can
    time them against ``ion-auto-fused`` (element-wise at D = 64) and FA3 (suite
    ``engine-d64``).  At D = 128 it is ``ion-auto-fused-vs``."""
    prep = prepare_ion_auto_fused(case, rot, device, shared, vec_straddle=True)
    if case.d == 64:
        shared["ion_plan"].vec_straddle_mode = True  # the plan every rotation's call uses
    return prep


PREPARE = {"ion": prepare_ion, "ion-auto": prepare_ion_auto, "ion-auto-rc": prepare_ion_auto_rc,
           "ion-auto-gc": prepare_ion_auto_gc, "ion-auto-p128": prepare_ion_auto_p128,
           "ion-auto-lr": prepare_ion_auto_lr, "ion-auto-pdl": prepare_ion_auto_pdl,
           "ion-auto-lc": prepare_ion_auto_lc, "ion-auto-kp": prepare_ion_auto_kp,
           "ion-auto-append": prepare_ion_auto_append, "ion-auto-fused": prepare_ion_auto_fused,
           "ion-auto-fused-kp": prepare_ion_auto_fused_kp,
           "ion-auto-s2": prepare_ion_auto_s2, "ion-auto-fused-s2": prepare_ion_auto_fused_s2,
           "ion-auto-fused-wf": prepare_ion_auto_fused_wf,
           "ion-auto-pp": prepare_ion_auto_pp, "ion-auto-fused-pp": prepare_ion_auto_fused_pp,
           "ion-auto-np": prepare_ion_auto_np, "ion-auto-fused-np": prepare_ion_auto_fused_np,
           "ion-auto-pin": prepare_ion_auto_pin,
           "ion-auto-fused-pin": prepare_ion_auto_fused_pin,
           "ion-auto-c3": prepare_ion_auto_c3, "ion-auto-fused-c3": prepare_ion_auto_fused_c3,
           "ion-auto-nsu": prepare_ion_auto_nsu,
           "ion-auto-fused-nsu": prepare_ion_auto_fused_nsu,
           "ion-auto-fused-t128": prepare_ion_auto_fused_t128,
           "ion-auto-fused-t192": prepare_ion_auto_fused_t192,
           "ion-auto-fused-vs": prepare_ion_auto_fused_vs,
           "ion-auto-fused-novs": prepare_ion_auto_fused_novs,
           "ion-auto-fused-si": prepare_ion_auto_fused_si,
           "ion-auto-fused-vs-si": prepare_ion_auto_fused_vs_si,
           "ion-auto-fused-vs64": prepare_ion_auto_fused_vs64,
           "ion-unpacked": prepare_ion_unpacked,
           "ion-m128": prepare_ion_m128, "ion-m128-unpacked": prepare_ion_m128_unpacked,
           "fa3": prepare_fa3, "fa3-layer": prepare_fa3_layer, "fa4": prepare_fa4,
           "triton": prepare_triton}


# --------------------------------------------------------------------------- timing

def time_calls(calls: list[Callable[[], object]], iters: int, warmup: int) -> list[float]:
    """GPU time (µs) of each of ``iters`` calls, cycling through ``calls``.

    Each call is bracketed by CUDA events.  Before the timed loop a
    ``torch.cuda._sleep`` spacer, sized from the measured host enqueue cost, keeps
    the GPU busy until the host has queued every call, so host launch overhead
    does not leak into the GPU time of a call.
    """
    import torch
    n = len(calls)
    for i in range(warmup):
        calls[i % n]()
    torch.cuda.synchronize()
    # Host enqueue cost per call (GPU busy behind a spacer so the queue never drains).
    t0 = time.perf_counter()
    probe = min(10, iters)
    torch.cuda._sleep(_cycles_for_us(20_000))
    for i in range(probe):
        calls[i % n]()
    host_us = (time.perf_counter() - t0) * 1e6 / max(1, probe)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    spacer_us = min(1_000_000.0, 2.0 * iters * (host_us + 10.0) + 2_000.0)
    torch.cuda._sleep(_cycles_for_us(spacer_us))
    for i in range(iters):
        starts[i].record()
        calls[i % n]()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends)]


def time_calls_synced(calls: list[Callable[[], object]], iters: int,
                      warmup: int) -> list[float]:
    """GPU time (µs) of each call started from an idle, synchronized GPU: events
    around one host call, then a sync.  Unlike :func:`time_calls` this includes the
    gap between the start event and the kernel (host enqueue and launch latency,
    several µs for a Python-wrapped kernel) and an empty GPU at kernel start.  It is
    the method a simple per-call benchmark uses; `ion-bench kernel --timing synced`
    exists to compare against such numbers, not for the A/B."""
    import torch
    n = len(calls)
    for i in range(warmup):
        calls[i % n]()
    torch.cuda.synchronize()
    out = []
    for i in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        calls[i % n]()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) * 1000.0)
    return out


def interleave_calls(calls_by_backend: dict[str, list[Callable[[], object]]]
                     ) -> list[Callable[[], object]]:
    """One call list that alternates backends call by call: rotation ``j`` of every backend,
    in the given backend order, then rotation ``j + 1`` (a backend with fewer rotations
    wraps around).  ``time_calls`` over it runs backend ``i % n`` at timed call ``i``."""
    names = list(calls_by_backend)
    n_rot = max(len(c) for c in calls_by_backend.values())
    return [calls_by_backend[b][j % len(calls_by_backend[b])]
            for j in range(n_rot) for b in names]


def split_interleaved(ts: list[float], backends: list[str]) -> dict[str, list[float]]:
    """Per-backend times, in call order, of a ``time_calls`` run over ``interleave_calls``."""
    n = len(backends)
    return {b: ts[i::n] for i, b in enumerate(backends)}


def time_interleaved(calls_by_backend: dict[str, list[Callable[[], object]]], iters: int,
                     warmup: int) -> dict[str, list[float]]:
    """``iters`` timed calls per backend, all queued in one stream that alternates the
    backends call by call (``time_calls`` over ``interleave_calls``).  Every backend then
    samples the same moments of the run: on the H200, sequential runs of 60 prefill calls
    turned 8-14% slower part-way through, at a different call per backend, FA3 included
    (bench/notes.md, ninth session), which biased the medians of an A/B by up to ~3%."""
    names = list(calls_by_backend)
    ts = time_calls(interleave_calls(calls_by_backend), iters * len(names),
                    warmup * len(names))
    return split_interleaved(ts, names)


TIMERS = {"queued": time_calls, "synced": time_calls_synced}
#: every backend of a case timed in one queued stream, alternating call by call
INTERLEAVED = "interleaved"
TIMINGS = (*TIMERS, INTERLEAVED)

_CYCLES_PER_US: float | None = None


def _cycles_for_us(us: float) -> int:
    global _CYCLES_PER_US
    import torch
    if _CYCLES_PER_US is None:
        cyc = 10_000_000
        torch.cuda._sleep(1000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(cyc)
        e.record()
        torch.cuda.synchronize()
        _CYCLES_PER_US = cyc / max(1.0, s.elapsed_time(e) * 1000.0)
    return int(us * _CYCLES_PER_US)


def percentile(xs: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), p))


# --------------------------------------------------------------------------- ceilings

def measure_ceilings(device, iters: int = 20, copy_bytes: int = 1 << 30,
                     gemm_n: int = 8192) -> dict:
    """Device-to-device copy bandwidth (bytes read + written / time) and bf16 GEMM
    throughput (``gemm_n``^3 torch.matmul on random data), same process, same GPU."""
    import torch
    n = copy_bytes // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ts = time_calls([lambda: dst.copy_(src)], iters, 3)
    copy_us = statistics.median(ts)
    copy_gbps = 2 * n * 2 / (copy_us * 1e-6) / 1e9
    del src, dst
    a = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device=device)
    b = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device=device)
    c = torch.empty(gemm_n, gemm_n, dtype=torch.bfloat16, device=device)
    ts = time_calls([lambda: torch.matmul(a, b, out=c)], iters, 3)
    gemm_us = statistics.median(ts)
    gemm_tflops = 2 * gemm_n ** 3 / (gemm_us * 1e-6) / 1e12
    del a, b, c
    torch.cuda.empty_cache()
    return {"copy_gbps": copy_gbps, "copy_bytes": 2 * n * 2, "copy_us": copy_us,
            "gemm_tflops": gemm_tflops, "gemm_n": gemm_n, "gemm_us": gemm_us}


# --------------------------------------------------------------------------- driver

def rel_err(out, ref) -> float:
    import torch
    o = out.float()
    r = ref.float()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def prepare_case_backend(case: Case, backend: str, device, *,
                         l2_bytes: int = H200_L2_BYTES) -> tuple[list[Prepared], object]:
    """Every rotation of one backend on one case, and the first rotation's output (on
    device, cloned after one call) for the cross-checks."""
    import torch
    n_rot = rotations(case, l2_bytes)
    shared: dict = {}
    preps = [PREPARE[backend](case, r, device, shared) for r in range(n_rot)]
    preps[0].call()
    torch.cuda.synchronize()
    return preps, preps[0].out.clone()


def summarize_times(ts: list[float], n_rot: int, timing: str) -> dict:
    return {
        "median_us": statistics.median(ts),
        "p10_us": percentile(ts, 10),
        "p90_us": percentile(ts, 90),
        "min_us": min(ts),
        "mean_us": statistics.fmean(ts),
        "iters": len(ts),
        "rotations": n_rot,
        "timing": timing,
        # every timed call in order (call i ran rotation i % rotations): shows whether a
        # wide p10-p90 spread comes from some rotations' data / page layout or from
        # moments of the run (the H200 measured ION's prefill at p10 788 / p90 939 us in
        # runs where FA3 stayed within 773-779)
        "iter_us": [round(t, 2) for t in ts],
    }


def run_case_backend(case: Case, backend: str, device, *, iters: int, warmup: int,
                     l2_bytes: int = H200_L2_BYTES,
                     timing: str = "queued") -> tuple[dict, object]:
    """Time one backend on one case. Returns (measurement dict, first-rotation
    output (on device) for cross-checks). Raises BackendUnavailable / other errors."""
    import torch
    preps, first_out = prepare_case_backend(case, backend, device, l2_bytes=l2_bytes)
    n_rot = len(preps)
    try:
        ts = TIMERS[timing]([p.call for p in preps], iters, warmup)
    finally:
        del preps
    torch.cuda.empty_cache()
    return summarize_times(ts, n_rot, timing), first_out


def run_kernel_suite(cases: list[Case], backends: list[str], *, iters: int = 60,
                     warmup: int = 10, device: str = "cuda", ceilings: dict | None = None,
                     suite_label: str = "", log=print, on_record=None,
                     l2_bytes: int = H200_L2_BYTES, timing: str = "queued") -> list[dict]:
    """Run every (case, backend); never raises for a backend failure: the record
    then has ``status`` "skipped" (backend unavailable) or "error".

    ``timing``: "queued" / "synced" time one backend after the other; "interleaved" prepares
    every backend of a case, then times them in one stream alternating call by call
    (``time_interleaved``).  If that joint run fails, each backend is timed alone
    ("queued"), so one broken backend costs only its own record."""
    import torch
    if timing not in TIMINGS:
        raise ValueError(f"timing {timing!r}: use one of {', '.join(TIMINGS)}")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    records: list[dict] = []
    unavailable: dict[str, str] = {}
    copy_gbps = (ceilings or {}).get("copy_gbps")
    gemm_tflops = (ceilings or {}).get("gemm_tflops")

    def fail(rec: dict, be: str, case: Case, e: Exception) -> None:
        if isinstance(e, BackendUnavailable):
            unavailable[be] = str(e)
            rec.update(status="skipped", error=str(e))
            log(f"[kernel] {case.name:<44} {be:<7} skipped: {e}")
            return
        rec.update(status="error", error=f"{type(e).__name__}: {e}",
                   traceback=traceback.format_exc(limit=8))  # called in an except block
        log(f"[kernel] {case.name:<44} {be:<7} ERROR {type(e).__name__}: {e}")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def finish(rec: dict, be: str, case: Case, res: dict, out, outs: dict) -> None:
        by, fl = rec["bytes"], rec["flops"]
        rec.update(status="ok", **res)
        sec = res["median_us"] * 1e-6
        rec["achieved_gbps"] = by / sec / 1e9
        rec["achieved_tflops"] = fl / sec / 1e12
        rec["frac_copy_bw"] = rec["achieved_gbps"] / copy_gbps if copy_gbps else None
        rec["frac_gemm"] = rec["achieved_tflops"] / gemm_tflops if gemm_tflops else None
        outs[be] = out
        ref_name = "fa3" if "fa3" in outs else None
        if ref_name and be != ref_name:
            rec["rel_err_vs_fa3"] = rel_err(out, outs[ref_name])
        elif be == "fa3":
            # fa3 finished after others: back-fill their cross-check
            for r in records:
                if r["case"] == case.name and r["backend"] in outs and r["backend"] != "fa3":
                    r["rel_err_vs_fa3"] = rel_err(outs[r["backend"]], out)
                    log(f"[kernel] {case.name:<44} {r['backend']:<7} "
                        f"rel_err vs fa3 = {r['rel_err_vs_fa3']:.2e}")
        extra = (f"  rel_err_vs_fa3={rec['rel_err_vs_fa3']:.2e}"
                 if "rel_err_vs_fa3" in rec else "")
        fb = f"{rec['frac_copy_bw']:.2f}" if rec["frac_copy_bw"] is not None else "n/a"
        fg = f"{rec['frac_gemm']:.3f}" if rec["frac_gemm"] is not None else "n/a"
        log(f"[kernel] {case.name:<44} {be:<7} {res['median_us']:10.1f} us "
            f"(p10 {res['p10_us']:.1f} p90 {res['p90_us']:.1f}, rot {res['rotations']})"
            f"  {rec['achieved_gbps']:7.1f} GB/s bw={fb} gemm={fg}{extra}")

    def emit(rec: dict) -> None:
        records.append(rec)
        if on_record:
            on_record(records)

    for case in cases:
        by = min_bytes(case)
        fl = flops(case)
        outs: dict[str, object] = {}
        pending: list[tuple[str, dict]] = []
        for be in backends:
            rec = {"suite": "kernel", "case": case.name, "backend": be,
                   "bytes": by, "flops": fl, "shape": case.to_dict()}
            if suite_label:
                rec["kernel_suite"] = suite_label
            if be in unavailable:
                rec.update(status="skipped", error=unavailable[be])
                log(f"[kernel] {case.name:<44} {be:<7} skipped: {unavailable[be]}")
                emit(rec)
                continue
            if timing == INTERLEAVED:
                pending.append((be, rec))  # prepared and timed together below
                continue
            try:
                res, out = run_case_backend(case, be, dev, iters=iters, warmup=warmup,
                                            l2_bytes=l2_bytes, timing=timing)
            except Exception as e:  # noqa: BLE001 - one failure must not end the run
                fail(rec, be, case, e)
            else:
                finish(rec, be, case, res, out, outs)
            emit(rec)
        if pending:
            prepared: dict[str, tuple[list[Prepared], object]] = {}
            for be, rec in pending:
                try:
                    prepared[be] = prepare_case_backend(case, be, dev, l2_bytes=l2_bytes)
                except Exception as e:  # noqa: BLE001
                    fail(rec, be, case, e)
            results: dict[str, dict] = {}
            if prepared:
                calls = {be: [p.call for p in preps] for be, (preps, _) in prepared.items()}
                try:
                    ts_by = time_interleaved(calls, iters, warmup)
                    results = {be: dict(summarize_times(ts_by[be], len(calls[be]), INTERLEAVED),
                                        interleaved_with=list(calls))
                               for be in calls}
                except Exception as e:  # noqa: BLE001 - time each alone, keep the rest
                    log(f"[kernel] {case.name:<44} interleaved timing failed "
                        f"({type(e).__name__}: {e}); timing each backend alone")
                    torch.cuda.synchronize()
                    for be in calls:
                        try:
                            results[be] = summarize_times(time_calls(calls[be], iters, warmup),
                                                          len(calls[be]), "queued")
                        except Exception as e2:  # noqa: BLE001
                            fail(dict(pending)[be], be, case, e2)
            for be, rec in pending:
                if be in results:
                    finish(rec, be, case, results[be], prepared[be][1], outs)
                emit(rec)
            del prepared
            torch.cuda.empty_cache()
        del outs
        torch.cuda.empty_cache()
    return records
