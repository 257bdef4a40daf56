"""Quantized projections ``y = x @ W.T`` straight from the packed formats of ``engine.quant``.

Shapes: x ``[T, K]``, W ``[N, K]`` stored as ``quant.pack(W, fmt)`` (flat uint8), y ``[T, N]``.
``fmt`` is one of ``q8_g32_fp16``, ``q5_g64_fp16``, ``q4_g64_fp16``; the byte layout is fixed in
``engine/quant.py`` and read here as it is: each group (32 values for q8, 64 for q5/q4) of a row is 32
contiguous code bytes (8 32-bit words), plus 8 high-bit bytes for q5, plus one fp16 scale.

  qlinear_ref      plain fp32 reference: x @ dequantize(buf).T
  qlinear_triton   fused dequantize-and-multiply Triton kernels for the decode / verify widths
  qlinear_dequant  the packed weight as a dense [N, K] tensor, on the device (Triton)
  PackedLinear     a packed weight placed on a device, callable on x [..., K]

At these widths the product is a GEMV: each weight byte is read once, so the time to beat is packed bytes
over bandwidth, and the arithmetic per weight must stay at a few instructions to keep up with it. Codes
become floats by bit assembly (a code placed in the mantissa of 128.0f / 256.0f, or of 128.0 in bf16 /
1024.0 in fp16, is that float plus the code), never by int->float conversion instructions, which run at a
quarter of the FMA rate. Two kernels (``QConfig.kind``):

  "gemv"  T = 1, CUDA cores: codes read as 32-bit words, one shift + one lop3 + one FMA per weight, the
          fp16 group scales and the float offset applied once per word (_gemv_kernel).
  "dot"   T >= 2, tensor cores: ``tl.dot`` with the weight tile as the left operand ("swap AB") and x^T
          padded to 16+ columns; the operand is q * scale rounded to x's dtype, as a dense dequantized
          weight would hold it (_dot_kernel).

When N / BLOCK_N programs are too few to fill the GPU, K is split over several programs whose fp32 sums
meet in a shared workspace, and the last program of each tile writes the output: one launch (_epilogue).
The launch configuration is a pure function of (fmt, N, K, T) (``choose_config``): no autotuning, so the
first call only compiles, nothing is timed or synchronised, and later calls are safe to capture in a
CUDA graph. Triton is imported on first use, so this module imports (and the CPU fallback runs) without it.

Where it stands (H200, 27B projection shapes, 20 calls replayed from a CUDA graph over weight copies, % of
the 4.27 TB/s copy bandwidth; scripts/bench_qlinear.py, docs/perf/2026-11-30-27b-decode-qmv-h200.md): gemv
T = 1: q4 31-48 % (lm_head 68 %), q5 25-34 %, q8 47-70 % (lm_head 86 %). dot T = 2..16: q4 18-30 %, q5
10-12 %, q8 25-38 %, and it still returns wrong sums now and then (an H200 caught mlp gate+up q8 T = 4 at
relative RMS 0.07 with num_stages=1, so the missing-fence explanation below is not the whole story). For bf16 /
fp16 x the engine therefore runs ``kernels/qmv_cuda.cu`` (tensor cores, 8 rows a launch, deterministic, T = 8 at
the cost of T = 1) whenever cupy imports; these kernels serve fp32 x and machines without cupy. The gemv spends
~4.3 instructions per weight; qmv 2.3 (q4), and neither holds more than ~65 % of the copy bandwidth at T = 1:
both are short of bytes in flight, which a deeper load pipeline (cp.async / TMA) would fix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import _triton, qmv_cuda
from ..engine import quant

__all__ = ["qlinear_ref", "qlinear_triton", "qlinear_dequant", "PackedLinear", "QConfig", "choose_config",
           "MAX_KERNEL_ROWS"]

# Rows of x up to which PackedLinear uses the fused kernels; wider inputs (prefill) use a dense weight.
MAX_KERNEL_ROWS = 64
_FMT_ID = {"q8_g32_fp16": 0, "q5_g64_fp16": 1, "q4_g64_fp16": 2}

# Bound lazily by _kernels(): the Triton modules, and the jitted versions of the functions below.
triton = None
tl = None


def qlinear_ref(x: torch.Tensor, buf: torch.Tensor, fmt: str, shape: tuple[int, int]) -> torch.Tensor:
    """fp32 reference: ``x [T, K]`` (any float dtype) @ ``dequantize(buf, fmt, shape).T`` -> ``[T, N]`` fp32."""
    w = quant.dequantize(buf.reshape(-1).cpu(), fmt, shape)  # [N, K] fp32
    return x.detach().cpu().to(torch.float32) @ w.T


# ---------------------------------------------------------------------------------------------------
# Triton kernels: plain functions here, jitted on first use (_kernels), so that TRITON_INTERPRET is read
# when they are first needed and the module imports without Triton.


def _word_codes(w, i: tl.constexpr, magic, h, FMT: tl.constexpr):
    """Value i of each 32-bit code word (uint32) as the fp32 BASE + u (BASE = 128, 256 for q8; u = q - qmin).

    Nibble i (bits 4i..4i+3) is shifted to bits 16..19 of 128.0f, byte i (q8) to bits 15..22 of 256.0f,
    and merged with ``magic`` (that float's bits, passed as a kernel argument so that it stays in a register
    and mask and merge fuse into one lop3). q5: bit i of the word's high byte ``h`` becomes bit 20 (bit 4
    of u).
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
    else:  # magic = 0x43000000
        if i < 4:
            v = w << (16 - 4 * i)
        elif i == 4:
            v = w
        else:
            v = w >> (4 * i - 16)
        if FMT == 1:
            v = (v & 0xF0000) | (((h << (20 - i)) & 0x100000) | magic)
        else:
            v = (v & 0xF0000) | magic
    return v.to(tl.float32, bitcast=True)


