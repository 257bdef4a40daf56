"""Weight formats: packing is lossless for codes, dequant matches the docs/DESIGN.md formula, error bounds hold."""

import numpy as np
import pytest
import torch

from ninfer_bench.kernels import quant

SHAPES = [(5, 100), (3, 64), (1, 1), (2, 3, 70)]  # K not a multiple of the group, a multiple, tiny, 3-D


def _weights(shape, seed=0):
    """Gaussian weights with a few outliers, magnitudes where fp16 scales are normal numbers."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.5
    w.view(-1)[:: 37] *= 20.0
    return w


def _reference(w: torch.Tensor, fmt: str):
    """docs/DESIGN.md in numpy: codes [N, Kp], scales fp16 [N, G] and dequantized [N, K]."""
    group, qmax, _ = quant.QSPEC[fmt]
    x = w.reshape(-1, w.shape[-1]).numpy().astype(np.float32)
    n, k = x.shape
    kp = -(-k // group) * group
    x = np.pad(x, ((0, 0), (0, kp - k))).reshape(n, kp // group, group)
    scale = (np.abs(x).max(-1) / np.float32(qmax)).astype(np.float16)
    scale[scale == 0] = np.float16(np.finfo(np.float16).smallest_subnormal)
    q = np.clip(np.rint(x / scale.astype(np.float32)[..., None]), -qmax, qmax)  # rint: half to even
    deq = (scale.astype(np.float32)[..., None] * q).reshape(n, kp)[:, :k]
    return q.reshape(n, kp).astype(np.int8), scale, deq


@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_pack_unpack_exact(fmt, shape):
    w = _weights(shape)
    q, s = quant.quantize_codes(w, fmt)
    buf = quant.pack(w, fmt)
    assert buf.dtype == torch.uint8 and buf.numel() == quant.nbytes(fmt, shape)
    q2, s2 = quant.unpack_codes(buf, fmt, shape)
    assert torch.equal(q2, q) and torch.equal(s2, s)


@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_formula(fmt, shape):
    w = _weights(shape, seed=1)
    q_ref, s_ref, deq_ref = _reference(w, fmt)
    q, s = quant.quantize_codes(w, fmt)
    assert np.array_equal(q.numpy(), q_ref) and np.array_equal(s.numpy(), s_ref)
    deq = quant.dequantize(quant.pack(w, fmt), fmt, shape)
    assert deq.shape == w.shape
    assert np.array_equal(deq.reshape(-1, shape[-1]).numpy(), deq_ref)


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_error_bound(fmt, shape):
    w = _weights(shape, seed=2)
    deq = quant.dequantize(quant.pack(w, fmt), fmt, shape)
    err = (w - deq).abs().reshape(-1, shape[-1])
    if fmt in quant.FLOAT_FORMATS:  # elementwise relative rounding error
        amax = w.abs().reshape(-1, shape[-1])
    else:
        group = quant.QSPEC[fmt][0]
        x = w.reshape(-1, shape[-1])
        pad = -x.shape[-1] % group
        g = torch.nn.functional.pad(x.abs(), (0, pad)).reshape(x.shape[0], -1, group).amax(-1)
        amax = g.repeat_interleave(group, dim=-1)[:, : x.shape[-1]]
    excess = err - quant.error_bound(fmt) * amax
    assert bool((excess <= 0).all()), f"bound exceeded by up to {excess.max():.3g}"


CODE_RANGE = {"q8_g32_fp16": (-127, 127), "q5_g64_fp16": (-16, 15), "q4_g64_fp16": (-8, 7)}  # what the unpacker accepts


@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
def test_code_range(fmt):
    lo, hi = CODE_RANGE[fmt]
    w = _weights((16, 256), seed=3) * 100
    q, _ = quant.quantize_codes(w, fmt)
    assert -hi <= int(q.min()) and int(q.max()) <= hi  # symmetric: quantization never emits lo < -hi
    assert int(q.max()) == hi and int(q.min()) == -hi  # each group's amax element lands on +-qmax
    # both ends of the packed range decode: all-low and all-high code sections (q8: int8 -127 / 127)
    lay = quant.qlayout(fmt, (1, 256))
    low_byte, high_byte = (0x81, 0x7F) if fmt == "q8_g32_fp16" else (0x00, 0xFF)
    for byte, code in ((low_byte, lo), (high_byte, hi)):
        buf = torch.full((lay.nbytes,), byte, dtype=torch.uint8)
        buf[lay.scales[0]:] = 0
        codes, _ = quant.unpack_codes(buf, fmt, (1, 256))
        assert bool((codes == code).all()), (fmt, byte, codes.unique())


@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
def test_zero_group(fmt):
    group = quant.QSPEC[fmt][0]
    w = torch.randn(2, 2 * group)
    w[1, :group] = 0.0
    q, s = quant.quantize_codes(w, fmt)
    assert s[1, 0].item() == quant.FP16_TINY and s[1, 0].item() > 0
    deq = quant.dequantize(quant.pack(w, fmt), fmt, tuple(w.shape))
    assert torch.equal(deq[1, :group], torch.zeros(group)) and bool((q[1, :group] == 0).all())


@pytest.mark.parametrize("fmt,step", [("q8_g32_fp16", 2.0**-4), ("q5_g64_fp16", 2.0**-3), ("q4_g64_fp16", 2.0**-3)])
def test_round_half_even_on_ties(fmt, step):
    group, qmax, _ = quant.QSPEC[fmt]
    halves = torch.tensor([0.5, 1.5, 2.5, 3.5, 4.5, 5.5, -0.5, -1.5, -2.5, -3.5])
    expected = torch.tensor([0, 2, 2, 4, 4, 6, 0, -2, -2, -4], dtype=torch.int8)
    w = torch.zeros(1, group)
    w[0, 0] = qmax * step  # amax fixes scale = step exactly (a power of two, exact in fp16)
    w[0, 1:1 + len(halves)] = halves * step  # x / scale lands exactly on k + 1/2
    q, s = quant.quantize_codes(w, fmt)
    assert s[0, 0].item() == step
    assert torch.equal(q[0, 1:1 + len(halves)], expected)
    deq = quant.dequantize(quant.pack(w, fmt), fmt, (1, group))
    assert torch.equal(deq[0, 1:1 + len(halves)], expected.float() * step)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_take_rows_is_the_row_subset_of_the_pack(fmt):
    w = _weights((12, 100), seed=4)
    buf = quant.pack(w, fmt)
    rows = torch.tensor([7, 0, 3, 3, 11])
    got = quant.take_rows(buf, fmt, (12, 100), rows)
    assert got.numel() == quant.nbytes(fmt, (5, 100))
    assert torch.equal(quant.dequantize(got, fmt, (5, 100)), quant.dequantize(buf, fmt, (12, 100))[rows])


@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
def test_packed_and_dense_embeddings_look_up_the_same_rows(fmt):
    """engine/model/weights.Embedding: a packed table's lookup (rows dequantized on the fly) and a dense copy's (kept
    when it is small, weights.DENSE_EMBED_MAX) give the same bits."""
    from ninfer_bench.engine.model.weights import Embedding, RawWeight

    w = _weights((50, 70), seed=5)
    raw = RawWeight(fmt, (50, 70), quant.pack(w, fmt))
    ids = torch.tensor([[3, 49, 0], [3, 7, 7]])
    for dtype in (torch.float32, torch.bfloat16):
        dense, packed = Embedding(raw, dtype, "cpu", dense=True), Embedding(raw, dtype, "cpu", dense=False)
        assert dense.table is not None and packed.table is None
        assert torch.equal(dense(ids), packed(ids)) and dense(ids).shape == (2, 3, 70)
