#!/usr/bin/env python3
"""Attention share of GPU step time, ION vs FLASH_ATTN, from vLLM's own torch profiler.

For each backend in ``--backends`` (one fresh subprocess each) this runs vLLM offline on a
dummy-weight model with random, seeded, all-distinct prompts: a short warm-up generate, the
timed full workload (``--num-prompts`` x ``--input-len``/``--output-len``, unprofiled), then
one generate of ``--profile-prompts`` further prompts between ``LLM.start_profile()`` and
``stop_profile()`` (``profiler_config`` profiler="torch"), so the trace holds chunked-prefill
and decode steps.  The parent parses the worker's Chrome trace(s) (``*.pt.trace.json[.gz]``,
events with ``cat == "kernel"``) into total kernel time, time per category (attention /
gemm / other), the attention share and the top-10 kernels, and predicts each backend's
step-time ratio to ``--baseline`` from the baseline's attention share a_B and the attention
times t_X, t_B:  predicted X/B = (1 - a_B) + a_B * t_X / t_B  (non-attention work unchanged),
next to the measured GPU-kernel-time ratio and the unprofiled wall-time ratio.

  python3 scripts/make_demo_model.py /tmp/demo
  python3 scripts/attention_share.py --model /tmp/demo
  python3 scripts/attention_share.py --parse-only --out bench/results/attention-share-X
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict

from ion_vllm.bench.stream_trace import busy_stats, load_trace  # noqa: F401

ATTN_PATTERNS = {  # backend -> kernels that are its attention (cache write + attention + combine)
    # Combine\w*Sm90: the group combine (CombineSm90) and the row combine (CombineRowsSm90,
    # the default since the fourth session; missing here until the sixth, which put its
    # 70 ms under "other")
    "ION": r"IonAttentionSm90|Combine\w*Sm90|KVAppendKernel|(?i:append)",
    "FLASH_ATTN": r"flash_fwd|FlashAttn|flash::|reshape_and_cache",
}
GENERIC_ATTN = "|".join(ATTN_PATTERNS.values())
GEMM_PATTERN = r"(?i)gemm|sm90_xmma|nvjet|cutlass.*gemm|cublas"
CATEGORIES = ("attention", "gemm", "other")


# ----------------------------------------------------------------------------- pure parsing
def kernel_events(trace: dict) -> list[tuple[str, float]]:
    """(name, duration in us) of every complete GPU kernel event (``cat == "kernel"``)."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") == "kernel" and ev.get("ph", "X") == "X" and "dur" in ev:
            out.append((str(ev.get("name", "")), float(ev["dur"])))
    return out


def kernel_intervals(trace: dict) -> list[tuple[float, float]]:
    """(start, end) in us of every complete GPU kernel event (``cat == "kernel"``)."""
    out = []
    for ev in trace.get("traceEvents", []):
        if (ev.get("cat") == "kernel" and ev.get("ph", "X") == "X" and "dur" in ev
                and "ts" in ev):
            t0 = float(ev["ts"])
            out.append((t0, t0 + float(ev["dur"])))
    return out


def kernel_spans(trace: dict) -> list[tuple[float, float, str]]:
    """(start, end, name) of every complete GPU kernel event, in start order."""
    out = []
    for ev in trace.get("traceEvents", []):
        if (ev.get("cat") == "kernel" and ev.get("ph", "X") == "X" and "dur" in ev
                and "ts" in ev):
            t0 = float(ev["ts"])
            out.append((t0, t0 + float(ev["dur"]), str(ev.get("name", ""))))
    out.sort()
    return out


def _short(name: str, attn_pattern: str, width: int = 48) -> str:
    """A kernel's category and the start of its name (a gap's neighbours in the report)."""
    return f"{classify(name, attn_pattern)}:{name[:width]}"


