"""The Triton kernels of :mod:`kernels.qlinear` (its docstring has the formats, the two kernels and where they
stand): plain functions here, jitted on first use (:func:`kernels`), so that TRITON_INTERPRET is read when they are
first needed and the module imports without Triton.

  _gemv_kernel     T = 1 on the CUDA cores, codes read as 32-bit words
  _dot_kernel      T >= 2 on the tensor cores, the dequantized weight tile as the left operand
  _dequant_kernel  the dense weight (prefill), from the row-major, tiled or lanes layout
  _dequant_lanes_kernel  the same from the lanes layout, a tile's code words read whole (the engine's prefill path)
"""

from __future__ import annotations

import functools

from . import _triton

# Bound lazily by kernels(): the Triton modules, and the jitted versions of the functions below.
triton = None
tl = None



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
    _epilogue(acc[None, :], t, rows, t >= 0, row_ok, out_ptr, stride_ot, ws_ptr, cnt_ptr, N, tl.num_programs(2),
              GPU, SPLIT_K)


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
    _epilogue(tl.trans(acc), t, rows, t_ok, row_ok, out_ptr, stride_ot, ws_ptr, cnt_ptr, N, T, GPU, SPLIT_K)


def _epilogue(acc, t, rows, t_ok, row_ok, out_ptr, stride_ot, ws_ptr, cnt_ptr, N, ROWS, GPU: tl.constexpr,
              SPLIT_K: tl.constexpr):
    """Write acc [BT, BN] (fp32) to out; with SPLIT_K > 1, sum the SPLIT_K programs' tiles first, in one launch.

    Each program stores its tile in its own slice of the fp32 workspace (split s: ``[ROWS, N]`` floats at
    ``s * ROWS * N``, ROWS = x's rows), then counts itself in on the tile's counter. The count must not overtake
    any thread's stores: every thread fences after its own, and a reduction over the fences' results (which
    waits for every thread of the program) produces the count's increment. The program that arrives last adds
    the slices up in split order - a fixed order, so the result does not depend on which program finishes first
    (deterministic, as qmv's split-K) - writes out, and leaves the counter at zero for the next launch: no memset
    or cast kernels around the launch, which matters in a CUDA graph of microsecond kernels.
    """
    mask = t_ok[:, None] & row_ok[None, :]
    out_ptrs = out_ptr + t[:, None] * stride_ot + rows[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + t[:, None] * N + rows[None, :]
        piece = ROWS * N  # one split's slice
        tl.store(ws + tl.program_id(1) * piece, acc, mask=mask)
        one = 1
        if GPU:  # the interpreter runs programs one after another: nothing to order there
            fenced = tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, 1;", "=r,r",
                                               [acc.to(tl.int32, bitcast=True)], dtype=tl.int32, is_pure=False,
                                               pack=1)
            one = tl.max(tl.max(fenced, axis=1), axis=0)
        tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        arrived = tl.atomic_add(cnt_ptr + tile, one, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.load(ws, mask=mask, other=0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(ws + s * piece, mask=mask, other=0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
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


def _dequant_lanes_kernel(words_ptr, high_ptr, scales_ptr, w_ptr, N, K, NG, stride_w,
                          FMT: tl.constexpr, GPS: tl.constexpr):
    """The lanes layout (qmv_cuda.TiledWeight(lanes=True)) to a dense weight, one 16-row tile and ``GPS`` groups a
    program: a (tile, group)'s codes are 128 consecutive 32-bit words (512 bytes) read as words, unpacked in
    registers and stored in K order - not gathered a byte per code as ``_dequant_kernel``'s path for it does. The
    same values (q * scale in fp32, rounded once), so the same bits.

    A (tile, group)'s words, in order: row j of each half (8), piece c (4), half (2), word (2) - word ``2 c + wp`` of
    row ``8 half + j``'s group. A word holds its even codes in the low 16 bits and its odd codes in the high 16
    (:data:`qmv_layout.WORD_ORDER`): field i of a half is code 2 i (+ 1). q5's high bits: one byte a word, in the
    same order, bit p of it for the code at field position p; scales [j, half]."""
    GROUP: tl.constexpr = 32 if FMT == 0 else 64
    FB: tl.constexpr = 8 if FMT == 0 else 4  # bits a code field
    HALF: tl.constexpr = 16 // FB  # fields in each 16-bit half of a word
    QMIN: tl.constexpr = -128 if FMT == 0 else (-16 if FMT == 1 else -8)
    tile = tl.program_id(0)
    i = tl.arange(0, HALF)
    shift = (i * FB)[None, None, None, None, :]
    mask_bits: tl.constexpr = (1 << FB) - 1
    # output coordinates of the [j, c, half, wp, q] values once permuted to [half, j, c, wp, q] = [16, GROUP]
    rows = tile * 16 + tl.arange(0, 16)
    cols = tl.arange(0, GROUP)
    for gi in tl.static_range(GPS):
        g = tl.program_id(1) * GPS + gi
        if g < NG:
            base = (tile * NG + g).to(tl.int64)
            w = tl.load(words_ptr + base * 128 + tl.arange(0, 128)).reshape(8, 4, 2, 2)  # [j, c, half, wp]
            w = w[:, :, :, :, None]
            lo = (w >> shift) & mask_bits  # codes 2 i
            hi = (w >> (shift + 16)) & mask_bits  # codes 2 i + 1
            if FMT == 1:  # bit 4 of each code: bit p of the word's high byte, p its field (i low, HALF + i high)
                h = tl.load(high_ptr + base * 128 + tl.arange(0, 128)).to(tl.int32).reshape(8, 4, 2, 2)
                h = h[:, :, :, :, None]
                lo = lo | (((h >> (i[None, None, None, None, :])) & 1) << 4)
                hi = hi | (((h >> (i[None, None, None, None, :] + HALF)) & 1) << 4)
            if FMT == 0:  # the bytes of int8 codes: their top bit flipped makes u = q + 128
                lo = lo ^ 0x80
                hi = hi ^ 0x80
            u = tl.join(lo, hi).reshape(8, 4, 2, 2, 2 * HALF)  # [j, c, half, wp, q = 2 i + e]
            s = tl.load(scales_ptr + base * 16 + tl.arange(0, 16)).to(tl.float32).reshape(8, 1, 2, 1, 1)
            v = _codes_as(u, QMIN, tl.float32) * s  # [j, c, half, wp, q]
            v = tl.permute(v, (2, 0, 1, 3, 4)).reshape(16, GROUP)  # row 8 half + j; k (2 c + wp) 2 HALF + q
            k = g * GROUP + cols
            tl.store(w_ptr + rows[:, None].to(tl.int64) * stride_w + k[None, :], v.to(w_ptr.dtype.element_ty),
                     mask=(rows[:, None] < N) & (k[None, :] < K))


_HELPERS = ("_word_codes", "_load_in_layout", "_codes_as", "_lanes_weights", "_step_weights", "_epilogue")


@functools.cache
def kernels():
    """Import Triton and jit the kernels (once): (gemv, dot, dequant); raises ImportError when Triton is missing."""
    global triton
    import triton as _triton_pkg

    triton = _triton_pkg
    k = _triton.jit_module(globals(), _HELPERS, {"gemv": "_gemv_kernel", "dot": "_dot_kernel",
                                                 "dequant": "_dequant_kernel", "lanes": "_dequant_lanes_kernel"})
    return k["gemv"], k["dot"], k["dequant"], k["lanes"]
