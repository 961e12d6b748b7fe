#!/usr/bin/env python
"""GPU check: with a tiny HBM KV pool (forcing preemptions) and shared prefixes,
greedy outputs with the Ion KV tier must be token-identical to a run without
offloading; the run must really preempt and really restore blocks from host.

    python scripts/kv_tier_preempt_check.py /path/to/tiny-model \
        [--attention-backend ION] [--kv-cache-memory-bytes 8388608] [--host-gib 1]

Each configuration runs in its own process (GPU memory is fully released).
Both run with VLLM_BATCH_INVARIANT=1 (ION then plans without split-KV and vLLM
makes its GEMMs batch-invariant), so a token's logits do not depend on which
requests share its batch.  Without it, the two runs schedule differently
(restores vs recompute, different preemptions), bf16 rounding differs, and
greedy decoding with random weights diverges by itself: a token mismatch would
not tell a corrupted block from a changed batch.  ``--control always`` adds a second
no-offload run with half the concurrency: it must match too, which shows the
comparison is batch-free (it runs by default only after a mismatch).

``--verify`` (Ion tier only) runs the tier child with the tier's ``verify`` key: the
worker fingerprints every stored block from its GPU source and every restored
block in its GPU destination, and counts restored blocks checked
(``verified_blocks``) and those that differ (``verify_mismatch_blocks``),
exported as ``vllm:ion_kv_tier_verified_blocks`` /
``vllm:ion_kv_tier_verify_mismatch_blocks``.  The report also gives, for the tier
run and for the control run, the index of the first differing output token of
every mismatching request (``tier_first_diff_token``,
``control_first_diff_token``: request index -> token index), to tell a
divergence that starts right after a restore from a late near-tie flip.

Verdicts: ``pass`` = strict token identity (plus: preempted, restored, control
clean when it ran); ``blocks_pass`` = verified_blocks > 0 and
verify_mismatch_blocks == 0.  Exit code 0 iff ``pass``; with ``--verify``, iff
``blocks_pass`` and (``pass``, or the run preempted and the control run ALSO
mismatched).
Reasoning: when a no-offload run at another concurrency already diverges from
the reference, token identity cannot separate a corrupted restore from vLLM's
own batch-dependent numerics (greedy near-ties of a random-weight model), so the
direct evidence is byte identity of every restored block.  When the control
matches but the tier run does not, the token comparison is meaningful and the
run fails even if every block verified (the fault is then elsewhere, e.g. in
which blocks are restored or when).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile


def child(cfg: dict) -> dict:
    from vllm import LLM, SamplingParams

    from vllm.inputs import TokensPrompt

    from ion_vllm.bench.offload_configs import prometheus_sums

    kw = dict(model=cfg["model"], seed=0, enforce_eager=cfg["enforce_eager"],
              skip_tokenizer_init=True,
              kv_cache_memory_bytes=cfg["kv_bytes"], block_size=cfg["block_size"],
              max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"],
              disable_log_stats=False, enable_prefix_caching=True)
    if cfg["backend"]:
        kw["attention_backend"] = cfg["backend"]
    if cfg.get("dtype", "auto") != "auto":
        kw["dtype"] = cfg["dtype"]
    if cfg.get("gpu_memory_utilization"):
        kw["gpu_memory_utilization"] = cfg["gpu_memory_utilization"]
    if cfg["offload"]:
        kw["kv_transfer_config"] = offload_config(cfg)
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
    outs: list[list[int]] = []
    for wave in range(cfg["waves"]):  # later waves reuse prefixes of earlier ones
        res = llm.generate(prompts, sp, use_tqdm=False)
        outs += [list(o.outputs[0].token_ids) for o in res]
    return {"outputs": outs, "metrics": prometheus_sums()}


def offload_config(cfg: dict) -> dict:
    """--kv-transfer-config of the run with offloading: the Ion tier (with block
    verification when ``verify``), or (``spec: native``) vLLM's own CPUOffloadingSpec with
    decode blocks stored too, for comparison."""
    from ion_vllm.bench.offload_configs import offload_transfer_config

    host = int(cfg["host_gib"] * (1 << 30))
    if cfg.get("spec", "ion") == "native":
        return offload_transfer_config("native", host)
    from ion_vllm.kv_tier import register_kv_tier

    register_kv_tier()
    extra = {"verify": True} if cfg.get("verify") else {}
    return offload_transfer_config("ion", host, ring_mib=cfg["ring_mib"], **extra)


def make_prompts(n: int, vocab: int, prefix_len: int, suffix_len: int, n_prefixes: int,
                 seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, vocab) for _ in range(prefix_len)] for _ in range(n_prefixes)]
    return [prefixes[i % n_prefixes] + [rng.randrange(10, vocab) for _ in range(suffix_len)]
            for i in range(n)]


M_VERIFIED = "vllm:ion_kv_tier_verified_blocks"
M_VERIFY_MISMATCH = "vllm:ion_kv_tier_verify_mismatch_blocks"


#: float32 runs: no TF32 anywhere (cuBLAS / cuDNN, torch matmuls, and Triton's tl.dot,
#: whose fp32 default is TF32).  TF32 rounds inputs to 10 mantissa bits, so two batch
#: compositions whose sums differ in the last fp32 bit can round differently, and greedy
#: near-ties flip again.
#: The first fp32 run (with TF32) left 1 tier and 2 control mismatches of 96.
FP32_STRICT_ENV = {"NVIDIA_TF32_OVERRIDE": "0", "TRITON_F32_DEFAULT": "ieee",
                   "VLLM_FLOAT32_MATMUL_PRECISION": "highest"}


def child_env(cfg: dict) -> dict:
    env = dict(os.environ)
    if cfg.get("dtype") in ("float32", "float"):
        env.update(FP32_STRICT_ENV)
    if cfg.get("batch_invariant", True):
        env["VLLM_BATCH_INVARIANT"] = "1"
    return env


def run_child(cfg: dict) -> dict:
    return run_children([cfg])[0]


def run_children(cfgs: list[dict]) -> list[dict]:
    """Run each config in its own process, all at once (each told to plan for 1/n of the
    GPU memory when there are several); return their results in order.  Correctness
    runs: nothing here is timed, so they may share the GPU."""
    from start_gate import engine_env, gpu_memory_fraction

    frac = gpu_memory_fraction(len(cfgs)) if len(cfgs) > 1 else None
    with tempfile.TemporaryDirectory() as d:
        procs, outs = [], []
        for k, cfg in enumerate(cfgs):
            if frac is not None:
                cfg = {**cfg, "gpu_memory_utilization": frac}
            cpath, opath = os.path.join(d, f"cfg{k}.json"), os.path.join(d, f"out{k}.json")
            with open(cpath, "w") as f:
                json.dump(cfg, f)
            env = child_env(cfg)
            if frac is not None:  # concurrent engines: separate compile caches
                env = engine_env(d, str(k), env)
            procs.append(subprocess.Popen([sys.executable, __file__, "--child", cpath, opath],
                                          env=env))
            outs.append(opath)
        rcs = [p.wait() for p in procs]
        if any(rcs):
            raise subprocess.CalledProcessError(max(rcs, key=abs), "child",
                                                output=f"exit codes {rcs}")
        res = []
        for opath in outs:
            with open(opath) as f:
                res.append(json.load(f))
        return res


def first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length when one output is
    a prefix of the other); None when identical."""
    if a == b:
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def first_diffs(ref: list[list[int]], other: list[list[int]]) -> dict[int, int]:
    """Request index -> first differing token index, for the requests that differ."""
    out = {}
    for i, (a, b) in enumerate(zip(ref, other)):
        t = first_diff(a, b)
        if t is not None:
            out[i] = t
    if len(ref) != len(other):
        raise ValueError(f"{len(ref)} reference outputs vs {len(other)}")
    return out


