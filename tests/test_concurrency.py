"""Continuous batching and the concurrency suite (in-process, and against a ``serve tiny`` subprocess)."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_bench.engine.runtime.engine import CapacityError, Engine
from ninfer_bench.engine.sampling import SamplingParams
from ninfer_bench.engine.runtime.scheduler import QueueFull, Scheduler
from ninfer_bench.reports.schema import validate
from ninfer_bench.suites.concurrency import ConcurrencyOptions, _record, itl_samples, level_summary, run_concurrency


@pytest.mark.parametrize("spec", ["none", "mtp", "dflash2"])
def test_batched_greedy_equals_sequential(spec):
    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_concurrency=3, spec=spec)
    prompts = [list(range(i + 1, i + 25 + 9 * i)) for i in range(5)]  # 5 requests on 3 slots: some wait
    alone = [eng.generate(p, max_new_tokens=30, ignore_eos=True).tokens for p in prompts]
    sched = Scheduler(eng)
    reqs = [sched.submit(p, SamplingParams(max_new_tokens=30, ignore_eos=True)) for p in prompts]
    sched.run_until_idle()
    assert [r.tokens for r in reqs] == alone
    assert all(r.finish_reason == "length" for r in reqs)
    assert sorted(eng.free_slots) == [0, 1, 2]


def test_interleaved_prefill_keeps_the_others_decoding():
    """--interleave-chunk: while one request decodes, a newcomer's 60-token prompt is prefilled 8 tokens an
    iteration, and the running request gains a token at every one of those iterations; outputs stay the sequential
    ones. Alone, a request prefills in whole --prefill-chunk pieces."""
    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_concurrency=2, prefill_chunk=64, interleave_chunk=8)
    first, second = list(range(3, 40)), list(range(50, 110))
    alone = [eng.generate(p, max_new_tokens=24, ignore_eos=True).tokens for p in (first, second)]
    sched = Scheduler(eng)
    a = sched.submit(first, SamplingParams(max_new_tokens=24, ignore_eos=True))
    sched.step()  # 37 prompt tokens < 64: prefilled at once (nothing else is decoding)
    assert len(a.tokens) >= 1
    b = sched.submit(second, SamplingParams(max_new_tokens=24, ignore_eos=True))
    steps = 0
    while not b.tokens:
        before = len(a.tokens)
        sched.step()
        steps += 1
        assert len(a.tokens) == before + 1  # a decoded during each piece of b's prefill
    assert steps == -(-len(second) // 8)  # 60 tokens, 8 an iteration
    sched.run_until_idle()
    assert [a.tokens, b.tokens] == alone
    with pytest.raises(ValueError, match="interleave-chunk"):
        Engine.load("tiny", device="cpu", interleave_chunk=0)


def _prefill_shapes(eng, monkeypatch) -> list:
    """The [B, T] of every prefill forward the engine runs from now on."""
    from ninfer_bench.engine.model.hybrid import PREFILL

    shapes, real = [], eng.model.forward

    def spy(step, cache):
        if step.mode == PREFILL:
            shapes.append(tuple(step.ids.shape))
        return real(step, cache)

    monkeypatch.setattr(eng.model, "forward", spy)
    return shapes


@pytest.mark.parametrize("spec", ["none", "mtp", "dflash2"])
def test_admissions_prefill_packed_in_one_forward(spec, monkeypatch):
    """Requests admitted together share their prompt chunks' forwards within the iteration's token budget
    (--prefill-chunk, nobody decoding): rows of different lengths padded to the longest; a prompt that does not fit
    continues in the next iteration. Each request's tokens (greedy, and sampled with a seed) are its tokens alone."""
    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_concurrency=4, spec=spec, prefill_chunk=64,
                      pack_prefill=True)
    prompts = [list(range(2 + i, 2 + i + n)) for i, n in enumerate((5, 37, 64, 90))]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, top_k=20, seed=7),
              SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.7, seed=3)]
    sched = Scheduler(eng)
    alone = []
    for p, sp in zip(prompts, params):
        r = sched.submit(p, sp)
        sched.run_until_idle()
        alone.append(r.tokens)
    shapes = _prefill_shapes(eng, monkeypatch)
    reqs = [sched.submit(p, sp) for p, sp in zip(prompts, params)]
    sched.step()
    # 64 tokens: 5 + 37 of the first two, 22 of the third, packed at the longest (37)
    assert shapes == [(3, 37)]
    assert [len(r.tokens) > 0 for r in reqs] == [True, True, False, False]  # (and the first two decoded a round)
    sched.run_until_idle()
    assert [r.tokens for r in reqs] == alone
    assert all(b == 1 or t <= 64 for b, t in shapes) and sum(b > 1 for b, _ in shapes) >= 1
    assert sorted(eng.free_slots) == [0, 1, 2, 3]


