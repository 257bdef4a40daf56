"""How far the gate can be trusted, measured: N A/A pairs (two independent decode runs of the same build; the gate
should pass them) and M pairs against a candidate with a known injected slowdown (``inject_delay_us``, a fixed delay
a decode step; the gate should fail them), each pair gated with ``reports.gate.gate`` and its default rules.

Prints and writes (``--out``) the false-alarm rate (A/A pairs the gate fails), the ambiguous rates and the detection
rate (injected pairs the gate fails), each with a Wilson 95% interval, and every pair's verdicts.

Each run is an independent measurement: a fresh Engine, its own warm-up and repeats, its own result document; only
the weights are loaded once. The delay is chosen from a plain calibration so that decode tok/s drops by ``--slowdown``
(delay = step x s / (1 - s); on a GPU the step is the wall time a token of the calibration run's fastest repeat, on
a CPU the thread's CPU time a step, the clock the CPU delay's busy-wait counts), unless ``--delay-us`` gives it; the
slowdown each injected pair actually saw is reported too. Pairs alternate which run goes first (drift of a warming or
loaded machine favours neither), and A/A and injected pairs interleave, so a ``--time-limit-s`` cut leaves both
counted.

Builds are compared in separate processes, so nothing of one run reaches the next; here the runs share a process, and
a delayed run left the run after it slower (H200, bundled model, -n 128: a baseline measured right after its delayed
candidate ran 2-3% below the baselines measured first in 5 of 10 such pairs, and those pairs saw a 3.2-3.9% slowdown
instead of 5.4-6.5%: 5 of the 20 injected pairs went undetected). ``--settle-runs`` (1) plain unmeasured runs follow
every delayed run, so each measured run follows a plain one, as in an A/A pair. Every pair records both runs'
per-repeat decode and prefill tok/s and SM clock (where nvidia-smi reads it), and the summary splits the injected
slowdown by which run went first, so a carry-over shows.

Usage: python3 scripts/gate_trust.py --pairs 40 --injected-pairs 20 --repeats 5 -n 64 --device cpu --out trust.json
       python3 scripts/gate_trust.py --pairs 100 --repeats 5 --injected-pairs 40 --injected-repeats auto
           --repeats-budget-s 5 -n 128 --device cuda --time-limit-s 420 --out trust-h200.json"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()
from ninfer_bench.reports.gate import default_rules, gate, load_rules, status_of  # noqa: E402
from ninfer_bench.engine.runtime.engine import Engine  # noqa: E402
from ninfer_bench.suites.common import copy_bandwidth  # noqa: E402
from ninfer_bench.suites.decode import (DecodeOptions, free_device_memory, load_model, load_prompts,  # noqa: E402
                                        run_decode)

STATUSES = ("pass", "ambiguous", "fail")


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float] | None:
    """The Wilson score interval of a proportion k / n (95% by default); None without trials."""
    if n <= 0:
        return None
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def pair_status(verdicts) -> str:
    """The gate's verdict on a pair, as its exit code reads it (:func:`status_of`): "fail" when a row failed or is
    missing, else "ambiguous" when a row is, else "pass"."""
    return status_of(verdicts)


def tally(pairs: list[dict], kind: str) -> dict:
    """Counts and rates over the pairs of one kind ("aa" or "injected"): how many the gate passed, called ambiguous,
    failed, each rate with its Wilson 95% interval, and per metric the rows' statuses."""
    mine = [p for p in pairs if p["kind"] == kind]
    n = len(mine)
    counts = {s: sum(p["status"] == s for p in mine) for s in STATUSES}
    by_metric: dict[str, dict[str, int]] = {}
    for p in mine:
        for metric, status in p["rows"].items():
            row = by_metric.setdefault(metric, {})
            row[status] = row.get(status, 0) + 1
    out = {"pairs": n, "counts": counts, "by_metric": by_metric}
    for status in STATUSES:
        out[f"{status}_rate"] = counts[status] / n if n else None
        out[f"{status}_ci95"] = wilson(counts[status], n)
    slow = [p["slowdown"] for p in mine if p.get("slowdown") is not None]
    out["slowdown_median"] = statistics.median(slow) if slow else None
    for first in ("baseline", "candidate"):  # a run carrying over into the next one shows as a split by order
        part = [p["slowdown"] for p in mine if p.get("slowdown") is not None
                and bool(p.get("candidate_first")) == (first == "candidate")]
        out[f"slowdown_median_{first}_first"] = statistics.median(part) if part else None
    return out


