#!/usr/bin/env python3
"""Fused quantized projections at the 27B shapes: correctness on the GPU, then time against the copy roofline.

    python3 scripts/bench_qlinear.py [--quick] [--variants] [--fmts q4,q5] [--ts 1,8]

For each projection (K -> N), packed format and T rows of x (bf16): checks the kernel against the fp32
reference on a sample of rows (rel. RMS), then times
  ours          what the engine calls (a tiled PackedLinear: qmv, up to 64 rows a launch, when cupy imports, else
                Triton)
                replayed from a CUDA graph, the median of 50 calls, each after the kernels suite's clean L2
                flush (suites/kernels.l2_flusher: a 256 MB read, so no dirty lines are left for the call to write
                back; graph replay keeps host launch time out of the number)
  triton        qlinear_triton with its default launch config
  qmv           kernels/qmv_cuda.cu (tensor cores, T <= 8) with its default split
  ours-<spec>   (--shape-knobs) what the engine calls with a per-shape qmv override (warps a tile, split-K
                count, blocks an SM: NINFER_BENCH_QMV_SHAPES's letters); scripts/pick_qmv_shapes.py reads the
                @graph20 rows (with --pdl: captured with programmatic dependent launch, as the step is)
  ours-r<R>     (T > 8, --rows) what the engine calls with R rows a launch (8: one column group a launch, the weight
                read once per 8 rows); every row's bits must equal ours-r8's
  X@graph20     20 calls of X replayed from one CUDA graph, cycling over weight copies so L2 cannot hold them
  bf16      cuBLAS F.linear on a dense bf16 weight
  int4      torch's _weight_int4pack_mm (tinygemm, g128), as the reference-GPU kernel anchors time it
and reports us, GB/s (packed weight bytes + x + out; dense bytes for bf16) and % of the copy bandwidth
measured in the same run. ``--variants`` also times every Triton variant in VARIANTS, ``--qmv-variants`` qmv's
launch variants (split-K, unroll x blocks per SM; the tiled and lanes layouts); the best is named
(back-to-back graph20 calls are where programmatic dependent launch can overlap one call's start with the last's
end).
Writes one JSON line per measurement to $OUT/qlinear.jsonl when OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

from _benchlib import capture, copy_bandwidth, graph_us  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ninfer_bench.kernels import quant  # noqa: E402
from ninfer_bench.engine.runtime.options import EngineOptions  # noqa: E402
from ninfer_bench.kernels import qlinear as ql  # noqa: E402
from ninfer_bench.kernels import qmv_cuda  # noqa: E402

# op -> (K, N) at the 27B shape
SHAPES = {
    "attn.q_gate": (5120, 12288),
    "attn.qkv": (5120, 14336),  # q | gate | k | v: the step's attention input launch when the formats match
    "attn.o": (6144, 5120),
    "gdn.qkv": (5120, 10240),
    "gdn.z": (5120, 6144),
    "gdn.out": (6144, 5120),
    "mlp.gate_up": (5120, 34816),
    "mlp.down": (17408, 5120),
    "lm_head": (5120, 248320),
}
QUICK_OPS = ("attn.q_gate", "attn.o", "mlp.down")
FMT_ALIASES = quant.QUANT_SHORT
LM_HEAD_FMTS = ("q4_g64_fp16", "q8_g32_fp16")
# Relative RMS error allowed against the fp32 reference with bf16 x: the output's own bf16 rounding is
# ~1.6e-3, and the dot variant rounds q * scale to bf16 (~1e-3 more).
TOL_BF16 = 6e-3
GRAPH_CALLS = 20
L2_BYTES = 60 * 2**20  # H200; graph replays rotate over enough weight copies to exceed it 3x


def _split(fmt: str, n: int, k: int, block_n: int, gps: int) -> int:
    ng = quant.qlayout(fmt, (n, k)).kp // quant.QSPEC[fmt][0]
    return ql._split_for(-(-n // block_n), ng, gps)


def _dot(block_n, gps=2, split=True, warps=4, stages=1):
    def make(fmt, n, k, t):
        bt = min(64, max(16, 1 << max(0, (t - 1).bit_length())))
        sk = _split(fmt, n, k, block_n, gps) if split else 1
        return ql.QConfig("dot", block_n, gps=gps, split_k=sk, block_t=bt, num_warps=warps, num_stages=stages)
    return make


def _gemv(block_n, gps=4, split=True, warps=4):
    def make(fmt, n, k, t):
        if t != 1:
            return None
        sk = _split(fmt, n, k, block_n, gps) if split else 1
        return ql.QConfig("gemv", block_n, gps=gps, split_k=sk, num_warps=warps)
    return make


# Kernel variants compared by --variants (name -> config maker, None where it does not apply): the gemv
# (CUDA-core reduce) against the tensor-core dot at T = 1, tile shapes, pipeline depth, split-K on/off.
VARIANTS = {
    "gemv_n64_g4": _gemv(64),
    "gemv_n128_g2": _gemv(128, gps=2),
    "gemv_n256_g2": _gemv(256, gps=2),
    "gemv_n128_g4_w8": _gemv(128, warps=8),
    "gemv_n128_g4_nosplit": _gemv(128, split=False),
    "dot_n64_g4": _dot(64, gps=4),
    "dot_n128_g4": _dot(128, gps=4),
    "dot_n128_g2_s2": _dot(128, stages=2),  # pipelined: seen returning wrong sums (see _dot_kernel)
    "dot_n128_g2_w2": _dot(128, warps=2),  # mma.sync instead of wgmma
    "dot_n128_g2_w8": _dot(128, warps=8),
    "dot_n256_g2_w8": _dot(256, warps=8),
    "dot_n128_g2_nosplit": _dot(128, split=False),
}


def random_packed(fmt: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A valid packed buffer on the GPU: random code bytes (every code value), scales in [0.005, 0.015]."""
    lay = quant.qlayout(fmt, (n, k))
    buf = torch.randint(0, 256, (lay.nbytes,), dtype=torch.uint8, device="cuda", generator=gen)
    scales = torch.rand(lay.scales[1] // 2, device="cuda", generator=gen) * 0.01 + 0.005
    buf[lay.scales[0]:lay.scales[0] + lay.scales[1]] = scales.half().view(torch.uint8)
    return buf


def row_sample(buf: torch.Tensor, fmt: str, n: int, k: int, rows: torch.Tensor) -> torch.Tensor:
    """The packed buffer (on the CPU) of just ``rows`` of the [n, k] weight in ``buf``."""
    lay, sub = quant.qlayout(fmt, (n, k)), quant.qlayout(fmt, (len(rows), k))
    out = torch.zeros(sub.nbytes, dtype=torch.uint8)
    for (off, size), (soff, ssize) in ((lay.codes, sub.codes), (lay.high, sub.high), (lay.scales, sub.scales)):
        if size:
            out[soff:soff + ssize] = buf[off:off + size].view(n, size // n)[rows.to(buf.device)].cpu().reshape(-1)
    return out


def rel_rms(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.float().cpu()
    if not torch.isfinite(y).all():
        return math.inf
    return ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@functools.cache
def _clean_flush():
    """The kernels suite's read flush over its buffer, made once (suites/kernels.l2_flusher)."""
    from ninfer_bench.suites.kernels import FLUSH_BYTES, l2_flusher

    return l2_flusher(torch.zeros(FLUSH_BYTES // 4, device="cuda"), "read")


def one_call_us(fn) -> float:
    """Median us of one call replayed from a CUDA graph, each after a clean L2 flush (the kernels suite's timer and
    flush; Triton's do_bench zeroes its buffer, and the dirty lines cost a memory-bound call up to 1.27x): no host
    time."""
    import numpy as np

    from ninfer_bench.suites.kernels import time_cuda

    g = capture([fn])
    return float(np.median(time_cuda(g.replay, repeats=50, warmup=10, flush=_clean_flush())))


def rotating_us(calls, pdl: bool = False) -> float:
    """us per call of GRAPH_CALLS thunks replayed from one graph (different weight copies, so the weights
    come from DRAM as in a model's forward), median of 15 replays; with ``pdl``, captured with programmatic
    dependent launch as the engine captures its decode step (each launch may start while the one before ends)."""
    from ninfer_bench.suites.kernels import step_capture

    with step_capture(pdl):
        return graph_us(calls, replays=15)


def with_shape_knobs(fn, n: int, knobs: dict):
    """``fn`` (a candidate: x, lin, out) called with ``knobs`` as its weight shape's qmv override
    (qmv_cuda.set_shape_knobs: warps, splits, blocks an SM), as NINFER_BENCH_QMV_SHAPES would set it for the engine."""
    def run(x, li, out=None):
        saved = {key: dict(v) for key, v in qmv_cuda._SHAPES.items()}
        qmv_cuda.set_shape_knobs({**saved, (n, li.ng): knobs})
        try:
            return fn(x, li, out)
        finally:
            qmv_cuda.set_shape_knobs(saved)
    return run


def int4_tinygemm(x: torch.Tensor, n: int, k: int, gs: int = 128):
    """torch's int4 weight-only matmul on a random weight, as kernel_anchors.py calls it (None if absent)."""
    try:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wf = w.float().reshape(n, k // gs, gs)
        mx, mn = wf.amax(-1, keepdim=True), wf.amin(-1, keepdim=True)
        scale = (mx - mn).clamp(min=1e-6) / 15
        zero = mn + scale * 8
        q = ((wf - mn) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), 8)
        sz = torch.cat([scale.reshape(n, k // gs, 1), zero.reshape(n, k // gs, 1)], -1).transpose(0, 1)
        sz = sz.contiguous().to(torch.bfloat16)
        del w, wf, q
        f = lambda: torch.ops.aten._weight_int4pack_mm(x, packed, gs, sz)  # noqa: E731
        f()
        return f, n * k // 2 + n * (k // gs) * 4
    except Exception as e:  # not built for this GPU / torch
        print(f"  int4 tinygemm unavailable: {e!r:.120}")
        return None


# Dense bf16 projections qmv's FMT 3 may take instead of cuBLAS (--dense): (K, N)
DENSE_SHAPES = {"gdn.ba": (5120, 96), "dense.1024": (5120, 1024), "dense.5120": (5120, 5120)}


def bench_dense(ts, row, failures) -> None:
    """cuBLAS F.linear against qmv's dense path (FMT 3, with and without PDL), same weights, same run."""
    from ninfer_bench.kernels import qmv_cuda

    gen = torch.Generator(device="cuda").manual_seed(2)
    for op, (k, n) in DENSE_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        copies = max(1, min(16, math.ceil(3 * L2_BYTES / (w.numel() * 2))))
        ws = [w] + [torch.randn_like(w) * 0.02 for _ in range(copies - 1)]
        dws = [qmv_cuda.DenseWeight(v) for v in ws]
        tds = [qmv_cuda.TiledWeight(d) for d in dws]
        for t in ts:
            if t > qmv_cuda.MAX_T:
                continue
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = x.float() @ w.float().T
            nbytes = w.numel() * 2 + x.numel() * 2 + t * n * 2
            cands = {"cublas": lambda i, out: F.linear(x, ws[i]),
                     "qmv-dense": lambda i, out: qmv_cuda.qmv(x, dws[i], out, pdl=False),
                     "qmv-dense-pdl": lambda i, out: qmv_cuda.qmv(x, dws[i], out, pdl=True),
                     "qmv-dense-tiled": lambda i, out: qmv_cuda.qmv(x, tds[i], out)}
            for label, fn in cands.items():
                out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
                err = rel_rms(fn(0, out), ref.cpu())
                if not err <= TOL_BF16:
                    print(f"!!! FAILED CORRECTNESS {op} T={t} {label}: rel RMS {err:.3e}")
                    failures.append((op, "bf16", t, label, err))
                us = one_call_us(lambda fn=fn, out=out: fn(0, out))
                calls = [(lambda i=i, fn=fn, out=out: fn(i % len(ws), out)) for i in range(GRAPH_CALLS)]
                us_rot = rotating_us(calls)
                row(op, "bf16", t, label, us, nbytes, {"rel_rms": err, "us_graph20": us_rot})
                row(op, "bf16", t, label + "@graph20", us_rot, nbytes)


def rows_into(x, w, out=None, **kw):
    """``qmv_cuda.qmv_rows(x, w, **kw)``, copied into ``out`` when given (the candidates' calling shape)."""
    y = qmv_cuda.qmv_rows(x, w, **kw)
    return y if out is None else out.copy_(y)


def qmv_knobs(spec: str) -> dict:
    """qmv keyword arguments from a --qmv-knobs spec such as ``u5b2t``, ``w4u4b6tx`` or ``p3s4b1``."""
    kw = {**qmv_cuda.knob_kwargs(spec), **{"rows": int(num) for num in re.findall(r"r(\d+)", spec)}}
    rest = re.sub(rf"[r{''.join(qmv_cuda.KNOB_LETTERS)}]\d+", "", spec)
    for flag in rest:
        if flag not in "tx":
            raise ValueError(f"--qmv-knobs: {spec!r}: unknown letter {flag!r} (u<n> b<n> w<n> r<n> p<n> s<n> t x)")
    kw.update(tail="t" in rest, xlate="x" in rest)
    return kw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_OPS)}, T in 1, 8")
    ap.add_argument("--variants", action="store_true", help="also time every kernel variant in VARIANTS")
    ap.add_argument("--qmv-variants", action="store_true",
                    help="also time qmv's layouts (tiled, lanes) and launch knobs on the lanes layout")
    ap.add_argument("--qmv-splits", default="1,2,3,4,6,8",
                    help="comma list: split-K slice counts --qmv-variants times on the lanes layout")
    ap.add_argument("--qmv-knobs", default="",
                    help="comma list of qmv launch builds on the lanes layout, each letters + numbers: u<steps in "
                         "flight> b<blocks per SM> w<warps a tile> r<rows a launch> p<row tiles a block, over 8 "
                         "rows> s<cp.async ring stages, 0 off> t (predicated tail batch) x (x one step ahead), "
                         "e.g. u4b3,u4b3t,u5b2t,w4u4b6t,p3s4b1; timed as qmv-lanes-<spec>")
    ap.add_argument("--shape-knobs", default="",
                    help="comma list of per-shape overrides timed through the engine's call (ours), each letters + "
                         "numbers: w<warps a tile> k<split-K count> b<blocks an SM, up to 8 rows>, e.g. w4k2,w8b3; "
                         "timed as ours-<spec> at every T, as NINFER_BENCH_QMV_SHAPES sets them for the engine")
    ap.add_argument("--pdl", action="store_true",
                    help="capture the graph20 chains with programmatic dependent launch, as the engine's step is")
    ap.add_argument("--rows", default="",
                    help="comma list of rows a launch (8, 16, 32, 64) timed for T > 8 as ours-r<R>, e.g. 8,16,32,64; "
                         "--qmv-knobs then also run at T > 8 (without t / x)")
    ap.add_argument("--only", default="",
                    help="comma list: time only these candidates (e.g. qmv-lanes,qmv-lanes-r8; default all)")
    ap.add_argument("--only-variants", default="", help="comma list: restrict --variants to these names")
    ap.add_argument("--fmts", default="q4,q5,q8", help="comma list of q4, q5, q8")
    ap.add_argument("--ts", default="", help="comma list of T (default 1,2,4,8,16; --quick 1,8)")
    ap.add_argument("--ops", default="", help="comma list of ops (default all; --quick a few)")
    ap.add_argument("--no-baselines", action="store_true", help="skip bf16 cuBLAS and torch int4")
    ap.add_argument("--dense", action="store_true", help="also cuBLAS vs qmv's dense path at DENSE_SHAPES")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_qlinear: needs a CUDA GPU (none visible)", file=sys.stderr)
        return 2
    import triton

    t_start = time.time()
    ops = args.ops.split(",") if args.ops else (QUICK_OPS if args.quick else tuple(SHAPES))
    ts = [int(v) for v in args.ts.split(",")] if args.ts else ([1, 8] if args.quick else [1, 2, 4, 8, 16])
    fmts = [FMT_ALIASES[f] for f in args.fmts.split(",")]
    split_sweep = sorted({int(v) for v in args.qmv_splits.split(",") if v})
    rows_sweep = sorted({int(v) for v in args.rows.split(",") if v} | ({8} if args.rows else set()))
    if any(r not in (8, 16, 32, 64) for r in rows_sweep):
        ap.error(f"--rows: each must be 8, 16, 32 or 64, got {args.rows}")
    if any(not 1 <= sp <= qmv_cuda.MAX_SPLITS for sp in split_sweep):
        ap.error(f"--qmv-splits: each count must be 1..{qmv_cuda.MAX_SPLITS}, got {args.qmv_splits}")
    try:
        knobs = {spec: qmv_knobs(spec) for spec in args.qmv_knobs.split(",") if spec}
    except ValueError as e:
        ap.error(str(e))
    try:
        shape_knobs = {spec: qmv_cuda.parse_shapes(f"1x1:{spec}")[(1, 1)]
                       for spec in args.shape_knobs.split(",") if spec}
    except ValueError as e:
        ap.error(f"--shape-knobs: {e}")
    engine_layout = EngineOptions().qmv_layout
    variants = {}
    if args.variants:
        names = args.only_variants.split(",") if args.only_variants else list(VARIANTS)
        variants = {name: VARIANTS[name] for name in names}
    out_path = Path(os.environ["OUT"]) / "qlinear.jsonl" if os.environ.get("OUT") else None
    records = []

    def emit(rec):
        records.append(rec)
        if out_path:
            with out_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")

    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    bw = copy_bandwidth()
    print(f"device {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}; copy bandwidth {bw / 1e12:.3f} TB/s (read + write)")
    emit({"kind": "copy", "device": props.name, "copy_Bps": bw})

    gen = torch.Generator(device="cuda").manual_seed(0)
    failures = []
    header = f"{'op':12s} {'fmt':12s} {'T':>3s} {'impl':22s} {'us':>8s} {'GB/s':>7s} {'%copy':>6s}"
    print(header)
    print("-" * len(header))

    def row(op, fmt, t, impl, us, nbytes, extra=None):
        gbs = nbytes / (us * 1e-6) / 1e9
        print(f"{op:12s} {fmt:12s} {t:3d} {impl:22s} {us:8.2f} {gbs:7.0f} {100 * gbs * 1e9 / bw:5.1f}%")
        emit({"kind": "time", "op": op, "fmt": fmt, "T": t, "impl": impl, "us": us, "bytes": nbytes,
              "GBps": gbs, "frac_copy": gbs * 1e9 / bw, **(extra or {})})

    for op in ops:
        k, n = SHAPES[op]
        dense = None
        for fmt in fmts:
            if op == "lm_head" and fmt not in LM_HEAD_FMTS:
                continue
            buf = random_packed(fmt, n, k, gen)
            lin = ql.PackedLinear(buf, fmt, (n, k), "cuda")
            copies = max(1, min(16, math.ceil(3 * L2_BYTES / lin.packed_bytes)))
            lins = [lin] + [ql.PackedLinear(random_packed(fmt, n, k, gen), fmt, (n, k), "cuda")
                            for _ in range(copies - 1)]
            rows = torch.cat([torch.randperm(n, generator=torch.Generator().manual_seed(1))[:255],
                              torch.tensor([n - 1])]).unique()
            ref_buf = row_sample(buf, fmt, n, k, rows)
            held, tiled, lanes = {}, {}, {}  # each copy as the engine holds it / in TILED 1 / in TILED 2, made once
            for t in ts:
                x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                ref = ql.qlinear_ref(x, ref_buf, fmt, (len(rows), k))
                nbytes = lin.packed_bytes + x.numel() * 2 + t * n * 2
                # the engine's bf16 models keep their packed weights in qmv's layout (EngineOptions.qmv_layout)
                held = held or {id(li): ql.PackedLinear(li.buf, fmt, (n, k), "cuda", layout=engine_layout)
                                for li in lins}
                cands = {"ours": lambda x, li, out=None: held[id(li)](x),
                         "triton": lambda x, li, out=None: ql.qlinear_triton(x, li, out=out)}
                if t <= qmv_cuda.MAX_T and qmv_cuda.available():
                    cands["qmv"] = lambda x, li, out=None: qmv_cuda.qmv(x, li, out)
                    cands["qmv"].config = f"splits={qmv_cuda.choose_splits(n, lin.ng, sms)}"
                for name, make in variants.items():
                    cfg = make(fmt, n, k, t)
                    if cfg is not None:
                        cands[name] = lambda x, li, out=None, cfg=cfg: ql.qlinear_triton(x, li, cfg, out=out)
                        cands[name].config = repr(cfg)
                if args.qmv_variants and t <= qmv_cuda.MAX_T and qmv_cuda.available():
                    tiled = tiled or {id(li): qmv_cuda.TiledWeight(li) for li in lins}
                    lanes = lanes or {id(li): qmv_cuda.TiledWeight(li, lanes=True) for li in lins}
                    cands["qmv-tiled"] = lambda x, li, out=None: qmv_cuda.qmv(x, tiled[id(li)], out)
                    cands["qmv-lanes"] = lambda x, li, out=None: qmv_cuda.qmv(x, lanes[id(li)], out)
                    cands["qmv-lanes"].config = f"splits={qmv_cuda.choose_splits(n, lin.ng, sms)}"
                    # the launch's knobs on the lanes layout: split-K slices, then steps in flight x blocks per SM
                    for sp in split_sweep:
                        cands[f"qmv-lanes-s{sp}"] = (lambda x, li, out=None, sp=sp:
                                                     qmv_cuda.qmv(x, lanes[id(li)], out, splits=sp))
                    for un, mb in ((4, 2), (4, 4), (8, 2), (2, 4)):
                        cands[f"qmv-lanes-u{un}-b{mb}"] = (lambda x, li, out=None, un=un, mb=mb:
                                                           qmv_cuda.qmv(x, lanes[id(li)], out, unroll=un,
                                                                        min_blocks=mb))
                if shape_knobs and qmv_cuda.available():
                    for spec, kw in shape_knobs.items():
                        cands[f"ours-{spec}"] = with_shape_knobs(cands["ours"], n, kw)
                        cands[f"ours-{spec}"].config = f"shape override {kw}"
                if rows_sweep and t > qmv_cuda.MAX_T and qmv_cuda.available():
                    for r in rows_sweep:  # (ours-r8: the bits every other width must give)
                        cands[f"ours-r{r}"] = (lambda x, li, out=None, r=r: rows_into(x, held[id(li)], out, rows=r))
                        cands[f"ours-r{r}"].config = f"{-(-t // r)} launches of {qmv_cuda.column_groups(min(t, r))} " \
                                                     "column groups"
                if knobs and qmv_cuda.available() and (t <= qmv_cuda.MAX_T or rows_sweep):
                    lanes = lanes or {id(li): qmv_cuda.TiledWeight(li, lanes=True) for li in lins}
                    for spec, kw in knobs.items():
                        if t > qmv_cuda.MAX_T and (kw["tail"] or kw["xlate"]):
                            continue
                        if "rows" in kw:  # launches of that many rows
                            cands[f"qmv-lanes-{spec}"] = (lambda x, li, out=None, kw=kw:
                                                          rows_into(x, lanes[id(li)], out, **kw))
                        else:
                            cands[f"qmv-lanes-{spec}"] = (lambda x, li, out=None, kw=kw:
                                                          qmv_cuda.qmv(x, lanes[id(li)], out, **kw))
                if args.only:
                    cands = {name: fn for name, fn in cands.items() if name in args.only.split(",")}
                best, wide = None, {}  # T > 8: each width's output, against ours-r8's bits below
                for label, fn in cands.items():
                    try:
                        y = fn(x, lin)
                        torch.cuda.synchronize()
                    except Exception as e:
                        print(f"{op:12s} {fmt:12s} {t:3d} {label:22s} COMPILE/RUN FAILED: {e!r:.300}")
                        failures.append((op, fmt, t, label, "error"))
                        emit({"kind": "error", "op": op, "fmt": fmt, "T": t, "impl": label, "error": repr(e)[:2000]})
                        continue
                    # (a shape override sums in another order: its rows are checked against the reference only)
                    if t > qmv_cuda.MAX_T and rows_sweep and label.startswith(("ours", "qmv-lanes-")) \
                            and label.removeprefix("ours-") not in shape_knobs:
                        wide[label] = y
                    err = rel_rms(y[:, rows], ref)
                    if not err <= TOL_BF16:
                        print(f"!!! FAILED CORRECTNESS {op} {fmt} T={t} {label}: rel RMS {err:.3e} > {TOL_BF16}")
                        failures.append((op, fmt, t, label, err))
                    out = torch.empty_like(y)
                    us = one_call_us(lambda lin=lin: fn(x, lin, out))
                    calls = [(lambda li=li: fn(x, li, out)) for li in (lins * GRAPH_CALLS)[:GRAPH_CALLS]]
                    us_rot = rotating_us(calls, args.pdl)
                    row(op, fmt, t, label, us, nbytes, {"rel_rms": err, "config": getattr(fn, "config", ""),
                                                        "us_graph20": us_rot})
                    row(op, fmt, t, label + "@graph20", us_rot, nbytes)
                    if best is None or us_rot < best[1]:
                        best = (label, us_rot)
                for label, y in wide.items():
                    if "ours-r8" in wide and not torch.equal(y, wide["ours-r8"]):
                        print(f"!!! BITS DIFFER {op} {fmt} T={t} {label} from ours-r8")
                        failures.append((op, fmt, t, label, "bits"))
                if (variants or args.qmv_variants) and best:
                    print(f"{'':12s} {'':12s} {'':3s} best: {best[0]} {best[1]:.2f} us")
            del lins, lin, buf, held, tiled, lanes
            torch.cuda.empty_cache()
        if not args.no_baselines:
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            for t in ts:
                x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                us = one_call_us(lambda: F.linear(x, dense))
                row(op, "bf16", t, "cublas", us, dense.numel() * 2 + x.numel() * 2 + t * n * 2)
                tg = int4_tinygemm(x, n, k)
                if tg:
                    us = one_call_us(tg[0])
                    row(op, "int4_g128", t, "torch_tinygemm", us, tg[1] + x.numel() * 2 + t * n * 2)
                    del tg
            del dense
            torch.cuda.empty_cache()
        print(f"  ({time.time() - t_start:.0f} s)")
    if args.dense:
        bench_dense(ts, row, failures)
    if failures:
        print(f"\n!!! {len(failures)} FAILURES: {failures}")
        return 1
    print(f"\nall correct; {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
