"""Reading Hugging Face checkpoints: config.json, safetensors (single file or sharded index), HF names.

Accepted layouts: ``Qwen3_5ForCausalLM`` (``model.*``, ``lm_head.weight``, ``mtp.*``),
``Qwen3_5ForConditionalGeneration`` (``model.language_model.*``, ``model.visual.*`` read as ``vision.*``), and
``Qwen3NextForCausalLM`` whose fused ``in_proj_qkvz`` / ``in_proj_ba`` are split here into the
Qwen3.5 names (same rows, reordered; see :func:`split_qwen3_next`). Everything is returned under the
``Qwen3_5ForCausalLM`` names the rest of the engine uses. FP8 checkpoints (Qwen's ``-FP8`` releases,
llm-compressor's FP8 schemes) are read back to the checkpoint's dtype with their scales (:mod:`.fp8`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..model.config import ModelConfig
from ..model.weights import check_text_shapes, text_weight_names
from . import fp8
from .source import TensorSource


class CheckpointError(ValueError):
    """A Hugging Face folder that cannot be read as a model of this family."""


def read_config(folder: Path) -> tuple[dict, ModelConfig]:
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise CheckpointError(f"no such directory: {folder}")
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    try:
        return hf, ModelConfig.from_hf(hf)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def safetensor_files(folder: Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{folder}: shard(s) named in the index are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    return files


def canonical_name(name: str) -> str | None:
    """The Qwen3_5ForCausalLM name of a checkpoint tensor, or None for tensors we do not use."""
    # the vision tower (Qwen3_5ForConditionalGeneration) is kept for the artifact's vision component
    if name.startswith("model.visual."):
        return "vision." + name[len("model.visual."):]
    if name.startswith("visual."):
        return "vision." + name[len("visual."):]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model.model."):
        return "model." + name[len("language_model.model."):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    return name


def _split_fused(t: torch.Tensor, fused: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The Qwen3.5 parts (suffix -> rows) of one fused Qwen3-Next tensor ``in_proj_qkvz`` or ``in_proj_ba``."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    if fused == "qkvz":
        g = t.reshape(hk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = torch.split(g, [dk, dk, r * dv, r * dv], dim=1)
        return {"in_proj_qkv.weight": torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)]),
                "in_proj_z.weight": z.reshape(-1, t.shape[-1])}
    g = t.reshape(hk, 2 * r, -1)
    return {"in_proj_b.weight": g[:, :r].reshape(-1, t.shape[-1]), "in_proj_a.weight": g[:, r:].reshape(-1, t.shape[-1])}


def split_qwen3_next(sources: dict[str, TensorSource], cfg: ModelConfig) -> dict[str, TensorSource]:
    """Turn Qwen3-Next's per-key-head interleaved ``in_proj_qkvz`` / ``in_proj_ba`` into Qwen3.5 rows.

    qkvz rows are grouped per key head: [q (dk), k (dk), v (r*dv), z (r*dv)] with r = Hv/Hk; ba rows per key
    head: [b (r), a (r)]. The Qwen3.5 layout puts all q heads first, then k, then v (conv channel order). Each part
    is a source of its own, which reads the fused tensor whole when asked (the rows it needs are spread through it).
    """
    out = {}
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    for name, src in sources.items():
        fused = "qkvz" if name.endswith("linear_attn.in_proj_qkvz.weight") else \
            "ba" if name.endswith("linear_attn.in_proj_ba.weight") else None
        if fused is None:
            out[name] = src
            continue
        prefix, k = name[: -len(f"in_proj_{fused}.weight")], src.shape[-1]
        rows = {"in_proj_qkv.weight": hk * (2 * dk + r * dv), "in_proj_z.weight": hk * r * dv} if fused == "qkvz" \
            else {"in_proj_b.weight": hk * r, "in_proj_a.weight": hk * r}
        if sum(rows.values()) != src.shape[0]:  # a misshapen fused tensor: left whole for the shape check to name
            out[name] = src
            continue
        for part, n in rows.items():
            out[prefix + part] = TensorSource(
                (n, k), lambda r0, r1, src=src, fused=fused, part=part: _split_fused(src.load(), fused, cfg)[part][r0:r1],
                whole=True)
    return out


class HFCheckpoint:
    """Lazy access to the tensors of a Hugging Face folder, under canonical names."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.hf_config, self.config = read_config(self.folder)
        self.files = safetensor_files(self.folder)
        self.where: dict[str, tuple[Path, str]] = {}
        # from the files' headers: no tensor is read before the writer asks for it
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.stored: dict[str, str] = {}  # safetensors dtype names ("BF16", "F8_E4M3", ...)
        for f in self.files:
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for key in sf.keys():
                        canon = canonical_name(key)
                        if canon is not None:
                            self.where[canon] = (f, key)
                            part = sf.get_slice(key)
                            self.shapes[canon] = tuple(int(d) for d in part.get_shape())
                            self.stored[canon] = part.get_dtype()
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        self.next_fused = self.config.model_type == "qwen3_next"
        try:
            self.fp8 = fp8.fp8_layout(self.hf_config)
        except ValueError as e:
            raise CheckpointError(f"{self.folder}: {e}") from None
        if self.config.mtp_num_hidden_layers and not any(n.startswith("mtp.") for n in self.where):
            # a config that announces MTP layers whose weights were not shipped: run without the head
            self.config.mtp_num_hidden_layers = 0

    def _rows(self, canon: str, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of a stored tensor as the checkpoint stores it; the file is opened for this read only, so
        its mapped pages are let go when the rows are copied out."""
        f, key = self.where[canon]
        with safe_open(str(f), framework="pt") as sf:
            part = sf.get_slice(key)
            return part[r0:r1] if self.shapes[canon] else part[:]

    def source(self, canon: str) -> TensorSource:
        """Tensor ``canon`` read on demand: FP8 weights come back times their scales, in the checkpoint's dtype."""
        shape = self.shapes[canon]
        if self.stored[canon] not in fp8.FP8_STORED:
            return TensorSource(shape, lambda r0, r1: self._rows(canon, r0, r1))
        if self.fp8 is None:
            raise CheckpointError(f"{self.folder}: tensor {canon} is stored in FP8, but config.json declares no "
                                  "quantization_config to scale it with")
        scale = self.fp8.scale_name(canon)
        if scale is None or scale not in self.where:
            raise CheckpointError(f"{self.folder}: FP8 tensor {canon} has no {scale or 'scale'} beside it")
        return TensorSource(shape, lambda r0, r1: self._dequantized(canon, scale, r0, r1))

    def _dequantized(self, canon: str, scale: str, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of an FP8 weight times its scale, in the dtype the checkpoint declares (bf16 for the
        published ones)."""
        try:
            scales = self._rows(scale, 0, self.shapes[scale][0] if self.shapes[scale] else 1)  # small: read whole
            w = fp8.dequantize(self._rows(canon, r0, r1), scales, self.fp8.block, canon, row0=r0,
                               rows=self.shapes[canon][0])
        except ValueError as e:
            raise CheckpointError(f"{self.folder}: {e}") from None
        text = self.hf_config.get("text_config") if isinstance(self.hf_config.get("text_config"), dict) else {}
        declared = next((c.get(k) for c in (self.hf_config, text) for k in ("dtype", "torch_dtype") if c.get(k)), None)
        half = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        return w.to(half[declared]) if declared in half else w

    def _weight_names(self, prefixes: tuple[str, ...]) -> list[str]:
        """The tensors under ``prefixes`` that are weights (not an FP8 checkpoint's scales)."""
        return [n for n in self.where if n.startswith(prefixes) and not (self.fp8 and self.fp8.is_scale(n))]

    def sources(self) -> dict[str, TensorSource]:
        """Every needed text (and MTP) tensor under Qwen3_5ForCausalLM names, read on demand, checked against the
        config's shapes (from the files' headers: no weight is read here)."""
        cfg = self.config
        raw = {n: self.source(n) for n in self._weight_names(("model.", "lm_head.", "mtp."))}
        if self.next_fused:
            raw = split_qwen3_next(raw, cfg)
        needed = text_weight_names(cfg)
        # a decoder-layer tensor the engine would not use is a model feature it does not implement: refused with
        # the missing and misshapen ones, rather than converted into a model that computes something else
        # (buffers such as rotary tables aside)
        checked = {n: tuple(t.shape) for n, t in raw.items()
                   if n in needed or (n.startswith("model.layers.") and not n.endswith("inv_freq"))}
        try:
            check_text_shapes(cfg, checked, str(self.folder))
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        return {n: raw[n] for n in needed}

    def tensors(self) -> dict[str, torch.Tensor]:
        """:meth:`sources`, read whole (small checkpoints, tests)."""
        return {n: s.load() for n, s in self.sources().items()}

    def vision(self) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """The ``vision`` component (tower config, preprocessing parameters, tensor names) and its ``vision.*``
        tensors, checked against the config; None for a checkpoint without a vision tower."""
        from ..media.decode import PreprocessConfig
        from ..model.vision import VisionConfig, check_preprocess, check_shapes, vision_weight_shapes

        try:
            vcfg = VisionConfig.from_hf(self.hf_config)
            if vcfg is None or not any(n.startswith("vision.") for n in self.where):
                return None  # no tower, or a text-only export of a vision model's config
            image, video = (self._json(n) for n in ("preprocessor_config.json", "video_preprocessor_config.json"))
            # what the processor files leave out of the patch geometry (or a folder without them) is the tower's
            geometry = {"patch_size": vcfg.patch_size, "temporal_patch_size": vcfg.temporal_patch_size,
                        "merge_size": vcfg.spatial_merge_size}
            pre = PreprocessConfig.from_hf({**geometry, **(image or {})}, video)
            check_preprocess(vcfg, pre)
            names = list(vision_weight_shapes(vcfg))
            tensors = {n: self.source(n) for n in names if n in self.where}
            check_shapes(vcfg, {n: tuple(t.shape) for n, t in tensors.items()}, str(self.folder))
        except ValueError as e:
            raise CheckpointError(f"{self.folder}: {e}") from None
        return {"config": vcfg.to_dict(), "preprocess": pre.to_dict(), "tensors": names}, tensors

    def _json(self, name: str) -> dict | None:
        p = self.folder / name
        try:
            return json.loads(p.read_text()) if p.is_file() else None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{p}: not valid JSON ({e})") from None

    def blobs(self) -> dict[str, bytes]:
        """Tokenizer and generation files found in the folder, by file name; each JSON file checked to parse, and the
        tokenizer to load and fit the model's vocabulary (an artifact with a broken one would only fail at use)."""
        from .tokenizer import load_tokenizer_json

        out = {}
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                     "special_tokens_map.json"):
            p = self.folder / name
            if not p.is_file():
                continue
            out[name] = data = p.read_bytes()
            try:
                if name == "tokenizer.json":
                    load_tokenizer_json(data, self.config.vocab_size)
                elif name.endswith(".json"):
                    json.loads(data.decode("utf-8"))
                else:
                    data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CheckpointError(f"{p}: not UTF-8 text (byte {e.start})") from None
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{p}: not valid JSON ({e})") from None
            except ValueError as e:
                raise CheckpointError(f"{p}: {e}") from None
        return out
