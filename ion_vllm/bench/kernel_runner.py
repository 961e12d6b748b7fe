"""GPU side of the kernel A/B benchmark: data setup per backend, timing, ceilings.

Every backend sees the same logical q/K/V (generated from per-case, per-rotation seeds)
scattered into its own vLLM cache layout, pages placed by a seeded permutation (a
fragmented allocator).  ``BACKENDS`` maps a name to a :data:`PrepareFn`; a script may add
entries (e.g. another checkout's kernels, see :func:`ion_backend` and
:func:`import_package`) before calling :func:`run_kernel_suite`.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pkgutil
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .kernel_suite import PAGE, Case, flops, min_bytes, rotations

H200_L2_BYTES = 50 * 1024 * 1024
#: a backend's first output (rotation 0) against the fp32 reference: ||out-ref|| / ||ref||
REL_TOL = 1e-2


class BackendUnavailable(RuntimeError):
    """The backend cannot run at all here (import failure, unsupported GPU)."""


@dataclass
class Prepared:
    """One rotation of one backend: ``call()`` runs the timed launch(es), writing ``out``."""
    call: Callable[[], object]
    out: object


#: (case, rotation, device, shared) -> Prepared; ``shared`` is one dict per (case, backend)
#: for what all rotations reuse (plans, scheduler metadata), built outside the timed region
PrepareFn = Callable[[Case, int, object, dict], Prepared]


# --------------------------------------------------------------------------- data

def _seed(case: Case, rot: int, salt: int) -> int:
    h = 0
    for ch in case.name:
        h = (h * 131 + ord(ch)) % (2 ** 31)
    return (h + 7919 * rot + 104729 * salt) % (2 ** 31)


def logical_qkv(case: Case, rot: int, device):
    """q ``[total_q, Hq, D]`` and logical K/V ``[total_kv, Hkv, D]`` of a rotation
    (request-major, token order), standard normal, deterministic per (case, rot)."""
    import torch
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    out = []
    for salt, rows, heads in ((0, case.total_q, case.hq), (1, case.total_kv, case.hkv),
                              (2, case.total_kv, case.hkv)):
        g = torch.Generator(device=device)
        g.manual_seed(_seed(case, rot, salt))
        out.append(torch.randn((rows, heads, case.d), generator=g, device=device).to(dt))
    return out


def qkv_views(case: Case, **given):
    """The given of ``q`` / ``key`` / ``value`` (``[T, H, D]``, keyword order kept) as the
    engine hands them over when ``case.qkv_layout == "fused"``: each copied into its columns
    of a ``[T, (hq + 2 hkv) * D]`` buffer (q at 0, key at hq*D, value at (hq + hkv)*D, as a
    fused qkv projection lays them out) and returned as a strided view; as given otherwise."""
    import torch
    if case.qkv_layout != "fused":
        return tuple(given.values())
    out = []
    for name, t in given.items():
        col = {"q": 0, "key": case.hq, "value": case.hq + case.hkv}[name]
        T, H, D = t.shape
        buf = torch.zeros((T, (case.hq + 2 * case.hkv) * D), dtype=t.dtype, device=t.device)
        view = buf[:, col * D:(col + H) * D].view(T, H, D)
        view.copy_(t)
        out.append(view)
    return tuple(out)


def page_assignment(case: Case, page: int, rot: int):
    """Block table ``[B, max_pages]`` (int32, numpy) with each request's pages drawn from a
    seeded permutation, the physical page and in-page offset of every logical KV token
    (request-major), and the page count."""
    n_pages = case.num_pages(page)
    perm = np.random.default_rng(_seed(case, rot, 3 + page)).permutation(n_pages)
    bt = np.zeros((case.batch, max(math.ceil(k / page) for k in case.kv_lens)), np.int32)
    tok_page = np.empty(case.total_kv, np.int64)
    tok_off = np.empty(case.total_kv, np.int64)
    p0 = t0 = 0
    for b, kv in enumerate(case.kv_lens):
        npg = math.ceil(kv / page)
        bt[b, :npg] = perm[p0:p0 + npg]
        t = np.arange(kv)
        tok_page[t0:t0 + kv] = bt[b, t // page]
        tok_off[t0:t0 + kv] = t % page
        p0, t0 = p0 + npg, t0 + kv
    return bt, tok_page, tok_off, n_pages


def _paged(case: Case, rot: int, device, page: int, shape, write):
    """q, a cache of ``shape(num_pages)`` and the block table, the logical K/V written at
    their slots by ``write(cache, slot, k, v)``.  The cache is filled with random values
    first: a serving engine's cache holds earlier requests' K/V (never NaN) in the slots a
    kernel reads masked past a request's end."""
    import torch
    q, k_log, v_log = logical_qkv(case, rot, device)
    bt, tp, to, n_pages = page_assignment(case, page, rot)
    cache = torch.empty(shape(n_pages), dtype=q.dtype, device=device).normal_()
    write(cache, torch.from_numpy(tp * page + to).to(device), k_log, v_log)
    return qkv_views(case, q=q)[0], cache, torch.from_numpy(bt).to(device)


