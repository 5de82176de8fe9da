#!/usr/bin/env bash
# One device call (~2-3 min): Nsight Compute on the decode step's 4-bit kernels (bench/gemv_ncu.py: the one-token
# GEMV, planar input, 8x16 w4 prefetching tile, and nf4_mm at 8 rows, on each Llama-2-7B linear): where their time
# goes (stall reasons, issue slots, DRAM throughput, occupancy). Needs a Firecracker machine (ncu reads counters
# there, not on gVisor: the device docs' KINDS.md). Run from the repo root with .whl carried; output under $OUT.
# NCU_ARGS passes arguments to bench.gemv_ncu, NCU_KERNELS the kernel regex, NCU_NAME the files' name: nf4_frag at 8 and
# 32 rows is NCU_ARGS="--frag-rows 8,32" NCU_KERNELS=_nf4_frag_kernel NCU_NAME=frag-ncu (SKIP 16, COUNT 8). The warps'
# stall reasons per issued instruction come with every run (smsp__average_warps_issue_stalled_*).
set -uo pipefail
source bench/h200_env.sh || exit 1
# nf4_mm may launch twice a call (split-K and its reduction): skip by kernel count of two warm rounds, whatever it is
timeout -s INT -k 15 "${NCU_S:-240}" ncu --clock-control none --target-processes all \
  -k regex:"${NCU_KERNELS:-_nf4_(gemv|mm)_kernel}" --launch-skip "${SKIP:-16}" --launch-count "${COUNT:-8}" \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
  --csv --page details python3 -m bench.gemv_ncu ${NCU_ARGS:-} > "$OUT/${NCU_NAME:-gemv-ncu}.csv" \
  2> "$OUT/${NCU_NAME:-gemv-ncu}.err"
echo "ncu rc=$?"; tail -3 "$OUT/${NCU_NAME:-gemv-ncu}.err"; wc -l "$OUT/${NCU_NAME:-gemv-ncu}.csv"
python3 - "$OUT/${NCU_NAME:-gemv-ncu}.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
if head is None:
    print("no ncu table"); sys.exit()
cols = rows[head]
want = ("Duration", "DRAM Throughput", "Memory Throughput", "Achieved Occupancy", "Registers Per Thread",
        "Issue Slots Busy", "No Eligible", "Warp Cycles Per Issued Instruction", "Stall Long Scoreboard",
        "Grid Size", "Block Size", "Eligible Warps Per Scheduler", "Active Warps Per Scheduler")
for r in rows[head + 1:]:
    d = dict(zip(cols, r))
    name = d.get("Metric Name", "")
    stalled = "issue_stalled" in name
    if stalled:
        try:
            if float(d.get("Metric Value", "0").replace(",", "")) < 0.2:
                continue
        except ValueError:
            pass
    if stalled or any(w in name for w in want):
        print(d.get("ID"), d.get("Kernel Name", "")[:20], name, d.get("Metric Unit"), d.get("Metric Value"))
PY
