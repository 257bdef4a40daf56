"""Gated DeltaNet (gated delta rule) recurrence, in flash-linear-attention's layout.

Shapes: q, k [B, T, Hk, dk] (already L2-normalised: see `l2norm`), v [B, T, Hv, dv] with Hv a
multiple of Hk (v head i reads q/k head i // (Hv // Hk)), g and beta [B, T, Hv], state
[B, Hv, dk, dv] fp32. Per token, per v head:

    S = S * exp(g_t)
    S = S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T (scale q_t)                      scale defaults to dk ** -0.5

Implementations, all with the same argument order:
  gated_delta_rule_ref      plain fp32 sequential loop (the reference)
  gated_delta_rule_chunked  chunked WY / UT-transform form in torch, for prefill
  gated_delta_rule_step     tight loop over a few tokens from a given state, for decode / verify
  gated_delta_rule_fla      flash-linear-attention's Triton kernels (CUDA only)
  gated_delta_rule          dispatch between them
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings

import torch
import torch.nn.functional as F

from . import _triton

__all__ = [
    "l2norm",
    "fla_available",
    "gated_delta_rule_ref",
    "gated_delta_rule_chunked",
    "gated_delta_rule_step",
    "gated_delta_rule_fla",
    "gated_delta_rule",
    "IMPLS",
    "STEP_MAX_T",
]

IMPLS = ("auto", "ref", "chunked", "fla", "step")

# `auto` uses the step loop up to this many tokens (decode and speculative verify).
STEP_MAX_T = 16

# Tokens per block of `gated_delta_rule_chunked` (rounded down to whole chunks): bounds the
# [chunks, B, Hv, C, C] and per-chunk-state intermediates, which would otherwise grow with T.
_BLOCK_TOKENS = 512


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2, -1) + eps) over the last dim, computed in fp32, returned in x.dtype.

    Same formula as Hugging Face's `l2norm` and fla's `use_qk_l2norm_in_kernel`.
    """
    xf = x.to(torch.float32)
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _fla_import_error() -> str | None:
    return _triton.import_error("fla.ops.gated_delta_rule")


def fla_available() -> bool:
    """True when CUDA is usable and flash-linear-attention's gated delta rule imports."""
    return torch.cuda.is_available() and _fla_import_error() is None


def _check(q, k, v, g, beta, state=None) -> tuple[int, int, int, int, int, int]:
    """Validate shapes; returns (B, T, Hk, Hv, dk, dv)."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(
            "gated_delta_rule: q and k must both be [B, T, Hk, dk], "
            f"got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    B, T, Hk, dk = k.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"gated_delta_rule: v must be [B={B}, T={T}, Hv, dv], got {tuple(v.shape)}")
    Hv, dv = v.shape[2], v.shape[3]
    if Hv % Hk != 0:
        raise ValueError(f"gated_delta_rule: Hv={Hv} v heads is not a multiple of Hk={Hk} k heads")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, Hv):
            raise ValueError(
                f"gated_delta_rule: {name} must be [B, T, Hv] = {(B, T, Hv)}, got {tuple(t.shape)}"
            )
    if state is not None and tuple(state.shape) != (B, Hv, dk, dv):
        raise ValueError(
            f"gated_delta_rule: state must be [B, Hv, dk, dv] = {(B, Hv, dk, dv)}, got {tuple(state.shape)}"
        )
    return B, T, Hk, Hv, dk, dv


def _to_v_heads(x: torch.Tensor, Hv: int) -> torch.Tensor:
    """[B, T, Hk, d] -> [B, T, Hv, d] fp32, v head i reading head i // (Hv // Hk)."""
    x = x.to(torch.float32)
    r = Hv // x.shape[2]
    return x if r == 1 else x.repeat_interleave(r, dim=2)


def _zero_state(B, Hv, dk, dv, device) -> torch.Tensor:
    return torch.zeros(B, Hv, dk, dv, dtype=torch.float32, device=device)


