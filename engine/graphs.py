"""CUDA-graph capture of the decode and verify forwards (runtime v3 on CUDA).

One graph per (mode, T, batch bucket), captured on first use, largest bucket first where several are asked
for, all in one memory pool. Inputs are copied into static buffers; rows past the real batch are padding that
reads and writes the engine's scratch slot. Speculative verification also captures the rollback (``commit``)
of its bucket, so a whole round replays with no host synchronisation other than reading the accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import VERIFY, Step


def buckets(max_batch: int) -> list[int]:
    """Batch sizes graphs are captured for: powers of two up to ``max_batch``, and ``max_batch`` itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor
    taps: list
    pending: object = None
    keep: torch.Tensor | None = None
    commit_graph: torch.cuda.CUDAGraph | None = None


class GraphRunner:
    """Replays captured forwards of ``engine.model`` over ``engine.cache``."""

    def __init__(self, engine):
        self.e = engine
        self.buckets = buckets(engine.options.max_concurrency)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, Captured] = {}

    def bucket(self, b: int) -> int:
        return next(x for x in self.buckets if x >= b)

    def _capture(self, mode: str, t: int, b: int, taps: tuple[int, ...]) -> Captured:
        e = self.e
        dev = e.device
        ids = torch.zeros(b, t, dtype=torch.long, device=dev)
        pos = torch.arange(t, device=dev).repeat(b, 1)
        slots = torch.full((b,), e.scratch_slot, dtype=torch.long, device=dev)
        step = Step(ids, pos, slots, kv_len=e.capacity, mode=mode, taps=taps)
        keep = torch.full((b,), t, dtype=torch.long, device=dev)

        def forward():
            hidden, tp = e.model.forward(step, e.cache)
            return hidden, e.model.logits(hidden), tp

        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # compile Triton kernels and settle allocations outside the capture
                forward()
                if mode == VERIFY:
                    e.cache.commit(keep)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, logits, tp = forward()
        cap = Captured(graph, ids, pos, slots, hidden, logits, tp)
        if mode == VERIFY:
            cap.pending, cap.keep = e.cache.pending, keep
            cap.commit_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cap.commit_graph, pool=self.pool):
                e.cache.commit(keep)
            e.cache.pending = None
        return cap

    def forward(self, mode: str, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                taps: tuple[int, ...] = ()):
        """(hidden, logits, taps) for the real rows of ``ids [B, T]`` via the bucket's graph."""
        b, t = ids.shape
        key = (mode, t, self.bucket(b), taps)
        cap = self.graphs.get(key)
        if cap is None:
            cap = self.graphs[key] = self._capture(mode, t, key[2], taps)
        cap.ids[:b].copy_(ids)
        cap.pos[:b].copy_(pos)
        cap.slots[:b].copy_(slots)
        if b < key[2]:
            cap.slots[b:].fill_(self.e.scratch_slot)
        cap.graph.replay()
        if mode == VERIFY:
            self.e.cache.pending = cap
        return cap.hidden[:b], cap.logits[:b], [x[:b] for x in cap.taps]

    def commit(self, cap: Captured, keep: torch.Tensor) -> None:
        """Replay the captured rollback with ``keep [B]`` (padding rows keep everything)."""
        b = keep.shape[0]
        cap.keep[:b].copy_(keep)
        cap.keep[b:].fill_(cap.ids.shape[1])
        cap.commit_graph.replay()
