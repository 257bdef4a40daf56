"""The int8 K/V cache format that the attention kernels read and write: int8 codes of each token's head vector and one
fp16 scale per ``KV_GROUP`` (64) contiguous values (symmetric, ``scale = fp16(max(amax / 127, 1e-8))``). The cache's
layout around it (slots, heads, capacity) is :mod:`ninfer_bench.engine.model.cache`'s."""

from __future__ import annotations

import torch

KV_GROUP = 64  # values per fp16 scale in the int8 KV cache


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and fp16 scales of ``x [..., hd]``, one scale per 64 contiguous values along hd."""
    hd = x.shape[-1]
    groups = (hd + KV_GROUP - 1) // KV_GROUP
    pad = groups * KV_GROUP - hd
    xf = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    xg = xf.reshape(*x.shape[:-1], groups, KV_GROUP)
    scale = (xg.abs().amax(-1) / 127.0).clamp_min(1e-8).to(torch.float16)
    q = torch.round(xg / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(*x.shape[:-1], groups * KV_GROUP)[..., :hd], scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_kv`: ``q [..., hd]`` int8, ``scale [..., groups]`` -> ``dtype``."""
    hd = q.shape[-1]
    s = scale.to(dtype).repeat_interleave(KV_GROUP, dim=-1)[..., :hd]
    return q.to(dtype) * s
