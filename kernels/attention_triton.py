"""Decode / speculative-verify attention in Triton, reading the engine's KV cache in place.

Same semantics as :func:`kernels.attention.attention_ref`, but the keys and values come straight from the cache
layout of :mod:`engine.model.cache`: ``k_cache``/``v_cache`` ``[S, Hkv, cap, hd]`` in bf16 / fp16, or int8 codes with
fp16 scales ``[S, Hkv, cap, ceil(hd/64)]`` (one per 64 contiguous values) that are applied in registers, so no
dequantized copy of the cache is ever written. Row ``b`` of the batch reads slot ``slots[b]``; its query ``t``
sits at ``q_pos[b, t]`` and sees keys ``0 .. q_pos[b, t]`` (the new tokens' keys are already in the cache).

Flash-decoding in two launches:

1. ``_attn_split``: grid ``(tiles, splits, B * Hkv)``. One program takes the G = H / Hkv query rows of ``pack``
   tokens of one kv head (a T = 8 verify's 8 x G rows in one tile by default, so each K/V tile is loaded once for
   all of them; with ``pack = 1``, one token's rows, ``m`` tiles of them when G is over the tile) and one split
   of the key range; exp2-based online softmax in fp32; writes a normalised partial output and its
   log2-sum-exp. With a single split it writes the final output and the second launch is skipped.
2. ``_attn_combine``: one program per ``(b, t, h)`` (and block of hd columns when those rows are few) merges the
   splits that row actually used.

The grid's split count is sized for ``kv_len_max``; each query token's chunk (keys per split) is then set on the
GPU from its own position (``_row_chunk``, between ``min_chunk`` and ``chunk``), so a sequence far shorter than
the cache still spreads over all the splits (the 27B shape at 8K capacity: 64 splits of 4 blocks; an 880-key
sequence takes 28 splits of one block rather than 7 of four).

Token invariance: a query token's output is the same bits whatever else is in the call - the other tokens of a
speculative block (T > 1) or other batch rows. The launch shape (tile rows, warps, key block) depends on G, hd, the
key range and the dtypes, never on B or T, so a T = 1 step runs the very tile a verify pass runs; a row's result
depends only on its own q row (a row of the MMA), its key range is split from its own position, and the blocks a
packed tile walks for its other rows leave it unchanged to the bit (a fully masked block: alpha = 1, p = 0). So a
verify pass over T drafted tokens computes, row by row, exactly what T single-token decode steps compute, and
greedy speculative decoding keeps plain decoding's tokens even where two logits almost tie. A T = 1 step in a tile
of its own would be faster (16 rows, 46.4% of the copy bandwidth against 35.0% at 65,536 int8 keys on the H200),
but it is another MMA (the warp-level one; 64 rows take Hopper's warpgroup MMA) and on the H200 its rows differ from
the packed tile's in 175 of 192 cases (up to 0.0039; ``scripts/probe_tile_bits.py``), so the step keeps the packed
tile.

The grid depends only on static sizes (B, T, H, hd and ``kv_len_max``), never on ``q_pos``, so a call can be
captured in a CUDA graph; programs whose chunk starts past the rows' last position do no loads and store nothing.
Triton is imported on first use, so this module imports on machines without it.

Implementations, same argument order:
  decode_attention_ref  plain fp32 torch on a gathered, dequantized copy (the reference)
  decode_attention      the Triton kernels of kernels/attention_triton_kernels.py (CUDA, or ``TRITON_INTERPRET=1``
                        on the CPU); for an int8 cache with 16-bit queries on CUDA, the tensor-core split pass of
                        kernels/attn_cuda.cu and this module's combine (same arguments, same combine)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import _triton, attn_cuda
from ._triton import pow2 as _pow2
from .attention import attention_ref
from .attention_triton_kernels import jit_kernels as _kernels
from .kv_quant import KV_GROUP, dequantize_kv

__all__ = ["AttnConfig", "plan", "decode_attention", "decode_attention_ref", "triton_available"]

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256  # one [BLOCK_M, hd] fp32 accumulator per program must stay in registers
MAX_BLOCK_M = 64  # query rows (T * G) per program; more rows take more m tiles, which re-read K/V from L2
PACK_TOKENS = 8  # tokens a tile is sized for by default: a DFlash2 K=7 verify (T = 8) reads K/V once
# split the key range until the grid has about this many programs per multiprocessor: on the H200 at 65,536 keys,
# 2 (64 splits of 1,024 keys) beat 4 (128 of 512) in all six cases measured for the packed tile, int8 27.6 ->
# 31.9 % of the copy bandwidth at B = 1, T = 1 and bf16 58.4 -> 70.6 % (call 2's sweep in
# docs/perf/2026-12-02c-packed-decode-attention-h200.md); short key ranges are bound by MIN_BLOCKS_PER_SPLIT either
# way (8K: 64 splits)
PROGRAMS_PER_SM = 2
MIN_BLOCKS_PER_SPLIT = 4  # shorter chunks spend more on partial writes and the combine than they gain
SHORT_MIN_BLOCKS = 1  # a sequence shorter than the grid's key range: the chunk shrinks on the GPU to this floor
COMBINE_COLS, COMBINE_SPLITS = 64, 32  # combine tile [splits, columns] when the rows alone are too few programs


_triton_import_error = _triton.import_error
triton_available = _triton.available


@dataclass(frozen=True, slots=True)
class AttnConfig:
    """Launch shape of :func:`decode_attention` (a function of static sizes only; see :func:`plan`)."""

    block_m: int  # query rows (pack tokens' heads g) per program, a power of two >= 16
    block_n: int  # keys per inner step, a power of two >= 16
    chunk: int  # keys per split at the full key range, a multiple of block_n
    num_warps: int
    num_stages: int
    combine_cols: int = 64  # head_dim columns per combine program (power of two; capped at the padded hd)
    # the floor of the chunk a row's own length sets on the GPU (a multiple of block_n; None: chunk, a fixed split)
    min_chunk: int | None = None
    # tokens a tile holds (G rows each, pack * G <= block_m): one program reads each K/V tile once for all of them;
    # 1: a tile holds one token's rows (or block_m of them, G > block_m)
    pack: int = 1
    # int8 caches: K / V as one 2-D tile per 64-value scale group, K's scales applied to the fp32 q.k products
    # (_attn_split's GROUPED); False: one [block_n, groups, 64] tile dequantized as a whole
    grouped: bool = False
    # int8 caches (one tile per K / V): each key block's scales loaded one block ahead (_attn_split's AHEAD); the
    # planner's default for int8
    ahead: bool = False
    # with ahead: the int8 codes as one 2-D tile, the scales broadcast to its columns (_attn_split's FLAT; the same
    # values); a launch-sweep candidate
    flat: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "combine_cols"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"AttnConfig.{name} must be a power of two >= 16, got {v}")
        if self.chunk <= 0 or self.chunk % self.block_n:
            raise ValueError(f"AttnConfig.chunk must be a positive multiple of block_n={self.block_n}, "
                             f"got {self.chunk}")
        if self.min_chunk is not None and not (0 < self.min_chunk <= self.chunk and self.min_chunk % self.block_n == 0):
            raise ValueError(f"AttnConfig.min_chunk must be a multiple of block_n={self.block_n} in (0, chunk="
                             f"{self.chunk}], got {self.min_chunk}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"AttnConfig.num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"AttnConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.pack < 1 or self.pack > self.block_m:
            raise ValueError(f"AttnConfig.pack must be in 1..block_m={self.block_m}, got {self.pack}")
        if self.ahead and self.grouped:
            raise ValueError("AttnConfig: ahead is for one K / V tile a block, not grouped tiles")
        if self.flat and not self.ahead:
            raise ValueError("AttnConfig: flat tiles take their scales a block ahead (ahead=True)")


def _block_d(head_dim: int) -> int:
    """Head-dim columns of a tile: a power of two, at least 16 (tl.dot's smallest K; columns past hd are masked)."""
    return max(16, _pow2(head_dim))


def plan(batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, kv_len: int, int8: bool,
         device: torch.device | str = "cuda", *, q_dtype: torch.dtype = torch.bfloat16, block_n: int | None = None,
         num_warps: int | None = None, num_stages: int | None = None, chunk: int | None = None,
         combine_cols: int | None = None, min_chunk: int | None = None, block_m: int | None = None,
         pack: int | None = None, grouped: bool = False, ahead: bool | None = None,
         flat: bool = False) -> AttnConfig:
    """The default launch shape for these static sizes; keyword overrides are for tuning sweeps and tests.

    A tile is sized for ``PACK_TOKENS`` tokens' rows (at most ``MAX_BLOCK_M``) and holds as many whole tokens as
    fit (``pack``), whatever T the call has: a T = 1 step runs the same tile, so each row's sums are the same bits
    in a single step and in a verify pass. ``pack=1`` with ``block_m`` the padded G is the one-token tile.
    Register and shared-memory notes come from sm_90 ptxas reports of these kernels (Triton 3.6).
    """
    rows = heads // kv_heads  # one token's rows: nothing below depends on batch or tokens (token invariance)
    block_d = _block_d(head_dim)
    if block_m is None:
        block_m = max(16, min(MAX_BLOCK_M, _pow2(rows * (PACK_TOKENS if pack is None else pack))))
    if pack is None:
        pack = max(1, block_m // rows)
    fp32 = q_dtype == torch.float32  # the reference-precision path (tests): fp32 tiles, twice the shared memory
    if block_n is None:
        # hd=256: 64 keys push the int8 path to 255 registers with spills at BLOCK_M=64, and bf16 to 64 KB of
        # shared memory per K+V stage; 32 keys keep 2-3 programs per SM at BLOCK_M=16
        block_n = 32 if block_d >= 256 else 64
        if fp32:
            block_n //= 2
    if num_warps is None:
        # the [BLOCK_M, hd] accumulator and q: 4 warps reach 238-255 registers from 64 x 128 up (with spills at 64 x
        # 256), and yet on the H200 at 65,536 keys 4 warps beat 8 at 64 x 256 in every case measured (int8 26 vs
        # 17 % of the copy bandwidth at T = 1, bf16 58 vs 50 %; docs/perf/2026-12-02c-packed-decode-attention-h200.md);
        # fp32 tiles (the tests' reference precision) keep 8 there
        num_warps = 8 if fp32 and block_m * block_d >= 64 * 128 else 4
    if num_stages is None:
        num_stages = 2 if fp32 else 3  # fp32 at 64 x 256 needs 256 KB of shared memory with 3 stages
    sms = _triton.num_sms(device)
    if chunk is None:
        # from one token's sizes, not the call's: a row's key range is split (and summed) the same way whatever
        # it is batched with, so concurrent decoding and verify passes give the bits single decode steps give
        n_blocks = -(-kv_len // block_n)
        per_split = -(-rows // block_m) * kv_heads
        want = -(-PROGRAMS_PER_SM * sms // per_split)
        splits = max(1, min(want, n_blocks // MIN_BLOCKS_PER_SPLIT))
        chunk = -(-n_blocks // splits) * block_n
    if combine_cols is None:
        # each row's columns spread over programs (a B=1 decode has few rows); one width for every call, since the
        # combine tile's shape sets the order of its sums
        combine_cols = min(block_d, COMBINE_COLS)
    if min_chunk is None:
        min_chunk = min(chunk, SHORT_MIN_BLOCKS * block_n)
    if ahead is None:
        # int8 scales a block ahead (same values): on the H200 at 65,536 keys, B = 1, the packed tile went from 30.8
        # to 35.7 % of the copy bandwidth at T = 1 and 29.6 to 33.7 % at T = 8 (Nsight Compute: 99.5 -> 88.3 us;
        # docs/perf/2026-12-02d-prefill-weights-scales-ahead-h200.md); grouped tiles never take it
        ahead = not grouped
    return AttnConfig(block_m=block_m, block_n=block_n, chunk=chunk, num_warps=num_warps, num_stages=num_stages,
                      combine_cols=combine_cols, min_chunk=min_chunk, pack=pack, grouped=grouped and int8,
                      ahead=ahead and int8, flat=flat and ahead and int8)


def _new_buffer(shape, dtype, device) -> torch.Tensor:
    """Output and workspace allocation (tests swap in a NaN fill to catch unwritten elements)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, kv_len_max, gate=None,
           who: str = "decode_attention") -> int:
    """Validate shapes and dtypes; returns the key range the grid covers."""
    if q.dim() != 4:
        raise ValueError(f"{who}: q must be [B, T, H, hd], got shape {tuple(q.shape)}")
    b, t, h, hd = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{who}: q must be bf16, fp16 or fp32, got {q.dtype}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != hd:
        raise ValueError(f"{who}: k_cache and v_cache must both be [S, Hkv, cap, hd={hd}], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in (torch.bfloat16, torch.float16, torch.float32,
                                                              torch.int8):
        raise ValueError(f"{who}: caches must be bf16, fp16, fp32 or int8 (both the same), "
                         f"got {k_cache.dtype} and {v_cache.dtype}")
    hkv, cap = k_cache.shape[1], k_cache.shape[2]
    if h % hkv:
        raise ValueError(f"{who}: H={h} query heads is not a multiple of Hkv={hkv} kv heads")
    if hd > MAX_HEAD_DIM:
        raise ValueError(f"{who}: head_dim {hd} is over the supported {MAX_HEAD_DIM}")
    if k_cache.dtype == torch.int8:
        sshape = (*k_cache.shape[:3], -(-hd // KV_GROUP))
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None or tuple(s.shape) != sshape or s.dtype != torch.float16:
                got = "None" if s is None else f"{tuple(s.shape)} {s.dtype}"
                raise ValueError(f"{who}: int8 cache needs {name} {sshape} fp16, got {got}")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"{who}: scales are only for an int8 cache, the cache is {k_cache.dtype}")
    if slots.shape != (b,) or q_pos.shape != (b, t):
        raise ValueError(f"{who}: slots must be [B={b}] and q_pos [B={b}, T={t}], "
                         f"got {tuple(slots.shape)} and {tuple(q_pos.shape)}")
    if gate is not None and (gate.shape != (b, t, h * hd) or gate.stride(-1) != 1):
        raise ValueError(f"{who}: gate must be [B, T, H * hd] = {[b, t, h * hd]}, contiguous along its "
                         f"last dimension, got {tuple(gate.shape)} with strides {gate.stride()}")
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k_scale": k_scale, "v_scale": v_scale,
             "slots": slots, "q_pos": q_pos, "gate": gate}
    for name, x in named.items():
        if x is not None and x.device != q.device:
            raise ValueError(f"{who}: {name} is on {x.device}, q on {q.device}")
        if x is not None and x.dim() == 4 and x.stride(-1) != 1:
            raise ValueError(f"{who}: {name} must be contiguous along its last dimension")
    kv_len = cap if kv_len_max is None else int(kv_len_max)
    if not 0 < kv_len <= cap:
        raise ValueError(f"{who}: kv_len_max must be in 1..cap={cap}, got {kv_len_max}")
    return kv_len


def decode_attention_ref(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, scale, *, kv_len_max=None, gate=None):
    """fp32 reference: gather the slots, dequantize, slice to ``max(q_pos) + 1`` keys, :func:`attention_ref`; with
    ``gate``, the output rounded to q's dtype times ``sigmoid(gate)`` (kernels/fused.sigmoid_mul_ref)."""
    kv_len = _check(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, kv_len_max, gate)
    length = int(q_pos.max()) + 1
    if int(q_pos.min()) < 0 or length > kv_len:
        raise ValueError(f"decode_attention_ref: q_pos must lie in 0..{kv_len - 1}, "
                         f"got {int(q_pos.min())}..{length - 1}")
    k, v = k_cache[slots, :, :length], v_cache[slots, :, :length]  # [B, Hkv, L, hd]
    if k_cache.dtype == torch.int8:
        k = dequantize_kv(k, k_scale[slots, :, :length], torch.float32)
        v = dequantize_kv(v, v_scale[slots, :, :length], torch.float32)
    out = attention_ref(q.float(), k.float(), v.float(), q_pos, scale).to(q.dtype)
    if gate is None:
        return out
    return (out.float() * torch.sigmoid(gate.float().view(out.shape))).to(q.dtype)


def decode_attention(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, scale, *, kv_len_max=None, gate=None,
                     config: AttnConfig | attn_cuda.CudaPlan | None = None):
    """Attention of ``q [B, T, H, hd]`` over cache slots ``slots [B]``; query t of row b sees keys 0..q_pos[b, t].

    ``k_cache``/``v_cache`` ``[S, Hkv, cap, hd]`` bf16 / fp16, or int8 with ``k_scale``/``v_scale``
    ``[S, Hkv, cap, ceil(hd/64)]`` fp16 (None otherwise). ``kv_len_max`` (default ``cap``) bounds the key range the
    grid covers: every ``q_pos`` must be below it. Returns ``[B, T, H, hd]`` in ``q.dtype``; fp32 accumulation.
    ``gate`` ``[B, T, H * hd]`` (full attention's output gate), when given, is applied as the output is stored:
    ``o * sigmoid(gate)``, the same bits as ``kernels/fused.sigmoid_mul`` of the ungated output, one launch less.
    No host synchronisation: safe inside a CUDA graph. An int8 cache with 16-bit queries takes the tensor-core split
    kernel of ``kernels/attn_cuda.cu`` where it runs (:func:`kernels.attn_cuda.wanted`; a property of dtypes and
    shapes, never of B or T), else the Triton kernels. ``config`` overrides the plan (tuning, tests): an
    :class:`AttnConfig` runs the Triton kernels, a :class:`kernels.attn_cuda.CudaPlan` the CUDA one.
    """
    kv_len = _check(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, kv_len_max, gate)
    kern = _triton.ready("decode_attention", _kernels, q)
    b, t, h, hd = q.shape
    hkv = k_cache.shape[1]
    int8 = k_cache.dtype == torch.int8
    cuda_args = (q, k_cache, v_cache, k_scale, v_scale, slots, q_pos)
    if isinstance(config, attn_cuda.CudaPlan) or (config is None and attn_cuda.wanted(*cuda_args)):
        if not attn_cuda.supports(*cuda_args):
            raise ValueError(f"decode_attention: the CUDA split kernel does not run these inputs "
                             f"({attn_cuda.import_error() or 'see kernels.attn_cuda.supports'})")
        return _launch_cuda(kern, q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, scale, kv_len,
                            config or attn_cuda.plan(kv_len, hkv, q.device), gate)
    cfg = config or plan(b, t, h, hkv, hd, kv_len, int8, q.device, q_dtype=q.dtype)
    if q.is_cuda and q.dtype == torch.float32 and cfg.block_n < 32 and cfg.num_warps > 4:
        # triton 3.6 on sm_90: fp32 (tf32x3) tiles of 16 keys with 8 warps fault with an illegal address, split or
        # not, pipelined or not; 4 warps, or 32-key tiles, run correctly (scripts/probe_attention.py on an H200)
        cfg = dataclasses.replace(cfg, num_warps=4)
    return _launch(kern, q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, scale, kv_len, cfg, gate)


def _launch_cuda(kern, q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, scale, kv_len, cfg, gate=None):
    """kernels/attn_cuda.cu's split pass, always into partials, then _attn_combine (which rounds and gates)."""
    b, t, h, hd = q.shape
    splits = cfg.splits(kv_len)
    out = _new_buffer((b, t, h, hd), q.dtype, q.device)
    o_part = _new_buffer((b, t, h, splits, hd), attn_cuda.part_dtype(), q.device)
    lse_part = _new_buffer((b, t, h, splits), torch.float32, q.device)
    attn_cuda.split(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, scale * LOG2E, kv_len, cfg, o_part,
                    lse_part)
    _combine(kern, o_part, lse_part, q_pos, out, gate, cfg.chunk, cfg.min_chunk, splits, attn_cuda.STEP,
             min(_block_d(hd), cfg.combine_cols), cfg.combine_splits)
    return out


def _combine(kern, o_part, lse_part, q_pos, out, gate, chunk, min_chunk, splits, block_n, block_dc, block_s):
    """_attn_combine over the splits each row used: the output in q's dtype, gated as it is stored."""
    b, t, h, hd = out.shape
    gt = gate if gate is not None else out  # a placeholder (HAS_GATE)
    kern["combine"][(b * t * h, _block_d(hd) // block_dc)](
        o_part, lse_part, q_pos, out, gt, *q_pos.stride(), *out.stride()[:3], gt.stride(0), gt.stride(1), t, h,
        chunk, min_chunk, splits, BLOCK_N=block_n, HAS_GATE=gate is not None, HD=hd, BLOCK_S=block_s,
        BLOCK_DC=block_dc, num_warps=4, **_triton.pdl_args(out.device),
    )


def _launch(kern, q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, scale, kv_len, cfg: AttnConfig, gate=None):
    b, t, h, hd = q.shape
    hkv = k_cache.shape[1]
    g = h // hkv
    int8 = k_cache.dtype == torch.int8
    block_d = _block_d(hd)
    gw = min(KV_GROUP, block_d)  # columns per scale group in the int8 tile [BLOCK_N, NG, GW]
    splits = -(-kv_len // cfg.chunk)
    if (cfg.grouped or cfg.ahead) and not int8:
        raise ValueError(f"decode_attention: grouped tiles and scales ahead are for an int8 cache, the cache is "
                         f"{k_cache.dtype}")
    if cfg.pack > 1 and cfg.pack * g > cfg.block_m:
        raise ValueError(f"decode_attention: pack={cfg.pack} tokens of G={g} rows do not fit block_m={cfg.block_m}")
    m_tiles = -(-g // cfg.block_m)  # a token's tiles (pack = 1)
    tiles = -(-t // cfg.pack) if cfg.pack > 1 else t * m_tiles
    out = _new_buffer((b, t, h, hd), q.dtype, q.device)
    if splits > 1:
        o_part = _new_buffer((b, t, h, splits, hd), torch.float32, q.device)
        lse_part = _new_buffer((b, t, h, splits), torch.float32, q.device)
    else:
        o_part = lse_part = out  # unused: the split kernel writes the output directly
    # the dots' operand type: q's, except that int8 codes meet 16-bit queries in fp16: codes times scales are made
    # in fp16 (one rounding, finer than bf16's) and need no fp16 -> bf16 conversion per cached value (on the H200
    # that was within two calls' spread at 65K keys); q (RMS-normed) and p (in [0, 1]) fit fp16's range
    dot_dtype = torch.float16 if int8 and q.dtype == torch.bfloat16 else q.dtype
    ks = k_scale if int8 else k_cache  # placeholders keep one signature; never read without IS_INT8
    vs = v_scale if int8 else v_cache
    gt = gate if gate is not None else out  # a placeholder likewise (HAS_GATE)
    kern["split"][(tiles, splits, b * hkv)](
        q, k_cache, v_cache, ks, vs, slots, q_pos, out, o_part, lse_part, gt, gt.stride(0), gt.stride(1),
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *ks.stride()[:3], *vs.stride()[:3],
        *q_pos.stride(), *out.stride()[:3],
        scale * LOG2E, t, h, hkv, kv_len, cfg.chunk, cfg.min_chunk or cfg.chunk, splits, m_tiles,
        G=g, HD=hd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, NG=block_d // gw, GW=gw,
        IS_INT8=int8, SPLIT=splits > 1, HAS_GATE=gate is not None, DOT_DTYPE=kern["dtypes"][dot_dtype],
        DOT_PREC="tf32x3" if q.dtype == torch.float32 else "tf32", PACK=cfg.pack, GROUPED=cfg.grouped, AHEAD=cfg.ahead,
        FLAT=cfg.flat,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_triton.pdl_args(q.device),
    )
    if splits > 1:
        _combine(kern, o_part, lse_part, q_pos, out, gate, cfg.chunk, cfg.min_chunk or cfg.chunk, splits,
                 cfg.block_n, min(block_d, cfg.combine_cols), COMBINE_SPLITS)
    return out
