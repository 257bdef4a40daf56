"""Chained speculative decoding: a greedy sequence's rounds replayed from CUDA graphs with the host one round behind
the GPU (``EngineOptions.lookahead``), as plain decoding's chain (engine/runtime/chain.py) runs its steps.

A round is three captured graphs over state kept on the device (the newest token, the length, the tokens generated
and still allowed, a finished flag, the slot written):

1. drafting (and replayed acceptance's substitution, its draws made beside the graph);
2. the verify forward over the newest token and the drafts, greedy acceptance, the tokens kept (stop ids and the
   length limit applied on the device: :func:`.accept.accept_keep`) and the cache's rollback;
3. the drafter's pass over the verified block, then the state's update and the round's result row
   (n_acc | bonus | keep | drafts), copied to the host without waiting.

Acceptance and the state update are one Triton launch each on CUDA (kernels/spec_round.py).

Nothing in a round reads the device: the host queues round n + 1 before it reads round n, so its launches and
bookkeeping hide behind the GPU's work (an unchained round, spec/loop.py, waits for its result before the next round
can be queued, and launches its glue op by op). Near the length limit - once the unread round could reach it - the
host reads before it queues, so no round is queued past the limit. Once a stop id ends the sequence on the device,
the rounds still queued write the scratch slot and keep nothing (``stats["discarded_rounds"]``). The functions,
shapes and key ranges are the unchained round's on CUDA graphs (keys bound by the capacity): the same tokens and the
same acceptance. On a CPU (tests only: the engine chains on CUDA graphs) the stages run eagerly over the key ranges
the lengths give.
"""

from __future__ import annotations

import torch

from ...kernels import spec_round
from ..model.graphs import MAX_STOP_IDS, capture
from ..model.hybrid import VERIFY, Step
from .accept import accept_keep
from .drafters import MTPDrafter
from .loop import append, ms, record, settle_times, timer


class _Stage:
    """A stage on a CPU, replayed as a graph is: run again, its results written into the tensors of its first run."""

    def __init__(self, fn, outs):
        self.fn, self.outs = fn, outs

    @classmethod
    def make(cls, fn):
        outs = fn()
        return cls(fn, outs), outs

    def replay(self) -> None:
        new = self.fn()
        if new is None:
            return
        for out, value in zip(*((self.outs, new) if isinstance(new, tuple) else ((self.outs,), (new,)))):
            out.copy_(value)


def chainable(e, seq) -> bool:
    """Whether ``seq`` decodes through the chained rounds: a drafter, CUDA graphs, lookahead on, greedy, no
    log-probabilities, no stop strings (the host finds those only in the text), no media rotary shift, at most
    ``MAX_STOP_IDS`` stop ids, and with replayed acceptance the plain continuation given."""
    p = seq.params
    return (e.options.lookahead and e.drafter is not None and e.graphs is not None and p.greedy
            and not p.keeps_logprobs and not p.stop and not (seq.media is not None and seq.media.delta)
            and seq.finish_reason is None and len(e.stops.stop_ids(p)) <= MAX_STOP_IDS
            and (e.replay is None or seq.reference is not None))


