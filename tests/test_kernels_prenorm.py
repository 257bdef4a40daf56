"""The RMSNorm split between two projections (kernels/prenorm.py): qmv's RES epilogue (residual add, r * (1 + w),
per-tile sums of r^2) and its NORM build (the norm's scale on the sums), against the fused norm kernel's
references. The finishing of a Prenormed as a tensor runs everywhere; the kernels need CUDA and cupy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer_bench.engine import quant
from ninfer_bench.kernels import fused, qmv_cuda
from ninfer_bench.kernels import qlinear as ql
from ninfer_bench.kernels.prenorm import Prenormed

needs_qmv = pytest.mark.skipif(not qmv_cuda.available(), reason=f"qmv_cuda cannot run here: "
                                                                  f"{qmv_cuda.import_error()}")
needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
                                reason="programmatic dependent launch needs an sm_90+ GPU")
EPS = 1e-6


def rel_rms(y, ref) -> float:
    return float((y.float().cpu() - ref.float().cpu()).norm() / ref.float().cpu().norm())


def pieces(r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the RES epilogue leaves for residual ``r [T, N]`` and norm weight ``w``: ``r * (1 + w)`` rounded to
    r's dtype and the fp32 sums of r^2 over each 16 columns."""
    t, n = r.shape
    tiles = qmv_cuda.norm_parts(n)
    sq = F.pad(r.float() ** 2, (0, tiles * 16 - n))
    return (r.float() * (1 + w.float())).to(r.dtype), sq.view(t, tiles, 16).sum(-1)


def residual_case(t: int, n: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = (torch.randn(t, n, generator=g) * 4).to(torch.bfloat16)
    r[:, ::37] *= 20  # a few large channels, as residual streams have
    w = torch.randn(n, generator=g) * 0.3
    return r.to(device), w.to(device)


@pytest.mark.parametrize("t,n", [(1, 64), (3, 200), (8, 5120)])
def test_dense_is_the_rms_norm(t, n):
    """A Prenormed finished as a tensor is the zero-centred RMSNorm of the residual (two bf16 roundings)."""
    r, w = residual_case(t, n, seed=n)
    xs, part = pieces(r, w)
    got = Prenormed(xs, part, EPS).dense()
    assert got.shape == r.shape and got.dtype == r.dtype
    assert rel_rms(got, fused.rms_norm_ref(r.float(), w, EPS)) < 6e-3


def test_prenorm_limits():
    """The NORM build holds MAX_T x K / 16 partial sums in shared memory: K up to 8192."""
    assert qmv_cuda.prenorm_supported(8192) and not qmv_cuda.prenorm_supported(8208)
    assert qmv_cuda.norm_parts(5120) == 320 and qmv_cuda.norm_parts(200) == 13


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
def test_add_norm_is_the_projection_then_the_residual_add(fmt, n, k, t, splits):
    """RES: r is the plain projection (same bits) plus the residual, rounded as fused.add_rms_norm stores it; xs is
    r * (1 + w) rounded once; part is each 16 columns' sum of r^2 - whole tiles, a last partial tile, split-K."""
    lin, _ = weight(fmt, n, k, seed=n + k)
    g = torch.Generator().manual_seed(t)
    x = (torch.randn(t, k, generator=g) * 2).to(torch.bfloat16).cuda()
    res, w = residual_case(t, n, seed=k, device="cuda")
    w1 = (1 + w).float().contiguous()
    xs, r, part = qmv_cuda.add_norm(x, lin, res, w1, splits=splits)
    plain = qmv_cuda.qmv(x, lin, splits=splits)
    want_r = (plain.float() + res.float()).to(torch.bfloat16)
    assert torch.equal(r, want_r)
    assert torch.equal(xs, (want_r.float() * w1).to(torch.bfloat16))
    _, want_part = pieces(want_r, w)
    assert part.shape == (t, qmv_cuda.norm_parts(n))
    assert torch.allclose(part, want_part, rtol=1e-5, atol=0)
    again = qmv_cuda.add_norm(x, lin, res, w1, splits=splits)
    assert all(torch.equal(a, b) for a, b in zip(again, (xs, r, part)))  # a fixed order: the same bits


@needs_qmv
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,t,splits,warps", [(320, 1024, 1, 1, None), (200, 512, 3, 1, 4), (96, 4096, 8, 3, None),
                                                (1000, 5120, 2, None, None)])
