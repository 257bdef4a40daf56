"""Causal GQA attention of T new queries against a slot's cached keys/values.

Query ``t`` of batch row ``b`` sits at position ``q_pos[b, t]`` and sees keys ``0 .. q_pos[b, t]``
(the cache already holds the new tokens' keys). Shapes: q ``[B, T, H, hd]``, k/v ``[B, Hkv, L, hd]``,
output ``[B, T, H, hd]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _mask(q_pos: torch.Tensor, length: int) -> torch.Tensor:
    # [B, 1, T, L]: key j visible to query t iff j <= q_pos[b, t]
    j = torch.arange(length, device=q_pos.device)
    return (j.view(1, 1, 1, length) <= q_pos[:, None, :, None])


def attention_ref(q, k, v, q_pos, scale: float) -> torch.Tensor:
    """Plain fp32 softmax attention (the reference)."""
    rep = q.shape[2] // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)  # [B, H, L, hd]
    vf = v.float().repeat_interleave(rep, dim=1)
    s = torch.einsum("bthd,bhld->bhtl", q.float(), kf) * scale
    s = s.masked_fill(~_mask(q_pos, k.shape[2]), float("-inf"))
    o = torch.einsum("bhtl,bhld->bthd", torch.softmax(s, dim=-1), vf)
    return o.to(q.dtype)


# Query rows up to which a GQA group rides as extra query rows of its KV head (no K/V copy); past it the K/V heads
# are repeated instead (a folded mask of group x T x L elements would outgrow the repeated K/V)
FOLD_ROWS = 64


def sdpa(q, k, v, mask, scale: float, group: str = "auto") -> torch.Tensor:
    """Masked grouped-query SDPA: q ``[B, H, T, hd]``, k/v ``[B, Hkv, L, hd]`` in q's dtype, boolean ``mask``
    ``[B, 1, T, L]`` (True = visible) -> ``[B, H, T, hd]``.

    On a GPU torch would pick cuDNN for a masked GQA call, and cuDNN builds an execution plan for every new shape:
    42.5 ms for each new key length against 0.07 ms a call once built (H200, ``scripts/probe_sdpa.py``), paid at every
    step of an eager decode and at every prefill chunk. So on CUDA the call runs the memory-efficient (or math)
    kernel, which has no GQA support: the group is folded into the query rows (``group="fold"``, T x group up to
    ``FOLD_ROWS``) or the K/V heads are repeated (``"expand"``); ``"auto"`` picks between the two, ``"native"`` is
    torch's own ``enable_gqa`` choice (kept for the probe). On a CPU ``auto`` is torch's ``enable_gqa`` call.
    """
    if group not in ("auto", "fold", "expand", "native"):
        raise ValueError(f"sdpa: group must be auto, fold, expand or native, not {group!r}")
    if group == "native" or (group == "auto" and not q.is_cuda):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    b, h, t, hd = q.shape
    hkv, length = k.shape[1], k.shape[2]
    rep = h // hkv
    if group == "auto":
        group = "fold" if rep * t <= FOLD_ROWS else "expand"
    with sdpa_kernel(_NO_CUDNN):
        if rep == 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        if group == "fold":  # query head j = kv head j // rep: rows r * T + t of kv head j // rep
            mb = mask.shape[0]
            fm = mask.expand(mb, 1, t, length)[:, :, None].expand(mb, 1, rep, t, length).reshape(mb, 1, rep * t, length)
            o = F.scaled_dot_product_attention(q.reshape(b, hkv, rep * t, hd), k, v, attn_mask=fm, scale=scale)
            return o.reshape(b, h, t, hd)
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                              attn_mask=mask, scale=scale)


_NO_CUDNN = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def rows_bias(mask: torch.Tensor, rep: int) -> torch.Tensor:
    """:func:`sdpa_rows`' additive form of a boolean ``mask [B, 1, T, L]`` (True = visible) for ``rep`` query heads a
    key head: fp32 ``[B, 1, rep * T, L]``, 0 where visible and -inf where not, row ``r * T + i`` query row i's. Made
    once, it serves every layer of a drafter's block."""
    b, _, t, length = mask.shape
    return torch.where(mask.expand(b, 1, t, length).repeat(1, 1, rep, 1), 0.0, float("-inf"))


