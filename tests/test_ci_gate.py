"""CI gates the default model's deterministic CPU metrics against committed baselines (tests/baselines/)."""

from __future__ import annotations

import copy

import pytest

from ninfer_bench.engine.artifact.loader import default_model
from ninfer_bench.reports.gate import exit_code, gate
from ninfer_bench.reports.schema import read_result
from ninfer_bench.suites.ci import DECODE_RUNS, EXACT_DECODE, EXACT_NIAH, baseline_path, decode_options
from ninfer_bench.suites.decode import run_decode
from ninfer_bench.suites.niah import NiahOptions, oracle_path, run_niah


@pytest.mark.parametrize("name", list(DECODE_RUNS))
def test_decode_exact_metrics_match_the_baseline(name):
    base = read_result(baseline_path(name))
    assert base["model"].get("artifact_id") == _model_id() or base["model"].get("preset") == default_model(), \
        "baselines were made with another default model: run scripts/update_ci_baselines.py"
    cand = run_decode(decode_options(name))
    verdicts = gate(base, cand, EXACT_DECODE)
    assert exit_code(verdicts) == 0, [v.to_dict() for v in verdicts if v.status != "pass"]
    # the gate can fail: a changed token hash is caught
    broken = copy.deepcopy(cand)
    broken["summary"]["tokens_sha256"] = "0" * 64
    assert exit_code(gate(base, broken, EXACT_DECODE)) == 1


def _model_id():
    from ninfer_bench.engine.artifact.loader import load_source

    return load_source(default_model()).info.get("artifact_id")


def test_niah_subset_agrees_with_committed_oracles():
    opts = NiahOptions.make(model=None, ctxs=(2048, 8192), depths=(0, 50, 100), device="cpu", kv_dtype="int8")
    from ninfer_bench.engine.artifact.loader import load_source

    info = load_source(default_model()).info  # oracles are named by the text model's identity
    if not all(oracle_path(info, c).is_file() for c in opts.ctxs):
        pytest.fail("no committed NIAH oracles for the default model: run `ninfer-bench oracle niah --ctx 2048,8192 "
                    "--depths 0,50,100`")
    doc = run_niah(opts)
    s = doc["summary"]
    assert s["oracle_cases"] == s["cases"] == 6
    assert s["oracle_agreement"] == 1.0, s["first_divergence"]
    # KL(oracle || engine) on the oracle's top-k ids, every step on the oracle's path: the engine (fp32 compute,
    # int8 KV, q8 weights as the oracle's float64 model reads them) is close but not bit-equal to it
    kls = [r["kl"] for r in doc["records"]]
    assert all(0 <= v < 1e-2 for v in kls) and any(v > 0 for v in kls), kls
    assert s["kl_mean"] == pytest.approx(sum(kls) / len(kls))
    # each case's TTFT and prefill speed, and each context's medians of them
    assert all(r["ttft_ms"] > 0 and r["prefill_tok_s"] == pytest.approx(r["prompt_tokens"] / r["ttft_ms"] * 1e3)
               for r in doc["records"])
    for c in ("2048", "8192"):
        ttfts = sorted(r["ttft_ms"] for r in doc["records"] if str(r["ctx"]) == c)
        assert s["ttft_ms_by_ctx"][c] == pytest.approx(ttfts[1]) and s["prefill_tok_s_by_ctx"][c] > 0
        mfu = sorted(r["prefill_tflops"] / s["matmul_tflops"] for r in doc["records"] if str(r["ctx"]) == c)
        assert s["prefill_compute_fraction_by_ctx"][c] == pytest.approx(mfu[1]) and mfu[0] > 0
    same = copy.deepcopy(doc)
    assert exit_code(gate(doc, same, EXACT_NIAH)) == 0
    same["summary"]["oracle_agreement"] = 0.5
    assert exit_code(gate(doc, same, EXACT_NIAH)) == 1


def test_rescore_judges_an_earlier_document_against_stored_oracles(tmp_path):
    """A niah document made before its oracles existed is judged later from its own tokens; a changed token
    fails, and a document of another suite is refused."""
    from click.testing import CliRunner

    from ninfer_bench.cli import main
    from ninfer_bench.reports.schema import write_result
    from ninfer_bench.suites.niah import rescore_niah

    doc = run_niah(NiahOptions.make(model=None, ctxs=(2048,), depths=(50,), device="cpu",
                                    oracle=str(tmp_path / "none")))
    assert doc["summary"]["oracle_cases"] == 0  # no oracle where it looked
    again = rescore_niah(doc)
    assert again["summary"]["oracle_cases"] == 1 and again["summary"]["oracle_agreement"] == 1.0
    assert again["records"][0]["tokens"] == doc["records"][0]["tokens"]
    from ninfer_bench.oracles.store import load_oracle

    records, _ = load_oracle(oracle_path(doc["model"], 2048))
    top = next(r for r in records if r["id"] == doc["records"][0]["case"])["topk_ids"][0]
    bad = copy.deepcopy(doc)
    bad["records"][0]["tokens"][0] = next(t for t in range(1000) if t not in top)  # not even a near-tie choice
    judged = rescore_niah(bad)["records"][0]
    assert judged["pass"] is False and judged["first_divergence"] == 0
    path = tmp_path / "niah.json"
    write_result(doc, path)
    r = CliRunner().invoke(main, ["niah", "--rescore", str(path), "--json", str(tmp_path / "out.json")])
    assert r.exit_code == 0, r.output
    assert read_result(tmp_path / "out.json")["summary"]["oracle_agreement"] == 1.0
    with pytest.raises(ValueError, match="niah result"):
        rescore_niah({**doc, "suite": "decode"})


