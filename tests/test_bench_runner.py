"""The kernel-suite driver's bookkeeping on CPU: CUDA timing calls are replaced by
host-clock stand-ins and the backends by CPU attention over each layout, so the
skip/error handling, the ION-vs-FA3 cross-check and the derived metrics are exercised."""

import time

import pytest

torch = pytest.importorskip("torch")

from ion_vllm.bench import kernel_runner as kr  # noqa: E402
from ion_vllm.bench import kernel_suite as ks  # noqa: E402


class _Event:
    def __init__(self, enable_timing=True):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1000.0


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(kr, "_CYCLES_PER_US", 1000.0)


def _attend(case, q, kc, vc, bt, page, hnd):
    """fp32 causal paged attention written independently of the reference."""
    out = torch.empty_like(q)
    g = case.hq // case.hkv
    qsl = case.query_start_loc()
    for b, (ql, kv) in enumerate(zip(case.q_lens, case.kv_lens)):
        t = torch.arange(kv)
        pg, off = bt[b, t // page].long(), t % page
        k = kc[pg, :, off] if hnd else kc[pg, off]
        v = vc[pg, :, off] if hnd else vc[pg, off]
        k = k.float().repeat_interleave(g, 1)
        v = v.float().repeat_interleave(g, 1)
        qq = q[qsl[b]:qsl[b + 1]].float()
        s = torch.einsum("ihd,lhd->hil", qq, k) * case.d ** -0.5
        qpos = kv - ql + torch.arange(ql)
        s = s.masked_fill(t[None, None] > qpos[None, :, None], float("-inf"))
        out[qsl[b]:qsl[b + 1]] = torch.einsum("hil,lhd->ihd", s.softmax(-1), v).to(q.dtype)
    return out


def _fake_backends(monkeypatch, calls):
    def ion(case, rot, device, shared):
        calls.append(("ion", case.name, rot))
        q, k, v, bt = kr.ion_cache(case, rot, device)
        out = torch.empty_like(q)
        return kr.Prepared(lambda: out.copy_(_attend(case, q, k, v, bt, case.ion_page, True)),
                           out)

    def fa3(case, rot, device, shared):
        calls.append(("fa3", case.name, rot))
        q, k, v, bt = kr.fa_cache(case, rot, device)
        out = torch.empty_like(q)
        return kr.Prepared(lambda: out.copy_(_attend(case, q, k, v, bt, case.fa_page, False)),
                           out)

    def fa4(case, rot, device, shared):
        calls.append(("fa4", case.name, rot))
        raise kr.BackendUnavailable("FA4 unsupported: test")

    def triton(case, rot, device, shared):
        calls.append(("triton", case.name, rot))
        q, k, v, bt = kr.triton_cache(case, rot, device)
        out = torch.zeros_like(q)     # wrong on purpose: a broken backend must show up

        def call():
            raise RuntimeError("kernel exploded")
        return kr.Prepared(call, out)

    monkeypatch.setitem(kr.PREPARE, "ion", ion)
    monkeypatch.setitem(kr.PREPARE, "fa3", fa3)
    monkeypatch.setitem(kr.PREPARE, "fa4", fa4)
    monkeypatch.setitem(kr.PREPARE, "triton", triton)


L2 = 128 * 1024  # tiny pretend L2 so that the tiny cases rotate over 3 copies
CASES = [ks.Case("tiny-a", (1, 1, 4), (40, 90, 70), hq=4, hkv=2, d=64),
         ks.Case("tiny-b", (1,), (130,), hq=8, hkv=2, d=64, fa_page=64)]


def test_suite_driver_records(fake_cuda, monkeypatch):
    calls = []
    _fake_backends(monkeypatch, calls)
    snapshots = []
    lines = []
    recs = kr.run_kernel_suite(CASES, ["ion", "fa3", "fa4", "triton"], iters=5, warmup=1,
                               device="cpu", ceilings={"copy_gbps": 100.0, "gemm_tflops": 1.0},
                               suite_label="t", log=lines.append, l2_bytes=L2,
                               on_record=lambda rs: snapshots.append(len(rs)))
    assert [(r["case"], r["backend"], r["status"]) for r in recs] == [
        ("tiny-a", "ion", "ok"), ("tiny-a", "fa3", "ok"), ("tiny-a", "fa4", "skipped"),
        ("tiny-a", "triton", "error"),
        ("tiny-b", "ion", "ok"), ("tiny-b", "fa3", "ok"), ("tiny-b", "fa4", "skipped"),
        ("tiny-b", "triton", "error")]
    assert snapshots == list(range(1, 9))
    # an unavailable backend is probed once, not once per case
    assert [c for c in calls if c[0] == "fa4"] == [("fa4", "tiny-a", 0)]
    # KV rotations: tiny cases need many copies to exceed 2x L2
    n_rot = ks.rotations(CASES[0], L2)
    assert n_rot == 3
    assert [c[2] for c in calls if c[:2] == ("ion", "tiny-a")] == list(range(n_rot))
    for r in recs:
        assert r["suite"] == "kernel" and r["kernel_suite"] == "t"
        assert r["bytes"] == ks.min_bytes(next(c for c in CASES if c.name == r["case"]))
    ok = [r for r in recs if r["status"] == "ok"]
    for r in ok:
        assert r["iters"] == 5 and r["rotations"] >= 2
        assert r["p10_us"] <= r["median_us"] <= r["p90_us"]
        sec = r["median_us"] * 1e-6
        assert r["achieved_gbps"] == pytest.approx(r["bytes"] / sec / 1e9)
        assert r["frac_copy_bw"] == pytest.approx(r["achieved_gbps"] / 100.0)
        assert r["frac_gemm"] == pytest.approx(r["flops"] / sec / 1e12)
    # ION ran before FA3: its cross-check is back-filled once FA3 finishes
    for r in ok:
        if r["backend"] == "ion":
            assert r["rel_err_vs_fa3"] < 1e-2
    assert "kernel exploded" in recs[3]["error"]
    assert any("skipped" in line for line in lines)
    assert any("rel_err vs fa3" in line for line in lines)


def test_fa3_first_cross_checks_in_place(fake_cuda, monkeypatch):
    _fake_backends(monkeypatch, [])
    recs = kr.run_kernel_suite(CASES[:1], ["fa3", "ion"], iters=3, warmup=0, device="cpu",
                               log=lambda s: None, l2_bytes=L2)
    assert recs[1]["backend"] == "ion" and recs[1]["rel_err_vs_fa3"] < 1e-2
    assert recs[0]["frac_copy_bw"] is None  # no ceilings measured


def test_time_calls_cycles_through_rotations(fake_cuda):
    seen = []
    calls = [lambda i=i: seen.append(i) for i in range(3)]
    ts = kr.time_calls(calls, iters=7, warmup=2)
    assert len(ts) == 7 and all(t >= 0 for t in ts)
    # warm-up (2), host-cost probe (min(10, iters) = 7), then 7 timed calls
    assert seen[-7:] == [0, 1, 2, 0, 1, 2, 0]


def test_synced_timing_syncs_each_call_and_is_recorded(fake_cuda, monkeypatch):
    """--timing synced: one host call per synchronize (launch latency included), and the
    record says which timing produced it."""
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: log.append("sync"))
    ts = kr.time_calls_synced([lambda: log.append("call")], iters=4, warmup=2)
    assert len(ts) == 4 and all(t >= 0 for t in ts)
    timed = log[log.index("sync") + 1:]  # after the warm-up sync
    assert timed == ["call", "sync"] * 4
    calls = []
    _fake_backends(monkeypatch, calls)
    recs = kr.run_kernel_suite(CASES[:1], ["fa3"], iters=3, warmup=0, device="cpu",
                               l2_bytes=L2, timing="synced", log=lambda *_: None)
    assert recs[0]["status"] == "ok" and recs[0]["timing"] == "synced"


