"""Quantized projections ``y = x @ W.T`` straight from the packed formats of ``engine.quant``.

Shapes: x ``[T, K]``, W ``[N, K]`` stored as ``quant.pack(W, fmt)`` (flat uint8), y ``[T, N]``.
``fmt`` is one of ``q8_g32_fp16``, ``q5_g64_fp16``, ``q4_g64_fp16``; the byte layout is fixed in
``engine/quant.py`` and read here as it is: every group (32 values for q8, 64 for q5/q4) of one row
is 32 contiguous code bytes, plus 8 high-bit bytes for q5, plus one fp16 scale.

  qlinear_ref      plain fp32 reference: x @ dequantize(buf).T
  qlinear_triton   fused dequantize-and-multiply Triton kernel, for the decode / verify widths (T <= 64)
  qlinear_dequant  the packed weight as a dense [N, K] tensor, on the device (Triton)
  PackedLinear     a packed weight placed on a device, callable on x [..., K]

The kernel is a GEMV at these widths: each weight byte is read once, so time ~ packed bytes / bandwidth.
A program owns BLOCK_N rows and a run of K groups; per group it turns the 32 code bytes of each row
into exact integer codes (float bit tricks, no int->float conversion instructions), multiplies them
with x's 64 (or 32) values, then applies the row's fp16 scale to the group's partial sum in fp32, so
the weights enter the product exactly (no bf16 rounding of ``q * scale``). Two ways to do the multiply:
  - "fma": broadcast-multiply-reduce on the CUDA cores (few rows of x: T <= 2 or so);
  - "dot": ``tl.dot`` with the weight tile as the left operand ("swap AB") and x^T padded to 16 columns
    on the tensor cores; exact for bf16/fp16 x because the codes are small integers.
When N / BLOCK_N programs are too few to fill the GPU, K is split over several programs whose fp32 sums
meet in a shared workspace; the last program of each tile writes the output (one launch, see _epilogue).
The launch configuration is a pure function of (fmt, N, K, T, dtype) (``choose_config``): no autotuning,
so nothing is timed or synchronised on the first call and the launch is safe under CUDA-graph capture.

Triton is imported on first use, so this module imports (and the CPU fallback runs) without it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..engine import quant

__all__ = ["qlinear_ref", "qlinear_triton", "qlinear_dequant", "PackedLinear", "QConfig", "choose_config",
           "MAX_KERNEL_ROWS"]

# Rows of x up to which PackedLinear uses the fused kernel; wider inputs (prefill) use a dense weight.
MAX_KERNEL_ROWS = 64
_FMT_ID = {"q8_g32_fp16": 0, "q5_g64_fp16": 1, "q4_g64_fp16": 2}
# Bytes of codes per group and row, the same for all three formats (32 x 8 bits, 64 x 4 bits).
_GROUP_CODE_BYTES = 32

# Bound lazily by _kernels(): the Triton modules and the jitted functions below.
triton = None
tl = None


def qlinear_ref(x: torch.Tensor, buf: torch.Tensor, fmt: str, shape: tuple[int, int]) -> torch.Tensor:
    """fp32 reference: ``x [T, K]`` (any float dtype) @ ``dequantize(buf, fmt, shape).T`` -> ``[T, N]`` fp32."""
    w = quant.dequantize(buf.reshape(-1).cpu(), fmt, shape)  # [N, K] fp32
    return x.detach().cpu().to(torch.float32) @ w.T


# ---------------------------------------------------------------------------------------------------
# Triton kernels. Written as plain functions and jitted on first use (see _kernels).


def _codes_as(u, QMIN: tl.constexpr, DT: tl.constexpr):
    """Unsigned codes u (int32, 0 <= u < 256) as the exact values q = u + QMIN in dtype DT.

    Built from bits, not converted: u in the low mantissa bits of a power of two P gives P + u exactly,
    and one subtraction gives q. int->float conversions run at a quarter of the FMA rate on Hopper.
    """
    if DT == tl.bfloat16 and QMIN > -128:  # u < 128 fits bf16's 7 mantissa bits: 0x4300 = 128.0
        return (u | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - (128.0 - QMIN)
    elif DT == tl.float16:  # 0x6400 = 1024.0, 10 mantissa bits
        return (u | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 - QMIN)
    else:  # fp32: 0x43800000 = 256.0, one mantissa unit there is 2^-15 (q8 with bf16 x comes here too)
        return (((u << 15) | 0x43800000).to(tl.float32, bitcast=True) - (256.0 - QMIN)).to(DT)


def _q4_pairs_asm(b, DT: tl.constexpr):
    """q4 bytes -> (low-nibble codes, high-nibble codes) as exact q in DT (bf16/fp16), 4 bytes per asm block.

    FasterTransformer's trick: spread two bytes into the two 16-bit lanes of a register (prmt), mask a
    nibble into each lane's mantissa and OR in the exponent of 128 (bf16) / 1024 (fp16) with one lop3, then
    subtract 128 + 8 / 1024 + 8 from both lanes with one packed instruction: ~1.5 instructions per value.
    """
    if DT == tl.bfloat16:  # 0x4300 = 128.0; bias: one 1.0 = 0x3F80, -136.0 = 0xC308
        lo, hi = tl.inline_asm_elementwise(
            asm="""{ .reg .b32 t0, t1, s0, s1, one, bias, z;
            mov.b32 z, 0; mov.b32 one, 0x3F803F80; mov.b32 bias, 0xC308C308;
            prmt.b32 t0, $4, z, 0x4140; prmt.b32 t1, $4, z, 0x4342;
            shr.b32 s0, t0, 4; shr.b32 s1, t1, 4;
            lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA; lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 $2, s0, 0x000F000F, 0x43004300, 0xEA; lop3.b32 $3, s1, 0x000F000F, 0x43004300, 0xEA;
            fma.rn.bf16x2 $0, $0, one, bias; fma.rn.bf16x2 $1, $1, one, bias;
            fma.rn.bf16x2 $2, $2, one, bias; fma.rn.bf16x2 $3, $3, one, bias; }""",
            constraints="=r,=r,=r,=r,r", args=[b], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:  # fp16: 0x6400 = 1024.0, 0x6408 = 1032.0
        lo, hi = tl.inline_asm_elementwise(
            asm="""{ .reg .b32 t0, t1, s0, s1, bias, z;
            mov.b32 z, 0; mov.b32 bias, 0x64086408;
            prmt.b32 t0, $4, z, 0x4140; prmt.b32 t1, $4, z, 0x4342;
            shr.b32 s0, t0, 4; shr.b32 s1, t1, 4;
            lop3.b32 $0, t0, 0x000F000F, 0x64006400, 0xEA; lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 $2, s0, 0x000F000F, 0x64006400, 0xEA; lop3.b32 $3, s1, 0x000F000F, 0x64006400, 0xEA;
            sub.f16x2 $0, $0, bias; sub.f16x2 $1, $1, bias; sub.f16x2 $2, $2, bias; sub.f16x2 $3, $3, bias; }""",
            constraints="=r,=r,=r,=r,r", args=[b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return lo, hi


def _group_operands(codes_ptr, high_ptr, rows, g, g_ok, stride_c, stride_h,
                    FMT: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """Group g of each of ``rows`` as exact codes in DT: (even-k, odd-k) ``[BN, 32]`` for q5/q4, (k, k) for q8.

    Byte c of a group's 32 code bytes holds k = 2c (low nibble) and 2c + 1 (high nibble) for q5/q4 and
    k = c for q8; for q5, bit 2(c % 4) (+1) of high byte c // 4 is bit 4 of the even (odd) code.
    """
    c = tl.arange(0, 32)
    b = tl.load(codes_ptr + rows[:, None] * stride_c + g * 32 + c[None, :], mask=g_ok, other=0)  # [BN, 32] u8
    if FMT == 0:
        q = _codes_as(b.to(tl.int32) ^ 0x80, -128, DT)  # int8 code q = (byte ^ 0x80) - 128
        return q, q
    elif FMT == 2 and USE_ASM:
        return _q4_pairs_asm(b, DT)
    else:
        bi = b.to(tl.int32)
        lo = bi & 15
        hi = bi >> 4
        if FMT == 1:
            h = tl.load(high_ptr + rows[:, None] * stride_h + g * 8 + (c // 4)[None, :], mask=g_ok, other=0)
            sh = 2 * (c % 4)
            hb = h.to(tl.int32) >> sh[None, :]
            lo = lo | ((hb & 1) << 4)
            hi = hi | ((hb & 2) << 3)
            return _codes_as(lo, -16, DT), _codes_as(hi, -16, DT)
        return _codes_as(lo, -8, DT), _codes_as(hi, -8, DT)


def _qlinear_kernel(x_ptr, codes_ptr, high_ptr, scales_ptr, out_ptr, ws_ptr, cnt_ptr,
                    T, N, K, NG, groups_per_split,
                    stride_xt, stride_ot, stride_c, stride_h, stride_s,
                    FMT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, GPS: tl.constexpr,
                    EXACT: tl.constexpr, USE_ASM: tl.constexpr, SPLIT: tl.constexpr, SPLIT_K: tl.constexpr):
    """out[t, n] (+)= sum_k x[t, k] W[n, k] over this program's rows and K groups, on the tensor cores.

    EXACT: per group, the rows' integer codes (exact in x's dtype) times x, then the rows' scales in fp32;
    q5/q4 even and odd k go through separate products (low / high nibbles), x read as two stride-2 halves.
    Otherwise: q * scale rounded to x's dtype (what a dense dequantized weight holds) and one product
    per loop step over GPS groups in K order.
    """
    DT: tl.constexpr = x_ptr.dtype.element_ty
    STEP: tl.constexpr = 1 if FMT == 0 else 2  # k between consecutive code bytes
    GROUP: tl.constexpr = 32 * STEP
    pid_n = tl.program_id(0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_c = tl.where(row_ok, rows, 0)  # clamped: loads stay in bounds without a row mask
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    c = tl.arange(0, 32)
    g_lo = tl.program_id(1) * groups_per_split
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)  # out^T tile: weights are the left operand
    for g0 in range(g_lo, g_lo + groups_per_split, GPS):  # groups_per_split is a multiple of GPS
        if EXACT:
            for gi in tl.static_range(GPS):
                g = g0 + gi
                g_ok = g < NG
                qa, qb = _group_operands(codes_ptr, high_ptr, rows_c, g, g_ok, stride_c, stride_h, FMT, DT, USE_ASM)
                s = tl.load(scales_ptr + rows_c * stride_s + g, mask=g_ok, other=0).to(tl.float32)  # [BN]
                k = g * GROUP + STEP * c  # [32]: k of the even codes (q8: all codes)
                xa = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :],
                             mask=t_ok[:, None] & (k[None, :] < K) & g_ok, other=0)  # [BT, 32]
                p = _dot(qa, xa, None, DT)  # [BN, BT]
                if FMT != 0:
                    xb = tl.load(x_ptr + t[:, None] * stride_xt + (k + 1)[None, :],
                                 mask=t_ok[:, None] & (k[None, :] + 1 < K) & g_ok, other=0)
                    p = _dot(qb, xb, p, DT)
                acc += p * s[:, None]
        else:
            gs = g0 + tl.arange(0, GPS)
            gs_ok = gs < NG
            wa, wb = _step_weights(codes_ptr, high_ptr, scales_ptr, rows_c, gs, gs_ok, stride_c, stride_h,
                                   stride_s, FMT, DT, BLOCK_N, GPS, SPLIT and FMT != 0)
            if SPLIT and FMT != 0:
                k = g0 * GROUP + 2 * tl.arange(0, GPS * 32)
                xa = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :], mask=t_ok[:, None] & (k[None, :] < K),
                             other=0)
                xb = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :] + 1,
                             mask=t_ok[:, None] & (k[None, :] + 1 < K), other=0)
                acc = _dot(wb, xb, _dot(wa, xa, acc, DT), DT)
            else:
                k = g0 * GROUP + tl.arange(0, GPS * GROUP)
                xs = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :], mask=t_ok[:, None] & (k[None, :] < K),
                             other=0)  # [BT, GPS * GROUP]; groups past NG have k >= Kp >= K
                acc = _dot(wa, xs, acc, DT)
    _epilogue(tl.trans(acc), t, rows, t_ok, row_ok, out_ptr, stride_ot, ws_ptr, cnt_ptr, N, SPLIT_K)


def _dot(w, x, acc, DT: tl.constexpr):
    """acc + w [BN, K] @ x[BT, K].T in fp32; exact fp32 products for fp32 inputs (not tf32)."""
    if DT == tl.float32:
        return tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


def _step_weights(codes_ptr, high_ptr, scales_ptr, rows, gs, gs_ok, stride_c, stride_h, stride_s,
                  FMT: tl.constexpr, DT: tl.constexpr, BLOCK_N: tl.constexpr, GPS: tl.constexpr,
                  SPLIT: tl.constexpr):
    """Groups ``gs`` [GPS] of each of ``rows`` dequantized (q * scale, rounded to DT), ``[BN, GPS * GROUP]``."""
    c = tl.arange(0, 32)
    base = rows[:, None, None] * stride_c + gs[None, :, None] * 32 + c[None, None, :]
    b = tl.load(codes_ptr + base, mask=gs_ok[None, :, None], other=0).to(tl.int32)  # [BN, GPS, 32]
    s = tl.load(scales_ptr + rows[:, None] * stride_s + gs[None, :], mask=gs_ok[None, :], other=0)
    s = s.to(DT)[:, :, None]  # [BN, GPS, 1]
    if FMT == 0:
        wa = tl.reshape(_codes_as(b ^ 0x80, -128, DT) * s, (BLOCK_N, GPS * 32))
        wb = wa
    else:
        lo = b & 15
        hi = b >> 4
        if FMT == 1:
            h = tl.load(high_ptr + rows[:, None, None] * stride_h + gs[None, :, None] * 8 + (c // 4)[None, None, :],
                        mask=gs_ok[None, :, None], other=0).to(tl.int32)
            hb = h >> (2 * (c % 4))[None, None, :]
            lo = lo | ((hb & 1) << 4)
            hi = hi | ((hb & 2) << 3)
            qmin: tl.constexpr = -16
        else:
            qmin: tl.constexpr = -8
        if SPLIT:  # (even k, odd k) as two [BN, GPS * 32] operands
            wa = tl.reshape(_codes_as(lo, qmin, DT) * s, (BLOCK_N, GPS * 32))
            wb = tl.reshape(_codes_as(hi, qmin, DT) * s, (BLOCK_N, GPS * 32))
        else:
            wa = tl.join(_codes_as(lo, qmin, DT) * s, _codes_as(hi, qmin, DT) * s)  # [BN, GPS, 32, 2]: k = 2c + (0, 1)
            wa = tl.reshape(wa, (BLOCK_N, GPS * 64))
            wb = wa
    return wa, wb


def _load_in_layout(ptrs, DT: tl.constexpr, ASM: tl.constexpr):
    """``tl.load(ptrs)`` (no mask) that keeps the pointers' register layout.

    Triton picks a load's layout from its pointers' contiguity; for a scale repeated over 8 words that is
    a layout unlike the words', and the products then go through shared memory and barriers every step.
    An inline-PTX load is elementwise, so it stays in the layout of its pointers (the words' layout).
    """
    if not ASM:
        return tl.load(ptrs)
    elif DT == tl.float16:
        return tl.inline_asm_elementwise("ld.global.nc.b16 $0, [$1];", "=h,l", [ptrs], dtype=tl.float16,
                                         is_pure=True, pack=1)
    else:  # uint8, zero-extended in a 16-bit register
        return tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=h,l", [ptrs], dtype=tl.uint16,
                                         is_pure=True, pack=1)


def _gemv_kernel(x_ptr, words_ptr, high_ptr, scales_ptr, out_ptr, ws_ptr, cnt_ptr,
                 N, K, NG, groups_per_split, magic,
                 stride_xt, stride_ot, stride_w, stride_h, stride_s,
                 FMT: tl.constexpr, BLOCK_N: tl.constexpr, GPS: tl.constexpr, EVEN_K: tl.constexpr,
                 ASM_LOADS: tl.constexpr, SPLIT_K: tl.constexpr):
    """out[t, n] (+)= sum_k x[t, k] W[n, k] for one row t of x (grid axis 2), on the CUDA cores: a GEMV.

    The codes are read as 32-bit words, 8 per group and row; value i of word j is k = EPW j + i (EPW = 8
    nibbles, or 4 bytes for q8), turned into the float BASE + u by _word_codes (a shift and a lop3) and
    multiplied with x[k] by one FMA. The float's offset from q is taken off per word with the sum of its
    x's. x[EPW j + i] for fixed i is a [W] vector broadcast over the weight rows, so each thread reuses its
    x loads for all the rows it holds. The next step's words are loaded before this step's arithmetic.
    (Several rows of x in one program would need a 3-D tile, which Triton lays out across threads and
    reduces with shuffles and barriers: T > 1 goes to the tensor-core kernels instead.)
    """
    EPW: tl.constexpr = 4 if FMT == 0 else 8  # codes per word
    GROUP: tl.constexpr = 8 * EPW
    W: tl.constexpr = 8 * GPS  # words per row and loop step
    QMIN: tl.constexpr = -128 if FMT == 0 else (-16 if FMT == 1 else -8)
    BASE: tl.constexpr = 256.0 if FMT == 0 else 128.0
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_c = tl.where(row_ok, rows, 0)
    x_row = x_ptr + tl.program_id(2) * stride_xt
    jw = tl.arange(0, W)
    g_lo = tl.program_id(1) * groups_per_split
    g_end = g_lo + groups_per_split
    w_ptrs = words_ptr + rows_c[:, None] * stride_w + jw[None, :]  # [BN, W] at group 0
    s_rows = scales_ptr + rows_c[:, None] * stride_s  # [BN, 1]
    h_rows = high_ptr + rows_c[:, None] * stride_h
    w_next = tl.load(w_ptrs + g_lo * 8, mask=(g_lo + jw // 8 < NG)[None, :], other=0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for g0 in range(g_lo, g_end, GPS):
        w = w_next.to(tl.uint32, bitcast=True)  # logical shifts
        gw = g0 + jw // 8  # [W]: each word's group
        gw_ok = gw < NG
        w_next = tl.load(w_ptrs + (g0 + GPS) * 8, mask=(gw + GPS < tl.minimum(NG, g_end))[None, :], other=0)
        gw_in = tl.minimum(gw, NG - 1)  # in-bounds stand-in for groups past NG (their x's are all 0)
        s = _load_in_layout(s_rows + gw_in[None, :], tl.float16, ASM_LOADS).to(tl.float32)  # [BN, W]
        h = w
        if FMT == 1:
            h = _load_in_layout(h_rows + (gw_in * 8 + jw % 8)[None, :], tl.uint8, ASM_LOADS).to(tl.uint32)
        e = tl.zeros((BLOCK_N, W), dtype=tl.float32)
        xs = tl.zeros((W,), dtype=tl.float32)
        for i in tl.static_range(EPW):
            k = g0 * GROUP + jw * EPW + i  # [W]
            if EVEN_K:
                xi = tl.load(x_row + k, mask=gw_ok, other=0).to(tl.float32)
            else:
                xi = tl.load(x_row + k, mask=gw_ok & (k < K), other=0).to(tl.float32)
            e += _word_codes(w, i, magic, h, FMT) * xi[None, :]  # (BASE + u) x
            xs += xi
        # q = BASE + u - (BASE - QMIN); reduced every step so the accumulator keeps the words' layout
        acc += tl.sum((e - (BASE - QMIN) * xs[None, :]) * s, axis=1)
    t = tl.program_id(2) + tl.arange(0, 1)
    _epilogue(acc[None, :], t, rows, t >= 0, row_ok, out_ptr, stride_ot, ws_ptr, cnt_ptr, N, SPLIT_K)


def _word_codes(w, i: tl.constexpr, magic, h, FMT: tl.constexpr):
    """Value i of each 32-bit code word as the float BASE + u (BASE = 128.0f, 256.0f for q8; u = q - qmin).

    Nibble i (bits 4i..4i+3) is shifted to bits 16..19 of 128.0f, byte i (q8) to bits 15..22 of 256.0f,
    and merged with ``magic`` (the float's bits, a kernel argument so that it stays in a register and mask
    and merge fuse into one lop3): a shift and a lop3, no int->float conversion. q5: bit i of the word's
    high byte ``h`` goes to bit 20, bit 4 of u.
    """
    if FMT == 0:  # magic = 0x43800000 ^ (0x80 << 15): flipping the byte's top bit makes u = q + 128
        if i == 0:
            v = w << 15
        elif i == 1:
            v = w << 7
        elif i == 2:
            v = w >> 1
        else:
            v = w >> 9
        v = (v & 0x7F8000) ^ magic
    else:
        if i < 4:
            v = w << (16 - 4 * i)
        elif i == 4:
            v = w
        else:
            v = w >> (4 * i - 16)
        if FMT == 1:  # (h-bit | magic) first: two lop3s, not three
            v = (v & 0xF0000) | (((h << (20 - i)) & 0x100000) | magic)
        else:
            v = (v & 0xF0000) | magic
    return v.to(tl.float32, bitcast=True)


def _wdot_kernel(x_ptr, words_ptr, high_ptr, scales_ptr, out_ptr, ws_ptr, cnt_ptr,
                 T, N, K, NG, groups_per_split, magic,
                 stride_xt, stride_ot, stride_w, stride_h, stride_s,
                 FMT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, GPS: tl.constexpr,
                 EVEN_K: tl.constexpr, ASM_LOADS: tl.constexpr, SPLIT_K: tl.constexpr):
    """out[t, n] (+)= sum_k x[t, k] W[n, k] on the tensor cores, from 32-bit code words.

    Value i of word j (k = EPW j + i) of every row becomes q * scale in x's dtype (_word_codes, then one
    FMA with the word's scale); the EPW values of a word go to EPW separate products over the step's W
    words, each against the matching stride-EPW slice of x, so the words are read once, in whatever
    register layout the products want, and never re-interleaved.
    """
    DT: tl.constexpr = x_ptr.dtype.element_ty
    EPW: tl.constexpr = 4 if FMT == 0 else 8
    GROUP: tl.constexpr = 8 * EPW
    W: tl.constexpr = 8 * GPS
    QMIN: tl.constexpr = -128 if FMT == 0 else (-16 if FMT == 1 else -8)
    BASE: tl.constexpr = 256.0 if FMT == 0 else 128.0
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_c = tl.where(row_ok, rows, 0)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    jw = tl.arange(0, W)
    g_lo = tl.program_id(1) * groups_per_split
    g_end = g_lo + groups_per_split
    w_ptrs = words_ptr + rows_c[:, None] * stride_w + jw[None, :]
    s_rows = scales_ptr + rows_c[:, None] * stride_s
    h_rows = high_ptr + rows_c[:, None] * stride_h
    x_rows = x_ptr + t[:, None] * stride_xt  # [BT, 1]
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)  # out^T tile: the weights are the left operand
    for g0 in range(g_lo, g_end, GPS):
        gw = g0 + jw // 8
        gw_ok = gw < NG
        # plain loads: the pipeliner stages them through shared memory and reads them back in the
        # products' register layout (a prefetch into registers here makes it convert the bf16 operand)
        w = tl.load(w_ptrs + g0 * 8, mask=gw_ok[None, :], other=0).to(tl.uint32, bitcast=True)
        s = tl.load(s_rows + gw[None, :], mask=gw_ok[None, :], other=0).to(tl.float32)  # [BN, W]
        b = -(BASE - QMIN) * s
        h = w
        if FMT == 1:
            h = tl.load(h_rows + (gw * 8 + jw % 8)[None, :], mask=gw_ok[None, :], other=0).to(tl.uint32)
        for i in tl.static_range(EPW):
            a = (_word_codes(w, i, magic, h, FMT) * s + b).to(DT)  # q * scale, [BN, W]
            k = g0 * GROUP + jw * EPW + i
            if EVEN_K:
                xm = t_ok[:, None] & gw_ok[None, :]
            else:
                xm = t_ok[:, None] & (gw_ok & (k < K))[None, :]
            xi = tl.load(x_rows + k[None, :], mask=xm, other=0)  # [BT, W]
            acc = _dot(a, xi, acc, DT)
    _epilogue(tl.trans(acc), t, rows, t_ok, row_ok, out_ptr, stride_ot, ws_ptr, cnt_ptr, N, SPLIT_K)


def _epilogue(acc, t, rows, t_ok, row_ok, out_ptr, stride_ot, ws_ptr, cnt_ptr, N, SPLIT: tl.constexpr):
    """Write acc [BT, BN] (fp32) to out; with SPLIT > 1, sum the SPLIT programs' tiles first, in one launch.

    Each program adds its tile into the fp32 workspace (atomics, at L2), then counts itself in on the tile's
    counter (release after a CTA barrier, so every thread's adds are ordered before it). The program that
    arrives last (acquire) reads the sums, writes out, and leaves workspace and counter at zero for the next
    launch: no memset or cast kernels around it, which matters inside a CUDA graph of microsecond kernels.
    """
    mask = t_ok[:, None] & row_ok[None, :]
    out_ptrs = out_ptr + t[:, None] * stride_ot + rows[None, :]
    if SPLIT == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + t[:, None] * N + rows[None, :]
        tl.atomic_add(ws, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()
        tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            total = tl.load(ws, mask=mask, other=0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(ws, tl.zeros_like(total), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)


def _dequant_kernel(codes_ptr, high_ptr, scales_ptr, w_ptr, N, K, stride_c, stride_h, stride_s, stride_w,
                    FMT: tl.constexpr, BLOCK_N: tl.constexpr):
    """w[n, k] = scale[n, g] * q[n, k] for this program's rows and one group g."""
    STEP: tl.constexpr = 1 if FMT == 0 else 2
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_c = tl.where(row_ok, rows, 0)
    g = tl.program_id(1)
    qa, qb = _group_operands(codes_ptr, high_ptr, rows_c, g, g >= 0, stride_c, stride_h, FMT, tl.float32, False)
    s = tl.load(scales_ptr + rows_c * stride_s + g).to(tl.float32)[:, None]
    k = g * (32 * STEP) + STEP * tl.arange(0, 32)
    ptrs = w_ptr + rows[:, None] * stride_w + k[None, :]
    tl.store(ptrs, (qa * s).to(w_ptr.dtype.element_ty), mask=row_ok[:, None] & (k[None, :] < K))
    if FMT != 0:
        tl.store(ptrs + 1, (qb * s).to(w_ptr.dtype.element_ty), mask=row_ok[:, None] & (k[None, :] + 1 < K))


@functools.cache
def _kernels():
    """Import Triton and jit the kernels (once). Raises ImportError when Triton is missing."""
    global triton, tl, _codes_as, _q4_pairs_asm, _group_operands, _dot, _step_weights, _qlinear_kernel, \
        _load_in_layout, _gemv_kernel, _word_codes, _wdot_kernel, _epilogue, _dequant_kernel
    import triton as _triton
    import triton.language as _tl

    triton, tl = _triton, _tl
    # Helpers first: the kernels resolve them by name in this module's globals when they compile.
    _codes_as = triton.jit(_codes_as)
    _q4_pairs_asm = triton.jit(_q4_pairs_asm)
    _group_operands = triton.jit(_group_operands)
    _dot = triton.jit(_dot)
    _epilogue = triton.jit(_epilogue)
    _step_weights = triton.jit(_step_weights)
    _load_in_layout = triton.jit(_load_in_layout)
    _gemv_kernel = triton.jit(_gemv_kernel)
    _word_codes = triton.jit(_word_codes)
    _wdot_kernel = triton.jit(_wdot_kernel)
    _qlinear_kernel = triton.jit(_qlinear_kernel)
    _dequant_kernel = triton.jit(_dequant_kernel)
    return _qlinear_kernel, _dequant_kernel


def triton_available() -> bool:
    """Whether Triton imports here (on a CPU it then runs only under TRITON_INTERPRET=1)."""
    try:
        _kernels()
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------
# Launch configuration


@dataclass(frozen=True, slots=True)
class QConfig:
    """Launch parameters of the fused kernel.

    kind: "gemv" (CUDA cores, one row of x per program: T = 1) or "dot" (tensor cores, x padded to
    block_t rows). block_n: weight rows per program. gps: groups per loop step. split_k: programs that
    share one row tile's K (fp32 atomics when > 1). exact / use_asm: the dot variant's weight path
    (codes exact + fp32 group scales / q * scale in x's dtype; inline-PTX q4 unpack).
    """

    kind: str
    block_n: int
    gps: int = 4
    split_k: int = 1
    block_t: int = 16
    exact: bool = False
    use_asm: bool = False
    split_nibbles: bool = False
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        if self.kind not in ("gemv", "dot", "wdot"):
            raise ValueError(f"QConfig.kind must be 'gemv', 'dot' or 'wdot', got {self.kind!r}")
        for name in ("block_n", "block_t", "gps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"QConfig.{name} must be a power of two, got {v}")
        if self.split_k < 1:
            raise ValueError(f"QConfig.split_k must be >= 1, got {self.split_k}")
        if self.kind != "gemv" and (self.block_n < 16 or self.block_t < 16):
            raise ValueError(f"QConfig: the dot kernel needs block_n and block_t >= 16, got {self.block_n}, "
                             f"{self.block_t}")


# Programs to aim for: several per SM of an H200 (132 SMs). A program keeps about one loop step of
# weights in flight, so the chip needs many resident programs to cover DRAM latency.
_TARGET_PROGRAMS = 6 * 132


def _split_for(tiles: int, ng: int, gps: int, target: int = _TARGET_PROGRAMS) -> int:
    """K splits so that tiles * split reaches ``target`` programs, each with at least one loop step."""
    return max(1, min(-(-target // tiles), ng // gps))


def choose_config(fmt: str, n: int, k: int, t: int, dtype: torch.dtype) -> QConfig:
    """The launch configuration for x [t, k] @ W[n, k].T in fmt: a pure function of shapes, no timing."""
    ng = quant.qlayout(fmt, (n, k)).kp // quant.QSPEC[fmt][0]
    if t == 1:
        return QConfig("gemv", 128, gps=4, split_k=_split_for(-(-n // 128), ng, 4))
    block_t = min(64, max(16, _next_pow2(t)))
    return QConfig("dot", 128, gps=4, block_t=block_t, split_k=_split_for(-(-n // 128), ng, 4))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ---------------------------------------------------------------------------------------------------
# Launches


def qlinear_triton(x: torch.Tensor, lin: PackedLinear, config: QConfig | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused dequantize-and-multiply: ``x [T, K]`` contiguous (bf16/fp16/fp32) -> ``[T, N]`` in x.dtype.

    ``config`` overrides ``choose_config``; ``out`` (contiguous [T, N], x.dtype) is written instead of a
    fresh tensor. No host synchronisation and a fixed set of allocations per shape: safe to capture in a
    CUDA graph once a first call (which compiles the kernel) has run outside the capture.
    """
    dot_kernel, _ = _kernels()
    if x.dim() != 2 or x.shape[1] != lin.k:
        raise ValueError(f"qlinear_triton: x must be [T, K={lin.k}], got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("qlinear_triton: x must be contiguous")
    t = x.shape[0]
    if out is not None and (out.shape != (t, lin.n) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"qlinear_triton: out must be contiguous [{t}, {lin.n}] {x.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    cfg = config or choose_config(lin.fmt, lin.n, lin.k, t, x.dtype)
    groups_per_split = _cdiv(_cdiv(lin.ng, cfg.split_k), cfg.gps) * cfg.gps
    if out is None:
        out = torch.empty(t, lin.n, dtype=x.dtype, device=x.device)
    n_tiles, k_tiles = _cdiv(lin.n, cfg.block_n), _cdiv(lin.ng, groups_per_split)
    t_tiles = t if cfg.kind == "gemv" else _cdiv(t, cfg.block_t)
    ws, counters = _workspace(x.device, t, lin.n, n_tiles * t_tiles) if k_tiles > 1 else (out, out)
    fmt_id = _FMT_ID[lin.fmt]
    magic = 0x43C00000 if fmt_id == 0 else 0x43000000  # the float bits the word kernels build codes in
    common = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, SPLIT_K=k_tiles)
    if cfg.kind == "gemv":
        _gemv_kernel[(n_tiles, k_tiles, t)](
            x, lin.words, lin.high, lin.scales, out, ws, counters, lin.n, lin.k, lin.ng, groups_per_split, magic,
            x.stride(0), out.stride(0), lin.words.stride(0), lin.high.stride(0), lin.scales.stride(0),
            FMT=fmt_id, BLOCK_N=cfg.block_n, GPS=cfg.gps, EVEN_K=lin.k == lin.kp, ASM_LOADS=x.is_cuda, **common)
    elif cfg.kind == "wdot":
        _wdot_kernel[(n_tiles, k_tiles, t_tiles)](
            x, lin.words, lin.high, lin.scales, out, ws, counters, t, lin.n, lin.k, lin.ng, groups_per_split,
            magic, x.stride(0), out.stride(0), lin.words.stride(0), lin.high.stride(0), lin.scales.stride(0),
            FMT=fmt_id, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, GPS=cfg.gps, EVEN_K=lin.k == lin.kp,
            ASM_LOADS=x.is_cuda, **common)
    else:
        dot_kernel[(n_tiles, k_tiles, t_tiles)](
            x, lin.codes, lin.high, lin.scales, out, ws, counters, t, lin.n, lin.k, lin.ng, groups_per_split,
            x.stride(0), out.stride(0), lin.codes.stride(0), lin.high.stride(0), lin.scales.stride(0),
            FMT=fmt_id, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, GPS=cfg.gps, EXACT=cfg.exact,
            USE_ASM=cfg.use_asm and x.dtype != torch.float32, SPLIT=cfg.split_nibbles, **common)
    return out


# Split-K scratch, one per device: fp32 [rows, N] sums and per-tile arrival counters, both left at zero by
# every launch (the last program of each tile clears its part). Kernels on one stream run one after the
# other, so they can share it; two split-K launches running concurrently on different streams cannot.
_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_TILES = 1 << 16


def _workspace(device, rows: int, n: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's split-K scratch, grown (zeroed) to at least rows * n floats and `tiles` counters.

    Growing allocates, so a first call that grows it must not be inside a CUDA-graph capture:
    PackedLinear reserves MAX_KERNEL_ROWS x N when it is built.
    """
    device = torch.device(device)
    ws, counters = _WORKSPACES.get(device, (None, None))
    if tiles > _MAX_TILES:
        raise ValueError(f"qlinear: {tiles} output tiles exceed the split-K counters ({_MAX_TILES})")
    if ws is None or ws.numel() < rows * n:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("qlinear: the split-K workspace must grow outside CUDA-graph capture "
                               "(make the PackedLinear, or call once, before capturing)")
        ws = torch.zeros(max(rows * n, 1 << 20), dtype=torch.float32, device=device)
        counters = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
        _WORKSPACES[device] = (ws, counters)
    return ws, counters




def qlinear_dequant(lin: PackedLinear, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The packed weight as a dense ``[N, K]`` tensor of ``dtype`` on lin's device (Triton kernel)."""
    _, kernel = _kernels()
    w = torch.empty(lin.n, lin.k, dtype=dtype, device=lin.device)
    block_n = 64
    kernel[(_cdiv(lin.n, block_n), lin.ng)](
        lin.codes, lin.high, lin.scales, w, lin.n, lin.k,
        lin.codes.stride(0), lin.high.stride(0), lin.scales.stride(0), w.stride(0),
        FMT=_FMT_ID[lin.fmt], BLOCK_N=block_n)
    return w


class PackedLinear:
    """A quantized weight W [N, K] placed on a device, ready for the fused kernel.

    Holds the packed uint8 buffer on ``device`` and typed views of its sections, made once here so a
    call only passes pointers: ``codes`` uint8 [N, code bytes per row], ``high`` uint8 [N, Kp/8] (q5; a
    1-byte placeholder otherwise), ``scales`` fp16 [N, Kp/group].

    ``lin(x)`` with x [..., K]: on CUDA with at most MAX_KERNEL_ROWS rows, the fused kernel. Otherwise
    (prefill widths, or a CPU) a dense weight and F.linear: with ``dense_fallback=True`` (default) the
    dense weight is made once per dtype and cached, which costs 2 bytes per weight on top of the packed
    ~0.6 (q4) - the quantization's memory saving is gone for any layer that ever takes that path; with
    ``dense_fallback=False`` it is dequantized on every such call (no memory kept, a dequant pass per call).
    """

    def __init__(self, buf: torch.Tensor, fmt: str, shape: tuple[int, int], device, *, dense_fallback: bool = True):
        if fmt not in _FMT_ID:
            raise ValueError(f"PackedLinear: fmt must be one of {tuple(_FMT_ID)}, got {fmt!r}")
        if len(shape) != 2:
            raise ValueError(f"PackedLinear: shape must be (N, K), got {tuple(shape)}")
        lay = quant.qlayout(fmt, tuple(int(s) for s in shape))
        if buf.dtype != torch.uint8 or buf.numel() < lay.nbytes:
            raise ValueError(f"PackedLinear: {fmt} buffer for shape {tuple(shape)} must be uint8 with "
                             f">= {lay.nbytes} bytes, got {buf.dtype} with {buf.numel()}")
        self.fmt, self.n, self.k = fmt, lay.n, lay.k
        self.kp, self.group = lay.kp, lay.group
        self.ng = lay.kp // lay.group
        self.device = torch.device(device)
        self.dense_fallback = dense_fallback
        self.buf = buf.reshape(-1)[:lay.nbytes].to(self.device).contiguous()

        def section(off_len):
            return self.buf[off_len[0]:off_len[0] + off_len[1]]

        self.codes = section(lay.codes).view(lay.n, -1)  # [N, Kp/2] (q4/q5) or [N, Kp] (q8)
        self.words = self.codes.view(torch.int32)  # the same bytes, 4 at a time: [N, 8 per group]
        self.high = section(lay.high).view(lay.n, -1) if fmt == "q5_g64_fp16" else self.buf[:1].view(1, 1)
        self.scales = section(lay.scales).view(torch.float16).view(lay.n, self.ng)  # [N, Kp/group]
        self._dense: dict[torch.dtype, torch.Tensor] = {}
        if self.device.type == "cuda":
            _workspace(self.device, MAX_KERNEL_ROWS, self.n, 1)

    @property
    def packed_bytes(self) -> int:
        """Bytes the kernel reads for the weight: codes + high bits + scales."""
        return self.codes.numel() + (self.high.numel() if self.fmt == "q5_g64_fp16" else 0) + 2 * self.scales.numel()

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense [N, K] tensor of dtype on the device (cached if dense_fallback)."""
        w = self._dense.get(dtype)
        if w is not None:
            return w
        if self.device.type == "cuda" and triton_available():
            w = qlinear_dequant(self, dtype)
        else:
            w = quant.dequantize(self.buf.cpu(), self.fmt, (self.n, self.k), dtype).to(self.device)
        if self.dense_fallback:
            self._dense[dtype] = w
        return w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.k:
            raise ValueError(f"PackedLinear: x must be [..., K={self.k}], got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        if x2.is_cuda and x2.shape[0] <= MAX_KERNEL_ROWS and triton_available():
            y = qlinear_triton(x2.contiguous(), self)
        else:
            y = F.linear(x2, self.dense(x.dtype))
        return y.reshape(*lead, self.n)