def gap_attribution(spans: list[tuple[float, float, str]], attn_pattern: str,
                    top: int = 12) -> list[dict]:
    """Where the GPU sat idle: every gap between busy stretches (the union of the kernel
    intervals), keyed by the kernel that ended the stretch before it and the kernel that
    started the one after (``_short`` names), with the summed gap time and the count; the
    ``top`` keys by summed time.  A backend's extra idle time then names its launches."""
    acc: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0])
    if not spans:
        return []
    end, last = spans[0][1], spans[0][2]
    for s, e, name in spans[1:]:
        if s > end:
            key = (_short(last, attn_pattern), _short(name, attn_pattern))
            acc[key][0] += s - end
            acc[key][1] += 1
        if e >= end:
            end, last = e, name
    ranked = sorted(acc.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"before": a, "after": b, "us": us, "count": n} for (a, b), (us, n) in ranked]


def attention_calls_by_length(kernels: list[tuple[str, float]], attn_pattern: str,
                              long_us: float = 400.0) -> dict:
    """The attention kernels' calls split at ``long_us``: on a 7B model a decode step's
    attention call takes ~0.13 ms and a step carrying a long prefill chunk's ~1-2 ms, so
    the two classes separate cleanly.  ``{"short": {"count", "us"}, "long": {...}}``;
    only calls of at least 20 us count (the combine and cache-write kernels are excluded,
    as are a backend's small helper launches)."""
    out = {"short": {"count": 0, "us": 0.0}, "long": {"count": 0, "us": 0.0},
           "long_us": long_us}
    for name, dur in kernels:
        if dur < 20.0 or not re.search(attn_pattern, name):
            continue
        c = out["long" if dur >= long_us else "short"]
        c["count"] += 1
        c["us"] += dur
    return out


def _dims(v) -> str:
    """A launch dimension from a trace event's args (``[512, 1, 1]``) as ``512`` /
    ``132x2``: trailing 1s dropped."""
    if not isinstance(v, (list, tuple)) or not v:
        return "?"
    dims = [int(x) for x in v]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return "x".join(str(x) for x in dims)


def attention_launches(trace: dict, attn_pattern: str, long_us: float = 400.0) -> list[dict]:
    """The attention kernels' calls grouped by kernel and launch shape (the trace's
    ``args.block`` / ``args.grid``), split at ``long_us`` as ``attention_calls_by_length``.
    CuTeDSL names every IonAttention variant alike, so the block size is what tells the
    64-, 128- and 192-row kernels apart (256, 384 and 512 threads).  Rows: ``kernel``
    (the first 60 characters), ``block``, ``grid``, then ``short``/``long`` counts and us,
    by total time."""
    acc: dict[tuple[str, str, str], dict] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != "kernel" or ev.get("ph", "X") != "X" or "dur" not in ev:
            continue
        name, dur = str(ev.get("name", "")), float(ev["dur"])
        if not re.search(attn_pattern, name):
            continue
        args = ev.get("args") or {}
        key = (name[:60], _dims(args.get("block")), _dims(args.get("grid")))
        row = acc.setdefault(key, {"kernel": key[0], "block": key[1], "grid": key[2],
                                   "short_count": 0, "short_us": 0.0,
                                   "long_count": 0, "long_us": 0.0})
        cls = "long" if dur >= long_us else "short"
        row[f"{cls}_count"] += 1
        row[f"{cls}_us"] += dur
    return sorted(acc.values(), key=lambda r: -(r["short_us"] + r["long_us"]))


def attn_regex(backend: str, overrides: dict[str, str] | None = None) -> str:
    """Attention regex for ``backend``: an override (key backend or ``*``), else the default."""
    overrides = overrides or {}
    if backend in overrides:
        return overrides[backend]
    if "*" in overrides:
        return overrides["*"]
    return ATTN_PATTERNS.get(vllm_backend(backend).upper(), GENERIC_ATTN)


def vllm_backend(label: str) -> str:
    """The ``--attention-backend`` of a label: ``ION+noreuse`` and the other ION variants
    of ``ion_vllm.bench.e2e.ION_VARIANTS`` run ION (with their environment), anything
    else is a vLLM backend name."""
    from ion_vllm.bench.e2e import resolve_backend

    return resolve_backend(label)[0]


def label_env(label: str) -> dict[str, str]:
    """The environment a label's engine runs with (empty for a plain backend name)."""
    from ion_vllm.bench.e2e import resolve_backend

    return resolve_backend(label)[1]


