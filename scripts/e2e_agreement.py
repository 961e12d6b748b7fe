#!/usr/bin/env python3
"""End-to-end teacher-forced agreement of ION vs FLASH_ATTN vs TRITON_ATTN in vLLM.

Usage (on the H200, vLLM + the ion-vllm plugin installed):
    python scripts/e2e_agreement.py [--model DIR] [--out DIR] [--enforce-eager] [--break]

Model: the small real-weight Qwen2 of ``scripts/make_tiny_model.py`` (built into
``bench/models/tiny-qwen2`` when --model is not given; GQA 8, head_dim 128).

Method
  * A fixed, seeded set of prompts of random token ids: lengths 16..4000
    including page boundaries (64k, 64k +- 1) and groups sharing long prefixes.
  * Every backend runs in its own fresh subprocess (one ``vllm.LLM`` per
    process, GPU memory freed at exit) with ``enable_prefix_caching=True``,
    ``max_num_batched_tokens`` 512 (chunked prefill mixes with decode),
    ``max_model_len`` 8192, ``gpu_memory_utilization`` 0.3.
  * FLASH_ATTN (the reference) runs first: greedy-generates --gen-tokens (32)
    tokens per prompt.  Then each backend teacher-forces prompt + those tokens
    (``SamplingParams(max_tokens=1, prompt_logprobs=k)``) and reports, at every
    position, its top-1 token and the logprob of the teacher (actual next) token.
  * Each backend also greedy-generates from the prompts itself (decode steps,
    prefix-cache hits): reported as the number of generated tokens equal to
    FLASH_ATTN's before the first divergence (informational only).

Metrics, per backend X in {ION, TRITON_ATTN}, against FLASH_ATTN:
  * top-1 agreement = fraction of positions where X's and FA's top-1 tokens match;
  * |dlogprob| = |logprob_X(teacher) - logprob_FA(teacher)| over the positions
    where top-1 agrees: mean, p99, max.

Verdict rule: PASS iff
    top1(ION) >= top1(TRITON) - top1_slack          (slack default 0)
    and p99|dlogprob|(ION) <= 1.5 * p99|dlogprob|(TRITON)
    and max|dlogprob|(ION) <= 1.5 * max|dlogprob|(TRITON)
i.e. ION must be at least as close to FlashAttention as vLLM's own Triton
backend, up to a 1.5x margin on the logprob deviations.

``--spec-ngram K``: every backend runs with vLLM's n-gram speculative decoding (K draft
tokens, so decode rows of up to 1 + K query tokens), on prompts that repeat a random
segment (so the proposer drafts); PASS then also needs ION's greedy generation equal to
FLASH_ATTN's token for token on every prompt, and drafts verified (vLLM's counters).

``--break`` runs ION with a fault injected by this script (``inject_fault``: every
``cute_kernels.ion_attention`` launch reads a wrong KV page, with vLLM's engine core in the
worker process so that the patch applies); the script must then report FAIL.  Writes
``agreement.json`` + ``agreement.md`` (and per-backend raw results and logs)
to --out (default bench/results/e2e-agreement-<date>), prints a table, and
exits 0 on PASS, 1 on FAIL, 2 on a worker error.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import random
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = "FLASH_ATTN"
DEFAULT_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "ION")
MAX_REGULAR_TOKEN = 151643  # ids below the special tokens of the Qwen2 tokenizer
LOGPROB_MARGIN = 1.5
FAULT_VALUE = "swap_kv_page"


# ----------------------------------------------------------------------------- prompts

def build_prompts(seed: int = 0, vocab: int = MAX_REGULAR_TOKEN) -> List[Dict]:
    """Fixed prompt set: [{"name", "ids"}], deterministic for a seed.

    Lengths cover 16..4000 with page boundaries; three groups share long
    prefixes (one prefix is itself a full prompt) for prefix-cache hits.
    """
    rng = random.Random(seed)

    def rand(n: int) -> List[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    lengths = [16, 17, 31, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 383,
               500, 511, 512, 513, 777, 1000, 1023, 1024, 1025, 1500, 2047, 2048,
               2049, 2500, 3000, 3583, 4000]
    prompts = [{"name": f"len{n}", "ids": rand(n)} for n in lengths]
    base_a = rand(3000)
    for pre, suf in [(3000, 1), (2048, 100), (2048, 511), (1000, 37), (64, 900)]:
        prompts.append({"name": f"shareA_{pre}+{suf}", "ids": base_a[:pre] + rand(suf)})
    base_b = rand(1536)
    for suf in (1, 64, 65, 700):
        prompts.append({"name": f"shareB_1536+{suf}", "ids": base_b + rand(suf)})
    base_c = prompts[lengths.index(513)]["ids"]  # an earlier prompt as a prefix
    prompts.append({"name": "shareC_len513+250", "ids": base_c + rand(250)})
    return prompts


def spec_prompts(seed: int = 0, vocab: int = MAX_REGULAR_TOKEN) -> List[Dict]:
    """``--spec-ngram`` prompts: a random segment repeated, so that the n-gram proposer finds
    matches and drafts (a random prompt rarely repeats an n-gram).  Segment lengths and
    repeat counts put the drafted rows across page edges and long contexts."""
    rng = random.Random(seed + 7)
    prompts = []
    for seg, reps in [(5, 4), (16, 3), (37, 5), (63, 2), (64, 3), (65, 4), (100, 6), (127, 2),
                      (200, 5), (333, 3), (500, 4), (700, 5)]:
        s = [rng.randrange(vocab) for _ in range(seg)]
        prompts.append({"name": f"rep{seg}x{reps}", "ids": s * reps})
    return prompts


def spec_counters(llm) -> Dict[str, float]:
    """vLLM's speculative-decoding counters of this engine (drafts, draft and accepted
    tokens), summed over label sets; {} when the engine keeps no metrics."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - an engine without stats: nothing to report
        return {}
    out: Dict[str, float] = {}
    for m in metrics:
        if "spec_decode" in getattr(m, "name", "") and isinstance(getattr(m, "value", None),
                                                                  (int, float)):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
    return out