class SpecChain:
    """The captured round of one engine (batch 1, K drafts), its device state and its result row."""

    def __init__(self, e, seq):
        self.e = e
        dev, k = e.device, e.options.draft_tokens
        self.k = k
        self.cuda = dev.type == "cuda"
        self.mtp = isinstance(e.drafter, MTPDrafter)
        long = {"dtype": torch.long, "device": dev}
        # the state: warm-ups and captures run on the scratch slot; prime() sets a sequence's own values after
        self.own = torch.full((1,), e.scratch_slot, **long)
        self.slot = self.own.clone()
        self.last, self.length, self.ntok = (torch.zeros(1, **long) for _ in range(3))
        self.left = torch.full((1,), k + 1, **long)
        self.done = torch.zeros(1, dtype=torch.bool, device=dev)
        self.scratch = torch.full((1,), e.scratch_slot, **long)
        self.stops = torch.full((1, MAX_STOP_IDS), -1, **long)
        self.steps = torch.arange(k + 1, device=dev)
        self.out = torch.zeros(1, 3 + k, **long)  # n_acc | bonus | keep | drafts
        if self.mtp:  # the head's pending (h, logits) of the newest position
            h, logits = e.drafter.pending[seq.slot]
            self.h, self.logits = torch.zeros_like(h)[None], torch.zeros_like(logits)[None]
        if e.replay is not None:  # the plain continuation (positions past it read its last token) and the draws
            self.ref = torch.zeros(e.capacity + k + 1, **long)
            self.ref_len = torch.ones(1, **long)
            self.u = torch.ones(1, k, dtype=torch.float32, device=dev)
        self.drafts = self.verified = None
        self.graphs = []
        pool = e.graphs.pool if e.graphs is not None else None
        for stage in (self._draft, self._verify, self._link):
            graph, out = capture(stage, pool, dev) if self.cuda else _Stage.make(stage)
            graph.replay()  # the outputs hold real values for the next stage's warm-ups
            if stage == self._draft:
                self.drafts = out
            elif stage == self._verify:
                self.verified = out
            self.graphs.append(graph)

    # ---- the three stages (device tensors only, nothing read back on CUDA) ----------------------------------
    def _keys(self, extra: int) -> int:
        """The keys a stage attends: the capacity on CUDA (a graph serves every length; later keys are masked), the
        length plus ``extra`` on a CPU (as the unchained round takes them)."""
        return self.e.capacity if self.cuda else int(self.length.max()) + extra

    def _draft(self) -> torch.Tensor:
        d, k = self.e.drafter, self.k
        if self.mtp:
            drafts = d.steps(self.h, self.logits, self.length, self.slot, k, self._keys(k))[0]
        else:
            drafts = d.greedy(*d.block(self.last, self.length, self.slot, k), self.last)
        if self.e.replay is not None:
            idx = torch.minimum(self.ntok + self.steps[:k], self.ref_len - 1)  # the next token is reference[ntok]
            drafts = self.e.replay.replace(self.ref.gather(0, idx)[None], self.u)
        return drafts

    def _verify(self):
        e, drafts = self.e, self.drafts
        block = torch.cat([self.last[:, None], drafts], dim=1)  # [1, K+1]
        pos = self.length[:, None] + self.steps[None]
        step = Step(block, pos, self.slot, kv_len=self._keys(self.k + 1), mode=VERIFY, taps=e.drafter.taps)
        hidden, taps = e.model.forward(step, e.cache)
        n_acc, bonus, keep, tokens, stopped = accept_keep(drafts, e.model.logits(hidden), self.stops, self.left)
        e.cache.commit(keep.clamp_min(1))  # a finished chain's rounds (keep 0) roll the scratch slot back to 1
        taps = torch.cat(taps, dim=-1) if taps else hidden  # (MTP reads the hidden rows, DFlash the taps)
        return block, hidden, taps, n_acc, bonus, keep, tokens, stopped

    def _link(self) -> None:
        d, k = self.e.drafter, self.k
        block, hidden, taps, n_acc, bonus, keep, tokens, stopped = self.verified
        if self.mtp:  # the head over the verified block: the next round's first draft
            live = ~self.done
            h0, l0 = d.verified(hidden, block, bonus, n_acc, self.length, self.slot, self._keys(k + 1))
            self.h.copy_(torch.where(live[:, None], h0, self.h))
            self.logits.copy_(torch.where(live[:, None], l0, self.logits))
        else:  # context K/V of the kept positions
            d.verified(taps, self.length, n_acc, self.slot, k + 1)
        update = spec_round.chain_update if self.cuda and spec_round.triton_available() \
            else spec_round.chain_update_ref  # one launch on CUDA
        update(keep, tokens, stopped, self.done, self.last, self.length, self.ntok, self.left, self.slot, self.own,
               self.scratch, self.out, n_acc, bonus, self.drafts)

    # ---- host side ---------------------------------------------------------------------------------------
    def prime(self, seq) -> None:
        """Start the state at ``seq`` (its slot, newest token, length, tokens so far and allowed, stop ids)."""
        e = self.e
        self.own.fill_(seq.slot)
        self.slot.fill_(seq.slot)
        self.last.fill_(seq.last)
        self.length.fill_(seq.length)
        self.ntok.fill_(len(seq.tokens))
        self.left.fill_(seq.params.max_new_tokens - len(seq.tokens))
        self.done.fill_(False)
        stop_ids = sorted(e.stops.stop_ids(seq.params))
        self.stops.fill_(-1)
        if stop_ids:
            self.stops[0, :len(stop_ids)].copy_(torch.tensor(stop_ids, dtype=torch.long))
        if self.mtp:
            h, logits = e.drafter.pending[seq.slot]
            self.h[0].copy_(h)
            self.logits[0].copy_(logits)
        if e.replay is not None:
            ref = seq.reference[: self.ref.numel()]
            self.ref[: ref.numel()].copy_(ref)
            self.ref_len.fill_(ref.numel())

    def round(self, host_row: torch.Tensor) -> tuple:
        """Queue one round; its result row lands in ``host_row`` (pinned on CUDA) by the last of the returned marks
        (draft start, verify start, drafter pass start, end)."""
        e, dev = self.e, self.e.device
        t0 = timer(dev)
        if e.replay is not None:
            self.u.copy_(e.replay.draws(1, self.k, dev))
        self.graphs[0].replay()
        t1 = timer(dev)
        self.graphs[1].replay()
        t2 = timer(dev)
        self.graphs[2].replay()
        if e.step_delay:  # testing only (EngineOptions.inject_delay_us): queued behind the round, before its copy
            e.step_delay()
        host_row.copy_(self.out[0], non_blocking=self.cuda)
        return t0, t1, t2, timer(dev)

    def finish(self, seq) -> None:
        """Hand the drafter the chain's state of ``seq`` (MTP's pending entry), as the unchained rounds leave it."""
        if self.mtp:
            self.e.drafter.pending[seq.slot] = (self.h[0].clone(), self.logits[0].clone())


