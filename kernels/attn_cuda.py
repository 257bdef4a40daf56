"""Decode / verify attention over an int8 KV cache on the tensor cores: ``kernels/attn_cuda.cu``.

The split pass of :func:`kernels.attention_triton.decode_attention` for int8 caches and bf16 / fp16 queries (its
``_attn_combine`` merges the splits, rounds and gates the output), 16 keys a step, the cache's codes turned into
exact fp16 by byte permutes, scales applied to the fp32 sums (K) or the codes (V). Two kernels:

- ``attn_split`` (T = 1, any batch): one warp takes one query token's G <= 8 heads of one kv head over one key
  range, with the heads as the MMA's 8 columns and keys / head dims as its 16 rows (a decode step's G = 6 rows fill
  6 of 8 columns instead of 6 of a 64-row tile), its K / V in a register double buffer;
- ``attn_verify`` (T > 1): a block takes all T x G query rows of one (row, kv head) over one key range, one warp a
  16-row m tile, the rows as the MMA's rows; the block streams the raw codes into shared memory (cp.async) once for
  all of them.

The second computes the first's products in the other orientation, from the very fragments, in the same order, and
follows its softmax element for element (the source's header says how), so a T = 8 verify gives each token the bits
a T = 1 step gives (token invariance), at any batch.

Compiled at first use for each (head dim, query dtype, index dtypes) by CuPy's NVRTC, so it needs
``cupy`` (the ``[gpu]`` extra) and an sm_80+ GPU (``mma.m16n8k16``, ``movmatrix``). :func:`wanted` says whether a
call takes this path; the reference is :func:`kernels.attention_triton.decode_attention_ref`. Launches are
asynchronous on the current torch stream and allocate nothing: safe to capture in a CUDA graph once compiled.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import _cupy, _triton
from ._cupy import parse_build

__all__ = ["CudaPlan", "plan", "split", "verify_grid", "wanted", "supports", "available", "import_error",
           "set_enabled", "enabled", "set_verify_kernel", "part_dtype", "STEP"]

STEP = 16  # keys a warp step (the kernel's STEP; the combine's BLOCK_N)
MAX_VERIFY_WARPS = 8  # m tiles of 16 query rows a verify block (one warp each)
# attn_verify's two builds (the same bits): blocks of up to NARROW_WARPS warps keep q's fragments in registers (254
# registers a thread at hd 256, no spills); wider blocks (a K = 7 verify's 48 rows: 3 warps) keep them in shared
# memory under a 168-register cap, 3 stages in flight, so that an SM holds 4 such blocks rather than 2. H200, 65,536
# int8 keys, one run: 24 rows 90.4 us narrow / 117.1 wide; 48 rows 169.3 / 145.3; B = 8 x 48 rows 1202 / 1027
NARROW_WARPS = 2
WIDE_BUILD = {"QSMEM": 1, "VDEPTH": 3, "VMAXREG": 168}
MAX_G = 8  # query heads a kv head: the MMA's 8 columns
# grid size at B = 1, T = 1: about this many warps (one a (split, kv head)) an SM; 243 registers a thread at hd 256
# hold 8 warps an SM. At 65,536 keys on the H200: 4 -> 48-50 %, 8 -> 58-62 %, 12 -> 45-50 %, 16 -> 43-52 % of the copy
# bandwidth (the combine's four tiles each)
WARPS_PER_SM = 8
MIN_STEPS = 8  # a split holds at least this many steps at the full key range (shorter: partial writes cost more)
# a token far before the key range's end: its chunk shrinks on the GPU down to this many steps (a process may set it
# with NINFER_BENCH_ATTN_MIN_STEPS, recorded in a result's env.knobs). T = 1 steps and T > 1 verifies share it, so
# the two keep each other's bits
DEFAULT_SHORT_MIN_STEPS = 1


def env_min_steps() -> int:
    """NINFER_BENCH_ATTN_MIN_STEPS (a positive integer), else :data:`DEFAULT_SHORT_MIN_STEPS`."""
    return _triton.env_count("NINFER_BENCH_ATTN_MIN_STEPS", DEFAULT_SHORT_MIN_STEPS, "16-key steps")


SHORT_MIN_STEPS = env_min_steps()
# the combine's tile [splits, columns]. With fp32 partials, at 65,536 keys, B = 1, T = 1 on the H200 (256 splits), 64
# splits a step read 61.4-61.8 % of the copy bandwidth for the whole call against 57.8-58.4 % at 32, columns 32 or 64
# alike. With fp16 partials (PART16), on an H100 in one run (docs/perf/2026-12-07g-fp16-partials-h100.md), 256 x 32
# against 64 x 32: the combine 4.9 / 14.5 us against 7.2 / 20.9 at T = 1 / 8, the whole call 56.1 / 115.7 against
# 59.2 / 125.3 us. The splits a step fix the combine's order of sums (alike for every T), the columns change no bits
COMBINE_COLS, COMBINE_SPLITS = 32, 256
_SOURCE = Path(__file__).with_name("attn_cuda.cu")


# extra -D defines of the build (tuning: scripts/bench_attention.py --cuda-builds, or NINFER_BENCH_ATTN_BUILD for a
# process, recorded in a result's env.knobs), e.g. (("VDEPTH", 3),)
_BUILD = {"defines": tuple(sorted(parse_build(os.environ.get("NINFER_BENCH_ATTN_BUILD", ""),
                                              "NINFER_BENCH_ATTN_BUILD").items()))}


def part_dtype() -> torch.dtype:
    """The dtype of the partial outputs the split pass writes: fp16 (the source's PART16 = 1, the default: half the
    bytes of fp32 for the split pass to write and the combine to read), or fp32 with the build define PART16=0."""
    return torch.float16 if dict(_BUILD["defines"]).get("PART16", 1) else torch.float32


def set_build_defines(defines: dict[str, int] | None = None) -> None:
    """Compile later launches with these extra ``-D`` defines of ``attn_cuda.cu`` (tuning; None: the defaults)."""
    _BUILD["defines"] = tuple(sorted((defines or {}).items()))


# the switch (on by default where the kernel runs): NINFER_BENCH_ATTN=triton turns it off for the process
_SWITCH = {"on": os.environ.get("NINFER_BENCH_ATTN", "").strip().lower() != "triton"}


VERIFY_KERNELS = ("mma", "wgmma")  # what may take T > 1 calls: attn_verify (the default), attn_verify_wg


def env_verify_kernel() -> str:
    """NINFER_BENCH_ATTN_VERIFY: which kernel takes T > 1 calls, ``mma`` (attn_verify, the default) or ``wgmma``
    (attn_verify_wg on an sm_90 GPU: the same products, sums and order, with K and V made into fp16 once a block)."""
    raw = os.environ.get("NINFER_BENCH_ATTN_VERIFY", "mma").strip().lower()
    if raw not in VERIFY_KERNELS:
        raise ValueError(f"NINFER_BENCH_ATTN_VERIFY: expected mma (the default) or wgmma, got {raw!r}")
    return raw


_VERIFY = {"kernel": env_verify_kernel()}


def set_verify_kernel(kernel: str) -> None:
    """T > 1 calls from now on through ``mma`` (attn_verify) or ``wgmma`` (attn_verify_wg, sm_90 only; elsewhere
    attn_verify)."""
    if kernel not in VERIFY_KERNELS:
        raise ValueError(f"attn_cuda: the verify kernel is mma or wgmma, got {kernel!r}")
    _VERIFY["kernel"] = kernel


def set_enabled(on: bool) -> None:
    """int8 decode attention through this kernel (True, the default where it runs) or the Triton split kernel."""
    _SWITCH["on"] = bool(on)


def enabled() -> bool:
    return _SWITCH["on"]


@functools.cache
def import_error() -> str | None:
    """Why the kernel cannot run here (None when it can): no CUDA device, an old GPU, or no cupy."""
    return _cupy.import_error("mma.m16n8k16 f16, movmatrix")


def available() -> bool:
    return import_error() is None


def supports(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos) -> bool:
    """Whether the kernel runs these inputs: CUDA, q bf16 / fp16 [B, T, H, hd] with hd a multiple of 64 up to 256 and
    H / Hkv <= 8, an int8 cache [S, Hkv, cap, hd] with contiguous rows, fp16 scales [S, Hkv, cap, hd / 64] with
    contiguous rows (4-byte aligned, even strides), 16-byte aligned query rows and cache rows, int32 / int64 slots and
    positions. A function of dtypes, shapes and layouts only, never of B or T (so one model's steps and verify passes
    take one path)."""
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.dim() == 4 and k_cache.dtype == torch.int8
            and k_scale is not None and v_scale is not None):
        return False
    hd = q.shape[3]
    hkv = k_cache.shape[1]
    if hd % 64 or hd > 256 or q.shape[2] % hkv or q.shape[2] // hkv > MAX_G:
        return False
    ng = hd // 64
    for c in (k_cache, v_cache):
        if c.stride(3) != 1 or c.stride(2) != hd or c.data_ptr() % 16 or c.stride(0) % 16 or c.stride(1) % 16:
            return False
    for s in (k_scale, v_scale):
        if s.dtype != torch.float16 or s.stride(3) != 1 or s.stride(2) != ng or s.data_ptr() % 4 \
                or s.stride(0) % 2 or s.stride(1) % 2:
            return False
    if q.stride(3) != 1 or q.data_ptr() % 16 or any(st % 8 for st in q.stride()[:3]):
        return False
    return slots.dtype in (torch.int32, torch.int64) and q_pos.dtype in (torch.int32, torch.int64) and available()


def wanted(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos) -> bool:
    """The switch is on and :func:`supports` holds."""
    return enabled() and supports(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos)


@dataclass(frozen=True, slots=True)
class CudaPlan:
    """Launch shape of the kernel: keys a split at the full key range (``chunk``), the floor a token's own position
    may shrink it to (``min_chunk``), both multiples of :data:`STEP`; the combine's tile. A function of static sizes
    only (the key range, Hkv, the GPU), never of B, T or the positions."""

    chunk: int
    min_chunk: int
    combine_cols: int = COMBINE_COLS
    combine_splits: int = COMBINE_SPLITS
    # a verify block's m tiles of 16 query rows at most (one warp each, 1 .. MAX_VERIFY_WARPS): T x G rows take
    # cdiv(T x G, 16 x verify_warps) blocks a (split, kv head), each reading the keys. No effect on any bits
    verify_warps: int = MAX_VERIFY_WARPS

    def __post_init__(self):
        if self.chunk <= 0 or self.chunk % STEP or self.min_chunk <= 0 or self.min_chunk % STEP \
                or self.min_chunk > self.chunk:
            raise ValueError(f"CudaPlan: chunk and min_chunk must be positive multiples of {STEP} with "
                             f"min_chunk <= chunk, got {self.chunk} and {self.min_chunk}")
        if not 1 <= self.verify_warps <= MAX_VERIFY_WARPS:
            raise ValueError(f"CudaPlan.verify_warps must be 1 .. {MAX_VERIFY_WARPS}, got {self.verify_warps}")
        for name in ("combine_cols", "combine_splits"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"CudaPlan.{name} must be a power of two >= 16, got {v}")

    def splits(self, kv_len: int) -> int:
        return -(-kv_len // self.chunk)


def plan(kv_len: int, kv_heads: int, device: torch.device | str = "cuda", *, warps_per_sm: int = WARPS_PER_SM,
         min_steps: int = MIN_STEPS, **combine) -> CudaPlan:
    """The default plan for a key range of ``kv_len`` and ``kv_heads``: split until a B = 1, T = 1 call has about
    ``warps_per_sm`` warps an SM, each split at least ``min_steps`` steps; ``combine``: ``combine_cols`` /
    ``combine_splits`` (tuning)."""
    sms = _triton.num_sms(device)
    steps = -(-kv_len // STEP)
    want = -(-warps_per_sm * sms // kv_heads)
    splits = max(1, min(want, steps // max(1, min_steps)))
    chunk = -(-steps // splits) * STEP
    return CudaPlan(chunk=chunk, min_chunk=min(chunk, SHORT_MIN_STEPS * STEP), **combine)


@functools.cache
def _builds(defines: tuple) -> tuple[tuple, tuple]:
    """(narrow, wide) attn_verify defines: the process's extra ``defines`` (tuning) over each build's own."""
    return tuple(sorted(dict(defines).items())), tuple(sorted({**WIDE_BUILD, **dict(defines)}.items()))


@functools.cache
def _kernels(hd: int, half: bool, pos64: bool, slot64: bool, device_index: int,
             defines: tuple = (), wgv: bool = False) -> tuple[object, ...]:
    """(attn_split, narrow attn_verify, wide attn_verify[, attn_verify_wg]) built and loaded at once: a T = 8 verify's
    first launch may come inside a CUDA-graph capture, after only T = 1 steps ran eagerly, and must not compile or
    load a module. ``wgv``: also attn_verify_wg (sm_90a, through NVRTC: _cupy.arch_kernel)."""
    import cupy

    out, source = [], _SOURCE.read_text()
    with cupy.cuda.Device(device_index):
        for i, build in enumerate(_builds(defines)):
            module = cupy.RawModule(code=source, backend="nvrtc",
                                    options=_options(hd, half, pos64, slot64, build))
            if i == 0:
                out.append(module.get_function("attn_split"))
            verify = module.get_function("attn_verify")
            verify.max_dynamic_shared_size_bytes = verify_smem(hd, MAX_VERIFY_WARPS, build)
            out.append(verify)
        for fn in out:
            if not fn.kernel.ptr:  # compiled and loaded now (cupy would on the first launch)
                raise RuntimeError("attn_cuda: a kernel did not load")
        if wgv:
            build = _builds(defines)[0]
            wg = _cupy.arch_kernel(source, (*_options(hd, half, pos64, slot64, build), "-DWGV=1"),
                                   "90a", "attn_verify_wg", device_index)
            wg.max_dynamic_shared_size_bytes = wgv_smem(hd, build)
            out.append(wg)
    return tuple(out)


def _options(hd: int, half: bool, pos64: bool, slot64: bool, build: tuple) -> tuple[str, ...]:
    return ("-std=c++17", "--fmad=false", f"-DHD={hd}", f"-DHALF={int(half)}", f"-DPOS64={int(pos64)}",
            f"-DSLOT64={int(slot64)}", *(f"-D{k}={v}" for k, v in build))


def wgv_smem(hd: int, defines: tuple = ()) -> int:
    """Bytes of dynamic shared memory an attn_verify_wg block takes: the source's WGV_SMEM (VDEPTH stages of raw codes
    and scales, then K' and V', the step's fp16 operands)."""
    return verify_smem(hd, 1, tuple(sorted({**dict(defines), "QSMEM": 0}.items()))) + (hd // 64) * 4 * 512 + hd * 32


def _wgv_wanted(device_index: int) -> bool:
    """attn_verify_wg takes this process's T > 1 calls: asked for (NINFER_BENCH_ATTN_VERIFY=wgmma) on an sm_90 GPU."""
    return _VERIFY["kernel"] == "wgmma" and _sm90(device_index)


@functools.cache
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def verify_smem(hd: int, warps: int, defines: tuple = ()) -> int:
    """Bytes of dynamic shared memory an attn_verify block of ``warps`` warps takes: the source's VERIFY_SMEM (its
    stages of raw codes and scales, then q's fragments under QSMEM; the kernel traps when launched with less)."""
    d = {"VDEPTH": 4, "QSMEM": 0, **dict(defines)}
    ng, kstr, vstr = hd // 64, hd if hd % 128 else hd + 64, hd + 16
    stage = STEP * kstr + STEP * vstr + 4 * STEP * ng
    return d["VDEPTH"] * stage + (warps * ng * 4 * 32 * 16 if d["QSMEM"] else 0)


def verify_grid(t: int, g: int, verify_warps: int = MAX_VERIFY_WARPS) -> tuple[int, int]:
    """(warps a block, blocks a (split, kv head)) of a T-token verify with G query heads a kv head: one warp a 16-row
    m tile of the T x G rows, at most ``verify_warps`` a block (no effect on any bits)."""
    tiles = -(-(t * g) // 16)
    warps = min(verify_warps, tiles)
    return warps, -(-tiles // warps)


def split(q, k_cache, v_cache, k_scale, v_scale, slots, q_pos, qk_scale: float, kv_len: int, cfg: CudaPlan,
          o_part: torch.Tensor, lse_part: torch.Tensor) -> None:
    """The split pass into ``o_part [B, T, H, splits, hd]`` (:func:`part_dtype`) and ``lse_part [B, T, H, splits]``
    fp32 (log2 units), written for each row's splits up to its position; ``qk_scale`` = softmax scale * log2(e).
    Inputs as :func:`supports` accepts them (the caller checks)."""
    import cupy

    b, t, h, hd = q.shape
    hkv = k_cache.shape[1]
    splits = cfg.splits(kv_len)
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    defines = _BUILD["defines"]
    wgv = _wgv_wanted(dev)
    one, narrow, wide, *wg = _kernels(hd, q.dtype == torch.float16, q_pos.dtype == torch.int64,
                                      slots.dtype == torch.int64, dev, defines, wgv)
    if t == 1:
        kern, grid, block, smem = one, (splits, b * hkv, 1), (32,), 0
    elif wgv:  # one warpgroup a block: 64 of the T x G rows
        kern, grid, block = wg[0], (splits, b * hkv, -(-(t * (h // hkv)) // 64)), (128,)
        smem = wgv_smem(hd, _builds(defines)[0])
    else:
        warps, blocks = verify_grid(t, h // hkv, cfg.verify_warps)
        w = warps > NARROW_WARPS
        kern, grid, block = (wide if w else narrow), (splits, b * hkv, blocks), (32 * warps,)
        smem = verify_smem(hd, warps, _builds(defines)[w])
    ptrs = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
            slots.data_ptr(), q_pos.data_ptr(), o_part.data_ptr(), lse_part.data_ptr())
    longs = (*q.stride()[:3], *k_cache.stride()[:2], *v_cache.stride()[:2], *k_scale.stride()[:2],
             *v_scale.stride()[:2], *q_pos.stride(), slots.stride(0))
    ints = (t, h, hkv, h // hkv, kv_len, cfg.chunk, cfg.min_chunk, splits)
    args = (*map(np.uint64, ptrs), *map(np.int64, longs), np.float32(qk_scale), *map(np.int32, ints))
    stream = torch.cuda.current_stream(q.device)
    with cupy.cuda.Device(dev):
        kern(grid, block, args, stream=_cupy.stream(stream, dev), shared_mem=smem)
