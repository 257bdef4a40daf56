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
from .accept import accept_greedy, accept_sampling, keep_counts


def timer(device):
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def ms(device, a, b) -> float:
    return a.elapsed_time(b) if device.type == "cuda" else (b - a) * 1e3


@torch.inference_mode()
def speculative_round(e, seqs) -> None:
    """Draft K tokens per sequence, verify them in one target forward, accept, roll back the rest, and add the
    accepted tokens (plus the target's bonus token) to each sequence; updates each sequence's spec stats."""
    with e.weights.round_products():  # on a CPU, the k + 1 rows' products packed (WeightStore.pack_rows)
        _round(e, seqs)


def _round(e, seqs) -> None:
    k, dev = e.options.draft_tokens, e.device
    t0 = timer(dev)
    drafts, q = e.drafter.draft(seqs, k)  # [B, K]
    if e.replay is not None:  # replayed acceptance: proposals replaced on the device (spec/replay.py)
        drafts = e.replay.substitute(e, seqs, drafts)
    t1 = timer(dev)
    old_len = e.device_ids([s.length for s in seqs])
    block = torch.cat([e.device_ids([[s.last] for s in seqs]), drafts], dim=1)  # [B, K+1]
    hidden, logits, taps = e.forward_rows(seqs, block, VERIFY, e.drafter.taps)  # logits [B, K+1, V]
    n_acc, bonus = accept_greedy(drafts, logits)
    sampling = [r for r, s in enumerate(seqs) if not s.params.greedy]
    if sampling:
        rows = torch.tensor(sampling, device=dev)
        p = torch.stack([probs(logits[r], seqs[r].params) for r in sampling])
        n_acc[rows], bonus[rows] = accept_sampling(drafts[rows], p, q[rows], [seqs[r].generator for r in sampling])
    taps_cat = torch.cat(taps, dim=-1) if taps else None
    if sampling or any(s.params.stop for s in seqs):  # stop strings end a sequence only in the host's text
        n_list, d_list, b_list = n_acc.tolist(), drafts.tolist(), bonus.tolist()
        settle_times(e)  # the read waited for everything queued before it: the last round's events are complete
        keep = [append(e, s, d_list[r][: n_list[r]] + [b_list[r]]) for r, s in enumerate(seqs)]
        e.commit(e.device_ids(keep))  # the cache keeps block positions 0 .. keep-1; the newest is not in it yet
        t2 = timer(dev)
        e.drafter.commit(seqs, old_len, block, hidden, taps_cat, n_acc, bonus)
    else:  # greedy, stop ids only: how many tokens each row keeps is known on the device; both rollbacks are
        # queued before the host reads the round, and its bookkeeping runs while they do
        keep_dev = device_keep(e, seqs, drafts, n_acc, bonus)
        read, ready = _read_later(dev, n_acc, bonus, keep_dev, drafts)
        e.commit(keep_dev)
        t2 = timer(dev)
        e.drafter.commit(seqs, old_len, block, hidden, taps_cat, n_acc, bonus)
        if ready is not None:
            ready.synchronize()  # the accept and its copy, not the rollbacks queued after them
        settle_times(e)
        rows = read.tolist()
        keep = [append(e, s, row[3:3 + row[0]] + [row[1]]) for row, s in zip(rows, seqs)]
        if keep != [row[2] for row in rows]:
            raise RuntimeError(f"speculative round: the device kept {[row[2] for row in rows]} tokens, the host "
                               f"{keep}")
    t3 = timer(dev)
    for s, added in zip(seqs, keep):
        # the drafts this round put into the output: all n accepted ones when the round ends in its bonus token,
        # fewer when the length limit, a stop string or EOS cut it (the last token added then counts as the round's
        # own), so completion = first token + rounds + accepted drafts holds for every sequence
        record(s.stats, k, added - 1)
    e.spec_times = (seqs, (t0, t1, t2, t3))
    if any(s.finish_reason is not None for s in seqs):
        settle_times(e)


def device_keep(e, seqs, drafts: torch.Tensor, n_acc: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """Tokens each row keeps of this round, on the device ``[B]``: the accepted drafts and the bonus, cut after the
    first of the row's stop ids (EOS unless ignored, ``stop_token_ids``) and at its ``max_new_tokens`` - what
    :func:`append` keeps on the host for requests without stop strings."""
    stop_lists = [sorted(e.stops.stop_ids(s.params)) or [-1] for s in seqs]
    width = max(map(len, stop_lists))
    stops = e.device_ids([ids + [-1] * (width - len(ids)) for ids in stop_lists])  # [B, S], -1 matches no token
    left = e.device_ids([s.params.max_new_tokens - len(s.tokens) for s in seqs])
    return keep_counts(drafts, n_acc, bonus, stops, left)[0]


def _read_later(dev, n_acc, bonus, keep, drafts):
    """The round's result ``[B, 3 + K]`` (n_acc | bonus | keep | drafts) copied towards the host without waiting:
    (host tensor, event to wait on before reading it; None on a CPU, where it is already there)."""
    pack = torch.cat([n_acc[:, None], bonus[:, None], keep[:, None], drafts], dim=1)
    if dev.type != "cuda":
        return pack, None
    host = torch.empty(pack.shape, dtype=pack.dtype, pin_memory=True)
    host.copy_(pack, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return host, ev


def settle_times(e) -> None:
    """Add the last speculative round's device times (drafting with the drafter's commit; verify with the target's
    commit) to its sequences' stats; on a GPU, waits for its last event if the stream has not passed it yet."""
    pending, e.spec_times = e.spec_times, None
    if pending is None:
        return
    seqs, (t0, t1, t2, t3) = pending
    if e.device.type == "cuda":
        t3.synchronize()
    verify_ms, draft_ms = ms(e.device, t1, t2), ms(e.device, t0, t1) + ms(e.device, t2, t3)
    for s in seqs:
        s.stats["verify_ms"] += verify_ms
        s.stats["draft_ms"] += draft_ms


def append(e, seq, tokens: list[int]) -> int:
    """Add ``tokens`` to ``seq`` until it finishes; returns how many were added (its length grows by as many)."""
    added = 0
    for tok in tokens:
        seq.tokens.append(tok)
        added += 1
        if e.stops.finish(seq):
            break
    seq.length += added
    return added


def record(st: dict, k: int, accepted: int) -> None:
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
