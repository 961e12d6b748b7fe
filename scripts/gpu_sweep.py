#!/usr/bin/env python3
"""Randomized GPU correctness sweep of IonAttention's default paths against the reference.

Usage (on a Hopper GPU):
    python scripts/gpu_sweep.py [--cases 1000] [--seed N] [--out DIR]

Each case is a fresh random batch mixing decode rows (q_len 1) with prefill chunks (q_len up
to 2048, fresh or with context), KV lengths 1..32768 including exact page boundaries
(multiples of 64 and +-1), requests with 0 new tokens (with and without context), padding
rows after the last request, GQA ratios 1/4/7/8 with 1..4 KV heads, head sizes 64/128,
bf16 (and every 5th case fp16), int64 or int32 slot mappings.  The layer path alternates
case by case: ``fused`` (the backend's default: one launch writes the step's K/V into the
cache and attends) and ``append`` (``kv_append``, then attention: the fallback), and the
q-tile size rotates over 64, 128 and 192 rows, so every kernel the backend can launch runs.

Per case: random paged caches (shuffled pages, garbage spare pages), random new K/V; the
output is NaN-poisoned; the kernel runs; the result is compared with the fp32 reference.
Pass bar, per element as FlashAttention's tests judge: max |out - ref| <= 2 x that of the
same attention in PyTorch in the input dtype + 1e-4; no NaN in written rows; every row that
must not be written (padding, requests without work) still NaN; the cache equal to the
reference append wherever a request holds tokens, untouched where no request does.  Every
``--force-split-every``-th case (default 4) is planned with a split-friendly cost model, so
split-KV and the combine pass run on many cases.

The base seed is fresh unless ``--seed`` is given, and recorded.  Writes ``cases.jsonl``
(one line per case) and ``summary.json`` into --out (default bench/results/sweep-<date>) and
prints a table; exit code 1 if any case fails.  ``--fault spare_pages`` hands the kernel a
block table in which the request with the most new tokens points at garbage pages: every
case must then fail (a check that the sweep can fail).  ``--list`` prints the cases (CPU).
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
GQA_RATIOS = (1, 4, 7, 8, 12, 16)
HEAD_DIMS = (64, 128, 256)
#: logits soft caps of the cases that have one: Gemma 2's 50, and caps that bite on the
#: sweep's random scores (|s * scale| of a few units)
SOFTCAPS = (1.5, 4.0, 50.0)
#: sliding windows of the cases that have one: below, at and above a page, gpt-oss's 128,
#: Gemma 3's 1024, Mistral's 4096
WINDOWS = (1, 17, 63, 64, 65, 128, 300, 1024, 4096)
#: cases over which every (GQA ratio, head size) pair comes once
CYCLE = len(GQA_RATIOS) * len(HEAD_DIMS)
DEFAULT_CASES = 1000
DEFAULT_MAX_KV_TOKENS = 65536
ATOL = 1e-4
#: relative L2 error bound, kept beside the per-element bar (it catches errors spread thin)
REL_TOL = 1e-2
TILE_MS = (64, 128, 192)
PATHS = ("fused", "append")


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
    softcap: float = 0.0  # logits soft cap (0: none)
    window: int = 0  # sliding window in tokens (0: none)
    sinks: bool = False  # per-q-head attention sinks (drawn from the case seed)

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
    # a quarter of the cases with a soft cap (Gemma 2: 50), drawn last so the shapes of
    # every case stay what they were without it
    feat = random.Random(case_seed ^ 0x5EED)
    softcap = feat.choice(SOFTCAPS) if feat.random() < 0.25 else 0.0
    # a quarter with a sliding window (below, at, above a page, and model sizes), a quarter
    # with sinks: the combinations real models use come up together
    window = feat.choice(WINDOWS) if feat.random() < 0.25 else 0
    sinks = feat.random() < 0.25
    for on, tag in ((softcap, "softcap"), (window, "window"), (sinks, "sinks")):
        if on:
            tags.append(tag)
    return SweepCase(index=index, seed=case_seed, q_lens=q_lens, seq_lens=seq_lens,
                     hq=g * hkv, hkv=hkv, d=d, dtype=dtype, pad_rows=pad,
                     slot_dtype="int32" if index % 3 == 2 else "int64", tags=tags,
                     softcap=softcap, window=window, sinks=sinks)


def make_cases(n: int, seed: int, max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS,
               pad_rows: bool = True) -> List[SweepCase]:
    return [make_case(i, seed, max_kv_tokens, pad_rows) for i in range(n)]


def judge(max_err: float, pt_err: float, nan_in_written: bool, poison_ok: bool,
          cache_ok: bool, rel_err: float) -> bool:
    """The pass bar of one case: the kernel's largest error against the fp32 reference is at
    most twice PyTorch's in the input dtype, plus ATOL, and its relative L2 error at most
    REL_TOL (NaN never passes)."""
    return (max_err <= 2 * pt_err + ATOL and rel_err <= REL_TOL and not nan_in_written
            and poison_ok and cache_ok)


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


def case_path(case: SweepCase) -> tuple[str, int]:
    """(layer path, q-tile rows) of a case: fused / append alternate, tiles rotate."""
    # GQA ratio and head size cycle over index % CYCLE (make_case): every
    # CYCLE * 2 * len(TILE_MS) cases hold each (ratio, head size, path, tile size) once
    # (D = 256 has no 192-row tile: its 128-row tile comes twice instead)
    from cute_kernels.options import tile_ms_for

    tiles = tile_ms_for(case.d)
    k = (case.index // (2 * CYCLE)) % len(TILE_MS)
    return PATHS[(case.index // CYCLE) % 2], tiles[min(k, len(tiles) - 1)]


def impl_sink_log2(sinks):
    """Sink logits as the kernels take them (cute_kernels.attention.sink_log2's formula,
    kept here so an injected ``impl`` needs no CuTeDSL)."""
    return sinks.float() * (1.0 / math.log(2.0))


def make_plan(case: SweepCase, qsl, sl, device, *, force_split: bool, fresh_kv: bool,
              tile_m: int):
    """The device plan for one case (planned here so it can force splits and record how
    many items were split)."""
    from cute_kernels import make_device_plan
    from cute_kernels.cost_model import CostModel

    cm = CostModel(head_dim=case.d, **FORCED_SPLIT) if force_split else None
    return make_device_plan(qsl.cpu(), sl.cpu(), num_kv_heads=case.hkv, group_size=case.g,
                            head_dim=case.d, device=device, fresh_kv=fresh_kv, tile_m=tile_m,
                            cost_model=cm, window=case.window)


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


def run_case(case: SweepCase, device, fault: str = "none", impl=None,
             force_split: bool = False, path: Optional[str] = None,
             tile_m: Optional[int] = None) -> Dict:
    """Run one case on its path and tile size (``case_path`` unless given); ``impl``
    (default: the ``cute_kernels`` module) provides ``kv_append`` and ``ion_attention``
    (tests inject other implementations)."""
    import torch
    if impl is None:
        import cute_kernels as impl
    from cute_kernels import worklist as W
    from cute_kernels.reference import (make_paged_case, new_token_slot_mapping,
                                        reference_kv_append, reference_paged_attention,
                                        relative_error, written_rows_mask)

    dtype = getattr(torch, case.dtype)
    path = path or case_path(case)[0]
    tile_m = tile_m or case_path(case)[1]
    fused = path == "fused"
    res = {"index": case.index, "pass": False, "error": None, "path": path,
           "tile_m": tile_m, "forced_split": force_split}
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
        plan = make_plan(case, qsl, sl, device, force_split=force_split, fresh_kv=fused,
                         tile_m=tile_m)
        w = plan.host.work
        res.update(unpacked_items=int((w[:, W.QHEAD] >= 0).sum()),
                   split_items=int((w[:, W.NSPLIT] > 1).sum()),
                   split_unpacked_items=int(((w[:, W.NSPLIT] > 1) & (w[:, W.QHEAD] >= 0)).sum()),
                   partial_rows=int(plan.host.partial_rows))
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
        plan.partial_o.fill_(float("nan"))  # a split read before it is written must show
        _sync(device)
        t1 = time.perf_counter()
        cap = {"softcap": case.softcap} if case.softcap else {}
        if case.window:
            cap["window"] = case.window
        ref_feat = dict(cap)
        if case.sinks:  # logits of the size gpt-oss learns (a few units, either sign)
            sg = torch.Generator(device="cpu").manual_seed(case.seed + 2)
            sinks = (torch.randn(case.hq, generator=sg) * 2.0).to(device)
            ref_feat["sinks"] = sinks
            cap["sinks_log2"] = impl_sink_log2(sinks)
        if fused:
            impl.ion_attention(q, kc, vc, out, qsl, sl, kernel_bt, scale, plan=plan,
                               key=key, value=value, **cap)
        else:
            impl.ion_attention(q, kc, vc, out, qsl, sl, kernel_bt, scale, plan=plan, **cap)
        _sync(device)
        t_kernel = time.perf_counter() - t1
        if fused:
            cache_ok = cache_matches(kc, vc, ref_k, ref_v, orig_k, orig_v, bt.cpu(),
                                     case.seq_lens)

        ref = reference_paged_attention(q, ref_k, ref_v, qsl, sl, bt, scale, **ref_feat)
        pt = reference_paged_attention(q, ref_k, ref_v, qsl, sl, bt, scale,
                                       compute_dtype=dtype, **ref_feat)
        mask = written_rows_mask(qsl, sl, total_q).to(device)
        written = out[mask]
        nan_in_written = bool(torch.isnan(written).any())
        poison_ok = bool(torch.isnan(out[~mask]).all()) if (~mask).any() else True
        rel = relative_error(out, ref, mask)
        max_err = float((written.float() - ref[mask]).abs().max()) if mask.any() else 0.0
        pt_err = float((pt[mask] - ref[mask]).abs().max()) if mask.any() else 0.0
        res.update(rel_err=rel, max_abs_err=max_err, pytorch_max_abs_err=pt_err,
                   nan_in_written=nan_in_written, poison_ok=poison_ok, cache_ok=cache_ok,
                   kernel_s=t_kernel)
        res["pass"] = judge(max_err, pt_err, nan_in_written, poison_ok, cache_ok, rel)
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


def summarize(cases: List[SweepCase], results: List[Dict]) -> Dict:
    by_variant: Dict[str, Dict] = {}
    for c, r in zip(cases, results):
        key = f"{c.dtype}/D{c.d}/G{c.g}/{r['path']}/m{r['tile_m']}"
        v = by_variant.setdefault(key, {"cases": 0, "passed": 0, "max_abs_err": None,
                                         "pytorch_max_abs_err": None, "errors": 0})
        v["cases"] += 1
        v["passed"] += int(r["pass"])
        v["errors"] += int(r.get("error") is not None)
        v["max_abs_err"] = _worse(v["max_abs_err"], r.get("max_abs_err"))
        v["pytorch_max_abs_err"] = _worse(v["pytorch_max_abs_err"],
                                          r.get("pytorch_max_abs_err"))
    failed = [r["index"] for r in results if not r["pass"]]
    tag_counts: Dict[str, int] = {}
    for c in cases:
        for t in c.tags:
            tag_counts[t] = tag_counts.get(t, 0) + 1
    return {
        "cases": len(results),
        "passed": len(results) - len(failed),
        "failed": len(failed),
        "failed_indices": failed,
        "bar": f"max abs error <= 2 x PyTorch in the input dtype + {ATOL}, "
               f"relative L2 <= {REL_TOL}",
        "max_rel_err": _reduce_worse(r.get("rel_err") for r in results),
        "by_variant": dict(sorted(by_variant.items())),
        "tag_counts": tag_counts,
        "cases_by_path": {p: sum(1 for r in results if r["path"] == p) for p in PATHS},
        "cases_by_tile_m": {t: sum(1 for r in results if r["tile_m"] == t) for t in TILE_MS},
        "cases_with_split_kv": sum(1 for r in results if r.get("split_items", 0) > 0),
        "split_items": sum(r.get("split_items", 0) for r in results),
        "cases_with_unpacked_tiles": sum(1 for r in results if r.get("unpacked_items", 0) > 0),
        "cases_with_split_unpacked": sum(1 for r in results
                                         if r.get("split_unpacked_items", 0) > 0),
        "verdict": "PASS" if not failed else "FAIL",
    }


def print_table(summary: Dict) -> None:
    print(f"{'variant':<34}{'cases':>6}{'passed':>7}{'errors':>7}{'max_err':>10}{'pytorch':>10}")
    for k, v in summary["by_variant"].items():
        print(f"{k:<34}{v['cases']:>6}{v['passed']:>7}{v['errors']:>7}"
              f"{_fmt(v['max_abs_err']):>10}{_fmt(v['pytorch_max_abs_err']):>10}")
    print(f"{'TOTAL':<34}{summary['cases']:>6}{summary['passed']:>7}")
    print(f"verdict: {summary['verdict']} ({summary['bar']}; seed {summary.get('seed')}; "
          f"failed: {summary['failed_indices'][:20]})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Randomized GPU sweep of IonAttention's default paths against the "
                    "reference.")
    ap.add_argument("--cases", type=int, default=DEFAULT_CASES,
                    help=f"number of cases ({DEFAULT_CASES})")
    ap.add_argument("--seed", type=int, default=None,
                    help="base seed (default: fresh, recorded in summary.json)")
    ap.add_argument("--out", default=None,
                    help="output dir (default bench/results/sweep-<date>)")
    ap.add_argument("--max-kv-tokens", type=int, default=DEFAULT_MAX_KV_TOKENS,
                    help="bound on the total KV tokens of one case")
    ap.add_argument("--no-pad-rows", action="store_true",
                    help="never add padding rows after the last request")
    ap.add_argument("--fault", choices=("none", "spare_pages"), default="none",
                    help="inject a fault on the kernel side (every case must fail)")
    ap.add_argument("--force-split-every", type=int, default=4,
                    help="plan every N-th case with a split-friendly cost model (0: never)")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds; start no new case after this (0: no limit). The summary "
                         "then covers the cases run and records how many were planned")
    ap.add_argument("--only", default="",
                    help="comma-separated case indices to run (for reproducing one failure)")
    ap.add_argument("--shard", default="0/1", metavar="K/N",
                    help="run the cases whose index is K modulo N (N processes, one GPU)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--list", action="store_true", help="print the cases and exit (no GPU)")
    ap.add_argument("--quiet", action="store_true", help="no per-case lines")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else time.time_ns() % (2 ** 31)
    cases = make_cases(args.cases, seed, args.max_kv_tokens, not args.no_pad_rows)
    if args.only:
        keep = {int(i) for i in args.only.split(",") if i.strip()}
        cases = [c for c in cases if c.index in keep]
    shard, shards = (int(x) for x in args.shard.split("/"))
    cases = [c for c in cases if c.index % shards == shard]
    if args.list:
        for c in cases:
            print(json.dumps({**c.to_json(), "path": case_path(c)}))
        return 0

    import torch
    if not torch.cuda.is_available():
        print("gpu_sweep: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    out_dir = args.out or os.path.join(
        ROOT, "bench", "results", "sweep-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    print(f"gpu_sweep: seed {seed} (replay: --seed {seed})", flush=True)
    results = []
    t_start = time.perf_counter()
    with open(os.path.join(out_dir, "cases.jsonl"), "w") as f:
        for c in cases:
            if args.time_budget and time.perf_counter() - t_start > args.time_budget:
                break
            every = args.force_split_every
            r = run_case(c, device, args.fault,
                         force_split=every > 0 and c.index % every == every - 1)
            f.write(json.dumps({**c.to_json(), **r}) + "\n")
            f.flush()
            results.append(r)
            if not args.quiet:
                status = "ok  " if r["pass"] else "FAIL"
                print(f"[{c.index:4d}] {status} {c.dtype[:4]} D{c.d} G{c.g} Hkv{c.hkv} "
                      f"{r['path']} m{r['tile_m']} B{len(c.q_lens)} q{c.total_q} "
                      f"kv{c.total_kv} split={r.get('split_items', 0)} "
                      f"err={_fmt(r.get('max_abs_err'))}/{_fmt(r.get('pytorch_max_abs_err'))} "
                      f"{r.get('error') or ''}", flush=True)
    summary = summarize(cases[:len(results)], results)
    summary.update(cases_planned=len(cases), seed=seed, shard=args.shard, fault=args.fault,
                   force_split_every=args.force_split_every, max_kv_tokens=args.max_kv_tokens,
                   wall_s=time.perf_counter() - t_start, out_dir=out_dir,
                   device_name=torch.cuda.get_device_name(device), torch=torch.__version__)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print_table(summary)
    return 0 if summary["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
