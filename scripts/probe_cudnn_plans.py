#!/usr/bin/env python3
"""Does the cuDNN split of a prompt chunk's attention (kernels/attention_prefill.cudnn_past, ``--cudnn-prefill``) pay
a cost the first time it meets a shape, and how large?

For each (query rows T, past keys L) it times the first call of ``cudnn_past`` at that shape and the next few, with
the GPU synchronised around each, at the 27B shape (24 query heads, 4 K/V heads, head size 256, fp16, K / V in the
BSHD copy the engine makes). A first call far slower than the repeats means cuDNN builds an execution plan per shape:
then a prompt of a new length pays it for its last chunk (and a process's first long prompt for every chunk), and
the split needs its shapes bucketed before it can be on by default.

    python3 scripts/probe_cudnn_plans.py [--shapes 2048:2048,2048:4096,943:2048,...] [--repeats 3] [--varlen 2048:65536]

``--varlen MAXQ:MAXK`` times the same shapes again through torch's variable-length entry
(``aten._cudnn_attention_forward`` with cumulative sequence lengths, the nested-tensor path), every call declaring
the same maximum lengths: whether one plan then serves every length, what a call costs beside the fixed-shape call,
and how far its output and log-sum-exp are from it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

DEFAULT_SHAPES = "2048:2048,2048:4096,2048:8192,943:2048,943:4096,1500:4096,2048:63488,1000:63488,943:63488"


def main() -> int:
    import torch

    _bootstrap.ensure_package()
    from ninfer_bench.kernels.attention_prefill import cudnn_past

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="T:L pairs (query rows : past keys), comma-separated, "
                    "timed in this order")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls after the first at each shape")
    ap.add_argument("--heads", default="24:4:256", help="H:Hkv:hd")
    ap.add_argument("--varlen", default="", help="MAXQ:MAXK: also time the variable-length entry at these maxima")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_cudnn_plans: needs a CUDA GPU", file=sys.stderr)
        return 2
    h, hkv, hd = (int(x) for x in args.heads.split(":"))
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",") if s]
    dev, dt = torch.device("cuda"), torch.float16
    cap = max(t + key_lo for t, key_lo in shapes)
    g = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(1, cap, hkv, hd, generator=g, device=dev, dtype=dt).transpose(1, 2)  # [1, Hkv, L, hd] over BSHD
    v = torch.randn(1, cap, hkv, hd, generator=g, device=dev, dtype=dt).transpose(1, 2)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}; "
          f"H {h}, Hkv {hkv}, hd {hd}, fp16; ms a call, synchronised")
    varlen = tuple(int(x) for x in args.varlen.split(":")) if args.varlen else None
    scale = hd ** -0.5

    def timed(fn):
        times, out = [], None
        for _ in range(1 + args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - t0))
        rep = sorted(times[1:])[len(times[1:]) // 2]
        return times[0], rep, out

    def var_call(q, key_lo):
        mq, mk = varlen
        cq = torch.tensor([0, q.shape[1]], dtype=torch.int32, device=dev)
        ck = torch.tensor([0, key_lo], dtype=torch.int32, device=dev)
        kk, vv = (x.transpose(1, 2)[0, :key_lo] for x in (k, v))  # [L, Hkv, hd] rows of the BSHD copy
        res = torch.ops.aten._cudnn_attention_forward(q[0], kk, vv, None, cq, ck, mq, mk, True, 0.0, False, False,
                                                      scale=scale)
        return res[0], res[1]

    head = f"{'T':>6s} {'past keys':>9s} {'first':>9s} {'repeats':>9s} {'first-rep':>9s}"
    print(head + (f" | varlen: {'first':>9s} {'repeats':>9s} {'first-rep':>9s} {'max |do|':>9s} {'lse':>9s}"
                  if varlen else ""))
    for t, key_lo in shapes:
        q = torch.randn(1, t, h, hd, generator=g, device=dev, dtype=dt)
        first, rep, out = timed(lambda: cudnn_past(q, k, v, key_lo, scale))
        if out is None:
            print(f"{t:6d} {key_lo:9d}  cuDNN refused")
            continue
        line = f"{t:6d} {key_lo:9d} {first:9.2f} {rep:9.3f} {first - rep:9.2f}"
        if varlen:
            try:
                vfirst, vrep, (vo, vlse) = timed(lambda: var_call(q, key_lo))
                do = (vo.float().reshape(out[0].shape) - out[0].float()).abs().max().item()
                lse = out[1].reshape(-1)
                vl = vlse.float().reshape(-1) if vlse.numel() == lse.numel() else None
                if vl is None:
                    dl = "shape " + "x".join(map(str, vlse.shape))
                else:  # [H, T] or [T, H]: the nearer of the two readings
                    dl = f"{min((vl - lse).abs().max(), (vl.view(t, h).t().reshape(-1) - lse).abs().max()).item():9.2e}"
                line += f" | varlen: {vfirst:9.2f} {vrep:9.3f} {vfirst - vrep:9.2f} {do:9.2e} {dl:>9s}"
            except RuntimeError as exc:
                line += f" | varlen refused: {str(exc).splitlines()[0][:120]}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
