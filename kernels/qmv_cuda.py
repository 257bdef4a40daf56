"""Quantized projections for the decode, verify and batch widths (T <= 64) on the tensor cores: ``kernels/qmv_cuda.cu``.

``qmv(x, lin)`` computes ``x [T, K] @ W.T`` for a :class:`kernels.qlinear.PackedLinear` in q8 / q5 / q4, reading the
packed bytes in place, with x (and the output) in bf16 or fp16. The source's header says how: each code word
becomes four exact bf16/fp16 pairs with one mask-and-or and one packed subtraction, an ``mma.m16n8k16`` sums them
against x in fp32, and the group scale multiplies the sums; T = 1 and T = 8 cost nearly the same (the MMA's 8
columns are the tokens). Wider x (9-64 rows, a batch's verify) takes ``ceil(T / 8)`` column groups of 8 tokens in
one launch (rounded up to 2, 4 or 8): the weight is read and its fragments made once, and each group's sums are
those of a launch of its 8 rows alone, so a row's bits do not depend on the launch width
(:func:`qmv_rows` splits wider x into launches of ``MAX_ROWS``).
Compiled at first use for each (format, dtype, whole-groups, column groups) by CuPy's NVRTC, so it needs
``cupy`` (the ``[gpu]`` extra) and an sm_80+ GPU; :func:`supports` says whether a call can take this path, and
``PackedLinear`` falls back to the Triton kernels of ``kernels/qlinear.py`` otherwise. The reference is
:func:`kernels.qlinear.qlinear_ref`.

Launches are asynchronous, allocate nothing but the output and use the current torch stream, so a call is safe
to capture in a CUDA graph once a first call for its (format, dtype) has compiled and loaded the module. Results
are deterministic and row t of the output does not depend on the other rows of x (split-K partials are added in
a fixed order), which is what lets concurrent greedy decoding reproduce sequential decoding bit for bit. A split
launch reduces its pieces in a thread-block cluster on sm_90+ (else through a workspace), or, where the pieces buy
no parallelism (:func:`pieces_pay`), one block walks them all and adds them up the same way: the same bits.

Defaults: one split and 3 blocks per SM; wide weights take 4 warps a tile (:func:`choose_warps`); the engine keeps
its weights in a :class:`TiledWeight` (``kernels/qmv_layout.py``). The measurements behind them, and what each
projection reaches at the 27B shapes: ``docs/perf/README.md``.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from . import _cupy, _triton, quant
from .qmv_layout import DENSE_FMT, WORD_ORDER, TiledWeight

__all__ = ["qmv", "supports", "available", "import_error", "choose_splits", "choose_warps", "workspace", "set_dense",
           "dense_enabled", "DenseWeight", "TiledWeight", "DENSE_FMT", "WORD_ORDER", "qmv_rows", "MAX_T", "MAX_ROWS",
           "MAX_SPLITS", "reserve", "shape_splits", "column_groups", "pieces_pay", "set_pieces", "MAX_CLUSTER",
           "set_shape_knobs", "shape_knobs", "parse_shapes"]

MAX_T = 8  # tokens per column group: the MMA's n = 8 columns
MAX_ROWS = 64  # rows of x per launch: up to 8 column groups
MAX_SPLITS = 8  # split-K slices: the workspace holds splits x T x N floats
NW = 8  # warps per block (NW in the source)
_FMT_ID = {"q8_g32_fp16": 0, "q5_g64_fp16": 1, "q4_g64_fp16": 2, DENSE_FMT: 3}
_SOURCE = Path(__file__).with_name("qmv_cuda.cu")
_BLOCKS_PER_SM = 3  # MIN_BLOCKS in the source at NW warps (the H200 sweep: 3 beats 2 and 4 at the 27B shapes)
_WARPS_PER_SM = NW * _BLOCKS_PER_SM  # the register cap a launch is built for: 24 warps an SM, whatever the block
# a one-pass launch of at most 8 rows whose row tiles overfill one wave of the default's blocks but fit one wave of up
# to this many warps an SM is built for that wave instead (ceil(tiles / SMs) blocks, :func:`wave_blocks`): one wave
# and no tail of a few blocks an SM. ptxas (sm_90a): 4 warps x 7 blocks caps q4 / q5 / q8 at 72 registers (q4 spills
# 4 bytes). H100, chained under PDL: the 27B attention q | gate | k | v (896 tiles, q5) 21.55 -> 18.53 us at T = 1,
# 22.02 -> 19.12 at T = 8, and 4 warps x 7 blocks lost 7 % where the default's wave already held the tiles (GDN
# qkv, 640); the 27B step 6.202 -> 6.167 ms, the same tokens (docs/perf/2026-12-06j-qmv-shape-knobs-h100.md)
_WAVE_WARPS_PER_SM = 28


@functools.cache
def import_error() -> str | None:
    """Why the kernel cannot run here (None when it can): no CUDA device, an old GPU, or no cupy."""
    return _cupy.import_error("mma.m16n8k16 bf16")


def available() -> bool:
    return import_error() is None


def supports(x: torch.Tensor, lin) -> bool:
    """Whether ``qmv(x, lin)`` runs for this input: CUDA, bf16/fp16, 1..64 rows, contiguous, a q format (or a
    :class:`DenseWeight` in x's dtype), the packed buffer 16-byte aligned."""
    lin = getattr(lin, "qmv_weight", None) or lin
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS
            and x.shape[1] == lin.k and x.is_contiguous() and lin.fmt in _FMT_ID
            and lin.codes.data_ptr() % 16 == 0  # 8 / 16-byte code loads; a view into a bigger buffer may sit anywhere
            and (lin.fmt != DENSE_FMT or lin.weight.dtype == x.dtype)
            and available())


