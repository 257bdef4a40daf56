"""Training batches: packed windows of the token stream, with synthetic long-range retrieval samples mixed in.

A packed row is ``seq_len + 1`` consecutive stream tokens (documents separated by ``<|endoftext|>``); windows
start at multiples of ``seq_len`` and are visited in a fresh seeded permutation each epoch. A retrieval row
(probability ``retrieval_frac``) is code from the stream with 1-3 needle lines (``corpus.needle_text``) spliced
in at line ends at uniformly random depths, and ends with the question for one of them and its answer
(``corpus.question_text`` + ``corpus.answer_text``). Every token is trained on; the answer digits at the end
can only be predicted by finding the needle, up to ``seq_len`` tokens back.
"""

from __future__ import annotations

import numpy as np

from .corpus import answer_text, make_needle, needle_text, question_text


class Batches:
    """Deterministic (seeded) source of ``[batch, seq_len + 1]`` int64 token rows."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch: int, seed: int, retrieval_frac: float,
                 encode, newline: np.ndarray):
        if len(stream) < 2 * (seq_len + 1):
            raise ValueError(f"token stream of {len(stream)} tokens is too short for sequences of {seq_len}")
        self.stream, self.seq_len, self.batch = stream, seq_len, batch
        self.retrieval_frac, self.encode, self.newline = retrieval_frac, encode, newline
        self.rng = np.random.default_rng(seed)
        self.windows = (len(stream) - 1) // seq_len
        self.order, self.cursor, self.epoch = self.rng.permutation(self.windows), 0, 0
        self.rows = 0

    def _window(self) -> np.ndarray:
        if self.cursor == self.windows:
            self.order, self.cursor, self.epoch = self.rng.permutation(self.windows), 0, self.epoch + 1
        start = int(self.order[self.cursor]) * self.seq_len
        self.cursor += 1
        return self.stream[start:start + self.seq_len + 1]

    def retrieval_row(self) -> np.ndarray:
        """One retrieval sample of ``seq_len + 1`` tokens (see the module docstring)."""
        n = self.seq_len + 1
        needles = [make_needle(self.rng) for _ in range(int(self.rng.integers(1, 4)))]
        ask = int(self.rng.integers(len(needles)))
        key, value = needles[ask]
        tail = self.encode(question_text(key)) + self.encode(answer_text(value))
        pieces = [self.encode(needle_text(k, v)) for k, v in needles]
        room = n - len(tail) - sum(len(p) for p in pieces)
        if room < 8:
            raise ValueError(f"sequence length {self.seq_len} leaves no room for retrieval filler")
        start = int(self.rng.integers(0, len(self.stream) - room - 1))
        filler = self.stream[start:start + room].astype(np.int64)
        cuts = np.flatnonzero(self.newline[filler[:-1]]) + 1  # positions right after a line end
        end = int(cuts[-1]) if len(cuts) else room  # the question starts a line when it can
        at = np.sort(self.rng.choice(cuts, size=len(pieces))) if len(cuts) else np.zeros(len(pieces), int)
        parts, prev = [], 0
        for cut, piece in zip(at, pieces):
            parts += [filler[prev:cut], np.asarray(piece, dtype=np.int64)]
            prev = int(cut)
        parts += [filler[prev:end], np.asarray(tail, dtype=np.int64)]
        row = np.concatenate(parts)
        # trimming the filler to a line end made the row shorter: pad at the front with stream tokens
        if len(row) < n:
            s = int(self.rng.integers(0, len(self.stream) - n))
            row = np.concatenate([self.stream[s:s + n - len(row)].astype(np.int64), row])
        return row[-n:]

    def next(self) -> np.ndarray:
        rows = []
        for _ in range(self.batch):
            if self.retrieval_frac > 0 and self.rng.random() < self.retrieval_frac:
                rows.append(self.retrieval_row())
            else:
                rows.append(self._window().astype(np.int64))
        self.rows += self.batch
        return np.stack(rows)
