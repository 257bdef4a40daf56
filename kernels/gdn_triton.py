"""Gated DeltaNet token mixing for decode / speculative verify in Triton: one layer, T new tokens of B slots.

Replaces, on the CUDA decode path, everything :meth:`engine.model.hybrid.HybridModel.gated_deltanet` does between the
input
projections and ``out_proj``: the depthwise causal conv (reading and updating the conv state in the cache), SiLU,
the per-head L2 norms of q and k, the gates ``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)``,
the delta-rule recurrence from the cached state, and the gated RMSNorm ``norm_w * rmsnorm(o) * silu(z)``.

Shapes (C = 2 * Hk * dk + Hv * dv channels, q | k | v; W the conv width; S cache slots):
  qkv [B, T, C], z [B, T, Hv * dv], b / a [B, T, Hv]   compute dtype (views of the fused projection outputs are
                                                         fine: only the last dim must be contiguous)
  conv_state [S, C, W-1] compute dtype; conv_w [C, W] fp32; ssm [S, Hv, dk, dv] fp32; slots [B] int64
  A_log, dt_bias [Hv] fp32; norm_w [dv] fp32; out [B, T, Hv * dv] compute dtype

Two launches (three with block_v < dv):

1. ``_prep_kernel`` over (B, Hk + Hv, T): one program per k head (its q and k channels) or v head (its v channels
   and gates) and token, each token computed as a single decode step computes it (so every sum is the same bits
   whatever T is: a verify pass over drafted tokens computes what single decode steps compute): conv + SiLU, L2
   norms, q.k, e^g and beta, written to a small fp32 workspace ([B, T, C] and [B, T, 2 Hv + Hk]). It writes nothing
   of the cache, so the tokens run side by side.
2. ``_recur_kernel`` over (B * Hv, dv / BV): the fp32 state tile ``S[:, v block]`` ([dk, BV]) stays in registers
   across the T tokens (read and written once per call; the cache's state is read before the PDL wait, beside the
   prep kernel's tail). The token loop is unrolled and its inputs come from the
   workspace, so their loads do not wait on the state; per token ``S^T k`` and ``S^T q`` in one pass and the
   rank-1 update in a second (``o = e^g S^T q + (q . k) u`` saves a third). With BV >= dv the gated RMSNorm is
   applied right there; with BV < dv (more, smaller programs: better at these sizes, see scripts/bench_fused.py)
   o goes to an fp32 buffer and
3. ``_gated_norm_kernel`` normalises it.

A verify pass can write its workspace, and the raw conv inputs, into one stack over the GDN layers
(``workspace_out``, :func:`new_stack`); :func:`gdn_commit` then rolls every layer back in one launch: the recurrence
alone (no conv, norms or gates again), the layer as a third grid axis (``LAYERED``), over the caches' own stacks.

(An earlier single-launch version, with every program of a k head recomputing its q/k conv and holding all T
tokens' q/k/v in registers, used 255 registers per thread with spills at T = 8 and ran 4-8x over the floor there.)

State write-back (``write_state``, by the recurrence): the state after the first ``keep[b]`` tokens (tokens past
keep[b] get beta = 0 and g = 0, which leaves the state exactly unchanged) goes to ``ssm[slots[b]]``, each tile by the
program that read it, and the conv window ending at keep[b] to ``conv_state[slots[b]]``, each channel by one program
of v block 0, which reads its old window before it writes the new one.

No host synchronisation and a grid that depends only on static sizes: CUDA-graph safe. Slots must be distinct.
Triton is imported on first use, so this module imports on machines without it.

Implementations, same argument order:
  gdn_decode_ref  plain fp32 torch from kernels/conv.py, kernels/gdn.py and kernels/norm.py (the reference)
  gdn_decode      the Triton kernels of kernels/gdn_triton_kernels.py (CUDA, or ``TRITON_INTERPRET=1`` on the CPU)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import _triton
from ._triton import pow2 as _pow2
from .conv import causal_conv1d_ref
from .gdn import STEP_MAX_T, gated_delta_rule_ref, l2norm
from .gdn_triton_kernels import jit_kernels as _kernels
from .norm import gated_rms_norm_ref

__all__ = ["GDNConfig", "GDNWorkspace", "plan", "gdn_decode", "gdn_decode_ref", "gdn_commit", "gdn_commit_ref",
           "new_stack", "layer_of", "triton_available", "MAX_T"]

MAX_T = STEP_MAX_T  # tokens per call: every token's q/k/v tiles stay in registers for the whole loop
L2_EPS = 1e-6  # l2norm's eps (kernels/gdn.py)


_triton_import_error = _triton.import_error
triton_available = _triton.available


@dataclass(frozen=True, slots=True)
class GDNConfig:
    """Launch shape of :func:`gdn_decode` (see :func:`plan`)."""

    block_v: int  # dv columns of the state per program (power of two); >= dv fuses the gated RMSNorm
    num_warps: int

    def __post_init__(self):
        if self.block_v < 8 or self.block_v & (self.block_v - 1):
            raise ValueError(f"GDNConfig.block_v must be a power of two >= 8, got {self.block_v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GDNConfig.num_warps must be a power of two <= 16, got {self.num_warps}")


def plan(dk: int, dv: int, *, block_v: int | None = None, num_warps: int | None = None) -> GDNConfig:
    """Default launch shape of the recurrence. Narrow state tiles ([128, 32], 2 warps: ~32 state registers per
    thread) beat whole-head tiles with the norm fused at every batch and T timed on the H200: more programs stream
    the state and each token's reductions stay short. Keyword overrides are for tuning sweeps and tests."""
    bk, bd = _pow2(dk), max(8, _pow2(dv))
    if block_v is None:
        block_v = min(32, bd)
    if num_warps is None:
        num_warps = min(8, max(1, bk * block_v // 2048))
    return GDNConfig(block_v=block_v, num_warps=num_warps)


def _new_buffer(shape, dtype, device) -> torch.Tensor:
    """Output and workspace allocation (tests swap in a NaN fill to catch unwritten elements)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _dims(qkv, ssm, conv_w) -> tuple[int, int, int, int, int, int, int]:
    """(B, T, C, Hk, Hv, dk, dv) from the cache and input shapes."""
    if qkv.dim() != 3:
        raise ValueError(f"gdn_decode: qkv must be [B, T, C], got shape {tuple(qkv.shape)}")
    if ssm.dim() != 4:
        raise ValueError(f"gdn_decode: ssm must be [S, Hv, dk, dv], got shape {tuple(ssm.shape)}")
    b, t, c = qkv.shape
    _, hv, dk, dv = ssm.shape
    qk = c - hv * dv
    if qk <= 0 or qk % (2 * dk):
        raise ValueError(f"gdn_decode: qkv has {c} channels, not 2 * Hk * dk + Hv * dv with Hv={hv}, dk={dk}, dv={dv}")
    hk = qk // (2 * dk)
    if hv % hk:
        raise ValueError(f"gdn_decode: Hv={hv} v heads is not a multiple of Hk={hk} k heads")
    if conv_w.dim() != 2 or conv_w.shape[0] != c or conv_w.shape[1] < 2:
        raise ValueError(f"gdn_decode: conv_w must be [C={c}, W >= 2], got {tuple(conv_w.shape)}")
    return b, t, c, hk, hv, dk, dv


def _check(qkv, z, b, a, conv_state, conv_w, ssm, slots, A_log, dt_bias, norm_w, keep, conv_init, ssm_init,
           states_out):
    bsz, t, c, hk, hv, dk, dv = _dims(qkv, ssm, conv_w)
    w = conv_w.shape[1]
    if not 1 <= t <= MAX_T:
        raise ValueError(f"gdn_decode: T={t} new tokens, must be 1..{MAX_T}")
    if qkv.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"gdn_decode: qkv must be bf16, fp16 or fp32, got {qkv.dtype}")
    expect = {
        "z": (z, (bsz, t, hv * dv)), "b": (b, (bsz, t, hv)), "a": (a, (bsz, t, hv)),
        "conv_state": (conv_state, (conv_state.shape[0], c, w - 1)), "ssm": (ssm, tuple(ssm.shape)),
        "slots": (slots, (bsz,)), "A_log": (A_log, (hv,)), "dt_bias": (dt_bias, (hv,)),
        "norm_w": (norm_w, (dv,)), "keep": (keep, (bsz,)), "conv_init": (conv_init, (bsz, c, w - 1)),
        "ssm_init": (ssm_init, (bsz, hv, dk, dv)), "states_out": (states_out, (bsz, t, hv, dk, dv)),
    }
    for name, (x, shape) in expect.items():
        if x is None:
            continue
        if tuple(x.shape) != shape:
            raise ValueError(f"gdn_decode: {name} must be {list(shape)}, got {list(x.shape)}")
        if x.device != qkv.device:
            raise ValueError(f"gdn_decode: {name} is on {x.device}, qkv on {qkv.device}")
        if x.dim() and x.numel() and x.stride(-1) != 1:
            raise ValueError(f"gdn_decode: {name} must be contiguous along its last dimension")
    if conv_state.shape[0] != ssm.shape[0]:
        raise ValueError(f"gdn_decode: conv_state has {conv_state.shape[0]} slots, ssm {ssm.shape[0]}")
    for name, x in (("ssm", ssm), ("ssm_init", ssm_init), ("states_out", states_out), ("conv_w", conv_w),
                    ("A_log", A_log), ("dt_bias", dt_bias), ("norm_w", norm_w)):
        if x is not None and x.dtype != torch.float32:
            raise ValueError(f"gdn_decode: {name} must be fp32, got {x.dtype}")
    for name, x in (("slots", slots), ("keep", keep)):
        if x is not None and x.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"gdn_decode: {name} must be int64 or int32, got {x.dtype}")
    return bsz, t, c, hk, hv, dk, dv, w


def gdn_decode_ref(qkv, z, b, a, conv_state, conv_w, ssm, slots, A_log, dt_bias, norm_w, eps, *,
                   keep=None, conv_init=None, ssm_init=None, states_out=None, write_state=True):
    """fp32 torch reference of :func:`gdn_decode` (same arguments, same effects on the caches)."""
    bsz, t, c, hk, hv, dk, dv, w = _check(qkv, z, b, a, conv_state, conv_w, ssm, slots, A_log, dt_bias, norm_w,
                                          keep, conv_init, ssm_init, states_out)
    conv0 = conv_state[slots] if conv_init is None else conv_init  # [B, C, W-1]
    ssm0 = ssm[slots] if ssm_init is None else ssm_init  # [B, Hv, dk, dv]
    y, _ = causal_conv1d_ref(qkv.float(), conv_w.float(), conv0.float())  # [B, T, C] fp32
    q, k, v = torch.split(y, [hk * dk, hk * dk, hv * dv], dim=-1)
    q = l2norm(q.reshape(bsz, t, hk, dk), L2_EPS)
    k = l2norm(k.reshape(bsz, t, hk, dk), L2_EPS)
    v = v.reshape(bsz, t, hv, dv)
    beta = torch.sigmoid(b.float())
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    n = torch.full((bsz,), t, device=qkv.device) if keep is None else keep
    live = (torch.arange(t, device=qkv.device)[None, :] < n[:, None]).float()[..., None]  # [B, T, 1]
    o, state, states = gated_delta_rule_ref(q, k, v, g * live, beta * live, initial_state=ssm0.float(),
                                            return_states=True)
    out = None
    if z is not None:
        out = gated_rms_norm_ref(o, z.float().view(bsz, t, hv, dv), norm_w, eps).reshape(bsz, t, hv * dv)
        out = out.to(qkv.dtype)
    if states_out is not None:
        states_out.copy_(states)
    if write_state:
        # the window of W-1 inputs ending at keep[b] in cat(old, new), copied exactly (cache dtype)
        seq = torch.cat([conv0.to(conv_state.dtype), qkv.transpose(1, 2).to(conv_state.dtype)], dim=-1)
        idx = n.view(bsz, 1, 1) + torch.arange(w - 1, device=qkv.device).view(1, 1, w - 1)
        conv_state[slots] = torch.gather(seq, 2, idx.expand(bsz, c, w - 1))
        ssm[slots] = state
    return out


@dataclass(frozen=True, slots=True)
class GDNWorkspace:
    """What the prep launch of :func:`gdn_decode` leaves for the recurrence: the conv + SiLU outputs (q normalised
    and scaled, k normalised, v) ``work [B, T, C]`` and ``gates [B, T, 2 Hv + Hk]`` (e^g | beta | q.k), fp32, and
    with ``inputs`` the raw conv inputs. A verify pass writes it (``workspace_out``), so its rollback
    (:func:`gdn_commit`) runs the recurrence alone."""

    work: torch.Tensor
    gates: torch.Tensor
    inputs: torch.Tensor | None = None  # [B, T, C] the raw conv inputs (qkv), compute dtype: for gdn_commit


def gdn_decode(qkv, z, b, a, conv_state, conv_w, ssm, slots, A_log, dt_bias, norm_w, eps, *,
               keep=None, conv_init=None, ssm_init=None, states_out=None, write_state=True,
               config: GDNConfig | None = None, before_z=None, workspace_out: GDNWorkspace | None = None):
    """One GDN layer's token mixing for T (1..16) new tokens of B slots: two launches (three when block_v < dv).

    qkv [B, T, C] (C = 2*Hk*dk + Hv*dv: the in_proj_qkv output before the conv, q | k | v), z [B, T, Hv*dv],
    b / a [B, T, Hv] (in_proj_b / in_proj_a outputs), all in the compute dtype; conv_state [S, C, W-1] (compute
    dtype) and ssm [S, Hv, dk, dv] fp32 are the cache tensors of all slots; conv_w [C, W] fp32; slots [B] int64
    (distinct); A_log, dt_bias [Hv] and norm_w [dv] fp32.

    Semantics of engine/model/hybrid.py ``gated_deltanet`` (decode): y = silu(causal conv over cat(conv_state[slot],
    qkv)),
    q, k L2-normalised per k head, q scaled by dk^-0.5, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias),
    per v head h (k head h // (Hv/Hk)): S = S e^g; S += k (beta (v - S^T k))^T; o = S^T q; then
    out = norm_w * rmsnorm(o) * silu(z) per head. Returns out [B, T, Hv*dv] in qkv's dtype (None when z is None:
    a state-only call).

    State: starts from conv_init [B, C, W-1] / ssm_init [B, Hv, dk, dv] when given, else from conv_state[slots] /
    ssm[slots]; tokens t >= keep[b] (keep [B] in 1..T, default T) leave it unchanged. With write_state the state
    after keep[b] tokens is written to conv_state[slots] / ssm[slots]. states_out [B, T, Hv, dk, dv] fp32, when
    given, receives the state after every token. No host synchronisation, static grid: CUDA-graph safe.
    ``config`` overrides :func:`plan` (tuning, tests). ``before_z``, when given, is called right before the first
    launch that reads z (z may still be in the making on another stream until then). ``workspace_out``: buffers the
    prep launch writes its workspace to (layer l's slices of the stacks :func:`gdn_commit` reads; with ``inputs`` the
    prep also copies qkv there) instead of new ones.
    """
    bsz, t, c, hk, hv, dk, dv, w = _check(qkv, z, b, a, conv_state, conv_w, ssm, slots, A_log, dt_bias, norm_w,
                                          keep, conv_init, ssm_init, states_out)
    kern = _triton.ready("gdn_decode", _kernels, qkv)
    cfg = config or plan(dk, dv)
    dev, bt = qkv.device, _pow2(t)
    conv_src = conv_init if conv_init is not None else conv_state
    if b is None or a is None:
        raise ValueError("gdn_decode: b and a are needed")
    xin = None
    if workspace_out is None:
        work = _new_buffer((bsz, t, c), torch.float32, dev)  # q (normalised, scaled) | k (normalised) | v
        gates = _new_buffer((bsz, t, 2 * hv + hk), torch.float32, dev)  # e^g | beta | q.k
    else:
        work, gates, xin = workspace_out.work, workspace_out.gates, workspace_out.inputs
        _check_workspace(workspace_out, bsz, t, c, hv, hk, qkv.dtype, dev)
    kern["prep"][(bsz, hk + hv, t)](  # one token a program: each token's sums as a single step's
        qkv, conv_src, conv_w.contiguous(), slots, b, a, A_log, dt_bias, work, gates,
        xin if xin is not None else work,  # a placeholder when not stored: never written with STORE_X off
        qkv.stride(0), qkv.stride(1), *conv_src.stride(), b.stride(0), b.stride(1), a.stride(0), a.stride(1),
        t, dk ** -0.5,
        HK=hk, HV=hv, DK=dk, DV=dv, W=w, BD=max(16, _pow2(max(dk, dv))), CONV_INIT=conv_init is not None,
        STORE_X=xin is not None,
        num_warps=4 if max(dk, dv) >= 512 else 2, **_triton.pdl_args(dev),  # not from T: the sums' layout
    )
    bv = min(cfg.block_v, max(8, _pow2(dv)))
    fused_norm = bv >= dv
    has_out = z is not None
    out = _new_buffer((bsz, t, hv * dv), qkv.dtype, dev) if has_out else None
    obuf = _new_buffer((bsz, t, hv * dv), torch.float32, dev) if has_out and not fused_norm else None
    ssm_src = ssm_init if ssm_init is not None else ssm
    y = (out if fused_norm else obuf) if has_out else work
    zz = z if has_out else qkv
    so = states_out if states_out is not None else ssm
    if has_out and fused_norm and before_z is not None:
        before_z()  # the recurrence's epilogue reads z
    kp = keep if keep is not None else slots  # a placeholder keeps one signature; never read with HAS_KEEP off
    kern["recur"][(bsz * hv, -(-dv // bv))](
        work, gates, ssm_src, ssm, slots, kp, so, zz, norm_w, y, qkv, conv_src, conv_state,
        *ssm_src.stride()[:3], *ssm.stride()[:3], *so.stride()[:4], zz.stride(0), zz.stride(1), y.stride(0),
        y.stride(1), qkv.stride(0), qkv.stride(1), *conv_src.stride(), *conv_state.stride(), t, eps,
        0, 0, 0, 0, 0,  # layer strides: one layer
        HK=hk, R=hv // hk, DK=dk, DV=dv, BT=bt, BK=_pow2(dk), BV=bv, W=w, BW=_pow2(w - 1), BDK=max(16, _pow2(dk)),
        BDV=max(16, _pow2(dv)), SSM_INIT=ssm_init is not None, CONV_INIT=conv_init is not None,
        HAS_KEEP=keep is not None, WRITE_STATE=write_state, STORE_STATES=states_out is not None,
        HAS_OUT=has_out, FUSED_NORM=fused_norm, LAYERED=False,
        num_warps=cfg.num_warps, **_triton.pdl_args(dev),
    )
    if has_out and not fused_norm:
        if before_z is not None:
            before_z()
        hb = 8  # heads per program of the norm epilogue
        kern["norm"][(bsz * t, -(-hv // hb))](
            obuf, z, norm_w, out, obuf.stride(0), obuf.stride(1), z.stride(0), z.stride(1), out.stride(0),
            out.stride(1), t, hv, eps, DV=dv, BD=max(16, _pow2(dv)), HB=hb, num_warps=4, **_triton.pdl_args(dev),
        )
    return out


def _check_workspace(ws: GDNWorkspace, bsz, t, c, hv, hk, dtype, dev) -> None:
    want = {"work": (ws.work, (bsz, t, c), torch.float32), "gates": (ws.gates, (bsz, t, 2 * hv + hk), torch.float32),
            "inputs": (ws.inputs, (bsz, t, c), dtype)}
    for name, (x, shape, dt) in want.items():
        if x is None:
            continue
        if tuple(x.shape) != shape or x.dtype != dt or x.device != dev or not x.is_contiguous():
            raise ValueError(f"gdn_decode: workspace_out.{name} must be a contiguous {dt} {list(shape)} on {dev}, "
                             f"got {x.dtype} {list(x.shape)} on {x.device}")


def new_stack(layers: int, bsz: int, t: int, c: int, hv: int, hk: int, dtype, device) -> GDNWorkspace:
    """Workspace stacks for a verify pass over ``layers`` GDN layers: ``work`` [L, B, T, C] and ``gates``
    [L, B, T, 2 Hv + Hk] fp32, ``inputs`` [L, B, T, C] in the compute dtype; layer l's slices go to
    :func:`gdn_decode` as ``workspace_out`` and the whole to :func:`gdn_commit`."""
    return GDNWorkspace(_new_buffer((layers, bsz, t, c), torch.float32, device),
                        _new_buffer((layers, bsz, t, 2 * hv + hk), torch.float32, device),
                        _new_buffer((layers, bsz, t, c), dtype, device))


def layer_of(stack: GDNWorkspace, layer: int) -> GDNWorkspace:
    return GDNWorkspace(stack.work[layer], stack.gates[layer], stack.inputs[layer])


def _commit_dims(stack: GDNWorkspace, conv_all, ssm_all, slots, keep):
    if stack.inputs is None:
        raise ValueError("gdn_commit: the stack has no conv inputs (make it with new_stack)")
    if ssm_all.dim() != 5 or conv_all.dim() != 4:
        raise ValueError(f"gdn_commit: ssm_all must be [L, S, Hv, dk, dv] and conv_all [L, S, C, W-1], got "
                         f"{list(ssm_all.shape)} and {list(conv_all.shape)}")
    n, s, hv, dk, dv = ssm_all.shape
    _, bsz, t, c = stack.work.shape
    ng = stack.gates.shape[-1]
    hk = ng - 2 * hv
    if hk <= 0 or hv % hk or c != 2 * hk * dk + hv * dv:
        raise ValueError(f"gdn_commit: a stack of {c} channels and {ng} gates does not fit Hv={hv}, dk={dk}, dv={dv}")
    shapes = {"work": (stack.work, (n, bsz, t, c)), "gates": (stack.gates, (n, bsz, t, ng)),
              "inputs": (stack.inputs, (n, bsz, t, c)), "conv_all": (conv_all, (n, s, c, conv_all.shape[-1])),
              "slots": (slots, (bsz,)), "keep": (keep, (bsz,))}
    for name, (x, shape) in shapes.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"gdn_commit: {name} must be {list(shape)}, got {list(x.shape)}")
        if x.device != ssm_all.device:
            raise ValueError(f"gdn_commit: {name} is on {x.device}, the caches on {ssm_all.device}")
    for name, x in (("work", stack.work), ("gates", stack.gates), ("inputs", stack.inputs), ("ssm_all", ssm_all),
                    ("conv_all", conv_all)):
        if not x.is_contiguous():
            raise ValueError(f"gdn_commit: {name} must be contiguous")
    if ssm_all.dtype != torch.float32 or stack.work.dtype != torch.float32 or stack.gates.dtype != torch.float32:
        raise ValueError("gdn_commit: ssm_all, work and gates must be fp32")
    if not 1 <= t <= MAX_T:
        raise ValueError(f"gdn_commit: T={t} verified tokens, must be 1..{MAX_T}")
    return n, bsz, t, c, hk, hv, dk, dv, conv_all.shape[-1] + 1


def gdn_commit(stack: GDNWorkspace, conv_all, ssm_all, slots, keep, *, config: GDNConfig | None = None) -> None:
    """The ``recompute`` rollback of every GDN layer of a verify pass in one launch: for each layer l the recurrence
    of the verified block rerun from the pre-verify state (still in ``ssm_all[l]``) over the pass's own workspace
    ``stack`` (:func:`new_stack`, filled through ``workspace_out``), applying only the first ``keep[b]`` positions,
    and the state and the conv window ending at keep[b] written to ``ssm_all[l][slots]`` / ``conv_all[l][slots]``.
    The same bits as one ``gdn_decode(..., z=None, keep=keep)`` call a layer from the same state (the same
    recurrence kernel, the layer as a grid axis). ``conv_all`` [L, S, C, W-1] and ``ssm_all`` [L, S, Hv, dk, dv] are the caches' stacks."""
    n, bsz, t, _, hk, hv, dk, dv, w = _commit_dims(stack, conv_all, ssm_all, slots, keep)
    if n == 0:
        return
    kern = _triton.ready("gdn_decode", _kernels, stack.work)
    cfg = config or plan(dk, dv)
    bv = min(cfg.block_v, max(8, _pow2(dv)))
    dev = stack.work.device
    work, gates, xin = stack.work, stack.gates, stack.inputs
    kern["recur"][(bsz * hv, -(-dv // bv), n)](
        work, gates, ssm_all, ssm_all, slots, keep, ssm_all, xin, work, work, xin, conv_all, conv_all,
        *ssm_all.stride()[1:4], *ssm_all.stride()[1:4], 0, 0, 0, 0, 0, 0, 0, 0, xin.stride(1), xin.stride(2),
        *conv_all.stride()[1:], *conv_all.stride()[1:], t, 0.0,
        work.stride(0), gates.stride(0), ssm_all.stride(0), xin.stride(0), conv_all.stride(0),
        HK=hk, R=hv // hk, DK=dk, DV=dv, BT=_pow2(t), BK=_pow2(dk), BV=bv, W=w, BW=_pow2(w - 1), BDK=max(16, _pow2(dk)),
        BDV=max(16, _pow2(dv)), SSM_INIT=False, CONV_INIT=False, HAS_KEEP=True, WRITE_STATE=True, STORE_STATES=False,
        HAS_OUT=False, FUSED_NORM=bv >= dv, LAYERED=True,
        num_warps=cfg.num_warps, **_triton.pdl_args(dev),
    )


def gdn_commit_ref(stack: GDNWorkspace, conv_all, ssm_all, slots, keep) -> None:
    """fp32 torch reference of :func:`gdn_commit` (same arguments, same effects on the caches)."""
    n, bsz, t, c, hk, hv, dk, dv, w = _commit_dims(stack, conv_all, ssm_all, slots, keep)
    r = hv // hk
    live = torch.arange(t, device=keep.device)[None, :] < keep[:, None]  # [B, T]
    for layer in range(n):
        work, gates = stack.work[layer].float(), stack.gates[layer].float()
        k = work[..., hk * dk:2 * hk * dk].reshape(bsz, t, hk, dk).repeat_interleave(r, dim=2)
        v = work[..., 2 * hk * dk:].reshape(bsz, t, hv, dv)
        eg = torch.where(live[..., None], gates[..., :hv], torch.ones_like(gates[..., :hv]))
        beta = torch.where(live[..., None], gates[..., hv:2 * hv], torch.zeros_like(gates[..., :hv]))
        state = ssm_all[layer][slots].clone()  # [B, Hv, dk, dv]
        for i in range(t):
            state = state * eg[:, i, :, None, None]
            u = beta[:, i, :, None] * (v[:, i] - torch.einsum("bhk,bhkv->bhv", k[:, i], state))
            state = state + k[:, i, :, :, None] * u[:, :, None, :]
        seq = torch.cat([conv_all[layer][slots], stack.inputs[layer].transpose(1, 2).to(conv_all.dtype)], dim=-1)
        idx = keep.view(bsz, 1, 1) + torch.arange(w - 1, device=seq.device).view(1, 1, w - 1)
        conv_all[layer][slots] = torch.gather(seq, 2, idx.expand(bsz, c, w - 1))
        ssm_all[layer][slots] = state
