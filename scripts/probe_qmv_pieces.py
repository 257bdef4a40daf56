#!/usr/bin/env python3
"""A split-K qmv launch three ways: its pieces spread over blocks (the split: reduced in a thread-block cluster on
sm_90+), walked in one block (``pieces=True``: the same bits, checked here), and one pass (``splits=1``: other bits,
the floor a walk can reach). Prints us a call (20 PDL-chained calls replayed from one CUDA graph, as a decode step
chains them) and what :func:`qmv_cuda.pieces_pay` picks, so the rule can be read against the measurement.

    python3 scripts/probe_qmv_pieces.py [--bundled] [--fmts q8,q4] [--ns 256,1024,4096] [--ks 1024,2048,4096]
                                        [--splits 2,4,8] [--ts 1,8] [--copies 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

from _benchlib import graph_us  # noqa: E402
from bench_qlinear import FMT_ALIASES, random_packed  # noqa: E402

import torch  # noqa: E402

from ninfer_bench.kernels import quant  # noqa: E402
from ninfer_bench.kernels import qlinear as ql  # noqa: E402
from ninfer_bench.kernels import qmv_cuda  # noqa: E402

# the bundled model's projections (N, K) that split (q8): attention q | gate and k | v, the GDN's q | k | v | z, the
# MLP's down
BUNDLED = [(768, 512), (128, 512), (1024, 512), (512, 1024)]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundled", action="store_true", help="the bundled model's split shapes (q8) at their own splits")
    ap.add_argument("--fmts", default="q8,q4")
    ap.add_argument("--ns", default="256,1024,4096")
    ap.add_argument("--ks", default="1024,2048,4096")
    ap.add_argument("--splits", default="2,4,8", help="split counts forced on the grid (each where it can walk)")
    ap.add_argument("--ts", default="1,8")
    ap.add_argument("--copies", type=int, default=1, help="weight copies the 20 calls cycle (1: L2-resident)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not qmv_cuda.available():
        print(f"probe_qmv_pieces: needs CUDA and cupy ({qmv_cuda.import_error()})", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: {sms} SMs; 20 PDL-chained calls a graph; {args.copies} weight copies")
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []  # (fmt, n, k, splits or None: the shape's own)
    if args.bundled:
        cases += [("q8_g32_fp16", n, k, None) for n, k in BUNDLED]
    else:
        for short in args.fmts.split(","):
            for n in _ints(args.ns):
                for k in _ints(args.ks):
                    cases += [(FMT_ALIASES[short.strip()], n, k, s) for s in _ints(args.splits)]
    rows, bad = [], 0
    print(f"{'fmt':4s} {'N':>6s} {'K':>6s} {'T':>2s} {'split':>5s} {'grp/pc':>6s} {'split us':>9s} {'walk us':>8s} "
          f"{'1-pass us':>9s} {'walk/split':>10s} {'rule':>5s} bits")
    for fmt, n, k, forced in cases:
        group = quant.QSPEC[fmt][0]
        ng = -(-k // group)
        one = ql.PackedLinear(random_packed(fmt, n, k, gen), fmt, (n, k), "cuda")
        lins = [qmv_cuda.TiledWeight(one, lanes=True)]
        lins += [qmv_cuda.TiledWeight(ql.PackedLinear(random_packed(fmt, n, k, gen), fmt, (n, k), "cuda"), lanes=True)
                 for _ in range(args.copies - 1)]
        warps = qmv_cuda.choose_warps(n, sms)
        s = forced or qmv_cuda.shape_splits(n, ng, sms, warps)
        gps = -(-ng // min(s, qmv_cuda.MAX_SPLITS))
        s = -(-ng // gps)
        if s < 2 or gps % warps:
            print(f"{fmt[:2]:4s} {n:6d} {k:6d}  - {s:5d} {gps:6d}  (cannot walk: one piece, or not whole warp strides)")
            continue
        for t in _ints(args.ts):
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
            us = {}
            for name, kw in (("split", {"splits": s, "pieces": False}), ("walk", {"splits": s, "pieces": True}),
                             ("one", {"splits": 1})):
                calls = [(lambda li=li, kw=kw: qmv_cuda.qmv(x, li, out, pdl=True, **kw)) for li in (lins * 20)[:20]]
                us[name] = graph_us(calls, replays=25)
            same = torch.equal(qmv_cuda.qmv(x, lins[0], splits=s, pieces=True),
                               qmv_cuda.qmv(x, lins[0], splits=s, pieces=False))
            bad += not same
            rule = qmv_cuda.pieces_pay(ng, gps, warps, qmv_cuda.launch_build(fmt, n, t, 2, sms).unroll)
            row = {"fmt": fmt, "n": n, "k": k, "t": t, "splits": s, "groups_per_piece": gps, "ng": ng,
                   "warps": warps, "split_us": us["split"], "walk_us": us["walk"], "one_pass_us": us["one"],
                   "rule_walks": rule, "same_bits": same}
            rows.append(row)
            print(f"{fmt[:2]:4s} {n:6d} {k:6d} {t:2d} {s:5d} {gps:6d} {us['split']:9.2f} {us['walk']:8.2f} "
                  f"{us['one']:9.2f} {us['walk'] / us['split']:10.3f} {'walk' if rule else 'split':>5s} "
                  f"{'same' if same else 'DIFFER'}", flush=True)
        del lins, one
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "sms": sms,
                                               "copies": args.copies, "rows": rows}, indent=1))
    print(f"bits: {len(rows) - bad} of {len(rows)} walks equal their split launch")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
