"""Fused GDN decode / verify and the fused decode glue at the 27B shape, bf16, on one CUDA GPU.

Gated DeltaNet (Hk=16, Hv=48, dk=dv=128, conv_dim 10240, W=4): ``gdn_decode`` (prep + recurrence launches, plus
the norm kernel when block_v < dv) for B = 1 / 8 slots and T = 1 / 8 new tokens, with and without per-token
snapshots (``states_out``), the state-only rollback form (keep + conv_init / ssm_init, z=None), and several
(block_v, num_warps) launch shapes (128 = gated RMSNorm fused; ``--sweep`` for more), against the eager torch path of
engine/model/hybrid.py (conv, l2norms, gates, gated_delta_rule_step, cache writes, gated RMSNorm). Then the fused glue
(hidden 5120): add_rms_norm, rms_norm, silu_mul (I = 17408), sigmoid_mul (H*hd = 6144) and attn_prologue (H=24,
Hkv=4, hd=256, partial rotary 64, int8 cache) against their eager torch equivalents.

Per case: correctness vs the fp32 reference first (printed loudly when off), then median us by
``triton.testing.do_bench`` (L2 flushed before each call) and by CUDA-graph replay (one graph calling every slot
set once: the state of all sets is several times the 50 MB L2), bytes moved (the floor: the fp32 state read and
written once, 3 MB each way per slot and layer, plus snapshots), GB/s and % of the copy bandwidth measured in the
same run.

    python scripts/bench_fused.py       # from a plain checkout; JSON lines to $OUT/fused.jsonl when OUT is set
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import copy_bandwidth, graph_us, resource_report  # noqa: E402
from _bootstrap import ensure_package  # noqa: E402

ensure_package()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ninfer_bench.kernels.kv_quant import quantize_kv  # noqa: E402
from ninfer_bench.kernels import fused as fu  # noqa: E402
from ninfer_bench.kernels import gdn_triton as gt  # noqa: E402
from ninfer_bench.kernels.conv import causal_conv1d  # noqa: E402
from ninfer_bench.kernels.gdn import gated_delta_rule_step, l2norm  # noqa: E402
from ninfer_bench.kernels.norm import gated_rms_norm, rms_norm  # noqa: E402
from ninfer_bench.kernels.rope import apply_rope, rope_tables  # noqa: E402

DEVICE = "cuda"
DT = torch.bfloat16
HK, HV, DK, DV, W = 16, 48, 128, 128, 4
C = 2 * HK * DK + HV * DV  # 10240
HIDDEN, INTER, H, HKV, HD, RD = 5120, 17408, 24, 4, 256, 64
EPS = 1e-6
GDN_CASES = [(1, 1, False), (8, 1, False), (1, 8, False), (1, 8, True), (8, 8, False), (8, 8, True)]
# (block_v, num_warps) launch shapes timed besides the default plan; --sweep adds more
CONFIGS = ((128, 4), (32, 2), (16, 1))
SWEEP = ((128, 8), (64, 4), (64, 2), (32, 1), (16, 2), (8, 1))
TOL = {"out": 1e-2, "ssm": 1e-4, "states_out": 1e-4}  # rel RMS vs fp32 reference (bf16 output rounding)
TOL_GLUE = 1e-2
ROTATE_BYTES = 256 * 2**20  # graph replays rotate over this much GDN state, five times the H200's L2
GRAPH_CALLS = 20  # a single-call case is captured this many times, so the graph's launch cost is spread out
SEED = 0
STATE_BYTES = HV * DK * DV * 4  # 3 MB per slot and layer


def timings(fns, nbytes: int, bw: float) -> dict:
    from triton.testing import do_bench

    fns[0]()  # compile outside the timings
    us = do_bench(fns[0], warmup=10, rep=60, return_mode="median") * 1e3
    us_graph = graph_us(fns if len(fns) > 1 else fns * GRAPH_CALLS)
    best = min(us, us_graph)
    return {"us_median": round(us, 2), "us_graph": round(us_graph, 2), "bytes": nbytes,
            "gbps": round(nbytes / (best * 1e-6) / 1e9, 1), "copy_bw_frac": round(nbytes / (best * 1e-6) / bw, 3)}


def rel_rms(a, b) -> float:
    if not torch.isfinite(a.float()).all():
        return float("nan")
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ---- Gated DeltaNet ---------------------------------------------------------------------------------------------

class GDNCase:
    """Caches of `copies` disjoint slot sets of B slots, weights, and one layer's projection outputs for T tokens."""

    def __init__(self, b: int, t: int):
        g = torch.Generator(device=DEVICE).manual_seed(SEED)
        rnd = lambda *s, scale=1.0: torch.randn(*s, generator=g, device=DEVICE) * scale  # noqa: E731
        self.b, self.t = b, t
        self.copies = max(2, min(64, math.ceil(ROTATE_BYTES / (b * STATE_BYTES))))
        slots = b * self.copies
        self.ssm = rnd(slots, HV, DK, DV, scale=0.05)
        self.conv = rnd(slots, C, W - 1).to(DT)
        proj = rnd(b, t, C + HV * DV + 2 * HV).to(DT)  # one fused projection output, split into views
        self.qkv, self.z, self.bb, self.aa = torch.split(proj, [C, HV * DV, HV, HV], dim=-1)
        self.conv_w = rnd(C, W, scale=0.5)
        self.A_log, self.dt_bias, self.norm_w = rnd(HV, scale=0.5), rnd(HV), 1.0 + rnd(DV, scale=0.1)
        self.slot_sets = [torch.arange(i * b, (i + 1) * b, device=DEVICE).flip(0) for i in range(self.copies)]
        self.keep = torch.randint(1, t + 1, (b,), generator=g, device=DEVICE)
        self.states = torch.empty(b, t, HV, DK, DV, device=DEVICE) if t > 1 else None

    def args(self, slots):
        return (self.qkv, self.z, self.bb, self.aa, self.conv, self.conv_w, self.ssm, slots, self.A_log,
                self.dt_bias, self.norm_w, EPS)

    def nbytes(self, snap: bool, rollback: bool = False) -> int:
        state = 2 * self.b * STATE_BYTES + (self.b * self.t * STATE_BYTES if snap else 0)
        io = self.b * self.t * (C + 2 * HV) * 2 + (0 if rollback else 2 * self.b * self.t * HV * DV * 2)
        return state + io + 2 * self.b * C * (W - 1) * 2