def test_prenorm_projection_is_the_norm_then_the_projection(fmt, n, k, t, splits, warps):
    """NORM: the projection of xs scaled by the partial sums' rsqrt is the projection of the RMSNorm's output; a
    token's row does not depend on the others and repeats bit for bit."""
    lin, dense = weight(fmt, n, k, seed=3 * n + k)
    r, w = residual_case(t, k, seed=n, device="cuda")
    xs, part = pieces(r, w)
    y = qmv_cuda.qmv(xs, lin, splits=splits, warps=warps, prenorm=(part, EPS))
    want = fused.rms_norm_ref(r.float(), w, EPS).cpu() @ dense.T
    assert y.shape == (t, n) and rel_rms(y, want) < 1e-2
    assert torch.equal(qmv_cuda.qmv(xs, lin, splits=splits, warps=warps, prenorm=(part, EPS)), y)
    for i in range(t):
        one = qmv_cuda.qmv(xs[i:i + 1].contiguous(), lin, splits=splits, warps=warps, prenorm=(part[i:i + 1], EPS))
        assert torch.equal(one[0], y[i])


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
def test_prenorm_silu_epilogue(fmt):
    """NORM with ACT: silu(gate) * up of the normed projection, gate and up rows alternating in runs of 8."""
    n, k, t = 256, 1024, 4
    lin, _ = weight(fmt, n, k, seed=11)
    r, w = residual_case(t, k, seed=12, device="cuda")
    xs, part = pieces(r, w)
    y = qmv_cuda.qmv(xs, lin, prenorm=(part, EPS)).float().view(t, n // 16, 2, 8)
    want = (F.silu(y[:, :, 0].to(torch.bfloat16).float()) * y[:, :, 1].to(torch.bfloat16).float()).reshape(t, -1)
    got = qmv_cuda.qmv(xs, lin, act=True, prenorm=(part, EPS))
    assert got.shape == (t, n // 2) and rel_rms(got, want) < 1e-2


@needs_qmv
def test_prenorm_inputs_are_checked():
    lin, _ = weight("q4_g64_fp16", 64, 256, seed=1)
    xs = torch.zeros(2, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="prenorm needs"):
        qmv_cuda.qmv(xs, lin, prenorm=(torch.zeros(2, 15, device="cuda"), EPS))
    with pytest.raises(ValueError, match="add_norm: needs bf16"):
        qmv_cuda.add_norm(xs.half(), lin, torch.zeros(2, 64, dtype=torch.half, device="cuda"),
                          torch.ones(64, device="cuda"))


@needs_qmv
@needs_sm90
def test_split_norm_chain_in_a_pdl_graph():
    """A captured chain under PDL - a producer with the RES epilogue, two NORM readers of its pieces (one split-K),
    a second producer on the first reader's output - replayed on new inputs gives the eager plain launches' bits:
    each NORM block copies the partial sums only after its wait."""
    g = torch.Generator().manual_seed(5)
    down = ql.PackedLinear(quant.pack(torch.randn(1024, 2048, generator=g) * 0.05, "q4_g64_fp16"), "q4_g64_fp16",
                           (1024, 2048), "cuda")
    qkv = ql.PackedLinear(quant.pack(torch.randn(2048, 1024, generator=g) * 0.05, "q5_g64_fp16"), "q5_g64_fp16",
                          (2048, 1024), "cuda")
    z = ql.PackedLinear(quant.pack(torch.randn(96, 1024, generator=g) * 0.05, "q8_g32_fp16"), "q8_g32_fp16",
                        (96, 1024), "cuda")
    x = torch.zeros(3, 2048, dtype=torch.bfloat16, device="cuda")
    res = torch.zeros(3, 1024, dtype=torch.bfloat16, device="cuda")
    w1 = (1 + torch.randn(1024, generator=g) * 0.2).cuda()

    def chain(pdl):
        xs, r, part = qmv_cuda.add_norm(x * 1.5, down, res, w1, pdl=pdl)
        a = qmv_cuda.qmv(xs, qkv, pdl=pdl, prenorm=(part, EPS))
        b = qmv_cuda.qmv(xs, z, pdl=pdl, splits=4, prenorm=(part, EPS))
        xs2, r2, part2 = qmv_cuda.add_norm(a, down, r, w1, pdl=pdl)
        return a, b, xs2, r2, part2

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
