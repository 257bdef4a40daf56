"""Checkpoints whose projections ship in FP8: read back to full precision before the converter quantizes them.

Two layouts are published for this family, both ``float8_e4m3fn`` weights with a scale tensor beside each one:

- ``quant_method: "fp8"`` (Qwen's own ``-FP8`` releases, transformers' fine-grained FP8, DeepSeek's layout):
  ``X.weight`` [N, K] and ``X.weight_scale_inv`` [ceil(N / bn), ceil(K / bk)] for ``weight_block_size`` [bn, bk]
  (a single value without one); despite its name the stored value multiplies: ``w = fp8 * scale_inv``.
- ``quant_method: "compressed-tensors"`` with ``format: "float-quantized"`` (llm-compressor's FP8 / FP8_DYNAMIC /
  FP8_BLOCK schemes): ``X.weight`` and ``X.weight_scale`` per tensor [1], per output channel [N, 1] or per block
  (``block_structure`` [bn, bk]); ``w = fp8 * weight_scale``. Static activation and K/V-cache scales
  (``input_scale``, ``activation_scale``, ``k_scale``, ``v_scale``) are dropped: the engine computes activations in
  its own dtype and quantizes its own cache.

Layers left unquantized (``ignore`` / ``modules_to_not_convert``, e.g. lm_head) are plain tensors and pass as they
are. Any other ``quant_method`` (GPTQ, AWQ, bitsandbytes, int-quantized compressed-tensors ...) is refused naming it:
its weights would need that method's own unpacking, so convert from the unquantized checkpoint instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.config import is_int

FP8_STORED = ("F8_E4M3",)  # float8_e4m3fn, as safetensors names it in a file's header
# static activation and K/V cache scales (llm-compressor, Qwen's fp8 layout): not weights, the engine computes its
# activations and quantizes its own cache
DROPPED_SUFFIXES = (".input_scale", ".activation_scale", ".k_scale", ".v_scale")


@dataclass(frozen=True, slots=True)
class FP8Layout:
    """How a checkpoint's FP8 weights are scaled: the scale tensor's name suffix and the block shape, if any."""

    method: str  # "fp8" or "compressed-tensors"
    scale_suffix: str  # ".weight_scale_inv" or ".weight_scale": replaces ".weight" in a weight's name
    block: tuple[int, int] | None  # [bn, bk] of one scale; None: per tensor or per output channel

    def scale_name(self, weight_name: str) -> str | None:
        """The name of ``weight_name``'s scale tensor (None for names that are not ``*.weight``)."""
        if not weight_name.endswith(".weight"):
            return None
        return weight_name[: -len(".weight")] + self.scale_suffix

    def is_scale(self, name: str) -> bool:
        """True for the tensors that only describe other tensors (scales, activation scales)."""
        return name.endswith(self.scale_suffix) or name.endswith(DROPPED_SUFFIXES)


def _block(value, where: str) -> tuple[int, int] | None:
    """A block shape [bn, bk] of ``quantization_config`` (``where`` names its key), None for none."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(is_int(v) and v > 0 for v in value):
        raise ValueError(f"config.json: {where} must be two positive integers [rows, columns], got {value!r}")
    return value[0], value[1]


def _compressed_tensors(qc: dict) -> FP8Layout:
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"config.json: compressed-tensors format {fmt!r} is not supported (only 'float-quantized', "
                         "FP8 weights); convert from the unquantized checkpoint")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError("config.json: compressed-tensors quantization_config has no config_groups")
    blocks = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ValueError(f"config.json: compressed-tensors group {name!r} stores {w.get('num_bits')}-bit "
                             f"{w.get('type')!r} weights; only 8-bit float (FP8) is supported")
        strategy = w.get("strategy", "tensor")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"config.json: compressed-tensors group {name!r} strategy {strategy!r} is not "
                             "supported (tensor, channel or block)")
        blocks.add(_block(w.get("block_structure"), f"group {name!r} block_structure") if strategy == "block"
                   else None)
    if len(blocks) > 1:
        raise ValueError(f"config.json: compressed-tensors groups use different block shapes "
                         f"{sorted(map(str, blocks))}")
    return FP8Layout("compressed-tensors", ".weight_scale", blocks.pop())


def fp8_layout(hf_config: dict) -> FP8Layout | None:
    """The FP8 layout a ``config.json`` declares (its ``quantization_config``, at the top or in ``text_config``),
    None for an unquantized checkpoint; ValueError naming any other quantization."""
    qc = hf_config.get("quantization_config")
    if qc is None and isinstance(hf_config.get("text_config"), dict):
        qc = hf_config["text_config"].get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"config.json: fp8 fmt {fmt!r} is not supported (only e4m3)")
        return FP8Layout("fp8", ".weight_scale_inv", _block(qc.get("weight_block_size"), "weight_block_size"))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"config.json: quantization_config quant_method {method!r} is not supported (FP8 checkpoints "
                     "are: 'fp8', 'compressed-tensors' float-quantized); convert from the unquantized checkpoint")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, name: str, row0: int = 0,
               rows: int | None = None) -> torch.Tensor:
    """``weight`` [n, K] (FP8) times its ``scale`` as fp32: one value, one per row ([N] or [N, 1]), or one per
    [bn, bk] block ([ceil(N / bn), ceil(K / bk)]); ValueError naming ``name`` when the scale fits none of these.
    ``weight`` may be rows ``[row0, row0 + n)`` of a weight of ``rows`` rows (a block read by the converter): the
    scale is the whole weight's, and the rows take their own."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: an FP8 tensor of shape {list(weight.shape)}, expected a 2-D weight")
    n, k = weight.shape
    total = n if rows is None else rows
    w, s = weight.to(torch.float32), scale.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(())
    if block is None and tuple(s.shape) in ((total,), (total, 1)):
        return w * s.reshape(total, 1)[row0:row0 + n]
    if block is not None:
        bn, bk = block
        if tuple(s.shape) == (-(-total // bn), -(-k // bk)):
            first = row0 // bn
            mine = s[first:-(-(row0 + n) // bn)]  # the block rows these weight rows fall in
            full = mine.repeat_interleave(bn, 0)[row0 - first * bn:row0 - first * bn + n].repeat_interleave(bk, 1)
            return w * full[:, :k]
    want = f"one per [{block[0]}, {block[1]}] block: {[-(-total // block[0]), -(-k // block[1])]}" if block \
        else f"[1] or one per row [{total}, 1]"
    raise ValueError(f"{name}: scale of shape {list(s.shape)} does not fit the weight {[total, k]} ({want})")
