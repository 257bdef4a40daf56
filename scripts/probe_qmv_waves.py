#!/usr/bin/env python3
"""How qmv's efficiency depends on its grid: the same K at many row-tile counts (whole waves of blocks and not),
and split-K counts at the 27B's 5120-row shapes. Prints us a call (20 calls over weight copies larger than L2,
replayed from one CUDA graph) and the fraction of the copy bandwidth measured in the same run.

    python3 scripts/probe_qmv_waves.py [--fmt q4] [--ks 5120,17408] [--tiles 132,264,...] [--splits 1,2,3,4,5,6]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

from _benchlib import copy_bandwidth, graph_us  # noqa: E402
from bench_qlinear import FMT_ALIASES, L2_BYTES, random_packed  # noqa: E402

import torch  # noqa: E402

from ninfer_bench.kernels import quant  # noqa: E402
from ninfer_bench.kernels import qlinear as ql  # noqa: E402
from ninfer_bench.kernels import qmv_cuda  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", default="q4")
    ap.add_argument("--ks", default="5120,17408")
    ap.add_argument("--tiles", default="132,264,320,396,400,528,640,792,1188,1584,2176")
    ap.add_argument("--splits", default="1,2,3,4,5,6", help="split-K counts timed at N = 5120")
    ap.add_argument("--t", type=int, default=1)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not qmv_cuda.available():
        print(f"probe_qmv_waves: needs CUDA and cupy ({qmv_cuda.import_error()})", file=sys.stderr)
        return 2
    fmt = FMT_ALIASES[args.fmt]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    slots = sms * qmv_cuda._BLOCKS_PER_SM
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: {sms} SMs, {slots} block slots (MIN_BLOCKS {qmv_cuda._BLOCKS_PER_SM}); "
          f"copy bandwidth {bw / 1e12:.3f} TB/s; {fmt}, T = {args.t}")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def measure(k: int, n: int, splits: int | None) -> tuple[float, float]:
        one = ql.PackedLinear(random_packed(fmt, n, k, gen), fmt, (n, k), "cuda")
        copies = max(1, min(16, math.ceil(3 * L2_BYTES / one.packed_bytes)))
        lins = [qmv_cuda.TiledWeight(one, lanes=True)]
        lins += [qmv_cuda.TiledWeight(ql.PackedLinear(random_packed(fmt, n, k, gen), fmt, (n, k), "cuda"), lanes=True)
                 for _ in range(copies - 1)]
        x = torch.randn(args.t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty(args.t, n, device="cuda", dtype=torch.bfloat16)
        calls = [(lambda li=li: qmv_cuda.qmv(x, li, out, splits=splits)) for li in (lins * 20)[:20]]
        us = graph_us(calls, replays=15)
        nbytes = one.packed_bytes + x.numel() * 2 + out.numel() * 2
        del lins, one
        torch.cuda.empty_cache()
        return us, nbytes / (us * 1e-6) / bw

    print(f"{'K':>6s} {'N':>7s} {'tiles':>6s} {'waves':>6s} {'split':>5s} {'MB':>7s} {'us':>8s} {'of copy':>8s}")
    for k in (int(v) for v in args.ks.split(",")):
        for tiles in (int(v) for v in args.tiles.split(",")):
            n = tiles * 16
            s = qmv_cuda.choose_splits(n, -(-k // 64), sms)
            us, frac = measure(k, n, None)
            mb = quant.qlayout(fmt, (n, k)).nbytes / 1e6
            print(f"{k:6d} {n:7d} {tiles:6d} {tiles * s / slots:6.2f} {s:5d} {mb:7.1f} {us:8.2f} {100 * frac:7.1f}%",
                  flush=True)
        for s in (int(v) for v in args.splits.split(",")):
            us, frac = measure(k, 5120, s)
            print(f"{k:6d} {5120:7d} {320:6d} {320 * s / slots:6.2f} {s:5d} {'':7s} {us:8.2f} {100 * frac:7.1f}%",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
