"""Accepting drafted tokens: greedy argmax matching and rejection sampling, batched over sequences.

Inputs per row b: ``drafts [B, K]``; target logits over the verified block ``[B, K+1, V]`` (position i predicts
the token after block position i); for sampling, the target distributions ``p [B, K+1, V]`` and the draft
distributions ``q [B, K, V]`` after the same temperature / top-k / top-p processing.

Output: ``n_acc [B]`` (accepted drafts, 0..K) and ``bonus [B]`` (the token the target adds after them:
its argmax at position n_acc, or a draw from the normalised residual ``max(0, p - q)`` at the first
rejection, or from ``p`` at K when every draft was accepted). Sampling this way leaves the output
distribution exactly the target's (Leviathan et al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

import torch

from ...kernels import spec_round
from ...kernels.spec_round import greedy_accept_ref
from ...kernels.spec_round import keep_counts_ref as keep_counts

__all__ = ["accept_greedy", "accept_keep", "accept_sampling", "keep_counts"]


def accept_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix of ``drafts`` equal to the target's argmax, and the target's next token after it."""
    return greedy_accept_ref(drafts, logits.argmax(-1))


def accept_keep(drafts: torch.Tensor, logits: torch.Tensor, stops: torch.Tensor, left: torch.Tensor):
    """A greedy round's acceptance and the tokens it keeps, worked out on the device (:func:`accept_greedy`, then
    :func:`keep_counts`): (n_acc, bonus, keep, tokens, stopped). One Triton launch on CUDA
    (kernels/spec_round.accept_keep), the torch reference elsewhere: the same integers."""
    target = logits.argmax(-1)
    if drafts.is_cuda and spec_round.triton_available():
        return spec_round.accept_keep(drafts, target, stops, left)
    return spec_round.accept_keep_ref(drafts, target, stops, left)


def accept_sampling(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                    generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling: accept draft i with probability min(1, p_i(d_i) / q_i(d_i)); resample at the first
    rejection from norm(max(0, p_i - q_i)); when all K are accepted, draw the bonus from p_K."""
    b, k = drafts.shape
    p_d = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [B, K]
    q_d = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.stack([torch.rand(k, generator=g, device=p.device) if g is not None else
                     torch.rand(k, device=p.device) for g in generators])
    ok = (u * q_d < p_d).to(torch.int64)  # u < p/q, written without dividing by q
    n_acc = ok.cumprod(dim=1).sum(dim=1)
    bonus = torch.empty(b, dtype=torch.long, device=p.device)
    for r in range(b):
        i = int(n_acc[r])
        if i == k:
            dist = p[r, k]
        else:
            resid = (p[r, i] - q[r, i]).clamp_min(0)
            total = resid.sum()
            # p == q at this position (the draft was rejected by the coin only): fall back to p
            dist = resid / total if total > 0 else p[r, i]
        bonus[r] = torch.multinomial(dist, 1, generator=generators[r])[0]
    return n_acc, bonus
