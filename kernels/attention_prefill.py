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
"""

from __future__ import annotations

import dataclasses
import os
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
                      config: PrefillConfig | None = None):
    """Attention of ``q [B, T, H, hd]`` over cache slots ``slots [B]``; query t of row b sees keys 0..q_pos[b, t]
    (every ``q_pos`` below ``kv_len_max``, default the capacity). Returns ``[B, T, H, hd]`` in ``q.dtype``, fp32
    accumulation; ``gate [B, T, H * hd]`` applied as the output is stored (``o * sigmoid(gate)``, the bits of
    kernels/fused.sigmoid_mul). ``config`` overrides :func:`prefill_plan`."""
    kv_len = _check(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, kv_len_max, gate, "prefill_attention")
    kern = _triton.ready("prefill_attention", _kernels, q)
    b, t, h, hd = q.shape
    hkv = k_cache.shape[1]
    int8 = k_cache.dtype == torch.int8
    cfg = config or prefill_plan(hd, int8, q.dtype)
    block_d = _block_d(hd)
    gw = min(KV_GROUP, block_d)
    out = _new_buffer((b, t, h, hd), q.dtype, q.device)
    if cfg.tma and descriptor_ok(k_cache, v_cache):
        return _prefill_desc(kern, cfg, q, k_cache, v_cache, slots, q_pos, scale, kv_len, gate, out, block_d)
    ks = k_scale if int8 else k_cache  # placeholders keep one signature; never read without IS_INT8
    vs = v_scale if int8 else v_cache
    gt = gate if gate is not None else out
    kern["prefill"][(b * h, -(-t // cfg.block_m))](
        q, k_cache, v_cache, ks, vs, slots, q_pos, out, gt, gt.stride(0), gt.stride(1),
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *ks.stride()[:3], *vs.stride()[:3],
        *q_pos.stride(), *out.stride()[:3],
        scale * LOG2E, t, h, kv_len,
        G=h // hkv, HD=hd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, NG=block_d // gw, GW=gw,
        IS_INT8=int8, HAS_GATE=gate is not None, DOT_DTYPE=kern["dtypes"][q.dtype],
        DOT_PREC="tf32x3" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def descriptor_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``_attn_prefill_desc`` can read these caches: 16-bit, contiguous, 16-byte aligned, rows of a whole
    number of 16 bytes, and row indices within int32 (the descriptors' coordinates)."""
    for c in (k_cache, v_cache):
        if c.dtype not in (torch.bfloat16, torch.float16) or not c.is_contiguous() or c.data_ptr() % 16 \
                or (c.shape[-1] * c.element_size()) % 16 or c.numel() // c.shape[-1] >= 2 ** 31:
            return False
    return k_cache.shape == v_cache.shape


def _prefill_desc(kern, cfg, q, k_cache, v_cache, slots, q_pos, scale, kv_len, gate, out, block_d):
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
        *out.stride()[:3], scale * LOG2E, t, h, hkv, cap, kv_len,
        G=h // hkv, HD=hd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, HAS_GATE=gate is not None,
        DOT_DTYPE=kern["dtypes"][q.dtype], DOT_PREC="tf32x3" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


DEQUANT_BLOCK = 64  # keys a dequantization program writes


def dequantize_slots(codes, scales, slots, length: int, dtype) -> torch.Tensor:
    """Keys (or values) ``0 .. length - 1`` of cache slots ``slots [B]`` from int8 ``codes [S, Hkv, cap, hd]`` and
    fp16 ``scales [S, Hkv, cap, ceil(hd / 64)]`` as a contiguous ``[B, Hkv, length, hd]`` tensor in ``dtype``: each
    value the fp32 product of its code and scale, rounded once (kv_quant.dequantize_kv in fp32, then ``.to``)."""
    if codes.dtype != torch.int8 or scales.dtype != torch.float16 or codes.dim() != 4:
        raise ValueError(f"dequantize_slots: int8 codes [S, Hkv, cap, hd] and fp16 scales, got {codes.dtype} "
                         f"{tuple(codes.shape)} and {scales.dtype}")
    if not 0 < length <= codes.shape[2]:
        raise ValueError(f"dequantize_slots: length must be in 1..{codes.shape[2]}, got {length}")
    kern = _triton.ready("dequantize_slots", _kernels, codes)
    b, hkv, hd = slots.shape[0], codes.shape[1], codes.shape[3]
    block_d = _block_d(hd)
    gw = min(KV_GROUP, block_d)
    out = _new_buffer((b, hkv, length, hd), dtype, codes.device)
    kern["kv_dequant"][(b * hkv, -(-length // DEQUANT_BLOCK))](
        codes, scales, slots, out, *codes.stride()[:3], *scales.stride()[:3], *out.stride()[:3], hkv, length,
        HD=hd, BLOCK_L=DEQUANT_BLOCK, BLOCK_D=block_d, NG=block_d // gw, GW=gw, num_warps=4,
    )
    return out


def prefill_attention_cached(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, scale, *, kv_len: int, gate=None,
                             config: PrefillConfig | None = None):
    """:func:`prefill_attention` the faster way for the cache's format: a bf16 / fp16 cache read in place; an int8
    cache's slots dequantized first (keys ``0 .. kv_len - 1``, :func:`dequantize_slots`, in q's dtype) and the kernel
    run over that copy. ``kv_len`` (static: a CUDA graph's key bucket) must exceed every ``q_pos``."""
    if k_cache.dtype != torch.int8:
        return prefill_attention(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, scale, kv_len_max=kv_len,
                                 gate=gate, config=config)
    if k_scale is None or v_scale is None:
        raise ValueError("prefill_attention_cached: an int8 cache needs k_scale and v_scale")
    k = dequantize_slots(k_cache, k_scale, slots, kv_len, q.dtype)
    v = dequantize_slots(v_cache, v_scale, slots, kv_len, q.dtype)
    rows = torch.arange(slots.shape[0], device=slots.device)  # row b of the copy is slot slots[b]
    return prefill_attention(q, k, v, None, None, rows, q_pos, scale, gate=gate, config=config)
