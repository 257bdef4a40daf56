"""Prefill attention in Triton: a prompt chunk's queries against every key up to their positions, flash style, read
from the engine's KV cache in place.

Same semantics and argument order as :func:`kernels.attention_triton.decode_attention` (its fp32 reference,
``decode_attention_ref``, is this kernel's too): ``q [B, T, H, hd]``; the caches ``[S, Hkv, cap, hd]`` bf16 / fp16, or
int8 codes with fp16 scales ``[S, Hkv, cap, ceil(hd / 64)]`` applied in registers (the tile loader is the decode
kernel's); row ``b`` reads slot ``slots[b]`` and its query ``t`` sees keys ``0 .. q_pos[b, t]``, the chunk's own keys
already written. The decode kernel gives each token a program of its own (token invariance, a few query rows against
many keys); a prompt chunk has many query rows, so here one program takes ``BLOCK_M`` tokens of one query head:

* no mask tensor and no repeated K/V heads: the causal bound comes from ``q_pos`` in registers and the query head's
  kv head is ``h // G``; the G heads of a kv head are neighbours on the grid's first axis, so they run side by side
  and share its tiles through L2;
* keys below the block's smallest position (whole tiles) are read without a mask, the diagonal tiles with one;
* the last query block (the longest key range) starts first;
* full attention's output gate can be applied as the output is stored (``gate``), one launch less.

:func:`prefill_attention` reads an int8 cache in place (each of the G heads' programs dequantizes the tiles it reads);
:func:`prefill_attention_cached`, what the engine calls, first dequantizes the slots' keys and values up to
``kv_len`` into a contiguous bf16 / fp16 copy (:func:`dequantize_slots`: one fp32 product rounded once, so the copy
holds the cache's values to the query dtype's precision) and runs the kernel over that. Measured on an H200 at the
27B shape, a 2,048-token chunk after 63,488 tokens: 12.0 ms in place against 6.4 ms over the copy plus the copy
(docs/perf/2026-12-02b-flash-prefill-h200.md).

The grid depends on B, T and H only and nothing is read back to the host, so a call can be captured in a CUDA
graph (engine/model/graphs.py captures prefill chunks). Triton is imported on first use.

A long chunk's past keys can go through cuDNN's fused attention instead (``prefill_attention_cached(cudnn=True)``,
the engine's ``--cudnn-prefill``): :func:`cudnn_past` over the keys below the chunk, the kernel over the
rest from ``key_lo``, cuDNN's output and sum-exp folded into the kernel's online softmax (``past``). Eager chunks of
one row only, at head sizes where it measured faster (256; :func:`cudnn_past_ok`). The split runs in fp16 where the
queries and the cache's values fit its range:
cuDNN rounds its output to 16 bits before the fold, and in bf16 that extra rounding moved a NIAH near-tie past the
oracle's tolerance (docs/perf/2026-12-06-cudnn-split-h200.md). The caller may vouch for the range (``fp16_safe``: the
engine bounds a layer's values by its weights once, engine/model/hybrid.attention_value_bound); otherwise
:func:`fp16_fits` checks it, one read back to the host a chunk and layer.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass

import torch

from . import _triton
from .attention_triton import LOG2E, _block_d, _check, _new_buffer
from .attention_triton_kernels import jit_kernels as _kernels
from .kv_quant import KV_GROUP

__all__ = ["PrefillConfig", "prefill_plan", "prefill_attention", "prefill_attention_cached", "dequantize_slots",
           "descriptor_ok", "triton_available"]

triton_available = _triton.available


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Launch shape of :func:`prefill_attention`: query tokens and keys a tile, warps, pipeline stages; ``tma``: a
    16-bit cache's K / V tiles through tensor descriptors (Hopper's bulk tensor copies, ``_attn_prefill_desc``: the
    same sums) where the cache allows it (:func:`descriptor_ok`)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"PrefillConfig.{name} must be a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"PrefillConfig.num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"PrefillConfig.num_stages must be >= 1, got {self.num_stages}")


def plan_overrides(text: str) -> dict:
    """``PrefillConfig`` fields from ``"block_n=32,num_stages=3,tma=1"`` (NINFER_BENCH_PREFILL_PLAN: a tuning run's
    launch shape for the 16-bit queries' plans, the engine's included); a ValueError names what is wrong."""
    fields = {f.name: f.type for f in dataclasses.fields(PrefillConfig)}
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or key not in fields:
            raise ValueError(f"NINFER_BENCH_PREFILL_PLAN: {item!r}: expected FIELD=VALUE with FIELD one of "
                             f"{', '.join(fields)}")
        try:
            out[key] = bool(int(val)) if fields[key] in (bool, "bool") else int(val)
        except ValueError:
            raise ValueError(f"NINFER_BENCH_PREFILL_PLAN: {item!r}: the value must be an integer") from None
    return out


def prefill_plan(head_dim: int, int8: bool, q_dtype: torch.dtype = torch.bfloat16, *, block_m: int | None = None,
                 block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None) -> PrefillConfig:
    """The default launch shape for a head size and cache format; keyword overrides are for sweeps and tests, and
    NINFER_BENCH_PREFILL_PLAN (:func:`plan_overrides`) replaces fields of the 16-bit queries' plans under them."""
    block_d = _block_d(head_dim)
    if q_dtype == torch.float32:  # the reference-precision path (tests, the interpreter): small fp32 tiles
        cfg = dict(block_m=32, block_n=16, num_warps=4, num_stages=1)
    elif block_d >= 256:  # a 16-bit cache's K / V through descriptors: 6.06 against 6.32 ms a 2,048-token chunk
        # after 63,488 keys, the same bits (H100, docs/perf/2026-12-05f-prefill-attention-tma.md); int8 reads in place
        cfg = dict(block_m=128, block_n=64, num_warps=8, num_stages=2, tma=not int8)
    else:
        cfg = dict(block_m=128, block_n=64, num_warps=8 if block_d >= 128 else 4, num_stages=3)
    if q_dtype != torch.float32:
        cfg.update(plan_overrides(os.environ.get("NINFER_BENCH_PREFILL_PLAN", "")))
    given = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    cfg.update({k: v for k, v in given.items() if v is not None})
    return PrefillConfig(**cfg)


