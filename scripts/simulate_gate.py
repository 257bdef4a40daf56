#!/usr/bin/env python3
"""The gate's timing rule under simulated noise: how often an A/A pair fails and a 5% slowdown is caught.

Each pair: two decode result documents whose ``decode_tok_s`` samples are ``100 * factor * (1 + drift) * (1 + noise
* e)`` (drift: one normal draw a run, the shift no interval over one run's repeats sees; e: normal, or Student t with
3 degrees of freedom for heavy tails), 5 repeats a side; an ambiguous row is rerun once on both sides at its
``repeats_needed`` (at most 60), as ``--repeats auto`` would. Counted: the ``decode_tok_s`` row's final status.

    python3 scripts/simulate_gate.py [--pairs 200] [--seed 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

import numpy as np  # noqa: E402

from ninfer_bench.reports.gate import gate  # noqa: E402
from ninfer_bench.reports.schema import make_result  # noqa: E402

NOISE = (("GPU-like: 0.5% a repeat, 0.3% drift a run", 0.005, 0.003, False),
         ("CPU-like: 3% a repeat (heavy-tailed), 0.5% drift", 0.03, 0.005, True),
         ("CPU-like: 3% a repeat (heavy-tailed), 2% drift", 0.03, 0.02, True))


def doc(tok_s: list[float]) -> dict:
    """A minimal decode result with these decode tok/s samples (everything else equal on both sides)."""
    n = len(tok_s)
    records = [{"repeat": i, "decode_tok_s": v, "tokens_sha256": "ab" * 32} for i, v in enumerate(tok_s)]
    summary = {"prompt_tokens": 500, "completion_tokens": 129, "tokens_sha256": "ab" * 32, "prefill_tok_s": 4000.0,
               "decode_tok_s": statistics.median(tok_s), "ttft_ms": 20.0, "peak_memory_bytes": 1 << 30,
               "device_ms_per_round": 10.0, "rounds": 129, "drafted_tokens": 0, "accepted_tokens": 0,
               "acceptance_rate": None, "tokens_per_round": 1.0, "accepted_per_position": [],
               "deterministic": True, "samples": {"decode_tok_s": tok_s}}
    cfg = {"engine": "ours", "runtime": "v3", "spec": "none", "device": "cuda:0", "max_new_tokens": 129, "repeats": n}
    return make_result("decode", label="sim", config=cfg, records=records, summary=summary,
                       model={"artifact_id": "sim"}, env={"git_sha": "0" * 40, "gpu": "sim"})


def pair(rng, noise: float, drift: float, heavy: bool, slow: float) -> str:
    def run(n: int, factor: float) -> dict:
        d = drift * rng.standard_normal()
        e = rng.standard_t(3, n) if heavy else rng.standard_normal(n)
        return doc(list(100 * factor * (1 + d) * (1 + noise * e)))

    def row(n: int):
        return next(v for v in gate(run(n, 1.0), run(n, 1.0 - slow)) if v.metric == "decode_tok_s")

    v = row(5)
    if v.status == "ambiguous" and v.repeats_needed:
        v = row(min(60, v.repeats_needed))
    return v.status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"{'noise':52s} {'slowdown':>8s} {'pass':>5s} {'ambig':>5s} {'fail':>5s}")
    for name, noise, drift, heavy in NOISE:
        for slow in (0.0, 0.05):
            st = [pair(rng, noise, drift, heavy, slow) for _ in range(args.pairs)]
            print(f"{name:52s} {slow:8.0%} {st.count('pass'):5d} {st.count('ambiguous'):5d} {st.count('fail'):5d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
