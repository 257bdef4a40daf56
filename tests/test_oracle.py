"""The oracle (oracles/reference.py) against Hugging Face transformers, and the stored-oracle helpers.

Tiny random models are built with transformers inside the tests. Norm weights, A_log and dt_bias are
randomised away from their init (zeros / ones) so that a ``1 + w`` vs ``w`` mistake, a missing
``exp`` or a dropped bias shows up; linear weights get fan-in scaled init so logits spread out.
"""

from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ninfer_bench.engine.model.config import ModelConfig
from ninfer_bench.oracles.reference import ReferenceModel, split_qwen3_next_weights
from ninfer_bench.oracles.store import NEAR_TIE_NATS, agreement, kl, load_oracle, save_oracle

PROMPT_LEN = 224
RTOL_VS_HF_FP32 = 1e-4   # oracle float64 vs transformers float32
RTOL_VS_HF_FP64 = 1e-10  # oracle float64 vs transformers in true float64
RTOL_SELF = 1e-12        # oracle vs itself along another code path (incremental, chunked)

LINEAR, FULL = "linear_attention", "full_attention"

SHAPES = {
    # untied, Hv/Hk = 2, dk != dv, partial rotary 0.25, two full layers of six
    "qwen3_5_ratio2_untied": dict(
        family="qwen3_5", vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, layer_types=[LINEAR, LINEAR, FULL, LINEAR, LINEAR, FULL],
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.25}),
    # tied, Hv/Hk = 3, GQA group 3, partial rotary 0.5
    "qwen3_5_ratio3_tied": dict(
        family="qwen3_5", vocab_size=301, hidden_size=48, intermediate_size=80, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=8, linear_value_head_dim=12, layer_types=[LINEAR, FULL, LINEAR, LINEAR, FULL],
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                   "partial_rotary_factor": 0.5}),
    # Qwen3-Next, dense MLP, fused in_proj_qkvz / in_proj_ba, Hv/Hk = 3
    "qwen3_next_ratio3": dict(
        family="qwen3_next", vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=12, linear_value_head_dim=8, layer_types=[LINEAR, FULL, LINEAR, FULL],
        tie_word_embeddings=False, num_experts=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                   "partial_rotary_factor": 0.25}),
}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(math.log(0.05), math.log(4.0), generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:  # zero-centred norms and the GDN gated norm: well away from 0 and from 1
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))


