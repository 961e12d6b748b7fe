"""Reference (fp32, plain PyTorch) paged attention and KV append.

This module is THE single source of truth every test, sweep and bench compares
against.  It implements exactly the semantics of ``docs/contract.md``:

* ``q``: ``[total_q, Hq, D]``; rows of request ``b`` are
  ``query_start_loc[b]:query_start_loc[b+1]``.  Rows past ``query_start_loc[-1]``
  (padding) belong to no request.
* ``k_cache`` / ``v_cache``: ``[num_blocks, Hkv, P, D]`` (HND pages).
* ``seq_lens[b]``: total KV length of request ``b`` including its new tokens.
* causal: new token ``i`` of request ``b`` (``q_len`` new tokens, ``L`` KV) sits at
  position ``L - q_len + i`` and attends to KV positions ``0 ..= L - q_len + i``.
* GQA: q head ``hq`` reads KV head ``hq // (Hq // Hkv)``.
* Optional, as vLLM's layers pass them: a sliding ``window`` of W tokens (a query at
  position p attends ``max(0, p - W + 1) ..= p``, FlashAttention's ``window_size=(W - 1,
  0)``); a logits soft cap (``cap * tanh(s / cap)`` on the scaled scores, before masking);
  per-q-head attention ``sinks`` (a logit that joins the softmax denominator with a zero
  value, as gpt-oss learns it).
* fp8 KV cache (vLLM's ``fp8`` = ``fp8_e4m3``): caches of ``torch.float8_e4m3fn`` with one
  scale per tensor, ``k = k_scale * float(k_fp8)``; a new token's K is stored as
  ``quantize_kv(k, k_scale)`` (divide, saturate to +-448, round to nearest even).

It runs on any device (CPU included) and never imports vLLM or the CuTe kernels.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Union

import torch

__all__ = ["reference_paged_attention", "reference_kv_append", "relative_error",
    "written_rows_mask", "make_paged_case", "new_token_slot_mapping", "PagedCase",
    "quantize_kv", "dequantize_kv", "FP8_KV_DTYPE", "FP8_MAX"]

#: the fp8 KV-cache format (vLLM's ``fp8`` / ``fp8_e4m3``): e4m3, finite values only
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0

# Upper bound on the number of fp32 score elements materialised at once per
# request chunk (keeps 2k x 32k x 32-head prefills in a few hundred MiB).
_MAX_SCORE_ELEMS = 1 << 26


def _as_list(t: Union[torch.Tensor, Sequence[int]]) -> list:
    if isinstance(t, torch.Tensor):
        return [int(x) for x in t.detach().cpu().tolist()]
    return [int(x) for x in t]


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` in fp32, saturated to +-FP8_MAX, rounded to the nearest e4m3 value."""
    if not scale > 0:
        raise ValueError(f"KV scale must be > 0, got {scale}")
    return (x.float() / float(scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``scale * float(x)`` (exact in fp32), then cast to ``dtype``."""
    return (x.float() * float(scale)).to(dtype)


def _kv_scales(cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales a cache's values are multiplied by: (1, 1) unless it is fp8."""
    if cache.dtype == FP8_KV_DTYPE:
        return float(k_scale), float(v_scale)
    if cache.dtype.is_floating_point and cache.dtype.itemsize == 1:
        raise ValueError(f"fp8 KV caches are {FP8_KV_DTYPE} (e4m3), got {cache.dtype}")
    if k_scale != 1.0 or v_scale != 1.0:
        raise ValueError(f"k_scale / v_scale apply to fp8 caches only (cache is {cache.dtype})")
    return 1.0, 1.0


def _check_shapes(q, k_cache, v_cache, query_start_loc, seq_lens, block_table):
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache/v_cache must both be [num_blocks, Hkv, P, D], got "
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    total_q, hq, d = q.shape
    _, hkv, _, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head dim mismatch: q {d} vs cache {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    b = seq_lens.shape[0]
    if query_start_loc.shape[0] != b + 1:
        raise ValueError("query_start_loc must have B+1 entries")
    if block_table.dim() != 2 or block_table.shape[0] < b:
        raise ValueError("block_table must be [B, max_pages]")


def reference_paged_attention(q: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor,
                              query_start_loc: torch.Tensor,
                              seq_lens: torch.Tensor,
                              block_table: torch.Tensor,
                              softmax_scale: float,
                              compute_dtype: torch.dtype = torch.float32,
                              k_scale: float = 1.0, v_scale: float = 1.0,
                              window: Optional[int] = None,
                              softcap: Optional[float] = None,
                              sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal varlen paged GQA attention, computed in fp32.

    ``window`` (tokens, >= 1), ``softcap`` (> 0) and ``sinks`` (``[Hq]`` logits) are the
    optional features of the module docstring; None (or a soft cap of 0) leaves each out.

    Returns an fp32 tensor ``[total_q, Hq, D]`` on ``q.device``.  Rows that no
    request writes (padding rows after ``query_start_loc[-1]`` and rows of
    requests with ``seq_lens == 0``) are zero; use :func:`written_rows_mask`
    to select the rows a kernel must write.

    ``compute_dtype=q.dtype`` (bf16 / fp16) computes the same function the way plain
    PyTorch does in that dtype: both products in it, the softmax in fp32 rounded back
    to it (FlashAttention's ``attention_ref(upcast=False)``).  Its error against the
    fp32 result is the yardstick a kernel's error is judged by.

    fp8 caches are dequantized with ``k_scale`` / ``v_scale`` (in fp32, then cast to
    ``compute_dtype``): the output is attention over the K/V the cache holds.
    """
    _check_shapes(q, k_cache, v_cache, query_start_loc, seq_lens, block_table)
    ks, vs = _kv_scales(k_cache, k_scale, v_scale)
    total_q, hq, d = q.shape
    _, hkv, page, _ = k_cache.shape
    g = hq // hkv
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    if softcap is not None and softcap < 0:
        raise ValueError(f"softcap must be > 0 (0: none), got {softcap}")
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must be [Hq]={hq} logits, got {tuple(sinks.shape)}")
    # sink logits per (KV head, group member), shaped to join the scores' last dim
    sink = None if sinks is None else \
        sinks.detach().float().to(q.device).reshape(hkv, g, 1, 1)
    qsl = _as_list(query_start_loc)
    lens = _as_list(seq_lens)
    if qsl[0] != 0:
        raise ValueError("query_start_loc[0] must be 0")
    if qsl[-1] > total_q:
        raise ValueError(f"query_start_loc[-1]={qsl[-1]} > total_q={total_q}")
    bt = block_table.detach()
    out = torch.zeros(total_q, hq, d, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        q_len = end - start
        if q_len < 0:
            raise ValueError("query_start_loc must be non-decreasing")
        if q_len == 0 or seq_len == 0:
            continue
        if seq_len < q_len:
            raise ValueError(
                f"request {b}: seq_len {seq_len} < q_len {q_len} (contract violation)")
        n_pages = (seq_len + page - 1) // page
        if n_pages > bt.shape[1]:
            raise ValueError(f"request {b}: needs {n_pages} pages, block_table has "
                             f"{bt.shape[1]}")
        pages = bt[b, :n_pages].to(device=k_cache.device, dtype=torch.long)
        # Gather logical pages -> contiguous [Hkv, L, D] (fp32).
        k = dequantize_kv(k_cache.index_select(0, pages).permute(1, 0, 2, 3).reshape(
            hkv, n_pages * page, d)[:, :seq_len].to(q.device), ks, compute_dtype)
        v = dequantize_kv(v_cache.index_select(0, pages).permute(1, 0, 2, 3).reshape(
            hkv, n_pages * page, d)[:, :seq_len].to(q.device), vs, compute_dtype)
        # q rows of this request grouped per KV head: [Hkv, G, q_len, D].
        qb = q[start:end].to(compute_dtype).reshape(q_len, hkv, g, d).permute(1, 2, 0, 3)
        first_pos = seq_len - q_len
        kv_pos = torch.arange(seq_len, device=q.device)
        chunk = max(1, _MAX_SCORE_ELEMS // max(1, hq * seq_len))
        for c0 in range(0, q_len, chunk):
            c1 = min(q_len, c0 + chunk)
            q_pos = first_pos + torch.arange(c0, c1, device=q.device)
            # [Hkv, G, c, L]
            s = torch.einsum("hgid,hld->hgil", qb[:, :, c0:c1], k) * float(softmax_scale)
            if softcap:
                s = (softcap * torch.tanh(s.float() / softcap)).to(s.dtype)
            masked = kv_pos[None, :] > q_pos[:, None]  # [c, L]
            if window is not None:
                masked |= kv_pos[None, :] <= q_pos[:, None] - window
            s = s.masked_fill(masked, float("-inf")).float()
            if sink is not None:  # one more logit per row, with a zero value
                s = torch.cat([s, sink.expand(-1, -1, c1 - c0, 1)], dim=-1)
            p = torch.softmax(s, dim=-1)[..., :seq_len].to(compute_dtype)
            o = torch.einsum("hgil,hld->hgid", p, v)  # [Hkv, G, c, D]
            out[start + c0:start + c1] = o.permute(2, 0, 1, 3).reshape(c1 - c0, hq, d).float()
    return out


def reference_kv_append(key: torch.Tensor, value: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the paged caches in place.

    Token ``i`` goes to page ``slot // P``, offset ``slot % P``; negative slots
    are skipped.  Only the first ``len(slot_mapping)`` tokens are considered.
    fp8 caches get ``quantize_kv(key, k_scale)`` / ``quantize_kv(value, v_scale)``.
    """
    ks, vs = _kv_scales(k_cache, k_scale, v_scale)
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError("key/value must both be [T, Hkv, D]")
    _, hkv, page, d = k_cache.shape
    if key.shape[1] != hkv or key.shape[2] != d:
        raise ValueError(f"key {tuple(key.shape)} does not match cache {tuple(k_cache.shape)}")
    n = slot_mapping.shape[0]
    if n > key.shape[0]:
        raise ValueError("slot_mapping longer than key")
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    idx = torch.nonzero(keep, as_tuple=False).flatten()
    if idx.numel() == 0:
        return
    s = slots[idx]
    if int(s.max()) >= k_cache.shape[0] * page:
        raise ValueError("slot out of range")
    pg, off = s // page, s % page
    src_idx = idx.to(key.device)
    k_new = key.index_select(0, src_idx).to(k_cache.device)
    v_new = value.index_select(0, src_idx).to(v_cache.device)
    if k_cache.dtype == FP8_KV_DTYPE:
        k_new, v_new = quantize_kv(k_new, ks), quantize_kv(v_new, vs)
    k_cache[pg, :, off, :] = k_new.to(k_cache.dtype)
    v_cache[pg, :, off, :] = v_new.to(v_cache.dtype)


def relative_error(out: torch.Tensor, ref: torch.Tensor,
                   mask: Optional[torch.Tensor] = None) -> float:
    """``||out - ref|| / ||ref||`` in fp32 (optionally over rows ``mask``).

    NaN/inf in ``out`` propagate (the result is then NaN/inf, which fails
    every ``<= tol`` comparison).
    """
    o = out.detach().to(torch.float32)
    r = ref.detach().to(device=o.device, dtype=torch.float32)
    if mask is not None:
        m = mask.to(o.device)
        o, r = o[m], r[m]
    if r.numel() == 0:
        return 0.0
    den = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(o - r).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def written_rows_mask(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      total_q: int) -> torch.Tensor:
    """Bool ``[total_q]`` (CPU): True for rows the kernel must write."""
    qsl = _as_list(query_start_loc)
    lens = _as_list(seq_lens)
    mask = torch.zeros(total_q, dtype=torch.bool)
    for b, seq_len in enumerate(lens):
        if seq_len > 0 and qsl[b + 1] > qsl[b]:
            mask[qsl[b]:qsl[b + 1]] = True
    return mask


class PagedCase(NamedTuple):
    """Unpacks as ``q, k_cache, v_cache, qsl, seq_lens, block_table``."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor


def _generator(rng: Union[int, torch.Generator, None],
               rng_device: Union[str, torch.device] = "cpu") -> torch.Generator:
    if isinstance(rng, torch.Generator):
        return rng
    gen = torch.Generator(device=rng_device)
    gen.manual_seed(0 if rng is None else int(rng))
    return gen


def make_paged_case(rng: Union[int, torch.Generator, None],
                    q_lens: Sequence[int], seq_lens: Sequence[int],
                    Hq: int, Hkv: int, D: int, page: int = 64,
                    dtype: torch.dtype = torch.bfloat16,
                    device: Union[str, torch.device] = "cpu",
                    spare_pages: Optional[int] = None,
                    pad_rows: int = 0,
                    extra_table_cols: int = 2,
                    rng_device: Union[str, torch.device] = "cpu",
                    kv_scales: Optional[tuple[float, float]] = None) -> PagedCase:
    """Random paged-attention inputs (deterministic given ``rng``).

    * every tensor value is ``randn`` (never zeros), generated from ``rng`` (an
      int seed, used on ``rng_device`` -- the CPU by default, so values do not
      depend on ``device`` -- or a ``torch.Generator``) and moved to ``device``;
      pass ``rng_device=device`` for fast generation of big CUDA cases;
    * physical pages are a random permutation; ``spare_pages`` extra pages of
      garbage (default: max(4, used/4)) are never referenced by the used part
      of the block table, so reading a wrong page is detected;
    * block table entries past each request's last page (and ``extra_table_cols``
      extra columns) hold random *valid* page ids of other data;
    * ``pad_rows`` extra q rows after ``query_start_loc[-1]`` (belonging to no
      request, as in a padded CUDA-graph batch);
    * ``kv_scales=(k_scale, v_scale)``: fp8 caches holding ``quantize_kv(randn, scale)``
      (a scale under 1/100 also saturates a few values); q stays ``dtype``.
    """
    q_lens = [int(x) for x in q_lens]
    seq_lens = [int(x) for x in seq_lens]
    if len(q_lens) != len(seq_lens) or not q_lens:
        raise ValueError("q_lens and seq_lens must be non-empty and of equal length")
    for ql, sl in zip(q_lens, seq_lens):
        if ql < 0 or sl < 0:
            raise ValueError("negative length")
        if sl > 0 and sl < ql:
            raise ValueError(f"seq_len {sl} < q_len {ql}")
        if sl == 0 and ql != 0:
            raise ValueError("a request with seq_len 0 cannot have new tokens")
    if Hq % Hkv:
        raise ValueError("Hq must be a multiple of Hkv")
    gen = _generator(rng, rng_device)
    gdev = gen.device
    pages_per_req = [(sl + page - 1) // page for sl in seq_lens]
    used = sum(pages_per_req)
    if spare_pages is None:
        spare_pages = max(4, used // 4)
    num_blocks = used + spare_pages
    max_pages = max(1, max(pages_per_req)) + extra_table_cols
    perm = torch.randperm(num_blocks, generator=gen, device=gdev).cpu()
    bt = torch.randint(0, num_blocks, (len(q_lens), max_pages), generator=gen,
                       dtype=torch.int64, device=gdev).cpu()
    pos = 0
    for b, n in enumerate(pages_per_req):
        bt[b, :n] = perm[pos:pos + n]
        pos += n
    total_q = sum(q_lens) + pad_rows
    q = torch.randn(total_q, Hq, D, generator=gen, dtype=torch.float32,
                    device=gdev).to(dtype)
    k_cache = torch.randn(num_blocks, Hkv, page, D, generator=gen,
                          dtype=torch.float32, device=gdev)
    v_cache = torch.randn(num_blocks, Hkv, page, D, generator=gen,
                          dtype=torch.float32, device=gdev)
    if kv_scales is None:
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    else:
        k_cache = quantize_kv(k_cache, kv_scales[0])
        v_cache = quantize_kv(v_cache, kv_scales[1])
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int64), 0).to(torch.int32)
    return PagedCase(q.to(device), k_cache.to(device), v_cache.to(device),
                     qsl.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                     bt.to(torch.int32).to(device))


def new_token_slot_mapping(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_table: torch.Tensor, page: int,
                           total_q: Optional[int] = None) -> torch.Tensor:
    """int64 ``[total_q]`` slots of the new tokens (``-1`` for padding rows).

    New token ``i`` of request ``b`` sits at position ``L - q_len + i`` and goes
    to ``block_table[b, pos // P] * P + pos % P``.
    """
    qsl = _as_list(query_start_loc)
    lens = _as_list(seq_lens)
    bt = block_table.detach().cpu().to(torch.int64)
    n = qsl[-1] if total_q is None else int(total_q)
    slots = torch.full((n,), -1, dtype=torch.int64)
    for b, seq_len in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        q_len = end - start
        if q_len == 0 or seq_len == 0:
            continue
        posn = torch.arange(seq_len - q_len, seq_len, dtype=torch.int64)
        slots[start:end] = bt[b, posn // page] * page + posn % page
    return slots.to(query_start_loc.device)


def default_softmax_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)