def test_admissions_prefill_in_one_iteration_a_forward_each(monkeypatch):
    """--pack-prefill off (the default): every admitting request's chunk within the budget in the same iteration
    (before the decode round), one forward each; each first token goes out as its prompt is done."""
    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_concurrency=3, pack_prefill=False)
    shapes = _prefill_shapes(eng, monkeypatch)
    sched = Scheduler(eng)
    reqs = [sched.submit(list(range(3, 3 + n)), SamplingParams(max_new_tokens=4, ignore_eos=True))
            for n in (9, 20, 31)]
    sched.step()
    assert shapes == [(1, 9), (1, 20), (1, 31)]  # all three in the budget, one forward each
    assert all(len(r.tokens) == 2 for r in reqs)  # the first token, then one decode round
    with pytest.raises(ValueError, match="pack-prefill"):
        Engine.load("tiny", device="cpu", pack_prefill="yes")


def test_cancel_frees_the_slot_and_queue_bound():
    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_concurrency=1)
    sched = Scheduler(eng, max_queue=2)
    a = sched.submit(list(range(1, 20)), SamplingParams(max_new_tokens=50, ignore_eos=True))
    b = sched.submit(list(range(1, 20)), SamplingParams(max_new_tokens=5, ignore_eos=True))
    c = sched.submit(list(range(1, 20)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    with pytest.raises(QueueFull):  # one goes to the free slot, two may wait: the fourth is refused
        sched.submit([1, 2, 3], SamplingParams(max_new_tokens=5))
    sched.step()
    sched.step()
    sched.cancel(a)
    sched.run_until_idle()
    assert a.finish_reason == "cancelled" and len(a.tokens) < 50
    assert b.finish_reason == "length" and len(b.tokens) == 5
    assert c.finish_reason == "length" and len(c.tokens) == 3
    with pytest.raises(CapacityError):
        sched.submit(list(range(10)), SamplingParams(max_new_tokens=100_000))


def test_itl_counts_tokens_not_chunks():
    # three tokens arrive together 30 ms after the first: each gets 10 ms
    assert itl_samples([0.0, 0.03, 0.03, 0.03, 0.04]) == pytest.approx([10.0, 10.0, 10.0, 10.0])


def test_concurrency_suite_in_process():
    doc = run_concurrency(ConcurrencyOptions.make(levels=(1, 2, 4), model="tiny", device="cpu", kv_dtype="fp32",
                                                  max_new_tokens=16, prompt_tokens=48, rounds=1, spec="dflash2"))
    validate(doc)
    levels = doc["summary"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2, 4]
    assert all(lv["matches_sequential"] for lv in levels)
    assert all(lv["aggregate_tok_s"] > 0 and lv["ttft_ms_p50"] > 0 for lv in levels)
    assert len(doc["records"]) == 1 + 2 + 4
    assert all(r["prompt_tokens"] == 48 for r in doc["records"])
    assert (doc["config"]["device"], doc["config"]["max_concurrency"], doc["config"]["spec"]) == ("cpu", 4, "dflash2")
    assert doc["config"]["max_context"] == 8192  # the resolved capacity (the option was left to its default)
    assert_wall_throughput(doc)


@pytest.mark.parametrize("p,spec", [("1.0", "mtp"), ("0.0", "dflash2")])
def test_concurrency_suite_replays_acceptance(p, spec):
    """--replay-acceptance in-process: the sequential reference's tokens are the continuation drafts are replaced by
    (p = 1: every draft accepted; p = 0: none), outputs stay the sequential ones, and the run says it replayed."""
    doc = run_concurrency(ConcurrencyOptions.make(levels=(1, 2), model="tiny", device="cpu", kv_dtype="fp32",
                                                  max_new_tokens=13, prompt_tokens=40, rounds=1, spec=spec,
                                                  draft_tokens=3, replay_acceptance=p))
    validate(doc)
    levels = doc["summary"]["levels"]
    assert all(lv["matches_sequential"] for lv in levels)
    assert [lv["acceptance_rate"] for lv in levels] == [float(p)] * 2
    assert doc["config"]["replay_profile"] == [float(p)] * 3 and doc["label"].endswith("-replay-conc")


def test_a_replayed_engine_refuses_a_request_without_its_reference():
    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", spec="mtp", draft_tokens=3, replay_acceptance="seed")
    with pytest.raises(ValueError, match="plain run's tokens"):
        Scheduler(eng).submit([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))


def assert_wall_throughput(doc):
    """Every level's aggregate_tok_s is its output tokens / (first request sent .. last one finished) (one round)."""
    for lv in doc["summary"]["levels"]:
        rows = [r for r in doc["records"] if r["concurrency"] == lv["concurrency"]]
        wall = max(r["finished_abs"] for r in rows) - min(r["submitted_abs"] for r in rows)
        assert lv["aggregate_tok_s"] == pytest.approx(sum(r["completion_tokens"] for r in rows) / wall)


def test_aggregate_throughput_has_one_definition_at_every_level():
    """C2 with both clients decoding together, and C4 on two slots (two requests queue behind the others, so the
    clients never all decode at once): both levels' aggregate_tok_s is output tokens / round wall time; the steady
    window's figure is a second key, None where there is no such window."""
    def req(c, i, first, finished, n=10):  # submitted at 0, n tokens evenly from first to finished
        times = [first + (finished - first) * k / (n - 1) for k in range(n)]
        return _record(c, 0, f"p{i}", 0.0, times, list(range(n)), finished)

    both = [req(2, 0, 0.1, 1.0), req(2, 1, 0.2, 1.1)]
    queued = [req(4, 0, 0.1, 1.0), req(4, 1, 0.2, 1.1), req(4, 2, 1.2, 2.0), req(4, 3, 1.3, 2.2)]
    base = {f"p{i}": r["tokens_sha256"] for i, r in enumerate(queued)}
    c2, c4 = level_summary(2, both, base), level_summary(4, queued, base)
    assert c2["aggregate_tok_s"] == pytest.approx(20 / 1.1)
    assert c4["aggregate_tok_s"] == pytest.approx(40 / 2.2)
    steady = sum(1 for r in both for t in r["times_abs"] if 0.2 < t <= 1.0) / 0.8
    assert c2["steady_tok_s"] == pytest.approx(steady) and c2["samples"]["steady_tok_s"] == [pytest.approx(steady)]
    assert c4["steady_tok_s"] is None and "steady_tok_s" not in c4["samples"]
    assert c2["matches_sequential"] and c4["matches_sequential"]


def test_tpot_is_time_after_the_first_token_over_the_tokens_after_it():
    """TPOT per request as vLLM's benchmark_serving reports it: (e2e - TTFT) / (tokens - 1); its p50 / p99 over a
    level's requests, beside the ITL that pools every gap."""
    def req(i, first, finished, n):
        times = [first + (finished - first) * k / (n - 1) for k in range(n)]
        return _record(2, 0, f"p{i}", 0.0, times, list(range(n)), finished)

    rows = [req(0, 0.1, 1.0, 10), req(1, 0.3, 0.7, 5)]
    lv = level_summary(2, rows, {})
    tpot = [(1.0 - 0.1) * 1e3 / 9, (0.7 - 0.3) * 1e3 / 4]  # 100 ms and 100 ms
    assert lv["tpot_ms_p50"] == pytest.approx(np.percentile(tpot, 50))
    assert lv["tpot_ms_p99"] == pytest.approx(np.percentile(tpot, 99))
    rows = [req(0, 0.1, 1.0, 10), req(1, 0.3, 1.1, 5)]  # 100 and 200 ms a token
    lv = level_summary(2, rows, {})
    assert lv["tpot_ms_p50"] == pytest.approx(150.0) and lv["tpot_ms_p99"] == pytest.approx(199.0)


def test_url_refuses_in_process_engine_options():
    """With --url the engine is the server's: its options are refused when given, even at their defaults, before
    any request (port 9: nothing listens)."""
    from click.testing import CliRunner

    from ninfer_bench.cli import main

    url = "http://127.0.0.1:9"
    for extra, named in ((["--spec", "mtp"], "--spec"), (["--kv-dtype", "int8", "--runtime", "v3"], "--kv-dtype"),
                         (["-k", "7"], "--draft-tokens"), (["--model", "tiny", "--device", "cpu"], "--model")):
        r = CliRunner().invoke(main, ["concurrency", "--url", url, "-c", "1", *extra])
        out = " ".join(r.output.split())
        assert r.exit_code == 1 and named in out and "in-process engine" in out, r.output
    with pytest.raises(ValueError, match="spec, draft_tokens configure an in-process engine"):
        ConcurrencyOptions.make(url=url, spec="mtp", draft_tokens=3)
    with pytest.raises(ValueError, match="needs --url"):
        ConcurrencyOptions.make(served_model="tiny")


def test_url_run_records_the_servers_settings(tmp_path):
    """Against `serve tiny --spec dflash2 -k 5 --max-concurrency 2`: the config holds what the server reports (spec,
    max context, slots), "server" / None for the engine settings it does not report (never this client's
    defaults), prompts cut to --prompt-tokens from the server's tokenization; C4 on two slots has no steady window
    and its aggregate tok/s has the same definition as C1's and C2's."""
    import json

    from click.testing import CliRunner
    from serveproc import ServeProcess

    from ninfer_bench.cli import main

    server = ServeProcess("tiny", tmp_path / "serve.log", "--spec", "dflash2", "-k", "5", "--max-concurrency", "2")
    try:
        r = CliRunner().invoke(main, ["concurrency", "--url", server.url, "-c", "1,2,4", "-n", "8", "--rounds", "1",
                                      "--prompt-tokens", "24", "--json", str(tmp_path / "c.json")])
    finally:
        server.stop()
    assert r.exit_code == 0, r.output
    assert "steady tok/s" in r.output
    doc = json.loads((tmp_path / "c.json").read_text())
    validate(doc)
    c = doc["config"]
    assert (c["spec"], c["max_context"], c["max_concurrency"], c["device"], c["prompt_tokens"]) == \
        ("dflash2", 4096, 2, "server", 24)
    for key in ("draft_tokens", "kv_dtype", "runtime", "model", "synthetic", "quant", "prefill_chunk",
                "interleave_chunk"):
        assert c[key] is None, key
    assert all(r["prompt_tokens"] == 24 for r in doc["records"])
    levels = doc["summary"]["levels"]
    assert all(lv["matches_sequential"] for lv in levels)
    assert all(r["drafted_tokens"] > 0 for r in doc["records"])  # the server speculated, as its config says
    assert levels[2]["steady_tok_s"] is None  # 4 clients, 2 slots: two finish before the others start
    assert_wall_throughput(doc)


def test_every_client_prompt_has_the_asked_length():
    from ninfer_bench.suites.concurrency import exact_length

    assert exact_length([1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]
    assert exact_length([1, 2, 3], 2) == [1, 2]
    with pytest.raises(ValueError, match="interleave"):
        ConcurrencyOptions.make(prefill_chunk=256, interleave_chunk=512)


def test_concurrency_samples_seeded_per_request():
    """--temperature: every request samples from its own seed (sample_seed + its index), so a batched run equals
    the sequential reference and the gate may hold it exact; the draws differ from greedy decoding's."""
    kw = dict(levels=(1, 3), model="tiny", device="cpu", kv_dtype="fp32", max_new_tokens=10, prompt_tokens=24,
              rounds=1)
    sampled = run_concurrency(ConcurrencyOptions.make(**kw, temperature=0.9, top_k=50, top_p=0.95))
    greedy = run_concurrency(ConcurrencyOptions.make(**kw))
    validate(sampled)
    assert sampled["label"] == "v3-none-t0.9-conc" and sampled["config"]["sample_seed"] == 0
    assert all(lv["matches_sequential"] for lv in sampled["summary"]["levels"])
    assert {r["tokens_sha256"] for r in sampled["records"]} != {r["tokens_sha256"] for r in greedy["records"]}
    with pytest.raises(ValueError, match="temperature > 0"):
        ConcurrencyOptions.make(top_k=5)
    with pytest.raises(ValueError, match="greedy"):
        ConcurrencyOptions.make(temperature=0.5, spec="dflash2", replay_acceptance="seed")
