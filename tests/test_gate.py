"""The regression gate: exact metrics must match; timing metrics are decided on the interval of their samples' shift
(fail only on a significant slowdown at or past the threshold, pass only when the interval stays within it, else
ambiguous with the repeats that would decide); the statistics it rests on agree with known values."""

import itertools
import json
import math
import statistics

import numpy as np
import pytest
from rich.console import Console

from ninfer_bench.reports.gate import (FAIL_FRACTION, Rule, RuleChange, default_rules, exit_code, expand, gate,
                                       load_rule_changes, load_rules, merge_rules, pair_results, parse_threshold,
                                       render_table)
from ninfer_bench.reports.metric_path import lookup, parse_path
from ninfer_bench.reports.schema import make_result
from ninfer_bench.reports.stats import (interval_rank, mann_whitney_u, min_interval_samples, rank_test,
                                        shift_interval)

ENV = {"git_sha": "0" * 40, "gpu": "NVIDIA H200", "torch": "2.13", "python": "3.11"}
MODEL = {"artifact_id": "5f3c", "quant_policy": "mixed", "model_type": "qwen3_5_text"}
SHA = "ab" * 32


def decode_doc(tok_s=None, *, label="v3-dflash2-k7", sha=SHA, accepted=60, config=None, ttft=None):
    """A decode result whose decode tok/s samples are ``tok_s`` (10 tight samples around 100 by default)."""
    tok_s = list(np.linspace(99.5, 100.5, 10)) if tok_s is None else list(tok_s)
    ttft = [20.0 + 0.01 * i for i in range(len(tok_s))] if ttft is None else ttft
    records = [{"repeat": i, "prompt_tokens": 500, "completion_tokens": 129, "decode_tok_s": v, "ttft_ms": t,
                "prefill_tok_s": 4000.0, "device_ms_per_round": 30.0, "rounds": 32, "drafted_tokens": 224,
                "accepted_tokens": accepted, "tokens_sha256": sha} for i, (v, t) in enumerate(zip(tok_s, ttft))]
    summary = {"prompt_tokens": 500, "completion_tokens": 129, "tokens_sha256": sha,
               "prefill_tok_s": 4000.0, "decode_tok_s": statistics.median(tok_s), "ttft_ms": statistics.median(ttft),
               "device_ms_per_round": 30.0, "rounds": 32, "drafted_tokens": 224, "accepted_tokens": accepted,
               "acceptance_rate": accepted / 224, "tokens_per_round": 1 + accepted / 32,
               "accepted_per_position": [0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.0], "peak_memory_bytes": 1 << 30,
               "deterministic": True,
               "samples": {"decode_tok_s": tok_s, "prefill_tok_s": [4000.0] * len(tok_s), "ttft_ms": ttft,
                           "device_ms_per_round": [30.0] * len(tok_s)}}
    cfg = {"engine": "ours", "runtime": "v3", "spec": "dflash2", "draft_tokens": 7, "kv_dtype": "int8",
           "device": "cuda:0", "max_new_tokens": 129, "repeats": len(tok_s), **(config or {})}
    return make_result("decode", label=label, config=cfg, records=records, summary=summary, model=MODEL, env=ENV)


def by_metric(verdicts):
    return {v.metric: v for v in verdicts}


def test_identical_documents_pass():
    doc = decode_doc()
    verdicts = gate(doc, json.loads(json.dumps(doc)))
    assert verdicts and all(v.status == "pass" for v in verdicts), [v for v in verdicts if v.status != "pass"]
    assert {v.metric for v in verdicts} == {r.metric for r in default_rules("decode")}
    assert exit_code(verdicts) == 0


def test_clearly_slower_with_tight_samples_fails():
    base = decode_doc(np.linspace(99.5, 100.5, 10))
    cand = decode_doc(np.linspace(79.5, 80.5, 10))
    v = by_metric(gate(base, cand))["decode_tok_s"]
    assert v.status == "fail", v
    assert v.change == pytest.approx(-0.2)
    assert v.p < 1e-3 and v.repeats_needed is None
    assert v.ci[0] == pytest.approx(-0.21, abs=0.01) and v.ci[1] == pytest.approx(-0.19, abs=0.01)
    assert "significant slowdown" in v.reason and "99% CI" in v.reason
    assert exit_code(gate(base, cand)) == 1


@pytest.mark.parametrize("device, status", [("cuda:0", "fail"), ("cuda", "fail"), ("cpu", "pass")])
def test_a_gpu_decode_run_is_held_to_its_tighter_step_threshold(device, status):
    """A 4.5% slower decode with tight samples: past a GPU's 4% (fail), within a CPU's 5% (pass); the threshold
    follows the runs' device, through the default rules and through merged ones (``ninfer-bench gate``'s)."""
    cfg = {"device": device}
    base, cand = decode_doc(config=cfg), decode_doc(np.linspace(95.0, 96.0, 10), config=cfg)
    assert by_metric(gate(base, cand))["decode_tok_s"].status == status
    merged = merge_rules("decode", [], device=device).rules
    assert by_metric(gate(base, cand, merged))["decode_tok_s"].status == status
    rules = {r.metric: r.threshold for r in default_rules("decode", device)}
    step = 0.04 if device.startswith("cuda") else 0.05
    assert rules["decode_tok_s"] == rules["device_ms_per_round"] == step and rules["prefill_tok_s"] == 0.10
    loose = merge_rules("decode", [parse_threshold("decode_tok_s=5")], device=device).rules  # a user's own word wins
    assert by_metric(gate(base, cand, loose))["decode_tok_s"].status == "pass"


def test_runs_on_different_devices_take_the_default_threshold_and_fail_as_different_experiments():
    base, cand = decode_doc(config={"device": "cuda"}), decode_doc(config={"device": "cpu"})
    rows = by_metric(gate(base, cand))
    assert rows["config"].status == "fail" and rows["decode_tok_s"].status == "pass"


@pytest.mark.parametrize("factor, status", [(0.95, "fail"), (0.94, "fail"), (0.98, "pass"), (1.0, "pass"),
                                            (1.2, "pass")])
def test_tight_samples_decide_around_the_threshold(factor, status):
    """10 tight samples a side (spread 1%): a 5% slowdown (the threshold) fails, 2% is within the threshold and
    passes, as does a speed-up."""
    base = decode_doc(np.linspace(99.5, 100.5, 10))
    cand = decode_doc(np.linspace(99.5, 100.5, 10)[::-1] * factor)
    v = by_metric(gate(base, cand))["decode_tok_s"]
    assert v.status == status, v
    assert v.repeats_needed is None


def test_a_significant_slowdown_well_short_of_the_threshold_is_not_failed():
    """2.5% slower, significant, but the 5% threshold still inside the interval: more repeats decide, never a fail on
    a slowdown estimated well short of the threshold (run-to-run drift could explain it)."""
    rng = np.random.default_rng(3)
    base = decode_doc(100 * (1 + 0.02 * rng.standard_normal(8)))
    cand = decode_doc(97.5 * (1 + 0.02 * rng.standard_normal(8)))
    v = by_metric(gate(base, cand))["decode_tok_s"]
    lo, hi = sorted(-x for x in v.ci)
    assert v.status == "ambiguous" and hi > 0.05, v
    assert v.repeats_needed > 8 and f"needs about {v.repeats_needed} repeats" in v.reason


def test_noisy_overlapping_samples_beyond_threshold_are_ambiguous():
    base = decode_doc([100, 60, 140, 90, 110, 70, 130])
    cand = decode_doc([85, 130, 50, 95, 70, 120, 60])  # median 85: 15% slower, but the samples overlap
    v = by_metric(gate(base, cand))["decode_tok_s"]
    assert v.status == "ambiguous", v
    assert v.p >= 0.05 and "spans no change" in v.reason and v.repeats_needed > 7
    assert exit_code([v]) == 3


