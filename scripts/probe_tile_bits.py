"""Does a one-token tile give the packed tile's bits on this GPU? (issue 32: decode attention at T = 1)

Decode attention keeps token invariance by construction: a T = 1 step runs the tile a T = 8 verify runs (sized for
8 tokens' rows, ``kernels/attention_triton.plan``), so each query row is one row of the same MMA. At T = 1 that
tile is 6 of 64 rows busy; the one-token tile (``pack=1``, 16 rows, ``flat``) reached 46.4% of the copy bandwidth
against the packed tile's 35.0% on the H200 (int8, 65,536 keys, B = 1; bench_attention's sweep). It may only be
used if its rows are the same bits as the packed tile's: Triton issues Hopper's warpgroup MMA for the 64-row tile
and the warp-level MMA for the 16-row one, and nothing promises the two round alike.

This measures it: at the 27B attention shape (H = 24, Hkv = 4, hd = 256), for each key range, batch and seed, one
T = 8 call with the default plan against eight T = 1 calls per token (the one-token tile, and as a control the
default tile), comparing the outputs bit for bit. Prints the count of equal and unequal token rows per variant and
the largest difference; exit code 0 either way (it is a measurement).

Measured on the H200 (session 36, lengths 37-65,536, batches 1 and 4, 3 seeds): the default tile's T = 1 rows equal
the T = 8 rows in 192 of 192 cases; the one-token tile's in 17 of 192 (int8, up to 0.0039 apart; flat or not) and
63 of 192 (bf16, up to 0.002). So decode steps keep the packed tile (kernels/attention_triton.py).

Usage: python3 scripts/probe_tile_bits.py [--lengths 37,1000,8192,65536] [--seeds 3] [--batches 1,4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()
from ninfer_bench.kernels import attention_triton as at  # noqa: E402
from ninfer_bench.kernels.kv_quant import quantize_kv  # noqa: E402

H, HKV, HD, T = 24, 4, 256, 8


def variants(b: int, kv_len: int, int8: bool, dev: str, qdt: torch.dtype) -> dict[str, at.AttnConfig]:
    """The T = 1 launch shapes compared against the T = 8 call's rows."""
    kw = dict(q_dtype=qdt)
    out = {"default": at.plan(b, 1, H, HKV, HD, kv_len, int8, dev, **kw),
           "pack1": at.plan(b, 1, H, HKV, HD, kv_len, int8, dev, pack=1, block_m=16, **kw)}
    if int8:
        out["pack1-flat"] = at.plan(b, 1, H, HKV, HD, kv_len, int8, dev, pack=1, block_m=16, ahead=True,
                                    flat=True, **kw)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="37,1000,8192,65536", help="key ranges (cache capacity = the largest)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--kv", default="int8,bf16")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (a smoke test)")
    args = ap.parse_args(argv)
    dev = args.device
    if dev == "cpu":  # the interpreter's tl.dot takes no bf16: fp32 queries, the tests' interpreter fixes
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        import triton_interp  # noqa: F401
    qdt = torch.bfloat16 if dev == "cuda" else torch.float32
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    lengths = [int(x) for x in args.lengths.split(",")]
    cap = max(lengths)
    tally: dict[tuple[str, str], list] = {}
    for kv in args.kv.split(","):
        int8 = kv == "int8"
        for b in (int(x) for x in args.batches.split(",")):
            for seed in range(args.seeds):
                g = torch.Generator(device=dev).manual_seed(seed)
                k = torch.randn(b, HKV, cap, HD, generator=g, device=dev, dtype=torch.bfloat16)
                v = torch.randn(b, HKV, cap, HD, generator=g, device=dev, dtype=torch.bfloat16)
                if int8:
                    (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
                else:
                    ks = vs = None
                slots = torch.arange(b, device=dev).flip(0)
                for n in lengths:
                    q = torch.randn(b, T, H, HD, generator=g, device=dev, dtype=qdt)
                    q_pos = (n - T + torch.arange(T, device=dev)).clamp(min=0).expand(b, T).contiguous()
                    common = dict(k_cache=k, v_cache=v, k_scale=ks, v_scale=vs, slots=slots, scale=HD ** -0.5,
                                  kv_len_max=cap)
                    full = at.decode_attention(q, q_pos=q_pos, **common)
                    for name, cfg in variants(b, cap, int8, dev, qdt).items():
                        row = tally.setdefault((kv, name), [0, 0, 0.0, str(cfg)])
                        for t in range(T):
                            one = at.decode_attention(q[:, t:t + 1].contiguous(), q_pos=q_pos[:, t:t + 1].contiguous(),
                                                      config=cfg, **common)
                            same = torch.equal(one[:, 0], full[:, t])
                            row[0 if same else 1] += 1
                            row[2] = max(row[2], float((one[:, 0].float() - full[:, t].float()).abs().max()))
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (Triton interpreter)"
    print(f"{name}: T = 1 calls against the rows of a T = {T} call (default plan), "
          f"lengths {lengths}, batches {args.batches}, {args.seeds} seeds")
    for (kv, name), (eq, ne, diff, cfg) in tally.items():
        print(f"  {kv:5s} {name:11s} equal {eq:4d}  unequal {ne:4d}  max |diff| {diff:.3g}  {cfg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
