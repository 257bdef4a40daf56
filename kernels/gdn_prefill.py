"""A Gated DeltaNet layer's prefill glue in two Triton kernels (the recurrence itself stays fla's chunked kernel):

* :func:`conv_qkv` - the depthwise causal conv over a chunk's ``qkv`` projection (the slot's conv state supplying the
  W-1 inputs before the chunk), SiLU, and the per-head L2 norm of q and k, in fp32 with one rounding at the store:
  ``q [B, T, Hk, dk]``, ``k [B, T, Hk, dk]``, ``v [B, T, Hv, dv]`` contiguous in qkv's dtype. Eagerly this is a
  concatenation with the state, an fp32 cast, ``F.conv1d``, SiLU, a cast back, splits, two fp32 L2 norms and casts.
* :func:`gated_rms_norm` - ``w * rmsnorm(o) * silu(z)`` per GDN head, reading the strided ``z`` view in place.

References (fp32 torch, the eager path's math): :func:`conv_qkv_ref`, :func:`gated_rms_norm_ref`. Triton is imported
on first use; under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (how the tests check them).
"""

from __future__ import annotations

import functools

import torch

from . import _triton
from ._triton import pow2 as _pow2
from .conv import causal_conv1d_ref
from .gdn import l2norm
from .norm import gated_rms_norm_ref as norm_ref

__all__ = ["conv_qkv", "conv_qkv_ref", "gated_rms_norm", "gated_rms_norm_ref", "triton_available"]

triton_available = _triton.available
L2_EPS = 1e-6  # kernels/gdn.l2norm's default
BLOCK_T = 16  # tokens a conv program takes

tl = None  # triton.language, bound by _kernels()


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
    v [B * T, HV * DV] from 2 N_OUT (N_OUT = B * T * HK * DK)."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    n_tb = tl.cdiv(T, BLOCK_T)
    b = pid // n_tb
    offs_t = (pid % n_tb) * BLOCK_T + tl.arange(0, BLOCK_T)
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
        sv = tl.load(ST + slot * stride_sb + ch[None, :] * stride_sc + (W - 1 + src)[:, None],
                     mask=(t_ok & (src < 0))[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc += (xv + sv) * wj[None, :]
    y = acc / (1.0 + tl.exp(-acc))  # silu
    y = tl.where(is_v, y, y * tl.rsqrt(tl.sum(y * y, 1) + eps)[:, None])
    width = tl.where(is_v, (tl.num_programs(1) - 2 * HK) * DV, HK * DK)  # a token's channels in its part
    row = part.to(tl.int64) * N_OUT + (b * T + offs_t).to(tl.int64) * width + h * D
    tl.store(OUT + row[:, None] + offs_d[None, :], y.to(OUT.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])


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
    return _triton.jit_module(globals(), (), {"conv": "_conv_kernel", "gnorm": "_gnorm_kernel"})


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
        t, hk, dk, dv, n_qk, L2_EPS, W=w, BLOCK_T=BLOCK_T, BLOCK_D=_pow2(max(dk, dv)), num_warps=4)
    return (out[:n_qk].view(b, t, hk, dk), out[n_qk:2 * n_qk].view(b, t, hk, dk),
            out[2 * n_qk:].view(b, t, hv, dv))


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
