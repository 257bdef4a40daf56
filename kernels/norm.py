"""RMSNorm variants of the family, fp32 math.

- ``rms_norm``: zero-centred, ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` (decoder, q/k norms, MTP norms).
- ``gated_rms_norm``: per GDN head, ``w * rmsnorm(o) * silu(z)`` (plain ``w``, not ``1 + w``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 reference of the zero-centred RMSNorm over the last dim; returns x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return y.to(x.dtype)


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 reference of the gated RMSNorm over the last dim (one GDN head); returns x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y * F.silu(z.float())).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm (torch's fused rms_norm in fp32 where available)."""
    w1 = 1.0 + weight.float()
    return F.rms_norm(x.float(), (x.shape[-1],), w1, eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm: ``weight * rmsnorm(x) * silu(z)``."""
    y = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return (y * F.silu(z.float())).to(x.dtype)
