"""The kernel benchmark on the CPU: each backend's cache layout holds the same logical
K/V; the ION backends drive the ``cute_kernels`` API as documented (a plain-PyTorch stand-in
here, so neither a GPU nor the kernels are needed); the suite driver's timing (CUDA events
replaced by the host clock), interleaving, correctness check and failure handling."""

import sys
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from ion_vllm.bench import kernel_runner as kr  # noqa: E402
from ion_vllm.bench import kernel_suite as ks  # noqa: E402

P = ks.PAGE
CASE = ks.Case("layout", (1, 3, 70), (70, 20, 130), hq=4, hkv=2, d=64)
CASES = [ks.Case("tiny-a", (1, 1, 4), (40, 90, 70), hq=4, hkv=2, d=64),
         ks.Case("tiny-b", (1, 65), (130, 65), hq=8, hkv=2, d=64, qkv_layout="fused")]
L2 = 128 * 1024  # a pretend L2 small enough that the tiny cases rotate over several copies


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny CPU ops: an intra-op thread pool only adds wake-up latency (200x on a busy
    2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def attend(q, kc, vc, qsl, seq_lens, bt, scale, hnd=True):
    """fp32 causal paged GQA attention, written independently of the kernels' reference."""
    page = kc.shape[2] if hnd else kc.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    g = q.shape[1] // kc.shape[1 if hnd else 2]
    for b in range(len(seq_lens)):
        s0, s1, kv = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        t = torch.arange(kv)
        pg, off = bt[b, t // page].long(), t % page
        k = (kc[pg, :, off] if hnd else kc[pg, off]).float().repeat_interleave(g, 1)
        v = (vc[pg, :, off] if hnd else vc[pg, off]).float().repeat_interleave(g, 1)
        s = torch.einsum("ihd,lhd->hil", q[s0:s1].float(), k) * scale
        qpos = kv - (s1 - s0) + torch.arange(s1 - s0)
        s = s.masked_fill(t[None, None] > qpos[None, :, None], float("-inf"))
        out[s0:s1] = torch.einsum("hil,lhd->ihd", s.softmax(-1), v)
    return out


class FakeKernels:
    """The ``cute_kernels`` API of the default path, in plain PyTorch; records its calls."""
    PAGE_SIZE = 64

    def __init__(self, broken=False):
        self.calls, self.plans, self.broken = [], [], broken

    def make_device_plan(self, qsl, seq_lens, *, num_kv_heads, group_size, head_dim, device,
                         fresh_kv=False, tile_m="auto", num_ctas=None):
        self.plans.append(dict(qsl=list(qsl), seq_lens=list(seq_lens), hkv=num_kv_heads,
                               group=group_size, d=head_dim, fresh_kv=fresh_kv, tile_m=tile_m))
        return SimpleNamespace(fresh_kv=fresh_kv)

    def kv_append(self, key, value, kc, vc, slots):
        self.calls.append("append")
        kc[slots // P, :, slots % P] = key
        vc[slots // P, :, slots % P] = value

    def ion_attention(self, q, kc, vc, out, qsl, seq_lens, bt, scale, plan=None, *,
                      key=None, value=None):
        self.calls.append("fused" if key is not None else "attn")
        assert plan is not None and plan.fresh_kv == (key is not None)
        if key is not None:  # fused writeback: the new rows at seq_len - q_len .. seq_len
            for b in range(len(seq_lens)):
                s0, s1, kv = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
                t = torch.arange(kv - (s1 - s0), kv)
                kc[bt[b, t // P].long(), :, t % P] = key[s0:s1]
                vc[bt[b, t // P].long(), :, t % P] = value[s0:s1]
        if not self.broken:  # broken: never writes out (it stays NaN-poisoned)
            out.copy_(attend(q, kc, vc, qsl, seq_lens, bt, scale).to(out.dtype))
        return out


# --------------------------------------------------------------------------- layouts

def test_logical_data_deterministic_per_rotation():
    a, b, c = (kr.logical_qkv(CASE, r, "cpu") for r in (0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[1], c[1])
    assert a[0].shape == (74, 4, 64) and a[1].shape == (220, 2, 64)
    assert a[0].dtype == torch.bfloat16 and 0.8 < a[1].float().std() < 1.2


def test_page_assignment_is_a_shuffled_permutation():
    bt, tp, to, n = kr.page_assignment(CASE, 16, 0)
    used = [int(bt[b, j]) for b, kv in enumerate(CASE.kv_lens) for j in range(-(-kv // 16))]
    assert sorted(used) == list(range(n)) and used != sorted(used)
    assert tp.shape == to.shape == (CASE.total_kv,)


@pytest.mark.parametrize("build,page,hnd", [(kr.ion_cache, P, True), (kr.fa_cache, 16, False),
                                            (kr.triton_cache, 16, False)])
def test_every_layout_holds_the_same_logical_kv(build, page, hnd):
    _, k_log, v_log = kr.logical_qkv(CASE, 1, "cpu")
    q, kc, vc, bt = build(CASE, 1, "cpu")
    assert torch.equal(q, kr.logical_qkv(CASE, 1, "cpu")[0])
    t0 = 0
    for b, kv in enumerate(CASE.kv_lens):
        t = torch.arange(kv)
        pg, off = bt[b, t // page].long(), t % page
        for cache, want in ((kc, k_log), (vc, v_log)):
            got = cache[pg, :, off] if hnd else cache[pg, off]
            assert torch.equal(got, want[t0:t0 + kv])
        t0 += kv
    if build is kr.ion_cache:
        assert kc.shape[1:] == (2, P, 64) and kc.stride(2) == 64  # HND pages, rows contiguous


def test_ion_layout_matches_the_kernels_reference():
    """The ION cache + block table, read by cute_kernels' fp32 reference, give the same
    attention as the independent one above (so every backend computes the same thing)."""
    ref = pytest.importorskip("cute_kernels.reference").reference_paged_attention
    q, kc, vc, bt = kr.ion_cache(CASE, 0, "cpu")
    qsl, sl = kr._meta(CASE, "cpu")
    torch.testing.assert_close(ref(q, kc, vc, qsl, sl, bt, 0.125),
                               attend(q, kc, vc, qsl, sl, bt, 0.125), rtol=1e-4, atol=1e-4)


def test_new_token_rows_are_the_cache_rows_at_their_slots():
    q, kc, vc, bt = kr.ion_cache(CASE, 1, "cpu")
    key, value, slots = kr.new_token_rows(CASE, 1, "cpu")
    assert key.shape == (CASE.total_q, 2, 64) and slots.dtype == torch.int64
    assert torch.equal(kc[slots // P, :, slots % P], key)
    assert torch.equal(vc[slots // P, :, slots % P], value)
    assert int(slots[0]) == int(bt[0, 69 // P]) * P + 69 % P  # request 0's last token


def test_fused_qkv_layout_gives_strided_views_of_the_same_values():
    fused = ks.Case("layout", CASE.q_lens, CASE.kv_lens, hq=4, hkv=2, d=64, qkv_layout="fused")
    row = (4 + 2 * 2) * 64
    for build in (kr.ion_cache, kr.fa_cache, kr.triton_cache):
        q_s, q_f = build(CASE, 0, "cpu")[0], build(fused, 0, "cpu")[0]
        assert torch.equal(q_s, q_f) and q_f.stride() == (row, 64, 1)
    for sep, fus, col in zip(kr.new_token_rows(CASE, 0, "cpu")[:2],
                             kr.new_token_rows(fused, 0, "cpu")[:2], (4, 6)):
        assert torch.equal(sep, fus) and fus.stride() == (row, 64, 1)
        assert fus.data_ptr() - fus.untyped_storage().data_ptr() == col * 64 * fus.element_size()


# --------------------------------------------------------------------------- ION backends

@pytest.mark.parametrize("mode,calls", [("fused", ["fused"]), ("attn", ["attn"]),
                                        ("append", ["append", "attn"])])
def test_ion_backends_call_the_documented_api(mode, calls):
    k = FakeKernels()
    prep = kr.ion_backend(mode, kernels=k)
    shared = {}
    preps = [prep(CASES[1], r, "cpu", shared) for r in range(2)]
    assert len(k.plans) == 1  # one plan per case, outside the timed calls
    assert k.plans[0] == dict(qsl=[0, 1, 66], seq_lens=[130, 65], hkv=2, group=4, d=64,
                              fresh_kv=mode == "fused", tile_m="auto")
    q, kc, vc, bt = kr.ion_cache(CASES[1], 0, "cpu")
    preps[0].out.fill_(float("nan"))
    preps[0].call()
    assert k.calls == calls
    qsl, sl = kr._meta(CASES[1], "cpu")
    assert kr.rel_err(preps[0].out, attend(q, kc, vc, qsl, sl, bt, 64 ** -0.5)) < 1e-2


def test_ion_backend_plan_hook_and_bad_mode():
    seen = []
    prep = kr.ion_backend("fused", kernels=FakeKernels(),
                          plan=lambda k, case, dev, fresh: seen.append((case.name, fresh))
                          or SimpleNamespace(fresh_kv=fresh))
    prep(CASES[0], 0, "cpu", {}).call()
    assert seen == [("tiny-a", True)]
    with pytest.raises(ValueError):
        kr.ion_backend("pingpong")


def test_registry_holds_the_default_backends_only():
    assert list(kr.BACKENDS) == ["ion", "ion-attn", "ion-append", "fa3", "fa3-layer", "fa4",
                                 "triton"]


def test_import_package_loads_a_checkout_beside_the_installed_one(tmp_path, monkeypatch):
    """Another checkout's package, loaded under an alias while a package of the same name
    is installed: its lazy exports (absolute imports of its own name, as cute_kernels'
    __getattr__) and its call-time relative imports resolve inside it."""
    pkg = tmp_path / "tree" / "ck_under_test"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "__all__ = ['ion_attention']\n"
        "def __getattr__(name):\n"
        "    import importlib\n"
        "    return importlib.import_module('ck_under_test.attention').ion_attention\n")
    (pkg / "attention.py").write_text(
        "def ion_attention():\n    from .kernel import WHO\n    return WHO\n")
    (pkg / "kernel.py").write_text("WHO = 'tag'\n")
    installed = SimpleNamespace(__name__="ck_under_test")
    monkeypatch.setitem(sys.modules, "ck_under_test", installed)
    monkeypatch.setitem(sys.modules, "ck_under_test.kernel", SimpleNamespace(WHO="installed"))
    mod = kr.import_package(str(pkg), "tag_ck_under_test")
    assert mod.ion_attention() == "tag" and mod.attention.__name__ == "tag_ck_under_test.attention"
    assert sys.modules["ck_under_test"] is installed  # the installed one is left in place
    assert sys.modules["ck_under_test.kernel"].WHO == "installed"
    for k in [k for k in sys.modules if k.startswith("tag_ck_under_test")]:
        del sys.modules[k]


# --------------------------------------------------------------------------- driver

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
    for name in ("synchronize", "_sleep", "set_device", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(kr, "_CYCLES_PER_US", 1000.0)


def _fa3(case, rot, device, shared):
    q, kc, vc, bt = kr.fa_cache(case, rot, device)
    qsl, sl = kr._meta(case, device)
    out = torch.empty_like(q)
    return kr.Prepared(lambda: out.copy_(attend(q, kc, vc, qsl, sl, bt, case.d ** -0.5,
                                                hnd=False)), out)


@pytest.fixture
def backends(monkeypatch, fake_cuda):
    """ion on the stand-in kernels, fa3 on the CPU, fa4 unavailable, triton failing, and a
    registered extra backend ("tag") as a script adds one; every call is logged."""
    order, probes = [], []

    def logged(name, prep):
        def wrapped(case, rot, device, shared):
            probes.append((name, case.name, rot))
            p = prep(case, rot, device, shared)
            return kr.Prepared(lambda: (order.append(name), p.call())[1], p.out)
        return wrapped

    def fa4(case, rot, device, shared):
        probes.append(("fa4", case.name, rot))
        raise kr.BackendUnavailable("FA4 unsupported: test")

    def triton(case, rot, device, shared):
        out = torch.zeros(case.total_q, case.hq, case.d)
        return kr.Prepared(lambda: (_ for _ in ()).throw(RuntimeError("kernel exploded")), out)

    monkeypatch.setitem(kr.BACKENDS, "ion", logged("ion", kr.ion_backend("fused", FakeKernels())))
    monkeypatch.setitem(kr.BACKENDS, "tag", logged("tag", kr.ion_backend("attn", FakeKernels())))
    monkeypatch.setitem(kr.BACKENDS, "wrong", kr.ion_backend("attn", FakeKernels(broken=True)))
    monkeypatch.setitem(kr.BACKENDS, "fa3", logged("fa3", _fa3))
    monkeypatch.setitem(kr.BACKENDS, "fa4", fa4)
    monkeypatch.setitem(kr.BACKENDS, "triton", triton)
    return SimpleNamespace(order=order, probes=probes)


def _run(cases, names, **kw):
    kw.setdefault("log", lambda s: None)
    return kr.run_kernel_suite(cases, names, iters=4, warmup=1, device="cpu", l2_bytes=L2,
                               reference=lambda *a: attend(*a), **kw)


@pytest.mark.parametrize("timing", ["interleaved", "queued"])
def test_suite_records_statuses_and_metrics(backends, timing):
    snaps = []
    recs = _run(CASES, ["ion", "tag", "fa3", "fa4", "triton", "wrong"], timing=timing,
                ceilings={"copy_gbps": 100.0, "gemm_tflops": 1.0}, suite_label="t",
                on_record=lambda rs: snaps.append(len(rs)))
    assert [(r["case"], r["backend"], r["status"]) for r in recs] == [
        (c.name, b, s) for c in CASES for b, s in (("ion", "ok"), ("tag", "ok"), ("fa3", "ok"),
                                                   ("fa4", "skipped"), ("triton", "error"),
                                                   ("wrong", "wrong"))]
    assert snaps == list(range(1, 13))
    assert [p for p in backends.probes if p[0] == "fa4"] == [("fa4", "tiny-a", 0)]  # once
    n_rot = ks.rotations(CASES[0], L2)
    assert n_rot >= 3 and [p[2] for p in backends.probes if p[:2] == ("ion", "tiny-a")] == \
        list(range(n_rot))
    for r in recs:
        assert r["kernel_suite"] == "t" and r["shape"]["name"] == r["case"]
        if r["status"] in ("ok", "wrong"):
            assert r["iters"] == 4 and len(r["iter_us"]) == 4 and r["timing"] == timing
            assert r["p10_us"] <= r["median_us"] <= r["p90_us"]
            assert r["frac_copy_bw"] == pytest.approx(r["bytes"] / r["median_us"] / 1e5)
    ok = [r for r in recs if r["status"] == "ok"]
    assert all(r["rel_err"] < 1e-2 for r in ok)
    assert all(r["rel_err"] == float("inf") for r in recs if r["backend"] == "wrong")
    assert "kernel exploded" in next(r for r in recs if r["backend"] == "triton")["error"]
    if timing == "interleaved":
        assert all(r["interleaved_with"] == ["ion", "tag", "fa3", "wrong"] for r in ok)
        timed = backends.order[-3 * 4:]  # the last timed calls alternate call by call
        assert timed == ["ion", "tag", "fa3"] * 4


def test_interleaved_run_that_breaks_times_each_backend_alone(backends, monkeypatch):
    n = {"calls": 0}
    good = kr.BACKENDS["tag"]

    def flaky(case, rot, device, shared):
        p = good(case, rot, device, shared)

        def call():
            n["calls"] += 1
            if n["calls"] > 3:  # fine while prepared and checked, fails once timed
                raise RuntimeError("flaky kernel")
            return p.call()
        return kr.Prepared(call, p.out)
    monkeypatch.setitem(kr.BACKENDS, "flaky", flaky)
    lines = []
    recs = _run(CASES[:1], ["flaky", "fa3"], log=lines.append)
    assert [(r["backend"], r["status"]) for r in recs] == [("flaky", "error"), ("fa3", "ok")]
    assert recs[1]["timing"] == "queued" and any("timing each backend alone" in x for x in lines)


def test_driver_refuses_unknown_timing_and_backend():
    with pytest.raises(ValueError, match="interleaved"):
        kr.run_kernel_suite([], ["fa3"], timing="synced", device="cpu")
    with pytest.raises(KeyError, match="ion-auto"):
        kr.run_kernel_suite([], ["ion-auto"], device="cpu")


def test_time_calls_and_interleaving(fake_cuda):
    seen = []
    ts = kr.time_calls([lambda i=i: seen.append(i) for i in range(3)], iters=7, warmup=2)
    assert len(ts) == 7 and all(t >= 0 for t in ts)
    assert seen[-7:] == [0, 1, 2, 0, 1, 2, 0]  # after warm-up and the host-cost probe
    calls = {"a": ["a0", "a1", "a2"], "b": ["b0"], "c": ["c0", "c1"]}
    assert kr.interleave_calls(calls) == ["a0", "b0", "c0", "a1", "b0", "c1", "a2", "b0", "c0"]
    got = kr.time_interleaved({"a": [lambda: seen.append("a")], "b": [lambda: seen.append("b")]},
                              iters=3, warmup=0)
    assert set(got) == {"a", "b"} and all(len(v) == 3 for v in got.values())
    assert seen[-6:] == ["a", "b"] * 3


def test_rel_err():
    a = torch.ones(4, 2, 8)
    assert kr.rel_err(a, a) == 0.0 and kr.rel_err(a * 1.01, a) == pytest.approx(0.01)
    a2 = a.clone()
    a2[0, 0, 0] = float("nan")
    assert kr.rel_err(a2, a) == float("inf")


def test_exp_backends_register_another_checkout(tmp_path, monkeypatch):
    """bench/exp_backends.py: an experiment branch's kernels (``$EXP_TREE``) registered as
    exp-ion / exp-ion-attn beside this checkout's, from the tree's own modules."""
    import runpy
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "cute_kernels", tmp_path / "cute_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("EXP_TREE", str(tmp_path))
    monkeypatch.setattr(kr, "BACKENDS", dict(kr.BACKENDS))
    saved = {k: v for k, v in sys.modules.items() if k.startswith("cute_kernels")}
    try:
        ns = runpy.run_path(str(root / "bench" / "exp_backends.py"))
        assert {"exp-ion", "exp-ion-attn"} <= set(kr.BACKENDS)
        assert ns["exp"].ion_attention.__module__ == "cute_kernels_exp.attention"
        assert sys.modules["cute_kernels_exp.attention"].__file__.startswith(str(tmp_path))
    finally:
        for k in [k for k in sys.modules if k.startswith("cute_kernels_exp")]:
            del sys.modules[k]
        sys.modules.update(saved)
