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


def accept_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix of ``drafts`` equal to the target's argmax, and the target's next token after it."""
    target = logits.argmax(-1)  # [B, K+1]
    match = (drafts == target[:, :-1]).to(torch.int64)
    n_acc = match.cumprod(dim=1).sum(dim=1)  # [B]
    bonus = target.gather(1, n_acc[:, None]).squeeze(1)
    return n_acc, bonus


def keep_counts(drafts: torch.Tensor, n_acc: torch.Tensor, bonus: torch.Tensor, stops: torch.Tensor,
                left: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How many tokens each row of a greedy round keeps, worked out on the device: ``stops [B, S]`` (a row's stop
    ids, padded with -1), ``left [B]`` (the tokens it may still add). Returns (``keep [B]``: the accepted drafts and
    the bonus, cut after the first stop id and at ``left``; ``tokens [B, K+1]``: the round's tokens in order, the bonus
    at position ``n_acc`` and after; ``stopped [B]``: a stop id is among the first ``n_acc + 1``)."""
    k = drafts.shape[1]
    i = torch.arange(k + 1, device=drafts.device)[None]
    block = torch.cat([drafts, bonus[:, None]], dim=1)
    tokens = torch.where(i < n_acc[:, None], block, bonus[:, None])
    count = n_acc + 1
    hit = (tokens[:, :, None] == stops[:, None, :]).any(-1) & (i < count[:, None])
    stopped = hit.any(1)
    first = torch.where(stopped, hit.to(torch.int64).argmax(1) + 1, count)
    return torch.minimum(torch.minimum(count, first), left), tokens, stopped


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
