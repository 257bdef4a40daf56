"""The batched sampler (engine/sampling.py ``sample_rows``) against the reference sampler beside it (``probs``):
chi-square goodness of fit of its draws for temperature, top-k, top-p, min-p and their combinations (with negative
controls that must be rejected), the filtered distributions themselves, the counter-based stream against its
Python reference, per-request seeds independent of the batch, greedy rows, log-probabilities, and the engine drawing
every row of a step in one call. The CUDA graph capture test skips without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from ninfer_bench.engine import sampling
from ninfer_bench.engine.sampling import (RowSampling, SamplingParams, batch_probs, probs, sample_rows, select,
                                          stream_key, stream_uniform, stream_uniform_ref)

Z_1E4 = 3.7190164854556804  # the standard normal's upper 1e-4 point


def chi2_critical(df: int) -> float:
    """The chi-square upper 1e-4 point by Wilson-Hilferty, which lies above the exact one for every df (a
    conservative bound: scipy's checks it below when installed)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + Z_1E4 * math.sqrt(c)) ** 3


def chi2_stat(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom for ``counts [V]`` against probabilities ``expected_p [V]``:
    tokens expected at least 5 times are bins of their own, the rest one pooled bin (folded into the smallest bin
    when that too is expected fewer than 5 times). A token the reference gives no mass must never be drawn."""
    n = float(counts.sum())
    exp = expected_p.double() * n
    assert int(counts[expected_p == 0].sum()) == 0, "a token outside the reference's support was drawn"
    big = exp >= 5
    obs_bins, exp_bins = counts[big].double().tolist(), exp[big].tolist()
    rest_o, rest_e = float(counts[~big & (expected_p > 0)].sum()), float(exp[~big].sum())
    if rest_e >= 5:
        obs_bins.append(rest_o)
        exp_bins.append(rest_e)
    elif rest_e > 0:
        i = min(range(len(exp_bins)), key=exp_bins.__getitem__)
        obs_bins[i] += rest_o
        exp_bins[i] += rest_e
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_bins, exp_bins))
    return stat, len(exp_bins) - 1


def fits(counts: torch.Tensor, expected_p: torch.Tensor) -> bool:
    stat, df = chi2_stat(counts, expected_p)
    return stat <= chi2_critical(df)


def test_the_critical_value_is_conservative():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 5, 10, 30, 63, 100, 400):
        assert chi2_critical(df) >= scipy_stats.chi2.ppf(1 - 1e-4, df)


V = 64
N = 16_000  # draws a configuration
CONFIGS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=8),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.6, top_k=3),
    SamplingParams(temperature=0.5, top_p=0.97, min_p=0.001),
]


def config_logits(c: int) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(100 + c)) * 2.0


LOGITS = torch.stack([config_logits(c) for c in range(len(CONFIGS))])


def seeds_steps(c: int, n: int) -> tuple[list[int], list[int]]:
    """Requests of 50 tokens each: seed ``1000 c + r // 50`` at token ``r % 50``."""
    return [1000 * c + r // 50 for r in range(n)], [r % 50 for r in range(n)]


@pytest.fixture(scope="module")
def draws():
    """Every configuration's N draws from one batched call, the configurations' rows interleaved with each other
    and with greedy rows: (tokens [C, N], greedy tokens, greedy rows' logits)."""
    params, seeds, steps, rows = [], [], [], []
    per = [seeds_steps(c, N) for c in range(len(CONFIGS))]
    greedy_logits = torch.randn(N // 8, V, generator=torch.Generator().manual_seed(7))
    for r in range(N):
        for c, p in enumerate(CONFIGS):
            params.append(p)
            seeds.append(per[c][0][r])
            steps.append(per[c][1][r])
            rows.append(c)
        if r % 8 == 0:
            params.append(SamplingParams(temperature=0.0, top_k=2))
            seeds.append(r)
            steps.append(0)
            rows.append(len(CONFIGS) + r // 8)
    logits = torch.cat([LOGITS, greedy_logits])[torch.tensor(rows)]
    out = sample_rows(logits, RowSampling.make(params, seeds, steps, "cpu")).tokens
    greedy = torch.tensor([p.greedy for p in params])
    return out[~greedy].view(N, len(CONFIGS)).T, out[greedy], greedy_logits


@pytest.mark.parametrize("c", range(len(CONFIGS)))
def test_draws_fit_the_reference_distribution(draws, c):
    counts = torch.bincount(draws[0][c], minlength=V)
    ref = probs(config_logits(c), CONFIGS[c])
    stat, df = chi2_stat(counts, ref)
    assert df >= 2 and stat <= chi2_critical(df), (stat, df)


def test_greedy_rows_in_a_sampled_batch_are_the_argmax(draws):
    _, tokens, logits = draws
    assert torch.equal(tokens, logits.argmax(-1))


def test_negative_controls_are_rejected(draws, monkeypatch):
    """The test can fail: draws against a slightly wrong temperature, against top-k one larger, against top-p a
    little wider, and a sampler with a biased uniform (u ** 1.15), are all rejected."""
    tokens = draws[0]
    wrong = [(0, SamplingParams(temperature=0.8)), (1, SamplingParams(temperature=1.0, top_k=9)),
             (2, SamplingParams(temperature=1.3, top_p=0.9)), (3, SamplingParams(temperature=1.0))]
    for c, p in wrong:
        assert not fits(torch.bincount(tokens[c], minlength=V), probs(config_logits(c), p)), (c, p)
    # a drawn token the (narrower) reference excludes: caught before the statistic
    with pytest.raises(AssertionError, match="support"):
        fits(torch.bincount(tokens[1], minlength=V), probs(config_logits(1), SamplingParams(top_k=7, temperature=1.0)))
    real = sampling.stream_uniform
    monkeypatch.setattr(sampling, "stream_uniform", lambda key, step: real(key, step) ** 1.15)
    seeds, steps = seeds_steps(0, N)
    biased = sample_rows(config_logits(0).expand(N, V), RowSampling.make([CONFIGS[0]] * N, seeds, steps, "cpu"))
    assert not fits(torch.bincount(biased.tokens, minlength=V), probs(config_logits(0), CONFIGS[0]))


@pytest.mark.parametrize("cap", [sampling.TOPK_CAP, 5, 40])
@pytest.mark.parametrize("prefix_only", [False, True])
def test_filtered_distributions_equal_the_reference(cap, prefix_only):
    """``batch_probs`` (what the rows are drawn from) is ``probs`` for random parameters on random rows, the rows of
    every kind in one batch; top-k keeps ties with its k-th value as the reference does. With ``cap`` at or below
    some rows' top-k, those rows filter from their ``cap`` largest values (``prefix_only``: a batch of such rows
    alone, which takes ``torch.topk`` instead of a whole sort)."""
    g = torch.Generator().manual_seed(3)
    params = []
    for i in range(96):
        params.append(SamplingParams(temperature=[0.3, 0.7, 1.0, 1.9][i % 4], top_k=[0, 1, 5, 40, 500][i % 5],
                                     top_p=[1.0, 0.5, 0.9, 0.99][i // 4 % 4], min_p=[0.0, 0.01, 0.2][i // 16 % 3]))
    if prefix_only:
        params = [p for p in params if 0 < p.top_k <= cap or (p.top_k == 0 and p.top_p == 1.0)]
    logits = torch.randn(len(params), 300, generator=g) * 3
    logits[::7] = (logits[::7] * 2).round() / 2  # ties
    rows = RowSampling.make(params, [0] * len(params), [0] * len(params), "cpu", cap=cap)
    assert rows.full != prefix_only
    got = batch_probs(logits, rows)
    for r, p in enumerate(params):
        if r % 7 == 0 and p.top_p < 1.0:
            continue  # a tie at the top-p boundary: see the next test
        want = probs(logits[r], p)
        assert torch.equal(got[r] > 0, want > 0), (r, p)
        assert torch.allclose(got[r], want.double(), atol=1e-6), (r, p)


def test_a_top_k_row_draws_the_same_from_its_prefix_as_from_the_whole_sort():
    """A row with a top-k within the cap gets the same threshold bits, and so the same token, from ``torch.topk`` of
    the cap (a batch of such rows) as from a whole-row sort (batched with a top-p-only row), ties at its k-th value
    reaching past the cap included; and the same distribution as the reference."""
    g = torch.Generator().manual_seed(13)
    cap = 6
    for trial in range(40):
        row = (torch.randn(1, 400, generator=g) * 2).round() / 2 if trial % 2 else torch.randn(1, 400, generator=g) * 3
        p = SamplingParams(temperature=[0.6, 1.0, 1.7][trial % 3], top_k=1 + trial % cap,
                           top_p=[1.0, 0.9, 0.6, 0.3][trial % 4], min_p=[0.0, 0.05][trial % 2])
        whole = SamplingParams(temperature=1.0, top_p=0.8)
        alone = RowSampling.make([p], [trial], [trial], "cpu", cap=cap)
        mixed = RowSampling.make([whole, p], [1, trial], [1, trial], "cpu", cap=cap)
        assert not alone.full and mixed.full
        a, m = batch_probs(row, alone)[0], batch_probs(torch.cat([row * 0.5, row]), mixed)[1]
        assert torch.equal(a, m), trial
        want = probs(row[0], p)
        assert set(torch.nonzero(want).flatten().tolist()) <= set(torch.nonzero(a).flatten().tolist()), trial
        if trial % 2 == 0:  # no ties: the same set and the same probabilities as the reference
            assert torch.allclose(a, want.double(), atol=1e-6), trial
        for step in range(5):
            alone.step.fill_(step)
            mixed.step.fill_(step)
            assert int(sample_rows(row, alone).tokens[0]) == int(sample_rows(torch.cat([row * 0.5, row]),
                                                                               mixed).tokens[1]), (trial, step)
    tied = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    one = RowSampling.make([SamplingParams(temperature=1.0, top_k=2)], [0], [0], "cpu")
    assert torch.equal(batch_probs(tied, one)[0] > 0, torch.tensor([True, True, True, True, False, False]))


def test_a_tie_at_the_top_p_boundary_is_kept_whole():
    """Where the reference keeps the part of a tie its sort puts first, the batched sampler keeps all of it (it
    works on a threshold value): the kept set is the reference's plus the rest of that tie."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    p = SamplingParams(temperature=1.0, top_p=0.6)
    got = batch_probs(logits, RowSampling.make([p], [0], [0], "cpu"))[0]
    want = probs(logits[0], p)
    assert set(torch.nonzero(want).flatten().tolist()) <= {0, 1, 2, 3} == set(torch.nonzero(got).flatten().tolist())


def test_the_stream_matches_its_reference_bit_for_bit():
    seeds = [0, 1, -1, 7, 2**63 - 1, -2**63, 12345678901234567, -98765432123]
    steps = [0, 1, 2, 999, 2**31, 2**40 + 3, 2**62]
    keys = torch.tensor([stream_key(s) for s in seeds for _ in steps])
    st = torch.tensor([n for _ in seeds for n in steps])
    got = stream_uniform(keys, st).tolist()
    want = [stream_uniform_ref(stream_key(s), n) for s in seeds for n in steps]
    assert got == want and len(set(want)) == len(want)
    assert all(0.0 <= u < 1.0 for u in got)


def test_the_stream_is_uniform_and_unrelated_across_steps_and_seeds():
    """64-bin histograms of 128K draws, and 8 x 8 histograms of pairs (a seed's consecutive steps; the same step of
    consecutive seeds, as a request's n choices take seed + i), fit the uniform."""
    steps = torch.arange(512).repeat(256)
    keys = torch.tensor([stream_key(s) for s in range(256)]).repeat_interleave(512)
    u = stream_uniform(keys, steps).view(256, 512)
    flat = torch.full((64,), 1 / 64)
    assert fits(torch.bincount((u.flatten() * 64).long(), minlength=64), flat)
    pairs = torch.full((64,), 1 / 64)
    bins = (u * 8).long()
    assert fits(torch.bincount((bins[:, :-1] * 8 + bins[:, 1:]).flatten(), minlength=64), pairs)  # steps
    assert fits(torch.bincount((bins[:-1] * 8 + bins[1:]).flatten(), minlength=64), pairs)  # seeds
    assert not fits(torch.bincount((u.flatten() ** 1.05 * 64).long(), minlength=64), flat)  # a biased one fails


def test_a_seeded_row_is_the_same_whatever_it_is_batched_with():
    """A row's token depends on its logits, parameters, seed and step only: drawn alone, and at any place of a batch
    of other rows (greedy ones, ones that need the sort and ones that do not), it comes out the same."""
    g = torch.Generator().manual_seed(11)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=7),
              SamplingParams(temperature=1.2, top_p=0.7), SamplingParams(temperature=1.0, min_p=0.1)]
    for i, p in enumerate([SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
                           SamplingParams(temperature=1.4, min_p=0.02)]):
        for seed, step in [(i, 0), (i, 1), (-5, 17), (2**62 + i, 3)]:
            row = torch.randn(1, 1000, generator=g) * 2
            alone = sample_rows(row, RowSampling.make([p], [seed], [step], "cpu")).tokens
            for at in range(len(others) + 1):
                ps = others[:at] + [p] + others[at:]
                batch = torch.cat([torch.randn(at, 1000, generator=g), row,
                                   torch.randn(len(others) - at, 1000, generator=g)])
                rows = RowSampling.make(ps, [9] * at + [seed] + [9] * (len(others) - at),
                                      [4] * at + [step] + [4] * (len(others) - at), "cpu")
                assert int(sample_rows(batch, rows).tokens[at]) == int(alone), (p, seed, step, at)
    # and different seeds, or steps, of one row do draw differently
    row = torch.zeros(1, 1000)
    drawn = {int(sample_rows(row, RowSampling.make([SamplingParams(temperature=1.0)], [s], [n], "cpu")).tokens)
             for s in range(4) for n in range(4)}
    assert len(drawn) >= 14


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_are_the_first_argmax(dtype):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 2.0, 2.0]], dtype=dtype)
    for mixed in (False, True):
        ps = [SamplingParams(temperature=0.0, top_k=1, min_p=0.5)] * 3 + [SamplingParams(temperature=1.0, top_k=2)]
        ps = ps if mixed else ps[:3]
        rows = RowSampling.make(ps, [1] * len(ps), [0] * len(ps), "cpu")
        x = torch.cat([logits, logits[:1]]) if mixed else logits
        got = sample_rows(x, rows).tokens[:3]
        assert got.tolist() == [1, 0, 2]
        assert got.tolist() == [int(select(r, SamplingParams(), None)) for r in logits]


def test_log_probabilities():
    """By default each token's log-probability and its top n are the log-softmax of the row's logits (what the
    engine keeps: ``keep_logprobs``); ``processed``: the log of the distribution it was drawn from (``probs``)."""
    g = torch.Generator().manual_seed(5)
    ps = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=10),
          SamplingParams(temperature=1.0, top_p=0.8, min_p=0.01), SamplingParams(temperature=1.3)]
    logits = torch.randn(len(ps), 200, generator=g) * 3
    rows = RowSampling.make(ps, [1, 2, 3, 4], [0, 5, 6, 7], "cpu")
    tokens = sample_rows(logits, rows).tokens
    raw = sample_rows(logits, rows, logprobs=5)
    full = torch.log_softmax(logits.float(), -1)
    assert torch.equal(raw.tokens, tokens)
    assert torch.equal(raw.logprobs, full.gather(-1, tokens[:, None])[:, 0])
    assert torch.equal(raw.top_logprobs, full.topk(5).values) and torch.equal(raw.top_ids, full.topk(5).indices)
    assert sample_rows(logits, rows, logprobs=0).top_ids is None
    proc = sample_rows(logits, rows, logprobs=3, processed=True)
    assert torch.equal(proc.tokens, tokens) and float(proc.logprobs[0]) == 0.0  # greedy: all its mass on the token
    for r, p in enumerate(ps[1:], 1):
        want = probs(logits[r], p)
        lp = proc.logprobs[r]
        assert math.isclose(float(lp.exp()), float(want[tokens[r]]), rel_tol=1e-5)
        assert torch.allclose(proc.top_logprobs[r].exp(), want.topk(3).values, rtol=1e-5)
        assert set(proc.top_ids[r].tolist()) <= set(torch.nonzero(want).flatten().tolist())
    all_greedy = RowSampling.make([SamplingParams()] * 2, [0, 0], [0, 0], "cpu")
    both = sample_rows(logits[:2], all_greedy, logprobs=2, processed=True)
    assert torch.equal(both.tokens, logits[:2].argmax(-1)) and both.logprobs.tolist() == [0.0, 0.0]
    assert torch.isinf(both.top_logprobs[:, 1]).all()


def test_switches_and_parameters():
    ps = [SamplingParams(temperature=1.0, min_p=0.1), SamplingParams()]
    rows = RowSampling.make(ps, [1, 2], [3, 4], "cpu")
    assert not rows.sort and not rows.greedy and not rows.full
    assert RowSampling.make([SamplingParams(top_k=3)], [0], [0], "cpu").greedy  # greedy rows sort nothing
    assert not RowSampling.make([SamplingParams(top_k=3)], [0], [0], "cpu").sort
    top_p = RowSampling.make([SamplingParams(temperature=0.5, top_p=0.9)], [0], [0], "cpu")
    assert top_p.sort and top_p.full  # top-p alone: the whole row's order
    cap = sampling.TOPK_CAP
    assert RowSampling.switches([SamplingParams(temperature=0.7, top_k=20, top_p=0.95)]) == (True, False, False)
    assert RowSampling.switches([SamplingParams(temperature=0.7, top_k=cap)]) == (True, False, False)
    assert RowSampling.switches([SamplingParams(temperature=0.7, top_k=cap + 1)]) == (True, True, False)
    assert RowSampling.switches([SamplingParams(top_p=0.5), SamplingParams(temperature=1.0, top_k=5)]) == \
        (True, False, False)  # a greedy row's filters do not count
    assert rows.key.tolist() == [stream_key(1), stream_key(2)] and rows.step.tolist() == [3, 4]
    static = RowSampling.make([SamplingParams(temperature=0.5, top_k=4)] * 2, [0, 0], [0, 0], "cpu")
    static.copy_(rows)
    assert static.sort and static.top_k.tolist() == [0, 0] and static.min_p.tolist() == pytest.approx([0.1, 0.0])
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    # a sorting batch and a non-sorting one draw the same tokens for rows that filter by neither
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sample_rows(logits, rows).tokens, sample_rows(logits, static).tokens)


def test_the_engine_draws_a_steps_rows_in_one_call(monkeypatch):
    """Through the scheduler, every decode step samples all its rows in one ``sample_rows`` call, and seeded
    requests batched together (with a greedy one and an unseeded one) give the tokens they give alone."""
    from ninfer_bench.engine.runtime import engine as engine_mod
    from ninfer_bench.engine.runtime.engine import Engine
    from ninfer_bench.engine.runtime.scheduler import Scheduler

    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_concurrency=4, max_context=256)
    prompts = [list(range(3 + i, 30 + 5 * i)) for i in range(4)]
    kws = [dict(temperature=1.0, seed=5), dict(temperature=0.8, top_k=20, top_p=0.9, seed=6),
           dict(temperature=0.0), dict(temperature=1.2, min_p=0.05, seed=7)]
    alone = [eng.generate(p, max_new_tokens=12, ignore_eos=True, **kw).tokens for p, kw in zip(prompts, kws)]
    calls, real = [], engine_mod.sample_rows

    def counted(logits, rows):
        calls.append(len(logits))
        return real(logits, rows)

    monkeypatch.setattr(engine_mod, "sample_rows", counted)
    sched = Scheduler(eng)
    reqs = [sched.submit(p, SamplingParams(max_new_tokens=12, ignore_eos=True, **kw)) for p, kw in zip(prompts, kws)]
    unseeded = sched.submit(prompts[0], SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0))
    sched.run_until_idle()
    assert [r.tokens for r in reqs] == alone
    assert len(unseeded.tokens) == 12
    assert max(calls) == 4  # decode steps of 4 (3 sampling + 1 greedy) rows: one call each


