"""Tensors read on demand: a shape known before any byte is read, and rows handed out a block at a time.

Converting a checkpoint of the real model's size must not hold it in memory: the converter plans the artifact from
the shapes alone, then the writer asks each tensor for its rows in blocks, packs, hashes and writes each block, and
drops it. A :class:`TensorSource` is such a tensor; a plain ``torch.Tensor`` is accepted wherever one is (its
blocks are slices of it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TensorSource:
    """A tensor of ``shape`` whose rows ``[r0, r1)`` (of the first dimension) ``read(r0, r1)`` returns. With
    ``whole`` the reader can only produce the whole tensor at once (a fused checkpoint tensor split in two): it is
    read once and sliced."""

    shape: tuple[int, ...]
    read: Callable[[int, int], torch.Tensor]
    whole: bool = False

    def load(self) -> torch.Tensor:
        """The whole tensor."""
        return self.read(0, self.shape[0] if self.shape else 1).reshape(self.shape)

    def blocks(self, rows: int) -> Iterator[torch.Tensor]:
        """The tensor as consecutive blocks of at most ``rows`` rows."""
        n = self.shape[0] if self.shape else 1
        if self.whole:
            yield from row_blocks(self.load(), rows)
            return
        for r0 in range(0, n, rows):
            yield self.read(r0, min(n, r0 + rows))


def row_blocks(t, rows: int) -> Iterator[torch.Tensor]:
    """Blocks of at most ``rows`` rows of a tensor or a :class:`TensorSource`."""
    if isinstance(t, TensorSource):
        yield from t.blocks(rows)
        return
    if t.dim() == 0:
        yield t.reshape(1)
        return
    for r0 in range(0, t.shape[0], rows):
        yield t[r0:r0 + rows]


@dataclass(frozen=True, slots=True)
class FileRange:
    """``nbytes`` bytes of a file from ``offset``: already-packed bytes copied into an artifact (``upgrade``) with
    reads, not a mapping, so the pages read do not stay in the process's memory."""

    path: str
    offset: int
    nbytes: int

    def chunks(self, size: int = 1 << 24) -> Iterator[bytes]:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < self.nbytes:
                data = os.pread(fd, min(size, self.nbytes - done), self.offset + done)
                if not data:
                    raise OSError(f"{self.path}: ends before byte {self.offset + self.nbytes:,}")
                done += len(data)
                yield data
        finally:
            os.close(fd)
