"""One wide qmv launch at a 27B projection shape, repeated, for Nsight Compute (issue 33: why 64 rows cost 4-5x what 8
rows do although they read the same weight).

Builds a random packed weight of ``--op`` (bench_qlinear.py's SHAPES) in ``--fmt``, held in the engine's layout,
then launches ``qmv`` on ``--rows`` rows ``--launches`` times with each ``--knobs`` build (bench_qlinear.py's knob
letters: ``p3u1`` three tiles a block with one step in flight, ``p1`` one tile a block, empty for the default). A
build's first launch (after NVRTC compiled it on the host) is a launch like the others; scripts/gpu_check.sh
``ncuqmv`` profiles them all. Prints each build's mean device time from CUDA events, and checks that every build
gives the first run build's bits (the builds keep the one-tile sums); a build the width refuses is skipped.

Usage: python3 scripts/probe_qmv_wide.py --op mlp.down --fmt q4 --rows 64 --knobs ,p1,p3u1 --launches 5"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap

_bootstrap.ensure_package()
import torch
from bench_qlinear import FMT_ALIASES, SHAPES, qmv_knobs, random_packed
from ninfer_bench.engine.runtime.options import EngineOptions
from ninfer_bench.kernels import qlinear as ql
from ninfer_bench.kernels import qmv_cuda


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="mlp.down", choices=sorted(SHAPES))
    ap.add_argument("--fmt", default="q4", choices=sorted(FMT_ALIASES))
    ap.add_argument("--rows", type=int, default=64, help="rows of x (9..64: a wide launch)")
    ap.add_argument("--knobs", default=",p1,p3u1", help="comma list of builds (empty: the default build)")
    ap.add_argument("--launches", type=int, default=5, help="launches a build after its first (compiling) one")
    args = ap.parse_args(argv)
    if not qmv_cuda.available():
        print(f"probe_qmv_wide: {qmv_cuda.import_error()}", file=sys.stderr)
        return 2
    if not 1 <= args.rows <= qmv_cuda.MAX_ROWS:
        ap.error(f"--rows: 1..{qmv_cuda.MAX_ROWS}, got {args.rows}")
    k, n = SHAPES[args.op]
    fmt = FMT_ALIASES[args.fmt]
    gen = torch.Generator(device="cuda").manual_seed(0)
    lin = ql.PackedLinear(random_packed(fmt, n, k, gen), fmt, (n, k), "cuda", layout=EngineOptions().qmv_layout)
    x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    first = None  # (label, output) of the first build that ran
    for spec in args.knobs.split(","):
        label, kw = spec or "default", qmv_knobs(spec) if spec else {}
        try:
            y = qmv_cuda.qmv(x, lin, **kw)  # compiles the build
        except ValueError as e:  # a build this width refuses (row tiles at <= 8 rows)
            print(f"{args.op} {args.fmt} rows={args.rows} build={label}: skipped ({e})")
            continue
        torch.cuda.synchronize()
        first = first or (label, y)
        same = torch.equal(y, first[1])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.launches):
            qmv_cuda.qmv(x, lin, y, **kw)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / max(1, args.launches)
        print(f"{args.op} {args.fmt} rows={args.rows} build={label}: {us:.1f} us a launch (events), "
              f"{'same bits as' if same else 'BITS DIFFER from'} {first[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
