"""Prompt log-probabilities (OpenAI completions' ``echo`` with ``logprobs``, loglikelihood evaluations): each
prompt token's log-probability given the tokens before it, and the ``top`` most likely tokens of its position.

They are made as the prompt is prefilled (:meth:`.runtime.Engine.prefill_step`), chunk by chunk, and kept compact
on the device: a chunk's logits go through log-softmax ``SCORE_ROWS`` rows at a time and only ``[t, top]`` ids and
values and the prompt tokens' own log-probabilities stay, never ``[T, V]`` rows (8K tokens x 248K vocabulary in
fp32 would be 8 GB). The last chunk moves them to the host (an eager prefill: no captured graph waits on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SCORE_ROWS = 256  # logits rows in log-softmax at a time: 256 x 248K fp32 is 254 MB per temporary


@dataclass(slots=True)
class PromptScores:
    """The scores of prompt tokens ``1 ..`` (token 0 has no context, so none), in prompt order, once
    :meth:`finish` ran: ``own [T-1]`` each token's log-probability, ``ids`` / ``values [T-1, top]`` its position's
    ``top`` most likely tokens, most likely first (host tensors)."""

    top: int
    scored: int = 0  # prompt positions whose rows were scored (the next chunk starts there)
    pieces: list = field(default_factory=list)  # (own, ids, values) of each block of rows, on the device
    own: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def add(self, logits, hidden: torch.Tensor, start: int, targets: torch.Tensor) -> None:
        """Score a prefilled chunk: ``hidden [t, H]`` of prompt positions ``start ..``; ``targets [n]`` the prompt
        tokens after its first ``n`` positions (n = t, or t - 1 for the last chunk, whose last row predicts the
        first generated token); ``logits`` the model's lm_head (hidden -> fp32 logits)."""
        if start != self.scored:  # a cached prefix (a session) was not prefilled: its rows were never computed
            raise ValueError(f"prompt scores need the whole prompt prefilled, but a chunk starts at {start} "
                             f"after {self.scored} scored positions")
        for r0 in range(0, targets.shape[0], SCORE_ROWS):
            tgt = targets[r0:r0 + SCORE_ROWS]
            logp = torch.log_softmax(logits(hidden[r0:r0 + tgt.shape[0]]), dim=-1)  # [r, V] fp32
            best = logp.topk(min(self.top, logp.shape[-1]), dim=-1)
            self.pieces.append((logp.gather(-1, tgt[:, None])[:, 0], best.indices, best.values))
        self.scored += hidden.shape[0]

    def finish(self) -> None:
        """After the last chunk: the pieces joined, on the host."""
        empty = (torch.empty(0), torch.empty(0, self.top, dtype=torch.long), torch.empty(0, self.top))
        own, ids, values = zip(*self.pieces) if self.pieces else ([t] for t in empty)
        self.own, self.ids, self.values = (torch.cat(parts).cpu() for parts in (own, ids, values))
        self.pieces = []

    def rows(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """``(own log-probability, [(id, log-probability)] * top)`` of prompt tokens ``1 ..`` (after finish)."""
        own, ids, values = self.own.tolist(), self.ids.tolist(), self.values.tolist()
        return [(lp, list(zip(i, v))) for lp, i, v in zip(own, ids, values)]