def eager_gdn(qkv, z, b, a, conv, conv_w, ssm, slots, A_log, dt_bias, norm_w, eps, snap=False):
    """engine/model/hybrid.py gated_deltanet between the projections and out_proj (decode / snapshot verify)."""
    bsz, t, _ = qkv.shape
    conv_old = conv[slots]
    y, conv_new = causal_conv1d(qkv, conv_w, conv_old)
    q, k, v = torch.split(y, [HK * DK, HK * DK, HV * DV], dim=-1)
    q, k = l2norm(q.reshape(bsz, t, HK, DK)), l2norm(k.reshape(bsz, t, HK, DK))
    beta = torch.sigmoid(b.float())
    g = -torch.exp(A_log) * F.softplus(a.float() + dt_bias)
    res = gated_delta_rule_step(q, k, v.reshape(bsz, t, HV, DV), g, beta, ssm[slots], return_states=snap)
    conv[slots] = conv_new.to(conv.dtype)
    ssm[slots] = res[1]
    o = gated_rms_norm(res[0].to(qkv.dtype), z.reshape(bsz, t, HV, DV), norm_w, eps)
    return o.reshape(bsz, t, HV * DV)


def check_gdn(case: GDNCase, snap: bool, cfg) -> dict:
    """rel RMS of out / ssm / states_out vs gdn_decode_ref, on NaN-filled outputs; conv state bit-exact."""
    slots = case.slot_sets[0]
    saved = (case.ssm.clone(), case.conv.clone())
    new_buffer = gt._new_buffer
    gt._new_buffer = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    try:
        st_k = torch.full_like(case.states, float("nan")) if snap else None
        out = gt.gdn_decode(*case.args(slots), states_out=st_k, config=cfg)
    finally:
        gt._new_buffer = new_buffer
    ssm_k, conv_k = case.ssm[slots].clone(), case.conv[slots].clone()
    case.ssm.copy_(saved[0])
    case.conv.copy_(saved[1])
    st_r = torch.empty_like(case.states) if snap else None
    ref = gt.gdn_decode_ref(*case.args(slots), states_out=st_r)
    errs = {"out": rel_rms(out, ref), "ssm": rel_rms(ssm_k, case.ssm[slots])}
    if snap:
        errs["states_out"] = rel_rms(st_k, st_r)
    conv_exact = torch.equal(conv_k, case.conv[slots])
    case.ssm.copy_(saved[0])
    case.conv.copy_(saved[1])
    return {"rel_rms": {k: float(f"{v:.3g}") for k, v in errs.items()}, "conv_exact": conv_exact,
            "ok": conv_exact and all(errs[k] <= TOL[k] for k in errs)}


