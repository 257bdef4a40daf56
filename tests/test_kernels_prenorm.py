"""The RMSNorm left to the projections that read it (kernels/prenorm.py): qmv's ``residual`` (the residual add as
the projection stores) and ``norm`` (the norm computed by the reading projection itself), against the norm
kernel's reference. The kernels need CUDA and cupy; the padded norm weight is checked everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer_bench.engine import quant
from ninfer_bench.kernels import fused, qmv_cuda
from ninfer_bench.kernels import qlinear as ql
from ninfer_bench.kernels.prenorm import Prenormed, norm_w1

needs_qmv = pytest.mark.skipif(not qmv_cuda.available(), reason=f"qmv_cuda cannot run here: "
                                                                  f"{qmv_cuda.import_error()}")
needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
                                reason="programmatic dependent launch needs an sm_90+ GPU")
EPS = 1e-6


def rel_rms(y, ref) -> float:
    return float((y.float().cpu() - ref.float().cpu()).norm() / ref.float().cpu().norm())


def residual_case(t: int, n: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = (torch.randn(t, n, generator=g) * 4).to(torch.bfloat16)
    r[:, ::37] *= 20  # a few large channels, as residual streams have
    w = torch.randn(n, generator=g) * 0.3
    return r.to(device), w.to(device)


def test_norm_weight_is_one_plus_w_padded():
    w = torch.randn(1000)
    w1 = norm_w1(w, torch.bfloat16)
    assert w1.shape == (1024,) and w1.dtype == torch.bfloat16
    assert torch.equal(w1[:1000], (1 + w).to(torch.bfloat16)) and not w1[1000:].any()


def weight(fmt: str, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    if fmt == qmv_cuda.DENSE_FMT:
        dense = w.to(torch.bfloat16).cuda()
        return qmv_cuda.DenseWeight(dense), dense.float().cpu()
    buf = quant.pack(w, fmt)
    return ql.PackedLinear(buf, fmt, (n, k), "cuda"), quant.dequantize(buf, fmt, (n, k))


FORMATS = [*quant.QUANT_FORMATS, qmv_cuda.DENSE_FMT]


@needs_qmv
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,t,splits", [(320, 1024, 1, 1), (200, 512, 3, 1), (5120, 2048, 8, None),
                                          (96, 4096, 2, 3)])
def test_residual_is_the_projection_then_the_add(fmt, n, k, t, splits):
    """``residual``: the plain projection's bits plus the residual, rounded as fused.add_rms_norm stores it - whole
    tiles, a last partial tile, split-K."""
    lin, _ = weight(fmt, n, k, seed=n + k)
    g = torch.Generator().manual_seed(t)
    x = (torch.randn(t, k, generator=g) * 2).to(torch.bfloat16).cuda()
    res, _ = residual_case(t, n, seed=k, device="cuda")
    r = qmv_cuda.qmv(x, lin, splits=splits, residual=res)
    want = (qmv_cuda.qmv(x, lin, splits=splits).float() + res.float()).to(torch.bfloat16)
    assert torch.equal(r, want)


@needs_qmv
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,t,warps", [(320, 1024, 1, None), (200, 512, 3, 4), (96, 4096, 8, None),
                                         (1000, 5120, 2, None), (64, 1000, 4, None)])
def test_norm_projection_is_the_norm_then_the_projection(fmt, n, k, t, warps):
    """``norm``: the projection of r computed with the norm inside is the projection of fused.rms_norm's output
    (K = 1000: a partial last group, w1 zero past K); a token's row does not depend on the others and repeats bit
    for bit."""
    if fmt == qmv_cuda.DENSE_FMT and k % 64:
        pytest.skip("dense weights take K in whole groups of 64")
    lin, dense = weight(fmt, n, k, seed=3 * n + k)
    r, w = residual_case(t, k, seed=n, device="cuda")
    w1 = norm_w1(w, torch.bfloat16)
    y = qmv_cuda.qmv(r, lin, warps=warps, norm=(w1, EPS))
    want = fused.rms_norm_ref(r.float(), w, EPS).cpu() @ dense.T
    assert y.shape == (t, n) and rel_rms(y, want) < 1e-2
    unsplit = qmv_cuda.qmv(fused.rms_norm(r, w, EPS), lin, warps=warps)  # the launch it replaces
    assert rel_rms(y, unsplit.float()) < 1e-2
    assert torch.equal(qmv_cuda.qmv(r, lin, warps=warps, norm=(w1, EPS)), y)
    for i in range(t):
        assert torch.equal(qmv_cuda.qmv(r[i:i + 1].contiguous(), lin, warps=warps, norm=(w1, EPS))[0], y[i])


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
def test_norm_with_the_silu_epilogue(fmt):
    """``norm`` with ``act``: silu(gate) * up of the normed projection, gate and up rows alternating in runs of 8."""
    n, k, t = 256, 1024, 4
    lin, _ = weight(fmt, n, k, seed=11)
    r, w = residual_case(t, k, seed=12, device="cuda")
    w1 = norm_w1(w, torch.bfloat16)
    y = qmv_cuda.qmv(r, lin, norm=(w1, EPS)).float().view(t, n // 16, 2, 8)
    want = (F.silu(y[:, :, 0]) * y[:, :, 1]).reshape(t, -1)
    got = qmv_cuda.qmv(r, lin, act=True, norm=(w1, EPS))
    assert got.shape == (t, n // 2) and rel_rms(got, want) < 1e-2


@needs_qmv
def test_prenormed_readers():
    """A PackedLinear reading a Prenormed runs qmv's norm; rows past qmv's kernels (65) take the norm kernel's
    output; dense() is fused.rms_norm's bits."""
    lin, _ = weight("q4_g64_fp16", 96, 512, seed=2)
    for rows in (3, 65):
        r, w = residual_case(rows, 512, seed=rows, device="cuda")
        x = Prenormed(r, w.float(), norm_w1(w, torch.bfloat16), EPS)
        assert torch.equal(x.dense(), fused.rms_norm(r, w.float(), EPS))
        assert rel_rms(lin(x), lin(x.dense()).float()) < 1e-2


