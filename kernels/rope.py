"""Partial rotary position embedding (NeoX rotate-half on the first ``rotary_dim`` dims of each head).

Text-only mRoPE of Qwen3.5 reduces to this 1-D form: the three position streams are equal for text.
"""

from __future__ import annotations

import torch


def rope_tables(rotary_dim: int, theta: float, max_pos: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables ``[max_pos, rotary_dim]`` in fp32 (each half repeated, as rotate-half needs)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float().to(device), emb.sin().float().to(device)


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, H, hd]``, cos/sin ``[B, T, rd]``: rotate the first rd dims; fp32 math, returns x.dtype."""
    rd = cos.shape[-1]
    xf = x.float()
    rot, rest = xf[..., :rd], xf[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat([rot * c + rotated * s, rest], dim=-1).to(x.dtype)


apply_rope = apply_rope_ref
