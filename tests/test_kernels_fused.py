"""Fused decode glue (kernels/fused.py): every Triton op against its fp32 reference on awkward shapes.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below before triton is imported),
which truncates bf16 stores instead of rounding them: bf16 tolerances are wider there.
"""

import os

import pytest
import torch

import triton_interp  # noqa: E402,F401  (sets TRITON_INTERPRET=1 without CUDA, fixes the interpreter)

from ninfer_bench.kernels.kv_quant import dequantize_kv  # noqa: E402
from ninfer_bench.kernels import fused as fu  # noqa: E402
from ninfer_bench.kernels.rope import rope_tables  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# relative RMS vs the fp32 reference, by output dtype: fp32 math everywhere, so only the output rounding counts
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2 if INTERPRET else 5e-3}
TOL_KV_INT8 = 1e-2  # dequantized cache entries: a code may round the other way where the fp32 k differs by an ulp
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]

pytestmark = pytest.mark.skipif(not fu.triton_available(),
                                reason=f"triton does not import: {fu._triton_import_error()}")


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Outputs start as NaN, so an element the kernels never write fails the comparison."""
    monkeypatch.setattr(fu, "_new_buffer", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                 device=device))


def rel_rms(out, ref):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out.float()).all(), "non-finite values (an unwritten element?)"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


# leading shapes and row lengths: not multiples of any block, one row, the 27B hidden size
ROWS = [((3, 5), 1000), ((1,), 5120), ((2, 1, 3), 72)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("lead,n", ROWS, ids=[f"n{n}" for _, n in ROWS])
def test_add_rms_norm(lead, n, dtype):
    x, r = randn(*lead, n, dtype=dtype, seed=1), randn(*lead, n, dtype=dtype, seed=2, scale=3.0)
    w = randn(n, seed=3, scale=0.1)
    y, ro = fu.add_rms_norm(x, r, w, 1e-6)
    yr, ror = fu.add_rms_norm_ref(x, r, w, 1e-6)
    assert y.dtype == ro.dtype == dtype
    assert rel_rms(ro, ror) <= TOL[dtype]
    assert rel_rms(y, yr) <= TOL[dtype]
    if not INTERPRET or dtype == torch.float32:
        assert torch.equal(ro, ror), "x + residual in fp32, rounded once"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("lead,n", ROWS, ids=[f"n{n}" for _, n in ROWS])
def test_rms_norm(lead, n, dtype):
    x, w = randn(*lead, n, dtype=dtype, seed=4), randn(n, seed=5, scale=0.1)
    y = fu.rms_norm(x, w, 1e-6)
    assert y.dtype == dtype and rel_rms(y, fu.rms_norm_ref(x, w, 1e-6)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape,n", [((2, 3), 1000), ((1, 1), 5120), ((4,), 72)], ids=["n1000", "n5120", "n72"])
def test_embed_rms_norm(shape, n, dtype):
    """One launch: the ids' rows gathered (h, exact) and rms_norm of them, the bits of the lookup then rms_norm
    (the same kernel arithmetic), within the reference's tolerance; ids in any order, repeated."""
    table = randn(50, n, dtype=dtype, seed=8)
    w = randn(n, seed=9, scale=0.1)
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(0, 50, shape, generator=g).to(DEVICE)
    ids.view(-1)[0] = 49
    y, h = fu.embed_rms_norm(table, ids, w, 1e-6)
    yr, hr = fu.embed_rms_norm_ref(table, ids, w, 1e-6)
    assert y.shape == h.shape == (*shape, n) and y.dtype == h.dtype == dtype
    assert torch.equal(h, hr), "the gathered rows as they are"
    assert torch.equal(y, fu.rms_norm(hr, w, 1e-6)), "rms_norm's bits"
    assert rel_rms(y, yr) <= TOL[dtype]
    y32, _ = fu.embed_rms_norm(table, ids.int(), w, 1e-6)
    assert torch.equal(y32, y)


