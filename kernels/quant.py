"""Weight formats: fp32, bf16 and symmetric group-quantized q8/q5/q4 with one fp16 scale per group along K.

Quantization (docs/DESIGN.md, "Artifact formats"): for each row n and group g of ``group`` consecutive K values,
``scale = fp16(amax / qmax)`` (a zero scale becomes the smallest positive fp16),
``q = clamp(round_half_even(x / scale), -qmax, qmax)`` and ``w = scale * q``.

Packing (one contiguous byte buffer per tensor; K is padded with zeros up to a multiple of the group,
``Kp``; every section is row-major so that a program owning a tile of rows reads each row's bytes as one
contiguous, coalesced run):

===============  =====================================================================================
``q8_g32_fp16``  codes ``int8 [N, Kp]`` | scales ``fp16 [N, Kp/32]``
``q4_g64_fp16``  nibbles ``uint8 [N, Kp/2]``, byte j = (q[2j]+8) | (q[2j+1]+8) << 4
                 | scales ``fp16 [N, Kp/64]``
``q5_g64_fp16``  low nibbles ``uint8 [N, Kp/2]`` of u = q + 16 (same pairing as q4)
                 | high bits ``uint8 [N, Kp/8]``, bit b of byte j = bit 4 of u[8j+b]
                 | scales ``fp16 [N, Kp/64]``
===============  =====================================================================================

The sections follow each other in the order listed, each starting at a multiple of 16 bytes. Tensors
of more than two dimensions are quantized as ``[prod(shape[:-1]), shape[-1]]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FLOAT_FORMATS = ("fp32", "bf16")
QUANT_FORMATS = ("q8_g32_fp16", "q5_g64_fp16", "q4_g64_fp16")
QUANT_SHORT = {"q8": "q8_g32_fp16", "q5": "q5_g64_fp16", "q4": "q4_g64_fp16"}  # short name -> format (tools, knobs)
FORMATS = FLOAT_FORMATS + QUANT_FORMATS
# format -> (group size, qmax, code minimum)
QSPEC = {"q8_g32_fp16": (32, 127, -127), "q5_g64_fp16": (64, 15, -16), "q4_g64_fp16": (64, 7, -8)}
FP16_TINY = float(np.finfo(np.float16).smallest_subnormal)
_ALIGN = 16


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True, slots=True)
class QLayout:
    """Byte offsets of the sections of a packed quantized [N, K] tensor."""

    n: int
    k: int
    kp: int
    group: int
    codes: tuple[int, int]  # (offset, bytes)
    high: tuple[int, int]  # q5 only; (0, 0) otherwise
    scales: tuple[int, int]
    nbytes: int


def qlayout(fmt: str, shape: tuple[int, ...]) -> QLayout:
    """Where each section of ``fmt`` for a tensor of ``shape`` lies in its byte buffer."""
    if fmt not in QSPEC:
        raise ValueError(f"not a quantized format: {fmt!r}")
    if len(shape) < 2:
        raise ValueError(f"quantized formats need a tensor of >= 2 dims, got shape {tuple(shape)}")
    group = QSPEC[fmt][0]
    n = int(np.prod(shape[:-1]))
    k = int(shape[-1])
    kp = (k + group - 1) // group * group
    code_bytes = {"q8_g32_fp16": n * kp, "q5_g64_fp16": n * kp // 2, "q4_g64_fp16": n * kp // 2}[fmt]
    high_bytes = n * kp // 8 if fmt == "q5_g64_fp16" else 0
    scale_bytes = n * (kp // group) * 2
    off = 0
    codes = (off, code_bytes)
    off = _align(off + code_bytes)
    high = (off, high_bytes) if high_bytes else (0, 0)
    off = _align(off + high_bytes) if high_bytes else off
    scales = (off, scale_bytes)
    return QLayout(n, k, kp, group, codes, high, scales, off + scale_bytes)


def nbytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Size in bytes of a tensor of ``shape`` stored in ``fmt``."""
    if fmt == "fp32":
        return int(np.prod(shape)) * 4
    if fmt == "bf16":
        return int(np.prod(shape)) * 2
    return qlayout(fmt, shape).nbytes