def gated_delta_rule_ref(q, k, v, g, beta, *, scale=None, initial_state=None, return_states=False):
    """Plain fp32 sequential recurrence (the reference).

    q, k: [B, T, Hk, dk] already L2-normalised; v: [B, T, Hv, dv]; g: [B, T, Hv] log-decay (<= 0);
    beta: [B, T, Hv] in (0, 1); scale multiplies q (default dk ** -0.5); initial_state
    [B, Hv, dk, dv] fp32 or None (zeros).
    Returns (o [B, T, Hv, dv] in v.dtype, final_state [B, Hv, dk, dv] fp32) and, with
    return_states, states [B, T, Hv, dk, dv] fp32 = the state after each step.
    """
    B, T, Hk, Hv, dk, dv = _check(q, k, v, g, beta, initial_state)
    scale = dk ** -0.5 if scale is None else scale
    qf, kf = _to_v_heads(q, Hv) * scale, _to_v_heads(k, Hv)  # [B, T, Hv, dk]
    vf, gf, bf = v.to(torch.float32), g.to(torch.float32), beta.to(torch.float32)
    S = _zero_state(B, Hv, dk, dv, v.device) if initial_state is None else initial_state.to(torch.float32)
    if T == 0:
        S = S.clone()
    outs, states = [], []
    for t in range(T):
        S = S * gf[:, t].exp()[..., None, None]
        pred = torch.einsum("bhkv,bhk->bhv", S, kf[:, t])  # S^T k, [B, Hv, dv]
        u = bf[:, t, :, None] * (vf[:, t] - pred)
        S = S + torch.einsum("bhk,bhv->bhkv", kf[:, t], u)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, qf[:, t]))
        if return_states:
            states.append(S)
    o = (torch.stack(outs, 1) if T else vf.new_empty(B, 0, Hv, dv)).to(v.dtype)
    if return_states:
        st = torch.stack(states, 1) if T else vf.new_empty(B, 0, Hv, dk, dv)
        return o, S, st
    return o, S


def gated_delta_rule_step(q, k, v, g, beta, state, *, scale=None, return_states=False):
    """Advance `state` by a few tokens (decode / speculative verify, T ~ 1..16).

    Same shapes as `gated_delta_rule_ref`; `state` [B, Hv, dk, dv] is required and is not modified.
    Returns (o [B, T, Hv, dv] in v.dtype, new_state fp32) and, with return_states, the state after
    each position [B, T, Hv, dk, dv] (states[:, -1] equals new_state; a transposed view of a
    [T, B, ...] buffer, so not contiguous when B > 1).
    One loop over T; every step is batched over B and heads, touching the state three times
    (decay, read [k q]^T S in one bmm, rank-1 update in place).
    """
    B, T, Hk, Hv, dk, dv = _check(q, k, v, g, beta, state)
    scale = dk ** -0.5 if scale is None else scale
    BH = B * Hv
    kf = _to_v_heads(k, Hv)  # [B, T, Hv, dk]
    qf = _to_v_heads(q, Hv) * scale
    # The read as [k q]^T @ S: x86 BLAS runs [2, dk] @ [dk, dv] 6-8x faster than S^T @ [dk, 2], with the same bits
    # (scripts/probe_gdn_read.py)
    kq = torch.stack([kf, qf], dim=-2).transpose(0, 1).reshape(T, BH, 2, dk)
    k_dot_q = (kf * qf).sum(-1).transpose(0, 1).reshape(T, BH, 1)  # [T, BH, 1]
    vf = v.to(torch.float32).transpose(0, 1).reshape(T, BH, dv)
    decay = g.to(torch.float32).exp().transpose(0, 1).reshape(T, BH, 1, 1)
    bf = beta.to(torch.float32).transpose(0, 1).reshape(T, BH, 1)
    prev = state.to(torch.float32).reshape(BH, dk, dv)
    # every step writes a buffer of its own (the caller's state is never written): with
    # return_states the per-position states in place, else two buffers used in turn
    if return_states:
        bufs = prev.new_empty(T, BH, dk, dv)
    else:
        bufs = [prev.new_empty(BH, dk, dv) for _ in range(min(T, 2))]
    if T == 1 and not return_states:  # decode: the one step's operands indexed directly, no buffers to set up
        S = bufs[0]
        torch.mul(prev, decay[0], out=S)
        read = torch.bmm(kq[0], S)  # [BH, 2, dv] = decayed k^T S, q^T S
        u = bf[0] * (vf[0] - read[:, 0])  # [BH, dv]
        S.baddbmm_(kq[0][:, 0].unsqueeze(-1), u.unsqueeze(1))  # S += k u^T
        # S_new^T q = S_decayed^T q + (k . q) u, without a fourth pass over the state
        o, prev = (read[:, 1] + k_dot_q[0] * u).view(T, B, Hv, dv).transpose(0, 1), S
    else:
        o, prev = _steps(kq, k_dot_q, vf, decay, bf, prev, bufs, return_states)
        o = o.view(T, B, Hv, dv).transpose(0, 1)
    o = o.to(v.dtype).contiguous()
    new_state = prev.view(B, Hv, dk, dv)
    if T == 0 or return_states:
        new_state = new_state.clone()  # never alias the caller's state or the returned states
    if return_states:
        # [T, B, ...] -> [B, T, ...] as a view: no copy, non-contiguous when B > 1
        return o, new_state, bufs.view(T, B, Hv, dk, dv).transpose(0, 1)
    return o, new_state


