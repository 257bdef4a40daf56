"""Drafting replayed from CUDA graphs (runtime v3 on CUDA): MTP's greedy draft steps and its pass over each
verified block, and DFlash / DFlash2 greedy block drafting. Each captures its drafter's own device-only function
(:meth:`MTPDrafter.steps`, :meth:`MTPDrafter.verified`, :meth:`BlockDraftRunner.block` + ``greedy``) per batch
bucket over static inputs, padding rows on the engine's scratch slot, in the target graphs' memory pool; a replay
copies the live rows in and its outputs out (the static buffers are overwritten by the next replay).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..graphs import capture

if TYPE_CHECKING:
    from .drafters import BlockDraftRunner, MTPDrafter


class MTPDraftGraphs:
    """MTP greedy drafting (:meth:`MTPDrafter.steps`) captured per (batch bucket, k), and the head's pass over a
    verified block (:meth:`MTPDrafter.verified`) per (batch bucket, block length), replayed over static inputs;
    padding rows write the engine's scratch slot. Shares the target graphs' memory pool."""

    def __init__(self, drafter: MTPDrafter):
        self.d, self.e = drafter, drafter.e
        self.captured: dict[tuple[int, int], tuple] = {}

    def _capture(self, b: int, k: int, like_h: torch.Tensor, like_logits: torch.Tensor):
        e, dev = self.e, self.e.device
        h = torch.zeros(b, like_h.shape[-1], dtype=like_h.dtype, device=dev)
        logits = torch.zeros(b, like_logits.shape[-1], dtype=like_logits.dtype, device=dev)
        length = torch.zeros(b, dtype=torch.long, device=dev)
        slots = torch.full((b,), e.scratch_slot, dtype=torch.long, device=dev)
        graph, toks = capture(lambda: self.d.steps(h, logits, length, slots, k, e.capacity)[0], e.graphs.pool, dev)
        return graph, h, logits, length, slots, toks

    def draft(self, h, logits, length, slots, k: int) -> torch.Tensor:
        b = h.shape[0]
        key = (self.e.graphs.bucket(b), k)
        cap = self.captured.get(key)
        if cap is None:
            cap = self.captured[key] = self._capture(*key, h, logits)
        graph, sh, sl, slen, sslots, toks = cap
        sh[:b].copy_(h)
        sl[:b].copy_(logits)
        slen[:b].copy_(length)
        sslots[:b].copy_(slots)
        sslots[b:].fill_(self.e.scratch_slot)
        graph.replay()
        return toks[:b].clone()

    def commit(self, hidden, block, bonus, n_acc, old_len, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`MTPDrafter.verified` replayed (keys bound by the capacity; later ones are masked by position).
        Returns copies: the static outputs are overwritten by the next replay, maybe of another batch."""
        b, t = block.shape
        key = ("commit", self.e.graphs.bucket(b), t)
        cap = self.captured.get(key)
        if cap is None:
            cap = self.captured[key] = self._capture_commit(key[1], t, hidden, block)
        graph, ins, (h0, l0) = cap
        for static, value in zip(ins, (hidden, block, bonus, n_acc, old_len, slots)):
            static[:b].copy_(value)
        ins[-1][b:].fill_(self.e.scratch_slot)
        graph.replay()
        return h0[:b].clone(), l0[:b].clone()

    def _capture_commit(self, b: int, t: int, like_hidden: torch.Tensor, like_block: torch.Tensor):
        e, dev = self.e, self.e.device
        ins = (torch.zeros(b, t, like_hidden.shape[-1], dtype=like_hidden.dtype, device=dev),  # hidden
               torch.zeros(b, t, dtype=like_block.dtype, device=dev),  # block
               torch.zeros(b, dtype=like_block.dtype, device=dev),  # bonus
               torch.zeros(b, dtype=torch.long, device=dev),  # n_acc
               torch.zeros(b, dtype=torch.long, device=dev),  # old_len
               torch.full((b,), e.scratch_slot, dtype=torch.long, device=dev))  # slots
        graph, outs = capture(lambda: self.d.verified(*ins, e.capacity), e.graphs.pool, dev)
        return graph, ins, outs


class BlockDraftGraphs:
    """DFlash / DFlash2 greedy block drafting (:meth:`BlockDraftRunner.block` + :meth:`BlockDraftRunner.greedy`)
    captured per (batch bucket, k), replayed over static inputs; padding rows read the engine's scratch slot (their
    drafts are dropped). Shares the target graphs' memory pool."""

    def __init__(self, runner: BlockDraftRunner):
        self.r, self.e = runner, runner.e
        self.captured: dict[tuple[int, int], tuple] = {}

    def draft(self, last, length, slots, k: int) -> torch.Tensor:
        b = last.shape[0]
        key = (self.e.graphs.bucket(b), k)
        cap = self.captured.get(key)
        if cap is None:
            cap = self.captured[key] = self._capture(*key)
        graph, ins, toks = cap
        for static, value in zip(ins, (last, length, slots)):
            static[:b].copy_(value)
        ins[-1][b:].fill_(self.e.scratch_slot)
        graph.replay()
        return toks[:b].clone()

    def _capture(self, b: int, k: int):
        e, dev = self.e, self.e.device
        ins = (torch.zeros(b, dtype=torch.long, device=dev), torch.zeros(b, dtype=torch.long, device=dev),
               torch.full((b,), e.scratch_slot, dtype=torch.long, device=dev))  # last, length, slots

        def run():
            h, logits = self.r.block(*ins, k)
            return self.r.greedy(h, logits, ins[0])

        graph, toks = capture(run, e.graphs.pool, dev)
        return graph, ins, toks