@pytest.mark.parametrize("n", [2, 3, 4])
def test_too_few_repeats_are_ambiguous_never_fail_never_pass(n):
    """Below 5 samples a side no 99% interval exists: whatever the medians say (halved, stopped, equal, faster), the
    row is ambiguous with the repeats that would decide; 2 and 3 (decode's default) repeats never fail."""
    base = decode_doc(100 + 0.1 * np.arange(n))
    for cand in (50 + 0.1 * np.arange(n), [0.0] * n, 100 + 0.1 * np.arange(n), 150 + 0.1 * np.arange(n)):
        v = by_metric(gate(base, decode_doc(cand)))["decode_tok_s"]
        assert v.status == "ambiguous" and "too few" in v.reason, v
        assert v.repeats_needed >= min_interval_samples(0.01) == 5, v
    assert exit_code(gate(base, json.loads(json.dumps(base)))) == 3


@pytest.mark.parametrize("n", [2, 3])
def test_noisy_a_a_pairs_with_few_repeats_never_fail(n):
    """The issue's A/A pairs: the same build twice on a loaded machine, 2 or 3 repeats each. No timing fails."""
    rng = np.random.default_rng(n)
    for _ in range(30):
        base = decode_doc(100 * (1 + 0.08 * rng.standard_normal(n)), ttft=list(20 * (1 + 0.2 * rng.random(n))))
        cand = decode_doc(100 * (1 + 0.08 * rng.standard_normal(n)), ttft=list(20 * (1 + 0.2 * rng.random(n))))
        verdicts = gate(base, cand)
        assert all(v.status != "fail" for v in verdicts), [v for v in verdicts if v.status == "fail"]
        timing = [v for v in verdicts if v.kind == "timing"]
        assert all(v.status == "ambiguous" and v.repeats_needed >= 5 for v in timing), timing
        assert exit_code(verdicts) == 3


def test_a_a_pairs_of_five_repeats_rarely_fail_and_a_real_slowdown_does():
    """100 A/A pairs of 5 repeats each (noise 2%, heavy-tailed): at most one fails any row. A 10% slowdown with the
    same noise never passes: at 5 repeats it fails in most pairs (the rest are ambiguous: their 99% interval still
    reaches under half of the threshold), at 10 repeats in almost every pair."""
    rng = np.random.default_rng(7)

    def run(n, factor=1.0):
        tok = 100 * factor * (1 + 0.02 * rng.standard_t(3, n))
        return decode_doc(tok, ttft=list(20 / factor * (1 + 0.02 * rng.standard_t(3, n))))

    failed = sum(exit_code(gate(run(5), run(5))) == 1 for _ in range(100))
    assert failed <= 1, failed
    five = [by_metric(gate(run(5), run(5, 0.9)))["decode_tok_s"].status for _ in range(40)]
    assert "pass" not in five and five.count("fail") >= 26, five
    ten = [by_metric(gate(run(10), run(10, 0.9)))["decode_tok_s"].status for _ in range(40)]
    assert "pass" not in ten and ten.count("fail") >= 36, ten


def test_repeats_needed_is_about_what_decides():
    """An ambiguous A/A row says how many repeats would decide; with that many (same noise), it does."""
    rng = np.random.default_rng(11)

    def tok(n):
        return 100 * (1 + 0.03 * rng.standard_normal(n))

    v = by_metric(gate(decode_doc(tok(5)), decode_doc(tok(5))))["decode_tok_s"]
    assert v.status == "ambiguous" and 5 < v.repeats_needed < 200, v
    n = v.repeats_needed
    decided = [by_metric(gate(decode_doc(tok(n)), decode_doc(tok(n))))["decode_tok_s"].status for _ in range(10)]
    assert decided.count("pass") >= 8 and "fail" not in decided, decided


def test_improvement_passes_with_a_note():
    base, cand = decode_doc(np.linspace(99.5, 100.5, 10)), decode_doc(np.linspace(119.5, 120.5, 10))
    v = by_metric(gate(base, cand))["decode_tok_s"]
    assert v.status == "pass" and "improved" in v.reason and v.change == pytest.approx(0.2)


def test_lower_is_better_metric_regresses_upwards():
    base = decode_doc(ttft=list(np.linspace(19.9, 20.1, 10)))
    cand = decode_doc(ttft=list(np.linspace(29.9, 30.1, 10)))
    assert by_metric(gate(base, cand))["ttft_ms"].status == "fail"
    assert by_metric(gate(cand, base))["ttft_ms"].status == "pass"


def test_changed_token_hash_fails():
    v = by_metric(gate(decode_doc(), decode_doc(sha="cd" * 32)))["tokens_sha256"]
    assert v.status == "fail" and v.candidate == "cd" * 32


def test_changed_acceptance_count_fails():
    verdicts = gate(decode_doc(accepted=60), decode_doc(accepted=59))
    assert by_metric(verdicts)["accepted_tokens"].status == "fail"
    assert exit_code(verdicts) == 1


def test_exact_mismatch_on_a_nondeterministic_run_is_ambiguous():
    cand = decode_doc(accepted=59)
    cand["summary"]["deterministic"] = False
    assert by_metric(gate(decode_doc(), cand))["accepted_tokens"].status == "ambiguous"
    sampled = decode_doc(accepted=59, config={"temperature": 0.7, "seed": None})
    assert by_metric(gate(decode_doc(), sampled))["accepted_tokens"].status == "ambiguous"


def test_a_candidate_whose_greedy_repeats_disagree_fails():
    """Repeats of a greedy run that decode different tokens are a regression (a race, an uninitialised buffer), not
    an excuse: the exact rows it makes ambiguous would otherwise let the gate pass."""
    cand = decode_doc(sha="cd" * 32)
    cand["summary"]["deterministic"] = False
    verdicts = gate(decode_doc(), cand)
    rows = by_metric(verdicts)
    assert rows["tokens_sha256"].status == "ambiguous"
    assert rows["deterministic"].status == "fail" and "baseline's agreed" in rows["deterministic"].reason
    assert exit_code(verdicts) == 1
    # a baseline whose repeats already disagreed: the candidate agreeing is an improvement, both disagreeing equal
    base = decode_doc()
    base["summary"]["deterministic"] = False
    assert by_metric(gate(base, decode_doc()))["deterministic"].status == "pass"
    assert by_metric(gate(base, cand))["deterministic"].status == "pass"
    # sampling without a seed is not expected to repeat itself
    sampled = decode_doc(config={"temperature": 0.7, "seed": None})
    sampled["summary"]["deterministic"] = False
    assert by_metric(gate(decode_doc(), sampled))["deterministic"].status == "ambiguous"


def test_missing_metric_is_missing_and_exits_1():
    cand = decode_doc()
    del cand["summary"]["accepted_tokens"]
    verdicts = gate(decode_doc(), cand)
    v = by_metric(verdicts)["accepted_tokens"]
    assert v.status == "missing" and "candidate" in v.reason
    assert exit_code(verdicts) == 1
    only_missing = [x for x in verdicts if x.status != "pass"]
    assert only_missing == [v]


def test_peak_memory_is_judged_on_the_threshold_alone():
    cand = decode_doc()
    cand["summary"]["peak_memory_bytes"] = 2 << 30
    v = by_metric(gate(decode_doc(), cand))["peak_memory_bytes"]
    assert v.kind == "threshold" and v.status == "fail" and "threshold alone" in v.reason, v
    cand["summary"]["peak_memory_bytes"] = (1 << 30) + (1 << 20)
    assert by_metric(gate(decode_doc(), cand))["peak_memory_bytes"].status == "pass"
    cand["summary"]["peak_memory_bytes"] = 1 << 29
    assert "improved" in by_metric(gate(decode_doc(), cand))["peak_memory_bytes"].reason
    with pytest.raises(ValueError, match="takes no samples"):
        Rule("peak_memory_bytes", "threshold", samples="samples.x")


