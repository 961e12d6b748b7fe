"""Helpers shared by the GPU tests of the attention kernel (imported by test modules; this
file holds no tests): random mixed batches, the NaN-poison + fp32-reference output check,
a planner cost model that forces split-KV, the GQA head shapes to sweep, a paged case with
its reference (with the step's new K/V for the fused-writeback call), plans with or without
forced splits, and checked launches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cute_kernels.reference import relative_error

#: output tolerance against the fp32 reference (rel. Frobenius error over rows with work)
TOL = 1e-2
#: planner cost-model overrides that make split-KV look free, so tests exercise it
CHEAP_SPLIT = dict(item_overhead_us=0.01, split_item_overhead_us=0.0, combine_launch_us=0.0)
#: (q heads, KV heads): GQA ratio 7 (padded to 8), 8 and 1
HEADS = [(28, 4), (32, 4), (4, 4)]
HEAD_IDS = ["g7", "g8", "g1"]


#: cached-context lengths of the long chunks random_mixed_batch adds (page boundaries of
#: 64- and 128-token pages included)
LONG_CTX = (0, 1, 37, 64, 100, 127, 128, 1000)


#: new-token counts of the page-boundary rows random_mixed_batch draws (64/128-row q-tile
#: boundaries and their neighbours)
BOUNDARY_Q = (1, 8, 9, 63, 64, 65, 127, 128, 129)


def _long_q_any(rng) -> int:
    return int(rng.integers(200, 700))


def random_mixed_batch(rng, n_long: int, page: int, long_ctx=LONG_CTX,
                       boundary_q=BOUNDARY_Q, long_q=_long_q_any):
    """(q_lens, seq_lens) of a random mixed step: decode rows, prefill chunks whose cached
    prefix is not a page multiple, rows with 0 new tokens, fresh prefills, lengths at page
    boundaries with new-token counts from ``boundary_q``, plus ``n_long`` long prefill
    chunks of ``long_q(rng)`` new tokens whose cached context is drawn from ``long_ctx``."""
    q_lens, seq_lens = [], []
    for _ in range(int(rng.integers(3, 8))):
        kind = int(rng.integers(0, 5))
        if kind == 0:  # decode
            ql, L = 1, int(rng.integers(1, 900))
        elif kind == 1:  # prefill chunk, ctx not a page multiple
            ql = int(rng.integers(2, 300))
            L = ql + int(rng.integers(1, 400))
        elif kind == 2:  # 0 new tokens
            ql, L = 0, int(rng.integers(0, 200))
        elif kind == 3:  # fresh prefill
            ql = int(rng.integers(1, 250))
            L = ql
        else:  # page boundary lengths
            L = page * int(rng.integers(1, 6)) + int(rng.integers(-1, 2))
            ql = int(min(L, rng.choice(list(boundary_q))))
        q_lens.append(ql)
        seq_lens.append(L)
    for _ in range(n_long):
        ql = long_q(rng)
        ctx = int(rng.choice(list(long_ctx)))
        pos = int(rng.integers(0, len(q_lens) + 1))
        q_lens.insert(pos, ql)
        seq_lens.insert(pos, ql + ctx)
    return q_lens, seq_lens


def check_out(out, ref, mask, what: str, tol: float = TOL) -> float:
    """``out`` was NaN-poisoned before the launch: rows with work must be finite and within
    ``tol`` of the fp32 reference, rows without work must still be NaN."""
    m = mask.to(out.device)
    assert not torch.isnan(out[m]).any(), f"{what}: NaN in a written row"
    assert torch.isnan(out[~m]).all(), f"{what}: a row without work written"
    err = relative_error(out, ref, mask)
    assert err <= tol, f"{what}: rel err {err:.3e}"
    return err


@dataclass
class ReferenceCase:
    """Fresh random paged inputs (``cute_kernels.reference.make_paged_case``) with their
    fp32 reference output, the mask of rows with work, and host copies of the metadata."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scale: float
    ref: torch.Tensor
    mask: torch.Tensor
    qsl_h: object
    sl_h: object


def reference_case(seed, q_lens, seq_lens, *, hq: int, hkv: int, d: int, dtype, page: int,
                   pad_rows: int = 0, device="cuda") -> ReferenceCase:
    from cute_kernels.reference import (
        default_softmax_scale,
        make_paged_case,
        reference_paged_attention,
        written_rows_mask,
    )

    q, k_cache, v_cache, qsl, sl, bt = make_paged_case(
        seed, q_lens, seq_lens, hq, hkv, d, page=page, dtype=dtype, device=device,
        pad_rows=pad_rows)
    scale = default_softmax_scale(d)
    ref = reference_paged_attention(q, k_cache, v_cache, qsl, sl, bt, scale)
    return ReferenceCase(q, k_cache, v_cache, qsl, sl, bt, scale, ref,
                         written_rows_mask(qsl, sl, q.shape[0]), qsl.cpu().numpy(),
                         sl.cpu().numpy())


