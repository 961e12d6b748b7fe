#!/usr/bin/env python3
"""Randomized GPU correctness sweep of cute_kernels.append_sm90 + ion_attention.

Usage (on a Hopper GPU):
    python scripts/gpu_sweep.py [--cases 240] [--seed 0] [--out DIR]

Each case is a fresh random batch mixing decode rows (q_len 1) with prefill
chunks (q_len up to 2048, fresh or with context), KV lengths 1..32768 including
exact page boundaries (multiples of 64 and +-1), requests with 0 new tokens
(with and without context), padding rows after the last request, GQA ratios
1/4/7/8 with 1..4 KV heads, head dims 64/128, bf16 (and every 5th case fp16),
int64 or int32 slot mappings.  Total KV tokens per case <= --max-kv-tokens.

Per case:
  1. random paged caches (shuffled pages + garbage spare pages), random new K/V;
  2. ``cute_kernels.append_sm90`` writes the new K/V at ``slot_mapping``;
     ``reference_kv_append`` does the same on a copy -> caches must be equal;
  3. ``out`` is filled with NaN, ``cute_kernels.ion_attention`` runs;
  4. compared with ``reference_paged_attention`` (fp32) on the reference cache.
Pass bar: relative error (||out-ref||/||ref|| over written rows) <= --tol
(1e-2), no NaN in written rows, every row that must not be written (padding rows,
requests with no work) still NaN, caches bit-equal to the reference append.

``--path fused`` runs the fused-writeback call instead of steps 2-3: no
``kv_append``; ``ion_attention(..., key=, value=)`` writes the new K/V inside the
attention launch, and the cache must equal the reference at every position
< seq_len of every request, with every block no request uses untouched
(positions past seq_len in a request's last page may hold garbage,
docs/contract.md).  Every ``--force-split-every``-th case (default 4) is
planned with a split-friendly cost model, so split-KV and the combine pass run
on many cases.  Each result records the plan's split items and partial rows.

Writes ``cases.jsonl`` (one line per case) and ``summary.json`` into --out
(default bench/results/sweep-<date>) and prints a table; exit code 1 if any
case fails.  ``--fault spare_pages`` deliberately hands the kernel a block table
in which the request with the most new tokens points at garbage pages: every
case must then fail (a check that the sweep can fail).  ``--list`` prints the cases (CPU only).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import random
import sys
import time
import traceback
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PAGE = 64
MAX_KV = 32768
MAX_CHUNK = 2048
GQA_RATIOS = (1, 4, 7, 8)
HEAD_DIMS = (64, 128)
DEFAULT_CASES = 240
DEFAULT_MAX_KV_TOKENS = 65536
DEFAULT_TOL = 1e-2


@dataclasses.dataclass
class SweepCase:
    index: int
    seed: int
    q_lens: List[int]
    seq_lens: List[int]
    hq: int
    hkv: int
    d: int
    dtype: str  # "bfloat16" | "float16"
    pad_rows: int
    slot_dtype: str  # "int64" | "int32"
    tags: List[str]

    @property
    def g(self) -> int:
        return self.hq // self.hkv

    @property
    def total_kv(self) -> int:
        return sum(self.seq_lens)

    @property
    def total_q(self) -> int:
        return sum(self.q_lens) + self.pad_rows

    def to_json(self) -> Dict:
        d = dataclasses.asdict(self)
        d["g"] = self.g
        d["total_kv"] = self.total_kv
        d["total_q"] = self.total_q
        return d


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    if hi <= lo:
        return lo
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


def _boundary_len(rng: random.Random, lo: int, hi: int) -> Optional[int]:
    """A length 64*k + {-1, 0, +1} inside [lo, hi] (None if impossible)."""
    for _ in range(20):
        k = _log_uniform(rng, 1, max(1, hi // PAGE))
        n = PAGE * k + rng.choice((-1, 0, 0, 1))
        if lo <= n <= hi:
            return n
    return None


def _kv_len(rng: random.Random, lo: int, hi: int) -> int:
    hi = max(lo, hi)
    if rng.random() < 0.4:
        n = _boundary_len(rng, lo, hi)
        if n is not None:
            return n
    return _log_uniform(rng, lo, hi)


def _decode_row(rng: random.Random, budget: int):
    return 1, _kv_len(rng, 1, min(MAX_KV, budget))


def _prefill_row(rng: random.Random, budget: int):
    cap = min(MAX_CHUNK, budget, MAX_KV)
    if cap < 2:
        return None
    r = rng.random()
    if r < 0.3:
        q = _boundary_len(rng, 2, cap) or _log_uniform(rng, 2, cap)
    else:
        q = _log_uniform(rng, 2, cap)
    room = min(MAX_KV, budget) - q
    r = rng.random()
    if r < 0.25 or room <= 0:
        ctx = 0  # fresh prompt
    elif r < 0.5 and room >= PAGE:
        ctx = PAGE * rng.randint(1, room // PAGE)  # chunk starts on a page boundary
    else:
        ctx = _kv_len(rng, 1, room)
    return q, ctx + q


def make_case(index: int, seed: int, max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS,
              pad_rows: bool = True) -> SweepCase:
    """Case ``index`` of the sweep with base ``seed`` (deterministic)."""
    case_seed = (seed * 1_000_003 + index * 7919 + 12345) % (2 ** 31)
    rng = random.Random(case_seed)
    g = GQA_RATIOS[index % len(GQA_RATIOS)]
    d = HEAD_DIMS[(index // len(GQA_RATIOS)) % len(HEAD_DIMS)]
    dtype = "float16" if index % 5 == 4 else "bfloat16"
    hkv = rng.randint(1, 4)
    budget = max_kv_tokens
    reqs = []  # (q_len, seq_len, tag)

    def take(row, tag):
        nonlocal budget
        if row is None:
            return
        q, L = row
        if L > budget:
            return
        reqs.append((q, L, tag))
        budget -= L

    if rng.random() < 0.3:  # one long-context request (16k..32k)
        L = _kv_len(rng, 16384, min(MAX_KV, budget // 2))
        if rng.random() < 0.5:
            take((1, L), "decode")
        else:
            q = _log_uniform(rng, 2, MAX_CHUNK)
            take((q, L), "chunk")
    take(_decode_row(rng, max(1, budget // 4)), "decode")
    row = _prefill_row(rng, max(2, budget // 3))
    take(row, "prefill" if row and row[0] == row[1] else "chunk")
    n_more = rng.randint(0, 14)
    for _ in range(n_more):
        if budget < 2:
            break
        r = rng.random()
        if r < 0.55:
            take(_decode_row(rng, budget), "decode")
        else:
            row = _prefill_row(rng, budget)
            take(row, "prefill" if row and row[0] == row[1] else "chunk")
    if rng.random() < 0.5:
        for _ in range(rng.randint(1, 2)):
            L = _kv_len(rng, 1, min(MAX_KV, max(1, budget)))
            if L <= budget:
                reqs.append((0, L, "zero_new"))
                budget -= L
    if rng.random() < 0.3:
        reqs.append((0, 0, "empty"))
    rng.shuffle(reqs)
    q_lens = [r[0] for r in reqs]
    seq_lens = [r[1] for r in reqs]
    tags = sorted({r[2] for r in reqs})
    if any(L > 0 and (L % PAGE in (0, 1, PAGE - 1)) for L in seq_lens):
        tags.append("page_boundary")
    if any(L >= 16384 for L in seq_lens):
        tags.append("long")
    pad = rng.randint(1, 8) if (pad_rows and rng.random() < 0.33) else 0
    if pad:
        tags.append("pad_rows")
    return SweepCase(index=index, seed=case_seed, q_lens=q_lens, seq_lens=seq_lens,
                     hq=g * hkv, hkv=hkv, d=d, dtype=dtype, pad_rows=pad,
                     slot_dtype="int32" if index % 3 == 2 else "int64", tags=tags)


def make_cases(n: int, seed: int, max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS,
               pad_rows: bool = True) -> List[SweepCase]:
    return [make_case(i, seed, max_kv_tokens, pad_rows) for i in range(n)]


def judge(rel_err: float, nan_in_written: bool, poison_ok: bool, cache_ok: bool,
          tol: float) -> bool:
    """The pass bar of one case (NaN rel_err never passes)."""
    return (rel_err <= tol) and (not nan_in_written) and poison_ok and cache_ok


def fault_block_table(bt, seq_lens, q_lens, used_pages_mask):
    """Copy of ``bt`` where every page of the request with the most new tokens
    points at spare (garbage) pages that hold none of its KV."""
    bad = bt.clone()
    work = [b for b in range(len(seq_lens)) if seq_lens[b] > 0 and q_lens[b] > 0]
    b = max(work, key=lambda i: (q_lens[i], seq_lens[i]))
    spare = (~used_pages_mask).nonzero().flatten().tolist()
    n = (seq_lens[b] + PAGE - 1) // PAGE
    for j in range(n):
        bad[b, j] = spare[j % len(spare)]
    return bad


def _worse(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """The larger error, NaN counting as the worst."""
    if a is None:
        return b
    if b is None:
        return a
    if a != a:
        return a
    if b != b:
        return b
    return max(a, b)


def _sync(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


#: cost model that makes splitting look cheap: forces split-KV + combine on long rows
FORCED_SPLIT = dict(item_overhead_us=0.01, split_item_overhead_us=0.0, combine_launch_us=0.0)


def make_plan(case: SweepCase, qsl, sl, device, *, force_split: bool, fresh_kv: bool,
              unpacked: bool = False, tile_m: int = 64, row_combine: bool = False,
              lazy_rescale: bool = False, pdl_combine: bool = False,
              lane_combine: bool = False, kv_pair: bool = False, kv_stages=None,
              pingpong=None, pin_pv_wait=None):
    """The device plan for one case (the sweep plans explicitly so it can force splits and
    record how many items were split)."""
    from cute_kernels.attention import make_device_plan
    from cute_kernels.planner import CostModel

    cm = CostModel(head_dim=case.d, **FORCED_SPLIT) if force_split else None
    return make_device_plan(qsl.cpu(), sl.cpu(), num_kv_heads=case.hkv, group_size=case.g,
                            page_size=PAGE, head_dim=case.d, device=device,
                            fresh_kv=fresh_kv, unpacked_prefill=unpacked, tile_m=tile_m,
                            cost_model=cm, row_combine=row_combine,
                            lazy_rescale=lazy_rescale, pdl_combine=pdl_combine,
                            lane_combine=lane_combine, kv_pair=kv_pair, kv_stages=kv_stages,
                            pingpong=pingpong, pin_pv_wait=pin_pv_wait)


def cache_matches(kc, vc, ref_k, ref_v, orig_k, orig_v, bt, seq_lens) -> bool:
    """Fused-path cache check: equal to the reference at every position < seq_len of every
    request, untouched in every block no request uses; positions >= seq_len of a request's
    last page are free (the fused kernel may leave garbage there)."""
    import torch

    check = torch.zeros(kc.shape[0], kc.shape[2], dtype=torch.bool)  # (block, row) to check
    check[:] = True
    for b, L in enumerate(seq_lens):
        n = (L + PAGE - 1) // PAGE
        if n and L % PAGE:
            check[int(bt[b, n - 1]), L % PAGE:] = False
    m = check.to(kc.device)[:, None, :, None].expand_as(kc)
    used = torch.zeros(kc.shape[0], dtype=torch.bool)
    for b, L in enumerate(seq_lens):
        used[bt[b, :(L + PAGE - 1) // PAGE].long().cpu()] = True
    u = used.to(kc.device)
    ok_ref = bool(torch.equal(kc[m], ref_k[m]) and torch.equal(vc[m], ref_v[m]))
    ok_unused = bool(torch.equal(kc[~u], orig_k[~u]) and torch.equal(vc[~u], orig_v[~u]))
    return ok_ref and ok_unused


def run_case(case: SweepCase, device, tol: float, fault: str = "none",
             impl=None, path: str = "append", force_split: bool = False,
             unpacked: bool = False, tile_m: int = 64, row_combine: bool = False,
             lazy_rescale: bool = False, pdl_combine: bool = False,
             lane_combine: bool = False, kv_pair: bool = False, kv_stages=None,
             pingpong=None, pin_pv_wait=None) -> Dict:
    """Run one case; ``impl`` (default: the ``cute_kernels`` module) provides
    ``kv_append`` and ``ion_attention`` (tests inject other implementations).
    ``path``: "append" (kv_append, then attention) or "fused" (one call writes the cache
    and attends)."""
    import torch
    if impl is None:
        import cute_kernels as impl
    from cute_kernels.reference import (make_paged_case, new_token_slot_mapping,
                                        reference_kv_append, reference_paged_attention,
                                        relative_error, written_rows_mask)

    dtype = getattr(torch, case.dtype)
    res = {"index": case.index, "pass": False, "error": None}
    t0 = time.perf_counter()
    try:
        q, kc, vc, qsl, sl, bt = make_paged_case(
            case.seed, case.q_lens, case.seq_lens, case.hq, case.hkv, case.d, PAGE,
            dtype, device, pad_rows=case.pad_rows, rng_device=device)
        total_q = q.shape[0]
        gen = torch.Generator(device=device)
        gen.manual_seed(case.seed + 1)
        key = torch.randn(total_q, case.hkv, case.d, generator=gen, device=device).to(dtype)
        value = torch.randn(total_q, case.hkv, case.d, generator=gen, device=device).to(dtype)
        slots = new_token_slot_mapping(qsl, sl, bt, PAGE, total_q)
        slots = slots.to(getattr(torch, case.slot_dtype))
        ref_k, ref_v = kc.clone(), vc.clone()
        reference_kv_append(key, value, ref_k, ref_v, slots)
        fused = path == "fused"
        plan = make_plan(case, qsl, sl, device, force_split=force_split, fresh_kv=fused,
                         unpacked=unpacked, tile_m=tile_m, row_combine=row_combine,
                         lazy_rescale=lazy_rescale, pdl_combine=pdl_combine,
                         lane_combine=lane_combine, kv_pair=kv_pair, kv_stages=kv_stages,
                         pingpong=pingpong, pin_pv_wait=pin_pv_wait)
        res.update(path=path, forced_split=force_split, tile_m=tile_m,
                   unpacked_items=int((plan.host.work[:, 8] >= 0).sum()) if plan.num_items else 0,
                   split_items=int((plan.host.work[:, 7] > 1).sum()) if plan.num_items else 0,
                   split_unpacked_items=int(((plan.host.work[:, 7] > 1)
                                             & (plan.host.work[:, 8] >= 0)).sum())
                   if plan.num_items else 0,
                   partial_rows=int(plan.host.partial_rows),
                   # the fused launch runs the 16-byte straddle-copy kernels (the default
                   # "auto" picks them for plans with a straddling fresh tile)
                   vec_straddle=bool(fused and getattr(plan, "vec_straddle", False)))

        if fused:
            orig_k, orig_v = kc.clone(), vc.clone()
        else:
            impl.kv_append(key, value, kc, vc, slots)
            _sync(device)
            cache_ok = bool(torch.equal(kc, ref_k) and torch.equal(vc, ref_v))

        kernel_bt = bt
        if fault == "spare_pages":
            used = torch.zeros(kc.shape[0], dtype=torch.bool)
            for b, L in enumerate(case.seq_lens):
                used[bt[b, :(L + PAGE - 1) // PAGE].long().cpu()] = True
            kernel_bt = fault_block_table(bt, case.seq_lens, case.q_lens, used)
        scale = 1.0 / math.sqrt(case.d)
        out = torch.full_like(q, float("nan"))
        if pdl_combine:
            # the PDL combine may be scheduled before the attention grid ends: a partial read
            # too early must show, not find plausible stale values in reused memory
            plan.partial_o.fill_(float("nan"))
            plan.partial_lse.fill_(float("nan"))
        _sync(device)
        t1 = time.perf_counter()
        if fused:
            impl.ion_attention(q, kc, vc, out, qsl, sl, kernel_bt, scale, plan=plan,
                               key=key, value=value)
        else:
            impl.ion_attention(q, kc, vc, out, qsl, sl, kernel_bt, scale, plan=plan)
        _sync(device)
        t_kernel = time.perf_counter() - t1
        if fused:
            cache_ok = cache_matches(kc, vc, ref_k, ref_v, orig_k, orig_v, bt.cpu(),
                                     case.seq_lens)

        ref = reference_paged_attention(q, ref_k, ref_v, qsl, sl, bt, scale)
        mask = written_rows_mask(qsl, sl, total_q).to(device)
        written = out[mask]
        nan_in_written = bool(torch.isnan(written).any())
        poison_ok = bool(torch.isnan(out[~mask]).all()) if (~mask).any() else True
        rel = relative_error(out, ref, mask)
        diff = (written.float() - ref[mask]).abs()
        finite = diff[torch.isfinite(diff)]
        max_abs = float(finite.max()) if finite.numel() else (
            0.0 if diff.numel() == 0 else float("nan"))
        res.update(rel_err=rel, max_abs_err=max_abs, nan_in_written=nan_in_written,
                   poison_ok=poison_ok, cache_ok=cache_ok, kernel_s=t_kernel)
        res["pass"] = judge(rel, nan_in_written, poison_ok, cache_ok, tol)
    except Exception as e:  # a crash is a failure of this case, keep sweeping
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc(limit=8)
    res["time_s"] = time.perf_counter() - t0
    return res


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2e}"
    return str(x)


def _reduce_worse(xs):
    out = None
    for x in xs:
        out = _worse(out, x)
    return out


def summarize(cases: List[SweepCase], results: List[Dict], tol: float) -> Dict:
    by_variant: Dict[str, Dict] = {}
    for c, r in zip(cases, results):
        key = f"{c.dtype}/D{c.d}/G{c.g}"
        v = by_variant.setdefault(key, {"cases": 0, "passed": 0, "max_rel_err": None,
                                         "errors": 0})
        v["cases"] += 1
        v["passed"] += int(r["pass"])
        v["errors"] += int(r.get("error") is not None)
        v["max_rel_err"] = _worse(v["max_rel_err"], r.get("rel_err"))
    failed = [r["index"] for r in results if not r["pass"]]
    rels = [r["rel_err"] for r in results if r.get("rel_err") is not None]
    tag_counts: Dict[str, int] = {}
    for c in cases:
        for t in c.tags:
            tag_counts[t] = tag_counts.get(t, 0) + 1
    return {
        "cases": len(results),
        "passed": len(results) - len(failed),
        "failed": len(failed),
        "failed_indices": failed,
        "tol": tol,
        "max_rel_err": _reduce_worse(rels),
        "mean_rel_err": (sum(rels) / len(rels)) if rels else None,
        "by_variant": dict(sorted(by_variant.items())),
        "tag_counts": tag_counts,
        "cases_with_split_kv": sum(1 for r in results if r.get("split_items", 0) > 0),
        "split_items": sum(r.get("split_items", 0) for r in results),
        "cases_with_unpacked_tiles": sum(1 for r in results if r.get("unpacked_items", 0) > 0),
        "cases_with_split_unpacked": sum(1 for r in results
                                         if r.get("split_unpacked_items", 0) > 0),
        "cases_vec_straddle": sum(1 for r in results if r.get("vec_straddle")),
        "verdict": "PASS" if not failed else "FAIL",
    }


def print_table(summary: Dict) -> None:
    print(f"{'variant':<20}{'cases':>7}{'passed':>8}{'errors':>8}{'max_rel_err':>14}")
    for k, v in summary["by_variant"].items():
        print(f"{k:<20}{v['cases']:>7}{v['passed']:>8}{v['errors']:>8}"
              f"{_fmt(v['max_rel_err']):>14}")
    print(f"{'TOTAL':<20}{summary['cases']:>7}{summary['passed']:>8}"
          f"{'':>8}{_fmt(summary['max_rel_err']):>14}")
    print(f"verdict: {summary['verdict']} (tol {summary['tol']:g}; "
          f"failed: {summary['failed_indices'][:20]})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Randomized GPU sweep of cute_kernels.append_sm90 + ion_attention "
                    "against the fp32 reference.")
    ap.add_argument("--cases", type=int, default=DEFAULT_CASES, help="number of cases (240)")
    ap.add_argument("--seed", type=int, default=0, help="base seed")
    ap.add_argument("--out", default=None,
                    help="output dir (default bench/results/sweep-<date>)")
    ap.add_argument("--tol", type=float, default=DEFAULT_TOL, help="max relative error")
    ap.add_argument("--max-kv-tokens", type=int, default=DEFAULT_MAX_KV_TOKENS,
                    help="bound on the total KV tokens of one case")
    ap.add_argument("--no-pad-rows", action="store_true",
                    help="never add padding rows after the last request")
    ap.add_argument("--fault", choices=("none", "spare_pages"), default="none",
                    help="inject a fault on the kernel side (every case must fail)")
    ap.add_argument("--path", choices=("append", "fused"), default="append",
                    help="append: kv_append then attention (the backend's default); fused: "
                         "one call writes the cache and attends (ION_FUSED_KV_WRITEBACK=1)")
    ap.add_argument("--tile-m", type=int, choices=(64, 128, 192), default=64,
                    help="q tile rows: 128 runs the two-consumer-warpgroup kernel, 192 the "
                         "three-consumer one (the backend's tiles for long prefill steps)")
    ap.add_argument("--unpacked-prefill", action="store_true",
                    help="plan with unpacked prefill tiles (ION_UNPACKED_PREFILL=1 variant)")
    ap.add_argument("--force-split-every", type=int, default=4,
                    help="plan every N-th case with a split-friendly cost model (0: never)")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds; start no new case after this (0: no limit). The summary "
                         "then covers the cases run and records how many were planned")
    ap.add_argument("--row-combine", action="store_true",
                    help="merge split-KV partials with the row-parallel combine kernel")
    ap.add_argument("--lazy-rescale", action="store_true",
                    help="the lazy-rescaling kernel variants (an experiment)")
    ap.add_argument("--pdl-combine", action="store_true",
                    help="launch the split-KV combine by programmatic dependent launch "
                         "(the split-KV workspace is NaN-poisoned before each case)")
    ap.add_argument("--lane-combine", action="store_true",
                    help="merge split-KV partials with the split-parallel combine kernel")
    ap.add_argument("--kv-pair", action="store_true",
                    help="the page-pair kernel variants (two pages per K/V stage; needs "
                         "--tile-m 128)")
    ap.add_argument("--kv-stages", type=int, default=None,
                    help="K/V pipeline stages of the 128-row kernels (2 or 3 instead of the "
                         "default 4; needs --tile-m 128)")
    ap.add_argument("--pingpong", choices=("on", "off"), default=None,
                    help="warpgroup ping-pong on the 128-row kernels (default: the kernels' "
                         "default, attention.PINGPONG_DEFAULT; needs --tile-m 128)")
    ap.add_argument("--pin-pv-wait", choices=("on", "off"), default=None,
                    help="the kernels' PV wait pinned after the softmax (default: the "
                         "kernels' default, attention.PIN_PV_WAIT_DEFAULT)")
    ap.add_argument("--only", default="",
                    help="comma-separated case indices to run (for reproducing one failure)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--list", action="store_true", help="print the cases and exit (no GPU)")
    ap.add_argument("--quiet", action="store_true", help="no per-case lines")
    return ap.parse_args(argv)


def _pingpong_arg(value):
    """``--pingpong on|off`` (or ``--pin-pv-wait``) as the plan option (None: the kernels'
    default)."""
    return None if value is None else value == "on"


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = make_cases(args.cases, args.seed, args.max_kv_tokens, not args.no_pad_rows)
    if args.only:
        keep = {int(i) for i in args.only.split(",") if i.strip()}
        cases = [c for c in cases if c.index in keep]
    if args.list:
        for c in cases:
            print(json.dumps(c.to_json()))
        return 0

    import torch
    if not torch.cuda.is_available():
        print("gpu_sweep: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    out_dir = args.out or os.path.join(
        ROOT, "bench", "results", "sweep-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    results = []
    t_start = time.perf_counter()
    with open(os.path.join(out_dir, "cases.jsonl"), "w") as f:
        for c in cases:
            if args.time_budget and time.perf_counter() - t_start > args.time_budget:
                break
            fs = args.force_split_every > 0 and c.index % args.force_split_every == (
                args.force_split_every - 1)
            r = run_case(c, device, args.tol, args.fault, path=args.path, force_split=fs,
                         unpacked=args.unpacked_prefill, tile_m=args.tile_m,
                         row_combine=args.row_combine, lazy_rescale=args.lazy_rescale,
                         pdl_combine=args.pdl_combine, lane_combine=args.lane_combine,
                         kv_pair=args.kv_pair, kv_stages=args.kv_stages,
                         pingpong=_pingpong_arg(args.pingpong),
                         pin_pv_wait=_pingpong_arg(args.pin_pv_wait))
            rec = {**c.to_json(), **r}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            results.append(r)
            if not args.quiet:
                status = "ok  " if r["pass"] else "FAIL"
                print(f"[{c.index:4d}] {status} {c.dtype[:4]} D{c.d} G{c.g} Hkv{c.hkv} "
                      f"B{len(c.q_lens)} q{c.total_q} kv{c.total_kv} "
                      f"split={r.get('split_items', 0)} "
                      f"rel={_fmt(r.get('rel_err'))} {r.get('error') or ''}", flush=True)
    summary = summarize(cases[:len(results)], results, args.tol)
    summary.update(cases_planned=len(cases), seed=args.seed, fault=args.fault, path=args.path,
                   unpacked_prefill=args.unpacked_prefill, tile_m=args.tile_m,
                   row_combine=args.row_combine, lazy_rescale=args.lazy_rescale,
                   pdl_combine=args.pdl_combine, lane_combine=args.lane_combine,
                   kv_pair=args.kv_pair, kv_stages=args.kv_stages, pingpong=args.pingpong,
                   pin_pv_wait=args.pin_pv_wait,
                   force_split_every=args.force_split_every, max_kv_tokens=args.max_kv_tokens,
                   wall_s=time.perf_counter() - t_start, out_dir=out_dir,
                   device_name=torch.cuda.get_device_name(device),
                   torch=torch.__version__)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print_table(summary)
    return 0 if summary["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
