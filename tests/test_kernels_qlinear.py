"""Fused quantized projections: every Triton variant and PackedLinear against the fp32 reference.

On a machine without CUDA the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by
triton_interp before the kernels are first jitted); there bf16 is left to the GPU: the interpreter
multiplies bf16 dot operands as raw integers and truncates bf16 stores. Without Triton those tests skip
and the CPU fallback tests still run.
"""

from __future__ import annotations

import os

import pytest
import torch

import triton_interp  # noqa: E402,F401  (sets TRITON_INTERPRET=1 without CUDA, fixes the interpreter)

CUDA = torch.cuda.is_available()

from ninfer_bench.kernels import quant  # noqa: E402
from ninfer_bench.kernels import qlinear as ql  # noqa: E402

QC = ql.QConfig
FMTS = quant.QUANT_FORMATS
DEVICE = "cuda" if CUDA else "cpu"

# Relative RMS error against the fp32 reference, per x dtype. fp32: summation order only. fp16: the
# output's rounding (2^-11) and the dot kernel's q * scale rounded to fp16. bf16: the same with 8-bit
# mantissas (~1.6e-3 each); the interpreter truncates bf16 stores (up to 2^-7).
TOL = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 6e-3 if CUDA else 1.2e-2}


# The gemv sums (128 + u) * x and takes 128 - qmin times the sum of x off per word: fp32 partial sums ~30x
# the result's, so an output that nearly cancels (N = 1 gives a single one) can lose ~2^-24 * 30 / |y|.
GEMV_TOL_FP32 = 1e-3


def _triton_skip_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA and TRITON_INTERPRET is not 1"
    return None


SKIP = _triton_skip_reason()
needs_triton = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _case(fmt, n, k, t, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w.view(-1)[::29] *= 8.0  # outliers: groups with a large amax
    buf = quant.pack(w, fmt)
    x = torch.randn(t, k, generator=g).to(dtype)
    lin = ql.PackedLinear(buf, fmt, (n, k), DEVICE)
    return buf, lin, x.to(DEVICE), ql.qlinear_ref(x, buf, fmt, (n, k))


def _rel_rms(y, ref):
    y = y.float().cpu()
    assert torch.isfinite(y).all(), "unwritten (NaN) or non-finite outputs"
    return ((y - ref).norm() / ref.norm()).item()


def _run(lin, x, cfg):
    out = torch.full((x.shape[0], lin.n), float("nan"), dtype=x.dtype, device=x.device)
    y = ql.qlinear_triton(x, lin, cfg, out=out)
    assert y is out
    return y


# (N, K, T): N not a multiple of any tile, K a multiple of the group or not (100: logical K < padded K)
GEMV_SHAPES = [(1, 64, 1), (7, 100, 1), (200, 320, 1), (96, 192, 3)]
DOT_SHAPES = [(1, 64, 1), (7, 100, 7), (96, 192, 8), (200, 320, 16), (33, 192, 17)]
KERNEL_DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.float16]


@needs_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES + ([] if CUDA else [torch.bfloat16]), ids=str)
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
def test_gemv_vs_ref(fmt, shape, dtype):
    n, k, t = shape
    _, lin, x, ref = _case(fmt, n, k, t, dtype)
    tol = GEMV_TOL_FP32 if dtype == torch.float32 else TOL[dtype]
    for cfg in (QC("gemv", 16, gps=2), QC("gemv", 64, gps=1, split_k=2)):
        assert _rel_rms(_run(lin, x, cfg), ref) <= tol, cfg


@needs_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", DOT_SHAPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
def test_dot_vs_ref(fmt, shape, dtype):
    n, k, t = shape
    _, lin, x, ref = _case(fmt, n, k, t, dtype, seed=1)
    cfgs = [QC("dot", 16, gps=2), QC("dot", 32, gps=1, split_k=3)]
    if CUDA:
        cfgs += [QC("dot", 64, gps=4, split_k=2), QC("dot", 128, gps=2, split_k=4, num_warps=8)]
    for cfg in cfgs:
        assert _rel_rms(_run(lin, x, cfg), ref) <= TOL[dtype], cfg