def _load_in_layout(ptrs, DT: tl.constexpr, GPU: tl.constexpr):
    """``tl.load(ptrs)`` (in bounds, no mask) that keeps the pointers' register layout.

    Triton lays a load out by its pointers' contiguity; for a scale repeated over 8 words that layout is
    unlike the words', and the products then move through shared memory, with barriers, every step. An
    inline-PTX load is elementwise, so it stays in its pointers' layout (the words'). Plain load otherwise
    (the interpreter runs no PTX).
    """
    if not GPU:
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
                 GPU: tl.constexpr, SPLIT_K: tl.constexpr):
    """out[t, n] = sum_k x[t, k] W[n, k] for one row t of x (grid axis 2), on the CUDA cores: a GEMV.

    Program (n-tile, k-split, t): BLOCK_N rows, groups [g_lo, g_lo + groups_per_split), GPS groups (W = 8 GPS
    words per row) a step. Value i of word j is k = EPW j + i (EPW = 8 nibbles, 4 bytes for q8): it becomes
    BASE + u by _word_codes and meets x[EPW j + i] -- a [W] vector broadcast over the rows, so a thread
    reuses its x loads for every row it holds -- in one FMA. BASE - qmin times the sum of each word's x's
    is taken off per word, then the word's group scale is applied. The next step's words are loaded
    before this step's arithmetic. (Several rows of x per program would need a 3-D tile, which Triton
    spreads over threads and reduces through shared memory; T > 1 uses the dot kernel.)
    """
    EPW: tl.constexpr = 4 if FMT == 0 else 8  # codes per word
    GROUP: tl.constexpr = 8 * EPW
    W: tl.constexpr = 8 * GPS  # words per row and step
    QMIN: tl.constexpr = -128 if FMT == 0 else (-16 if FMT == 1 else -8)
    BASE: tl.constexpr = 256.0 if FMT == 0 else 128.0
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_c = tl.where(row_ok, rows, 0)  # clamped: loads stay in bounds without a row mask
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
        s = _load_in_layout(s_rows + gw_in[None, :], tl.float16, GPU).to(tl.float32)  # [BN, W]
        h = w
        if FMT == 1:
            h = _load_in_layout(h_rows + (gw_in * 8 + jw % 8)[None, :], tl.uint8, GPU).to(tl.uint32)
        e = tl.zeros((BLOCK_N, W), dtype=tl.float32)
        xs = tl.zeros((W,), dtype=tl.float32)
        for i in tl.static_range(EPW):
            k = g0 * GROUP + jw * EPW + i  # [W]
            if EVEN_K:
                xi = tl.load(x_row + k, mask=gw_ok, other=0).to(tl.float32)
            else:
                xi = tl.load(x_row + k, mask=gw_ok & (k < K), other=0).to(tl.float32)  # logical K < Kp
            e += _word_codes(w, i, magic, h, FMT) * xi[None, :]  # (BASE + u) x
            xs += xi
        # q = BASE + u - (BASE - QMIN); reduced every step so the accumulator keeps the words' layout
        acc += tl.sum((e - (BASE - QMIN) * xs[None, :]) * s, axis=1)
    t = tl.program_id(2) + tl.arange(0, 1)
    _epilogue(acc[None, :], t, rows, t >= 0, row_ok, out_ptr, stride_ot, ws_ptr, cnt_ptr, N, GPU, SPLIT_K)


