"""Multimodal rotary tables: which of the three position streams (t, h, w) drives each rotary column, and the
cos / sin rows 3-D positions select (the positions themselves: :mod:`..media.prompt`).

Rotary (``Qwen3_5TextRotaryEmbedding``, interleaved): of the ``rotary_dim / 2`` frequency columns, column j
follows the h position when ``j % 3 == 1 and j < 3 * section[1]``, the w position when ``j % 3 == 2 and
j < 3 * section[2]``, and the t position otherwise. With equal streams this is exactly 1-D RoPE, so text-only
forwards keep the 1-D tables untouched.
"""

from __future__ import annotations

import torch


def column_axes(rotary_dim: int, section) -> torch.Tensor:
    """Which position stream (0 t, 1 h, 2 w) drives each of the ``rotary_dim`` cos/sin columns ``[rd]``."""
    half = rotary_dim // 2
    axes = []
    for j in range(half):
        if j % 3 == 1 and j < 3 * section[1]:
            axes.append(1)
        elif j % 3 == 2 and j < 3 * section[2]:
            axes.append(2)
        else:
            axes.append(0)
    return torch.tensor(axes + axes)  # rotate-half tables repeat the frequencies in both halves


def mrope_cos_sin(cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, axes: torch.Tensor):
    """cos, sin ``[B, T, rd]`` of 3-D positions ``pos [3, B, T]`` from the 1-D tables ``[max_pos, rd]``."""
    cols = torch.arange(cos.shape[-1], device=cos.device)
    sel = pos[axes.to(pos.device)]  # [rd, B, T]: the position each column reads
    sel = sel.permute(1, 2, 0)  # [B, T, rd]
    return cos[sel, cols], sin[sel, cols]
