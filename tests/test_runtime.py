"""The bound Engine on CPU: runtimes, chunk sizes, KV formats, capacities, sampling, the decode document."""

from __future__ import annotations

import pytest
import torch

from ninfer_bench.engine.runtime.engine import CapacityError, Engine
from ninfer_bench.reports.schema import REQUIRED_SUMMARY, validate
from ninfer_bench.suites.decode import DecodeOptions, run_decode

PROMPT = list(range(5, 150))
INT8_KV_RTOL = 2e-2  # relative RMS of logits, int8 K/V (one fp16 scale per 64 values) vs bf16 K/V


def engine(**kw):
    kw = {"device": "cpu", "max_context": 512, **kw}
    return Engine.load("tiny", **kw)


def test_the_documented_import_path():
    """docs/DESIGN.md's API: ``from ninfer_bench.engine import Engine``."""
    import ninfer_bench.engine as engine_pkg

    assert engine_pkg.Engine is Engine
    with pytest.raises(AttributeError):
        engine_pkg.NoSuchThing  # noqa: B018


def test_logprobs_are_the_rows_the_tokens_were_picked_from():
    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_context=512)
    ids = list(range(3, 40))
    res = eng.generate(ids, max_new_tokens=6, ignore_eos=True, logprobs=True)
    assert len(res.logprobs) == len(res.tokens) == 6
    assert [int(r.argmax()) for r in res.logprobs] == res.tokens  # greedy: each token is its row's argmax
    full = eng.logits(ids + res.tokens[:-1])[len(ids) - 1:].float().log_softmax(-1)
    assert torch.allclose(torch.stack(res.logprobs), full, atol=1e-4)
    assert eng.generate(ids, max_new_tokens=2, ignore_eos=True).logprobs is None
    with pytest.raises(ValueError, match="plain decoding only"):
        Engine.load("tiny", device="cpu", spec="mtp").generate(ids, max_new_tokens=2, logprobs=True)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_top_logprobs_are_the_rows_compacted_in_the_batched_pick(temperature):
    """top_logprobs N keeps each token's log-probability and its N most likely, computed in the step's batched pick:
    the same numbers as the whole rows' (logprobs=True), the same tokens, and rows of a batch that did not ask keep
    nothing; greedy or sampled."""
    from ninfer_bench.engine.sampling import SamplingParams

    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_context=512, max_concurrency=3)
    ids = list(range(3, 40))
    kw = dict(max_new_tokens=5, ignore_eos=True, temperature=temperature, seed=7)
    rows = eng.generate(ids, logprobs=True, **kw)
    top = eng.generate(ids, top_logprobs=4, **kw)
    assert top.tokens == rows.tokens and len(top.logprobs) == len(top.tokens) == 5
    for (lp, pairs), row, tok in zip(top.logprobs, rows.logprobs, top.tokens):
        assert lp == pytest.approx(float(row[tok]), abs=1e-5)
        best = row.topk(4)
        assert [i for i, _ in pairs] == best.indices.tolist()
        assert [v for _, v in pairs] == pytest.approx(best.values.tolist(), abs=1e-5)
    # a batch of three rows: N 2, none, N 0 (the token's own only)
    seqs = [eng.acquire(ids, SamplingParams(top_logprobs=2, **kw)), eng.acquire(ids, SamplingParams(**kw)),
            eng.acquire(ids, SamplingParams(top_logprobs=0, **kw))]
    for s in seqs:
        eng.start(s)
    while any(s.finish_reason is None for s in seqs):
        eng.advance(seqs)
    assert [s.tokens for s in seqs] == [top.tokens] * 3  # batched: each row its own stream
    assert len(seqs[0].logprobs) == 5 and seqs[1].logprobs == [] and len(seqs[2].logprobs) == 5
    assert all(len(p) == 2 for _, p in seqs[0].logprobs) and all(p == [] for _, p in seqs[2].logprobs)
    assert [lp for lp, _ in seqs[2].logprobs] == pytest.approx([lp for lp, _ in top.logprobs], abs=1e-5)
    for s in seqs:
        eng.release(s)
    with pytest.raises(ValueError, match="one of them"):
        SamplingParams(logprobs=True, top_logprobs=2)
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=-1)