@needs_triton
@pytest.mark.parametrize("cfg", [QC("gemv", 16, gps=1, split_k=3), QC("dot", 16, gps=1, split_k=4)], ids=str)
def test_split_k_adds_the_slices_in_split_order(cfg):
    """Split-K partial tiles go to their own workspace slices and the last program adds them in split order:
    the output is exactly that ordered fp32 sum (deterministic, whichever program finishes first), and every
    tile counter is back at zero."""
    t = 3
    _, lin, x, ref = _case("q4_g64_fp16", 40, 640, t, torch.float32, seed=5)
    y = _run(lin, x, cfg)
    assert _rel_rms(y, ref) <= GEMV_TOL_FP32
    ws, counters = ql._WORKSPACES[x.device]  # keyed by the GPU's index (cuda:0)
    splits = -(-lin.ng // (-(-(-(-lin.ng // cfg.split_k)) // cfg.gps) * cfg.gps))
    assert splits == cfg.split_k
    pieces = ws[:splits * t * lin.n].view(splits, t, lin.n)
    total = pieces[0].clone()
    for s in range(1, splits):
        total += pieces[s]
    assert torch.equal(y, total)
    assert not counters.any()
    for _ in range(3):
        assert torch.equal(_run(lin, x, cfg), y)


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
def test_default_config_and_wide_t(fmt):
    """choose_config's pick for T = 1 and for a T that needs two row tiles of x."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    for t in (1, 20):
        _, lin, x, ref = _case(fmt, 48, 192, t, dtype, seed=2)
        tol = GEMV_TOL_FP32 if dtype == torch.float32 and t == 1 else TOL[dtype]
        assert _rel_rms(ql.qlinear_triton(x, lin), ref) <= tol


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
def test_dequant_kernel(fmt):
    buf, lin, _, _ = _case(fmt, 37, 100, 1, torch.float32)
    w = ql.qlinear_dequant(lin, torch.float32).cpu()
    torch.testing.assert_close(w, quant.dequantize(buf, fmt, (37, 100)), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_linear_cpu_fallback(fmt, dtype):
    buf = quant.pack(torch.randn(24, 100), fmt)
    x = torch.randn(2, 3, 100).to(dtype)
    ref = ql.qlinear_ref(x.reshape(6, 100), buf, fmt, (24, 100)).reshape(2, 3, 24)
    for cached in (True, False):
        lin = ql.PackedLinear(buf, fmt, (24, 100), "cpu", dense_fallback=cached)
        y = lin(x)
        assert y.shape == (2, 3, 24) and y.dtype == dtype
        assert ((y.float() - ref).norm() / ref.norm()).item() <= (1e-5 if dtype == torch.float32 else 1e-2)
        assert (dtype in lin._dense) == cached


@pytest.mark.parametrize("fmt", FMTS)
def test_packed_linear_from_a_view_at_an_odd_offset(fmt):
    """A weight stored at an odd byte offset of a bigger buffer (a memory-mapped file's section, say) is copied
    once to an aligned buffer instead of failing on the 4-byte word view."""
    buf = quant.pack(torch.randn(24, 128), fmt)
    big = torch.zeros(buf.numel() + 3, dtype=torch.uint8)
    big[3:].copy_(buf)
    lin = ql.PackedLinear(big[3:], fmt, (24, 128), "cpu")
    assert lin.buf.data_ptr() % 16 == 0
    x = torch.randn(3, 128)
    ref = ql.qlinear_ref(x, buf, fmt, (24, 128))
    assert ((lin(x) - ref).norm() / ref.norm()).item() <= 1e-5


def test_packed_linear_rejects_bad_input():
    buf = quant.pack(torch.randn(8, 64), "q4_g64_fp16")
    with pytest.raises(ValueError, match="fmt"):
        ql.PackedLinear(buf, "q3", (8, 64), "cpu")
    with pytest.raises(ValueError, match="bytes"):
        ql.PackedLinear(buf[:-1], "q4_g64_fp16", (8, 64), "cpu")
    with pytest.raises(ValueError, match="K=64"):
        ql.PackedLinear(buf, "q4_g64_fp16", (8, 64), "cpu")(torch.randn(2, 65))


def test_choose_config_is_valid():
    for fmt in FMTS:
        for n, k in ((5120, 6144), (248320, 5120), (7, 100)):
            for t in (1, 2, 7, 16, 33, 64):
                cfg = ql.choose_config(fmt, n, k, t)
                assert cfg.kind == ("gemv" if t == 1 else "dot") and cfg.split_k >= 1
    with pytest.raises(ValueError, match="block_n"):
        QC("dot", 8)
    with pytest.raises(ValueError, match="power of two"):
        QC("gemv", 48)
    with pytest.raises(ValueError, match="kind"):
        QC("wdot", 64)


@cuda_only
@pytest.mark.parametrize("fmt", FMTS)
def test_cuda_graph_capture(fmt):
    """The default launch (first call outside the capture) replays correctly from a CUDA graph."""
    _, lin, x, _ = _case(fmt, 4096, 1024, 8, torch.bfloat16, seed=3)
    for t in (1, 8):
        xs = x[:t].clone()
        ql.qlinear_triton(xs, lin)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = ql.qlinear_triton(xs, lin)
        xs.copy_(torch.randn_like(xs))
        g.replay()
        torch.cuda.synchronize()
        ref = ql.qlinear_ref(xs, lin.buf, fmt, (lin.n, lin.k))
        assert _rel_rms(y, ref) <= TOL[torch.bfloat16]


@cuda_only
def test_packed_linear_cuda_paths():
    """Rows <= MAX_KERNEL_ROWS take the kernel, wider inputs the dense weight made by the dequant kernel."""
    fmt = "q5_g64_fp16"
    _, lin, _, _ = _case(fmt, 300, 320, 1, torch.bfloat16, seed=4)
    for rows in (1, 9, ql.MAX_KERNEL_ROWS + 1):
        x = torch.randn(rows, 320, device="cuda", dtype=torch.bfloat16)
        ref = ql.qlinear_ref(x, lin.buf, fmt, (300, 320))
        assert _rel_rms(lin(x), ref) <= TOL[torch.bfloat16]
    assert torch.bfloat16 in lin._dense


@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
def test_dequant_reads_the_tiled_layout_in_place(fmt):
    """qlinear_dequant on a TiledWeight (qmv's layout, what a tiled PackedLinear keeps) gives the row-major
    dequantization bit for bit, in the tiled and the lanes layout, a padded last tile included (N = 37)."""
    if not ql.triton_available():
        pytest.skip("needs triton")
    from ninfer_bench.kernels import qmv_cuda

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for n, k in ((37, 640), (48, 600), (16, 64 * 9)):  # a padded last tile; K past a whole group; NG % 4 != 0
        lin = ql.PackedLinear(quant.pack(torch.randn(n, k, generator=torch.Generator().manual_seed(8)), fmt), fmt,
                              (n, k), dev)
        for dtype in (torch.float32, torch.bfloat16):
            want = ql.qlinear_dequant(lin, dtype)
            if dtype == torch.float32:  # (Triton's interpreter truncates bf16 stores: bf16 is held to the kernels)
                assert torch.equal(want.cpu(), quant.dequantize(lin.buf.cpu(), fmt, (n, k), dtype))
            assert torch.equal(ql.qlinear_dequant(qmv_cuda.TiledWeight(lin), dtype), want)
            lanes = qmv_cuda.TiledWeight(lin, lanes=True)
            assert torch.equal(ql.qlinear_dequant(lanes, dtype), want)  # the word reads
            assert torch.equal(ql.qlinear_dequant(lanes, dtype, word_reads=False), want)  # the byte gathers


def test_single_pass_scope_turns_split_k_off():
    from ninfer_bench.kernels import _triton

    assert _triton.split_k_allowed()
    with _triton.single_pass():
        with _triton.single_pass():
            assert not _triton.split_k_allowed()
        assert not _triton.split_k_allowed()
    assert _triton.split_k_allowed()
