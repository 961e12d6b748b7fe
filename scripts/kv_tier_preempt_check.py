#!/usr/bin/env python
"""GPU check: with a tiny HBM KV pool (forcing preemptions) and shared prefixes,
greedy outputs with the Ion KV tier must be token-identical to a run without
offloading; the run must really preempt and really restore blocks from host.

    python scripts/kv_tier_preempt_check.py /path/to/tiny-model \
        [--attention-backend ION] [--kv-cache-memory-bytes 8388608] [--host-gib 1]

Each configuration runs in its own process (GPU memory is fully released).
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


def metric_sums(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        for m in llm.get_metrics():
            v = getattr(m, "value", None)
            if isinstance(v, (int, float)):
                out[m.name] = out.get(m.name, 0.0) + float(v)
    except Exception as e:  # stats disabled / API change: report, don't hide
        out["_metrics_error"] = str(e)  # type: ignore[assignment]
    return out


def child(cfg: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=cfg["model"], seed=0, enforce_eager=cfg["enforce_eager"],
              kv_cache_memory_bytes=cfg["kv_bytes"], block_size=cfg["block_size"],
              max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"],
              disable_log_stats=False, enable_prefix_caching=True)
    if cfg["backend"]:
        kw["attention_backend"] = cfg["backend"]
    if cfg["offload"]:
        from ion_vllm.kv_tier import register_kv_tier

        register_kv_tier()
        kw["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "IonKVTierSpec", "spec_module_path": "ion_vllm.kv_tier.spec",
                "cpu_bytes_to_use": int(cfg["host_gib"] * (1 << 30)),
                "ring_mib": cfg["ring_mib"]}}
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
    outs: list[list[int]] = []
    for wave in range(cfg["waves"]):  # later waves reuse prefixes of earlier ones
        res = llm.generate(prompts, sp, use_tqdm=False)
        outs += [list(o.outputs[0].token_ids) for o in res]
    return {"outputs": outs, "metrics": metric_sums(llm)}


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
        subprocess.run([sys.executable, __file__, "--child", cpath, opath], check=True)
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
                enforce_eager=args.enforce_eager,
                prompts=make_prompts(args.num_requests, vocab, args.prefix_len,
                                     args.suffix_len, args.n_prefixes))
    print(f"KV pool {kv_bytes/2**20:.1f} MiB for a workload needing {need/2**20:.1f} MiB")
    ref = run_child({**base, "offload": False})
    ion = run_child({**base, "offload": True})
    mism = [i for i, (a, b) in enumerate(zip(ref["outputs"], ion["outputs"])) if a != b]
    m = ion["metrics"]
    preempt = m.get("vllm:num_preemptions", m.get("vllm:num_preemptions_total", 0.0))
    loaded = m.get("vllm:kv_offload_load_bytes", 0.0)
    ext_hits = m.get("vllm:external_prefix_cache_hits", 0.0)
    report = {
        "kv_pool_bytes": kv_bytes, "requests": len(ref["outputs"]),
        "mismatched_requests": mism, "preemptions_ion": preempt,
        "preemptions_ref": ref["metrics"].get("vllm:num_preemptions", None),
        "host_loaded_bytes": loaded, "external_prefix_hit_tokens": ext_hits,
        "ion_tier_metrics": {k: v for k, v in m.items() if "ion_kv_tier" in k or "kv_offload" in k},
    }
    print(json.dumps(report, indent=1))
    ok = True
    if mism:
        i = mism[0]
        print(f"FAIL: {len(mism)} requests differ; first #{i}:\n ref {ref['outputs'][i][:32]}\n"
              f" ion {ion['outputs'][i][:32]}")
        ok = False
    if not preempt:
        print("FAIL: no preemption happened; lower --kv-cache-memory-bytes")
        ok = False
    if not loaded:
        print("FAIL: nothing was restored from the host tier")
        ok = False
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
