"""Speculative decoding: exactness against plain greedy, rollback of hybrid state, rejection sampling."""

from __future__ import annotations

import math

import pytest
import torch

from ninfer_bench.engine.runtime.engine import Engine
from ninfer_bench.engine.sampling import SamplingParams
from ninfer_bench.engine.spec.accept import accept_greedy, accept_sampling
from ninfer_bench.engine.model.dflash import ordered_topk
from ninfer_bench.suites.decode import summarize

from spec_rigs import RiggedDrafter, always, never, random_prefix

NEW = 256
PROMPTS = [list(range(1, 70)), [7, 3, 9, 200, 17, 17, 17, 44] * 9]


def engine(**kw):
    return Engine.load("tiny", device="cpu", kv_dtype="fp32", max_context=1024, prefill_chunk=32, **kw)


@pytest.fixture(scope="module")
def plain():
    eng = engine()
    return {i: eng.generate(p, max_new_tokens=NEW, ignore_eos=True).tokens for i, p in enumerate(PROMPTS)}


SPECS = [("mtp", k) for k in range(1, 5)] + [(s, k) for s in ("dflash", "dflash2") for k in range(1, 9)]


@pytest.mark.parametrize("spec,k", SPECS, ids=[f"{s}-k{k}" for s, k in SPECS])
def test_spec_greedy_equals_plain(plain, spec, k):
    eng = engine(spec=spec, draft_tokens=k, rollback="recompute" if k % 2 else "snapshot")
    for i, p in enumerate(PROMPTS):
        res = eng.generate(p, max_new_tokens=NEW, ignore_eos=True)
        assert res.tokens == plain[i], f"prompt {i}: first difference at {_first_diff(res.tokens, plain[i])}"
        assert res.spec["drafted_tokens"] == k * res.spec["rounds"]


@pytest.mark.parametrize("agree,label", [(always, "all"), (never, "none"), (random_prefix, "prefix")])
@pytest.mark.parametrize("rollback", ["recompute", "snapshot"])
def test_rigged_drafters_keep_greedy_exact(plain, agree, label, rollback):
    k = 5
    eng = engine(spec="mtp", draft_tokens=k, rollback=rollback)
    rule = agree(k) if label != "none" else agree()
    eng.drafter = RiggedDrafter(eng, plain[0], rule, eng.config.vocab_size)
    res = eng.generate(PROMPTS[0], max_new_tokens=NEW, ignore_eos=True)
    assert res.tokens == plain[0]
    per = res.spec["accepted_per_position"]
    if label == "all":
        assert res.spec["accepted_tokens"] == res.spec["drafted_tokens"] - _truncated(res, k)
        assert res.spec["rounds"] == math.ceil((NEW - 1) / (k + 1))
    if label == "none":
        assert res.spec["accepted_tokens"] == 0 and res.spec["rounds"] == NEW - 1
    if label == "prefix":
        assert 0 < res.spec["accepted_tokens"] < res.spec["drafted_tokens"]
        assert per == sorted(per, reverse=True)  # position i is accepted only after i-1