def _steps(kq, k_dot_q, vf, decay, bf, prev, bufs, return_states: bool):
    """`gated_delta_rule_step`'s loop over T steps (the same ops as its one-step form, step by step): each step's
    operands are views made up front (one unbind each) and its results land in buffers for all T steps, so a step
    runs five tensor ops and the output is formed once after the loop - a verify pass runs this loop T times per GDN
    layer, and on a CPU every op costs dispatch time however small it is. Returns (o [T, BH, dv], last state)."""
    T, BH, dv = kq.shape[0], kq.shape[1], vf.shape[-1]
    reads = prev.new_empty(T, BH, 2, dv)  # [k q]^T S of each step's decayed state
    us = prev.new_empty(T, BH, 1, dv)  # each step's update u = beta (v - k^T S)
    kq_t, kcol_t = kq.unbind(0), kq[:, :, 0].unsqueeze(-1).unbind(0)  # [BH, 2, dk]; k as a column [BH, dk, 1]
    reads_t, read_k_t, us_t = reads.unbind(0), reads[:, :, 0:1].unbind(0), us.unbind(0)  # [BH, 1, dv] for k, u
    decay_t, bf_t, vf_t = decay.unbind(0), bf[..., None].unbind(0), vf[:, :, None].unbind(0)
    for t in range(T):
        S = bufs[t] if return_states else bufs[t % 2]
        torch.mul(prev, decay_t[t], out=S)
        torch.bmm(kq_t[t], S, out=reads_t[t])  # [BH, 2, dv] = decayed k^T S, q^T S
        torch.sub(vf_t[t], read_k_t[t], out=us_t[t]).mul_(bf_t[t])  # u = beta (v - k^T S)
        S.baddbmm_(kcol_t[t], us_t[t])  # S += k u^T
        prev = S
    # S_new^T q = S_decayed^T q + (k . q) u, without a fourth pass over the state
    return reads[:, :, 1] + k_dot_q * us[:, :, 0], prev


def gated_delta_rule_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size=64):
    """Chunked (WY / UT-transform) gated delta rule in torch, fp32 math, any T.

    Same arguments and outputs as `gated_delta_rule_ref` (no per-step states). Within a chunk of C
    tokens with cumulative log-decay G_i, the corrections u_i = beta_i (v_i - S_{i-1}^T k_i) solve
        (I + A) U = diag(beta) V - diag(beta e^G) K S0,  A_ij = beta_i e^(G_i - G_j) k_i.k_j  (i > j)
    so with P = (I + A)^-1, U = U0 - W S0 where U0 = P diag(beta) V and W = P diag(beta e^G) K; then
        O = diag(e^G) (scale Q) S0 + (scale Q K^T * e^(G_i - G_j), i >= j) U
        S_next = e^(G_C) S0 + (K * e^(G_C - G))^T U
    leaving a loop over chunks of two small matmuls. Every exponent is <= 0, so nothing overflows.
    The sequence is processed in blocks of whole chunks (about _BLOCK_TOKENS tokens), which keeps
    the working set small for long prefills.
    """
    B, T, Hk, Hv, dk, dv = _check(q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"gated_delta_rule_chunked: chunk_size must be >= 1, got {chunk_size}")
    scale = dk ** -0.5 if scale is None else scale
    S = _zero_state(B, Hv, dk, dv, v.device) if initial_state is None else initial_state.to(torch.float32)
    if T == 0:
        return v.new_empty(B, 0, Hv, dv), S.clone()
    C = min(chunk_size, T)
    span = C * max(1, _BLOCK_TOKENS // C)
    o = v.new_empty(B, T, Hv, dv)
    for t0 in range(0, T, span):
        t1 = min(T, t0 + span)
        S = _chunked_block(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], g[:, t0:t1], beta[:, t0:t1],
                           S, scale, C, o[:, t0:t1])
    return o, S.clone()


