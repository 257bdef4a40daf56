"""concurrency --url --request-rate: open-loop load as vllm bench serve sends it (suites/open_loop.py). The arrival
times' statistics (mean rate, burstiness as the gaps' coefficient of variation, the seed), goodput and percentiles on
synthetic latencies, and runs against our own `serve` of the bundled model: the shipped prompts, and a JSONL
dataset with per-line lengths and a request the server refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from ninfer_bench.cli import main
from ninfer_bench.engine.artifact.loader import bundled_model_path
from ninfer_bench.reports.experiment import config_differences
from ninfer_bench.reports.gate import gate
from ninfer_bench.reports.schema import validate
from ninfer_bench.suites.concurrency import ConcurrencyOptions
from ninfer_bench.suites.open_loop import (arrival_times, is_good, latency_stats, level_summary, parse_goodput,
                                           parse_percentiles, parse_rate, pct_key, read_dataset, request_record,
                                           round_figures)

BUNDLED = bundled_model_path()
DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port


def invoke(*args: str):
    r = CliRunner().invoke(main, list(args))
    return r, " ".join(r.output.split())


# ---- the arrival times ------------------------------------------------------------------------------------
@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_the_asked_rate_and_burstiness(burstiness):
    """Gamma gaps of shape B and mean 1/R: the raw gaps' mean is 1/R and their coefficient of variation 1/sqrt(B)
    (1 for Poisson arrivals); vLLM's rescaling puts the last arrival at N/R exactly and keeps the shape."""
    n, rate = 20_000, 5.0
    raw = arrival_times(n, rate, burstiness, seed=1, normalize=False)
    gaps = np.diff(raw, prepend=0.0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.06)
    times = arrival_times(n, rate, burstiness, seed=1)
    assert np.all(np.diff(times) >= 0) and times[0] > 0  # the first request waits its own gap, as vLLM's
    assert times[-1] == pytest.approx(n / rate, rel=1e-12)  # mean rate exactly R over the schedule
    assert times == pytest.approx(raw * (n / rate) / raw[-1])
    small = arrival_times(50, 2.0, burstiness, seed=4)
    assert small[-1] == pytest.approx(25.0) and len(small) == 50


def test_arrival_times_are_seeded():
    a, b = arrival_times(64, 3.0, 0.5, seed=7), arrival_times(64, 3.0, 0.5, seed=7)
    assert np.array_equal(a, b)
    assert not np.allclose(a, arrival_times(64, 3.0, 0.5, seed=8))
    assert not np.allclose(a, arrival_times(64, 3.0, 2.0, seed=7))
    assert np.array_equal(arrival_times(5, "inf", seed=3), np.zeros(5))  # all at once
    assert arrival_times(4, 2.0, float("inf")) == pytest.approx([0.5, 1.0, 1.5, 2.0])  # evenly spaced
    for args, says in (((4, 0.0), "request-rate"), ((4, 1.0, 0.0), "burstiness"), ((0, 1.0), "num-prompts")):
        with pytest.raises(ValueError, match=says):
            arrival_times(*args)


