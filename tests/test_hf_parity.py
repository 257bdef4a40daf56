"""Our fp32 forward against transformers' on tiny random checkpoints made in the test."""

from __future__ import annotations

import pytest
import torch

from ninfer_bench.engine.convert import convert
from ninfer_bench.engine.model import DECODE
from ninfer_bench.engine.runtime import Engine
from ninfer_bench.engine.sampling import SamplingParams

from tinyhf import make_hf

PARITY_RTOL = 1e-4  # relative RMS of fp32 logits vs transformers (DESIGN / issue: <= 1e-4)


def rel_rms(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


CASES = [
    ("qwen3_5", dict(tied=False)),
    ("qwen3_5", dict(tied=True, linear_num_value_heads=4, linear_num_key_heads=4, num_key_value_heads=3,
                     num_attention_heads=3, linear_value_head_dim=20)),
    ("qwen3_5_vl", dict(tied=False)),
    ("qwen3_next", dict(tied=False, linear_num_value_heads=6, linear_num_key_heads=2)),
]


@pytest.mark.parametrize("kind,kw", CASES, ids=["qwen3_5", "qwen3_5-tied-gqa3", "qwen3_5-vl", "qwen3_next"])
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
