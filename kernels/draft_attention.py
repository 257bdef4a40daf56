"""A block drafter's attention in Triton: the block's query rows against the slot's context keys and values read in
place from the drafter's cache (a DFlash2 window ring, or a DFlash context of every position), plus the block's own
keys and values, with the context mask worked out from the rows' positions in registers.

The torch path (engine/model/dflash.py, ``sdpa_rows``) first gathers every layer's cache rows of the drafting slots
(one copy of ``[2, layers, B, rows, Hkv, hd]``), writes the block's keys and values after them, builds a boolean
mask and its additive form, and runs two batched matmuls with a softmax between them: at the 27B shape about a
dozen launches a layer and 0.15-0.3 ms a draft on an H200 (docs/perf/2026-12-04e-spec-round-pdl-h200.md). Here a
layer is two launches:

* ``_draft_split``, grid ``(B * Hkv, splits)``: one program takes all ``S x G`` query rows of one kv head (the block's
  S tokens times the G query heads of that kv head, folded into the rows of one tile as ``sdpa_rows`` folds them)
  against one range of the slot's context rows, online softmax in fp32 over ``BLOCK_N``-key tiles; the last range
  also takes the block's own S keys and values, from the tensors the layer just projected (nothing is written to
  the cache). A context row ``j`` is visible to the block when its position ``p = pos[slot, j]`` satisfies
  ``0 <= p < length`` and, with a window, ``p >= length - window``. Without a window a row's index is its position,
  so the program stops at ``min(range end, length)`` (no work for rows not yet written).
* ``_draft_combine``, grid ``(B * Hkv, S x G)``: one query row's partial sums of every range at once, merged by
  their running maxima (base 2), divided by the summed weights and stored as ``[B, S, H, hd]`` in q's dtype. With one range the split kernel stores the
  output itself and there is no second launch.

Nothing is read back to the host and the grid depends on shapes only, so a call can be captured in a CUDA graph
(the drafter's block is replayed from one, engine/spec/draft_graphs.py). :func:`draft_attention_ref` is the fp32
reference. Drafting only proposes tokens; the target's verify decides them, so this kernel cannot change a greedy
run's output, only how many drafts it accepts.
"""

from __future__ import annotations

import functools

import torch

from . import _triton

__all__ = ["block_mask", "draft_attention", "draft_attention_ref", "draft_splits", "triton_available"]

triton_available = _triton.available

LOG2E = 1.4426950408889634
BLOCK_N = 64  # context keys a tile
MAX_SPLITS = 64  # context ranges a call at most (the combine loads all of a row's at once)