def test_interleave_and_split_are_inverse():
    """interleave_calls alternates backends call by call (a backend with fewer rotations
    wraps around), and split_interleaved gives each backend back its own times in order."""
    calls = {"a": ["a0", "a1", "a2"], "b": ["b0"], "c": ["c0", "c1"]}
    assert kr.interleave_calls(calls) == ["a0", "b0", "c0", "a1", "b0", "c1",
                                          "a2", "b0", "c0"]
    ts = list(range(12))
    assert kr.split_interleaved(ts, ["a", "b", "c"]) == {
        "a": [0, 3, 6, 9], "b": [1, 4, 7, 10], "c": [2, 5, 8, 11]}


def test_interleaved_timing_runs_backends_call_by_call(fake_cuda, monkeypatch):
    """--timing interleaved: every backend of a case is prepared first, then timed in one
    queued stream that alternates backends; each record holds its own `iters` times, says
    which backends it was interleaved with, and keeps the FA3 cross-check. A backend that
    cannot be prepared gets its own error record and does not stop the others."""
    calls = []
    _fake_backends(monkeypatch, calls)
    order = []
    for be in ("ion", "fa3"):
        prep = kr.PREPARE[be]

        def wrapped(case, rot, device, shared, prep=prep, be=be):
            p = prep(case, rot, device, shared)
            return kr.Prepared(lambda: (order.append(be), p.call())[1], p.out)
        monkeypatch.setitem(kr.PREPARE, be, wrapped)
    recs = kr.run_kernel_suite(CASES[:1], ["ion", "triton", "fa3"], iters=4, warmup=1,
                               device="cpu", log=lambda *_: None, l2_bytes=L2,
                               timing="interleaved")
    assert [(r["backend"], r["status"]) for r in recs] == [
        ("ion", "ok"), ("triton", "error"), ("fa3", "ok")]
    for r in (recs[0], recs[2]):
        assert r["timing"] == "interleaved" and r["iters"] == 4 and len(r["iter_us"]) == 4
        assert r["interleaved_with"] == ["ion", "fa3"]
    assert recs[0]["rel_err_vs_fa3"] < 1e-2
    assert "kernel exploded" in recs[1]["error"]
    # after each backend's first (preparation) call: warm-up, probe and timed calls alternate
    timed = order[2:]
    assert timed[-8:] == ["ion", "fa3"] * 4