class DenseWeight:
    """A dense bf16 / fp16 weight ``[N, K]`` (K a multiple of 64, contiguous) in the shape qmv reads: the kernel's
    FMT 3 multiplies it as it is, in the same tiles, splits and fixed-order sums as the packed formats (so a small
    projection gets one launch with no split-K reduce kernel, and its rows do not depend on the batch)."""

    fmt = DENSE_FMT

    def __init__(self, weight: torch.Tensor):
        if weight.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2 or not weight.is_contiguous() \
                or weight.shape[1] % 64 or not weight.is_cuda:
            raise ValueError(f"DenseWeight: needs a contiguous CUDA bf16/fp16 [N, K] weight with K a multiple of 64, "
                             f"got {tuple(weight.shape)} {weight.dtype} on {weight.device}")
        self.weight = weight
        self.n, self.k = weight.shape
        self.kp, self.group = self.k, 64
        self.ng = self.k // 64
        self.codes = weight.view(torch.uint8)  # [N, 2K] bytes
        self.high = self.codes[:1, :1]  # unused by FMT 3
        self.scales = weight[:1, :1]  # unused by FMT 3
        reserve(weight.device, self.n, self.ng)  # outside any graph capture


def async_shared_bytes(fmt: str, warps: int, stages: int, tiles: int = 1) -> int:
    """Dynamic shared memory of a launch with a ``stages``-step cp.async ring (``ASYNC`` in the source): per warp,
    stage, row tile and lane a 16-byte code piece and a 4-byte scale pair, and for q5 a 4-byte high-bit pair."""
    per_lane = 16 + 4 + (4 if fmt == "q5_g64_fp16" else 0)
    return warps * stages * tiles * 32 * per_lane if stages else 0


def kernel_options(fmt_id: int, half: bool, even: bool, unroll: int, min_blocks: int, xlate: bool, pipe: bool,
                   fold: bool, pdl: bool, tiled: int, act: bool, warps: int, tail: bool, ncol: int, tiles: int,
                   xl1: bool = True, stages: int = 0, out_f32: bool = False,
                   cluster: bool = False, pieces: int = 1) -> tuple[str, ...]:
    """The source's compile options for one build (NVRTC's; a C preprocessor given them evaluates the source's
    static checks, its ``#error`` lines, as NVRTC does: tests/test_kernel_builds.py)."""
    return ("-std=c++17", f"-DFMT={fmt_id}", f"-DHALF={int(half)}", f"-DEVEN={int(even)}",
            f"-DUNROLL={unroll}", f"-DMIN_BLOCKS={min_blocks}", f"-DXLATE={int(xlate)}",
            f"-DPIPE={int(pipe)}", f"-DFOLD={int(fold)}", f"-DPDL={int(pdl)}",
            f"-DTILED={int(tiled)}", f"-DACT={int(act)}", f"-DNW={warps}",
            f"-DTAIL={int(tail)}", f"-DNCOL={ncol}", f"-DTPW={tiles}",
            f"-DXL1={int(xl1)}", f"-DASYNC={stages}", f"-DOUT_F32={int(out_f32)}", f"-DCLUSTER={int(cluster)}",
            f"-DPIECES={pieces}")


@functools.cache
def _kernel(fmt_id: int, half: bool, even: bool, unroll: int, min_blocks: int, xlate: bool, pipe: bool,
            fold: bool, pdl: bool, tiled: int, act: bool, warps: int, tail: bool, ncol: int, tiles: int,
            device_index: int, xl1: bool = True, stages: int = 0, shared: int = 0, out_f32: bool = False,
            cluster: bool = False, pieces: int = 1):
    import cupy

    options = kernel_options(fmt_id, half, even, unroll, min_blocks, xlate, pipe, fold, pdl, tiled, act, warps, tail,
                             ncol, tiles, xl1, stages, out_f32, cluster, pieces)
    with cupy.cuda.Device(device_index):
        func = cupy.RawModule(code=_SOURCE.read_text(), backend="nvrtc", options=options).get_function("qmv")
    if shared:  # the default cap is 48 KB less the kernel's static shared memory (tile_store's sums)
        with cupy.cuda.Device(device_index):
            func.max_dynamic_shared_size_bytes = shared
    return func


