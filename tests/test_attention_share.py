"""CPU tests of scripts/attention_share.py: trace parsing, classification, share math, report."""

import gzip
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import attention_share as A  # noqa: E402

ION_KERNELS = {  # name -> (category, duration us per call)
    "kernel_cutlass_kernel_cute_kernelsappend_sm90KVAppendKernel_object_at__0": "attention",
    "kernel_cutlass_kernel_cute_kernelsattention_sm90IonAttentionSm90_object_at__1": "attention",
    "kernel_cutlass_kernel_cute_kernelscombine_sm90CombineSm90_object_at__2": "attention",
    # the name the H200 profile showed for the row combine (sixth session)
    "kernel_cutlass_kernel_cute_kernelscombine_sm90CombineRowsSm90_object_at__tensorptrbf16"
    "gmemalign16o128i64div812": "attention",
    "kv_append_paged": "attention",
}
FA_KERNELS = {
    "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128> >(Flash_fwd_params)": "attention",
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<X>>>": "attention",
    "void flash::FlashAttnFwdCombine<cute::tuple<>, 7, 256, 64, false>(Params)": "attention",
    "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, 0>(...)": "attention",
}
OTHER_KERNELS = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
    "nvjet_tst_128x192_64x4_1x2_h_bz_coopA_NTN": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float>": "gemm",
    "void vllm::rms_norm_kernel<c10::BFloat16, 8, 4>(...)": "other",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other",
    "triton_poi_fused_mul_silu_0": "other",
}


@pytest.mark.parametrize("name,cat", list(ION_KERNELS.items()) + list(OTHER_KERNELS.items()))
def test_classify_ion(name, cat):
    assert A.classify(name, A.attn_regex("ION")) == cat


def test_every_ion_kernel_class_counts_as_attention():
    """Every kernel class cute_kernels launches for the backend, under the name CuTeDSL
    gives its launch (kernel_cutlass_kernel_cute_kernels<module><Class>_object_at_...),
    is attention; a new kernel class fails here instead of landing under "other"."""
    import inspect

    import cute_kernels.append_sm90 as ap
    import cute_kernels.attention_sm90 as at
    import cute_kernels.combine_sm90 as co

    classes = [(m, c) for m in (ap, at, co) for n, c in vars(m).items()
               if inspect.isclass(c) and c.__module__ == m.__name__ and
               callable(getattr(c, "kernel", None))]
    assert {c.__name__ for _, c in classes} >= {"KVAppendKernel", "IonAttentionSm90",
                                                 "CombineSm90", "CombineRowsSm90"}
    for m, c in classes:
        name = (f"kernel_cutlass_kernel_{m.__name__.replace('.', '')}{c.__name__}"
                "_object_at__0")
        assert A.classify(name, A.attn_regex("ION")) == "attention", name


@pytest.mark.parametrize("name,cat", list(FA_KERNELS.items()) + list(OTHER_KERNELS.items()))
def test_classify_flash_attn(name, cat):
    assert A.classify(name, A.attn_regex("FLASH_ATTN")) == cat


def test_backend_patterns_are_specific_and_overridable():
    # FA's kernels are not ION's attention and vice versa; unknown backends get the union.
    fa = next(iter(FA_KERNELS))
    ion = next(iter(ION_KERNELS))
    assert A.classify(fa, A.attn_regex("ION")) == "other"
    assert A.classify(ion, A.attn_regex("FLASH_ATTN")) == "other"
    assert A.classify(fa, A.attn_regex("TRITON_ATTN")) == "attention"
    ov = A.pattern_overrides(["ION=IonAttentionSm90", "rms_norm"])
    assert ov == {"ION": "IonAttentionSm90", "*": "rms_norm"}
    assert A.attn_regex("ION", ov) == "IonAttentionSm90"
    assert A.attn_regex("FLASH_ATTN", ov) == "rms_norm"
    assert A.classify(next(iter(ION_KERNELS)), A.attn_regex("ION", ov)) == "other"
    with pytest.raises(Exception):
        A.pattern_overrides(["ION=("])