def test_interleaved_timing_falls_back_to_one_backend_at_a_time(fake_cuda, monkeypatch):
    """A backend that breaks during the joint run: the others are timed alone ("queued"),
    and the broken one gets an error record."""
    _fake_backends(monkeypatch, [])
    n = {"calls": 0}
    prep_ion = kr.PREPARE["ion"]

    def flaky(case, rot, device, shared):
        p = prep_ion(case, rot, device, shared)

        def call():
            n["calls"] += 1
            if n["calls"] > 3:
                raise RuntimeError("flaky kernel")
            return p.call()
        return kr.Prepared(call, p.out)
    monkeypatch.setitem(kr.PREPARE, "ion", flaky)
    recs = kr.run_kernel_suite(CASES[:1], ["ion", "fa3"], iters=3, warmup=0, device="cpu",
                               log=lambda *_: None, l2_bytes=L2, timing="interleaved")
    assert [(r["backend"], r["status"]) for r in recs] == [("ion", "error"), ("fa3", "ok")]
    assert "flaky kernel" in recs[0]["error"]
    assert recs[1]["timing"] == "queued" and recs[1]["iters"] == 3


def test_unknown_timing_is_refused():
    with pytest.raises(ValueError, match="interleaved"):
        kr.run_kernel_suite([], ["fa3"], timing="sometimes", device="cpu")


def test_ion_unpacked_backend_plans_unpacked(monkeypatch):
    """`ion-unpacked` runs ION on an unpacked_prefill plan; `ion` keeps the default plan."""
    seen = []

    def fake_plan(case, device, **opts):
        seen.append(opts)
        return object()

    monkeypatch.setattr(kr, "_ion_plan", fake_plan)
    monkeypatch.setattr(kr, "ion_cache", lambda case, rot, device: (torch.zeros(1, 4, 64),) * 4)
    monkeypatch.setattr(kr, "_common_meta", lambda case, device: (None, None))
    assert "ion-unpacked" in kr.BACKENDS and "ion-unpacked" in kr.PREPARE
    for name in ("ion", "ion-unpacked", "ion-m128", "ion-m128-unpacked"):
        assert name in kr.BACKENDS
        kr.PREPARE[name](CASES[0], 0, "cpu", {})
    assert seen == [{}, {"unpacked_prefill": True}, {"tile_m": 128},
                    {"tile_m": 128, "unpacked_prefill": True}]