def run_spread(pairs: list[dict], key: str) -> dict | None:
    """How far two runs' medians of one metric sit apart in the A/A pairs (|candidate / baseline - 1|, from the
    per-repeat samples under ``key``): its median, 95th percentile and largest. The repeats within a run do not
    sample this (the gate's interval comes from them), so it is the noise a threshold has to clear."""
    gaps = []
    for p in pairs:
        runs = p.get(key) if p["kind"] == "aa" else None
        if runs and all(runs):
            a, b = (statistics.median(v for v in r if v) for r in runs)
            gaps.append(abs(b / a - 1))
    if not gaps:
        return None
    gaps.sort()
    p95 = gaps[min(len(gaps) - 1, int(0.95 * len(gaps)))]
    return {"pairs": len(gaps), "median": statistics.median(gaps), "p95": p95, "max": gaps[-1]}


def summarize(pairs: list[dict]) -> dict:
    """The headline numbers: false alarms are A/A pairs failed, detections injected pairs failed."""
    aa, inj = tally(pairs, "aa"), tally(pairs, "injected")
    return {"aa": aa, "injected": inj,
            "false_alarm_rate": aa["fail_rate"], "false_alarm_ci95": aa["fail_ci95"],
            "aa_ambiguous_rate": aa["ambiguous_rate"], "aa_ambiguous_ci95": aa["ambiguous_ci95"],
            "detection_rate": inj["fail_rate"], "detection_ci95": inj["fail_ci95"],
            "injected_ambiguous_rate": inj["ambiguous_rate"], "injected_ambiguous_ci95": inj["ambiguous_ci95"],
            "aa_run_spread": {"decode_tok_s": run_spread(pairs, "samples"),
                              "prefill_tok_s": run_spread(pairs, "prefill_samples")}}


def repeats_arg(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: a positive number of repeats, or auto")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="artifact or preset [default: the bundled model]")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--pairs", type=int, default=40, help="A/A pairs")
    ap.add_argument("--injected-pairs", type=int, default=None, help="pairs against the slowed candidate "
                                                                     "[default: --pairs]")
    ap.add_argument("--repeats", type=repeats_arg, default=5, help="repeats of each A/A run: N or auto")
    ap.add_argument("--injected-repeats", type=repeats_arg, default=None,
                    help="repeats of both runs of an injected pair [default: --repeats]")
    ap.add_argument("--repeats-target", type=float, default=None, help="auto: CI half-width, percent [2]")
    ap.add_argument("--repeats-budget-s", type=float, default=None, help="auto: seconds of repeats a run [60]")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128, help="tokens a repeat decodes")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--settle-runs", type=int, default=1, help="plain unmeasured runs after each delayed run")
    ap.add_argument("--slowdown", type=float, default=0.05, help="the drop of decode tok/s to inject (0.05 = 5%%)")
    ap.add_argument("--delay-us", type=float, default=None, help="the delay a step, instead of --slowdown's")
    ap.add_argument("--rules", default=None, help="a rules file: the gate's whole rule list [default: its decode "
                                                  "rules]")
    ap.add_argument("--time-limit-s", type=float, default=None,
                    help="start no pair that would end past this many seconds from the start (partial counts kept)")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args(argv)
    if args.pairs < 0 or (args.injected_pairs is not None and args.injected_pairs < 0):
        ap.error("--pairs and --injected-pairs count pairs (>= 0)")
    if args.settle_runs < 0:
        ap.error("--settle-runs counts runs (>= 0)")
    if not 0 < args.slowdown < 1:
        ap.error("--slowdown is a fraction in (0, 1)")
    args.injected_pairs = args.pairs if args.injected_pairs is None else args.injected_pairs
    args.injected_repeats = args.repeats if args.injected_repeats is None else args.injected_repeats
    return args