def _chunked_block(q, k, v, g, beta, S, scale, C, out):
    """One block of whole chunks (the last one zero-padded): writes o into `out` [B, L, Hv, dv] and
    returns the state after the block, [B, Hv, dk, dv] fp32."""
    B, L, Hk, dk = k.shape
    Hv, dv = v.shape[2], v.shape[3]
    r = Hv // Hk
    N = math.ceil(L / C)
    pad = N * C - L

    def chunks(x, heads):  # [B, L, Hk*heads, (d)] -> [N, B, Hk, heads, C, (d)], zero-padded in time
        x = x.to(torch.float32)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        x = x.reshape(B, N, C, Hk, heads, *x.shape[3:])
        return x.permute(1, 0, 3, 4, 2, *range(5, x.dim())).contiguous()

    # padding is inert: beta = 0 writes nothing, g = 0 does not decay
    qc, kc = chunks(q, 1), chunks(k, 1)  # [N, B, Hk, 1, C, dk]
    vc = chunks(v, r)  # [N, B, Hk, r, C, dv]
    gc, bc = chunks(g, r), chunks(beta, r)  # [N, B, Hk, r, C]
    qc = qc * scale

    G = gc.cumsum(-1)  # cumulative log-decay inside each chunk
    eG = G.exp()
    lower = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    # e^(G_i - G_j) for i >= j, 0 above the diagonal (masked before exp: those exponents are > 0)
    pair = (G[..., :, None] - G[..., None, :]).masked_fill_(~lower, float("-inf")).exp_()  # [.., C, C]
    # q.k and k.k are per k head, shared by its r v heads
    A = (kc @ kc.transpose(-1, -2)).mul(bc[..., :, None]).mul_(pair)  # [N, B, Hk, r, C, C]
    attn = (qc @ kc.transpose(-1, -2)) * pair  # intra-chunk attention, i >= j
    # P = (I + A)^-1 by one unit-triangular solve (A's diagonal is never read); cheaper than
    # solving against the dv + dk right-hand sides and followed by plain matmuls
    eye = torch.eye(C, dtype=torch.float32, device=v.device).expand_as(A)
    Pb = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True).mul_(bc[..., None, :])
    U0 = Pb @ vc  # [N, B, Hk, r, C, dv]
    W = (Pb * eG[..., None, :]) @ kc  # [N, B, Hk, r, C, dk]

    # from here on the v heads are one flat batch of M = B * Hv
    M = B * Hv
    U0, W = U0.reshape(N, M, C, dv), W.reshape(N, M, C, dk)
    KdT = (kc * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2).reshape(N, M, dk, C)
    chunk_decay = eG[..., -1].reshape(N, M, 1, 1)
    attn = attn.reshape(N, M, C, C)
    Qd = (qc * eG[..., None]).reshape(N * M, C, dk)

    states = vc.new_empty(N + 1, M, dk, dv)  # the state at the start of each chunk, then the last
    states[0] = S.reshape(M, dk, dv)
    for n in range(N):
        U0[n].baddbmm_(W[n], states[n], alpha=-1)  # U = U0 - W S0, in place
        torch.mul(states[n], chunk_decay[n], out=states[n + 1])
        states[n + 1].baddbmm_(KdT[n], U0[n])
    o = (attn @ U0).view(N * M, C, dv).baddbmm_(Qd, states[:N].view(N * M, dk, dv))
    o = o.view(N, B, Hk, r, C, dv).permute(1, 0, 4, 2, 3, 5).reshape(B, N * C, Hv, dv)
    out.copy_(o[:, :L])
    return states[N].view(B, Hv, dk, dv)


