"""Our fp32 forward against transformers' on tiny random checkpoints made in the test."""

from __future__ import annotations

import pytest
import torch

from ninfer_bench.engine.artifact.convert import convert
from ninfer_bench.engine.model.hybrid import DECODE
from ninfer_bench.engine.runtime.engine import Engine
from ninfer_bench.engine.sampling import SamplingParams

from tinyhf import make_hf

PARITY_RTOL = 1e-4  # relative RMS of fp32 logits vs transformers (DESIGN / issue: <= 1e-4)


def rel_rms(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def hf_logits(model, ids):
    with torch.no_grad():  # no cache: transformers' cache needs a full-attention layer to count the sequence
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


CASES = [
    ("qwen3_5", dict(tied=False)),
    ("qwen3_5", dict(tied=True, linear_num_value_heads=4, linear_num_key_heads=4, num_key_value_heads=3,
                     num_attention_heads=3, linear_value_head_dim=20)),
    ("qwen3_5_vl", dict(tied=False)),
    ("qwen3_next", dict(tied=False, linear_num_value_heads=6, linear_num_key_heads=2)),
    ("qwen3_5", dict(tied=False, attention_bias=True, head_dim=24)),
    ("qwen3_next", dict(tied=False, attention_bias=True)),
    # layer patterns other than 3 linear + 1 full: alternating, full attention first, no full attention at all
    ("qwen3_5", dict(tied=False, num_hidden_layers=5, layer_types=["linear_attention", "full_attention"] * 2
                     + ["linear_attention"])),
    ("qwen3_5", dict(tied=True, num_hidden_layers=3, layer_types=["full_attention", "full_attention",
                                                                  "linear_attention"], partial_rotary_factor=1.0)),
    ("qwen3_5", dict(tied=False, num_hidden_layers=3, layer_types=["linear_attention"] * 3,
                     linear_conv_kernel_dim=3)),
]


@pytest.mark.parametrize("kind,kw", CASES, ids=["qwen3_5", "qwen3_5-tied-gqa3", "qwen3_5-vl", "qwen3_next",
                                                 "qwen3_5-bias", "qwen3_next-bias", "qwen3_5-alternating",
                                                 "qwen3_5-full-first-rotary1", "qwen3_5-linear-only-conv3"])
def test_prefill_and_decode_match_transformers(tmp_path, kind, kw):
    model = make_hf(kind, tmp_path / "hf", seed=3, **kw)
    art = tmp_path / "m.ninfer"
    convert(tmp_path / "hf", art, policy="fp32")
    ids = torch.randint(0, 300, (217,), generator=torch.Generator().manual_seed(1)).tolist()
    eng = Engine.load(str(art), device="cpu", dtype="fp32", kv_dtype="fp32", max_context=512, prefill_chunk=64)
    ref = hf_logits(model, ids)
    assert rel_rms(eng.logits(ids), ref) <= PARITY_RTOL

    # 30 greedy decode steps after a prefill: our step logits vs transformers on the whole sequence
    seq = eng.acquire(ids, SamplingParams(max_new_tokens=30))
    eng.start(seq)
    steps = []
    for _ in range(29):
        _, logits = eng.decode_step([seq], torch.tensor([[seq.last]]), DECODE)
        seq.length += 1
        steps.append(logits[0, -1])
        seq.tokens.append(int(logits[0, -1].argmax()))
    eng.release(seq)
    full = hf_logits(model, ids + seq.tokens[:-1])
    ours = torch.stack(steps)
    theirs = full[len(ids):]
    assert rel_rms(ours, theirs) <= PARITY_RTOL
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert seq.tokens[0] == int(ref[-1].argmax())


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_prefill_equals_unchunked(tiny_artifact, chunk):
    ids = torch.randint(0, 300, (203,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = Engine.load(str(tiny_artifact), device="cpu", kv_dtype="fp32", max_context=256, prefill_chunk=256)
    parts = Engine.load(str(tiny_artifact), device="cpu", kv_dtype="fp32", max_context=256, prefill_chunk=chunk)
    a, b = whole.logits(ids), parts.logits(ids)
    assert rel_rms(b, a) <= 1e-5
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_quantized_artifact_close_to_fp32(tmp_path, hf_qwen35):
    folder, model = hf_qwen35
    ids = list(range(5, 120))
    ref = hf_logits(model, ids)
    for policy, tol in [("bf16", 2e-2), ("q8", 3e-2), ("mixed", 0.3)]:
        art = tmp_path / f"{policy}.ninfer"
        convert(folder, art, policy=policy)
        eng = Engine.load(str(art), device="cpu", kv_dtype="fp32", max_context=256)
        assert rel_rms(eng.logits(ids), ref) <= tol, policy


def test_attention_biases_fuse_with_their_projections(tmp_path):
    """attention_bias: the q / k / v / o biases are kept, and the CUDA path's fused q|k|v weight carries their
    concatenation (checked on the CPU: the fused store's forward equals the plain one's)."""
    from ninfer_bench.engine.model.hybrid import HybridModel
    from ninfer_bench.engine.model.weights import WeightStore

    make_hf("qwen3_5", tmp_path / "hf", seed=5, attention_bias=True)
    convert(tmp_path / "hf", tmp_path / "m.ninfer", policy="q8")
    eng = Engine.load(str(tmp_path / "m.ninfer"), device="cpu", dtype="fp32", max_context=64)
    raws, cfg = eng.weights.raws, eng.config
    fused, plain = WeightStore(raws, fuse=True), WeightStore(raws, fuse=False)
    p = f"model.layers.{cfg.layer_types.index('full_attention')}.self_attn"
    assert f"{p}.qkv_proj.bias" in fused.vectors and f"{p}.q_proj.bias" not in fused.vectors
    assert f"{p}.o_proj.bias" in fused.vectors and f"{p}.q_proj.bias" in plain.vectors
    x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for a, b in zip(HybridModel(cfg, fused, max_positions=64).attn_proj(p.rsplit(".", 1)[0], x),
                    HybridModel(cfg, plain, max_positions=64).attn_proj(p.rsplit(".", 1)[0], x)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_tensors_the_config_does_not_describe_are_refused(tmp_path):
    """A checkpoint whose layers hold tensors the engine would not use (here: attention biases under a config
    that says there are none) is refused at conversion, not converted into a model that computes something else."""
    import json

    from ninfer_bench.engine.artifact.hf_checkpoint import CheckpointError

    make_hf("qwen3_5", tmp_path / "hf", seed=5, attention_bias=True)
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["attention_bias"] = False
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="self_attn.*bias"):
        convert(tmp_path / "hf", tmp_path / "m.ninfer", policy="fp32")


def test_config_eos_ids_and_a_vocabulary_under_the_byte_specials(tmp_path):
    """A checkpoint without a tokenizer: the ids config.json names end generation (not the byte tokenizer's own
    specials, ordinary tokens of this model), and a vocabulary smaller than 256 bytes + 4 specials still loads and
    runs on token ids; text it cannot spell is a clear error."""
    model = make_hf("qwen3_5", tmp_path / "hf", seed=3, vocab_size=200, eos_token_id=7)
    convert(tmp_path / "hf", tmp_path / "m.ninfer", policy="fp32")
    eng = Engine.load(str(tmp_path / "m.ninfer"), device="cpu", dtype="fp32", kv_dtype="fp32", max_context=128)
    assert eng.tokenizer.eos_ids == (7,)
    ids = list(range(10, 40))
    assert rel_rms(eng.logits(ids), hf_logits(model, ids)) <= PARITY_RTOL
    with pytest.raises(ValueError, match="vocabulary"):
        eng.tokenizer.encode("\u20ac")  # UTF-8 bytes 226, 130, 172: no id 226 among 200 tokens