def _truncated(res, k):
    # the last round may draft past max_new_tokens; those drafts are accepted but not needed
    return 0 if (len(res.tokens) - 1) % (k + 1) == 0 else res.spec["drafted_tokens"] - res.spec["accepted_tokens"]


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("rollback", ["recompute", "snapshot"])
def test_rollback_restores_state_of_a_plain_run(plain, rollback):
    eng = engine(spec="mtp", draft_tokens=4, rollback=rollback)
    eng.drafter = RiggedDrafter(eng, plain[0], random_prefix(4, seed=3), eng.config.vocab_size)
    seq = eng.acquire(PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True))
    eng.start(seq)
    for _ in range(6):
        eng.advance([seq])
    assert seq.stats["accepted_tokens"] < seq.stats["drafted_tokens"]  # some rounds rejected drafts
    ref = engine()
    ref_seq = ref.acquire(PROMPTS[0] + seq.tokens[:-1], SamplingParams(max_new_tokens=1))
    ref.prefill(ref_seq.slot, ref_seq.prompt)
    n = seq.length
    assert n == len(ref_seq.prompt)
    for i in eng.cache.ssm:
        torch.testing.assert_close(eng.cache.ssm[i][seq.slot], ref.cache.ssm[i][ref_seq.slot], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(eng.cache.conv[i][seq.slot], ref.cache.conv[i][ref_seq.slot], rtol=1e-4, atol=1e-5)
    for key in ref.cache.kv:
        a, b = eng.cache.kv[key], ref.cache.kv[key]
        torch.testing.assert_close(a.k[seq.slot, :, :n], b.k[ref_seq.slot, :, :n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.v[seq.slot, :, :n], b.v[ref_seq.slot, :, :n], rtol=1e-4, atol=1e-5)


# ---- rejection sampling -------------------------------------------------------------------------------
CHI2_P = 1e-4  # reject "same distribution" only below this p-value: a false alarm in 1e4 seeded runs


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value (Wilson-Hilferty approximation of the chi-square tail)."""
    n = counts.sum()
    keep = probs > 0
    exp = probs[keep] * n
    stat = float(((counts[keep] - exp) ** 2 / exp).sum())
    assert int(counts[~keep].sum()) == 0, "samples fell outside the target's support"
    df = int(keep.sum()) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_rejection_sampling_preserves_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    v, k, n = 12, 3, 24000
    p = torch.softmax(torch.randn(k + 1, v, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, v, generator=g) * 1.5, -1)
    first, second = torch.zeros(v), torch.zeros(v)
    gens = [torch.Generator().manual_seed(1)]
    for _ in range(n):
        d = torch.multinomial(q, 1, generator=gens[0]).T  # [1, K] drafts from q
        n_acc, bonus = accept_sampling(d, p[None], q[None], gens)
        out = d[0, : int(n_acc)].tolist() + [int(bonus)]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    # token 1 is distributed as p_0; token 2 (emitted when draft 1 was accepted) as p_1
    assert chi2_pvalue(first, p[0]) > CHI2_P
    assert chi2_pvalue(second, p[1]) > CHI2_P
    # and the test can fail: the draft distribution itself is rejected
    assert chi2_pvalue(first, q[0]) < CHI2_P


def test_greedy_accept_arithmetic():
    logits = torch.zeros(2, 4, 10)
    target = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    logits.scatter_(2, target[..., None], 1.0)
    n_acc, bonus = accept_greedy(torch.tensor([[1, 2, 9], [0, 6, 7]]), logits)
    assert n_acc.tolist() == [2, 0] and bonus.tolist() == [3, 5]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_ordered_topk_breaks_ties_by_column(device):
    """DFlash2's candidates: topk's values, and among equal values the lower column first - also across the k-th
    place, where plain topk may take any of the tied columns."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(-3, 4, (4, 7, 3000), generator=g).float() / 2).to(device, torch.bfloat16)  # many ties
    vals, cols = ordered_topk(x, 16)
    want, _ = torch.topk(x.float(), 16, dim=-1)
    assert torch.equal(vals, want) and torch.equal(vals, x.float().gather(-1, cols))
    key = torch.sort(-x.float() * 1e4 + torch.arange(3000, device=device), dim=-1, stable=True).indices[..., :16]
    assert torch.equal(cols, key)
    assert torch.equal(ordered_topk(torch.tensor([[-0.5, 2.0, -7.0, 2.0]]), 3)[1], torch.tensor([[1, 3, 0]]))


def test_spec_sampling_is_seeded_and_reproducible():
    eng = engine(spec="dflash2", draft_tokens=4)
    a = eng.generate(PROMPTS[0], max_new_tokens=40, temperature=0.9, top_p=0.95, seed=11).tokens
    b = eng.generate(PROMPTS[0], max_new_tokens=40, temperature=0.9, top_p=0.95, seed=11).tokens
    c = eng.generate(PROMPTS[0], max_new_tokens=40, temperature=0.9, top_p=0.95, seed=12).tokens
    assert a == b and a != c


def test_metric_arithmetic_on_hand_made_rounds():
    recs = [dict(prefill_tok_s=10.0, decode_tok_s=5.0, ttft_ms=1.0, device_ms_per_round=2.0, draft_ms_per_round=None,
                 verify_ms_per_round=None, prompt_tokens=3, completion_tokens=11, tokens_sha256="x", rounds=4,
                 drafted_tokens=12, accepted_tokens=6, accepted_per_position_counts=[4, 2, 0], target_forwards=4,
                 decode_s=2.0)]
    s = summarize(recs, weight_bytes=100, copy_bw=1e3, peak=0)
    assert s["acceptance_rate"] == 0.5
    assert s["tokens_per_round"] == 1 + 6 / 4
    assert s["accepted_per_position"] == [1.0, 0.5, 0.0]
    assert s["roofline_fraction"] == pytest.approx(100 * 4 / 2.0 / 1e3)


def test_finishing_inside_a_block_keeps_cache_and_length_consistent(plain):
    eng = engine(spec="mtp", draft_tokens=5)
    eng.drafter = RiggedDrafter(eng, plain[0], always(5), eng.config.vocab_size)
    seq = eng.acquire(PROMPTS[0], SamplingParams(max_new_tokens=9, ignore_eos=True))  # 1 + 6 + 2 of 6
    eng.start(seq)
    while seq.finish_reason is None:
        eng.advance([seq])
    assert len(seq.tokens) == 9 and seq.tokens == plain[0][:9]
    assert seq.length == len(PROMPTS[0]) + len(seq.tokens) - 1  # the newest token is not in the cache
    state = eng.export_state(seq)
    eng.release(seq)
    assert len(state["ids"]) == state["cache"]["length"]
    # the stats count the drafts that reached the output: round 2 was cut to 2 tokens (its last the round's own)
    st = seq.stats
    assert (st["rounds"], st["accepted_tokens"], st["accepted_per_position"]) == (2, 6, [2, 1, 1, 1, 1])
    assert 1 + st["rounds"] + st["accepted_tokens"] == len(seq.tokens)


@pytest.mark.parametrize("spec,k", [("mtp", 3), ("dflash2", 7)])
@pytest.mark.parametrize("new", [5, 37])
def test_completion_is_first_token_plus_rounds_plus_accepted(spec, k, new):
    """Greedy speculative decoding cut by the token limit: every round adds 1 + the drafts it counts as accepted."""
    res = engine(spec=spec, draft_tokens=k).generate(PROMPTS[1], max_new_tokens=new, ignore_eos=True)
    st = res.spec
    assert len(res.tokens) == new == 1 + st["rounds"] + st["accepted_tokens"]
    assert st["tokens_per_round"] == (len(res.tokens) - 1) / st["rounds"]


class _EagerGraph:
    """A CUDA graph's replay semantics on the CPU: run the captured function again over the same static inputs
    and write its results into the tensors the capture returned."""

    def __init__(self, fn, outs):
        self.fn, self.outs = fn, outs

    def replay(self):
        new = self.fn()
        if new is None:  # the function wrote its own buffers
            return
        for out, value in zip(*((self.outs, new) if isinstance(new, tuple) else ((self.outs,), (new,)))):
            out.copy_(value)


@pytest.mark.parametrize("spec,k", [("mtp", 3), ("dflash", 5), ("dflash2", 7)])
def test_draft_graph_replays_equal_plain(plain, monkeypatch, spec, k):
    """The drafters' graph replays (static inputs, padding rows on the scratch slot, outputs copied out) with the
    capture emulated on the CPU, and a bucket one row wider than the batch: plain decoding's tokens, the eager
    drafter's acceptance, and every wanted function went through a replay."""
    from types import SimpleNamespace

    from ninfer_bench.engine.spec import draft_graphs

    def capture(fn, pool, device, **kw):
        outs = fn()
        return _EagerGraph(fn, outs), outs

    monkeypatch.setattr(draft_graphs, "capture", capture)
    eager = engine(spec=spec, draft_tokens=k, draft_graphs=False).generate(PROMPTS[1], max_new_tokens=NEW,
                                                                            ignore_eos=True)
    eng = engine(spec=spec, draft_tokens=k)
    eng.drafter.graphs = draft_graphs.DraftGraphs(eng, SimpleNamespace(bucket=lambda b: b + 1, pool=None))
    res = eng.generate(PROMPTS[1], max_new_tokens=NEW, ignore_eos=True)
    assert res.tokens == plain[1]
    assert res.spec["accepted_tokens"] == eager.spec["accepted_tokens"]
    names = {name for name, _, _ in eng.drafter.graphs.captured}
    assert names == {"draft", "commit"}


def test_round_times_are_settled_by_the_end_of_a_generation(monkeypatch):
    """A round's draft / verify times are added one round late (spec/loop.settle_times) and the last round's when
    its sequence finishes: a generation's stats hold every round's time, nothing left pending."""
    from ninfer_bench.engine.spec import loop

    times = iter(range(10_000))
    monkeypatch.setattr(loop, "timer", lambda dev: float(next(times)))  # 1 ms between consecutive stamps
    monkeypatch.setattr(loop, "ms", lambda dev, a, b: b - a)
    eng = engine(spec="dflash2", draft_tokens=3)
    res = eng.generate(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
    rounds = res.spec["rounds"]
    assert rounds > 1 and eng.spec_times is None
    assert res.spec["draft_ms"] == 2.0 * rounds and res.spec["verify_ms"] == 1.0 * rounds


def test_mtp_prompt_entries_do_not_depend_on_the_prefill_chunk():
    """The MTP head's entry for a chunk's last prompt position needs the next chunk's first token: it is made with
    that chunk. Its K/V for every prompt position, and the first round's pending draft logits, are those of a
    one-chunk prefill, also in a slot an earlier (longer) request left K/V in."""
    prompt = PROMPTS[0]
    caches = []
    for chunk in (len(prompt), 7, 1):
        eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_context=256, prefill_chunk=chunk, spec="mtp")
        eng.generate(list(range(100, 200)), max_new_tokens=4, ignore_eos=True)  # leaves K/V in slot 0
        seq = eng.acquire(prompt, SamplingParams(max_new_tokens=4))
        eng.start(seq)
        kv = eng.cache.kv["mtp0"]
        caches.append((kv.k[seq.slot, :, :len(prompt)].clone(), kv.v[seq.slot, :, :len(prompt)].clone(),
                       eng.drafter.pending[seq.slot][1].clone()))
        eng.release(seq)
    for k, v, logits in caches[1:]:
        torch.testing.assert_close(k, caches[0][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, caches[0][1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(logits, caches[0][2], rtol=1e-4, atol=1e-4)


def test_window_ring_writes_each_entry_once_when_a_prompt_chunk_is_longer_than_the_window(monkeypatch):
    """DFlash2's window ring keeps a position at entry ``pos % window``: a prompt chunk longer than the window must
    not write two positions to one entry in one scatter (CUDA keeps either write, so a row's K/V and its recorded
    position could come from different tokens - drafts go wrong, tokens stay right, acceptance drops). Each write
    lands on distinct entries, the ring then holds exactly the newest window positions, and their K/V equal those
    of a prefill in chunks no longer than the window; a committed block longer than the window keeps its newest
    window of accepted positions."""
    prompt = [(i * 37) % 500 + 5 for i in range(300)]
    rings = []
    for chunk in (2048, 64, 29):
        eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_context=1024, prefill_chunk=chunk,
                          spec="dflash2", draft_tokens=7)
        d = eng.drafter
        assert d.window == d.cap == 64
        writes = []
        real = d._entries

        def spy(pos, live, real=real):
            idx, kept = real(pos, live)
            for row, k in zip(idx, kept):
                writes.append(row[k].numel() == row[k].unique().numel())
            return idx, kept

        monkeypatch.setattr(d, "_entries", spy)
        seq = eng.acquire(prompt, SamplingParams(max_new_tokens=4))
        eng.start(seq)
        assert writes and all(writes)
        order = d.pos[seq.slot, :d.cap].argsort()
        assert d.pos[seq.slot, :d.cap][order].tolist() == list(range(len(prompt) - 64, len(prompt)))
        rings.append((d.kv[:, :, seq.slot, :d.cap][:, :, order].clone()))
        eng.release(seq)
    for ring in rings[1:]:
        torch.testing.assert_close(ring, rings[0], rtol=1e-3, atol=1e-4)
    # a committed block longer than the window (possible for a drafter whose window is shorter than its block): of
    # the accepted positions only the newest window's are kept, the rejected ones and the older go to the discard
    pos = torch.arange(500, 600)[None].repeat(2, 1)
    live = torch.arange(100)[None] <= torch.tensor([[79], [99]])
    idx, kept = d._entries(pos, live)
    assert kept.sum(1).tolist() == [64, 64] and (idx[~kept] == d.discard).all()
    assert pos[0][kept[0]].tolist() == list(range(516, 580)) and pos[1][kept[1]].tolist() == list(range(536, 600))
    assert all(row[k].unique().numel() == 64 for row, k in zip(idx, kept))


def test_packed_projections_run_the_drafters_stored_formats():
    """A drafter whose projections are stored packed (the synthetic drafters: the target's policy) runs them through
    the store's linears where the store keeps weights packed (v3 on CUDA; here a stand-in store), with the same
    results; a store that does not pack leaves the module as it is."""
    import copy

    from ninfer_bench.engine.artifact.loader import load_source
    from ninfer_bench.engine.model.dflash import BlockDrafter
    from ninfer_bench.engine.model.weights import DenseLinear
    from ninfer_bench.engine.spec.drafters import Projection, packed_projections
    from ninfer_bench.kernels import quant

    loaded = load_source("tiny", synthetic=True)
    cfg, raws = loaded.drafters["dflash2"]
    net = BlockDrafter.from_raws(cfg, raws, loaded.config.hidden_size, loaded.config.vocab_size)
    ref = copy.deepcopy(net)

    class Store:
        def __init__(self, packed):
            self.packed, self.made = packed, 0

        def linear_of(self, raw):
            self.made += 1
            return DenseLinear(raw.dense(torch.float32))

    assert packed_projections(net, raws, Store(False)) == 0
    store = Store(True)
    n = packed_projections(net, raws, store)
    packed = [name for name, r in raws.items() if r.fmt in quant.QUANT_FORMATS and len(r.shape) == 2
              and not name.endswith("embed_tokens.weight") and ".selector." not in name]
    assert n == store.made == len(packed) > 0
    assert sum(isinstance(m, Projection) for m in net.modules()) == n
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(1, 5, len(cfg.target_layer_ids) * loaded.config.hidden_size, generator=g)
    pos = torch.arange(5)[None]
    with torch.no_grad():
        for a, b in zip(net.context_kv(net.context(taps), pos), ref.context_kv(ref.context(taps), pos)):
            for x, y in zip(a, b):
                assert torch.equal(x, y)


@pytest.mark.parametrize("where", [0, 3])
def test_a_stop_id_inside_a_round_is_cut_on_the_device_as_on_the_host(plain, where):
    """Greedy rounds work out on the device how many tokens each row keeps (speculative_round's device_keep): a stop
    id among the accepted drafts (or as the bonus) ends the sequence there, and the rolled-back cache holds exactly
    the host's tokens, as a session export of it needs."""
    eng = engine(spec="mtp", draft_tokens=5)
    eng.drafter = RiggedDrafter(eng, plain[0], always(5), eng.config.vocab_size)
    stop = plain[0][1 + where + 1]  # the (where + 1)-th token of the first round
    seq = eng.acquire(PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True, stop_token_ids=(stop,)))
    eng.start(seq)
    while seq.finish_reason is None:
        eng.advance([seq])
    cut = plain[0].index(stop) + 1
    assert seq.finish_reason == "stop" and seq.tokens == plain[0][:cut]
    assert seq.length == len(PROMPTS[0]) + len(seq.tokens) - 1
    state = eng.export_state(seq)
    eng.release(seq)
    assert len(state["ids"]) == state["cache"]["length"]


def _chained(eng, prompt, **params):
    """A greedy generation through the chained rounds (spec/chain.py) - on a CPU its stages run eagerly, replayed as
    graphs are (results into the first run's tensors) - and the sequence."""
    from ninfer_bench.engine.spec.chain import decode_spec_chained

    reference = params.pop("reference", None)
    seq = eng.acquire(prompt, SamplingParams(**params))
    if reference is not None:
        seq.reference = eng.replay.reference(reference, eng.device)
    try:
        eng.start(seq)
        decode_spec_chained(eng, seq)
        return seq
    finally:
        eng.release(seq)


@pytest.mark.parametrize("spec,k", [("mtp", 3), ("dflash", 5), ("dflash2", 7)])
def test_chained_rounds_equal_the_unchained_loop(plain, spec, k):
    """Rounds with acceptance, the kept count, the rollback and the next round's input worked out on the device,
    read one round late: plain decoding's tokens, the unchained loop's acceptance per position, the cache as long
    as its tokens; the engine's one chain serves the next sequence."""
    ref = engine(spec=spec, draft_tokens=k).generate(PROMPTS[1], max_new_tokens=NEW, ignore_eos=True)
    eng = engine(spec=spec, draft_tokens=k)
    for prompt, want in ((PROMPTS[1], plain[1]), (PROMPTS[0], plain[0])):
        seq = _chained(eng, prompt, max_new_tokens=NEW, ignore_eos=True)
        assert seq.tokens == want and seq.finish_reason == "length"
        assert seq.length == len(prompt) + len(seq.tokens) - 1
        st = seq.stats
        assert 1 + st["rounds"] + st["accepted_tokens"] == NEW
        assert st["discarded_rounds"] == 0  # the host reads before queuing a round the limit may make useless
        assert st["verify_ms"] > 0 and st["draft_ms"] > 0
        if prompt is PROMPTS[1]:
            assert st["accepted_per_position"] == ref.spec["accepted_per_position"]
            assert st["rounds"] == ref.spec["rounds"]
    assert eng.spec_chain is not None


@pytest.mark.parametrize("new", [1, 2, 9, 40])
def test_chained_rounds_stop_on_the_device_where_the_host_does(plain, new):
    """A stop id inside an accepted block, and the length limit, end a chained sequence at the unchained loop's
    token; the rounds queued behind the end write the scratch slot, so the sequence's cache holds its tokens only."""
    eng = engine(spec="dflash2", draft_tokens=7)
    stop = plain[0][6]
    seq = _chained(eng, PROMPTS[0], max_new_tokens=new, ignore_eos=True, stop_token_ids=(stop,))
    cut = min(plain[0].index(stop) + 1, new)
    assert seq.tokens == plain[0][:cut]
    assert seq.finish_reason == ("stop" if cut < new or plain[0][cut - 1] == stop else "length")
    assert seq.length == len(PROMPTS[0]) + cut - 1
    again = _chained(eng, PROMPTS[0], max_new_tokens=NEW, ignore_eos=True)  # a stop does not stick to the chain
    assert again.tokens == plain[0]


@pytest.mark.parametrize("spec,k", [("mtp", 3), ("dflash2", 7)])
def test_chained_rounds_replay_acceptance_as_the_unchained_loop(plain, spec, k):
    """Replayed acceptance's draws are made beside the captured round, one call a round, as the unchained loop
    makes them: the same acceptance, plain decoding's tokens; no round queued past the length limit."""
    kw = {"spec": spec, "draft_tokens": k, "replay_acceptance": "0.7"}
    ref = engine(**kw).generate(PROMPTS[1], max_new_tokens=NEW, ignore_eos=True, reference=plain[1])
    seq = _chained(engine(**kw), PROMPTS[1], max_new_tokens=NEW, ignore_eos=True, reference=plain[1])
    assert seq.tokens == plain[1] == ref.tokens
    assert seq.stats["accepted_per_position"] == ref.spec["accepted_per_position"]
    assert seq.stats["accepted_tokens"] > NEW // 4
    # rounds keep several tokens here: none is queued that the length limit makes useless (the host reads first)
    assert seq.stats["discarded_rounds"] == 0


@pytest.mark.parametrize("b,k,c", [(1, 7, 16), (3, 4, 5), (2, 1, 3)])
def test_greedy_walk_equals_the_walk_one_position_at_a_time(b, k, c):
    """DFlash2's greedy walk, all pair scores at once (CandidateSelector.greedy_walk), picks what the left-to-right
    walk picks: each position's argmax of unary + pair score after the token chosen before it (the anchor first)."""
    from ninfer_bench.engine.model.dflash import CandidateSelector

    torch.manual_seed(b * 10 + k)
    sel = CandidateSelector(vocab=50, hidden=12, rank=4, candidates=c)
    for p in sel.parameters():
        p.data.normal_(0, 1.0)
    hidden, logits = torch.randn(b, k, 12), torch.randn(b, k, 50) * 3
    anchor = torch.randint(0, 50, (b,))
    with torch.no_grad():
        toks, cand, q = sel.walk(hidden, logits, anchor)
        unary, want_cand = ordered_topk(logits, c)
        prev, want = anchor, []
        for i in range(k):
            idx = (unary[:, i] + sel.pair_scores(hidden[:, i], prev, want_cand[:, i]).float()).argmax(-1)
            prev = want_cand[:, i].gather(1, idx[:, None])[:, 0]
            want.append(prev)
    assert q is None and torch.equal(cand, want_cand)
    assert toks.tolist() == torch.stack(want, 1).tolist()


@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 8), (torch.float32, 6), (torch.bfloat16, 3)])
def test_drafter_ring_gather_is_index_select(dtype, width):
    """The DFlash ring's gather (8-byte words where the row width allows, else per element) copies exactly what
    index_select does, NaN and signed-zero bit patterns included."""
    from ninfer_bench.engine.spec.drafters import _gather_rows

    x = torch.randn(2, 3, 5, 4, width).to(dtype)
    x[0, 1, 2, 0, 0], x[1, 2, 4, 3, -1] = float("nan"), -0.0
    idx = torch.tensor([4, 0, 2])
    got, want = _gather_rows(x, 2, idx), x.index_select(2, idx)
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]
    assert got.dtype == dtype and torch.equal(got.view(bits), want.view(bits))
