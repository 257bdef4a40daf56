"""One speculative round for a batch of sequences: draft, verify in one target forward, accept, roll back.

Greedy rows accept the longest prefix of drafts equal to the target's argmax; sampling rows use rejection
sampling (engine/spec/accept.py). The hybrid state of rejected positions is undone in the cache layer
(``Engine.commit`` -> ``HybridCache.commit``, or its captured graph).

A round's device times (drafting, verify) come from CUDA events that are read one round late: the next round's
token read-back has waited for them anyway, so the host queues the next drafts while this round's commits still
run instead of waiting for them. A sequence's last round is settled at once (its stats are read next).
"""

from __future__ import annotations

import time

import torch

from ..model.hybrid import VERIFY
from ..sampling import probs
from .accept import accept_greedy, accept_sampling


def _timer(device):
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _ms(device, a, b) -> float:
    return a.elapsed_time(b) if device.type == "cuda" else (b - a) * 1e3


@torch.inference_mode()
def speculative_round(e, seqs) -> None:
    """Draft K tokens per sequence, verify them in one target forward, accept, roll back the rest, and add the
    accepted tokens (plus the target's bonus token) to each sequence; updates each sequence's spec stats."""
    k, dev = e.options.draft_tokens, e.device
    t0 = _timer(dev)
    drafts, q = e.drafter.draft(seqs, k)  # [B, K]
    if e.replay is not None:  # replayed acceptance: proposals replaced on the device (spec/replay.py)
        drafts = e.replay.substitute(e, seqs, drafts)
    t1 = _timer(dev)
    old_len = e.device_ids([s.length for s in seqs])
    block = torch.cat([e.device_ids([[s.last] for s in seqs]), drafts], dim=1)  # [B, K+1]
    hidden, logits, taps = e.forward_rows(seqs, block, VERIFY, e.drafter.taps)  # logits [B, K+1, V]
    n_acc, bonus = accept_greedy(drafts, logits)
    sampling = [r for r, s in enumerate(seqs) if not s.params.greedy]
    if sampling:
        rows = torch.tensor(sampling, device=dev)
        p = torch.stack([probs(logits[r], seqs[r].params) for r in sampling])
        n_acc[rows], bonus[rows] = accept_sampling(drafts[rows], p, q[rows], [seqs[r].generator for r in sampling])
    n_list, d_list, b_list = n_acc.tolist(), drafts.tolist(), bonus.tolist()
    settle_times(e)  # the read above waited for everything queued before it: the last round's events are complete
    keep = [_append(e, s, d_list[r][: n_list[r]] + [b_list[r]]) for r, s in enumerate(seqs)]
    e.commit(e.device_ids(keep))  # the cache keeps block positions 0 .. keep-1; the newest token is not in it yet
    t2 = _timer(dev)
    e.drafter.commit(seqs, old_len, block, hidden, torch.cat(taps, dim=-1) if taps else None, n_acc, bonus)
    t3 = _timer(dev)
    for s, added in zip(seqs, keep):
        # the drafts this round put into the output: all n accepted ones when the round ends in its bonus token,
        # fewer when the length limit, a stop string or EOS cut it (the last token added then counts as the round's
        # own), so completion = first token + rounds + accepted drafts holds for every sequence
        _record(s.stats, k, added - 1)
    e.spec_times = (seqs, (t0, t1, t2, t3))
    if any(s.finish_reason is not None for s in seqs):
        settle_times(e)


def settle_times(e) -> None:
    """Add the last speculative round's device times (drafting with the drafter's commit; verify with the target's
    commit) to its sequences' stats; on a GPU, waits for its last event if the stream has not passed it yet."""
    pending, e.spec_times = e.spec_times, None
    if pending is None:
        return
    seqs, (t0, t1, t2, t3) = pending
    if e.device.type == "cuda":
        t3.synchronize()
    verify_ms, draft_ms = _ms(e.device, t1, t2), _ms(e.device, t0, t1) + _ms(e.device, t2, t3)
    for s in seqs:
        s.stats["verify_ms"] += verify_ms
        s.stats["draft_ms"] += draft_ms


def _append(e, seq, tokens: list[int]) -> int:
    """Add ``tokens`` to ``seq`` until it finishes; returns how many were added (its length grows by as many)."""
    added = 0
    for tok in tokens:
        seq.tokens.append(tok)
        added += 1
        if e.stops.finish(seq):
            break
    seq.length += added
    return added


def _record(st: dict, k: int, accepted: int) -> None:
    st["rounds"] = st.get("rounds", 0) + 1
    st["target_forwards"] = st.get("target_forwards", 0) + 1
    st["drafted_tokens"] = st.get("drafted_tokens", 0) + k
    st["accepted_tokens"] = st.get("accepted_tokens", 0) + accepted
    per = st.setdefault("accepted_per_position", [0] * k)
    for i in range(accepted):
        per[i] += 1
    st.setdefault("verify_ms", 0.0)  # added by settle_times
    st.setdefault("draft_ms", 0.0)
    st["acceptance_rate"] = st["accepted_tokens"] / st["drafted_tokens"]
    st["tokens_per_round"] = 1 + st["accepted_tokens"] / st["rounds"]
