#!/usr/bin/env python
"""GPU benchmark of the Ion KV tier on a multi-turn, shared-prefix workload
whose reuse set is several times the HBM KV pool.

Configs (each in a fresh process): `none` (no offload: recompute), `native` (vLLM
OffloadingConnector + CPUOffloadingSpec, same host size, decode blocks stored too so both
tiers hold the same data), `native-default` (the same with vLLM's defaults: prompt blocks
only, so a returning turn recomputes the previous answer's blocks) and `ion`
(OffloadingConnector + IonKVTier, its defaults; `--ring-mib` sets its ring).  The record
of the current defaults on the H200: bench/results/2026-12-06-h200/session32/.  The lab's
Ion variants (each a config key since removed) are at tag lab-2026-12.

Workload: C conversations, each with its own long context; T turns; turn t of
every conversation is prompt = context + all previous turns (user tokens +
generated tokens) + new user tokens.  Turns are submitted in waves of W
conversations, so by the time a conversation comes back its KV has been pushed
out of HBM by the others.

    python scripts/kv_tier_bench.py MODEL [--attention-backend ION] \
        [--kv-cache-memory-bytes N] [--host-gib 8] [--out bench/results/kv-tier-<date>]
    python scripts/kv_tier_bench.py --from-repeats OUT   # results of a run cut short

Defaults (8k contexts, 32 generated tokens per turn, CUDA graphs on) make the
returning turns' prefill the dominant cost, which is what a KV tier exists to save.

Reports TTFT p50/p99, mean TTFT, the TTFT p50 of the returning turns (2 and later) and
per turn (the p50 over all requests is bimodal on the 3-turn workload), output tok/s, total tok/s, the share of prompt tokens served
from a cache (``cached_frac``: vLLM's per-request ``num_cached_tokens`` over prompt tokens,
overall and per turn), the host hit rate of lookups (vLLM's
external_prefix_cache_hits / _queries, counted per lookup, which reads lower than the
token share: 0.45 on the H200 where 0.99 of turns 2-3's prompt tokens came from the
tier), measured
D2H and H2D GB/s (H2D: vLLM's kv_offload_load_{bytes,time}; D2H: the Ion worker's
own ion_kv_tier_d2h_{bytes,seconds} when present, since an Ion store is reported
finished once its sources are read, else vLLM's kv_offload_store_{bytes,time});
writes results.json and results.md into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import subprocess
import sys
import tempfile
import time


#: Ion tier configs -> the kv_connector_extra_config keys they set over the spec's
#: defaults (ion_vllm/kv_tier/config.py)
ION_CONFIGS = {"ion": {}}
CONFIGS = ("none", "native", "native-default", *ION_CONFIGS)


def offload_transfer_config(name: str, host_bytes: int, ring_mib: float) -> dict | None:
    """The kv_transfer_config of config ``name`` (None: no offloading)."""
    from ion_vllm.bench.offload_configs import offload_transfer_config as tier_config

    if name in ION_CONFIGS:
        return tier_config("ion", host_bytes, **{"ring_mib": ring_mib, **ION_CONFIGS[name]})
    return tier_config(name, host_bytes)


def has_weights(model_dir: str) -> bool:
    from ion_vllm.bench.e2e import WEIGHT_SUFFIXES

    return any(f.endswith(WEIGHT_SUFFIXES) for f in os.listdir(model_dir))


def pct_rank(n: int, p: float) -> int:
    """The index ``pct`` takes the ``p``-th percentile from in ``n`` sorted values (the
    nearest rank: one value, not a mean of two)."""
    return min(n - 1, max(0, int(round(p / 100 * (n - 1)))))


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    return sorted(xs)[pct_rank(len(xs), p)]


def child(cfg: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=cfg["model"], seed=0, kv_cache_memory_bytes=cfg["kv_bytes"],
              block_size=cfg["block_size"], max_model_len=cfg["max_model_len"],
              max_num_seqs=cfg["max_num_seqs"], disable_log_stats=False,
              enable_prefix_caching=True, enforce_eager=cfg["enforce_eager"],
              skip_tokenizer_init=True)  # token-id prompts; no detokenization cost
    if not has_weights(cfg["model"]):
        kw["load_format"] = "dummy"  # e.g. the offline demo model (config only)
    if cfg["backend"]:
        kw["attention_backend"] = cfg["backend"]
    if cfg.get("gpu_memory_utilization"):
        kw["gpu_memory_utilization"] = cfg["gpu_memory_utilization"]
    ktc = offload_transfer_config(cfg["name"], int(cfg["host_gib"] * (1 << 30)),
                                  cfg["ring_mib"])
    if ktc is not None:
        kw["kv_transfer_config"] = ktc
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    # warm-up (not measured): compile/capture on an unrelated prompt
    warm = random.Random(-1)
    llm.generate([TokensPrompt(prompt_token_ids=[warm.randrange(10, cfg["vocab"])
                                                 for _ in range(64)])], sp, use_tqdm=False)
    # repeat r draws its own conversations (seed + r): nothing of an earlier repeat is a
    # prefix of it, so it starts from cold GPU and host caches for its own prompts
    runs = []
    for r in range(cfg.get("repeats", 1)):
        if cfg.get("gate_dir"):  # --colocate: measure only when the parent says so
            from start_gate import ready_then_wait

            ready_then_wait(cfg["gate_dir"], cfg["name"], r)
        runs.append(run_workload(llm, sp, cfg, cfg["seed"] + r))
        log_repeat(cfg, runs[-1])
    return combine_repeats(cfg["name"], runs)





def log_repeat(cfg: dict, run: dict) -> None:
    """Append one finished repeat to ``<out>/repeats.jsonl`` as soon as it ends: a call cut
    short by its time limit (the parent and its children killed before any result is
    combined) still leaves every finished repeat on disk."""
    if not cfg.get("out"):
        return
    with open(os.path.join(cfg["out"], "repeats.jsonl"), "a") as f:
        f.write(json.dumps(run) + "\n")  # run_workload's record names its config


def rebuild_from_repeats(out: str) -> list[str]:
    """``kv_tier_bench.py --from-repeats OUT``: results.json / results.md of a run that was
    cut short, from the repeats that finished (``OUT/repeats.jsonl``) and the run's
    ``OUT/meta.json``; configs in the order they first finished.  Returns the table
    lines."""
    from types import SimpleNamespace

    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    by: dict[str, list[dict]] = {}
    with open(os.path.join(out, "repeats.jsonl")) as f:
        for line in f:
            if line.strip():
                run = json.loads(line)
                by.setdefault(run["config"], []).append(run)
    results = [combine_repeats(name, runs) for name, runs in by.items()]
    meta = {**meta, "rebuilt_from_repeats": True}
    return write_results(out, meta, results, SimpleNamespace(**meta["args"]),
                         meta["hbm_kv_pool_bytes"], meta["reuse_set_bytes"])


def run_workload(llm, sp, cfg: dict, seed: int) -> dict:
    """One pass of the multi-turn workload on a warm engine; its metrics are deltas."""
    from vllm.inputs import TokensPrompt

    from gpu_busy import GpuBusySampler
    from ion_vllm.bench.offload_configs import prometheus_sums

    rng = random.Random(seed)
    vocab = cfg["vocab"]
    tok = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    convs = [tok(cfg["context_len"]) for _ in range(cfg["conversations"])]
    m0 = prometheus_sums()
    ttft: list[float] = []
    ttft_turn: list[list[float]] = [[] for _ in range(cfg["turns"])]
    wave_s: list[float] = []
    n_in = n_out = 0
    with GpuBusySampler() as busy:
        t0 = time.perf_counter()
        W = cfg["wave"]
        # prompt tokens served from a cache (GPU prefix cache + tier), per turn: where hits
        # are lost (the tier-wide host hit rate mixes turns, preempted re-lookups and retries)
        cached = [0] * cfg["turns"]
        prompted = [0] * cfg["turns"]
        phases = {k: [0.0] * cfg["turns"] for k in PHASES}
        for turn in range(cfg["turns"]):
            for w in range(0, len(convs), W):
                idx = list(range(w, min(w + W, len(convs))))
                for i in idx:
                    convs[i] = convs[i] + tok(cfg["user_len"])
                tw = time.perf_counter()
                res = llm.generate([TokensPrompt(prompt_token_ids=convs[i]) for i in idx], sp,
                                   use_tqdm=False)
                wave_s.append(time.perf_counter() - tw)
                for i, r in zip(idx, res):
                    out = list(r.outputs[0].token_ids)
                    convs[i] = convs[i] + out
                    n_in += len(r.prompt_token_ids)
                    n_out += len(out)
                    prompted[turn] += len(r.prompt_token_ids)
                    cached[turn] += r.num_cached_tokens or 0
                    if r.metrics is not None and r.metrics.first_token_latency:
                        ttft.append(r.metrics.first_token_latency)
                        ttft_turn[turn].append(r.metrics.first_token_latency)
                    for k, v in request_phases(r.metrics).items():
                        phases[k][turn] += v
        wall = time.perf_counter() - t0
    m1 = prometheus_sums()
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}

    def gbps(b: str, t: str) -> float | None:
        return d[b] / d[t] / 1e9 if d.get(t) else None

    q = d.get("vllm:external_prefix_cache_queries", 0.0)
    return {
        "config": cfg["name"], "seed": seed, "requests": len(ttft), "wall_s": wall,
        "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
        **ttft_summary(ttft_turn),
        "output_tok_s": n_out / wall, "total_tok_s": (n_in + n_out) / wall,
        "prompt_tokens": n_in, "output_tokens": n_out,
        "gpu_prefix_hit_rate": (d.get("vllm:prefix_cache_hits", 0.0)
                                / max(1.0, d.get("vllm:prefix_cache_queries", 0.0))),
        "host_hit_rate": (d.get("vllm:external_prefix_cache_hits", 0.0) / q) if q else None,
        "d2h_gbps": (gbps("vllm:ion_kv_tier_d2h_bytes", "vllm:ion_kv_tier_d2h_seconds")
                     or gbps("vllm:kv_offload_store_bytes", "vllm:kv_offload_store_time")),
        "h2d_gbps": gbps("vllm:kv_offload_load_bytes", "vllm:kv_offload_load_time"),
        "preemptions": d.get("vllm:num_preemptions", 0.0),
        "cached_frac": sum(cached) / sum(prompted) if sum(prompted) else None,
        "cached_frac_by_turn": turn_fractions(cached, prompted),
        "tier_metrics": {k: v for k, v in d.items()
                         if ("kv_offload" in k or "ion_kv_tier" in k) and v},
        "wave_s": wave_s,
        "phase_s_by_turn": phases,
        **engine_step_stats(d, wall),
        **busy.summary(),
    }


#: a request's phases, from the engine core's time stamps on its output (``request_phases``)
PHASES = ("queue", "prefill", "decode")


def request_phases(m) -> dict[str, float]:
    """Seconds of one request's phases from its ``RequestStateStats`` ``m``: ``queue``
    (queued -> first scheduled; a tier load that the request waits for before it is
    scheduled falls here), ``prefill`` (first scheduled -> first token) and ``decode``
    (first -> last token, preemptions inside it included), the split behind vLLM's
    summed ``request_*_time_seconds``, kept per turn by ``run_workload``.  Empty when a
    time stamp is missing."""
    ts = [getattr(m, k, 0.0) for k in ("queued_ts", "scheduled_ts", "first_token_ts",
                                       "last_token_ts")] if m is not None else []
    if not ts or not all(ts):
        return {}
    q, s, f, last = ts
    return {"queue": s - q, "prefill": f - s, "decode": last - f}


def engine_step_stats(d: dict, wall: float) -> dict:
    """Where a run's wall time went, from the deltas ``d`` of vLLM's metrics
    (``prometheus_sums``): engine steps and the tokens they computed
    (``vllm:iteration_tokens_total``), wall ms a step, prompt tokens by source (computed,
    GPU prefix cache, the tier), and the requests' summed queue / prefill / decode
    seconds.  A config slower at equal work has more steps or longer ones; with the GPU
    busy share (``GpuBusySampler``) beside, longer steps split into GPU time and host
    time."""
    steps = d.get("vllm:iteration_tokens_total_count", 0.0)
    tokens = d.get("vllm:iteration_tokens_total_sum", 0.0)
    src = "vllm:prompt_tokens_by_source[{}]"
    return {
        "engine_steps": int(steps),
        "step_tokens": int(tokens),
        "tokens_per_step": tokens / steps if steps else None,
        "ms_per_step": wall * 1e3 / steps if steps else None,
        "prompt_computed": int(d.get(src.format("local_compute"), 0.0)),
        "prompt_gpu_cache": int(d.get(src.format("local_cache_hit"), 0.0)),
        "prompt_tier": int(d.get(src.format("external_kv_transfer"), 0.0)),
        "queue_s": d.get("vllm:request_queue_time_seconds_sum", 0.0),
        "prefill_s": d.get("vllm:request_prefill_time_seconds_sum", 0.0),
        "decode_s": d.get("vllm:request_decode_time_seconds_sum", 0.0),
    }


def ttft_summary(by_turn: list[list[float]]) -> dict:
    """TTFT figures besides the p50 / p99 over all requests (seconds in, ms out): the mean,
    the p50 of the returning turns (2 and later: the requests whose prefix the tier can
    restore; None with one turn), and the p50 of each turn (None for a turn with none).
    The p50 over all requests is bimodal on the 3-turn workload (each repeat lands near one
    of two values, twenty-fifth session), so comparisons also need these; and the turn
    (1-based) of the request that is that p50 (``pct`` takes one request, not a mean), to
    tell whether the whole-run median is a cold turn-1 request or a returning one."""
    every = [x for t in by_turn for x in t]
    warm = [x for t in by_turn[1:] for x in t]
    tagged = sorted((x, turn + 1) for turn, t in enumerate(by_turn) for x in t)
    p50_turn = tagged[pct_rank(len(tagged), 50)][1] if tagged else None
    return {"ttft_mean_ms": sum(every) / len(every) * 1e3 if every else None,
            "ttft_p50_warm_ms": pct(warm, 50) * 1e3 if warm else None,
            "ttft_p50_by_turn_ms": [pct(t, 50) * 1e3 if t else None for t in by_turn],
            "ttft_p50_turn": p50_turn}


def turn_fractions(cached: list[int], prompted: list[int]) -> list[float | None]:
    """Per turn: cached prompt tokens / prompt tokens (None for a turn with no prompts)."""
    return [c / p if p else None for c, p in zip(cached, prompted)]


#: fields of a config's result that are averaged over its repeats
MEAN_FIELDS = ("wall_s", "ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "ttft_p50_warm_ms",
               "output_tok_s", "total_tok_s",
               "gpu_prefix_hit_rate", "cached_frac", "host_hit_rate", "d2h_gbps", "h2d_gbps",
               "preemptions", "engine_steps", "step_tokens", "tokens_per_step",
               "ms_per_step", "prompt_computed", "prompt_gpu_cache", "prompt_tier",
               "queue_s", "prefill_s", "decode_s", "gpu_busy_pct")


def combine_repeats(name: str, runs: list[dict]) -> dict:
    """One config's result: the mean of each MEAN_FIELDS entry over its repeats (None when
    any repeat has none), min/max of throughput and TTFT p50, the per-repeat records, and
    summed token counts and tier metrics."""
    out: dict = {"config": name, "repeats": len(runs), "runs": runs}
    for k in MEAN_FIELDS:
        vals = [r.get(k) for r in runs]
        out[k] = None if not vals or any(v is None for v in vals) else sum(vals) / len(vals)
    for k in ("total_tok_s", "ttft_p50_ms"):
        out[k + "_min"] = min((r[k] for r in runs), default=None)
        out[k + "_max"] = max((r[k] for r in runs), default=None)
    for k in ("requests", "prompt_tokens", "output_tokens"):
        out[k] = sum(r[k] for r in runs)
    tm: dict = {}
    for r in runs:
        for k, v in r["tier_metrics"].items():
            tm[k] = tm.get(k, 0.0) + v
    out["tier_metrics"] = tm
    return out


def run_child(cfg: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cpath, opath = os.path.join(d, "cfg.json"), os.path.join(d, "out.json")
        with open(cpath, "w") as f:
            json.dump(cfg, f)
        subprocess.run([sys.executable, __file__, "--child", cpath, opath], check=True)
        with open(opath) as f:
            return json.load(f)


def run_colocated(base: dict, names: list[str], on_result, rotate: bool = True) -> None:
    """--colocate: every config's engine starts at once (each planning for 1/n of the GPU
    memory; separate compile caches); once all are up, they measure one at a time, the
    repeats interleaved (once per repeat, in the config order, rotated by one each round
    with ``rotate``; see scripts/start_gate.py).
    ``on_result(result)`` gets each config's result dict."""
    from start_gate import GatedChild, engine_env, gpu_memory_fraction, run_gated

    with tempfile.TemporaryDirectory() as d:
        frac = gpu_memory_fraction(len(names))
        children, outs = [], {}
        for name in names:
            cpath, outs[name] = os.path.join(d, f"{name}.json"), os.path.join(d, f"{name}.out")
            with open(cpath, "w") as f:
                json.dump({**base, "name": name, "gate_dir": d,
                           "gpu_memory_utilization": frac}, f)
            children.append(GatedChild(name, [sys.executable, __file__, "--child", cpath,
                                              outs[name]], engine_env(d, name)))

        def done(name: str, rc: int) -> None:
            if rc == 0 and os.path.exists(outs[name]):
                with open(outs[name]) as f:
                    on_result(json.load(f))
            else:
                on_result({"config": name, "error": f"child exited {rc}"})

        run_gated(children, d, on_done=done, rounds=base.get("repeats", 1), rotate=rotate)


