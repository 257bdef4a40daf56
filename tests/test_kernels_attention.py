"""decode_attention (Triton, reading the KV cache in place) against decode_attention_ref.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below before triton is imported).
"""

import dataclasses
import os

import pytest
import torch

import triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, fixes the interpreter)

from attention_cases import DEVICE, make_case, rel_rms
from ninfer_bench.kernels import attention_triton as at

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
RTOL = 2e-3  # relative RMS vs the fp32 reference, fp32 / fp16 queries (fp32 accumulation in the kernel)
RTOL_BF16 = 1e-2  # bf16 queries: q, the dequantized K/V and p are rounded to bf16 before the dots

pytestmark = pytest.mark.skipif(not at.triton_available(),
                                reason=f"triton does not import: {at._triton_import_error()}")


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Outputs and split workspaces start as NaN, so an element the kernels never write fails the comparison."""
    monkeypatch.setattr(at, "_new_buffer", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                 device=device))


def split_config(c, block_n=16, blocks=3):
    """A launch shape that splits the key range into chunks of `blocks` blocks, so the combine kernel runs."""
    b, t, h, hd = c["q"].shape
    hkv, cap = c["k_cache"].shape[1], c["k_cache"].shape[2]
    return at.plan(b, t, h, hkv, hd, cap, c["k_cache"].dtype == torch.int8, DEVICE, q_dtype=c["q"].dtype,
                   block_n=block_n, chunk=blocks * block_n)


# (B, T, H, Hkv, hd, lengths, slots, cap): T = 1 / 7 / 8 / 16, groups 1 / 2 / 3 / 6, rows at position 0,
# lengths that are not multiples of any block, more query rows than one m tile (T=16 x G=6 = 96), hd 8 - 256
SHAPES = {
    "T1-g1-hd32": (3, 1, 2, 2, 32, [1, 77, 130], 4, 160),
    "T7-g3-hd96": (3, 7, 6, 2, 96, [7, 150, 61], 5, 160),
    "T8-g2-hd64": (1, 8, 4, 2, 64, [100], 2, 128),
    "T16-g6-hd128": (1, 16, 6, 1, 128, [90], 2, 96),
    "T1-g6-hd256": (2, 1, 12, 2, 256, [1, 70], 3, 80),
    "T2-g1-hd8": (2, 2, 4, 4, 8, [3, 100], 3, 112),  # head dim under tl.dot's 16: padded tiles
}


@pytest.mark.parametrize("kv", ["bf16", "fp16", "int8"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("split", ["plan", "split", "token-tiles", "grouped", "inline", "flat"])
def test_matches_reference(kv, shape, split):
    """The default plan (tokens packed into one tile), a split one, one-token tiles (pack=1), and (int8) the
    cache read as one tile per scale group, with each block's scales loaded with it (not a block ahead), or as
    2-D code tiles with the scales broadcast to their columns."""
    if split in ("grouped", "inline", "flat") and kv != "int8":
        pytest.skip(f"{split} tiles are for int8 caches")
    c = make_case(kv, *SHAPES[shape])
    ref = at.decode_attention_ref(**c)
    b, t, h, hd = c["q"].shape
    hkv, cap = c["k_cache"].shape[1], c["k_cache"].shape[2]
    cfg = (None if split == "plan" else split_config(c) if split == "split" else
           at.plan(b, t, h, hkv, hd, cap, kv == "int8", DEVICE, q_dtype=c["q"].dtype, block_n=16, chunk=48, pack=1)
           if split == "token-tiles" else dataclasses.replace(split_config(c), flat=True) if split == "flat"
           else dataclasses.replace(split_config(c), grouped=split == "grouped", ahead=False))
    out = at.decode_attention(**c, config=cfg)
    assert out.shape == ref.shape and out.dtype == c["q"].dtype
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    err = rel_rms(out, ref)
    assert err <= RTOL, f"{kv} {shape}: relative RMS {err:.2e} > {RTOL}"


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_half_queries(q_dtype, kv):
    if q_dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("the Triton interpreter's tl.dot multiplies raw bf16 bit patterns (GPU only)")
    c = make_case(kv, *SHAPES["T7-g3-hd96"], q_dtype=q_dtype)
    ref = at.decode_attention_ref(**{**c, "q": c["q"].float()})
    out = at.decode_attention(**c, config=split_config(c))
    assert out.dtype == q_dtype and torch.isfinite(out).all()
    tol = RTOL_BF16 if q_dtype == torch.bfloat16 else RTOL
    assert rel_rms(out, ref) <= tol


def poison_past_length(c, value):
    """Fill every cache entry no query may see (past each row's last position, and unread slots) with `value`."""
    live = torch.zeros(c["k_cache"].shape[0], c["k_cache"].shape[2], dtype=torch.bool, device=DEVICE)
    live[c["slots"]] = torch.arange(live.shape[1], device=DEVICE)[None, :] <= c["q_pos"].max(1).values[:, None]
    dead = ~live[:, None, :, None]  # [S, 1, cap, 1]
    p = dict(c)
    if c["k_cache"].dtype == torch.int8:
        for name in ("k_cache", "v_cache"):
            p[name] = c[name].masked_fill(dead, 127)
        for name in ("k_scale", "v_scale"):
            p[name] = c[name].masked_fill(dead, value)
    else:
        for name in ("k_cache", "v_cache"):
            p[name] = c[name].masked_fill(dead, value)
    return p


@pytest.mark.parametrize("kv", ["bf16", "fp16", "int8"])
def test_no_leak_past_q_pos(kv):
    c = make_case(kv, 3, 3, 4, 2, 64, [3, 150, 61], 4, 160, seed=1)
    cfgs = [split_config(c, block_n=32, blocks=2)]
    if kv == "int8":
        assert cfgs[0].ahead  # the planner's int8 default
        cfgs += [dataclasses.replace(cfgs[0], grouped=True, ahead=False), dataclasses.replace(cfgs[0], ahead=False),
                 dataclasses.replace(cfgs[0], flat=True)]
    for cfg in cfgs:
        clean = at.decode_attention(**c, config=cfg)
        for value in (float("nan"), 6e4):
            dirty = at.decode_attention(**poison_past_length(c, value), config=cfg)
            assert torch.isfinite(dirty).all(), f"poison {value} leaked"
            assert torch.equal(clean, dirty), f"poison {value} changed the output"


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_short_rows_shrink_their_chunk(kv):
    """A grid sized for a long key range (chunk 4 blocks) and rows far shorter: each row's chunk shrinks on the GPU
    to its own length over the splits (min_chunk 1 block); the sums match the reference and the fixed split, and a
    row batched with others gives the bits it gives alone (the chunk follows the row, not the batch)."""
    c = make_case(kv, 3, 2, 6, 2, 64, [5, 40, 150], 4, 256, seed=3)
    b, t, h, hd = c["q"].shape
    dyn = at.plan(b, t, h, 2, hd, 256, kv == "int8", DEVICE, q_dtype=c["q"].dtype, block_n=16, chunk=64,
                  min_chunk=16)
    fixed = dataclasses.replace(dyn, min_chunk=None)
    ref = at.decode_attention_ref(**c)
    out = at.decode_attention(**c, config=dyn)
    assert rel_rms(out, ref) <= RTOL and rel_rms(at.decode_attention(**c, config=fixed), ref) <= RTOL
    for i in range(b):
        one = {**c, "q": c["q"][i:i + 1], "slots": c["slots"][i:i + 1], "q_pos": c["q_pos"][i:i + 1]}
        assert torch.equal(at.decode_attention(**one, config=dyn)[0], out[i]), f"row {i} depends on its batch"
    with pytest.raises(ValueError, match="min_chunk"):
        dataclasses.replace(dyn, min_chunk=24)


@pytest.mark.parametrize("kv,q_dtype", [("int8", torch.bfloat16), ("bf16", torch.bfloat16), ("int8", torch.float32)])
def test_tokens_give_the_bits_single_steps_give(kv, q_dtype):
    """Token invariance (what exact speculative decoding needs): each token of a T = 8 verify call gives the bits a
    T = 1 call at its position gives, with the default plan and with a split whose chunk changes inside the block
    (positions 60..67 cross 64 keys over 4 splits); also batched with a longer row."""
    c = make_case(kv, 2, 8, 12, 2, 64, [68, 150], 3, 256, q_dtype=q_dtype, seed=5)
    b, t, h, hd = c["q"].shape
    dyn = at.plan(b, t, h, 2, hd, 256, kv == "int8", DEVICE, q_dtype=q_dtype, block_n=16, chunk=64, min_chunk=16)
    assert dyn.pack * 6 <= dyn.block_m and dyn.pack >= t  # the default: all 8 tokens in one tile
    # also 3 tokens a tile (tiles of 3, 3, 2) and one token a tile
    cfgs = [None, dyn, at.plan(b, t, h, 2, hd, 256, kv == "int8", DEVICE, q_dtype=q_dtype, block_n=16, chunk=64,
                               min_chunk=16, pack=3),
            at.plan(b, t, h, 2, hd, 256, kv == "int8", DEVICE, q_dtype=q_dtype, block_n=16, chunk=64,
                    min_chunk=16, pack=1)]
    if kv == "int8":  # and a tile per scale group, and scales loaded with their block (the same values as dyn's)
        cfgs += [dataclasses.replace(dyn, grouped=True, ahead=False), dataclasses.replace(dyn, ahead=False),
                 dataclasses.replace(dyn, flat=True)]
    blocks = [at.decode_attention(**c, config=cfg) for cfg in cfgs]  # each T = 8 call once (interpreted: seconds)
    if kv == "int8":
        for same in blocks[-2:]:
            assert torch.equal(same, blocks[1])  # dyn's
    for cfg, block in zip(cfgs, blocks):
        for i in range(b):
            for j in range(t):
                one = {**c, "q": c["q"][i:i + 1, j:j + 1], "slots": c["slots"][i:i + 1],
                       "q_pos": c["q_pos"][i:i + 1, j:j + 1]}
                assert torch.equal(at.decode_attention(**one, config=cfg)[0, 0], block[i, j]), (cfg, i, j)
    assert at.plan(1, 1, 12, 2, 64, 256, True, DEVICE) == at.plan(4, 8, 12, 2, 64, 256, True, DEVICE)


def test_combine_column_blocks():
    """Few (b, t, h) rows: the combine also splits head_dim over programs."""
    c = make_case("int8", *SHAPES["T8-g2-hd64"])
    cfg = at.plan(1, 8, 4, 2, 64, 128, True, DEVICE, q_dtype=c["q"].dtype, block_n=16, chunk=32, combine_cols=16)
    assert rel_rms(at.decode_attention(**c, config=cfg), at.decode_attention_ref(**c)) <= RTOL


def test_kv_len_max_bounds_the_grid():
    c = make_case("int8", *SHAPES["T7-g3-hd96"], seed=2)
    ref = at.decode_attention_ref(**c)
    n = int(c["q_pos"].max()) + 1
    for kv_len_max in (n, n + 7):
        out = at.decode_attention(**c, kv_len_max=kv_len_max)
        assert rel_rms(out, ref) <= RTOL
    with pytest.raises(ValueError, match="kv_len_max"):
        at.decode_attention(**c, kv_len_max=c["k_cache"].shape[2] + 1)


def test_bad_inputs_name_the_problem():
    c = make_case("int8", *SHAPES["T7-g3-hd96"])
    with pytest.raises(ValueError, match="k_scale"):
        at.decode_attention(**{**c, "k_scale": None})
    with pytest.raises(ValueError, match="multiple of Hkv"):
        at.decode_attention(**{**c, "q": c["q"][:, :, :5]})
    f = make_case("bf16", *SHAPES["T7-g3-hd96"])
    with pytest.raises(ValueError, match="only for an int8 cache"):
        at.decode_attention(**{**f, "k_scale": c["k_scale"]})
    with pytest.raises(ValueError, match="q_pos"):
        at.decode_attention(**{**f, "q_pos": f["q_pos"][:, :1]})
    b, t, h, hd = f["q"].shape
    with pytest.raises(ValueError, match="gate must be"):
        at.decode_attention(**f, gate=torch.zeros(b, t, h * hd + 1, device=DEVICE))
    grouped = at.plan(b, t, h, 2, hd, 160, False, DEVICE, q_dtype=f["q"].dtype, grouped=True)
    assert not grouped.grouped  # the planner asks for groups only of an int8 cache
    with pytest.raises(ValueError, match="grouped tiles and scales ahead are for an int8 cache"):
        at.decode_attention(**f, config=dataclasses.replace(grouped, grouped=True))
    with pytest.raises(ValueError, match="grouped tiles and scales ahead are for an int8 cache"):
        at.decode_attention(**f, config=dataclasses.replace(grouped, ahead=True))
    with pytest.raises(ValueError, match="ahead is for one K / V tile"):
        dataclasses.replace(grouped, ahead=True, grouped=True)
    with pytest.raises(ValueError, match="flat tiles take their scales a block ahead"):
        dataclasses.replace(grouped, flat=True)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("split", [False, True], ids=["plan", "split"])
def test_gate_on_store_gives_sigmoid_mul_bits(split, q_dtype):
    """decode_attention(gate=g) stores what kernels/fused.sigmoid_mul makes of the ungated output, to the bit,
    whether the split kernel stores the output or the combine kernel does; and matches the gated reference."""
    from ninfer_bench.kernels import fused

    if q_dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("the Triton interpreter's tl.dot multiplies raw bf16 bit patterns (GPU only)")
    c = make_case("int8", *SHAPES["T7-g3-hd96"], q_dtype=q_dtype)
    b, t, h, hd = c["q"].shape
    gate = (2 * torch.randn(b, t, h * hd, generator=torch.Generator().manual_seed(5))).to(q_dtype).to(DEVICE)
    cfg = split_config(c) if split else None
    plain = at.decode_attention(**c, config=cfg)
    gated = at.decode_attention(**c, config=cfg, gate=gate)
    assert torch.equal(gated.view(b, t, h * hd), fused.sigmoid_mul(plain.view(b, t, h * hd), gate))
    ref = at.decode_attention_ref(**c, gate=gate)
    assert rel_rms(gated, ref) <= (RTOL_BF16 if q_dtype == torch.bfloat16 else RTOL)


def test_plan_depends_on_static_sizes_only():
    """Same sizes, same grid: what CUDA-graph capture needs (the launch reads q_pos only on the device)."""
    cfg = at.plan(1, 1, 24, 4, 256, 65536, True, DEVICE)
    assert cfg == at.plan(1, 1, 24, 4, 256, 65536, True, DEVICE)
    assert -(-65536 // cfg.chunk) > 1, "a long context at B=1 must be split over several programs"
    assert cfg.chunk % cfg.block_n == 0 and (cfg.block_m, cfg.pack) == (64, 10)  # G = 6: 10 tokens a tile


def test_module_imports_without_triton():
    triton_interp.assert_imports_without_triton("attention_triton")


@pytest.mark.parametrize("group", ["fold", "expand", "native", "auto"])
@pytest.mark.parametrize("b,t,h,hkv,length", [(2, 1, 6, 1, 37), (1, 5, 8, 2, 70), (3, 24, 4, 4, 24)])
def test_sdpa_group_strategies_equal_reference(group, b, t, h, hkv, length):
    """kernels.attention.sdpa: the query-row fold and the K/V repeat (the CUDA paths that keep cuDNN's per-shape
    plans away) give the grouped attention of the fp32 reference, on whatever device this runs."""
    from ninfer_bench.kernels.attention import _mask, attention_ref, sdpa

    g = torch.Generator().manual_seed(b * 100 + t)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(b, t, h, 16, generator=g).to(dev)
    k = torch.randn(b, hkv, length, 16, generator=g).to(dev)
    v = torch.randn(b, hkv, length, 16, generator=g).to(dev)
    q_pos = (length - t + torch.arange(t)).expand(b, t).contiguous().to(dev)
    q_pos[0] -= min(2, length - t)  # a row with its own (shorter) view
    ref = attention_ref(q, k, v, q_pos, 0.25)
    out = sdpa(q.transpose(1, 2), k, v, _mask(q_pos, length), 0.25, group=group).transpose(1, 2)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="group"):
        sdpa(q.transpose(1, 2), k, v, _mask(q_pos, length), 0.25, group="bogus")


@pytest.mark.parametrize("b,t,h,hkv,length", [(2, 1, 6, 1, 37), (1, 8, 40, 10, 300), (3, 5, 4, 4, 24)])
def test_sdpa_rows_equals_reference(b, t, h, hkv, length):
    """kernels.attention.sdpa_rows (a drafter's few query rows against its context, as matmuls): the grouped
    attention of the fp32 reference, a random visibility mask per row included, on whatever device this runs."""
    from ninfer_bench.kernels.attention import rows_bias, sdpa, sdpa_rows

    g = torch.Generator().manual_seed(b * 100 + t)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(b, h, t, 16, generator=g).to(dev)
    k = torch.randn(b, hkv, length, 16, generator=g).to(dev)
    v = torch.randn(b, hkv, length, 16, generator=g).to(dev)
    mask = torch.rand(b, 1, t, length, generator=g) < 0.6
    mask[..., -1] = True  # every row sees a key
    ref = sdpa(q, k, v, mask.to(dev), 0.25, group="native")
    out = sdpa_rows(q, k, v, mask.to(dev), 0.25)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-4
    # the additive form made once for a drafter's layers gives the same bits
    assert torch.equal(sdpa_rows(q, k, v, rows_bias(mask.to(dev), h // hkv), 0.25), out)


@pytest.mark.parametrize("b,t,h,hkv,length", [(1, 40, 6, 1, 40), (2, 33, 8, 2, 33), (2, 9, 4, 4, 20),
                                              (1, 1, 4, 2, 1)])
def test_first_chunk_causal_path_equals_reference(b, t, h, hkv, length):
    """kernels.attention.attention on a CPU: a prefill chunk from position 0 that is all the keys takes torch's
    is_causal kernel (no [T, L] mask), anything else the masked call, both the grouped attention of the fp32
    reference; without ``prefill`` the masked call's exact bits; a row whose positions are not 0 .. T - 1 keeps the
    mask."""
    from ninfer_bench.kernels import attention as ak

    g = torch.Generator().manual_seed(b * 100 + t)
    q = torch.randn(b, t, h, 16, generator=g)
    k = torch.randn(b, hkv, length, 16, generator=g)
    v = torch.randn(b, hkv, length, 16, generator=g)
    q_pos = (length - t + torch.arange(t)).expand(b, t).contiguous()
    assert ak.ends_at_length(q_pos, length) == (t > 1)  # the last T positions (T == L: from position 0)
    ref = ak.attention_ref(q, k, v, q_pos, 0.25)
    assert (ak.attention(q, k, v, q_pos, 0.25, prefill=True) - ref).abs().max().item() < 1e-5
    masked = ak.sdpa(q.transpose(1, 2), k, v, ak._mask(q_pos, length), 0.25).transpose(1, 2)
    assert torch.equal(ak.attention(q, k, v, q_pos, 0.25), masked)
    if t == length and t > 1:
        q_pos[-1, -1] -= 1  # one row's last query repeats a position: not a plain causal chunk
        assert not ak.ends_at_length(q_pos, length)
        ref = ak.attention_ref(q, k, v, q_pos, 0.25)
        assert (ak.attention(q, k, v, q_pos, 0.25, prefill=True) - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("b,t,h,hkv,length", [(1, 40, 6, 1, 100), (2, 33, 8, 2, 34), (2, 9, 4, 4, 20),
                                              (1, 2, 6, 3, 300)])
def test_later_chunk_past_and_own_equals_reference(monkeypatch, b, t, h, hkv, length):
    """kernels.attention.attention on a CPU, a prefill chunk that is the last T of the keys: the past keys with no
    mask and the chunk's own block causal, merged by log-sum-exp, give the fp32 reference; without ``prefill`` (a
    verify) the same call keeps the masked SDPA's exact bits; a missing CPU flash kernel falls back to the mask."""
    from ninfer_bench.kernels import attention as ak

    g = torch.Generator().manual_seed(b * 100 + t)
    q = torch.randn(b, t, h, 16, generator=g)
    k = torch.randn(b, hkv, length, 16, generator=g)
    v = torch.randn(b, hkv, length, 16, generator=g)
    q_pos = (length - t + torch.arange(t)).expand(b, t).contiguous()
    assert ak.ends_at_length(q_pos, length)
    ref = ak.attention_ref(q, k, v, q_pos, 0.25)
    split = ak.attention(q, k, v, q_pos, 0.25, prefill=True)
    assert split.shape == ref.shape and split.dtype == q.dtype
    assert (split - ref).abs().max().item() < 1e-5
    masked = ak.sdpa(q.transpose(1, 2), k, v, ak._mask(q_pos, length), 0.25).transpose(1, 2)
    assert torch.equal(ak.attention(q, k, v, q_pos, 0.25), masked)
    monkeypatch.setattr(ak, "_cpu_flash", None)
    assert torch.equal(ak.attention(q, k, v, q_pos, 0.25, prefill=True), masked)
    # a row whose chunk does not end at the keys' end keeps the mask (and its own, shorter view)
    q_pos[0] -= 1
    assert not ak.ends_at_length(q_pos, length)
    monkeypatch.undo()
    ref = ak.attention_ref(q, k, v, q_pos, 0.25)
    assert (ak.attention(q, k, v, q_pos, 0.25, prefill=True) - ref).abs().max().item() < 1e-5
