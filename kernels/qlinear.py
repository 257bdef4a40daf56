"""Quantized projections ``y = x @ W.T`` straight from the packed formats of ``kernels/quant.py``.

Shapes: x ``[T, K]``, W ``[N, K]`` stored as ``quant.pack(W, fmt)`` (flat uint8), y ``[T, N]``.
``fmt`` is one of ``q8_g32_fp16``, ``q5_g64_fp16``, ``q4_g64_fp16``; the byte layout is fixed in
``kernels/quant.py`` and read here as it is: each group (32 values for q8, 64 for q5/q4) of a row is 32
contiguous code bytes (8 32-bit words), plus 8 high-bit bytes for q5, plus one fp16 scale.

  qlinear_ref      plain fp32 reference: x @ dequantize(buf).T
  qlinear_triton   fused dequantize-and-multiply Triton kernels for the decode / verify widths
  qlinear_dequant  the packed weight as a dense [N, K] tensor, on the device (Triton)
  PackedLinear     a packed weight placed on a device, callable on x [..., K]

The Triton kernels themselves are in ``kernels/qlinear_triton.py``.

At these widths the product is a GEMV: each weight byte is read once, so the time to beat is packed bytes
over bandwidth, and the arithmetic per weight must stay at a few instructions to keep up with it. Codes
become floats by bit assembly (a code placed in the mantissa of 128.0f / 256.0f, or of 128.0 in bf16 /
1024.0 in fp16, is that float plus the code), never by int->float conversion instructions, which run at a
quarter of the FMA rate. Two kernels (``QConfig.kind``):

  "gemv"  T = 1, CUDA cores: codes read as 32-bit words, one shift + one lop3 + one FMA per weight, the
          fp16 group scales and the float offset applied once per word (_gemv_kernel).
  "dot"   T >= 2, tensor cores: ``tl.dot`` with the weight tile as the left operand ("swap AB") and x^T
          padded to 16+ columns; the operand is q * scale rounded to x's dtype, as a dense dequantized
          weight would hold it (_dot_kernel).

When N / BLOCK_N programs are too few to fill the GPU, K is split over several programs whose fp32 sums
meet in a shared workspace, and the last program of each tile writes the output: one launch (_epilogue).
The launch configuration is a pure function of (fmt, N, K, T) (``choose_config``): no autotuning, so the
first call only compiles, nothing is timed or synchronised, and later calls are safe to capture in a
CUDA graph. Triton is imported on first use, so this module imports (and the CPU fallback runs) without it.

On CUDA with bf16 / fp16 x the engine runs ``kernels/qmv_cuda.cu`` instead (tensor cores, up to 64 rows a
launch, deterministic, T = 8 at the cost of T = 1) whenever cupy imports: these Triton kernels serve fp32 x and
machines without cupy. Their dot kernel (T >= 2) has returned wrong sums now and then on the GPU (see
``_dot_kernel``). How fast each is at the 27B shapes: ``docs/perf/README.md``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import _triton, qmv_cuda, quant
from .qlinear_triton import kernels as _kernels

__all__ = ["qlinear_ref", "qlinear_triton", "qlinear_dequant", "PackedLinear", "QConfig", "choose_config",
           "MAX_KERNEL_ROWS"]

# Rows of x up to which PackedLinear uses the fused kernels; wider inputs (prefill) use a dense weight.
MAX_KERNEL_ROWS = 64
_FMT_ID = {"q8_g32_fp16": 0, "q5_g64_fp16": 1, "q4_g64_fp16": 2}

def qlinear_ref(x: torch.Tensor, buf: torch.Tensor, fmt: str, shape: tuple[int, int]) -> torch.Tensor:
    """fp32 reference: ``x [T, K]`` (any float dtype) @ ``dequantize(buf, fmt, shape).T`` -> ``[T, N]`` fp32."""
    w = quant.dequantize(buf.reshape(-1).cpu(), fmt, shape)  # [N, K] fp32
    return x.detach().cpu().to(torch.float32) @ w.T


triton_available = _triton.available


# ---------------------------------------------------------------------------------------------------
# Launch configuration


@dataclass(frozen=True, slots=True)
class QConfig:
    """Launch parameters of the fused kernels.

    kind: "gemv" (CUDA cores, one row of x per program) or "dot" (tensor cores, block_t rows of x per
    program). block_n: weight rows per program. gps: groups per loop step. split_k: programs sharing one
    row tile's K (summed in-kernel, see _epilogue). num_stages: Triton's software pipelining; keep 1 for
    "dot" -- with 2+ the x tile reaches the wgmma through cp.async without a fence.proxy.async in the
    code triton 3.6 generates, and an H200 returned wrong sums now and then (see _dot_kernel).
    """

    kind: str
    block_n: int
    gps: int = 2
    split_k: int = 1
    block_t: int = 16
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        if self.kind not in ("gemv", "dot"):
            raise ValueError(f"QConfig.kind must be 'gemv' or 'dot', got {self.kind!r}")
        for name in ("block_n", "block_t", "gps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"QConfig.{name} must be a power of two, got {v}")
        if self.split_k < 1:
            raise ValueError(f"QConfig.split_k must be >= 1, got {self.split_k}")
        if self.kind == "dot" and (self.block_n < 16 or self.block_t < 16):
            raise ValueError(f"QConfig: the dot kernel needs block_n and block_t >= 16, got {self.block_n}, "
                             f"{self.block_t}")


# Programs to aim for: several per SM of an H200 (132 SMs). A program has about one loop step of weights
# in flight, so DRAM latency is covered only with many resident programs.
_TARGET_PROGRAMS = 6 * 132


def _split_for(tiles: int, ng: int, gps: int, target: int = _TARGET_PROGRAMS) -> int:
    """K splits so that tiles * split reaches ``target`` programs, each with at least one loop step."""
    return max(1, min(-(-target // tiles), ng // gps))


def choose_config(fmt: str, n: int, k: int, t: int) -> QConfig:
    """The launch configuration for x [t, k] @ W[n, k].T in fmt: a pure function of the shapes.

    From scripts/bench_qlinear.py --variants on an H200 (CUDA-graph replays, weights not in L2): the gemv
    with 128 rows x 4 groups a step for T = 1; the dot kernel with 128 rows x 2 groups a step for T >= 2;
    K split to ~6 programs per SM in both. The dot kernel runs unpipelined (num_stages=1; see QConfig).
    """
    ng = quant.qlayout(fmt, (n, k)).kp // quant.QSPEC[fmt][0]
    if t == 1:
        return QConfig("gemv", 128, gps=4, split_k=_split_for(-(-n // 128), ng, 4))
    block_t = min(64, max(16, _next_pow2(t)))
    return QConfig("dot", 128, gps=2, block_t=block_t, split_k=_split_for(-(-n // 128) * -(-t // block_t), ng, 2))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ---------------------------------------------------------------------------------------------------
# Launches


def qlinear_triton(x: torch.Tensor, lin: PackedLinear, config: QConfig | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused dequantize-and-multiply: ``x [T, K]`` contiguous (bf16/fp16/fp32) -> ``[T, N]`` in x.dtype.

    ``config`` overrides ``choose_config``; ``out`` (contiguous [T, N], x.dtype) is written instead of a
    fresh tensor. One kernel launch, no host synchronisation, no allocation but ``out``: safe to capture in
    a CUDA graph once a first call for the shape (which compiles the kernel) has run outside the capture.
    """
    gemv_kernel, dot_kernel, _, _ = _kernels()
    if x.dim() != 2 or x.shape[1] != lin.k:
        raise ValueError(f"qlinear_triton: x must be [T, K={lin.k}], got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("qlinear_triton: x must be contiguous")
    t = x.shape[0]
    if out is not None and (out.shape != (t, lin.n) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"qlinear_triton: out must be contiguous [{t}, {lin.n}] {x.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    cfg = config or choose_config(lin.fmt, lin.n, lin.k, t)
    if not _triton.split_k_allowed():  # a launch that may run beside others on another stream (see _triton.single_pass)
        cfg = dataclasses.replace(cfg, split_k=1)
    groups_per_split = _cdiv(_cdiv(lin.ng, cfg.split_k), cfg.gps) * cfg.gps
    if out is None:
        out = torch.empty(t, lin.n, dtype=x.dtype, device=x.device)
    n_tiles, k_tiles = _cdiv(lin.n, cfg.block_n), _cdiv(lin.ng, groups_per_split)
    t_tiles = t if cfg.kind == "gemv" else _cdiv(t, cfg.block_t)
    ws, counters = _workspace(x.device, k_tiles * t, lin.n, n_tiles * t_tiles) if k_tiles > 1 else (out, out)
    fmt_id = _FMT_ID[lin.fmt]
    common = dict(FMT=fmt_id, BLOCK_N=cfg.block_n, GPS=cfg.gps, GPU=x.is_cuda, SPLIT_K=k_tiles,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.kind == "gemv":
        magic = 0x43C00000 if fmt_id == 0 else 0x43000000  # see _word_codes
        gemv_kernel[(n_tiles, k_tiles, t)](
            x, lin.words, lin.high, lin.scales, out, ws, counters, lin.n, lin.k, lin.ng, groups_per_split, magic,
            x.stride(0), out.stride(0), lin.words.stride(0), lin.high.stride(0), lin.scales.stride(0),
            EVEN_K=lin.k == lin.kp, **common)
    else:
        dot_kernel[(n_tiles, k_tiles, t_tiles)](
            x, lin.codes, lin.high, lin.scales, out, ws, counters, t, lin.n, lin.k, lin.ng, groups_per_split,
            x.stride(0), out.stride(0), lin.codes.stride(0), lin.high.stride(0), lin.scales.stride(0),
            BLOCK_T=cfg.block_t, **common)
    return out


# Split-K scratch, one per device: fp32 [splits, rows, N] partial sums (overwritten by every launch) and per-tile
# arrival counters (left at zero by every launch: the last program of each tile clears its own). Kernels on one
# stream run one after the other, so they share it; two split-K launches running at once on different streams
# must not.
_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device, rows: int, n: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's split-K scratch, grown (zeroed) to at least rows * n floats (rows: x's rows times the K
    splits) and ``tiles`` counters.

    Growing allocates, so it must not happen inside a CUDA-graph capture: PackedLinear reserves
    :func:`scratch_rows` x N when it is built.
    """
    return _triton.split_k_scratch(_WORKSPACES, device, rows * n, tiles, "qlinear")


@functools.cache  # a model has a handful of shapes and many weights of each
def scratch_rows(fmt: str, n: int, k: int) -> int:
    """The most split-K workspace rows (K splits x rows of x) a launch of :func:`choose_config` takes for a
    ``[n, k]`` weight, over every width up to MAX_KERNEL_ROWS."""
    return max(choose_config(fmt, n, k, t).split_k * t for t in range(1, MAX_KERNEL_ROWS + 1))


LANES_GROUPS = 4  # groups a program of the lanes dequantization (16 rows x 4 x 64 codes)


def qlinear_dequant(lin, dtype: torch.dtype = torch.bfloat16, *, word_reads: bool = True) -> torch.Tensor:
    """The packed weight as a dense ``[N, K]`` tensor of ``dtype`` on its device (Triton kernel): ``lin`` a
    row-major :class:`PackedLinear` or a :class:`kernels.qmv_cuda.TiledWeight` (tiled or lanes layout), read in
    place (no row-major copy). The lanes layout (the engine's on CUDA) is read a tile's code words at a time
    (``word_reads``; False: the general kernel's byte gathers, the same bits)."""
    _, _, kernel, lanes_kernel = _kernels()
    layout = getattr(lin, "layout", 0)  # 0: a PackedLinear's row-major sections
    w = torch.empty(lin.n, lin.k, dtype=dtype, device=lin.codes.device)
    if layout == 2 and word_reads:
        words = lin.codes.reshape(-1).view(torch.int32)  # [tiles * NG * 128]
        lanes_kernel[(_cdiv(lin.n, 16), _cdiv(lin.ng, LANES_GROUPS))](
            words, lin.high, lin.scales, w, lin.n, lin.k, lin.ng, w.stride(0), FMT=_FMT_ID[lin.fmt],
            GPS=LANES_GROUPS)
        return w
    block_n = 64
    kernel[(_cdiv(lin.n, block_n), lin.ng)](
        lin.codes, lin.high, lin.scales, w, lin.n, lin.k, lin.ng,
        lin.codes.stride(0), lin.high.stride(0), lin.scales.stride(0), w.stride(0),
        FMT=_FMT_ID[lin.fmt], BLOCK_N=block_n, TILED=layout)
    return w


class PackedLinear:
    """A quantized weight W [N, K] placed on a device, ready for the fused kernel.

    Holds the packed uint8 buffer on ``device`` and typed views of its sections, made once here so a
    call only passes pointers: ``codes`` uint8 [N, code bytes per row] (and ``words``, the same bytes as
    int32), ``high`` uint8 [N, Kp/8] (q5; a 1-byte placeholder otherwise), ``scales`` fp16 [N, Kp/group].
    On CUDA it also reserves the shared split-K workspace for the widest launch (see scratch_rows).
    ``layout="tiled"`` or ``"lanes"`` (on CUDA with qmv; the engine's choice for bf16/fp16 models) keeps only qmv's
    tile-contiguous copy (``qmv_weight``, :class:`kernels.qmv_cuda.TiledWeight`: 1.1-1.3x faster at the 27B shapes
    on the H200; lanes a further 1.04-1.2x) and drops the row-major sections, so the weight costs no more memory.
    The prefill dequantization reads either layout in place; the Triton GEMV kernels get a transient row-major
    copy from :meth:`row_major`.

    ``lin(x)`` with x [..., K]: on CUDA with at most MAX_KERNEL_ROWS rows, bf16/fp16 x goes to the tensor-core
    kernel of ``kernels/qmv_cuda.cu`` (up to ``qmv_cuda.MAX_ROWS`` rows a launch) when cupy imports, fp32 x (or no
    cupy) to the Triton kernels here. Otherwise
    (prefill widths, or a CPU) a dense weight and F.linear: with ``dense_fallback=True`` (default) the
    dense weight is made once per dtype and cached, which costs 2 bytes per weight on top of the packed
    ~0.6 (q4) - the quantization's memory saving is gone for any layer that ever takes that path; with
    ``dense_fallback=False`` it is dequantized on every such call (no memory kept, a dequant pass per call).
    """

    def __init__(self, buf: torch.Tensor, fmt: str, shape: tuple[int, int], device, *, dense_fallback: bool = True,
                 layout: str = "rows"):
        if fmt not in _FMT_ID:
            raise ValueError(f"PackedLinear: fmt must be one of {tuple(_FMT_ID)}, got {fmt!r}")
        if layout not in ("rows", "tiled", "lanes"):
            raise ValueError(f"PackedLinear: layout must be rows, tiled or lanes, got {layout!r}")
        if len(shape) != 2:
            raise ValueError(f"PackedLinear: shape must be (N, K), got {tuple(shape)}")
        lay = quant.qlayout(fmt, tuple(int(s) for s in shape))
        if buf.dtype != torch.uint8 or buf.numel() < lay.nbytes:
            raise ValueError(f"PackedLinear: {fmt} buffer for shape {tuple(shape)} must be uint8 with "
                             f">= {lay.nbytes} bytes, got {buf.dtype} with {buf.numel()}")
        self.fmt, self.n, self.k = fmt, lay.n, lay.k
        self.kp, self.group = lay.kp, lay.group
        self.ng = lay.kp // lay.group
        self.device = torch.device(device)
        self.dense_fallback = dense_fallback
        self.buf = buf.reshape(-1)[:lay.nbytes].to(self.device).contiguous()
        if self.buf.data_ptr() % 16:  # a view at an odd offset of a bigger buffer: one aligned copy, so the
            self.buf = self.buf.clone()  # kernels can read it 4 / 8 / 16 bytes at a time

        def section(off_len):
            return self.buf[off_len[0]:off_len[0] + off_len[1]]

        self.codes = section(lay.codes).view(lay.n, -1)  # [N, Kp/2] (q4/q5) or [N, Kp] (q8)
        self.words = self.codes.view(torch.int32)  # the same bytes, 4 at a time: [N, 8 per group]
        self.high = section(lay.high).view(lay.n, -1) if fmt == "q5_g64_fp16" else self.buf[:1].view(1, 1)
        self.scales = section(lay.scales).view(torch.float16).view(lay.n, self.ng)  # [N, Kp/group]
        self._dense: dict[torch.dtype, torch.Tensor] = {}
        self.packed_bytes = self.codes.numel() + self.high.numel() * (fmt == "q5_g64_fp16") + 2 * self.scales.numel()
        self.qmv_weight = None  # the tiled copy qmv reads, when tiled (the row-major sections are then dropped)
        if self.device.type == "cuda":
            _workspace(self.device, scratch_rows(fmt, self.n, self.k), self.n, 1)
            if qmv_cuda.available():
                qmv_cuda.reserve(self.device, self.n, self.ng)
                if layout != "rows":
                    self.qmv_weight = qmv_cuda.TiledWeight(self, lanes=layout == "lanes")
                    self.buf = self.codes = self.words = self.high = self.scales = None

    def row_major(self) -> PackedLinear:
        """This weight with its row-major sections (the Triton kernels' layout): itself, or, when only the tiled
        copy is kept, a transient row-major copy made from it."""
        if self.qmv_weight is None:
            return self
        return PackedLinear(self.qmv_weight.row_major(), self.fmt, (self.n, self.k), self.device, dense_fallback=False)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense [N, K] tensor of dtype on the device (cached if dense_fallback)."""
        w = self._dense.get(dtype)
        if w is not None:
            return w
        if self.device.type == "cuda" and triton_available():
            w = qlinear_dequant(self.qmv_weight or self, dtype)  # a tiled or lanes layout read in place
        else:
            w = quant.dequantize(self.buf.cpu(), self.fmt, (self.n, self.k), dtype).to(self.device)
        if self.dense_fallback:
            self._dense[dtype] = w
        return w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.k:
            raise ValueError(f"PackedLinear: x must be [..., K={self.k}], got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        if x2.is_cuda and x2.shape[0] <= MAX_KERNEL_ROWS and (qmv_cuda.available() or triton_available()):
            x2 = x2.contiguous()
            qw = self.qmv_weight or self
            if qmv_cuda.supports(x2[:qmv_cuda.MAX_T], qw):
                # up to 64 rows a launch, each row's sums those of a one-row launch: results that do not depend on
                # the batch (and are deterministic); the Triton dot kernel (T >= 2) also returned wrong sums now and
                # then on an H200
                y = qmv_cuda.qmv_rows(x2, qw)
            else:
                y = qlinear_triton(x2, self.row_major())
        else:
            y = F.linear(x2, self.dense(x.dtype))
        return y.reshape(*lead, self.n)

    def _qmv_for(self, x2: torch.Tensor):
        """The weight qmv reads for ``x2`` ``[T, K]`` (this one's tiles, or itself) where qmv runs for it: CUDA, at most
        ``MAX_KERNEL_ROWS`` rows, :func:`qmv_cuda.supports`; else None."""
        qw = self.qmv_weight or self
        if x2.is_cuda and x2.shape[0] <= MAX_KERNEL_ROWS and qmv_cuda.supports(x2[:qmv_cuda.MAX_T].contiguous(), qw):
            return qw
        return None

    def fp32(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()``, the same values: where qmv runs, its fp32 store (each value rounded to x's dtype, then
        widened) writes them, with no copy kernel after it (the logits of every decode step)."""
        x2 = x.reshape(-1, self.k)
        qw = self._qmv_for(x2) if x.shape[-1] == self.k else None
        if qw is None:
            return self(x).float()
        return qmv_cuda.qmv_rows(x2.contiguous(), qw, out_f32=True).reshape(*x.shape[:-1], self.n)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` ``[..., N / 2]`` of a gate / up weight whose rows alternate in runs of 8
        (engine/model/weights.py's interleaved gate_up), through qmv's fused epilogue; None where that kernel does not
        run for x (the caller takes the product itself)."""
        x2 = x.reshape(-1, self.k)
        qw = self._qmv_for(x2) if self.n % 16 == 0 else None
        if qw is None:
            return None
        return qmv_cuda.qmv_rows(x2.contiguous(), qw, act=True).reshape(*x.shape[:-1], self.n // 2)
