"""Self-distillation data for the block drafters: the target's own greedy continuations of training-code prefixes.

A round drafts after the prompt, from a context that is the prompt and then the target's own greedy tokens, and
a draft is accepted when it equals the target's next greedy token. Corpus text trains the drafters on contexts
the target did not write, and past a block's first position only some corpus blocks follow the greedy path
(``DrafterOptions.labels``). A self-generated sequence is that round's context exactly: a training-corpus prefix
as the prompt, then ``new_tokens`` greedy tokens of the frozen target, every one on the greedy path.

Prompts are document prefixes of the training stream (held-out files never enter it: ``corpus.is_heldout``), cut
at a line end, their lengths drawn as the held-out prompts' are (``Preset.prompt_tokens``). A group holds prompts
of one length, so that its rows make one training batch without padding: the prefixes are sorted by length and each
group is cut to its shortest from the front (a few tokens; every prompt still ends at a line end). The engine
decodes a group's rows together (``Engine.advance``: the served weights and K/V format, so the tokens are the ones a
round must guess), greedy, the end of text not stopping them (what follows it is the greedy path too).

:class:`SelfBatches` serves the sequences to ``drafters.train``: rows of one group, with the first block anchor
at the prompt's end, so every block drafts from a context a round can have; :class:`Mixed` interleaves them with
corpus rows. A small generated set seen many times is memorised (a transformers-generated set of 1,024 rows, seen 134
times, took DFlash2 K=7 from 3.3 to 2.07 tokens a round: docs/perf/2026-12-04d): generate with the engine's batched
decoding, which is fast enough for many rows, and mix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class GenOptions:
    sequences: int  # prompts to continue (at most; the budget may stop first)
    new_tokens: int
    batch: int
    prompt_tokens: tuple[int, int]  # inclusive range of prompt lengths, as the held-out prompts'
    budget_s: float
    seed: int = 0

    def __post_init__(self) -> None:
        lo, hi = self.prompt_tokens
        if min(self.sequences, self.new_tokens, self.batch, lo) < 1 or hi < lo or self.budget_s <= 0:
            raise ValueError(f"self-generation: bad options {self}")


def document_starts(stream: np.ndarray, eot: int) -> np.ndarray:
    """Offsets in the token stream where a document begins (the stream's start and after each end of text)."""
    starts = np.concatenate([[0], np.flatnonzero(stream == eot) + 1])
    return starts[starts < len(stream)]


def prefixes(stream: np.ndarray, eot: int, newline: np.ndarray, opts: GenOptions) -> list[np.ndarray]:
    """Up to ``opts.sequences`` document prefixes, each of a drawn length cut back to its last line end."""
    rng = np.random.default_rng(opts.seed)
    starts = document_starts(stream, eot)
    lo, hi = opts.prompt_tokens
    out = []
    for s in rng.permutation(starts):
        want = int(rng.integers(lo, hi + 1))
        doc = stream[s:s + want]
        cut = np.flatnonzero(doc == eot)
        doc = doc[:cut[0]] if len(cut) else doc
        ends = np.flatnonzero(newline[doc])
        if not len(ends) or ends[-1] + 1 < lo:
            continue
        out.append(doc[:ends[-1] + 1].astype(np.int64))
        if len(out) == opts.sequences:
            break
    return out


def groups(prompts: list[np.ndarray], batch: int) -> list[np.ndarray]:
    """Prompts sorted by length, in groups of ``batch``, each prompt cut from the front to its group's shortest."""
    order = sorted(prompts, key=len)
    out = []
    for i in range(0, len(order), batch):
        part = order[i:i + batch]
        n = min(len(p) for p in part)
        out.append(np.stack([p[len(p) - n:] for p in part]))
    return out


def generate(artifact, stream: np.ndarray, eot: int, newline: np.ndarray, opts: GenOptions, device,
             progress=print) -> dict:
    """The target's greedy continuations, decoded by the engine (``Engine.advance`` over a group's rows at once:
    the served weights and K/V format, so the tokens are the ones a round must guess):
    ``{"groups": [int64 [b, P + new_tokens]], "prompt_lengths": [P], ...}`` (groups in the order generated; the
    budget stops between groups)."""
    from ninfer_bench.engine.runtime.engine import Engine
    from ninfer_bench.engine.sampling import SamplingParams

    prompts = prefixes(stream, eot, newline, opts)
    if not prompts:
        raise ValueError("self-generation: no document in the training stream is long enough for a prompt")
    todo = groups(prompts, opts.batch)
    rng = np.random.default_rng(opts.seed + 1)
    todo = [todo[i] for i in rng.permutation(len(todo))]  # a budget cut keeps every prompt length alike
    eng = Engine.load(str(artifact), device=torch.device(device).type, max_concurrency=opts.batch,
                      max_context=max(map(len, prompts)) + opts.new_tokens + 8)
    params = SamplingParams(max_new_tokens=opts.new_tokens, ignore_eos=True)
    t0, done, out, plens = time.perf_counter(), 0, [], []
    for g in todo:
        if out and time.perf_counter() - t0 > opts.budget_s:
            break
        seqs = [eng.acquire(row.tolist(), params) for row in g]
        try:
            for seq in seqs:
                eng.start(seq)
            while any(seq.finish_reason is None for seq in seqs):
                eng.advance(seqs)
            new = np.array([seq.tokens for seq in seqs], dtype=np.int64)
        finally:
            for seq in seqs:
                eng.release(seq)
        if new.shape != (len(g), opts.new_tokens):
            raise RuntimeError(f"the engine decoded {new.shape} tokens for {len(g)} rows of {opts.new_tokens}")
        out.append(np.concatenate([g, new], axis=1))
        plens.append(g.shape[1])
        done += len(g)
        progress(f"  [selfgen] {done} / {len(prompts)} sequences, prompt {g.shape[1]} + {opts.new_tokens} tokens, "
                 f"{time.perf_counter() - t0:.1f} s")
    secs = time.perf_counter() - t0
    return {"groups": out, "prompt_lengths": plens, "sequences": done, "new_tokens": opts.new_tokens,
            "generated_tokens": done * opts.new_tokens, "seconds": round(secs, 1),
            "tok_s": round(done * opts.new_tokens / max(secs, 1e-9), 1)}


def save(path, data: dict) -> None:
    np.savez(path, prompt_lengths=np.asarray(data["prompt_lengths"]), new_tokens=data["new_tokens"],
             **{f"g{i}": g for i, g in enumerate(data["groups"])})


def load(path) -> dict:
    z = np.load(path)
    plens = [int(x) for x in z["prompt_lengths"]]
    gs = [z[f"g{i}"] for i in range(len(plens))]
    n = int(z["new_tokens"])
    return {"groups": gs, "prompt_lengths": plens, "new_tokens": n, "sequences": sum(len(g) for g in gs),
            "generated_tokens": n * sum(len(g) for g in gs)}


class SelfBatches:
    """Training rows from the self-generated groups: ``next()`` gives ``(x [b, L + 1], first_anchor)``, ``b`` up to
    ``batch`` rows of one group (a group larger than ``batch`` is served in parts), ``first_anchor`` the prompt
    length (the position of the first generated token, a round's first anchor). Groups are visited in a fresh
    seeded order each epoch."""

    def __init__(self, data: dict, batch: int, seed: int):
        self.parts = []
        for g, p in zip(data["groups"], data["prompt_lengths"]):
            for i in range(0, len(g), batch):
                self.parts.append((g[i:i + batch], p))
        if not self.parts:
            raise ValueError("self-generated data is empty")
        self.rng = np.random.default_rng(seed)
        self.order, self.cursor, self.epoch, self.rows = self.rng.permutation(len(self.parts)), 0, 0, 0

    def next(self) -> tuple[np.ndarray, int]:
        if self.cursor == len(self.parts):
            self.order, self.cursor, self.epoch = self.rng.permutation(len(self.parts)), 0, self.epoch + 1
        x, p = self.parts[int(self.order[self.cursor])]
        self.cursor += 1
        self.rows += len(x)
        return x.astype(np.int64), p


class Mixed:
    """Self-generated rows for ``fraction`` of the steps (seeded draw), corpus rows (``bundled/batches.Batches``)
    for the rest."""

    def __init__(self, own: SelfBatches, corpus, fraction: float, seed: int):
        self.own, self.corpus, self.fraction = own, corpus, fraction
        self.rng = np.random.default_rng(seed)

    def next(self):
        return self.own.next() if self.rng.random() < self.fraction else self.corpus.next()