def ion_cache(case: Case, rot: int, device):
    """q, K/V views ``[num_blocks, Hkv, 64, D]`` of ION's cache ``[num_blocks, 2, Hkv, 64,
    D]`` (HND pages, as the backend allocates it) and the block table."""
    def write(c, s, k, v):
        c[s // PAGE, 0, :, s % PAGE] = k
        c[s // PAGE, 1, :, s % PAGE] = v
    q, cache, bt = _paged(case, rot, device, PAGE,
                          lambda n: (n, 2, case.hkv, PAGE, case.d), write)
    return q, cache[:, 0], cache[:, 1], bt


def fa_cache(case: Case, rot: int, device):
    """q, K/V of FlashAttention's cache ``[2, num_blocks, P, Hkv, D]`` (NHD, P = fa_page)."""
    def write(c, s, k, v):
        c[0].view(-1, case.hkv, case.d)[s] = k
        c[1].view(-1, case.hkv, case.d)[s] = v
    q, cache, bt = _paged(case, rot, device, case.fa_page,
                          lambda n: (2, n, case.fa_page, case.hkv, case.d), write)
    return q, cache[0], cache[1], bt


def triton_cache(case: Case, rot: int, device):
    """q, K/V views of TritonAttention's cache ``[num_blocks, P, Hkv, 2*D]`` (K | V halves)."""
    d = case.d

    def write(c, s, k, v):
        c.view(-1, case.hkv, 2 * d)[s, :, :d] = k
        c.view(-1, case.hkv, 2 * d)[s, :, d:] = v
    q, cache, bt = _paged(case, rot, device, case.fa_page,
                          lambda n: (n, case.fa_page, case.hkv, 2 * d), write)
    kc, vc = cache.split(d, dim=-1)
    return q, kc, vc, bt


def new_token_rows(case: Case, rot: int, device, page: int = PAGE):
    """The step's new K/V rows ``[total_q, Hkv, D]`` (each request's last ``q_len`` logical
    tokens, request-major like q) and their cache slots at page size ``page`` (int64): what
    vLLM hands the backend as key / value / slot_mapping.  The caches built above already
    hold these tokens, so writing them again leaves every output comparable."""
    import torch
    _, k_log, v_log = logical_qkv(case, rot, device)
    _, tok_page, tok_off, _ = page_assignment(case, page, rot)
    starts = np.cumsum((0,) + case.kv_lens[:-1])
    sel = np.concatenate([np.arange(s + kv - q, s + kv)
                          for s, q, kv in zip(starts, case.q_lens, case.kv_lens)])
    slots = torch.from_numpy(tok_page[sel] * page + tok_off[sel]).to(device)
    i = torch.from_numpy(sel).to(device)
    key, value = qkv_views(case, key=k_log[i].contiguous(), value=v_log[i].contiguous())
    return key, value, slots


def _meta(case: Case, device):
    import torch
    return (torch.tensor(case.query_start_loc(), dtype=torch.int32, device=device),
            torch.tensor(case.kv_lens, dtype=torch.int32, device=device))


# --------------------------------------------------------------------------- backends

def import_package(package_dir: str, alias: str):
    """Import the package in ``package_dir`` (e.g. another checkout's ``cute_kernels``) under
    the module name ``alias``, beside the installed one, for :func:`ion_backend`'s
    ``kernels``.  Its submodules are imported at once under ``alias``, so its relative imports
    (at call time too) stay inside it, and its exported names (``__all__``; the lazy
    ``__getattr__`` of ``cute_kernels`` imports them by absolute name) are bound to its own
    modules while they answer for the package's original name."""
    orig = os.path.basename(os.path.normpath(package_dir))
    spec = importlib.util.spec_from_file_location(
        alias, os.path.join(package_dir, "__init__.py"), submodule_search_locations=[package_dir])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    subs = {f"{orig}.{m.name}": importlib.import_module(f"{alias}.{m.name}")
            for m in pkgutil.iter_modules([package_dir])}
    saved = {k: sys.modules.get(k) for k in [orig, *subs]}
    sys.modules.update({orig: mod, **subs})
    try:
        for name in getattr(mod, "__all__", []):
            setattr(mod, name, getattr(mod, name))
    finally:
        for k, m in saved.items():
            if m is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = m
    return mod


def default_plan(kernels, case: Case, device, fresh_kv: bool):
    """The DevicePlan vLLM's ION metadata builder makes once per step (host planner over
    host copies of query_start_loc / seq_lens, q-tile rows chosen per step)."""
    return kernels.make_device_plan(
        np.asarray(case.query_start_loc(), np.int32), np.asarray(case.kv_lens, np.int32),
        num_kv_heads=case.hkv, group_size=case.hq // case.hkv, head_dim=case.d,
        device=device, fresh_kv=fresh_kv, tile_m="auto",
        **({"window": case.window} if case.window else {}))


MODES = ("fused", "attn", "append")


def ion_backend(mode: str, kernels=None, plan=None) -> PrepareFn:
    """ION on its cache, the plan built once per case outside the timed region.

    ``mode``: "fused" -- what one vLLM layer runs by default: one launch writes the step's
    new K/V into the cache and attends (``key``/``value``, a ``fresh_kv`` plan); "attn" --
    attention alone over a cache that already holds them (like ``fa3``); "append" --
    ``kv_append`` of the new K/V, then attention (the layer without fused writeback).
    ``kernels``: a module with the ``cute_kernels`` API (default: ``import cute_kernels``).
    ``plan(kernels, case, device, fresh_kv)``: how the plan is made (default
    :func:`default_plan`; another checkout's ``make_device_plan`` may take other options)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: use one of {MODES}")
    make_plan = plan or default_plan

    def prepare(case: Case, rot: int, device, shared: dict) -> Prepared:
        import torch
        k = kernels
        if k is None:
            try:
                import cute_kernels as k
            except Exception as e:  # noqa: BLE001
                raise BackendUnavailable(f"cute_kernels import failed: {e!r}") from e
        if "plan" not in shared:
            shared["plan"] = make_plan(k, case, device, mode == "fused")
        q, kc, vc, bt = ion_cache(case, rot, device)
        qsl, seq_lens = _meta(case, device)
        out = torch.empty_like(q)
        kw = dict(plan=shared["plan"], **ion_features(case, k, device))
        if mode != "attn":
            key, value, slots = new_token_rows(case, rot, device)
        if mode == "fused":
            kw.update(key=key, value=value)

        def call():
            if mode == "append":
                k.kv_append(key, value, kc, vc, slots)
            return k.ion_attention(q, kc, vc, out, qsl, seq_lens, bt, case.d ** -0.5, **kw)

        return Prepared(call, out)

    return prepare


def ion_features(case: Case, kernels, device) -> dict:
    """``ion_attention`` keyword arguments of a case's model features (none: {})."""
    kw: dict = {}
    if case.window:
        kw["window"] = case.window
    if case.softcap:
        kw["softcap"] = case.softcap
    if case.sinks:
        kw["sinks_log2"] = kernels.sink_log2(case.sink_logits().to(device))
    return kw


def fa_features(case: Case, device) -> dict:
    """The same features as vLLM's FLASH_ATTN passes them to FA3."""
    kw: dict = {"window_size": (case.window - 1, 0) if case.window else (-1, -1)}
    if case.softcap:
        kw["softcap"] = case.softcap
    if case.sinks:
        kw["s_aux"] = case.sink_logits().to(device)
    return kw


def _fa_version(ver: int):
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        from vllm.vllm_flash_attn.flash_attn_interface import fa_version_unsupported_reason
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailable(f"vllm.vllm_flash_attn import failed: {e!r}") from e
    reason = fa_version_unsupported_reason(ver)
    if reason:
        raise BackendUnavailable(f"FA{ver} unsupported: {reason}")
    return flash_attn_varlen_func


def fa_backend(ver: int, layer: bool = False) -> PrepareFn:
    """``vllm.vllm_flash_attn.flash_attn_varlen_func(fa_version=ver)`` on the NHD cache, as
    vLLM's FLASH_ATTN backend calls it (FA3: scheduler metadata built once, outside the timed
    region, like the builder's ``aot_schedule``).  ``layer``: what one FLASH_ATTN layer
    launches, ``reshape_and_cache_flash`` of the step's new K/V rows, then FA3."""

    def prepare(case: Case, rot: int, device, shared: dict) -> Prepared:
        import torch
        fa = _fa_version(ver)
        q, kc, vc, bt = fa_cache(case, rot, device)
        qsl, seq_lens = _meta(case, device)
        out = torch.empty_like(q)
        feats = fa_features(case, device)
        if ver == 3 and "sched" not in shared:
            from vllm.vllm_flash_attn.flash_attn_interface import get_scheduler_metadata
            shared["sched"] = get_scheduler_metadata(
                batch_size=case.batch, max_seqlen_q=case.max_q, max_seqlen_k=case.max_kv,
                num_heads_q=case.hq, num_heads_kv=case.hkv, headdim=case.d,
                cache_seqlens=seq_lens, qkv_dtype=q.dtype, cu_seqlens_q=qsl,
                page_size=case.fa_page, causal=True,
                window_size=fa_features(case, device)["window_size"], num_splits=0)
        if layer:
            try:
                from vllm._custom_ops import reshape_and_cache_flash
            except Exception as e:  # noqa: BLE001
                raise BackendUnavailable(f"reshape_and_cache_flash import failed: {e!r}") from e
            key, value, slots = new_token_rows(case, rot, device, page=case.fa_page)
            one = torch.ones((), dtype=torch.float32, device=device)

        def call():
            if layer:
                reshape_and_cache_flash(key, value, kc, vc, slots, "auto", one, one)
            return fa(q=q, k=kc, v=vc, out=out, cu_seqlens_q=qsl, max_seqlen_q=case.max_q,
                      seqused_k=seq_lens, max_seqlen_k=case.max_kv,
                      softmax_scale=case.d ** -0.5, causal=True, block_table=bt,
                      scheduler_metadata=shared.get("sched"), fa_version=ver, num_splits=0,
                      **feats)

        return Prepared(call, out)

    return prepare


def prepare_triton(case: Case, rot: int, device, shared: dict) -> Prepared:
    """vLLM's TritonAttention kernel (``unified_attention``) on its cache, with the
    split-softmax buffers its metadata builder allocates (no cudagraph capture)."""
    import torch
    if case.window or case.softcap or case.sinks:
        raise BackendUnavailable("the triton entry runs plain causal attention only")
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailable(f"triton unified_attention import failed: {e!r}") from e
    q, kc, vc, bt = triton_cache(case, rot, device)
    qsl, seq_lens = _meta(case, device)
    out = torch.empty_like(q)
    if "bufs" not in shared:
        thr, segs, dpad = 128 // case.hkv, 16, 1 << (case.d - 1).bit_length()
        f32 = dict(dtype=torch.float32, device=device)
        shared["bufs"] = dict(
            seq_threshold_3D=thr, num_par_softmax_segments=segs,
            softmax_segm_output=torch.empty((thr, case.hq, segs, dpad), **f32),
            softmax_segm_max=torch.empty((thr, case.hq, segs), **f32),
            softmax_segm_expsum=torch.empty((thr, case.hq, segs), **f32))
        shared["descale"] = torch.ones(1, **f32).expand(case.batch, case.hkv)

    def call():
        return unified_attention(
            q=q, k=kc, v=vc, out=out, cu_seqlens_q=qsl, max_seqlen_q=case.max_q,
            seqused_k=seq_lens, max_seqlen_k=case.max_kv, softmax_scale=case.d ** -0.5,
            causal=True, window_size=(-1, -1), block_table=bt, softcap=0, q_descale=None,
            k_descale=shared["descale"], v_descale=shared["descale"], **shared["bufs"])

    return Prepared(call, out)


#: the public registry: add entries to A/B other kernels in the same run
BACKENDS: dict[str, PrepareFn] = {
    "ion": ion_backend("fused"),
    "ion-attn": ion_backend("attn"),
    "ion-append": ion_backend("append"),
    "fa3": fa_backend(3),
    "fa3-layer": fa_backend(3, layer=True),
    "fa4": fa_backend(4),
    "triton": prepare_triton,
}


# --------------------------------------------------------------------------- timing

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


def time_calls(calls: list[Callable[[], object]], iters: int, warmup: int) -> list[float]:
    """GPU time (µs) of each of ``iters`` calls, cycling through ``calls``, each bracketed by
    CUDA events.  A ``torch.cuda._sleep`` spacer, sized from the measured host enqueue cost,
    keeps the GPU busy until the host has queued every call, so host launch overhead does
    not leak into the GPU time."""
    import torch
    n = len(calls)
    for i in range(warmup):
        calls[i % n]()
    torch.cuda.synchronize()
    t0 = time.perf_counter()  # host enqueue cost per call, behind a spacer
    probe = min(10, iters)
    torch.cuda._sleep(_cycles_for_us(20_000))
    for i in range(probe):
        calls[i % n]()
    host_us = (time.perf_counter() - t0) * 1e6 / max(1, probe)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda._sleep(_cycles_for_us(min(1e6, 2.0 * iters * (host_us + 10.0) + 2000.0)))
    for i in range(iters):
        starts[i].record()
        calls[i % n]()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends)]