def fmt(v, nd=1):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def write_results(out, meta, results, args, kv_bytes, reuse) -> list[str]:
    """results.json + results.md of the configs run so far; returns the table lines."""
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    cols = [("config", "config", 0), ("TTFT p50 ms", "ttft_p50_ms", 1),
            ("TTFT p99 ms", "ttft_p99_ms", 1), ("TTFT mean ms", "ttft_mean_ms", 1),
            ("TTFT p50 turns 2+ ms", "ttft_p50_warm_ms", 1), ("out tok/s", "output_tok_s", 0),
            ("total tok/s", "total_tok_s", 0), ("GPU prefix hit", "gpu_prefix_hit_rate", 3),
            ("prompt from cache", "cached_frac", 3),
            ("host hit (lookups)", "host_hit_rate", 3), ("D2H GB/s", "d2h_gbps", 2),
            ("H2D GB/s", "h2d_gbps", 2), ("preemptions", "preemptions", 0)]
    lines = [f"# KV tier benchmark ({dt.date.today().isoformat()})", "",
             f"model `{args.model}`, backend {args.attention_backend}, HBM KV pool "
             f"{kv_bytes/2**20:.0f} MiB, reuse set {reuse/2**20:.0f} MiB "
             f"({reuse/kv_bytes:.1f}x), host tier {args.host_gib} GiB; "
             f"{args.conversations} conversations x {args.turns} turns, context "
             f"{args.context_len}, +{args.user_len} user / {args.max_tokens} generated "
             f"tokens per turn, waves of {args.wave}.", "",
             "| " + " | ".join(c[0] for c in cols) + " |",
             "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join(fmt(r.get(k), nd) if nd else fmt(
            int(r[k]) if isinstance(r.get(k), float) else r.get(k)) for _, k, nd in cols) + " |")
    multi = [r for r in results if r.get("repeats", 1) > 1]
    if multi:
        lines += ["", "Per repeat:", "",
                  "| config | seed | TTFT p50 ms | p50 from turn | TTFT p50 by turn ms | "
                  "total tok/s | host hit (lookups) | preemptions | cached by turn |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['config']} | {x['seed']} | {fmt(x['ttft_p50_ms'])} | "
                  f"{fmt(x.get('ttft_p50_turn'))} | "
                  f"{' / '.join(fmt(v) for v in x.get('ttft_p50_by_turn_ms') or []) or '-'} | "
                  f"{fmt(x['total_tok_s'], 0)} | {fmt(x['host_hit_rate'], 3)} | "
                  f"{fmt(x['preemptions'], 0)} | "
                  f"{' / '.join(fmt(v, 3) for v in x.get('cached_frac_by_turn') or [])} |"
                  for r in multi for x in r["runs"]]
        lines += ["", "cached by turn: prompt tokens served from a cache (GPU prefix cache or "
                  "tier) / prompt tokens, turn 1 / 2 / ..."]
    lines += step_table(results)
    lines += turn_table(results, args)
    lines += phase_table(results)
    lines += ["", "prompt from cache: prompt tokens served from the GPU prefix cache or the "
              "tier / prompt tokens. host hit (lookups): vLLM's external prefix-cache hits / "
              "queries, counted per lookup."]
    lines += [""] + bar_lines({r["config"]: r for r in results})
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