def test_ion_variant_labels_run_ion_with_their_environment():
    # ION+noreuse is ION under ION_PLAN_REUSE=0: ION's kernels are its attention, FA's are
    # not, and the engine gets ION as --attention-backend; plain names pass through.
    fa, ion = next(iter(FA_KERNELS)), next(iter(ION_KERNELS))
    for label, env in (("ION+noreuse", {"ION_PLAN_REUSE": "0"}),
                       ("ION+repage", {"ION_PLAN_REPAGE": "1"})):
        assert A.vllm_backend(label) == "ION"
        assert A.label_env(label) == env
        assert A.classify(ion, A.attn_regex(label)) == "attention"
        assert A.classify(fa, A.attn_regex(label)) == "other"
    assert A.vllm_backend("FLASH_ATTN") == "FLASH_ATTN" and A.label_env("FLASH_ATTN") == {}
    assert A.vllm_backend("ION") == "ION" and A.label_env("ION") == {}
    pytest.importorskip("vllm")
    cfg = dict(model="/m", backend="ION+noreuse", seed=0, input_len=8, output_len=4,
               max_num_seqs=2, enforce_eager=True, gpu_memory_utilization=0.5)
    assert A.engine_kwargs(cfg, "/tmp/t")["attention_backend"] == "ION"


