"""The tensor-core int8 decode attention (kernels/attn_cuda.cu) against decode_attention_ref and the Triton path.

The kernel runs on CUDA with cupy only; those tests skip elsewhere. The plan, the path choice and the module's
import are checked on every machine.
"""

import pytest
import torch
from attention_cases import DEVICE, make_case, rel_rms
from ninfer_bench.kernels import attention_triton as at
from ninfer_bench.kernels import attn_cuda

RTOL_BF16 = 1e-2  # relative RMS vs the fp32 reference with bf16 q (q and p rounded to fp16, V codes x scales in fp16)
RTOL_FP16 = 3e-3

gpu = pytest.mark.skipif(not attn_cuda.available() or not at.triton_available(),
                         reason=f"needs CUDA, cupy and triton: {attn_cuda.import_error()}")


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Outputs and split workspaces start as NaN, so an element the kernels never write fails the comparison."""
    monkeypatch.setattr(at, "_new_buffer", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                 device=device))


# (B, T, H, Hkv, hd, lengths, slots, cap): G = 1 / 2 / 6 / 8, hd 64 - 256, T = 1 / 3 / 8 / 9 / 16, rows at
# position 0, lengths that are not multiples of 16, a batch of rows of different lengths
SHAPES = {
    "T1-g6-hd256": (2, 1, 24, 4, 256, [1, 300], 3, 320),
    "T8-g6-hd256": (1, 8, 24, 4, 256, [200], 2, 256),
    "T3-g8-hd128": (3, 3, 16, 2, 128, [3, 77, 130], 4, 160),
    "T9-g2-hd192": (2, 9, 4, 2, 192, [9, 100], 3, 112),
    "T16-g1-hd64": (1, 16, 4, 4, 64, [90], 2, 96),
    "T2-g6-hd64": (3, 2, 6, 1, 64, [2, 17, 33], 4, 48),
    "T4-g6-hd256": (2, 4, 24, 4, 256, [4, 161], 2, 176),  # MTP3's verify: 24 rows, a second m tile half full
    # a verify's tokens on both sides of a position where a row's chunk grows (the cache far longer than the rows:
    # the engine's kv_len is the cache's capacity), so they split the keys differently: the bundled model's shape
    # (hd 64, G = 6, one kv head) and the 27B's
    "T8-g6-hd64-edge": (1, 8, 6, 1, 64, [516], 2, 4096),
    "T4-g6-hd64-edge": (2, 4, 6, 1, 64, [514, 1500], 3, 4096),
    "T8-g6-hd256-edge": (1, 8, 24, 4, 256, [1028], 2, 8192),
}


def half_case(shape, q_dtype=torch.bfloat16, seed=0):
    return make_case("int8", *SHAPES[shape], q_dtype=q_dtype, seed=seed)


def many_splits(c):
    """A plan that splits the keys into 32-key chunks (a row's chunk shrinking to 16 keys near the start)."""
    return attn_cuda.CudaPlan(chunk=32, min_chunk=16)


@gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("split", ["plan", "many"])
def test_matches_reference(shape, q_dtype, split):
    c = half_case(shape, q_dtype)
    assert attn_cuda.wanted(c["q"], c["k_cache"], c["v_cache"], c["k_scale"], c["v_scale"], c["slots"], c["q_pos"])
    out = at.decode_attention(**c, config=many_splits(c) if split == "many" else None)
    ref = at.decode_attention_ref(**{**c, "q": c["q"].float()})
    assert out.dtype == q_dtype and torch.isfinite(out).all()
    assert rel_rms(out, ref) <= (RTOL_BF16 if q_dtype == torch.bfloat16 else RTOL_FP16)


@gpu
def test_matches_the_triton_kernel():
    """The same sums, another order: the CUDA and Triton paths agree as closely as either agrees with fp32."""
    c = half_case("T8-g6-hd256", torch.float16, seed=4)
    cuda = at.decode_attention(**c)
    cfg = at.plan(1, 8, 24, 4, 256, 256, True, DEVICE, q_dtype=torch.float16)
    triton = at.decode_attention(**c, config=cfg)
    assert rel_rms(cuda, triton) <= RTOL_FP16


@gpu
@pytest.mark.parametrize("shape", ["T8-g6-hd256", "T9-g2-hd192", "T3-g8-hd128", "T4-g6-hd256", "T16-g1-hd64",
                                   "T2-g6-hd64", "T8-g6-hd64-edge", "T4-g6-hd64-edge", "T8-g6-hd256-edge"])
@pytest.mark.parametrize("split", ["plan", "many"])
def test_tokens_and_rows_give_the_bits_single_steps_give(shape, split):
    """Token invariance: each token of a T-token call (attn_verify: the rows as the MMA's rows), each row of a batch,
    gives the bits a B = 1, T = 1 call (attn_split: the heads as its columns) at its position gives. "many" splits
    give a verify's tokens different chunks, so a block's rows meet steps outside their own ranges."""
    c = half_case(shape, seed=7)
    cfg = many_splits(c) if split == "many" else None
    block = at.decode_attention(**c, config=cfg)
    b, t = c["q"].shape[:2]
    for i in range(b):
        for j in range(t):
            one = {**c, "q": c["q"][i:i + 1, j:j + 1].contiguous(), "slots": c["slots"][i:i + 1],
                   "q_pos": c["q_pos"][i:i + 1, j:j + 1].contiguous()}
            assert torch.equal(at.decode_attention(**one, config=cfg)[0, 0], block[i, j]), (i, j)


@gpu
@pytest.mark.parametrize("shape", ["T8-g6-hd256", "T16-g1-hd64"])
def test_rows_a_verify_block_change_no_bits(shape):
    """A verify's query rows in blocks of 1 .. 8 m tiles (each block reading the keys once; blocks of 1 - 2 warps
    take the narrow build, q in registers, wider ones the wide build, q in shared memory): the same bits."""
    c = half_case(shape, seed=8)
    outs = [at.decode_attention(**c, config=attn_cuda.CudaPlan(chunk=64, min_chunk=16, verify_warps=w))
            for w in (8, 3, 2, 1)]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


needs_wgv = pytest.mark.skipif(not (attn_cuda.available() and at.triton_available()
                                     and torch.cuda.get_device_capability() == (9, 0)),
                               reason="attn_verify_wg needs an sm_90 GPU, cupy and triton")


@needs_wgv
@pytest.mark.parametrize("shape", ["T8-g6-hd256", "T9-g2-hd192", "T3-g8-hd128", "T4-g6-hd256", "T16-g1-hd64",
                                   "T2-g6-hd64", "T8-g6-hd64-edge", "T4-g6-hd64-edge", "T8-g6-hd256-edge"])
@pytest.mark.parametrize("split", ["plan", "many"])
def test_wgmma_verify_gives_the_verify_bits(shape, split, monkeypatch):
    """attn_verify_wg (NINFER_BENCH_ATTN_VERIFY=wgmma: one warpgroup a block, K and V made into fp16 once a step for
    all its rows, wgmma) gives attn_verify's bits - which are the T = 1 steps' (the test above) - for every shape,
    split plan and row of a batch, in bf16 and fp16."""
    for q_dtype in (torch.bfloat16, torch.float16):
        c = half_case(shape, q_dtype, seed=9)
        cfg = many_splits(c) if split == "many" else None
        monkeypatch.setitem(attn_cuda._VERIFY, "kernel", "mma")
        want = at.decode_attention(**c, config=cfg)
        monkeypatch.setitem(attn_cuda._VERIFY, "kernel", "wgmma")
        got = at.decode_attention(**c, config=cfg)
        ref = at.decode_attention_ref(**{**c, "q": c["q"].float()})
        differ = 100 * (got != want).float().mean().item()
        assert torch.equal(got, want), (q_dtype, f"{differ:.3f} % differ; rel RMS to fp32 {rel_rms(got, ref):.2e}, "
                                                 f"attn_verify's {rel_rms(want, ref):.2e}")


@gpu
def test_gate_gives_sigmoid_mul_bits():
    from ninfer_bench.kernels import fused

    c = half_case("T3-g8-hd128", seed=2)
    b, t, h, hd = c["q"].shape
    gate = (2 * torch.randn(b, t, h * hd, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16).to(DEVICE)
    plain = at.decode_attention(**c)
    gated = at.decode_attention(**c, gate=gate)
    assert torch.equal(gated.view(b, t, h * hd), fused.sigmoid_mul(plain.view(b, t, h * hd), gate))
    assert rel_rms(gated, at.decode_attention_ref(**{**c, "q": c["q"].float()}, gate=gate)) <= RTOL_BF16


@gpu
def test_no_leak_past_the_position():
    """Cache entries past each row's position (NaN or huge scales, codes 127) change nothing."""
    c = half_case("T2-g6-hd64", seed=3)
    clean = at.decode_attention(**c)
    live = torch.zeros(c["k_cache"].shape[0], c["k_cache"].shape[2], dtype=torch.bool, device=DEVICE)
    live[c["slots"]] = torch.arange(live.shape[1], device=DEVICE)[None, :] <= c["q_pos"].max(1).values[:, None]
    dead = ~live[:, None, :, None]
    for value in (float("nan"), 6e4):
        p = {**c, "k_cache": c["k_cache"].masked_fill(dead, 127), "v_cache": c["v_cache"].masked_fill(dead, 127),
             "k_scale": c["k_scale"].masked_fill(dead, value), "v_scale": c["v_scale"].masked_fill(dead, value)}
        assert torch.equal(at.decode_attention(**p), clean), value


@gpu
def test_int32_indices_and_strided_slots():
    c = half_case("T3-g8-hd128", seed=6)
    out = at.decode_attention(**c)
    slots = torch.stack([c["slots"], c["slots"]], 1)[:, 0]  # a strided view
    assert slots.stride(0) == 2
    same = at.decode_attention(**{**c, "slots": slots.int(), "q_pos": c["q_pos"].int()})
    assert torch.equal(same, out)
    assert torch.equal(at.decode_attention(**{**c, "slots": slots}), out)


@gpu
def test_unsupported_inputs_take_the_triton_path_or_are_refused():
    c = make_case("int8", 1, 2, 18, 2, 64, [40], 2, 64, q_dtype=torch.bfloat16)  # G = 9: over the MMA's 8 columns
    args = (c["q"], c["k_cache"], c["v_cache"], c["k_scale"], c["v_scale"], c["slots"], c["q_pos"])
    assert not attn_cuda.supports(*args)
    assert rel_rms(at.decode_attention(**c), at.decode_attention_ref(**{**c, "q": c["q"].float()})) <= RTOL_BF16
    with pytest.raises(ValueError, match="CUDA split kernel"):
        at.decode_attention(**c, config=attn_cuda.CudaPlan(chunk=32, min_chunk=16))
    f32 = half_case("T2-g6-hd64", torch.float32)  # fp32 queries: the Triton reference-precision path
    assert not attn_cuda.supports(f32["q"], f32["k_cache"], f32["v_cache"], f32["k_scale"], f32["v_scale"],
                                  f32["slots"], f32["q_pos"])
    # scales with an odd stride (hd 64: one a key, in a cache one key longer): not 4-byte aligned, the Triton path
    c = half_case("T2-g6-hd64", seed=9)
    odd = {k: torch.cat([c[k], c[k][:, :, :1]], 2)[:, :, :-1] for k in ("k_scale", "v_scale")}
    assert odd["k_scale"].stride(1) % 2 and torch.equal(odd["k_scale"], c["k_scale"])
    args = (c["q"], c["k_cache"], c["v_cache"], odd["k_scale"], odd["v_scale"], c["slots"], c["q_pos"])
    assert not attn_cuda.supports(*args)
    assert torch.equal(at.decode_attention(**{**c, **odd}), at.decode_attention(**c, config=at.plan(
        3, 2, 6, 1, 64, 48, True, DEVICE, q_dtype=torch.bfloat16)))


@gpu
def test_switch_off_runs_the_triton_kernel():
    c = half_case("T1-g6-hd256", seed=1)
    args = (c["q"], c["k_cache"], c["v_cache"], c["k_scale"], c["v_scale"], c["slots"], c["q_pos"])
    try:
        attn_cuda.set_enabled(False)
        assert not attn_cuda.wanted(*args)
        off = at.decode_attention(**c)
    finally:
        attn_cuda.set_enabled(True)
    assert attn_cuda.wanted(*args)
    assert rel_rms(off, at.decode_attention(**c)) <= RTOL_BF16


def test_plan_is_a_function_of_static_sizes():
    """Same key range and kv heads, same grid (CUDA-graph capture); a long range splits, a short one keeps at least
    MIN_STEPS steps a split; chunks are whole steps."""
    dev = DEVICE if torch.cuda.is_available() else "cpu"
    p = attn_cuda.plan(65536, 4, dev)
    assert p == attn_cuda.plan(65536, 4, dev) and p.splits(65536) > 1
    assert p.chunk % attn_cuda.STEP == 0 and p.min_chunk % attn_cuda.STEP == 0 and p.min_chunk <= p.chunk
    short = attn_cuda.plan(200, 4, dev)
    assert short.chunk >= min(200, attn_cuda.MIN_STEPS * attn_cuda.STEP) or short.splits(200) == 1
    for bad in ({"chunk": 24, "min_chunk": 16}, {"chunk": 32, "min_chunk": 48},
                {"chunk": 32, "min_chunk": 16, "combine_cols": 24}):
        with pytest.raises(ValueError):
            attn_cuda.CudaPlan(**bad)


def test_a_verify_block_takes_m_tiles_of_its_rows():
    """One warp a 16-row m tile of the T x G query rows, at most verify_warps a block."""
    assert [attn_cuda.verify_grid(t, 6) for t in (2, 3, 4, 8, 16, 32)] == [(1, 1), (2, 1), (2, 1), (3, 1), (6, 1),
                                                                             (8, 2)]
    assert attn_cuda.verify_grid(8, 6, 2) == (2, 2) and attn_cuda.verify_grid(9, 8, 1) == (1, 5)
    for bad in (0, 9):
        with pytest.raises(ValueError, match="verify_warps"):
            attn_cuda.CudaPlan(chunk=32, min_chunk=16, verify_warps=bad)


def test_cpu_tensors_never_take_the_kernel():
    c = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in half_case("T2-g6-hd64").items()}
    assert not attn_cuda.supports(c["q"], c["k_cache"], c["v_cache"], c["k_scale"], c["v_scale"], c["slots"],
                                  c["q_pos"])


def test_the_attention_switch_is_recorded_in_a_result(monkeypatch):
    """A run with NINFER_BENCH_ATTN set says so in its env (its config does not change); secrets are not copied."""
    from ninfer_bench.reports.schema import environment

    monkeypatch.setenv("NINFER_BENCH_ATTN", "triton")
    monkeypatch.setenv("NINFER_BENCH_ATTN_BUILD", "VDEPTH=3")
    monkeypatch.setenv("NINFER_BENCH_API_KEY", "secret")
    knobs = environment()["knobs"]
    assert knobs == {"NINFER_BENCH_ATTN": "triton", "NINFER_BENCH_ATTN_BUILD": "VDEPTH=3"}


def test_build_defines_parse_or_are_refused():
    assert attn_cuda.parse_build("") == {}
    assert attn_cuda.parse_build("VDEPTH=3:QSMEM=1") == {"VDEPTH": 3, "QSMEM": 1}
    for bad in ("VDEPTH", "VDEPTH=x", "1A=2", "VDEPTH=3;QSMEM=1"):
        with pytest.raises(ValueError, match="NAME=INTEGER"):
            attn_cuda.parse_build(bad)


def test_short_min_steps_knob(monkeypatch):
    """NINFER_BENCH_ATTN_MIN_STEPS sets the floor a short key range's chunk shrinks to (16-key steps), a positive
    integer; unset gives the default; anything else is refused by name. The plan takes the module's value."""
    monkeypatch.delenv("NINFER_BENCH_ATTN_MIN_STEPS", raising=False)
    assert attn_cuda.env_min_steps() == attn_cuda.DEFAULT_SHORT_MIN_STEPS
    monkeypatch.setenv("NINFER_BENCH_ATTN_MIN_STEPS", " 4 ")
    assert attn_cuda.env_min_steps() == 4
    for bad in ("0", "-2", "four", "1.5"):
        monkeypatch.setenv("NINFER_BENCH_ATTN_MIN_STEPS", bad)
        with pytest.raises(ValueError, match="NINFER_BENCH_ATTN_MIN_STEPS"):
            attn_cuda.env_min_steps()
    monkeypatch.setattr(attn_cuda, "SHORT_MIN_STEPS", 4)
    assert attn_cuda.plan(65536, 4, "cpu").min_chunk == 4 * attn_cuda.STEP


def test_verify_kernel_knob(monkeypatch):
    """NINFER_BENCH_ATTN_VERIFY picks the T > 1 kernel: mma (the default) or wgmma; anything else is refused by name,
    and a run records it. attn_verify_wg's shared memory: attn_verify's stages, then K' (512 bytes a scale group and
    16-dim chunk) and V' (32 bytes a head dim)."""
    monkeypatch.delenv("NINFER_BENCH_ATTN_VERIFY", raising=False)
    assert attn_cuda.env_verify_kernel() == "mma"
    monkeypatch.setenv("NINFER_BENCH_ATTN_VERIFY", " WGMMA ")
    assert attn_cuda.env_verify_kernel() == "wgmma"
    monkeypatch.setenv("NINFER_BENCH_ATTN_VERIFY", "tma")
    with pytest.raises(ValueError, match="NINFER_BENCH_ATTN_VERIFY"):
        attn_cuda.env_verify_kernel()
    with pytest.raises(ValueError, match="mma or wgmma"):
        attn_cuda.set_verify_kernel("fast")
    assert attn_cuda.wgv_smem(256) == attn_cuda.verify_smem(256, 1) + 4 * 4 * 512 + 256 * 32
    assert attn_cuda.wgv_smem(64, (("VDEPTH", 3),)) == attn_cuda.verify_smem(64, 1, (("VDEPTH", 3),)) + 2048 + 2048
    from ninfer_bench.reports.schema import environment

    monkeypatch.setenv("NINFER_BENCH_ATTN_VERIFY", "wgmma")
    assert environment()["knobs"]["NINFER_BENCH_ATTN_VERIFY"] == "wgmma"


def test_partials_follow_the_build(monkeypatch):
    """The split pass writes fp16 partial outputs by default (the source's PART16 = 1) and fp32 with PART16=0: the
    buffer decode_attention sizes (part_dtype) follows the process's build defines."""
    monkeypatch.setitem(attn_cuda._BUILD, "defines", ())
    assert attn_cuda.part_dtype() == torch.float16
    attn_cuda.set_build_defines({"VDEPTH": 3})
    assert attn_cuda.part_dtype() == torch.float16
    attn_cuda.set_build_defines({"PART16": 0})
    assert attn_cuda.part_dtype() == torch.float32


@gpu
@pytest.mark.parametrize("shape", ["T1-g6-hd256", "T8-g6-hd256", "T3-g8-hd128"])
def test_fp32_partials_build_agrees(shape, monkeypatch):
    """PART16=0 (fp32 partials, the same reciprocal products unrounded) against the fp32 reference, and the default
    fp16 partials within their rounding of it; token invariance holds in the fp32 build too (one row, one T = 1 call;
    the default build's: test_tokens_and_rows_give_the_bits_single_steps_give)."""
    c = half_case(shape, torch.float16, seed=3)
    ref = at.decode_attention_ref(**{**c, "q": c["q"].float()})
    fp16 = at.decode_attention(**c)
    monkeypatch.setitem(attn_cuda._BUILD, "defines", (("PART16", 0),))
    fp32 = at.decode_attention(**c)
    assert rel_rms(fp32, ref) <= RTOL_FP16 and rel_rms(fp16, ref) <= RTOL_FP16
    assert rel_rms(fp16, fp32) <= 1e-3
    one = {**c, "q": c["q"][:1, -1:].contiguous(), "slots": c["slots"][:1], "q_pos": c["q_pos"][:1, -1:].contiguous()}
    assert torch.equal(at.decode_attention(**one)[0, 0], fp32[0, -1])