# ----------------------------------------------------------------------------- worker

def _lp_value(entry) -> float:
    return float(entry.logprob if hasattr(entry, "logprob") else entry["logprob"])


def _lp_rank(entry) -> Optional[int]:
    r = entry.rank if hasattr(entry, "rank") else entry.get("rank")
    return None if r is None else int(r)


def extract_prompt_logprobs(token_ids: Sequence[int], prompt_logprobs) -> Dict[str, List]:
    """Per position i >= 1: top-1 token and logprob of the teacher token ids[i].

    ``prompt_logprobs[i]`` maps token id -> Logprob(logprob, rank, ...) and
    always contains ``ids[i]`` (vLLM adds the actual token to the top-k).
    """
    if len(prompt_logprobs) != len(token_ids):
        raise ValueError(f"{len(prompt_logprobs)} prompt logprob positions for "
                         f"{len(token_ids)} tokens")
    top1, teacher = [], []
    for i in range(1, len(token_ids)):
        pos = prompt_logprobs[i]
        if pos is None:
            raise ValueError(f"missing prompt logprobs at position {i}")
        best_tok, best_lp = None, -math.inf
        for tok, entry in pos.items():
            rank = _lp_rank(entry)
            if rank == 1:
                best_tok, best_lp = int(tok), _lp_value(entry)
                break
            if _lp_value(entry) > best_lp:
                best_tok, best_lp = int(tok), _lp_value(entry)
        top1.append(best_tok)
        teacher.append(_lp_value(pos[token_ids[i]]))
    return {"top1": top1, "teacher_logprob": teacher}


