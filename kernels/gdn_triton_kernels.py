"""The Triton kernels of :mod:`kernels.gdn_triton` (the device side; planning, checks, launches and the
fp32 reference live there): ``_prep_kernel`` (conv + SiLU, L2 norms, gates into a workspace, one token a program),
``_recur_kernel`` (the delta-rule recurrence on a state tile held in registers, optionally the gated norm, the
state and the new conv windows), ``_gated_norm_kernel``, and ``_conv_window_kernel`` (a prompt chunk's new conv
windows, for :mod:`kernels.gdn_prefill`).
"""

from __future__ import annotations

import functools

from . import _triton

# Plain functions here, turned into jitted kernels by `jit_kernels()` on first use: triton is optional, and
# TRITON_INTERPRET (which the test module sets on machines without CUDA) is read when `triton.jit` runs. Their
# annotations are strings (postponed evaluation), so `tl` only has to exist by then.

tl = pdl_enter = None  # triton.language and the PDL helper, bound by jit_kernels()


def _conv_tok(x_base, stride_xt, src_base, stride_sc, stride_sw, CW, chan, c_ok, t, W: tl.constexpr,
              BD: tl.constexpr):
    """silu(depthwise causal conv) of channels ``chan`` for token ``t``: [BD] fp32.

    Token t reads positions t .. t+W-1 of cat(old window [W-1], new inputs [T]); the old window is src[c, 0:W-1].
    One token in a [BD] vector whose layout depends on BD alone: its sums (and the norms the caller takes of it)
    are the same bits whatever T is, so a verify pass computes what single decode steps compute.
    """
    acc = tl.zeros([BD], tl.float32)
    for j in tl.static_range(W):
        wj = tl.load(CW + chan * W + j, mask=c_ok, other=0.0)
        p = t + j
        old = p < W - 1  # the tap reads the old window, else the new inputs
        xs = tl.load(src_base + chan * stride_sc + p * stride_sw, mask=c_ok & old, other=0.0).to(tl.float32)
        xn = tl.load(x_base + (p - (W - 1)) * stride_xt + chan, mask=c_ok & (p >= W - 1), other=0.0).to(tl.float32)
        acc += wj * tl.where(old, xs, xn)
    return acc * tl.sigmoid(acc)


def _window(x_base, stride_xt, src_base, stride_sc, stride_sw, chan, c_ok, keep, W: tl.constexpr,
            BW: tl.constexpr):
    """The W-1 inputs ending at token ``keep``: positions keep .. keep+W-2 of cat(old, new), [BW, BC]."""
    j = tl.arange(0, BW)
    p = keep + j
    old = p < W - 1
    ok = (j < W - 1)[:, None] & c_ok[None, :]
    xs = tl.load(src_base + chan[None, :] * stride_sc + p[:, None] * stride_sw, mask=ok & old[:, None], other=0.0)
    xn = tl.load(x_base + (p - (W - 1))[:, None] * stride_xt + chan[None, :], mask=ok & ~old[:, None], other=0.0)
    return tl.where(old[:, None], xs.to(tl.float32), xn.to(tl.float32))


def _write_window(x_base, stride_xt, src_base, stride_sc, stride_sw, dst_base, stride_vc, stride_vw, chan, c_ok,
                  keep, ty, W: tl.constexpr, BW: tl.constexpr):
    """Channels ``chan``'s new conv window (the W-1 inputs ending at token ``keep``) into the cache: read whole
    before any of it is written (the source may be the same cache rows)."""
    win = _window(x_base, stride_xt, src_base, stride_sc, stride_sw, chan, c_ok, keep, W, BW)
    tl.debug_barrier()  # every thread's reads of the old window before any write over it
    jj = tl.arange(0, BW)[:, None]
    tl.store(dst_base + chan[None, :] * stride_vc + jj * stride_vw, win.to(ty), mask=(jj < W - 1) & c_ok[None, :])


