"""Token selection for DFlash2's drafts in Triton: the candidates (an ordered top-k over the vocabulary) and the greedy
walk through them, each in place of torch launches that cost more than the work (torch.topk gives a row of 8,192
int64 keys one block and about 76 us on an H200; the walk is two small launches a position).

  ordered_topk   ``torch.topk(x.float(), k)`` along the last dim with ties in one order (equal values by ascending
                 column): two launches, each program the top k of a 2,048-column chunk, then the top k of those
  greedy_walk    tokens ``[B, K]`` from the pair-scored candidates ``scores [B, K, C, C]``: position i's argmax over
                 the row of its scores that position i - 1's choice picks (row 0 at i = 0), one program a row

And the greedy decode chain's link (engine/model/graphs.GraphRunner.chain) in one launch:

  chain_link     the step's argmax over the vocabulary (torch.argmax's choice), written as the picked token and as the
                 next step's input, the position advanced, the stop ids checked and the slot switched to the scratch
                 slot once one came out: about ten torch launches (an argmax reduction, copies, a comparison, an
                 any-reduction, a where), each costing more than its work in a small model's step

Each has a torch reference (``*_ref``) giving the same bits: every comparison is over exact keys or values.
"""

from __future__ import annotations

import functools

import torch

from . import _triton
from ._triton import pow2 as _pow2

__all__ = ["chain_link", "chain_link_ref", "greedy_walk", "greedy_walk_ref", "ordered_topk", "ordered_topk_ref",
           "triton_available"]

triton_available = _triton.available
CHUNK = 2048  # columns a first-pass program of ordered_topk ranks
LINK_CHUNK = 16384  # columns a chain_link program takes (the last program to finish reduces the programs' maxima)
LINK_BLOCK = 8192  # columns a chain_link program loads at once (a chunk of LINK_CHUNK in two loads)


# ---- references --------------------------------------------------------------------------------------------------

def ordered_topk_ref(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x.float(), k)`` along the last dim with ties in one order: equal values by ascending column.

    topk's order among equal values is not specified and, on CUDA, not always the same run to run; bf16 logits tie
    often. Each float is mapped to an int32 of the same order, shifted up 32 bits and joined with its reversed
    column, so every key is distinct and topk's choice is a function of the values alone. Returns (values, columns).
    """
    f = x.float()
    bits = f.view(torch.int32)
    # negative floats with their magnitude bits flipped (bits >> 31 is all ones for them, 0 otherwise): the same keys
    # as where(bits < 0, bits ^ 0x7FFFFFFF, bits) in three cheap elementwise ops instead of a where over a mask
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)
    n = f.shape[-1]
    cols = torch.arange(n - 1, -1, -1, device=f.device, dtype=torch.int64)
    _, top = torch.topk((ordered << 32) | cols, k, dim=-1)
    return f.gather(-1, top), top


def greedy_walk_ref(scores: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Tokens ``[B, K]``: ``cand[b, i, j_i]`` with ``j_0 = argmax scores[b, 0, 0]`` and ``j_i = argmax scores[b, i,
    j_(i-1)]`` (``scores [B, K, C, C]`` fp32, ``cand [B, K, C]``)."""
    b, k, c, _ = scores.shape
    idx = scores[:, 0, 0].argmax(-1)
    picks = [idx]
    for i in range(1, k):
        idx = scores[:, i].gather(1, idx.view(b, 1, 1).expand(b, 1, c)).squeeze(1).argmax(-1)
        picks.append(idx)
    return cand.gather(2, torch.stack(picks, 1)[..., None]).squeeze(-1)


def chain_link_ref(logits, stops, own, scratch: int, picked, ids, pos, done, slots) -> None:
    """The greedy chain's link as torch ops: ``tok = logits.argmax(-1)`` (``logits [1, V]``) into ``picked [1]`` and
    ``ids [1]``, ``pos [1]`` += 1, ``done [1]`` (bool) |= tok is one of ``stops [S]`` (-1 padded), ``slots [1]`` =
    ``scratch`` where done, else ``own [1]``."""
    tok = logits.argmax(-1)
    picked.copy_(tok)
    ids.copy_(tok)
    pos.add_(1)
    done.logical_or_((tok[:, None] == stops[None]).any(-1))
    slots.copy_(torch.where(done, torch.full_like(own, scratch), own))


# ---- fast versions -----------------------------------------------------------------------------------------------

def _ready(op: str, x: torch.Tensor) -> dict:
    return _triton.ready(op, _kernels, x)


