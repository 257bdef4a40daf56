"""A Gated DeltaNet layer's prefill glue in Triton (the recurrence itself stays fla's chunked kernel):

* :func:`conv_qkv` - the depthwise causal conv over a chunk's ``qkv`` projection (the slot's conv state supplying the
  W-1 inputs before the chunk), SiLU, and the per-head L2 norm of q and k, in fp32 with one rounding at the store:
  ``q [B, T, Hk, dk]``, ``k [B, T, Hk, dk]``, ``v [B, T, Hv, dv]`` contiguous in qkv's dtype. Eagerly this is a
  concatenation with the state, an fp32 cast, ``F.conv1d``, SiLU, a cast back, splits, two fp32 L2 norms and casts.
* :func:`conv_state_update` - the slot's new conv state (the last W-1 inputs, after a padded chunk's real tokens)
  written in place: eagerly a gather of the old state, a concatenation and a scatter.
* :func:`gates` - ``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)`` (zero past a padded chunk's
  real tokens) in one launch: eagerly eight (two casts, sigmoid, add, softplus, exp, negation, product).
* :func:`gated_rms_norm` - ``w * rmsnorm(o) * silu(z)`` per GDN head, reading the strided ``z`` view in place.

References (fp32 torch, the eager path's math): :func:`conv_qkv_ref`, :func:`conv_state_update_ref`,
:func:`gates_ref`, :func:`gated_rms_norm_ref`. Triton is imported on first use; under ``TRITON_INTERPRET=1`` the
kernels run on CPU tensors (how the tests check them).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import _triton, gdn_triton_kernels
from ._triton import pow2 as _pow2
from .conv import causal_conv1d_ref, causal_conv1d_state_at
from .gdn import l2norm
from .norm import gated_rms_norm_ref as norm_ref

__all__ = ["conv_qkv", "conv_qkv_ref", "conv_state_update", "conv_state_update_ref", "gates", "gates_ref",
           "gated_rms_norm", "gated_rms_norm_ref", "triton_available"]

triton_available = _triton.available
L2_EPS = 1e-6  # kernels/gdn.l2norm's default
BLOCK_T = 16  # tokens a conv program takes
CONV_WARPS = 4  # warps a conv program takes (8: 3.2x slower on an H100)

tl = None  # triton.language, bound by _kernels()
libdevice = None  # triton.language.extra.libdevice, bound by _kernels()


def conv_qkv_ref(qkv, conv_w, state, hk: int, dk: int, hv: int, dv: int):
    """fp32 reference: ``qkv [B, T, C]`` (C = 2 hk dk + hv dv), ``conv_w [C, W]``, ``state [B, C, W-1]`` (the inputs
    before the chunk) -> (q, k, v) as :func:`conv_qkv` returns them: conv.causal_conv1d_ref and gdn.l2norm in fp32,
    rounded once at the end."""
    b, t, _ = qkv.shape
    y, _ = causal_conv1d_ref(qkv.float(), conv_w, state.float())
    q, k, v = torch.split(y, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k = (l2norm(x.reshape(b, t, hk, dk), L2_EPS) for x in (q, k))
    return q.to(qkv.dtype), k.to(qkv.dtype), v.reshape(b, t, hv, dv).to(qkv.dtype)


def gated_rms_norm_ref(o, z, weight, eps: float):
    """fp32 reference: ``o [B, T, Hv, dv]``, ``z [B, T, Hv * dv]`` (any row stride), ``weight [dv]`` -> o's dtype,
    ``[B, T, Hv, dv]`` (norm.gated_rms_norm_ref per head)."""
    return norm_ref(o, z.reshape(o.shape), weight, eps)


def _conv_kernel(X, CW, ST, SLOTS, OUT, stride_xb, stride_xt, stride_sb, stride_sc, T, HK, DK, DV, N_OUT, eps,
                 W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b * token blocks + token block, head): one head of q (head < HK), k (< 2 HK) or v of BLOCK_T tokens,
    conv + SiLU, q and k L2-normed over their DK channels, stored in OUT: q [B * T, HK * DK] from 0, k from N_OUT,
    v [B * T, HV * DV] from 2 N_OUT (N_OUT = B * T * HK * DK). Only a block that starts within the first W - 1
    tokens reads the conv state (the others would issue W masked-off scalar loads a tap and element)."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    n_tb = tl.cdiv(T, BLOCK_T)
    b = pid // n_tb
    t0 = (pid % n_tb) * BLOCK_T
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    is_v = head >= 2 * HK
    D = tl.where(is_v, DV, DK)
    part = tl.minimum(head // HK, 2)  # 0 q, 1 k, 2 v
    h = head - part * HK  # the head within its part
    d_ok = offs_d < D
    ch = part * HK * DK + h * D + offs_d  # channels of qkv
    t_ok = offs_t < T
    slot = tl.load(SLOTS + b).to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for j in tl.static_range(W):
        src = offs_t - (W - 1) + j  # the input feeding tap j; negative: from the conv state
        wj = tl.load(CW + ch * W + j, mask=d_ok, other=0.0).to(tl.float32)
        xv = tl.load(X + b.to(tl.int64) * stride_xb + src[:, None] * stride_xt + ch[None, :],
                     mask=(t_ok & (src >= 0))[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if t0 < W - 1:  # this block's first tokens reach before the chunk: their inputs from the conv state
            for r in tl.static_range(W - 1):
                if r < BLOCK_T:
                    pos = t0 + r + j  # token t0 + r's input for tap j, at position pos of the state when < W - 1
                    sv = tl.load(ST + slot * stride_sb + ch * stride_sc + pos,
                                 mask=d_ok & (pos < W - 1) & (t0 + r < T), other=0.0).to(tl.float32)
                    xv += tl.where((offs_t == t0 + r)[:, None], sv[None, :], 0.0)
        acc += xv * wj[None, :]
    y = acc / (1.0 + tl.exp(-acc))  # silu
    y = tl.where(is_v, y, y * tl.rsqrt(tl.sum(y * y, 1) + eps)[:, None])
    width = tl.where(is_v, (tl.num_programs(1) - 2 * HK) * DV, HK * DK)  # a token's channels in its part
    row = part.to(tl.int64) * N_OUT + (b * T + offs_t).to(tl.int64) * width + h * D
    tl.store(OUT + row[:, None] + offs_d[None, :], y.to(OUT.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])


def _gates_kernel(B_, A_, ALOG, DTB, N, G, BETA, stride_bb, stride_bt, stride_ab, stride_at, T, HV,
                  HAS_N: tl.constexpr, PRECISE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (row b, token block): beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias) (torch's
    threshold 20) for BLOCK_T tokens x every head, fp32, into contiguous G / BETA [B, T, HV]; with N, tokens at or
    past N[b] get 0 for both (padding: no write to the state, no decay). PRECISE (on a GPU): the functions torch's
    CUDA kernels use (libdevice's expf and log1pf, a correctly rounded division), so the eager ops' bits."""
    b = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < HV
    ok = (offs_t < T)[:, None] & h_ok[None, :]
    bt = b.to(tl.int64)
    bv = tl.load(B_ + bt * stride_bb + offs_t[:, None] * stride_bt + offs_h[None, :], mask=ok, other=0.0)
    av = tl.load(A_ + bt * stride_ab + offs_t[:, None] * stride_at + offs_h[None, :], mask=ok, other=0.0)
    x = av.to(tl.float32) + tl.load(DTB + offs_h, mask=h_ok, other=0.0)[None, :]
    alog = tl.load(ALOG + offs_h, mask=h_ok, other=0.0)
    bf = bv.to(tl.float32)
    if PRECISE:
        softplus = tl.where(x > 20.0, x, libdevice.log1p(libdevice.exp(x)))
        g = -libdevice.exp(alog)[None, :] * softplus
        beta = tl.math.div_rn(tl.zeros_like(bf) + 1.0, 1.0 + libdevice.exp(-bf))
    else:  # the interpreter (numpy's functions)
        e = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + e
        log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))  # log1p(e), tiny e too
        g = -tl.exp(alog)[None, :] * tl.where(x > 20.0, x, log1p)
        beta = tl.sigmoid(bf)
    if HAS_N:
        live = (offs_t < tl.load(N + b))[:, None]
        g = tl.where(live, g, 0.0)
        beta = tl.where(live, beta, 0.0)
    out = bt * T * HV + offs_t[:, None] * HV + offs_h[None, :]
    tl.store(G + out, g, mask=ok)
    tl.store(BETA + out, beta, mask=ok)