def test_the_chunked_scan_is_the_rows_cumulative_sum(monkeypatch):
    """``_cdf``: each row's inclusive cumulative sum (to fp64 rounding), non-decreasing across chunk boundaries,
    zero-padded to whole chunks (at least two), and a row's bits do not depend on the rows beside it."""
    monkeypatch.setattr(sampling, "CDF_CHUNK", 16)
    g = torch.Generator().manual_seed(4)
    for v in (5, 16, 17, 100):
        w = torch.rand(3, v, generator=g, dtype=torch.float64) * (torch.rand(3, v, generator=g) > 0.3)
        got = sampling._cdf(w)
        assert got.shape == (3, max(2, -(-v // 16)) * 16)
        assert torch.allclose(got[:, :v], w.cumsum(-1), rtol=1e-12)
        assert torch.equal(got[:, v:], got[:, v - 1:v].expand(-1, got.shape[1] - v))
        assert bool((got.diff(dim=-1) >= 0).all())
        assert torch.equal(sampling._cdf(w[1:2]), got[1:2])


# ---- CUDA (skipped without a GPU) ----------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GRAPH_KINDS = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=50),
               SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.1, min_p=0.05),
               SamplingParams(temperature=0.6, top_k=20, top_p=0.9, min_p=0.01),
               SamplingParams(temperature=1.5, top_k=1000), SamplingParams(temperature=0.0, top_p=0.5)]


def _graph_rows(trial: int, step: int, device) -> RowSampling:
    kinds = GRAPH_KINDS[trial:] + GRAPH_KINDS[:trial]
    rows = RowSampling.make(kinds, [trial * 100 + r for r in range(len(kinds))], [step] * len(kinds), device)
    rows.sort = rows.full = True  # the captured graph's switches
    rows.greedy = False
    return rows


@pytest.mark.cuda
@needs_cuda
def test_cuda_graph_replay_equals_eager():
    """``sample_rows`` captured in a CUDA graph (8 rows of a 248K vocabulary, bf16 logits, every kind of row, the
    chosen and top-4 log-probabilities) with the rows' step counters advanced inside the graph: each replay, after
    new logits and parameters are copied into the static buffers or with none copied (the next step of the same
    streams), gives eager's tokens and log-probabilities exactly."""
    dev = torch.device("cuda")
    b, v = len(GRAPH_KINDS), 248_320
    gen = torch.Generator(device=dev).manual_seed(0)

    def fresh_logits():
        return (torch.randn(b, v, generator=gen, device=dev) * 3).to(torch.bfloat16)

    static_logits = fresh_logits()
    static = _graph_rows(0, 0, dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            sample_rows(static_logits, static, logprobs=4)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample_rows(static_logits, static, logprobs=4)
        static.step.add_(1)
    for trial in range(4):
        logits, rows = fresh_logits(), _graph_rows(trial, 10 * trial, dev)
        static_logits.copy_(logits)
        static.copy_(rows)
        for n in range(3):  # the first replay after the copies, then two more steps of the same streams
            graph.replay()
            rows.step.fill_(10 * trial + n)
            want = sample_rows(logits, rows, logprobs=4)
            torch.cuda.synchronize()
            assert torch.equal(out.tokens, want.tokens), (trial, n)
            assert torch.equal(out.logprobs, want.logprobs) and torch.equal(out.top_ids, want.top_ids)
            assert torch.equal(out.top_logprobs, want.top_logprobs)
            assert static.step.tolist() == [10 * trial + n + 1] * b
        greedy = (b - trial) % b  # where the rotation put GRAPH_KINDS[0] (greedy)
        assert int(out.tokens[greedy]) == int(logits[greedy].argmax())


@pytest.mark.cuda
@needs_cuda
def test_cuda_sampler_needs_no_host_sync_and_matches_the_cpu():
    """Eager on CUDA: building the rows and sampling them never synchronises with the host (torch's sync debug mode
    raises on any call that would); the stream's bits are the reference's; the draws fit the reference
    distribution and, for the same fp32 logits, are the CPU's tokens."""
    dev = torch.device("cuda")
    logits = torch.randn(len(GRAPH_KINDS), 248_320, generator=torch.Generator().manual_seed(1)) * 3
    on_dev = logits.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = RowSampling.make(GRAPH_KINDS, list(range(len(GRAPH_KINDS))), [5] * len(GRAPH_KINDS), dev)
        got = sample_rows(on_dev, rows, logprobs=2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = sample_rows(logits, RowSampling.make(GRAPH_KINDS, list(range(len(GRAPH_KINDS))), [5] * len(GRAPH_KINDS),
                                               "cpu"))
    assert got.tokens.cpu().tolist() == cpu.tokens.tolist()
    keys = torch.tensor([stream_key(s) for s in range(-50, 50)])
    steps = torch.arange(100) * 2**33
    assert stream_uniform(keys.to(dev), steps.to(dev)).cpu().tolist() == [
        stream_uniform_ref(int(k), int(n)) for k, n in zip(keys, steps)]
    for c in (1, 4):  # a batch of draws of one configuration on the device against the reference
        seeds, st = seeds_steps(c, N)
        drawn = sample_rows(LOGITS[c].to(dev).expand(N, V), RowSampling.make([CONFIGS[c]] * N, seeds, st, dev))
        counts = torch.bincount(drawn.tokens.cpu(), minlength=V)
        assert fits(counts, probs(config_logits(c), CONFIGS[c]))
        cpu = sample_rows(LOGITS[c].expand(N, V), RowSampling.make([CONFIGS[c]] * N, seeds, st, "cpu"))
        assert int((cpu.tokens != drawn.tokens.cpu()).sum()) <= 2  # rounding at a boundary, at most


@pytest.mark.cuda
@needs_cuda
def test_cuda_engine_seeded_sampling_repeats_itself():
    from ninfer_bench.engine.runtime.engine import Engine

    eng = Engine.load("tiny", device="cuda", max_context=512)
    kw = dict(max_new_tokens=24, temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, ignore_eos=True)
    a = eng.generate(list(range(3, 60)), seed=3, **kw).tokens
    assert a == eng.generate(list(range(3, 60)), seed=3, **kw).tokens
    assert a != eng.generate(list(range(3, 60)), seed=4, **kw).tokens


@pytest.mark.cuda
@needs_cuda
def test_cuda_engine_samples_from_a_captured_graph():
    """The engine's step sampler on CUDA graphs (GraphRunner.sample, what Engine.pick calls for sampling rows without
    log-probabilities): one graph per (rows, vocabulary, dtype, switches), new rows' parameters and logits each call,
    the eager sampler's tokens every time; the greedy-only and log-probability picks stay eager."""
    from ninfer_bench.engine.runtime.engine import Engine

    eng = Engine.load("tiny", device="cuda", max_context=256, max_concurrency=4)
    assert eng.graphs is not None
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    v = eng.config.vocab_size
    for trial in range(6):
        b = 1 + trial % 3
        kinds = (GRAPH_KINDS[trial:] + GRAPH_KINDS[:trial])[:b]
        seeds, steps = [trial * 7 + r for r in range(b)], [trial + r for r in range(b)]
        logits = (torch.randn(b, v, generator=gen, device=dev) * 3).to(torch.bfloat16)
        got = eng.graphs.sample(logits, kinds, seeds, steps).clone()
        want = sample_rows(logits, RowSampling.make(kinds, seeds, steps, dev)).tokens
        assert torch.equal(got, want), trial
    sort_full_greedy = {k[3:] for k in eng.graphs.samplers}
    assert len(eng.graphs.samplers) >= 4 and {(True, False, False), (True, True, False)} <= sort_full_greedy


@pytest.mark.cuda
@needs_cuda
def test_cuda_a_row_draws_the_same_alone_and_in_a_batch_of_eight():
    """On the device (248K vocabulary, bf16): a seeded row's token is the same drawn alone and at any place of a
    batch of eight - with top-k rows only (``torch.topk`` of the cap) and beside top-p-only rows (the whole-row
    sort)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(9)
    v = 248_320
    issue = SamplingParams(temperature=0.7, top_k=20, top_p=0.95)
    for others in ([issue] * 7, [SamplingParams(temperature=0.8, top_p=0.9)] * 7):
        for step in range(4):
            logits = (torch.randn(8, v, generator=gen, device=dev) * 3).to(torch.bfloat16)
            for at in (0, 3, 7):
                ps = others[:at] + [issue] + others[at:]
                seeds, steps = [100 + r for r in range(8)], [step] * 8
                seeds[at] = 5
                rows = torch.cat([logits[1:at + 1], logits[:1], logits[at + 1:]])
                batch = sample_rows(rows, RowSampling.make(ps, seeds, steps, dev)).tokens
                alone = sample_rows(logits[:1], RowSampling.make([issue], [5], [step], dev)).tokens
                assert int(batch[at]) == int(alone[0]), (others[0], step, at)
