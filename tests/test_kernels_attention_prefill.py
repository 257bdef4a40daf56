"""prefill_attention (Triton, a prompt chunk against the KV cache in place) against decode_attention_ref.

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by triton_interp before triton is
imported); on CUDA the same cases run compiled, bf16 queries and the default launch shapes included.
"""

import dataclasses
import os

import pytest
import torch

import triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, fixes the interpreter)
from attention_cases import DEVICE, rel_rms
from attention_cases import make_case as attention_case

from ninfer_bench.kernels import attention_prefill as ap
from ninfer_bench.kernels import attention_triton as at
from ninfer_bench.kernels.kv_quant import dequantize_kv

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
RTOL = 2e-3  # fp32 queries against the fp32 reference
RTOL_BF16 = 1e-2  # bf16 queries: q, the dequantized K/V and p rounded to bf16 before the dots

pytestmark = pytest.mark.skipif(not at.triton_available(),
                                reason=f"triton does not import: {at._triton_import_error()}")


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """The output starts as NaN, so a row the kernel never writes fails the comparison."""
    monkeypatch.setattr(ap, "_new_buffer", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                 device=device))


def make_case(kv, h, hkv, hd, starts, t, cap, slots=3, q_dtype=torch.float32, seed=0):
    """Random q of T tokens a row and a cache of ``slots`` slots; row i reads slot perm[i] and its tokens sit at
    starts[i] .. starts[i] + T - 1 (a chunk after starts[i] earlier prompt tokens)."""
    return attention_case(kv, len(starts), t, h, hkv, hd, [s + t for s in starts], slots, cap, q_dtype, seed)


SMALL = ap.PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)  # several blocks each way at test sizes

# (H, Hkv, hd, starts, T, cap): a first chunk (start 0), later chunks whose start is not a multiple of any tile,
# T not a multiple of BLOCK_M, groups 1 / 3 / 6, head dims 8 - 256
SHAPES = {
    "first-g3-hd64": (6, 2, 64, [0], 37, 48),
    "later-g6-hd128": (12, 2, 128, [21, 50], 19, 80),
    "later-g1-hd32": (2, 2, 32, [0, 77], 33, 112),
    "later-g3-hd256": (3, 1, 256, [40], 24, 64),
    "first-g2-hd8": (4, 2, 8, [0, 5], 20, 32),  # head dim under tl.dot's 16: padded tiles
}


