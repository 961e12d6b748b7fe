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
Exit code 0 = pass.
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

    from ion_vllm.kv_tier.stats import prometheus_sums
    from vllm.inputs import TokensPrompt

    kw = dict(model=cfg["model"], seed=0, enforce_eager=cfg["enforce_eager"],
              skip_tokenizer_init=True,
              kv_cache_memory_bytes=cfg["kv_bytes"], block_size=cfg["block_size"],
              max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"],
              disable_log_stats=False, enable_prefix_caching=True)
    if cfg["backend"]:
        kw["attention_backend"] = cfg["backend"]
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
    """--kv-transfer-config of the run with offloading: the Ion tier, or (``spec:
    native``) vLLM's own CPUOffloadingSpec with decode blocks stored too, for comparison."""
    host = int(cfg["host_gib"] * (1 << 30))
    if cfg.get("spec", "ion") == "native":
        extra = {"cpu_bytes_to_use": host, "offload_prompt_only": False}
    else:
        from ion_vllm.kv_tier import register_kv_tier

        register_kv_tier()
        extra = {"spec_name": "IonKVTierSpec", "spec_module_path": "ion_vllm.kv_tier.spec",
                 "cpu_bytes_to_use": host, "ring_mib": cfg["ring_mib"]}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def make_prompts(n: int, vocab: int, prefix_len: int, suffix_len: int, n_prefixes: int,
                 seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, vocab) for _ in range(prefix_len)] for _ in range(n_prefixes)]
    return [prefixes[i % n_prefixes] + [rng.randrange(10, vocab) for _ in range(suffix_len)]
            for i in range(n)]


def run_child(cfg: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cpath, opath = os.path.join(d, "cfg.json"), os.path.join(d, "out.json")
        with open(cpath, "w") as f:
            json.dump(cfg, f)
        env = dict(os.environ)
        if cfg.get("batch_invariant", True):
            env["VLLM_BATCH_INVARIANT"] = "1"
        subprocess.run([sys.executable, __file__, "--child", cpath, opath], check=True, env=env)
        with open(opath) as f:
            return json.load(f)


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
    ap.add_argument("--out", help="write the report as JSON here")
    args = ap.parse_args()

    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(args.model)
    vocab = hf.vocab_size
    n_kv = getattr(hf, "num_key_value_heads", hf.num_attention_heads)
    head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    per_token = 2 * hf.num_hidden_layers * n_kv * head * 2  # bf16
    seq = args.prefix_len + args.suffix_len + args.max_tokens
    need = per_token * seq * args.num_requests
    kv_bytes = args.kv_cache_memory_bytes or max(need // 4, per_token * seq * 2)
    base = dict(model=args.model, backend=args.attention_backend, kv_bytes=kv_bytes,
                block_size=args.block_size, max_model_len=seq + args.block_size,
                max_num_seqs=args.num_requests, max_tokens=args.max_tokens,
                waves=args.waves, host_gib=args.host_gib, ring_mib=args.ring_mib,
                enforce_eager=args.enforce_eager, batch_invariant=not args.no_batch_invariant,
                spec=args.spec,
                prompts=make_prompts(args.num_requests, vocab, args.prefix_len,
                                     args.suffix_len, args.n_prefixes))
    print(f"KV pool {kv_bytes/2**20:.1f} MiB for a workload needing {need/2**20:.1f} MiB")
    ref = run_child({**base, "offload": False})
    ion = run_child({**base, "offload": True})
    mism = [i for i, (a, b) in enumerate(zip(ref["outputs"], ion["outputs"])) if a != b]
    ctl_mism = None
    if args.control == "always" or (args.control == "auto" and mism):
        ctl = run_child({**base, "offload": False,
                         "max_num_seqs": max(1, args.num_requests // 2)})
        ctl_mism = [i for i, (a, b) in enumerate(zip(ref["outputs"], ctl["outputs"]))
                    if a != b]
    m = ion["metrics"]
    preempt = m.get("vllm:num_preemptions", m.get("vllm:num_preemptions_total", 0.0))
    loaded = m.get("vllm:kv_offload_load_bytes", 0.0)
    ext_hits = m.get("vllm:external_prefix_cache_hits", 0.0)
    report = {
        "kv_pool_bytes": kv_bytes, "requests": len(ref["outputs"]),
        "batch_invariant": not args.no_batch_invariant, "spec": args.spec,
        "generated_tokens": sum(len(o) for o in ref["outputs"]),
        "mismatched_requests": mism, "control_mismatched_requests": ctl_mism,
        "preemptions_ion": preempt,
        "preemptions_ref": ref["metrics"].get("vllm:num_preemptions", None),
        "host_loaded_bytes": loaded, "external_prefix_hit_tokens": ext_hits,
        "ion_tier_metrics": {k: v for k, v in m.items() if "ion_kv_tier" in k or "kv_offload" in k},
    }
    ok = True
    if mism:
        i = mism[0]
        a, b = ref["outputs"][i], ion["outputs"][i]
        t = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"FAIL: {len(mism)} requests differ; first #{i} from token {t}:\n"
              f" ref {a[t:t + 16]}\n ion {b[t:t + 16]}")
        ok = False
    if not preempt:
        print("FAIL: no preemption happened; lower --kv-cache-memory-bytes")
        ok = False
    if not loaded:
        print("FAIL: nothing was restored from the host tier")
        ok = False
    if ctl_mism:
        print(f"CONTROL FAIL: {len(ctl_mism)} requests differ between two no-offload runs "
              "at different concurrency: the comparison is not batch-invariant")
        ok = False
    report["pass"] = ok
    print(json.dumps(report, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