def classify(name: str, attn_pattern: str) -> str:
    """'attention' if ``name`` matches ``attn_pattern``, else 'gemm' if a GEMM, else 'other'."""
    if re.search(attn_pattern, name):
        return "attention"
    if re.search(GEMM_PATTERN, name):
        return "gemm"
    return "other"


def aggregate(kernels: list[tuple[str, float]], attn_pattern: str, top: int = 10) -> dict:
    """Total kernel time, time/share per category and the ``top`` kernels by total time."""
    per_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for name, dur in kernels:
        per_name[name][0] += dur
        per_name[name][1] += 1
    cat_us = {c: 0.0 for c in CATEGORIES}
    cat_of = {}
    for name, (us, _) in per_name.items():
        cat_of[name] = classify(name, attn_pattern)
        cat_us[cat_of[name]] += us
    total = sum(cat_us.values())
    ranked_all = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    ranked = ranked_all[:top]
    by_cat = {c: [kv for kv in ranked_all if cat_of[kv[0]] == c][:top] for c in CATEGORIES}
    return {
        "attn_pattern": attn_pattern,
        "num_kernels": len(kernels),
        "total_us": total,
        "category_us": cat_us,
        "share": {c: (cat_us[c] / total if total else 0.0) for c in CATEGORIES},
        "attention_share": cat_us["attention"] / total if total else 0.0,
        "top_kernels": [{"name": n, "category": cat_of[n], "us": us, "count": cnt,
                         "share": us / total if total else 0.0}
                        for n, (us, cnt) in ranked],
        # the top kernels of each category: where two backends' non-attention time differs
        "top_by_category": {c: [{"name": n, "us": us, "count": cnt} for n, (us, cnt) in kvs]
                            for c, kvs in by_cat.items()},
    }


def predicted_ratio(baseline_attn_share: float, t_attn: float, t_attn_baseline: float) -> float:
    """Step-time ratio X/B if only attention changes: (1 - a_B) + a_B * t_X / t_B."""
    if t_attn_baseline <= 0:
        raise ValueError("baseline attention time must be positive")
    return (1.0 - baseline_attn_share) + baseline_attn_share * t_attn / t_attn_baseline


def find_traces(trace_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(trace_dir, "**", "*.pt.trace.json*"), recursive=True))


def analyze_backend(backend: str, trace_dir: str, overrides=None) -> dict:
    """Aggregate the kernel events of all traces in ``trace_dir`` (one per worker rank)."""
    paths = find_traces(trace_dir)
    if not paths:
        raise FileNotFoundError(f"no *.pt.trace.json[.gz] under {trace_dir}")
    traces = [load_trace(p) for p in paths]
    kernels = [k for t in traces for k in kernel_events(t)]
    res = aggregate(kernels, attn_regex(backend, overrides))
    # one worker here (TP 1); with several, each trace has its own GPU: the first one's span
    res["busy"] = busy_stats(kernel_intervals(traces[0]))
    res["gaps"] = gap_attribution(kernel_spans(traces[0]), res["attn_pattern"])
    res["attention_calls"] = attention_calls_by_length(kernels, res["attn_pattern"])
    res["attention_launches"] = [r for t in traces
                                 for r in attention_launches(t, res["attn_pattern"])]
    res["traces"] = [os.path.relpath(p, trace_dir) for p in paths]
    return res


def compare(results: dict[str, dict], baseline: str) -> dict[str, dict]:
    """Per backend: measured GPU-kernel-time ratio, predicted ratio, wall ratio vs baseline."""
    base = results.get(baseline)
    if not base or not base.get("category_us", {}).get("attention"):
        return {}
    out = {}
    for name, r in results.items():
        if "total_us" not in r:
            continue
        row = {"measured_gpu_ratio": r["total_us"] / base["total_us"],
               **({"span_ratio": r["busy"]["span_us"] / base["busy"]["span_us"]}
                  if r.get("busy", {}).get("span_us") and base.get("busy", {}).get("span_us")
                  else {}),
               "attention_time_ratio": r["category_us"]["attention"] / base["category_us"]["attention"],
               "predicted_ratio": predicted_ratio(base["attention_share"],
                                                  r["category_us"]["attention"],
                                                  base["category_us"]["attention"])}
        for key in ("timed_wall_s", "profiled_wall_s"):
            if r.get(key) and base.get(key):
                row[key.replace("_s", "_ratio")] = r[key] / base[key]
        out[name] = row
    return out