def test_ion_auto_backend_plans_like_the_vllm_backend(monkeypatch):
    """`ion-auto` plans what the vLLM backend plans by default: unpacked prefill tiles and
    planner.choose_tile_m's tile size with 192-row tiles allowed, as the backend's
    ION_PREFILL_TILE_M=auto (192 for a lone 8192 prefill, 64 once decodes dominate)."""
    from ion_vllm.bench.kernel_suite import Case

    seen = []
    monkeypatch.setattr(kr, "_ion_plan", lambda case, device, **opts: seen.append(opts))
    monkeypatch.setattr(kr, "ion_cache", lambda case, rot, device: (torch.zeros(1, 4, 64),) * 4)
    monkeypatch.setattr(kr, "_common_meta", lambda case, device: (None, None))
    prefill = Case("p", q_lens=(8192,), kv_lens=(8192,))
    mixed = Case("m", q_lens=(1,) * 32 + (2048,), kv_lens=(8192,) * 32 + (2048,))
    for case in (prefill, mixed):
        kr.PREPARE["ion-auto"](case, 0, "cpu", {})
    auto = {"unpacked_prefill": True, "row_combine": True, "lane_combine": True}
    assert seen == [dict(auto, tile_m=192), dict(auto, tile_m=64)]
    # the combine ion-auto plans is the backend's default one (ION_LANE_COMBINE and
    # ION_ROW_COMBINE unset: the split-parallel combine)
    import ion_vllm.backend as backend_mod
    monkeypatch.delenv(backend_mod.ROW_COMBINE_ENV, raising=False)
    monkeypatch.delenv(backend_mod.LANE_COMBINE_ENV, raising=False)
    assert backend_mod.row_combine() is True and backend_mod.lane_combine() is True
    seen.clear()
    kr.PREPARE["ion-auto-rc"](mixed, 0, "cpu", {})
    kr.PREPARE["ion-auto-gc"](mixed, 0, "cpu", {})
    assert [(o["lane_combine"], o["row_combine"]) for o in seen] == [(False, True),
                                                                      (False, False)]
    assert all(o["tile_m"] == 64 and o["unpacked_prefill"] for o in seen)
    # ion-auto-lr: the same plan options on the lazy-rescaling kernels
    seen.clear()
    kr.PREPARE["ion-auto-lr"](prefill, 0, "cpu", {})
    assert seen == [dict(auto, tile_m=192, lazy_rescale=True)]
    assert "ion-auto-lr" in kr.BACKENDS
    # ion-auto-pdl: the same plan options, combine by programmatic dependent launch
    seen.clear()
    kr.PREPARE["ion-auto-pdl"](mixed, 0, "cpu", {})
    assert seen == [dict(auto, tile_m=64, pdl_combine=True)]
    assert "ion-auto-pdl" in kr.BACKENDS
    # ion-auto-lc: the split-parallel combine, now the default: the same as ion-auto
    seen.clear()
    kr.PREPARE["ion-auto-lc"](mixed, 0, "cpu", {})
    assert seen == [dict(auto, tile_m=64)]
    assert "ion-auto-lc" in kr.BACKENDS
    # ion-auto-kp: page pairs on the 128-row tiles only (a mixed step keeps ion-auto's plan)
    seen.clear()
    kr.PREPARE["ion-auto-kp"](prefill, 0, "cpu", {})
    kr.PREPARE["ion-auto-kp"](mixed, 0, "cpu", {})
    assert seen == [dict(auto, tile_m=128, kv_pair=True), dict(auto, tile_m=64, kv_pair=False)]
    assert "ion-auto-kp" in kr.BACKENDS
    # ion-auto-s2 / ion-auto-fused-s2: two K/V stages on the 128-row tiles only
    seen.clear()
    kr.PREPARE["ion-auto-s2"](prefill, 0, "cpu", {})
    kr.PREPARE["ion-auto-s2"](mixed, 0, "cpu", {})
    assert seen == [dict(auto, tile_m=128, kv_stages=2), dict(auto, tile_m=64, kv_stages=None)]
    assert "ion-auto-s2" in kr.BACKENDS and "ion-auto-fused-s2" in kr.BACKENDS


