"""The ``--lm-head-draft`` vocabulary: a model's token ids ranked by how often a corpus uses them, most frequent first
(ties: lower id first; ids the corpus never uses follow in id order), stored in an artifact as ``draft_head.token_ids``
(fp32, exact for ids below 2^24). A draft head over the first N rows of that ranking scores the tokens a drafter most
often needs, as EAGLE-3's reduced draft vocabulary does.

``convert --draft-vocab-corpus PATH`` builds it from text files, JSON-lines files (a ``text`` field, or a string, a
line) and folders of them, tokenized with the checkpoint's own tokenizer; the bundled model's training ranks its
training stream the same way (:func:`frequency_order`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..jsonl import json_lines

TENSOR = "draft_head.token_ids"
MAX_VOCAB = 1 << 24  # fp32 holds every id below this exactly
COVERAGE_AT = (4096, 8192, 16384, 32768, 65536)  # head sizes the summary reports the corpus coverage of


def frequency_order(counts: np.ndarray) -> np.ndarray:
    """Token ids sorted by ``counts`` (one per id), most frequent first; ties (the unused ids among them) by id."""
    counts = np.asarray(counts)
    return np.lexsort((np.arange(counts.size), -counts)).astype(np.int64)


def corpus_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files of ``paths``: files as given, folders walked in sorted order (hidden entries skipped)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*")
                          if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts))
        elif p.is_file():
            out.append(p)
        else:
            raise ValueError(f"draft vocabulary corpus: no such file or folder: {p}")
    return out


@dataclass
class CorpusStats:
    """What a ranking was made from."""

    files: int = 0
    bytes: int = 0
    tokens: int = 0
    skipped: list[str] = field(default_factory=list)  # files that are not UTF-8 text
    coverage: dict[int, float] = field(default_factory=dict)  # head size -> share of the corpus's tokens it holds

    def describe(self) -> str:
        cover = ", ".join(f"{n:,}: {100 * c:.1f}%" for n, c in self.coverage.items())
        text = (f"draft vocabulary from {self.tokens:,} tokens in {self.files:,} files ({self.bytes:,} bytes); "
                f"share of those tokens the first N ids cover, N = {cover}")
        if self.skipped:
            text += f"; {len(self.skipped)} files skipped (not UTF-8 text), e.g. {self.skipped[0]}"
        return text


def corpus_texts(files: list[Path], stats: CorpusStats, progress: Callable | None = None) -> Iterator[str]:
    """The texts of ``files``: a ``.jsonl`` file one a line (a string, or an object's ``text``), any other file whole
    (files that are not UTF-8 are skipped and named in ``stats``). ``progress(done_bytes, total_bytes, name)``."""
    total, done = sum(f.stat().st_size for f in files), 0
    for f in files:
        data = f.read_bytes()
        done += len(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            stats.skipped.append(str(f))
            text = None
        if text is not None:
            stats.files += 1
            stats.bytes += len(data)
            if f.suffix == ".jsonl":
                for n, obj in json_lines(text, str(f)):
                    item = obj.get("text") if isinstance(obj, dict) else obj
                    if not isinstance(item, str):
                        raise ValueError(f"{f}:{n}: a JSON-lines corpus line must be a string or an object with a "
                                         f"'text' string")
                    yield item
            else:
                yield text
        if progress is not None:  # skipped files count toward the bytes done too
            progress(done, total, f.name)


def corpus_order(tokenizer_json: bytes, vocab_size: int, paths: Iterable[str | Path], *, batch: int = 64,
                 progress: Callable | None = None) -> tuple[np.ndarray, CorpusStats]:
    """(the ranking of all ``vocab_size`` ids, :class:`CorpusStats`) of the corpus at ``paths``, tokenized with the
    ``tokenizer.json`` bytes given (no special tokens added)."""
    from .tokenizer import load_tokenizer_json

    if not 0 < vocab_size <= MAX_VOCAB:
        raise ValueError(f"a draft vocabulary holds ids below {MAX_VOCAB:,}; this model has {vocab_size:,}")
    backend = load_tokenizer_json(tokenizer_json, vocab_size)
    files = corpus_files(paths)
    if not files:
        raise ValueError("draft vocabulary corpus: no files")
    stats = CorpusStats()
    counts = np.zeros(vocab_size, dtype=np.int64)
    pending: list[str] = []

    def flush():
        for enc in backend.encode_batch(pending, add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype=np.int64)
            counts[:] += np.bincount(ids, minlength=vocab_size)
            stats.tokens += ids.size
        pending.clear()

    for text in corpus_texts(files, stats, progress):
        pending.append(text)
        if len(pending) >= batch:
            flush()
    flush()
    if stats.tokens == 0:
        raise ValueError(f"draft vocabulary corpus: no tokens in {len(files)} files"
                         + (f" ({len(stats.skipped)} not UTF-8 text)" if stats.skipped else ""))
    order = frequency_order(counts)
    ranked = np.cumsum(counts[order])
    stats.coverage = {n: float(ranked[min(n, vocab_size) - 1] / stats.tokens) for n in COVERAGE_AT if n < vocab_size}
    return order, stats
