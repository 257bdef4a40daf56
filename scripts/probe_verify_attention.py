"""Where a verify's int8 decode attention spends its time (issue 32: T = 8 <= 1.5x T = 1 at 65,536 keys).

For each key-split plan (``--splits``: the default plan's, and fewer, longer splits) and each T, the CUDA split pass
alone, the combine alone and the whole ``decode_attention`` call are timed by CUDA-graph replay over cache copies
larger than L2 (bench_attention's ``Case``), beside the bytes each moves: K / V codes and scales, and the partial
outputs (fp16 by default: attn_cuda.part_dtype) the split writes and the combine reads back. T > 1 runs each verify
kernel of ``--kernels``. One plan serves T = 1 and T > 1 alike in the engine (their bits depend on it), so a plan is
judged by both columns.

    python scripts/probe_verify_attention.py --json out.json
    ncu --profile-from-start off -k regex:"attn_split|attn_verify|_attn_combine" \\
        python scripts/probe_verify_attention.py --profile      # one launch of each kernel, nothing timed
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

import torch  # noqa: E402
from _benchlib import copy_bandwidth, graph_us  # noqa: E402
from bench_attention import HKV, Case, check  # noqa: E402
from ninfer_bench.kernels import attention_triton as at  # noqa: E402
from ninfer_bench.kernels import attn_cuda  # noqa: E402


def parts(case: Case, t: int, cfg: attn_cuda.CudaPlan, kernel: str):
    """(split-only calls, combine-only calls, whole calls) over every slot set of ``case``, and the partials' bytes."""
    attn_cuda.set_verify_kernel(kernel)
    kern = at._triton.ready("decode_attention", at._kernels, torch.empty(1, device="cuda"))
    sets = [case.inputs(t, s) for s in case.slot_sets]
    splits = cfg.splits(case.ctx)
    b, _, h, hd = sets[0]["q"].shape
    # partial buffers: as many as fit twice L2's size over them, so the combine reads from HBM like the engine's
    part = attn_cuda.part_dtype()
    per = b * t * h * splits * (hd * part.itemsize + 4)
    nbuf = max(2, min(len(sets), -(-(160 * 2**20) // per)))
    o_parts = [torch.empty(b, t, h, splits, hd, dtype=part, device="cuda") for _ in range(nbuf)]
    lse_parts = [torch.empty(b, t, h, splits, dtype=torch.float32, device="cuda") for _ in range(nbuf)]
    outs = [torch.empty(b, t, h, hd, dtype=torch.bfloat16, device="cuda") for _ in range(nbuf)]

    def split(i, x):
        attn_cuda.split(x["q"], x["k_cache"], x["v_cache"], x["k_scale"], x["v_scale"], x["slots"], x["q_pos"],
                        x["scale"] * at.LOG2E, case.ctx, cfg, o_parts[i % nbuf], lse_parts[i % nbuf])

    def combine(i, x):
        at._combine(kern, o_parts[i % nbuf], lse_parts[i % nbuf], x["q_pos"], outs[i % nbuf], None, cfg.chunk,
                    cfg.min_chunk, splits, attn_cuda.STEP, min(at._block_d(hd), cfg.combine_cols), cfg.combine_splits)

    splits_fns = [lambda i=i, x=x: split(i, x) for i, x in enumerate(sets)]
    combine_fns = [lambda i=i, x=x: combine(i, x) for i, x in enumerate(sets)]
    whole = [lambda x=x: at.decode_attention(**x, kv_len_max=case.ctx, config=cfg) for x in sets]
    return splits_fns, combine_fns, whole, per


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctx", type=int, default=65536)
    p.add_argument("--ts", default="1,8", help="query tokens a call, a comma list")
    p.add_argument("--kernels", default="mma,wgmma", help="verify kernels for T > 1 (mma, wgmma)")
    p.add_argument("--splits", default="", help="also these split counts (a comma list; the default plan first)")
    p.add_argument("--combine-cols", default="",
                   help="also time the combine alone with these column tiles (a comma list; no bit depends on them)")
    p.add_argument("--combine-tiles", default="",
                   help="also time the combine alone and the whole call with these combine tiles, SPLITSxCOLS (a comma "
                        "list, e.g. 128x32,256x32): splits a program step changes the combine's order of sums, so "
                        "the bits (alike for every T), columns do not")
    p.add_argument("--profile", action="store_true",
                   help="one launch of each (split, combine) between cudaProfilerStart / Stop (for ncu), no timing")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not attn_cuda.available():
        print(f"attn_cuda does not run here: {attn_cuda.import_error()}")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    case = Case("int8", a.ctx, 1)
    base = attn_cuda.plan(a.ctx, HKV, "cuda")
    plans = [base]
    steps = -(-a.ctx // attn_cuda.STEP)
    for s in filter(None, a.splits.split(",")):
        chunk = -(-steps // int(s)) * attn_cuda.STEP
        cfg = attn_cuda.CudaPlan(chunk=chunk, min_chunk=min(chunk, base.min_chunk))
        if cfg not in plans:
            plans.append(cfg)
    ts = [int(x) for x in a.ts.split(",")]
    kernels = [k for k in a.kernels.split(",") if k]
    bw = None if a.profile else copy_bandwidth()
    kv_bytes = case.bytes_read(1)
    print(f"{torch.cuda.get_device_name()}  ctx {a.ctx}  K/V codes + scales {kv_bytes / 1e6:.1f} MB"
          + (f"  copy bandwidth {bw / 1e12:.2f} TB/s" if bw else ""))
    rows = []
    for cfg in plans:
        for t in ts:
            for kernel in (kernels if t > 1 else ["-"]):
                split_fns, comb_fns, whole, per = parts(case, t, cfg, kernel if t > 1 else "mma")
                if a.profile:
                    split_fns[0](), comb_fns[0]()  # compile, load, warm
                    torch.cuda.synchronize()
                    torch.cuda.profiler.start()
                    split_fns[1 % len(split_fns)]()
                    comb_fns[1 % len(comb_fns)]()
                    torch.cuda.synchronize()
                    torch.cuda.profiler.stop()
                    print(f"profiled splits {cfg.splits(a.ctx)} T {t} {kernel}")
                    continue
                rel = check(case, t, cfg)
                r = {"splits": cfg.splits(a.ctx), "chunk": cfg.chunk, "T": t, "kernel": kernel,
                     "rel_rms": rel, "split_us": graph_us(split_fns), "combine_us": graph_us(comb_fns),
                     "whole_us": graph_us(whole), "partial_bytes": per}
                r["split_gbps"] = (kv_bytes + per) / (r["split_us"] * 1e-6) / 1e9
                for cols in filter(None, a.combine_cols.split(",")):
                    alt = dataclasses.replace(cfg, combine_cols=int(cols))
                    r[f"combine_us_cols{cols}"] = graph_us(parts(case, t, alt, kernel if t > 1 else "mma")[1])
                    print(f"  combine with {cols} columns a program: {r[f'combine_us_cols{cols}']:6.1f} us")
                for tile in filter(None, a.combine_tiles.split(",")):
                    n, _, cols = tile.partition("x")
                    alt = dataclasses.replace(cfg, combine_splits=int(n), combine_cols=int(cols or cfg.combine_cols))
                    _, comb, whole_alt, _ = parts(case, t, alt, kernel if t > 1 else "mma")
                    r[f"combine_us_{tile}"], r[f"whole_us_{tile}"] = graph_us(comb), graph_us(whole_alt)
                    print(f"  combine tile {tile}: combine {r[f'combine_us_{tile}']:6.1f} us  whole "
                          f"{r[f'whole_us_{tile}']:7.1f} us")
                rows.append(r)
                print(f"splits {r['splits']:4d} chunk {cfg.chunk:5d}  T {t}  {kernel:7s}  rel {rel:.1e}  split "
                      f"{r['split_us']:7.1f} us  combine {r['combine_us']:6.1f} us  whole {r['whole_us']:7.1f} us  "
                      f"partials {per / 1e6:6.1f} MB", flush=True)
    if rows:
        for cfg in plans:
            one = [r for r in rows if r["chunk"] == cfg.chunk and r["T"] == 1]
            for r in rows:
                if r["chunk"] == cfg.chunk and one:
                    r["x_t1"] = r["whole_us"] / one[0]["whole_us"]
        print("\nsplits  T kernel   whole us  x T=1 (same plan)")
        for r in rows:
            print(f"{r['splits']:6d} {r['T']:2d} {r['kernel']:7s} {r['whole_us']:9.1f}  {r.get('x_t1', float('nan')):.2f}")
    if a.json and rows:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bw": bw,
                                            "kv_bytes": kv_bytes, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
