#!/usr/bin/env python3
"""The CPU decode / verify GDN step's state read, two layouts side by side in one process.

    python3 scripts/probe_gdn_read.py [--threads 1] [--new 256]

``kernels/gdn.py gated_delta_rule_step`` reads the decayed state once a token: both S^T k and S^T q. It used to run
``bmm(S^T, [k q])`` ([dv, dk] @ [dk, 2], the state's transpose on the left); it now runs ``bmm([k q]^T, S)``
([2, dk] @ [dk, dv]). The probe times the two bmm forms at the bundled model's and the 27B shape's GDN heads, checks
that they give the same bits, then decodes the README's short-code prompt with the bundled model twice in one
process - the engine as it is, and with the previous step function swapped in - greedy and DFlash2 K=7, and checks
both decoded the same tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

import torch  # noqa: E402

from ninfer_bench.engine.model import cache as cache_mod  # noqa: E402
from ninfer_bench.engine.model import hybrid as model_mod  # noqa: E402
from ninfer_bench.engine.runtime.engine import Engine  # noqa: E402
from ninfer_bench.kernels import gdn  # noqa: E402
from ninfer_bench.suites.common import DEFAULT_PROMPT  # noqa: E402


def previous_step(q, k, v, g, beta, state, *, scale=None, return_states=False):
    """gated_delta_rule_step before the change: the read as bmm(S^T, [k q]) (kept here for the comparison)."""
    B, T, Hk, Hv, dk, dv = gdn._check(q, k, v, g, beta, state)
    scale = dk ** -0.5 if scale is None else scale
    BH = B * Hv
    kf = gdn._to_v_heads(k, Hv)
    qf = gdn._to_v_heads(q, Hv) * scale
    kq = torch.stack([kf, qf], dim=-1).transpose(0, 1).reshape(T, BH, dk, 2)
    k_dot_q = (kf * qf).sum(-1).transpose(0, 1).reshape(T, BH, 1)
    vf = v.to(torch.float32).transpose(0, 1).reshape(T, BH, dv)
    decay = g.to(torch.float32).exp().transpose(0, 1).reshape(T, BH, 1, 1)
    bf = beta.to(torch.float32).transpose(0, 1).reshape(T, BH, 1)
    prev = state.to(torch.float32).reshape(BH, dk, dv)
    bufs = prev.new_empty(T, BH, dk, dv) if return_states else [prev.new_empty(BH, dk, dv) for _ in range(min(T, 2))]
    outs = []
    for t in range(T):
        S = bufs[t] if return_states else bufs[t % 2]
        torch.mul(prev, decay[t], out=S)
        read = torch.bmm(S.transpose(1, 2), kq[t])
        u = bf[t] * (vf[t] - read[..., 0])
        S.baddbmm_(kq[t][:, :, :1], u.unsqueeze(1))
        outs.append(read[..., 1] + k_dot_q[t] * u)
        prev = S
    o = (torch.stack(outs, 0) if T else vf.new_empty(0, BH, dv)).view(T, B, Hv, dv).transpose(0, 1)
    o = o.to(v.dtype).contiguous()
    new_state = prev.view(B, Hv, dk, dv)
    if T == 0 or return_states:
        new_state = new_state.clone()
    if return_states:
        return o, new_state, bufs.view(T, B, Hv, dk, dv).transpose(0, 1)
    return o, new_state


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def ops() -> None:
    print("state read, microseconds a call (same bits: yes/no)")
    for name, hv, dk, dv in (("bundled 3 heads x 128 x 128", 3, 128, 128), ("27B 48 heads x 128 x 128", 48, 128, 128)):
        S, kq = torch.randn(hv, dk, dv), torch.randn(hv, dk, 2)
        kq_rows = kq.transpose(1, 2).contiguous()
        old, new = torch.bmm(S.transpose(1, 2), kq), torch.bmm(kq_rows, S)
        same = torch.equal(old, new.transpose(1, 2))
        print(f"  {name}: bmm(S^T, [k q]) {per_call_us(lambda: torch.bmm(S.transpose(1, 2), kq)):.1f}, "
              f"bmm([k q]^T, S) {per_call_us(lambda: torch.bmm(kq_rows, S)):.1f}, same bits: {'yes' if same else 'no'}")


def decode(new: int) -> None:
    eng_kw = dict(device="cpu", max_context=8192)
    ids = None
    print(f"bundled model, short-code prompt, {new} new tokens, greedy (one process, steps swapped in turn)")
    for spec, k in (("none", None), ("dflash2", 7)):
        got = {}
        for label, step in (("previous", previous_step), ("current", gdn.gated_delta_rule_step)):
            model_mod.gated_delta_rule_step = cache_mod.gated_delta_rule_step = step  # decode / verify, rollback
            eng = Engine.load("models/ninfer-code-small.ninfer", spec=spec, draft_tokens=k, **eng_kw)
            ids = ids or eng.tokenizer.encode(DEFAULT_PROMPT.read_text())
            eng.generate(ids, max_new_tokens=32, ignore_eos=True)  # warm-up
            res = [eng.generate(ids, max_new_tokens=new, ignore_eos=True) for _ in range(3)]
            tok_s = sorted((len(r.tokens) - 1) / r.decode_s for r in res)[1]
            got[label] = (res[0].tokens, tok_s)
            print(f"  {spec:8s} {label:8s}: {tok_s:7.1f} tok/s (median of 3)")
        same = got["previous"][0] == got["current"][0]
        print(f"  {spec:8s} current / previous {got['current'][1] / got['previous'][1]:.2f}x, same tokens: "
              f"{'yes' if same else 'NO'}")
    model_mod.gated_delta_rule_step = cache_mod.gated_delta_rule_step = gdn.gated_delta_rule_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the op timings (default: torch's)")
    ap.add_argument("--new", type=int, default=256, help="new tokens a decode")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops()
    decode(args.new)


if __name__ == "__main__":
    main()