def _check(q, k_blk, v_blk, ring_k, ring_v, slots, ring_pos, length, cap: int, window: int,
           who: str = "draft_attention") -> None:
    if q.dim() != 4:
        raise ValueError(f"{who}: q must be [B, S, H, hd], got shape {tuple(q.shape)}")
    b, s, h, hd = q.shape
    if k_blk.dim() != 4 or k_blk.shape[:2] != (b, s) or k_blk.shape[3] != hd or v_blk.shape != k_blk.shape:
        raise ValueError(f"{who}: k_blk and v_blk must both be [B={b}, S={s}, Hkv, hd={hd}], "
                         f"got {tuple(k_blk.shape)} and {tuple(v_blk.shape)}")
    hkv = k_blk.shape[2]
    if h % hkv:
        raise ValueError(f"{who}: H={h} query heads is not a multiple of Hkv={hkv} kv heads")
    if ring_k.dim() != 4 or ring_k.shape[2:] != (hkv, hd) or ring_v.shape != ring_k.shape:
        raise ValueError(f"{who}: ring_k and ring_v must both be [slots, rows, Hkv={hkv}, hd={hd}], "
                         f"got {tuple(ring_k.shape)} and {tuple(ring_v.shape)}")
    n_slots, rows = ring_k.shape[:2]
    if not 0 < cap <= rows or ring_pos.dim() != 2 or ring_pos.shape[0] != n_slots or ring_pos.shape[1] < cap:
        raise ValueError(f"{who}: cap={cap} context rows must fit the ring's {rows} rows and ring_pos "
                         f"[slots={n_slots}, >= cap], got ring_pos {tuple(ring_pos.shape)}")
    if window < 0:
        raise ValueError(f"{who}: window must be >= 0 (0: no window), got {window}")
    if slots.shape != (b,) or length.shape != (b,):
        raise ValueError(f"{who}: slots and length must be [B={b}], got {tuple(slots.shape)} and "
                         f"{tuple(length.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{who}: q must be bf16, fp16 or fp32, got {q.dtype}")
    for name, x in (("k_blk", k_blk), ("v_blk", v_blk), ("ring_k", ring_k), ("ring_v", ring_v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{who}: {name} is {x.dtype}, q is {q.dtype} (one dtype for all)")
    for name, x in (("q", q), ("k_blk", k_blk), ("v_blk", v_blk), ("ring_k", ring_k), ("ring_v", ring_v),
                    ("slots", slots), ("ring_pos", ring_pos), ("length", length)):
        if x.device != q.device:
            raise ValueError(f"{who}: {name} is on {x.device}, q on {q.device}")
        if x.dim() == 4 and x.stride(-1) != 1:
            raise ValueError(f"{who}: {name} must be contiguous along its last dimension")


def block_mask(ring_pos, slots, length, cap: int, window: int, s: int) -> torch.Tensor:
    """The boolean mask ``[B, 1, S, cap + S]`` (True = visible) of a block of ``s`` rows over its slots' first ``cap``
    context rows and then itself: context row j of row b is visible when its position ``p = ring_pos[slots[b], j]``
    is in ``[length[b] - window, length[b])`` (no lower bound for ``window`` 0), every block key is. What
    :func:`draft_attention` works out in registers; the drafter's torch path and the reference build it here."""
    cpos = ring_pos.index_select(0, slots)[:, :cap]  # [B, cap] (index_select: a plain copy per row)
    vis = (cpos >= 0) & (cpos < length[:, None])
    if window:
        vis &= cpos >= (length[:, None] - window)
    b = slots.shape[0]
    block = torch.ones(b, s, s, dtype=torch.bool, device=vis.device)
    return torch.cat([vis[:, None, :].expand(b, s, -1), block], dim=-1)[:, None]


def draft_attention_ref(q, k_blk, v_blk, ring_k, ring_v, slots, ring_pos, length, cap: int, window: int,
                        scale: float) -> torch.Tensor:
    """fp32 reference of :func:`draft_attention`: the context rows gathered, the mask built, softmax in fp32, one
    rounding to q's dtype."""
    _check(q, k_blk, v_blk, ring_k, ring_v, slots, ring_pos, length, cap, window)
    b, s, h, hd = q.shape
    hkv = k_blk.shape[2]
    mask = block_mask(ring_pos, slots, length, cap, window, s)  # [B, 1, S, cap + S]
    k = torch.cat([ring_k[slots, :cap], k_blk], dim=1).float()  # [B, cap + S, Hkv, hd]
    v = torch.cat([ring_v[slots, :cap], v_blk], dim=1).float()
    rep = h // hkv
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    sc = torch.einsum("bshd,bnhd->bhsn", q.float(), k) * scale
    sc = sc.masked_fill(~mask, float("-inf"))
    o = torch.einsum("bhsn,bnhd->bshd", torch.softmax(sc, dim=-1), v)
    return o.to(q.dtype)


def _new_buffer(shape, dtype, device) -> torch.Tensor:
    """Output and workspace allocation (tests swap in a NaN fill to catch unwritten elements)."""
    return torch.empty(shape, dtype=dtype, device=device)


def draft_splits(batch: int, kv_heads: int, cap: int, device) -> int:
    """Context ranges a call splits the rows into: about two programs an SM over the grid, whole tiles each."""
    tiles = -(-cap // BLOCK_N)
    want = min(MAX_SPLITS, -(-2 * _triton.num_sms(device) // max(1, batch * kv_heads)))
    per = -(-tiles // max(1, min(tiles, want)))  # tiles a range
    return -(-tiles // per)


def draft_attention(q, k_blk, v_blk, ring_k, ring_v, slots, ring_pos, length, cap: int, window: int,
                    scale: float, splits: int | None = None) -> torch.Tensor:
    """Attention of a drafted block ``q [B, S, H, hd]`` over its context and itself: row b reads cache slot
    ``slots[b]`` of ``ring_k`` / ``ring_v [slots, rows, Hkv, hd]`` (its first ``cap`` rows; their positions are
    ``ring_pos [slots, >= cap]``, -1 for an empty row) and the block's ``k_blk`` / ``v_blk [B, S, Hkv, hd]``, all in
    q's dtype. A context row is visible when its position is in ``[length[b] - window, length[b])`` (no lower bound
    for ``window`` 0), every block key is visible. Returns ``[B, S, H, hd]`` in q's dtype; fp32 softmax and
    accumulation (fp32 inputs take tf32x3 products on a GPU). ``splits`` overrides :func:`draft_splits` (tests). No host
    synchronisation: capturable."""
    _check(q, k_blk, v_blk, ring_k, ring_v, slots, ring_pos, length, cap, window)
    kern = _triton.ready("draft_attention", _kernels, q)
    b, s, h, hd = q.shape
    hkv = k_blk.shape[2]
    g = h // hkv
    tiles = -(-cap // BLOCK_N)
    n = max(1, min(tiles, MAX_SPLITS, splits or draft_splits(b, hkv, cap, q.device)))
    keys = -(-tiles // n) * BLOCK_N  # context rows a range
    n = -(-cap // keys)
    block_r = max(16, _triton.pow2(s * g))
    block_d = max(16, _triton.pow2(hd))
    block_s = max(16, _triton.pow2(s))
    out = _new_buffer((b, s, h, hd), q.dtype, q.device)
    if n > 1:
        part = _new_buffer((b * hkv, n, block_r, block_d), torch.float32, q.device)
        stats = _new_buffer((b * hkv, n, 2, block_r), torch.float32, q.device)
    else:
        part = stats = out  # unused: the split kernel stores the output
    dt = kern["dtypes"][q.dtype]
    pdl = _triton.pdl_args(q.device)
    kern["split"][(b * hkv, n)](
        q, k_blk, v_blk, ring_k, ring_v, slots, ring_pos, length, part, stats, out,
        *q.stride()[:3], *k_blk.stride()[:3], *v_blk.stride()[:3], *ring_k.stride()[:3], *ring_v.stride()[:3],
        ring_pos.stride(0), *out.stride()[:3],
        s, cap, keys, n, scale * LOG2E, WINDOW=window,
        HKV=hkv, G=g, HD=hd, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_S=block_s, BLOCK_N=BLOCK_N,
        DOT_DTYPE=dt, DOT_PREC="tf32x3" if q.dtype == torch.float32 else "tf32", FINAL=n == 1, num_warps=4, num_stages=2, **pdl)
    if n > 1:
        kern["combine"][(b * hkv, s * g)](part, stats, out, *out.stride()[:3], s, n, HKV=hkv, G=g, HD=hd,
                                          BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_SP=max(2, _triton.pow2(n)),
                                          num_warps=4, **pdl)
    return out


# ---- the kernels (plain functions, jitted on first use: see kernels/attention_triton_kernels.py) ------------------

tl = pdl_enter = None  # triton.language and the PDL helper, bound by _kernels()


def _softmax_tile(q, k, v, visible, m_i, l_i, acc, SCALE2, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
    """One tile of keys ``k`` / values ``v`` (``visible`` [BLOCK_N]) into the running max, sum and output of the
    query rows ``q`` (base 2: SCALE2 = scale * log2 e)."""
    sc = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * SCALE2
    sc = tl.where(visible[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp2(m_i - m_new)
    pr = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(DOT_DTYPE), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


def _draft_split(Q, KB, VB, RK, RV, SLOTS, RPOS, LEN, PART, STATS, OUT,
                 sq_b, sq_s, sq_h, skb_b, skb_s, skb_h, svb_b, svb_s, svb_h, srk_s, srk_n, srk_h, srv_s, srv_n, srv_h,
                 sp_s, so_b, so_s, so_h,
                 S, CAP, KEYS, NSPLIT, SCALE2, WINDOW: tl.constexpr,
                 HKV: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
                 FINAL: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // HKV
    kvh = pid % HKV
    pdl_enter(PDL)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < S * G
    tok = r // G
    head = kvh * G + r % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HD
    q = tl.load(Q + b.to(tl.int64) * sq_b + tok[:, None] * sq_s + head[:, None] * sq_h + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
    slot = tl.load(SLOTS + b).to(tl.int64)
    length = tl.load(LEN + b).to(tl.int32)
    lo = sp * KEYS
    hi = tl.minimum(lo + KEYS, CAP)
    if WINDOW == 0:  # a row's index is its position: rows at or past the length are not written yet
        hi = tl.minimum(hi, length)
    m_i = tl.full((BLOCK_R,), -1.0e30, tl.float32)  # finite: a range with no visible key keeps weight 0
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    n = tl.arange(0, BLOCK_N)
    rk = RK + slot * srk_s + kvh * srk_h
    rv = RV + slot * srv_s + kvh * srv_h
    for start in range(lo, hi, BLOCK_N):
        j = start + n
        j_ok = j < hi
        p = tl.load(RPOS + slot * sp_s + j, mask=j_ok, other=-1)
        vis = j_ok & (p >= 0) & (p < length)
        if WINDOW > 0:
            vis = vis & (p >= length - WINDOW)
        kd = j_ok[:, None] & d_ok[None, :]
        k = tl.load(rk + j[:, None].to(tl.int64) * srk_n + d[None, :], mask=kd, other=0.0).to(DOT_DTYPE)
        v = tl.load(rv + j[:, None].to(tl.int64) * srv_n + d[None, :], mask=kd, other=0.0).to(DOT_DTYPE)
        m_i, l_i, acc = _softmax_tile(q, k, v, vis, m_i, l_i, acc, SCALE2, DOT_DTYPE, DOT_PREC)
    if sp == NSPLIT - 1:  # the block's own keys and values, every one visible
        t = tl.arange(0, BLOCK_S)
        t_ok = t < S
        kd = t_ok[:, None] & d_ok[None, :]
        k = tl.load(KB + b.to(tl.int64) * skb_b + t[:, None] * skb_s + kvh * skb_h + d[None, :], mask=kd,
                    other=0.0).to(DOT_DTYPE)
        v = tl.load(VB + b.to(tl.int64) * svb_b + t[:, None] * svb_s + kvh * svb_h + d[None, :], mask=kd,
                    other=0.0).to(DOT_DTYPE)
        m_i, l_i, acc = _softmax_tile(q, k, v, t_ok, m_i, l_i, acc, SCALE2, DOT_DTYPE, DOT_PREC)
    if FINAL:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + b.to(tl.int64) * so_b + tok[:, None] * so_s + head[:, None] * so_h + d[None, :],
                 o.to(OUT.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    else:
        base = pid.to(tl.int64) * NSPLIT + sp
        tl.store(PART + base * BLOCK_R * BLOCK_D + r[:, None] * BLOCK_D + d[None, :], acc)
        tl.store(STATS + base * 2 * BLOCK_R + r, m_i)
        tl.store(STATS + base * 2 * BLOCK_R + BLOCK_R + r, l_i)


def _draft_combine(PART, STATS, OUT, so_b, so_s, so_h, S, NSPLIT,
                   HKV: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_SP: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    r = tl.program_id(1)  # one query row, every range's partial at once
    b = pid // HKV
    kvh = pid % HKV
    pdl_enter(PDL)
    j = tl.arange(0, BLOCK_SP)
    j_ok = j < NSPLIT
    d = tl.arange(0, BLOCK_D)
    base = pid.to(tl.int64) * NSPLIT + j
    m_j = tl.load(STATS + base * 2 * BLOCK_R + r, mask=j_ok, other=-1.0e30)
    l_j = tl.load(STATS + base * 2 * BLOCK_R + BLOCK_R + r, mask=j_ok, other=0.0)
    o_j = tl.load(PART + base[:, None] * BLOCK_R * BLOCK_D + r * BLOCK_D + d[None, :], mask=j_ok[:, None], other=0.0)
    w = tl.exp2(m_j - tl.max(m_j, 0))
    w = tl.where(j_ok, w, 0.0)
    o = tl.sum(o_j * w[:, None], 0) / tl.sum(l_j * w, 0)
    tok = r // G
    head = kvh * G + r % G
    tl.store(OUT + b.to(tl.int64) * so_b + tok * so_s + head * so_h + d, o.to(OUT.dtype.element_ty), mask=d < HD)


@functools.lru_cache(maxsize=1)
def _kernels() -> dict:
    out = _triton.jit_module(globals(), ("_softmax_tile",), {"split": "_draft_split", "combine": "_draft_combine"})
    out["dtypes"] = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    return out
