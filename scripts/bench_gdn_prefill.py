"""A Gated DeltaNet layer's prefill glue (kernels/gdn_prefill.py) at the 27B shape on one CUDA GPU.

One prompt chunk (B = 1, T = 2,048 by default; Hk = 16, Hv = 48, dk = dv = 128, conv width 4, bf16): ``conv_qkv``
(causal conv + SiLU + q / k L2 norms, one launch), ``conv_state_update``, ``gates`` and ``gated_rms_norm``, each
first checked against its fp32 reference (relative RMS; the state update for equality), then timed by
``triton.testing.do_bench`` (median) beside the eager torch ops they replace (kernels/conv.causal_conv1d,
kernels/gdn.l2norm; the gather, concatenation and scatter of the state; the gates' eight ops;
kernels/norm.gated_rms_norm), with bytes moved (each input read once, each output written once), GB/s and the share
of the copy bandwidth measured in the same run.

    python scripts/bench_gdn_prefill.py [--t 2048] [--block-t 16,32:8,64] [--baseline .old/kernels/gdn_prefill.py]

``--block-t``: conv_qkv's tokens a program, each timed, ``BT:WARPS`` with its warps too (the module's default when
not given).
``--baseline``: another copy of kernels/gdn_prefill.py (e.g. the tree before, ``git archive REV | tar -x -C .old``)
timed in the same process, its outputs compared with this tree's.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import copy_bandwidth  # noqa: E402
from _bootstrap import ensure_package  # noqa: E402

ensure_package()

import torch  # noqa: E402

from ninfer_bench.kernels import gdn_prefill as gp  # noqa: E402
from ninfer_bench.kernels.conv import causal_conv1d  # noqa: E402
from ninfer_bench.kernels.gdn import l2norm  # noqa: E402
from ninfer_bench.kernels.norm import gated_rms_norm as eager_gated_norm  # noqa: E402

HK, HV, DK, DV, W = 16, 48, 128, 128, 4
C = 2 * HK * DK + HV * DV
EPS = 1e-6


def rel_rms(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def load_baseline(path: str):
    """kernels/gdn_prefill.py from another tree, imported as a module of this package (its relative imports resolve
    to this tree's kernels)."""
    spec = importlib.util.spec_from_file_location("ninfer_bench.kernels._baseline_gdn_prefill", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def median_us(fn) -> float:
    from triton.testing import do_bench

    return 1e3 * do_bench(fn, warmup=10, rep=100, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--t", type=int, default=2048, help="tokens of the chunk")
    ap.add_argument("--b", type=int, default=1, help="sequences of the chunk")
    ap.add_argument("--block-t", default="", help="conv_qkv's BLOCK_T[:WARPS] values to time, comma-separated")
    ap.add_argument("--baseline", default="", help="another kernels/gdn_prefill.py to time beside this tree's")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gdn_prefill: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, dt, b, t = "cuda", torch.bfloat16, args.b, args.t
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(b, t, C + HV * DV, generator=g).to(dt).to(dev)  # qkvz: qkv and z are views of one row
    qkv, z = wide[..., :C], wide[..., C:]
    conv_w = (0.5 * torch.randn(C, W, generator=g)).to(dev)
    state = torch.randn(b + 1, C, W - 1, generator=g).to(dt).to(dev)
    slots = torch.arange(1, b + 1, device=dev)
    o = torch.randn(b, t, HV, DV, generator=g).to(dt).to(dev)
    norm_w = (1 + 0.1 * torch.randn(DV, generator=g)).to(dt).to(dev)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s  B {b}  T {t}")

    refs = gp.conv_qkv_ref(qkv, conv_w, state[slots], HK, DK, HV, DV)
    conv_bytes = 2 * b * t * C * qkv.element_size() + conv_w.numel() * 4 + b * C * (W - 1) * state.element_size()
    rows = []

    def row(name, fn, nbytes, err):
        us = median_us(fn)
        rows.append((name, us, nbytes / us / 1e3, 100 * nbytes / (us * 1e-6) / bw, err))

    default = gp.BLOCK_T, gp.CONV_WARPS
    for item in [x for x in args.block_t.split(",") if x] or [f"{default[0]}:{default[1]}"]:
        bt, _, warps = item.partition(":")
        gp.BLOCK_T, gp.CONV_WARPS = int(bt), int(warps or default[1])
        out = gp.conv_qkv(qkv, conv_w, state, slots, HK, DK, HV, DV)
        err = max(rel_rms(x, r) for x, r in zip(out, refs))
        row(f"conv_qkv BLOCK_T {gp.BLOCK_T} warps {gp.CONV_WARPS}",
            lambda: gp.conv_qkv(qkv, conv_w, state, slots, HK, DK, HV, DV), conv_bytes, err)
    gp.BLOCK_T, gp.CONV_WARPS = default
    if args.baseline:
        base = load_baseline(args.baseline)
        out = base.conv_qkv(qkv, conv_w, state, slots, HK, DK, HV, DV)
        mine = gp.conv_qkv(qkv, conv_w, state, slots, HK, DK, HV, DV)
        same = all(torch.equal(x, y) for x, y in zip(out, mine))
        err = max(rel_rms(x, r) for x, r in zip(out, refs))
        row(f"conv_qkv baseline ({'same bits' if same else 'other bits'})",
            lambda: base.conv_qkv(qkv, conv_w, state, slots, HK, DK, HV, DV), conv_bytes, err)

    def eager_conv():
        y, _ = causal_conv1d(qkv, conv_w, state[slots])
        q, k, v = torch.split(y, [HK * DK, HK * DK, HV * DV], dim=-1)
        return l2norm(q.reshape(b, t, HK, DK)), l2norm(k.reshape(b, t, HK, DK)), v.reshape(b, t, HV, DV)

    err = max(rel_rms(x, r) for x, r in zip(eager_conv(), refs))
    row("conv + l2norm eager", eager_conv, conv_bytes, err)

    # the slot's new conv state: in place (state_b's slots hold the same values before every call: the window of a
    # T >= W - 1 chunk does not depend on the old state) against the eager gather, concatenation and scatter
    state_b, state_e = state.clone(), state.clone()
    gp.conv_state_update(qkv, state_b, slots)
    gp.conv_state_update_ref(qkv, state_e, slots)
    same = torch.equal(state_b, state_e)
    state_bytes = 2 * b * C * (W - 1) * state.element_size()

    def eager_state():
        old = state_e[slots]
        state_e[slots] = torch.cat([old, qkv[:, -(W - 1):].transpose(1, 2)], dim=-1)[..., -(W - 1):]

    row(f"conv_state_update ({'same' if same else 'OTHER'} values)", lambda: gp.conv_state_update(qkv, state_b, slots),
        state_bytes, 0.0 if same else 1.0)
    row("conv state eager (gather, cat, scatter)", eager_state, state_bytes, 0.0)

    ba = torch.randn(b, t, 2 * HV, generator=g).to(dt).to(dev)
    bb, aa = ba[..., :HV], ba[..., HV:]
    a_log = torch.randn(HV, generator=g).to(dev)
    dt_bias = torch.randn(HV, generator=g).to(dev)
    gref = gp.gates_ref(bb, aa, a_log, dt_bias)
    gout = gp.gates(bb, aa, a_log, dt_bias)
    gates_bytes = b * t * HV * (2 * ba.element_size() + 8)
    row("gates", lambda: gp.gates(bb, aa, a_log, dt_bias), gates_bytes,
        max(rel_rms(x, r) for x, r in zip(gout, gref)))
    row("gates eager (8 ops)", lambda: gp.gates_ref(bb, aa, a_log, dt_bias), gates_bytes, 0.0)

    nref = gp.gated_rms_norm_ref(o, z, norm_w, EPS)
    norm_bytes = 3 * b * t * HV * DV * o.element_size()
    row("gated_rms_norm", lambda: gp.gated_rms_norm(o, z, norm_w, EPS), norm_bytes,
        rel_rms(gp.gated_rms_norm(o, z, norm_w, EPS).view_as(nref), nref))
    row("gated_rms_norm eager", lambda: eager_gated_norm(o, z.reshape(o.shape), norm_w, EPS), norm_bytes,
        rel_rms(eager_gated_norm(o, z.reshape(o.shape), norm_w, EPS), nref))

    print(f"{'kernel':40s} {'us':>9s} {'GB/s':>8s} {'% copy':>7s} {'rel RMS':>9s}")
    for name, us, gbps, frac, err in rows:
        print(f"{name:40s} {us:9.2f} {gbps:8.0f} {frac:7.1f} {err:9.2e}")
    bad = [r[0] for r in rows if r[4] > 1e-2]
    if bad:
        print(f"OFF against the fp32 reference: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