def render_markdown(meta: dict, results: dict, ratios: dict) -> str:
    ms = lambda us: f"{us / 1e3:.1f}"  # noqa: E731
    lines = [f"# Attention share of GPU time ({meta['date']})", "",
             f"Workload: {json.dumps(meta['workload'])}; baseline {meta['baseline']}.", "",
             "| backend | GPU kernel ms | attention ms | gemm ms | other ms | attention share "
             "| measured GPU ratio | predicted ratio | wall ratio (timed run) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "total_us" not in r:
            lines.append(f"| {name} | failed: {r.get('error', '?')} | | | | | | | |")
            continue
        c, q = r["category_us"], ratios.get(name, {})
        f = lambda k: f"{q[k]:.3f}" if k in q else "-"  # noqa: E731
        lines.append(f"| {name} | {ms(r['total_us'])} | {ms(c['attention'])} | {ms(c['gemm'])} "
                     f"| {ms(c['other'])} | {r['attention_share']:.1%} | {f('measured_gpu_ratio')} "
                     f"| {f('predicted_ratio')} | {f('timed_wall_ratio')} |")
    lines += ["", "Predicted X/B = (1 - a_B) + a_B * t_X / t_B, a_B = baseline attention share.",
              "", "GPU busy over the profiled span (union of kernel intervals; gaps of at least "
              "0.1 ms are where the GPU waited for the host):", "",
              "| backend | span ms | busy ms | idle ms | busy share | gaps >= 0.1 ms | their ms "
              "| span ratio |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        b = r.get("busy")
        if not b:
            continue
        q = ratios.get(name, {})
        lines.append(f"| {name} | {ms(b['span_us'])} | {ms(b['busy_us'])} | {ms(b['idle_us'])} "
                     f"| {b['busy_share']:.1%} | {b['long_gaps']} | {ms(b['long_gap_us'])} "
                     f"| {q['span_ratio']:.3f} |" if "span_ratio" in q else
                     f"| {name} | {ms(b['span_us'])} | {ms(b['busy_us'])} | {ms(b['idle_us'])} "
                     f"| {b['busy_share']:.1%} | {b['long_gaps']} | {ms(b['long_gap_us'])} | - |")
    split = [(n, r["attention_calls"]) for n, r in results.items() if r.get("attention_calls")]
    if split:
        lines += ["", "Attention calls of at least 20 us, split at "
                  f"{split[0][1]['long_us'] / 1e3:.1f} ms (decode steps / prefill-carrying "
                  "steps):", "", "| backend | short calls | short ms | mean us | long calls "
                  "| long ms | mean us |", "|---|---|---|---|---|---|---|"]
        for n, c in split:
            sh, lo = c["short"], c["long"]
            mean = lambda x: f"{x['us'] / x['count']:.1f}" if x["count"] else "-"  # noqa: E731
            lines.append(f"| {n} | {sh['count']} | {ms(sh['us'])} | {mean(sh)} | {lo['count']} "
                         f"| {ms(lo['us'])} | {mean(lo)} |")
    for name, r in results.items():
        if r.get("attention_launches"):
            lines += ["", f"{name}: attention launches by kernel and shape (calls split at "
                      "0.4 ms as above):", "", "| kernel | block | grid | short calls "
                      "| short ms | long calls | long ms | long mean us |",
                      "|---|---|---|---|---|---|---|---|"]
            lines += [f"| `{a['kernel']}` | {a['block']} | {a['grid']} | {a['short_count']} "
                      f"| {ms(a['short_us'])} | {a['long_count']} | {ms(a['long_us'])} | "
                      + (f"{a['long_us'] / a['long_count']:.1f} |" if a["long_count"] else "- |")
                      for a in r["attention_launches"]]
    for name, r in results.items():
        if r.get("gaps"):
            lines += ["", f"{name}: idle time by the kernels around each gap "
                      "(before -> after; category:name):", "",
                      "| before | after | idle ms | gaps |", "|---|---|---|---|"]
            lines += [f"| `{g['before']}` | `{g['after']}` | {ms(g['us'])} | {g['count']} |"
                      for g in r["gaps"]]
    for name, r in results.items():
        if "top_kernels" not in r:
            continue
        lines += ["", f"## {name}: top kernels (attention = /{r['attn_pattern']}/)", "",
                  "| kernel | category | ms | calls | share |", "|---|---|---|---|---|"]
        lines += [f"| `{k['name'][:110]}` | {k['category']} | {ms(k['us'])} | {k['count']} "
                  f"| {k['share']:.1%} |" for k in r["top_kernels"]]
        other = r.get("top_by_category", {}).get("other", [])
        if other:
            lines += ["", f"{name}, top kernels of category `other`:", "",
                      "| kernel | ms | calls |", "|---|---|---|"]
            lines += [f"| `{k['name'][:110]}` | {ms(k['us'])} | {k['count']} |" for k in other]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- vLLM side
def request_lengths(input_len: int, output_len: int, n: int, range_ratio: float | None,
                    seed: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths of ``n`` requests: all ``(input_len, output_len)``, or with
    ``range_ratio`` r each drawn uniformly from ``[int(L * (1 - r)), int(L * (1 + r))]`` as
    vLLM's random dataset draws them (``vllm bench --random-range-ratio``; at least 1)."""
    if not range_ratio:
        return [(input_len, output_len)] * n
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio {range_ratio}: use 0 <= r < 1")
    import random

    rng = random.Random(seed)

    def draw(length):
        return max(1, rng.randint(int(length * (1 - range_ratio)),
                                  int(length * (1 + range_ratio))))
    return [(draw(input_len), draw(output_len)) for _ in range(n)]


def max_model_len(cfg: dict) -> int:
    r = cfg.get("range_ratio") or 0.0
    return int(cfg["input_len"] * (1 + r)) + int(cfg["output_len"] * (1 + r))


def engine_kwargs(cfg: dict, trace_dir: str) -> dict:
    """Keyword arguments for ``vllm.LLM`` (also valid for ``vllm.engine.arg_utils.EngineArgs``)."""
    from vllm.config.profiler import ProfilerConfig
    kw = dict(model=cfg["model"], load_format="dummy",
              attention_backend=vllm_backend(cfg["backend"]),
              seed=cfg["seed"], max_model_len=max_model_len(cfg),
              max_num_seqs=cfg["max_num_seqs"], enforce_eager=cfg["enforce_eager"],
              gpu_memory_utilization=cfg["gpu_memory_utilization"],
              profiler_config=ProfilerConfig(
                  profiler="torch", torch_profiler_dir=trace_dir,
                  torch_profiler_with_stack=False, torch_profiler_dump_cuda_time_total=False))
    if cfg.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = cfg["max_num_batched_tokens"]
    if cfg.get("kv_cache_memory_bytes"):
        kw["kv_cache_memory_bytes"] = cfg["kv_cache_memory_bytes"]
    return kw


def vocab_size(model: str, default: int = 32000) -> int:
    try:
        with open(os.path.join(model, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, KeyError, ValueError):
        return default


def child(cfg: dict) -> dict:
    import random
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.makedirs(cfg["trace_dir"], exist_ok=True)
    llm = LLM(**engine_kwargs(cfg, cfg["trace_dir"]))
    rng, vocab = random.Random(cfg["seed"]), vocab_size(cfg["model"])
    rr, seed = cfg.get("range_ratio"), cfg["seed"]

    def batch(n, salt, max_out=None):
        """n prompts with their own lengths (``request_lengths``) and sampling params."""
        lens = request_lengths(cfg["input_len"], cfg["output_len"], n, rr, seed + salt)
        ps = [TokensPrompt(prompt_token_ids=[rng.randrange(10, vocab) for _ in range(i)])
              for i, _ in lens]
        return ps, [sp(o if max_out is None else min(o, max_out)) for _, o in lens], lens

    sp = lambda n: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)  # noqa: E731
    ps, sps, _ = batch(min(cfg["num_prompts"], cfg["max_num_seqs"]), 1, max_out=16)
    llm.generate(ps, sps, use_tqdm=False)
    if cfg.get("gate_dir"):  # --colocate: measure only when the parent says so
        from ion_vllm.bench.start_gate import ready_then_wait

        ready_then_wait(cfg["gate_dir"], cfg["backend"])
    ps, sps, _ = batch(cfg["num_prompts"], 2)
    t0 = time.perf_counter()
    llm.generate(ps, sps, use_tqdm=False)
    timed = time.perf_counter() - t0
    ps, sps, _ = batch(cfg["profile_prompts"], 3)  # lengths: profile_lengths(cfg)
    llm.start_profile(profile_prefix=cfg["backend"])
    t0 = time.perf_counter()
    llm.generate(ps, sps, use_tqdm=False)
    profiled = time.perf_counter() - t0
    llm.stop_profile()
    return {"timed_wall_s": timed, "profiled_wall_s": profiled}


def profile_lengths(cfg: dict) -> list[tuple[int, int]]:
    """(prompt, output) lengths of the profiled batch (``child``'s third batch)."""
    return request_lengths(cfg["input_len"], cfg["output_len"], cfg["profile_prompts"],
                           cfg.get("range_ratio"), cfg["seed"] + 3)


def backend_cfg(args, backend: str, trace_dir: str) -> dict:
    return dict(backend=backend, trace_dir=os.path.abspath(trace_dir), model=args.model,
               seed=args.seed, input_len=args.input_len, output_len=args.output_len,
               range_ratio=args.range_ratio,
               num_prompts=args.num_prompts, max_num_seqs=args.max_num_seqs,
               profile_prompts=args.profile_prompts, enforce_eager=args.enforce_eager,
               gpu_memory_utilization=args.gpu_memory_utilization,
               max_num_batched_tokens=args.max_num_batched_tokens)


def child_argv(cfg: dict, res_file: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg),
            "--child-out", res_file]


def run_backend(args, backend: str, trace_dir: str) -> dict:
    cfg = backend_cfg(args, backend, trace_dir)
    res_file = os.path.join(trace_dir, "child_result.json")
    os.makedirs(trace_dir, exist_ok=True)
    proc = subprocess.run(child_argv(cfg, res_file), timeout=args.timeout,
                          env={**os.environ, **label_env(backend)})
    if proc.returncode != 0 or not os.path.exists(res_file):
        raise RuntimeError(f"{backend} child exited with {proc.returncode}")
    with open(res_file) as f:
        return json.load(f)


def run_backends_colocated(args, backends: list[str], trace_dirs: dict[str, str]) -> None:
    """--colocate: both engines start at once (each planning for 1/n of the GPU memory, with
    a fixed KV pool and its own compile cache), then run their timed and profiled parts one
    at a time (ion_vllm.bench.start_gate).  Each child leaves child_result.json in its trace
    dir, which the caller reads as in the sequential path."""
    import tempfile

    from ion_vllm.bench.start_gate import GatedChild, engine_env, gpu_memory_fraction, run_gated

    with tempfile.TemporaryDirectory() as gate:
        kids = []
        for b in backends:
            cfg = {**backend_cfg(args, b, trace_dirs[b]), "gate_dir": gate,
                   "gpu_memory_utilization": gpu_memory_fraction(len(backends)),
                   "kv_cache_memory_bytes": int(args.kv_cache_gib * (1 << 30))}
            os.makedirs(trace_dirs[b], exist_ok=True)
            kids.append(GatedChild(b, child_argv(cfg, os.path.join(trace_dirs[b],
                                                                   "child_result.json")),
                                   engine_env(gate, b, {**os.environ, **label_env(b)})))
        run_gated(kids, gate)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model dir (e.g. from scripts/make_demo_model.py)")
    p.add_argument("--backends", default="ION,FLASH_ATTN",
                   help="vLLM backends or ION variant labels (ION+noreuse, ION+repage, ...: "
                        "ion_vllm.bench.e2e.ION_VARIANTS), comma-separated")
    p.add_argument("--baseline", default="FLASH_ATTN", help="backend the prediction is against")
    p.add_argument("--input-len", type=int, default=7680)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--range-ratio", type=float, default=None,
                   help="draw each request's prompt and output length uniformly within "
                        "this ratio of --input-len / --output-len, as vllm bench's "
                        "--random-range-ratio (the skewed workload: 0.9)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--profile-prompts", type=int, default=32,
                   help="prompts in the profiled generate (after warm-up and timed run)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn-pattern", action="append", default=[], metavar="[BACKEND=]REGEX",
                   help="attention-kernel regex for BACKEND (or for all); repeatable")
    p.add_argument("--out", default=None, help="default bench/results/attention-share-<date>")
    p.add_argument("--colocate", action="store_true",
                   help="start every backend's engine at once, then time and profile them one "
                        "at a time (saves an engine start of device time)")
    p.add_argument("--kv-cache-gib", type=float, default=30.0,
                   help="--colocate: each engine's fixed KV pool")
    p.add_argument("--parse-only", action="store_true",
                   help="do not run vLLM; re-analyse OUT/traces/<backend>/")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per backend")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.child and not args.parse_only and not args.model:
        p.error("--model is required unless --parse-only")
    return args


def pattern_overrides(specs: list[str]) -> dict[str, str]:
    out = {}
    for s in specs:
        key, sep, rx = s.partition("=")
        if sep and re.fullmatch(r"[A-Za-z0-9_]+", key):
            out[key] = rx
        else:
            out["*"] = s
    for rx in out.values():
        re.compile(rx)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        res = child(json.loads(args.child))
        with open(args.child_out, "w") as f:
            json.dump(res, f)
        return 0
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join("bench", "results", f"attention-share-{date}")
    overrides = pattern_overrides(args.attn_pattern)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    results, failed = {}, False
    tdirs = {b: os.path.join(out, "traces", b) for b in backends}
    if not args.parse_only:
        for b in backends:
            for old in find_traces(tdirs[b]) + glob.glob(os.path.join(tdirs[b],
                                                                     "child_result.json")):
                os.remove(old)
    if args.colocate and not args.parse_only:
        run_backends_colocated(args, backends, tdirs)
    for b in backends:
        tdir = tdirs[b]
        try:
            if not args.parse_only and not args.colocate:
                timing = run_backend(args, b, tdir)
            elif args.colocate and not args.parse_only and not os.path.exists(
                    os.path.join(tdir, "child_result.json")):
                raise RuntimeError(f"{b}: no child_result.json (its child failed)")
            else:
                cr = os.path.join(tdir, "child_result.json")
                timing = json.load(open(cr)) if os.path.exists(cr) else {}
            results[b] = {**analyze_backend(b, tdir, overrides), **timing}
        except Exception as e:  # keep the other backends' results
            failed, results[b] = True, {"error": f"{type(e).__name__}: {e}"}
            print(f"[attention_share] {b} failed: {e}", file=sys.stderr)
    ratios = compare(results, args.baseline)
    workload = {k: getattr(args, k) for k in (
        "model", "input_len", "output_len", "num_prompts", "max_num_seqs", "profile_prompts",
        "enforce_eager", "seed")}
    if args.range_ratio:  # the profiled requests' own lengths (scripts/e2e_attention_bound.py)
        workload["range_ratio"] = args.range_ratio
        workload["profile_lengths"] = profile_lengths(vars(args))
    meta = {"date": date, "baseline": args.baseline, "workload": workload}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "attention_share.json"), "w") as f:
        json.dump({"meta": meta, "results": results, "ratios": ratios}, f, indent=1)
    with open(os.path.join(out, "attention_share.md"), "w") as f:
        f.write(render_markdown(meta, results, ratios))
    print(f"\nwrote {out}/attention_share.{{json,md}}")
    print(f"{'backend':<12}{'GPU ms':>10}{'attn ms':>10}{'share':>8}{'meas':>8}{'pred':>8}{'wall':>8}")
    for b, r in results.items():
        if "total_us" not in r:
            print(f"{b:<12} FAILED {r['error']}")
            continue
        q = ratios.get(b, {})
        g = lambda k: f"{q[k]:8.3f}" if k in q else f"{'-':>8}"  # noqa: E731
        print(f"{b:<12}{r['total_us'] / 1e3:10.1f}{r['category_us']['attention'] / 1e3:10.1f}"
              f"{r['attention_share']:8.1%}{g('measured_gpu_ratio')}{g('predicted_ratio')}"
              f"{g('timed_wall_ratio')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
