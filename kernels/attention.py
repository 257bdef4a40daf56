"""Causal GQA attention of T new queries against a slot's cached keys/values.

Query ``t`` of batch row ``b`` sits at position ``q_pos[b, t]`` and sees keys ``0 .. q_pos[b, t]``
(the cache already holds the new tokens' keys). Shapes: q ``[B, T, H, hd]``, k/v ``[B, Hkv, L, hd]``,
output ``[B, T, H, hd]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _mask(q_pos: torch.Tensor, length: int) -> torch.Tensor:
    # [B, 1, T, L]: key j visible to query t iff j <= q_pos[b, t]
    j = torch.arange(length, device=q_pos.device)
    return (j.view(1, 1, 1, length) <= q_pos[:, None, :, None])


def attention_ref(q, k, v, q_pos, scale: float) -> torch.Tensor:
    """Plain fp32 softmax attention (the reference)."""
    b, t, h, hd = q.shape
    rep = h // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)  # [B, H, L, hd]
    vf = v.float().repeat_interleave(rep, dim=1)
    s = torch.einsum("bthd,bhld->bhtl", q.float(), kf) * scale
    s = s.masked_fill(~_mask(q_pos, k.shape[2]), float("-inf"))
    o = torch.einsum("bhtl,bhld->bthd", torch.softmax(s, dim=-1), vf)
    return o.to(q.dtype)


def attention(q, k, v, q_pos, scale: float) -> torch.Tensor:
    """torch SDPA with an explicit causal-offset mask and grouped KV heads."""
    qh = q.transpose(1, 2)  # [B, H, T, hd]
    o = F.scaled_dot_product_attention(qh, k.to(q.dtype), v.to(q.dtype), attn_mask=_mask(q_pos, k.shape[2]),
                                       scale=scale, enable_gqa=True)
    return o.transpose(1, 2)
