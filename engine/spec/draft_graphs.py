"""Drafting replayed from CUDA graphs (runtime v3 on CUDA): MTP's greedy draft steps and its pass over each
verified block, DFlash / DFlash2 greedy block drafting and their context K/V of each verified block. A drafter
hands :meth:`DraftGraphs.replay` one of its own device-only functions (:meth:`MTPDrafter.steps`,
:meth:`MTPDrafter.verified`, :meth:`BlockDraftRunner.block` + ``greedy``, :meth:`BlockDraftRunner.verified`) with
its batch inputs; the function is captured once per (name, batch bucket, k) over static inputs, padding rows on the
engine's scratch slot, in the target graphs' memory pool, and each replay copies the live rows in and the outputs
out (the static buffers are overwritten by the next replay, maybe of another batch).
"""

from __future__ import annotations

import torch

from ..model.graphs import capture, pdl_scope


class DraftGraphs:
    """One drafter's captured functions. ``runner`` (default the engine's :class:`..model.graphs.GraphRunner`) gives the
    batch buckets (``bucket(b)``) and the memory pool (``pool``)."""

    def __init__(self, engine, runner=None):
        self.e = engine
        self.runner = runner if runner is not None else engine.graphs
        self.captured: dict[tuple[str, int, int], tuple] = {}

    def replay(self, name: str, k: int, values: tuple[torch.Tensor, ...], fn):
        """``fn(*values)``'s output (a tensor or a tuple of them, ``[B, ...]`` each; None for a function that writes
        its own buffers) from the graph captured for (``name``, B's bucket, ``k``). ``values``: ``[B, ...]`` device
        tensors, the cache slots last; ``fn`` must read nothing back to the host, and stand for the same computation
        whenever name and k are the same."""
        b = values[0].shape[0]
        key = (name, self.runner.bucket(b), k)
        cap = self.captured.get(key)
        if cap is None:
            cap = self.captured[key] = self._capture(key[1], values, fn)
        graph, ins, outs = cap
        for static, value in zip(ins, values):
            static[:b].copy_(value)
        ins[-1][b:].fill_(self.e.scratch_slot)
        graph.replay()
        if outs is None:  # fn writes the drafter's own buffers
            return None
        if isinstance(outs, torch.Tensor):
            return outs[:b].clone()
        return tuple(o[:b].clone() for o in outs)

    def _capture(self, bucket: int, values, fn):
        ins = tuple(v.new_zeros((bucket, *v.shape[1:])) for v in values[:-1]) + (
            torch.full((bucket,), self.e.scratch_slot, dtype=torch.long, device=self.e.device),)
        with pdl_scope(bucket):  # as the target's graphs
            graph, outs = capture(lambda: fn(*ins), self.runner.pool, self.e.device)
        return graph, ins, outs


def wanted(drafter, want: bool) -> DraftGraphs | None:
    """``drafter.graphs`` when ``want``, made on first use; None when not wanted or where the engine captures no
    graphs (CPU, runtime v2)."""
    if want and drafter.graphs is None and drafter.e.graphs is not None:
        drafter.graphs = DraftGraphs(drafter.e)
    return drafter.graphs if want else None