def build_hf(shape: str, seed: int = 0):
    """A tiny random transformers model of the named shape, in float32, and its ModelConfig."""
    spec = dict(SHAPES[shape])
    family = spec.pop("family")
    torch.manual_seed(seed)
    spec["num_hidden_layers"] = len(spec["layer_types"])
    if family == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**spec))
    else:
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**spec))
    _randomise(model, seed)
    model.eval()
    return model, ModelConfig.from_hf(model.config.to_dict())


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@contextlib.contextmanager
def true_float64(model: torch.nn.Module):
    """Make a ``.double()`` transformers model compute in float64 throughout.

    transformers upcasts several ops to float32 explicitly (RMSNorm ``x.float()``, the GDN gate
    ``A_log.float()``, the delta rule ``.to(torch.float32)``, RoPE's float32 ``inv_freq``), which caps a
    float64 comparison at ~1e-7. Inside this context float64 tensors stay float64 and ``inv_freq`` is
    rebuilt in float64, so HF becomes a float64 reference the oracle must match to rounding.
    """
    real_float, real_to = torch.Tensor.float, torch.Tensor.to

    def keep_float(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else real_float(self, *args, **kwargs)

    def keep_to(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return real_to(self, *args, **kwargs)

    cfg = model.config
    rope = cfg.rope_parameters
    dim = int(cfg.head_dim * rope.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    model.model.rotary_emb.inv_freq = inv_freq
    torch.Tensor.float, torch.Tensor.to = keep_float, keep_to
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to = real_float, real_to


def prompt(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# ---- against transformers -----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_logits_match_transformers(shape):
    from ninfer_bench.suites.hf_peer import cpu_blocked

    if cpu_blocked():
        pytest.skip(f"transformers cannot run Qwen3.5 on the CPU here: {cpu_blocked()}")
    hf, cfg = build_hf(shape)
    ids = prompt(PROMPT_LEN, cfg.vocab_size)
    oracle = ReferenceModel(cfg, weights_of(hf))
    logits, hidden = oracle.forward(ids)
    assert logits.dtype == torch.float64 and logits.shape == (PROMPT_LEN, cfg.vocab_size)
    assert hidden.shape == (PROMPT_LEN, cfg.hidden_size)
    assert float(logits.std()) > 0.5, "the random model is too flat to be a meaningful check"

    with torch.no_grad():
        hf32 = hf(ids[None]).logits[0]
        assert rel_rms(logits, hf32) <= RTOL_VS_HF_FP32

        hf.double()
        last_layer = {}  # transformers' hidden_states[-1] is after model.norm; the oracle's is before it
        hf.model.layers[-1].register_forward_hook(lambda module, args, out: last_layer.setdefault("out", out))
        with true_float64(hf):
            hf64 = hf(ids[None]).logits[0]
    assert rel_rms(logits, hf64) <= RTOL_VS_HF_FP64
    assert rel_rms(hidden, last_layer["out"][0]) <= RTOL_VS_HF_FP64


def test_float32_oracle_is_close():
    hf, cfg = build_hf("qwen3_5_ratio2_untied")
    ids = prompt(64, cfg.vocab_size)
    ref64, _ = ReferenceModel(cfg, weights_of(hf)).forward(ids)
    ref32, _ = ReferenceModel(cfg, weights_of(hf), dtype=torch.float32).forward(ids)
    assert ref32.dtype == torch.float32
    assert rel_rms(ref32, ref64) <= RTOL_VS_HF_FP32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_oracle_on_cuda_is_the_oracle_on_the_cpu():
    """``oracle niah --device cuda``: the same plain float64 ops on the GPU give the CPU's greedy tokens, top-k ids
    and log-probs (to float64 rounding: the sums run in another order), chunked prefill included."""
    hf, cfg = build_hf("qwen3_5_ratio2_untied")
    ids = prompt(97, cfg.vocab_size)
    cpu = ReferenceModel(cfg, weights_of(hf)).greedy(ids, 12, prefill_chunk=40)
    gpu = ReferenceModel(cfg, weights_of(hf), device="cuda").greedy(ids, 12, prefill_chunk=40)
    assert (gpu["tokens"], gpu["topk_ids"]) == (cpu["tokens"], cpu["topk_ids"])
    assert torch.allclose(torch.tensor(gpu["topk_logprobs"]), torch.tensor(cpu["topk_logprobs"]), rtol=0, atol=1e-9)


def test_qwen3_next_split_matches_hf_ordering():
    hf, cfg = build_hf("qwen3_next_ratio3")
    split = split_qwen3_next_weights(weights_of(hf), cfg)
    assert not any("in_proj_qkvz" in k or "in_proj_ba" in k for k in split)
    x = torch.randn(1, 5, cfg.hidden_size)
    gdn = hf.model.layers[0].linear_attn
    with torch.no_grad():
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
    p = "model.layers.0.linear_attn."
    qkv = x @ split[p + "in_proj_qkv.weight"].T
    torch.testing.assert_close(qkv, torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1))
    torch.testing.assert_close(x @ split[p + "in_proj_z.weight"].T, z.flatten(2))
    torch.testing.assert_close(x @ split[p + "in_proj_b.weight"].T, b)
    torch.testing.assert_close(x @ split[p + "in_proj_a.weight"].T, a)


# ---- the oracle against itself ----------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["qwen3_5_ratio2_untied", "qwen3_next_ratio3"])
def test_greedy_incremental_matches_full_forward(shape):
    hf, cfg = build_hf(shape)
    oracle = ReferenceModel(cfg, weights_of(hf))
    ids = prompt(29, cfg.vocab_size)
    new = 12
    for chunk in (None, 5):  # the prompt in one piece, and in pieces that straddle the conv window
        out = oracle.greedy(ids, max_new_tokens=new, top_k=8, prefill_chunk=chunk)
        assert len(out["tokens"]) == new and all(len(r) == 8 for r in out["topk_ids"])
        full = torch.cat([ids, torch.tensor(out["tokens"][:-1])])
        logprobs = torch.log_softmax(oracle.forward(full)[0][len(ids) - 1:], dim=-1)  # [new, V]
        assert out["tokens"] == logprobs.argmax(-1).tolist()
        top = torch.topk(logprobs, 8)
        assert out["topk_ids"] == top.indices.tolist()
        assert rel_rms(torch.tensor(out["topk_logprobs"], dtype=torch.float64), top.values) <= RTOL_SELF


def test_greedy_stops_on_stop_id():
    hf, cfg = build_hf("qwen3_5_ratio3_tied")
    oracle = ReferenceModel(cfg, weights_of(hf))
    ids = prompt(16, cfg.vocab_size)
    free = oracle.greedy(ids, max_new_tokens=10)
    stop = free["tokens"][3]
    first = free["tokens"].index(stop)
    stopped = oracle.greedy(ids, max_new_tokens=10, stop_ids=(stop,))
    assert stopped["tokens"] == free["tokens"][:first + 1]
    assert len(stopped["topk_ids"]) == len(stopped["topk_logprobs"]) == first + 1


def test_bad_weights_are_named():
    hf, cfg = build_hf("qwen3_5_ratio2_untied")
    w = weights_of(hf)
    del w["model.layers.2.self_attn.q_norm.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.q_norm\.weight"):
        ReferenceModel(cfg, w)
    w = weights_of(hf)
    w["model.layers.0.linear_attn.A_log"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"A_log.*shape"):
        ReferenceModel(cfg, w)


# ---- MTP ------------------------------------------------------------------------------------------------
def with_mtp(model: torch.nn.Module, cfg: ModelConfig, seed: int = 3) -> dict[str, torch.Tensor]:
    """The model's weights plus a random MTP head (transformers has no MTP module).

    ``mtp.layers.0`` takes the tensor names and shapes of one of the model's full-attention layers.
    """
    gen = torch.Generator().manual_seed(seed)
    h = cfg.hidden_size
    w = weights_of(model)
    source = f"model.layers.{cfg.full_layers[0]}."
    shapes = {name.replace(source, "mtp.layers.0."): tuple(t.shape) for name, t in w.items() if name.startswith(source)}
    shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                   "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen)
        w[name] = 0.5 * t if len(shape) == 1 else t / math.sqrt(shape[1])
    return w


def test_mtp_shapes_and_causality():
    hf, cfg = build_hf("qwen3_5_ratio2_untied")
    oracle = ReferenceModel(cfg, with_mtp(hf, cfg))
    ids = prompt(40, cfg.vocab_size)
    _, hidden = oracle.forward(ids)
    next_ids = torch.cat([ids[1:], torch.tensor([7])])
    out = oracle.mtp_logits(hidden, next_ids)
    assert out.shape == (40, cfg.vocab_size) and out.dtype == torch.float64 and torch.isfinite(out).all()

    # Changing token 25 changes main-model hidden from 25 on and next_ids from 24 on: rows < 24 are fixed.
    ids2 = ids.clone()
    ids2[25] = (ids[25] + 1) % cfg.vocab_size
    _, hidden2 = oracle.forward(ids2)
    out2 = oracle.mtp_logits(hidden2, torch.cat([ids2[1:], torch.tensor([7])]))
    torch.testing.assert_close(out2[:24], out[:24], rtol=0, atol=0)
    assert not torch.allclose(out2[24:], out[24:])

    # The pre-/post-norm choice of h_t is a real switch.
    pre = oracle.mtp_logits(hidden, next_ids, mtp_uses_prenorm_hidden=True)
    assert rel_rms(pre, out) > 1e-3

    with pytest.raises(ValueError, match="MTP head"):
        ReferenceModel(cfg, weights_of(hf)).mtp_logits(hidden, next_ids)


# ---- agreement rule, KL, file format -------------------------------------------------------------------
def oracle_case(tokens, gaps, top_k=4):
    """A hand-made oracle record: at step i the top-1 is tokens[i] and the top-2 sits gaps[i] below it."""
    ids, lps = [], []
    for tok, gap in zip(tokens, gaps):
        ids.append([tok, tok + 100] + [tok + 200 + j for j in range(top_k - 2)])
        lps.append([-0.5, -0.5 - gap] + [-5.0 - j for j in range(top_k - 2)])
    return {"id": "case", "prompt_ids": [1, 2, 3], "tokens": list(tokens), "topk_ids": ids, "topk_logprobs": lps}


def test_agreement_rule():
    rec = oracle_case([10, 11, 12, 13, 14], [1.0, 1.0, 0.01, 2.0, 1.0])
    same = agreement([10, 11, 12, 13, 14], rec)
    assert same == {"pass": True, "first_divergence": None, "top1_agreement": 1.0, "gap_at_divergence": None,
                    "compared_steps": 5}

    near_tie = agreement([10, 11, 112, 50, 51], rec)  # picks the top-2 at step 2, where the gap is 0.01
    assert near_tie["pass"] and near_tie["first_divergence"] == 2
    assert near_tie["gap_at_divergence"] == pytest.approx(0.01)
    assert near_tie["top1_agreement"] == pytest.approx(2 / 5)

    large_gap = agreement([10, 11, 12, 113, 14], rec)  # picks the top-2 at step 3, where the gap is 2.0
    assert not large_gap["pass"] and large_gap["first_divergence"] == 3
    assert large_gap["gap_at_divergence"] == pytest.approx(2.0)

    not_top2 = agreement([10, 11, 212], rec)  # near tie, but the candidate picked the top-3, 4.5 nats down
    assert not not_top2["pass"] and not_top2["first_divergence"] == 2 and not_top2["compared_steps"] == 3
    assert not_top2["gap_at_divergence"] == pytest.approx(4.5)
    outside = agreement([10, 11, 999], rec)  # not in the oracle's top-k: at least the gap to its last entry
    assert not outside["pass"] and outside["gap_at_divergence"] == pytest.approx(5.5)

    # a three-way tie (as the bundled model's 8K NIAH case at 20% depth met it): any token inside the band agrees
    three = oracle_case([10, 11, 12], [1.0, 0.028, 1.0])
    three["topk_logprobs"][1][2] = -0.5 - 0.048
    tie = agreement([10, 211], three)
    assert tie["pass"] and tie["gap_at_divergence"] == pytest.approx(0.048)
    assert not agreement([10, 211], three, near_tie=0.04)["pass"]
    three["topk_logprobs"][1][2] = -0.5 - 0.06
    assert not agreement([10, 211], three)["pass"]

    first_step = agreement([110, 11], rec)
    assert first_step["first_divergence"] == 0 and not first_step["pass"] and first_step["top1_agreement"] == 0.0

    assert agreement([10, 11, 12, 13, 14], rec, near_tie=0.0)["pass"]
    assert not agreement([10, 11, 112], rec, near_tie=0.005)["pass"]
    assert agreement([10, 11, 12], rec)["pass"]  # a shorter run that agrees where compared
    assert 0.0 < NEAR_TIE_NATS < 0.5


def test_kl():
    p = [-0.1, -2.5, -3.0, -4.0]
    assert kl(p, p) == pytest.approx(0.0, abs=1e-15)
    assert kl(p, [v - 3.0 for v in p]) == pytest.approx(0.0, abs=1e-12)  # renormalised: a shift is no change
    q = [-0.3, -1.5, -3.5, -4.0]
    pn = torch.log_softmax(torch.tensor(p, dtype=torch.float64), 0)
    qn = torch.log_softmax(torch.tensor(q, dtype=torch.float64), 0)
    assert kl(p, q) == pytest.approx(float((pn.exp() * (pn - qn)).sum()), rel=1e-12)
    assert kl(p, q) > 0 and kl(p, q) != pytest.approx(kl(q, p))
    with pytest.raises(ValueError):
        kl(p, q[:2])


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_store_round_trip(tmp_path, suffix):
    hf, cfg = build_hf("qwen3_5_ratio3_tied")
    oracle = ReferenceModel(cfg, weights_of(hf))
    records = []
    for case in range(2):
        ids = prompt(12, cfg.vocab_size, seed=10 + case)
        records.append({"id": f"case-{case}", "prompt_ids": ids.tolist(), **oracle.greedy(ids, 6, top_k=5)})
    meta = {"artifact_id": "hf-random", "artifact_sha256": None, "dtype": "float64", "top_k": 5}
    path = save_oracle(tmp_path / f"oracle{suffix}", records, meta)
    loaded, loaded_meta = load_oracle(path)
    assert loaded == records  # floats round-trip exactly
    assert loaded_meta["top_k"] == 5 and loaded_meta["created"]
    assert all(agreement(r["tokens"], r)["pass"] for r in loaded)
    # rewriting the same records gives the same bytes (no gzip timestamp) and leaves no temporary file behind
    first = path.read_bytes()
    save_oracle(path, records, {**meta, "created": loaded_meta["created"]})
    assert path.read_bytes() == first and [p.name for p in tmp_path.iterdir()] == [path.name]

    with pytest.raises(ValueError, match="artifact_id"):
        save_oracle(tmp_path / "x.json", records, {"dtype": "float64", "top_k": 5, "artifact_sha256": None})
    bad = dict(records[0], topk_ids=records[0]["topk_ids"][:-1])
    with pytest.raises(ValueError, match="case-0"):
        save_oracle(tmp_path / "y.json", [bad], meta)
    (tmp_path / "z.json").write_text('{"schema": "something-else"}')
    with pytest.raises(ValueError, match="schema"):
        load_oracle(tmp_path / "z.json")


def test_niah_oracle_file_is_extended_not_rebuilt(tmp_path, monkeypatch):
    """A second `oracle niah` run keeps the stored cases and computes only the new ones (unless forced)."""
    from ninfer_bench.oracles.reference import ReferenceModel
    from ninfer_bench.suites.niah import NiahOptions, build_niah_oracle

    calls = []
    real = ReferenceModel.greedy
    monkeypatch.setattr(ReferenceModel, "greedy", lambda self, ids, *a, **k: calls.append(len(ids)) or
                        real(self, ids, *a, **k))
    out = tmp_path / "o.json.gz"
    opts = dict(model="tiny", ctxs=(512,), answer_tokens=4)
    build_niah_oracle("tiny", NiahOptions.make(depths=(0,), **opts), str(out))
    first, _ = load_oracle(out)
    build_niah_oracle("tiny", NiahOptions.make(depths=(0, 100), **opts), str(out))
    records, meta = load_oracle(out)
    assert len(calls) == 2 and meta["depths"] == [0, 100]  # depth 0 reused, depth 100 computed
    assert sorted(r["id"] for r in records) == ["ctx512-d0-0", "ctx512-d100-0"]
    assert next(r for r in records if r["id"] == "ctx512-d0-0")["tokens"] == first[0]["tokens"]
    build_niah_oracle("tiny", NiahOptions.make(depths=(100,), **opts), str(out), force=True)
    records, meta = load_oracle(out)
    assert len(calls) == 3 and [r["id"] for r in records] == ["ctx512-d100-0"] and meta["depths"] == [100]


def test_niah_oracle_cases_record_their_device(tmp_path):
    """Each case records the device that computed it (`--device auto` may extend a CPU-built file with GPU cases),
    and `oracle niah` says which built how many. A file from before cases recorded one stays readable, its cases
    counted as unknown and kept as they are when the file is extended."""
    from click.testing import CliRunner

    from ninfer_bench.cli import main
    from ninfer_bench.oracles.store import UNKNOWN_DEVICE, devices
    from ninfer_bench.suites.niah import NiahOptions, build_niah_oracle

    out = tmp_path / "o.json.gz"
    build_niah_oracle("tiny", NiahOptions.make(model="tiny", ctxs=(512,), depths=(0,), answer_tokens=3), str(out),
                      device="cpu")
    records, meta = load_oracle(out)
    assert [r["device"] for r in records] == ["cpu"]
    save_oracle(out, [{k: v for k, v in r.items() if k != "device"} for r in records], meta)  # as older files are
    records, _ = load_oracle(out)
    assert "device" not in records[0] and devices(records) == {UNKNOWN_DEVICE: 1}
    res = CliRunner().invoke(main, ["oracle", "niah", "--model", "tiny", "--ctx", "512", "--depths", "0,100",
                                    "--answer-tokens", "3", "--out", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "2 cases (1 on an unrecorded device, 1 on cpu)" in " ".join(res.output.split())
    records, _ = load_oracle(out)
    assert {r["id"]: r.get("device") for r in records} == {"ctx512-d0-0": None, "ctx512-d100-0": "cpu"}
    with pytest.raises(ValueError, match="device must name where it was computed"):
        save_oracle(out, [{**records[0], "device": ""}], meta)


def test_niah_oracle_keeps_finished_depths_when_interrupted(tmp_path):
    """Each finished depth is on disk before the next starts: stopping a long build loses only the case in hand."""
    from ninfer_bench.suites.niah import NiahOptions, build_niah_oracle

    out = tmp_path / "o.json.gz"

    def stop_at_second(done, total, case):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_niah_oracle("tiny", NiahOptions.make(model="tiny", ctxs=(512,), depths=(0, 50, 100), answer_tokens=3),
                          str(out), progress=stop_at_second)
    records, meta = load_oracle(out)
    assert meta["depths"] == [0] and [r["id"] for r in records] == ["ctx512-d0-0"]


def test_niah_oracles_belong_to_a_text_model_not_an_artifact(tmp_path):
    """A stored NIAH oracle is found and accepted by the text model's identity (an artifact whose drafters were
    replaced keeps its oracles); another text model's oracle, or (without identities) another artifact's, is
    refused."""
    from ninfer_bench.suites.niah import NiahOptions, _load_oracles, oracle_path

    rec = {"id": "c0", "prompt_ids": [1, 2], "tokens": [3], "topk_ids": [[3]], "topk_logprobs": [[-0.1]]}
    path = tmp_path / "o.json.gz"
    save_oracle(path, [rec], {"artifact_id": "old", "artifact_sha256": "", "text_id": "a" * 64, "dtype": "float64",
                              "top_k": 1, "suite": "niah"})
    opts = NiahOptions.make(ctxs=(2048,), oracle=str(path))
    assert list(_load_oracles(opts, {"artifact_id": "new", "text_id": "a" * 64})) == ["c0"]
    with pytest.raises(ValueError, match="oracle made for text model"):
        _load_oracles(opts, {"artifact_id": "old", "text_id": "b" * 64})
    with pytest.raises(ValueError, match=r"oracle made for text model a{16} \(artifact old\), this model is "
                                         r"artifact new"):
        _load_oracles(opts, {"artifact_id": "new"})
    assert oracle_path({"artifact_id": "new", "text_id": "a" * 64}, 2048).name == f"niah-{'a' * 16}-2048.json.gz"
    assert oracle_path({"artifact_id": "new" * 8}, 2048).name == f"niah-{('new' * 8)[:16]}-2048.json.gz"


def _counting_greedy(monkeypatch) -> list[int]:
    """Prompt lengths of every reference forward from now on (what a build computed rather than kept)."""
    calls = []
    real = ReferenceModel.greedy
    monkeypatch.setattr(ReferenceModel, "greedy", lambda self, ids, *a, **k: calls.append(len(ids)) or
                        real(self, ids, *a, **k))
    return calls


def test_niah_oracle_extended_by_new_depths_and_more_cases(tmp_path, monkeypatch):
    """The audit's repro: a run for depth 25 after one for 0/50/100 adds its case; a run with more --cases
    (not a setting: it only adds case indices) adds them too instead of replacing the file."""
    from ninfer_bench.suites.niah import NiahOptions, build_niah_oracle

    calls = _counting_greedy(monkeypatch)
    out = tmp_path / "x.json.gz"
    opts = dict(model="tiny", ctxs=(256,), answer_tokens=3)
    build_niah_oracle("tiny", NiahOptions.make(depths=(0, 50, 100), **opts), str(out))
    build_niah_oracle("tiny", NiahOptions.make(depths=(25,), **opts), str(out))
    build_niah_oracle("tiny", NiahOptions.make(depths=(25, 50), cases=2, **opts), str(out))
    records, meta = load_oracle(out)
    assert sorted(r["id"] for r in records) == ["ctx256-d0-0", "ctx256-d100-0", "ctx256-d25-0", "ctx256-d25-1",
                                                "ctx256-d50-0", "ctx256-d50-1"]
    assert len(calls) == 6 and meta["depths"] == [0, 25, 50, 100] and meta["cases"] == 1
    assert meta["preset"] == "tiny"


@pytest.mark.parametrize("change, named", [
    (dict(top_k=4), "top_k 8 (this run: 4)"), (dict(dtype="fp32"), "dtype 'fp64' (this run: 'fp32')"),
    (dict(seed=1), "seed 0 (this run: 1)"), (dict(answer_tokens=4), "answer_tokens 3 (this run: 4)")])
def test_niah_oracle_with_other_settings_refused_unless_forced(tmp_path, monkeypatch, change, named):
    """A build whose cases would not be comparable with the file's is refused before any compute, naming the
    setting and leaving the file as it was; --force replaces the file (its cases dropped)."""
    from ninfer_bench.suites.niah import NiahOptions, build_niah_oracle

    out = tmp_path / "x.json.gz"
    case = dict(model="tiny", ctxs=(256,), answer_tokens=3, seed=0)
    kw = dict(top_k=8, dtype="fp64")
    build_niah_oracle("tiny", NiahOptions.make(depths=(0, 100), **case), str(out), **kw)
    before = out.read_bytes()
    case.update((k, v) for k, v in change.items() if k in case)
    kw.update((k, v) for k, v in change.items() if k in kw)
    calls = _counting_greedy(monkeypatch)
    with pytest.raises(ValueError, match=rf"{re.escape(named)}\. --force replaces the file"):
        build_niah_oracle("tiny", NiahOptions.make(depths=(50,), **case), str(out), **kw)
    assert out.read_bytes() == before and calls == []
    build_niah_oracle("tiny", NiahOptions.make(depths=(50,), **case), str(out), force=True, **kw)
    records, meta = load_oracle(out)
    assert [r["id"] for r in records] == ["ctx256-d50-0"] and meta["depths"] == [50]
    assert all(meta[k] == v for k, v in change.items())


def test_niah_oracle_of_another_model_or_prompt_refused(tmp_path, tiny_artifact):
    """A preset's oracle file is not extended by an artifact's build (the error names both), nor one whose stored
    prompt is not what the same settings build now (tokenizer or haystack changed)."""
    from ninfer_bench.suites.niah import NiahOptions, build_niah_oracle

    out = tmp_path / "x.json.gz"
    opts = dict(ctxs=(256,), answer_tokens=3)
    build_niah_oracle("tiny", NiahOptions.make(depths=(0,), **opts), str(out))
    before = out.read_bytes()
    with pytest.raises(ValueError, match=r"oracle made for preset tiny, this model is text model [0-9a-f]{16} "
                                         r"\(artifact \w+\)\. --force replaces the file"):
        build_niah_oracle(str(tiny_artifact), NiahOptions.make(depths=(50,), **opts), str(out))
    assert out.read_bytes() == before
    records, meta = load_oracle(out)
    records[0]["prompt_ids"][5] += 1
    save_oracle(out, records, meta)
    with pytest.raises(ValueError, match=r"case ctx256-d0-0's stored prompt is not the one built now \(tokenizer "
                                         r"or haystack changed\)"):
        build_niah_oracle("tiny", NiahOptions.make(depths=(50,), **opts), str(out))


def test_niah_oracle_identity_names_what_differs(tmp_path):
    """`niah --oracle FILE` accepts a preset's oracle only for that preset with the same config (also a file made
    before the preset's name was recorded, by its config digest) and an artifact's only for its text model; a
    mismatch says what the oracle was made for and what the model is, before any prompt comparison blames the
    tokenizer."""
    from ninfer_bench.engine.artifact.loader import load_source
    from ninfer_bench.suites.niah import NiahOptions, _load_oracles

    tiny = load_source("tiny").info
    rec = {"id": "c0", "prompt_ids": [1, 2], "tokens": [3], "topk_ids": [[3]], "topk_logprobs": [[-0.1]]}
    base = {"artifact_id": "", "artifact_sha256": tiny["config_sha256"], "text_id": "", "dtype": "fp64",
            "top_k": 1, "suite": "niah", "seed": 0, "answer_tokens": 10}
    artifact = {"artifact_id": "abc", "text_id": "b" * 64, "preset": None}
    for name, extra in (("named", {"preset": "tiny"}), ("legacy", {})):  # legacy: no preset name recorded
        path = tmp_path / f"{name}.json.gz"
        save_oracle(path, [rec], {**base, **extra})
        opts = NiahOptions.make(ctxs=(2048,), oracle=str(path))
        assert list(_load_oracles(opts, tiny)) == ["c0"]
        what = "preset tiny" if extra else r"an unnamed preset \(config sha256 [0-9a-f]{16}\)"
        with pytest.raises(ValueError, match=rf"oracle made for {what}, this model is text model b{{16}} "
                                             rf"\(artifact abc\)"):
            _load_oracles(opts, artifact)
    with pytest.raises(ValueError, match=r"oracle made for preset tiny with config sha256 \w{16}, this model is "
                                         r"preset tiny with config sha256 0{16}"):
        _load_oracles(NiahOptions.make(oracle=str(tmp_path / "named.json.gz")), {**tiny, "config_sha256": "0" * 64})
    path = tmp_path / "art.json.gz"
    save_oracle(path, [rec], {**base, "artifact_id": "abc", "artifact_sha256": "f" * 64, "text_id": "b" * 64})
    assert list(_load_oracles(NiahOptions.make(oracle=str(path)), {**artifact, "artifact_id": "redrafted"})) == ["c0"]
    with pytest.raises(ValueError, match=r"oracle made for text model b{16} \(artifact abc\), this model is preset "
                                         r"tiny"):
        _load_oracles(NiahOptions.make(oracle=str(path)), tiny)
    with pytest.raises(ValueError, match=r"oracle cases built with answer_tokens 10 \(this run: 4\)"):
        _load_oracles(NiahOptions.make(oracle=str(path), answer_tokens=4), artifact)


def test_niah_needle_sits_at_its_depth_of_the_body_tokens():
    """The needle goes to the line boundary nearest ``depth`` percent of the body's tokens, not ``depth`` percent of
    its lines: with lines of uneven length the two are far apart (here 50 % of the lines is 83 % of the tokens)."""
    from ninfer_bench.engine.artifact.loader import load_source
    from ninfer_bench.suites.needle import needle_text
    from ninfer_bench.suites.niah import build_case, needle_line, question_text

    body = [[1] * 10] * 5 + [[2]] * 5  # 55 tokens: five long lines, then five short ones
    assert [needle_line(body, d) for d in (0, 10, 50, 80, 100)] == [0, 1, 3, 4, 10]  # offsets 0, 10, 30, 40, 55
    assert needle_line(body, 95) == 7  # 52.25 of 55: the boundary at 52 (line 7) beats 53
    tok = load_source("tiny").tokenizer
    for ctx, depth in [(1024, 33), (2048, 50), (2048, 77), (1024, 5)]:
        case = build_case(tok, ctx, depth, 0)
        ids, needle = case["prompt_ids"], tok.encode(needle_text(case["key"], case["value"]))
        at = next(i for i in range(len(ids)) if ids[i:i + len(needle)] == needle)
        body_tokens = len(ids) - len(needle) - len(tok.encode("\n" + question_text(case["key"])))
        assert abs(100 * at / body_tokens - depth) < 1.5, (ctx, depth, 100 * at / body_tokens)


def test_niah_rescore_refuses_documents_with_the_old_needle_placement():
    """A document made when needles were placed by share of lines ran other prompts than this build makes: its
    tokens are not judged against today's oracles (their prompts differ, at most depths, by where the needle is)."""
    from ninfer_bench.reports.schema import make_result
    from ninfer_bench.suites.niah import rescore_niah

    config = {"model": None, "ctxs": [2048], "depths": [50], "cases": 1, "answer_tokens": 10, "seed": 0}
    rec = {"case": "ctx2048-d50-0", "ctx": 2048, "depth": 50, "prompt_tokens": 2034, "answer": " 1\n", "tokens": [1],
           "retrieved": False}
    doc = make_result("niah", label="old", config=config, records=[rec], env={},
                      summary={"cases": 1, "oracle_agreement": None, "retrieval": 0.0, "first_divergence": {}})
    with pytest.raises(ValueError, match="placed by share of lines"):
        rescore_niah(doc)
