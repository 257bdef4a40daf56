"""The Triton kernels of :mod:`kernels.attention_triton` (the device side; planning, checks, launches and the
fp32 reference live there): ``_attn_split`` (one key range of one slot's query rows, online softmax over int8 or
float K/V tiles read from the cache in place) and ``_attn_combine`` (the ranges merged by their log-sum-exp, the
output gate applied); ``_attn_prefill`` (kernels/attention_prefill.py: a block of a prompt's tokens of one query
head against all their keys, flash style, from the same cache tiles), ``_attn_prefill_desc`` (the same over a
16-bit cache whose tiles arrive through tensor descriptors) and ``_kv_dequant`` (a slot's int8 K or V dequantized
to a contiguous copy, for them).
"""

from __future__ import annotations

import functools

import torch

from . import _triton

# Plain functions here, turned into jitted kernels by `jit_kernels()` on first use: triton is optional, and
# TRITON_INTERPRET (which the test module sets on machines without CUDA) is read when `triton.jit` runs. Their
# annotations are strings (postponed evaluation), so `tl` only has to exist by then.

tl = pdl_enter = None  # triton.language and the PDL helper, bound by jit_kernels()


def _load_tile(base, s_base, stride_n, stride_sn, offs_n, n_ok, DOT_DTYPE: tl.constexpr, HD: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NG: tl.constexpr, GW: tl.constexpr,
               IS_INT8: tl.constexpr):
    """Keys or values [BLOCK_N, BLOCK_D] of one slot and kv head in DOT_DTYPE, 0 past HD and where n_ok is false."""
    if IS_INT8:
        # TODO(perf): for BLOCK_M=16 (mma.sync) sm_90 SASS reads the int8 V tile from shared memory one byte per
        # LDS (the dot-operand layout walks keys, which are strided); a suspect while int8 lags bf16 in % copy bw
        return _dequant(_codes_tile(base, stride_n, offs_n, n_ok, HD, NG, GW),
                        _scales_tile(s_base, stride_sn, offs_n, n_ok, HD, NG, GW), DOT_DTYPE, BLOCK_N, BLOCK_D)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        x = tl.load(base + offs_n[:, None] * stride_n + offs_d[None, :],
                    mask=n_ok[:, None] & (offs_d[None, :] < HD), other=0.0)
        return x.to(DOT_DTYPE)


def _codes_tile(base, stride_n, offs_n, n_ok, HD: tl.constexpr, NG: tl.constexpr, GW: tl.constexpr):
    """int8 codes of keys offs_n as [BLOCK_N, NG, GW], so that each 64-wide group meets its scale by broadcasting
    (0 past HD and where n_ok is false)."""
    d3 = tl.arange(0, NG)[None, :, None] * GW + tl.arange(0, GW)[None, None, :]
    return tl.load(base + offs_n[:, None, None] * stride_n + d3, mask=n_ok[:, None, None] & (d3 < HD), other=0)


def _scales_tile(s_base, stride_sn, offs_n, n_ok, HD: tl.constexpr, NG: tl.constexpr, GW: tl.constexpr):
    """The fp16 scales of keys offs_n [BLOCK_N, NG] (0 where n_ok is false)."""
    offs_g = tl.arange(0, NG)
    return tl.load(s_base + offs_n[:, None] * stride_sn + offs_g[None, :],
                   mask=n_ok[:, None] & (offs_g[None, :] * GW < HD), other=0.0)


def _dequant(codes, sc, DOT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """codes [BLOCK_N, NG, GW] times their scales [BLOCK_N, NG] as [BLOCK_N, BLOCK_D] in DOT_DTYPE: the product in
    fp16 (exact codes, one rounding) holds the tile in half the registers of fp32, and overflows only for cached
    values past fp16's 65504; decode attention dots it in fp16 (DOT_DTYPE), so no conversion follows."""
    x = _int8_f16(codes) * sc[:, :, None]
    return tl.reshape(x, (BLOCK_N, BLOCK_D)).to(DOT_DTYPE)


def _codes_flat(base, stride_n, offs_n, n_ok, HD: tl.constexpr, BLOCK_D: tl.constexpr):
    """int8 codes of keys offs_n as one [BLOCK_N, BLOCK_D] tile (0 past HD and where n_ok is false)."""
    offs_d = tl.arange(0, BLOCK_D)
    return tl.load(base + offs_n[:, None] * stride_n + offs_d[None, :], mask=n_ok[:, None] & (offs_d[None, :] < HD),
                   other=0)


def _dequant_flat(codes, sc, DOT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  NG: tl.constexpr, GW: tl.constexpr):
    """_dequant of a 2-D codes tile: the scales [BLOCK_N, NG] broadcast to the tile's columns instead of the codes
    reshaped, so the codes stay 2-D from the load to the dot (the same fp16 products, the same bits)."""
    s2 = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, NG, GW)), (BLOCK_N, BLOCK_D))
    return (_int8_f16(codes) * s2).to(DOT_DTYPE)


