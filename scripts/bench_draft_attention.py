"""A block drafter's attention at the 27B drafter's shape on a GPU: kernels/draft_attention.py by context ranges
(``splits``) beside the torch path it replaces (the slots' rows gathered, the block's keys written after them, the
additive mask, ``sdpa_rows``), each call replayed from a CUDA graph, microseconds a layer. Every variant is checked
against the fp32 reference first.

    python scripts/bench_draft_attention.py [--batch 1,8] [--splits 1,2,4,8,16,32] [--cap 2048] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

from ninfer_bench.kernels import draft_attention as da  # noqa: E402
from ninfer_bench.kernels.attention import rows_bias, sdpa_rows  # noqa: E402


def case(b: int, cap: int, s: int = 8, h: int = 40, hkv: int = 10, hd: int = 128, layers: int = 5):
    """The drafter's cache ``kv [2, layers, B + 1, cap + s + 1, Hkv, hd]`` (a full ring), a block's q / k / v."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = cap + s + 1
    kv = torch.randn(2, layers, b + 1, rows, hkv, hd, generator=g, device=dev, dtype=torch.float32).to(dt)
    length = torch.tensor([5000 + 17 * i for i in range(b)], device=dev)
    pos = torch.full((b + 1, rows), -1, dtype=torch.long, device=dev)
    for i in range(b):
        p = torch.arange(int(length[i]) - cap, int(length[i]), device=dev)
        pos[i, p % cap] = p
    q = torch.randn(b, s, h, hd, generator=g, device=dev, dtype=torch.float32).to(dt)
    kb = torch.randn(b, s, hkv, hd, generator=g, device=dev, dtype=torch.float32).to(dt)
    vb = torch.randn(b, s, hkv, hd, generator=g, device=dev, dtype=torch.float32).to(dt)
    return dict(kv=kv, q=q, k_blk=kb, v_blk=vb, slots=torch.arange(b, device=dev), pos=pos, length=length, cap=cap)


def torch_path(c):
    """The drafter's torch path for one layer (engine/model/dflash.py with ``room``): gather, write, mask, matmuls. The
    drafter builds the mask once a block for its layers; here each call builds it, about 5 small launches."""
    q, kb, vb, slots, cap = c["q"], c["k_blk"], c["v_blk"], c["slots"], c["cap"]
    b, s, h, hd = q.shape
    mask = da.block_mask(c["pos"], slots, c["length"], cap, cap, s)
    kv = c["kv"][:, 0].index_select(1, slots)  # this layer's rows (the drafter gathers every layer's in one copy)
    k, v = kv[0], kv[1]
    k[:, cap:cap + s], v[:, cap:cap + s] = kb, vb
    bias = rows_bias(mask, h // kb.shape[2])
    return sdpa_rows(q.transpose(1, 2), k[:, :cap + s].transpose(1, 2), v[:, :cap + s].transpose(1, 2), bias,
                     hd ** -0.5).transpose(1, 2)


def timed(fn, reps: int = 20, rounds: int = 10) -> float:
    """Microseconds a call: ``reps`` calls captured in one CUDA graph, replayed ``rounds`` times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (reps * rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--splits", default="1,2,4,8,16,32")
    ap.add_argument("--cap", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_draft_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    out = []
    for b in (int(x) for x in args.batch.split(",")):
        c = case(b, args.cap)
        k, v = list(c["kv"][0]), list(c["kv"][1])
        call = dict(q=c["q"], k_blk=c["k_blk"], v_blk=c["v_blk"], ring_k=k[0], ring_v=v[0], slots=c["slots"],
                    ring_pos=c["pos"], length=c["length"], cap=c["cap"], window=c["cap"], scale=128 ** -0.5)
        ref = da.draft_attention_ref(**call).float()
        err = (torch_path(c).float() - ref).abs().max().item()
        us = timed(lambda: torch_path(c))
        print(f"B={b}: torch path (gather, mask, sdpa_rows) {us:7.2f} us a layer, max |err| {err:.3g}", flush=True)
        out.append({"batch": b, "variant": "torch", "us": us, "max_err": err})
        default = da.draft_splits(b, 10, args.cap, "cuda")
        for n in sorted({int(x) for x in args.splits.split(",")} | {default}):
            err = (da.draft_attention(**call, splits=n).float() - ref).abs().max().item()
            us = timed(lambda: da.draft_attention(**call, splits=n))
            tag = " (default)" if n == default else ""
            print(f"B={b}: draft_attention splits {n:3d}{tag} {us:7.2f} us a layer, max |err| {err:.3g}", flush=True)
            out.append({"batch": b, "variant": f"splits{n}", "default": n == default, "us": us, "max_err": err})
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "cap": args.cap,
                                               "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
