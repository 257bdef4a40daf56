"""An RMSNorm left in two pieces by the projection before it, for the projections after it to finish.

Between two layers of the decode step the residual add and the next RMSNorm used to be a kernel of their own
(``fused.add_rms_norm``): one more launch on the critical path, 129 of them a 27B step. With ``norm_epilogue`` the
projection that ends a residual branch (attention's o_proj, GDN's out_proj, the MLP's down_proj) stores, in qmv's
RES epilogue, the new residual ``r``, ``xs = r * (1 + w)`` and the sums of ``r^2`` over each 16 columns; the
projections that read the norm (qmv's NORM build) add those partial sums up and scale their own fp32 sums by
``rsqrt(mean(r^2) + eps)`` - the RMSNorm's factor, which is one scalar a token and so can come after the
multiplication. A reader that does not run qmv takes :meth:`Prenormed.dense`, the norm's output as a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Prenormed:
    """``rms_norm(r) = xs * rsqrt(part.sum(-1) / N + eps)`` per token: ``xs [..., N]`` in the activation dtype,
    ``part [tokens, N / 16]`` fp32 (kernels/qmv_cuda.add_norm)."""

    xs: torch.Tensor
    part: torch.Tensor
    eps: float

    @property
    def shape(self) -> torch.Size:
        return self.xs.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.xs.dtype

    @property
    def device(self) -> torch.device:
        return self.xs.device

    @property
    def is_cuda(self) -> bool:
        return self.xs.is_cuda

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``xs`` as ``[tokens, N]`` (contiguous) and ``part``."""
        return self.xs.reshape(-1, self.xs.shape[-1]).contiguous(), self.part

    def dense(self) -> torch.Tensor:
        """The norm's output as a tensor (fp32 math, rounded to the activation dtype). Made anew by each reader that
        asks (readers may run on different streams of a CUDA graph)."""
        xs, part = self.rows()
        inv = torch.rsqrt(part.sum(-1, keepdim=True) / xs.shape[-1] + self.eps)
        return (xs.float() * inv).to(xs.dtype).reshape(self.xs.shape)


def dense(x):
    """``x`` as a tensor: a :class:`Prenormed` finished, anything else as it is."""
    return x.dense() if isinstance(x, Prenormed) else x


def project(x: Prenormed, qw, act: bool = False) -> torch.Tensor | None:
    """``x``'s projection by the qmv weight ``qw`` (qmv's NORM build: the norm's scale goes on the sums), ``[...,
    N]`` (``act``: ``silu(gate) * up``, ``[..., N / 2]``); None where that kernel does not run for x."""
    from . import qmv_cuda
    from .qlinear import MAX_KERNEL_ROWS

    xs, part = x.rows()
    if qw is None or not (xs.is_cuda and xs.shape[0] <= MAX_KERNEL_ROWS and qmv_cuda.prenorm_supported(qw.k)
                          and qmv_cuda.supports(xs[:qmv_cuda.MAX_T], qw)):
        return None
    y = qmv_cuda.qmv_rows(xs, qw, act=act, prenorm=(part, x.eps))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def add_norm(x: torch.Tensor, qw, residual: torch.Tensor, w1: torch.Tensor, eps: float
             ) -> tuple[Prenormed, torch.Tensor] | None:
    """``(rms_norm(residual + x @ W.T) as a Prenormed, the new residual)`` through qmv's RES epilogue (``w1``:
    1 + the norm's weight, fp32), or None where that kernel does not run for x (bf16 only)."""
    from . import qmv_cuda
    from .qlinear import MAX_KERNEL_ROWS

    x2 = x.reshape(-1, x.shape[-1])
    if qw is None or not (x2.is_cuda and x.dtype == torch.bfloat16 and x2.shape[0] <= MAX_KERNEL_ROWS
                          and residual.shape == (*x.shape[:-1], qw.n) and residual.dtype == x.dtype
                          and qmv_cuda.prenorm_supported(qw.n)):
        return None
    x2 = x2.contiguous()
    if not qmv_cuda.supports(x2[:qmv_cuda.MAX_T], qw):
        return None
    xs, r, part = qmv_cuda.add_norm_rows(x2, qw, residual.reshape(-1, qw.n).contiguous(), w1)
    return Prenormed(xs.reshape(residual.shape), part, eps), r.reshape(residual.shape)