STEP_COLS = (("config", "config", 0), ("wall s", "wall_s", 1), ("engine steps", "engine_steps", 0),
             ("tokens/step", "tokens_per_step", 1), ("ms/step", "ms_per_step", 2),
             ("GPU busy %", "gpu_busy_pct", 1), ("prompt computed", "prompt_computed", 0),
             ("from GPU cache", "prompt_gpu_cache", 0), ("from tier", "prompt_tier", 0),
             ("queue s", "queue_s", 1))


def step_table(results: list[dict]) -> list[str]:
    """Where the wall time went (``engine_step_stats``, means over repeats); empty when no
    result has engine-step counts (results of older versions of this script)."""
    rows = [r for r in results if r.get("engine_steps") is not None]
    if not rows:
        return []
    out = ["", "Engine steps (vLLM metrics; GPU busy: NVML utilization sampled every 0.1 s):",
           "", "| " + " | ".join(c[0] for c in STEP_COLS) + " |", "|" + "---|" * len(STEP_COLS)]
    for r in rows:
        cells = []
        for _, k, nd in STEP_COLS:
            v = r.get(k)
            cells.append(fmt(v, nd) if nd else fmt(int(v) if isinstance(v, float) else v))
        out.append("| " + " | ".join(cells) + " |")
    return out


