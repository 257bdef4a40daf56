"""A prompt's first chunk padded to a captured length (engine/model/graphs.py, ``Step.valid``): the padding must be
inert. On the CPU the padded forward is held to the unpadded one (hidden rows, the recurrent state, the K/V of the
real positions); on CUDA the captured prefill is held to the eager one, token for token."""

from __future__ import annotations

import pytest
import torch

import triton_interp  # noqa: F401  (TRITON_INTERPRET=1 without CUDA: the fused glue's CPU case)

from ninfer_bench.engine.model.graphs import prefill_buckets
from ninfer_bench.engine.model.hybrid import PREFILL, Step
from ninfer_bench.engine.runtime.engine import Engine
from ninfer_bench.kernels.conv import causal_conv1d, causal_conv1d_state_at


def test_buckets_cover_every_length_with_little_padding():
    sizes = prefill_buckets(2048)
    assert sizes[:4] == [16, 32, 64, 128] and sizes[-1] == 2048 and sizes == sorted(set(sizes))
    for t in range(1, 2049):
        b = next(x for x in sizes if x >= t)
        assert b - t < max(t, 128)  # under 128 tokens of padding (under t itself below 128)
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert prefill_buckets(8) == [8]


@pytest.mark.parametrize("n", [0, 1, 3, 7, 12])
def test_conv_state_at_is_the_state_after_the_real_tokens(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(2, 12, 5, generator=g).to(torch.bfloat16)
    w = torch.randn(5, 4, generator=g)
    state = torch.randn(2, 5, 3, generator=g).to(torch.bfloat16)
    counts = torch.tensor([n, max(n - 1, 0)])
    got = causal_conv1d_state_at(x, state, counts)
    for b in range(2):
        m = int(counts[b])
        _, want = causal_conv1d(x[b:b + 1, :m], w, state[b:b + 1])
        assert torch.equal(got[b:b + 1], want)


@pytest.mark.parametrize("t,w", [(0, 4), (1, 4), (2, 4), (5, 2), (9, 5)])
def test_conv_state_at_short_chunks_and_other_widths(t, w):
    """Chunks shorter than the window (the state partly the old state's), width 2 and 5, an fp32 state beside bf16
    inputs: every count 0 .. t against causal_conv1d's own new state, bit for bit."""
    g = torch.Generator().manual_seed(10 * t + w)
    x = torch.randn(3, t, 6, generator=g).to(torch.bfloat16)
    conv_w = torch.randn(6, w, generator=g)
    state = torch.randn(3, 6, w - 1, generator=g)
    for n in range(t + 1):
        counts = torch.tensor([n, t - n, min(n, 1)])
        got = causal_conv1d_state_at(x, state, counts)
        assert got.dtype == state.dtype and got.is_contiguous()
        for b in range(3):
            m = int(counts[b])
            _, want = causal_conv1d(x[b:b + 1, :m], conv_w, state[b:b + 1])
            assert torch.equal(got[b:b + 1], want.to(state.dtype)), (n, b)


@pytest.mark.parametrize("start,t,pad,kernels", [(0, 5, 11, "auto"), (0, 37, 27, "auto"), (0, 70, 58, "auto"),
                                                 (40, 24, 40, "auto"), (100, 9, 7, "auto"), (0, 2, 14, "triton"),
                                                 (40, 24, 40, "triton")])
def test_padded_prefill_equals_the_unpadded_one(start, t, pad, kernels):
    """The real rows' hidden states, the conv / GDN states and the real positions' K/V do not see the padding: a
    first chunk, and a later one (after ``start`` tokens prefilled unpadded) reading a key bucket past its end as its
    graph does; eagerly and through the fused prefill glue (``triton``: kernels/gdn_prefill under the interpreter,
    its conv state written after a padded chunk's real tokens, its gates zero past them)."""
    if kernels == "triton" and not triton_interp.INTERPRET:
        pytest.skip("the fused glue on CPU tensors needs the interpreter (on a GPU the captured prefills test it)")
    kv = "fp32" if kernels == "auto" else "bf16"  # the fused attention reads 16-bit or int8 K/V
    eng = Engine.load("tiny", device="cpu", dtype="fp32", kv_dtype=kv, max_context=512, kernels=kernels)
    assert eng.model.fused_prefill == (kernels == "triton")
    m, cache = eng.model, eng.cache
    ids = torch.randint(3, eng.config.vocab_size, (1, start + t), generator=torch.Generator().manual_seed(t))

    def run(slot, n_pad):
        cache.reset(slot)
        if start:  # the chunk before, as the eager prefill runs it
            m.forward(Step(ids[:, :start], torch.arange(start)[None], torch.tensor([slot]), kv_len=start,
                           mode=PREFILL), cache)
        x = torch.cat([ids[:, start:], torch.zeros(1, n_pad, dtype=torch.long)], dim=1)
        keys = start + t if not n_pad else (start + t + n_pad if not start else 256)
        step = Step(x, torch.arange(start, start + t + n_pad)[None], torch.tensor([slot]), kv_len=keys,
                    mode=PREFILL, valid=torch.tensor([t]) if n_pad else None)
        hidden, _ = m.forward(step, cache)
        return hidden[:, :t]

    want, got = run(0, 0), run(1, pad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for i in cache.conv:
        # the conv state holds projection outputs: fp32 GEMMs of 70 and 128 rows differ by an ulp or so
        torch.testing.assert_close(cache.conv[i][1], cache.conv[i][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.ssm[i][1], cache.ssm[i][0], rtol=1e-5, atol=1e-6)
    tol = 1e-5 if kv == "fp32" else 1e-2  # bf16 K/V: an ulp of the product can move a rounding
    for layer in cache.kv.values():
        torch.testing.assert_close(layer.k[1, :, :start + t], layer.k[0, :, :start + t], rtol=tol, atol=tol)
        torch.testing.assert_close(layer.v[1, :, :start + t], layer.v[0, :, :start + t], rtol=tol, atol=tol)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("spec,k", [("none", 0), ("mtp", 3), ("dflash2", 7)])
def test_captured_prefill_decodes_like_the_eager_one(dtype, spec, k):
    """Prompts of several lengths (a bucket's exact size, padded ones, longer than the chunk: their later chunks
    captured too, reading key buckets past their ends) give the eager prefill's tokens; the graphs are reused."""
    kw = dict(device="cuda", dtype=dtype, kv_dtype="int8", max_context=1024, prefill_chunk=256,
              spec=spec, draft_tokens=k or None)
    on, off = Engine.load("tiny", **kw), Engine.load("tiny", prefill_graphs=False, **kw)
    for t in (5, 16, 137, 256, 300, 700):
        prompt = [3 + (i * 7919) % 500 for i in range(t)]
        a = off.generate(prompt, max_new_tokens=24, ignore_eos=True).tokens
        b = on.generate(prompt, max_new_tokens=24, ignore_eos=True).tokens
        assert a == b, f"{t}-token prompt"
    captured = {key[1:3] for key in on.graphs.graphs if key[0] == PREFILL}
    # first chunks: 5 and 16 share 16; 137, 256 and the longer prompts' first chunks share 256. Later chunks (at most
    # LATER_MAX_T long): 300's 44 tokens at 256 (bucket 64, keys to 512), 700's 256 at 256 (keys to 512) and 188 at
    # 512 (bucket 256, keys to 1024)
    assert captured == {(16, 16), (256, 256), (64, 512), (256, 512), (256, 1024)}
    assert on.graphs.prefill_off is None
    assert not any(key[0] == PREFILL for key in off.graphs.graphs)


@cuda
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_final_chunks_graph_picks_from_the_eager_logits(dtype):
    """A prompt's final chunk replays a graph that ends in its last row's logits and argmax (its first token, one
    replay and one read-back): the bits of the eager lm_head on the graph's own last row, and its argmax. Through the
    engine: the eager prefill's greedy token, kept log-softmax row (to rounding: an fp32 prefill of 137 rows and one
    padded to 256 may take different cuBLAS kernels) and seeded sampled tokens; a long prompt's earlier chunks replay
    graphs without the head."""
    kw = dict(device="cuda", dtype=dtype, kv_dtype="int8", max_context=1024, prefill_chunk=256)
    on, off = Engine.load("tiny", **kw), Engine.load("tiny", prefill_graphs=False, **kw)
    with torch.inference_mode():
        for t in (5, 16, 137, 256):
            prompt = [3 + (i * 104729) % 500 for i in range(t)]
            on.cache.reset(on.scratch_slot)
            hidden, _, (logits, token) = on.graphs.prefill(prompt, on.scratch_slot, head=True)
            want = on.model.logits(hidden[0, -1:])
            assert torch.equal(logits, want) and token.item() == want.argmax(-1).item(), f"{t}-token prompt"
    for t in (5, 137, 256, 300, 700):
        prompt = [3 + (i * 104729) % 500 for i in range(t)]
        a = off.generate(prompt, max_new_tokens=1, ignore_eos=True, logprobs=True)
        b = on.generate(prompt, max_new_tokens=1, ignore_eos=True, logprobs=True)
        assert a.tokens == b.tokens, f"{t}-token prompt"
        torch.testing.assert_close(a.logprobs[0], b.logprobs[0], rtol=0, atol=1e-2 if dtype == "bf16" else 1e-4)
        sampled = dict(max_new_tokens=4, ignore_eos=True, temperature=0.9, top_k=50, seed=t)
        assert off.generate(prompt, **sampled).tokens == on.generate(prompt, **sampled).tokens, f"{t}: sampled"
    heads = {key[1:3]: key[4] for key in on.graphs.graphs if key[0] == PREFILL}
    assert heads[(16, 16)] and heads[(64, 512)] and heads[(256, 1024)]  # finals: 5; 300's 44 later; 700's 188 later
    assert any(key[0] == PREFILL and not key[4] and key[1:3] == (256, 512) for key in on.graphs.graphs)  # 700's 2nd


@cuda
def test_prefill_graph_after_a_prompt_with_scores_and_a_cached_prefix():
    """Scored prompts and prompts past position 0 stay eager; the next plain prompt still replays its graph."""
    eng = Engine.load("tiny", device="cuda", dtype="fp32", max_context=512)
    prompt = list(range(3, 90))
    first = eng.generate(prompt, max_new_tokens=8, ignore_eos=True).tokens
    eng.score(prompt, top=2)
    assert eng.generate(prompt, max_new_tokens=8, ignore_eos=True).tokens == first


def test_prefill_weights_choose_whether_dense_copies_are_kept():
    from ninfer_bench.engine.runtime.options import EngineOptions

    eng = Engine.load("tiny", device="cpu")
    raws = eng.weights.raws
    from ninfer_bench.engine.model.weights import WeightStore

    assert WeightStore(raws, prefill_weights="auto").cache_dense  # a small model: copies kept
    assert WeightStore(raws, prefill_weights="dense").cache_dense
    assert not WeightStore(raws, prefill_weights="packed").cache_dense
    with pytest.raises(ValueError, match="prefill weights must be"):
        EngineOptions(prefill_weights="bf16")
    with pytest.raises(ValueError, match="dense copy already"):
        EngineOptions(device="cpu", prefill_weights="dense")


def test_auto_keeps_dense_copies_by_the_free_memory():
    from ninfer_bench.engine.model.weights import DENSE_CACHE_LIMIT, keep_dense_copies

    gib = 1 << 30
    assert keep_dense_copies(DENSE_CACHE_LIMIT, 5 * DENSE_CACHE_LIMIT, None)  # small: kept wherever it runs
    assert keep_dense_copies(15 * gib, 65 * gib, 130 * gib)  # the 27B shape on a 141 GB GPU
    assert not keep_dense_copies(15 * gib, 65 * gib, 78 * gib)  # ... on an 80 GB one
    assert not keep_dense_copies(15 * gib, 50 * gib, 60 * gib)  # ... or beside a K/V cache that left 60 GB free
    assert not keep_dense_copies(15 * gib, 65 * gib, None)  # free memory unknown: no copies past the limit


@cuda
@pytest.mark.parametrize("choice", ["dense", "packed"])
def test_prefill_weights_decode_the_same_tokens(choice):
    """Dense copies kept or the packed weights dequantized every chunk: the same dequantized values, the same tokens;
    only "dense" keeps a copy after the prefill."""
    kw = dict(device="cuda", dtype="bf16", max_context=1024, quant="q4")
    prompt = [3 + (i * 131) % 400 for i in range(300)]
    want = Engine.load("tiny", **kw).generate(prompt, max_new_tokens=16, ignore_eos=True).tokens
    eng = Engine.load("tiny", prefill_weights=choice, **kw)
    assert eng.generate(prompt, max_new_tokens=16, ignore_eos=True).tokens == want
    kept = [lin for lin in eng.weights.linears.values() if getattr(lin, "_dense", None)]
    assert bool(kept) == (choice == "dense")
