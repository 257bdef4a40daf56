"""The tiled weight layouts qmv reads (``TILED`` in ``kernels/qmv_cuda.cu``): a
:class:`kernels.qlinear.PackedLinear`'s row-major sections re-laid 16 rows a tile, optionally with each lane's
pieces side by side and each code word's codes in the MMA's pair order (``lanes``), and back (:meth:`row_major`)."""

from __future__ import annotations

import torch

DENSE_FMT = "dense16"  # a bf16 / fp16 weight read as it is (FMT 3 in the source), see qmv_cuda.DenseWeight


# TILED 2 ("lanes"): each 4-byte code word's codes in the order the MMA pairs them with x's own (k, k + 1) pairs:
# new position p holds old code WORD_ORDER[p] (q4/q5: nibble positions, q5's high bits alike; q8: bytes)
WORD_ORDER = {"q4_g64_fp16": (0, 2, 4, 6, 1, 3, 5, 7), "q5_g64_fp16": (0, 2, 4, 6, 1, 3, 5, 7),
              "q8_g32_fp16": (0, 2, 1, 3)}


def _reorder_codes(codes: torch.Tensor, fmt: str, order) -> torch.Tensor:
    """Each 4-byte word of ``codes [rows, bytes]`` with its codes permuted: new position p <- old ``order[p]``."""
    words = codes.reshape(-1, 4)
    if fmt == "q8_g32_fp16":
        return words[:, list(order)].reshape(codes.shape)
    nib = torch.stack([words & 15, words >> 4], -1).reshape(-1, 8)[:, list(order)]  # position 2 * byte + high
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).reshape(codes.shape)


def _reorder_bits(high: torch.Tensor, order) -> torch.Tensor:
    """Each byte of q5's high bits (bit b = bit 4 of code b of a word) permuted the same way."""
    shifts = torch.arange(8, device=high.device, dtype=torch.uint8)
    bits = ((high[..., None] >> shifts) & 1)[..., list(order)]
    return (bits << shifts).sum(-1, dtype=torch.int32).to(torch.uint8)


def _inverse(order) -> tuple[int, ...]:
    return tuple(sorted(range(len(order)), key=lambda p: order[p]))


class TiledWeight:
    """A weight's sections re-laid for qmv (TILED in the source): for each 16-row tile and group, the tile's 16 rows
    of code bytes in a row (then of scales, and of q5's high bits), so each warp load of a step is one contiguous
    run instead of 8 rows' slices a row stride apart. Rows past N are zero padding. Made from a
    :class:`kernels.qlinear.PackedLinear` or a :class:`kernels.qmv_cuda.DenseWeight` on the GPU (a copy: the
    original stays).

    ``lanes=True`` (TILED 2, q formats; the engine's default): within each (tile, group) every lane's pieces of its
    two rows side by side, so a lane loads its codes, its two scales and its two q5 high-bit pairs with one load
    each, and each code word's codes reordered (:data:`WORD_ORDER`) so the MMA takes x's pairs as they are: 18 %
    fewer instructions in the q4 loop (ptxas), 27B decode step 6.43 -> 6.08 ms GPU busy on the H200."""

    def __init__(self, lin, lanes: bool = False):
        self.fmt, self.n, self.k, self.kp, self.group, self.ng = lin.fmt, lin.n, lin.k, lin.kp, lin.group, lin.ng
        if lanes and lin.fmt not in WORD_ORDER:
            raise ValueError(f"TiledWeight: lanes=True is for the q formats, not {lin.fmt}")
        self.layout = 2 if lanes else 1
        tiles = -(-lin.n // 16)

        def tiled(a: torch.Tensor) -> torch.Tensor:  # [N, NG * per] -> [tiles, NG, 16, per]
            a = a.reshape(lin.n, lin.ng, -1)
            if tiles * 16 != lin.n:
                a = torch.cat([a, a.new_zeros(tiles * 16 - lin.n, *a.shape[1:])])
            return a.view(tiles, 16, lin.ng, -1).transpose(1, 2).contiguous()

        codes, high = lin.codes, lin.high
        if lanes:
            codes = _reorder_codes(codes, lin.fmt, WORD_ORDER[lin.fmt])
            if lin.fmt == "q5_g64_fp16":
                high = _reorder_bits(high, WORD_ORDER[lin.fmt])
        self.codes = tiled(codes)
        self.scales = lin.scales if lin.fmt == DENSE_FMT else tiled(lin.scales)
        self.high = tiled(high) if lin.fmt == "q5_g64_fp16" else lin.high.clone()
        if lin.fmt == DENSE_FMT:
            self.weight = lin.weight
        if lanes:  # [tiles, NG, 16 = (half, g), per = (c, piece)] -> [tiles, NG, g, c, half, piece]
            t, ng = tiles, lin.ng
            self.codes = self.codes.view(t, ng, 2, 8, 4, -1).permute(0, 1, 3, 4, 2, 5).contiguous()
            self.scales = self.scales.view(t, ng, 2, 8).transpose(2, 3).contiguous()
            if lin.fmt == "q5_g64_fp16":
                self.high = self.high.view(t, ng, 2, 8, 4, 2).permute(0, 1, 3, 4, 2, 5).contiguous()

    def row_major(self) -> torch.Tensor:
        """The packed buffer of kernels/quant.py's layout (q formats), rebuilt from the tiles."""
        from . import quant

        lay = quant.qlayout(self.fmt, (self.n, self.k))
        buf = torch.zeros(lay.nbytes, dtype=torch.uint8, device=self.codes.device)
        codes, scales, high = self.codes, self.scales, self.high
        if self.layout == 2:  # back to [tiles, NG, 16, per]
            t, ng = codes.shape[:2]
            codes = codes.permute(0, 1, 4, 2, 3, 5).reshape(t, ng, 16, -1)
            scales = scales.transpose(2, 3).reshape(t, ng, 16, 1)
            if self.fmt == "q5_g64_fp16":
                high = high.permute(0, 1, 4, 2, 3, 5).reshape(t, ng, 16, 8)

        def rows(t: torch.Tensor) -> torch.Tensor:  # [tiles, NG, 16, per] -> [N, NG * per]
            return t.transpose(1, 2).reshape(-1, t.shape[1] * t.shape[3])[:self.n]

        codes = rows(codes)
        if self.layout == 2:
            codes = _reorder_codes(codes, self.fmt, _inverse(WORD_ORDER[self.fmt]))
        parts = [(lay.codes, codes), (lay.scales, rows(scales.view(torch.uint8)))]
        if self.fmt == "q5_g64_fp16":
            high = rows(high)
            if self.layout == 2:
                high = _reorder_bits(high, _inverse(WORD_ORDER[self.fmt]))
            parts.append((lay.high, high))
        for (off, size), part in parts:
            buf[off:off + size] = part.reshape(-1)
        return buf