def test_rescore_refuses_a_document_it_cannot_rebuild(tmp_path):
    """A niah document missing what its cases are rebuilt from, or what its records were judged on, is refused
    by name (no KeyError), before any model is loaded."""
    from click.testing import CliRunner

    from ninfer_bench.cli import main
    from ninfer_bench.reports.schema import make_result, write_result
    from ninfer_bench.suites.niah import rescore_niah

    config = {"model": None, "ctxs": [2048], "depths": [50], "cases": 1, "answer_tokens": 8, "seed": 0}
    doc = make_result("niah", label="n", config=config, records=[{"case": "ctx2048-d50-0", "ctx": 2048}], env={},
                      summary={"cases": 1, "oracle_agreement": None, "retrieval": 0.0, "first_divergence": {}})
    with pytest.raises(ValueError, match=r"records\[0\] lacks \['depth', 'prompt_tokens', 'answer', 'tokens'"):
        rescore_niah(doc)
    with pytest.raises(ValueError, match=r"config lacks \['ctxs', 'depths'"):
        rescore_niah({**doc, "config": {"model": None}})
    write_result(doc, tmp_path / "n.json")
    r = CliRunner().invoke(main, ["niah", "--rescore", str(tmp_path / "n.json")])
    assert r.exit_code == 1 and "records[0] lacks" in r.output and r.exception.__class__ is SystemExit, r.output


def test_niah_progress_counts_prefill_chunks_within_a_case(tmp_path):
    """A long case shows progress while it prefills: the callback counts prompt tokens chunk by chunk, rising over
    all cases to their total, and following it changes no result."""
    opts = NiahOptions.make(model="tiny", ctxs=(512,), depths=(0, 100), answer_tokens=3, device="cpu",
                            prefill_chunk=128, oracle=str(tmp_path / "none"))
    calls = []
    doc = run_niah(opts, progress=lambda done, total, what: calls.append((done, total, what)))
    assert calls[0] == (0, None, "loading the model")
    counts = [c for c in calls[1:] if c[2].endswith("ctx512-d0-0")]
    lengths = [r["prompt_tokens"] for r in doc["records"]]
    assert lengths[0] > 2 * 128  # several chunks
    assert [done for done, _, _ in counts] == [*range(0, lengths[0], 128), lengths[0]]
    done = [c[0] for c in calls[1:]]
    assert done == sorted(done) and done[-1] == calls[-1][1] == sum(lengths)
    assert "case 2/2 ctx512-d100-0" in calls[-1][2]
    quiet = run_niah(opts)
    timings = ("seconds", "ttft_ms", "prefill_tok_s", "prefill_tflops")
    strip = [{k: v for k, v in r.items() if k not in timings} for r in doc["records"]]
    assert strip == [{k: v for k, v in r.items() if k not in timings} for r in quiet["records"]]


def test_niah_warmup_runs_before_the_cases_and_changes_no_result(tmp_path):
    """--warmup-prompt: one generation before the cases (so the first case's TTFT is a warm engine's), recorded in the
    config as run; the cases' tokens are those of a run without it. The default resolves to the longest case's own
    prompt on CUDA and to none on the CPU; N tokens of code prompt stay within the engine's context."""
    from click.testing import CliRunner

    from ninfer_bench.cli import main
    from ninfer_bench.engine.artifact.loader import load_source
    from ninfer_bench.suites.common import code_prompt
    from ninfer_bench.suites.niah import cases, warmup_ids

    opts = NiahOptions.make(model="tiny", ctxs=(512,), depths=(50,), answer_tokens=3, device="cpu",
                            prefill_chunk=128, oracle=str(tmp_path / "none"), warmup_prompt=200)
    calls = []
    warm = run_niah(opts, progress=lambda done, total, what: calls.append(what))
    assert "warming up on a 200-token prompt" in calls
    assert calls.index("warming up on a 200-token prompt") < min(i for i, w in enumerate(calls) if "case 1/1" in w)
    assert warm["config"]["warmup_prompt"] == 200 and warm["config"]["warmup_s"] > 0
    cold = run_niah(NiahOptions.make(model="tiny", ctxs=(512,), depths=(50,), answer_tokens=3, device="cpu",
                                     prefill_chunk=128, oracle=str(tmp_path / "none")))
    assert cold["config"]["warmup_prompt"] == 0 and cold["config"]["warmup_s"] == 0  # the CPU default: none
    assert [r["tokens"] for r in warm["records"]] == [r["tokens"] for r in cold["records"]]
    tok = load_source("tiny").tokenizer
    auto = NiahOptions.make(ctxs=(256, 512), depths=(0, 100), answer_tokens=3)
    grid = cases(tok, auto)
    longest = max(grid, key=lambda c: len(c["prompt_ids"]))
    assert longest["ctx"] == 512 and warmup_ids(auto, "cuda", 512, grid, tok) == list(longest["prompt_ids"])
    assert warmup_ids(auto, "cpu", 512, grid, tok) == []
    clamp = NiahOptions.make(ctxs=(64,), answer_tokens=3, warmup_prompt=500)
    assert warmup_ids(clamp, "cuda", 64, grid, tok) == code_prompt(tok, 61)
    assert warmup_ids(NiahOptions.make(warmup_prompt=0), "cuda", 512, grid, tok) == []
    with pytest.raises(ValueError, match="warmup-prompt"):
        NiahOptions.make(warmup_prompt=-1)
    r = CliRunner().invoke(main, ["niah", "--rescore", __file__, "--warmup-prompt", "64"])
    assert r.exit_code == 1 and "--rescore runs none" in r.output, r.output