@dataclass
class FusedReferenceCase(ReferenceCase):
    """A ``ReferenceCase`` for the fused-writeback call: the step's new K/V (``key`` /
    ``value``, fresh random values), the caches the reference append makes of them
    (``ref_k`` / ``ref_v``) and the reference output over those; ``page`` is the cache's
    page size."""
    key: torch.Tensor
    value: torch.Tensor
    ref_k: torch.Tensor
    ref_v: torch.Tensor
    page: int


def fused_reference_case(seed, key_seed, q_lens, seq_lens, *, hq: int, hkv: int, d: int,
                         dtype, page: int, pad_rows: int = 0,
                         device="cuda") -> FusedReferenceCase:
    """Fresh random paged inputs (``make_paged_case(seed, ...)``) plus the step's new K/V
    drawn on the CPU from ``torch.Generator().manual_seed(key_seed)``, appended by the
    reference into copies of the caches; the reference output attends over those."""
    from cute_kernels.reference import (
        default_softmax_scale,
        make_paged_case,
        new_token_slot_mapping,
        reference_kv_append,
        reference_paged_attention,
        written_rows_mask,
    )

    q, k_cache, v_cache, qsl, sl, bt = make_paged_case(
        seed, q_lens, seq_lens, hq, hkv, d, page=page, dtype=dtype, device=device,
        pad_rows=pad_rows)
    total_q = q.shape[0]
    gen = torch.Generator().manual_seed(key_seed)
    key = torch.randn(total_q, hkv, d, generator=gen).to(device, dtype)
    value = torch.randn(total_q, hkv, d, generator=gen).to(device, dtype)
    scale = default_softmax_scale(d)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference_kv_append(key, value, ref_k, ref_v,
                        new_token_slot_mapping(qsl, sl, bt, page, total_q=total_q))
    ref = reference_paged_attention(q, ref_k, ref_v, qsl, sl, bt, scale)
    return FusedReferenceCase(q, k_cache, v_cache, qsl, sl, bt, scale, ref,
                              written_rows_mask(qsl, sl, total_q), qsl.cpu().numpy(),
                              sl.cpu().numpy(), key, value, ref_k, ref_v, page)