def fault_block_table(block_table):
    """A copy of ``block_table`` whose request 0 reads a wrong KV page: its page 0 aliased
    to the last request's page 0 (several requests), else its pages 0 and 1 swapped.  Merely
    swapping two fully visible pages would not change attention (RoPE is inside K), so the
    alias to another sequence's K/V is what makes the fault observable end to end."""
    broken = block_table.clone()
    if block_table.shape[0] >= 2:
        broken[0, 0] = block_table[-1, 0]
    elif block_table.shape[1] >= 2:
        broken[0, 0:2] = block_table[0, 0:2].flip(0)
    return broken


def inject_fault() -> int:
    """``--break``: replace ``cute_kernels.ion_attention`` (and every loaded
    ``cute_kernels.*`` module's binding of it) by a wrapper that hands the kernel
    :func:`fault_block_table` of its block table.  Call before vLLM builds the engine, with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core then runs in this process).
    Returns the number of bindings replaced."""
    import cute_kernels

    real = cute_kernels.ion_attention

    def broken(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, *args, **kw):
        return real(q, k_cache, v_cache, out, query_start_loc, seq_lens,
                    fault_block_table(block_table), *args, **kw)

    n = 0
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] == "cute_kernels" and getattr(mod, "ion_attention", None) is real:
            mod.ion_attention = broken
            n += 1
    return n


def worker(backend: str, task_path: str, result_path: str) -> int:
    """Runs inside a fresh subprocess: one LLM with ``backend``."""
    with open(task_path) as f:
        task = json.load(f)
    if task.get("fault"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        inject_fault()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    extra = {}
    if backend == "ION" and task.get("ion_cudagraph_mode"):
        # e.g. FULL: mixed prefill/decode batches replay full CUDA graphs of the ION launch
        extra["compilation_config"] = {"cudagraph_mode": task["ion_cudagraph_mode"]}
    if task.get("spec_tokens"):
        # every backend drafts with the same n-gram proposer: decode rows of 1 + k tokens
        extra["speculative_config"] = {"method": "ngram",
                                       "num_speculative_tokens": task["spec_tokens"],
                                       "prompt_lookup_min": 2, "prompt_lookup_max": 4}
        extra["disable_log_stats"] = False  # the spec-decode counters
    llm = LLM(model=task["model"], attention_backend=backend, dtype="bfloat16",
              enforce_eager=task["enforce_eager"], **extra,
              gpu_memory_utilization=task["gpu_memory_utilization"],
              max_model_len=task["max_model_len"], enable_prefix_caching=True,
              max_num_batched_tokens=task["max_num_batched_tokens"],
              max_num_seqs=task["max_num_seqs"], seed=0)
    t_init = time.time() - t0
    prompts = task["prompts"]
    k = task["topk"]

    def generate(items):
        sp = SamplingParams(temperature=0.0, max_tokens=task["gen_tokens"], ignore_eos=True,
                            logprobs=k, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p["ids"]) for p in items], sp,
                            use_tqdm=False)
        res = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [_lp_value(step[t]) for step, t in zip(c.logprobs, ids)]
            res.append({"ids": ids, "logprobs": lps})
        return res

    result = {"backend": backend, "init_s": t_init,
              "fault": FAULT_VALUE if task.get("fault") else None}
    t1 = time.time()
    if task.get("teacher") is None:
        # reference: generate first, then teacher-force prompt + its own tokens
        gen = generate(prompts)
        teacher = [p["ids"] + g["ids"] for p, g in zip(prompts, gen)]
    else:
        teacher = task["teacher"]
        gen = None
    sp_tf = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=t) for t in teacher], sp_tf,
                        use_tqdm=False)
    result["teacher_forced"] = [extract_prompt_logprobs(t, o.prompt_logprobs)
                                for t, o in zip(teacher, outs)]
    if gen is None:
        gen = generate(prompts)  # decode steps, prefix-cache hits on the prompts
    result["generated"] = gen
    result["teacher"] = teacher
    if task.get("spec_tokens"):
        result["spec_decode"] = spec_counters(llm)
    result["run_s"] = time.time() - t1
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


# ----------------------------------------------------------------------------- metrics