def prefill_attention(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, scale, *, kv_len_max=None, gate=None,
                      config: PrefillConfig | None = None, key_lo: int = 0, past=None, out_dtype=None):
    """Attention of ``q [B, T, H, hd]`` over cache slots ``slots [B]``; query t of row b sees keys 0..q_pos[b, t]
    (every ``q_pos`` below ``kv_len_max``, default the capacity). Returns ``[B, T, H, hd]`` in ``out_dtype``
    (default ``q.dtype``; the fp32 result rounded once to it before the gate), fp32 accumulation; ``gate [B, T, H *
    hd]`` applied as the output is stored (``o * sigmoid(gate)``, the bits of kernels/fused.sigmoid_mul). ``config``
    overrides :func:`prefill_plan`.

    ``key_lo`` (a multiple of the plan's ``block_n``, at most every real row's q_pos): keys below it are not read;
    ``past = (o [B, T, H, hd], lse [B, H, T])``, another kernel's normalised output over keys ``0 .. key_lo - 1`` and
    its rows' natural-log sum-exp (:func:`cudnn_past`), is folded into the online softmax before the store."""
    kv_len = _check(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, kv_len_max, gate, "prefill_attention")
    kern = _triton.ready("prefill_attention", _kernels, q)
    b, t, h, hd = q.shape
    hkv = k_cache.shape[1]
    int8 = k_cache.dtype == torch.int8
    cfg = config or prefill_plan(hd, int8, q.dtype)
    block_d = _block_d(hd)
    gw = min(KV_GROUP, block_d)
    past_args = _past_args(q, key_lo, past, cfg)
    out = _new_buffer((b, t, h, hd), out_dtype or q.dtype, q.device)
    if cfg.tma and descriptor_ok(k_cache, v_cache):
        return _prefill_desc(kern, cfg, q, k_cache, v_cache, slots, q_pos, scale, kv_len, gate, out, block_d,
                             past_args, past is not None)
    ks = k_scale if int8 else k_cache  # placeholders keep one signature; never read without IS_INT8
    vs = v_scale if int8 else v_cache
    gt = gate if gate is not None else out
    kern["prefill"][(b * h, -(-t // cfg.block_m))](
        q, k_cache, v_cache, ks, vs, slots, q_pos, out, gt, gt.stride(0), gt.stride(1),
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *ks.stride()[:3], *vs.stride()[:3],
        *q_pos.stride(), *out.stride()[:3],
        scale * LOG2E, t, h, kv_len, *past_args,
        G=h // hkv, HD=hd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, NG=block_d // gw, GW=gw,
        IS_INT8=int8, HAS_GATE=gate is not None, DOT_DTYPE=kern["dtypes"][q.dtype],
        DOT_PREC="tf32x3" if q.dtype == torch.float32 else "tf32", HAS_PAST=past is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _past_args(q, key_lo: int, past, cfg: PrefillConfig) -> tuple:
    """The kernels' KEY_LO, PO, PLSE and their strides (placeholders without ``past``), ``past`` checked."""
    if isinstance(key_lo, bool) or not isinstance(key_lo, int) or key_lo < 0 or key_lo % cfg.block_n:
        raise ValueError(f"prefill_attention: key_lo must be a non-negative multiple of block_n {cfg.block_n}, "
                         f"got {key_lo!r}")
    if past is None:
        return (key_lo, q, q, 0, 0, 0, 0, 0, 0)
    if not key_lo:
        raise ValueError("prefill_attention: past folds in keys below key_lo: give key_lo > 0 with it")
    po, lse = past
    b, t, h, hd = q.shape
    if tuple(po.shape) != (b, t, h, hd) or po.stride(3) != 1 or po.device != q.device:
        raise ValueError(f"prefill_attention: past output must be [B, T, H, hd] = {(b, t, h, hd)} with its last "
                         f"dimension contiguous, got {tuple(po.shape)} (strides {po.stride()})")
    if tuple(lse.shape) != (b, h, t) or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"prefill_attention: past lse must be fp32 [B, H, T] = {(b, h, t)}, got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    return (key_lo, po, lse, po.stride(0), po.stride(1), po.stride(2), *lse.stride())


def descriptor_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``_attn_prefill_desc`` can read these caches: 16-bit, contiguous, 16-byte aligned, rows of a whole
    number of 16 bytes, and row indices within int32 (the descriptors' coordinates)."""
    for c in (k_cache, v_cache):
        if c.dtype not in (torch.bfloat16, torch.float16) or not c.is_contiguous() or c.data_ptr() % 16 \
                or (c.shape[-1] * c.element_size()) % 16 or c.numel() // c.shape[-1] >= 2 ** 31:
            return False
    return k_cache.shape == v_cache.shape


def _prefill_desc(kern, cfg, q, k_cache, v_cache, slots, q_pos, scale, kv_len, gate, out, block_d, past_args,
                  has_past: bool):
    """prefill_attention through ``_attn_prefill_desc``: K and V as [S * Hkv * cap, hd] tensor descriptors whose
    boxes are one key tile (past hd, and past the last row, the copy engine fills zeros)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, t, h, hd = q.shape
    s, hkv, cap, _ = k_cache.shape
    box = [cfg.block_n, block_d]
    desc_k = TensorDescriptor(k_cache, [s * hkv * cap, hd], [hd, 1], box)
    desc_v = TensorDescriptor(v_cache, [s * hkv * cap, hd], [hd, 1], box)
    gt = gate if gate is not None else out
    kern["prefill_desc"][(b * h, -(-t // cfg.block_m))](
        q, desc_k, desc_v, slots, q_pos, out, gt, gt.stride(0), gt.stride(1), *q.stride()[:3], *q_pos.stride(),
        *out.stride()[:3], scale * LOG2E, t, h, hkv, cap, kv_len, *past_args,
        G=h // hkv, HD=hd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, HAS_GATE=gate is not None,
        DOT_DTYPE=kern["dtypes"][q.dtype], DOT_PREC="tf32x3" if q.dtype == torch.float32 else "tf32",
        HAS_PAST=has_past, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


DEQUANT_BLOCK = 64  # keys a dequantization program writes


def dequantize_slots(codes, scales, slots, length: int, dtype, *, layout: str = "bhsd") -> torch.Tensor:
    """Keys (or values) ``0 .. length - 1`` of cache slots ``slots [B]`` from int8 ``codes [S, Hkv, cap, hd]`` and
    fp16 ``scales [S, Hkv, cap, ceil(hd / 64)]`` as a ``[B, Hkv, length, hd]`` tensor in ``dtype``: each value the
    fp32 product of its code and scale, rounded once (kv_quant.dequantize_kv in fp32, then ``.to``). ``layout``:
    "bhsd" contiguous, "bshd" a view of contiguous ``[B, length, Hkv, hd]`` memory (what cuDNN's attention reads)."""
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"dequantize_slots: layout must be 'bhsd' or 'bshd', got {layout!r}")
    if codes.dtype != torch.int8 or scales.dtype != torch.float16 or codes.dim() != 4:
        raise ValueError(f"dequantize_slots: int8 codes [S, Hkv, cap, hd] and fp16 scales, got {codes.dtype} "
                         f"{tuple(codes.shape)} and {scales.dtype}")
    if not 0 < length <= codes.shape[2]:
        raise ValueError(f"dequantize_slots: length must be in 1..{codes.shape[2]}, got {length}")
    kern = _triton.ready("dequantize_slots", _kernels, codes)
    b, hkv, hd = slots.shape[0], codes.shape[1], codes.shape[3]
    block_d = _block_d(hd)
    gw = min(KV_GROUP, block_d)
    if layout == "bshd":
        out = _new_buffer((b, length, hkv, hd), dtype, codes.device).permute(0, 2, 1, 3)
    else:
        out = _new_buffer((b, hkv, length, hd), dtype, codes.device)
    kern["kv_dequant"][(b * hkv, -(-length // DEQUANT_BLOCK))](
        codes, scales, slots, out, *codes.stride()[:3], *scales.stride()[:3], *out.stride()[:3], hkv, length,
        HD=hd, BLOCK_L=DEQUANT_BLOCK, BLOCK_D=block_d, NG=block_d // gw, GW=gw, num_warps=4,
    )
    return out


def prefill_attention_cached(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, scale, *, kv_len: int, gate=None,
                             config: PrefillConfig | None = None, past_start: int | None = None,
                             cudnn: bool = False, fp16_safe: bool = False):
    """:func:`prefill_attention` the faster way for the cache's format: a bf16 / fp16 cache read in place; an int8
    cache's slots dequantized first (keys ``0 .. kv_len - 1``, :func:`dequantize_slots`, in q's dtype) and the kernel
    run over that copy. ``kv_len`` (static: a CUDA graph's key bucket) must exceed every ``q_pos``.

    ``cudnn`` with ``past_start`` (the host's copy of the chunk's first position, every q_pos at or after it): where
    :func:`cudnn_past_ok` allows, the keys below it (rounded down to the plan's key tile) go through cuDNN's fused
    attention (:func:`cudnn_past`) and the kernel takes the rest, the two folded into one softmax (other sums than
    the kernel's alone: the same values to rounding). The split computes in fp16 (q, the copy, cuDNN's output; the
    result stored in q's dtype) where ``fp16_safe`` (the caller's guarantee that every ``|q|`` and every cached key
    and value of the slots is at most FP16_MAX: no host read) or else :func:`fp16_fits` (one host read) says so, else
    in q's dtype; where cuDNN refuses, the kernel alone."""
    if k_cache.dtype != torch.int8:
        return prefill_attention(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, scale, kv_len_max=kv_len,
                                 gate=gate, config=config)
    if k_scale is None or v_scale is None:
        raise ValueError("prefill_attention_cached: an int8 cache needs k_scale and v_scale")
    rows = torch.arange(slots.shape[0], device=slots.device)  # row b of the copy is slot slots[b]
    if cudnn and past_start is not None and cudnn_past_ok(q, past_start):
        # the split in fp16 where q and the keys / values fit its range: cuDNN's output is rounded to 16 bits before
        # the fold, and fp16's 10-bit mantissa keeps that rounding 8x under bf16's
        dt = torch.float16 if fp16_safe or fp16_fits(q, k_scale, v_scale, slots, kv_len) else q.dtype
        t = q.shape[1]
        qp = cudnn_queries(q, dt)  # rows padded to a bucket: one cuDNN plan serves every chunk length in it
        qs = qp[:, :t]
        k = dequantize_slots(k_cache, k_scale, slots, kv_len, dt, layout="bshd")  # BSHD memory: what cuDNN reads
        v = dequantize_slots(v_cache, v_scale, slots, kv_len, dt, layout="bshd")
        cfg = config or prefill_plan(q.shape[-1], False, dt)
        key_lo = cudnn_keys(past_start, cfg.block_n)
        past = cudnn_past(qp, k, v, key_lo, scale)
        if past is not None:
            return prefill_attention(qs, k, v, None, None, rows, q_pos, scale, gate=gate, config=cfg, key_lo=key_lo,
                                     past=(past[0][:, :t], past[1][:, :, :t]), out_dtype=q.dtype)
    k = dequantize_slots(k_cache, k_scale, slots, kv_len, q.dtype)
    v = dequantize_slots(v_cache, v_scale, slots, kv_len, q.dtype)
    return prefill_attention(q, k, v, None, None, rows, q_pos, scale, gate=gate, config=config)


FP16_MAX = 65504.0  # the largest finite fp16


def fp16_fits(q, k_scale, v_scale, slots, kv_len: int) -> bool:
    """Whether ``q`` and the int8 cache's keys and values ``0 .. kv_len - 1`` of ``slots`` fit fp16's finite range:
    every ``|q|`` and 127 times every scale (a code's largest magnitude) at most FP16_MAX; NaN anywhere fails. One
    read back to the host (the split runs eagerly, never inside a CUDA graph)."""
    tops = [q.abs().amax().float()]
    for sc in (k_scale, v_scale):
        tops.append(sc.index_select(0, slots)[:, :, :kv_len].amax().float() * 127.0)
    top = torch.stack(tops).amax()
    return bool((top <= FP16_MAX).item())


# The first chunk start whose past keys take cuDNN (prefill_attention_cached's cudnn): after 8,192 and 63,488 keys
# cuDNN's fused attention took the past of a 2,048-token chunk (27B shape, hd 256, native GQA) in 0.567 / 4.298 ms
# against the Triton kernel's 0.803 / 6.044 ms (H100, docs/perf/2026-12-05g-layer-prefill-niah131k.md)
CUDNN_PAST_MIN = 2048
# The least head size the split takes (NINFER_BENCH_CUDNN_MIN_HEAD_DIM overrides it for a process, e.g. 8 to run the
# split on the bundled model's hd-64 heads): at hd 256 (the Qwen3.5 / 3.8 family's) it took 2.0-3.9 % off a 27B
# 65,000-token prefill in four runs (H100 and H200); at hd 64 it was slower (docs/perf/2026-12-06-cudnn-split-h200.md,
# 2026-12-07f-cudnn-split-default-h100.md); head sizes between were not measured
CUDNN_MIN_HEAD_DIM = 256
_CUDNN = {"refused": None}  # the reason cuDNN's attention failed in this process (then the kernel alone runs)


# cuDNN builds an execution plan for each new (query rows, past keys) shape it meets, 40-46 ms on an H100
# (docs/perf/2026-12-06c-gdn-glue-chain-link-h100.md): a chunk's query rows are padded up to a multiple of CUDNN_ROWS
# and its past keys cut down to a multiple of CUDNN_KEYS (the kernel takes the keys above), so one plan serves every
# chunk length and start in a bucket (a prompt of a new length, a session's next turn) instead of one each
CUDNN_ROWS = 512
CUDNN_KEYS = 2048


def cudnn_keys(past_start: int, block_n: int) -> int:
    """The keys below a chunk starting at ``past_start`` that go through cuDNN: ``past_start`` rounded down to a
    multiple of CUDNN_KEYS (itself a multiple of the kernel's key tile ``block_n``)."""
    step = CUDNN_KEYS if CUDNN_KEYS % block_n == 0 else block_n
    return past_start // step * step


def cudnn_queries(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [B, T, H, hd]`` in ``dtype`` with zero rows appended up to a multiple of CUDNN_ROWS: the queries
    :func:`cudnn_past` takes (its first T rows are the kernel's). Each row's attention is its own, so the padding
    changes no real row."""
    t = q.shape[1]
    rows = -(-t // CUDNN_ROWS) * CUDNN_ROWS
    if rows == t:
        return q.to(dtype)
    qp = q.new_empty((q.shape[0], rows, *q.shape[2:]), dtype=dtype)
    qp[:, :t].copy_(q)
    qp[:, t:].zero_()
    return qp


def cudnn_min_head_dim() -> int:
    """CUDNN_MIN_HEAD_DIM, or NINFER_BENCH_CUDNN_MIN_HEAD_DIM where set (recorded in a result's ``env.knobs``)."""
    return _triton.env_count("NINFER_BENCH_CUDNN_MIN_HEAD_DIM", CUDNN_MIN_HEAD_DIM, "a head size")


def cudnn_split_applies(head_dim: int, device) -> bool:
    """Whether a model of ``head_dim`` on ``device`` can take the split at all (what a result records as its
    ``cudnn_prefill``): CUDA, a head size where the split pays (:func:`cudnn_min_head_dim`) and cuDNN's fused attention
    has (a multiple of 8 up to 256), cuDNN built in."""
    return (torch.device(device).type == "cuda" and head_dim % 8 == 0 and cudnn_min_head_dim() <= head_dim <= 256
            and torch.backends.cudnn.is_available())


def cudnn_past_ok(q, past_start: int) -> bool:
    """Whether :func:`cudnn_past` takes this chunk's past: :func:`cudnn_split_applies` to q's head size and device,
    16-bit queries, one row (B = 1), at least CUDNN_PAST_MIN keys before it, not inside a CUDA graph capture, and no
    earlier refusal in this process."""
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[0] == 1 and past_start >= CUDNN_PAST_MIN
            and cudnn_split_applies(q.shape[-1], q.device) and _CUDNN["refused"] is None
            and not torch.cuda.is_current_stream_capturing())


def cudnn_past(q, k, v, key_lo: int, scale: float):
    """cuDNN's fused attention (torch's ``aten._scaled_dot_product_cudnn_attention``, native GQA, no mask) of
    ``q [1, T, H, hd]`` over keys ``0 .. key_lo - 1`` of ``k`` / ``v [1, Hkv, L, hd]`` in BSHD memory
    (:func:`dequantize_slots` layout "bshd"). Returns (output ``[1, T, H, hd]``, its rows' natural-log sum-exp
    ``[1, H, T]`` fp32), or None when cuDNN refuses (the reason warned once; this process then stays on the kernel)."""
    _, t, h, hd = q.shape
    hkv = k.shape[1]
    qh = q.contiguous().transpose(1, 2)  # [1, H, T, hd] over [1, T, H, hd] memory
    past = [x.as_strided((1, hkv, key_lo, hd), (key_lo * hkv * hd, hd, hkv * hd, 1), x.storage_offset())
            for x in (k, v)]
    try:
        o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(qh, *past, None, True, 0.0, False, False,
                                                                   scale=scale)[:2]
    except RuntimeError as exc:
        _CUDNN["refused"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        warnings.warn(f"prefill attention: cuDNN's fused attention refused ({_CUDNN['refused']}); prompt chunks' "
                      f"attention stays on the Triton kernel", RuntimeWarning, stacklevel=2)
        return None
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return o.transpose(1, 2), lse.float()