def git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return f"{sha}{' + uncommitted changes' if dirty else ''}" if sha else None
    except (OSError, subprocess.SubprocessError):
        return None


def gate_sources() -> str:
    """A digest of the gate's decision code (reports/gate.py, stats.py, experiment.py) as this process loaded it."""
    import hashlib

    from ninfer_bench.reports import experiment, stats
    from ninfer_bench.reports import gate as gate_module

    digest = hashlib.sha256()
    for module in (gate_module, stats, experiment):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def cpu_step_us(loaded, kw: dict, tokens: int = 32, tries: int = 3) -> float:
    """The thread's CPU time a plain decode step on a CPU takes (decoding ``tokens + 1`` tokens against 1, the best of
    ``tries`` each; the bundled model's steps run on the calling thread: apply_cpu_threads gives it one)."""
    opts = DecodeOptions.make(**kw)
    engine = Engine(loaded, opts.engine_options)
    ids = load_prompts(opts.prompt_file, engine.tokenizer, opts.prompts)[0]

    def cpu_ns(n: int) -> int:
        t = time.thread_time_ns()
        engine.generate(ids, max_new_tokens=n, ignore_eos=True)
        return time.thread_time_ns() - t

    cpu_ns(tokens + 1)  # warm
    long, short = min(cpu_ns(tokens + 1) for _ in range(tries)), min(cpu_ns(1) for _ in range(tries))
    return (long - short) / tokens / 1e3


