"""Token selection: greedy, or temperature / top-k / top-p sampling from a seeded generator.

``probs`` gives the distribution a sampler draws from (after temperature, top-k and top-p), so that
speculative rejection sampling can compare target and draft distributions under the same processing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens, and when to stop."""

    max_new_tokens: int = 256  # 0: prefill only (scoring the prompt with prompt_logprobs): nothing generated
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # keep every generated position's log-softmax row (a drafter's rounds keep none)
    prompt_logprobs: int | None = None  # N: each prompt token's log-probability and its N most likely (scoring.py)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be None or a non-negative integer, got {self.prompt_logprobs!r}")
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and -2**63 <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(s for s in self.stop if s)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The sampling distribution ``[..., V]`` (fp32) after temperature, top-k and top-p."""
    x = logits.float() / max(p.temperature, 1e-6)
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    pr = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(pr, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < p.top_p  # always keeps the most likely token
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        pr = pr * keep
        pr = pr / pr.sum(-1, keepdim=True)
    return pr


def select(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits [..., V]``: argmax when greedy, else a draw from :func:`probs`."""
    if p.greedy:
        return logits.argmax(-1)
    pr = probs(logits, p)
    flat = pr.reshape(-1, pr.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(pr.shape[:-1])


def make_generator(seed: int | None, device) -> torch.Generator:
    """A generator seeded with ``seed``, or with a fresh non-deterministic seed of its own when None (without
    reseeding torch's global generator, which the caller may have seeded for its own work)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
