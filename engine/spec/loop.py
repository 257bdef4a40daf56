"""One speculative round for a batch of sequences: draft, verify in one target forward, accept, roll back.

Greedy rows accept the longest prefix of drafts equal to the target's argmax; sampling rows use rejection
sampling (engine/spec/accept.py). The hybrid state of rejected positions is undone in the cache layer
(``Engine.commit`` -> ``HybridCache.commit``, or its captured graph).
"""

from __future__ import annotations

import time

import torch

from ..model import VERIFY
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
    t1 = _timer(dev)
    old_len = e._ids([s.length for s in seqs])
    block = torch.cat([e._ids([[s.last] for s in seqs]), drafts], dim=1)  # [B, K+1]
    hidden, logits, taps = e.forward_rows(seqs, block, VERIFY, e.drafter.taps)  # logits [B, K+1, V]
    n_acc, bonus = accept_greedy(drafts, logits)
    sampling = [r for r, s in enumerate(seqs) if not s.params.greedy]
    if sampling:
        rows = torch.tensor(sampling, device=dev)
        p = torch.stack([probs(logits[r], seqs[r].params) for r in sampling])
        n_acc[rows], bonus[rows] = accept_sampling(drafts[rows], p, q[rows], [seqs[r].generator for r in sampling])
    n_list, d_list, b_list = n_acc.tolist(), drafts.tolist(), bonus.tolist()
    keep = [_append(e, s, d_list[r][: n_list[r]] + [b_list[r]]) for r, s in enumerate(seqs)]
    e.commit(e._ids(keep))  # the cache keeps block positions 0 .. keep-1; the newest token is not in it yet
    t2 = _timer(dev)
    e.drafter.commit(seqs, old_len, block, hidden, torch.cat(taps, dim=-1) if taps else None, n_acc, bonus)
    t3 = _timer(dev)
    if dev.type == "cuda":
        t3.synchronize()  # the round's events are only readable once complete
    verify_ms, draft_ms = _ms(dev, t1, t2), _ms(dev, t0, t1) + _ms(dev, t2, t3)
    for s, n in zip(seqs, n_list):
        _record(s.stats, k, n, verify_ms, draft_ms)


def _append(e, seq, tokens: list[int]) -> int:
    """Add ``tokens`` to ``seq`` until it finishes; returns how many were added (its length grows by as many)."""
    added = 0
    for tok in tokens:
        seq.tokens.append(tok)
        added += 1
        if e._finish(seq):
            break
    seq.length += added
    return added


def _record(st: dict, k: int, accepted: int, verify_ms: float, draft_ms: float) -> None:
    st["rounds"] = st.get("rounds", 0) + 1
    st["target_forwards"] = st.get("target_forwards", 0) + 1
    st["drafted_tokens"] = st.get("drafted_tokens", 0) + k
    st["accepted_tokens"] = st.get("accepted_tokens", 0) + accepted
    per = st.setdefault("accepted_per_position", [0] * k)
    for i in range(accepted):
        per[i] += 1
    st["verify_ms"] = st.get("verify_ms", 0.0) + verify_ms
    st["draft_ms"] = st.get("draft_ms", 0.0) + draft_ms
    st["acceptance_rate"] = st["accepted_tokens"] / st["drafted_tokens"]
    st["tokens_per_round"] = 1 + st["accepted_tokens"] / st["rounds"]
