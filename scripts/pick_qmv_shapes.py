#!/usr/bin/env python3
"""Pick per-shape qmv overrides from a ``bench_qlinear.py --shape-knobs ... --pdl`` run: NINFER_BENCH_QMV_SHAPES.

    python3 scripts/pick_qmv_shapes.py QLINEAR_JSONL [--margin 0.03] [--table]

For each weight shape (N rows x G groups of K; projections that share a shape, such as the 27B's attention o and
GDN out, are judged together) it sums each candidate's chained time a launch (``@graph20``) over every op, format
and T measured, and keeps the best override (``ours-<spec>``) when that sum beats the engine's default (``ours``)
by more than ``--margin`` and no single (op, format, T) of it is slower than the default's. Prints the
NINFER_BENCH_QMV_SHAPES value (an empty line when nothing wins) and, with ``--table``, every shape's sums to stderr.
A candidate that failed its reference check or did not run at some (op, format, T) is never picked.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

from bench_qlinear import SHAPES, TOL_BF16  # noqa: E402

from ninfer_bench.kernels import quant  # noqa: E402


def shape_of(op: str, fmt: str, shapes: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """(N, G): the weight's rows and its groups of K in ``fmt``."""
    k, n = shapes[op]
    return n, quant.qlayout(fmt, (n, k)).kp // quant.QSPEC[fmt][0]


def pick(records: list[dict], shapes: dict[str, tuple[int, int]], margin: float) -> tuple[dict, list[str]]:
    """({(N, G): spec}, the table's lines) from bench_qlinear's JSON lines."""
    chained = defaultdict(dict)  # (N, G) -> {(op, fmt, T): {impl: us}}
    bad = set()  # (impl, op, fmt, T) that failed or erred
    for r in records:
        if r.get("kind") == "error":
            bad.add((r["impl"], r["op"], r["fmt"], r["T"]))
        if r.get("kind") != "time" or r["op"] not in shapes:
            continue
        impl = r["impl"]
        if impl.endswith("@graph20"):
            key = shape_of(r["op"], r["fmt"], shapes)
            chained[key].setdefault((r["op"], r["fmt"], r["T"]), {})[impl.removesuffix("@graph20")] = r["us"]
        elif not r.get("rel_rms", 0.0) <= TOL_BF16:  # bench_qlinear's own check
            bad.add((impl, r["op"], r["fmt"], r["T"]))
    picked, lines = {}, []
    for key, cases in sorted(chained.items()):
        names = set.intersection(*(set(c) for c in cases.values()))
        names = {nm for nm in names if not any((nm, *case) in bad for case in cases)}
        if "ours" not in names:
            continue
        sums = {nm: sum(c[nm] for c in cases.values()) for nm in names}
        base = sums["ours"]
        lines.append(f"{key[0]}x{key[1]} ({', '.join(sorted({f'{op} {fmt} T={t}' for op, fmt, t in cases}))}): "
                     + ", ".join(f"{nm} {sums[nm]:.2f}" for nm in sorted(sums, key=sums.get)))
        wins = [nm for nm in names if nm.startswith("ours-") and sums[nm] < base * (1 - margin)
                and all(c[nm] <= c["ours"] for c in cases.values())]
        if wins:
            best = min(wins, key=sums.get)
            picked[key] = best.removeprefix("ours-")
            lines.append(f"  -> {best}: {sums[best] / base:.3f}x the default's chained time")
    return picked, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", type=Path)
    ap.add_argument("--margin", type=float, default=0.03, help="fraction the summed chained time must drop by")
    ap.add_argument("--table", action="store_true", help="every shape's summed chained times to stderr")
    args = ap.parse_args()
    records = [json.loads(line) for line in args.jsonl.read_text().splitlines() if line.strip()]
    picked, lines = pick(records, SHAPES, args.margin)
    if args.table:
        print("\n".join(lines), file=sys.stderr)
    print(",".join(f"{n}x{g}:{spec}" for (n, g), spec in sorted(picked.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