def test_ion_auto_p128_runs_the_auto_path_over_128_token_pages(monkeypatch):
    """`ion-auto-p128`: the backend's default plan options over a cache of 128-token pages
    (the plan, the cache and the call all see page 128; the call admits it explicitly)."""
    from ion_vllm.bench.kernel_suite import Case

    seen, calls = [], []
    monkeypatch.setattr(kr, "_ion_plan",
                        lambda case, device, **opts: seen.append((case.ion_page, opts)) or "plan")
    monkeypatch.setattr(kr, "ion_cache",
                        lambda case, rot, device: calls.append(case.ion_page)
                        or (torch.zeros(1, 4, 64),) * 4)
    monkeypatch.setattr(kr, "_common_meta", lambda case, device: (None, None))
    import cute_kernels
    got = {}
    monkeypatch.setattr(cute_kernels, "ion_attention",
                        lambda *a, **kw: got.update(kw))
    prefill = Case("p", q_lens=(8192,), kv_lens=(8192,))
    prep = kr.PREPARE["ion-auto-p128"](prefill, 0, "cpu", {})
    prep.call()
    assert seen == [(128, {"unpacked_prefill": True, "tile_m": 128, "row_combine": True,
                           "lane_combine": True})]
    assert calls == [128] and got == {"plan": "plan", "experimental_pages": True}
    got.clear()
    kr.PREPARE["ion-auto"](prefill, 0, "cpu", {}).call()
    assert got == {"plan": "plan", "experimental_pages": False}


