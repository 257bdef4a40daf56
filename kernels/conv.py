"""Depthwise causal conv1d of the Gated DeltaNet mixer (kernel width 4, SiLU in the models).

Layout: x [B, T, C] (token-major, as it comes out of `in_proj_qkv`), weight [C, W] (Hugging Face
stores [C, 1, W]; the caller squeezes it), conv state [B, C, W-1] = the last W-1 inputs seen, oldest
first (the layout of HF's `conv_states` and of the causal-conv1d package).

    y_t[c] = act(sum_j weight[c, j] * xx[t + j, c]),  xx = cat(state, x) along time

`causal_conv1d_ref` is the plain fp32 reference; `causal_conv1d` is the fast torch version with the
same signature; `causal_conv1d_states` gives the state after every position (speculative rollback).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_ref", "causal_conv1d", "causal_conv1d_states", "causal_conv1d_state_at"]

_ACTIVATIONS = ("silu", None)

def _check(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None, activation) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x must be [B, T, C], got shape {tuple(x.shape)}")
    B, _, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 2:
        raise ValueError(f"causal_conv1d: weight must be [C={C}, W >= 2], got shape {tuple(weight.shape)}")
    W = weight.shape[1]
    if state is not None and tuple(state.shape) != (B, C, W - 1):
        raise ValueError(
            f"causal_conv1d: state must be [B, C, W-1] = {(B, C, W - 1)}, got shape {tuple(state.shape)}"
        )


def _padded_input(x: torch.Tensor, state: torch.Tensor | None, W: int) -> torch.Tensor:
    """xx = cat(state, x) along time, fp32, [B, W-1+T, C]."""
    B, _, C = x.shape
    if state is None:
        head = x.new_zeros(B, W - 1, C, dtype=torch.float32)
    else:
        head = state.to(torch.float32).transpose(1, 2)
    return torch.cat([head, x.to(torch.float32)], dim=1)


def _new_state(xx: torch.Tensor, x: torch.Tensor, state: torch.Tensor | None, W: int) -> torch.Tensor:
    """The last W-1 inputs of xx as [B, C, W-1], in the state's dtype (x's when there was none)."""
    dtype = state.dtype if state is not None else x.dtype
    return xx[:, xx.shape[1] - (W - 1):].transpose(1, 2).to(dtype).contiguous()


def _activate(y: torch.Tensor, activation) -> torch.Tensor:
    return F.silu(y) if activation == "silu" else y


def causal_conv1d_ref(x, weight, state=None, *, activation="silu"):
    """Depthwise causal conv, plain fp32 reference.

    x [B, T, C]; weight [C, W]; state [B, C, W-1] = the last W-1 inputs before x (zeros if None).
    Returns (y [B, T, C] in x.dtype, new_state [B, C, W-1] = last W-1 inputs of cat(state, x)).
    """
    _check(x, weight, state, activation)
    T = x.shape[1]
    W = weight.shape[1]
    xx = _padded_input(x, state, W)  # [B, W-1+T, C]
    w = weight.to(torch.float32)  # [C, W]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(W):
        y = y + w[:, j] * xx[:, j:j + T]
    return _activate(y, activation).to(x.dtype), _new_state(xx, x, state, W)


def causal_conv1d_states(x, weight, state=None):
    """The conv state after each of the T positions: [B, T, C, W-1] (same dtype rule as new_state).

    states[:, t] is the `new_state` that `causal_conv1d` returns for x[:, :t+1]; states[:, -1] is the
    new_state of the whole call. Used to roll the conv state back to any accepted draft position.
    """
    _check(x, weight, state, None)
    W = weight.shape[1]
    dtype = state.dtype if state is not None else x.dtype
    if state is None:
        head = x.new_zeros(x.shape[0], W - 1, x.shape[2], dtype=dtype)
    else:
        head = state.to(dtype).transpose(1, 2)
    xx = torch.cat([head, x.to(dtype)], dim=1)  # [B, W-1+T, C], exact copies of the inputs
    # window i of length W-1 starts at xx[i]; the state after position t is window t+1
    return xx.unfold(1, W - 1, 1)[:, 1:].contiguous()  # [B, T, C, W-1]


def causal_conv1d_state_at(x, state, n):
    """The conv state after the first ``n [B]`` positions of each row of ``x [B, T, C]`` (0 <= n <= T), from
    ``state [B, C, W-1]`` before them: [B, C, W-1] in the state's dtype, equal to `causal_conv1d`'s new state of
    ``x[:, :n]``. For a row padded past its real tokens (a captured prefill's fixed length)."""
    B, T, C = x.shape
    keep = state.shape[-1]
    # the W-1 inputs before position n are rows n .. n + W-2 of cat(state^T, x): gathered from each side (no copy of
    # the whole chunk, which a captured prefill would pay on every layer), exact copies of the inputs
    if T == 0:  # (n is 0: the state before them)
        return state.clone(memory_format=torch.contiguous_format)
    idx = n.to(torch.long)[:, None] + torch.arange(keep, device=x.device)[None]  # [B, W-1]
    from_x = x.gather(1, (idx - keep).clamp(0, T - 1)[:, :, None].expand(B, keep, C))
    from_state = state.gather(2, idx.clamp(max=keep - 1)[:, None, :].expand(B, C, keep))  # [B, C, W-1]
    return torch.where((idx >= keep)[:, None, :], from_x.to(state.dtype).transpose(1, 2), from_state).contiguous()


def causal_conv1d(x, weight, state=None, *, activation="silu", return_states=False):
    """Fast torch depthwise causal conv; same signature and outputs as `causal_conv1d_ref`.

    fp32 math: grouped F.conv1d on CUDA, W in-place multiply-adds on CPU. With return_states=True
    also returns `causal_conv1d_states(x, weight, state)` as a third output.
    """
    _check(x, weight, state, activation)
    B, T, C = x.shape
    W = weight.shape[1]
    xx = _padded_input(x, state, W)  # [B, W-1+T, C]
    w = weight.to(torch.float32)
    if x.is_cuda:
        y = F.conv1d(xx.transpose(1, 2), w.unsqueeze(1), groups=C).transpose(1, 2)  # [B, T, C]
        y = _activate(y, activation)
    else:
        # On CPU torch's grouped conv1d is slower than W fused multiply-adds into one buffer
        # (about 2x for C = 10240, T = 512..2048 on a 2-core Xeon) and no faster for decode.
        y = xx[:, :T] * w[:, 0]
        for j in range(1, W):
            y.addcmul_(xx[:, j:j + T], w[:, j])
        if activation == "silu":
            F.silu(y, inplace=True)
    y = y.to(x.dtype)
    new_state = _new_state(xx, x, state, W)
    if return_states:
        return y, new_state, causal_conv1d_states(x, weight, state)
    return y, new_state
