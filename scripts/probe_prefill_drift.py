"""Where a short prompt's prefill time drifts between decode runs (issue 34's A/A false alarms on the H200).

The gate compares two runs' repeats; on the H200 the bundled model's 232-token prefill moved 7-50% between runs
while one run's repeats agreed. This probe times the prefill (wall, and on CUDA the device time of the same span
from events) in runs of ``--repeats`` repeats under conditions that separate the suspects, the conditions
interleaved run by run so that a drift of the machine in time reaches each alike:

* ``fresh``: a new Engine a run (as the decode suite and scripts/gate_trust.py make one), after freeing the last
* ``shared``: one Engine for every run: what is left between its runs is time alone
* ``fresh-nogc``: as ``fresh``, with Python's garbage collector off during the timed repeats

Three clocks: ``wall`` (the decode result's prefill time), on CUDA ``device`` (events around the whole prefill, host
gaps included) and ``replay`` (events around the captured prefill graph alone: its device time). Where wall drifts
between runs and replay does not, the drift is host work on the prefill's path, not the GPU.

For each: the median prefill, the within-run spread (median of the runs' coefficients of variation), the spread of
the runs' medians, the share of variance between runs (intraclass correlation), and the share of consecutive run
pairs whose repeats do not overlap at all and differ by more than 5% (what the gate's 5-vs-5 rank test calls
significant: the A/A false alarms of that condition).

Usage: python3 scripts/probe_prefill_drift.py --runs 40 --repeats 5 -n 128 --device cuda --out drift.json
       [--conditions fresh,shared]"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()
import torch  # noqa: E402

from ninfer_bench.engine.runtime.engine import Engine  # noqa: E402
from ninfer_bench.suites.decode import DecodeOptions, free_device_memory, load_model, load_prompts  # noqa: E402

CONDITIONS = ("fresh", "shared", "fresh-nogc")


def timed(owner, name: str, spans: list) -> None:
    """Wrap ``owner.name`` so each call that returns something appends CUDA events around it to ``spans``."""
    inner = getattr(owner, name)

    def call(*args, **kw):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = inner(*args, **kw)
        b.record()
        if out is not None or name == "start":  # (GraphRunner.prefill's None: no graph ran)
            spans.append((a, b))
        return out

    setattr(owner, name, call)


def one_run(engine: Engine, ids, n: int, repeats: int, nogc: bool) -> dict:
    spans: list = []
    replays: list = []
    if engine.device.type == "cuda":
        timed(engine, "start", spans)  # the whole prefill, host gaps included
        if engine.graphs is not None:
            timed(engine.graphs, "prefill", replays)  # the captured prefill alone: its device time
    engine.generate(ids, max_new_tokens=n, ignore_eos=True)  # the run's warm-up
    spans.clear()
    replays.clear()
    wall = []
    if nogc:
        gc.collect()
        gc.disable()
    try:
        for _ in range(repeats):
            wall.append(engine.generate(ids, max_new_tokens=n, ignore_eos=True).prefill_s * 1e3)
    finally:
        gc.enable()
    device = [a.elapsed_time(b) for a, b in spans] if spans else None
    replay = [a.elapsed_time(b) for a, b in replays] if replays else None
    return {"wall_ms": wall, "device_ms": device, "replay_ms": replay}


def spread(runs: list[list[float]], threshold: float = 0.05) -> dict:
    """Within- and between-run spread of per-repeat times (one list a run)."""
    meds = [statistics.median(r) for r in runs]
    grand = statistics.median(meds)
    within_cv = statistics.median(statistics.stdev(r) / statistics.mean(r) for r in runs if len(r) > 1)
    k = len(runs[0])
    ms_within = statistics.mean(statistics.variance(r) for r in runs)
    ms_between = k * statistics.variance([statistics.mean(r) for r in runs]) if len(runs) > 1 else 0.0
    icc = (ms_between - ms_within) / (ms_between + (k - 1) * ms_within) if ms_between + ms_within else 0.0
    separated = 0
    for a, b in zip(runs[:-1], runs[1:]):
        apart = max(a) < min(b) or max(b) < min(a)
        if apart and abs(statistics.median(b) / statistics.median(a) - 1) > threshold:
            separated += 1
    return {"median_ms": grand, "within_run_cv": within_cv,
            "between_run_cv": statistics.stdev(meds) / statistics.mean(meds) if len(meds) > 1 else 0.0,
            "run_median_range": [min(meds) / grand, max(meds) / grand], "icc": icc,
            "consecutive_pairs_apart": f"{separated}/{len(runs) - 1}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--runs", type=int, default=40, help="runs a condition")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats a run")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help="comma-separated, of " + ", ".join(CONDITIONS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    conditions = [c for c in args.conditions.split(",") if c]
    if not conditions or set(conditions) - set(CONDITIONS):
        ap.error(f"--conditions: of {', '.join(CONDITIONS)}")
    opts = DecodeOptions.make(model=args.model, device=args.device, max_new_tokens=args.max_new_tokens, repeats=1)
    loaded = load_model(opts)
    shared = Engine(loaded, opts.engine_options)
    ids = load_prompts(opts.prompt_file, shared.tokenizer, opts.prompts)[0]
    data = {c: {"wall_ms": [], "device_ms": [], "replay_ms": []} for c in conditions}
    t0 = time.perf_counter()
    for i in range(args.runs):
        for c in conditions:
            if c == "shared":
                engine = shared
            else:
                free_device_memory()
                engine = Engine(loaded, opts.engine_options)
            r = one_run(engine, ids, args.max_new_tokens, args.repeats, nogc=c.endswith("nogc"))
            data[c]["wall_ms"].append(r["wall_ms"])
            for clock in ("device_ms", "replay_ms"):
                if r[clock]:
                    data[c][clock].append(r[clock])
            if engine is not shared:
                del engine
        if (i + 1) % 10 == 0:
            print(f"{i + 1}/{args.runs} runs a condition, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    result = {"command": "python3 scripts/probe_prefill_drift.py " + " ".join(sys.argv[1:]),
              "device": str(opts.engine_options.torch_device), "prompt_tokens": len(ids),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "conditions": {}}
    for c in conditions:
        row = {"wall": spread(data[c]["wall_ms"])}
        for clock in ("device", "replay"):
            if data[c][f"{clock}_ms"]:
                row[clock] = spread(data[c][f"{clock}_ms"])
        result["conditions"][c] = row
        for clock, s in row.items():
            print(f"{c:11s} {clock:6s} median {s['median_ms']:.3f} ms  within-run cv {s['within_run_cv']:.3f}  "
                  f"between-run cv {s['between_run_cv']:.3f}  run medians {s['run_median_range'][0]:.2f}-"
                  f"{s['run_median_range'][1]:.2f}x  icc {s['icc']:.2f}  pairs apart >5% "
                  f"{s['consecutive_pairs_apart']}")
    result["raw"] = data
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
