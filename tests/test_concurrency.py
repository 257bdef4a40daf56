"""Continuous batching and the concurrency suite (in-process)."""

from __future__ import annotations

import pytest

from ninfer_bench.engine.runtime import CapacityError, Engine
from ninfer_bench.engine.sampling import SamplingParams
from ninfer_bench.engine.scheduler import QueueFull, Scheduler
from ninfer_bench.reports.schema import validate
from ninfer_bench.suites.concurrency import ConcurrencyOptions, itl_samples, run_concurrency


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
    doc = run_concurrency(ConcurrencyOptions(levels=(1, 2, 4), model="tiny", device="cpu", kv_dtype="fp32",
                                             max_new_tokens=16, prompt_tokens=48, rounds=1, spec="dflash2"))
    validate(doc)
    levels = doc["summary"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2, 4]
    assert all(lv["matches_sequential"] for lv in levels)
    assert all(lv["aggregate_tok_s"] > 0 and lv["ttft_ms_p50"] > 0 for lv in levels)
    assert len(doc["records"]) == 1 + 2 + 4


def test_every_client_prompt_has_the_asked_length():
    from ninfer_bench.suites.concurrency import exact_length

    assert exact_length([1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]
    assert exact_length([1, 2, 3], 2) == [1, 2]
    with pytest.raises(ValueError, match="interleave"):
        ConcurrencyOptions(prefill_chunk=256, interleave_chunk=512)
