#!/usr/bin/env python3
"""A prompt chunk's projection GEMMs at each chunk length M: the dense bf16 products a prefill forward makes
(``F.linear`` over the model's fused weight shapes, as runtime v3 keeps them on CUDA), timed alone per shape and
summed over the layer stack. It says whether a chunk length (a prefill graph's bucket, a --prefill-chunk) lands on
a shape the GEMM library runs slowly, by the stack's model TFLOP/s at every M side by side in one process.

    python3 scripts/bench_prefill_gemm.py --model qwen3.8-27b --m 2048,2991,3072,3200,4096,8192 [--json out.json]
        [--variants linear,swap]   # swap: the same product as (W x^T)^T, made contiguous (another cuBLAS problem)

Shapes (per layer kind, from the preset's config): MLP gate|up and down; a GDN layer's qkv, z (kept apart for the
captured decode's side stream), b|a and out; an attention layer's q|gate|k|v and o. The lm_head's one row and the
attention / GDN products are not GEMMs of the chunk's rows and are left out. Times are medians (triton's do_bench,
CUDA, L2 flushed between repeats) or of a few repeats (CPU, where the absolute times mean nothing).

What it does not say: how a product runs inside the forward. On an H100 it had the 27B stack 5-7 % cheaper a token in
2,048-row products than at 3,072 or 8,192 rows, yet the engine's prefill with its projections cut into 2,048-row
blocks measured 1.0-1.3 % slower end to end (docs/perf/2026-12-07c-prefill-chunk-default.md); decide with the decode
suite's prompt grid, not with this table alone."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ninfer_bench.engine.model.config import preset  # noqa: E402


def stack_shapes(cfg) -> list[tuple[str, int, int, int]]:
    """(name, N, K, calls a forward) of every projection GEMM a prefill chunk makes."""
    h, hd = cfg.hidden_size, cfg.head_dim
    full, lin, layers = len(cfg.full_layers), len(cfg.linear_layers), cfg.num_hidden_layers
    q_rows = cfg.num_attention_heads * hd * 2 + 2 * cfg.num_key_value_heads * hd
    out = [("mlp.gate_up", 2 * cfg.intermediate_size, h, layers), ("mlp.down", h, cfg.intermediate_size, layers)]
    if lin:
        out += [("gdn.qkv", cfg.conv_dim, h, lin), ("gdn.z", cfg.value_dim, h, lin),
                ("gdn.ba", 2 * cfg.linear_num_value_heads, h, lin), ("gdn.out", h, cfg.value_dim, lin)]
    if full:
        out += [("attn.q_gate_kv", q_rows, h, full), ("attn.o", h, cfg.num_attention_heads * hd, full)]
    return out


def time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=60, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3.8-27b", help="a model preset")
    ap.add_argument("--m", default="2048,2560,2944,2991,3072,3200,3584,4096,8192", help="chunk lengths (rows)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", default="linear", help="linear: F.linear(x, W); swap: (W @ x^T)^T made contiguous "
                    "(the transposed problem, which cuBLAS may tile otherwise; the same values up to summation order)")
    ap.add_argument("--json", default=None, help="write the table here")
    args = ap.parse_args(argv)
    cfg = preset(args.model)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ms_list = [int(v) for v in args.m.split(",")]
    shapes = stack_shapes(cfg)
    gen = torch.Generator(device="cpu").manual_seed(0)
    weights = {name: (torch.randn(n, k, generator=gen) * k ** -0.5).to(device, dtype) for name, n, k, _ in shapes}
    x_all = torch.randn(max(ms_list), max(k for _, _, k, _ in shapes), generator=gen).to(device, dtype)
    variants = args.variants.split(",")
    unknown = set(variants) - {"linear", "swap"}
    if unknown:
        ap.error(f"--variants: unknown {', '.join(sorted(unknown))} (known: linear, swap)")
    products = {"linear": lambda x, w: F.linear(x, w), "swap": lambda x, w: torch.mm(w, x.t()).t().contiguous()}
    rows = []
    print(f"{args.model} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} ({dtype}); "
          f"per shape: us a call (TFLOP/s)")
    print(f"{'how':>6} {'M':>6} " + " ".join(f"{name:>20}" for name, *_ in shapes) + f" {'stack ms':>9} {'us/token':>9} "
          f"{'TFLOP/s':>8}")
    for variant, m in ((v, m) for v in variants for m in ms_list):
        per, total_ms, flops = {}, 0.0, 0
        for name, n, k, calls in shapes:
            x = x_all[:m, :k].contiguous()
            w = weights[name]
            ms = time_ms(lambda x=x, w=w: products[variant](x, w), device)
            per[name] = {"us": ms * 1e3, "tflops": 2 * m * n * k / (ms * 1e-3) / 1e12}
            total_ms += ms * calls
            flops += 2 * m * n * k * calls
        tflops = flops / (total_ms * 1e-3) / 1e12
        rows.append({"variant": variant, "m": m, "stack_ms": total_ms, "us_per_token": total_ms * 1e3 / m,
                     "tflops": tflops, "shapes": per})
        print(f"{variant[:6]:>6} {m:>6} " + " ".join(f"{v['us']:>10.1f} ({v['tflops']:>6.1f})" for v in per.values())
              + f" {total_ms:>9.2f} {total_ms * 1e3 / m:>9.2f} {tflops:>8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "device": str(device), "dtype": str(dtype),
                                               "shapes": [list(s) for s in shapes], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