def _write_trace(path, kernels, wrap=True):
    """kernels: list of (name, dur). Adds non-kernel events that must be ignored."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9999},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 777},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 0, "dur": 555},
              {"ph": "f", "cat": "ac2g", "name": "ac2g", "ts": 1, "id": 3},
              {"ph": "M", "name": "process_name", "args": {"name": "python"}}]
    ts = 10.0
    for name, dur in kernels:
        events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7,
                       "ts": ts, "dur": dur, "args": {"device": 0, "stream": 7}})
        ts += dur + 1
    data = {"schemaVersion": 1, "traceEvents": events} if wrap else events
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as f:
        json.dump(data, f)


FA_RUN = [("void flash::flash_fwd_kernel<T>(P)", 30.0)] * 4 + \
         [("void vllm::reshape_and_cache_flash_kernel<bf16>", 5.0)] * 4 + \
         [("nvjet_tst_128x192", 50.0)] * 4 + [("void vllm::rms_norm_kernel<bf16>", 10.0)] * 4
ION_RUN = [("kernel_IonAttentionSm90_0", 15.0)] * 4 + [("kernel_KVAppendKernel_0", 2.0)] * 4 + \
          [("kernel_CombineSm90_0", 1.5)] * 4 + \
          [("nvjet_tst_128x192", 50.0)] * 4 + [("void vllm::rms_norm_kernel<bf16>", 10.0)] * 4


@pytest.mark.parametrize("fname,wrap", [("w.pt.trace.json.gz", True), ("w.pt.trace.json", True),
                                        ("w.pt.trace.json", False)])
def test_load_and_kernel_events(tmp_path, fname, wrap):
    p = tmp_path / fname
    _write_trace(p, FA_RUN, wrap=wrap)
    ks = A.kernel_events(A.load_trace(str(p)))
    assert len(ks) == len(FA_RUN)
    assert sum(d for _, d in ks) == pytest.approx(4 * (30 + 5 + 50 + 10))


def test_aggregate_shares_and_top():
    r = A.aggregate(FA_RUN, A.attn_regex("FLASH_ATTN"), top=3)
    assert r["total_us"] == pytest.approx(380.0)
    assert r["category_us"] == pytest.approx({"attention": 140.0, "gemm": 200.0, "other": 40.0})
    assert r["attention_share"] == pytest.approx(140 / 380)
    assert sum(r["share"].values()) == pytest.approx(1.0)
    assert [k["name"] for k in r["top_kernels"]] == [
        "nvjet_tst_128x192", "void flash::flash_fwd_kernel<T>(P)", "void vllm::rms_norm_kernel<bf16>"]
    assert r["top_kernels"][0]["count"] == 4 and r["top_kernels"][0]["us"] == 200.0
    by = r["top_by_category"]
    assert [k["name"] for k in by["other"]] == ["void vllm::rms_norm_kernel<bf16>"]
    assert sum(k["us"] for k in by["attention"]) == pytest.approx(140.0)
    assert A.aggregate([], "x")["attention_share"] == 0.0


def test_busy_stats_union_and_gaps():
    # two overlapping kernels (another stream) count once; a 150 us gap is a host wait,
    # a 5 us gap is not
    iv = [(0.0, 10.0), (5.0, 20.0), (25.0, 30.0), (180.0, 200.0)]
    b = A.busy_stats(iv)
    assert b["span_us"] == pytest.approx(200.0)
    assert b["busy_us"] == pytest.approx(20.0 + 5.0 + 20.0)
    assert b["idle_us"] == pytest.approx(155.0)
    assert b["long_gaps"] == 1 and b["long_gap_us"] == pytest.approx(150.0)
    assert b["busy_share"] == pytest.approx(45.0 / 200.0)
    # order does not matter; a kernel inside another adds nothing
    assert A.busy_stats(list(reversed(iv)) + [(1.0, 2.0)]) == b
    assert A.busy_stats([])["busy_share"] == 0.0


def test_gap_attribution_names_the_launch_after_the_idle():
    att = A.attn_regex("ION")
    spans = [(0.0, 10.0, "nvjet_gemm_a"), (2.0, 12.0, "rms_norm_kernel"),  # overlap: no gap
             (20.0, 30.0, "kernel_IonAttentionSm90_0"),     # 8 us after the norm
             (31.0, 35.0, "kernel_CombineRowsSm90_0"),      # 1 us after attention
             (55.0, 60.0, "nvjet_gemm_a"),                  # 20 us after the combine
             (70.0, 80.0, "kernel_IonAttentionSm90_0")]     # 10 us after the gemm
    g = A.gap_attribution(spans, att)
    by = {(x["before"].split(":")[0], x["after"].split(":")[0]): x for x in g}
    assert [round(x["us"], 6) for x in g] == [20.0, 10.0, 8.0, 1.0]
    assert by[("attention", "gemm")]["count"] == 1
    assert g[0]["before"].endswith("CombineRowsSm90_0") and g[0]["after"] == "gemm:nvjet_gemm_a"
    assert g[2]["before"] == "other:rms_norm_kernel"  # the stretch ended with the norm
    assert sum(x["us"] for x in g) == pytest.approx(
        A.busy_stats([(s, e) for s, e, _ in spans], gap_us=0)["idle_us"])
    assert A.gap_attribution([], att) == []


def test_attention_calls_by_length():
    att = A.attn_regex("FLASH_ATTN")
    ks = [("flash_fwd_kernel", 130.0)] * 3 + [("flash_fwd_kernel", 1800.0)] * 2 + \
         [("reshape_and_cache_flash_kernel", 5.0)] * 5 + [("nvjet_gemm", 900.0)]
    c = A.attention_calls_by_length(ks, att)
    assert c["short"] == {"count": 3, "us": 390.0}
    assert c["long"] == {"count": 2, "us": 3600.0}


def test_kernel_intervals_from_trace(tmp_path):
    p = tmp_path / "w.pt.trace.json"
    _write_trace(p, FA_RUN)
    iv = A.kernel_intervals(A.load_trace(str(p)))
    assert len(iv) == len(FA_RUN)
    b = A.busy_stats(iv)
    # _write_trace leaves 1 us between kernels: busy = the kernel time, idle = the gaps
    assert b["busy_us"] == pytest.approx(380.0)
    assert b["idle_us"] == pytest.approx(len(FA_RUN) - 1)
    assert b["long_gaps"] == 0


def test_predicted_ratio_formula():
    assert A.predicted_ratio(0.5, 1.0, 2.0) == pytest.approx(0.75)
    assert A.predicted_ratio(0.3, 7.0, 7.0) == pytest.approx(1.0)
    assert A.predicted_ratio(0.0, 1.0, 9.0) == pytest.approx(1.0)
    assert A.predicted_ratio(1.0, 3.0, 4.0) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        A.predicted_ratio(0.5, 1.0, 0.0)


def _make_traces(out, with_timing=True):
    for b, run, wall in (("ION", ION_RUN, 80.0), ("FLASH_ATTN", FA_RUN, 100.0)):
        d = out / "traces" / b
        d.mkdir(parents=True)
        half = len(run) // 2  # two worker traces, one gzipped: both are aggregated
        _write_trace(d / f"{b}_dp0_pp0_tp0.1.pt.trace.json.gz", run[:half])
        _write_trace(d / f"{b}_dp0_pp0_tp1.2.pt.trace.json", run[half:])
        if with_timing:
            (d / "child_result.json").write_text(json.dumps({"timed_wall_s": wall,
                                                             "profiled_wall_s": wall * 2}))


def test_compare_and_main_parse_only(tmp_path, capsys):
    _make_traces(tmp_path)
    assert A.main(["--parse-only", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "attention_share.json").read_text())
    res, ratios = data["results"], data["ratios"]
    assert res["ION"]["category_us"]["attention"] == pytest.approx(4 * 18.5)
    assert res["FLASH_ATTN"]["attention_share"] == pytest.approx(140 / 380)
    assert len(res["ION"]["traces"]) == 2
    ion_total = 74.0 + 200 + 40
    assert ratios["ION"]["measured_gpu_ratio"] == pytest.approx(ion_total / 380)
    # non-attention kernels identical -> the prediction equals the measured GPU ratio
    assert ratios["ION"]["predicted_ratio"] == pytest.approx(ion_total / 380)
    assert ratios["ION"]["predicted_ratio"] == pytest.approx(
        (1 - 140 / 380) + (140 / 380) * 74 / 140)
    assert ratios["ION"]["timed_wall_ratio"] == pytest.approx(0.8)
    assert ratios["FLASH_ATTN"]["predicted_ratio"] == pytest.approx(1.0)
    md = (tmp_path / "attention_share.md").read_text()
    assert "| ION |" in md and "IonAttentionSm90" in md and "36.8%" in md
    # two worker traces: busy is the first one's GPU (4 x 30 + 4 x 5 us)
    assert res["FLASH_ATTN"]["busy"]["busy_us"] == pytest.approx(140.0)
    assert "span ratio" in md and "ratio" in json.dumps(ratios["ION"])
    assert "idle time by the kernels around each gap" in md and res["ION"]["gaps"]
    assert "short calls" in md and res["FLASH_ATTN"]["attention_calls"]["short"]["count"] == 4
    last = capsys.readouterr().out.strip().splitlines()
    assert last[-2].startswith("ION") and last[-1].startswith("FLASH_ATTN")
    assert "0.826" in last[-2]


def test_main_reports_missing_backend(tmp_path):
    _make_traces(tmp_path, with_timing=False)
    rc = A.main(["--parse-only", "--out", str(tmp_path), "--backends", "ION,FLASH_ATTN,NOPE"])
    assert rc == 1
    data = json.loads((tmp_path / "attention_share.json").read_text())
    assert "error" in data["results"]["NOPE"] and "NOPE" not in data["ratios"]
    assert "timed_wall_ratio" not in data["ratios"]["ION"]


def test_help():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "attention_share.py"),
                        "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for flag in ("--backends", "--input-len", "--output-len", "--num-prompts", "--max-num-seqs",
                 "--profile-prompts", "--attn-pattern", "--out", "--parse-only"):
        assert flag in r.stdout
    with pytest.raises(SystemExit):
        A.parse_args([])  # --model required when running vLLM


@pytest.mark.parametrize("backend", ["ION", "FLASH_ATTN"])
def test_engine_kwargs_accepted_by_vllm(cpu_platform, tmp_path, backend):
    from vllm.config.attention import AttentionConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    args = A.parse_args(["--model", str(tmp_path), "--max-num-batched-tokens", "8192"])
    cfg = dict(vars(args), backend=backend, trace_dir=str(tmp_path / "t"))
    kw = A.engine_kwargs(cfg, cfg["trace_dir"])
    ea = EngineArgs(**kw)  # loads general plugins (the ION alias) as vLLM does
    assert ea.load_format == "dummy" and ea.max_model_len == 7680 + 512
    assert ea.max_num_seqs == 32 and ea.max_num_batched_tokens == 8192
    assert ea.profiler_config.profiler == "torch"
    assert ea.profiler_config.torch_profiler_dir == str(tmp_path / "t")
    enum = AttentionConfig.validate_backend_before(ea.attention_backend)
    want = AttentionBackendEnum.CUSTOM if backend == "ION" else AttentionBackendEnum.FLASH_ATTN
    assert enum is want
    # LLM passes the same names through: every key is an LLM or EngineArgs parameter
    import inspect
    from vllm import LLM
    params = set(inspect.signature(LLM.__init__).parameters) | set(
        inspect.signature(EngineArgs).parameters)
    assert set(kw) <= params


def test_colocated_children_share_the_gpu_and_are_gated(tmp_path, monkeypatch):
    """--colocate: one gated child per backend, each planning for 1/n of the GPU with a
    fixed KV pool and its own compile cache; the measured parts run in backend order."""
    import ion_vllm.bench.start_gate as gate

    seen = {}

    def fake_run_gated(kids, gate_dir, **kw):
        seen["names"] = [k.name for k in kids]
        seen["cfgs"] = [json.loads(k.argv[k.argv.index("--child") + 1]) for k in kids]
        seen["roots"] = [k.env["VLLM_CACHE_ROOT"] for k in kids]
        return {k.name: 0 for k in kids}

    monkeypatch.setattr(gate, "run_gated", fake_run_gated)
    args = A.parse_args(["--model", "/m", "--colocate", "--kv-cache-gib", "2",
                         "--out", str(tmp_path)])
    A.run_backends_colocated(args, ["ION", "FLASH_ATTN"],
                             {b: str(tmp_path / b) for b in ("ION", "FLASH_ATTN")})
    assert seen["names"] == ["ION", "FLASH_ATTN"]
    assert [c["gpu_memory_utilization"] for c in seen["cfgs"]] == [0.45, 0.45]
    assert all(c["kv_cache_memory_bytes"] == 2 << 30 and c["gate_dir"] for c in seen["cfgs"])
    assert len(set(seen["roots"])) == 2


def test_colocated_backend_without_a_result_is_reported(tmp_path, monkeypatch):
    """The children write traces and child_result.json; a backend whose child left no
    result is an error, the other is still analysed."""
    import shutil

    src = tmp_path / "src"
    _make_traces(src, with_timing=True)
    os.remove(src / "traces" / "FLASH_ATTN" / "child_result.json")
    out = tmp_path / "out"

    def fake_children(args, backends, tdirs):  # what the gated children leave behind
        shutil.copytree(src / "traces", out / "traces", dirs_exist_ok=True)

    monkeypatch.setattr(A, "run_backends_colocated", fake_children)
    rc = A.main(["--model", "/m", "--colocate", "--out", str(out)])
    data = json.loads((out / "attention_share.json").read_text())
    assert rc == 1 and "error" in data["results"]["FLASH_ATTN"]
    assert data["results"]["ION"]["timed_wall_s"] == 80.0


def test_attention_launches_tell_the_tile_sizes_apart_by_block():
    # one IonAttention name, three launch shapes (64-, 128- and 192-row kernels); calls of
    # 0.4 ms or more count as long; other kernels and non-kernel events are ignored
    ion = next(n for n in ION_KERNELS if "IonAttentionSm90" in n)
    ev = lambda name, dur, block, grid: {  # noqa: E731
        "ph": "X", "cat": "kernel", "name": name, "ts": 0, "dur": dur,
        "args": {"block": block, "grid": grid}}
    trace = {"traceEvents": [
        ev(ion, 120.0, [256, 1, 1], [264, 1, 1]), ev(ion, 130.0, [256, 1, 1], [264, 1, 1]),
        ev(ion, 900.0, [256, 1, 1], [264, 1, 1]),
        ev(ion, 1000.0, [512, 1, 1], [132, 1, 1]), ev(ion, 1100.0, [512, 1, 1], [132, 1, 1]),
        ev(ion, 450.0, [384, 1, 1], [132, 1, 1]),
        ev("nvjet_tst_128x192", 999.0, [384, 1, 1], [132, 1, 1]),
        {"ph": "X", "cat": "cpu_op", "name": ion, "ts": 0, "dur": 5000.0},
        ev(ion, 50.0, None, [7, 2, 1]),
    ]}
    rows = A.attention_launches(trace, A.attn_regex("ION"))
    by_block = {r["block"]: r for r in rows}
    assert [r["block"] for r in rows] == ["512", "256", "384", "?"]  # by total time
    assert by_block["512"]["long_count"] == 2 and by_block["512"]["long_us"] == 2100.0
    assert by_block["512"]["short_count"] == 0 and by_block["512"]["grid"] == "132"
    assert (by_block["256"]["short_count"], by_block["256"]["short_us"]) == (2, 250.0)
    assert (by_block["256"]["long_count"], by_block["256"]["long_us"]) == (1, 900.0)
    assert by_block["384"]["long_count"] == 1 and by_block["?"]["grid"] == "7x2"
    md = A.render_markdown({"date": "d", "baseline": "FLASH_ATTN", "workload": {}},
                           {"ION": {"attention_launches": rows}}, {})
    assert "| 512 | 132 | 0 | 0.0 | 2 | 2.1 | 1050.0 |" in md


def test_request_lengths_uniform_and_skewed():
    assert A.request_lengths(100, 10, 3, None, 0) == [(100, 10)] * 3
    assert A.request_lengths(100, 10, 2, 0.0, 0) == [(100, 10)] * 2
    lens = A.request_lengths(4096, 512, 2000, 0.9, 7)
    assert lens == A.request_lengths(4096, 512, 2000, 0.9, 7)  # deterministic
    assert lens != A.request_lengths(4096, 512, 2000, 0.9, 8)
    ins, outs = [i for i, _ in lens], [o for _, o in lens]
    assert min(ins) >= int(4096 * 0.1) and max(ins) <= int(4096 * 1.9)
    assert min(outs) >= int(512 * 0.1) and max(outs) <= int(512 * 1.9)
    assert max(ins) - min(ins) > 4096  # spread over the range, mean near the middle
    assert abs(sum(ins) / len(ins) - 4096) < 150
    with pytest.raises(ValueError, match="range_ratio"):
        A.request_lengths(10, 10, 1, 1.0, 0)
    assert A.max_model_len({"input_len": 4096, "output_len": 512, "range_ratio": 0.9}) == (
        int(4096 * 1.9) + int(512 * 1.9))
    assert A.max_model_len({"input_len": 7680, "output_len": 512}) == 8192


@pytest.mark.parametrize("rr", [None, 0.9])
def test_child_profiles_the_recorded_lengths(monkeypatch, tmp_path, rr):
    """``child`` warms up (outputs capped at 16), times, then profiles a batch whose
    (prompt, output) lengths are ``profile_lengths(cfg)``, the lengths ``main`` records
    for scripts/e2e_attention_bound.py."""
    import vllm

    calls = []

    class FakeLLM:
        def __init__(self, **kw):
            calls.append(("init", kw["max_model_len"]))

        def generate(self, prompts, sps, use_tqdm=False):
            assert len(prompts) == len(sps)
            calls.append(("generate", [(len(p["prompt_token_ids"]), s.max_tokens)
                                       for p, s in zip(prompts, sps)]))

        def start_profile(self, profile_prefix=None):
            calls.append(("start", profile_prefix))

        def stop_profile(self):
            calls.append(("stop", None))

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(A, "engine_kwargs", lambda cfg, d: {"max_model_len": A.max_model_len(cfg)})
    args = A.parse_args(["--model", str(tmp_path), "--input-len", "300", "--output-len", "40",
                         "--num-prompts", "6", "--max-num-seqs", "4", "--profile-prompts", "5"]
                        + (["--range-ratio", str(rr)] if rr else []))
    cfg = A.backend_cfg(args, "ION", str(tmp_path / "t"))
    res = A.child(cfg)
    assert res["profiled_wall_s"] >= 0 and res["timed_wall_s"] >= 0
    kinds = [c[0] for c in calls]
    assert kinds == ["init", "generate", "generate", "start", "generate", "stop"]
    warm, timed, prof = calls[1][1], calls[2][1], calls[4][1]
    assert len(warm) == 4 and all(o <= 16 for _, o in warm) and len(timed) == 6
    assert prof == [tuple(x) for x in A.profile_lengths(cfg)]
    assert all(i + o <= calls[0][1] for i, o in warm + timed + prof)
    if rr:
        assert len(set(prof)) > 1
    else:
        assert prof == [(300, 40)] * 5


def test_main_records_the_profiled_lengths(tmp_path):
    _make_traces(tmp_path)
    assert A.main(["--parse-only", "--out", str(tmp_path), "--range-ratio", "0.9",
                   "--profile-prompts", "3", "--input-len", "4096"]) == 0
    w = json.loads((tmp_path / "attention_share.json").read_text())["meta"]["workload"]
    assert w["range_ratio"] == 0.9
    cfg = {"input_len": 4096, "output_len": 512, "profile_prompts": 3, "range_ratio": 0.9,
           "seed": 0}
    assert [tuple(x) for x in w["profile_lengths"]] == A.profile_lengths(cfg)
    assert A.main(["--parse-only", "--out", str(tmp_path)]) == 0
    assert "profile_lengths" not in json.loads(
        (tmp_path / "attention_share.json").read_text())["meta"]["workload"]