def interleave_calls(calls_by_backend: dict[str, list[Callable]]) -> list[Callable]:
    """One call list alternating backends call by call: rotation ``j`` of every backend, in
    order, then rotation ``j + 1`` (a backend with fewer rotations wraps around)."""
    n_rot = max(len(c) for c in calls_by_backend.values())
    return [c[j % len(c)] for j in range(n_rot) for c in calls_by_backend.values()]


def time_interleaved(calls_by_backend: dict[str, list[Callable]], iters: int,
                     warmup: int) -> dict[str, list[float]]:
    """``iters`` timed calls per backend in one queued stream that alternates the backends
    call by call, so every backend samples the same moments of the run (clock and power
    phases: sequential runs drifted 8-14% part-way through on the H200, bench/notes.md)."""
    names = list(calls_by_backend)
    ts = time_calls(interleave_calls(calls_by_backend), iters * len(names),
                    warmup * len(names))
    return {b: ts[i::len(names)] for i, b in enumerate(names)}


TIMINGS = ("interleaved", "queued")


def summarize_times(ts: list[float], n_rot: int, timing: str) -> dict:
    return {"median_us": statistics.median(ts), "p10_us": float(np.percentile(ts, 10)),
            "p90_us": float(np.percentile(ts, 90)), "min_us": min(ts),
            "mean_us": statistics.fmean(ts), "iters": len(ts), "rotations": n_rot,
            "timing": timing,
            # every timed call in order (call i ran rotation i % rotations)
            "iter_us": [round(t, 2) for t in ts]}