def run_trust(args: argparse.Namespace, log=print) -> dict:
    """Calibrate, run the pairs, gate and count; returns the result dict (also written to ``args.out``)."""
    start, sources, commit = time.perf_counter(), gate_sources(), git_commit()  # as the run starts
    rules = load_rules(args.rules) if args.rules else None

    def kw(repeats, delay_us=0.0) -> dict:
        auto = repeats == "auto"
        return dict(model=args.model, device=args.device, max_new_tokens=args.max_new_tokens, warmup=args.warmup,
                    repeats=repeats, label="gate-trust", inject_delay_us=delay_us,
                    repeats_target=args.repeats_target / 100 if auto and args.repeats_target else None,
                    repeats_budget_s=args.repeats_budget_s if auto else None)

    opts = DecodeOptions.make(**kw(args.repeats))
    loaded = load_model(opts)
    bw = copy_bandwidth(opts.engine_options.torch_device)  # measured once: no timing a run is gated on

    def measure(repeats, delay_us=0.0) -> dict:
        doc = run_decode(DecodeOptions.make(**kw(repeats, delay_us)), loaded=loaded, copy_bw=bw)
        free_device_memory()  # the run's engine goes, as its process would
        if delay_us:
            for _ in range(args.settle_runs):  # the next measured run follows a plain one (module docstring)
                run_decode(DecodeOptions.make(**{**kw(1), "warmup": 0}), loaded=loaded, copy_bw=bw)
                free_device_memory()
        return doc

    # a plain calibration run: the step time the delay is chosen from, and the process warmed before any pair (the
    # first run's imports and allocations would otherwise show as a change of the first pair's peak memory on a CPU)
    info = measure(args.repeats if args.repeats != "auto" else 5)
    wall_us = 1e6 / max(v for v in info["summary"]["samples"]["decode_tok_s"] if v)  # the fastest repeat's
    on_cpu = info["config"]["device"] == "cpu"
    # the step the delay is a share of, in the delay's own clock: on a CPU the thread's CPU time (the busy-wait
    # counts it, so the share holds at any load of a shared machine), on a GPU wall time a decoded token (as the gated
    # metric counts it) in the fastest repeat
    step_us = cpu_step_us(loaded, kw(1)) if on_cpu else wall_us
    delay_us = step_us * args.slowdown / (1 - args.slowdown) if args.delay_us is None else args.delay_us
    log(f"gate trust: {info['config']['device']} ({info['env'].get('gpu') or info['env'].get('cpu_model')}); plain "
        f"step {step_us:.1f} us {'CPU time' if on_cpu else 'wall'} (fastest wall {wall_us:.1f} us); injected delay "
        f"{delay_us:.1f} us a step; "
        f"{args.pairs} A/A pairs x {args.repeats} repeats, {args.injected_pairs} injected pairs x "
        f"{args.injected_repeats} repeats, -n {args.max_new_tokens}")

    plan = []
    for i in range(max(args.pairs, args.injected_pairs)):
        if i < args.pairs:
            plan.append(("aa", args.repeats, 0.0))
        if i < args.injected_pairs:
            plan.append(("injected", args.injected_repeats, delay_us))
    pairs, stopped_early, pair_s = [], False, []
    for i, (kind, repeats, delay) in enumerate(plan):
        elapsed = time.perf_counter() - start
        if args.time_limit_s and pair_s and elapsed + max(pair_s[-8:]) > args.time_limit_s:
            stopped_early = True
            log(f"time limit: {len(pairs)} of {len(plan)} pairs run in {elapsed:.0f} s")
            break
        t0 = time.perf_counter()
        b_first = i % 4 >= 2  # alternate the order within each kind (plan alternates the kinds)
        if b_first:
            cand = measure(repeats, delay)
            base = measure(repeats)
        else:
            base = measure(repeats)
            cand = measure(repeats, delay)
        verdicts = gate(base, cand, rules)
        status = pair_status(verdicts)
        b_tok, c_tok = base["summary"]["decode_tok_s"], cand["summary"]["decode_tok_s"]
        pairs.append({"kind": kind, "candidate_first": b_first, "status": status,
                      "rows": {v.metric: v.status for v in verdicts},
                      "failed": [f"{v.metric}: {v.reason}" for v in verdicts if v.status in ("fail", "missing")],
                      "ambiguous": [f"{v.metric}: {v.reason}" for v in verdicts if v.status == "ambiguous"],
                      "load_avg_1m": [base["env"].get("load_avg_1m"), cand["env"].get("load_avg_1m")],
                      "decode_tok_s": [b_tok, c_tok],
                      "slowdown": 1 - c_tok / b_tok if b_tok and c_tok else None,
                      "repeats_run": [base["summary"]["repeats_run"], cand["summary"]["repeats_run"]],
                      "repeats_stopped_by": [base["summary"]["repeats_stopped_by"],
                                             cand["summary"]["repeats_stopped_by"]],
                      "samples": [d["summary"]["samples"]["decode_tok_s"] for d in (base, cand)],
                      "prefill_samples": [d["summary"]["samples"].get("prefill_tok_s") for d in (base, cand)],
                      "sm_mhz": [(d["env"].get("gpu_clocks") or {}).get("sm_mhz") for d in (base, cand)],
                      "seconds": time.perf_counter() - t0})
        pair_s.append(pairs[-1]["seconds"])
        s = summarize(pairs)
        log(f"pair {i + 1}/{len(plan)} {kind}: {status} (tok/s {c_tok / b_tok - 1:+.1%}, "
            f"{pairs[-1]['repeats_run'][0]}+{pairs[-1]['repeats_run'][1]} repeats, {pair_s[-1]:.1f} s) | "
            f"false alarms {s['aa']['counts']['fail']}/{s['aa']['pairs']}, "
            f"detected {s['injected']['counts']['fail']}/{s['injected']['pairs']}")

    env = info["env"]
    result = {
        "command": "python3 scripts/gate_trust.py " + " ".join(sys.argv[1:]),
        "commit": commit, "device": info["config"]["device"], "gpu": env.get("gpu"),
        "cpu_model": env.get("cpu_model"), "cpu_count": env.get("cpu_count"),
        "model": info["model"].get("model_id") or info["model"].get("preset") or args.model or "bundled",
        "artifact_id": info["model"].get("artifact_id"),
        "max_new_tokens": args.max_new_tokens, "warmup": args.warmup, "repeats": args.repeats,
        "injected_repeats": args.injected_repeats, "repeats_target": args.repeats_target,
        "repeats_budget_s": args.repeats_budget_s, "settle_runs": args.settle_runs,
        "slowdown_asked": args.slowdown if args.delay_us is None else None,
        "plain_step_us": step_us, "plain_step_clock": "thread CPU time" if on_cpu else "wall",
        "plain_step_wall_us": wall_us, "inject_delay_us": delay_us, "rules": args.rules or "default",
        "thresholds": {r.metric: r.threshold for r in (rules or default_rules("decode", info["config"]["device"]))
                       if r.kind != "exact"},
        "gate_sources_sha256": sources,  # the decision rule counted, as the run started
        "stopped_early": stopped_early, "seconds": time.perf_counter() - start,
        **summarize(pairs), "pairs": pairs,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def rate(value, ci) -> str:
    return "-" if value is None else f"{value:.1%} (95% CI {ci[0]:.1%}-{ci[1]:.1%})"


def main(argv=None) -> int:
    args = parse_args(argv)
    r = run_trust(args, log=lambda line: print(line, file=sys.stderr, flush=True))
    aa, inj = r["aa"], r["injected"]
    print("thresholds: " + ", ".join(f"{m} {t:.0%}" for m, t in r["thresholds"].items()))
    print(f"A/A pairs {aa['pairs']}: pass {aa['counts']['pass']}, ambiguous {aa['counts']['ambiguous']}, "
          f"fail {aa['counts']['fail']}")
    print(f"  false-alarm rate {rate(r['false_alarm_rate'], r['false_alarm_ci95'])}; "
          f"ambiguous {rate(r['aa_ambiguous_rate'], r['aa_ambiguous_ci95'])}")
    print(f"injected pairs {inj['pairs']} (delay {r['inject_delay_us']:.1f} us a step, median tok/s drop "
          f"{'-' if inj['slowdown_median'] is None else format(inj['slowdown_median'], '.1%')}): pass "
          f"{inj['counts']['pass']}, ambiguous {inj['counts']['ambiguous']}, fail {inj['counts']['fail']}")
    split = [(w, inj[f"slowdown_median_{w}_first"]) for w in ("baseline", "candidate")]
    if all(v is not None for _, v in split):
        print("  median drop by order: " + ", ".join(f"{w} first {v:.1%}" for w, v in split))
    print(f"  detection rate {rate(r['detection_rate'], r['detection_ci95'])}; "
          f"ambiguous {rate(r['injected_ambiguous_rate'], r['injected_ambiguous_ci95'])}")
    for metric, spread in r["aa_run_spread"].items():
        if spread:
            print(f"A/A run medians apart, {metric}: median {spread['median']:.1%}, p95 {spread['p95']:.1%}, "
                  f"max {spread['max']:.1%} ({spread['pairs']} pairs)")
    for kind, t in (("A/A", aa), ("injected", inj)):
        rows = {m: c for m, c in t["by_metric"].items() if c.get("fail") or c.get("ambiguous") or c.get("missing")}
        if rows:
            print(f"{kind} rows not passing: " + "; ".join(f"{m} {c}" for m, c in rows.items()))
    if args.out:
        print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
