#!/usr/bin/env python3
"""The prefill's dequantization (packed weight -> dense bf16) at the 27B shapes: the lanes layout read a tile's code
words at a time (the engine's path) against the general kernel's byte gathers, both checked bit-equal first.

    python3 scripts/bench_dequant.py [--fmts q4,q5,q8] [--ops mlp.gate_up,mlp.down]   (default: the mixed formats)

Times each as a CUDA graph of 20 calls (weights larger than L2 in total, so each call reads HBM), microseconds a
call, and the bytes moved (packed read + bf16 written) against the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

import torch  # noqa: E402
from _benchlib import copy_bandwidth, graph_us  # noqa: E402
from bench_qlinear import FMT_ALIASES, SHAPES  # noqa: E402

from ninfer_bench.kernels import quant  # noqa: E402
from ninfer_bench.kernels import qlinear as ql  # noqa: E402
from ninfer_bench.kernels.qmv_cuda import TiledWeight  # noqa: E402

CALLS = 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmts", default=None, help="formats to time (default: the mixed policy's for the op)")
    ap.add_argument("--ops", default=",".join(op for op in SHAPES if op != "lm_head"))
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write)")
    print(f"{'op':<12} {'fmt':<12} {'MB moved':>9} {'bytes us':>9} {'words us':>9} {'% copy':>7} {'x':>6}")
    for op in args.ops.split(","):
        k, n = SHAPES[op]
        fmts = args.fmts.split(",") if args.fmts else ["q5" if op.startswith("attn.") else "q4"]
        for fmt in (FMT_ALIASES[f] for f in fmts):
            w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
            lin = ql.PackedLinear(quant.pack(w, fmt), fmt, (n, k), "cuda")
            tiles = TiledWeight(lin, lanes=True)
            assert torch.equal(ql.qlinear_dequant(tiles), ql.qlinear_dequant(tiles, word_reads=False)), (op, fmt)
            copies = [TiledWeight(lin, lanes=True) for _ in range(3)]  # rotated: more than L2 in total
            moved = lin.buf.numel() + n * k * 2
            us = {words: graph_us([lambda i=i, words=words, c=copies: ql.qlinear_dequant(c[i % 3], word_reads=words)
                                   for i in range(CALLS)])
                  for words in (False, True)}
            frac = moved / (us[True] * 1e-6) / bw
            print(f"{op:<12} {fmt:<12} {moved / 1e6:>9.1f} {us[False]:>9.1f} {us[True]:>9.1f} {100 * frac:>6.1f}% "
                  f"{us[False] / us[True]:>5.2f}x", flush=True)
            del lin, tiles, copies
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