def quantize_codes(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group quantization of ``w [N, K]``: (codes int8 [N, Kp], scales fp16 [N, Kp/group])."""
    group, qmax, _ = QSPEC[fmt]
    w = w.detach().to(torch.float32).reshape(-1, w.shape[-1])
    n, k = w.shape
    kp = (k + group - 1) // group * group
    if kp != k:
        w = torch.nn.functional.pad(w, (0, kp - k))
    g = w.reshape(n, kp // group, group)
    # a tensor divisor, not a Python number: CUDA turns division by a host scalar into multiplication by its
    # reciprocal, which rounds differently; a tensor divides exactly on every device, so packing on the GPU gives
    # the CPU's bytes
    scale = (g.abs().amax(-1) / torch.tensor(float(qmax), device=w.device)).to(torch.float16)
    scale = torch.where(scale == 0, torch.full_like(scale, FP16_TINY), scale)
    # torch.round rounds half to even, as the format asks.
    q = torch.round(g / scale.to(torch.float32)[..., None]).clamp_(-qmax, qmax).to(torch.int8)
    return q.reshape(n, kp), scale


def pack(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """``w`` in ``fmt`` as a flat uint8 tensor (see the module docstring for the layout)."""
    if fmt == "fp32":
        return w.detach().to(torch.float32).contiguous().reshape(-1).view(torch.uint8).clone()
    if fmt == "bf16":
        return w.detach().to(torch.bfloat16).contiguous().reshape(-1).view(torch.uint8).clone()
    if fmt not in QSPEC:
        raise ValueError(f"unknown weight format {fmt!r} (known: {', '.join(FORMATS)})")
    lay = qlayout(fmt, tuple(w.shape))
    q, scale = quantize_codes(w, fmt)
    out = torch.zeros(lay.nbytes, dtype=torch.uint8, device=w.device)
    if fmt == "q8_g32_fp16":
        codes = q.view(torch.uint8).reshape(-1)
    else:
        u = (q.to(torch.int16) - QSPEC[fmt][2]).to(torch.uint8)  # q - min: [0, 2^bits)
        lo = u & 0x0F
        codes = (lo[:, 0::2] | (lo[:, 1::2] << 4)).reshape(-1)
        if fmt == "q5_g64_fp16":
            hb = ((u >> 4) & 1).reshape(lay.n, lay.kp // 8, 8)
            weights = (1 << torch.arange(8, dtype=torch.int32, device=w.device))
            high = (hb.to(torch.int32) * weights).sum(-1).to(torch.uint8).reshape(-1)
            out[lay.high[0]:lay.high[0] + lay.high[1]] = high
    out[lay.codes[0]:lay.codes[0] + lay.codes[1]] = codes
    out[lay.scales[0]:lay.scales[0] + lay.scales[1]] = scale.contiguous().reshape(-1).view(torch.uint8)
    return out


def rows_per_block(shape: tuple[int, ...], budget_bytes: int) -> int:
    """How many rows (of the first dimension) of a tensor of ``shape`` fit ``budget_bytes`` in fp32 (at least 1)."""
    row = 4 * int(np.prod(shape[1:])) if len(shape) > 1 else 4
    return max(1, budget_bytes // row)


def pack_blocks(blocks, fmt: str, shape: tuple[int, ...]):
    """:func:`pack` of a tensor given as consecutive row blocks (``blocks`` yields ``w[r0:r1]`` in order), as
    uint8 chunks in the packed buffer's byte order: their concatenation is ``pack(w, fmt)``, while only one block
    (and, for quantized formats, the ``high`` and ``scales`` sections, 1/10 of the codes or less) is held at a time.
    Rows are independent in every format, so a block packs exactly as the same rows of the whole tensor."""
    if fmt in FLOAT_FORMATS:
        for b in blocks:
            yield pack(b, fmt)
        return
    if fmt not in QSPEC:
        raise ValueError(f"unknown weight format {fmt!r} (known: {', '.join(FORMATS)})")
    lay = qlayout(fmt, tuple(shape))
    rows, done, tails = int(np.prod(shape[:-1])), 0, {"high": [], "scales": []}
    for b in blocks:
        part = b.reshape(-1, lay.k)
        sec = sections(pack(part, fmt), fmt, (part.shape[0], lay.k))
        yield sec["codes"].reshape(-1).view(torch.uint8)
        for name in tails:
            if name in sec:
                tails[name].append(sec[name].reshape(-1).view(torch.uint8).cpu())
        done += part.shape[0]
    if done != rows:
        raise ValueError(f"pack_blocks: blocks gave {done} rows, the shape {tuple(shape)} has {rows}")
    end = lay.codes[1]
    for name, (offset, length) in (("high", lay.high), ("scales", lay.scales)):
        if not length:
            continue
        yield torch.zeros(offset - end, dtype=torch.uint8)  # the 16-byte alignment between sections
        yield from tails[name]
        end = offset + length


def sections(buf: torch.Tensor, fmt: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Row-major typed views of a packed buffer: ``codes`` (int8 [N, Kp] for q8, uint8 [N, Kp/2] nibbles
    otherwise), ``high`` (uint8 [N, Kp/8], q5 only) and ``scales`` (fp16 [N, Kp/group]). No copies, so
    a row subset (``v[rows]`` for every view) can be unpacked with :func:`unpack_sections`."""
    lay = qlayout(fmt, shape)
    if buf.numel() < lay.nbytes:
        raise ValueError(f"{fmt} buffer for shape {tuple(shape)} needs {lay.nbytes} bytes, got {buf.numel()}")
    buf = buf.reshape(-1)
    out = {}
    codes = buf[lay.codes[0]:lay.codes[0] + lay.codes[1]]
    if fmt == "q8_g32_fp16":
        out["codes"] = codes.view(torch.int8).reshape(lay.n, lay.kp)
    else:
        out["codes"] = codes.reshape(lay.n, lay.kp // 2)
    if fmt == "q5_g64_fp16":
        out["high"] = buf[lay.high[0]:lay.high[0] + lay.high[1]].reshape(lay.n, lay.kp // 8)
    out["scales"] = buf[lay.scales[0]:lay.scales[0] + lay.scales[1]].view(torch.float16).reshape(
        lay.n, lay.kp // lay.group)
    return out


def unpack_sections(sec: dict[str, torch.Tensor], fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [n, Kp], scales fp16 [n, Kp/group]) from :func:`sections` views (or a row subset)."""
    codes, scales = sec["codes"], sec["scales"]
    if fmt == "q8_g32_fp16":
        return codes, scales
    n = codes.shape[0]
    kp = codes.shape[1] * 2
    u = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(n, kp).to(torch.int16)
    if fmt == "q5_g64_fp16":
        high = sec["high"].reshape(n, kp // 8, 1).to(torch.int16)
        bits = (high >> torch.arange(8, dtype=torch.int16, device=high.device)) & 1
        u = u | (bits.reshape(n, kp) << 4)
    return (u + QSPEC[fmt][2]).to(torch.int8), scales


def dequantize_rows(sec: dict[str, torch.Tensor], fmt: str, k: int, dtype=torch.float32) -> torch.Tensor:
    """Dequantize packed rows given as :func:`sections` views (or a row subset): ``[n, k]`` in ``dtype``."""
    q, scale = unpack_sections(sec, fmt)
    n, kp = q.shape
    group = QSPEC[fmt][0]
    w = q.to(torch.float32).reshape(n, kp // group, group) * scale.to(torch.float32)[..., None]
    return w.reshape(n, kp)[:, :k].to(dtype)


def concat_rows(bufs: list[torch.Tensor], fmt: str, shapes: list[tuple[int, int]]) -> torch.Tensor:
    """Pack of ``cat([W_0, W_1, ...], dim=0)`` from the packs of each ``W_i`` (same K), bytes unchanged."""
    ks = {s[-1] for s in shapes}
    if len(ks) != 1:
        raise ValueError(f"concat_rows needs one K, got shapes {shapes}")
    if fmt in FLOAT_FORMATS:
        return torch.cat([b.reshape(-1) for b in bufs])
    total = (sum(s[0] for s in shapes), ks.pop())
    lay = qlayout(fmt, total)
    out = torch.zeros(lay.nbytes, dtype=torch.uint8, device=bufs[0].device)
    outsec = sections(out, fmt, total)
    row = 0
    for b, s in zip(bufs, shapes):
        for name, view in sections(b, fmt, s).items():
            outsec[name][row:row + s[0]] = view
        row += s[0]
    return out


def take_rows(buf: torch.Tensor, fmt: str, shape: tuple[int, int], rows: torch.Tensor) -> torch.Tensor:
    """Pack of ``W[rows]`` from the pack of ``W`` (any format), bytes unchanged."""
    n, k = shape
    if fmt in FLOAT_FORMATS:
        return buf.reshape(n, -1)[rows].reshape(-1)
    return pack_sections({name: view[rows] for name, view in sections(buf, fmt, shape).items()}, fmt, k)


def pack_sections(sec: dict[str, torch.Tensor], fmt: str, k: int) -> torch.Tensor:
    """A packed buffer from :func:`sections`-shaped views (e.g. a row subset), bytes unchanged."""
    n = sec["codes"].shape[0]
    out = torch.zeros(nbytes(fmt, (n, k)), dtype=torch.uint8, device=sec["codes"].device)
    for name, view in sections(out, fmt, (n, k)).items():
        view.copy_(sec[name])
    return out


def unpack_codes(buf: torch.Tensor, fmt: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of the packing: (codes int8 [N, Kp], scales fp16 [N, Kp/group]) from a uint8 buffer."""
    return unpack_sections(sections(buf.contiguous(), fmt, shape), fmt)


def dequantize(buf: torch.Tensor, fmt: str, shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    """The tensor stored in ``buf`` (flat uint8) as ``dtype`` of ``shape``."""
    shape = tuple(int(s) for s in shape)
    if fmt == "fp32":
        return buf.reshape(-1).contiguous().view(torch.float32).reshape(shape).to(dtype)
    if fmt == "bf16":
        return buf.reshape(-1).contiguous().view(torch.bfloat16).reshape(shape).to(dtype)
    if fmt not in QSPEC:
        raise ValueError(f"unknown weight format {fmt!r} (known: {', '.join(FORMATS)})")
    return dequantize_rows(sections(buf.contiguous(), fmt, shape), fmt, shape[-1], dtype).reshape(shape)


def nonfinite(buf: torch.Tensor, fmt: str, shape: tuple[int, ...], chunk: int = 1 << 24) -> int:
    """How many of the floats stored in ``buf`` (flat uint8, 4-byte aligned) are NaN or inf: the values of fp32 /
    bf16, the scales of a quantized format (its codes are integers: a weight is finite when its group's scale is)."""
    if fmt in QSPEC:
        vals = sections(buf, fmt, shape)["scales"].reshape(-1)
    elif fmt in FLOAT_FORMATS:
        vals = buf.reshape(-1).view(torch.float32 if fmt == "fp32" else torch.bfloat16)
    else:
        raise ValueError(f"unknown weight format {fmt!r} (known: {', '.join(FORMATS)})")
    return sum(int(part.numel() - torch.isfinite(part).sum()) for part in torch.split(vals, chunk))


def error_bound(fmt: str) -> float:
    """Worst-case |w - dequant(w)| relative to the group's amax: half a quantization step plus the fp16
    rounding of the scale. Holds while the scale is a normal fp16 (amax / qmax >= 2**-14); below that the
    scale is subnormal and rounds by up to 2**-25 absolute, see :func:`abs_error_floor`."""
    if fmt == "fp32":
        return 0.0
    if fmt == "bf16":
        return 2.0 ** -8
    qmax = QSPEC[fmt][1]
    return 0.5 / qmax + 2.0 ** -10


def abs_error_floor(fmt: str) -> float:
    """Absolute error a subnormal fp16 scale can add (qmax * half the subnormal spacing), for tiny groups."""
    return QSPEC[fmt][1] * 2.0 ** -25 if fmt in QSPEC else 0.0
