"""Fused glue of the decode step in Triton: the small elementwise / per-row ops between the projections.

Each op replaces a handful of eager torch launches on the CUDA decode path, works for any leading shape, does its
math in fp32 and has a plain fp32 torch reference beside it (``*_ref``, same signature, same outputs):

  add_rms_norm   residual add + zero-centred RMSNorm: ``r = x + residual``; ``r * rsqrt(mean(r^2) + eps) * (1 + w)``
  rms_norm       zero-centred RMSNorm alone (first layer, final norm)
  embed_rms_norm a forward's start: the ids' rows of a dense embedding table gathered (stored as the residual) and
                 the first layer's RMSNorm of them, in one launch: rms_norm's bits, without the lookup's kernel
  silu_mul       ``silu(gu[..., :I]) * gu[..., I:]`` of the fused gate+up projection
  sigmoid_mul    ``o * sigmoid(gate)`` (the output gating of full attention)
  norm_rope      zero-centred RMSNorm then NeoX RoPE at given positions, per head (a drafter's q / k)
  attn_prologue  full attention between the projections and the attention kernel: q / k RMSNorm, partial NeoX
                 RoPE, the gate split, and the K/V cache write (bf16 / fp16 as is, int8 quantized in registers)

The row kernels keep one whole row in registers (hidden sizes up to ``MAX_ROW``), one program per row. No host
synchronisation, grids from static sizes only: CUDA-graph safe. Triton is imported on first use, so this module
imports on machines without it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import _triton
from ._triton import pow2 as _pow2
from .kv_quant import KV_GROUP, quantize_kv
from .norm import rms_norm_ref as _rms_norm_ref
from .rope import apply_rope_ref

__all__ = [
    "MAX_ROW",
    "add_rms_norm",
    "add_rms_norm_ref",
    "attn_prologue",
    "attn_prologue_ref",
    "embed_rms_norm",
    "embed_rms_norm_ref",
    "norm_rope",
    "norm_rope_ref",
    "rms_norm",
    "rms_norm_ref",
    "sigmoid_mul",
    "sigmoid_mul_ref",
    "silu_mul",
    "silu_mul_ref",
    "triton_available",
]

MAX_ROW = 16384  # longest row the norm kernels hold in registers
ELEM_BLOCK = 1024  # columns per program of the elementwise kernels


_triton_import_error = _triton.import_error
triton_available = _triton.available


def _new_buffer(shape, dtype, device) -> torch.Tensor:
    """Output allocation (tests swap in a NaN fill to catch unwritten elements)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _ready(op: str, x: torch.Tensor) -> dict:
    return _triton.ready(op, _kernels, x)


