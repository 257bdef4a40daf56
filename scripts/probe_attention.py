#!/usr/bin/env python3
"""Which launch shapes of the Triton decode attention fault or miscompute on this GPU (each in its own process,
so a fault cannot poison the others). Used to bisect tests/test_kernels_attention.py's split-T16-g6-hd128 crash.

    python3 scripts/probe_attention.py            # the grid below, 8 processes at a time
    python3 scripts/probe_attention.py --one ARGS # one case (what the grid runs)
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def one(q_dtype: str, kv: str, block_n: int, warps: int, stages: int, chunk_blocks: int) -> dict:
    import _bootstrap

    _bootstrap.ensure_package()
    import torch
    from test_kernels_attention import SHAPES, make_case, rel_rms

    from ninfer_bench.kernels import attention_triton as at

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[q_dtype]
    c = make_case(kv, *SHAPES["T16-g6-hd128"], q_dtype=dt)
    b, t, h, hd = c["q"].shape
    cfg = at.plan(b, t, h, c["k_cache"].shape[1], hd, c["k_cache"].shape[2], kv == "int8", "cuda", q_dtype=dt,
                  block_n=block_n, num_warps=warps, num_stages=stages, chunk=chunk_blocks * block_n)
    out = at.decode_attention(**c, config=cfg)
    torch.cuda.synchronize()
    ref = at.decode_attention_ref(**{**c, "q": c["q"].float()})
    return {"err": rel_rms(out, ref), "cfg": repr(cfg)}


def main() -> int:
    if sys.argv[1:2] == ["--one"]:
        a = sys.argv[2:]
        print(json.dumps(one(a[0], a[1], *map(int, a[2:]))))
        return 0
    grid = list(itertools.product(["fp32", "bf16"], ["bf16"], [16, 32], [4, 8], [1, 2], [3, 100]))

    def run(case):
        cmd = [sys.executable, __file__, "--one", *map(str, case)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        last = (r.stdout.strip().splitlines() or [""])[-1]
        if r.returncode == 0:
            return case, f"ok  rel_rms {json.loads(last)['err']:.2e}"
        err = [ln for ln in r.stderr.splitlines() if "Error" in ln or "error" in ln]
        return case, f"FAIL rc={r.returncode} {(err or ['?'])[-1][:120]}"

    print("q_dtype kv block_n warps stages chunk_blocks -> result")
    with ThreadPoolExecutor(8) as ex:
        for case, res in ex.map(run, grid):
            print(*case, "->", res, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