@pytest.mark.parametrize("kv", ["bf16", "fp16", "int8"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("config", ["plan", "small"])
def test_matches_reference(kv, shape, config):
    c = make_case(kv, *SHAPES[shape])
    ref = at.decode_attention_ref(**c)
    out = ap.prefill_attention(**c, config=SMALL if config == "small" else None)
    assert out.shape == ref.shape and out.dtype == c["q"].dtype
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    err = rel_rms(out, ref)
    assert err <= RTOL, f"{kv} {shape}: relative RMS {err:.2e} > {RTOL}"


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_bf16_queries_default_plan(kv):
    """The engine's case: bf16 queries, the default launch shape (compiled on a GPU)."""
    if INTERPRET:
        pytest.skip("the Triton interpreter's tl.dot multiplies raw bf16 bit patterns (GPU only)")
    c = make_case(kv, 12, 2, 256, [0, 300], 200, 512, q_dtype=torch.bfloat16)
    ref = at.decode_attention_ref(**{**c, "q": c["q"].float()})
    out = ap.prefill_attention(**c)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_rms(out, ref) <= RTOL_BF16


def test_padding_rows_and_poison_past_positions():
    """Rows of a padded chunk (positions past the real ones, as a captured prefill pads) do not change the real
    rows, and cache entries past each row's position (NaN, huge) never reach the output."""
    c = make_case("int8", 6, 2, 64, [10], 30, 64, seed=1)
    clean = ap.prefill_attention(**c, config=SMALL)
    dead = torch.arange(64, device=DEVICE) > int(c["q_pos"].max())
    p = dict(c)
    for name in ("k_cache", "v_cache"):
        p[name] = c[name].masked_fill(dead[None, None, :, None], 127)
    for name, val in (("k_scale", float("nan")), ("v_scale", 6e4)):
        p[name] = c[name].masked_fill(dead[None, None, :, None], val)
    dirty = ap.prefill_attention(**p, config=SMALL)
    assert torch.equal(clean, dirty)
    real = 17  # the first 17 tokens alone: the same rows, bit for bit (each row's tiles do not depend on T)
    one = {**c, "q": c["q"][:, :real], "q_pos": c["q_pos"][:, :real]}
    assert torch.equal(ap.prefill_attention(**one, config=SMALL), clean[:, :real])


TMA = ap.PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, tma=True)


@pytest.mark.parametrize("kv", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_descriptor_path_gives_the_pointer_paths_bits(shape, kv):
    """K / V tiles through tensor descriptors (``tma``): the same sums, bit for bit,
    with the cache past each row's position poisoned (NaN keys, huge values) - a tile's rows past its end belong to
    the next kv head or lie past the view, and must not reach the output."""
    c = make_case(kv, *SHAPES[shape])
    assert ap.descriptor_ok(c["k_cache"], c["v_cache"])
    want = ap.prefill_attention(**c, config=SMALL)
    cfg = TMA
    assert torch.equal(ap.prefill_attention(**c, config=cfg), want)
    cap = c["k_cache"].shape[2]
    live = c["q_pos"].max(dim=1).values  # per row; poison every slot past the largest position any row reads
    dead = torch.arange(cap, device=DEVICE) > int(live.max())
    p = {**c, "k_cache": c["k_cache"].masked_fill(dead[None, None, :, None], float("nan")),
         "v_cache": c["v_cache"].masked_fill(dead[None, None, :, None], 6e4)}
    assert torch.equal(ap.prefill_attention(**p, config=cfg), want)


def test_descriptor_path_default_shape_bf16():
    """The engine's shape (bf16 queries, hd 256, the default tiles, which read through descriptors): the pointer
    kernel's bits, compiled."""
    if INTERPRET:
        pytest.skip("the Triton interpreter's tl.dot multiplies raw bf16 bit patterns (GPU only)")
    c = make_case("bf16", 12, 2, 256, [0, 300], 200, 512, q_dtype=torch.bfloat16)
    plan = ap.prefill_plan(256, False, torch.bfloat16)
    assert plan.tma  # the default at this head size
    want = ap.prefill_attention(**c, config=dataclasses.replace(plan, tma=False))
    assert torch.equal(ap.prefill_attention(**c, config=plan), want)


def test_descriptor_ok_refuses_what_it_cannot_read():
    c = make_case("bf16", *SHAPES["later-g6-hd128"])
    k, v = c["k_cache"], c["v_cache"]
    assert ap.descriptor_ok(k, v)
    assert not ap.descriptor_ok(k.transpose(2, 3), v.transpose(2, 3))  # not contiguous
    assert not ap.descriptor_ok(k.float(), v.float())  # 32-bit: the pointer kernel
    q8 = make_case("int8", *SHAPES["later-g6-hd128"])
    assert not ap.descriptor_ok(q8["k_cache"], q8["v_cache"])
    odd = make_case("bf16", 2, 1, 4, [0], 4, 16)  # rows of 8 bytes: under the copy engine's 16
    assert not ap.descriptor_ok(odd["k_cache"], odd["v_cache"])
    # a tma plan on a cache it cannot read takes the pointer kernel: same result
    assert torch.equal(ap.prefill_attention(**q8, config=TMA), ap.prefill_attention(**q8, config=SMALL))


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gate_on_store_gives_sigmoid_mul_bits(q_dtype):
    from ninfer_bench.kernels import fused

    if q_dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("the Triton interpreter's tl.dot multiplies raw bf16 bit patterns (GPU only)")
    c = make_case("int8", *SHAPES["later-g6-hd128"], q_dtype=q_dtype)
    b, t, h, hd = c["q"].shape
    gate = (2 * torch.randn(b, t, h * hd, generator=torch.Generator().manual_seed(5))).to(q_dtype).to(DEVICE)
    plain = ap.prefill_attention(**c)
    gated = ap.prefill_attention(**c, gate=gate)
    assert torch.equal(gated.view(b, t, h * hd), fused.sigmoid_mul(plain.view(b, t, h * hd), gate))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_dequantize_slots_rounds_once(dtype):
    """The copy holds each value as the fp32 product of code and scale rounded once to the dtype, for the slots in
    the order asked, keys 0 .. length - 1 (a length that is no multiple of the program's key block)."""
    if dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("the Triton interpreter truncates to bf16 instead of rounding to nearest (GPU only)")
    c = make_case("int8", 6, 2, 96, [0, 0], 4, 150)
    length = 141
    out = ap.dequantize_slots(c["k_cache"], c["k_scale"], c["slots"], length, dtype)
    want = dequantize_kv(c["k_cache"][c["slots"], :, :length], c["k_scale"][c["slots"], :, :length], torch.float32)
    assert out.shape == (2, 2, length, 96) and out.dtype == dtype
    assert torch.equal(out, want.to(dtype))
    with pytest.raises(ValueError, match="length"):
        ap.dequantize_slots(c["k_cache"], c["k_scale"], c["slots"], 151, dtype)


@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_cached_path_matches_reference(kv):
    """What the engine calls: an int8 cache through a dequantized copy of the slots' key range, a bf16 one in place."""
    c = make_case(kv, *SHAPES["later-g6-hd128"])
    kv_len = int(c["q_pos"].max()) + 5
    out = ap.prefill_attention_cached(**c, kv_len=kv_len, config=SMALL)
    assert rel_rms(out, at.decode_attention_ref(**c)) <= RTOL


def past_ref(c, key_lo):
    """fp32 attention of the case's queries over keys 0 .. key_lo - 1 alone: (output [B, T, H, hd] in q's dtype,
    natural-log sum-exp [B, H, T]), what cudnn_past returns."""
    k, v = (past_ref_keys(c, which)[:, :, :key_lo] for which in ("k", "v"))
    return attention_ref(c["q"], k, v, c["scale"])


def attention_ref(q, k, v, scale):
    """fp32 attention of ``q [B, T, H, hd]`` over every key of ``k`` / ``v [B, H, L, hd]``: (output [B, T, H, hd] in
    q's dtype, natural-log sum-exp [B, H, T])."""
    s = torch.einsum("bthd,bhkd->bhtk", q.float(), k.float()) * scale
    o = torch.einsum("bhtk,bhkd->bthd", torch.softmax(s, -1), v.float())
    return o.to(q.dtype), torch.logsumexp(s, -1)


@pytest.mark.parametrize("kv,config", [("int8", "small"), ("bf16", "small"), ("bf16", "tma")])
def test_keys_below_key_lo_folded_in_from_past(kv, config):
    """``key_lo`` with ``past``: the kernel reads keys from key_lo on and folds in another kernel's normalised output
    and natural-log sum-exp over the keys below (cuDNN's on a GPU, an fp32 reference here): the whole softmax's
    result, gated on store as without it; without ``past`` the keys below key_lo are left out."""
    cfg = SMALL if config == "small" else TMA
    c = make_case(kv, 6, 2, 64, [40, 53], 21, 96, seed=3)
    key_lo = 32
    ref = at.decode_attention_ref(**c)
    past = past_ref(c, key_lo)
    out = ap.prefill_attention(**c, config=cfg, key_lo=key_lo, past=past)
    assert torch.isfinite(out).all()
    assert rel_rms(out, ref) <= RTOL, rel_rms(out, ref)
    b, t, h, hd = c["q"].shape
    gate = torch.randn(b, t, h * hd, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    from ninfer_bench.kernels import fused

    gated = ap.prefill_attention(**c, config=cfg, key_lo=key_lo, past=past, gate=gate)
    assert torch.equal(gated.view(b, t, h * hd), fused.sigmoid_mul(out.view(b, t, h * hd), gate))
    # no past: attention over keys key_lo .. q_pos alone; the keys below are poisoned (NaN): never read
    below = (torch.arange(c["k_cache"].shape[2], device=DEVICE) < key_lo)[None, None, :, None]
    poisoned = {**c, "k_scale": c["k_scale"].masked_fill(below, float("nan"))} if kv == "int8" else \
        {**c, "k_cache": c["k_cache"].masked_fill(below, float("nan"))}
    alone = ap.prefill_attention(**poisoned, config=cfg, key_lo=key_lo)
    keys = torch.arange(c["k_cache"].shape[2], device=DEVICE)
    kk, vv = (past_ref_keys(c, name) for name in ("k", "v"))
    sc = torch.einsum("bthd,bhkd->bhtk", c["q"].float(), kk) * c["scale"]
    live = (keys[None, None, None, :] >= key_lo) & (keys[None, None, None, :] <= c["q_pos"][:, None, :, None])
    want = torch.einsum("bhtk,bhkd->bthd", torch.softmax(sc.masked_fill(~live, float("-inf")), -1), vv)
    assert rel_rms(alone, want) <= RTOL


def past_ref_keys(c, which):
    """The case's dequantized K or V for its rows' slots, repeated to the query heads: [B, H, cap, hd] fp32."""
    x, sc = c[f"{which}_cache"][c["slots"]], c[f"{which}_scale"]
    x = dequantize_kv(x, sc[c["slots"]], torch.float32) if x.dtype == torch.int8 else x.float()
    return x.repeat_interleave(c["q"].shape[2] // x.shape[1], dim=1)


def test_key_lo_and_past_are_checked():
    c = make_case("int8", *SHAPES["later-g6-hd128"])
    with pytest.raises(ValueError, match="multiple of block_n"):
        ap.prefill_attention(**c, config=SMALL, key_lo=8)
    past = past_ref(c, 16)
    with pytest.raises(ValueError, match="key_lo > 0"):
        ap.prefill_attention(**c, config=SMALL, past=past)
    with pytest.raises(ValueError, match="lse"):
        ap.prefill_attention(**c, config=SMALL, key_lo=16, past=(past[0], past[1].transpose(1, 2)))
    with pytest.raises(ValueError, match="past output"):
        ap.prefill_attention(**c, config=SMALL, key_lo=16, past=(past[0][:, :-1], past[1]))


def test_dequantize_slots_bshd_layout():
    """layout "bshd": the same [B, Hkv, L, hd] values over [B, L, Hkv, hd] memory (cuDNN's layout)."""
    c = make_case("int8", 6, 2, 64, [0, 0], 4, 80)
    want = ap.dequantize_slots(c["k_cache"], c["k_scale"], c["slots"], 70, torch.float32)
    out = ap.dequantize_slots(c["k_cache"], c["k_scale"], c["slots"], 70, torch.float32, layout="bshd")
    assert out.shape == want.shape and out.permute(0, 2, 1, 3).is_contiguous() and torch.equal(out, want)
    with pytest.raises(ValueError, match="layout"):
        ap.dequantize_slots(c["k_cache"], c["k_scale"], c["slots"], 70, torch.float32, layout="sbhd")


def test_cudnn_split_only_where_it_can_run():
    """The cuDNN split needs CUDA, 16-bit queries, one row and CUDNN_PAST_MIN keys before the chunk; elsewhere the
    cached path with ``cudnn`` gives the kernel's own bits."""
    c = make_case("int8", 6, 2, 64, [40], 21, 96)
    assert not ap.cudnn_past_ok(c["q"], ap.CUDNN_PAST_MIN)  # fp32 queries (and on the CPU: no CUDA)
    assert not ap.cudnn_past_ok(c["q"].to(torch.bfloat16), ap.CUDNN_PAST_MIN - 1)
    kv_len = int(c["q_pos"].max()) + 1
    want = ap.prefill_attention_cached(**c, kv_len=kv_len, config=SMALL)
    got = ap.prefill_attention_cached(**c, kv_len=kv_len, config=SMALL, cudnn=True, past_start=40)
    assert torch.equal(got, want)


@pytest.mark.parametrize("t", [21, 32])
def test_cudnn_split_buckets_its_shapes(t, monkeypatch):
    """cuDNN builds a plan per shape, so the split buckets its shapes: the queries cuDNN takes are the chunk's
    rows padded with zero rows to a multiple of CUDNN_ROWS, the keys below the chunk cut down to a multiple of
    CUDNN_KEYS (the kernel takes the rest); the result is still the whole attention's (an fp32 reference stands in
    for cuDNN on the CPU, small buckets for the test's sizes)."""
    monkeypatch.setattr(ap, "CUDNN_ROWS", 16)
    monkeypatch.setattr(ap, "CUDNN_KEYS", 48)  # three of the kernel's 16-key tiles
    monkeypatch.setattr(ap, "cudnn_past_ok", lambda q, start: True)
    c = make_case("int8", 6, 2, 64, [70], t, 112, q_dtype=torch.float16, seed=5)
    seen = []

    def fake_cudnn(q, k, v, key_lo, scale):  # cudnn_past's contract in fp32: k / v [1, Hkv, L, hd] over BSHD memory
        seen.append((q.shape[1], key_lo))
        assert q.dtype == torch.float16 and torch.equal(q[:, :t], c["q"]) and not q[:, t:].any()
        kk, vv = (x[:, :, :key_lo].repeat_interleave(q.shape[2] // x.shape[1], dim=1) for x in (k, v))
        return attention_ref(q, kk, vv, scale)

    monkeypatch.setattr(ap, "cudnn_past", fake_cudnn)
    kv_len = 70 + t
    got = ap.prefill_attention_cached(**c, kv_len=kv_len, config=SMALL, cudnn=True, past_start=70, fp16_safe=True)
    assert seen == [(32, 48)]  # 21 or 32 rows -> 32; 70 keys below the chunk -> 48
    ref = at.decode_attention_ref(**{**c, "q": c["q"].float()})
    alone = ap.prefill_attention_cached(**c, kv_len=kv_len, config=SMALL)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    assert rel_rms(got, ref) <= RTOL_BF16 and rel_rms(got, alone) <= RTOL_BF16, (rel_rms(got, ref), rel_rms(got, alone))


def test_fp16_fits_reads_the_slots_keys_and_the_queries():
    """The fp16 split's range check: |q| and 127 x every scale of the given slots' keys 0 .. kv_len - 1 at most
    fp16's largest finite value; a scale past kv_len or in another slot does not count, NaN fails."""
    c = make_case("int8", 6, 2, 64, [40], 21, 96)
    kv_len = 61
    args = (c["k_scale"], c["v_scale"], c["slots"], kv_len)
    assert ap.fp16_fits(c["q"], *args)
    slot = int(c["slots"][0])
    other = next(i for i in range(c["k_scale"].shape[0]) if i != slot)
    big = ap.FP16_MAX / 127 * 1.01  # a scale whose largest code overflows fp16
    for which in ("k_scale", "v_scale"):
        for where, fits in (((slot, 1, kv_len - 1, 0), False), ((slot, 0, kv_len, 0), True), ((other, 0, 3, 0), True)):
            sc = c[which].clone()
            sc[where] = big
            a = {"k_scale": c["k_scale"], "v_scale": c["v_scale"], which: sc}
            assert ap.fp16_fits(c["q"], a["k_scale"], a["v_scale"], c["slots"], kv_len) is fits, (which, where)
    q = c["q"].clone()
    q[0, 3, 1, 5] = -70000.0
    assert not ap.fp16_fits(q, *args)
    q[0, 3, 1, 5] = ap.FP16_MAX
    assert ap.fp16_fits(q, *args)
    q[0, 3, 1, 5] = float("nan")
    assert not ap.fp16_fits(q, *args)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_output_in_another_dtype_than_the_queries(out_dtype):
    """``out_dtype``: fp16 queries and keys with the fp32 result rounded once to another dtype (the fp16 split's
    store in the model's bf16), gated as the output is stored; past folded in as in q's dtype."""
    if out_dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("the Triton interpreter truncates to bf16 instead of rounding to nearest (GPU only)")
    c = make_case("fp16", 6, 2, 64, [40, 53], 21, 96, q_dtype=torch.float16, seed=4)
    ref = at.decode_attention_ref(**{**c, "q": c["q"].float()})
    key_lo = 32
    past = past_ref(c, key_lo)
    out = ap.prefill_attention(**c, config=SMALL, key_lo=key_lo, past=past, out_dtype=out_dtype)
    assert out.dtype == out_dtype and rel_rms(out, ref) <= RTOL_BF16, rel_rms(out, ref)
    same = ap.prefill_attention(**c, config=SMALL, key_lo=key_lo, past=past)
    assert same.dtype == torch.float16 and rel_rms(out, same) <= RTOL_BF16
    if out_dtype == torch.float32:  # rounded to fp16 it is the kernel's own fp16 output
        assert torch.equal(out.to(torch.float16), same)
    b, t, h, hd = c["q"].shape
    gate = torch.randn(b, t, h * hd, generator=torch.Generator().manual_seed(2)).to(DEVICE).to(out_dtype)
    from ninfer_bench.kernels import fused

    gated = ap.prefill_attention(**c, config=SMALL, key_lo=key_lo, past=past, gate=gate, out_dtype=out_dtype)
    assert torch.equal(gated.view(b, t, h * hd), fused.sigmoid_mul(out.view(b, t, h * hd), gate))


def test_cudnn_prefill_is_an_engine_switch():
    """The split is ``--cudnn-prefill`` (on by default; a run with it off is labelled ``-nocudnnpast``), recorded in
    a run's settings; the model takes it only with the flash prefill path."""
    from ninfer_bench.engine.runtime.options import SWITCHES, EngineOptions
    from ninfer_bench.reports.experiment import SETTING_KEYS
    from ninfer_bench.suites.decode import DecodeOptions

    sw = SWITCHES["cudnn_prefill"]
    assert EngineOptions().cudnn_prefill and sw.flag == "--cudnn-prefill" and "cudnn_prefill" in SETTING_KEYS
    assert (sw.label(True), sw.label(False)) == ("", "-nocudnnpast")
    assert SWITCHES["pdl"].label(True) == "" and SWITCHES["pdl"].label(False) == "-nopdl"
    on, off = (DecodeOptions.make(model="tiny", cudnn_prefill=v).default_label() for v in (True, False))
    assert off == on + "-nocudnnpast"


def test_cudnn_split_takes_the_head_sizes_where_it_pays(monkeypatch):
    """The split's head-size floor: a chunk's past goes to cuDNN at head size 256 (where it measured faster), not at
    64 (slower) nor past cuDNN's 256; NINFER_BENCH_CUDNN_MIN_HEAD_DIM moves the floor for a process and is recorded
    as a kernel knob; a value that is not a positive integer is refused by name. (On a CPU nothing qualifies: the
    device is checked first, so the head sizes are checked through a stand-in for a CUDA tensor.)"""
    from ninfer_bench.reports.schema import KERNEL_KNOBS

    class Q:  # what cudnn_past_ok reads of q
        dtype, device = torch.bfloat16, torch.device("cuda")

        def __init__(self, hd):
            self.shape = (1, 512, 24, hd)

    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setitem(ap._CUDNN, "refused", None)
    monkeypatch.delenv("NINFER_BENCH_CUDNN_MIN_HEAD_DIM", raising=False)
    assert ap.cudnn_min_head_dim() == ap.CUDNN_MIN_HEAD_DIM == 256
    assert [ap.cudnn_past_ok(Q(hd), 4096) for hd in (64, 128, 256, 512)] == [False, False, True, False]
    assert not ap.cudnn_past_ok(Q(256), ap.CUDNN_PAST_MIN - 1)
    # what a result records as its cudnn_prefill (Engine.recorded): the model's head size on the device
    assert [ap.cudnn_split_applies(hd, "cuda") for hd in (64, 256, 512)] == [False, True, False]
    assert not ap.cudnn_split_applies(256, "cpu")
    monkeypatch.setenv("NINFER_BENCH_CUDNN_MIN_HEAD_DIM", "8")
    assert [ap.cudnn_past_ok(Q(hd), 4096) for hd in (32, 64, 256, 512)] == [True, True, True, False]
    assert ap.cudnn_split_applies(64, torch.device("cuda", 0))
    assert not ap.cudnn_past_ok(torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16), 4096)  # a CPU tensor never
    assert "NINFER_BENCH_CUDNN_MIN_HEAD_DIM" in KERNEL_KNOBS
    for bad in ("hd64", "0", "-8"):
        monkeypatch.setenv("NINFER_BENCH_CUDNN_MIN_HEAD_DIM", bad)
        with pytest.raises(ValueError, match="NINFER_BENCH_CUDNN_MIN_HEAD_DIM"):
            ap.cudnn_past_ok(Q(256), 4096)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's fused attention needs CUDA")
@pytest.mark.parametrize("start", [2048, 4160])
def test_cudnn_past_split_matches_the_kernel(start, monkeypatch):
    """The engine's split on a GPU: an int8 cache, bf16 queries at hd 256, one row, a chunk after ``start`` keys
    (4,160: not a multiple of the chunk): cuDNN's past folded into the kernel's diagonal agrees with the kernel alone
    and with the fp32 reference, cuDNN accepted."""
    c = attention_case("int8", 1, 256, 24, 4, 256, [start + 256], 2, start + 300, torch.bfloat16)
    kv_len = start + 256
    ref = at.decode_attention_ref(**{**c, "q": c["q"].float()})
    alone = ap.prefill_attention_cached(**c, kv_len=kv_len)
    assert ap.cudnn_past_ok(c["q"], start)
    split = ap.prefill_attention_cached(**c, kv_len=kv_len, cudnn=True, past_start=start)
    assert ap._CUDNN["refused"] is None, ap._CUDNN["refused"]
    assert split.dtype == torch.bfloat16 and ap.fp16_fits(c["q"], c["k_scale"], c["v_scale"], c["slots"], kv_len)
    assert rel_rms(split, ref) <= RTOL_BF16 and rel_rms(split, alone) <= RTOL_BF16
    assert rel_rms(split, ref) <= 1.1 * rel_rms(alone, ref) + 1e-5  # in fp16: as close to fp32 as the kernel alone
    # the caller vouching for fp16's range (fp16_safe): the same split, and no range check read back
    with monkeypatch.context() as m:
        m.setattr(ap, "fp16_fits", lambda *a: pytest.fail("fp16_safe still read the range back"))
        assert torch.equal(ap.prefill_attention_cached(**c, kv_len=kv_len, cudnn=True, past_start=start,
                                                       fp16_safe=True), split)
    # a scale past fp16's range: the split in bf16, as close as before the fp16 path
    wide = {**c, "v_scale": c["v_scale"].clone()}
    wide["v_scale"][int(c["slots"][0]), 0, 7, 0] = ap.FP16_MAX / 100
    assert not ap.fp16_fits(wide["q"], wide["k_scale"], wide["v_scale"], wide["slots"], kv_len)
    ref16 = at.decode_attention_ref(**{**wide, "q": wide["q"].float()})
    split16 = ap.prefill_attention_cached(**wide, kv_len=kv_len, cudnn=True, past_start=start)
    alone16 = ap.prefill_attention_cached(**wide, kv_len=kv_len)
    assert torch.isfinite(split16).all() and rel_rms(split16, ref16) <= 1.5 * rel_rms(alone16, ref16) + 1e-4


def test_bad_inputs_name_the_function():
    c = make_case("int8", *SHAPES["first-g3-hd64"])
    with pytest.raises(ValueError, match="prefill_attention: .*k_scale"):
        ap.prefill_attention(**{**c, "k_scale": None})
    with pytest.raises(ValueError, match="kv_len_max"):
        ap.prefill_attention(**c, kv_len_max=c["k_cache"].shape[2] + 1)
    with pytest.raises(ValueError, match="power of two"):
        ap.PrefillConfig(block_m=24, block_n=16, num_warps=4, num_stages=1)


def test_plan_overrides():
    cfg = ap.prefill_plan(256, True)
    assert cfg.block_m >= 64 and cfg.block_n >= 32
    assert ap.prefill_plan(256, True, block_n=32).block_n == 32
    assert ap.prefill_plan(64, False, torch.float32).block_m <= 32  # the interpreter's small fp32 tiles


def test_plan_overrides_from_the_environment(monkeypatch):
    assert ap.plan_overrides("block_n=32, tma=1,num_warps=4") == dict(block_n=32, tma=True, num_warps=4)
    monkeypatch.setenv("NINFER_BENCH_PREFILL_PLAN", "num_stages=3,tma=1")
    cfg = ap.prefill_plan(256, False, torch.bfloat16)
    assert (cfg.num_stages, cfg.tma, cfg.block_n) == (3, True, 64)
    monkeypatch.setenv("NINFER_BENCH_PREFILL_PLAN", "tma=0")
    assert not ap.prefill_plan(256, False, torch.bfloat16).tma
    assert ap.prefill_plan(256, False, torch.bfloat16, num_stages=1).num_stages == 1  # the caller's keyword wins
    assert not ap.prefill_plan(64, False, torch.float32).tma  # the reference-precision plan is left alone
    for bad in ("tma", "colour=1", "block_n=x"):
        with pytest.raises(ValueError, match="NINFER_BENCH_PREFILL_PLAN"):
            ap.plan_overrides(bad)


def test_module_imports_without_triton():
    triton_interp.assert_imports_without_triton("attention_prefill")


def test_a_run_records_the_split_as_applied(monkeypatch):
    """Engine.recorded (a result's cudnn_prefill): on only where the switch is on and the split can take this model's
    head size on this device - never on a CPU, not below the head-size floor."""
    from ninfer_bench.engine.runtime.engine import Engine

    eng = Engine.load("tiny", device="cpu")
    assert eng.options.cudnn_prefill and eng.recorded == {"cudnn_prefill": False}
    hd = eng.model_config.head_dim
    monkeypatch.setattr(eng.model, "cudnn_prefill", True)  # what a CUDA engine's model holds with the switch on
    monkeypatch.setattr(eng, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setenv("NINFER_BENCH_CUDNN_MIN_HEAD_DIM", str(hd + 8))
    assert eng.recorded == {"cudnn_prefill": False}
    monkeypatch.setenv("NINFER_BENCH_CUDNN_MIN_HEAD_DIM", str(hd))
    assert eng.recorded == {"cudnn_prefill": hd % 8 == 0}
    monkeypatch.setattr(eng.model, "cudnn_prefill", False)
    assert eng.recorded == {"cudnn_prefill": False}
