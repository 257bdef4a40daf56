"""What an L2 flush before a timed launch costs the launch: one qmv projection at a 27B shape timed (CUDA events, graph
replay) after the kernels suite's two flushes (suites/kernels.l2_flusher: ``read`` a 256 MB buffer, or ``write`` it),
and with ``--ncu-launches`` once after each, for Nsight Compute to count the launch's DRAM bytes read and written
(run it under ``ncu --cache-control none``, or ncu's own flush hides the effect).

A memory-bound launch after a write flush finds the L2 full of dirty lines and writes them back as its reads evict
them: extra DRAM writes up to the L2's size. After a read flush it reads its own bytes and writes only its output.

Usage: python3 scripts/probe_l2_flush.py --ops mlp.gate_up:q4,attn.o:q5 --rows 1 --repeats 30 [--ncu-launches]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap

_bootstrap.ensure_package()
import numpy as np
import torch
from bench_qlinear import FMT_ALIASES, SHAPES, random_packed
from ninfer_bench.engine.runtime.options import EngineOptions
from ninfer_bench.kernels import qlinear as ql
from ninfer_bench.kernels import quant
from ninfer_bench.suites.common import copy_bandwidth
from ninfer_bench.suites.kernels import (
    FLUSH_BYTES,
    L2_FLUSHES,
    cuda_graph,
    l2_flusher,
    time_cuda,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="mlp.gate_up:q4,attn.q_gate:q5,attn.o:q5,gdn.out:q4",
                    help="comma list of op:fmt (bench_qlinear.py's SHAPES, FMT_ALIASES)")
    ap.add_argument("--rows", type=int, default=1, help="rows of x")
    ap.add_argument("--repeats", type=int, default=30, help="timed launches a flush mode (alternating modes)")
    ap.add_argument("--ncu-launches", action="store_true",
                    help="no timing: per op one warm-up launch, then one after each flush mode (read, write), eager, "
                         "for ncu (--kernel-name regex:qmv --cache-control none)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_l2_flush: needs a CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    copy = copy_bandwidth(torch.device("cuda")) / 1e9
    print(f"{props.name}: L2 {props.L2_cache_size / 2**20:.0f} MiB, copy bandwidth {copy:.1f} GB/s, "
          f"flush buffer {FLUSH_BYTES >> 20} MiB")
    buf = torch.zeros(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    flushes = {mode: l2_flusher(buf, mode) for mode in L2_FLUSHES}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for spec in args.ops.split(","):
        op, fmt = spec.split(":")
        k, n = SHAPES[op]
        fmt = FMT_ALIASES[fmt]
        lin = ql.PackedLinear(random_packed(fmt, n, k, gen), fmt, (n, k), "cuda",
                              layout=EngineOptions().qmv_layout)
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        if args.ncu_launches:
            lin(x)  # the warm-up launch (compiles the build)
            for mode in ("read", "write"):
                flushes[mode]()
                lin(x)
                torch.cuda.synchronize()
                print(f"ncu launch: {op} {fmt} after the {mode} flush", flush=True)
            continue
        run = cuda_graph(lambda lin=lin, x=x: lin(x))
        nbytes = quant.nbytes(fmt, (n, k)) + 2 * args.rows * (k + n)
        us = {mode: [] for mode in flushes}
        for _ in range(args.repeats):  # alternate the modes, one timed launch each, so drift hits both alike
            for mode, flush in flushes.items():
                us[mode] += time_cuda(run, repeats=1, warmup=1, flush=flush)
        line = [f"{op} {fmt} rows={args.rows} {nbytes / 1e6:.1f} MB:"]
        for mode, samples in us.items():
            med = float(np.median(samples))
            line.append(f"{mode} flush {med:.1f} us ({nbytes / med / 1e3 / copy:.3f} of copy)")
        print("  ".join(line), f" write / read {np.median(us['write']) / np.median(us['read']):.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