@needs_qmv
def test_norm_inputs_are_checked():
    lin, _ = weight("q4_g64_fp16", 64, 256, seed=1)
    x = torch.zeros(2, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="norm weight must be"):
        qmv_cuda.qmv(x, lin, norm=(torch.ones(128, dtype=torch.bfloat16, device="cuda"), EPS))
    with pytest.raises(ValueError, match="residual must be"):
        qmv_cuda.qmv(x, lin, residual=torch.zeros(2, 63, dtype=torch.bfloat16, device="cuda"))


@needs_qmv
@needs_sm90
def test_split_norm_chain_in_a_pdl_graph():
    """A captured chain under PDL - a projection adding the residual, two readers of the norm (one on a dense
    weight), a second residual projection - replayed on new inputs gives the eager plain launches' bits."""
    g = torch.Generator().manual_seed(5)
    down = ql.PackedLinear(quant.pack(torch.randn(1024, 2048, generator=g) * 0.05, "q4_g64_fp16"), "q4_g64_fp16",
                           (1024, 2048), "cuda")
    qkv = ql.PackedLinear(quant.pack(torch.randn(2048, 1024, generator=g) * 0.05, "q5_g64_fp16"), "q5_g64_fp16",
                          (2048, 1024), "cuda")
    ba = qmv_cuda.DenseWeight((torch.randn(96, 1024, generator=g) * 0.05).to(torch.bfloat16).cuda())
    x = torch.zeros(3, 2048, dtype=torch.bfloat16, device="cuda")
    res = torch.zeros(3, 1024, dtype=torch.bfloat16, device="cuda")
    w1 = norm_w1((torch.randn(1024, generator=g) * 0.2).cuda(), torch.bfloat16)

    def chain(pdl):
        r = qmv_cuda.qmv(x * 1.5, down, residual=res, pdl=pdl)
        a = qmv_cuda.qmv(r, qkv, pdl=pdl, norm=(w1, EPS))
        b = qmv_cuda.qmv(r, ba, pdl=pdl, norm=(w1, EPS))
        r2 = qmv_cuda.qmv(a, down, residual=r, pdl=pdl)
        return r, a, b, r2

    chain(True)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for seed in range(3):
        gi = torch.Generator().manual_seed(100 + seed)
        x.copy_(torch.randn(3, 2048, generator=gi).to(torch.bfloat16))
        res.copy_((torch.randn(3, 1024, generator=gi) * 3).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(out, chain(False)):
            assert torch.equal(got, want), f"input {seed}"