def _percentile(xs: List[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def compare(ref: Dict, other: Dict, names: Optional[List[str]] = None) -> Dict:
    """Agreement of ``other`` with ``ref`` (both worker results)."""
    agree = total = 0
    dlp_agree: List[float] = []
    dlp_all: List[float] = []
    per_prompt = []
    for i, (r, o) in enumerate(zip(ref["teacher_forced"], other["teacher_forced"])):
        if len(r["top1"]) != len(o["top1"]):
            raise ValueError(f"prompt {i}: position count differs")
        a = 0
        worst = 0.0
        for t_r, t_o, l_r, l_o in zip(r["top1"], o["top1"], r["teacher_logprob"],
                                      o["teacher_logprob"]):
            d = abs(l_o - l_r)
            if not math.isfinite(d):
                d = math.inf
            dlp_all.append(d)
            if t_r == t_o:
                a += 1
                dlp_agree.append(d)
            worst = max(worst, d)
        agree += a
        total += len(r["top1"])
        per_prompt.append({"prompt": names[i] if names else i, "positions": len(r["top1"]),
                           "top1_agree": a / max(1, len(r["top1"])), "max_dlogprob": worst})
    gen_match = []
    for g_r, g_o in zip(ref.get("generated") or [], other.get("generated") or []):
        n = 0
        for x, y in zip(g_r["ids"], g_o["ids"]):
            if x != y:
                break
            n += 1
        gen_match.append(n)
    gen_tokens = sum(len(g["ids"]) for g in (ref.get("generated") or []))
    return {
        "positions": total,
        "top1_agreement": agree / max(1, total),
        "top1_disagreements": total - agree,
        "dlogprob_mean": (sum(dlp_agree) / len(dlp_agree)) if dlp_agree else 0.0,
        "dlogprob_p99": _percentile(dlp_agree, 99.0),
        "dlogprob_max": max(dlp_agree) if dlp_agree else 0.0,
        "dlogprob_all_mean": (sum(dlp_all) / len(dlp_all)) if dlp_all else 0.0,
        "dlogprob_all_max": max(dlp_all) if dlp_all else 0.0,
        "greedy_prefix_match": (sum(gen_match) / gen_tokens) if gen_tokens else None,
        "greedy_identical_prompts": sum(1 for g, n in zip(ref.get("generated") or [], gen_match)
                                        if n == len(g["ids"])),
        "per_prompt": per_prompt,
    }


def verdict(ion: Dict, triton: Dict, top1_slack: float = 0.0,
            margin: float = LOGPROB_MARGIN, spec: Optional[Dict] = None) -> Dict:
    """Apply the rule of the module docstring; returns {"verdict", "checks"}.  ``spec``
    (``--spec-ngram``: ION's spec-decode counters): ION's greedy output must also equal
    FLASH_ATTN's token for token on every prompt, with drafts verified on the way."""
    checks = {
        "top1": ion["top1_agreement"] >= triton["top1_agreement"] - top1_slack,
        "dlogprob_p99": ion["dlogprob_p99"] <= margin * triton["dlogprob_p99"],
        "dlogprob_max": ion["dlogprob_max"] <= margin * triton["dlogprob_max"],
    }
    if spec is not None:
        checks["greedy_identical"] = ion["greedy_prefix_match"] == 1.0
        checks["drafts_verified"] = spec.get("vllm:spec_decode_num_draft_tokens", 0) > 0
    return {"verdict": "PASS" if all(checks.values()) else "FAIL", "checks": checks}


def render_markdown(summary: Dict) -> str:
    lines = [f"# E2E agreement vs {REFERENCE} ({summary['date']})", "",
             f"Model: `{summary['model']}`; prompts: {summary['num_prompts']} "
             f"(teacher-forced positions: {summary['positions']}); "
             f"enforce_eager={summary['enforce_eager']}; fault={summary['fault'] or 'none'}"
             + (f"; n-gram speculation of {summary['spec_ngram']} tokens, ION's counters "
                f"{summary['spec_decode'].get('ION')}" if summary.get("spec_ngram") else ""),
             "", "| backend | top-1 agree | disagreements | mean |Δlp| | p99 |Δlp| | max |Δlp| "
             "| greedy prefix match |", "|---|---|---|---|---|---|---|"]
    for b, s in summary["vs_reference"].items():
        gm = s["greedy_prefix_match"]
        lines.append(f"| {b} | {100 * s['top1_agreement']:.3f}% | {s['top1_disagreements']} | "
                     f"{s['dlogprob_mean']:.2e} | {s['dlogprob_p99']:.2e} | "
                     f"{s['dlogprob_max']:.2e} | {'-' if gm is None else f'{100 * gm:.1f}%'} |")
    v = summary.get("verdict")
    if v:
        lines += ["", f"**Verdict: {v['verdict']}** (checks: "
                  + ", ".join(f"{k}={'ok' if ok else 'FAIL'}" for k, ok in v["checks"].items())
                  + f"; rule: ION top-1 >= TRITON top-1 - {summary['top1_slack']}, "
                  f"ION p99/max |Δlp| <= {LOGPROB_MARGIN} x TRITON's)"]
    return "\n".join(lines) + "\n"


def print_table(summary: Dict) -> None:
    print(f"{'backend':<14}{'top1':>10}{'disagree':>10}{'mean|dlp|':>12}{'p99|dlp|':>12}"
          f"{'max|dlp|':>12}")
    for b, s in summary["vs_reference"].items():
        print(f"{b:<14}{100 * s['top1_agreement']:>9.3f}%{s['top1_disagreements']:>10}"
              f"{s['dlogprob_mean']:>12.2e}{s['dlogprob_p99']:>12.2e}{s['dlogprob_max']:>12.2e}")
    v = summary.get("verdict")
    if v:
        extra = " (fault injected: FAIL expected)" if summary["fault"] else ""
        print(f"verdict: {v['verdict']}{extra} {v['checks']}")


# ----------------------------------------------------------------------------- driver

def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Teacher-forced agreement of ION vs FLASH_ATTN vs TRITON_ATTN in vLLM "
                    "(see the module docstring for the verdict rule).")
    ap.add_argument("--model", default=None,
                    help="model dir (default: build bench/models/tiny-qwen2 with "
                         "scripts/make_tiny_model.py if missing)")
    ap.add_argument("--out", default=None,
                    help="output dir (default bench/results/e2e-agreement-<date>)")
    ap.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                    help=f"comma list; must contain {REFERENCE}, TRITON_ATTN and ION")
    ap.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    ap.add_argument("--ion-cudagraph-mode", default=None,
                    choices=["FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "NONE"],
                    help="vLLM cudagraph_mode for the ION run only (default: vLLM's default); "
                         "FULL checks capture/replay of mixed batches")
    ap.add_argument("--break", dest="break_", action="store_true",
                    help="run ION with a wrong KV page in every attention launch (must "
                         "report FAIL)")
    ap.add_argument("--spec-ngram", type=int, default=0, metavar="K",
                    help="every backend speculates K tokens with vLLM's n-gram proposer, on "
                         "prompts that repeat a segment; PASS then also needs ION's greedy "
                         "output equal to FLASH_ATTN's on every prompt")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="use only the first N prompts (shortest first; a quick smoke run)")
    ap.add_argument("--topk", type=int, default=5, help="prompt_logprobs / logprobs k")
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--top1-slack", type=float, default=0.0,
                    help="absolute slack on the top-1 rule (default 0)")
    ap.add_argument("--worker-timeout", type=int, default=1800)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--task", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def ensure_model(path: Optional[str]) -> str:
    if path:
        return os.path.abspath(path)
    path = os.path.join(ROOT, "bench", "models", "tiny-qwen2")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_model.py"),
                        path], check=True)
    return path


