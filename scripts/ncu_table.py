"""Chosen metrics of every kernel in an Nsight Compute report, one line a launch: ``ncu --import REP --page raw --csv``
on stdin, metric-name regexes as arguments (default: duration, registers, occupancy, issue activity, the tensor pipe,
L1 / DRAM throughput and every warp stall reason above 1 %).

Usage: ncu --import rep.ncu-rep --page raw --csv | python3 scripts/ncu_table.py [REGEX ...]"""

from __future__ import annotations

import csv
import re
import sys

DEFAULT = [r"^gpu__time_duration\.sum$", r"^launch__registers_per_thread$", r"^launch__grid_size$",
           r"^sm__warps_active\.avg\.pct_of_peak_sustained_active$",
           r"^smsp__issue_active\.avg\.pct_of_peak_sustained_active$",
           r"^sm__pipe_tensor_op_hmma_cycles_active\.avg\.pct_of_peak_sustained_active$",
           r"^sm__inst_executed_pipe_lsu\.avg\.pct_of_peak_sustained_active$",
           r"^l1tex__throughput\.avg\.pct_of_peak_sustained_active$",
           r"^dram__throughput\.avg\.pct_of_peak_sustained_elapsed$",
           r"^smsp__average_warp_latency_per_inst_issued\.ratio$",
           r"^smsp__warp_issue_stalled_.*_per_warp_active\.pct$",
           r"^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$"]


def main(argv: list[str]) -> int:
    pats = [re.compile(p) for p in (argv or DEFAULT)]
    rows = list(csv.reader(sys.stdin))
    if len(rows) < 3:
        print("ncu_table: no kernels in the report", file=sys.stderr)
        return 1
    names, units = rows[0], rows[1]
    cols = [i for i, n in enumerate(names) if any(p.search(n) for p in pats)]
    kcol = names.index("Kernel Name") if "Kernel Name" in names else None
    icol = names.index("ID") if "ID" in names else None
    for r in rows[2:]:
        parts = []
        for i in cols:
            v = r[i] if i < len(r) else ""
            try:
                f = float(v.replace(",", ""))
            except ValueError:
                continue
            if "stalled" in names[i] and f < (1.0 if names[i].endswith(".pct") else 0.05):
                continue
            short = (names[i].replace("smsp__warp_issue_stalled_", "stall%:").replace("_per_warp_active.pct", "")
                     .replace("smsp__average_warps_issue_stalled_", "stall/issue:")
                     .replace("_per_issue_active.ratio", ""))
            parts.append(f"{short}={f:.4g}{units[i] if units[i] and 'stall' not in short else ''}")
        launch = r[icol] if icol is not None else "?"
        print(f"[{launch} {r[kcol][:20] if kcol is not None else '?'}] " + " ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