@torch.inference_mode()
def decode_spec_chained(e, seq) -> None:
    """Greedy speculative decode of ``seq`` (:func:`chainable`) until it finishes, one round queued ahead of the
    host's read; never more rounds queued than tokens still allowed."""
    settle_times(e)  # an unchained round's times still pending
    left = seq.params.max_new_tokens - len(seq.tokens)
    if left <= 0:
        return
    with e.weights.round_products():
        ch = e.spec_chain
        if ch is None:
            ch = e.spec_chain = SpecChain(e, seq)
        ch.prime(seq)
        k = ch.k
        host = torch.empty(left, 3 + k, dtype=torch.long, pin_memory=ch.cuda)
        marks = []
        read = 0
        cap = seq.params.max_new_tokens
        while seq.finish_reason is None:
            unread = len(marks) - read
            # a round is queued ahead only while the unread ones cannot reach the length limit (each keeps at most
            # k + 1 tokens); near the end the host reads first, a short idle gap instead of a whole round that
            # would write the scratch slot
            if len(marks) < left and unread < 2 and len(seq.tokens) + unread * (k + 1) < cap:
                marks.append(ch.round(host[len(marks)]))
                continue
            t0, t1, t2, t3 = marks[read]
            if ch.cuda:
                t3.synchronize()
            n, bonus, kept, *drafts = host[read].tolist()
            read += 1
            added = append(e, seq, drafts[:n] + [bonus])
            if added != kept:
                raise RuntimeError(f"chained speculative round: the device kept {kept} tokens, the host {added}")
            record(seq.stats, k, added - 1)
            seq.stats["verify_ms"] += ms(e.device, t1, t2)
            seq.stats["draft_ms"] += ms(e.device, t0, t1) + ms(e.device, t2, t3)
        seq.stats["discarded_rounds"] = seq.stats.get("discarded_rounds", 0) + len(marks) - read  # after a stop id
        ch.finish(seq)
