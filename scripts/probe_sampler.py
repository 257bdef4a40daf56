"""The step sampler's cost on the GPU, eager against the captured graph (issue 33's sampled-decoding target).

For each batch size B and each of ``--configs`` (``issue``: temperature 0.7, top-p 0.95, top-k 20 - a top-k within
the cap, so ``torch.topk`` of the cap; ``top_p``: temperature 0.8, top-p 0.95 - the whole-row sort), ``--iters``
picks of B rows of ``--vocab`` bf16 logits, a seed per row, each pick read back to the host as the engine's step
does:

* ``eager``: ``RowSampling.make`` + ``sample_rows`` (what ``Engine.pick`` ran before the sampler was captured)
* ``graph``: ``GraphRunner.sample`` (one replay per pick after the rows' and logits' copies)

and prints the median wall time a pick (host launches, device work and the read) and the median device time of the
pick's span (CUDA events around it: the GPU's share), and whether both gave the same tokens.

Usage: python3 scripts/probe_sampler.py [--batches 1,8] [--configs issue,top_p] [--iters 200] [--vocab 248320]
       [--json FILE]"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()
import torch  # noqa: E402

from ninfer_bench.engine.model.graphs import GraphRunner  # noqa: E402
from ninfer_bench.engine.sampling import RowSampling, SamplingParams, sample_rows  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--configs", default="issue,top_p")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_sampler: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    configs = {"issue": SamplingParams(temperature=0.7, top_p=0.95, top_k=20),
               "top_p": SamplingParams(temperature=0.8, top_p=0.95)}
    # GraphRunner needs only these of an engine for its sampler
    fake = SimpleNamespace(device=dev, capacity=4096, scratch_slot=0, options=SimpleNamespace(
        max_concurrency=8, prefill_chunk=2048, prefill_graphs=False))
    runner = GraphRunner(fake)
    gen = torch.Generator(device=dev).manual_seed(0)
    results = []
    for b, config in [(int(v), c) for v in args.batches.split(",") for c in args.configs.split(",")]:
        params = configs[config]
        ps, seeds = [params] * b, list(range(b))
        logits = [(torch.randn(b, args.vocab, generator=gen, device=dev) * 4).to(torch.bfloat16) for _ in range(8)]

        def eager(i):
            rows = RowSampling.make(ps, seeds, [i] * b, dev)
            return sample_rows(logits[i % 8], rows).tokens

        def graph(i):
            return runner.sample(logits[i % 8], ps, seeds, [i] * b)

        tokens = {}
        for name, fn in (("eager", eager), ("graph", graph)):
            for i in range(5):  # warm-up (the graph's capture)
                fn(i).tolist()
            walls, devs, toks = [], [], []
            for i in range(args.iters):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                e0.record()
                out = fn(i)
                e1.record()
                toks.append(out.tolist())
                walls.append((time.perf_counter() - t0) * 1e3)
                devs.append(e0.elapsed_time(e1))
            tokens[name] = toks
            rec = {"batch": b, "config": config, "impl": name, "wall_ms": statistics.median(walls),
                   "span_ms": statistics.median(devs)}
            results.append(rec)
            print(f"B={b:2d} {config:6s} {name:6s} wall {rec['wall_ms']:.3f} ms a pick, "
                  f"device span {rec['span_ms']:.3f} ms")
        same = tokens["eager"] == tokens["graph"]
        results.append({"batch": b, "config": config, "same_tokens": same})
        print(f"B={b:2d} {config:6s} same tokens eager / graph: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