def ordered_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ordered_topk_ref` in two launches (any leading shape, ``1 <= k <= 64`` and ``k <=`` the last dim).
    Returns (values fp32, columns int64), both ``[..., k]``."""
    n = x.shape[-1]
    if not 1 <= k <= min(64, n):
        raise ValueError(f"ordered_topk: k must be in 1 .. min(64, {n}), got {k}")
    kern = _ready("ordered_topk", x)
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    chunk = min(CHUNK, _pow2(n))
    chunks = -(-n // chunk)
    part = torch.empty(rows, chunks * k, dtype=torch.int64, device=x.device)
    vals = torch.empty(rows, k, dtype=torch.float32, device=x.device)
    cols = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    kern["topk_chunks"][(rows, chunks)](x2, part, x2.stride(0), part.stride(0), n, K=k, CHUNK=chunk,
                                         num_warps=4 if chunk >= 1024 else 1, **_triton.pdl_args(x.device))
    kern["topk_merge"][(rows,)](x2, part, vals, cols, x2.stride(0), part.stride(0), vals.stride(0), n, chunks * k,
                                K=k, BLOCK=_pow2(chunks * k), num_warps=1 if chunks * k <= 256 else 4,
                                **_triton.pdl_args(x.device))
    lead = x.shape[:-1]
    return vals.view(*lead, k), cols.view(*lead, k)


def greedy_walk(scores: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """:func:`greedy_walk_ref` in one launch (``scores [B, K, C, C]`` fp32 and ``cand [B, K, C]`` int64, both
    contiguous)."""
    if scores.dim() != 4 or cand.shape != scores.shape[:3] or scores.shape[2] != scores.shape[3]:
        raise ValueError(f"greedy_walk: scores must be [B, K, C, C] and cand [B, K, C], got {tuple(scores.shape)} "
                         f"and {tuple(cand.shape)}")
    if not (scores.is_contiguous() and cand.is_contiguous()) or scores.dtype != torch.float32:
        raise ValueError("greedy_walk: scores (fp32) and cand must be contiguous")
    b, k, c, _ = scores.shape
    kern = _ready("greedy_walk", scores)
    out = torch.empty(b, k, dtype=cand.dtype, device=cand.device)
    kern["walk"][(b,)](scores, cand, out, K=k, C=c, BLOCK_C=_pow2(c), num_warps=1, **_triton.pdl_args(scores.device))
    return out


class LinkScratch:
    """:func:`chain_link`'s buffers for a vocabulary of ``n`` on ``device`` (made before a capture, reused by every
    replay): each program's largest key and the programs' finish counter (back at 0 after every launch)."""

    def __init__(self, n: int, device):
        self.n = n
        self.chunk = min(LINK_CHUNK, _pow2(n))
        self.programs = -(-n // self.chunk)
        self.part = torch.empty(self.programs, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)


def chain_link(logits, stops, own, scratch: int, picked, ids, pos, done, slots, work: LinkScratch) -> None:
    """:func:`chain_link_ref` in one launch (``logits [1, V]`` with the last dim contiguous; the int64 ``picked``,
    ``ids``, ``pos``, ``own``, ``slots`` and the bool ``done`` one element each, contiguous; ``stops`` int64 [S]).
    Programs of LINK_CHUNK columns each store their largest ordered key (:func:`ordered_topk_ref`'s keys: a value's
    order above, its reversed column below, so the largest key is the first column of the largest value; a NaN
    counts as the largest, -0.0 as 0.0, as torch's argmax takes them); the last program to finish takes the largest
    of those and writes the link. A vocabulary of at most LINK_CHUNK is one program, which writes the link from its
    own maximum (no counter, no second read). No host synchronisation: CUDA-graph safe."""
    n = logits.shape[-1]
    if logits.dim() != 2 or logits.shape[0] != 1 or logits.stride(-1) != 1 or work.n != n:
        raise ValueError(f"chain_link: logits must be [1, V] with V = {work.n} (the scratch's), last dim contiguous; "
                         f"got {tuple(logits.shape)}")
    for name, x in (("picked", picked), ("ids", ids), ("pos", pos), ("own", own), ("slots", slots), ("done", done)):
        if x.numel() != 1 or not x.is_contiguous() or x.dtype != (torch.bool if name == "done" else torch.int64):
            raise ValueError(f"chain_link: {name} must be one contiguous "
                             f"{'bool' if name == 'done' else 'int64'} element, got {x.dtype} {tuple(x.shape)}")
    kern = _ready("chain_link", logits)
    kern["link"][(work.programs,)](logits, work.part, work.count, stops, own, picked, ids, pos, done, slots, n,
                                   stops.numel(), scratch, CHUNK=work.chunk, BLOCK=min(LINK_BLOCK, work.chunk),
                                   ONE=work.programs == 1,
                                   BLOCK_S=_pow2(stops.numel()), BLOCK_P=_pow2(work.programs), num_warps=8,
                                   **_triton.pdl_args(logits.device))


# ---- Triton kernels ------------------------------------------------------------------------------------------------
# Plain functions here, turned into jitted kernels by `_kernels()` on first use (see kernels/fused.py).

tl = pdl_enter = None  # triton.language and the PDL helper, bound by _kernels()


def _order_keys(x, offs, N):
    """The ordered int64 keys of fp32 values ``x`` at columns ``offs`` (a value's order above, its reversed column
    below), the int64 minimum past N."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
    key = (ordered << 32) | (N - 1 - offs).to(tl.int64)
    return tl.where(offs < N, key, -9223372036854775807 - 1)


def _keys(X, row, stride_x, offs, N):
    """The ordered int64 keys of columns ``offs`` of row ``row`` (the reference's), the int64 minimum past N."""
    x = tl.load(X + row * stride_x + offs, mask=offs < N, other=0.0).to(tl.float32)
    return _order_keys(x, offs, N)


def _topk_chunks_kernel(X, PART, stride_x, stride_p, N, K: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk): the chunk's K largest keys, in order (keys are distinct: K rounds of max-and-remove)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1)
    keys = _keys(X, row, stride_x, ch * CHUNK + tl.arange(0, CHUNK), N)
    for j in tl.static_range(K):
        m = tl.max(keys, 0)
        tl.store(PART + row * stride_p + ch * K + j, m)
        keys = tl.where(keys == m, -9223372036854775807 - 1, keys)


def _topk_merge_kernel(X, PART, VALS, COLS, stride_x, stride_p, stride_v, N, M, K: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program = one row: the K largest of its chunks' keys, their columns and values."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    keys = tl.load(PART + row * stride_p + offs, mask=offs < M, other=-9223372036854775807 - 1)
    for j in tl.static_range(K):
        m = tl.max(keys, 0)
        col = N - 1 - (m & 0xFFFFFFFF)
        tl.store(COLS + row * stride_v + j, col)
        tl.store(VALS + row * stride_v + j, tl.load(X + row * stride_x + col).to(tl.float32))
        keys = tl.where(keys == m, -9223372036854775807 - 1, keys)


def _walk_kernel(S, CAND, OUT, K: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """Program = one row: K argmaxes, each over the scores row the previous pick selects (first index on ties)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    j = 0
    for i in tl.static_range(K):
        base = S + ((b * K + i) * C + j) * C
        s = tl.load(base + offs, mask=offs < C, other=float("-inf"))
        j = tl.argmax(s, 0, tie_break_left=True)
        tl.store(OUT + b * K + i, tl.load(CAND + (b * K + i) * C + j))


def _link_kernel(X, PART, COUNT, STOPS, OWN, PICKED, IDS, POS, DONE, SLOTS, N, NS, scratch, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, ONE: tl.constexpr,
                 PDL: tl.constexpr):
    """Program p: the largest ordered key of columns p * CHUNK ..; the last program to finish (ONE: the only one,
    from its own maximum): the link."""
    pdl_enter(PDL)  # PDL launches (a captured step): launched while the lm_head runs, reading its logits after it
    p = tl.program_id(0)
    lowest = -9223372036854775807 - 1
    best = tl.full([BLOCK], lowest, tl.int64)
    for j in tl.static_range(CHUNK // BLOCK):
        offs = p * CHUNK + j * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < N, other=0.0).to(tl.float32)
        x = tl.where(x != x, float("nan"), tl.where(x == 0.0, 0.0, x))  # one NaN (above every number), one zero
        best = tl.maximum(best, _order_keys(x, offs, N))
    if ONE:
        last = True
        top = tl.max(best, 0)
    else:
        tl.store(PART + p, tl.max(best, 0))
        ticket = tl.atomic_add(COUNT, 1, sem="acq_rel")  # after this program's maximum is stored
        last = ticket == tl.num_programs(0) - 1  # every program's maximum is in PART
        offs_p = tl.arange(0, BLOCK_P)
        top = tl.max(tl.load(PART + offs_p, mask=(offs_p < tl.num_programs(0)) & last, other=lowest, volatile=True), 0)
    if last:
        tok = N - 1 - (top & 0xFFFFFFFF)
        tl.store(PICKED, tok)
        tl.store(IDS, tok)
        tl.store(POS, tl.load(POS) + 1)
        offs_s = tl.arange(0, BLOCK_S)
        hit = tl.max((tl.load(STOPS + offs_s, mask=offs_s < NS, other=-1) == tok).to(tl.int32), 0)
        done = (tl.load(DONE).to(tl.int32) | hit) != 0
        tl.store(DONE, done)
        tl.store(SLOTS, tl.where(done, scratch, tl.load(OWN)))
        if not ONE:
            tl.store(COUNT, 0)  # ready for the next launch (ONE never raised it)


@functools.lru_cache(maxsize=1)
def _kernels() -> dict:
    """Jit the kernels (first call only)."""
    return _triton.jit_module(globals(), ("_order_keys", "_keys"), {"topk_chunks": "_topk_chunks_kernel",
                                                      "topk_merge": "_topk_merge_kernel", "walk": "_walk_kernel",
                                                      "link": "_link_kernel"})