def bench_gdn(bw: float, emit, sweep: bool) -> tuple[list, int]:
    rows, failures = [], 0
    for b, t, snap in GDN_CASES:
        case = GDNCase(b, t)
        base = {"B": b, "T": t, "snapshots": snap}
        default = gt.plan(DK, DV)
        configs = [default] + [gt.GDNConfig(bv, nw) for bv, nw in CONFIGS + (SWEEP if sweep else ())]
        for cfg in dict.fromkeys(configs):
            bv = cfg.block_v
            rec = {"op": "gdn_decode", **base, "block_v": bv, "num_warps": cfg.num_warps,
                   "default": cfg == default}
            try:
                rec.update(check_gdn(case, snap, cfg))
                if not rec["ok"]:
                    failures += 1
                    print(f"!!!!! WRONG RESULT gdn_decode {base} block_v={bv}: {rec['rel_rms']} (tol {TOL}) !!!!!")
                st = case.states if snap else None
                fns = [lambda s=s: gt.gdn_decode(*case.args(s), states_out=st, config=cfg) for s in case.slot_sets]
                rec.update(timings(fns, case.nbytes(snap), bw))
            except Exception as exc:
                failures += 1
                rec.update(ok=False, error=repr(exc)[:400])
                print(f"!!!!! FAILED gdn_decode {base} block_v={bv}: {exc!r}")
                traceback.print_exc()
            rows.append(emit(rec))
        rows.append(emit(bench_gdn_eager(case, snap, bw, base)))
        if t > 1 and not snap:
            rows.append(emit(bench_rollback(case, bw, base)))
        del case
        torch.cuda.empty_cache()
    return rows, failures


def bench_gdn_eager(case: GDNCase, snap: bool, bw: float, base: dict) -> dict:
    rec = {"op": "gdn_eager_torch", **base}
    try:
        fns = [lambda s=s: eager_gdn(*case.args(s), snap=snap) for s in case.slot_sets]
        rec.update(timings(fns, case.nbytes(snap), bw))
    except Exception as exc:
        rec["error"] = repr(exc)[:400]
    return rec


def bench_rollback(case: GDNCase, bw: float, base: dict) -> dict:
    """The 'recompute' rollback: state-only rerun from the pre-verify state with keep[b] accepted tokens."""
    rec = {"op": "gdn_rollback", **base}
    try:
        conv_init = case.conv[case.slot_sets[0]].clone()
        ssm_init = case.ssm[case.slot_sets[0]].clone()

        def call(s):
            a = list(case.args(s))
            a[1] = None  # z: no output
            gt.gdn_decode(*a, keep=case.keep, conv_init=conv_init, ssm_init=ssm_init)

        rec.update(timings([lambda s=s: call(s) for s in case.slot_sets], case.nbytes(False, rollback=True), bw))
    except Exception as exc:
        rec["error"] = repr(exc)[:400]
    return rec


# ---- fused glue -------------------------------------------------------------------------------------------------

def glue_cases(rows_n: int):
    """(name, fused fn, eager fn, reference fn, bytes) at rows_n = B * T rows; inputs rotate over a few sets."""
    g = torch.Generator(device=DEVICE).manual_seed(SEED)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=DEVICE) * scale)  # noqa: E731
    x, r, w = rnd(rows_n, HIDDEN).to(DT), rnd(rows_n, HIDDEN, scale=4).to(DT), rnd(HIDDEN, scale=0.1)
    gu = rnd(rows_n, 2 * INTER, scale=2).to(DT)
    o, gate = rnd(rows_n, H * HD).to(DT), rnd(rows_n, H * HD).to(DT)
    yield ("add_rms_norm", lambda: fu.add_rms_norm(x, r, w, EPS), lambda: _eager_add_norm(x, r, w),
           lambda: fu.add_rms_norm_ref(x, r, w, EPS), 4 * rows_n * HIDDEN * 2)
    yield ("rms_norm", lambda: fu.rms_norm(x, w, EPS), lambda: rms_norm(x, w, EPS), lambda: fu.rms_norm_ref(x, w, EPS),
           2 * rows_n * HIDDEN * 2)
    yield ("silu_mul", lambda: fu.silu_mul(gu, INTER), lambda: F.silu(gu[:, :INTER]) * gu[:, INTER:],
           lambda: fu.silu_mul_ref(gu, INTER), 3 * rows_n * INTER * 2)
    yield ("sigmoid_mul", lambda: fu.sigmoid_mul(o, gate), lambda: o * torch.sigmoid(gate),
           lambda: fu.sigmoid_mul_ref(o, gate), 3 * rows_n * H * HD * 2)


