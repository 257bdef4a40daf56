#!/usr/bin/env python3
"""Does torch SDPA pay a per-new-key-length cost on this GPU, and what does each way round it cost per call?

On the H200 (2026-11-30) torch's own choice for a masked GQA call (cuDNN) spent 42.5 ms at every new key length
(0.07 ms a call once built): every eager decode step and prefill chunk paid it. ``kernels.attention.sdpa`` therefore
runs the memory-efficient kernel with the GQA group folded into the query rows or the K/V heads repeated. This times
each strategy (``native`` = torch's enable_gqa choice, ``fold``, ``expand``, each also under the math backend alone,
``auto`` = what the engine runs) on a
growing sequence, twice over the same lengths, at decode, verify and prefill shapes of the bundled model and of the
27B. A first pass much slower than the second means something is built per shape.

    python3 scripts/probe_sdpa.py [--steps 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

# name: (heads, kv heads, head dim, queries, first key length)
SHAPES = {"bundled T=1": (6, 1, 64, 1, 296), "bundled T=8": (6, 1, 64, 8, 296),
          "bundled T=512": (6, 1, 64, 512, 2048), "27b T=1": (24, 4, 256, 1, 8000),
          "27b T=8": (24, 4, 256, 8, 8000), "27b T=512": (24, 4, 256, 512, 4096)}


def main() -> int:
    import torch

    _bootstrap.ensure_package()
    from torch.nn.attention import SDPBackend

    from ninfer_bench.kernels import attention
    from ninfer_bench.kernels.attention import _mask, sdpa

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=32, help="key lengths in a pass (one more key each)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_sdpa: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.dtype}, boolean causal-offset mask, "
          f"{args.steps} key lengths a pass; ms a call")
    print(f"{'shape':14s} {'group':11s} {'first':>8s} {'second':>8s} {'ratio':>6s} {'max err':>8s}")
    for name, (h, hkv, hd, t, start) in SHAPES.items():
        lengths = list(range(start, start + args.steps))
        k = torch.randn(1, hkv, lengths[-1], hd, device=dev, dtype=dtype)
        v = torch.randn(1, hkv, lengths[-1], hd, device=dev, dtype=dtype)
        q = torch.randn(1, h, t, hd, device=dev, dtype=dtype)
        ref = None
        engine_backends = attention._NO_CUDNN
        for variant in ("native", "fold", "expand", "fold-math", "expand-math", "auto"):
            group = variant.split("-")[0]
            attention._NO_CUDNN = [SDPBackend.MATH] if variant.endswith("math") else engine_backends
            passes = []
            try:
                for _ in range(2):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for n in lengths:
                        pos = torch.arange(n - t, n, device=dev).view(1, t)
                        o = sdpa(q, k[:, :, :n], v[:, :, :n], _mask(pos, n), hd ** -0.5, group=group)
                    torch.cuda.synchronize()
                    passes.append((time.perf_counter() - t0) * 1e3 / len(lengths))
            except (RuntimeError, torch.OutOfMemoryError) as e:
                print(f"{name:14s} {variant:11s} failed: {str(e).splitlines()[0][:100]}")
                continue
            ref = o.float() if ref is None else ref
            err = (o.float() - ref).abs().max().item()
            print(f"{name:14s} {variant:11s} {passes[0]:8.3f} {passes[1]:8.3f} {passes[0] / passes[1]:6.1f} {err:8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
