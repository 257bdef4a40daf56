"""Seeded random weights of a config's real shape, built directly on the target device in the chosen formats.

Used for presets (``--model qwen3.8-27b --synthetic``): speed is measured at the real shape without a
54 GB file. Values follow the usual initialisation scales so activations stay finite through every layer.
The values come from the device's own generator: one seed gives the same weights on every run on one kind of
device, but CUDA and CPU draw different numbers (compare devices through an artifact file, not a preset).
"""

from __future__ import annotations

import math

import torch

from ...kernels import quant
from ..model.config import DraftConfig, ModelConfig
from ..model.weights import RawWeight, expected_shapes, text_weight_names
from .convert import weight_format


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


def synthetic_bytes(cfg: ModelConfig, policy: str = "mixed", dense_itemsize: int = 0) -> int:
    """Bytes :func:`synthetic_raws` will hold (the packed weights) plus its peak (its largest tensor in fp32), and
    with ``dense_itemsize`` the dense copies of the matrices a CPU engine then makes at that many bytes a weight."""
    shapes = expected_shapes(cfg)
    names = text_weight_names(cfg)
    packed = sum(quant.nbytes(weight_format(n, shapes[n], policy), shapes[n]) for n in names)
    dense = dense_itemsize * sum(math.prod(shapes[n]) for n in names if len(shapes[n]) == 2)
    return packed + max(4 * math.prod(shapes[n]) for n in names) + dense


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


def preset_draft_config(cfg: ModelConfig, kind: str, mask_token_id: int) -> DraftConfig:
    """A DFlash / DFlash2 drafter shaped for ``cfg``: at the 27B shape the family's drafter (5 layers, block 8,
    taps [5, 19, 33, 47, 61]); for smaller targets two layers tapping evenly spaced target layers, block 16."""
    n = cfg.num_hidden_layers
    big = cfg.hidden_size >= 4096
    layers = 5 if big else 2
    taps = [5, 19, 33, 47, 61] if n == 64 else sorted({round(i * (n - 1) / (layers + 2)) + 1
                                                       for i in range(layers + 1)} - {n})
    hd = 128 if big else max(16, cfg.head_dim)
    heads = max(1, cfg.hidden_size // hd // (1 if big else 2))
    return DraftConfig(kind=kind, num_layers=layers, block_size=8 if big else 16, target_layer_ids=tuple(taps),
                       mask_token_id=mask_token_id, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_attention_heads=heads,
                       num_key_value_heads=max(1, heads // 4) if big else heads, head_dim=hd,
                       rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                       window=(2048 if big else 64) if kind == "dflash2" else 0,
                       candidates=16, scorer_rank=(64 if big else 16) if kind == "dflash2" else 0)


def synthetic_drafter(cfg: ModelConfig, dcfg: DraftConfig, policy: str = "mixed", seed: int = 0,
                      device="cpu") -> dict[str, RawWeight]:
    """Random weights of a block drafter (names under ``{kind}.``), packed like the target's projections."""
    from ..model.dflash import BlockDrafter

    torch.manual_seed(seed)
    net = BlockDrafter(dcfg, cfg.hidden_size, cfg.vocab_size)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1)
    out = {}
    for name, p in net.state_dict().items():
        shape = tuple(p.shape)
        t = _init(name, shape, gen, device) if len(shape) == 2 else 0.05 * torch.randn(shape, generator=gen,
                                                                                      device=device)
        fmt = weight_format(f"model.layers.0.{name}", shape, policy) if len(shape) == 2 else "fp32"
        if name.startswith("selector."):
            fmt = "fp32" if policy == "fp32" else "bf16"
        out[f"{dcfg.kind}.{name}"] = RawWeight(fmt, shape, quant.pack(t, fmt))
    return out