# --------------------------------------------------------------------------- ceilings

def measure_ceilings(device, iters: int = 20, copy_bytes: int = 1 << 30,
                     gemm_n: int = 8192) -> dict:
    """Device-to-device copy bandwidth (bytes read + written / time) and bf16 GEMM
    throughput (``gemm_n``^3 torch.matmul on random data), same process, same GPU."""
    import torch
    src = torch.randn(copy_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_us = statistics.median(time_calls([lambda: dst.copy_(src)], iters, 3))
    del src, dst
    a, b, c = (torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device=device)
               for _ in range(3))
    gemm_us = statistics.median(time_calls([lambda: torch.matmul(a, b, out=c)], iters, 3))
    del a, b, c
    torch.cuda.empty_cache()
    return {"copy_gbps": 2 * copy_bytes / (copy_us * 1e-6) / 1e9, "copy_bytes": 2 * copy_bytes,
            "copy_us": copy_us, "gemm_tflops": 2 * gemm_n ** 3 / (gemm_us * 1e-6) / 1e12,
            "gemm_n": gemm_n, "gemm_us": gemm_us}


# --------------------------------------------------------------------------- driver

def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in fp32; inf when ``out`` holds a non-finite value (the
    output is NaN-poisoned before the checked call, so a row never written shows up)."""
    import torch
    o, r = out.float(), ref.float()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def reference_output(case: Case, device, reference=None):
    """fp32 attention of rotation 0's logical data (``cute_kernels.reference_paged_attention``
    over the ION cache, or ``reference`` with its signature)."""
    if reference is None:
        from cute_kernels import reference_paged_attention as reference
    q, kc, vc, bt = ion_cache(case, 0, device)
    qsl, seq_lens = _meta(case, device)
    feats = {}
    if case.window:
        feats["window"] = case.window
    if case.softcap:
        feats["softcap"] = case.softcap
    if case.sinks:
        feats["sinks"] = case.sink_logits().to(device)
    return reference(q, kc, vc, qsl, seq_lens, bt, case.d ** -0.5, **feats)


def prepare_checked(case: Case, backend: str, device, ref, l2_bytes: int = H200_L2_BYTES
                    ) -> tuple[list[Prepared], float]:
    """Every rotation of one backend on one case, and rotation 0's relative error against
    ``ref`` from one call on a NaN-poisoned output."""
    import torch
    shared: dict = {}
    preps = [BACKENDS[backend](case, r, device, shared)
             for r in range(rotations(case, l2_bytes))]
    preps[0].out.fill_(float("nan"))
    preps[0].call()
    torch.cuda.synchronize()
    return preps, rel_err(preps[0].out, ref)


def _time_group(calls: dict[str, list[Callable]], iters: int, warmup: int, timing: str,
                log) -> dict[str, dict | Exception]:
    """Time the prepared backends of one case: interleaved in one stream, or (``queued``,
    or when the joint run fails) one after the other.  Per backend its summary or error."""
    import torch
    if timing == "interleaved" and len(calls) > 1:
        try:
            ts = time_interleaved(calls, iters, warmup)
            return {b: dict(summarize_times(ts[b], len(calls[b]), "interleaved"),
                            interleaved_with=list(calls)) for b in calls}
        except Exception as e:  # noqa: BLE001 - time each alone, keep the rest
            log(f"[kernel] interleaved timing failed ({type(e).__name__}: {e}); "
                "timing each backend alone")
            torch.cuda.synchronize()
    res: dict[str, dict | Exception] = {}
    for b, c in calls.items():
        try:
            res[b] = summarize_times(time_calls(c, iters, warmup), len(c), "queued")
        except Exception as e:  # noqa: BLE001
            res[b] = e
    return res


def run_kernel_suite(cases: list[Case], backends: list[str], *, iters: int = 60,
                     warmup: int = 10, device: str = "cuda", ceilings: dict | None = None,
                     suite_label: str = "", log=print, on_record=None,
                     l2_bytes: int = H200_L2_BYTES, timing: str = "interleaved",
                     reference=None, tol: float = REL_TOL) -> list[dict]:
    """Time every (case, backend) of ``BACKENDS``; never raises for a backend failure (the
    record's ``status`` is then "skipped": unavailable, or "error").  A backend whose first
    output misses the fp32 reference by more than ``tol`` is timed, with status "wrong".

    ``timing``: "interleaved" prepares every backend of a case, then times them in one
    stream alternating call by call; "queued" prepares and times one backend at a time."""
    import torch
    if timing not in TIMINGS:
        raise ValueError(f"timing {timing!r}: use one of {', '.join(TIMINGS)}")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise KeyError(f"unknown kernel backend(s) {unknown}; known: {', '.join(BACKENDS)}")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    ceil = ceilings or {}
    records: list[dict] = []
    unavailable: dict[str, str] = {}

    def note(rec: dict, e: Exception) -> None:
        skipped = isinstance(e, BackendUnavailable)
        if skipped:
            unavailable[rec["backend"]] = str(e)
        rec.update(status="skipped" if skipped else "error",
                   error=str(e) if skipped else f"{type(e).__name__}: {e}")
        if not skipped and e.__traceback__ is not None:
            rec["traceback"] = "".join(traceback.format_exception(e, limit=8))
        log(f"[kernel] {rec['case']:<44} {rec['backend']:<10} {rec['status']}: {rec['error']}")

    for case in cases:
        ref = reference_output(case, dev, reference)
        recs = {b: {"suite": "kernel", "case": case.name, "backend": b,
                    "bytes": min_bytes(case), "flops": flops(case), "shape": case.to_dict(),
                    **({"kernel_suite": suite_label} if suite_label else {})}
                for b in backends}
        for group in ([backends] if timing == "interleaved" else [[b] for b in backends]):
            prepared: dict[str, list[Prepared]] = {}
            for b in group:
                if b in unavailable:
                    recs[b].update(status="skipped", error=unavailable[b])
                    continue
                try:
                    prepared[b], recs[b]["rel_err"] = prepare_checked(case, b, dev, ref,
                                                                      l2_bytes)
                except Exception as e:  # noqa: BLE001 - one failure must not end the run
                    note(recs[b], e)
            results = _time_group({b: [p.call for p in ps] for b, ps in prepared.items()},
                                  iters, warmup, timing, log)
            for b, res in results.items():
                if isinstance(res, Exception):
                    note(recs[b], res)
                else:
                    _finish(recs[b], res, ceil, tol, log)
            del prepared
            torch.cuda.empty_cache()
        for b in backends:
            records.append(recs[b])
            if on_record:
                on_record(records)
    return records


def _finish(rec: dict, res: dict, ceil: dict, tol: float, log) -> None:
    sec = res["median_us"] * 1e-6
    rec.update(res, status="ok" if rec["rel_err"] <= tol else "wrong",
               achieved_gbps=rec["bytes"] / sec / 1e9,
               achieved_tflops=rec["flops"] / sec / 1e12)
    rec["frac_copy_bw"] = (rec["achieved_gbps"] / ceil["copy_gbps"]
                           if ceil.get("copy_gbps") else None)
    rec["frac_gemm"] = (rec["achieved_tflops"] / ceil["gemm_tflops"]
                        if ceil.get("gemm_tflops") else None)
    fb, fg = ("n/a" if rec[k] is None else f"{rec[k]:.2f}" for k in ("frac_copy_bw", "frac_gemm"))
    log(f"[kernel] {rec['case']:<44} {rec['backend']:<10} {res['median_us']:10.1f} us "
        f"(p10 {res['p10_us']:.1f} p90 {res['p90_us']:.1f}, rot {res['rotations']}) "
        f"{rec['achieved_gbps']:7.1f} GB/s bw={fb} gemm={fg} rel_err={rec['rel_err']:.1e}"
        + ("" if rec["status"] == "ok" else f" WRONG (tol {tol:g})"))