def test_greedy_identical_across_runtimes_and_chunk_sizes():
    ref = engine(runtime="v3", prefill_chunk=512, kv_dtype="bf16").generate(PROMPT, max_new_tokens=48).tokens
    for kw in (dict(runtime="v2"), dict(prefill_chunk=16), dict(prefill_chunk=33, runtime="v2")):
        assert engine(kv_dtype="bf16", **kw).generate(PROMPT, max_new_tokens=48).tokens == ref, kw


def test_int8_kv_logits_close_to_bf16_kv():
    ids = PROMPT * 2
    a = engine(kv_dtype="bf16").logits(ids)
    b = engine(kv_dtype="int8").logits(ids)
    assert float((a - b).norm() / a.norm()) <= INT8_KV_RTOL
    assert float((a - b).norm() / a.norm()) > 0  # int8 really changes something


def test_capacity_refusals_before_any_work():
    eng = engine(max_context=200, max_concurrency=2, kv_capacity=300)
    with pytest.raises(CapacityError, match="max-context"):
        eng.generate(PROMPT, max_new_tokens=100)  # 145 + 100 > 200
    with pytest.raises(CapacityError, match="slots holds 150"):
        eng.generate(PROMPT, max_new_tokens=10)  # 155 > 300 / 2
    with pytest.raises(CapacityError, match="empty prompt"):
        eng.generate([], max_new_tokens=10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate([1, 2, 100_000], max_new_tokens=4)
    assert eng.free_slots == [0, 1]
    a, b = (eng.acquire([1, 2, 3], eng_params()) for _ in range(2))
    with pytest.raises(CapacityError, match="no free capacity"):
        eng.acquire([1, 2, 3], eng_params())
    eng.release(a)
    eng.release(b)


def eng_params():
    from ninfer_bench.engine.sampling import SamplingParams

    return SamplingParams(max_new_tokens=4)


def test_bad_options_fail_with_a_message():
    with pytest.raises(ValueError, match="kv dtype"):
        engine(kv_dtype="int4")
    with pytest.raises(ValueError, match="draft-tokens"):
        engine(spec="mtp", draft_tokens=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine(max_context=10**7)
    with pytest.raises(ValueError, match="qmv layout"):
        engine(qmv_layout="columns")


def test_sampling_is_seeded_stops_and_respects_top_k():
    eng = engine()
    a = eng.generate(PROMPT, max_new_tokens=30, temperature=1.0, top_k=5, seed=3).tokens
    assert a == eng.generate(PROMPT, max_new_tokens=30, temperature=1.0, top_k=5, seed=3).tokens
    assert a != eng.generate(PROMPT, max_new_tokens=30, temperature=1.0, top_k=5, seed=4).tokens
    greedy = eng.generate(PROMPT, max_new_tokens=30)
    stop_text = eng.tokenizer.decode(greedy.tokens[5:7])
    res = eng.generate(PROMPT, max_new_tokens=30, stop=[stop_text])
    assert res.finish_reason == "stop" and stop_text not in res.text and len(res.tokens) <= 7
    eos = eng.tokenizer.eos_ids[0]
    res = eng.generate(PROMPT, max_new_tokens=30, stop_token_ids=(greedy.tokens[3],))
    assert res.tokens == greedy.tokens[:4] and res.finish_reason == "stop"
    assert eos in eng.tokenizer.eos_ids
    # a stop string that never comes, the request ended by a stop id: the text is that of the tokens, not empty
    res = eng.generate(PROMPT, max_new_tokens=30, stop=["never in this text"], stop_token_ids=(greedy.tokens[3],))
    assert res.tokens == greedy.tokens[:4] and res.text == eng.tokenizer.decode(greedy.tokens[:4]) != ""
    assert eng.generate(PROMPT, max_new_tokens=30, stop=None).tokens == greedy.tokens  # None: no stop strings


def test_unseeded_sampling_leaves_the_global_generator_alone():
    """A request without a seed draws from a generator seeded on its own: the caller's seeded global torch
    generator goes on as if the engine had not sampled, and two unseeded requests differ."""
    eng = engine()
    torch.manual_seed(0)
    want = torch.rand(4)
    torch.manual_seed(0)
    a = eng.generate(PROMPT, max_new_tokens=20, temperature=1.0, ignore_eos=True).tokens
    assert torch.equal(torch.rand(4), want)
    assert a != eng.generate(PROMPT, max_new_tokens=20, temperature=1.0, ignore_eos=True).tokens


def test_stop_string_across_tokens_that_decode_to_nothing():
    """A stop string is found however many tokens between its characters decode to nothing (the byte tokenizer's
    unnamed ids past its specials, a padded vocabulary's ids), and the text is cut before it."""
    from ninfer_bench.engine.runtime.sequence import Sequence
    from ninfer_bench.engine.sampling import SamplingParams

    eng = engine()
    blank = eng.config.vocab_size - 1
    assert eng.tokenizer.decode([blank]) == ""
    seq = Sequence(slot=0, prompt=[1], params=SamplingParams(max_new_tokens=64, stop=("ab",)))
    for tok in [ord("x"), ord("a")] + [blank] * 20 + [ord("b"), ord("c")]:
        seq.tokens.append(tok)
        if eng.stops.finish(seq):
            break
    assert (seq.finish_reason, len(seq.tokens), seq.text) == ("stop", 23, "x")


def test_control_tokens_are_no_text_for_the_output_or_stop_strings():
    """End and special tokens (chat markers) are left out of the output text and of the text stop strings are
    matched in, as the server's stream leaves them out (vLLM's default): a stop string split by a chat marker still
    stops the engine, and a special token's name is no stop string."""
    from ninfer_bench.engine.runtime.sequence import Sequence
    from ninfer_bench.engine.sampling import SamplingParams

    eng = engine()
    marker = min(t for t in eng.tokenizer.special_ids if t not in eng.tokenizer.eos_ids)
    name, eos = eng.tokenizer.decode([marker]), eng.tokenizer.eos_ids[0]
    assert name and eng.stops.text([ord("x"), marker, ord("y"), eos]) == "xy"
    for stop, tokens, want in [("ab", [ord("x"), ord("a"), marker, ord("b"), ord("c")], ("stop", 4, "x")),
                               (name, [ord("x"), marker, ord("y")], (None, 3, None))]:
        seq = Sequence(slot=0, prompt=[1], params=SamplingParams(max_new_tokens=64, stop=(stop,)))
        for tok in tokens:
            seq.tokens.append(tok)
            if eng.stops.finish(seq):
                break
        assert (seq.finish_reason, len(seq.tokens), seq.text) == want, stop


def test_top_p_keeps_the_nucleus_only():
    from ninfer_bench.engine.sampling import SamplingParams, probs

    logits = torch.tensor([4.0, 3.0, 0.0, -1.0, -2.0])
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert p[2:].sum() == 0 and abs(float(p.sum()) - 1) < 1e-6


def test_decode_document_has_every_required_key(tmp_path):
    doc = run_decode(DecodeOptions.make(model="tiny", device="cpu", max_new_tokens=16, repeats=2, warmup=0,
                                        spec="dflash2", draft_tokens=3))
    validate(doc)
    s = doc["summary"]
    for key in REQUIRED_SUMMARY["decode"] + ("weight_bytes_per_step", "copy_bandwidth_gbps", "roofline_fraction",
                                             "draft_ms_per_round", "verify_ms_per_round"):
        assert key in s, key
    assert len(doc["records"]) == 2 and s["deterministic"]
    assert s["drafted_tokens"] == 3 * s["rounds"]


def test_hf_peer_same_tokens_and_real_timings():
    """The transformers peer decodes the same greedy tokens as ours on the same weights, and its times come from
    one generate call (TTFT and decode both positive even without warm-up)."""
    from ninfer_bench.suites.hf_peer import cpu_blocked

    kw = dict(model="tiny", device="cpu", dtype="fp32", kv_dtype="fp32", max_new_tokens=12, repeats=1, warmup=0)
    if cpu_blocked():  # (the H200 machine: transformers 5.17 with fla-core) refused before any work, saying why
        with pytest.raises(ValueError, match="--engine hf on the CPU: transformers .* fla's Triton kernels"):
            run_decode(DecodeOptions.make(engine="hf", **kw))
        return
    ours = run_decode(DecodeOptions.make(**kw))
    peer = run_decode(DecodeOptions.make(engine="hf", **kw))
    assert peer["summary"]["tokens_sha256"] == ours["summary"]["tokens_sha256"]
    assert peer["model"]["gdn_kernels"] in ("fla", "torch fallback")
    assert peer["model"]["generate"] == "inference_mode, torch default dtype float32"
    rec = peer["records"][0]
    assert rec["ttft_ms"] > 0 and rec["decode_s"] > 0
    assert 0 < rec["decode_tok_s"] < 1e6


def test_hf_peer_on_the_cpu_is_refused_where_transformers_would_send_cpu_tensors_to_fla(monkeypatch):
    """transformers before 5.24 with fla-core importable fails on CPU tensors in fla's Triton kernels: the peer says
    so before any weight loads; 5.24, or no fla, runs."""
    import importlib.util

    import transformers

    from ninfer_bench.suites.hf_peer import cpu_blocked

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "fla" else real(name, *a))
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    assert "transformers 5.17.0 with fla-core installed" in cpu_blocked()
    with pytest.raises(ValueError, match="--engine hf on the CPU: transformers 5.17.0"):
        run_decode(DecodeOptions.make(model="tiny", device="cpu", engine="hf", max_new_tokens=4, repeats=1, warmup=0))
    monkeypatch.setattr(transformers, "__version__", "5.24.0")
    assert cpu_blocked() is None


def test_fp32_kv_takes_the_eager_attention():
    """The fused attention reads bf16 / fp16 / int8 K/V: fp32 K/V decodes eagerly, and asking for the kernels says
    so."""
    from ninfer_bench.engine.runtime.options import EngineOptions

    assert not EngineOptions(device="cpu", kv_dtype="fp32").fused_kernels()
    with pytest.raises(ValueError, match="kv-dtype"):
        EngineOptions(device="cpu", kv_dtype="fp32", kernels="triton").fused_kernels()


def test_fused_projections_give_the_members_outputs():
    """The CUDA path's fused weights (q|k|v, k|v, gate|up, qkv|z, b|a rows stacked) on the CPU: each layer's
    projections through the fused store equal the member projections one by one."""
    from ninfer_bench.engine.model.hybrid import HybridModel
    from ninfer_bench.engine.model.weights import WeightStore

    eng = engine()
    raws, cfg = eng.weights.raws, eng.config
    fused = WeightStore(raws, fuse=True)
    plain = WeightStore(raws, fuse=False)
    assert any(n.endswith("self_attn.qkv_proj.weight") for n in fused.linears)
    assert not any(n.endswith("self_attn.kv_proj.weight") for n in fused.linears)  # k, v joined q instead
    mf = HybridModel(cfg, fused, max_positions=64)
    mp = HybridModel(cfg, plain, max_positions=64)
    x = torch.randn(2, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}"
        if kind == "full_attention":
            for a, b in zip(mf.attn_proj(p, x), mp.attn_proj(p, x)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        gu = mf._proj(p, "mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), [cfg.intermediate_size] * 2, x)
        for a, name in zip(gu, ("mlp.gate_proj", "mlp.up_proj")):
            torch.testing.assert_close(a, plain.linear(f"{p}.{name}.weight")(x), rtol=1e-5, atol=1e-5)


def test_interleaved_gate_up_gives_the_members_outputs():
    """WeightStore(interleave=True): the fused gate_up rows alternate 8 gate, 8 up; HybridModel.gate_up takes them
    apart again into the member projections' outputs, and the MLP is unchanged."""
    from ninfer_bench.engine.model.hybrid import HybridModel
    from ninfer_bench.engine.model.weights import GATE_UP_RUN, WeightStore

    eng = engine()
    raws, cfg = eng.weights.raws, eng.config
    store = WeightStore(raws, fuse=True, interleave=True)
    plain = WeightStore(raws, fuse=False)
    p = "model.layers.0"
    name = f"{p}.mlp.gate_up_proj.weight"
    assert name in store.interleaved and cfg.intermediate_size % GATE_UP_RUN == 0
    w = store.linear(name).weight.view(-1, 2, GATE_UP_RUN, cfg.hidden_size)
    torch.testing.assert_close(w[:, 0].reshape(-1, cfg.hidden_size), plain.linear(f"{p}.mlp.gate_proj.weight").weight,
                               rtol=0, atol=0)
    torch.testing.assert_close(w[:, 1].reshape(-1, cfg.hidden_size), plain.linear(f"{p}.mlp.up_proj.weight").weight,
                               rtol=0, atol=0)
    mi, mp = HybridModel(cfg, store, max_positions=64), HybridModel(cfg, plain, max_positions=64)
    x = torch.randn(2, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    for a, b in zip(mi.gate_up(p, x), mp.gate_up(p, x)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mi.mlp(p, x), mp.mlp(p, x), rtol=1e-5, atol=1e-5)


def test_store_options_keep_what_they_cannot_serve():
    """interleave on an intermediate size that is no multiple of the run leaves gate_up as the plain fusion (the
    MLP unchanged)."""
    from ninfer_bench.engine.model.config import PRESETS, ModelConfig
    from ninfer_bench.engine.model.hybrid import HybridModel
    from ninfer_bench.engine.artifact.synthetic import synthetic_raws
    from ninfer_bench.engine.model.weights import WeightStore

    cfg = ModelConfig(**{**PRESETS["tiny"], "intermediate_size": 100})
    raws = synthetic_raws(cfg, seed=3)
    store = WeightStore(raws, fuse=True, interleave=True)
    plain = WeightStore(raws, fuse=False)
    assert not store.interleaved and store.has("model.layers.0.mlp.gate_up_proj.weight")
    x = torch.randn(1, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    ms, mp = HybridModel(cfg, store, max_positions=64), HybridModel(cfg, plain, max_positions=64)
    torch.testing.assert_close(ms.mlp("model.layers.0", x), mp.mlp("model.layers.0", x), rtol=1e-5, atol=1e-5)


def test_stop_hold_back_is_the_longest_possible_stop_start():
    """The streamed text holds back exactly the longest end that could begin a stop string (the brute force over
    every prefix of every stop, which the server ran before, is the reference)."""
    import random

    from ninfer_bench.engine.serve.engine_thread import _held
    from ninfer_bench.engine.sampling import SamplingParams

    rng = random.Random(0)
    checked = 0
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        tail = "".join(rng.choice("abc") for _ in range(rng.randint(0, 10)))
        if any(s in tail for s in stops):
            continue  # (a whole stop in the text ends it before any hold-back)
        want = max((k for s in stops for k in range(1, len(s)) if tail.endswith(s[:k])), default=0)
        assert _held(tail, stops) == want, (tail, stops)
        checked += 1
    assert checked > 1000
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(temperature=1.0, seed=2**64)


def test_served_text_leaves_out_control_tokens():
    """The server's text stream hides special tokens (chat markers, the mask) as OpenAI-style servers do."""
    from ninfer_bench.engine.serve.engine_thread import TextStream
    from ninfer_bench.engine.artifact.tokenizer import ByteTokenizer

    tok = ByteTokenizer(300)
    start, mask = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|mask|>")
    assert {start, mask} <= tok.special_ids
    stream = TextStream(tok, hide=tok.special_ids)
    assert stream.push([ord("a"), start, ord("b"), mask]) + stream.finish() == "ab"
    assert TextStream(tok).push([ord("a"), start]) == "a<|im_start|>"  # (decode alone keeps them)


def test_weights_that_cannot_fit_are_refused_before_they_are_made(monkeypatch):
    """A synthetic preset whose packed weights exceed the device's available memory is refused before any weight is
    drawn; a model whose dense copies (every CPU run) would not fit is refused before they are made - one line each,
    not an allocator error minutes in."""
    from ninfer_bench.engine.artifact import loader
    from ninfer_bench.engine.model import memory
    from ninfer_bench.engine.runtime.options import EngineOptions

    monkeypatch.setattr(memory, "available_bytes", lambda device: 8 << 30)
    monkeypatch.setattr(loader, "synthetic_raws", lambda *a, **k: pytest.fail("weights drawn before the check"))
    with pytest.raises(ValueError, match=r"qwen3.8-27b preset's mixed weights and their dense CPU copies need "
                                         r"\d+\.\d GiB, this machine has 8.0 GiB available"):
        loader.load_source("qwen3.8-27b", synthetic=True)
    monkeypatch.undo()
    loaded = loader.load_source("tiny")
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 20)
    with pytest.raises(ValueError, match="dense float32 copies of the weights need .* GiB, this machine has 0.0 GiB"):
        Engine(loaded, EngineOptions(device="cpu"))
    monkeypatch.setattr(memory, "available_bytes", lambda device: None)  # unknown: no check
    Engine(loaded, EngineOptions(device="cpu"))


def test_every_spec_mode_gets_one_cache_capacity():
    """Decode attention's split plan on the GPU is a function of the cache's capacity (kernels/attn_cuda.plan), and
    another plan rounds differently: engines of one max_context get one capacity whatever their spec and -k, so a
    speculative engine's greedy tokens are a plain one's (on an H200 a capacity of length + K + 1 gave MTP3 and
    DFlash2 K=7 other tokens than plain on the held-out prompts)."""
    from ninfer_bench.engine.artifact.loader import load_source
    from ninfer_bench.engine.runtime.options import MAX_DRAFT_TOKENS, EngineOptions

    loaded = load_source("tiny")
    modes = [("none", None), ("mtp", 1), ("mtp", MAX_DRAFT_TOKENS), ("dflash2", 7), ("dflash2", 15)]
    caps = {Engine(loaded, EngineOptions(device="cpu", spec=spec, draft_tokens=k, max_context=300)).capacity
            for spec, k in modes}
    assert len(caps) == 1 and caps.pop() >= 300 + MAX_DRAFT_TOKENS + 1


def test_attention_value_bound_is_the_weights_bound_and_no_input_passes_it():
    """attention_value_bound (the cuDNN split's fp16 range, vouched for without a host read): through the fused store
    (q | k | v rows stacked) it is the bound worked from the dense weights: sqrt(hd) max|1 + w| for the normed,
    rotated queries / keys (reached by a one-hot head), sqrt(H) max|1 + w_in| max_j ||W_v[j]|| + |bias| for the
    values; no hidden state gets a value past it, random or aimed at a value row's weights. A layer whose values
    could pass fp16's range is not vouched for (attention_fp16_safe)."""
    from ninfer_bench.engine.model.hybrid import FP16_MAX, HybridModel, attention_value_bound
    from ninfer_bench.engine.model.weights import RawWeight, WeightStore
    from ninfer_bench.kernels.norm import rms_norm

    eng = engine(dtype="fp32")
    raws, cfg = eng.weights.raws, eng.config
    hd, hkv, hsz = cfg.head_dim, cfg.num_key_value_heads, cfg.hidden_size
    model = HybridModel(cfg, WeightStore(raws, fuse=True), max_positions=64)
    assert any(n.endswith("self_attn.qkv_proj.weight") for n in model.w.linears)
    gen = torch.Generator().manual_seed(0)
    for i in cfg.full_layers:
        p = f"model.layers.{i}"
        vec = {n: raws[f"{p}.{n}.weight"].dense() for n in ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm")}
        wv = raws[f"{p}.self_attn.v_proj.weight"].dense()
        bias = raws[f"{p}.self_attn.v_proj.bias"].dense() if f"{p}.self_attn.v_proj.bias" in raws else torch.zeros(1)
        bq, bk = (hd ** 0.5 * float((1 + vec[n]).abs().max()) for n in ("self_attn.q_norm", "self_attn.k_norm"))
        bv = hsz ** 0.5 * float((1 + vec["input_layernorm"]).abs().max()) * float(wv.norm(dim=1).max()) \
            + float(bias.abs().max())
        got = attention_value_bound(model, p)
        assert got == pytest.approx(max(bq, bk, bv), rel=1e-4), (p, got, bq, bk, bv)
        # a one-hot head reaches the query / key bound at the weight's largest |1 + w|
        for n, b in (("self_attn.q_norm", bq), ("self_attn.k_norm", bk)):
            onehot = torch.zeros(hd)
            onehot[int((1 + vec[n]).abs().argmax())] = 3.0
            assert float(rms_norm(onehot, vec[n], cfg.rms_norm_eps).abs().max()) == pytest.approx(b, rel=1e-4)
        # hidden states: random ones, and one per value row aimed at its weights through the input norm
        w_in = 1 + vec["input_layernorm"]
        aimed = wv / torch.where(w_in.abs() > 1e-3, w_in, torch.ones_like(w_in))
        h = torch.cat([torch.randn(64, hsz, generator=gen) * 50, aimed])[None]
        v = model.attn_proj(p, rms_norm(h, vec["input_layernorm"], cfg.rms_norm_eps))[1][..., hkv * hd:]
        assert float(v.abs().max()) <= bv * (1 + 1e-5)
    assert all(model.attention_fp16_safe(f"model.layers.{i}") for i in cfg.full_layers)
    # one layer's value weight scaled until its bound passes fp16's range: that layer alone is not vouched for
    i = cfg.full_layers[0]
    name = f"model.layers.{i}.self_attn.v_proj.weight"
    wv = raws[name].dense()
    scaled = wv * (2 * FP16_MAX / float(wv.norm(dim=1).max()))  # a row of norm 2 x FP16_MAX
    big = HybridModel(cfg, WeightStore({**raws, name: RawWeight("fp32", tuple(wv.shape), scaled.view(torch.uint8))},
                                       fuse=True), max_positions=64)
    assert not big.attention_fp16_safe(f"model.layers.{i}")
    assert all(big.attention_fp16_safe(f"model.layers.{j}") for j in cfg.full_layers[1:])


def test_prefill_chunk_defaults_by_device_and_the_help_says_so():
    """--prefill-chunk left out takes the device's measured default (8,192 tokens on CUDA, 2,048 on a CPU); a given
    value is kept; the CLI's help names the same two numbers."""
    from click.testing import CliRunner

    from ninfer_bench.cli import main
    from ninfer_bench.engine.runtime.options import PREFILL_CHUNK, EngineOptions

    assert EngineOptions(device="cpu").prefill_chunk == PREFILL_CHUNK["cpu"]
    assert EngineOptions(device="cpu", prefill_chunk=96).prefill_chunk == 96
    with pytest.raises(ValueError, match="prefill-chunk must be a positive integer"):
        EngineOptions(device="cpu", prefill_chunk=0)
    for command in ("decode", "niah", "concurrency", "serve"):
        text = " ".join(CliRunner().invoke(main, [command, "--help"], terminal_width=400).output.split())
        assert f"[default: {PREFILL_CHUNK['cuda']} on CUDA, {PREFILL_CHUNK['cpu']} on a CPU]" in text, command
