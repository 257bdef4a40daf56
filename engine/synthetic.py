"""Seeded random weights of a config's real shape, built directly on the target device in the chosen formats.

Used for presets (``--model qwen3.8-27b --synthetic``): speed is measured at the real shape without a
54 GB file. Values follow the usual initialisation scales so activations stay finite through every layer.
"""

from __future__ import annotations

import math

import torch

from . import quant
from .config import ModelConfig
from .convert import weight_format
from .weights import RawWeight, expected_shapes, text_weight_names


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log_()
    if name.endswith("dt_bias"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.05 * torch.randn(shape, generator=gen, device=device)
    if len(shape) == 1:  # zero-centred norms
        return 0.05 * torch.randn(shape, generator=gen, device=device)
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, generator=gen, device=device) / math.sqrt(shape[-1])
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen, device=device)
    return torch.randn(shape, generator=gen, device=device) / math.sqrt(shape[-1])


def synthetic_tensors(cfg: ModelConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """fp32 random weights of every text (and MTP) tensor of ``cfg``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    shapes = expected_shapes(cfg)
    return {n: _init(n, shapes[n], gen, device) for n in text_weight_names(cfg)}


def synthetic_raws(cfg: ModelConfig, policy: str = "mixed", seed: int = 0, device="cpu",
                   progress=None) -> dict[str, RawWeight]:
    """Random weights packed in ``policy``'s formats, one tensor at a time (peak memory: one fp32 tensor)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    shapes = expected_shapes(cfg)
    names = text_weight_names(cfg)
    out = {}
    for i, n in enumerate(names):
        t = _init(n, shapes[n], gen, device)
        fmt = weight_format(n, shapes[n], policy)
        out[n] = RawWeight(fmt, shapes[n], quant.pack(t, fmt))
        del t
        if progress:
            progress(i + 1, len(names), n)
    return out
