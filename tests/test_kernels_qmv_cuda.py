"""The tensor-core quantized GEMV (kernels/qmv_cuda.cu) against the fp32 reference; its split choice and fallbacks.

The kernel needs CUDA (sm_80+) and cupy: those tests skip without them. The split model and the dispatch rules
run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from ninfer_bench.kernels import quant
from ninfer_bench.kernels import qlinear as ql
from ninfer_bench.kernels import qmv_cuda

READY = qmv_cuda.available()
needs_qmv = pytest.mark.skipif(not READY, reason=f"qmv_cuda cannot run here: {qmv_cuda.import_error()}")
needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
                                reason="programmatic dependent launch needs an sm_90+ GPU")
# relative RMS vs the fp32 reference: the exact codes times x summed in fp32; the output's rounding dominates
TOL = {torch.bfloat16: 6e-3, torch.float16: 1.5e-3}


def _case(fmt, n, k, t, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w.view(-1)[::29] *= 8.0  # outliers: groups with a large amax
    buf = quant.pack(w, fmt)
    x = torch.randn(t, k, generator=g) * 3
    ref = ql.qlinear_ref(x.to(dtype), buf, fmt, (n, k))
    return ql.PackedLinear(buf, fmt, (n, k), "cuda"), x.to(dtype).cuda(), ref


def rel_rms(y, ref):
    return ((y.float().cpu() - ref).norm() / ref.norm()).item()


def _graph_replay(out: torch.Tensor, launch) -> torch.Tensor:
    """``launch()`` (which writes ``out``) run once outside a capture (its build compiled), captured into a CUDA
    graph, then replayed into a zeroed ``out``; returns ``out``."""
    launch()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return out


# (N, K): whole tiles; N not a multiple of 16 and K not of the group (the element-wise x path); a 27B-like K
SHAPES = [(64, 256), (50, 100), (37, 1152), (300, 5120)]


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("t", [1, 3, 8])
def test_matches_reference(fmt, dtype, shape, t):
    lin, x, ref = _case(fmt, *shape, t, dtype)
    y = qmv_cuda.qmv(x, lin)
    assert y.shape == (t, shape[0]) and y.dtype == dtype
    assert rel_rms(y, ref) <= TOL[dtype], f"rel RMS {rel_rms(y, ref):.2e}"


def exact_and_repeatable(launch, ref, repeats: int) -> torch.Tensor:
    """``launch()`` matches the bf16 reference, gives the same bits ``repeats`` more times (partials added in a
    fixed order, not by atomics) and leaves the split-K arrival counters at zero; returns its output."""
    first = launch()
    assert rel_rms(first, ref) <= TOL[torch.bfloat16]
    for _ in range(repeats):
        assert torch.equal(launch(), first)
    torch.cuda.synchronize()
    assert int(qmv_cuda._WORKSPACES[first.device][1].abs().sum()) == 0
    return first


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
@pytest.mark.parametrize("splits", [1, 2, 5, 64])
def test_split_k_is_exact_and_deterministic(fmt, splits):
    """Every split count gives the reference; a repeated launch gives the same bits, and the arrival counters are
    left at zero."""
    lin, x, ref = _case(fmt, 200, 2048, 8, torch.bfloat16, seed=1)
    exact_and_repeatable(lambda: qmv_cuda.qmv(x, lin, splits=splits), ref, 3)


@needs_qmv
def test_rows_do_not_depend_on_the_batch():
    """Row t of the output is the same bits whatever else is in x (what concurrent == sequential relies on)."""
    lin, x, _ = _case("q4_g64_fp16", 1000, 5120, 8, torch.bfloat16, seed=6)
    full = qmv_cuda.qmv(x, lin)
    for t in range(8):
        assert torch.equal(qmv_cuda.qmv(x[t:t + 1].contiguous(), lin)[0], full[t])


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
@pytest.mark.parametrize("unroll,min_blocks,xlate,pipe,fold", [
    (1, 2, False, False, True), (2, 4, False, False, True), (8, 1, False, False, True), (8, 2, True, False, True),
    (16, 1, True, False, True), (1, 3, False, True, True), (2, 3, False, True, True), (3, 2, False, True, True),
    (4, 2, False, True, True), (4, 3, False, False, False), (4, 3, True, False, False), (2, 2, False, True, False)])
@pytest.mark.parametrize("k,splits", [(5120, None), (5120, 1), (5120, 3), (3000, 2), (700, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_launch_variants_agree(fmt, unroll, min_blocks, xlate, pipe, fold, k, splits, dtype):
    """Every launch variant against the reference, with whole, partial (pipelined) and single step batches: K =
    5120 is 10 steps a warp (q4/q5), a split of 3 leaves uneven slices, 3000 and 700 end in a partial group."""
    lin, x, ref = _case(fmt, 96, k, 2, dtype, seed=2)
    y = qmv_cuda.qmv(x, lin, splits=splits, unroll=unroll, min_blocks=min_blocks, xlate=xlate, pipe=pipe, fold=fold)
    assert rel_rms(y, ref) <= TOL[dtype]
    if splits == 1:  # the variants with one zero-point treatment add a warp's steps in the same order: same bits
        assert torch.equal(y, qmv_cuda.qmv(x, lin, splits=1, fold=fold))


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
@pytest.mark.parametrize("unroll,min_blocks,warps,xlate", [(4, 3, 8, False), (5, 2, 8, False), (5, 3, 8, True),
                                                          (3, 3, 8, False), (4, 6, 4, False), (6, 4, 4, True)])
@pytest.mark.parametrize("k,splits,layout", [(5120, 1, "lanes"), (6144, 1, "lanes"), (17408, 1, "plain"),
                                             (3000, 2, "plain"), (700, 1, "lanes")])
def test_tail_batch_and_warps_agree(fmt, unroll, min_blocks, warps, xlate, k, splits, layout):
    """A warp's last groups as one predicated batch (``tail``) add the same steps in the same order as one step at
    a time: the same bits; other warp counts (another order of the sums) match the reference, repeat bit for
    bit, and a row does not depend on the others."""
    lin, x, ref = _case(fmt, 96, k, 3, torch.bfloat16, seed=31)
    w = qmv_cuda.TiledWeight(lin, lanes=True) if layout == "lanes" else lin
    kw = dict(splits=splits, unroll=unroll, min_blocks=min_blocks, warps=warps, xlate=xlate)
    y = qmv_cuda.qmv(x, w, tail=True, **kw)
    assert rel_rms(y, ref) <= TOL[torch.bfloat16]
    assert torch.equal(y, qmv_cuda.qmv(x, w, tail=False, **kw))
    assert torch.equal(y, qmv_cuda.qmv(x, w, tail=True, **kw))
    assert torch.equal(y[1], qmv_cuda.qmv(x[1:2].contiguous(), w, tail=True, **kw)[0])


@needs_qmv
def test_unaligned_x_and_out_buffer():
    """x whose rows are not 16-byte aligned takes the element-wise path; ``out`` is written in place."""
    lin, x, ref = _case("q5_g64_fp16", 48, 512, 4, torch.bfloat16, seed=3)
    flat = torch.empty(4 * 512 + 1, dtype=x.dtype, device="cuda")
    xs = flat[1:].view(4, 512)
    xs.copy_(x)
    assert xs.is_contiguous() and xs.data_ptr() % 16 != 0
    out = torch.full((4, 48), float("nan"), dtype=x.dtype, device="cuda")
    assert qmv_cuda.qmv(xs, lin, out) is out
    assert rel_rms(out, ref) <= TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="out must be"):
        qmv_cuda.qmv(x, lin, torch.empty(4, 47, dtype=x.dtype, device="cuda"))


@needs_qmv
def test_cuda_graph_replay():
    lin, x, ref = _case("q4_g64_fp16", 128, 1024, 1, torch.bfloat16, seed=4)
    out = torch.empty(1, 128, dtype=x.dtype, device="cuda")
    qmv_cuda.qmv(x, lin, out)  # compiles and loads the module outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        qmv_cuda.qmv(x, lin, out, splits=3)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert rel_rms(out, ref) <= TOL[torch.bfloat16]


@needs_qmv
def test_packed_linear_runs_wider_inputs_in_one_launch():
    lin, x, ref = _case("q4_g64_fp16", 64, 256, 8, torch.bfloat16, seed=5)
    assert qmv_cuda.supports(torch.cat([x] * 8), lin) and not qmv_cuda.supports(torch.cat([x] * 8 + [x[:1]]), lin)
    assert not qmv_cuda.supports(x.float(), lin)
    big = torch.cat([x, x.flip(0), x[:3]])  # 19 rows: one launch of 3 column groups (compiled for 4)
    y = lin(big)
    assert torch.equal(y[:8], qmv_cuda.qmv(x, lin)) and torch.equal(y[8:16], qmv_cuda.qmv(x.flip(0), lin))
    assert rel_rms(y[16:], ref[:3]) <= TOL[torch.bfloat16]


# (N, K, splits): split-K over a narrow weight, one pass, K ending in a partial group (the element-wise x path)
WIDE_CASES = [(200, 2048, None), (1000, 5120, 1), (96, 700, None), (37, 1152, 3)]


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS + ("dense",))
@pytest.mark.parametrize("n,k,splits", WIDE_CASES, ids=[f"{n}x{k}-s{s}" for n, k, s in WIDE_CASES])
def test_wide_launch_rows_are_one_row_launches(fmt, n, k, splits):
    """9-64 rows in one launch (2, 4 or 8 column groups): every row is the bits of that row launched alone, and of
    launches of 8 rows - the weight's fragments are shared, each column group's sums are its own - with split-K,
    PDL and a graph replay; the launch matches the reference."""
    if fmt == "dense":
        if k % 64:
            pytest.skip("DenseWeight needs K a multiple of 64")
        g = torch.Generator().manual_seed(41)
        w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
        lin, ref_w = qmv_cuda.DenseWeight(w.cuda()), w.float()
        x = (torch.randn(64, k, generator=g) * 3).to(torch.bfloat16).cuda()
        ref = x.float().cpu() @ ref_w.T
    else:
        lin, x, ref = _case(fmt, n, k, 64, torch.bfloat16, seed=41)
    for t in (9, 16, 23, 33, 64):
        xt = x[:t].contiguous()
        y = qmv_cuda.qmv(xt, lin, splits=splits)
        assert rel_rms(y, ref[:t]) <= TOL[torch.bfloat16]
        assert torch.equal(y, qmv_cuda.qmv_rows(xt, lin, rows=8) if splits is None else
                           torch.cat([qmv_cuda.qmv(xt[i:i + 8], lin, splits=splits) for i in range(0, t, 8)]))
        for r in sorted({0, 7, 8, t - 1}):
            assert torch.equal(y[r], qmv_cuda.qmv(xt[r:r + 1], lin, splits=splits)[0]), f"T={t} row {r}"
    if torch.cuda.get_device_capability() >= (9, 0):
        assert torch.equal(qmv_cuda.qmv(x, lin, splits=splits, pdl=True), qmv_cuda.qmv(x, lin, splits=splits))
    torch.cuda.synchronize()
    assert int(qmv_cuda._WORKSPACES[x.device][1].abs().sum()) == 0  # split-K counters left at zero
    out = torch.empty(64, n, dtype=x.dtype, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the weight reserved its widest launch's scratch when it was built
        qmv_cuda.qmv(x, lin, out, splits=splits)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, qmv_cuda.qmv(x, lin, splits=splits))


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
def test_wide_launch_variants_keep_the_bits(fmt):
    """Other registers a thread (min_blocks) and step batches (unroll) for a 32-row launch (and 20 rows: 3 column
    groups), split-K and one pass: the same sums in the same order; the one-column-group tuning knobs are refused
    over 8 rows."""
    lin, x, ref = _case(fmt, 300, 5120, 32, torch.bfloat16, seed=43)
    y = qmv_cuda.qmv(x, lin)
    assert rel_rms(y, ref) <= TOL[torch.bfloat16]
    for kw in ({"min_blocks": 1}, {"min_blocks": 3, "unroll": 2}, {"unroll": 1}, {"splits": 1},
               {"splits": 1, "min_blocks": 2}):
        want = y if "splits" not in kw else qmv_cuda.qmv(x, lin, splits=1)
        assert torch.equal(qmv_cuda.qmv(x, lin, **kw), want), kw
        assert torch.equal(qmv_cuda.qmv(x[:20].contiguous(), lin, **kw), want[:20]), kw  # 3 column groups
    for kw in ({"xlate": True}, {"pipe": True}, {"tail": True}):
        with pytest.raises(ValueError, match="at most 8 rows"):
            qmv_cuda.qmv(x, lin, **kw)


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
@pytest.mark.parametrize("n,k,splits", [(300, 5120, None), (200, 2048, 3), (37, 1152, None)],
                         ids=["300x5120", "200x2048-s3", "37x1152"])
def test_tiles_a_block_keep_the_bits(fmt, n, k, splits):
    """2 and 3 row tiles a block (x loaded once for all of them) give one tile a block's bits at 4 and 8 column
    groups, with split-K, tile counts they do not divide (the last block's extra tiles never stored), PDL, and the
    silu epilogue (an interleaved gate / up weight); one column group refuses them."""
    lin, x, _ = _case(fmt, n, k, 64, torch.bfloat16, seed=47)
    for t in (20, 64):
        xt = x[:t].contiguous()
        want = qmv_cuda.qmv(xt, lin, splits=splits, tiles=1)
        for kw in ({"tiles": 2, "unroll": 1}, {"tiles": 3, "unroll": 1}):
            assert torch.equal(qmv_cuda.qmv(xt, lin, splits=splits, **kw), want), (t, kw)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert torch.equal(qmv_cuda.qmv(x, lin, splits=splits, tiles=2, pdl=True), qmv_cuda.qmv(x, lin, splits=splits))
    torch.cuda.synchronize()
    assert int(qmv_cuda._WORKSPACES[x.device][1].abs().sum()) == 0  # split-K counters left at zero
    if n % 16 == 0:
        assert torch.equal(qmv_cuda.qmv(x, lin, act=True, tiles=2, unroll=1), qmv_cuda.qmv(x, lin, act=True))
    with pytest.raises(ValueError, match="more than 8 rows"):
        qmv_cuda.qmv(x[:8].contiguous(), lin, tiles=2)


# (N, K, splits): warps that get no step (K of 4 q4 groups), split-K, tiles the row tiles a block do not divide
RING_CASES = [(64, 256, None), (200, 2048, 3), (37, 1152, None), (1000, 5120, 1)]


def _pdl_graph_act_keep_the_bits(x, lin, splits, build: dict, act_build: dict) -> None:
    """qmv with the keywords ``build`` gives the register build's bits under PDL (sm_90+) and replayed from a CUDA
    graph, leaves the split-K counters at zero, and with ``act_build`` gives its silu epilogue's bits."""
    want = qmv_cuda.qmv(x, lin, splits=splits, stages=0)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert torch.equal(qmv_cuda.qmv(x, lin, splits=splits, pdl=True, **build), want)
    torch.cuda.synchronize()
    assert int(qmv_cuda._WORKSPACES[x.device][1].abs().sum()) == 0  # split-K counters left at zero
    out = torch.empty_like(want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qmv_cuda.qmv(x, lin, out, splits=splits, **build)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    if lin.n % 16 == 0:
        assert torch.equal(qmv_cuda.qmv(x, lin, act=True, **act_build), qmv_cuda.qmv(x, lin, act=True, stages=0))


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
@pytest.mark.parametrize("n,k,splits", RING_CASES, ids=[f"{n}x{k}-s{s}" for n, k, s in RING_CASES])
def test_async_ring_keeps_the_bits(fmt, n, k, splits):
    """Weights streamed through a cp.async ring in shared memory (1-6 stages) give the register build's bits at 1,
    8, 20 and 64 rows, with 1-3 row tiles a block, split-K, warps that get no step, PDL, a CUDA graph and the silu
    epilogue, past 48 KB of shared memory too; a layout other than lanes refuses an explicit ring."""
    base, x, ref = _case(fmt, n, k, 64, torch.bfloat16, seed=53)
    lin = qmv_cuda.TiledWeight(base, lanes=True)
    for t in (1, 8, 20, 64):
        xt = x[:t].contiguous()
        want = qmv_cuda.qmv(xt, lin, splits=splits, stages=0)
        assert rel_rms(want, ref[:t]) <= TOL[torch.bfloat16]
        builds = [{"stages": s} for s in (1, 2, 4, 6)]
        if t > 8:
            builds += [{"stages": 3, "tiles": 2}, {"stages": 6, "tiles": 3, "min_blocks": 1}]
        for kw in builds:
            assert torch.equal(qmv_cuda.qmv(xt, lin, splits=splits, **kw), want), (t, kw)
    _pdl_graph_act_keep_the_bits(x, lin, splits, {"stages": 4}, {"stages": 4, "tiles": 2})
    with pytest.raises(ValueError, match="lanes layout"):
        qmv_cuda.qmv(x, base, stages=4)
    with pytest.raises(ValueError, match="stages"):
        qmv_cuda.qmv(x[:4].contiguous(), lin, stages=2, tail=True)


def test_async_ring_shared_bytes():
    """A ring's shared memory: 20 bytes a lane, stage, tile and warp (q5: 24, its high bits); none without one."""
    assert qmv_cuda.async_shared_bytes("q4_g64_fp16", 4, 4, 3) == 4 * 4 * 3 * 32 * 20
    assert qmv_cuda.async_shared_bytes("q5_g64_fp16", 8, 2) == 8 * 2 * 32 * 24
    assert qmv_cuda.async_shared_bytes("q8_g32_fp16", 8, 0, 3) == 0


def test_wide_builds_parse():
    assert qmv_cuda._wide_builds("8:p2u1b1, 4:p2u2") == {(8, None): {"tiles": 2, "unroll": 1, "min_blocks": 1},
                                                          (4, None): {"tiles": 2, "unroll": 2}}
    assert qmv_cuda._wide_builds("8q4:p2s4b1,8q8:p1") == {
        (8, "q4_g64_fp16"): {"tiles": 2, "stages": 4, "min_blocks": 1}, (8, "q8_g32_fp16"): {"tiles": 1}}
    assert qmv_cuda._wide_builds("") == {}
    assert qmv_cuda._wide_builds("1q5:s4") == {(1, "q5_g64_fp16"): {"stages": 4}}
    for bad in ("8:q2", "3:p2", "p2", "8:", "8q6:p1", "8q4:g1s4"):
        with pytest.raises(ValueError, match="NINFER_BENCH_QMV_WIDE"):
            qmv_cuda._wide_builds(bad)


QMV_ENV = ("NINFER_BENCH_QMV_WIDE", "NINFER_BENCH_QMV_PDL_X", "NINFER_BENCH_QMV_SPLIT_CAP", "NINFER_BENCH_QMV_CLUSTER",
           "NINFER_BENCH_QMV_PIECES", "NINFER_BENCH_QMV_SHAPES")


def _check_env_knob(monkeypatch, var, key, accepted, refused):
    """qmv_cuda._load_env_knobs reads ``var`` into ``_SWITCHES[key]``: each (value, expected) of ``accepted`` (value
    None: unset), the expected value and its type exactly; each value of ``refused`` is refused naming ``var``. The
    other qmv variables are unset and the switches restored afterwards."""
    monkeypatch.setattr(qmv_cuda, "_SWITCHES", dict(qmv_cuda._SWITCHES))
    for other in QMV_ENV:
        monkeypatch.delenv(other, raising=False)
    for value, want in accepted:
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
        qmv_cuda._load_env_knobs()
        got = qmv_cuda._SWITCHES[key]
        assert got == want and type(got) is type(want), (var, value, got)
    for bad in refused:
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            qmv_cuda._load_env_knobs()


def test_pdl_x_path_knob(monkeypatch):
    """NINFER_BENCH_QMV_PDL_X picks how qmv reads x under PDL: l1 (the default), l2 (the old path); anything else is
    refused by name."""
    _check_env_knob(monkeypatch, "NINFER_BENCH_QMV_PDL_X", "pdl_x_l1",
                    [("l2", False), (" L1 ", True), ("l2", False), (None, True)], ["l3"])


needs_clusters = pytest.mark.skipif(not (READY and torch.cuda.get_device_capability() >= (9, 0)),
                                    reason="thread-block clusters need an sm_90+ GPU (and qmv_cuda)")


@needs_clusters
@pytest.mark.parametrize("fmt", [*quant.QUANT_FORMATS, "dense"])
@pytest.mark.parametrize("t", [1, 8, 64])
def test_cluster_split_k_keeps_the_bits(fmt, t):
    """A split-K launch whose tile pieces reduce in a thread-block cluster (distributed shared memory) gives the
    workspace path's bits at every split count (2-8 blocks a cluster), plainly, through the lanes layout, under PDL
    in a CUDA graph and into an fp32 store; the workspace's counters are untouched."""
    if fmt == "dense":
        g = torch.Generator().manual_seed(21)
        lins = [qmv_cuda.DenseWeight((torch.randn(200, 2048, generator=g) * 0.05).to(torch.bfloat16).cuda())]
        x = (torch.randn(t, 2048, generator=g) * 3).to(torch.bfloat16).cuda()
    else:
        lin, x, _ = _case(fmt, 200, 2048, t, torch.bfloat16, seed=22)
        lins = [lin, qmv_cuda.TiledWeight(lin, lanes=True)]
    try:
        for w in lins:
            for splits in (2, 3, 5, 8):
                qmv_cuda.set_cluster(False)
                want = qmv_cuda.qmv(x, w, splits=splits)
                want32 = qmv_cuda.qmv(x, w, splits=splits, out_f32=True) if w is lins[0] else None
                qmv_cuda.set_cluster(True)
                assert torch.equal(qmv_cuda.qmv(x, w, splits=splits), want), (type(w).__name__, splits)
                if want32 is not None:
                    assert torch.equal(qmv_cuda.qmv(x, w, splits=splits, out_f32=True), want32)
        w = lins[-1]
        out = torch.empty(t, w.n, dtype=x.dtype, device="cuda")
        _graph_replay(out, lambda: qmv_cuda.qmv(x, w, out, splits=3, pdl=True))
        qmv_cuda.set_cluster(False)
        assert torch.equal(out, qmv_cuda.qmv(x, w, splits=3, pdl=False))
    finally:
        qmv_cuda.set_cluster(True)
    torch.cuda.synchronize()
    assert int(qmv_cuda._WORKSPACES[x.device][1].abs().sum()) == 0


@needs_qmv
@pytest.mark.parametrize("fmt", [*quant.QUANT_FORMATS, "dense"])
@pytest.mark.parametrize("t", [1, 3, 8])
def test_pieces_walked_in_one_block_keep_the_split_bits(fmt, t):
    """A split launch whose pieces one block walks (PIECES) gives the split's bits - the cluster's and the
    workspace's - at 2-4 pieces, a short last piece (some warps without groups there), 4 warps a tile, x read
    element by element (K not whole groups), the lanes layout, an fp32 store and under PDL in a CUDA graph; where it
    cannot walk (a piece not a whole number of warp strides, over 8 rows) pieces=True is refused by name."""
    g = torch.Generator().manual_seed(31)
    if fmt == "dense":
        ks = (2048, 1472)
        cases = [(qmv_cuda.DenseWeight((torch.randn(200, k, generator=g) * 0.05).to(torch.bfloat16).cuda()), k)
                 for k in ks]
    else:
        group = quant.QSPEC[fmt][0]
        ks = (64 * group, 23 * group, 23 * group - 6)  # 64 / 23 groups; the last one's K not a whole group
        cases = []
        for k in ks:
            lin, _, _ = _case(fmt, 200, k, t, torch.bfloat16, seed=k)
            cases += [(lin, k), (qmv_cuda.TiledWeight(lin, lanes=True), k)] if k % group == 0 else [(lin, k)]
    try:
        for w, k in cases:
            x = (torch.randn(t, k, generator=g) * 3).to(torch.bfloat16).cuda()
            for warps in (8, 4):
                for splits in (2, 3, 4):
                    gps = -(-w.ng // splits)
                    if gps % warps or gps >= w.ng:
                        continue
                    label = (type(w).__name__, k, warps, splits)
                    qmv_cuda.set_cluster(True)
                    want = qmv_cuda.qmv(x, w, splits=splits, warps=warps, pieces=False)
                    assert torch.equal(qmv_cuda.qmv(x, w, splits=splits, warps=warps, pieces=True), want), label
                    qmv_cuda.set_cluster(False)
                    assert torch.equal(qmv_cuda.qmv(x, w, splits=splits, warps=warps, pieces=False), want), label
                    qmv_cuda.set_cluster(True)
                    if not isinstance(w, qmv_cuda.TiledWeight):
                        assert torch.equal(qmv_cuda.qmv(x, w, splits=splits, warps=warps, pieces=True, out_f32=True),
                                           want.float()), label
        w, k = cases[0]
        x = (torch.randn(t, k, generator=g) * 3).to(torch.bfloat16).cuda()
        out = torch.empty(t, w.n, dtype=x.dtype, device="cuda")
        _graph_replay(out, lambda: qmv_cuda.qmv(x, w, out, splits=2, pieces=True, pdl=True))
        assert torch.equal(out, qmv_cuda.qmv(x, w, splits=2, pieces=False, pdl=False))
        with pytest.raises(ValueError, match="pieces"):
            qmv_cuda.qmv(x, w, splits=3, pieces=True)  # 64 / 32 groups in 3: not whole strides of 8 warps
        x9 = (torch.randn(9, k, generator=g) * 3).to(torch.bfloat16).cuda()
        with pytest.raises(ValueError, match="pieces"):
            qmv_cuda.qmv(x9, w, splits=2, pieces=True)
    finally:
        qmv_cuda.set_cluster(True)


def test_pieces_rule_and_knob(monkeypatch):
    """pieces_pay: a split whose pieces are whole warp strides is walked in one block when the whole walk takes no
    more step batches than a piece (the bundled model's splits); a wider walk, or pieces that are not whole strides
    (the 27B's attention k / v), keep the split's blocks. NINFER_BENCH_QMV_PIECES is 1 (the default) or 0."""
    assert qmv_cuda.PIECES_SLACK >= 0
    assert qmv_cuda.pieces_pay(16, 8, 8, 4) and qmv_cuda.pieces_pay(32, 8, 8, 4)  # q_gate / down at 512 / 1024 wide
    assert qmv_cuda.pieces_pay(64, 32, 8, 4)  # two batches against one: walked (faster at every N measured)
    assert not qmv_cuda.pieces_pay(80, 27, 8, 4)  # 27 groups a piece: not whole strides of 8 warps
    assert not qmv_cuda.pieces_pay(16, 16, 8, 4)  # one piece: nothing to walk
    assert not qmv_cuda.pieces_pay(64, 8, 8, 4)  # 8 pieces: a reduction round each (slower at 16 row tiles)
    slack = qmv_cuda.PIECES_SLACK
    assert not qmv_cuda.pieces_pay(32 * (slack + 2) + 32, 32, 8, 4)  # slack + 2 more batches than a piece
    _check_env_knob(monkeypatch, "NINFER_BENCH_QMV_PIECES", "pieces", [("0", False), ("1 ", True)], ["yes"])


def test_cluster_knob(monkeypatch):
    """NINFER_BENCH_QMV_CLUSTER: 1 (the default) or 0; anything else is refused by name."""
    _check_env_knob(monkeypatch, "NINFER_BENCH_QMV_CLUSTER", "cluster", [("0", False), (" 1", True), (None, True)],
                    ["on"])


def test_split_cap_knob(monkeypatch):
    """NINFER_BENCH_QMV_SPLIT_CAP (a tuning run's): a cap on the split-K count qmv picks; unset, no cap; anything
    but a count >= 1 is refused by name."""
    _check_env_knob(monkeypatch, "NINFER_BENCH_QMV_SPLIT_CAP", "split_cap", [("1", 1), (" 3 ", 3), ("", 0)],
                    ["0", "two", "-1"])


def test_shape_knobs_parse_and_load(monkeypatch):
    """NINFER_BENCH_QMV_SHAPES: ``NxG:KNOBS`` entries (rows, groups of K; w warps, k splits, b blocks an SM) into
    the per-shape table; malformed or out-of-range entries are refused by name, and unset leaves it empty."""
    assert qmv_cuda.parse_shapes("5120x96:w4k2, 14336x80:w8b3") == {
        (5120, 96): {"warps": 4, "splits": 2}, (14336, 80): {"warps": 8, "min_blocks": 3}}
    assert qmv_cuda.parse_shapes("") == {}
    for bad in ("5120x96", "5120:w4", "5120x96:q4", "5120x96:w3", "5120x96:k9", "5120x96:k0", "5120x96:b0",
                "x96:w4"):
        with pytest.raises(ValueError, match="NINFER_BENCH_QMV_SHAPES"):
            qmv_cuda.parse_shapes(bad)
    monkeypatch.setattr(qmv_cuda, "_SHAPES", {})
    for other in QMV_ENV:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv("NINFER_BENCH_QMV_SHAPES", "320x96:k3")
    qmv_cuda._load_env_knobs()
    assert qmv_cuda.shape_knobs(320, 96) == {"splits": 3} and qmv_cuda.shape_knobs(320, 80) == {}
    monkeypatch.delenv("NINFER_BENCH_QMV_SHAPES")
    qmv_cuda._load_env_knobs()
    assert qmv_cuda._SHAPES == {}


def test_shape_knobs_hold_at_every_width(monkeypatch):
    """A shape's override sets its warps and split count at every launch width (the order of a row's sums, so a
    verify row keeps a step's bits), its blocks an SM only up to 8 rows; other shapes and explicit keywords keep
    theirs."""
    monkeypatch.setattr(qmv_cuda, "_SHAPES", {})
    sms, n, ng = 132, 5120, 96
    default = qmv_cuda.shape_splits(n, ng, sms)
    qmv_cuda.set_shape_knobs({(n, ng): {"warps": 4, "splits": 3, "min_blocks": 5}})
    assert qmv_cuda.shape_splits(n, ng, sms) == 3 and qmv_cuda.shape_splits(n, 80, sms) == default
    for t in (1, 8, 16, 64):
        b = qmv_cuda.launch_build("q4_g64_fp16", n, t, 2, sms, ng=ng)
        assert b.warps == 4, t
        assert (b.min_blocks == 5) == (t <= 8), (t, b)
    assert qmv_cuda.launch_build("q4_g64_fp16", n, 1, 2, sms).warps == qmv_cuda.choose_warps(n, sms)  # no ng
    assert qmv_cuda.launch_build("q4_g64_fp16", n, 1, 2, sms, ng=ng, warps=8, min_blocks=2).warps == 8
    # 7 groups cannot take 3 pieces of whole groups unevenly: the count is what whole pieces give
    qmv_cuda.set_shape_knobs({(n, 7): {"splits": 3}})
    assert qmv_cuda.shape_splits(n, 7, sms) == 3
    qmv_cuda.set_shape_knobs({(n, 4): {"splits": 3}})
    assert qmv_cuda.shape_splits(n, 4, sms) == 2  # 4 groups in pieces of 2
    qmv_cuda.set_shape_knobs(None)
    assert qmv_cuda.shape_splits(n, ng, sms) == default


def test_wave_blocks_fit_an_overfull_wave(monkeypatch):
    """A wide weight whose row tiles overfill the default's one wave (6 blocks of 4 warps an SM) but fit one of 7
    is built for 7 blocks an SM up to 8 rows (the 27B attention q | gate | k | v: 896 tiles on 132 SMs); one that
    fits the default's wave, or needs more than 7, keeps the default, as do wider launches, narrow weights, explicit
    blocks and a shape override's split."""
    monkeypatch.setattr(qmv_cuda, "_SHAPES", {})
    sms, fmt = 132, "q5_g64_fp16"
    assert qmv_cuda.wave_blocks(14336, sms, 4) == 7 and qmv_cuda.wave_blocks(16 * 6 * sms + 16, sms, 4) == 7
    for n in (16 * 6 * sms, 16 * 7 * sms + 16, 10240, 34816, 5120):
        assert qmv_cuda.wave_blocks(n, sms, qmv_cuda.choose_warps(n, sms)) is None, n
    assert qmv_cuda.wave_blocks(14336, 100, 4) is None  # 144 SMs' worth of tiles on 100: 9 an SM
    for t, want in ((1, 7), (8, 7), (16, 1)):
        assert qmv_cuda.launch_build(fmt, 14336, t, 2, sms).min_blocks == want, t
    assert qmv_cuda.launch_build(fmt, 14336, 1, 2, sms, min_blocks=6).min_blocks == 6
    assert qmv_cuda.launch_build(fmt, 10240, 1, 2, sms).min_blocks == 6
    qmv_cuda.set_shape_knobs({(14336, 80): {"splits": 2}})
    assert qmv_cuda.launch_build(fmt, 14336, 1, 2, sms, ng=80).min_blocks == 6


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
def test_shape_knobs_keep_rows_equal_across_widths(monkeypatch, fmt):
    """With a shape's override (4 warps, 3 splits) a launch matches the reference, and each row of an 8-row and a
    64-row launch is the bits of its 1-row launch, as without one."""
    monkeypatch.setattr(qmv_cuda, "_SHAPES", {})
    lin, x, ref = _case(fmt, 160, 3072, 64, torch.bfloat16, seed=11)
    qmv_cuda.set_shape_knobs({(lin.n, lin.ng): {"warps": 4, "splits": 3}})
    qmv_cuda.reserve(x.device, lin.n, lin.ng)
    y64 = qmv_cuda.qmv(x, lin)
    assert rel_rms(y64, ref) <= TOL[torch.bfloat16]
    y8 = qmv_cuda.qmv(x[:8].contiguous(), lin)
    for t in range(8):
        row = qmv_cuda.qmv(x[t:t + 1].contiguous(), lin)[0]
        assert torch.equal(row, y8[t]) and torch.equal(row, y64[t]), t


def test_wide_build_defaults(monkeypatch):
    """At 8 column groups q4 and q5 take 3 row tiles a block through a 4-stage cp.async ring by default (measured
    faster); q8, other widths and one column group take none; a NINFER_BENCH_QMV_WIDE entry for the width (or for the
    width and format) replaces the default."""
    monkeypatch.setattr(qmv_cuda, "_WIDE", {})
    for fmt in ("q4_g64_fp16", "q5_g64_fp16"):
        assert qmv_cuda.wide_build(8, fmt) == {"tiles": 3, "stages": 4, "unroll": 1, "min_blocks": 1}
    for ncol, fmt in ((8, "q8_g32_fp16"), (4, "q4_g64_fp16"), (1, "q4_g64_fp16")):
        assert qmv_cuda.wide_build(ncol, fmt) == {}, (ncol, fmt)
    monkeypatch.setattr(qmv_cuda, "_WIDE", qmv_cuda._wide_builds("8:p1,8q5:p2s4"))
    assert qmv_cuda.wide_build(8, "q4_g64_fp16") == {"tiles": 1}
    assert qmv_cuda.wide_build(8, "q5_g64_fp16") == {"tiles": 2, "stages": 4}  # its format's entry first
    assert qmv_cuda.wide_build(1, "q4_g64_fp16") == {}


def test_column_groups_and_the_shape_split():
    assert [qmv_cuda.column_groups(t) for t in (1, 8, 9, 16, 17, 24, 25, 32, 33, 64)] == [1, 1, 2, 2, 4, 4, 4, 4, 8, 8]
    assert qmv_cuda.MAX_ROWS == 64
    # the split count is the shape's alone: the same whatever the launch's width
    for n, ng in [(1024, 80), (200, 32), (34816, 80)]:
        assert qmv_cuda.shape_splits(n, ng, 132) == qmv_cuda.shape_splits(n, ng, 132, qmv_cuda.choose_warps(n, 132))


def test_split_choice_fills_the_gpu_only_when_needed():
    # many row tiles (an lm_head): no split; few (k / v projections): split until the GPU has work
    assert qmv_cuda.choose_splits(248320, 80, 132) == 1
    assert qmv_cuda.choose_splits(1024, 80, 132) > 1
    for n, ng in [(16, 1), (16, 8), (5120, 80), (5120, 272), (17, 3)]:
        s = qmv_cuda.choose_splits(n, ng, 132)
        assert 1 <= s <= max(1, ng // qmv_cuda.NW)


def test_warp_choice_depends_on_the_weight_shape_only():
    # wide weights (>= 4 tiles an SM) take 4 warps a tile and one pass; narrower ones 8
    assert qmv_cuda.choose_warps(34816, 132) == qmv_cuda.choose_warps(248320, 132) == 4
    assert qmv_cuda.choose_warps(5120, 132) == qmv_cuda.choose_warps(16, 132) == qmv_cuda.NW
    for n in (10240, 14336, 34816):
        assert qmv_cuda.choose_splits(n, 80, 132, 4, 6, 4) == 1


def test_unsupported_inputs_are_refused_with_the_reason():
    buf = quant.pack(torch.randn(16, 64), "q4_g64_fp16")
    lin = ql.PackedLinear(buf, "q4_g64_fp16", (16, 64), "cpu")
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    assert not qmv_cuda.supports(x, lin)
    with pytest.raises(ValueError, match="qmv: needs CUDA"):
        qmv_cuda.qmv(x, lin)


@needs_qmv
def test_unaligned_packed_buffer_is_realigned_for_qmv():
    """A packed weight that is a view at an odd offset of a bigger CUDA buffer is copied once to an aligned one
    (the kernels read it several bytes at a time), and then runs the tensor-core kernel."""
    g = torch.Generator().manual_seed(7)
    buf = quant.pack(torch.randn(32, 128, generator=g), "q4_g64_fp16")
    big = torch.empty(buf.numel() + 1, dtype=torch.uint8, device="cuda")
    big[1:].copy_(buf)
    lin = ql.PackedLinear(big[1:], "q4_g64_fp16", (32, 128), "cuda")
    assert lin.buf.data_ptr() % 16 == 0
    x = torch.randn(2, 128, generator=g).to(torch.bfloat16).cuda()
    assert qmv_cuda.supports(x, lin)
    assert rel_rms(lin(x), ql.qlinear_ref(x, buf, "q4_g64_fp16", (32, 128))) <= TOL[torch.bfloat16]




@needs_qmv
@needs_sm90
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
@pytest.mark.parametrize("n,k,t", [(320, 5120, 3), (96, 700, 8), (5000, 1024, 1), (200, 640, 8)])
def test_pdl_launch_equals_plain(fmt, n, k, t):
    """The PDL launch (cuLaunchKernelEx, first code loads before griddepcontrol.wait) gives the plain launch's bits,
    split-K (96 rows) and the element-wise x path (K = 700) included, and warps of fewer steps than a batch (K = 640:
    1-3 steps a warp, all loaded before the wait)."""
    lin, x, ref = _case(fmt, n, k, t, torch.bfloat16, seed=11)
    y = qmv_cuda.qmv(x, lin, pdl=True)
    assert torch.equal(y, qmv_cuda.qmv(x, lin, pdl=False))
    assert rel_rms(y, ref) <= TOL[torch.bfloat16]


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
@pytest.mark.parametrize("n,k,t,splits", [(320, 5120, 3, 1), (100, 1024, 8, 4), (5000, 1024, 1, None), (7, 700, 2, 1)])
def test_tiled_layout_equals_plain(fmt, n, k, t, splits):
    """TiledWeight (the tile-contiguous re-layout) gives the row-major launch's bits - the same sums in the same
    order from other addresses - with a padded last tile (N = 100, 7), split-K, and the element-wise x path."""
    lin, x, ref = _case(fmt, n, k, t, torch.bfloat16, seed=21)
    tw = qmv_cuda.TiledWeight(lin)
    packed = ql.PackedLinear(lin.buf, fmt, (n, k), "cuda", layout="tiled")  # keeps only the tiles
    assert packed.codes is None and torch.equal(packed(x), qmv_cuda.qmv(x, tw, splits=None))
    assert torch.equal(packed.row_major().buf, lin.buf)
    # (the Triton kernel's split-K sums are not in a fixed order: close, not equal - fp32 sums of K = 5120 products
    # in another order differ by some 1e-5 relative; torch's fp32 default, 1.3e-6, failed one element in ~500 runs)
    torch.testing.assert_close(ql.qlinear_triton(x.float(), packed.row_major()), ql.qlinear_triton(x.float(), lin),
                               rtol=5e-5, atol=5e-5)
    assert tw.codes.shape[:3] == (-(-n // 16), lin.ng, 16)
    y = qmv_cuda.qmv(x, tw, splits=splits)
    assert torch.equal(y, qmv_cuda.qmv(x, lin, splits=splits))
    assert rel_rms(y, ref) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
def test_tiled_layout_addresses(fmt):
    """(CPU) TiledWeight puts row r's group gi - code bytes, scale, q5 high bits - where the kernel's TILED pointers
    look: chunk (tile, gi) = 16 rows in a row; padding rows are zero."""
    n, k = 37, 640
    lin = ql.PackedLinear(quant.pack(torch.randn(n, k, generator=torch.Generator().manual_seed(3)), fmt), fmt,
                          (n, k), "cpu")
    tw = qmv_cuda.TiledWeight(lin)
    cb = lin.codes.shape[1] // lin.ng
    codes, scales, high = tw.codes.reshape(-1), tw.scales.reshape(-1), tw.high.reshape(-1)
    for r in range(n):
        tile, g = divmod(r, 16)
        for gi in range(lin.ng):
            at = (tile * lin.ng + gi) * 16 + g
            assert torch.equal(codes[at * cb:(at + 1) * cb], lin.codes[r, gi * cb:(gi + 1) * cb])
            assert scales[at] == lin.scales[r, gi]
            if fmt == "q5_g64_fp16":
                assert torch.equal(high[at * 8:at * 8 + 8], lin.high[r, gi * 8:gi * 8 + 8])
    assert not tw.codes[2, :, n - 32:].any()  # rows 37..47: the last tile's padding
    assert torch.equal(tw.row_major(), lin.buf)  # and back (the transient copy the Triton paths read)


@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
def test_lanes_layout_pairs_codes_with_the_same_x(fmt):
    """(CPU) TiledWeight(lanes=True), read the way the kernel's TILED 2 build reads it - one 16-byte load a lane
    (rows g and g + 8), pair i of a word = (position i, position i + 4) / (byte 0, byte 2) multiplied by x's own
    pair - gives every k the code, scale and q5 high bit the row-major build gives it (pairs with x[k], x[k + 4] /
    x[k], x[k + 2]); and it converts back to the row-major buffer."""
    n, k = 21, 320
    lin = ql.PackedLinear(quant.pack(torch.randn(n, k, generator=torch.Generator().manual_seed(4)), fmt), fmt,
                          (n, k), "cpu")
    tw = qmv_cuda.TiledWeight(lin, lanes=True)
    assert torch.equal(tw.row_major(), lin.buf)
    cb, q8 = lin.codes.shape[1] // lin.ng, fmt == "q8_g32_fp16"
    lb, xpl = cb // 4, 8 if q8 else 16
    codes, scales, high = tw.codes.reshape(-1), tw.scales.reshape(-1), tw.high.reshape(-1)

    def rowmajor_codes(r, gi, c, wd):  # {k in the group: code} of the lane's word wd, as the row-major build pairs
        w = lin.codes[r, gi * cb + lb * c + 4 * wd: gi * cb + lb * c + 4 * wd + 4].tolist()
        if q8:  # byte j = k 4 wd + j
            return {xpl * c + 4 * wd + j: w[j] for j in range(4)}
        nib = [w[p // 2] >> (4 * (p % 2)) & 15 for p in range(8)]  # position p = k 8 wd + p
        return {xpl * c + 8 * wd + p: nib[p] for p in range(8)}

    def lanes_codes(word, c, wd):  # the same from the lanes layout: pair i = x's pair i
        if q8:  # bytes k0 k2 k1 k3
            return {xpl * c + 4 * wd + j: word[[0, 2, 1, 3][j]] for j in range(4)}
        nib = [word[p // 2] >> (4 * (p % 2)) & 15 for p in range(8)]
        return {xpl * c + 8 * wd + 2 * i + h: nib[i + 4 * h] for i in range(4) for h in range(2)}

    for tile in range(-(-n // 16)):
        for gi in range(lin.ng):
            chunk = tile * lin.ng + gi
            for g in range(8):
                for c in range(4):
                    at = chunk * 16 * cb + (g * 4 + c) * 2 * lb  # L.cp0: 2 lb bytes, row g then row g + 8
                    piece = codes[at:at + 2 * lb].tolist()
                    s = scales[chunk * 16 + 2 * g: chunk * 16 + 2 * g + 2]  # L.sp0: the two rows' scales
                    hb = high[chunk * 128 + (g * 4 + c) * 4: chunk * 128 + (g * 4 + c) * 4 + 4].tolist() \
                        if fmt == "q5_g64_fp16" else None
                    for half, r in enumerate((tile * 16 + g, tile * 16 + g + 8)):
                        if r >= n:
                            assert not any(piece[half * lb:(half + 1) * lb])  # padding rows are zero
                            continue
                        assert s[half] == lin.scales[r, gi]
                        for wd in range(lb // 4):
                            word = piece[half * lb + 4 * wd: half * lb + 4 * wd + 4]
                            assert lanes_codes(word, c, wd) == rowmajor_codes(r, gi, c, wd)
                            if hb is not None:  # bit i <-> pair i's low half, bit i + 4 <-> its high half
                                old = lin.high[r, gi * 8 + 2 * c + wd].item()
                                new = hb[2 * half + wd]
                                for i in range(4):
                                    for h in range(2):
                                        assert (new >> (i + 4 * h)) & 1 == (old >> (2 * i + h)) & 1


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
@pytest.mark.parametrize("n,k,t,splits", [(320, 5120, 3, 1), (100, 1024, 8, 4), (7, 700, 2, 1)])
def test_lanes_layout_equals_plain(fmt, n, k, t, splits):
    """TILED 2 on the GPU: the row-major launch's bits (the same products, summed in the same order)."""
    lin, x, _ = _case(fmt, n, k, t, torch.bfloat16, seed=23)
    tw = qmv_cuda.TiledWeight(lin, lanes=True)
    assert torch.equal(qmv_cuda.qmv(x, tw, splits=splits), qmv_cuda.qmv(x, lin, splits=splits))


@needs_qmv
def test_tiled_dense_equals_plain():
    g = torch.Generator().manual_seed(22)
    dw = qmv_cuda.DenseWeight((torch.randn(90, 512, generator=g) * 0.05).to(torch.bfloat16).cuda())
    x = torch.randn(5, 512, generator=g).to(torch.bfloat16).cuda()
    assert torch.equal(qmv_cuda.qmv(x, qmv_cuda.TiledWeight(dw)), qmv_cuda.qmv(x, dw))


@needs_qmv
@needs_sm90
def test_pdl_dependent_chain_in_a_cuda_graph():
    """Each launch reads the output of the one before it; under PDL it may start while that one still runs and must
    wait before it reads x (and before it writes). A captured chain - a torch op, then qmv on its output, then qmv
    on qmv's output (split-K in the middle) - replayed on new inputs gives the plain eager chain's bits."""
    g = torch.Generator().manual_seed(12)
    shapes = [("q4_g64_fp16", 1024, 1024), ("q5_g64_fp16", 96, 1024), ("q8_g32_fp16", 2048, 96)]
    lins = [ql.PackedLinear(quant.pack(torch.randn(n, k, generator=g) * 0.05, f), f, (n, k), "cuda")
            for f, n, k in shapes]
    x = torch.zeros(4, 1024, dtype=torch.bfloat16, device="cuda")

    def chain(pdl):
        y = x * 2.0
        for lin in lins:
            y = qmv_cuda.qmv(y, lin, pdl=pdl)
        return y

    replays_equal_eager(chain, x, seeds=4)


def replays_equal_eager(chain, x, seeds: int) -> None:
    """``chain(pdl)`` captured with PDL, replayed on ``seeds`` random fillings of its input ``x``: each replay's
    output has the bits of the eager chain without PDL."""
    chain(True)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for seed in range(seeds):
        x.copy_(torch.randn(*x.shape, generator=torch.Generator().manual_seed(seed)).to(x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, chain(False)), f"input {seed}"


@needs_qmv
@needs_sm90
@pytest.mark.parametrize("t", [1, 8, 24])
def test_pdl_reads_a_rewritten_buffer_fresh(t):
    """Under PDL qmv reads x through L1 after its wait. A captured ping-pong over two buffers - a -> b, b -> a (a
    rewritten after an earlier launch read it, maybe on the same SM), a -> c, six rounds - gives the eager chain's
    bits on every replay: no launch reads a line of x cached before the kernel that wrote it finished."""
    g = torch.Generator().manual_seed(13)
    fmts = ("q4_g64_fp16", "q5_g64_fp16", "q8_g32_fp16")
    lins = [ql.PackedLinear(quant.pack(torch.randn(2048, 2048, generator=g) * 0.03, f), f, (2048, 2048), "cuda")
            for f in fmts]
    a, b = (torch.zeros(t, 2048, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    x = torch.zeros_like(a)

    def chain(pdl):
        a.copy_(x)
        outs = []
        for r in range(6):
            qmv_cuda.qmv(a, lins[r % 3], b, pdl=pdl)
            qmv_cuda.qmv(b, lins[(r + 1) % 3], a, pdl=pdl)
            outs.append(qmv_cuda.qmv(a, lins[(r + 2) % 3], pdl=pdl))
        return torch.stack(outs)

    replays_equal_eager(chain, x, seeds=3)


@needs_qmv
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n,k,t", [(96, 5120, 1), (96, 5120, 8), (1000, 640, 3), (17, 64, 2)])
def test_dense_weight_path(dtype, n, k, t):
    """FMT 3: a dense 16-bit weight multiplied as it is, against the fp32 product; rows do not depend on the batch."""
    g = torch.Generator().manual_seed(13)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = (torch.randn(t, k, generator=g) * 3).to(dtype)
    dw = qmv_cuda.DenseWeight(w.cuda())
    y = qmv_cuda.qmv(x.cuda(), dw)
    assert rel_rms(y, x.float() @ w.float().T) <= TOL[dtype]
    for r in range(t):
        assert torch.equal(qmv_cuda.qmv(x[r:r + 1].cuda(), dw)[0], y[r])
    with pytest.raises(ValueError, match="multiple of 64"):
        qmv_cuda.DenseWeight(w[:, :k - 1].contiguous().cuda() if k > 64 else torch.zeros(4, 65, dtype=dtype).cuda())
    assert not qmv_cuda.supports(x.cuda().float(), dw)  # x in another dtype than the weight


@needs_qmv
def test_dense_linear_takes_qmv_when_enabled():
    """engine.model.weights.DenseLinear: small projections through qmv (up to 64 rows) only when the
    experimental switch is on; more rows, or the switch off, take F.linear."""
    from ninfer_bench.engine.model.weights import DenseLinear

    g = torch.Generator().manual_seed(14)
    w = (torch.randn(96, 512, generator=g) * 0.05).to(torch.bfloat16).cuda()
    lin = DenseLinear(w)
    x = (torch.randn(3, 7, 512, generator=g)).to(torch.bfloat16).cuda()  # 21 rows: one launch of 3 column groups
    want = (x.float() @ w.float().T)
    try:
        qmv_cuda.set_dense(True)
        y = lin(x)
        assert lin._qmv is not None and y.shape == (3, 7, 96)
        assert rel_rms(y, want.cpu()) <= TOL[torch.bfloat16]
        assert torch.equal(y[1, 2], lin(x[1, 2:3])[0])  # a row alone gives the same bits
        big = torch.randn(80, 512, generator=g).to(torch.bfloat16).cuda()
        assert torch.equal(lin(big), torch.nn.functional.linear(big, w))  # 80 rows: cuBLAS
    finally:
        qmv_cuda.set_dense(False)
    assert torch.equal(DenseLinear(w)(x), torch.nn.functional.linear(x, w))


def _interleaved_gate_up(fmt, inter, k, t, dtype, seed):
    """A gate / up pair packed as one weight with its rows alternating 8 gate, 8 up (WeightStore's interleaved
    gate_up), in the lanes layout; x; and the reference silu(g) * u from the unfused projection's output."""
    from ninfer_bench.engine.model.weights import interleave_order

    lin, x, _ = _case(fmt, 2 * inter, k, t, dtype, seed=seed)  # rows: gate, then up
    buf = quant.take_rows(lin.buf.cpu(), fmt, (2 * inter, k), interleave_order(2 * inter))
    mixed = qmv_cuda.TiledWeight(ql.PackedLinear(buf, fmt, (2 * inter, k), "cuda"), lanes=True)
    gu = qmv_cuda.qmv(x, qmv_cuda.TiledWeight(lin, lanes=True), splits=1).float()
    ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    return mixed, x, ref


@needs_qmv
@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("inter,k,t", [(64, 256, 1), (136, 1152, 3), (1024, 5120, 8), (136, 1152, 40)])
def test_silu_epilogue_matches_the_unfused_product(fmt, dtype, inter, k, t):
    """act=True on an interleaved gate / up weight: silu(g) * u [T, N / 2] within the output rounding of the
    unfused projection + product; each row's bits independent of the other rows (T = 1 gives row 0's)."""
    mixed, x, ref = _interleaved_gate_up(fmt, inter, k, t, dtype, seed=41)
    y = qmv_cuda.qmv(x, mixed, act=True)
    assert y.shape == (t, inter) and y.dtype == dtype
    assert rel_rms(y, ref.cpu()) <= TOL[dtype], f"rel RMS {rel_rms(y, ref.cpu()):.2e}"
    for r in sorted({0, t // 2, t - 1}):
        assert torch.equal(qmv_cuda.qmv(x[r:r + 1].contiguous(), mixed, act=True)[0], y[r])
    with pytest.raises(ValueError, match="multiple of 16"):
        qmv_cuda.qmv(x, qmv_cuda.TiledWeight(_case(fmt, 40, k, t, dtype)[0], lanes=True), act=True)


@needs_qmv
@needs_sm90
def test_silu_epilogue_in_a_pdl_graph_and_through_packed_linear():
    mixed, x, ref = _interleaved_gate_up("q4_g64_fp16", 512, 2048, 4, torch.bfloat16, seed=42)
    out = torch.empty(4, 512, dtype=x.dtype, device="cuda")
    _graph_replay(out, lambda: qmv_cuda.qmv(x, mixed, out, act=True, pdl=True))
    assert torch.equal(out, qmv_cuda.qmv(x, mixed, act=True, pdl=False))
    assert rel_rms(out, ref.cpu()) <= TOL[torch.bfloat16]


@needs_qmv
@pytest.mark.parametrize("fmt", [*quant.QUANT_FORMATS, "dense"])
@pytest.mark.parametrize("dtype,t", [(torch.bfloat16, 1), (torch.bfloat16, 64), (torch.float16, 8)],
                         ids=["bf16-1", "bf16-64", "fp16-8"])
def test_fp32_store_widens_the_rounded_values(fmt, dtype, t):
    """out_f32=True: the values of the 16-bit store widened, bit for bit (split-K or not, the lanes layout and a
    wide launch's build, a PDL launch in a CUDA graph, a caller's buffer), with no copy after the kernel;
    PackedLinear.fp32 the same as ``lin(x).float()``; refused with the gate / up epilogue."""
    if fmt == "dense":
        g = torch.Generator().manual_seed(17)
        weights = [qmv_cuda.DenseWeight((torch.randn(300, 1024, generator=g) * 0.05).to(dtype).cuda())]
        x = (torch.randn(t, 1024, generator=g) * 3).to(dtype).cuda()
    else:
        lin, x, _ = _case(fmt, 300, 5120, t, dtype, seed=18)
        weights = [lin, qmv_cuda.TiledWeight(lin, lanes=True)]
        assert torch.equal(lin.fp32(x), lin(x).float()) and lin.fp32(x).dtype == torch.float32
    for w in weights:
        for splits in (1, 3):
            y = qmv_cuda.qmv(x, w, splits=splits, out_f32=True)
            assert y.dtype == torch.float32 and y.shape == (t, w.n)
            assert torch.equal(y, qmv_cuda.qmv(x, w, splits=splits).float())
    if torch.cuda.get_device_capability() >= (9, 0):
        w = weights[-1]
        out = torch.empty(t, w.n, dtype=torch.float32, device="cuda")
        _graph_replay(out, lambda: qmv_cuda.qmv(x, w, out, pdl=True, out_f32=True))
        assert torch.equal(out, qmv_cuda.qmv(x, w, pdl=False).float())
    with pytest.raises(ValueError, match="out must be"):  # a 16-bit buffer for the fp32 store
        qmv_cuda.qmv(x, weights[0], torch.empty(t, weights[0].n, dtype=dtype, device="cuda"), out_f32=True)
    if fmt != "dense":
        mixed, xm, _ = _interleaved_gate_up(fmt, 64, 256, 1, dtype, seed=19)
        with pytest.raises(ValueError, match="out_f32"):
            qmv_cuda.qmv(xm, mixed, act=True, out_f32=True)


def test_fp32_product_off_the_kernel():
    """Where qmv does not run (a CPU here), PackedLinear.fp32 and weights.product_fp32 are ``lin(x).float()``."""
    from ninfer_bench.engine.model.weights import DenseLinear, product_fp32

    g = torch.Generator().manual_seed(20)
    w = torch.randn(48, 128, generator=g) * 0.05
    x = torch.randn(2, 3, 128, generator=g)
    packed = ql.PackedLinear(quant.pack(w, "q8_g32_fp16"), "q8_g32_fp16", (48, 128), "cpu")
    for lin in (packed, DenseLinear(w.to(torch.bfloat16))):
        xi = x.to(torch.bfloat16) if isinstance(lin, DenseLinear) else x
        y = product_fp32(lin, xi)
        assert y.dtype == torch.float32 and y.shape == (2, 3, 48) and torch.equal(y, lin(xi).float())


def test_bench_knob_letters():
    """scripts/bench_qlinear.py's --qmv-knobs: p tiles, s stages, b blocks an SM, t / x flags; an unknown letter is
    refused (g, the removed wgmma build's, among them)."""
    import bench_qlinear  # scripts/ (conftest puts it on sys.path)

    assert bench_qlinear.qmv_knobs("p3s4b1t") == {"tiles": 3, "stages": 4, "min_blocks": 1, "tail": True,
                                                  "xlate": False}
    for bad in ("g1s4", "s4q2"):
        with pytest.raises(ValueError, match="unknown letter"):
            bench_qlinear.qmv_knobs(bad)


def test_pick_qmv_shapes_keeps_only_clear_wins():
    """scripts/pick_qmv_shapes.py judges projections that share a weight shape together (chained times summed over
    op, format and T): an override is picked only when the sum drops by more than the margin, no case of it is
    slower than the default, and none of its cases failed its reference check."""
    import pick_qmv_shapes  # scripts/

    shapes = {"a.o": (6144, 5120), "g.out": (6144, 5120), "down": (17408, 5120), "qkv": (5120, 14336)}

    def rec(op, fmt, t, impl, us, err=1e-3):
        return [{"kind": "time", "op": op, "fmt": fmt, "T": t, "impl": impl, "us": us * 2, "rel_rms": err},
                {"kind": "time", "op": op, "fmt": fmt, "T": t, "impl": impl + "@graph20", "us": us}]

    q4, q5 = "q4_g64_fp16", "q5_g64_fp16"
    rs = []
    for t in (1, 8):  # 5120 x 96: w4k2 wins in both ops; w8k2 wins more in one and loses in the other
        rs += rec("a.o", q5, t, "ours", 10.0) + rec("a.o", q5, t, "ours-w4k2", 9.0) \
            + rec("a.o", q5, t, "ours-w8k2", 7.0)
        rs += rec("g.out", q4, t, "ours", 8.0) + rec("g.out", q4, t, "ours-w4k2", 7.5) \
            + rec("g.out", q4, t, "ours-w8k2", 8.2)
        # 5120 x 272: 2 % better, under the margin
        rs += rec("down", q4, t, "ours", 20.0) + rec("down", q4, t, "ours-w4", 19.6)
        # 14336 x 80: the faster override failed its check at T = 8
        rs += rec("qkv", q5, t, "ours", 20.0) + rec("qkv", q5, t, "ours-w8", 15.0, err=1e-3 if t == 1 else 1.0)
    picked, lines = pick_qmv_shapes.pick(rs, shapes, 0.03)
    assert picked == {(5120, 96): "w4k2"}, (picked, lines)
    assert any("-> ours-w4k2" in line for line in lines)
    assert pick_qmv_shapes.pick(rs, shapes, 0.2)[0] == {}


def test_arch_image_compiles_once_and_reports_errors(monkeypatch, tmp_path):
    """_cupy's sm_90a path (NVRTC itself: CuPy's names the plain target): machine code for sm_90a where NVRTC gives
    a cubin, else PTX for compute_90a (NUL-terminated for the driver), both with CuPy's -ftz=true; the image is cached
    by source, options and NVRTC version, so a second process skips NVRTC; a source that does not build raises with
    NVRTC's log. (A stand-in NVRTC: no GPU or cupy needed.)"""
    import sys
    import types

    from ninfer_bench.kernels import _cupy

    calls = []

    class NVRTCError(Exception):
        pass

    def compile_program(prog, options):
        calls.append(tuple(options))
        if "-DBAD=1" in options:
            raise NVRTCError("NVRTC_ERROR_COMPILATION (6)")

    fake = types.SimpleNamespace(NVRTCError=NVRTCError, getVersion=lambda: (13, 0), destroyProgram=lambda prog: None,
                                 createProgram=lambda src, name, headers, names: 1, compileProgram=compile_program,
                                 getCUBIN=lambda prog: b"\x7fELF cubin",
                                 getProgramLog=lambda prog: "kern.cu(3): error: wgmma needs sm_90a")
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.nvrtc = fake
    monkeypatch.setitem(sys.modules, "cupy_backends", types.ModuleType("cupy_backends"))
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda", types.ModuleType("cupy_backends.cuda"))
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs", libs)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nvrtc", fake)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    assert _cupy._arch_image("src", ("-DX=1",), "90a", "qmv") == b"\x7fELF cubin"
    assert calls == [("-DX=1", "-arch=sm_90a", "-ftz=true")]
    assert _cupy._arch_image("src", ("-DX=1",), "90a", "qmv") == b"\x7fELF cubin"  # from the cache
    assert len(calls) == 1 and len(list(tmp_path.glob("ninfer_qmv_*.cubin"))) == 1
    # an ELF whose program headers end one byte past what the binding returned (CuPy's getCUBIN drops the last
    # byte as a string's NUL) is given that byte back; one of the right length is left as it is
    import struct

    elf = bytearray(b"\x7fELF" + bytes(124))
    struct.pack_into("<QQ", elf, 32, 72, 64)  # program headers at 72, section headers at 64 (none)
    struct.pack_into("<HHHH", elf, 54, 56, 1, 64, 0)  # one 56-byte program header: the file is 128 bytes
    assert _cupy._elf_whole(bytes(elf[:127])) == bytes(elf) and _cupy._elf_whole(bytes(elf)) == bytes(elf)
    _cupy._arch_image("src", ("-DX=2",), "90a", "qmv")  # other options: another entry
    assert len(calls) == 2
    with pytest.raises(RuntimeError, match="wgmma needs sm_90a"):
        _cupy._arch_image("src", ("-DBAD=1",), "90a", "qmv")
    del fake.getCUBIN  # an older NVRTC binding without it: PTX for compute_90a (a str there)
    fake.getPTX = lambda prog: ".version 9.0\n.target sm_90a\n"
    assert _cupy._arch_image("src", ("-DX=1",), "90a", "qmv") == b".version 9.0\n.target sm_90a\n\0"
    assert calls[-1] == ("-DX=1", "-arch=compute_90a", "-ftz=true")