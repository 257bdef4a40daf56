"""Decode / verify attention at the 27B shape (H=24, Hkv=4, hd=256) on one CUDA GPU.

Triton ``decode_attention`` reading the cache in place (int8 codes + fp16 scales, or bf16), for int8 the tensor-core
CUDA split kernel (``kernels/attn_cuda.cu``, the default where it runs) beside it, against torch SDPA on a
dequantized bf16 copy (the peer), and the Triton kernel with one token a tile (``pack=1``), for contexts 8192 /
65536, T = 1 / 8 new tokens, B = 1 / 8 rows, every row at the full context. Per case: correctness vs the fp32
reference first (printed loudly on failure), then median us by ``triton.testing.do_bench`` (L2 flushed before each
call) and by CUDA-graph replay (one graph rotating over slot sets bigger than L2), bytes read (K+V codes + scales +
q + out), GB/s and % of the device copy bandwidth measured in the same run. Then, while time is left, launch shapes
around the default plan and around the one-token tile (``--no-sweep`` skips; ``--budget-s``).

    python scripts/bench_attention.py            # from a plain checkout; JSON lines to $OUT/attention.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

import torch  # noqa: E402
from _benchlib import copy_bandwidth, graph_us, resource_report  # noqa: E402
from ninfer_bench.kernels import attention_triton as at  # noqa: E402
from ninfer_bench.kernels import attn_cuda  # noqa: E402
from ninfer_bench.kernels.attention import attention as sdpa_attention  # noqa: E402
from ninfer_bench.kernels.kv_quant import dequantize_kv, quantize_kv  # noqa: E402

DEVICE = "cuda"
H, HKV, HD = 24, 4, 256
CONTEXTS = (8192, 65536)
TOKENS = (1, 8)
BATCHES = (1, 8)
KV_DTYPES = ("int8", "bf16")
RTOL_BF16 = 1e-2  # relative RMS vs the fp32 reference with bf16 q (q, dequantized K/V and p rounded to bf16)
ROTATE_BYTES = 512 * 2**20  # graph replays rotate over this many cache bytes, several times the H200's L2
MAX_COPIES = 16
TIME_BUDGET_S = 150  # the sweep stops starting new cases past this
SEED = 0


class Case:
    """One (kv dtype, context, B) cache holding `copies` disjoint slot sets, and queries for T new tokens."""

    def __init__(self, kv: str, ctx: int, b: int):
        g = torch.Generator(device=DEVICE).manual_seed(SEED)
        per_set = b * HKV * ctx * HD * 2 * (1 if kv == "int8" else 2)
        self.kv, self.ctx, self.b = kv, ctx, b
        self.copies = max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / per_set)))
        shape = (b * self.copies, HKV, ctx, HD)
        k = torch.randn(shape, generator=g, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn(shape, generator=g, device=DEVICE, dtype=torch.bfloat16)
        if kv == "int8":
            (self.k, self.ks), (self.v, self.vs) = quantize_kv(k), quantize_kv(v)
            del k, v
        else:
            self.k, self.v, self.ks, self.vs = k, v, None, None
        self.slot_sets = [torch.arange(i * b, (i + 1) * b, device=DEVICE).flip(0) for i in range(self.copies)]

    def inputs(self, t: int, slots: torch.Tensor):
        g = torch.Generator(device=DEVICE).manual_seed(SEED + t)
        q = torch.randn(self.b, t, H, HD, generator=g, device=DEVICE, dtype=torch.bfloat16)
        q_pos = (self.ctx - t + torch.arange(t, device=DEVICE)).expand(self.b, t).contiguous()
        return dict(q=q, k_cache=self.k, v_cache=self.v, k_scale=self.ks, v_scale=self.vs, slots=slots,
                    q_pos=q_pos, scale=HD ** -0.5)

    def bytes_read(self, t: int) -> int:
        """K+V codes + scales of the attended keys, q, and the output (partial results not counted)."""
        elt = 1 if self.kv == "int8" else 2
        kv = 2 * self.b * HKV * self.ctx * HD * elt
        scales = 2 * self.b * HKV * self.ctx * math.ceil(HD / 64) * 2 if self.kv == "int8" else 0
        return kv + scales + 2 * self.b * t * H * HD * 2

    def dequantized(self, slots):
        """The peer's input: the slots' K/V as a contiguous bf16 copy [B, Hkv, ctx, hd]."""
        if self.kv == "int8":
            return (dequantize_kv(self.k[slots], self.ks[slots], torch.bfloat16),
                    dequantize_kv(self.v[slots], self.vs[slots], torch.bfloat16))
        return self.k[slots].contiguous(), self.v[slots].contiguous()


def check(case: Case, t: int, config=None) -> float:
    """Relative RMS of decode_attention vs the fp32 reference, on NaN-filled outputs."""
    x = case.inputs(t, case.slot_sets[0])
    new_buffer = at._new_buffer
    at._new_buffer = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    try:
        out = at.decode_attention(**x, kv_len_max=case.ctx, config=config).float()
    finally:
        at._new_buffer = new_buffer
    ref = at.decode_attention_ref(**{**x, "q": x["q"].float()}, kv_len_max=case.ctx)
    err = ((out - ref).norm() / ref.norm()).item()
    del ref
    return err if torch.isfinite(out).all() else float("nan")


def measure(case: Case, t: int, bw: float, config=None) -> dict:
    from triton.testing import do_bench

    sets = [case.inputs(t, s) for s in case.slot_sets]
    fns = [lambda x=x: at.decode_attention(**x, kv_len_max=case.ctx, config=config) for x in sets]
    fns[0]()  # compile outside the timings
    us = do_bench(fns[0], warmup=25, rep=100, return_mode="median") * 1e3
    us_graph = graph_us(fns)
    nbytes = case.bytes_read(t)
    best = min(us, us_graph)
    return {"us_median": round(us, 2), "us_graph": round(us_graph, 2), "bytes": nbytes,
            "gbps": round(nbytes / (best * 1e-6) / 1e9, 1), "copy_bw_frac": round(nbytes / (best * 1e-6) / bw, 3)}


def measure_peer(case: Case, t: int, bw: float) -> dict:
    from triton.testing import do_bench

    x = case.inputs(t, case.slot_sets[0])
    k, v = case.dequantized(x["slots"])
    us = do_bench(lambda: sdpa_attention(x["q"], k, v, x["q_pos"], x["scale"]), warmup=10, rep=100,
                  return_mode="median") * 1e3
    nbytes = k.numel() * 2 * 2 + 2 * x["q"].numel() * 2
    return {"us_median": round(us, 2), "bytes": nbytes, "gbps": round(nbytes / (us * 1e-6) / 1e9, 1),
            "copy_bw_frac": round(nbytes / (us * 1e-6) / bw, 3)}


def timed(rec: dict, case: Case, t: int, bw: float, config) -> dict:
    """``rec`` with the check against the fp32 reference (``rel_rms``, ``ok``; printed loudly when wrong) and, when it
    ran, the timings of :func:`measure`."""
    shape = {k: rec[k] for k in ("kv", "ctx", "B", "T")}
    try:
        rec["rel_rms"] = check(case, t, config)
        rec["ok"] = rec["rel_rms"] <= RTOL_BF16
        if not rec["ok"]:
            print(f"!!!!! WRONG RESULT {shape} {config}: relative RMS {rec['rel_rms']:.3e} > {RTOL_BF16} "
                  f"vs the fp32 reference !!!!!")
        rec.update(measure(case, t, bw, config))
    except Exception as exc:
        rec.update(ok=False, error=repr(exc)[:400])
        print(f"!!!!! FAILED {shape} {config}: {exc!r}")
        traceback.print_exc()
    return rec


def sweep_configs(case: Case, t: int) -> list:
    """For int8, first the CUDA kernel's plans (warps an SM the split aims at, the combine's tile); then the Triton
    kernel's default plan (tokens packed in one tile), then launch shapes one change away from it (block_n, warps,
    stages, split length; for int8 one tile per scale group, the scales loaded with their block, or 2-D code
    tiles); then the same around 5 tokens a tile (32 rows) and the one-token tile (pack=1, G rows padded to 16)."""
    out = []
    if case.kv == "int8" and attn_cuda.available():  # first the CUDA kernel (warps an SM, combine tiles)
        for wps in (4, 8, 12, 16):
            for comb in ({}, {"combine_cols": 32}, {"combine_splits": 64}, {"combine_cols": 32, "combine_splits": 64}):
                cfg = attn_cuda.plan(case.ctx, HKV, DEVICE, warps_per_sm=wps, **comb)
                if cfg not in out:
                    out.append(cfg)
    for tile in ({}, {"pack": 5}, {"pack": 1}):  # pack 5: 30 of 32 rows, a T = 8 verify in two tiles
        base = at.plan(case.b, t, H, HKV, HD, case.ctx, case.kv == "int8", DEVICE, **tile)
        if base not in out:
            out.append(base)
        for change in ({"block_n": 32}, {"block_n": 64}, {"num_warps": 4}, {"num_warps": 8}, {"num_stages": 1},
                       {"num_stages": 2},
                       {"num_stages": 4}, {"chunk": base.chunk // 2}, {"chunk": base.chunk * 2},
                       {"chunk": base.chunk * 4},
                       *([{"grouped": True, "ahead": False}, {"ahead": False}, {"flat": True},
                          {"flat": True, "num_stages": 4}]
                         if case.kv == "int8" else [])):
            fields = {**dataclasses.asdict(base), **change}
            bn = fields["block_n"]
            fields["chunk"] = chunk = max(bn, fields["chunk"] // bn * bn)
            fields["min_chunk"] = max(bn, min(fields["min_chunk"] or chunk, chunk) // bn * bn)
            cfg = at.AttnConfig(**fields)
            if cfg not in out:
                out.append(cfg)
    return out


def kernel_resources() -> list:
    return resource_report({"split": at._kernels()["split"], "combine": at._kernels()["combine"]})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true", help="time the default launch plan only")
    parser.add_argument("--budget-s", type=float, default=TIME_BUDGET_S,
                        help=f"no new sweep case starts past this many seconds (default {TIME_BUDGET_S})")
    parser.add_argument("--cases", default=None,
                        help="only these cases, a comma list of KV:CTX:B:T (e.g. int8:65536:1:1,bf16:65536:1:1), "
                             "as under a profiler (ncu): fewer launches to find")
    parser.add_argument("--no-peer", action="store_true", help="skip SDPA on the bf16 copy and the pack1 row")
    parser.add_argument("--cuda-verify-warps", default="",
                        help="also time the CUDA kernel at T > 1 with at most these m tiles of 16 query rows a verify "
                             "block (a comma list of 1 .. 8; the default plan's is in the table)")
    parser.add_argument("--cuda-builds", default="",
                        help="also time the CUDA kernel at T > 1 built with these extra defines of attn_cuda.cu: "
                             "builds separated by ';', each a ':' list of NAME=VALUE (e.g. 'VDEPTH=3;QSMEM=1:VMAXREG=168')")
    parser.add_argument("--plan", default="",
                        help="the first row's plan with these overrides of kernels.attention_triton.plan, a comma "
                             "list of NAME=INT (e.g. ahead=1,block_n=64), as under a profiler (ncu): a candidate's "
                             "kernel alone")
    args = parser.parse_args()
    overrides = {}
    for item in filter(None, args.plan.split(",")):
        name, _, value = item.partition("=")
        if name not in ("block_n", "num_warps", "num_stages", "chunk", "min_chunk", "block_m", "pack", "grouped",
                        "ahead", "flat") or not value.lstrip("-").isdigit():
            parser.error(f"--plan: expected NAME=INT with NAME a keyword of plan(), got {item!r}")
        overrides[name] = bool(int(value)) if name in ("grouped", "ahead", "flat") else int(value)
    only = None
    if args.cases:
        try:
            only = {(kv, int(ctx), int(b), int(t)) for kv, ctx, b, t in (c.split(":") for c in args.cases.split(","))}
        except ValueError:
            parser.error(f"--cases: expected KV:CTX:B:T[,...], got {args.cases!r}")
        if any(c[0] not in KV_DTYPES for c in only):
            parser.error(f"--cases: kv must be one of {', '.join(KV_DTYPES)}")
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    t0 = time.time()
    out_dir = os.environ.get("OUT")
    sink = open(Path(out_dir) / "attention.jsonl", "w") if out_dir else None

    def emit(rec):
        line = json.dumps(rec)
        if sink:
            sink.write(line + "\n")
            sink.flush()
        return rec

    bw = copy_bandwidth()
    emit({"op": "env", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
          "copy_TBps": round(bw / 1e12, 3), "sms": torch.cuda.get_device_properties(0).multi_processor_count})
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s  triton {triton.__version__}")
    table, failures, sweep_todo = [], 0, []
    for kv in KV_DTYPES:
        for ctx in sorted({c[1] for c in only if c[0] == kv}) if only else CONTEXTS:
            for b in sorted({c[2] for c in only if c[:2] == (kv, ctx)}) if only else BATCHES:
                case = Case(kv, ctx, b)
                for t in sorted({c[3] for c in only if c[:3] == (kv, ctx, b)}) if only else TOKENS:
                    shape = {"kv": kv, "ctx": ctx, "B": b, "T": t}
                    cfg = at.plan(b, t, H, HKV, HD, ctx, kv == "int8", DEVICE, **overrides)
                    rec = timed({"op": "decode_attention", **shape, "config": str(cfg),
                                 "splits": -(-ctx // cfg.chunk)}, case, t, bw, cfg)
                    failures += not rec["ok"]
                    if ctx == max(CONTEXTS) and rec.get("ok"):
                        sweep_todo.append((kv, ctx, b, t))
                    cu = {"op": "decode_attention_cuda", **shape}
                    if kv == "int8" and attn_cuda.available():
                        cfg_cu = attn_cuda.plan(ctx, HKV, DEVICE)
                        cu = timed({**cu, "config": str(cfg_cu), "splits": cfg_cu.splits(ctx)}, case, t, bw, cfg_cu)
                        failures += not cu["ok"]
                        emit(cu)
                        for build in filter(None, args.cuda_builds.split(";")):
                            if t == 1 or "error" in cu:
                                break
                            attn_cuda.set_build_defines(attn_cuda.parse_build(build))
                            try:
                                row = timed({"op": "decode_attention_cuda", **shape, "config": str(cfg_cu),
                                             "build": build}, case, t, bw, cfg_cu)
                            finally:
                                attn_cuda.set_build_defines(None)
                            failures += not row["ok"]
                            emit(row)
                            print(f"cuda {shape} build {build}: {_best(row)} us, rel_rms {row.get('rel_rms')}")
                        for bt in filter(None, args.cuda_verify_warps.split(",")):
                            if t == 1 or "error" in cu:
                                break
                            cfg_bt = dataclasses.replace(cfg_cu, verify_warps=int(bt))
                            row = timed({"op": "decode_attention_cuda", **shape, "config": str(cfg_bt)}, case, t,
                                        bw, cfg_bt)
                            failures += not row["ok"]
                            emit(row)
                            print(f"cuda {shape} verify_warps={bt}: {_best(row)} us, rel_rms {row.get('rel_rms')}")
                    rec["cuda"] = cu
                    one = {"op": "decode_attention_pack1", **shape}  # one token a tile, the same run
                    peer = {"op": "sdpa_bf16_copy", **shape}
                    if args.no_peer:
                        table.append((emit(rec), peer))
                        continue
                    try:
                        cfg1 = at.plan(b, t, H, HKV, HD, ctx, kv == "int8", DEVICE, pack=1)
                        one.update(config=str(cfg1), **measure(case, t, bw, cfg1))
                    except Exception as exc:
                        one["error"] = repr(exc)[:400]
                    emit(one)
                    rec["pack1_us"] = min(one.get("us_median", math.inf), one.get("us_graph", math.inf))
                    try:
                        peer.update(measure_peer(case, t, bw))
                    except Exception as exc:
                        peer["error"] = repr(exc)[:400]
                    table.append((emit(rec), emit(peer)))
                del case
                torch.cuda.empty_cache()
    sweep = []
    sweep_todo.sort(key=lambda c: (c[0] != "int8", c[2], c[3]))  # int8 B=1 first: a decode step's case
    for kv, ctx, b, t in [] if args.no_sweep else sweep_todo:
        if time.time() - t0 > args.budget_s:
            print(f"sweep stopped at {time.time() - t0:.0f} s (budget {args.budget_s:.0f} s)")
            break
        case = Case(kv, ctx, b)
        for cfg in sweep_configs(case, t):
            if time.time() - t0 > args.budget_s:
                break
            rec = {"op": "decode_attention_sweep", "kv": kv, "ctx": ctx, "B": b, "T": t, "config": str(cfg),
                   "splits": -(-ctx // cfg.chunk)}
            if isinstance(cfg, attn_cuda.CudaPlan):
                try:
                    rec["rel_rms"] = check(case, t, cfg)
                except Exception as exc:
                    rec["error"] = repr(exc)[:400]
            try:
                rec.update(measure(case, t, bw, cfg))
            except Exception as exc:
                rec["error"] = repr(exc)[:400]
            sweep.append(emit(rec))
        del case
        torch.cuda.empty_cache()
    for row in kernel_resources():
        emit({"op": "resources", **row})
        print("resources", row)
    if sink:
        sink.close()
    print_tables(table, sweep)
    print(f"{'ALL CORRECT' if not failures else f'{failures} FAILURES'}; {time.time() - t0:.0f} s")
    return 1 if failures else 0


def _best(rec: dict):
    times = [rec[k] for k in ("us_median", "us_graph") if k in rec]
    return min(times) if times else None


def print_tables(table, sweep):
    print(f"\n{'kv':5} {'ctx':>6} {'B':>2} {'T':>2} {'rel_rms':>8} {'us':>8} {'us_graph':>8} {'GB/s':>7} "
          f"{'%copy':>6} {'pack1 us':>8} | {'cuda us':>8} {'%copy':>6} | {'sdpa us':>8} {'%copy':>6}")
    for rec, peer in table:
        fmt = lambda x, f: format(x, f) if isinstance(x, (int, float)) else "-"  # noqa: E731
        print(f"{rec['kv']:5} {rec['ctx']:>6} {rec['B']:>2} {rec['T']:>2} {fmt(rec.get('rel_rms'), '8.1e')} "
              f"{fmt(rec.get('us_median'), '8.1f')} {fmt(rec.get('us_graph'), '8.1f')} {fmt(rec.get('gbps'), '7.0f')} "
              f"{fmt(100 * rec['copy_bw_frac'] if 'copy_bw_frac' in rec else None, '6.1f')} "
              f"{fmt(rec.get('pack1_us'), '8.1f')} | "
              f"{fmt(_best(rec.get('cuda', {})), '8.1f')} "
              f"{fmt(100 * rec['cuda']['copy_bw_frac'] if 'copy_bw_frac' in rec.get('cuda', {}) else None, '6.1f')} | "
              f"{fmt(peer.get('us_median'), '8.1f')} "
              f"{fmt(100 * peer['copy_bw_frac'] if 'copy_bw_frac' in peer else None, '6.1f')}"
              + (f"  ERROR {rec['error'][:60]}" if "error" in rec else ""))
    if sweep:
        print("\nsweep (best of do_bench / graph, % of copy bandwidth):")
        for rec in sweep:
            perf = f"{100 * rec['copy_bw_frac']:5.1f}%" if "copy_bw_frac" in rec else f"ERROR {rec['error'][:60]}"
            print(f"  {rec['kv']:5} B={rec['B']} T={rec['T']} splits={rec['splits']:>4} {perf}  {rec['config']}")


if __name__ == "__main__":
    sys.exit(main())