def _eager_add_norm(x, r, w):
    h = r + x
    return rms_norm(h, w, EPS), h


class Prologue:
    """Attention prologue inputs at B slots x T tokens with an int8 cache of 4096 positions per slot."""

    def __init__(self, b: int, t: int, cap: int = 4096):
        g = torch.Generator(device=DEVICE).manual_seed(SEED)
        rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=DEVICE) * scale)  # noqa: E731
        self.b, self.t = b, t
        self.cos, self.sin = rope_tables(RD, 1e7, cap, DEVICE)
        self.qg, self.kv = rnd(b, t, H, 2 * HD).to(DT), rnd(b, t, 2 * HKV * HD).to(DT)
        self.qw, self.kw = rnd(HD, scale=0.1), rnd(HD, scale=0.1)
        (self.kc, self.ks), (self.vc, self.vs) = quantize_kv(rnd(b, HKV, cap, HD)), quantize_kv(rnd(b, HKV, cap, HD))
        self.slots = torch.arange(b, device=DEVICE).flip(0)
        self.pos = (cap - t - 7 + torch.arange(t, device=DEVICE)).expand(b, t).contiguous()

    def args(self):
        return (self.qg, self.kv, self.qw, self.kw, self.cos, self.sin, self.kc, self.vc, self.ks, self.vs,
                self.slots, self.pos, EPS)

    def eager(self):
        """engine/model/hybrid.py attention up to the attention call (rms norms, rope, int8 cache write)."""
        b, t = self.b, self.t
        q, gate = self.qg[..., :HD], self.qg[..., HD:].reshape(b, t, H * HD)
        k, v = self.kv.split([HKV * HD, HKV * HD], dim=-1)
        q = rms_norm(q, self.qw, EPS)
        k = rms_norm(k.view(b, t, HKV, HD), self.kw, EPS)
        cos, sin = self.cos[self.pos], self.sin[self.pos]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        sl = self.slots[:, None].expand(b, t)
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v.view(b, t, HKV, HD))
        self.kc[sl, :, self.pos], self.vc[sl, :, self.pos] = kq, vq
        self.ks[sl, :, self.pos], self.vs[sl, :, self.pos] = ks, vs
        return q, gate

    def nbytes(self) -> int:
        n = self.b * self.t
        return n * (H * 2 * HD * 2 + 2 * HKV * HD * 2 + 2 * H * HD * 2 + 2 * HKV * (HD + 2 * math.ceil(HD / 64)))


def bench_glue(bw: float, emit) -> tuple[list, int]:
    rows, failures = [], 0
    for b, t in ((1, 1), (8, 1), (8, 8)):
        n = b * t
        for name, fast, eager, ref, nbytes in glue_cases(n):
            rec = {"op": name, "rows": n}
            try:
                got, want = fast(), ref()
                got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
                rec["rel_rms"] = max(rel_rms(a, c) for a, c in zip(got, want))
                rec["ok"] = rec["rel_rms"] <= TOL_GLUE
                rec.update(timings([fast], nbytes, bw))
                rec["eager_us_graph"] = timings([eager], nbytes, bw)["us_graph"]
            except Exception as exc:
                rec.update(ok=False, error=repr(exc)[:400])
                traceback.print_exc()
            failures += not rec.get("ok", False)
            if not rec.get("ok", False):
                print(f"!!!!! WRONG RESULT / FAILED {name} rows={n}: {rec.get('rel_rms', rec.get('error'))} !!!!!")
            rows.append(emit(rec))
        rows.append(emit(bench_prologue(b, t, bw)))
        failures += not rows[-1].get("ok", False)
    return rows, failures


