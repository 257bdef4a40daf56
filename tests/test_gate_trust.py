"""Measurement truth (issue 34): ``--repeats auto`` stops by its rule, ``--inject-delay-us`` slows a run by a known
amount without making it another experiment, and scripts/gate_trust.py counts the gate's verdicts."""

from __future__ import annotations

import functools
import json
import math
import time

import pytest
import torch
from click.testing import CliRunner

import gate_trust  # scripts/ (conftest puts it on sys.path)
from ninfer_bench.cli import main
from ninfer_bench.engine.runtime.delay import step_delay
from ninfer_bench.engine.runtime.engine import Engine
from ninfer_bench.engine.runtime.options import EngineOptions
from ninfer_bench.reports.experiment import config_differences
from ninfer_bench.reports.gate import Verdict, gate
from ninfer_bench.reports.stats import median_ci
from ninfer_bench.suites import decode as dec
from ninfer_bench.suites.decode import AUTO_MAX_REPEATS, AUTO_MIN_REPEATS, DecodeOptions, auto_stop, run_decode

TINY = dict(model="tiny", device="cpu", max_new_tokens=4, warmup=0)
BW = 1e9  # the copy bandwidth handed to run_decode: on a CPU measuring it fills 256 MiB (seconds)


def test_median_ci_is_the_order_statistic_interval():
    assert median_ci([3, 1, 2, 5, 4]) == (-math.inf, math.inf)  # (min, max) of 5 covers 93.75% < 95%
    assert median_ci([6, 1, 2, 5, 4, 3, None]) == (1, 6)  # of 6: 96.9%; None dropped
    assert median_ci(range(1, 10)) == (2, 8)
    assert median_ci(range(1, 51)) == (18, 33)
    assert median_ci(range(1, 10), confidence=0.8) == (3, 7)  # 1 - 2 * 46 / 512 = 82%
    for n in range(6, 60):  # the largest k whose coverage reaches 95%
        lo, hi = median_ci(range(1, n + 1))
        k = int(lo)
        assert hi == n + 1 - k

        def coverage(k, n=n):
            return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

        assert coverage(k) >= 0.95 and (k + 1 > n // 2 or coverage(k + 1) < 0.95)
    with pytest.raises(ValueError):
        median_ci([1, 2], confidence=1.0)


def test_auto_stop_rule():
    flat = [100.0] * AUTO_MIN_REPEATS
    assert auto_stop(flat[:-1], 0.0, 0.02, 60) is None  # below the minimum: never, whatever the budget
    assert auto_stop(flat[:-1], 1e9, 0.02, 60) is None
    assert auto_stop(flat, 0.0, 0.02, 60) is None  # 5 samples cannot bound a 95% CI of the median
    assert auto_stop(flat + [100.0], 0.0, 0.02, 60) == "target"
    noisy = [100.0, 50.0, 150.0, 100.0, 60.0, 140.0]
    assert auto_stop(noisy, 0.0, 0.02, 60) is None  # CI (50, 150): ±50%
    assert auto_stop(noisy, 0.0, 0.5, 60) == "target"
    # budget: stop when one more repeat of the mean length so far would end past it
    assert auto_stop(noisy, 50.0, 0.02, 60) is None  # 6 repeats in 50 s: the 7th ends at 58.3 s
    assert auto_stop(noisy, 52.0, 0.02, 60) == "budget"  # ... at 60.7 s
    assert auto_stop(noisy * 9, 0.0, 0.02, 60) == "max"  # 54 >= 50
    assert auto_stop([None] * 10, 0.0, 0.02, 60) is None  # nothing measured: keep going (to the budget or max)


def test_repeats_auto_stops_by_its_rule_and_is_recorded(monkeypatch):
    """A run of ``--repeats auto`` whose decode tok/s are set per repeat: it stops at the first repeat after which
    the median's CI half-width is within the target, and the document says so."""
    values = iter([100.0, 50.0, 150.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0] + [100.0] * 50)
    real = dec.run_once

    def run_once(*a, **kw):
        rec = real(*a, **kw)
        rec["decode_tok_s"] = next(values)
        return rec

    monkeypatch.setattr(dec, "run_once", run_once)
    doc = run_decode(DecodeOptions.make(**TINY, repeats="auto"), copy_bw=BW)
    s, c = doc["summary"], doc["config"]
    # (min, max) = (50, 150) bounds the CI up to 8 samples; from 9 on it is (x2, x8) = (100, 100)
    assert s["repeats_run"] == 9 and s["repeats_stopped_by"] == "target" and len(doc["records"]) == 9
    assert s["decode_tok_s_ci95"] == [100.0, 100.0] and s["decode_tok_s_ci_half_width"] == 0.0
    assert (c["repeats"], c["repeats_target"], c["repeats_budget_s"]) == ("auto", 0.02, 60.0)
    fixed = run_decode(DecodeOptions.make(**TINY, repeats=2), copy_bw=BW)["summary"]
    assert (fixed["repeats_run"], fixed["repeats_stopped_by"], fixed["decode_tok_s_ci95"]) == (2, None, None)
    assert AUTO_MAX_REPEATS == 50


def test_repeats_options_are_checked():
    assert DecodeOptions.make(**TINY, repeats="auto", repeats_target=0.1).repeats_budget_s == 60.0
    for bad in (dict(repeats=0), dict(repeats="5"), dict(repeats=True), dict(repeats=3, repeats_target=0.02),
                dict(repeats=3, repeats_budget_s=10.0), dict(repeats="auto", repeats_target=0.0),
                dict(repeats="auto", repeats_budget_s=math.nan)):
        with pytest.raises(ValueError):
            DecodeOptions.make(**{**TINY, **bad})


def test_repeats_auto_on_the_command_line(tmp_path, monkeypatch):
    monkeypatch.setattr(dec, "copy_bandwidth", lambda device: BW)
    out = tmp_path / "auto.json"
    r = CliRunner().invoke(main, ["decode", "--model", "tiny", "--device", "cpu", "-n", "4", "--warmup", "0",
                                  "--repeats", "auto", "--repeats-target", "0.001", "--repeats-budget-s", "0.001",
                                  "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["config"]["repeats"] == "auto" and doc["config"]["repeats_target"] == pytest.approx(1e-5)
    assert doc["summary"]["repeats_run"] == AUTO_MIN_REPEATS and doc["summary"]["repeats_stopped_by"] == "budget"
    assert "5 (auto: budget)" in r.output
    bad = CliRunner().invoke(main, ["decode", "--model", "tiny", "--device", "cpu", "--repeats", "many"])
    assert bad.exit_code == 2 and "a number of repeats, or auto" in bad.output
    bad = CliRunner().invoke(main, ["decode", "--model", "tiny", "--device", "cpu", "--repeats-target", "2"])
    assert bad.exit_code == 1 and "--repeats auto" in bad.output


def test_inject_delay_runs_once_a_step_and_spins_cpu_time():
    """The engine calls its step delay once per decode step (plain, graph chain or not) and once per speculative
    round; on a CPU the delay is a busy-wait of that much of the thread's CPU time."""
    assert step_delay(0, torch.device("cpu")) is None
    spin = step_delay(20_000, torch.device("cpu"))
    t = time.thread_time_ns()
    spin()
    assert time.thread_time_ns() - t >= 20_000_000
    for spec, k in (("none", None), ("mtp", 2)):
        eng = Engine.load("tiny", device="cpu", spec=spec, draft_tokens=k, inject_delay_us=1.0)
        calls = []
        eng.step_delay = functools.partial(calls.append, 1)
        res = eng.generate(list(range(1, 20)), max_new_tokens=8, ignore_eos=True)
        assert len(calls) == (7 if spec == "none" else res.spec["rounds"]) and len(calls) > 0
    assert Engine.load("tiny", device="cpu").step_delay is None


def test_inject_delay_slows_a_run_and_is_no_part_of_the_experiment():
    """A 100 ms delay a step (a tiny step is a few ms): every repeat's time a round includes it, the tokens are the
    same, and the gate sees the same experiment slowed (no config row; decode tok/s does not pass)."""
    plain = run_decode(DecodeOptions.make(**TINY, repeats=5), copy_bw=BW)
    slow = run_decode(DecodeOptions.make(**TINY, repeats=5, inject_delay_us=100_000), copy_bw=BW)
    assert slow["config"]["inject_delay_us"] == 100_000 and plain["config"]["inject_delay_us"] == 0
    assert min(slow["summary"]["samples"]["device_ms_per_round"]) >= 100.0
    assert slow["summary"]["tokens_sha256"] == plain["summary"]["tokens_sha256"]
    assert config_differences(plain, slow) == []
    rows = {v.metric: v for v in gate(plain, slow)}
    assert "config" not in rows and rows["decode_tok_s"].status != "pass", rows["decode_tok_s"]
    assert rows["decode_tok_s"].change < -0.3
    for bad in (-1, True, math.nan, math.inf):
        with pytest.raises(ValueError, match="inject-delay-us"):
            EngineOptions(device="cpu", inject_delay_us=bad)
    with pytest.raises(ValueError, match="--engine ours"):
        DecodeOptions.make(**TINY, engine="hf", inject_delay_us=10.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inject_delay_on_cuda_is_device_time():
    """On CUDA the delay is a sleep kernel queued a step, its cycles calibrated against CUDA events: 1000 us a step
    adds about 1 ms to the device time a round (graph chain or not)."""
    base = dict(model="tiny", device="cuda", max_new_tokens=32, warmup=1, repeats=3)
    for lookahead in (True, False):
        plain = run_decode(DecodeOptions.make(**base, lookahead=lookahead))["summary"]["device_ms_per_round"]
        slow = run_decode(DecodeOptions.make(**base, lookahead=lookahead, inject_delay_us=1000.0))
        extra = slow["summary"]["device_ms_per_round"] - plain
        assert 0.9 <= extra <= 1.3, (lookahead, plain, extra)


def _verdict(metric, status):
    return Verdict(metric, "timing", 1.0, 1.0, 0.0, status, "")


def test_trust_counting():
    assert gate_trust.pair_status([_verdict("a", "pass"), _verdict("b", "ambiguous")]) == "ambiguous"
    assert gate_trust.pair_status([_verdict("a", "ambiguous"), _verdict("b", "missing")]) == "fail"
    assert gate_trust.pair_status([_verdict("a", "pass")]) == "pass"
    assert gate_trust.pair_status([]) == "fail"
    lo, hi = gate_trust.wilson(0, 40)
    assert lo == 0.0 and hi == pytest.approx(1.959964 ** 2 / (40 + 1.959964 ** 2))
    lo, hi = gate_trust.wilson(40, 40)
    assert hi == 1.0 and lo == pytest.approx(40 / (40 + 1.959964 ** 2))
    assert gate_trust.wilson(0, 0) is None
    pairs = [{"kind": "aa", "status": "pass", "rows": {"x": "pass"}},
             {"kind": "aa", "status": "fail", "rows": {"x": "fail"}, "slowdown": 0.01},
             {"kind": "aa", "status": "ambiguous", "rows": {"x": "ambiguous"}},
             {"kind": "aa", "status": "pass", "rows": {"x": "pass"}},
             {"kind": "injected", "status": "fail", "rows": {"x": "fail"}, "slowdown": 0.05},
             {"kind": "injected", "status": "ambiguous", "rows": {"x": "ambiguous"}, "slowdown": 0.03}]
    s = gate_trust.summarize(pairs)
    assert s["aa"]["counts"] == {"pass": 2, "ambiguous": 1, "fail": 1} and s["aa"]["pairs"] == 4
    assert s["false_alarm_rate"] == 0.25 and s["aa_ambiguous_rate"] == 0.25
    assert s["detection_rate"] == 0.5 and s["injected_ambiguous_rate"] == 0.5
    assert s["injected"]["by_metric"] == {"x": {"fail": 1, "ambiguous": 1}}
    assert s["injected"]["slowdown_median"] == pytest.approx(0.04)
    assert s["false_alarm_ci95"] == gate_trust.wilson(1, 4)
    assert s["aa_run_spread"] == {"decode_tok_s": None, "prefill_tok_s": None}  # no samples kept
    spread = gate_trust.run_spread([{"kind": "aa", "samples": [[100, 101, 99], [110, 90, 104]]},
                                    {"kind": "aa", "samples": [[100, 100, 100], [98, 98, 98]]},
                                    {"kind": "injected", "samples": [[100, 100, 100], [50, 50, 50]]}], "samples")
    assert spread["pairs"] == 2 and spread["max"] == pytest.approx(0.04) and spread["median"] == pytest.approx(0.03)


def test_trust_script_runs_and_gates_pairs(tmp_path, monkeypatch):
    """The script end to end on the tiny model: a calibration run, one A/A pair and one pair slowed by 30 ms a step,
    gated and counted, the result written."""
    monkeypatch.setattr(gate_trust, "copy_bandwidth", lambda device: BW)
    out = tmp_path / "trust.json"
    args = gate_trust.parse_args(["--model", "tiny", "--device", "cpu", "--pairs", "1", "--injected-pairs", "1",
                                  "-n", "4", "--repeats", "5", "--warmup", "0", "--delay-us", "30000",
                                  "--out", str(out)])
    lines, runs, real = [], [], gate_trust.run_decode

    def counted(opts, **kw):
        runs.append((opts.repeats, opts.engine_options.inject_delay_us))
        return real(opts, **kw)

    monkeypatch.setattr(gate_trust, "run_decode", counted)
    r = gate_trust.run_trust(args, log=lines.append)
    # the calibration, the A/A pair, the injected pair's baseline and delayed candidate, then one plain settle run
    assert runs == [(5, 0.0), (5, 0.0), (5, 0.0), (5, 0.0), (5, 30000), (1, 0.0)]
    assert r["settle_runs"] == 1 and r["aa_run_spread"]["decode_tok_s"]["pairs"] == 1
    assert r["aa_run_spread"]["prefill_tok_s"]["pairs"] == 1
    assert json.loads(out.read_text())["pairs"] == r["pairs"]
    assert [p["kind"] for p in r["pairs"]] == ["aa", "injected"]
    assert r["aa"]["pairs"] == r["injected"]["pairs"] == 1 and sum(r["aa"]["counts"].values()) == 1
    inj = r["pairs"][1]
    assert inj["rows"]["decode_tok_s"] != "pass" and inj["slowdown"] > 0.5 and inj["repeats_run"] == [5, 5]
    assert [len(x) for x in inj["samples"]] == [5, 5] and inj["sm_mhz"] == [None, None]  # no GPU: no clock
    assert r["injected"]["slowdown_median_baseline_first"] == inj["slowdown"]
    assert r["injected"]["slowdown_median_candidate_first"] is None
    assert r["inject_delay_us"] == 30000 and r["plain_step_us"] > 0 and r["device"] == "cpu"
    assert "config" not in inj["rows"] and len(lines) == 3


def test_a_cuda_only_default_moved_parts_no_cpu_run_from_its_baseline():
    """--cudnn-prefill went on by default (session 79). A run records it as applied (Engine.recorded): off on a CPU,
    and off where the model's head size never takes the split. A CPU baseline that recorded it either way (earlier
    documents recorded the option asked for) is one experiment with a new CPU run, since a CPU run never splits; on
    CUDA, on and off are two. The CUDA-only settings the comparison skips on CPU runs are exactly the engine's
    switches that leave a CPU run alone."""
    from ninfer_bench.engine.runtime.options import SWITCHES
    from ninfer_bench.reports.experiment import CUDA_ONLY_SETTINGS, SETTING_KEYS

    assert set(CUDA_ONLY_SETTINGS) == {k for k in SETTING_KEYS if k in SWITCHES and not SWITCHES[k].cpu}
    new = run_decode(DecodeOptions.make(**TINY, repeats=1), copy_bw=BW)
    assert new["config"]["device"] == "cpu" and new["config"]["cudnn_prefill"] is False  # asked on, never applied
    old = json.loads(json.dumps(new))
    for recorded in (False, True):
        old["config"]["cudnn_prefill"] = recorded
        assert config_differences(old, new) == []
    for doc in (old, new):
        doc["config"]["device"] = "cuda:0"
    assert config_differences(old, new, timings=False) == ["cudnn_prefill True vs False"]