def check_cache_written(case: FusedReferenceCase) -> None:
    """The caches equal the reference append at every position < seq_len of every request
    (bit for bit)."""
    bt_h = case.block_table.cpu()
    P = case.page
    for b, L in enumerate(case.sl_h.tolist()):
        for pos in range(L):
            blk, row = int(bt_h[b, pos // P]), pos % P
            assert torch.equal(case.k_cache[blk, :, row], case.ref_k[blk, :, row]), (b, pos)
            assert torch.equal(case.v_cache[blk, :, row], case.ref_v[blk, :, row]), (b, pos)


def device_plan(qsl_h, sl_h, *, hkv: int, group_size: int, head_dim: int, page: int = 64,
                force_split: bool = False, device="cuda", **plan_options):
    """``make_device_plan`` with the ``CHEAP_SPLIT`` cost model when ``force_split`` (most
    long tiles split), else the default one; ``plan_options``: any other option."""
    from cute_kernels.attention import make_device_plan
    from cute_kernels.planner import CostModel

    extra = CHEAP_SPLIT if force_split else {}
    return make_device_plan(qsl_h, sl_h, num_kv_heads=hkv, group_size=group_size,
                            page_size=page, head_dim=head_dim, device=device,
                            cost_model=CostModel(head_dim=head_dim, **extra), **plan_options)


def launch_checked(case: ReferenceCase, plan, what: str, attention=None) -> torch.Tensor:
    """Launch ``plan`` on ``case`` into a NaN-poisoned output and ``check_out`` it against
    the reference; returns the output.  ``attention``: ``cute_kernels.ion_attention`` by
    default (tests of this helper pass another)."""
    if attention is None:
        from cute_kernels.attention import ion_attention as attention
    out = torch.full_like(case.q, float("nan"))
    attention(case.q, case.k_cache, case.v_cache, out, case.qsl, case.seq_lens,
              case.block_table, case.scale, plan=plan)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    check_out(out, case.ref, case.mask, what)
    return out


def launch_fused_checked(case: FusedReferenceCase, plan, what: str,
                         attention=None) -> torch.Tensor:
    """The fused-writeback launch of ``plan`` on ``case`` (``key=`` / ``value=``) into a
    NaN-poisoned output: ``check_out`` against the reference, then ``check_cache_written``.
    Returns the output; ``attention`` as for ``launch_checked``."""
    if attention is None:
        from cute_kernels.attention import ion_attention as attention
    out = torch.full_like(case.q, float("nan"))
    attention(case.q, case.k_cache, case.v_cache, out, case.qsl, case.seq_lens,
              case.block_table, case.scale, plan=plan, key=case.key, value=case.value)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    check_out(out, case.ref, case.mask, what)
    check_cache_written(case)
    return out


def check_agree(out_a, out_b, mask, what: str, tol: float = TOL) -> float:
    """Two launches of one case agree to ``tol`` on the rows with work."""
    agree = relative_error(out_a, out_b.float(), mask)
    assert agree <= tol, f"{what}: rel diff {agree:.3e}"
    return agree


def mixed_batch_with_long_decode(rng, trial: int, page: int):
    """``random_mixed_batch`` with ``1 + trial % 2`` long chunks, plus one decode row of
    9k-30k tokens, so that every batch has at least one long split row."""
    q_lens, seq_lens = random_mixed_batch(rng, n_long=1 + trial % 2, page=page)
    q_lens.append(1)
    seq_lens.append(int(rng.integers(9000, 30000)))
    return q_lens, seq_lens


def poison(plan, out) -> None:
    """NaN into the split-KV workspace and the output before a launch: a partial read before
    it is written, or a row written that has no work, then shows up as NaN."""
    plan.partial_o.fill_(float("nan"))
    plan.partial_lse.fill_(float("nan"))
    out.fill_(float("nan"))


def forced_split_plan(qsl_h, sl_h, *, hkv: int, group_size: int, head_dim: int,
                      tile_m: int = 64, page: int = 64, **plan_options):
    """``make_device_plan`` on the GPU with unpacked prefill tiles and the ``CHEAP_SPLIT``
    cost model, so that most tiles split: the plan the combine tests compare kernels on.
    ``plan_options``: the combine switches (``row_combine``, ``pdl_combine``,
    ``lane_combine``) and any other ``make_device_plan`` option."""
    return device_plan(qsl_h, sl_h, hkv=hkv, group_size=group_size, head_dim=head_dim,
                       page=page, force_split=True, unpacked_prefill=True, tile_m=tile_m,
                       **plan_options)


#: persistent grid and split-KV workspace of the plan-reuse and CUDA-graph tests (two CTAs
#: per SM of a 132-SM H100/H200, 256 partial rows a CTA, as the vLLM backend sizes them)
REUSE_CTAS = 264
REUSE_PARTIAL_ROWS = 256 * REUSE_CTAS


def forced_split_host_plan(qsl, sl, *, hkv: int, group_size: int, head_dim: int,
                           page: int = 64, fresh_kv: bool = False):
    """The host planner's plan of a batch with cheap splitting (``CHEAP_SPLIT``, up to 16
    splits) on the ``REUSE_CTAS`` grid, for uploading into a ``reusable_device_plan``."""
    from cute_kernels.planner import CostModel, plan

    return plan(qsl.cpu().numpy(), sl.cpu().numpy(), num_kv_heads=hkv, group_size=group_size,
                page_size=page, num_ctas=REUSE_CTAS, max_splits=16,
                max_partial_rows=REUSE_PARTIAL_ROWS,
                cost_model=CostModel(head_dim=head_dim, **CHEAP_SPLIT), fresh_kv=fresh_kv)


def reusable_device_plan(host_plan, head_dim: int, **options):
    """A ``DevicePlan`` with 4x the items ``host_plan`` needs that always launches the combine,
    so later plans can be uploaded into the same buffers (as the vLLM backend does, and as a
    captured CUDA graph needs); ``host_plan`` is uploaded.  Split groups get as much room as
    items (a group holds at least one item): shorter rows can split into more groups than
    the first plan had (seen on the H200: 12 groups, then 164)."""
    from cute_kernels.attention import DevicePlan

    dp = DevicePlan(item_capacity=4 * host_plan.n_items,
                    group_capacity=4 * host_plan.n_items,
                    partial_rows_capacity=REUSE_PARTIAL_ROWS, num_ctas=REUSE_CTAS,
                    head_dim=head_dim, device="cuda", always_combine=True, **options)
    dp.upload(host_plan)
    return dp


def capture_graph(launch):
    """Run ``launch()`` once (compile and load outside the capture), then capture it into a
    CUDA graph on a side stream; returns the graph."""
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            launch()
    torch.cuda.synchronize()
    return graph
