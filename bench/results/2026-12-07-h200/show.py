"""Print the verdicts of one run.sh archive (any stage's OUT/<stage>.tgz), compactly:
step exit codes, pytest summaries, sweep verdicts, kernel-bench medians (with the error
against the reference on fp8-cache cases), the soak's checks, the sanitizer's error
summaries, agreement verdicts and e2e throughput ratios.  Usage: python3 show.py OUT/X.tgz"""

import gzip
import json
import re
import sys
import tarfile


def text(tar, member):
    data = tar.extractfile(member).read()
    if member.name.endswith(".gz"):
        data = gzip.decompress(data)
    return data.decode(errors="replace")


def main(path):
    with tarfile.open(path) as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        for name, m in sorted(members.items()):
            base = name.rsplit("/", 1)[-1]
            if base == "steps.txt":
                for line in text(tar, m).splitlines():
                    if "rc=" in line or "skipped" in line or "cut to" in line:
                        print(line[:120])
            elif re.match(r"(kval-tests-\d+|san-.*)\.log$", base):
                tail = [x for x in text(tar, m).splitlines()
                        if re.search(r"passed|failed|error|seed:", x)]
                print(base, "|", " | ".join(x[9:120] for x in tail[-3:]))
            elif base == "summary.json" and "sweep" in name:
                s = json.loads(text(tar, m))
                print(name.split("/")[-2], s["verdict"], s["passed"], "/", s["cases"],
                      "seed", s.get("seed"), "failed", s["failed_indices"][:8])
            elif base == "summary.json" and "soak" in name:
                s = json.loads(text(tar, m))
                print("soak passed", s.get("passed"), s.get("checks"), s.get("host_rss"),
                      s.get("gpu_memory"), "errors", s.get("server_error_lines"), s.get("error"))
                for n, p in s.get("phases", {}).items():
                    d = p["metrics_delta"]
                    print(f"  {n}: {p['requests']} req, {p['completed']} done, "
                          f"{p['disconnected']} hung up, {p['failed']} failed, {p['seconds']} s, "
                          f"preempt {d.get('vllm:num_preemptions_total')}, loaded "
                          f"{d.get('vllm:ion_kv_tier_loaded_blocks_total')}")
            elif base.endswith(".log") and base.split("-")[0] in ("memcheck", "racecheck",
                                                                  "synccheck"):
                t = text(tar, m)
                summ = re.findall(r"(?:ERROR SUMMARY|RACECHECK SUMMARY)[^\n]*", t)
                print(base, len(t.splitlines()), "lines", summ[-3:])
            elif base in ("kbench.log", "kbench.log.gz"):
                cases = {}
                for line in text(tar, m).splitlines():
                    f = line.split()
                    if len(f) > 5 and f[1] == "[kernel]" and f[5] == "us":
                        err = re.search(r"rel_err=(\S+)", line)
                        fp8 = f[2].endswith("-fp8") and err
                        cases.setdefault(f[2], []).append(
                            f"{f[3]}={f[4]}" + (f"({err.group(1)})" if fp8 else ""))
                    elif "[kernel]" in line and ("error" in line or "wrong" in line):
                        print("  " + line[9:160])
                for case, times in cases.items():
                    print(f"  {case}: {' '.join(times)}")
            elif base == "agreement.json":
                s = json.loads(text(tar, m))
                print(name.split("/")[-2], s["verdict"]["verdict"], s["verdict"]["checks"])
                for b, v in s["vs_reference"].items():
                    print(f"  {b}: top1 {v['top1_agreement']:.4f} max|dlp| "
                          f"{v['dlogprob_max']:.3g} greedy {v.get('greedy_prefix_match')}")
            elif base == "summary.json" and "/e2e/" in "/" + name:
                for r in json.loads(text(tar, m)).get("records", []):
                    ratios = {k[len("ratio_total_tok_s_vs_"):]: round(v["ratio"], 3)
                              for k, v in r.items() if k.startswith("ratio_total_tok_s_vs_")
                              and isinstance(v, dict) and "ratio" in v}
                    kv = (r.get("server") or {}).get("kv_cache_tokens")
                    tok = r.get("total_tok_s")
                    print(f"  e2e {r['case']} {r['backend']}: {r.get('status')} "
                          f"{'-' if tok is None else round(tok)} tok/s {ratios} kv {kv} "
                          f"{r.get('error', '')[:100]}")


if __name__ == "__main__":
    main(sys.argv[1])
