"""Drafter training data from the target's own greedy continuations (self-distillation data, as DFlash and EAGLE
regenerate their training sets with the target).

Why: a drafted token ``i`` of a round is accepted only when tokens ``1 .. i - 1`` were, so the token it must equal
is the target's greedy token after the target's *own* greedy tokens. Labels taken along corpus text (the target's
argmax at each corpus position) equal that only where the corpus happens to follow the target's greedy path; past
the first block position they are often another path's tokens. A rollout row is ``[corpus prefix of P tokens,
the target's G greedy tokens after it]``: the drafters are trained only on anchors in the generated part, where
every label is the greedy continuation of the tokens before it, and the context they read is the kind of text a
greedy decode produces (the round's anchor is always a token the target generated).

:func:`generate` makes rows in batches of one prefix length each (no padding: transformers' ``generate``, greedy,
the end-of-text token not stopping a row, as ``ignore_eos`` decoding) until a time budget runs out;
:class:`RolloutBatches` serves them to ``drafters.train`` with ``first_anchor`` = the prefix length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class RolloutOptions:
    rows: int  # rows generated together (one prefix length per batch)
    new_tokens: int  # G: greedy tokens after each prefix
    prefix: tuple[int, int]  # P drawn uniformly from this range (inclusive) for each batch
    budget_s: float
    max_batches: int | None = None

    def __post_init__(self) -> None:
        lo, hi = self.prefix
        if self.rows < 1 or self.new_tokens < 2 or not 1 <= lo <= hi or self.budget_s <= 0:
            raise ValueError(f"rollouts: bad rows {self.rows}, new tokens {self.new_tokens}, prefix {self.prefix} "
                             f"or budget {self.budget_s}")


@torch.inference_mode()
def generate(model, stream: np.ndarray, opts: RolloutOptions, device, seed: int, log=None) -> dict:
    """Rollout rows from random windows of ``stream`` (the training token stream): ``{"chunks": [(P, rows [R, P +
    G] int32)], "facts": {...}}``. Stops before a batch that would not finish inside the budget (estimated from
    the batch before); always makes at least one batch."""
    lo, hi = opts.prefix
    if len(stream) <= hi + 1:
        raise ValueError(f"token stream of {len(stream)} tokens is too short for prefixes of up to {hi}")
    rng = np.random.default_rng(seed)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    model.eval()
    chunks, t0, last = [], time.perf_counter(), 0.0
    while True:
        p = int(rng.integers(lo, hi + 1))
        starts = rng.integers(0, len(stream) - p, size=opts.rows)
        prefix = torch.from_numpy(np.stack([stream[s:s + p] for s in starts]).astype(np.int64)).to(device)
        tb = time.perf_counter()
        with amp:
            out = model.generate(prefix, max_new_tokens=opts.new_tokens, min_new_tokens=opts.new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        rows = out.to(torch.int32).cpu().numpy()
        if rows.shape != (opts.rows, p + opts.new_tokens):
            raise RuntimeError(f"rollouts: generate returned {rows.shape}, wanted {(opts.rows, p + opts.new_tokens)}")
        chunks.append((p, rows))
        last = time.perf_counter() - tb
        done = time.perf_counter() - t0
        if log is not None:
            log({"phase": "rollouts", "step": len(chunks), "prefix": p, "rows": opts.rows,
                 "new_tokens": opts.new_tokens, "batch_s": round(last, 2), "elapsed": round(done, 2)})
        if (opts.max_batches is not None and len(chunks) >= opts.max_batches) or done + 1.1 * last > opts.budget_s:
            break
    seconds = time.perf_counter() - t0
    generated = sum(r.shape[0] for _, r in chunks) * opts.new_tokens
    return {"chunks": chunks,
            "facts": {"batches": len(chunks), "rows": sum(r.shape[0] for _, r in chunks),
                      "rows_per_batch": opts.rows, "new_tokens": opts.new_tokens, "prefix": list(opts.prefix),
                      "generated_tokens": generated, "seconds": round(seconds, 1),
                      "tok_s": round(generated / seconds, 1), "seed": seed}}


class RolloutBatches:
    """``[batch, P + G]`` rows from one rollout chunk at a time (chunks drawn in proportion to their rows, rows
    without replacement within a chunk until it is used up); ``first_anchor`` is that chunk's ``P``, the first
    position a drafter block may be anchored at (the first generated token)."""

    def __init__(self, chunks: list[tuple[int, np.ndarray]], batch: int, seed: int):
        if not chunks:
            raise ValueError("no rollout rows to train on")
        for p, rows in chunks:
            if rows.shape[0] < batch:
                raise ValueError(f"a rollout chunk has {rows.shape[0]} rows, fewer than a batch of {batch}")
            if rows.shape[1] - p < 2:
                raise ValueError(f"a rollout chunk has {rows.shape[1] - p} generated tokens; at least 2 are needed")
        self.chunks, self.batch = chunks, batch
        self.rng = np.random.default_rng(seed)
        self.weights = np.array([r.shape[0] for _, r in chunks], dtype=np.float64)
        self.weights /= self.weights.sum()
        self.order = [self.rng.permutation(r.shape[0]) for _, r in chunks]
        self.cursor = [0] * len(chunks)
        self.first_anchor, self.rows, self.epochs = 1, 0, 0.0

    def next(self) -> np.ndarray:
        i = int(self.rng.choice(len(self.chunks), p=self.weights))
        p, rows = self.chunks[i]
        if self.cursor[i] + self.batch > rows.shape[0]:
            self.order[i], self.cursor[i] = self.rng.permutation(rows.shape[0]), 0
        pick = self.order[i][self.cursor[i]:self.cursor[i] + self.batch]
        self.cursor[i] += self.batch
        self.first_anchor = p
        self.rows += self.batch
        self.epochs = self.rows / sum(r.shape[0] for _, r in self.chunks)
        return rows[pick].astype(np.int64)