def _prep_kernel(QKV, CSRC, CW, SLOTS, BB, AA, ALOG, DTB, WORK, GATES, XOUT,
                 stride_xb, stride_xt, stride_cb, stride_cc, stride_cw, stride_bb, stride_bt, stride_ab, stride_at,
                 T, scale,
                 HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, W: tl.constexpr,
                 BD: tl.constexpr, CONV_INIT: tl.constexpr, STORE_X: tl.constexpr, PDL: tl.constexpr):
    """Program (b, j, t), one token each: j < Hk the q and k channels of k head j (conv, SiLU, L2 norms, q.k), else
    the v channels of v head j - Hk (conv, SiLU) and its gates. Writes them to WORK / GATES [B, T, .] fp32 and
    nothing else: the cache's conv windows are the recurrence's to write, so tokens can run side by side. With
    STORE_X it also copies its channels' raw inputs of token t to XOUT [B, T, C] (the conv inputs a layered
    rollback, ``_recur_kernel`` with LAYERED, rebuilds the conv windows from)."""
    pdl_enter(PDL)  # PDL launches: wait for the kernel before, let the next one launch
    b = tl.program_id(0)
    j = tl.program_id(1)
    t = tl.program_id(2)
    slot = tl.load(SLOTS + b).to(tl.int64)  # slot * stride overflows int32 on large caches
    offs_d = tl.arange(0, BD)
    x_base = QKV + b.to(tl.int64) * stride_xb
    src_base = CSRC + (b.to(tl.int64) if CONV_INIT else slot) * stride_cb
    C = 2 * HK * DK + HV * DV  # a WORK row
    NGATE = 2 * HV + HK  # a GATES row
    w_row = WORK + (b * T + t) * C
    g_row = GATES + (b * T + t) * NGATE
    if j < HK:
        ok = offs_d < DK
        q_chan = j * DK + offs_d
        k_chan = HK * DK + j * DK + offs_d
        q = _conv_tok(x_base, stride_xt, src_base, stride_cc, stride_cw, CW, q_chan, ok, t, W, BD)
        k = _conv_tok(x_base, stride_xt, src_base, stride_cc, stride_cw, CW, k_chan, ok, t, W, BD)
        q = q * (tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        tl.store(w_row + q_chan, q, mask=ok)
        tl.store(w_row + k_chan, k, mask=ok)
        if STORE_X:
            x_row = XOUT + (b * T + t) * C
            tl.store(x_row + q_chan, tl.load(x_base + t * stride_xt + q_chan, mask=ok), mask=ok)
            tl.store(x_row + k_chan, tl.load(x_base + t * stride_xt + k_chan, mask=ok), mask=ok)
        tl.store(g_row + 2 * HV + j, tl.sum(q * k, 0))  # q . k, for o = e^g S^T q + (q.k) u
    else:
        h = j - HK
        ok = offs_d < DV
        v_chan = 2 * HK * DK + h * DV + offs_d
        v = _conv_tok(x_base, stride_xt, src_base, stride_cc, stride_cw, CW, v_chan, ok, t, W, BD)
        tl.store(w_row + v_chan, v, mask=ok)
        if STORE_X:
            tl.store(XOUT + (b * T + t) * C + v_chan, tl.load(x_base + t * stride_xt + v_chan, mask=ok), mask=ok)
        # beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the recurrence masks tokens past keep
        bt = tl.load(BB + b * stride_bb + t * stride_bt + h).to(tl.float32)
        x = tl.load(AA + b * stride_ab + t * stride_at + h).to(tl.float32) + tl.load(DTB + h)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold 20
        tl.store(g_row + h, tl.exp(-tl.exp(tl.load(ALOG + h)) * softplus))
        tl.store(g_row + HV + h, tl.sigmoid(bt))


def _recur_kernel(WORK, GATES, SSRC, SSM, SLOTS, KEEP, STATES, Z, NW, Y, QKV, CSRC, CONV,
                  stride_sb, stride_sh, stride_sk, stride_mb, stride_mh, stride_mk,
                  stride_ob, stride_ot, stride_oh, stride_ok, stride_zb, stride_zt, stride_yb, stride_yt,
                  stride_xb, stride_xt, stride_cb, stride_cc, stride_cw, stride_vs, stride_vc, stride_vw, T, eps,
                  stride_lw, stride_lg, stride_ls, stride_lx, stride_lc,
                  HK: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BDK: tl.constexpr,
                  BDV: tl.constexpr, SSM_INIT: tl.constexpr, CONV_INIT: tl.constexpr, HAS_KEEP: tl.constexpr,
                  WRITE_STATE: tl.constexpr, STORE_STATES: tl.constexpr, HAS_OUT: tl.constexpr,
                  FUSED_NORM: tl.constexpr, LAYERED: tl.constexpr, PDL: tl.constexpr):
    """Program (b * Hv + h, v block): the recurrence over the T tokens with the state tile [BK, BV] in registers;
    per token o (or, with the whole head in the tile, the gated RMSNorm output) and optionally the state. Tokens
    from ``keep[b]`` on (HAS_KEEP) get e^g = 1 and beta = 0, which leaves the state exactly unchanged. With
    WRITE_STATE the state after the first keep[b] tokens goes to the cache, and the programs of v block 0 write
    the conv windows ending at keep[b] (head h's v channels; with h % R == 0 also k head h // R's q and k channels):
    each channel by one program, which reads its old window before it writes the new one.

    LAYERED (a rollback of every GDN layer in one launch): grid axis 2 is the layer; WORK, GATES, QKV (the raw conv
    inputs) and the caches SSM (= SSRC) and CONV (= CSRC) are stacks over layers, layer l at l * stride_l."""
    pid = tl.program_id(0)
    pid_v = tl.program_id(1)
    if LAYERED:
        lid = tl.program_id(2).to(tl.int64)
        WORK += lid * stride_lw
        GATES += lid * stride_lg
        SSRC += lid * stride_ls
        SSM += lid * stride_ls
        QKV += lid * stride_lx
        CSRC += lid * stride_lc
        CONV += lid * stride_lc
    b = pid // (HK * R)
    h = pid % (HK * R)
    hk = h // R
    slot = tl.load(SLOTS + b).to(tl.int64)
    offs_k = tl.arange(0, BK)
    k_ok = offs_k < DK
    offs_v = pid_v * BV + tl.arange(0, BV)
    v_ok = offs_v < DV
    s_mask = k_ok[:, None] & v_ok[None, :]
    s_ptrs = SSRC + (b.to(tl.int64) if SSM_INIT else slot) * stride_sb + h * stride_sh \
        + offs_k[:, None] * stride_sk + offs_v[None, :]
    if not SSM_INIT:
        # the cache's state, read before the PDL wait: its last writer (this layer's previous step, or a rollback)
        # is at least two launches back, and a launch starts only once the one before it has passed its own
        # wait, i.e. once everything before that one has finished
        S = tl.load(s_ptrs, mask=s_mask, other=0.0)  # [BK, BV] fp32
    pdl_enter(PDL)  # PDL launches: wait for the kernel before (prep), let the next one launch
    if SSM_INIT:  # a caller's buffer, possibly written by the launch right before
        S = tl.load(s_ptrs, mask=s_mask, other=0.0)
    C = 2 * HK * DK + HK * R * DV  # WORK row: q | k | v channels
    NG = 2 * HK * R + HK  # GATES row: e^g | beta | q.k
    if FUSED_NORM:
        nw = tl.load(NW + offs_v, mask=v_ok, other=0.0)
    st_base = STATES + b.to(tl.int64) * stride_ob + h * stride_oh + offs_k[:, None] * stride_ok + offs_v[None, :]
    keep = tl.load(KEEP + b).to(tl.int32) if HAS_KEEP else T
    for t in tl.static_range(BT):  # unrolled: the loads of later tokens do not wait for the state
        live = t < T  # padding tokens read e^g = 1, beta = 0: no change
        kept = live & (t < keep)  # tokens past keep likewise
        w_row = WORK + (b * T + t) * C
        g_row = GATES + (b * T + t) * NG
        q_t = tl.load(w_row + hk * DK + offs_k, mask=k_ok & live, other=0.0)  # [BK]
        k_t = tl.load(w_row + HK * DK + hk * DK + offs_k, mask=k_ok & live, other=0.0)
        v_t = tl.load(w_row + 2 * HK * DK + h * DV + offs_v, mask=v_ok & live, other=0.0)  # [BV]
        e_t = tl.load(g_row + h, mask=kept, other=1.0)
        b_t = tl.load(g_row + HK * R + h, mask=kept, other=0.0)
        qk_t = tl.load(g_row + 2 * HK * R + hk, mask=live, other=0.0)
        kS = tl.sum(S * k_t[:, None], 0) * e_t  # (e^g S)^T k, [BV]
        qS = tl.sum(S * q_t[:, None], 0) * e_t
        u = b_t * (v_t - kS)
        S = S * e_t + k_t[:, None] * u[None, :]
        o = qS + qk_t * u  # S_new^T q without another pass over the state
        if HAS_OUT:
            y_ptr = Y + b * stride_yb + t * stride_yt + h * DV + offs_v
            if FUSED_NORM:
                z = tl.load(Z + b * stride_zb + t * stride_zt + h * DV + offs_v, mask=v_ok & live,
                            other=0.0).to(tl.float32)
                o = o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps) * nw * (z * tl.sigmoid(z))
            tl.store(y_ptr, o.to(Y.dtype.element_ty), mask=v_ok & live)
        if STORE_STATES:
            tl.store(st_base + t * stride_ot, S, mask=s_mask & live)
    if WRITE_STATE:
        tl.store(SSM + slot * stride_mb + h * stride_mh + offs_k[:, None] * stride_mk + offs_v[None, :], S,
                 mask=s_mask)
        if pid_v == 0:
            x_base = QKV + b.to(tl.int64) * stride_xb
            src_base = CSRC + (b.to(tl.int64) if CONV_INIT else slot) * stride_cb
            dst_base = CONV + slot * stride_vs
            ty = CONV.dtype.element_ty
            dv_ = tl.arange(0, BDV)
            _write_window(x_base, stride_xt, src_base, stride_cc, stride_cw, dst_base, stride_vc, stride_vw,
                          2 * HK * DK + h * DV + dv_, dv_ < DV, keep, ty, W, BW)
            if h % R == 0:
                dk_ = tl.arange(0, BDK)
                _write_window(x_base, stride_xt, src_base, stride_cc, stride_cw, dst_base, stride_vc, stride_vw,
                              hk * DK + dk_, dk_ < DK, keep, ty, W, BW)
                _write_window(x_base, stride_xt, src_base, stride_cc, stride_cw, dst_base, stride_vc, stride_vw,
                              HK * DK + hk * DK + dk_, dk_ < DK, keep, ty, W, BW)


