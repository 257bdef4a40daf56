"""Hugging Face folder -> ninfer artifact, with a quantization policy per tensor class.

Policies: ``fp32``, ``bf16``, ``q8``, ``q5``, ``q4`` put every 2-D projection (embeddings and lm_head
included) in that format; ``mixed`` (docs/DESIGN.md, "Artifact formats"): attention projections (and the MTP fc)
q5, MLP and
GDN projections q4, embeddings / lm_head q8, the tiny GDN ``in_proj_b``/``in_proj_a`` (Hv rows each, and
they set the decay and write strength of the recurrence) bf16. Norm weights, ``A_log``, ``dt_bias`` and conv
kernels are always fp32. A vision tower becomes the ``vision`` component (see :func:`vision_format`).
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

import torch

from ... import __version__
from ..model.config import DraftConfig, ModelConfig
from .source import TensorSource
from .writer import BLOCK_BYTES, write_artifact

POLICIES = ("fp32", "bf16", "q8", "q5", "q4", "mixed")
_UNIFORM = {"fp32": "fp32", "bf16": "bf16", "q8": "q8_g32_fp16", "q5": "q5_g64_fp16", "q4": "q4_g64_fp16"}


def weight_format(name: str, shape: tuple[int, ...], policy: str) -> str:
    """The storage format of tensor ``name`` under ``policy``."""
    if policy not in POLICIES:
        raise ValueError(f"unknown quantization policy {policy!r} (known: {', '.join(POLICIES)})")
    if len(shape) != 2:
        return "fp32"  # norms, A_log, dt_bias, conv1d [C, 1, W]
    if policy != "mixed":
        return _UNIFORM[policy]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return "q8_g32_fp16"
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight")):
        return "bf16"
    if ".self_attn." in name or name == "mtp.fc.weight":
        return "q5_g64_fp16"
    return "q4_g64_fp16"


def _special_tokens(blobs: dict[str, bytes]) -> dict:
    out = {}
    if "tokenizer_config.json" in blobs:
        tc = json.loads(blobs["tokenizer_config.json"])
        for key in ("eos_token", "bos_token", "pad_token"):
            tok = tc.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            if tok:
                out[key] = tok
        if isinstance(tc.get("chat_template"), str):
            out["chat_template"] = tc["chat_template"]
    if "chat_template.jinja" in blobs:
        out["chat_template"] = blobs["chat_template.jinja"].decode()
    return out


def text_components(cfg: ModelConfig, names: list[str]) -> dict:
    """The ``text`` and ``mtp`` component entries for the given tensor names."""
    comps = {"text": {"config": cfg.to_dict(), "tensors": [n for n in names if not n.startswith("mtp.")]}}
    mtp = [n for n in names if n.startswith("mtp.")]
    comps["mtp"] = {"config": {"num_hidden_layers": cfg.mtp_num_hidden_layers}, "tensors": mtp} if mtp else None
    comps.update({"dflash": None, "dflash2": None, "vision": None})
    return comps


def build_metadata(blobs: dict[str, bytes], policy: str, model_id: str) -> dict:
    meta = {"model_id": model_id, "quant_policy": policy}
    meta.update(_special_tokens(blobs))
    if "tokenizer.json" in blobs:
        meta["tokenizer"] = "tokenizer.json"
    if "generation_config.json" in blobs:
        meta["generation_config"] = json.loads(blobs["generation_config.json"])
    return meta


def write_model(out: str | Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor | TensorSource], *, policy: str,
                blobs: dict[str, bytes] | None = None, version: int = 3, model_id: str = "",
                source: str = "", extra_components: dict | None = None, extra_tensors: dict | None = None,
                progress=None, device="cpu", block_bytes: int = BLOCK_BYTES) -> None:
    """Quantize ``tensors`` by ``policy`` and write an artifact (atomically) at ``out``, one row block at a time
    (see :func:`.writer.write_artifact`; ``device`` packs there, with the same bytes as on the CPU).

    ``extra_components`` / ``extra_tensors`` carry drafter components (``dflash``, ``dflash2``) whose
    tensors are stored as given: ``name -> (format, tensor)``.
    """
    blobs = dict(blobs or {})
    names = list(tensors)
    aliases = {}
    if cfg.tie_word_embeddings and "lm_head.weight" not in tensors:
        aliases["lm_head.weight"] = "model.embed_tokens.weight"
    packed = {n: (weight_format(n, tuple(t.shape), policy), t) for n, t in tensors.items()}
    packed.update(extra_tensors or {})
    components = text_components(cfg, names)
    components.update(extra_components or {})
    tok_blobs = {k: v for k, v in blobs.items() if k in ("tokenizer.json",)}
    write_artifact(
        out, tensors=packed, blobs=tok_blobs, components=components, aliases=aliases,
        metadata=build_metadata(blobs, policy, model_id), version=version, model_id=model_id,
        provenance={"source": source, "tool": f"ninfer-bench {__version__}",
                    "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")},
        progress=progress, device=device, block_bytes=block_bytes,
    )


def drafter_components(folders, policy: str) -> tuple[dict, dict, dict]:
    """(components, tensors, the folder of each kind) for z-lab style drafter folders: projections bf16 (fp32 under
    the fp32 policy), small vectors fp32 (drafters are small next to the target, and their precision sets
    acceptance)."""
    from .zlab import read_zlab_drafter

    comps, tensors, sources = {}, {}, {}
    for folder in folders or ():
        dcfg, ts = read_zlab_drafter(folder)
        if dcfg.kind in comps:
            raise ValueError(f"two {dcfg.kind} drafters given ({folder})")
        comps[dcfg.kind] = {"config": dcfg.to_dict(), "tensors": sorted(ts)}
        sources[dcfg.kind] = folder
        for name, t in ts.items():
            fmt = "fp32" if policy == "fp32" or t.dim() != 2 else "bf16"
            tensors[name] = (fmt, t)
    return comps, tensors, sources


def convert(hf_dir: str | Path, out: str | Path, *, policy: str = "mixed", version: int = 3, progress=None,
            drafters=(), device="cpu", block_bytes: int = BLOCK_BYTES, draft_vocab_corpus=(),
            corpus_progress=None):
    """Convert a Hugging Face folder (Qwen3.5 / Qwen3-Next) into an artifact, with optional z-lab style drafter
    folders (DFlash / DFlash2) added as components. The checkpoint is streamed: each tensor is read, quantized (on
    ``device``), hashed and written one row block of at most ``block_bytes`` (as fp32) at a time, so memory holds
    a block (and the drafters, which are small), never the model. ``draft_vocab_corpus`` (files / folders): rank the
    vocabulary by that corpus's token counts into ``draft_head.token_ids`` (what ``--lm-head-draft`` reads;
    :mod:`.draft_vocab`), before anything is written. Returns that ranking's :class:`.draft_vocab.CorpusStats`, or
    None."""
    from ..model.dflash import check_drafter
    from .hf_checkpoint import HFCheckpoint

    if policy not in POLICIES:
        raise ValueError(f"unknown quantization policy {policy!r} (known: {', '.join(POLICIES)})")
    if version not in (2, 3):
        raise ValueError(f"format version must be 2 or 3, got {version}")
    check_outside(out, [hf_dir, *drafters])
    ckpt = HFCheckpoint(hf_dir)
    tensors = ckpt.sources()
    vision = ckpt.vision()  # the tower of a Qwen3_5ForConditionalGeneration: stored whole, never quantized
    comps, extra = ({"vision": vision[0]}, {n: (vision_format(t.shape, policy), t) for n, t in vision[1].items()}) \
        if vision else ({}, {})
    dcomps, dtensors, sources = drafter_components(drafters, policy)
    for kind, comp in dcomps.items():  # refused before anything is written, as loading the artifact would
        check_drafter(DraftConfig.from_dict(comp["config"]), ckpt.config,
                      {n.split(".", 1)[-1]: tuple(dtensors[n][1].shape) for n in comp["tensors"]},
                      str(sources[kind]))
    comps.update(dcomps)
    extra.update(dtensors)
    blobs = ckpt.blobs()
    stats = None
    if draft_vocab_corpus:
        from . import draft_vocab

        if "tokenizer.json" not in blobs:
            raise ValueError(f"--draft-vocab-corpus tokenizes with the checkpoint's tokenizer.json; {hf_dir} has none")
        order, stats = draft_vocab.corpus_order(blobs["tokenizer.json"], ckpt.config.vocab_size, draft_vocab_corpus,
                                                progress=corpus_progress)
        extra[draft_vocab.TENSOR] = ("fp32", torch.as_tensor(order, dtype=torch.float32))
    write_model(out, ckpt.config, tensors, policy=policy, blobs=blobs, version=version,
                model_id=ckpt.hf_config.get("_name_or_path") or Path(hf_dir).name,
                source=str(Path(hf_dir).resolve()), extra_components=comps, extra_tensors=extra, progress=progress,
                device=device, block_bytes=block_bytes)
    return stats


def check_outside(out: str | Path, folders) -> None:
    """Refuse an output path inside an input folder: it could replace the checkpoint being read."""
    dest = Path(out).resolve()
    for folder in folders:
        if dest.is_relative_to(Path(folder).resolve()):
            raise ValueError(f"output {out} is inside the input folder {folder}: write the artifact elsewhere")


def vision_format(shape: tuple[int, ...], policy: str) -> str:
    """Vision tower weights: fp32 under the fp32 policy, else bf16 (1-D biases and norms always fp32); the
    tower runs once per image, so quantizing it would save little and cost accuracy."""
    return "fp32" if policy == "fp32" or len(shape) == 1 else "bf16"