def evaluate(ref_outputs: list[list[int]], ion_outputs: list[list[int]], ion_metrics: dict,
             ctl_outputs: list[list[int]] | None, verify: bool) -> tuple[dict, list[str], int]:
    """Verdicts of one check.  Returns (report fields, messages, exit code)."""
    diffs = first_diffs(ref_outputs, ion_outputs)
    ctl_diffs = first_diffs(ref_outputs, ctl_outputs) if ctl_outputs is not None else None
    m = ion_metrics
    preempt = m.get("vllm:num_preemptions", m.get("vllm:num_preemptions_total", 0.0))
    loaded = m.get("vllm:kv_offload_load_bytes", 0.0)
    verified = m.get(M_VERIFIED, 0.0)
    vmism = m.get(M_VERIFY_MISMATCH, 0.0)
    msgs: list[str] = []
    ok = True
    if diffs:
        i = min(diffs)
        a, b = ref_outputs[i], ion_outputs[i]
        t = diffs[i]
        msgs.append(f"FAIL: {len(diffs)} requests differ; first #{i} from token {t}:\n"
                    f" ref {a[t:t + 16]}\n ion {b[t:t + 16]}")
        ok = False
    if not preempt:
        msgs.append("FAIL: no preemption happened; lower --kv-cache-memory-bytes")
        ok = False
    if not loaded:
        msgs.append("FAIL: nothing was restored from the host tier")
        ok = False
    if ctl_diffs:
        msgs.append(f"CONTROL FAIL: {len(ctl_diffs)} requests differ between two no-offload "
                    "runs at different concurrency: the comparison is not batch-invariant")
        ok = False
    blocks_pass = bool(verify and verified > 0 and vmism == 0)
    if verify:
        msgs.append(f"BLOCKS {'PASS' if blocks_pass else 'FAIL'}: {int(verified)} restored "
                    f"blocks verified byte-identical to the stored ones, {int(vmism)} mismatched")
    if verify:  # a detected corrupted restore (or no verified block) fails the run
        code = 0 if blocks_pass and (ok or (preempt and bool(ctl_diffs))) else 1
    else:
        code = 0 if ok else 1
    msgs.append(f"TOKENS {'PASS' if ok else 'FAIL'}; exit {code}"
                + (" (token comparison defeated by the control; blocks verified)"
                   if code == 0 and not ok else ""))
    report = {
        "mismatched_requests": sorted(diffs),
        "tier_first_diff_token": {str(i): t for i, t in sorted(diffs.items())},
        "control_mismatched_requests": sorted(ctl_diffs) if ctl_diffs is not None else None,
        "control_first_diff_token": ({str(i): t for i, t in sorted(ctl_diffs.items())}
                                     if ctl_diffs is not None else None),
        "preemptions_ion": preempt, "host_loaded_bytes": loaded,
        "verify": verify,
        "verified_blocks": verified if verify else None,
        "verify_mismatch_blocks": vmism if verify else None,
        "pass": ok, "blocks_pass": blocks_pass if verify else None, "exit_code": code,
    }
    return report, msgs, code


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        with open(sys.argv[2]) as f:
            cfg = json.load(f)
        with open(sys.argv[3], "w") as f:
            json.dump(child(cfg), f)
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--attention-backend", default="ION")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                    help="HBM KV pool; default: ~1/4 of what the workload needs")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--n-prefixes", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--host-gib", type=float, default=1.0)
    ap.add_argument("--ring-mib", type=float, default=16)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-batch-invariant", action="store_true",
                    help="run without VLLM_BATCH_INVARIANT (outputs may then diverge by rounding)")
    ap.add_argument("--control", choices=("auto", "always", "never"), default="auto",
                    help="a second no-offload run at half concurrency, which must match the "
                         "reference (shows the comparison is batch-free); auto = only when "
                         "the tier run mismatches, to tell corruption from batch variance")
    ap.add_argument("--spec", choices=("ion", "native"), default="ion",
                    help="offloading under test: the Ion tier (default) or vLLM's native "
                         "CPUOffloadingSpec (same host size, decode blocks stored too)")
    ap.add_argument("--verify", action="store_true",
                    help="Ion tier: fingerprint every stored/restored KV block on the GPU "
                         "(the tier's verify key) and report byte-level restore verdicts")
    ap.add_argument("--dtype", default="auto",
                    help="model dtype (vLLM's --dtype).  float32 (with a backend that takes "
                         "it, e.g. TRITON_ATTN, and --no-batch-invariant) makes rounding noise "
                         "~2^16 times smaller than bf16, so greedy near-ties stop flipping and "
                         "a token comparison can tell a corrupt restore from batch variance")
    ap.add_argument("--parallel", action="store_true",
                    help="run the reference, tier and control (implies --control always) "
                         "processes at the same time: a correctness check, nothing is timed")
    ap.add_argument("--out", help="write the report as JSON here")
    args = ap.parse_args()
    if args.verify and args.spec != "ion":
        ap.error("--verify needs --spec ion")

    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(args.model)
    vocab = hf.vocab_size
    n_kv = getattr(hf, "num_key_value_heads", hf.num_attention_heads)
    head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    elem = 4 if args.dtype in ("float32", "float") else 2
    per_token = 2 * hf.num_hidden_layers * n_kv * head * elem
    seq = args.prefix_len + args.suffix_len + args.max_tokens
    need = per_token * seq * args.num_requests
    kv_bytes = args.kv_cache_memory_bytes or max(need // 4, per_token * seq * 2)
    base = dict(model=args.model, backend=args.attention_backend, kv_bytes=kv_bytes,
                block_size=args.block_size, max_model_len=seq + args.block_size,
                max_num_seqs=args.num_requests, max_tokens=args.max_tokens,
                waves=args.waves, host_gib=args.host_gib, ring_mib=args.ring_mib,
                enforce_eager=args.enforce_eager, batch_invariant=not args.no_batch_invariant,
                spec=args.spec, dtype=args.dtype,
                prompts=make_prompts(args.num_requests, vocab, args.prefix_len,
                                     args.suffix_len, args.n_prefixes))
    print(f"KV pool {kv_bytes/2**20:.1f} MiB for a workload needing {need/2**20:.1f} MiB")
    ref_cfg = {**base, "offload": False}
    ion_cfg = {**base, "offload": True, "verify": args.verify}
    ctl_cfg = {**base, "offload": False, "max_num_seqs": max(1, args.num_requests // 2)}
    if args.parallel:
        ref, ion, ctl = run_children([ref_cfg, ion_cfg, ctl_cfg])
    else:
        ref = run_child(ref_cfg)
        ion = run_child(ion_cfg)
        tier_differs = any(a != b for a, b in zip(ref["outputs"], ion["outputs"]))
        ctl = None
        if args.control == "always" or (args.control == "auto" and tier_differs):
            ctl = run_child(ctl_cfg)
    m = ion["metrics"]
    verdict, msgs, code = evaluate(ref["outputs"], ion["outputs"], m,
                                   ctl["outputs"] if ctl else None, args.verify)
    report = {
        "kv_pool_bytes": kv_bytes, "requests": len(ref["outputs"]),
        "batch_invariant": not args.no_batch_invariant, "spec": args.spec,
        "dtype": args.dtype, "attention_backend": args.attention_backend,
        "generated_tokens": sum(len(o) for o in ref["outputs"]),
        "preemptions_ref": ref["metrics"].get("vllm:num_preemptions", None),
        "external_prefix_hit_tokens": m.get("vllm:external_prefix_cache_hits", 0.0),
        **verdict,
        "ion_tier_metrics": {k: v for k, v in m.items() if "ion_kv_tier" in k or "kv_offload" in k},
    }
    print(json.dumps(report, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    for line in msgs:
        print(line)
    print("PASS" if code == 0 else "FAIL")
    return code


if __name__ == "__main__":
    sys.exit(main())