def _gnorm_kernel(O, Z, Wt, Y, stride_ob, stride_zb, N_HEADS, eps, D: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Program (token row, head block): BLOCK_H heads of one token, each normed over its D values."""
    r = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < N_HEADS)[:, None] & (offs_d < D)[None, :]
    col = offs_h[:, None] * D + offs_d[None, :]
    x = tl.load(O + r * stride_ob + col, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + r * stride_zb + col, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(Wt + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None] * w[None, :]
    y = y * (z / (1.0 + tl.exp(-z)))
    tl.store(Y + r * (N_HEADS * D) + col, y.to(Y.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=1)
def _kernels() -> dict:
    from triton.language.extra import libdevice

    globals()["libdevice"] = libdevice  # the gates' precise functions (compiled kernels only)
    return _triton.jit_module(globals(), (), {"conv": "_conv_kernel", "gnorm": "_gnorm_kernel",
                                               "gates": "_gates_kernel"})


def conv_qkv(qkv, conv_w, state, slots, hk: int, dk: int, hv: int, dv: int):
    """(q ``[B, T, hk, dk]``, k ``[B, T, hk, dk]``, v ``[B, T, hv, dv]``), contiguous in qkv's dtype, from ``qkv
    [B, T, C]`` (last dimension contiguous, any row stride), ``conv_w [C, W]`` (fp32) and the conv state ``state
    [S, C, W-1]`` read at ``slots [B]``: silu(causal conv), q and k L2-normed per head, fp32 math. The state is only
    read (the caller writes the new one)."""
    b, t, c = qkv.shape
    w = conv_w.shape[1]
    if c != 2 * hk * dk + hv * dv:
        raise ValueError(f"conv_qkv: qkv has {c} channels; want 2 * {hk} * {dk} + {hv} * {dv}")
    if qkv.stride(2) != 1 or tuple(conv_w.shape) != (c, w) or state.shape[1:] != (c, w - 1) \
            or state.stride(2) != 1 or slots.shape != (b,):
        raise ValueError(f"conv_qkv: qkv [B, T, C] contiguous along C, conv_w [C, W], state [S, C, W-1], slots [B]; "
                         f"got {tuple(qkv.shape)} (strides {qkv.stride()}), {tuple(conv_w.shape)}, "
                         f"{tuple(state.shape)}, {tuple(slots.shape)}")
    kern = _triton.ready("conv_qkv", _kernels, qkv)
    n_qk, n_v = b * t * hk * dk, b * t * hv * dv
    out = torch.empty(2 * n_qk + n_v, dtype=qkv.dtype, device=qkv.device)  # q, k, v: each a contiguous run
    # one launch: programs of q's, k's and v's heads side by side (the rows' math as three launches would do it)
    kern["conv"][(b * -(-t // BLOCK_T), 2 * hk + hv)](
        qkv, conv_w.contiguous(), state, slots, out, qkv.stride(0), qkv.stride(1), state.stride(0), state.stride(1),
        t, hk, dk, dv, n_qk, L2_EPS, W=w, BLOCK_T=BLOCK_T, BLOCK_D=_pow2(max(dk, dv)), num_warps=CONV_WARPS)
    return (out[:n_qk].view(b, t, hk, dk), out[n_qk:2 * n_qk].view(b, t, hk, dk),
            out[2 * n_qk:].view(b, t, hv, dv))


def conv_state_update(qkv, state, slots, n=None) -> None:
    """Write each row's conv state after its chunk ``qkv [B, T, C]`` (last dimension contiguous) over ``state [S, C,
    W-1]`` at ``slots [B]``, in place: the last W-1 inputs of cat(old state, the row's first ``n[b]`` tokens) (``n
    [B]``, default T: a chunk padded past its real tokens keeps the state after them). Exact copies of the inputs
    (:func:`conv_state_update_ref`). Call it after every read of the old state (conv_qkv)."""
    b, t, c = qkv.shape
    keep = state.shape[-1]
    if qkv.stride(2) != 1 or state.shape[1] != c or state.stride(2) != 1 or slots.shape != (b,) \
            or (n is not None and n.shape != (b,)):
        raise ValueError(f"conv_state_update: qkv [B, T, C] contiguous along C, state [S, C, W-1], slots [B], n [B]; "
                         f"got {tuple(qkv.shape)} (strides {qkv.stride()}), {tuple(state.shape)}, {tuple(slots.shape)}"
                         f"{'' if n is None else ', ' + str(tuple(n.shape))}")
    if keep == 0 or b == 0:
        return
    # the decode recurrence's window write (gdn_triton_kernels._write_window: read whole, then written), a launch of
    # its own
    kern = _triton.ready("conv_state_update", gdn_triton_kernels.jit_kernels, qkv)
    block_c = 256
    kern["window"][(b, -(-c // block_c))](qkv, state, slots, n if n is not None else slots, qkv.stride(0),
                                          qkv.stride(1), state.stride(0), state.stride(1), state.stride(2), t, c,
                                          HAS_N=n is not None, W=keep + 1, BW=_pow2(keep), BLOCK_C=block_c,
                                          num_warps=4)


def conv_state_update_ref(qkv, state, slots, n=None) -> None:
    """torch reference of :func:`conv_state_update` (kernels/conv.causal_conv1d_state_at, written at the slots)."""
    b, t, _ = qkv.shape
    n = torch.full((b,), t, dtype=torch.long, device=qkv.device) if n is None else n
    state[slots] = causal_conv1d_state_at(qkv, state[slots], n).to(state.dtype)


def gates(b, a, A_log, dt_bias, n=None):
    """A GDN chunk's gates in one launch: ``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)``, fp32
    ``[B, T, Hv]`` contiguous, from ``b`` / ``a [B, T, Hv]`` (last dimension contiguous, any token stride: split views
    of the b | a projection) and ``A_log`` / ``dt_bias [Hv]`` fp32; with ``n [B]``, tokens at or past ``n[b]`` get 0
    (the engine's padding rule). Returns (g, beta); :func:`gates_ref` is the eager ops'."""
    bsz, t, hv = b.shape
    if tuple(a.shape) != (bsz, t, hv) or b.stride(2) != 1 or a.stride(2) != 1 or tuple(A_log.shape) != (hv,) \
            or tuple(dt_bias.shape) != (hv,) or (n is not None and n.shape != (bsz,)):
        raise ValueError(f"gates: b / a [B, T, Hv] contiguous along Hv, A_log / dt_bias [Hv], n [B]; got "
                         f"{tuple(b.shape)}, {tuple(a.shape)}, {tuple(A_log.shape)}, {tuple(dt_bias.shape)}")
    kern = _triton.ready("gates", _kernels, b)
    g = torch.empty(bsz, t, hv, dtype=torch.float32, device=b.device)
    beta = torch.empty_like(g)
    if g.numel() == 0:
        return g, beta
    block_h = _pow2(hv)
    block_t = max(1, min(64, 4096 // block_h))
    kern["gates"][(bsz, -(-t // block_t))](b, a, A_log.float().contiguous(), dt_bias.float().contiguous(),
                                           n if n is not None else b, g, beta, b.stride(0), b.stride(1), a.stride(0),
                                           a.stride(1), t, hv, HAS_N=n is not None, PRECISE=not kern["interpreted"],
                                           BLOCK_T=block_t,
                                           BLOCK_H=block_h, num_warps=4)
    return g, beta


def gates_ref(b, a, A_log, dt_bias, n=None):
    """The gates as eager torch ops (the eager GDN layer's, engine/model/hybrid.py): :func:`gates`' reference."""
    beta = torch.sigmoid(b.float())
    g = -torch.exp(A_log) * F.softplus(a.float() + dt_bias)
    if n is not None:
        real = (torch.arange(b.shape[1], device=b.device)[None] < n[:, None])[..., None]
        beta, g = beta * real, g * real
    return g, beta


def gated_rms_norm(o, z, weight, eps: float):
    """``weight * rmsnorm(o) * silu(z)`` per head: ``o [B, T, Hv, dv]`` (contiguous), ``z [B, T, Hv * dv]`` (last
    dimension contiguous, any token stride: a split view of the qkvz projection), ``weight [dv]`` ->
    ``[B, T, Hv * dv]`` in o's dtype, fp32 math."""
    b, t, h, d = o.shape
    if tuple(z.shape) != (b, t, h * d) or z.stride(2) != 1 or not o.is_contiguous() or tuple(weight.shape) != (d,):
        raise ValueError(f"gated_rms_norm: o [B, T, Hv, dv] contiguous, z [B, T, Hv * dv], weight [dv]; got "
                         f"{tuple(o.shape)}, {tuple(z.shape)} (strides {z.stride()}), {tuple(weight.shape)}")
    if b > 1 and z.stride(0) != t * z.stride(1):
        z = z.contiguous()  # rows of z are addressed as one [B * T] run below
    kern = _triton.ready("gated_rms_norm", _kernels, o)
    y = torch.empty(b, t, h * d, dtype=o.dtype, device=o.device)
    block_h = max(1, min(_pow2(h), 8192 // _pow2(d)))
    kern["gnorm"][(b * t, -(-h // block_h))](o, z, weight, y, h * d, z.stride(1), h, eps, D=d, BLOCK_H=block_h,
                                             BLOCK_D=_pow2(d), num_warps=4)
    return y
