"""A request in flight (:class:`Sequence`) and what a finished one returns (:class:`GenerationResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..media.prompt import MediaPrompt
from ..sampling import SamplingParams
from .scoring import PromptScores


@dataclass
class Sequence:
    """One request in flight: its slot, tokens and accounting."""

    slot: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None  # speculative rounds' draws (acceptance, drafting)
    sample_seed: int = 0  # the seed of the request's sampling stream (sampling.sample_rows): params.seed or fresh
    tokens: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose state is in the cache
    finish_reason: str | None = None
    text: str | None = None  # the output cut before a stop string, when one ended it (None: not cut)
    stats: dict = field(default_factory=dict)
    media: MediaPrompt | None = None  # images / videos of the prompt (engine/media/prompt.py)
    logprobs: list = field(default_factory=list)  # with params.logprobs: each token's log-softmax row, fp32 CPU; with
    #                                               params.top_logprobs: (its log-probability, [(id, logprob)] of the
    #                                               N most likely, most likely first) a token (Engine.pick)
    prompt_scores: PromptScores | None = field(default=None, init=False)  # filled by the prefill (scoring.py)
    reference: torch.Tensor | None = None  # replayed acceptance: the plain run's tokens on the device (spec/replay.py)

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:  # the request asks for its prompt's log-probabilities
            self.prompt_scores = PromptScores(self.params.prompt_logprobs)

    @property
    def last(self) -> int:
        return self.tokens[-1] if self.tokens else self.prompt[-1]


@dataclass
class GenerationResult:
    """Tokens and measurements of one generation."""

    tokens: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    ttft_s: float
    device_decode_ms: float
    spec: dict = field(default_factory=dict)
    vision: dict = field(default_factory=dict)  # media requests: encode_ms, tokens, items, cached
    logprobs: list | None = None  # SamplingParams.logprobs: [vocab] fp32 log-softmax rows, one a token;
    #                               top_logprobs: (logprob, [(id, logprob)]) one a token

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)


def keep_logprobs(seq: Sequence, logits: torch.Tensor) -> None:
    """With ``params.logprobs``, keep the log-softmax of the logits the next token of ``seq`` is picked from."""
    if seq.params.logprobs:
        seq.logprobs.append(torch.log_softmax(logits.float(), -1).cpu())