def run_worker(backend: str, task: Dict, out_dir: str, fault: bool, timeout: int) -> Dict:
    tag = backend + ("-fault" if fault else "")
    task_path = os.path.join(out_dir, f"task-{tag}.json")
    result_path = os.path.join(out_dir, f"result-{tag}.json")
    with open(task_path, "w") as f:
        json.dump(dict(task, fault=fault), f)
    env = dict(os.environ)
    log_path = os.path.join(out_dir, f"log-{tag}.txt")
    t0 = time.time()
    with open(log_path, "w") as log:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", backend,
                            "--task", task_path, "--result", result_path],
                           stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                           cwd=ROOT)
    if p.returncode != 0 or not os.path.exists(result_path):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{backend} worker failed (rc {p.returncode}); log {log_path}:\n{tail}")
    with open(result_path) as f:
        res = json.load(f)
    res["wall_s"] = time.time() - t0
    print(f"  {tag}: init {res['init_s']:.0f}s, run {res['run_s']:.0f}s", flush=True)
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args.task, args.result)
    backends = [b.strip().upper() for b in args.backends.split(",") if b.strip()]
    for need in (REFERENCE, "TRITON_ATTN", "ION"):
        if need not in backends:
            print(f"--backends must include {need}", file=sys.stderr)
            return 2
    backends = [REFERENCE] + [b for b in backends if b != REFERENCE]
    date = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = args.out or os.path.join(ROOT, "bench", "results", f"e2e-agreement-{date}")
    os.makedirs(out_dir, exist_ok=True)
    model = ensure_model(args.model)
    if args.spec_ngram < 0:
        print("--spec-ngram must be >= 0", file=sys.stderr)
        return 2
    prompts = (spec_prompts(args.seed) if args.spec_ngram
               else build_prompts(args.seed))[:args.num_prompts]
    task = {"model": model, "prompts": prompts, "topk": args.topk,
            "gen_tokens": args.gen_tokens, "enforce_eager": args.enforce_eager,
            "ion_cudagraph_mode": args.ion_cudagraph_mode,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs, "teacher": None,
            "spec_tokens": args.spec_ngram}
    results = {}
    try:
        print(f"running {REFERENCE} (reference, generates the teacher tokens)", flush=True)
        results[REFERENCE] = run_worker(REFERENCE, task, out_dir, False, args.worker_timeout)
        task["teacher"] = results[REFERENCE]["teacher"]
        for b in backends[1:]:
            fault = args.break_ and b == "ION"
            print(f"running {b}{' with the fault ' + FAULT_VALUE if fault else ''}",
                  flush=True)
            results[b] = run_worker(b, task, out_dir, fault, args.worker_timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 2
    names = [p["name"] for p in prompts]
    vs_ref = {b: compare(results[REFERENCE], results[b], names) for b in backends[1:]}
    summary = {
        "date": date, "model": model, "num_prompts": len(prompts),
        "prompt_lengths": [len(p["ids"]) for p in prompts],
        "positions": vs_ref["ION"]["positions"], "enforce_eager": args.enforce_eager,
        "ion_cudagraph_mode": args.ion_cudagraph_mode,
        "fault": FAULT_VALUE if args.break_ else None, "top1_slack": args.top1_slack,
        "settings": {k: task[k] for k in ("topk", "gen_tokens", "max_model_len",
                                          "max_num_batched_tokens", "max_num_seqs",
                                          "gpu_memory_utilization")},
        "timing_s": {b: {"init": r["init_s"], "run": r["run_s"], "wall": r["wall_s"]}
                     for b, r in results.items()},
        "vs_reference": vs_ref,
        "spec_ngram": args.spec_ngram,
        "spec_decode": {b: r.get("spec_decode") for b, r in results.items()},
    }
    summary["verdict"] = verdict(vs_ref["ION"], vs_ref["TRITON_ATTN"], args.top1_slack,
                                 spec=(results["ION"].get("spec_decode") or {})
                                 if args.spec_ngram else None)
    with open(os.path.join(out_dir, "agreement.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(out_dir, "agreement.md"), "w") as f:
        f.write(render_markdown(summary))
    print_table(summary)
    print(f"results: {out_dir}")
    return 0 if summary["verdict"]["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