def test_a_timing_without_samples_is_never_failed():
    """One number a side (no samples path, or a document without the samples): within the threshold it passes,
    beyond it the row is ambiguous, never a failure."""
    base, cand = decode_doc(), decode_doc(np.linspace(79.5, 80.5, 10))
    del cand["summary"]["samples"]["decode_tok_s"]
    v = by_metric(gate(base, cand))["decode_tok_s"]
    assert v.status == "ambiguous" and "no samples.decode_tok_s in the candidate" in v.reason, v
    v = by_metric(gate(base, cand, [Rule("decode_tok_s")]))["decode_tok_s"]
    assert v.status == "ambiguous" and "no samples" in v.reason, v
    within = decode_doc(np.linspace(97.5, 98.5, 10))
    v = by_metric(gate(base, within, [Rule("decode_tok_s")]))["decode_tok_s"]
    assert v.status == "pass" and "threshold alone" in v.reason, v


def test_samples_that_are_not_numbers_are_named():
    base, cand = decode_doc(), decode_doc(np.linspace(79.5, 80.5, 10))
    base["summary"]["samples_text"], cand["summary"]["samples_text"] = [1.0, 2.0, 3.0], "abc"
    with pytest.raises(ValueError, match="candidate samples_text: expected a list of numbers"):
        gate(base, cand, [Rule("decode_tok_s", samples="samples_text")])


@pytest.mark.parametrize("metric, value", [("decode_tok_s", math.inf), ("ttft_ms", -math.inf)])
def test_an_infinite_candidate_timing_fails(metric, value):
    """Infinite tok/s (or negative-infinite latency) is no unbounded improvement: it cannot be judged."""
    cand = decode_doc()
    cand["summary"][metric], cand["summary"]["samples"][metric] = value, [value]
    verdicts = gate(decode_doc(), json.loads(json.dumps(cand)))  # Python's json writes and reads Infinity
    v = by_metric(verdicts)[metric]
    assert v.status == "missing" and v.reason == f"not finite: candidate is {value!r}; candidate samples.{metric} " \
        f"holds {value!r}", v
    assert exit_code(verdicts) == 1


def test_an_infinite_baseline_timing_fails():
    base = decode_doc()
    base["summary"]["decode_tok_s"], base["summary"]["samples"]["decode_tok_s"] = math.inf, [math.inf]
    v = by_metric(gate(base, decode_doc()))["decode_tok_s"]
    assert v.status == "missing" and "not finite: baseline is inf" in v.reason, v
    # a finite median over a sample that is not: the samples cannot be trusted either, within the threshold or not
    base = decode_doc()
    base["summary"]["samples"]["decode_tok_s"][3] = math.inf
    verdicts = gate(base, decode_doc())
    v = by_metric(verdicts)["decode_tok_s"]
    assert v.status == "missing" and v.reason == "not finite: baseline samples.decode_tok_s holds inf", v
    assert exit_code(verdicts) == 1


def test_cli_fails_an_infinite_candidate(tmp_path):
    from click.testing import CliRunner

    from ninfer_bench.cli import main
    from ninfer_bench.reports.schema import write_result

    cand = decode_doc()
    cand["summary"]["decode_tok_s"], cand["summary"]["samples"]["decode_tok_s"] = math.inf, [math.inf]
    write_result(decode_doc(), tmp_path / "a.json")
    write_result(cand, tmp_path / "b.json")
    assert "Infinity" in (tmp_path / "b.json").read_text()
    r = CliRunner().invoke(main, ["gate", "--baseline", str(tmp_path / "a.json"), "--candidate",
                                  str(tmp_path / "b.json")], terminal_width=200)
    assert r.exit_code == 1 and "not finite" in r.output, r.output


def test_a_non_finite_exact_metric_fails_even_when_equal():
    doc = decode_doc()
    doc["summary"]["drafted_tokens"] = math.inf
    doc["summary"]["accepted_per_position"][2] = math.nan
    verdicts = by_metric(gate(doc, json.loads(json.dumps(doc))))
    assert verdicts["drafted_tokens"].status == "missing", verdicts["drafted_tokens"]
    assert verdicts["drafted_tokens"].reason == "not finite: baseline is inf; candidate is inf"
    assert verdicts["accepted_per_position"].status == "missing", verdicts["accepted_per_position"]
    assert verdicts["accepted_per_position"].reason == "not finite: baseline holds nan; candidate holds nan"


def test_an_exact_difference_of_type_is_named():
    """The string "32" and the number 32 print alike: the reason says what differs."""
    cand = decode_doc()
    cand["summary"]["rounds"] = "32"
    verdicts = gate(decode_doc(), cand)
    v = by_metric(verdicts)["rounds"]
    assert v.status == "fail" and v.reason == 'differs: int 32 vs str "32"', v
    console = Console(record=True, width=200)
    console.print(render_table(verdicts))
    assert 'differs: int 32 vs str "32"' in console.export_text()
    assert by_metric(gate(decode_doc(accepted=60), decode_doc(accepted=59)))["accepted_tokens"].reason == "differs"


def test_different_suites_are_refused():
    niah = make_result("niah", label="x", config={}, records=[], env=ENV,
                       summary={"cases": 0, "oracle_agreement": 1.0, "retrieval": 1.0, "first_divergence": {}})
    with pytest.raises(ValueError, match="cannot gate"):
        gate(decode_doc(), niah)


def test_config_difference_fails_unless_allowed():
    cand = decode_doc(config={"spec": "mtp", "draft_tokens": 3})
    verdicts = gate(decode_doc(), cand)
    assert verdicts[0].metric == "config" and verdicts[0].status == "fail" and exit_code(verdicts) == 1
    assert "spec 'dflash2' vs 'mtp'" in verdicts[0].reason and "draft_tokens 7 vs 3" in verdicts[0].reason
    allowed = gate(decode_doc(), cand, allow_config_change=True)
    assert allowed[0].status == "ambiguous" and exit_code(allowed) == 3
    assert "config" not in by_metric(gate(decode_doc(), decode_doc(config={"repeats": 5})))
    # --quant builds --synthetic weights only: an artifact run's recorded default (earlier documents) is no difference
    assert "config" not in by_metric(gate(decode_doc(config={"quant": "mixed"}), decode_doc(config={"quant": None})))
    synthetic = gate(decode_doc(config={"synthetic": True, "quant": "mixed"}),
                     decode_doc(config={"synthetic": True, "quant": "q4"}))
    assert synthetic[0].metric == "config" and "quant 'mixed' vs 'q4'" in synthetic[0].reason


@pytest.mark.parametrize("key, b, c", [
    ("prompt_file", "/a/short.txt", "/a/long.txt"), ("prompts", None, "set.jsonl"), ("runtime", "v3", "v2"),
    ("engine", "ours", "hf"), ("rollback", "recompute", "snapshot"), ("lm_head_draft", 0, 4096),
    ("ctxs", [2048], [8192]), ("depths", [0, 50], [100]), ("answer_tokens", 8, 16), ("cases", 1, 2),
    ("seed", 0, 1), ("levels", [1, 2], [1, 4]), ("prompt_tokens", 32, 64),
])
def test_every_experiment_key_makes_a_config_difference(key, b, c):
    verdicts = gate(decode_doc(config={key: b}), decode_doc(config={key: c}))
    assert verdicts[0].metric == "config" and verdicts[0].status == "fail" and key in verdicts[0].reason


