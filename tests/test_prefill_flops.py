"""The prefill's model FLOPs (suites.common.forward_flops), the measured matmul roofline and the decode document's
prefill compute fraction."""

import pytest
import torch

from ninfer_bench.engine.model.config import preset
from ninfer_bench.suites.common import forward_flops, matmul_peak
from ninfer_bench.suites.decode import DecodeOptions, run_decode


def test_forward_flops_counts_the_tiny_model_by_hand():
    cfg = preset("tiny")  # hidden 96, inter 160, 4 layers (3 GDN, 1 attention), H 4 / Hkv 2 / hd 32, vocab 512
    h, hd = 96, 32
    attn = h * (4 * hd * 2) + 2 * h * (2 * hd) + (4 * hd) * h  # q (with its gate), k, v, o
    kd, vd, hv = 2 * 24, 4 * 16, 4
    gdn = h * (2 * kd + vd) + h * vd + 2 * h * hv + vd * h  # qkv, z, b and a, out
    mlp = 3 * h * 160
    params = 4 * mlp + attn + 3 * gdn
    n = 10
    want = 2 * params * n + 2 * 512 * h  # one row of logits
    want += 4 * 4 * hd * (n * (n + 1) // 2)  # causal: query i sees i + 1 keys
    want += 3 * 2 * n * (3 * hv * 24 * 16 + (2 * kd + vd) * cfg.linear_conv_kernel_dim)
    assert forward_flops(cfg, n) == want


@pytest.mark.parametrize("name", ["tiny", "qwen3.8-27b"])
def test_forward_flops_of_chunks_add_up_to_the_whole_prompt(name):
    """A prompt prefilled in chunks does the whole prompt's work: the causal keys of chunk [a, a + b) after a
    past of a, added to those of [0, a), are those of [0, a + b)."""
    cfg = preset(name)
    for a, b in ((1, 1), (7, 13), (2048, 943), (4096, 60904)):
        parts = forward_flops(cfg, a, logits_rows=0) + forward_flops(cfg, b, past=a, logits_rows=1)
        assert parts == forward_flops(cfg, a + b)


def test_forward_flops_of_the_27b_shape_match_its_published_floor():
    """The 27B shape's 65,000-token prefill is about 4.0 PFLOP (issue 32's floor: about 5.1 s at 790 TFLOP/s); a
    token's work is twice the text layers' 24.35 B matmul weights plus its GDN recurrence (0.23 GFLOP)."""
    cfg = preset("qwen3.8-27b")
    per_token = forward_flops(cfg, 1, logits_rows=0)
    assert 2 * 24.35e9 + 0.2e9 < per_token < 2 * 24.36e9 + 0.25e9
    assert 5.0 < forward_flops(cfg, 65000) / 790e12 < 5.2
    with pytest.raises(ValueError, match="counts >= 0"):
        forward_flops(cfg, -1)


def test_matmul_peak_is_a_positive_rate_on_this_machine():
    flops = matmul_peak(torch.device("cpu"), torch.float32, n=256, repeats=2)
    assert 1e6 < flops < 1e15


def test_decode_document_reports_prefill_flops_against_the_measured_matmul():
    doc = run_decode(DecodeOptions.make(model="tiny", device="cpu", dtype="fp32", kv_dtype="fp32",
                                        max_new_tokens=4, repeats=2, warmup=0))
    s, rec = doc["summary"], doc["records"][0]
    cfg = preset("tiny")
    assert rec["prefill_tflops"] == pytest.approx(forward_flops(cfg, rec["prompt_tokens"]) / rec["prefill_s"] / 1e12)
    assert s["matmul_tflops"] > 0
    assert s["prefill_compute_fraction"] == pytest.approx(s["prefill_tflops"] / s["matmul_tflops"])


def test_matmul_peak_that_does_not_fit_reports_no_mfu(monkeypatch):
    """Operands that do not fit beside the engine: matmul_peak warns and gives None, and a decode document then has
    no matmul figure and no MFU, rather than a failed run."""
    from ninfer_bench.suites import common, decode

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    real = torch.randn
    monkeypatch.setattr(common.torch, "randn", oom)
    with pytest.warns(UserWarning, match="do not fit"):
        assert matmul_peak(torch.device("cpu"), torch.float32, n=64, repeats=1) is None
    monkeypatch.setattr(common.torch, "randn", real)
    monkeypatch.setattr(decode, "measured_matmul_peak", lambda device, dtype: None)
    doc = run_decode(DecodeOptions.make(model="tiny", device="cpu", dtype="fp32", kv_dtype="fp32",
                                        max_new_tokens=4, repeats=2, warmup=0))
    s = doc["summary"]
    assert s["matmul_tflops"] is None and s["prefill_compute_fraction"] is None and s["prefill_tflops"] > 0