def test_embed_rms_norm_inputs():
    table, w = randn(10, 64, seed=11), randn(64, seed=12, scale=0.1)
    ids = torch.tensor([[3, 10, -1]], device=DEVICE)
    y, h = fu.embed_rms_norm(table, ids, w, 1e-6)  # ids outside the table read zeros, never another row
    assert torch.equal(h[0, 0], table[3]) and not h[0, 1:].any() and not y[0, 1:].any()
    with pytest.raises(ValueError, match="int32 / int64"):
        fu.embed_rms_norm(table, ids.float(), w, 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        fu.embed_rms_norm(table, ids, w[:32], 1e-6)
    with pytest.raises(ValueError, match="table must be"):
        fu.embed_rms_norm(table[0], ids, w, 1e-6)
    y, h = fu.embed_rms_norm(table, ids[:, :0], w, 1e-6)
    assert y.shape == h.shape == (1, 0, 64)


def test_rms_norm_strided_rows():
    """A row-strided view (a slice of a wider buffer) is read in place."""
    wide = randn(4, 3, 1500, seed=6)
    x = wide[..., :1000]
    w = randn(1000, seed=7, scale=0.1)
    assert rel_rms(fu.rms_norm(x, w, 1e-6), fu.rms_norm_ref(x, w, 1e-6)) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("lead,inter", [((3, 5), 700), ((1,), 2176), ((2, 8), 1024)], ids=["i700", "i2176", "i1024"])
def test_silu_mul(lead, inter, dtype):
    gu = randn(*lead, 2 * inter, dtype=dtype, seed=8, scale=2.0)
    y = fu.silu_mul(gu, inter)
    assert y.shape == (*lead, inter) and y.dtype == dtype
    assert rel_rms(y, fu.silu_mul_ref(gu, inter)) <= TOL[dtype]


@pytest.mark.parametrize("run", [8, 16])
def test_silu_mul_interleaved(run):
    """Gate / up in alternating runs (an interleaved gate_up's output): the reference's product, and the bits of the
    two-halves layout holding the same columns."""
    inter = 1024
    gu = randn(3, 5, 2 * inter, dtype=torch.bfloat16, seed=11, scale=2.0)
    y = fu.silu_mul(gu, inter, run=run)
    assert y.shape == (3, 5, inter) and rel_rms(y, fu.silu_mul_ref(gu, inter, run=run)) <= TOL[torch.bfloat16]
    runs = gu.unflatten(-1, (-1, 2, run))
    halves = torch.cat([runs[..., 0, :].flatten(-2), runs[..., 1, :].flatten(-2)], -1)
    assert torch.equal(y, fu.silu_mul(halves, inter))
    with pytest.raises(ValueError, match="run must divide"):
        fu.silu_mul(gu, inter, run=24)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_sigmoid_mul(dtype):
    o, gate = randn(2, 3, 1100, dtype=dtype, seed=9), randn(2, 3, 1100, dtype=dtype, seed=10, scale=3.0)
    y = fu.sigmoid_mul(o, gate)
    assert y.dtype == dtype and rel_rms(y, fu.sigmoid_mul_ref(o, gate)) <= TOL[dtype]


def make_prologue(kv, B, T, H, Hkv, hd, rd, *, S=4, cap=4100, dtype=torch.float32, seed=0):
    """Projection outputs, norms, rope tables and a non-zero cache; rows at random positions up to cap - 1."""
    g = torch.Generator().manual_seed(seed)
    cos, sin = rope_tables(rd, 1e7, cap, DEVICE)
    start = torch.randint(0, cap - T + 1, (B,), generator=g)
    start[0] = cap - T  # the last positions of the table
    pos = start[:, None] + torch.arange(T)[None, :]
    noise = torch.randn(S, Hkv, cap, hd, generator=g)
    if kv == "int8":
        kc = torch.randint(-127, 128, (S, Hkv, cap, hd), generator=g, dtype=torch.int8)
        vc = torch.randint(-127, 128, (S, Hkv, cap, hd), generator=g, dtype=torch.int8)
        ks = torch.rand(S, Hkv, cap, -(-hd // 64), generator=g).to(torch.float16)
        vs = torch.rand(S, Hkv, cap, -(-hd // 64), generator=g).to(torch.float16)
    else:
        kc, vc, ks, vs = noise.to(torch.bfloat16), (2 * noise).to(torch.bfloat16), None, None
    args = dict(
        qg=torch.randn(B, T, H, 2 * hd, generator=g).to(dtype),
        kv=(2 * torch.randn(B, T, 2 * Hkv * hd, generator=g)).to(dtype),
        q_norm_w=torch.randn(hd, generator=g) * 0.1, k_norm_w=torch.randn(hd, generator=g) * 0.1,
        cos=cos, sin=sin, k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs,
        slots=torch.randperm(S, generator=g)[:B], pos=pos,
    )
    args = {k: (v.to(DEVICE) if v is not None else None) for k, v in args.items()}
    args["eps"] = 1e-6
    return args


def clone(c):
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in c.items()}


# (kv, B, T, H, Hkv, hd, rd): head dims 32 / 64 / 96 / 256, partial rotary 1/4 and full, GQA groups 1 / 2 / 6
PROLOGUE = {
    "int8-hd32": ("int8", 2, 3, 2, 2, 32, 8),
    "int8-hd96": ("int8", 1, 2, 4, 2, 96, 24),
    "int8-hd256": ("int8", 2, 1, 6, 1, 256, 64),
    "bf16-hd64": ("bf16", 2, 3, 4, 2, 64, 64),
    "bf16-hd256": ("bf16", 1, 2, 6, 1, 256, 64),
}


@pytest.mark.parametrize("case", list(PROLOGUE), ids=list(PROLOGUE))
def test_attn_prologue(case):
    kv, B, T, H, Hkv, hd, rd = PROLOGUE[case]
    c = make_prologue(kv, B, T, H, Hkv, hd, rd)
    ck, cr = clone(c), clone(c)
    q, gate = fu.attn_prologue(**ck)
    qr, gr = fu.attn_prologue_ref(**cr)
    assert q.shape == (B, T, H, hd) and gate.shape == (B, T, H * hd)
    assert rel_rms(q, qr) <= TOL[torch.float32]
    assert torch.equal(gate, gr), "the gate is a copy"
    sl = c["slots"][:, None].expand(B, T)
    written = torch.zeros(c["k_cache"].shape[0], c["k_cache"].shape[2], dtype=torch.bool, device=DEVICE)
    written[sl, c["pos"]] = True
    names = ("k_cache", "v_cache", "k_scale", "v_scale") if kv == "int8" else ("k_cache", "v_cache")
    for name in names:
        a, b = ck[name].transpose(1, 2), c[name].transpose(1, 2)  # [S, cap, Hkv, .]
        assert torch.equal(a[~written], b[~written]), f"{name}: an entry outside (slot, pos) changed"
    for name, scale in (("k_cache", "k_scale"), ("v_cache", "v_scale")):
        got, want = ck[name][sl, :, c["pos"]], cr[name][sl, :, c["pos"]]  # [B, T, Hkv, hd]
        if kv == "int8":
            assert rel_rms(ck[scale][sl, :, c["pos"]].float(), cr[scale][sl, :, c["pos"]].float()) <= 1e-3
            got = dequantize_kv(got, ck[scale][sl, :, c["pos"]], torch.float32)
            want = dequantize_kv(want, cr[scale][sl, :, c["pos"]], torch.float32)
            assert rel_rms(got, want) <= TOL_KV_INT8, f"{name}"
            if name == "v_cache":  # v is stored unrotated and unnormalised: exactly quantize_kv's codes
                assert torch.equal(ck[name][sl, :, c["pos"]], cr[name][sl, :, c["pos"]])
        else:
            assert rel_rms(got, want) <= TOL[torch.bfloat16], f"{name}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_attn_prologue_half_inputs(dtype):
    c = make_prologue("int8", 2, 2, 4, 2, 64, 16, dtype=dtype, seed=1)
    ck, cr = clone(c), clone(c)
    q, gate = fu.attn_prologue(**ck)
    qr, gr = fu.attn_prologue_ref(**cr)
    assert q.dtype == dtype and rel_rms(q, qr) <= TOL[dtype]
    assert torch.equal(gate, gr)


# (B, T, H, hd, rd, weight dtype): full and partial rotary, head dims not a power of two, bf16 weights (a drafter's)
NORM_ROPE = {"full-hd64": (2, 8, 3, 64, 64, torch.float32), "part-hd96": (1, 5, 2, 96, 24, torch.float32),
             "bf16w-hd128": (1, 16, 4, 128, 128, torch.bfloat16), "hd256": (3, 1, 1, 256, 64, torch.float32)}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("case", list(NORM_ROPE), ids=list(NORM_ROPE))
def test_norm_rope(case, dtype):
    b, t, h, hd, rd, wdt = NORM_ROPE[case]
    g = torch.Generator().manual_seed(7)
    cos, sin = rope_tables(rd, 1e6, 600, DEVICE)
    pos = torch.randint(0, 600, (b, t), generator=g).to(DEVICE)
    x = randn(b, t, h, hd, dtype=dtype, seed=11, scale=2.0)
    w = randn(hd, seed=12, scale=0.1).to(wdt)
    y = fu.norm_rope(x, w, cos, sin, pos, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_rms(y, fu.norm_rope_ref(x, w, cos, sin, pos, 1e-6)) <= TOL[dtype]


def test_norm_rope_reads_strided_heads_and_names_bad_inputs():
    cos, sin = rope_tables(32, 1e4, 64, DEVICE)
    pos = torch.arange(6, device=DEVICE).view(2, 3)
    wide = randn(2, 3, 4, 64, seed=13)
    x = wide[..., :32]  # heads 64 apart in memory
    w = randn(32, seed=14, scale=0.1)
    assert rel_rms(fu.norm_rope(x, w, cos, sin, pos, 1e-6), fu.norm_rope_ref(x, w, cos, sin, pos, 1e-6)) <= 1e-5
    with pytest.raises(ValueError, match="pos"):
        fu.norm_rope(x, w, cos, sin, pos[:, :2], 1e-6)
    with pytest.raises(ValueError, match="weight"):
        fu.norm_rope(x, w[:16], cos, sin, pos, 1e-6)
    with pytest.raises(ValueError, match="rd"):
        fu.norm_rope(x[..., :16], w[:16], cos, sin, pos, 1e-6)


def test_bad_inputs_name_the_problem():
    c = make_prologue("int8", 1, 2, 4, 2, 64, 16)
    with pytest.raises(ValueError, match="k_scale"):
        fu.attn_prologue(**{**c, "k_scale": None})
    with pytest.raises(ValueError, match="kv must be"):
        fu.attn_prologue(**{**c, "kv": c["kv"][..., :-2]})
    with pytest.raises(ValueError, match="pos"):
        fu.attn_prologue(**{**c, "pos": c["pos"][:, :1]})
    with pytest.raises(ValueError, match="weight must be"):
        fu.rms_norm(randn(2, 10), randn(11), 1e-6)
    with pytest.raises(ValueError, match="2 \\* inter"):
        fu.silu_mul(randn(2, 10), 4)


def test_pdl_switch_applies_to_graph_captures_only():
    """With the PDL switch on, eager launches stay plain (on the CPU interpreter and on GPUs alike): PDL is for
    launches into a CUDA-graph capture (see test_pdl_graph_replay_changes_no_bits), and the kernels give the same
    bits."""
    from ninfer_bench.kernels import _triton

    x, r, w = randn(4, 1000), randn(4, 1000, seed=1), randn(1000, seed=2)
    plain = fu.add_rms_norm(x, r, w, 1e-6)
    _triton.set_pdl(True)
    try:
        assert _triton.pdl_enabled() and _triton.pdl_args(x.device) == {"PDL": False}
        with _triton.graph_scope():
            assert _triton.pdl_args(torch.device("cpu")) == {"PDL": False}
        again = fu.add_rms_norm(x, r, w, 1e-6)
    finally:
        _triton.set_pdl(False)
    for a, b in zip(plain, again):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs an sm_90+ GPU")
def test_pdl_held_launches_a_capture_plainly():
    """pdl_held (the engine's batched decode graphs): launches into a capture go without PDL while it is held, with
    it again after."""
    from ninfer_bench.kernels import _triton

    dev = torch.device("cuda")
    _triton.set_pdl(True)
    try:
        with _triton.graph_scope():
            assert _triton.pdl_now(dev)
            with _triton.pdl_held():
                assert not _triton.pdl_now(dev) and _triton.pdl_args(dev) == {"PDL": False}
            assert _triton.pdl_now(dev)
    finally:
        _triton.set_pdl(False)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs an sm_90+ GPU")
def test_pdl_graph_replay_changes_no_bits():
    """A chain of the kernels captured into a CUDA graph with PDL (each may launch while the one before finishes)
    replays to the eager chain's bits."""
    from ninfer_bench.kernels import _triton

    x, r, w, gu = randn(4, 1000), randn(4, 1000, seed=1), randn(1000, seed=2), randn(4, 2000, seed=3)

    def chain():
        y, ro = fu.add_rms_norm(x, r, w, 1e-6)
        z = fu.silu_mul(torch.cat([y, ro], -1), 1000)
        return fu.sigmoid_mul(fu.rms_norm(z, w, 1e-6), y), fu.silu_mul(gu, 1000)

    want = chain()
    _triton.set_pdl(True)
    try:
        with _triton.graph_scope():  # as engine.graphs.capture warms up: the PDL variants compile outside it
            assert _triton.pdl_args(x.device) == {"PDL": True, "launch_pdl": True}
            chain()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain()
        graph.replay()
        torch.cuda.synchronize()
    finally:
        _triton.set_pdl(False)
    for a, b in zip(want, outs):
        assert torch.equal(a, b)


def test_module_imports_without_triton():
    triton_interp.assert_imports_without_triton("fused")