# Split-K scratch, one per device: fp32 partial tiles [splits, T, N] (overwritten by every launch) and per-tile
# arrival counters (left at zero). Its own, not kernels/qlinear.py's, whose sums must stay zero between launches.
_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(device, floats: int, tiles: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's split-K scratch, grown to at least ``floats`` floats; never grown inside a CUDA-graph capture
    (``PackedLinear`` and ``DenseWeight`` :func:`reserve` what their widest launch needs when they are built)."""
    return _triton.split_k_scratch(_WORKSPACES, device, floats, tiles, "qmv")


def reserve(device, n: int, ng: int) -> None:
    """Grow the device's split-K scratch for an ``[n, K]`` weight of ``ng`` groups: its split count (a function of
    the shape, :func:`shape_splits`) times ``MAX_ROWS`` rows times ``n`` - nothing when it takes one pass."""
    device = torch.device(device)
    dev = device.index if device.index is not None else torch.cuda.current_device()
    s = shape_splits(n, ng, _triton.num_sms(dev))
    workspace(device, s * MAX_ROWS * n if s > 1 else 1, -(-n // 16))


def shape_splits(n: int, ng: int, sms: int, warps: int | None = None) -> int:
    """The split count every launch for this weight uses (unless a caller passes ``splits``): :func:`choose_splits`
    at the default unroll and blocks an SM for ``warps`` (default :func:`choose_warps`), or the shape's override
    (:func:`set_shape_knobs`), so that it is the same at every width - the order of the sums, and so each row's
    bits, do not depend on how many rows a launch takes."""
    knobs = _SHAPES.get((n, ng), {})
    warps = warps or knobs.get("warps") or choose_warps(n, sms)
    splits = knobs.get("splits") or choose_splits(n, ng, sms, 4, max(1, _WARPS_PER_SM // warps), warps)
    groups = -(-ng // min(splits, MAX_SPLITS))
    return -(-ng // groups)


# ---- switches, process-wide (as DeepGEMM's set_pdl); off here, the engine sets them from EngineOptions ---------
# pdl (the one switch of kernels/_triton.set_pdl, shared with the Triton glue kernels): the kernel is launched with
# programmatic stream serialization (cuLaunchKernelEx, through ctypes: CuPy's launcher takes no launch attributes),
# so it may start while the kernel before it finishes; it issues its first weight loads, then waits
# (griddepcontrol.wait) before it reads x, and lets the next kernel launch from its start. CUDA graphs captured from
# such launches keep the programmatic edges; sm_90+. Alone it measured slower on the H200 (the kernels around qmv
# did not let it start early); with the Triton glue PDL-aware too the 27B step is 4 % faster (EngineOptions.pdl,
# on by default). dense: small dense 16-bit projections (engine/weights.DenseLinear) through
# FMT 3 (measured faster: on by default in EngineOptions.qmv_dense).
# pdl_x_l1: under PDL, x is read through L1 (ld.global.ca) once griddepcontrol.wait has made the kernel before's
# writes visible; off (NINFER_BENCH_QMV_PDL_X=l2): through L2 only (ld.global.cg), every warp its own L2 reads of all
# T rows.
# cluster: a split-K launch on sm_90+ runs each tile's pieces as one thread-block cluster and adds their sums through
# distributed shared memory (CLUSTER in the source; the same sums in the same order as the workspace's, so the same
# bits): on by default, off (NINFER_BENCH_QMV_CLUSTER=0) through the global workspace and its counters.
# pieces: a split launch whose pieces buy no parallelism (pieces_pay) walks them in one block instead (PIECES in the
# source: each piece's sums kept apart and added as the split's reduction adds them, so the same bits): on by default,
# off (NINFER_BENCH_QMV_PIECES=0) every split launch spreads its pieces over blocks.
_SWITCHES = {"dense": False, "pdl_x_l1": True, "split_cap": 0, "cluster": True, "pieces": True}
MAX_CLUSTER = 8  # the portable thread-block cluster size: a split of at most this many pieces reduces in a cluster


def set_dense(on: bool) -> None:
    """Small dense 16-bit projections (engine/weights.DenseLinear, up to 64 rows) through qmv's FMT 3 instead of
    cuBLAS from now on."""
    _SWITCHES["dense"] = bool(on)


def set_pdl_x_l1(on: bool) -> None:
    """Under PDL, read x through L1 (on, the default) or through L2 only (off) in kernels built from now on."""
    _SWITCHES["pdl_x_l1"] = bool(on)


def set_cluster(on: bool) -> None:
    """Split-K launches (sm_90+) reduce within a thread-block cluster (on, the default) or through the global
    workspace (off), from now on: the same bits either way."""
    _SWITCHES["cluster"] = bool(on)


def set_pieces(on: bool) -> None:
    """Split launches that :func:`pieces_pay` picks walk their pieces in one block (on, the default) or spread them
    over blocks (off), from now on: the same bits either way."""
    _SWITCHES["pieces"] = bool(on)


def dense_enabled() -> bool:
    return _SWITCHES["dense"]


def column_groups(t: int) -> int:
    """Column groups of 8 tokens a launch of ``t`` rows is compiled for: ceil(t / 8) rounded up to 1, 2, 4 or 8 (the
    rows past t repeat row t - 1 and are not stored)."""
    return 1 << ((t + MAX_T - 1) // MAX_T - 1).bit_length()


# blocks an SM whose registers a launch of (column groups, warps a tile) is built for: ptxas (sm_90) fits 2 groups in
# 128 registers a thread without spills, 4 and 8 take 210-255; the H200 at the 27B shapes (16 and 64 rows) measured
# one block of 4 warps best for 2 groups, two of 8 warps, and one block for 8 groups
# (docs/perf/2026-12-03e-qmv-rows-sampler-h200.md); 4 groups by the register count alone
_NCOL_MIN_BLOCKS = {(2, 4): 1, (2, 8): 2, (4, 4): 2, (4, 8): 1, (8, 4): 1, (8, 8): 1}

# a wide launch's build by its column groups (and format): {(ncol, fmt or None): {"tiles": tiles a block (TPW),
# "unroll": steps in flight, "min_blocks": blocks an SM, "stages": cp.async ring stages}}, what qmv takes for the
# keywords a caller leaves out, for tuning runs: set from NINFER_BENCH_QMV_WIDE, e.g. "8:p2u1b1,4:p2u2b1" (every
# format) or "8q4:p3u1b1,8q5:p1" (one format; scripts/bench_qlinear.py's knob letters: p tiles, u unroll, b blocks an
# SM, s stages). A launch with no entry takes _WIDE_DEFAULT's build for its format, else one tile a block and the
# defaults above.
_WIDE: dict[tuple[int, str | None], dict[str, int]] = {}
# the measured default builds by (column groups, format), docs/perf/2026-12-05b-qmv-ring-h200.md: at 8 column groups
# (a C8 speculative verify) q4 and q5 take 3 row tiles a block with their weights through a 4-stage cp.async ring, one
# block an SM. The 27B DFlash2 K=7 replayed C8 on the H200 ran 1,049.9 tok/s aggregate (1,497.0 steady) with it against
# 1,023.9 (1,431.2) with the builds before (q4: 3 tiles, one step in registers; q5: one tile), same tokens. Alone, at
# 64 rows without PDL (us): H100 gate_up 112.1 against 122.4 for 3 tiles from registers, attention q | gate 48.1
# against 59.6 for one tile; H200 gate_up 113.6 against 110.2 (3 tiles from registers: within the bench's spread),
# q | gate 48.1 against 57.3. q8 (lm_head) keeps one tile from registers (H100: 1,363 against 1,370 with a ring and
# 1,849 with 3 tiles and a ring). The ring needs the lanes layout: on another layout these builds load one step into
# registers (unroll 1), as q4's build before the ring did
_WIDE_DEFAULT: dict[tuple[int, str], dict[str, int]] = {
    (8, "q4_g64_fp16"): {"tiles": 3, "stages": 4, "unroll": 1, "min_blocks": 1},
    (8, "q5_g64_fp16"): {"tiles": 3, "stages": 4, "unroll": 1, "min_blocks": 1}}


# the letters of a build's knobs (NINFER_BENCH_QMV_WIDE's entries, bench_qlinear's --qmv-knobs, ptxas_report's
# --knobs), each followed by its number: p row tiles a block, u steps in registers, b blocks an SM, s cp.async ring
# stages, w warps a tile
KNOB_LETTERS = {"p": "tiles", "u": "unroll", "b": "min_blocks", "s": "stages", "w": "warps"}


def knob_kwargs(knobs: str) -> dict[str, int]:
    """{keyword: number} of every letter-number pair of ``knobs`` whose letter is in :data:`KNOB_LETTERS` (callers
    check which letters they take, and what else the text may hold)."""
    import re

    return {KNOB_LETTERS[k]: int(v) for k, v in re.findall(rf"([{''.join(KNOB_LETTERS)}])(\d+)", knobs)}


# per-weight-shape launch overrides (tuning runs): {(rows N, groups of K): {"warps", "splits", "min_blocks"}}, set
# from NINFER_BENCH_QMV_SHAPES (recorded in a result's env.knobs) or set_shape_knobs. Warps and splits fix the order
# of a row's sums, so an entry holds at every launch width of that shape (a verify row keeps a step's bits); blocks
# an SM only caps the registers of a launch of up to 8 rows (wider builds keep theirs)
_SHAPES: dict[tuple[int, int], dict[str, int]] = {}
SHAPE_LETTERS = {"w": "warps", "k": "splits", "b": "min_blocks"}


def parse_shapes(text: str) -> dict[tuple[int, int], dict[str, int]]:
    """``NxG:KNOBS,...`` (N weight rows, G groups of K; knobs w<warps a tile> k<split-K count> b<blocks an SM>, e.g.
    ``5120x96:w4k2,14336x80:w8``) -> {(N, G): {keyword: number}}; ValueError when malformed."""
    import re

    out = {}
    for item in (v.strip() for v in text.split(",") if v.strip()):
        m = re.fullmatch(r"(\d+)x(\d+):((?:[wkb]\d+)+)", item)
        if not m:
            raise ValueError(f"NINFER_BENCH_QMV_SHAPES: {item!r}: expected NxG:KNOBS (N weight rows, G groups of K; "
                             "knobs w<warps a tile> k<split-K count> b<blocks an SM>), e.g. 5120x96:w4k2")
        kw = {SHAPE_LETTERS[k]: int(v) for k, v in re.findall(r"([wkb])(\d+)", m.group(3))}
        if kw.get("warps", 4) not in (1, 2, 4, 8) or not 1 <= kw.get("splits", 1) <= MAX_SPLITS \
                or not 1 <= kw.get("min_blocks", 1) <= 16:
            raise ValueError(f"NINFER_BENCH_QMV_SHAPES: {item!r}: warps 1, 2, 4 or 8, splits 1..{MAX_SPLITS}, "
                             "blocks an SM 1..16")
        out[(int(m.group(1)), int(m.group(2)))] = kw
    return out


def set_shape_knobs(table: dict[tuple[int, int], dict[str, int]] | None) -> None:
    """Launches of the weights named in ``table`` ({(N, groups): {"warps", "splits", "min_blocks"}}) take those
    knobs from now on where their caller leaves them out (None or {}: none). For tuning: build the weights (their
    split-K scratch is reserved then) after setting it."""
    _SHAPES.clear()
    _SHAPES.update(table or {})


def shape_knobs(n: int, ng: int) -> dict[str, int]:
    """The override :func:`set_shape_knobs` / NINFER_BENCH_QMV_SHAPES holds for an ``[n, ng groups]`` weight."""
    return dict(_SHAPES.get((n, ng), {}))


def _wide_builds(text: str) -> dict[tuple[int, str | None], dict[str, int]]:
    """``NCOL[FMT]:KNOBS,...`` (``8:p2u1b1``, ``8q5:p1``, ``8q4:p3s4b1``) -> {(ncol, format or None): {"tiles",
    "unroll", "min_blocks", "stages" given}}; ValueError when malformed."""
    import re

    out = {}
    for item in (v.strip() for v in text.split(",") if v.strip()):
        m = re.fullmatch(r"(\d+)(q4|q5|q8)?:((?:[pubs]\d+)+)", item)
        if not m or int(m.group(1)) not in (1, 2, 4, 8):
            raise ValueError(f"NINFER_BENCH_QMV_WIDE: {item!r}: expected NCOL[FMT]:KNOBS with NCOL 1, 2, 4 or 8, "
                             "FMT q4, q5 or q8 (none: every format) and knobs p<tiles> u<unroll> b<blocks an SM> "
                             "s<cp.async stages, 0 off>, e.g. 8:p2u1b1 or 8q4:p3s4b1")
        key = (int(m.group(1)), quant.QUANT_SHORT.get(m.group(2)))
        out[key] = knob_kwargs(m.group(3))
    return out


def wide_build(ncol: int, fmt: str) -> dict[str, int]:
    """The build keywords a launch of ``ncol`` column groups of a ``fmt`` weight takes where its caller leaves them
    out: :data:`_WIDE`'s entry for (``ncol``, ``fmt``), else for ``ncol`` and every format (NINFER_BENCH_QMV_WIDE),
    else :data:`_WIDE_DEFAULT`'s for (ncol, fmt), else none (one tile a block). One column group (up to 8 rows) has
    no default entry: an NINFER_BENCH_QMV_WIDE entry for it (``1q4:s4``) is a tuning run's."""
    for table, key in ((_WIDE, (ncol, fmt)), (_WIDE, (ncol, None)), (_WIDE_DEFAULT, (ncol, fmt))):
        if key in table:
            return dict(table[key])
    return {}