def _rows(op: str, name: str, x: torch.Tensor, n: int) -> torch.Tensor:
    """``x [..., n]`` as a [rows, n] view (a copy only when the leading dims do not flatten)."""
    if x.shape[-1] != n:
        raise ValueError(f"{op}: {name} must end in {n}, got shape {tuple(x.shape)}")
    x2 = x.reshape(-1, n)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _row_warps(block: int) -> int:
    return min(16, max(1, block // 512))


# ---- references ------------------------------------------------------------------------------------------------

def add_rms_norm_ref(x, residual, weight, eps):
    """fp32 reference: ``residual_out = x + residual`` (rounded to x.dtype), ``normed = rms_norm(residual_out)``."""
    r = (x.float() + residual.float()).to(x.dtype)
    return _rms_norm_ref(r, weight, eps), r


def rms_norm_ref(x, weight, eps):
    """fp32 reference of the zero-centred RMSNorm (kernels/norm.py)."""
    return _rms_norm_ref(x, weight, eps)


def embed_rms_norm_ref(table, ids, weight, eps):
    """fp32 reference: ``(rms_norm(h), h)`` with ``h = F.embedding(ids, table)``."""
    h = F.embedding(ids, table)
    return _rms_norm_ref(h, weight, eps), h


def silu_mul_ref(gu, inter, run=None):
    """fp32 reference: ``silu(gate) * up`` in gu.dtype; gate ``gu[..., :inter]`` and up ``gu[..., inter:]``, or
    (``run``) runs of ``run`` gate columns, then as many up columns, alternating (engine/model/weights.py's
    interleaved gate_up)."""
    if run is None:
        g, u = gu.float().split([inter, gu.shape[-1] - inter], dim=-1)
    else:
        runs = gu.float().unflatten(-1, (-1, 2, run))
        g, u = runs[..., 0, :].flatten(-2), runs[..., 1, :].flatten(-2)
    return (F.silu(g) * u).to(gu.dtype)


def sigmoid_mul_ref(o, gate):
    """fp32 reference: ``o * sigmoid(gate)`` in o.dtype."""
    return (o.float() * torch.sigmoid(gate.float())).to(o.dtype)


def norm_rope_ref(x, weight, cos, sin, pos, eps):
    """fp32 reference of :func:`norm_rope`: the norm and the rotation in fp32, one rounding to x.dtype."""
    _check_norm_rope(x, weight, cos, sin, pos)
    return apply_rope_ref(_rms_norm_ref(x.float(), weight, eps), cos[pos], sin[pos]).to(x.dtype)


def attn_prologue_ref(qg, kv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, k_scale, v_scale, slots, pos, eps):
    """fp32 reference of :func:`attn_prologue` (same arguments, same cache writes)."""
    b, t, h, hd, hkv = _check_prologue(qg, kv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, k_scale, v_scale,
                                       slots, pos)
    q = _rms_norm_ref(qg[..., :hd].float(), q_norm_w, eps)  # [B, T, H, hd] fp32
    k = _rms_norm_ref(kv[..., :hkv * hd].float().view(b, t, hkv, hd), k_norm_w, eps)
    v = kv[..., hkv * hd:].float().view(b, t, hkv, hd)
    c, s = cos[pos], sin[pos]  # [B, T, rd]
    q, k = apply_rope_ref(q, c, s), apply_rope_ref(k, c, s)
    sl = slots[:, None].expand(b, t)
    if k_cache.dtype == torch.int8:
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)  # fp32 k, v
        k_cache[sl, :, pos], v_cache[sl, :, pos] = kq, vq
        k_scale[sl, :, pos], v_scale[sl, :, pos] = ks, vs
    else:
        k_cache[sl, :, pos] = k.to(k_cache.dtype)
        v_cache[sl, :, pos] = v.to(v_cache.dtype)
    return q.to(qg.dtype), qg[..., hd:].reshape(b, t, h * hd).clone()


# ---- fast versions ---------------------------------------------------------------------------------------------

def _check_row_weight(op, weight, n):
    if weight.shape != (n,):
        raise ValueError(f"{op}: weight must be [{n}], got {tuple(weight.shape)}")
    if n > MAX_ROW:
        raise ValueError(f"{op}: rows of {n} values are over the supported {MAX_ROW}")


def add_rms_norm(x, residual, weight, eps):
    """``(normed, residual_out)``: ``residual_out = x + residual`` and its zero-centred RMSNorm, both in x.dtype.

    x, residual ``[..., N]`` (N <= MAX_ROW); weight ``[N]``. The norm reads ``residual_out`` as stored (rounded
    to x.dtype), like the eager ``h = h + f(x); rms_norm(h)``. fp32 math.
    """
    n = x.shape[-1]
    _check_row_weight("add_rms_norm", weight, n)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    kern = _ready("add_rms_norm", x)
    x2, r2 = _rows("add_rms_norm", "x", x, n), _rows("add_rms_norm", "residual", residual, n)
    y = _new_buffer(x.shape, x.dtype, x.device)
    ro = _new_buffer(x.shape, x.dtype, x.device)
    block = _pow2(n)
    kern["norm"][(x2.shape[0],)](x2, r2, weight, y, ro, x2, x2.stride(0), r2.stride(0), n, n, n, 0, eps,
                                 BLOCK=block, HAS_RES=True, GATHER=False, num_warps=_row_warps(block),
                                 **_triton.pdl_args(x.device))
    return y, ro


def rms_norm(x, weight, eps):
    """Zero-centred RMSNorm ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim, fp32 math, x.dtype."""
    n = x.shape[-1]
    _check_row_weight("rms_norm", weight, n)
    kern = _ready("rms_norm", x)
    x2 = _rows("rms_norm", "x", x, n)
    y = _new_buffer(x.shape, x.dtype, x.device)
    block = _pow2(n)
    kern["norm"][(x2.shape[0],)](x2, x2, weight, y, y, x2, x2.stride(0), x2.stride(0), n, n, n, 0, eps,
                                 BLOCK=block, HAS_RES=False, GATHER=False, num_warps=_row_warps(block),
                                 **_triton.pdl_args(x.device))
    return y


def embed_rms_norm(table, ids, weight, eps):
    """``(rms_norm(h, weight, eps), h)`` with ``h = F.embedding(ids, table)``, in one launch: a program gathers its
    id's row of the dense ``table [V, N]`` (stored as ``h``, the residual) and normalizes it as :func:`rms_norm`
    does (the same arithmetic, so the same bits). ``ids`` (any shape, integer, on the table's device) must index
    the table: the engine checks ids before they reach a forward; an id outside it reads zeros here, where
    F.embedding would stop with a device-side assert."""
    if table.dim() != 2:
        raise ValueError(f"embed_rms_norm: table must be [V, N], got shape {tuple(table.shape)}")
    if ids.dtype not in (torch.int32, torch.int64) or ids.device != table.device:
        raise ValueError(f"embed_rms_norm: ids must be int32 / int64 on {table.device}, got {ids.dtype} on "
                         f"{ids.device}")
    v, n = table.shape
    _check_row_weight("embed_rms_norm", weight, n)
    kern = _ready("embed_rms_norm", table)
    t2 = table if table.stride(-1) == 1 else table.contiguous()
    flat = ids.reshape(-1).contiguous()
    h = _new_buffer((*ids.shape, n), table.dtype, table.device)
    y = _new_buffer((*ids.shape, n), table.dtype, table.device)
    if flat.numel():
        block = _pow2(n)
        kern["norm"][(flat.numel(),)](t2, t2, weight, y, h, flat, t2.stride(0), t2.stride(0), n, n, n, v, eps,
                                      BLOCK=block, HAS_RES=False, GATHER=True, num_warps=_row_warps(block),
                                      **_triton.pdl_args(table.device))
    return y, h


def silu_mul(gu, inter, run=None):
    """``silu(gu[..., :inter]) * gu[..., inter:]`` for the fused gate+up output ``gu [..., 2 * inter]``; with ``run``,
    of an interleaved one (``run`` gate columns, then as many up columns, alternating), so that a prompt chunk's
    MLP takes its product in one pass instead of copying gate and up out first. fp32 math, one rounding."""
    if gu.shape[-1] != 2 * inter:
        raise ValueError(f"silu_mul: gu must end in 2 * inter = {2 * inter}, got shape {tuple(gu.shape)}")
    if run is not None and (run < 1 or inter % run):
        raise ValueError(f"silu_mul: run must divide inter = {inter}, got {run}")
    kern = _ready("silu_mul", gu)
    g2 = _rows("silu_mul", "gu", gu, 2 * inter)
    y = _new_buffer((*gu.shape[:-1], inter), gu.dtype, gu.device)
    kern["silu_mul"][(g2.shape[0], -(-inter // ELEM_BLOCK))](g2, y, g2.stride(0), inter, inter, BLOCK=ELEM_BLOCK,
                                                             RUN=inter if run is None else run, num_warps=4,
                                                             **_triton.pdl_args(gu.device))
    return y


def sigmoid_mul(o, gate):
    """``o * sigmoid(gate)`` (same shape), fp32 math, in o.dtype."""
    if o.shape != gate.shape:
        raise ValueError(f"sigmoid_mul: o {tuple(o.shape)} and gate {tuple(gate.shape)} must have the same shape")
    kern = _ready("sigmoid_mul", o)
    n = o.shape[-1]
    o2, g2 = _rows("sigmoid_mul", "o", o, n), _rows("sigmoid_mul", "gate", gate, n)
    y = _new_buffer(o.shape, o.dtype, o.device)
    kern["sigmoid_mul"][(o2.shape[0], -(-n // ELEM_BLOCK))](o2, g2, y, o2.stride(0), g2.stride(0), n, n,
                                                            BLOCK=ELEM_BLOCK, num_warps=4,
                                                            **_triton.pdl_args(o.device))
    return y


def _check_tables(op, cos, sin, hd):
    """The rotary tables: cos and sin ``[max_pos, rd]``, one layout, an even rd <= hd."""
    rd = cos.shape[-1]
    if cos.dim() != 2 or sin.shape != cos.shape or sin.stride() != cos.stride() or rd % 2 or rd > hd:
        raise ValueError(f"{op}: cos and sin must both be [max_pos, rd] with an even rd <= {hd}, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")


def _check_norm_rope(x, weight, cos, sin, pos):
    if x.dim() != 4 or pos.shape != x.shape[:2]:
        raise ValueError(f"norm_rope: x must be [B, T, H, hd] and pos [B, T], got {tuple(x.shape)} and "
                         f"{tuple(pos.shape)}")
    hd = x.shape[-1]
    if weight.shape != (hd,):
        raise ValueError(f"norm_rope: weight must be [{hd}], got {tuple(weight.shape)}")
    _check_tables("norm_rope", cos, sin, hd)
    if x.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("norm_rope: x, cos and sin must be contiguous along their last dimension")


def norm_rope(x, weight, cos, sin, pos, eps):
    """Per head of ``x [B, T, H, hd]``: zero-centred RMSNorm with ``weight [hd]``, then NeoX rotate-half on the first
    rd dims at position ``pos[b, t]`` of the fp32 tables ``cos / sin [max_pos, rd]`` (kernels/rope.rope_tables). One
    launch, fp32 math, one rounding to x.dtype (the q / k of a drafter's block, instead of a norm and a rotation of
    a dozen eager launches). Returns a new contiguous ``[B, T, H, hd]``."""
    _check_norm_rope(x, weight, cos, sin, pos)
    kern = _ready("norm_rope", x)
    b, t, h, hd = x.shape
    y = _new_buffer((b, t, h, hd), x.dtype, x.device)
    block_d = max(16, _pow2(hd))
    kern["norm_rope"][(b * t, h)](x, weight, cos, sin, pos, y, *x.stride()[:3], cos.stride(0), *pos.stride(),
                                  *y.stride()[:3], t, eps, HD=hd, RD=cos.shape[-1], BLOCK_D=block_d,
                                  num_warps=1 if block_d <= 128 else 2, **_triton.pdl_args(x.device))
    return y


def _check_prologue(qg, kv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, k_scale, v_scale, slots, pos):
    """Validate shapes; returns (B, T, H, hd, Hkv)."""
    if qg.dim() != 4 or qg.shape[-1] % 2:
        raise ValueError(f"attn_prologue: qg must be [B, T, H, 2 * hd], got shape {tuple(qg.shape)}")
    b, t, h, hd2 = qg.shape
    hd = hd2 // 2
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != hd:
        raise ValueError(f"attn_prologue: k_cache and v_cache must both be [S, Hkv, cap, hd={hd}], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    hkv = k_cache.shape[1]
    if kv.shape != (b, t, 2 * hkv * hd):
        raise ValueError(f"attn_prologue: kv must be [B, T, 2 * Hkv * hd] = {[b, t, 2 * hkv * hd]}, "
                         f"got {list(kv.shape)}")
    for name, w in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)):
        if w.shape != (hd,):
            raise ValueError(f"attn_prologue: {name} must be [{hd}], got {tuple(w.shape)}")
    _check_tables("attn_prologue", cos, sin, hd)
    if k_cache.dtype == torch.int8:
        sshape = (*k_cache.shape[:3], -(-hd // KV_GROUP))
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None or tuple(s.shape) != sshape or s.dtype != torch.float16:
                got = "None" if s is None else f"{tuple(s.shape)} {s.dtype}"
                raise ValueError(f"attn_prologue: int8 cache needs {name} {sshape} fp16, got {got}")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"attn_prologue: scales are only for an int8 cache, the cache is {k_cache.dtype}")
    if slots.shape != (b,) or pos.shape != (b, t):
        raise ValueError(f"attn_prologue: slots must be [B={b}] and pos [B={b}, T={t}], "
                         f"got {tuple(slots.shape)} and {tuple(pos.shape)}")
    for name, x in (("qg", qg), ("kv", kv), ("k_cache", k_cache), ("v_cache", v_cache), ("k_scale", k_scale),
                    ("v_scale", v_scale), ("cos", cos), ("sin", sin)):
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"attn_prologue: {name} must be contiguous along its last dimension")
    return b, t, h, hd, hkv


def attn_prologue(qg, kv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, k_scale, v_scale, slots, pos, eps):
    """Full attention from the projection outputs to the attention kernel's inputs, in one launch.

    qg ``[B, T, H, 2 * hd]``: the q_proj output (query | gate per head); kv ``[B, T, 2 * Hkv * hd]``: the fused
    k | v projection output; q_norm_w / k_norm_w ``[hd]`` (zero-centred RMSNorm weights); cos / sin ``[max_pos, rd]``
    fp32 (kernels/rope.rope_tables); k_cache / v_cache ``[S, Hkv, cap, hd]`` bf16 / fp16, or int8 with k_scale /
    v_scale ``[S, Hkv, cap, ceil(hd / 64)]`` fp16 (None otherwise); slots ``[B]``; pos ``[B, T]``.

    q = rope(rmsnorm(q)), k = rope(rmsnorm(k)) (NeoX rotate-half on the first rd dims), written with v into the
    cache at ``(slots[b], :, pos[b, t])`` (int8: kv_quant.quantize_kv's codes and scales). Returns
    ``(q [B, T, H, hd], gate [B, T, H * hd])`` in qg's dtype. fp32 math.
    """
    b, t, h, hd, hkv = _check_prologue(qg, kv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, k_scale, v_scale,
                                       slots, pos)
    kern = _ready("attn_prologue", qg)
    int8 = k_cache.dtype == torch.int8
    q = _new_buffer((b, t, h, hd), qg.dtype, qg.device)
    gate = _new_buffer((b, t, h * hd), qg.dtype, qg.device)
    block_d = max(16, _pow2(hd))
    gw = min(KV_GROUP, block_d)
    ks = k_scale if int8 else k_cache  # placeholders keep one signature; never read without IS_INT8
    vs = v_scale if int8 else v_cache
    kern["prologue"][(b * t, h + 2 * hkv)](
        qg, kv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, ks, vs, slots, pos, q, gate,
        *qg.stride()[:3], *kv.stride()[:2], cos.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        *ks.stride()[:3], *vs.stride()[:3], *pos.stride(), *q.stride()[:3], *gate.stride()[:2],
        t, h, hkv, eps,
        HD=hd, RD=cos.shape[-1], BLOCK_D=block_d, NG=block_d // gw, GW=gw, N_SCALES=-(-hd // KV_GROUP),
        IS_INT8=int8, num_warps=1 if block_d <= 128 else 2, **_triton.pdl_args(qg.device),
    )
    return q, gate


# ---- Triton kernels ------------------------------------------------------------------------------------------
# Plain functions here, turned into jitted kernels by `_kernels()` on first use (see kernels/attention_triton.py).

tl = pdl_enter = None  # triton.language and the PDL helper, bound by _kernels()


def _norm_kernel(X, RES, W, Y, RO, IDS, stride_x, stride_r, stride_y, stride_ro, N, V, eps,
                 BLOCK: tl.constexpr, HAS_RES: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr):
    """Program = one row: (optionally r = x + res, stored) then y = r * rsqrt(mean(r^2) + eps) * (1 + w). GATHER:
    x is row IDS[row] of X (V rows; an id outside them reads zeros), stored to RO as read."""
    pdl_enter(PDL)  # PDL launches: wait for the kernel before, let the next one launch
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    if GATHER:
        src = tl.load(IDS + row).to(tl.int64)
        inside = (src >= 0) & (src < V)
        raw = tl.load(X + src * stride_x + offs, mask=ok & inside, other=0.0)
        tl.store(RO + row * stride_ro + offs, raw, mask=ok)
        x = raw.to(tl.float32)
    else:
        x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = x + tl.load(RES + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        r = r.to(RO.dtype.element_ty)  # the norm reads the stored (rounded) residual, as the eager path does
        tl.store(RO + row * stride_ro + offs, r, mask=ok)
        x = r.to(tl.float32)
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    tl.store(Y + row * stride_y + offs, (x * inv * (1.0 + w)).to(Y.dtype.element_ty), mask=ok)


def _silu_mul_kernel(GU, Y, stride_g, stride_y, I, BLOCK: tl.constexpr, RUN: tl.constexpr, PDL: tl.constexpr):
    """Program (row, column block): y = silu(g) * u, gate column j at (j // RUN) * 2 RUN + j % RUN and its up
    RUN further (RUN = I: the two halves)."""
    pdl_enter(PDL)  # PDL launches: wait for the kernel before, let the next one launch
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    gi = (offs // RUN) * (2 * RUN) + offs % RUN
    g = tl.load(GU + row * stride_g + gi, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_g + RUN + gi, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=ok)


def _sigmoid_mul_kernel(O, G, Y, stride_o, stride_g, stride_y, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, column block): y = o * sigmoid(gate)."""
    pdl_enter(PDL)  # PDL launches: wait for the kernel before, let the next one launch
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    o = tl.load(O + row * stride_o + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (o * tl.sigmoid(g)).to(Y.dtype.element_ty), mask=ok)


def _norm_rope(base, W, cos_row, sin_row, eps, HD: tl.constexpr, RD: tl.constexpr, BLOCK_D: tl.constexpr):
    """Zero-centred RMSNorm of one head (``base[0:HD]``), then NeoX rotate-half on its first RD dims: [BLOCK_D] fp32.

    The rotation partner of dim i (i +- RD/2) is loaded a second time (an L1 hit) instead of permuting registers.
    """
    offs = tl.arange(0, BLOCK_D)
    ok = offs < HD
    x = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / HD + eps)
    x = x * inv * (1.0 + tl.load(W + offs, mask=ok, other=0.0).to(tl.float32))
    rot = offs < RD
    partner = tl.where(offs < RD // 2, offs + RD // 2, offs - RD // 2)
    xp = tl.load(base + partner, mask=rot, other=0.0).to(tl.float32)
    xp = xp * inv * (1.0 + tl.load(W + partner, mask=rot, other=0.0).to(tl.float32))
    c = tl.load(cos_row + offs, mask=rot, other=1.0)
    s = tl.load(sin_row + offs, mask=rot, other=0.0)
    return tl.where(rot, x * c + tl.where(offs < RD // 2, -xp, xp) * s, x)


def _norm_rope_kernel(X, W, COS, SIN, POS, Y, stride_xb, stride_xt, stride_xh, stride_cos, stride_pb, stride_pt,
                      stride_yb, stride_yt, stride_yh, T, eps,
                      HD: tl.constexpr, RD: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Program (b * T + t, head): the head's norm and rotation at its row's position."""
    pdl_enter(PDL)  # PDL launches: wait for the kernel before, let the next one launch
    row = tl.program_id(0)
    j = tl.program_id(1)
    b = (row // T).to(tl.int64)
    t = row % T
    p = tl.load(POS + b * stride_pb + t * stride_pt).to(tl.int64)
    x = _norm_rope(X + b * stride_xb + t * stride_xt + j * stride_xh, W, COS + p * stride_cos, SIN + p * stride_cos,
                   eps, HD, RD, BLOCK_D)
    offs = tl.arange(0, BLOCK_D)
    tl.store(Y + b * stride_yb + t * stride_yt + j * stride_yh + offs, x.to(Y.dtype.element_ty), mask=offs < HD)


def _round_half_even(y):
    """torch.round of fp32 y with |y| < 2^22, from floor alone (the same on the GPU and in the interpreter)."""
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


def _store_kv(x, cache, scales, IS_INT8: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr, NG: tl.constexpr,
              GW: tl.constexpr, N_SCALES: tl.constexpr):
    """Store one head ``x [BLOCK_D]`` fp32 at ``cache[0:HD]``: cast, or int8 codes + one fp16 scale per 64 values."""
    offs = tl.arange(0, BLOCK_D)
    if IS_INT8:
        xg = tl.reshape(x, (NG, GW))
        sc = (tl.max(tl.abs(xg), 1) / 127.0)
        sc = tl.maximum(sc, 1e-8).to(tl.float16)  # kv_quant.quantize_kv: clamp_min(1e-8), then fp16
        sf = sc.to(tl.float32)
        y = tl.where(sf[:, None] > 0.0, tl.div_rn(xg, tl.where(sf > 0.0, sf, 1.0)[:, None]), 0.0)
        codes = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0).to(tl.int8)
        tl.store(cache + offs, tl.reshape(codes, (BLOCK_D,)), mask=offs < HD)
        offs_g = tl.arange(0, NG)
        tl.store(scales + offs_g, sc, mask=offs_g < N_SCALES)
    else:
        tl.store(cache + offs, x.to(cache.dtype.element_ty), mask=offs < HD)


def _prologue_kernel(QG, KV, QW, KW, COS, SIN, KC, VC, KS, VS, SLOTS, POS, Q, GATE,
                     stride_gb, stride_gt, stride_gh, stride_kvb, stride_kvt, stride_cos,
                     stride_kcs, stride_kch, stride_kcn, stride_vcs, stride_vch, stride_vcn,
                     stride_kss, stride_ksh, stride_ksn, stride_vss, stride_vsh, stride_vsn,
                     stride_pb, stride_pt, stride_qb, stride_qt, stride_qh, stride_ab, stride_at,
                     T, H, HKV, eps,
                     HD: tl.constexpr, RD: tl.constexpr, BLOCK_D: tl.constexpr, NG: tl.constexpr, GW: tl.constexpr,
                     N_SCALES: tl.constexpr, IS_INT8: tl.constexpr, PDL: tl.constexpr):
    """Program (b * T + t, j): j < H query head j (norm, rope, gate copy); then Hkv key heads, then Hkv value heads."""
    pdl_enter(PDL)  # PDL launches: wait for the kernel before, let the next one launch
    row = tl.program_id(0)
    j = tl.program_id(1)
    b = row // T
    t = row % T
    offs = tl.arange(0, BLOCK_D)
    ok = offs < HD
    p = tl.load(POS + b * stride_pb + t * stride_pt).to(tl.int64)
    if j < H:
        base = QG + b.to(tl.int64) * stride_gb + t * stride_gt + j * stride_gh
        x = _norm_rope(base, QW, COS + p * stride_cos, SIN + p * stride_cos, eps, HD, RD, BLOCK_D)
        tl.store(Q + b.to(tl.int64) * stride_qb + t * stride_qt + j * stride_qh + offs, x.to(Q.dtype.element_ty),
                 mask=ok)
        gate = tl.load(base + HD + offs, mask=ok, other=0.0)
        tl.store(GATE + b.to(tl.int64) * stride_ab + t * stride_at + j * HD + offs, gate, mask=ok)
    else:
        slot = tl.load(SLOTS + b).to(tl.int64)  # slot * stride overflows int32 on large caches
        kv_row = KV + b.to(tl.int64) * stride_kvb + t * stride_kvt
        if j < H + HKV:
            hh = j - H
            x = _norm_rope(kv_row + hh * HD, KW, COS + p * stride_cos, SIN + p * stride_cos, eps, HD, RD, BLOCK_D)
            _store_kv(x, KC + slot * stride_kcs + hh * stride_kch + p * stride_kcn,
                      KS + slot * stride_kss + hh * stride_ksh + p * stride_ksn, IS_INT8, HD, BLOCK_D, NG, GW,
                      N_SCALES)
        else:
            hh = j - H - HKV
            x = tl.load(kv_row + (HKV + hh) * HD + offs, mask=ok, other=0.0).to(tl.float32)
            _store_kv(x, VC + slot * stride_vcs + hh * stride_vch + p * stride_vcn,
                      VS + slot * stride_vss + hh * stride_vsh + p * stride_vsn, IS_INT8, HD, BLOCK_D, NG, GW,
                      N_SCALES)


@functools.lru_cache(maxsize=1)
def _kernels() -> dict:
    """Jit the kernels (first call only); the prologue finds its helpers and `tl` as module globals."""
    return _triton.jit_module(globals(), ("_norm_rope", "_round_half_even", "_store_kv"),
                              {"norm": "_norm_kernel", "silu_mul": "_silu_mul_kernel",
                               "sigmoid_mul": "_sigmoid_mul_kernel", "prologue": "_prologue_kernel",
                               "norm_rope": "_norm_rope_kernel"})
