#!/usr/bin/env python
"""What the cache slots past ``seq_len`` do to IonAttention's output (docs/contract.md,
"Every slot of a page a request uses must hold a finite value").

For a mixed batch whose requests end mid-page (decode rows, a chunk continuing at a
context that is not a page multiple), the slots a kernel loads but masks are set to one
fill before the launch: the positions past ``seq_len`` in each request's last page and,
for the fused-writeback launch, also the positions of the step's new tokens (written by
the launch itself while other CTAs read that page masked).  Every fill is checked on the
plain launch (cache written beforehand by the reference append) and the fused one:

* ``randn``, ``1e4``: finite garbage; the output must match the fp32 reference
  (masking is exact, a finite masked V row is multiplied by exactly 0);
* ``nan``: the requirement's reason; rows of requests that end mid-page come out
  non-finite (0 * NaN in the PV product).

    python3 scripts/cache_tail_check.py --out OUT     (needs a GPU and CuTeDSL)

Writes ``OUT/cache_tail.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

#: q_lens / seq_lens: 8 decode rows at lengths that end mid-page, one chunk of 1,500 new
#: tokens continuing at context 1,023 (every fresh tile straddles), one fresh prompt
Q_LENS = [1] * 8 + [1500, 700]
SEQ_LENS = [1000 + 37 * i for i in range(8)] + [1023 + 1500, 700]
FILLS = ("randn", "1e4", "nan")


def masked_slots(qsl, seq_lens, block_table, page: int, with_new: bool):
    """(page, row) of every slot a launch loads but masks: past seq_len in the last page,
    and (``with_new``) the new tokens' slots."""
    out = []
    for b, L in enumerate(seq_lens):
        q_len = qsl[b + 1] - qsl[b]
        start = L - q_len if with_new else L
        end = math.ceil(L / page) * page
        for pos in range(start, end):
            out.append((int(block_table[b, pos // page]), pos % page))
    return out


def run(fill: str, fused: bool, seed: int, device: str = "cuda") -> dict:
    import torch

    from cute_kernels.attention import ion_attention, make_device_plan
    from cute_kernels.reference import (
        default_softmax_scale,
        make_paged_case,
        new_token_slot_mapping,
        reference_kv_append,
        reference_paged_attention,
        relative_error,
        written_rows_mask,
    )
    hq, hkv, d, page = 28, 4, 128, 64
    q, kc, vc, qsl, sl, bt = make_paged_case(seed, Q_LENS, SEQ_LENS, hq, hkv, d, page=page,
                                            dtype=torch.bfloat16, device=device)
    T = q.shape[0]
    gen = torch.Generator().manual_seed(seed + 1)
    key = torch.randn(T, hkv, d, generator=gen).to(device, torch.bfloat16)
    value = torch.randn(T, hkv, d, generator=gen).to(device, torch.bfloat16)
    slots = new_token_slot_mapping(qsl, sl, bt, page, total_q=T)
    ref_k, ref_v = kc.clone(), vc.clone()
    reference_kv_append(key, value, ref_k, ref_v, slots)
    scale = default_softmax_scale(d)
    ref = reference_paged_attention(q, ref_k, ref_v, qsl, sl, bt, scale)
    qsl_h, sl_h, bt_h = qsl.cpu().tolist(), sl.cpu().tolist(), bt.cpu()
    if not fused:  # the plain launch reads the new tokens from the cache
        kc.copy_(ref_k)
        vc.copy_(ref_v)
    value_of = {"randn": None, "1e4": 1e4, "nan": float("nan")}[fill]
    for pg, row in masked_slots(qsl_h, sl_h, bt_h, page, with_new=fused):
        for c in (kc, vc):
            if value_of is None:
                c[pg, :, row].normal_()
            else:
                c[pg, :, row].fill_(value_of)
    plan = make_device_plan(qsl.cpu().numpy(), sl.cpu().numpy(), num_kv_heads=hkv,
                            group_size=hq // hkv, page_size=page, head_dim=d, device=device,
                            fresh_kv=fused)
    out = torch.full_like(q, float("nan"))
    extra = {"key": key, "value": value} if fused else {}
    ion_attention(q, kc, vc, out, qsl, sl, bt, scale, plan=plan, **extra)
    torch.cuda.synchronize()
    mask = written_rows_mask(qsl, sl, T).to(out.device)
    rows_bad = (~torch.isfinite(out.float())).any(dim=(1, 2)) & mask
    bad_reqs = sorted({b for b in range(len(Q_LENS))
                       if rows_bad[qsl_h[b]:qsl_h[b + 1]].any().item()})
    good = mask & ~rows_bad
    err = relative_error(out, ref, good) if good.any() else float("nan")
    mid_page = [b for b, L in enumerate(SEQ_LENS) if L % page]
    return {"fill": fill, "path": "fused" if fused else "plain", "seed": seed,
            "rows": int(mask.sum()), "nonfinite_rows": int(rows_bad.sum()),
            "requests_nonfinite": bad_reqs, "requests_mid_page": mid_page,
            "rel_err_finite_rows": float(err)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1801)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = [run(f, fused, args.seed + 10 * i + fused)
            for i, f in enumerate(FILLS) for fused in (False, True)]
    with open(os.path.join(args.out, "cache_tail.json"), "w") as f:
        json.dump({"q_lens": Q_LENS, "seq_lens": SEQ_LENS, "results": rows}, f, indent=1)
    print("| fill | path | non-finite rows / rows | requests non-finite | rel err (finite rows) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fill']} | {r['path']} | {r['nonfinite_rows']} / {r['rows']} | "
              f"{r['requests_nonfinite']} | {r['rel_err_finite_rows']:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