def _env_on(var: str) -> bool:
    """An on / off switch from the environment: 1 (the default) or 0; anything else is refused by name."""
    value = os.environ.get(var, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{var}: {value!r}: expected 1 (the default) or 0")
    return value == "1"


def _load_env_knobs() -> None:
    text = os.environ.get("NINFER_BENCH_QMV_WIDE", "")
    if text:
        _WIDE.update(_wide_builds(text))
    x_path = os.environ.get("NINFER_BENCH_QMV_PDL_X", "l1").strip().lower()
    if x_path not in ("l1", "l2"):
        raise ValueError(f"NINFER_BENCH_QMV_PDL_X: {x_path!r}: expected l1 (the default) or l2")
    set_pdl_x_l1(x_path == "l1")
    # a tuning run's cap on the split-K count qmv picks (1: every launch in one pass over K), to measure what the
    # split's second pass costs; it changes the order of the sums, so the bits and possibly the tokens (0: none)
    _SWITCHES["split_cap"] = _triton.env_count("NINFER_BENCH_QMV_SPLIT_CAP", 0, "a split count")
    set_cluster(_env_on("NINFER_BENCH_QMV_CLUSTER"))
    set_pieces(_env_on("NINFER_BENCH_QMV_PIECES"))
    set_shape_knobs(parse_shapes(os.environ.get("NINFER_BENCH_QMV_SHAPES", "")))


_load_env_knobs()


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_ubyte * 4), ("value", ctypes.c_ubyte * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


_ATTR_CLUSTER_DIMENSION = 4
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.POINTER(ctypes.c_void_p)]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib


def _launch_ex(func, grid: tuple[int, int], block: int, args: tuple, stream_handle: int, shared: int = 0, *,
               pdl: bool = True, cluster_y: int = 0) -> None:
    """``func<<<grid, block, shared, stream>>>(args)`` through cuLaunchKernelEx: with programmatic stream
    serialization allowed (``pdl``) and / or thread-block clusters of ``(1, cluster_y, 1)`` blocks; ``func`` is a
    cupy RawKernel (its ``kernel`` is the CUfunction on the current device), ``args`` ctypes scalars in parameter
    order, ``shared`` bytes of dynamic shared memory."""
    attrs = (_LaunchAttr * 2)()
    count = 0
    if pdl:
        attrs[count].id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[count].value[0] = 1  # programmaticStreamSerializationAllowed (an int, little-endian)
        count += 1
    if cluster_y:
        attrs[count].id = _ATTR_CLUSTER_DIMENSION
        dims = (ctypes.c_uint * 3).from_buffer(attrs[count].value)  # CUlaunchAttributeValue.clusterDim
        dims[0], dims[1], dims[2] = 1, cluster_y, 1
        count += 1
    cfg = _LaunchConfig((ctypes.c_uint * 3)(grid[0], grid[1], 1), (ctypes.c_uint * 3)(block, 1, 1), shared,
                        ctypes.c_void_p(stream_handle), attrs, count)
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    rc = _driver().cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(func.kernel.ptr), params, None)
    if rc != 0:
        raise RuntimeError(f"qmv: cuLaunchKernelEx (PDL {pdl}, clusters of (1, {cluster_y}, 1)) failed (CUresult {rc})")


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def choose_splits(n: int, ng: int, sms: int, unroll: int = 4, min_blocks: int = _BLOCKS_PER_SM,
                  warps: int = NW) -> int:
    """Blocks per 16-row tile along K (split-K): a pure function of the shape, so the launch never changes.

    A cost model in units of one warp step: the grid runs in waves of ``sms * 2`` blocks; a block's warps take
    ceil(groups / NW) steps each, plus a fixed cost (the block's start, its reduction, split-K's atomics) of
    about one batch of ``unroll`` steps. Few tiles (N small) want more splits to fill the GPU; many tiles want none.
    """
    if _wide(n, sms):  # tiles enough to fill the GPU: one pass
        return 1
    tiles = -(-n // 16)
    best, best_cost = 1, None
    for s in range(1, max(1, ng // warps) + 1):
        waves = -(-tiles * s // (sms * min_blocks))
        steps = -(-(-(-ng // s)) // warps)
        cost = waves * (steps + unroll)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def choose_warps(n: int, sms: int) -> int:
    """Warps per 16-row tile for an N-row weight: a pure function of the weight's shape (never of T, so a row's
    sums keep their order at every width). A weight of at least 4 tiles an SM takes 4 warps a tile and twice the
    blocks an SM, each warp walking twice the groups: faster on the H200 at the wide 27B shapes (gate_up q4 28.3 ->
    26.6 us, attention q|gate q5 16.1 -> 14.5, GDN qkv q4 11.2 -> 10.2, lm_head q8 334.8 -> 321.7); a narrower one
    keeps 8, which fills the GPU with its fewer tiles (5120 rows: 7.5 us against 9.1 at 4 warps;
    docs/perf/2026-12-01-qmv-warps-h200.md)."""
    return 4 if _wide(n, sms) else NW


@dataclass(frozen=True, slots=True)
class QmvBuild:
    """How one qmv launch is built and shaped (:func:`launch_build`): the source's defines it compiles with (its
    column groups ``ncol``, row tiles a block ``tiles`` (TPW), steps in flight ``unroll``, blocks an SM ``min_blocks``,
    warps a tile ``warps`` (NW) and cp.async ring ``stages`` (ASYNC)), its block's ``threads`` and dynamic ``shared``
    bytes."""

    ncol: int
    tiles: int
    unroll: int
    min_blocks: int
    warps: int
    stages: int
    threads: int
    shared: int


def launch_build(fmt: str, n: int, t: int, layout: int, sms: int, *, unroll: int | None = None,
                 min_blocks: int | None = None, xlate: bool = False, pipe: bool = False, warps: int | None = None,
                 tail: bool = False, tiles: int | None = None, stages: int | None = None,
                 ng: int | None = None) -> QmvBuild:
    """The build a :func:`qmv` launch of ``t`` rows of an ``[n, K]`` ``fmt`` weight in ``layout`` (0 a
    PackedLinear's row-major sections, 1 tiles, 2 the lanes layout) takes on a GPU with ``sms`` SMs, from the
    keywords its caller gave (None: the default) and the process's tables (:func:`wide_build`; with ``ng``, the
    weight's groups, the shape's override of :func:`set_shape_knobs`). A pure function of its arguments and those
    tables (no GPU): ValueError where :func:`qmv` refuses the keywords."""
    ncol = column_groups(t)
    if ncol > 1 and (xlate or pipe or tail):
        raise ValueError(f"qmv: xlate, pipe and tail are for launches of at most {MAX_T} rows, got {t}")
    wide = wide_build(ncol, fmt)
    tiles = tiles or wide.get("tiles", 1)
    unroll = unroll or wide.get("unroll", 4)
    min_blocks = min_blocks or wide.get("min_blocks")
    if stages is None:  # the ring streams the lanes layout's pieces: other layouts load into registers
        stages = wide.get("stages", 0) if layout == 2 else 0
    elif stages and layout != 2:
        raise ValueError(f"qmv: stages > 0 streams the lanes layout (a TiledWeight with lanes=True), got layout "
                         f"{layout} (0: a PackedLinear's row-major sections, 1: a TiledWeight without lanes)")
    if stages < 0 or stages and (xlate or pipe or tail):
        raise ValueError(f"qmv: stages must be >= 0 and comes without xlate, pipe and tail, got {stages}")
    if tiles > 1 and ncol == 1:
        raise ValueError(f"qmv: tiles a block > 1 shares x between the tiles of a launch of more than {MAX_T} rows, "
                         f"got {t}")
    knobs = _SHAPES.get((n, ng), {}) if ng is not None else {}
    warps = warps or knobs.get("warps") or choose_warps(n, sms)
    if ncol == 1 and not min_blocks:
        min_blocks = knobs.get("min_blocks")
    if ncol == 1 and not min_blocks and not knobs.get("splits"):
        min_blocks = wave_blocks(n, sms, warps)
    min_blocks = min_blocks or (max(1, _WARPS_PER_SM // warps) if ncol == 1 else
                                _NCOL_MIN_BLOCKS.get((ncol, warps), max(1, 8 // warps)))
    return QmvBuild(ncol=ncol, tiles=tiles, unroll=unroll, min_blocks=min_blocks, warps=warps, stages=stages,
                    threads=warps * 32, shared=async_shared_bytes(fmt, warps, stages, tiles))


def wave_blocks(n: int, sms: int, warps: int) -> int | None:
    """Blocks an SM a one-pass launch of up to 8 rows of an ``n``-row weight is built for when its row tiles
    overfill the default's one wave (:data:`_WARPS_PER_SM` warps an SM) but fit one wave of at most
    :data:`_WAVE_WARPS_PER_SM`: ceil(tiles / ``sms``); else None (the default). Only wide weights (:func:`_wide`),
    which always take one pass over K, so their grid is their tiles. A build's registers change no sum, so no bits."""
    tiles = -(-n // 16)
    per_sm = -(-tiles // sms)
    if not _wide(n, sms) or per_sm <= _WARPS_PER_SM // warps or per_sm > _WAVE_WARPS_PER_SM // warps:
        return None
    return per_sm


# pieces_pay's bounds, from the H100 grid of scripts/probe_qmv_pieces.py (docs/perf/2026-12-06g-qmv-pieces-h100.md):
# batches of steps a walk may take beyond one piece's (a walk of two batches against a piece's one ran 0.67-0.97x
# the split, of four against one or two 0.93-1.37x), and pieces it may walk (each piece is one round of the block's
# reduction: 8 pieces of 16 row tiles ran 1.09-1.17x the split, 2-4 pieces 0.67-0.97x)
PIECES_SLACK = 1
WALK_MAX_PIECES = 4
# the register cap a walk is built for (warps an SM): each warp holds up to 8 pieces' sums, which spill at the
# default's 24 warps (80 registers a thread) and fit at 16 (128); a walk's grid is small, so the occupancy is moot
_WALK_WARPS_PER_SM = 16


def walk_build(build: QmvBuild) -> QmvBuild:
    """``build`` as a walk of split pieces takes it by default: registers for every piece's sums (the register cap of
    :data:`_WALK_WARPS_PER_SM` warps an SM)."""
    return replace(build, min_blocks=max(1, _WALK_WARPS_PER_SM // build.warps))


def pieces_pay(ng: int, groups_per_split: int, warps: int, unroll: int) -> bool:
    """Whether a split-K launch of an ``ng``-group weight in pieces of ``groups_per_split`` groups should walk its
    pieces in one block (``PIECES`` in the source) instead of spreading them over blocks: it can (a piece is a whole
    number of warp strides, so the block's warps walk its groups as the piece's block would), there are at most
    :data:`WALK_MAX_PIECES` pieces, and the walk of all the groups takes at most :data:`PIECES_SLACK` more batches of
    ``unroll`` steps (a batch: one round trip to memory) than one piece's, so the split's blocks buy little latency
    and its reduction costs more than it saves. A pure function of the shape and the build; the bits are the
    split's either way."""
    if groups_per_split >= ng or groups_per_split % warps or -(-ng // groups_per_split) > WALK_MAX_PIECES:
        return False

    def batches(groups: int) -> int:
        return -(-(-(-groups // warps)) // unroll)
    return batches(ng) <= batches(groups_per_split) + PIECES_SLACK


def _wide(n: int, sms: int) -> bool:
    """At least 4 row tiles an SM: 4 warps a tile (:func:`choose_warps`) and one pass (:func:`choose_splits`)."""
    return -(-n // 16) >= 4 * sms


def qmv(x: torch.Tensor, lin, out: torch.Tensor | None = None, *, splits: int | None = None,
        unroll: int | None = None, min_blocks: int | None = None, xlate: bool = False, pipe: bool = False,
        fold: bool = False, pdl: bool | None = None, act: bool = False, warps: int | None = None,
        tail: bool = False, tiles: int | None = None, stages: int | None = None,
        out_f32: bool = False, pieces: bool | None = None) -> torch.Tensor:
    """``x [T, K] @ W.T`` -> ``[T, N]`` in x.dtype, for T <= 64 (see :func:`supports`); with ``out_f32``, in fp32:
    each value rounded to x.dtype first and then widened, the values of ``qmv(x, lin).float()`` without the copy
    (not with ``act``). ``out`` (contiguous [T, N], the result's dtype) is written instead of a fresh tensor.
    ``splits`` (default :func:`choose_splits`), ``unroll`` (steps whose loads are in flight together),
    ``min_blocks`` (blocks per SM the registers must allow), ``xlate`` (x loaded one step ahead instead of with the
    codes), ``pipe`` (the step batches double-buffered: the next batch's
    loads in flight while one is multiplied) and ``fold`` (q4/q5: the zero point taken off the sums by one MMA per
    x fragment instead of a subtraction per code pair: 7 % fewer instructions, but it spills at 80 registers) are
    for tuning and tests - none of the last three was faster on the H200 (``fold`` 3-15 % slower). ``pdl``
    (default :func:`kernels._triton.pdl_now`: the switch is on and the launch is for a CUDA graph) launches with
    programmatic dependent launch on sm_90+. ``act``: the weight is a gate / up pair with rows alternating in runs of
    8 (engine/model/weights.py's interleaved gate_up) and the result is ``silu(gate) * up`` ``[T, N / 2]`` (one launch,
    no split-K; N a multiple of 16). ``warps``: warps per 16-row tile (default :func:`choose_warps`; they take its
    groups in turn, so this fixes the order of the sums), ``min_blocks`` defaulting to 24 warps an SM; ``tail``: a
    warp's last groups (fewer than ``unroll``) loaded as one predicated batch instead of one step at a time (the
    same sums in the same order). Over 8 rows (:func:`column_groups` > 1) ``xlate``, ``pipe`` and ``tail`` are
    refused and ``min_blocks`` defaults to the measured best for the column groups (:data:`_NCOL_MIN_BLOCKS`);
    ``tiles`` (over 8 rows): row tiles a block takes, each warp its groups of all of them, so that one
    load of x serves them all - the same sums as one tile a block; ``stages`` (the lanes layout, any width; 0: off):
    each warp streams its weight pieces through a ring of that many steps in shared memory with cp.async, that many
    minus one steps ahead of its arithmetic, instead of ``unroll`` steps into registers - the same sums (defaults for
    these four over 8 rows: :data:`_WIDE`, else :data:`_WIDE_DEFAULT`). ``pieces`` (default: :func:`pieces_pay`
    with the switch on, :func:`set_pieces`): a split launch of at most 8 rows walks its pieces in one block, the
    same bits (True where it cannot is refused; False spreads them over blocks)."""
    lin = getattr(lin, "qmv_weight", None) or lin  # a tiled PackedLinear: its tiles
    if not supports(x, lin):
        raise ValueError(f"qmv: needs CUDA bf16/fp16 x [1..{MAX_ROWS}, K={lin.k}] contiguous and a q8/q5/q4 weight "
                         f"(or a DenseWeight in x's dtype) "
                         f"({import_error() or 'cupy ready'}); got {tuple(x.shape)} {x.dtype} on {x.device}, "
                         f"{lin.fmt}")
    t, n = x.shape[0], lin.n
    if act and n % 16:
        raise ValueError(f"qmv: act needs whole tiles of interleaved gate / up rows (N a multiple of 16), got N={n}")
    if act and out_f32:
        raise ValueError("qmv: out_f32 widens a projection's output; act's silu(gate) * up is stored in x's dtype")
    width = n // 2 if act else n
    dtype = torch.float32 if out_f32 else x.dtype
    if out is None:
        out = torch.empty(t, width, dtype=dtype, device=x.device)
    elif out.shape != (t, width) or out.dtype != dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"qmv: out must be contiguous [{t}, {width}] {dtype} on {x.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    layout = getattr(lin, "layout", 0)  # 0: a PackedLinear's row-major sections
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    even = lin.k == lin.kp and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
    if t * x.stride(0) >= 2 ** 31:  # the column groups' row offsets are int32
        raise ValueError(f"qmv: x too large for one launch ({t} rows of stride {x.stride(0)})")
    build = launch_build(lin.fmt, n, t, layout, _triton.num_sms(dev), unroll=unroll, min_blocks=min_blocks,
                         xlate=xlate, pipe=pipe, warps=warps, tail=tail, tiles=tiles, stages=stages, ng=lin.ng)
    pdl = _triton.pdl_now(x.device) if pdl is None else pdl and _capability(dev) >= (9, 0)
    row_tiles = -(-n // 16)
    whole = act or not _triton.split_k_allowed()  # (the epilogue, or a launch beside others: _triton.single_pass)
    s = 1 if whole else min(splits, MAX_SPLITS) if splits else shape_splits(n, lin.ng, _triton.num_sms(dev), build.warps)
    if _SWITCHES["split_cap"] and not splits:
        s = min(s, _SWITCHES["split_cap"])
    groups_per_split = -(-lin.ng // s)
    s = -(-lin.ng // groups_per_split)
    # a split launch's pieces walked in one block (one column group from registers, a piece a whole number of warp
    # strides): the split's sums without its blocks' reduction
    can_walk = (s > 1 and build.ncol == 1 and build.tiles == 1 and not build.stages and not (xlate or pipe or tail)
                and groups_per_split % build.warps == 0)
    if pieces and not can_walk:
        raise ValueError(f"qmv: pieces walks a split launch (splits {s}) of at most {MAX_T} rows from registers, "
                         f"its pieces whole warp strides ({groups_per_split} groups a piece, {build.warps} warps), "
                         f"without xlate, pipe, tail, tiles or stages")
    walk = can_walk and (pieces if pieces is not None else
                         _SWITCHES["pieces"] and pieces_pay(lin.ng, groups_per_split, build.warps, build.unroll))
    if walk and min_blocks is None:  # registers for the pieces' sums: 128 a thread (8 pieces spill at 80)
        build = walk_build(build)
    # a split-K tile's pieces as one cluster (sm_90+, at most the portable size): their sums added through
    # distributed shared memory, in the workspace's order (the same bits)
    cluster = (s > 1 and not walk and _SWITCHES["cluster"] and s <= MAX_CLUSTER
               and _capability(dev) >= (9, 0))
    kern = _kernel(_FMT_ID[lin.fmt], x.dtype == torch.float16, even, build.unroll, build.min_blocks, xlate, pipe,
                   fold, pdl, layout, act, build.warps, tail, build.ncol, build.tiles, dev, _SWITCHES["pdl_x_l1"],
                   build.stages, build.shared, out_f32, cluster, s if walk else 1)
    ws, counters = workspace(x.device, s * t * n, row_tiles) if s > 1 and not (cluster or walk) else (out, out)
    grid = (-(-row_tiles // build.tiles), 1 if walk else s)  # a block takes build.tiles row tiles
    stream = torch.cuda.current_stream(x.device)
    # the kernel's parameters in order: 7 pointers, 5 int32, 5 int64
    ptrs = (x.data_ptr(), lin.codes.data_ptr(), lin.high.data_ptr(), lin.scales.data_ptr(), out.data_ptr(),
            ws.data_ptr(), counters.data_ptr())
    ints = (t, n, lin.k, lin.ng, groups_per_split)
    longs = (x.stride(0), out.stride(0), lin.codes.stride(0), lin.high.stride(0), lin.scales.stride(0))
    if pdl or cluster:
        cargs = (*map(ctypes.c_uint64, ptrs), *map(ctypes.c_int32, ints), *map(ctypes.c_int64, longs))
        with torch.cuda.device(dev):  # the module was loaded in this device's context
            _launch_ex(kern, grid, build.threads, cargs, stream.cuda_stream, build.shared, pdl=pdl,
                       cluster_y=s if cluster else 0)
        return out
    import cupy

    args = (*map(np.uint64, ptrs), *map(np.int32, ints), *map(np.int64, longs))
    with cupy.cuda.Device(dev):
        kern(grid, (build.threads,), args, stream=_cupy.stream(stream, dev), shared_mem=build.shared)
    return out


def qmv_rows(x: torch.Tensor, lin, act: bool = False, rows: int | None = None, **launch) -> torch.Tensor:
    """:func:`qmv` for any number of rows, ``rows`` (default ``MAX_ROWS``; 8 is a launch a column group, the weight
    read once per 8 rows) a launch (``launch``: more :func:`qmv` keywords): each row's result does not depend on the
    others or on the launch width (the caller checks :func:`supports` on the first rows)."""
    step = min(rows or MAX_ROWS, MAX_ROWS)
    if x.shape[0] <= step:
        return qmv(x, lin, act=act, **launch)
    return torch.cat([qmv(x[i:i + step], lin, act=act, **launch) for i in range(0, x.shape[0], step)])