@functools.lru_cache(maxsize=None)
def _fla_gva(fn) -> bool:
    """Whether fla's ``fn`` takes fewer q/k heads than v heads itself (grouped value attention, v head j reading q/k
    head j // (Hv / Hk): what repeat_interleave gives it), so that q and k need not be repeated to Hv (two copies of
    a chunk's q and k a layer). Its docstring names GVA where it does (fla 0.6's chunk_gated_delta_rule)."""
    return "GVA" in (fn.__doc__ or "")


def gated_delta_rule_fla(q, k, v, g, beta, *, scale=None, initial_state=None):
    """flash-linear-attention's kernels (CUDA only); same arguments and outputs as the reference.

    bf16 / fp16 inputs go to fla's `chunk_gated_delta_rule`. That kernel refuses fp32 inputs, so fp32
    goes to fla's `fused_recurrent_gated_delta_rule` (the same recurrence, fp32 throughout).
    q/k heads are repeated to Hv here where the fla kernel has no grouped-value support (:func:`_fla_gva`).
    """
    err = _fla_import_error()
    if err is not None:
        raise RuntimeError(
            "gated_delta_rule_fla needs flash-linear-attention (pip install flash-linear-attention), "
            f"which failed to import: {err}"
        )
    if not q.is_cuda:
        raise RuntimeError(f"gated_delta_rule_fla runs on CUDA tensors only, got q on {q.device}")
    B, T, Hk, Hv, dk, dv = _check(q, k, v, g, beta, initial_state)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    scale = dk ** -0.5 if scale is None else scale
    r = Hv // Hk
    dtype = v.dtype
    fn = fused_recurrent_gated_delta_rule if dtype == torch.float32 else chunk_gated_delta_rule
    qx, kx = (x.to(dtype) for x in (q, k))
    if r > 1 and not _fla_gva(fn):
        qx, kx = qx.repeat_interleave(r, dim=2), kx.repeat_interleave(r, dim=2)
    args = dict(
        q=qx.contiguous(), k=kx.contiguous(), v=v.contiguous(), g=g.to(torch.float32).contiguous(),
        beta=beta.to(dtype).contiguous(), scale=scale, output_final_state=True,
        initial_state=None if initial_state is None else initial_state.to(torch.float32).contiguous(),
    )
    if "head_first" in inspect.signature(fn).parameters:
        args["head_first"] = False  # some fla releases default to [B, H, T, d]
    with warnings.catch_warnings():
        # fla warns when T < H, guessing a head-first layout; ours is always [B, T, H, d]
        warnings.filterwarnings("ignore", message="Input tensor shape suggests")
        o, final_state = fn(**args)
    return o.to(dtype), final_state.to(torch.float32)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, impl="auto"):
    """Dispatch to one implementation; returns (o [B, T, Hv, dv] in v.dtype, final_state fp32).

    impl: "ref", "chunked", "fla", "step", or "auto" = fla on CUDA when importable and
    T > STEP_MAX_T, else step for T <= STEP_MAX_T, else chunked.
    """
    if impl not in IMPLS:
        raise ValueError(f"gated_delta_rule: impl must be one of {IMPLS}, got {impl!r}")
    T = q.shape[1]
    if impl == "auto":
        if T <= STEP_MAX_T:
            impl = "step"
        elif q.is_cuda and fla_available():
            impl = "fla"
        else:
            impl = "chunked"
    kw = dict(scale=scale, initial_state=initial_state)
    if impl == "ref":
        return gated_delta_rule_ref(q, k, v, g, beta, **kw)
    if impl == "chunked":
        return gated_delta_rule_chunked(q, k, v, g, beta, **kw)
    if impl == "fla":
        return gated_delta_rule_fla(q, k, v, g, beta, **kw)
    if initial_state is None:
        B, Hv, dk, dv = v.shape[0], v.shape[2], k.shape[3], v.shape[3]
        initial_state = _zero_state(B, Hv, dk, dv, v.device)
    return gated_delta_rule_step(q, k, v, g, beta, initial_state, scale=scale)