@pytest.mark.parametrize("key, b, c", [
    ("pdl", True, False), ("side_stream", True, False), ("silu_epilogue", True, False), ("lookahead", True, False),
    ("draft_graphs", True, False), ("prefill_chunk", 2048, 512), ("interleave_chunk", 512, 128),
    ("max_context", 8192, 65536), ("ignore_eos", True, False), ("synthetic", False, True),
])
def test_engine_switches_make_a_config_difference(key, b, c):
    """``--pdl off`` (or a smaller prefill chunk) against a default baseline is another experiment, not a speed
    change of the build; a document made before a switch existed does not say, and is not held against it."""
    verdicts = gate(decode_doc(config={key: b}), decode_doc(config={key: c}))
    assert verdicts[0].metric == "config" and verdicts[0].status == "fail" and f"{key} {b!r} vs {c!r}" in \
        verdicts[0].reason
    older = decode_doc()
    assert key not in older["config"]
    assert "config" not in by_metric(gate(older, decode_doc(config={key: c})))
    # recorded as null (in-process concurrency's max_context before it recorded the resolved value): not held either
    assert "config" not in by_metric(gate(decode_doc(config={key: None}), decode_doc(config={key: c})))


def test_cpu_timings_of_another_cpu_are_another_experiment():
    """A CPU baseline made on a laptop against a candidate on the CI box: the timings compare machines. Exact metrics
    still compare across CPUs (CI's machines vary), and documents that do not name their CPU model are not held
    against each other."""
    base, cand = decode_doc(config={"device": "cpu"}), decode_doc(config={"device": "cpu"})
    base["env"] = {**ENV, "gpu": None, "cpu_model": "Apple M3 Max", "cpu_count": 16}
    cand["env"] = {**ENV, "gpu": None, "cpu_model": "AMD EPYC 9654 96-Core Processor", "cpu_count": 2}
    verdicts = gate(base, cand)
    assert verdicts[0].metric == "config" and verdicts[0].status == "fail"
    assert "env.cpu_model 'Apple M3 Max'" in verdicts[0].reason and "env.cpu_count 16 vs 2" in verdicts[0].reason
    exact = [r for r in default_rules("decode") if r.kind == "exact"]
    assert "config" not in by_metric(gate(base, cand, exact))
    del base["env"]["cpu_model"], base["env"]["cpu_count"]
    assert "config" not in by_metric(gate(base, cand))


def test_what_is_not_the_experiment_is_no_config_difference():
    """A checkout's location, and the GPU of a CPU run, do not make another experiment."""
    base = decode_doc(config={"prompt_file": "/home/ci/repo/suites/data/short.txt", "device": "cpu",
                              "images": ["/home/ci/cat.png"]})
    cand = decode_doc(config={"prompt_file": "/work/main/suites/data/short.txt", "device": "cpu",
                              "images": ("cat.png",)})  # a fresh document holds tuples, one read back lists
    cand["env"] = {**cand["env"], "gpu": None}
    assert "config" not in by_metric(gate(base, cand))
    cand["config"]["device"] = "cuda:0"
    assert "env.gpu" in by_metric(gate(base, cand))["config"].reason


def test_runs_differing_only_in_sample_counts_are_one_experiment():
    """Concurrency's --rounds, like decode's --repeats, is how many samples a run takes: the rank test weighs it."""
    base, cand = concurrency_doc([1, 2]), concurrency_doc([1, 2])
    base["config"]["rounds"], cand["config"]["rounds"] = 1, 2
    verdicts = gate(base, cand)
    assert "config" not in by_metric(verdicts) and exit_code(verdicts) == 0
    assert "config" not in by_metric(gate(decode_doc(config={"repeats": 3}), decode_doc(config={"repeats": 10})))


def test_kernel_weight_formats_make_a_config_difference():
    """The same op, shape, variant and T timed in fp32 and in q5 are different experiments, not a speed change."""
    base, cand = kernels_doc(5.0), kernels_doc(5.0)
    for doc, fmt in ((base, "q5_g64_fp16"), (cand, "fp32")):
        for rec in doc["records"]:
            rec["fmt"] = fmt if rec["op"] == "gdn_decode" else "q8_g32_fp16"
    verdicts = gate(base, cand)
    assert verdicts[0].metric == "config" and verdicts[0].status == "fail"
    assert verdicts[0].reason.endswith("fmt of gdn_decode 'q5_g64_fp16' vs 'fp32'")
    assert "config" not in by_metric(gate(base, base))


def test_rules_that_apply_to_nothing_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no gate rule applies to a decode result .the rules are for niah"):
        gate(decode_doc(), decode_doc(), [Rule("cases", "exact", suite="niah")])
    with pytest.raises(ValueError, match="no gate rule applies"):
        gate(decode_doc(), decode_doc(), [])
    (tmp_path / "r.json").write_text("[]")
    with pytest.raises(ValueError, match="r.json: no rules"):
        load_rules(tmp_path / "r.json")
    assert exit_code([]) == 1  # nothing compared is no pass


def test_niah_oracle_agreement_must_match():
    def niah(agreement):
        return make_result("niah", label="n", config={"device": "cuda:0"}, records=[], env=ENV, model=MODEL,
                           summary={"cases": 8, "oracle_agreement": agreement, "retrieval": 1.0,
                                    "first_divergence": {"c0": None}})
    assert by_metric(gate(niah(1.0), niah(1.0)))["oracle_agreement"].status == "pass"
    assert by_metric(gate(niah(1.0), niah(0.875)))["oracle_agreement"].status == "fail"


def concurrency_doc(levels, scale=1.0):
    rows = []
    for c in levels:
        agg = [100.0 * c * scale + 0.1 * i for i in range(6)]
        rows.append({"concurrency": c, "aggregate_tok_s": statistics.median(agg), "per_request_tok_s": 100.0 * scale,
                     "ttft_ms_p50": 20.0, "ttft_ms_p90": 22.0, "ttft_ms_p99": 25.0, "itl_ms_p50": 10.0,
                     "itl_ms_p90": 11.0, "itl_ms_p99": 12.0, "e2e_ms_p50": 900.0, "e2e_ms_p99": 950.0,
                     "matches_sequential": True,
                     "samples": {"aggregate_tok_s": agg, "ttft_ms": [20.0] * 6, "itl_ms": [10.0] * 6}})
    return make_result("concurrency", label="c", config={"device": "cuda:0"}, records=[], env=ENV, model=MODEL,
                       summary={"levels": rows})


def test_concurrency_levels_expand_and_a_dropped_level_is_missing():
    base, cand = concurrency_doc([1, 2, 4]), concurrency_doc([1, 2])
    verdicts = by_metric(gate(base, cand))
    assert verdicts["levels[concurrency=2].aggregate_tok_s"].status == "pass"
    assert verdicts["levels[concurrency=4].aggregate_tok_s"].status == "missing"
    assert "no levels[concurrency=4]" in verdicts["levels[concurrency=4].aggregate_tok_s"].reason
    slow = by_metric(gate(base, concurrency_doc([1, 2, 4], scale=0.5)))
    assert slow["levels[concurrency=4].aggregate_tok_s"].status == "fail"
    per_request = slow["levels[concurrency=4].per_request_tok_s"]  # no samples: never failed on one number
    assert per_request.status == "ambiguous" and "no samples" in per_request.reason


def kernels_doc(us_v3, ok=True):
    recs = []
    for op, shape in (("rmsnorm", [1, 5120]), ("gdn_decode", [1, 48, 128, 128])):
        for variant, us in (("v2", 10.0), ("v3", us_v3)):
            samples = [us + 0.01 * i for i in range(9)]
            recs.append({"op": op, "shape": shape, "variant": variant, "t": 1, "us_median": statistics.median(samples),
                         "us_p10": samples[1], "us_p90": samples[-2], "samples_us": samples, "bytes": 1 << 20,
                         "gbps": 100.0, "roofline_fraction": 0.02, "max_rel_err": 1e-3 if ok else 0.5,
                         "ok": ok or variant == "v2"})
    return make_result("kernels", label="k", config={"device": "cuda:0"}, records=recs, env=ENV,
                       summary={"ops": 2, "copy_bandwidth_gbps": 4000.0, "timer": "cuda-events"})


