#!/usr/bin/env python3
"""Does torch SDPA pay a per-new-key-length cost on this GPU, and which backend pays it?

On the H200 (2026-11-30) every eager decode path that calls ``F.scaled_dot_product_attention`` with a mask (our
v2 runtime, MTP drafting's attention layer under v3, the transformers peer) ran its first 256-token repeat 3-4x
slower than the second one over the same lengths. This times one decode-shaped SDPA call (the bundled model's
attention shape by default) at every key length of a growing sequence, twice over the same lengths, under each
backend forced on its own and under torch's own choice; a backend whose first pass is much slower than its second
builds something per shape (a cuDNN plan, say).

    python3 scripts/probe_sdpa.py [--heads 6 --kv-heads 1 --head-dim 64 --start 296 --steps 64]
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--start", type=int, default=296)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_sdpa: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    h, hkv, hd = args.heads, args.kv_heads, args.head_dim
    lengths = list(range(args.start, args.start + args.steps))
    top = lengths[-1]
    k = torch.randn(1, hkv, top, hd, device=dev, dtype=dtype)
    v = torch.randn(1, hkv, top, hd, device=dev, dtype=dtype)
    q = torch.randn(1, h, 1, hd, device=dev, dtype=dtype)
    choices = {"auto": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, q [1, {h}, 1, {hd}], {hkv} kv heads, "
          f"keys {lengths[0]}..{top}, boolean mask (as kernels/attention.py)")
    for name, backend in choices.items():
        passes = []
        try:
            first = torch.ones(1, 1, 1, lengths[0] - 1, dtype=torch.bool, device=dev)  # one-time set-up, outside
            with sdpa_kernel([backend] if backend is not None else list(choices.values())[1:]):
                F.scaled_dot_product_attention(q, k[:, :, :lengths[0] - 1], v[:, :, :lengths[0] - 1],
                                               attn_mask=first, enable_gqa=True)
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for n in lengths:
                    mask = torch.ones(1, 1, 1, n, dtype=torch.bool, device=dev)
                    if backend is None:
                        F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], attn_mask=mask, enable_gqa=True)
                    else:
                        with sdpa_kernel([backend]):
                            F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], attn_mask=mask,
                                                           enable_gqa=True)
                torch.cuda.synchronize()
                passes.append((time.perf_counter() - t0) * 1e3 / len(lengths))
        except RuntimeError as e:
            print(f"{name:10s} not available here: {str(e).splitlines()[0][:120]}")
            continue
        print(f"{name:10s} first pass {passes[0]:8.3f} ms a call, second {passes[1]:8.3f} ms "
              f"({passes[0] / passes[1]:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
