#!/usr/bin/env bash
# Nsight Compute on one kernel-suite case, one call per backend (scripts/ncu_prefill.py):
#   bash scripts/ncu_prefill.sh OUT [BACKENDS] [CASE]
# writes OUT/prefill.ncu-rep, OUT/raw.csv (every metric of every profiled kernel),
# OUT/source-<n>.csv (per-SASS-instruction counters and stall samples of kernel n) and
# OUT/summary.txt (the metrics bench/notes.md compares).  Clocks are left alone
# (--clock-control none, as the device docs ask), so durations are the run's own.
set -u
out=${1:?usage: ncu_prefill.sh OUT [BACKENDS] [CASE]}
backends=${2:-ion-auto-fused,ion-auto-fused-s2,fa3}
case_name=${3:-prefill-1x8192-h28/4-d128}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
if ! command -v ncu >/dev/null 2>&1; then
  echo "ncu_prefill: ncu not on PATH" >&2
  exit 2
fi
ncu --profile-from-start off --clock-control none --set full --import-source no \
  -f -o "$out/prefill" python3 "$here/scripts/ncu_prefill.py" --case "$case_name" \
  --backends "$backends" > "$out/ncu.log" 2>&1
rc=$?
tail -5 "$out/ncu.log"
[ -f "$out/prefill.ncu-rep" ] || { echo "ncu_prefill: no report (rc=$rc)" >&2; exit 1; }
ncu --import "$out/prefill.ncu-rep" --page raw --csv > "$out/raw.csv" 2>/dev/null
n=$(python3 - "$out/raw.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
print(max(0, len(rows) - 2))
PY
)
for ((i = 0; i < n; i++)); do
  ncu --import "$out/prefill.ncu-rep" --page source --csv --print-source sass \
    --launch-skip "$i" --launch-count 1 > "$out/source-$i.csv" 2>/dev/null || true
done
python3 - "$out/raw.csv" > "$out/summary.txt" <<'PY'
import csv, re, sys
rows = list(csv.reader(open(sys.argv[1])))
head, units, data = rows[0], rows[1], rows[2:]
want = [r"^Kernel Name$", r"^gpu__time_duration\.sum$", r"^sm__cycles_elapsed\.avg\.per_second$",
        r"pipe_tensor.*pct_of_peak_sustained_active$", r"pipe_xu.*pct_of_peak_sustained_active$",
        r"^sm__inst_executed_pipe_xu\.sum$", r"^smsp__issue_active\.avg\.pct_of_peak_sustained_active$",
        r"^sm__warps_active\.avg\.pct_of_peak_sustained_active$",
        r"^smsp__average_warp_latency_issue_stalled_.*\.ratio$",
        r"^smsp__pcsamp_warps_issue_stalled_[a-z_]+$", r"^launch__registers_per_thread$",
        r"^lts__t_sector_hit_rate\.pct$", r"^dram__throughput\.avg\.pct_of_peak_sustained_elapsed$"]
cols = [i for i, h in enumerate(head) if any(re.search(w, h) for w in want)]
for r in data:
    print("=" * 60)
    for i in cols:
        v = r[i]
        if head[i] == "Kernel Name":
            v = v[:90]
        try:
            if float(v.replace(",", "")) == 0 and "stalled" in head[i]:
                continue
        except ValueError:
            pass
        print(f"{head[i]:<70} {v} {units[i]}")
PY
head -c 6000 "$out/summary.txt"
