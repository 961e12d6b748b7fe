"""IonAttention on a Hopper GPU: every kernel option against the reference, batch shape by
batch shape.

A case passes on per-element error, as FlashAttention's tests judge theirs: the kernel's
largest absolute error against the fp32 reference is at most twice that of the same
attention computed by plain PyTorch in the input dtype, plus a small ``ATOL``.  Outputs are
NaN-poisoned before each launch: every row a request owns must be written and finite, every
other row (padding, requests without work) must stay NaN.  Fused writeback must leave the
cache equal to the reference append at every position a request holds, and every page no
request uses untouched.  Inputs are ``randn`` from the session seed (``tests/conftest.py``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cute_kernels.cost_model import CostModel
from cute_kernels.options import tile_ms_for
from cute_kernels.reference import (
    default_softmax_scale,
    make_paged_case,
    new_token_slot_mapping,
    reference_kv_append,
    reference_paged_attention,
    relative_error,
    written_rows_mask,
)

pytestmark = pytest.mark.gpu

ATOL = 1e-4
REL_TOL = 1e-2  # relative L2, kept beside the per-element bar
#: splitting costs nothing in this model, so small batches split too
CHEAP_SPLITS = CostModel(item_overhead_us=0.01, split_item_overhead_us=0.0,
                         combine_launch_us=0.0)

#: (Hq, Hkv): GQA ratios 1, 2, 3 (padded to 4), 7 (padded to 8), 8, 12 (padded to 16), 16
HEADS = [(4, 4), (8, 4), (6, 2), (28, 4), (32, 4), (24, 2), (32, 2)]


def _shape(name: str, rng: torch.Generator):
    """(q_lens, seq_lens, pad_rows, cost_model) of a named batch shape, lengths drawn from
    ``rng`` around the boundaries that matter (page multiples, tile sizes)."""
    def r(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=rng))

    if name == "decode":
        kv = [64, 65, 63, 1, r(1, 4000), r(1, 4000), 128 * r(1, 20), r(1, 9000)]
        return [1] * len(kv), kv, 3, None
    if name == "mixed":  # decodes beside a chunk over a context that is not a page multiple
        q = [1, 1, r(65, 700), 1, r(2, 63)]
        kv = [r(1, 3000), 2048, q[2] + r(1, 900), 64, q[4] + r(0, 100)]
        return q, kv, 0, None
    if name == "prefill":  # fresh prompts: one long, one at a tile boundary
        q = [r(900, 1500), 192, 64, 1]
        return q, [q[0], 192, 64 + r(0, 64), r(1, 200)], 0, None
    if name == "chunks":  # continued prompts whose fresh tiles straddle cache pages
        q = [r(100, 400), r(300, 600), 129]
        return q, [q[0] + r(1, 63), q[1] + 64 * r(1, 8) + r(1, 63), 129 + 1000], 0, None
    if name == "empty-rows":  # requests with no new tokens or no KV, padding rows
        return [0, 3, 0, 1, 70], [50, 3 + r(0, 300), 0, r(1, 500), 70 + r(0, 10)], 5, None
    if name == "split":  # long rows split across CTAs, merged by the combine pass
        return [1, 1, r(65, 200), 1], [r(4000, 8000), 8191, 6000, r(1, 70)], 0, CHEAP_SPLITS
    if name.startswith("spec"):  # speculative decoding: every row 1 + k tokens, split too
        q = int(name[4:])
        kv = [q, 64, 64 + q - 1, 65, r(q, 3000), r(q, 9000), 8192, 128 * r(1, 20)]
        return [q] * len(kv), kv, 2, CHEAP_SPLITS
    raise KeyError(name)


SHAPES = ["decode", "mixed", "prefill", "chunks", "empty-rows", "split"]
CASES = [(dt, d, heads, tm, fused)
         for dt, d, heads, fused in itertools.product(
             [torch.bfloat16, torch.float16], [64, 128, 256], HEADS, [False, True])
         for tm in tile_ms_for(d)]


def _case_id(c):
    dt, d, (hq, hkv), tm, fused = c
    return f"{str(dt)[6:]}-d{d}-{hq}x{hkv}-m{tm}" + ("-fused" if fused else "")


def _run(dtype, d, hq, hkv, tile_m, fused, shape, seed, batch_invariant=False,
         spare_pages=None, features=None):
    """Inputs of one case, the kernel's output and cache, and the fp32 reference.
    ``spare_pages``: that many pages beside the used ones, and the used ones moved to the
    top block ids of the cache.  ``features``: the reference's ``window`` / ``softcap`` /
    ``sinks`` (the same passed to the planner and the kernel)."""
    from cute_kernels import ion_attention, make_device_plan, sink_log2

    features = features or {}

    rng = torch.Generator().manual_seed(seed)
    q_lens, seq_lens, pad, cost = _shape(shape, rng)
    case = make_paged_case(seed, q_lens, seq_lens, hq, hkv, d, dtype=dtype, device="cuda",
                           pad_rows=pad, spare_pages=spare_pages,
                           rng_device="cpu" if spare_pages is None else "cuda")
    q, k_cache, v_cache, qsl, sl, bt = case
    if spare_pages is not None:
        n = [-(-L // 64) for L in seq_lens]
        top = k_cache.shape[0] - 1 - torch.randperm(sum(n), generator=rng)
        for b, first in enumerate(itertools.accumulate([0] + n[:-1])):
            bt[b, :n[b]] = top[first:first + n[b]].to(bt.dtype).cuda()
    total = q.shape[0]
    key = torch.randn(total, hkv, d, generator=rng).to(dtype).cuda()
    value = torch.randn(total, hkv, d, generator=rng).to(dtype).cuda()
    slots = new_token_slot_mapping(qsl, sl, bt, 64, total)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference_kv_append(key, value, k_ref, v_ref, slots)
    if not fused:  # the cache already holds this step's K/V
        k_cache.copy_(k_ref)
        v_cache.copy_(v_ref)
    plan = make_device_plan(qsl.cpu(), sl.cpu(), num_kv_heads=hkv, group_size=hq // hkv,
                            head_dim=d, device="cuda", fresh_kv=fused, tile_m=tile_m,
                            cost_model=cost, batch_invariant=batch_invariant,
                            window=features.get("window") or 0)
    out = torch.full_like(q, float("nan"))
    scale = default_softmax_scale(d)
    extra = {}
    if features.get("window"):
        extra["window"] = features["window"]
    if features.get("softcap"):
        extra["softcap"] = features["softcap"]
    if features.get("sinks") is not None:
        extra["sinks_log2"] = sink_log2(features["sinks"].cuda())
    ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, plan,
                  key=key if fused else None, value=value if fused else None, **extra)
    torch.cuda.synchronize()
    return case, out, (k_cache, v_cache), (k_ref, v_ref), plan, scale


def _check_case(case, out, caches, ref_caches, plan, scale, what, features=None):
    q, _, _, qsl, sl, bt = case
    features = {k: (v.cuda() if torch.is_tensor(v) else v)
                for k, v in (features or {}).items()}
    written = written_rows_mask(qsl, sl, q.shape[0]).cuda()
    assert not torch.isnan(out[written]).any(), f"{what}: a row the kernel owns is unwritten"
    assert torch.isnan(out[~written]).all(), f"{what}: a row no request owns was written"
    k_ref, v_ref = ref_caches
    ref = reference_paged_attention(q, k_ref, v_ref, qsl, sl, bt, scale, **features)
    pt = reference_paged_attention(q, k_ref, v_ref, qsl, sl, bt, scale, compute_dtype=q.dtype,
                                   **features)
    err = (out[written].float() - ref[written]).abs().max().item()
    bar = 2 * (pt[written] - ref[written]).abs().max().item() + ATOL
    assert err <= bar, f"{what}: max abs error {err:.3g} > {bar:.3g} (2x PyTorch + atol)"
    rel = relative_error(out, ref, written)
    assert rel <= REL_TOL, f"{what}: relative L2 error {rel:.3g} > {REL_TOL}"
    _check_cache(caches, ref_caches, sl, bt, what)
    return plan


def _check_cache(caches, ref_caches, sl, bt, what):
    """Every position a request holds equals the reference; unused pages are untouched."""
    for name, c, r in zip("KV", caches, ref_caches):
        used = torch.zeros(c.shape[0], dtype=torch.bool)
        for b, L in enumerate(sl.tolist()):
            n = -(-L // 64)
            pages = bt[b, :n].long().cpu()
            used[pages] = True
            got = c[pages.cuda()].transpose(0, 1).reshape(c.shape[1], -1, c.shape[3])[:, :L]
            want = r[pages.cuda()].transpose(0, 1).reshape(c.shape[1], -1, c.shape[3])[:, :L]
            assert torch.equal(got, want), f"{what}: {name} cache of request {b} differs"
        assert torch.equal(c[~used.cuda()], r[~used.cuda()]), \
            f"{what}: {name} pages no request uses were written"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", CASES, ids=_case_id)
def test_kernel_matches_reference(config, shape, seed):
    dtype, d, (hq, hkv), tile_m, fused = config
    what = f"{_case_id(config)} {shape} seed={seed}"
    result = _run(dtype, d, hq, hkv, tile_m, fused, shape, seed)
    plan = _check_case(*result, what)
    if shape == "split":
        assert plan.host.num_splits_max > 1, f"{what}: the split case did not split"


#: (name, head size, (Hq, Hkv), features): the attention of the models the model-coverage
#: issue names (gpt-oss: sinks + 128-token window at d64; Gemma 2 9B: soft cap 50 + 4096
#: window at d256; Gemma 3: 1024 window at d256; Mistral: 4096 window; a cap that bites on
#: random scores), and windows below, at and above one page
FEATURES = [
    ("gpt-oss", 64, (64, 8), dict(window=128, sinks=True)),
    ("gemma2", 256, (16, 8), dict(window=4096, softcap=50.0)),
    ("gemma3", 256, (8, 4), dict(window=1024)),
    ("gemma2-d128", 128, (16, 8), dict(window=4096, softcap=50.0)),
    ("mistral", 128, (32, 8), dict(window=4096)),
    ("cap-bites", 128, (28, 4), dict(softcap=2.0)),
    ("window-1", 128, (28, 4), dict(window=1)),
    ("window-63", 64, (8, 4), dict(window=63)),
    ("window-64", 128, (28, 4), dict(window=64)),
    ("window-65", 128, (32, 2), dict(window=65, sinks=True)),
]


@pytest.mark.parametrize("shape", ["decode", "mixed", "chunks", "split"])
@pytest.mark.parametrize("fused", [False, True], ids=["append", "fused"])
@pytest.mark.parametrize("feature,tile_m", [(f, tm) for f in FEATURES for tm in tile_ms_for(f[1])],
                         ids=[f"{f[0]}-{tm}" for f in FEATURES for tm in tile_ms_for(f[1])])
def test_model_features_match_reference(feature, tile_m, fused, shape, seed):
    """Sliding windows (pruned by the planner, masked at the edge), attention sinks (epilogue
    and split-KV combine) and the logits soft cap, alone and as models combine them, on
    every tile size and both layer paths: the same per-element bar as every kernel case."""
    name, d, (hq, hkv), feat = feature
    feats = dict(feat)
    if feats.pop("sinks", False):
        g = torch.Generator().manual_seed(seed + 3)
        feats["sinks"] = torch.randn(hq, generator=g) * 2.0
    what = f"{name} d{d} {hq}x{hkv} m{tile_m} fused={fused} {shape} seed={seed}"
    result = _run(torch.bfloat16, d, hq, hkv, tile_m, fused, shape, seed, features=feats)
    plan = _check_case(*result, what, features=feats)
    assert plan.window == (feats.get("window") or 0)


@pytest.mark.parametrize("q_len", [2, 4, 9])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("fused", [False, True], ids=["append", "fused"])
def test_speculative_decode_rows_match_reference(q_len, d, fused, seed):
    """Rows of 1 + k query tokens, as vLLM's n-gram and EAGLE proposers send them (k = 1,
    3, 8): contexts at and across page edges, long rows split, GQA 8 and 16, the 64-row
    tiles such uniform batches always get."""
    for hq, hkv in ((32, 4), (32, 2)):
        what = f"spec q={q_len} d{d} {hq}x{hkv} fused={fused} seed={seed}"
        result = _run(torch.bfloat16, d, hq, hkv, 64, fused, f"spec{q_len}", seed)
        plan = _check_case(*result, what)
        assert plan.host.num_splits_max > 1, f"{what}: split-KV not exercised"


@pytest.mark.parametrize("fused", [False, True])
def test_cache_past_int32_offsets(fused, seed):
    """K and V caches of 2^31 elements (4 GiB each), every page a request uses among the
    top block ids: element and byte offsets past 2^31 reach the right pages, in the loads
    and in the fused writeback (its straddling rows too)."""
    hq, hkv, d = 28, 4, 128
    per_block = hkv * 64 * d
    spare = (1 << 31) // per_block  # used pages come on top: past 2^31 elements
    for shape in ("chunks", "split"):
        result = _run(torch.bfloat16, d, hq, hkv, 128, fused, shape, seed, spare_pages=spare)
        case = result[0]
        assert case.k_cache.numel() > 1 << 31
        assert int(case.block_table.max()) * per_block >= 1 << 31
        _check_case(*result, f"int32 offsets fused={fused} {shape} seed={seed}")
        del result, case
        torch.cuda.empty_cache()


@pytest.mark.parametrize("tile_m", [64, 128, 192])
@pytest.mark.parametrize("fused", [False, True])
def test_split_kv_repeats_bit_identically(tile_m, fused, seed):
    """The same split-KV batch run 10 times gives bit-identical outputs and caches (the
    combine adds the splits in a fixed order; nothing depends on CTA timing)."""
    first = None
    for run in range(10):
        _, out, caches, _, plan, _ = _run(torch.bfloat16, 128, 28, 4, tile_m, fused, "split",
                                          seed)
        assert plan.host.num_splits_max > 1, "split-KV not exercised"
        bits = [t.view(torch.int16) for t in (out, *caches)]
        if first is None:
            first = bits
            continue
        for name, a, b in zip(("output", "K cache", "V cache"), bits, first):
            assert torch.equal(a, b), \
                f"run {run}: {name} differs from run 0 (m{tile_m} fused={fused} seed={seed})"


def test_token_output_is_batch_invariant(seed):
    """Planned as under VLLM_BATCH_INVARIANT=1 (kv_append, then attention without split-KV
    on packed 64-row tiles), one request's rows are bit-identical whether it runs alone, in
    a batch, or after other requests (the KV tier's preemption check compares token for
    token and relies on it)."""
    from cute_kernels import ion_attention, make_device_plan

    hq, hkv, d = 28, 4, 128
    rng = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(700, 9000, (5,), generator=rng)] + [8191]
    q_lens = [1, 1, 150, 1, 64, 1]
    case = make_paged_case(seed, q_lens, lens, hq, hkv, d, device="cuda")
    q, k_cache, v_cache, qsl, sl, bt = case
    scale = default_softmax_scale(d)

    def attend(rows):
        """Output rows of the requests ``rows``, batched together in that order."""
        sub_q = torch.cat([q[int(qsl[r]):int(qsl[r + 1])] for r in rows])
        sub_qsl = torch.tensor([0] + list(itertools.accumulate(q_lens[r] for r in rows)),
                               dtype=torch.int32)
        sub_sl = torch.tensor([lens[r] for r in rows], dtype=torch.int32)
        sub_bt = bt[torch.tensor(rows, device="cuda")].contiguous()
        out = torch.full_like(sub_q, float("nan"))
        plan = make_device_plan(sub_qsl, sub_sl, num_kv_heads=hkv, group_size=hq // hkv,
                                head_dim=d, device="cuda", batch_invariant=True)
        ion_attention(sub_q, k_cache, v_cache, out, sub_qsl.cuda(), sub_sl.cuda(), sub_bt,
                      scale, plan)
        torch.cuda.synchronize()
        return {r: out[int(a):int(a) + q_lens[r]] for r, a in zip(rows, sub_qsl[:-1])}

    together = attend(list(range(6)))
    for order in ([5, 2, 0], [2], [4, 3, 1, 5]):
        for r, rows in attend(order).items():
            assert torch.equal(rows, together[r]), f"request {r} differs (seed={seed})"


@pytest.mark.parametrize("tile_m", [64, 128, 192])
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_graph_replays_new_batches(tile_m, fused, seed):
    """One launch captured in a CUDA graph, as vLLM captures a layer, then replayed on new
    values and on new lengths planned into the same device buffers (split-KV forced, the
    combine always launched): every replay matches the reference."""
    from cute_kernels import ion_attention
    from cute_kernels.device_plan import DevicePlan, grid_ctas
    from cute_kernels.planner import plan

    hq, hkv, d = 28, 4, 128
    q_lens, seq_lens = [1, 1, 1, 1, 300], [30000, 12000, 700, 20000, 2300]
    case = make_paged_case(seed, q_lens, seq_lens, hq, hkv, d, device="cuda",
                           rng_device="cuda")
    q, k_cache, v_cache, qsl, sl, bt = case
    key = torch.empty(q.shape[0], hkv, d, dtype=q.dtype, device="cuda")
    value = torch.empty_like(key)
    scale = default_softmax_scale(d)
    ctas = grid_ctas("cuda", tile_m)
    rows = 256 * grid_ctas("cuda", 64)

    def host_plan():
        return plan(qsl.cpu().numpy(), sl.cpu().numpy(), num_kv_heads=hkv, group_size=hq // hkv,
                    num_ctas=ctas, tile_m=tile_m, max_partial_rows=rows,
                    cost_model=CHEAP_SPLITS, fresh_kv=fused, unpacked_prefill=True)

    first = host_plan()
    dp = DevicePlan(item_capacity=4 * first.n_items, group_capacity=4 * first.n_items,
                    partial_rows_capacity=rows, num_ctas=ctas, head_dim=d, device="cuda",
                    tile_m=tile_m, always_combine=True).upload(first)
    out = torch.empty_like(q)

    def launch():
        ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, plan=dp,
                      key=key if fused else None, value=value if fused else None)

    launch()  # compiles and loads outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens_rng = torch.Generator().manual_seed(seed)
    for step in range(4):
        for t in (q, k_cache, v_cache, key, value):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
        if step >= 2:  # new decode lengths within each request's own pages
            new = [int(torch.randint(1, L + 1, (1,), generator=lens_rng))
                   for L in seq_lens[:4]] + [seq_lens[4]]
            sl.copy_(torch.tensor(new, dtype=sl.dtype))
            dp.upload(host_plan())
        assert dp.host.num_splits_max > 1, "split-KV not exercised"
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        if fused:
            reference_kv_append(key, value, k_ref, v_ref,
                                new_token_slot_mapping(qsl, sl, bt, 64, q.shape[0]))
        out.fill_(float("nan"))
        dp.partial_o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_case(case, out, (k_cache, v_cache), (k_ref, v_ref), dp, scale,
                    f"m{tile_m} fused={fused} replay {step} seed={seed}")


@pytest.mark.parametrize("fused", [False, True])
def test_kernels_loaded_from_the_cache_run_right(fused, seed, tmp_path, monkeypatch):
    """A process start loads its kernels from the persistent cache, compiling nothing: the
    loaded kernels (exported object files, not the in-process compile) pass the same
    checks as the compiled ones."""
    from cute_kernels import attention, kernel_cache

    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(tmp_path))
    compiled = []
    real_compile = attention._compile

    def counting_compile(kernel_and_args):
        compiled.append(1)
        return real_compile(kernel_and_args)

    monkeypatch.setattr(attention, "_compile", counting_compile)
    for cached in (attention.compiled_attention, attention._compiled_combine):
        cached.cache_clear()
    try:
        _run(torch.bfloat16, 128, 28, 4, 128, fused, "split", seed)  # compiles, exports
        assert compiled and len(list(tmp_path.glob("*.o"))) == 2
        compiled.clear()
        for cached in (attention.compiled_attention, attention._compiled_combine):
            cached.cache_clear()
        result = _run(torch.bfloat16, 128, 28, 4, 128, fused, "split", seed)
        assert not compiled, "a kernel was compiled although the cache held it"
        _check_case(*result, f"cached fused={fused} seed={seed}")
    finally:
        for cached in (attention.compiled_attention, attention._compiled_combine):
            cached.cache_clear()


@pytest.mark.parametrize("tile_m", [64, 128])
def test_plan_from_lengths_ahead_of_the_device(tile_m, seed):
    """Under async speculative decoding vLLM's host ``seq_lens`` may run ahead of the
    device's, and the backend plans from the host copy: the plan then holds a unit past the
    step's fresh tiles.  The kernel masks it and stores nothing from it, so no page past a
    request's last is written and the output is the device lengths' attention."""
    from cute_kernels import ion_attention, make_device_plan

    hq, hkv, d = 28, 4, 128
    q_lens = [4, 1, 3]
    device_lens = [132, 640, 190]  # contexts 128, 639, 187
    host_lens = [134, 641, 195]    # 2, 1 and 5 tokens ahead: 128 -> 130 crosses a page
    case = make_paged_case(seed, q_lens, device_lens, hq, hkv, d, device="cuda",
                           extra_table_cols=3)
    q, k_cache, v_cache, qsl, sl, bt = case
    rng = torch.Generator().manual_seed(seed)
    key = torch.randn(q.shape[0], hkv, d, generator=rng).to(q.dtype).cuda()
    value = torch.randn(q.shape[0], hkv, d, generator=rng).to(q.dtype).cuda()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference_kv_append(key, value, k_ref, v_ref,
                        new_token_slot_mapping(qsl, sl, bt, 64, q.shape[0]))
    plan = make_device_plan(qsl.cpu(), torch.tensor(host_lens, dtype=torch.int32),
                            num_kv_heads=hkv, group_size=hq // hkv, head_dim=d, device="cuda",
                            fresh_kv=True, tile_m=tile_m)
    out = torch.full_like(q, float("nan"))
    scale = default_softmax_scale(d)
    ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, plan, key=key, value=value)
    torch.cuda.synchronize()
    _check_case(case, out, (k_cache, v_cache), (k_ref, v_ref), plan, scale,
                f"host lengths ahead, m{tile_m} seed={seed}")