def _codes_as(u, QMIN: tl.constexpr, DT: tl.constexpr):
    """Unsigned codes u (int32, 0 <= u < 256) as the exact values q = u + QMIN in dtype DT."""
    if DT == tl.bfloat16 and QMIN > -128:  # u < 128 fits bf16's 7 mantissa bits: 0x4300 = 128.0
        return (u | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - (128.0 - QMIN)
    elif DT == tl.float16:  # 0x6400 = 1024.0, 10 mantissa bits
        return (u | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 - QMIN)
    else:  # fp32: 0x43800000 = 256.0f, one mantissa unit at bit 15 (q8 with bf16 x comes here too)
        return (((u << 15) | 0x43800000).to(tl.float32, bitcast=True) - (256.0 - QMIN)).to(DT)


def _lanes_weights(codes_ptr, high_ptr, scales_ptr, rows, gs, gs_ok, FMT: tl.constexpr, DT: tl.constexpr,
                   GPS: tl.constexpr, GROUP: tl.constexpr, NG):
    """Groups ``gs`` of ``rows`` dequantized from qmv's lanes layout (TiledWeight(lanes=True)), ``[BN, GPS, GROUP]``.

    Per (16-row tile, group): row r = 8 half + j, code byte b = 8 c + piece of its group at 64 j + 16 c + 8 half +
    piece; its scale at 2 j + half; q5's high byte w = 2 c + piece at 16 j + 4 c + 2 half + piece. Within each
    4-byte word (8 codes of q4/q5, 4 of q8) the code of position q sits at p = (q % 2) W / 2 + q // 2 (the
    inverse of qmv_cuda.WORD_ORDER), and q5's high bit of code q at bit p of its word's high byte."""
    kk = tl.arange(0, GROUP)
    CODES: tl.constexpr = 4 if FMT == 0 else 8  # codes a 4-byte word
    q = kk % CODES
    p = (q % 2) * (CODES // 2) + q // 2
    if FMT == 0:
        byte = (kk // 4) * 4 + p
    else:
        byte = (kk // 8) * 4 + p // 2
    j = rows % 8
    half = (rows % 16) // 8
    tile = rows // 16
    at = (tile * (NG * 512) + j * 64 + half * 8)[:, None, None] + gs[None, :, None] * 512 \
        + ((byte // 8) * 16 + byte % 8)[None, None, :]
    b = tl.load(codes_ptr + at, mask=gs_ok[None, :, None], other=0).to(tl.int32)  # [BN, GPS, GROUP]
    s = tl.load(scales_ptr + (tile * (NG * 16) + j * 2 + half)[:, None] + gs[None, :] * 16, mask=gs_ok[None, :],
                other=0).to(DT)[:, :, None]
    if FMT == 0:
        w = _codes_as(b ^ 0x80, -128, DT) * s
    elif FMT == 1:
        word = kk // 8
        h_at = (tile * (NG * 128) + j * 16 + half * 2)[:, None, None] + gs[None, :, None] * 128 \
            + ((word // 2) * 4 + word % 2)[None, None, :]
        h = tl.load(high_ptr + h_at, mask=gs_ok[None, :, None], other=0).to(tl.int32)
        u = ((b >> (4 * (p % 2))[None, None, :]) & 15) | (((h >> p[None, None, :]) & 1) << 4)
        w = _codes_as(u, -16, DT) * s
    else:
        w = _codes_as((b >> (4 * (p % 2))[None, None, :]) & 15, -8, DT) * s
    return w


def _step_weights(codes_ptr, high_ptr, scales_ptr, rows, gs, gs_ok, stride_c, stride_h, stride_s,
                  FMT: tl.constexpr, DT: tl.constexpr, BLOCK_N: tl.constexpr, GPS: tl.constexpr,
                  TILED: tl.constexpr, NG):
    """Groups ``gs`` [GPS] of ``rows`` dequantized, q * scale in DT, ``[BN, GPS * GROUP]`` in K order.

    Byte c of a group's 32 code bytes holds k = 2c (low nibble) and 2c + 1 (high nibble) for q5/q4, k = c
    for q8; q5: bit 2(c % 4) (+1) of high byte c // 4 is bit 4 of the even (odd) code. ``TILED`` 1 / 2: the
    sections are in qmv's tiled / lanes layout (kernels/qmv_cuda.TiledWeight, ``NG`` groups a row).
    """
    GROUP: tl.constexpr = 32 if FMT == 0 else 64
    if TILED == 2:  # the lanes layout: one gather per code (the word order undone), see _lanes_weights
        w = tl.reshape(_lanes_weights(codes_ptr, high_ptr, scales_ptr, rows, gs, gs_ok, FMT, DT, GPS, GROUP, NG),
                       (BLOCK_N, GPS * GROUP))
    else:
        c = tl.arange(0, 32)
        if TILED == 1:  # row r, group g at (r // 16) NG 16 + g 16 + r % 16 (in 32-byte, scale and 8-byte units)
            r_at = (rows // 16) * (NG * 16) + rows % 16
            base = r_at[:, None, None] * 32 + gs[None, :, None] * 512 + c[None, None, :]
            s_at = r_at[:, None] + gs[None, :] * 16
            h_row, h_group = r_at * 8, 128
        else:
            base = rows[:, None, None] * stride_c + gs[None, :, None] * 32 + c[None, None, :]
            s_at = rows[:, None] * stride_s + gs[None, :]
            h_row, h_group = rows * stride_h, 8
        b = tl.load(codes_ptr + base, mask=gs_ok[None, :, None], other=0).to(tl.int32)  # [BN, GPS, 32]
        s = tl.load(scales_ptr + s_at, mask=gs_ok[None, :], other=0)
        s = s.to(DT)[:, :, None]  # [BN, GPS, 1]
        if FMT == 0:
            w = tl.reshape(_codes_as(b ^ 0x80, -128, DT) * s, (BLOCK_N, GPS * 32))
        else:
            lo = b & 15
            hi = b >> 4
            if FMT == 1:
                h = tl.load(high_ptr + h_row[:, None, None] + gs[None, :, None] * h_group + (c // 4)[None, None, :],
                            mask=gs_ok[None, :, None], other=0).to(tl.int32)
                hb = h >> (2 * (c % 4))[None, None, :]
                lo = lo | ((hb & 1) << 4)
                hi = hi | ((hb & 2) << 3)
                qmin: tl.constexpr = -16
            else:
                qmin: tl.constexpr = -8
            w = tl.join(_codes_as(lo, qmin, DT) * s, _codes_as(hi, qmin, DT) * s)  # [BN, GPS, 32, 2]: k = 2c + e
            w = tl.reshape(w, (BLOCK_N, GPS * 64))
    return w


def _dot_kernel(x_ptr, codes_ptr, high_ptr, scales_ptr, out_ptr, ws_ptr, cnt_ptr,
                T, N, K, NG, groups_per_split,
                stride_xt, stride_ot, stride_c, stride_h, stride_s,
                FMT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, GPS: tl.constexpr,
                GPU: tl.constexpr, SPLIT_K: tl.constexpr):
    """out[t, n] = sum_k x[t, k] W[n, k] on the tensor cores, for BLOCK_T (>= 16) rows of x.

    Program (n-tile, k-split, t-tile): per step, GPS groups of BLOCK_N rows dequantized to x's dtype
    (_step_weights) times x's [BLOCK_T, GPS * GROUP] tile transposed, accumulated in fp32; the weights are
    the left operand, so BLOCK_N fills the MMA's M and the few rows of x its N. fp32 x: exact fp32 products.

    Launch with num_stages=1. Pipelined (2+ stages), triton 3.6 stages the x tile into shared memory with
    cp.async and has the wgmma read it with no fence.proxy.async between them (ptx shows none; with
    num_stages=1 it is st.shared + fence + bar), and bench runs on an H200 returned wrong sums for a few
    percent of calls (rel. error 0.02 - 0.17, different shapes each run) with 2-4 stages; gemv never did.
    The cause is inferred from the generated code, not proven; num_stages=1 is not yet confirmed on a GPU.
    """
    DT: tl.constexpr = x_ptr.dtype.element_ty
    GROUP: tl.constexpr = 32 if FMT == 0 else 64
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_c = tl.where(row_ok, rows, 0)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    g_lo = tl.program_id(1) * groups_per_split
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)  # out^T tile
    for g0 in range(g_lo, g_lo + groups_per_split, GPS):  # groups_per_split is a multiple of GPS
        gs = g0 + tl.arange(0, GPS)
        w = _step_weights(codes_ptr, high_ptr, scales_ptr, rows_c, gs, gs < NG, stride_c, stride_h, stride_s,
                          FMT, DT, BLOCK_N, GPS, 0, NG)  # [BN, GPS * GROUP]
        k = g0 * GROUP + tl.arange(0, GPS * GROUP)
        xs = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :], mask=t_ok[:, None] & (k[None, :] < K),
                     other=0)  # [BT, GPS * GROUP]; k >= K (padding, groups past NG) reads 0
        if DT == tl.float32:
            acc = tl.dot(w, tl.trans(xs), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(xs), acc)
    _epilogue(tl.trans(acc), t, rows, t_ok, row_ok, out_ptr, stride_ot, ws_ptr, cnt_ptr, N, GPU, SPLIT_K)


def _epilogue(acc, t, rows, t_ok, row_ok, out_ptr, stride_ot, ws_ptr, cnt_ptr, N, GPU: tl.constexpr,
              SPLIT_K: tl.constexpr):
    """Write acc [BT, BN] (fp32) to out; with SPLIT_K > 1, sum the SPLIT_K programs' tiles first, in one launch.

    Each program adds its tile into the fp32 workspace (atomics, performed at L2), then counts itself in on
    the tile's counter. The count must not overtake any thread's adds: the adds return their old values,
    the program sums them (every thread waits for its adds), and a fence on that sum produces the count's
    increment. The program that arrives last reads the sums, writes out, and leaves workspace and counter
    at zero for the next launch: no memset or cast kernels around the launch, which matters in a CUDA graph
    of microsecond kernels.
    """
    mask = t_ok[:, None] & row_ok[None, :]
    out_ptrs = out_ptr + t[:, None] * stride_ot + rows[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + t[:, None] * N + rows[None, :]
        old = tl.atomic_add(ws, acc, mask=mask, sem="relaxed")
        done = tl.sum(tl.sum(tl.where(mask, old, 0.0), axis=1), axis=0)
        one = 1
        if GPU:  # the interpreter runs programs one after another: nothing to order there
            one = tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, 1;", "=r,r",
                                            [done.to(tl.int32, bitcast=True)], dtype=tl.int32,
                                            is_pure=False, pack=1)
        tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        arrived = tl.atomic_add(cnt_ptr + tile, one, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.load(ws, mask=mask, other=0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(ws, tl.zeros_like(total), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)


def _dequant_kernel(codes_ptr, high_ptr, scales_ptr, w_ptr, N, K, NG, stride_c, stride_h, stride_s, stride_w,
                    FMT: tl.constexpr, BLOCK_N: tl.constexpr, TILED: tl.constexpr):
    """w[n, k] = scale[n, g] * q[n, k] (computed in fp32, rounded once) for this program's rows and group g;
    ``TILED`` 1 / 2: the sections in qmv's tiled / lanes layout."""
    GROUP: tl.constexpr = 32 if FMT == 0 else 64
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    g = tl.program_id(1)
    gs = g + tl.arange(0, 1)
    w = _step_weights(codes_ptr, high_ptr, scales_ptr, tl.where(row_ok, rows, 0), gs, gs >= 0, stride_c,
                      stride_h, stride_s, FMT, tl.float32, BLOCK_N, 1, TILED, NG)  # [BN, GROUP]
    k = g * GROUP + tl.arange(0, GROUP)
    tl.store(w_ptr + rows[:, None] * stride_w + k[None, :], w.to(w_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (k[None, :] < K))


_HELPERS = ("_word_codes", "_load_in_layout", "_codes_as", "_lanes_weights", "_step_weights", "_epilogue")


@functools.cache
def _kernels():
    """Import Triton and jit the kernels (once); raises ImportError when Triton is missing."""
    global triton
    import triton as _triton_pkg

    triton = _triton_pkg
    k = _triton.jit_module(globals(), _HELPERS, {"gemv": "_gemv_kernel", "dot": "_dot_kernel",
                                                 "dequant": "_dequant_kernel"})
    return k["gemv"], k["dot"], k["dequant"]


triton_available = _triton.available


# ---------------------------------------------------------------------------------------------------
# Launch configuration


@dataclass(frozen=True, slots=True)
class QConfig:
    """Launch parameters of the fused kernels.

    kind: "gemv" (CUDA cores, one row of x per program) or "dot" (tensor cores, block_t rows of x per
    program). block_n: weight rows per program. gps: groups per loop step. split_k: programs sharing one
    row tile's K (summed in-kernel, see _epilogue). num_stages: Triton's software pipelining; keep 1 for
    "dot" -- with 2+ the x tile reaches the wgmma through cp.async without a fence.proxy.async in the
    code triton 3.6 generates, and an H200 returned wrong sums now and then (see _dot_kernel).
    """

    kind: str
    block_n: int
    gps: int = 2
    split_k: int = 1
    block_t: int = 16
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        if self.kind not in ("gemv", "dot"):
            raise ValueError(f"QConfig.kind must be 'gemv' or 'dot', got {self.kind!r}")
        for name in ("block_n", "block_t", "gps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"QConfig.{name} must be a power of two, got {v}")
        if self.split_k < 1:
            raise ValueError(f"QConfig.split_k must be >= 1, got {self.split_k}")
        if self.kind == "dot" and (self.block_n < 16 or self.block_t < 16):
            raise ValueError(f"QConfig: the dot kernel needs block_n and block_t >= 16, got {self.block_n}, "
                             f"{self.block_t}")


# Programs to aim for: several per SM of an H200 (132 SMs). A program has about one loop step of weights
# in flight, so DRAM latency is covered only with many resident programs.
_TARGET_PROGRAMS = 6 * 132


def _split_for(tiles: int, ng: int, gps: int, target: int = _TARGET_PROGRAMS) -> int:
    """K splits so that tiles * split reaches ``target`` programs, each with at least one loop step."""
    return max(1, min(-(-target // tiles), ng // gps))


def choose_config(fmt: str, n: int, k: int, t: int) -> QConfig:
    """The launch configuration for x [t, k] @ W[n, k].T in fmt: a pure function of the shapes.

    From scripts/bench_qlinear.py --variants on an H200 (CUDA-graph replays, weights not in L2): the gemv
    with 128 rows x 4 groups a step for T = 1; the dot kernel with 128 rows x 2 groups a step for T >= 2;
    K split to ~6 programs per SM in both. The dot kernel runs unpipelined (num_stages=1; see QConfig).
    """
    ng = quant.qlayout(fmt, (n, k)).kp // quant.QSPEC[fmt][0]
    if t == 1:
        return QConfig("gemv", 128, gps=4, split_k=_split_for(-(-n // 128), ng, 4))
    block_t = min(64, max(16, _next_pow2(t)))
    return QConfig("dot", 128, gps=2, block_t=block_t, split_k=_split_for(-(-n // 128) * -(-t // block_t), ng, 2))


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
    fresh tensor. One kernel launch, no host synchronisation, no allocation but ``out``: safe to capture in
    a CUDA graph once a first call for the shape (which compiles the kernel) has run outside the capture.
    """
    gemv_kernel, dot_kernel, _ = _kernels()
    if x.dim() != 2 or x.shape[1] != lin.k:
        raise ValueError(f"qlinear_triton: x must be [T, K={lin.k}], got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("qlinear_triton: x must be contiguous")
    t = x.shape[0]
    if out is not None and (out.shape != (t, lin.n) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"qlinear_triton: out must be contiguous [{t}, {lin.n}] {x.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    cfg = config or choose_config(lin.fmt, lin.n, lin.k, t)
    groups_per_split = _cdiv(_cdiv(lin.ng, cfg.split_k), cfg.gps) * cfg.gps
    if out is None:
        out = torch.empty(t, lin.n, dtype=x.dtype, device=x.device)
    n_tiles, k_tiles = _cdiv(lin.n, cfg.block_n), _cdiv(lin.ng, groups_per_split)
    t_tiles = t if cfg.kind == "gemv" else _cdiv(t, cfg.block_t)
    ws, counters = _workspace(x.device, t, lin.n, n_tiles * t_tiles) if k_tiles > 1 else (out, out)
    fmt_id = _FMT_ID[lin.fmt]
    common = dict(FMT=fmt_id, BLOCK_N=cfg.block_n, GPS=cfg.gps, GPU=x.is_cuda, SPLIT_K=k_tiles,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.kind == "gemv":
        magic = 0x43C00000 if fmt_id == 0 else 0x43000000  # see _word_codes
        gemv_kernel[(n_tiles, k_tiles, t)](
            x, lin.words, lin.high, lin.scales, out, ws, counters, lin.n, lin.k, lin.ng, groups_per_split, magic,
            x.stride(0), out.stride(0), lin.words.stride(0), lin.high.stride(0), lin.scales.stride(0),
            EVEN_K=lin.k == lin.kp, **common)
    else:
        dot_kernel[(n_tiles, k_tiles, t_tiles)](
            x, lin.codes, lin.high, lin.scales, out, ws, counters, t, lin.n, lin.k, lin.ng, groups_per_split,
            x.stride(0), out.stride(0), lin.codes.stride(0), lin.high.stride(0), lin.scales.stride(0),
            BLOCK_T=cfg.block_t, **common)
    return out


# Split-K scratch, one per device: fp32 [rows, N] sums and per-tile arrival counters, both left at zero by
# every launch (the last program of each tile clears its part). Kernels on one stream run one after the
# other, so they share it; two split-K launches running at once on different streams must not.
_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_TILES = 1 << 16


def _workspace(device, rows: int, n: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's split-K scratch, grown (zeroed) to at least rows * n floats and ``tiles`` counters.

    Growing allocates, so it must not happen inside a CUDA-graph capture: PackedLinear reserves
    MAX_KERNEL_ROWS x N when it is built.
    """
    return split_k_scratch(_WORKSPACES, device, rows * n, tiles, "qlinear")


def split_k_scratch(store: dict, device, floats: int, tiles: int, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``store[device]``: (fp32 sums of at least ``floats``, ``_MAX_TILES`` int32 arrival counters), made zeroed
    and grown on demand - never inside a CUDA-graph capture, where allocating is not allowed."""
    device = torch.device(device)
    if tiles > _MAX_TILES:
        raise ValueError(f"{who}: {tiles} output tiles exceed the split-K counters ({_MAX_TILES})")
    ws, counters = store.get(device, (None, None))
    if ws is None or ws.numel() < floats:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{who}: the split-K workspace must grow outside CUDA-graph capture "
                               "(build the PackedLinear, or call once, before capturing)")
        ws = torch.zeros(max(floats, 1 << 20), dtype=torch.float32, device=device)
        counters = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
        store[device] = (ws, counters)
    return ws, counters


def qlinear_dequant(lin, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The packed weight as a dense ``[N, K]`` tensor of ``dtype`` on its device (Triton kernel): ``lin`` a
    row-major :class:`PackedLinear` or a :class:`kernels.qmv_cuda.TiledWeight` (tiled or lanes layout), read in
    place (no row-major copy)."""
    _, _, kernel = _kernels()
    layout = getattr(lin, "layout", 0)  # 0: a PackedLinear's row-major sections
    w = torch.empty(lin.n, lin.k, dtype=dtype, device=lin.codes.device)
    block_n = 64
    kernel[(_cdiv(lin.n, block_n), lin.ng)](
        lin.codes, lin.high, lin.scales, w, lin.n, lin.k, lin.ng,
        lin.codes.stride(0), lin.high.stride(0), lin.scales.stride(0), w.stride(0),
        FMT=_FMT_ID[lin.fmt], BLOCK_N=block_n, TILED=layout)
    return w


class PackedLinear:
    """A quantized weight W [N, K] placed on a device, ready for the fused kernel.

    Holds the packed uint8 buffer on ``device`` and typed views of its sections, made once here so a
    call only passes pointers: ``codes`` uint8 [N, code bytes per row] (and ``words``, the same bytes as
    int32), ``high`` uint8 [N, Kp/8] (q5; a 1-byte placeholder otherwise), ``scales`` fp16 [N, Kp/group].
    On CUDA it also reserves the shared split-K workspace for MAX_KERNEL_ROWS x N (see _workspace).
    ``layout="tiled"`` or ``"lanes"`` (on CUDA with qmv; the engine's choice for bf16/fp16 models) keeps only qmv's
    tile-contiguous copy (``qmv_weight``, :class:`kernels.qmv_cuda.TiledWeight`: 1.1-1.3x faster at the 27B shapes
    on the H200; lanes a further 1.04-1.2x) and drops the row-major sections, so the weight costs no more memory.
    The prefill dequantization reads either layout in place; the Triton GEMV kernels get a transient row-major
    copy from :meth:`row_major`.

    ``lin(x)`` with x [..., K]: on CUDA with at most MAX_KERNEL_ROWS rows, bf16/fp16 x goes to the tensor-core
    kernel of ``kernels/qmv_cuda.cu`` (``qmv_cuda.MAX_T`` rows a launch) when cupy imports, fp32 x (or no cupy) to
    the Triton kernels here. Otherwise
    (prefill widths, or a CPU) a dense weight and F.linear: with ``dense_fallback=True`` (default) the
    dense weight is made once per dtype and cached, which costs 2 bytes per weight on top of the packed
    ~0.6 (q4) - the quantization's memory saving is gone for any layer that ever takes that path; with
    ``dense_fallback=False`` it is dequantized on every such call (no memory kept, a dequant pass per call).
    """

    def __init__(self, buf: torch.Tensor, fmt: str, shape: tuple[int, int], device, *, dense_fallback: bool = True,
                 layout: str = "rows"):
        if fmt not in _FMT_ID:
            raise ValueError(f"PackedLinear: fmt must be one of {tuple(_FMT_ID)}, got {fmt!r}")
        if layout not in ("rows", "tiled", "lanes"):
            raise ValueError(f"PackedLinear: layout must be rows, tiled or lanes, got {layout!r}")
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
        if self.buf.data_ptr() % 16:  # a view at an odd offset of a bigger buffer: one aligned copy, so the
            self.buf = self.buf.clone()  # kernels can read it 4 / 8 / 16 bytes at a time

        def section(off_len):
            return self.buf[off_len[0]:off_len[0] + off_len[1]]

        self.codes = section(lay.codes).view(lay.n, -1)  # [N, Kp/2] (q4/q5) or [N, Kp] (q8)
        self.words = self.codes.view(torch.int32)  # the same bytes, 4 at a time: [N, 8 per group]
        self.high = section(lay.high).view(lay.n, -1) if fmt == "q5_g64_fp16" else self.buf[:1].view(1, 1)
        self.scales = section(lay.scales).view(torch.float16).view(lay.n, self.ng)  # [N, Kp/group]
        self._dense: dict[torch.dtype, torch.Tensor] = {}
        self.packed_bytes = self.codes.numel() + self.high.numel() * (fmt == "q5_g64_fp16") + 2 * self.scales.numel()
        self.qmv_weight = None  # the tiled copy qmv reads, when tiled (the row-major sections are then dropped)
        if self.device.type == "cuda":
            _workspace(self.device, MAX_KERNEL_ROWS, self.n, 1)
            if qmv_cuda.available():
                qmv_cuda.workspace(self.device, qmv_cuda.MAX_SPLITS * qmv_cuda.MAX_T * self.n)
                if layout != "rows":
                    self.qmv_weight = qmv_cuda.TiledWeight(self, lanes=layout == "lanes")
                    self.buf = self.codes = self.words = self.high = self.scales = None

    def row_major(self) -> PackedLinear:
        """This weight with its row-major sections (the Triton kernels' layout): itself, or, when only the tiled
        copy is kept, a transient row-major copy made from it."""
        if self.qmv_weight is None:
            return self
        return PackedLinear(self.qmv_weight.row_major(), self.fmt, (self.n, self.k), self.device, dense_fallback=False)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense [N, K] tensor of dtype on the device (cached if dense_fallback)."""
        w = self._dense.get(dtype)
        if w is not None:
            return w
        if self.device.type == "cuda" and triton_available():
            w = qlinear_dequant(self.qmv_weight or self, dtype)  # a tiled or lanes layout read in place
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
        if x2.is_cuda and x2.shape[0] <= MAX_KERNEL_ROWS and (qmv_cuda.available() or triton_available()):
            x2 = x2.contiguous()
            qw = self.qmv_weight or self
            if qmv_cuda.supports(x2[:qmv_cuda.MAX_T], qw):
                # 8 rows a launch, for every width: results that do not depend on the batch (and are deterministic);
                # the Triton dot kernel (T >= 2) also returned wrong sums now and then on an H200
                y = qmv_cuda.qmv_rows(x2, qw)
            else:
                y = qlinear_triton(x2, self.row_major())
        else:
            y = F.linear(x2, self.dense(x.dtype))
        return y.reshape(*lead, self.n)