def test_open_loop_options_parse_and_refuse():
    assert parse_rate("inf") == parse_rate(float("inf")) == "inf" and parse_rate("2.5") == 2.5
    for bad in ("0", "-1", "fast", "nan"):
        with pytest.raises(ValueError, match="--request-rate"):
            parse_rate(bad)
    assert parse_goodput(["ttft:500 tpot:50", "e2el:1e3"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 1000.0}
    assert parse_goodput("ttft:10,tpot:2") == {"ttft": 10.0, "tpot": 2.0} and parse_goodput(None) == {}
    for bad in ("ttft", "itl:5", "ttft:-1", "ttft:x", "ttft:1 ttft:2"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_percentiles("99,50, 99.9,50") == (50.0, 99.0, 99.9)
    assert [pct_key(q) for q in (50.0, 99.9, 0)] == ["p50", "p99_9", "p0"]
    for bad in ("", "101", "a,b"):
        with pytest.raises(ValueError, match="--percentiles"):
            parse_percentiles(bad)
    with pytest.raises(ValueError, match="needs --url"):
        ConcurrencyOptions.make(request_rate=4)
    with pytest.raises(ValueError, match="--burstiness, --max-concurrency configure an open-loop run"):
        ConcurrencyOptions.make(url=DEAD, burstiness=2.0, client_max_concurrency=3)
    opts = ConcurrencyOptions.make(url=DEAD, request_rate="inf", client_max_concurrency=8, num_prompts=5)
    assert (opts.levels, opts.burstiness, opts.seed, opts.percentiles, opts.goodput) == \
        ((5,), 1.0, 0, (50.0, 90.0, 99.0), None)
    assert opts.default_label() == "server-127.0.0.1:9-rateinf"


# ---- goodput and percentiles ------------------------------------------------------------------------------
def raw_result(i, ttft_ms, n, tpot_ms, error=None):
    """A stream_completion result sent at 10 + i s: the first token after ``ttft_ms``, then one every ``tpot_ms``."""
    sent = 10.0 + i
    times = [sent + (ttft_ms + k * tpot_ms) / 1e3 for k in range(n)]
    item = {"id": f"p{i}", "prompt": [1, 2, 3], "max_tokens": n}
    if error:
        return {"item": item, "scheduled": sent, "submitted": sent, "finished": sent, "times": [], "error": error}
    return {"item": item, "scheduled": sent - 0.001, "submitted": sent, "times": times, "finished": times[-1],
            "n": n, "ids": list(range(n)), "text": "", "prompt_n": 3, "timings": {}, "finish_reason": "length",
            "error": None}


def test_goodput_counts_requests_that_meet_every_slo():
    """vLLM's goodput: a request is good when it meets every given SLO (a one-token request's TPOT counts 0);
    goodput = good requests / the round's duration; a failed request is counted, never good, never timed."""
    raws = [raw_result(0, 100, 11, 10),  # TTFT 100, TPOT 10, E2E 200: good
            raw_result(1, 200, 11, 10),  # TTFT too long
            raw_result(2, 50, 1, 0),  # one token: TPOT None (0 for goodput)
            raw_result(3, 100, 6, 30),  # TPOT too long (E2E 250)
            raw_result(4, 0, 0, 0, error="ServerError: HTTP 400")]
    slos = {"ttft": 150.0, "tpot": 20.0, "e2el": 300.0}
    recs = [request_record(r, 5, 0, 9.0, slos) for r in raws]
    assert [r["good"] for r in recs] == [True, False, True, False, False]
    assert recs[0]["ttft_ms"] == pytest.approx(100) and recs[0]["tpot_ms"] == pytest.approx(10)
    assert recs[0]["e2e_ms"] == pytest.approx(200) and recs[2]["tpot_ms"] is None
    assert recs[0]["arrival_s"] == pytest.approx(1 - 0.001) and recs[0]["send_delay_ms"] == pytest.approx(1.0)
    assert recs[4]["error"] and recs[4]["ttft_ms"] is None
    rd = round_figures(recs, 2.0, slos)
    assert (rd["completed"], rd["failed"], rd["good_requests"]) == (4, 1, 2)
    assert rd["goodput"] == pytest.approx(1.0) and rd["request_throughput"] == pytest.approx(2.0)
    assert rd["output_throughput"] == pytest.approx((11 + 11 + 1 + 6) / 2.0)
    assert rd["total_token_throughput"] == pytest.approx((11 + 11 + 1 + 6 + 4 * 3) / 2.0)
    assert is_good(recs[3], {"ttft": 150.0, "e2el": 300.0})  # only the SLOs given count
    assert not is_good(recs[0], {"e2el": 199.0})
    assert [request_record(r, 5, 0, 9.0, {})["good"] for r in raws[:2]] == [None, None]  # no SLOs: no verdict

    opts = ConcurrencyOptions.make(url=DEAD, request_rate=2.0, num_prompts=5, goodput=["ttft:150 tpot:20 e2el:300"],
                                   percentiles="90")
    lv = level_summary(5, recs, [{**rd, "peak_in_flight": 2}], opts)
    assert (lv["goodput"], lv["good_requests"], lv["completed"], lv["failed"]) == (pytest.approx(1.0), 2, 4, 1)
    assert lv["aggregate_tok_s"] == lv["output_throughput"] and lv["samples"]["goodput"] == [pytest.approx(1.0)]
    assert lv["tpot_ms_mean"] == pytest.approx(np.mean([10, 10, 30]))  # requests of more than one token only
    assert lv["matches_sequential"] is None and lv["concurrency"] == 5 and lv["peak_in_flight"] == 2


def test_latency_statistics_are_numpys_with_the_chosen_percentiles():
    vals = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    s = latency_stats("ttft_ms", vals, (90.0, 99.9))
    assert s["ttft_ms_mean"] == pytest.approx(np.mean(vals)) and s["ttft_ms_median"] == pytest.approx(3.5)
    assert s["ttft_ms_std"] == pytest.approx(np.std(vals)) and s["ttft_ms_std"] != pytest.approx(np.std(vals, ddof=1))
    for q in (50, 90, 99, 99.9):  # the chosen ones, and the gate's p50 and p99 always
        assert s[f"ttft_ms_{pct_key(q)}"] == pytest.approx(np.percentile(vals, q))
    assert "ttft_ms_p95" not in s
    assert set(latency_stats("x", [], (95.0,)).values()) == {None}


# ---- against our own server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if BUNDLED is None:
        pytest.skip("the bundled model is not in this checkout")
    from serveproc import ServeProcess

    proc = ServeProcess(str(BUNDLED), tmp_path_factory.mktemp("serve") / "serve.log", "--max-concurrency", "2")
    yield proc
    proc.stop()


def test_open_loop_run_against_serve(server, tmp_path):
    """4 requests at 20 a second (seed 3) against `serve`: sent at the seeded arrival times, every one completed
    with -n tokens, the summary's throughputs equal their definitions, goodput under loose SLOs equals the request
    throughput, the table is vllm bench serve's; the gate sets the run apart from a closed-loop one."""
    r, out = invoke("concurrency", "--url", server.url, "--request-rate", "20", "--num-prompts", "4", "-n", "4",
                    "--prompt-tokens", "32", "--seed", "3", "--goodput", "ttft:600000", "tpot:600000",
                    "--percentiles", "50,95", "--json", str(tmp_path / "o.json"))
    assert r.exit_code == 0, r.output
    for line in ("Successful requests │ 4", "Request rate configured (RPS) │ 20.00", "Request goodput (req/s)",
                 "P95 TTFT (ms)", "Median TPOT (ms)", "Std ITL (ms)", "Mean E2EL (ms)"):
        assert line in out, line
    doc = json.loads((tmp_path / "o.json").read_text())
    validate(doc)
    c, (lv,), recs = doc["config"], doc["summary"]["levels"], doc["records"]
    assert (c["request_rate"], c["burstiness"], c["seed"], c["num_prompts"], c["levels"], c["device"]) == \
        (20.0, 1.0, 3, 4, [4], "server")
    assert doc["summary"]["mode"] == "open-loop" and doc["label"].endswith("-rate20")
    assert [x["arrival_s"] for x in recs] == pytest.approx(list(arrival_times(4, 20.0, 1.0, 3)), abs=1e-9)
    assert all(x["send_delay_ms"] < 500 for x in recs)  # sent at its time, not after the others finished
    assert all(x["completion_tokens"] == 4 and x["prompt_tokens"] == 32 and x["error"] is None for x in recs)
    assert lv["completed"] == 4 and lv["failed"] == 0 and lv["good_requests"] == 4
    assert lv["request_throughput"] == pytest.approx(4 / lv["duration_s"])
    assert lv["output_throughput"] == pytest.approx(16 / lv["duration_s"]) == lv["aggregate_tok_s"]
    assert lv["goodput"] == pytest.approx(lv["request_throughput"])
    assert lv["duration_s"] >= 4 / 20  # the last arrival is at N / R
    assert lv["ttft_ms_p95"] == pytest.approx(np.percentile([x["ttft_ms"] for x in recs], 95))
    assert {"ttft_ms_p50", "ttft_ms_p99", "itl_ms_p99", "e2e_ms_std"} <= set(lv) and "ttft_ms_p90" not in lv

    r, _ = invoke("concurrency", "--url", server.url, "-c", "1", "-n", "4", "--prompt-tokens", "32", "--rounds", "1",
                  "--json", str(tmp_path / "c.json"))
    assert r.exit_code == 0, r.output
    closed = json.loads((tmp_path / "c.json").read_text())
    assert closed["config"]["request_rate"] is None
    assert any(d.startswith("request_rate None vs 20.0") for d in config_differences(closed, doc))
    verdict = gate(closed, doc)[0]
    assert verdict.metric == "config" and verdict.status == "fail" and "request_rate" in verdict.reason
    assert config_differences(doc, doc) == []


def test_open_loop_dataset_run(server, tmp_path):
    """A JSONL dataset: text and token-id prompts used in turn, each line's max_tokens / output_len (else -n),
    --max-concurrency 1 keeping one request in flight; a request the server refuses (an id outside the vocabulary)
    is counted as failed and the run goes on."""
    data = tmp_path / "d.jsonl"
    lines = [{"prompt": "def add(a, b):\n", "max_tokens": 3}, {"prompt_ids": [5, 6, 7, 8, 9], "output_len": 5},
             {"prompt": "import os\n", "id": "third"}, {"prompt_ids": [10**9]}]
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert [x["max_tokens"] for x in read_dataset(data)] == [3, 5, None, None]
    assert ConcurrencyOptions.make(url=DEAD, request_rate=1, dataset=str(data)).num_prompts == 4  # its lines
    r, out = invoke("concurrency", "--url", server.url, "--request-rate", "inf", "--dataset", str(data),
                    "--num-prompts", "5", "--max-concurrency", "1", "-n", "2", "--json", str(tmp_path / "d.json"))
    assert r.exit_code == 0, r.output
    assert "1 of 5 requests failed" in out and "outside the vocabulary" in out
    doc = json.loads((tmp_path / "d.json").read_text())
    validate(doc)
    recs, (lv,), c = doc["records"], doc["summary"]["levels"], doc["config"]
    assert [x["prompt_id"] for x in recs] == ["1", "2", "third", "4", "1"]
    assert [x["completion_tokens"] for x in recs] == [3, 5, 2, 0, 3]
    assert recs[1]["prompt_tokens"] == 5 and recs[3]["error"] and "outside the vocabulary" in recs[3]["error"]
    assert recs[0]["tokens_sha256"] == recs[4]["tokens_sha256"]  # same prompt, greedy: same tokens
    assert (lv["completed"], lv["failed"], lv["concurrency"], lv["peak_in_flight"]) == (4, 1, 1, 1)
    assert lv["total_output_tokens"] == 13 and lv["goodput"] is None
    assert (c["dataset"], c["prompt_tokens"], c["prompt_format"], c["client_max_concurrency"]) == \
        (str(data), None, "ids,text", 1)
    assert all(x["arrival_s"] == 0 for x in recs)  # inf: all arrive at once; the cap holds them back
    assert recs[-1]["send_delay_ms"] > recs[0]["send_delay_ms"]


def test_open_loop_refusals_are_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "prompt_ids": [1]}\n')
    for args, says in (
            (["--request-rate", "4"], "--request-rate sends open-loop load over HTTP: it needs --url"),
            (["--url", DEAD, "--burstiness", "2"], "--burstiness configures an open-loop run: it needs --request-rate"),
            (["--url", DEAD, "--request-rate", "4", "-c", "2"], "-c sets closed-loop clients"),
            (["--url", DEAD, "--request-rate", "0"], "--request-rate '0': requests per second"),
            (["--url", DEAD, "--request-rate", "4", "--goodput", "itl:5"], "--goodput 'itl:5'"),
            (["--url", DEAD, "--request-rate", "4", "--dataset", str(bad)], "one of the two"),
            (["--url", DEAD, "--request-rate", "4", "--dataset", str(bad), "--prompt-tokens", "8"],
             "--dataset gives the prompts as they are"),
            (["--url", DEAD, "--request-rate", "4", "--num-prompts", "2"], f"{DEAD}: cannot connect")):
        r, out = invoke("concurrency", *args)
        assert r.exit_code == 1 and says in out and "Traceback" not in r.output, (args, r.output)