def _ahead_tile(base, sc, stride_n, offs_n, n_ok, DOT_DTYPE: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, NG: tl.constexpr, GW: tl.constexpr, FLAT: tl.constexpr):
    """An int8 K or V tile [BLOCK_N, BLOCK_D] in DOT_DTYPE from its codes and its scales ``sc`` loaded a block
    ahead: codes as [BLOCK_N, NG, GW] (_dequant), or FLAT as one 2-D tile (_dequant_flat); the same values."""
    if FLAT:
        return _dequant_flat(_codes_flat(base, stride_n, offs_n, n_ok, HD, BLOCK_D), sc, DOT_DTYPE, BLOCK_N,
                             BLOCK_D, NG, GW)
    return _dequant(_codes_tile(base, stride_n, offs_n, n_ok, HD, NG, GW), sc, DOT_DTYPE, BLOCK_N, BLOCK_D)


def _row_chunk(pos, CHUNK, MIN_CHUNK, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """Keys per split for a query token at ``pos``: its key range over the grid's NUM_SPLITS, in whole blocks,
    within [MIN_CHUNK, CHUNK] - so a short sequence spreads over the splits instead of filling a few (the grid is
    sized for the longest key range). A function of the token's own position: nothing batched with it changes it."""
    want = tl.cdiv(tl.cdiv(pos + 1, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return tl.minimum(tl.maximum(want, MIN_CHUNK), CHUNK)


def _attn_split(Q, K, V, KS, VS, SLOTS, QPOS, O, OP, LSE, GATE, stride_gb, stride_gt,
                stride_qb, stride_qt, stride_qh, stride_ks, stride_kh, stride_kn, stride_vs, stride_vh, stride_vn,
                stride_kss, stride_ksh, stride_ksn: tl.constexpr, stride_vss, stride_vsh, stride_vsn: tl.constexpr,
                stride_pb, stride_pt, stride_ob, stride_ot, stride_oh,
                qk_scale, T, H, HKV, KV_LEN, CHUNK, MIN_CHUNK, NUM_SPLITS, M_TILES,
                G: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, NG: tl.constexpr, GW: tl.constexpr, IS_INT8: tl.constexpr,
                SPLIT: tl.constexpr, HAS_GATE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
                PACK: tl.constexpr, GROUPED: tl.constexpr, AHEAD: tl.constexpr, FLAT: tl.constexpr,
                PDL: tl.constexpr):
    """Program (tile, split, b * Hkv + hkv). PACK == 1: tile = t * M_TILES + m, token t's rows g of m tile.
    PACK > 1: tile i holds tokens i * PACK .. + PACK - 1, G rows each, so one program reads each K/V tile once for
    all of them. Every row keeps its own key range [split * chunk, + chunk), chunk from its own position
    (_row_chunk); the program walks the union of its rows' ranges in BLOCK_N steps (all ranges start on a multiple
    of BLOCK_N, so a row meets exactly the blocks it meets alone), and a block outside a row's range leaves its
    running max, sum and accumulator unchanged to the bit (alpha = 1, p = 0).

    GROUPED (int8 caches): K and V as NG two-dimensional [BLOCK_N, GW] tiles, one per scale group, instead of one
    [BLOCK_N, NG, GW] tile reshaped: q.k is the sum over groups of (q_g . codes_g) times the keys' group scales,
    applied to the fp32 products (no scale per cached key value), and each group's values meet their scales by a
    [BLOCK_N, 1] broadcast into their own [BLOCK_M, GW] accumulator.

    AHEAD (int8 caches, one tile per K / V): each key block's scales are loaded one block ahead, so their load is
    in flight while the block before is dotted (a tile of 2-byte scales is too narrow for the asynchronous copies
    the loop's pipelining gives the codes). The strides of the scales along keys are compile-time constants (the
    cache's group count), so a key's scales load as one vector. FLAT (with AHEAD): the codes loaded as one 2-D tile
    and the scales broadcast to its columns (_dequant_flat). None of these changes a value."""
    pdl_enter(PDL)  # PDL launches: wait for the kernel before, let the next one launch
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // HKV
    hkv = pid_bh % HKV
    r = tl.arange(0, BLOCK_M)
    if PACK > 1:
        t = pid_m * PACK + r // G  # [BLOCK_M]
        g = r % G
        row_ok = (r < PACK * G) & (t < T)
    else:
        t = pid_m // M_TILES + 0 * r  # one token a tile
        g = (pid_m % M_TILES) * BLOCK_M + r
        row_ok = g < G
    h = hkv * G + g
    pos = tl.load(QPOS + b * stride_pb + t * stride_pt, mask=row_ok, other=-1).to(tl.int32)
    qpos = tl.where(row_ok, pos, -1)  # [BLOCK_M]; -1: no key
    chunk = _row_chunk(qpos, CHUNK, MIN_CHUNK, NUM_SPLITS, BLOCK_N)
    lo_r = pid_s * chunk
    hi_r = tl.minimum(tl.minimum(lo_r + chunk, KV_LEN), qpos + 1)  # hi_r <= lo_r: the chunk is past the row
    has_keys = hi_r > lo_r
    lo = tl.min(tl.where(has_keys, lo_r, KV_LEN), 0)
    hi = tl.max(tl.where(has_keys, hi_r, 0), 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    q_rows = Q + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh
    if GROUPED:
        q0 = _group_q(q_rows, row_ok, 0, DOT_DTYPE, HD, GW)
        acc0 = tl.zeros([BLOCK_M, GW], tl.float32)
        if NG > 1:
            q1 = _group_q(q_rows, row_ok, 1, DOT_DTYPE, HD, GW)
            acc1 = tl.zeros([BLOCK_M, GW], tl.float32)
        if NG > 2:
            q2 = _group_q(q_rows, row_ok, 2, DOT_DTYPE, HD, GW)
            q3 = _group_q(q_rows, row_ok, 3, DOT_DTYPE, HD, GW)
            acc2 = tl.zeros([BLOCK_M, GW], tl.float32)
            acc3 = tl.zeros([BLOCK_M, GW], tl.float32)
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    slot = tl.load(SLOTS + b).to(tl.int64)  # slot * stride overflows int32 on large caches
    k_base = K + slot * stride_ks + hkv * stride_kh
    v_base = V + slot * stride_vs + hkv * stride_vh
    ks_base = KS + slot * stride_kss + hkv * stride_ksh
    vs_base = VS + slot * stride_vss + hkv * stride_vsh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if AHEAD:  # the first block's scales; each block then loads the next one's
        offs0 = lo + tl.arange(0, BLOCK_N)
        sk = _scales_tile(ks_base, stride_ksn, offs0, offs0 < hi, HD, NG, GW)
        sv = _scales_tile(vs_base, stride_vsn, offs0, offs0 < hi, HD, NG, GW)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi  # masked loads give 0, so NaN or garbage past the last position never reaches p @ v
        if AHEAD:
            nxt = offs_n + BLOCK_N
            sk_next = _scales_tile(ks_base, stride_ksn, nxt, nxt < hi, HD, NG, GW)
            sv_next = _scales_tile(vs_base, stride_vsn, nxt, nxt < hi, HD, NG, GW)
        if GROUPED:
            qk = _group_qk(q0, k_base, ks_base, stride_kn, stride_ksn, offs_n, n_ok, 0, DOT_DTYPE, DOT_PREC, HD, GW)
            if NG > 1:
                qk += _group_qk(q1, k_base, ks_base, stride_kn, stride_ksn, offs_n, n_ok, 1, DOT_DTYPE, DOT_PREC,
                                HD, GW)
            if NG > 2:
                qk += _group_qk(q2, k_base, ks_base, stride_kn, stride_ksn, offs_n, n_ok, 2, DOT_DTYPE, DOT_PREC,
                                HD, GW)
                qk += _group_qk(q3, k_base, ks_base, stride_kn, stride_ksn, offs_n, n_ok, 3, DOT_DTYPE, DOT_PREC,
                                HD, GW)
            qk = qk * qk_scale
        elif AHEAD:
            k = _ahead_tile(k_base, sk, stride_kn, offs_n, n_ok, DOT_DTYPE, HD, BLOCK_N, BLOCK_D, NG, GW, FLAT)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        else:
            k = _load_tile(k_base, ks_base, stride_kn, stride_ksn, offs_n, n_ok, DOT_DTYPE, HD, BLOCK_N, BLOCK_D,
                           NG, GW, IS_INT8)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        live = (offs_n[None, :] >= lo_r[:, None]) & (offs_n[None, :] < hi_r[:, None])
        qk = tl.where(live, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no live key yet: avoid inf - inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p16 = p.to(DOT_DTYPE)
        if GROUPED:
            acc0 = acc0 * alpha[:, None] + _group_pv(p16, v_base, vs_base, stride_vn, stride_vsn, offs_n, n_ok, 0,
                                                     DOT_DTYPE, DOT_PREC, HD, GW)
            if NG > 1:
                acc1 = acc1 * alpha[:, None] + _group_pv(p16, v_base, vs_base, stride_vn, stride_vsn, offs_n, n_ok, 1,
                                                         DOT_DTYPE, DOT_PREC, HD, GW)
            if NG > 2:
                acc2 = acc2 * alpha[:, None] + _group_pv(p16, v_base, vs_base, stride_vn, stride_vsn, offs_n, n_ok, 2,
                                                         DOT_DTYPE, DOT_PREC, HD, GW)
                acc3 = acc3 * alpha[:, None] + _group_pv(p16, v_base, vs_base, stride_vn, stride_vsn, offs_n, n_ok, 3,
                                                         DOT_DTYPE, DOT_PREC, HD, GW)
        else:
            if AHEAD:
                v = _ahead_tile(v_base, sv, stride_vn, offs_n, n_ok, DOT_DTYPE, HD, BLOCK_N, BLOCK_D, NG, GW, FLAT)
                sk = sk_next
                sv = sv_next
            else:
                v = _load_tile(v_base, vs_base, stride_vn, stride_vsn, offs_n, n_ok, DOT_DTYPE, HD, BLOCK_N, BLOCK_D,
                               NG, GW, IS_INT8)
            acc = acc * alpha[:, None] + tl.dot(p16, v, input_precision=DOT_PREC)
        m_i = m_new
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    # partials [B, T, H, NUM_SPLITS, (hd)]; rows whose q_pos lies before this chunk are never read: skip them
    ri = ((b * T + t) * H + h).to(tl.int64) * NUM_SPLITS + pid_s
    used = row_ok & has_keys
    o_rows = O + b * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh
    g_rows = GATE + b * stride_gb + t[:, None] * stride_gt + h[:, None] * HD
    if GROUPED:
        _store_cols(acc0 / l_safe[:, None], 0, OP, ri, used, o_rows, g_rows, row_ok, HD, GW, SPLIT, HAS_GATE)
        if NG > 1:
            _store_cols(acc1 / l_safe[:, None], GW, OP, ri, used, o_rows, g_rows, row_ok, HD, GW, SPLIT, HAS_GATE)
        if NG > 2:
            _store_cols(acc2 / l_safe[:, None], 2 * GW, OP, ri, used, o_rows, g_rows, row_ok, HD, GW, SPLIT, HAS_GATE)
            _store_cols(acc3 / l_safe[:, None], 3 * GW, OP, ri, used, o_rows, g_rows, row_ok, HD, GW, SPLIT, HAS_GATE)
    else:
        _store_cols(acc / l_safe[:, None], 0, OP, ri, used, o_rows, g_rows, row_ok, HD, BLOCK_D, SPLIT, HAS_GATE)
    if SPLIT:
        tl.store(LSE + ri, tl.where(has, m_i + tl.log2(l_safe), float("-inf")), mask=used)


def _store_cols(o, c0, OP, ri, used, o_rows, g_rows, row_ok, HD: tl.constexpr, W: tl.constexpr,
                SPLIT: tl.constexpr, HAS_GATE: tl.constexpr):
    """Columns [c0, c0 + W) of a tile's normalised output ``o`` [BLOCK_M, W]: SPLIT, the fp32 partials of the rows
    that used this split; otherwise the output itself, gated as it is stored."""
    offs = c0 + tl.arange(0, W)
    ok = offs < HD
    if SPLIT:
        tl.store(OP + ri[:, None] * HD + offs[None, :], o, mask=used[:, None] & ok[None, :])
    else:
        mask = row_ok[:, None] & ok[None, :]
        val = _gated(o.to(o_rows.dtype.element_ty), g_rows + offs[None, :], mask, HAS_GATE)
        tl.store(o_rows + offs[None, :], val, mask=mask)


def _int8_f16(codes):
    """int8 codes as exact fp16: c + 1152 from bits (0x6400 = 1024.0 holds 0..255 exactly in its mantissa), then
    - 1152: no int->float conversion, which runs at a quarter of the FMA rate on Hopper."""
    return (codes.to(tl.int32) + 0x6480).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0


def _codes16(base, stride_n, offs_n, n_ok, g: tl.constexpr, HD: tl.constexpr, GW: tl.constexpr):
    """Scale group g's int8 codes of keys offs_n [BLOCK_N, GW] as exact fp16 (0 past HD and where n_ok is false)."""
    offs = g * GW + tl.arange(0, GW)
    c = tl.load(base + offs_n[:, None] * stride_n + offs[None, :], mask=n_ok[:, None] & (offs[None, :] < HD), other=0)
    return _int8_f16(c)


def _group_scale(s_base, stride_sn, offs_n, n_ok, g: tl.constexpr):
    """The keys' fp16 scales of group g [BLOCK_N] (0 where n_ok is false)."""
    return tl.load(s_base + offs_n * stride_sn + g, mask=n_ok, other=0.0)


def _group_q(q_rows, row_ok, g: tl.constexpr, DOT_DTYPE: tl.constexpr, HD: tl.constexpr, GW: tl.constexpr):
    """Columns of scale group g of the tile's query rows [BLOCK_M, GW] in DOT_DTYPE (0 past HD)."""
    offs = g * GW + tl.arange(0, GW)
    return tl.load(q_rows + offs[None, :], mask=row_ok[:, None] & (offs[None, :] < HD), other=0.0).to(DOT_DTYPE)


def _group_qk(q_g, k_base, ks_base, stride_kn, stride_ksn, offs_n, n_ok, g: tl.constexpr, DOT_DTYPE: tl.constexpr,
              DOT_PREC: tl.constexpr, HD: tl.constexpr, GW: tl.constexpr):
    """Group g's share of q.k [BLOCK_M, BLOCK_N] in fp32: (q_g . codes_g) times the keys' scales."""
    c = _codes16(k_base, stride_kn, offs_n, n_ok, g, HD, GW).to(DOT_DTYPE)
    sc = _group_scale(ks_base, stride_ksn, offs_n, n_ok, g).to(tl.float32)
    return tl.dot(q_g, tl.trans(c), input_precision=DOT_PREC) * sc[None, :]


def _group_pv(p16, v_base, vs_base, stride_vn, stride_vsn, offs_n, n_ok, g: tl.constexpr, DOT_DTYPE: tl.constexpr,
              DOT_PREC: tl.constexpr, HD: tl.constexpr, GW: tl.constexpr):
    """p [BLOCK_M, BLOCK_N] times group g's values [BLOCK_N, GW] (codes times their scales in fp16, one rounding)."""
    sc = _group_scale(vs_base, stride_vsn, offs_n, n_ok, g)
    v = (_codes16(v_base, stride_vn, offs_n, n_ok, g, HD, GW) * sc[:, None]).to(DOT_DTYPE)
    return tl.dot(p16, v, input_precision=DOT_PREC)


def _gated(o, gate_ptr, mask, HAS_GATE: tl.constexpr):
    """The stored output ``o`` (already in the output dtype), with HAS_GATE times sigmoid(gate) in fp32, rounded
    again: the bits kernels/fused.sigmoid_mul makes of it."""
    if HAS_GATE:
        g = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
        o = (o.to(tl.float32) * tl.sigmoid(g)).to(o.dtype)
    return o


def _attn_combine(OP, LSE, QPOS, O, GATE, stride_pb, stride_pt, stride_ob, stride_ot, stride_oh, stride_gb, stride_gt,
                  T, H, CHUNK, MIN_CHUNK, NUM_SPLITS, HD: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_DC: tl.constexpr, BLOCK_N: tl.constexpr, HAS_GATE: tl.constexpr, PDL: tl.constexpr):
    """Program (r = (b * T + t) * H + h, column block): merge the splits row r's q_pos reaches (log2-sum-exp)."""
    pdl_enter(PDL)  # PDL launches: wait for the kernel before, let the next one launch
    r = tl.program_id(0)
    h = r % H
    t = (r // H) % T
    b = r // (H * T)
    pos = tl.load(QPOS + b * stride_pb + t * stride_pt).to(tl.int32)
    n_used = tl.minimum(pos // _row_chunk(pos, CHUNK, MIN_CHUNK, NUM_SPLITS, BLOCK_N) + 1, NUM_SPLITS)
    offs_d = tl.program_id(1) * BLOCK_DC + tl.arange(0, BLOCK_DC)
    d_ok = offs_d < HD
    base = r.to(tl.int64) * NUM_SPLITS
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_DC], tl.float32)
    for s0 in range(0, n_used, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_ok = offs_s < n_used
        lse = tl.load(LSE + base + offs_s, mask=s_ok, other=float("-inf"))
        o = tl.load(OP + (base + offs_s)[:, None] * HD + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)  # fp32, or the CUDA split pass's fp16 (read back exactly)
        m_new = tl.maximum(m, tl.max(lse, 0))  # finite: split 0 always holds key 0
        w = tl.exp2(lse - m_new)
        alpha = tl.exp2(m - m_new)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        l = l * alpha + tl.sum(w, 0)
        m = m_new
    val = _gated((acc / l).to(O.dtype.element_ty), GATE + b * stride_gb + t * stride_gt + h * HD + offs_d, d_ok,
                 HAS_GATE)
    tl.store(O + b * stride_ob + t * stride_ot + h * stride_oh + offs_d, val, mask=d_ok)


def _softmax_step(qk, m_i, MASKED: tl.constexpr):
    """One key tile's online-softmax update of a prefill block: the new running max, the factor the sums so far
    are scaled by and the tile's weights p (MASKED: a row with no live key yet keeps m = -inf without an inf - inf)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = m_new
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, tl.exp2(m_i - m_safe), tl.exp2(qk - m_safe[:, None])


def _prefill_rows(Q, QPOS, stride_qb, stride_qt, stride_qh, stride_pb, stride_pt, T, H, KV_LEN, G: tl.constexpr,
                  HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  DOT_DTYPE: tl.constexpr):
    """A prefill program's rows (program (b * H + h, query block), the last block first): b, h, its kv head, the
    block's token offsets and which are real, their positions (-1 past T), the key bound ``hi``, ``full`` (keys
    0 .. full - 1, whole tiles, seen by every row), the head columns and the queries [BLOCK_M, BLOCK_D]."""
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < T
    qpos = tl.load(QPOS + b * stride_pb + offs_m * stride_pt, mask=row_ok, other=-1).to(tl.int32)
    hi = tl.minimum(tl.max(qpos, 0) + 1, KV_LEN)
    lo_pos = tl.min(tl.where(row_ok, qpos, KV_LEN), 0)
    full = tl.minimum(lo_pos + 1, hi) // BLOCK_N * BLOCK_N
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    q = tl.load(Q + b * stride_qb + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
    return b, h, h // G, offs_m, row_ok, qpos, hi, full, offs_d, d_ok, q


def _prefill_store(acc, l_i, O, GATE, b, h, offs_m, row_ok, offs_d, d_ok, stride_gb, stride_gt, stride_ob, stride_ot,
                   stride_oh, HD: tl.constexpr, HAS_GATE: tl.constexpr):
    """A prefill block's output: the sums over their weights (0 for a row with none), gated on store, real rows."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    gate_ptr = GATE + b * stride_gb + offs_m[:, None] * stride_gt + h * HD + offs_d[None, :]
    val = _gated(o.to(O.dtype.element_ty), gate_ptr, mask, HAS_GATE)
    tl.store(O + b * stride_ob + offs_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :], val, mask=mask)


def _fold_past(acc, m_i, l_i, PO, PLSE, b, h, offs_m, row_ok, offs_d, d_ok, stride_pob, stride_pot, stride_poh,
               stride_plb, stride_plh, stride_plt):
    """Keys below KEY_LO folded into a prefill block's online softmax from another kernel's result over them: its
    normalised output rows ``PO`` and their natural-log sum-exp ``PLSE`` (cuDNN's); returns the block's sums and
    weights over both key ranges, m_i's log2 units kept (a row with no key on one side takes the other's alone)."""
    lse = tl.load(PLSE + b * stride_plb + h * stride_plh + offs_m * stride_plt, mask=row_ok,
                  other=float("-inf")).to(tl.float32) * 1.4426950408889634  # to log2 units
    po = tl.load(PO + b * stride_pob + offs_m[:, None] * stride_pot + h * stride_poh + offs_d[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m_new = tl.maximum(m_i, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m_i - m_safe)
    w = tl.exp2(lse - m_safe)
    return acc * a[:, None] + po * w[:, None], l_i * a + w


def _prefill_tile(q, qpos, start, end, m_i, l_i, acc, k_base, v_base, ks_base, vs_base, stride_kn, stride_vn,
                  stride_ksn, stride_vsn, qk_scale, MASKED: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  DOT_PREC: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  NG: tl.constexpr, GW: tl.constexpr, IS_INT8: tl.constexpr):
    """One key tile [start, + BLOCK_N) of ``_attn_prefill``'s online softmax (keys from ``end`` on are not read);
    MASKED: each row only up to its q_pos (rows with no live key yet keep m = -inf without an inf - inf)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < end
    k = _load_tile(k_base, ks_base, stride_kn, stride_ksn, offs_n, n_ok, DOT_DTYPE, HD, BLOCK_N, BLOCK_D, NG, GW,
                   IS_INT8)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    if MASKED:
        qk = tl.where((offs_n[None, :] <= qpos[:, None]) & n_ok[None, :], qk, float("-inf"))
    m_new, alpha, p = _softmax_step(qk, m_i, MASKED)
    v = _load_tile(v_base, vs_base, stride_vn, stride_vsn, offs_n, n_ok, DOT_DTYPE, HD, BLOCK_N, BLOCK_D, NG, GW,
                   IS_INT8)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PREC)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


def _attn_prefill(Q, K, V, KS, VS, SLOTS, QPOS, O, GATE, stride_gb, stride_gt,
                  stride_qb, stride_qt, stride_qh, stride_ks, stride_kh, stride_kn, stride_vs, stride_vh, stride_vn,
                  stride_kss, stride_ksh, stride_ksn, stride_vss, stride_vsh, stride_vsn,
                  stride_pb, stride_pt, stride_ob, stride_ot, stride_oh,
                  qk_scale, T, H, KV_LEN, KEY_LO, PO, PLSE, stride_pob, stride_pot, stride_poh, stride_plb,
                  stride_plh, stride_plt,
                  G: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, NG: tl.constexpr, GW: tl.constexpr, IS_INT8: tl.constexpr,
                  HAS_GATE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, HAS_PAST: tl.constexpr):
    """Program (b * H + h, query block): tokens [m * BLOCK_M, + BLOCK_M) of head h against keys 0 .. their q_pos.

    Axis 0 walks the heads, so the G heads of one kv head run side by side and read its K/V tiles from L2; axis 1
    is taken last block first (the longest key ranges start first). The key loop runs in two parts: the keys every
    row of the block sees (below the block's smallest q_pos, in whole tiles) without a mask, then the rest with the
    causal mask. A padded row (past T) has q_pos -1 and stores nothing. Keys below KEY_LO (a multiple of BLOCK_N,
    at most every real row's q_pos) are not read; HAS_PAST folds them in from another kernel's result (_fold_past)."""
    b, h, hkv, offs_m, row_ok, qpos, hi, full, offs_d, d_ok, q = _prefill_rows(
        Q, QPOS, stride_qb, stride_qt, stride_qh, stride_pb, stride_pt, T, H, KV_LEN, G, HD, BLOCK_M, BLOCK_N,
        BLOCK_D, DOT_DTYPE)
    slot = tl.load(SLOTS + b).to(tl.int64)
    k_base = K + slot * stride_ks + hkv * stride_kh
    v_base = V + slot * stride_vs + hkv * stride_vh
    ks_base = KS + slot * stride_kss + hkv * stride_ksh
    vs_base = VS + slot * stride_vss + hkv * stride_vsh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(KEY_LO, full, BLOCK_N):  # no mask: every key here is at or before every row's position
        m_i, l_i, acc = _prefill_tile(q, qpos, start, full, m_i, l_i, acc, k_base, v_base, ks_base, vs_base,
                                      stride_kn, stride_vn, stride_ksn, stride_vsn, qk_scale, False, DOT_DTYPE,
                                      DOT_PREC, HD, BLOCK_N, BLOCK_D, NG, GW, IS_INT8)
    for start in range(full, hi, BLOCK_N):  # the diagonal: each row up to its own position
        m_i, l_i, acc = _prefill_tile(q, qpos, start, hi, m_i, l_i, acc, k_base, v_base, ks_base, vs_base,
                                      stride_kn, stride_vn, stride_ksn, stride_vsn, qk_scale, True, DOT_DTYPE,
                                      DOT_PREC, HD, BLOCK_N, BLOCK_D, NG, GW, IS_INT8)
    if HAS_PAST:
        acc, l_i = _fold_past(acc, m_i, l_i, PO, PLSE, b, h, offs_m, row_ok, offs_d, d_ok, stride_pob, stride_pot,
                              stride_poh, stride_plb, stride_plh, stride_plt)
    _prefill_store(acc, l_i, O, GATE, b, h, offs_m, row_ok, offs_d, d_ok, stride_gb, stride_gt, stride_ob, stride_ot,
                   stride_oh, HD, HAS_GATE)


def _prefill_tile_desc(q, qpos, start, end, m_i, l_i, acc, desc_k, desc_v, kv_row, qk_scale, MASKED: tl.constexpr,
                       DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr):
    """``_prefill_tile`` over a 16-bit cache read through tensor descriptors (Hopper's bulk tensor copies): the tile's
    rows from ``kv_row + start`` of the cache's [rows, hd] view. Rows past ``end`` may belong to the next kv head (or
    be 0 past the view): the mask drops their keys, and their values are zeroed before the dot, so the tile enters
    the sums exactly as ``_prefill_tile``'s masked load does."""
    offs_n = start + tl.arange(0, BLOCK_N)
    k = desc_k.load([kv_row + start, 0]).to(DOT_DTYPE)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    if MASKED:
        qk = tl.where((offs_n[None, :] <= qpos[:, None]) & (offs_n[None, :] < end), qk, float("-inf"))
    m_new, alpha, p = _softmax_step(qk, m_i, MASKED)
    v = desc_v.load([kv_row + start, 0]).to(DOT_DTYPE)
    if MASKED:
        v = tl.where((offs_n < end)[:, None], v, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PREC)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


def _attn_prefill_desc(Q, desc_k, desc_v, SLOTS, QPOS, O, GATE, stride_gb, stride_gt, stride_qb, stride_qt, stride_qh,
                       stride_pb, stride_pt, stride_ob, stride_ot, stride_oh, qk_scale, T, H, HKV, CAP, KV_LEN,
                       KEY_LO, PO, PLSE, stride_pob, stride_pot, stride_poh, stride_plb, stride_plh, stride_plt,
                       G: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                       DOT_PREC: tl.constexpr, HAS_PAST: tl.constexpr):
    """``_attn_prefill`` for a bf16 / fp16 cache ``[S, Hkv, CAP, hd]`` (contiguous) whose K and V tiles arrive through
    tensor descriptors over its [S * Hkv * CAP, hd] view (kernels/attention_prefill.py's ``tma`` plan): the same
    programs, key order, tiles and arithmetic, so the same sums."""
    b, h, hkv, offs_m, row_ok, qpos, hi, full, offs_d, d_ok, q = _prefill_rows(
        Q, QPOS, stride_qb, stride_qt, stride_qh, stride_pb, stride_pt, T, H, KV_LEN, G, HD, BLOCK_M, BLOCK_N,
        BLOCK_D, DOT_DTYPE)
    slot = tl.load(SLOTS + b)
    kv_row = ((slot * HKV + hkv) * CAP).to(tl.int32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(KEY_LO, full, BLOCK_N):  # no mask: every key at or before every row
        m_i, l_i, acc = _prefill_tile_desc(q, qpos, start, full, m_i, l_i, acc, desc_k, desc_v, kv_row, qk_scale,
                                           False, DOT_DTYPE, DOT_PREC, BLOCK_N)
    for start in range(full, hi, BLOCK_N):  # the diagonal: each row up to its own position
        m_i, l_i, acc = _prefill_tile_desc(q, qpos, start, hi, m_i, l_i, acc, desc_k, desc_v, kv_row, qk_scale,
                                           True, DOT_DTYPE, DOT_PREC, BLOCK_N)
    if HAS_PAST:
        acc, l_i = _fold_past(acc, m_i, l_i, PO, PLSE, b, h, offs_m, row_ok, offs_d, d_ok, stride_pob, stride_pot,
                              stride_poh, stride_plb, stride_plh, stride_plt)
    _prefill_store(acc, l_i, O, GATE, b, h, offs_m, row_ok, offs_d, d_ok, stride_gb, stride_gt, stride_ob, stride_ot,
                   stride_oh, HD, HAS_GATE)


def _kv_dequant(K, KS, SLOTS, OUT, stride_ks, stride_kh, stride_kn, stride_sss, stride_ssh, stride_ssn,
                stride_ob, stride_oh, stride_on, HKV, LENGTH,
                HD: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, NG: tl.constexpr, GW: tl.constexpr):
    """Program (b * Hkv + hkv, key block): int8 codes x fp16 scales of keys [l * BLOCK_L, + BLOCK_L) of slot
    slots[b], kv head hkv, as one fp32 product rounded once to OUT's dtype."""
    pid_bh = tl.program_id(0)
    b = pid_bh // HKV
    hkv = pid_bh % HKV
    offs_n = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    n_ok = offs_n < LENGTH
    slot = tl.load(SLOTS + b).to(tl.int64)
    offs_g = tl.arange(0, NG)
    d3 = offs_g[None, :, None] * GW + tl.arange(0, GW)[None, None, :]
    ok = n_ok[:, None, None] & (d3 < HD)
    codes = tl.load(K + slot * stride_ks + hkv * stride_kh + offs_n[:, None, None] * stride_kn + d3, mask=ok, other=0)
    sc = tl.load(KS + slot * stride_sss + hkv * stride_ssh + offs_n[:, None] * stride_ssn + offs_g[None, :],
                 mask=n_ok[:, None] & (offs_g[None, :] * GW < HD), other=0.0)
    x = codes.to(tl.float32) * sc.to(tl.float32)[:, :, None]
    tl.store(OUT + b.to(tl.int64) * stride_ob + hkv * stride_oh + offs_n[:, None, None] * stride_on + d3,
             x.to(OUT.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=1)
def jit_kernels() -> dict:
    """Jit the kernels (first call only). `_attn_split` finds `_load_tile` and `tl` as module globals."""
    out = _triton.jit_module(globals(), ("_int8_f16", "_load_tile", "_codes_tile", "_scales_tile", "_dequant",
                                         "_codes_flat", "_dequant_flat", "_ahead_tile", "_row_chunk", "_gated",
                                         "_softmax_step", "_prefill_rows", "_prefill_store", "_fold_past",
                                         "_prefill_tile", "_prefill_tile_desc", "_store_cols", "_codes16",
                                         "_group_scale", "_group_q", "_group_qk", "_group_pv"),
                             {"split": "_attn_split", "combine": "_attn_combine",
                              "prefill": "_attn_prefill", "prefill_desc": "_attn_prefill_desc",
                              "kv_dequant": "_kv_dequant"})
    out["dtypes"] = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    return out
