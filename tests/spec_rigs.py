"""Drafters rigged to agree with the target always, never, or for a random prefix of each block."""

from __future__ import annotations

import random

import torch


class RiggedDrafter:
    """Proposes the target's known greedy continuation, spoiled after ``agree(round)`` tokens."""

    taps: tuple[int, ...] = ()

    def __init__(self, engine, reference: list[int], agree, vocab: int):
        self.e, self.ref, self.agree, self.vocab = engine, reference, agree, vocab
        self.rounds = 0

    def begin(self, seq, start, hidden, taps):
        pass

    def commit(self, seqs, old_len, block, hidden, taps, n_acc, bonus):
        pass

    def release(self, seq):
        pass

    def export_slot(self, slot):
        return {}

    def import_slot(self, slot, state):
        pass

    def draft(self, seqs, k):
        rows = []
        for s in seqs:
            done = len(s.tokens)  # the next token to guess is reference[done]
            good = self.agree(self.rounds)
            row = []
            for j in range(k):
                true = self.ref[done + j] if done + j < len(self.ref) else 0
                row.append(true if j < good else (true + 1) % self.vocab)
            rows.append(row)
        self.rounds += 1
        return torch.tensor(rows, dtype=torch.long, device=self.e.device), None


def always(k):
    return lambda r: k


def never():
    return lambda r: 0


def random_prefix(k, seed=0):
    rng = random.Random(seed)
    return lambda r: rng.randint(0, k)
