"""An RMSNorm left to the projections that read it.

Between two layers of the decode step the residual add and the next RMSNorm used to be a kernel of their own
(``fused.add_rms_norm``): one more launch on the critical path, 129 of them a 27B step. With ``norm_epilogue`` the
projection that ends a residual branch (attention's o_proj, GDN's out_proj, the MLP's down_proj) adds its output to
the residual stream as it stores it (qmv's ``residual``), and the projections that read the norm take the stream
itself (qmv's ``norm``): each block sums r^2 on the tensor cores as it streams its weight, multiplies r by
``1 + w`` on the way into the projection and scales its sums by ``rsqrt(mean(r^2) + eps)`` at the end - the norm's
factor is one scalar a token, so it can come after the multiplication. A reader that does not run qmv takes
:meth:`Prenormed.dense`, the norm's output from ``fused.rms_norm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Prenormed:
    """``rms_norm(r)`` by the zero-centred weight ``weight`` (fp32 ``[N]``), not yet computed: ``r [..., N]`` the
    residual stream, ``w1`` = 1 + weight in r's dtype, zero-padded to a multiple of 64 (qmv's ``norm``)."""

    r: torch.Tensor
    weight: torch.Tensor
    w1: torch.Tensor
    eps: float

    @property
    def shape(self) -> torch.Size:
        return self.r.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.r.dtype

    @property
    def device(self) -> torch.device:
        return self.r.device

    @property
    def is_cuda(self) -> bool:
        return self.r.is_cuda

    def dense(self) -> torch.Tensor:
        """The norm's output as a tensor (``fused.rms_norm``: the bits the unsplit path computes). Made anew by each
        reader that asks (readers may run on different streams of a CUDA graph)."""
        from . import fused

        return fused.rms_norm(self.r, self.weight, self.eps)


def norm_w1(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``1 + weight`` in ``dtype``, zero-padded to a multiple of 64 (any reader's padded K)."""
    from .qmv_cuda import norm_weight

    return norm_weight(weight, -(-weight.numel() // 64) * 64, dtype)


def project(x: Prenormed, qw, act: bool = False) -> torch.Tensor | None:
    """``rms_norm(x.r)``'s projection by the qmv weight ``qw`` ``[..., N]`` (``act``: ``silu(gate) * up``,
    ``[..., N / 2]``) through qmv's ``norm``; None where that kernel does not run for x."""
    from . import qmv_cuda
    from .qlinear import MAX_KERNEL_ROWS

    r2 = x.r.reshape(-1, x.r.shape[-1])
    if qw is None or not (r2.is_cuda and r2.shape[0] <= MAX_KERNEL_ROWS and x.w1.numel() >= qw.kp):
        return None
    r2 = r2.contiguous()
    if not qmv_cuda.supports(r2[:qmv_cuda.MAX_T], qw):
        return None
    y = qmv_cuda.qmv_rows(r2, qw, act=act, norm=(x.w1, x.eps))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def add_residual(x: torch.Tensor, qw, residual: torch.Tensor) -> torch.Tensor | None:
    """``residual + x @ W.T`` (the product rounded as stored, then the sum) through qmv's ``residual``, or None
    where that kernel does not run for x (bf16 only: an fp16 stream is left to the norm kernel)."""
    from . import qmv_cuda
    from .qlinear import MAX_KERNEL_ROWS

    x2 = x.reshape(-1, x.shape[-1])
    if qw is None or not (x2.is_cuda and x.dtype == torch.bfloat16 and x2.shape[0] <= MAX_KERNEL_ROWS
                          and residual.shape == (*x.shape[:-1], qw.n) and residual.dtype == x.dtype):
        return None
    x2 = x2.contiguous()
    if not qmv_cuda.supports(x2[:qmv_cuda.MAX_T], qw):
        return None
    r = qmv_cuda.qmv_rows(x2, qw, residual=residual.reshape(-1, qw.n).contiguous())
    return r.reshape(residual.shape)