def test_kernel_records_expand_per_op_shape_variant():
    verdicts = by_metric(gate(kernels_doc(5.0), kernels_doc(7.0)))
    key = "records[op=gdn_decode,shape=1x48x128x128,variant=v3,t=1].us_median"
    assert verdicts[key].status == "fail"
    assert verdicts[key.replace("variant=v3", "variant=v2")].status == "pass"
    assert len(verdicts) == 8  # per record: its check against the reference, its time
    assert verdicts[key.replace("us_median", "ok")].status == "pass"


def test_a_kernel_that_fails_its_check_fails_the_gate_however_fast():
    """A v3 kernel that got faster by computing the wrong thing (its check against the fp32 reference failed in the
    candidate's own run) is no speedup: its ``ok`` row fails."""
    verdicts = gate(kernels_doc(5.0), kernels_doc(2.0, ok=False))
    rows = by_metric(verdicts)
    key = "records[op=gdn_decode,shape=1x48x128x128,variant=v3,t=1]"
    assert rows[f"{key}.us_median"].status == "pass"  # improved
    assert rows[f"{key}.ok"].status == "fail" and rows[f"{key}.ok"].candidate is False
    assert rows[key.replace("variant=v3", "variant=v2") + ".ok"].status == "pass"
    assert exit_code(verdicts) == 1
    # judged on the candidate: still broken fails, fixed passes
    assert by_metric(gate(kernels_doc(5.0, ok=False), kernels_doc(5.0, ok=False)))[f"{key}.ok"].status == "fail"
    fixed = by_metric(gate(kernels_doc(5.0, ok=False), kernels_doc(5.0)))[f"{key}.ok"]
    assert fixed.status == "pass" and "fixed" in fixed.reason


def test_lookup_paths():
    doc = kernels_doc(5.0)
    assert lookup(doc, "records[op=rmsnorm,variant=v3].us_median") == pytest.approx(5.04)
    assert lookup(doc, "records[0].variant") == "v2"
    assert lookup(doc, "timer") == "cuda-events"
    with pytest.raises(KeyError, match="2 items match"):
        lookup(doc, "records[op=rmsnorm].us_median")
    for bad in ("", "a[b", "a[x].", "levels[concurrency].x"):
        with pytest.raises(ValueError):
            parse_path(bad)


def test_load_rules_json_and_toml(tmp_path):
    rules = [{"metric": "levels[concurrency=*].aggregate_tok_s", "kind": "timing", "higher_is_better": True,
              "threshold": 0.1, "samples": "levels[concurrency=*].samples.aggregate_tok_s", "suite": "concurrency"},
             {"metric": "decode_tok_s", "threshold": 0.02}]
    (tmp_path / "r.json").write_text(json.dumps({"rules": rules}))
    (tmp_path / "r.toml").write_text(
        '[[rules]]\nmetric = "levels[concurrency=*].aggregate_tok_s"\nkind = "timing"\nhigher_is_better = true\n'
        'threshold = 0.1\nsamples = "levels[concurrency=*].samples.aggregate_tok_s"\nsuite = "concurrency"\n\n'
        '[[rules]]\nmetric = "decode_tok_s"\nthreshold = 0.02\n')
    from_json, from_toml = load_rules(tmp_path / "r.json"), load_rules(tmp_path / "r.toml")
    assert from_json == from_toml and from_json[0].threshold == 0.1 and from_json[1].kind == "timing"
    concrete = expand(from_json[:1], concurrency_doc([1, 8]), concurrency_doc([1, 8]))
    assert [r.samples for r in concrete] == ["levels[concurrency=1].samples.aggregate_tok_s",
                                             "levels[concurrency=8].samples.aggregate_tok_s"]
    # a rule for another suite is ignored
    assert {v.metric for v in gate(decode_doc(), decode_doc(), from_json)} == {"decode_tok_s"}


@pytest.mark.parametrize("text, match", [
    ('[{"metric": "x", "treshold": 0.1}]', r"unknown key\(s\) \['treshold'\]"),
    ('[{"metric": "x", "kind": "fuzzy"}]', "kind must be one of"),
    ('[{"kind": "exact"}]', "has no 'metric'"),
    ('{"rule": []}', "unknown top-level"),
    ('[{"metric": "x", "threshold": -1}]', "threshold"),
])
def test_load_rules_errors_name_the_problem(tmp_path, text, match):
    path = tmp_path / "rules.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_rules(path)


def test_render_table_shows_every_verdict():
    verdicts = gate(decode_doc(), decode_doc(sha="cd" * 32))
    table = render_table(verdicts)
    assert table.row_count == len(verdicts)
    console = Console(record=True, width=200)
    console.print(table)
    text = console.export_text()
    assert "tokens_sha256" in text and "fail" in text and "abababababab" in text


# ---- the U test ------------------------------------------------------------------------------------------
def test_u_test_known_values():
    # scipy.stats.mannwhitneyu documentation example (Mann & Whitney 1947): U1 = 17
    males, females = [19, 22, 16, 29, 24], [20, 11, 17, 12]
    exact = mann_whitney_u(males, females, method="exact")
    assert exact.u == 17 and exact.p == pytest.approx(0.1111111111111111)
    assert mann_whitney_u(males, females, method="asymptotic").p == pytest.approx(0.11134688653314041, rel=1e-9)
    # fully separated samples: only the two extreme splits of C(6,3) = 20 are as extreme -> p = 2/20
    assert mann_whitney_u([1, 2, 3], [4, 5, 6]).p == pytest.approx(0.1)
    assert mann_whitney_u([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]).p == pytest.approx(2 / 252)
    assert mann_whitney_u([1, 2, 3], [1, 2, 3]).p == pytest.approx(1.0)


def test_u_test_tie_corrected_normal_approximation_by_hand():
    # pooled 1 2 2 2 3 3 3 4 5: ranks 1, 3 3 3, 6 6 6, 8, 9; x = [1, 2, 2, 3] has R1 = 1 + 3 + 3 + 6 = 13,
    # U1 = 13 - 4*5/2 = 3; mean 10; ties two groups of 3: sum(t^3 - t) = 48;
    # var = 4*5/12 * (10 - 48 / (9*8)) = 15.5556; z = (|3 - 10| - 0.5) / 3.9441 = 1.6481; p = 2 (1 - Phi(z))
    r = mann_whitney_u([1, 2, 2, 3], [2, 3, 3, 4, 5], method="asymptotic")
    assert r.u == 3
    var = 4 * 5 / 12 * (10 - 48 / 72)
    assert r.p == pytest.approx(math.erfc((7 - 0.5) / math.sqrt(var) / math.sqrt(2)))
    assert r.p == pytest.approx(0.0993, abs=5e-4)


def test_u_test_exact_with_ties_matches_brute_force_enumeration():
    x, y = [1, 2, 2, 3, 5], [2, 3, 3, 4, 5, 6]
    pooled = x + y
    def u_of(idx):
        xs = [pooled[i] for i in idx]
        ys = [pooled[i] for i in range(len(pooled)) if i not in idx]
        return sum((a > b) + 0.5 * (a == b) for a in xs for b in ys)
    us = [u_of(set(c)) for c in itertools.combinations(range(len(pooled)), len(x))]
    u0 = u_of(set(range(len(x))))
    lo, hi = sum(u <= u0 for u in us) / len(us), sum(u >= u0 for u in us) / len(us)
    r = mann_whitney_u(x, y, method="exact")
    assert r.u == u0
    assert r.p == pytest.approx(min(1.0, 2 * min(lo, hi)))


