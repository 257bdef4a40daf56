"""A greedy speculative round's integer glue in Triton: acceptance, the tokens kept, and the chained round's state
update, each one launch instead of a dozen or more small torch ops (engine/spec/chain.py replays them in the
round's CUDA graphs, where every launch costs a few microseconds however little it does).

  accept_keep    from the drafts and the target's argmax over the verified block: the accepted drafts (the longest
                 matching prefix), the bonus token, the round's tokens in order, and how many are kept (cut after
                 the first stop id and at the tokens still allowed)
  chain_update   a chained round's device state after it: the newest token, length, tokens generated and still
                 allowed, the finished flag, the slot written next, and the round's result row

Each has a torch reference beside it (``*_ref``, same signature, same outputs; integer logic, so the same bits).
The engine runs the references on a CPU and the kernels on CUDA. Programs: one per sequence row.
"""

from __future__ import annotations

import functools

import torch

from . import _triton
from ._triton import pow2 as _pow2

__all__ = [
    "accept_keep",
    "accept_keep_ref",
    "chain_update",
    "chain_update_ref",
    "greedy_accept_ref",
    "keep_counts_ref",
    "triton_available",
]

triton_available = _triton.available


# ---- references --------------------------------------------------------------------------------------------------

def greedy_accept_ref(drafts: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``n_acc [B]``: the longest prefix of ``drafts [B, K]`` equal to ``target[:, :K]`` (the target's argmax at
    each verified position, ``[B, K + 1]``); ``bonus [B]``: the target's token after it, ``target[n_acc]``."""
    match = (drafts == target[:, :-1]).to(torch.int64)
    n_acc = match.cumprod(dim=1).sum(dim=1)
    return n_acc, target.gather(1, n_acc[:, None]).squeeze(1)


def keep_counts_ref(drafts: torch.Tensor, n_acc: torch.Tensor, bonus: torch.Tensor, stops: torch.Tensor,
                    left: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How many tokens each row of a greedy round keeps: ``stops [B, S]`` (a row's stop ids, padded with -1), ``left
    [B]`` (the tokens it may still add). Returns (``keep [B]``: the accepted drafts and the bonus, cut after the first
    stop id and at ``left``; ``tokens [B, K+1]``: the round's tokens in order, the bonus at position ``n_acc`` and
    after; ``stopped [B]``: a stop id is among the first ``n_acc + 1``)."""
    k = drafts.shape[1]
    i = torch.arange(k + 1, device=drafts.device)[None]
    block = torch.cat([drafts, bonus[:, None]], dim=1)
    tokens = torch.where(i < n_acc[:, None], block, bonus[:, None])
    count = n_acc + 1
    hit = (tokens[:, :, None] == stops[:, None, :]).any(-1) & (i < count[:, None])
    stopped = hit.any(1)
    first = torch.where(stopped, hit.to(torch.int64).argmax(1) + 1, count)
    return torch.minimum(torch.minimum(count, first), left), tokens, stopped


def accept_keep_ref(drafts, target, stops, left):
    """(n_acc, bonus, keep, tokens, stopped) of :func:`greedy_accept_ref` then :func:`keep_counts_ref`."""
    n_acc, bonus = greedy_accept_ref(drafts, target)
    return (n_acc, bonus, *keep_counts_ref(drafts, n_acc, bonus, stops, left))


def chain_update_ref(keep, tokens, stopped, done, last, length, ntok, left, slot, own, scratch, out, n_acc, bonus,
                     drafts) -> None:
    """A chained round's state after its acceptance, in place (every tensor ``[B]`` except ``tokens [B, K+1]``,
    ``drafts [B, K]``, ``out [B, 3 + K]``). Rows not yet ``done`` take the kept tokens: ``last`` = the newest of them,
    ``length`` / ``ntok`` grow and ``left`` shrinks by ``keep``; a row is done once a stop id was kept or nothing is
    left, and then writes the ``scratch`` slot instead of its ``own``; ``out`` = n_acc | bonus | keep | drafts."""
    live = ~done
    taken = torch.where(live, keep, torch.zeros_like(keep))
    newest = tokens.gather(1, (keep - 1).clamp_min(0)[:, None])[:, 0]
    last.copy_(torch.where(live, newest, last))
    length.add_(taken)
    ntok.add_(taken)
    left.sub_(taken)
    done.logical_or_(stopped | (left <= 0))
    slot.copy_(torch.where(done, scratch, own))
    out.copy_(torch.cat([n_acc[:, None], bonus[:, None], keep[:, None], drafts], dim=1))


# ---- fast versions -----------------------------------------------------------------------------------------------

def _ready(op: str, x: torch.Tensor) -> dict:
    return _triton.ready(op, _kernels, x)


def _check_rows(op: str, drafts: torch.Tensor, **named) -> tuple[int, int]:
    if drafts.dim() != 2 or drafts.stride(-1) != 1:
        raise ValueError(f"{op}: drafts must be [B, K], contiguous along K, got {tuple(drafts.shape)} "
                         f"strides {drafts.stride()}")
    b, k = drafts.shape
    for name, (x, shape) in named.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{op}: {name} must be {list(shape)}, got {list(x.shape)}")
        if x.dim() == 2 and x.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be contiguous along its last dimension")
    return b, k


def accept_keep(drafts, target, stops, left):
    """:func:`accept_keep_ref` in one launch: ``drafts [B, K]``, ``target [B, K+1]``, ``stops [B, S]`` and ``left
    [B]`` int64 on one device. Returns (n_acc, bonus, keep [B] int64, tokens [B, K+1] int64, stopped [B] bool)."""
    b, k = _check_rows("accept_keep", drafts, target=(target, (drafts.shape[0], drafts.shape[1] + 1)),
                       left=(left, (drafts.shape[0],)))
    if stops.dim() != 2 or stops.shape[0] != b or stops.stride(-1) != 1:
        raise ValueError(f"accept_keep: stops must be [B={b}, S], contiguous, got {tuple(stops.shape)}")
    kern = _ready("accept_keep", drafts)
    dev = drafts.device
    n_acc, bonus, keep = (torch.empty(b, dtype=torch.int64, device=dev) for _ in range(3))
    tokens = torch.empty(b, k + 1, dtype=torch.int64, device=dev)
    stopped = torch.empty(b, dtype=torch.bool, device=dev)
    kern["accept_keep"][(b,)](drafts, target, stops, left, n_acc, bonus, keep, tokens, stopped,
                              drafts.stride(0), target.stride(0), stops.stride(0), tokens.stride(0),
                              K=k, S=stops.shape[1], BLOCK_K=_pow2(k + 1), BLOCK_S=_pow2(max(1, stops.shape[1])),
                              num_warps=1, **_triton.pdl_args(dev))
    return n_acc, bonus, keep, tokens, stopped


def chain_update(keep, tokens, stopped, done, last, length, ntok, left, slot, own, scratch, out, n_acc, bonus,
                 drafts) -> None:
    """:func:`chain_update_ref` in one launch (the same arguments; the state tensors contiguous, int64, ``done``
    bool)."""
    b, k = _check_rows("chain_update", drafts, tokens=(tokens, (drafts.shape[0], drafts.shape[1] + 1)),
                       out=(out, (drafts.shape[0], drafts.shape[1] + 3)))
    for name, x in (("keep", keep), ("stopped", stopped), ("done", done), ("last", last), ("length", length),
                    ("ntok", ntok), ("left", left), ("slot", slot), ("own", own), ("scratch", scratch),
                    ("n_acc", n_acc), ("bonus", bonus)):
        if tuple(x.shape) != (b,) or x.stride(0) != 1:
            raise ValueError(f"chain_update: {name} must be a contiguous [{b}], got {tuple(x.shape)}")
    kern = _ready("chain_update", drafts)
    kern["chain_update"][(b,)](keep, tokens, stopped, done, last, length, ntok, left, slot, own, scratch, out, n_acc,
                               bonus, drafts, tokens.stride(0), out.stride(0), drafts.stride(0),
                               K=k, BLOCK_K=_pow2(k + 1), num_warps=1, **_triton.pdl_args(drafts.device))


# ---- Triton kernels ------------------------------------------------------------------------------------------------
# Plain functions here, turned into jitted kernels by `_kernels()` on first use (see kernels/fused.py).

tl = pdl_enter = None  # triton.language and the PDL helper, bound by _kernels()


def _accept_keep_kernel(D, TG, ST, LEFT, NACC, BONUS, KEEP, TOK, STOPPED, stride_d, stride_t, stride_s, stride_o,
                        K: tl.constexpr, S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                        PDL: tl.constexpr):
    """Program = one row: n_acc = the first mismatch (K if none), the tokens, the first stop id kept, keep."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_K)
    d = tl.load(D + row * stride_d + i, mask=i < K, other=-1)
    t = tl.load(TG + row * stride_t + i, mask=i < K, other=-2)
    n_acc = tl.min(tl.where((d != t) & (i < K), i, K), 0)
    bonus = tl.load(TG + row * stride_t + n_acc)
    tok = tl.where(i < n_acc, d, bonus)
    count = n_acc + 1
    j = tl.arange(0, BLOCK_S)
    st = tl.load(ST + row * stride_s + j, mask=j < S, other=-1)
    hit = (tl.max(((tok[:, None] == st[None, :]) & (j[None, :] < S)).to(tl.int32), 1) > 0) & (i < count)
    first = tl.min(tl.where(hit, i + 1, count), 0)  # the first stop id kept (count when none is)
    keep = tl.minimum(tl.minimum(count, first), tl.load(LEFT + row))
    tl.store(TOK + row * stride_o + i, tok, mask=i < K + 1)
    tl.store(NACC + row, n_acc.to(tl.int64))
    tl.store(BONUS + row, bonus)
    tl.store(KEEP + row, keep.to(tl.int64))
    tl.store(STOPPED + row, tl.max(hit.to(tl.int32), 0) > 0)


def _chain_update_kernel(KEEP, TOK, STOPPED, DONE, LAST, LENGTH, NTOK, LEFT, SLOT, OWN, SCRATCH, OUT, NACC, BONUS, D,
                         stride_t, stride_o, stride_d, K: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program = one row: the state of a live row advances by its kept tokens; the result row is written."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    keep = tl.load(KEEP + row)
    done = tl.load(DONE + row) != 0
    taken = tl.where(done, 0, keep)
    newest = tl.load(TOK + row * stride_t + tl.maximum(keep - 1, 0))
    tl.store(LAST + row, tl.where(done, tl.load(LAST + row), newest))
    tl.store(LENGTH + row, tl.load(LENGTH + row) + taken)
    tl.store(NTOK + row, tl.load(NTOK + row) + taken)
    left = tl.load(LEFT + row) - taken
    tl.store(LEFT + row, left)
    done = done | (tl.load(STOPPED + row) != 0) | (left <= 0)
    tl.store(DONE + row, done)
    tl.store(SLOT + row, tl.where(done, tl.load(SCRATCH + row), tl.load(OWN + row)))
    tl.store(OUT + row * stride_o, tl.load(NACC + row))
    tl.store(OUT + row * stride_o + 1, tl.load(BONUS + row))
    tl.store(OUT + row * stride_o + 2, keep)
    i = tl.arange(0, BLOCK_K)
    tl.store(OUT + row * stride_o + 3 + i, tl.load(D + row * stride_d + i, mask=i < K, other=0), mask=i < K)


@functools.lru_cache(maxsize=1)
def _kernels() -> dict:
    """Jit the kernels (first call only)."""
    return _triton.jit_module(globals(), (), {"accept_keep": "_accept_keep_kernel",
                                               "chain_update": "_chain_update_kernel"})