def test_new_token_rows_are_the_cache_rows_at_their_slots():
    """`ion-auto-append` / `ion-auto-fused` write the step's new K/V: each request's last
    q_len logical tokens, to the slots where `ion_cache` put those tokens (so rewriting them
    leaves the cache as it was)."""
    from ion_vllm.bench.kernel_suite import Case

    case = Case("t", q_lens=(1, 70, 2, 3), kv_lens=(130, 70, 5, 64), hq=4, hkv=2, d=64)
    q, k, v, bt = kr.ion_cache(case, 1, "cpu")
    key, value, slots = kr.new_token_rows(case, 1, "cpu")
    assert key.shape == (sum(case.q_lens), 2, 64) == value.shape and slots.dtype == torch.int64
    P = case.ion_page
    page, off = slots // P, slots % P
    assert torch.equal(k[page, :, off], key) and torch.equal(v[page, :, off], value)
    # request-major, last q_len tokens of each request: slots of request 0 are its token 129
    assert int(slots[0]) == int(bt[0, 129 // P]) * P + 129 % P
    assert not torch.equal(key[0], key[1])  # fresh values, never zeros


def test_append_and_fused_backends(monkeypatch):
    """`ion-auto-append` times kv_append of the new rows before the default attention;
    `ion-auto-fused` plans fresh_kv with ion-auto's options and passes key / value."""
    import cute_kernels

    from ion_vllm.bench.kernel_suite import Case

    plans, calls = [], []
    monkeypatch.setattr(kr, "_ion_plan", lambda case, device, **o: plans.append(o) or "plan")
    monkeypatch.setattr(cute_kernels, "kv_append",
                        lambda *a: calls.append(("append", a[4].tolist())))
    monkeypatch.setattr(cute_kernels, "ion_attention",
                        lambda *a, **kw: calls.append(("attn", sorted(kw))))
    case = Case("m", q_lens=(1, 1, 200), kv_lens=(300, 64, 260), hq=4, hkv=2, d=64)
    kr.PREPARE["ion-auto-append"](case, 0, "cpu", {}).call()
    _, _, slots = kr.new_token_rows(case, 0, "cpu")
    assert calls[0] == ("append", slots.tolist()) and calls[1][0] == "attn"
    assert "key" not in calls[1][1]
    calls.clear()
    kr.PREPARE["ion-auto-fused"](case, 0, "cpu", {}).call()
    assert calls == [("attn", ["key", "plan", "value"])]
    assert plans[-1] == dict(kr.auto_plan_options(case), fresh_kv=True)
    assert "fresh_kv" not in plans[0]
    # ion-auto-fused-kp: the same, with page pairs where the plan has 128-row tiles
    prefill = Case("p", q_lens=(300,), kv_lens=(300,), hq=4, hkv=2, d=64)
    for c, pair in ((case, False), (prefill, True)):
        calls.clear()
        kr.PREPARE["ion-auto-fused-kp"](c, 0, "cpu", {}).call()
        assert calls == [("attn", ["key", "plan", "value"])]
        assert plans[-1] == dict(kr.auto_plan_options(c), fresh_kv=True, kv_pair=pair)
        assert plans[-1]["tile_m"] == (128 if pair else 64)
    # ion-auto-fused-s2: the same, with two K/V stages where the plan has 128-row tiles
    for c, shallow in ((case, False), (prefill, True)):
        calls.clear()
        kr.PREPARE["ion-auto-fused-s2"](c, 0, "cpu", {}).call()
        assert calls == [("attn", ["key", "plan", "value"])]
        assert plans[-1] == dict(kr.auto_plan_options(c), fresh_kv=True,
                                 kv_stages=2 if shallow else None)
    # ion-auto-fused-wf: the same plan options, planned without the final local search
    calls.clear()
    kr.PREPARE["ion-auto-fused-wf"](prefill, 0, "cpu", {}).call()
    assert calls == [("attn", ["key", "plan", "value"])]
    assert plans[-1] == dict(kr.auto_plan_options(prefill), fresh_kv=True, refine_balance=False)
    assert "ion-auto-fused-wf" in kr.BACKENDS
    # ion-auto-nsu / ion-auto-fused-nsu: the same plan options, unpacked items never split
    for name, fused in (("ion-auto-nsu", False), ("ion-auto-fused-nsu", True)):
        calls.clear()
        kr.PREPARE[name](prefill, 0, "cpu", {}).call()
        assert calls == [("attn", ["key", "plan", "value"] if fused
                          else ["experimental_pages", "plan"])]
        want = dict(kr.auto_plan_options(prefill), split_unpacked=False)
        if fused:
            want["fresh_kv"] = True
        assert plans[-1] == want
        assert name in kr.BACKENDS
    # ion-auto-fused-t128 / -t192: the tile size forced on steps with a prefill row (a mixed
    # step the auto policy gives 64 rows), 64 on decode-only steps
    mixed = Case("m", q_lens=(1,) * 31 + (600,), kv_lens=(8192,) * 31 + (600,), hq=4,
                 hkv=2, d=64)
    decode_only = Case("d", q_lens=(1, 1), kv_lens=(300, 64), hq=4, hkv=2, d=64)
    assert kr.auto_plan_options(mixed)["tile_m"] == 64
    for name, tm in (("ion-auto-fused-t128", 128), ("ion-auto-fused-t192", 192)):
        for c, want_tm in ((mixed, tm), (decode_only, 64)):
            calls.clear()
            kr.PREPARE[name](c, 0, "cpu", {}).call()
            assert calls == [("attn", ["key", "plan", "value"])]
            assert plans[-1] == dict(kr.auto_plan_options(c), fresh_kv=True, tile_m=want_tm)
        assert name in kr.BACKENDS
    # ion-auto-fused-vs: the default fused plan, on the vectorized-straddle kernels
    for c in (mixed, decode_only):
        calls.clear()
        kr.PREPARE["ion-auto-fused-vs"](c, 0, "cpu", {}).call()
        assert calls == [("attn", ["key", "plan", "value"])]
        assert plans[-1] == dict(kr.auto_plan_options(c), fresh_kv=True, vec_straddle=True)
    assert "ion-auto-fused-vs" in kr.BACKENDS
    for c in (mixed, decode_only):
        calls.clear()
        kr.PREPARE["ion-auto-fused-si"](c, 0, "cpu", {}).call()
        assert plans[-1] == dict(kr.auto_plan_options(c), fresh_kv=True, skip_idle=True)
    assert "ion-auto-fused-si" in kr.BACKENDS
    kr.PREPARE["ion-auto-fused-vs-si"](mixed, 0, "cpu", {}).call()
    assert plans[-1] == dict(kr.auto_plan_options(mixed), fresh_kv=True, vec_straddle=True,
                             skip_idle=True)
    # ion-auto-fused-vs64: ion-auto-fused-vs whose plan runs the 16-byte kernels at head
    # size 64 too (make_device_plan gives such plans the element-wise ones)
    assert "ion-auto-fused-vs64" in kr.BACKENDS

    class FakePlan:
        vec_straddle_mode = False

    monkeypatch.setattr(kr, "_ion_plan", lambda case, device, **o: plans.append(o) or FakePlan())
    for c, want in ((mixed, True), (Case("m128", q_lens=(1, 300), kv_lens=(900, 300),
                                         hq=8, hkv=2, d=128), False)):
        shared = {}
        for rot in (0, 1):
            calls.clear()
            kr.PREPARE["ion-auto-fused-vs64"](c, rot, "cpu", shared).call()
            assert calls == [("attn", ["key", "plan", "value"])]
        assert plans[-1] == dict(kr.auto_plan_options(c), fresh_kv=True, vec_straddle=True)
        assert shared["ion_plan"].vec_straddle_mode is want  # D = 64 forced, D = 128 as asked