def turn_seconds(wave_s: list[float], conversations: int, wave: int) -> list[float]:
    """Wall seconds of each turn: the sum of its waves (``wave_s`` holds every wave in
    run order, ceil(conversations / wave) a turn)."""
    k = -(-conversations // wave)
    return [sum(wave_s[i:i + k]) for i in range(0, len(wave_s), k)]


def turn_table(results: list[dict], args) -> list[str]:
    """Wall seconds by turn, each config's mean over its repeats: where a config's time
    went turn by turn (the twenty-sixth session found Ion's whole gap in turn 1).  Empty
    when no repeat recorded its waves."""
    rows = []
    for r in results:
        runs = [x for x in r.get("runs", [r]) if x.get("wave_s")]
        if not runs:
            continue
        per = [turn_seconds(x["wave_s"], args.conversations, args.wave) for x in runs]
        n = min(len(p) for p in per)
        rows.append((r["config"], [sum(p[t] for p in per) / len(per) for t in range(n)]))
    return by_turn_lines("Wall seconds by turn (the sum of its waves; mean over repeats):",
                         rows, lambda x: f"{x:.2f}")


def by_turn_lines(title: str, rows: list[tuple[str, list]], cell) -> list[str]:
    """A table of one row per (config, per-turn values), ``cell(value)`` rendering each,
    rows with fewer turns padded with empty cells; empty without rows (``turn_table``,
    ``phase_table``)."""
    if not rows:
        return []
    n = max(len(v) for _, v in rows)
    out = ["", title, "", "| config | " + " | ".join(f"turn {t + 1}" for t in range(n)) + " |",
           "|---|" + "---|" * n]
    for name, v in rows:
        out.append(f"| {name} | " + " | ".join(cell(x) for x in v) + " |" * (1 + n - len(v)))
    return out


def phase_table(results: list[dict]) -> list[str]:
    """The requests' summed queue / prefill / decode seconds by turn (``request_phases``),
    each config's mean over its repeats: which phase of which turn a config's time went
    to (the twenty-ninth session: Ion's summed decode time 1.2% over native's over three
    turns, its prefill 17% under).  Empty when no repeat recorded them."""
    rows = []
    for r in results:
        runs = [x["phase_s_by_turn"] for x in r.get("runs", [r]) if x.get("phase_s_by_turn")]
        if not runs:
            continue
        n = min(len(x["decode"]) for x in runs)
        rows.append((r["config"], [[sum(x[k][t] for x in runs) / len(runs) for k in PHASES]
                                   for t in range(n)]))
    return by_turn_lines("Requests' summed seconds by turn, queue / prefill / decode "
                         "(queued -> scheduled, scheduled -> first token, first -> last "
                         "token; mean over repeats):", rows,
                         lambda c: " / ".join(f"{x:.1f}" for x in c))


def paired_ratio(a: dict, b: dict, key: str) -> tuple[float, float | None, int] | None:
    """Mean and sample standard deviation of the per-repeat ratios a/b of ``key`` (repeat
    i of ``a`` against repeat i of ``b``: they ran interleaved, so a pair shares the
    machine's state), and the number of pairs; None without a pair (``e2e_ratio``, the
    pairing the e2e reports use)."""
    from ion_vllm.bench.report import e2e_ratio

    r = e2e_ratio(a, b, key)
    return None if r is None else (r["ratio_mean"], r["ratio_sd"], r["pairs"])


def bar_lines(by: dict) -> list[str]:
    """The issue's bars, judged from the configs present: Ion >= native in throughput and
    <= native in TTFT p50; both tiers beat recompute (no offload) in throughput.  Every
    Ion variant present (``ion``, then the ``ion-*`` configs in run order) is judged, so
    that a candidate default measured under its own name gets its verdict too."""
    ok = {k: v for k, v in by.items() if v.get("total_tok_s")}
    out = []
    ions = [k for k in ok if k == "ion"] + [k for k in ok if k.startswith("ion-")]

    def check(name, cond):
        out.append(f"- {name}: {'PASS' if cond else 'FAIL'}")

    # native: decode blocks stored too (as Ion does); native-default: vLLM's defaults
    for ion in ions:
        for nat in ("native", "native-default"):
            if nat not in ok:
                continue
            check(f"{ion} total tok/s {ok[ion]['total_tok_s']:.0f} >= {nat} "
                  f"{ok[nat]['total_tok_s']:.0f}",
                  ok[ion]["total_tok_s"] >= ok[nat]["total_tok_s"])
            check(f"{ion} TTFT p50 {ok[ion]['ttft_p50_ms']:.1f} ms <= {nat} "
                  f"{ok[nat]['ttft_p50_ms']:.1f} ms",
                  ok[ion]["ttft_p50_ms"] <= ok[nat]["ttft_p50_ms"])
            for key, what in (("total_tok_s", "total tok/s"), ("ttft_p50_ms", "TTFT p50"),
                              ("ttft_mean_ms", "TTFT mean"),
                              ("ttft_p50_warm_ms", "TTFT p50 of turns 2+")):
                pr = paired_ratio(ok[ion], ok[nat], key)
                if pr is not None:
                    sd = "" if pr[1] is None else f" ± {pr[1]:.3f}"
                    out.append(f"- {ion} / {nat} {what}, paired by repeat: {pr[0]:.3f}{sd} "
                               f"({pr[2]} pairs)")
    for tier in (*ions, "native", "native-default"):
        if tier in ok and "none" in ok:
            check(f"{tier} total tok/s {ok[tier]['total_tok_s']:.0f} > recompute "
                  f"{ok['none']['total_tok_s']:.0f}",
                  ok[tier]["total_tok_s"] > ok["none"]["total_tok_s"])
    return (["Bars:"] + out) if out else []


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--from-repeats":
        print("\n".join(rebuild_from_repeats(sys.argv[2])))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        with open(sys.argv[2]) as f:
            cfg = json.load(f)
        res = child(cfg)
        with open(sys.argv[3], "w") as f:
            json.dump(res, f)
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--attention-backend", default="ION")
    ap.add_argument("--configs", default="ion,native-default,none",
                    help=f"run order, from {', '.join(CONFIGS)}; results are written after "
                         "each, so a run cut short by a time limit keeps the first ones")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    ap.add_argument("--reuse-over-hbm", type=float, default=4.0,
                    help="when sizing the HBM pool: reuse set / HBM pool")
    ap.add_argument("--host-gib", type=float, default=24.0)
    ap.add_argument("--ring-mib", type=float, default=256)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--context-len", type=int, default=8192)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--wave", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1,
                    help="workload passes per config on the same engine, each with its own "
                         "conversations (seed + r); the table shows means and min-max")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--colocate", action="store_true",
                    help="start every config's engine at once (each with 1/n of the GPU "
                         "memory), then measure them one at a time: saves (n-1) engine "
                         "starts of device time; the measured config has the GPU's compute "
                         "and PCIe to itself")
    ap.add_argument("--order", choices=("rotate", "fixed"), default="rotate",
                    help="--colocate: the configs' order in each round; rotate (round r "
                         "starts at config r mod n: no config always runs first) or fixed "
                         "(the --configs order every round)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    unknown = [n for n in args.configs.split(",") if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {CONFIGS}")

    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(args.model)
    n_kv = getattr(hf, "num_key_value_heads", hf.num_attention_heads)
    head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    per_token = 2 * hf.num_hidden_layers * n_kv * head * 2
    final_len = args.context_len + args.turns * (args.user_len + args.max_tokens)
    reuse = per_token * final_len * args.conversations
    kv_bytes = args.kv_cache_memory_bytes or int(reuse / args.reuse_over_hbm)
    kv_bytes = max(kv_bytes, per_token * (final_len + args.block_size) * 2)
    if args.host_gib * (1 << 30) < reuse:
        print(f"note: host tier {args.host_gib} GiB < reuse set {reuse/2**30:.2f} GiB")
    out = args.out or os.path.join("bench", "results",
                                   f"kv-tier-{dt.date.today().isoformat()}")
    os.makedirs(out, exist_ok=True)
    base = dict(model=args.model, backend=args.attention_backend, kv_bytes=kv_bytes,
                block_size=args.block_size, max_model_len=final_len + args.block_size,
                max_num_seqs=args.wave, host_gib=args.host_gib, ring_mib=args.ring_mib,
                conversations=args.conversations, context_len=args.context_len,
                user_len=args.user_len, max_tokens=args.max_tokens, turns=args.turns,
                wave=args.wave, vocab=hf.vocab_size, seed=0,
                enforce_eager=args.enforce_eager, repeats=args.repeats, out=out)
    meta = {"model": args.model, "attention_backend": args.attention_backend,
            "hbm_kv_pool_bytes": kv_bytes, "reuse_set_bytes": reuse,
            "reuse_over_hbm": reuse / kv_bytes, "host_gib": args.host_gib,
            "args": vars(args)}
    meta["colocate"] = args.colocate
    with open(os.path.join(out, "meta.json"), "w") as f:  # for --from-repeats
        json.dump(meta, f, indent=1)
    # a fresh run starts a fresh log: an earlier run's repeats in the same OUT must not be
    # mixed into this one's (--from-repeats reads them all)
    if os.path.exists(os.path.join(out, "repeats.jsonl")):
        os.remove(os.path.join(out, "repeats.jsonl"))
    results = []
    lines: list[str] = []

    def record(res: dict) -> None:
        nonlocal lines
        results.append(res)
        print(json.dumps(res, indent=1), flush=True)
        # written after every config, so a run cut short still leaves the finished ones
        lines = write_results(out, meta, results, args, kv_bytes, reuse)

    names = args.configs.split(",")
    if args.colocate:
        run_colocated(base, names, record, rotate=args.order == "rotate")
    else:
        for name in names:
            print(f"== {name}", flush=True)
            try:
                record(run_child({**base, "name": name}))
            except subprocess.CalledProcessError as e:
                record({"config": name, "error": f"child exited {e.returncode}"})
    print("\n".join(lines))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