def _conv_window_kernel(X, ST, SLOTS, N, stride_xb, stride_xt, stride_sb, stride_sc, stride_sw, T, C,
                        HAS_N: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (row b, channel block): the slot's conv window after the row's first N[b] (or T) inputs, written over
    the old one (kernels/gdn_prefill.conv_state_update: a prompt chunk's new conv state)."""
    b = tl.program_id(0)
    chan = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    keep = tl.load(N + b).to(tl.int32) if HAS_N else T
    base = ST + tl.load(SLOTS + b).to(tl.int64) * stride_sb
    _write_window(X + b.to(tl.int64) * stride_xb, stride_xt, base, stride_sc, stride_sw, base, stride_sc, stride_sw,
                  chan, chan < C, keep, ST.dtype.element_ty, W, BW)


def _gated_norm_kernel(O, Z, NW, Y, stride_ob, stride_ot, stride_zb, stride_zt, stride_yb, stride_yt, T, HV, eps,
                       DV: tl.constexpr, BD: tl.constexpr, HB: tl.constexpr, PDL: tl.constexpr):
    """Program (b * T + t, head block): y = norm_w * rmsnorm(o) * silu(z) for HB heads of one token."""
    pdl_enter(PDL)  # PDL launches: wait for the kernel before, let the next one launch
    row = tl.program_id(0)
    b = row // T
    t = row % T
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    offs = tl.arange(0, BD)
    mask = (heads < HV)[:, None] & (offs < DV)[None, :]
    col = heads[:, None] * DV + offs[None, :]
    o = tl.load(O + b * stride_ob + t * stride_ot + col, mask=mask, other=0.0)
    z = tl.load(Z + b * stride_zb + t * stride_zt + col, mask=mask, other=0.0).to(tl.float32)
    nw = tl.load(NW + offs, mask=offs < DV, other=0.0)
    inv = tl.rsqrt(tl.sum(o * o, 1) / DV + eps)
    y = o * inv[:, None] * nw[None, :] * (z * tl.sigmoid(z))
    tl.store(Y + b * stride_yb + t * stride_yt + col, y.to(Y.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=1)
def jit_kernels() -> dict:
    """Jit the kernels (first call only). The kernels find their helpers and `tl` as module globals."""
    return _triton.jit_module(globals(), ("_conv_tok", "_window", "_write_window"),
                              {"prep": "_prep_kernel", "recur": "_recur_kernel", "norm": "_gated_norm_kernel",
                               "window": "_conv_window_kernel"})
