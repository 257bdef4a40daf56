#!/usr/bin/env python3
"""The tensor-parallel collectives' own latency (kernels/ipc_collectives.py) on one GPU: two ranks' regions in one
process, each rank's calls captured in a CUDA graph (CALLS a graph) and the two graphs replayed at once on two
streams, so the ranks meet as they would on two GPUs - but through this GPU's L2, not NVLink. Each size is checked
against torch's sum / concatenation first. Prints the median device time of a call over REPEATS replays.

    python scripts/bench_ipc_collectives.py --sizes 5120,40960 --gather 124160 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

import torch  # noqa: E402

from ninfer_bench.kernels import ipc_collectives as ic  # noqa: E402


def pair(device: torch.device, max_bytes: int) -> list:
    """Two ranks' IpcCollectives over regions of this process (each rank's 'opened' region is the other's own)."""
    bases = [ic.alloc_region(device, max_bytes) for _ in range(2)]
    return [ic.IpcCollectives(r, 2, device, bases[r], list(bases), max_bytes) for r in range(2)]


def both(colls, call) -> list:
    """``call(coll, r)`` for each rank at once, on a stream each (one rank alone would wait for the other forever):
    their results, once both are done."""
    dev = colls[0].device
    streams = [torch.cuda.Stream(dev) for _ in colls]
    out = []
    for r, c in enumerate(colls):
        streams[r].wait_stream(torch.cuda.current_stream(dev))  # the inputs made on it are ready
        with torch.cuda.stream(streams[r]):
            out.append(call(c, r))
    torch.cuda.synchronize(dev)
    return out


def timed(colls, make, calls: int, repeats: int) -> float:
    """Median us a call: each rank's ``calls`` calls of ``make(coll, r)`` in one graph, both graphs replayed at once."""
    dev = colls[0].device
    streams = [torch.cuda.Stream(dev) for _ in colls]
    graphs = []
    for r, coll in enumerate(colls):  # (captures launch nothing: no rank waits for the other here)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=streams[r]):
            for _ in range(calls):
                make(coll, r)
        graphs.append(g)
    torch.cuda.synchronize(dev)
    out = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for s in streams:
            s.wait_event(start)
        for s, g in zip(streams, graphs):
            with torch.cuda.stream(s):
                g.replay()
        for s in streams:
            torch.cuda.current_stream(dev).wait_stream(s)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(out[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="5120,40960,655360", help="all-reduce sizes, bf16 elements (5120: one 27B "
                    "hidden row; 40960: eight)")
    ap.add_argument("--gather", default="124160", help="all-gather row widths, fp32 (124160: half the 27B vocabulary)")
    ap.add_argument("--calls", type=int, default=64, help="calls a graph")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    why = ic._cupy.import_error("IPC collectives")
    if why:
        print(f"bench_ipc_collectives: {why}", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    colls = pair(dev, ic.DEFAULT_MAX_BYTES)
    rows = []
    for n in (int(v) for v in args.sizes.split(",") if v.strip()):
        xs = [torch.randn(n, device=dev).to(torch.bfloat16) for _ in colls]
        want = (xs[0].float() + xs[1].float()).to(torch.bfloat16)
        ok = all(torch.equal(g, want) for g in both(colls, lambda c, r, xs=xs: c.reduce_(xs[r].clone())))
        us = timed(colls, lambda c, r, xs=xs: c.reduce_(xs[r]), args.calls, args.repeats)
        rows.append({"op": "all_reduce", "dtype": "bf16", "elements": n, "bytes": 2 * n, "us": us, "correct": ok})
    for n in (int(v) for v in args.gather.split(",") if v.strip()):
        xs = [torch.randn(1, n, device=dev) for _ in colls]
        want = torch.cat(xs, dim=-1)
        ok = all(torch.equal(g, want) for g in both(colls, lambda c, r, xs=xs: c.gather_last(xs[r])))
        us = timed(colls, lambda c, r, xs=xs: c.gather_last(xs[r]), args.calls, args.repeats)
        rows.append({"op": "all_gather", "dtype": "fp32", "elements": n, "bytes": 4 * n, "us": us, "correct": ok})
    print(f"{torch.cuda.get_device_name(dev)}: two ranks in one process, {args.calls} calls a graph, median of "
          f"{args.repeats} replays")
    for r in rows:
        print(f"  {r['op']:10} {r['dtype']:4} {r['elements']:>9,} elements ({r['bytes']:>9,} B): {r['us']:8.2f} us a "
              f"call  {'correct' if r['correct'] else 'WRONG'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "rows": rows}, indent=1))
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