def bench_prologue(b: int, t: int, bw: float) -> dict:
    rec = {"op": "attn_prologue_int8", "rows": b * t, "B": b, "T": t}
    try:
        p = Prologue(b, t)
        saved = [x.clone() for x in (p.kc, p.vc, p.ks, p.vs)]
        q, gate = fu.attn_prologue(*p.args())
        got = [x.clone() for x in (p.kc, p.vc, p.ks, p.vs)]
        for x, s in zip((p.kc, p.vc, p.ks, p.vs), saved):
            x.copy_(s)
        qr, gr = fu.attn_prologue_ref(*p.args())
        sl = p.slots[:, None].expand(b, t)
        deq = lambda c, s: c[sl, :, p.pos].float() * s[sl, :, p.pos].float().repeat_interleave(64, -1)  # noqa: E731
        rec["rel_rms"] = max(rel_rms(q, qr), rel_rms(deq(got[0], got[2]), deq(p.kc, p.ks)),
                             rel_rms(deq(got[1], got[3]), deq(p.vc, p.vs)))
        rec["ok"] = rec["rel_rms"] <= TOL_GLUE and torch.equal(gate, gr)
        rec.update(timings([lambda: fu.attn_prologue(*p.args())], p.nbytes(), bw))
        rec["eager_us_graph"] = timings([p.eager], p.nbytes(), bw)["us_graph"]
    except Exception as exc:
        rec.update(ok=False, error=repr(exc)[:400])
        traceback.print_exc()
    return rec


# ---- main -------------------------------------------------------------------------------------------------------

def kernel_resources() -> list:
    return resource_report({**{f"gdn.{k}": v for k, v in gt._kernels().items() if k != "interpreted"},
                            **{f"fused.{k}": v for k, v in fu._kernels().items() if k != "interpreted"}})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gdn-only", action="store_true", help="skip the fused glue ops")
    parser.add_argument("--sweep", action="store_true", help="time more gdn_decode launch shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_fused: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    t0 = time.time()
    out_dir = os.environ.get("OUT")
    sink = open(Path(out_dir) / "fused.jsonl", "w") if out_dir else None

    def emit(rec):
        if sink:
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
        return rec

    bw = copy_bandwidth()
    emit({"op": "env", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
          "copy_TBps": round(bw / 1e12, 3), "sms": torch.cuda.get_device_properties(0).multi_processor_count})
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s  triton {triton.__version__}")
    gdn_rows, failures = bench_gdn(bw, emit, args.sweep)
    glue_rows = []
    if not args.gdn_only:
        glue_rows, f2 = bench_glue(bw, emit)
        failures += f2
    for row in kernel_resources():
        emit({"op": "resources", **row})
    if sink:
        sink.close()
    print_tables(gdn_rows, glue_rows)
    print(f"{'ALL CORRECT' if not failures else f'{failures} FAILURES'}; {time.time() - t0:.0f} s")
    return 1 if failures else 0


def _fmt(x, f):
    return format(x, f) if isinstance(x, (int, float)) else "-"


def print_tables(gdn_rows, glue_rows):
    print(f"\n{'op':16} {'B':>2} {'T':>2} {'snap':>4} {'BV':>4} {'wp':>2} {'us':>8} {'us_graph':>8} {'MB':>7} "
          f"{'%copy':>6} {'rel_rms':>8}")
    for r in gdn_rows:
        frac = 100 * r["copy_bw_frac"] if "copy_bw_frac" in r else None
        err = max(r["rel_rms"].values()) if "rel_rms" in r else None
        print(f"{r['op']:16} {r['B']:>2} {r['T']:>2} {str(r['snapshots'])[0]:>4} {str(r.get('block_v', '-')):>4} "
              f"{str(r.get('num_warps', '-')):>2} {_fmt(r.get('us_median'), '8.1f')} {_fmt(r.get('us_graph'), '8.1f')} "
              f"{_fmt(r.get('bytes', 0) / 1e6, '7.2f')} {_fmt(frac, '6.1f')} {_fmt(err, '8.1e')}"
              f"{'  <- default' if r.get('default') else ''}"
              + (f"  ERROR {r['error'][:80]}" if "error" in r else ""))
    if glue_rows:
        print(f"\n{'op':20} {'rows':>4} {'us':>7} {'us_graph':>8} {'eager_graph':>11} {'%copy':>6} {'rel_rms':>8}")
        for r in glue_rows:
            frac = 100 * r["copy_bw_frac"] if "copy_bw_frac" in r else None
            print(f"{r['op']:20} {r['rows']:>4} {_fmt(r.get('us_median'), '7.1f')} {_fmt(r.get('us_graph'), '8.1f')} "
                  f"{_fmt(r.get('eager_us_graph'), '11.1f')} {_fmt(frac, '6.1f')} {_fmt(r.get('rel_rms'), '8.1e')}"
                  + (f"  ERROR {r['error'][:80]}" if "error" in r else ""))


if __name__ == "__main__":
    sys.exit(main())