def test_rank_test_needs_three_samples_a_side():
    far = rank_test([100.0, 100.1], [1.0 + i for i in range(20)])  # exact p = 2/231 < 0.05, but 2 samples
    assert mann_whitney_u([100.0, 100.1], [1.0 + i for i in range(20)]).p < 0.05
    assert not far.significant and far.powerless
    assert rank_test([1, 2, 3, 4], [5, 6, 7, 8]).significant  # 2/70 = 0.029
    assert rank_test([1, 2, 3, 4], [5, 6, 7, 8]).direction == 1
    assert rank_test([], [1, 2, 3]).p is None


def test_rule_validation():
    with pytest.raises(ValueError, match="wildcard"):
        Rule("decode_tok_s", samples="levels[concurrency=*].samples.x")
    with pytest.raises(ValueError, match="higher_is_better"):
        Rule("decode_tok_s", higher_is_better="yes")


def test_cli_gates_different_settings_only_when_asked(tmp_path):
    from click.testing import CliRunner

    from ninfer_bench.cli import main
    from ninfer_bench.reports.schema import write_result

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_result(decode_doc(), a)
    write_result(decode_doc(config={"spec": "mtp", "draft_tokens": 3}), b)
    args = ["gate", "--baseline", str(a), "--candidate", str(b)]
    assert CliRunner().invoke(main, args).exit_code == 1
    r = CliRunner().invoke(main, args + ["--allow-config-change"])
    assert r.exit_code == 3 and "gate: ambiguous (exit 3)" in r.output, r.output


# ---- rules merged into the defaults ------------------------------------------------------------------------
def _metrics(rules):
    return {r.metric: r for r in rules}


def test_a_rules_file_that_loosens_one_timing_keeps_every_other_default(tmp_path):
    """The issue's trap: a file that only loosens decode_tok_s must not drop the token-hash checks."""
    (tmp_path / "r.toml").write_text('[[rules]]\nmetric = "decode_tok_s"\nthreshold = 0.10\n')
    merged = merge_rules("decode", load_rule_changes(tmp_path / "r.toml"))
    rules = _metrics(merged.rules)
    assert set(rules) == {r.metric for r in default_rules("decode")} and merged.removed == []
    assert rules["decode_tok_s"].threshold == 0.10
    assert rules["decode_tok_s"].samples == "samples.decode_tok_s" and rules["decode_tok_s"].higher_is_better
    assert rules["tokens_sha256"].kind == "exact"
    verdicts = by_metric(gate(decode_doc(), decode_doc(sha="cd" * 32), merged.rules))
    assert verdicts["tokens_sha256"].status == "fail"
    # 8% slower with tight samples: fails at the default 5%, passes at 10%
    base, cand = decode_doc(np.linspace(99.5, 100.5, 10)), decode_doc(np.linspace(91.5, 92.5, 10))
    assert by_metric(gate(base, cand))["decode_tok_s"].status == "fail"
    assert by_metric(gate(base, cand, merged.rules))["decode_tok_s"].status == "pass"


def test_removing_a_rule_must_be_explicit_and_is_reported(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"rules": [
        {"metric": "tokens_sha256", "remove": True}, {"metric": "peak_memory_bytes", "remove": True},
        {"metric": "rounds", "kind": "timing"}, {"metric": "vision_encode_ms", "higher_is_better": False,
                                                "samples": "samples.vision_encode_ms", "suite": "decode"}]}))
    merged = merge_rules("decode", load_rule_changes(tmp_path / "r.json"))
    rules = _metrics(merged.rules)
    assert "tokens_sha256" not in rules and "peak_memory_bytes" not in rules
    assert rules["rounds"].kind == "timing" and rules["vision_encode_ms"].samples == "samples.vision_encode_ms"
    assert [(r["metric"], r["kind"], r["what"]) for r in merged.removed] == [
        ("tokens_sha256", "exact", "removed"), ("peak_memory_bytes", "threshold", "removed"),
        ("rounds", "exact", "made a timing rule")]
    assert merged.removed[0]["source"] == "r.json rule 1"
    # another suite's results: the decode-only entry does not apply, removals of rules it lacks are ignored
    assert {r.metric for r in merge_rules("niah", load_rule_changes(tmp_path / "r.json")).rules} == \
        {r.metric for r in default_rules("niah")} | {"rounds"}