def sdpa_rows(q, k, v, mask, scale: float) -> torch.Tensor:
    """:func:`sdpa` for a few query rows against many keys (a drafter's block against its context): two batched
    matmuls and a softmax in fp32, the group folded into the query rows. torch's fused kernels give such a call one
    program per head (a 27B drafter layer, 8 queries x 4 groups against 2,056 keys: 10 programs, about 90 us on an
    H200). Same shapes as :func:`sdpa`, or ``mask`` already in :func:`rows_bias`' form; every query row must see at
    least one key."""
    b, h, t, hd = q.shape
    hkv = k.shape[1]
    rep = h // hkv
    bias = mask if mask.is_floating_point() else rows_bias(mask, rep)
    s = torch.matmul(q.reshape(b, hkv, rep * t, hd), k.transpose(-1, -2))  # [B, Hkv, rep*T, L]
    p = torch.softmax(torch.add(bias, s, alpha=scale), dim=-1).to(v.dtype)  # fp32: the bias + scale * s
    return torch.matmul(p, v).reshape(b, h, t, hd)


def ends_at_length(q_pos: torch.Tensor, length: int) -> bool:
    """Whether every row's T > 1 queries are the last T positions of the ``length`` keys (``length - T .. length -
    1``): a chunk whose mask is causal from the bottom-right corner (plain causal where T == length: a prompt's first
    chunk). A host comparison: for CPU tensors only (on a GPU it would wait for the device)."""
    t = q_pos.shape[1]
    return 1 < t <= length and bool((q_pos == torch.arange(length - t, length, device=q_pos.device)).all())


_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _past_and_own(q, k, v, scale: float) -> torch.Tensor | None:
    """A CPU chunk's attention over its past keys and its own (``q [B, H, T, hd]`` are the last T of the ``L`` keys
    in ``k / v [B, Hkv, L, hd]``) in two calls of torch's CPU flash kernel, merged by their log-sum-exps in fp32: the
    past with no mask (the group folded into the query rows), the chunk's own block causal. None where the kernel is
    missing or refuses the call (the caller then takes the masked call)."""
    if _cpu_flash is None:
        return None
    b, h, t, hd = q.shape
    hkv, length = k.shape[1], k.shape[2]
    rep, past = h // hkv, length - t
    try:
        o1, l1 = _cpu_flash(q.reshape(b, hkv, rep * t, hd), k[:, :, :past], v[:, :, :past], scale=scale)[:2]
        own_k, own_v = (x[:, :, past:].repeat_interleave(rep, dim=1) for x in (k, v))
        o2, l2 = _cpu_flash(q, own_k, own_v, is_causal=True, scale=scale)[:2]
    except (RuntimeError, NotImplementedError):
        return None
    l1, l2 = l1.reshape(b, h, t, 1).float(), l2.reshape(b, h, t, 1).float()
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    o = (o1.reshape(b, h, t, hd).float() * w1 + o2.float() * w2) / (w1 + w2)
    return o.to(q.dtype)


def attention(q, k, v, q_pos, scale: float, prefill: bool = False) -> torch.Tensor:
    """:func:`sdpa` with an explicit causal-offset mask (q ``[B, T, H, hd]`` -> ``[B, T, H, hd]``).

    On a CPU, two kinds of ``prefill`` chunk skip the mask. A chunk from position 0 that is all the keys (a prompt's
    first chunk) is plain causal: torch's ``is_causal`` kernel skips the masked half of the products and builds no
    ``[T, L]`` mask (2,048 tokens of the bundled model: 48 against 91 ms a layer, the same values). A chunk that is
    the last T of the keys (a later chunk of a prompt) goes through :func:`_past_and_own`. Decode steps and verifies
    (``prefill`` False) keep the masked call, so a verify's rows give the single steps' bits."""
    qh, k, v = q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype)  # [B, H, T, hd]; the keys in the queries' dtype
    if prefill and not q.is_cuda and ends_at_length(q_pos, k.shape[2]):
        if q.shape[1] == k.shape[2]:  # no past: one causal call
            return F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=True).transpose(1, 2)
        o = _past_and_own(qh.contiguous(), k, v, scale)
        if o is not None:
            return o.transpose(1, 2)
    return sdpa(qh, k, v, _mask(q_pos, k.shape[2]), scale).transpose(1, 2)