@pytest.mark.parametrize("text, match", [
    ('[{"metric": "decode_tok_s", "remove": true, "threshold": 0.1}]', "a removal takes only metric and suite"),
    ('[{"metric": "decode_tok_s", "remove": "yes"}]', "remove must be true or false"),
    ('[{"metric": "nope", "remove": true, "suite": "decode"}]', "no decode rule has"),
    ('[{"metric": "peak_memory_bytes", "samples": "samples.x"}]', "takes no samples"),
])
def test_rule_changes_that_cannot_merge_are_named(tmp_path, text, match):
    (tmp_path / "r.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        merge_rules("decode", load_rule_changes(tmp_path / "r.json"))


def test_load_rules_refuses_a_removal(tmp_path):
    (tmp_path / "r.json").write_text('[{"metric": "tokens_sha256", "remove": true}]')
    with pytest.raises(ValueError, match="removal applies only when a rules file merges"):
        load_rules(tmp_path / "r.json")


def test_threshold_option_changes_a_rule_or_one_instance_of_a_wildcard():
    merged = merge_rules("decode", [parse_threshold("decode_tok_s=10"), parse_threshold("ttft_ms=25%")])
    rules = _metrics(merged.rules)
    assert rules["decode_tok_s"].threshold == pytest.approx(0.10) and rules["ttft_ms"].threshold == 0.25
    with pytest.raises(ValueError, match="tokens_sha256 is an exact decode rule"):
        merge_rules("decode", [parse_threshold("tokens_sha256=5")])
    for bad in ("decode_tok_s", "decode_tok_s=-1", "=5", "decode_tok_s=fast"):
        with pytest.raises(ValueError, match="expected METRIC=PCT"):
            parse_threshold(bad)
    assert merge_rules("decode", [parse_threshold("nope=5")]).used == []  # --threshold never adds a rule
    # one level of a wildcard rule: that instance's threshold, the others' the default
    merged = merge_rules("concurrency", [parse_threshold("levels[concurrency=4].aggregate_tok_s=30")])
    base, cand = concurrency_doc([1, 4]), concurrency_doc([1, 4], scale=0.8)
    rows = by_metric(gate(base, cand, merged.rules))
    assert rows["levels[concurrency=4].aggregate_tok_s"].status == "pass"
    assert rows["levels[concurrency=1].aggregate_tok_s"].status == "fail"
    assert [v.metric for v in gate(base, cand, merged.rules)].count("levels[concurrency=4].aggregate_tok_s") == 1
    kernels = merge_rules("kernels", [RuleChange("records[variant=v3,op=rmsnorm,shape=1x5120,t=1].us_median",
                                                 {"threshold": 0.5})])
    instance = kernels.rules[-1]
    assert instance.metric == "records[op=rmsnorm,shape=1x5120,variant=v3,t=1].us_median"  # the wildcard's key order
    assert instance.samples == "records[op=rmsnorm,shape=1x5120,variant=v3,t=1].samples_us"
    assert instance.threshold == 0.5 and instance.higher_is_better is False


# ---- exit codes, the CLI, grids --------------------------------------------------------------------------
def test_exit_codes_tell_pass_fail_and_ambiguous():
    base = decode_doc()
    assert exit_code(gate(base, json.loads(json.dumps(base)))) == 0
    assert exit_code(gate(base, decode_doc(sha="cd" * 32))) == 1
    assert exit_code(gate(decode_doc([100, 101, 99]), decode_doc([100, 101, 99]))) == 3
    assert exit_code([]) == 1


def _cli(*args):
    from click.testing import CliRunner

    from ninfer_bench.cli import main

    return CliRunner().invoke(main, ["gate", *map(str, args)], terminal_width=200)


def test_cli_merges_rules_and_thresholds_and_reports_removals(tmp_path):
    from ninfer_bench.reports.schema import write_result

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_result(decode_doc(np.linspace(99.5, 100.5, 10)), a)
    write_result(decode_doc(np.linspace(91.5, 92.5, 10), sha="cd" * 32), b)
    r = _cli("--baseline", a, "--candidate", b)
    assert r.exit_code == 1 and "tokens_sha256" in r.output, r.output
    (tmp_path / "loose.toml").write_text('[[rules]]\nmetric = "decode_tok_s"\nthreshold = 0.10\n')
    r = _cli("--baseline", a, "--candidate", b, "--rules", tmp_path / "loose.toml", "--json")
    assert r.exit_code == 1, r.output  # the hash still fails
    out = json.loads(r.stdout)
    rows = {v["metric"]: v for v in out["pairs"][0]["verdicts"]}
    assert rows["decode_tok_s"]["status"] == "pass" and rows["tokens_sha256"]["status"] == "fail"
    assert out["status"] == "fail" and out["exit_code"] == 1 and out["rules"]["removed"] == []
    (tmp_path / "drop.toml").write_text('[[rules]]\nmetric = "tokens_sha256"\nremove = true\n')
    r = _cli("--baseline", a, "--candidate", b, "--rules", tmp_path / "drop.toml", "--threshold", "decode_tok_s=10",
             "--json")
    assert r.exit_code == 0, r.output
    assert "warning: drop.toml rule 1 removed the exact decode rule tokens_sha256; it is no longer checked" in \
        " ".join(r.stderr.split())
    out = json.loads(r.stdout)
    assert out["rules"]["removed"] == [{"suite": "decode", "metric": "tokens_sha256", "kind": "exact",
                                        "source": "drop.toml rule 1", "what": "removed"}]
    assert {c["source"] for c in out["rules"]["changes"]} == {"drop.toml rule 1", "--threshold decode_tok_s=10"}
    r = _cli("--baseline", a, "--candidate", b, "--threshold", "nope=5")
    assert r.exit_code == 1 and "no rule of the gated decode has metric 'nope'" in r.output, r.output
    r = _cli("--baseline", a, "--candidate", b, "--threshold", "decode_tok_s")
    assert r.exit_code == 2 and "METRIC=PCT" in r.output, r.output


def test_cli_gates_a_grid_of_cpu_and_gpu_runs_each_at_its_own_threshold(tmp_path):
    """Two folders, each holding a CPU run and a GPU run 4.5% slower with tight samples: the GPU pair fails (4%), the
    CPU pair passes (5%); a rules file reaches both; a removal is reported once."""
    from ninfer_bench.reports.schema import write_result

    for side, lo in (("base", 99.5), ("cand", 95.0)):
        (tmp_path / side).mkdir()
        for device in ("cpu", "cuda"):
            write_result(decode_doc(np.linspace(lo, lo + 1, 10), label=f"on-{device}", config={"device": device}),
                         tmp_path / side / f"{device}.json")
    r = _cli("--baseline", tmp_path / "base", "--candidate", tmp_path / "cand", "--json")
    assert r.exit_code == 1, r.output
    status = {p["label"]: {v["metric"]: v["status"] for v in p["verdicts"]} for p in json.loads(r.stdout)["pairs"]}
    assert status["on-cuda"]["decode_tok_s"] == "fail" and status["on-cpu"]["decode_tok_s"] == "pass"
    (tmp_path / "r.toml").write_text('[[rules]]\nmetric = "decode_tok_s"\nthreshold = 0.06\n\n'
                                     '[[rules]]\nmetric = "rounds"\nremove = true\n')
    r = _cli("--baseline", tmp_path / "base", "--candidate", tmp_path / "cand", "--rules", tmp_path / "r.toml",
             "--json")
    assert r.exit_code == 0, r.output
    assert [x["metric"] for x in json.loads(r.stdout)["rules"]["removed"]] == ["rounds"]


def test_cli_exits_3_when_only_ambiguous(tmp_path):
    from ninfer_bench.reports.schema import write_result

    write_result(decode_doc([100, 101, 99]), tmp_path / "a.json")
    write_result(decode_doc([99, 100, 101]), tmp_path / "b.json")
    r = _cli("--baseline", tmp_path / "a.json", "--candidate", tmp_path / "b.json")
    assert r.exit_code == 3 and "needs about" in r.output and "gate: ambiguous (exit 3)" in r.output, r.output


def test_help_documents_exit_codes_and_the_rules_format():
    r = _cli("--help")
    text = " ".join(r.output.split())
    for needle in ("Exit codes", "0 every row passed", "3 nothing failed", "rules.toml", "rules.json", "[[rules]]",
                   "remove = true", "higher_is_better", "--threshold", "METRIC=PCT"):
        assert needle in text, needle


def test_cli_gates_a_grid_by_label(tmp_path):
    from ninfer_bench.reports.schema import write_result

    for side, slow in (("base", 1.0), ("cand", 0.5)):
        write_result(decode_doc(label="fast"), tmp_path / side / "fast.json")
        write_result(concurrency_doc([1, 2], scale=slow), tmp_path / side / "conc.json")
    write_result(decode_doc(label="gone"), tmp_path / "base" / "gone.json")
    write_result(decode_doc(label="new"), tmp_path / "cand" / "new.json")
    r = _cli("--baseline", tmp_path / "base", "--candidate", tmp_path / "cand", "--json")
    assert r.exit_code == 1, r.output
    out = json.loads(r.stdout)
    assert [(p["suite"], p["label"], p["status"]) for p in out["pairs"]] == [("concurrency", "c", "fail"),
                                                                              ("decode", "fast", "pass")]
    assert [(u["side"], u["label"]) for u in out["unpaired"]] == [("baseline", "gone"), ("candidate", "new")]
    assert "no candidate run: fails the gate" in r.stderr and "no baseline run: not gated" in r.stderr
    # only the paired decode runs: pass; a grid whose candidate lacks nothing but adds a run passes
    for f in ("conc.json", "gone.json"):
        (tmp_path / "base" / f).unlink()
    (tmp_path / "cand" / "conc.json").unlink()
    r = _cli("--baseline", tmp_path / "base", "--candidate", tmp_path / "cand")
    assert r.exit_code == 0 and "decode fast: pass" in r.output, r.output
    r = _cli("--baseline", tmp_path / "base", "--candidate", tmp_path / "cand" / "new.json")
    assert r.exit_code == 1 and "give two result files or two folders" in r.output, r.output


def test_pair_results_by_suite_and_label():
    d1, d2, c1 = decode_doc(label="x"), decode_doc(label="y"), concurrency_doc([1])
    pairs, unpaired = pair_results([("a/x", d1), ("a/c", c1)], [("b/c", c1), ("b/x", d1), ("b/y", d2)])
    assert [(p.suite, p.label, p.baseline_path, p.candidate_path) for p in pairs] == [
        ("decode", "x", "a/x", "b/x"), ("concurrency", "c", "a/c", "b/c")]
    assert unpaired == [{"side": "candidate", "suite": "decode", "label": "y", "path": "b/y"}]


# ---- the conditions of the measurement ---------------------------------------------------------------------
@pytest.mark.parametrize("key, b, c", [
    ("threads", 16, 1), ("cpu_affinity", 16, 1),
    ("gpu_clocks", {"app_sm_mhz": 1980, "sm_mhz": 1980}, {"app_sm_mhz": 1410, "sm_mhz": 1980}),
    ("gpu_clocks", {"max_sm_mhz": 1980}, {"max_sm_mhz": 1755}),
])
def test_threads_affinity_and_gpu_clocks_make_another_experiment(key, b, c):
    """A run pinned to one thread (or one core, or with the GPU's clocks set lower) is another experiment than the
    machine's default: its timings are no speed change of the build. Exact metrics still compare."""
    base, cand = decode_doc(), decode_doc()
    base["env"], cand["env"] = {**ENV, key: b}, {**ENV, key: c}
    verdicts = gate(base, cand)
    assert verdicts[0].metric == "config" and verdicts[0].status == "fail" and f"env.{key}" in verdicts[0].reason
    exact = [r for r in default_rules("decode") if r.kind == "exact"]
    assert "config" not in by_metric(gate(base, cand, exact))
    # not recorded on one side (an older document): unknown, no difference
    del base["env"][key]
    assert "config" not in by_metric(gate(base, cand))


def test_current_gpu_clocks_are_shown_not_compared():
    base, cand = decode_doc(), decode_doc()
    base["env"] = {**ENV, "gpu_clocks": {"sm_mhz": 345, "mem_mhz": 1593, "max_sm_mhz": 1980, "app_sm_mhz": None}}
    cand["env"] = {**ENV, "gpu_clocks": {"sm_mhz": 1980, "mem_mhz": 3201, "max_sm_mhz": 1980, "app_sm_mhz": 1980}}
    assert "config" not in by_metric(gate(base, cand))


def _loaded(doc, load, cpus=2):
    doc["env"] = {**doc["env"], "load_avg_1m": load, "cpu_affinity": cpus}
    return doc


def test_a_load_difference_leaves_timings_undecided():
    """An A/A pair where one run had an idle machine and the other an overloaded one: a timing that would fail is
    ambiguous instead (saying why), a pass stands only where the candidate had the heavier load; exact rows and
    peak memory are judged as ever."""
    base = _loaded(decode_doc(np.linspace(99.5, 100.5, 10)), 0.2)
    slow = _loaded(decode_doc(np.linspace(79.5, 80.5, 10)), 4.0)
    v = by_metric(gate(base, slow))["decode_tok_s"]
    assert v.status == "ambiguous" and "not failed: the machine's load differs" in v.reason, v
    assert "idle (load 0.20 on 2 CPUs)" in v.reason and "overloaded (load 4.00 on 2 CPUs)" in v.reason
    same_heavier = _loaded(decode_doc(np.linspace(99.5, 100.5, 10)), 4.0)
    assert by_metric(gate(base, same_heavier))["decode_tok_s"].status == "pass"
    v = by_metric(gate(same_heavier, base))["decode_tok_s"]  # the candidate had the lighter load
    assert v.status == "ambiguous" and "lighter load" in v.reason, v
    verdicts = by_metric(gate(base, _loaded(decode_doc(sha="cd" * 32), 4.0)))
    assert verdicts["tokens_sha256"].status == "fail" and verdicts["peak_memory_bytes"].status == "pass"
    # one class (busy: 1.1 and 2.5 on 2 CPUs), or a side that does not record its load: judged as ever
    assert by_metric(gate(_loaded(decode_doc(np.linspace(99.5, 100.5, 10)), 1.1),
                          _loaded(decode_doc(np.linspace(79.5, 80.5, 10)), 2.5)))["decode_tok_s"].status == "fail"
    assert by_metric(gate(decode_doc(np.linspace(99.5, 100.5, 10)), slow))["decode_tok_s"].status == "fail"


def test_environment_records_the_conditions_of_the_measurement():
    from ninfer_bench.reports.schema import environment

    env = environment()
    import torch

    assert env["threads"] == torch.get_num_threads()
    assert env["cpu_affinity"] is None or 1 <= env["cpu_affinity"] <= (env["cpu_count"] or 10 ** 6)
    assert env["load_avg_1m"] is None or env["load_avg_1m"] >= 0
    assert "gpu_clocks" in env and (env["gpu_clocks"] is None or isinstance(env["gpu_clocks"], dict))
    json.dumps(env)


def test_gpu_clocks_are_read_from_nvidia_smi(monkeypatch):
    import subprocess
    from types import SimpleNamespace

    from ninfer_bench.reports import schema

    out = ("550.54.15, GPU-aaaa, 1980, 3201, [N/A], [N/A], 1980, 3201\n"
           "550.54.15, GPU-bbbb, 345, 1593, 1410, 2619, 1980, 3201\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=out))
    cuda = SimpleNamespace(current_device=lambda: 0, get_device_properties=lambda i: SimpleNamespace(uuid="bbbb"))
    driver, clocks = schema._nvidia_smi(SimpleNamespace(cuda=cuda))
    assert driver == "550.54.15"
    assert clocks == {"sm_mhz": 345, "mem_mhz": 1593, "app_sm_mhz": 1410, "app_mem_mhz": 2619, "max_sm_mhz": 1980,
                      "max_mem_mhz": 3201}
    unknown = SimpleNamespace(cuda=SimpleNamespace(current_device=lambda: 0, get_device_properties=lambda i: None))
    assert schema._nvidia_smi(unknown) == ("550.54.15", None)  # two GPUs, none known as this one


# ---- the interval --------------------------------------------------------------------------------------------
def test_interval_rank_matches_mann_whitney_tables():
    """k - 1 is the two-sided critical value of U (n1 = n2 = 10: 16 at 0.01, 23 at 0.05; 5 and 5: 0 at 0.01)."""
    assert interval_rank(10, 10, 0.01) == 17 and interval_rank(10, 10, 0.05) == 24
    assert interval_rank(5, 5, 0.01) == 1 and interval_rank(4, 4, 0.01) == 0 and interval_rank(3, 3, 0.05) == 0
    assert min_interval_samples(0.01) == 5 and min_interval_samples(0.05) == 4
    from ninfer_bench.reports import stats

    exact = sum(p <= 0.005 for p in stats._u_null_cdf(51, 51))  # beyond 100 samples in all: the normal approximation
    assert abs(interval_rank(51, 51, 0.01) - exact) <= 3


def test_shift_interval_is_the_hodges_lehmann_shift_and_its_order_statistics():
    b, c = [1.0, 2.0, 3.0, 4.0, 5.0], [11.0, 12.0, 13.0, 14.0, 15.0]
    s = shift_interval(b, c, 0.01)
    assert s.estimate == 10 and (s.low, s.high) == (6, 14)  # k = 1: the extreme pairwise differences
    assert shift_interval(b, c[:3], 0.01).low is None
    rng = np.random.default_rng(0)
    x, y = rng.normal(100, 1, 1500), rng.normal(95, 1, 1200)  # beyond the pairs held in memory: by bisection
    from ninfer_bench.reports import stats

    exact = stats._kth_difference(np.sort(x), np.sort(y), 12345)
    assert exact == pytest.approx(np.sort(np.subtract.outer(y, x).ravel())[12344])
    big = shift_interval(x, y, 0.01)
    assert big.low < -5 < big.high and big.estimate == pytest.approx(-5, abs=0.1)


def test_fail_fraction_is_documented():
    from ninfer_bench.reports import gate as module

    assert FAIL_FRACTION == 0.75 and "3/4" in module.__doc__
    assert module.FAIL_LOW == 0.5 and "half of it" in module.__doc__


def test_a_slowdown_past_the_threshold_whose_interval_reaches_under_half_of_it_is_not_failed():
    """About 5% slower and significant (every candidate sample below every baseline one), but the interval reaches
    under t / 2 = 2.5% (a shared CPU's drift between two runs could be that much): ambiguous, not failed; the same
    shift with tight samples fails."""
    base = decode_doc([100.0, 100.5, 101.0, 101.5, 102.0])
    cand = decode_doc([98.0, 96.5, 96.0, 95.5, 90.0])
    v = by_metric(gate(base, cand))["decode_tok_s"]
    lo, hi = sorted(-x for x in v.ci)
    assert v.p < 0.01 and lo < 0.025 < 0.0375 <= -v.change and v.status == "ambiguous", v
    tight = by_metric(gate(decode_doc(100 + np.linspace(-0.2, 0.2, 5)), decode_doc(94 + np.linspace(-0.2, 0.2, 5))))
    assert tight["decode_tok_s"].status == "fail"
