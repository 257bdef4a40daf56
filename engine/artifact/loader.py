"""Resolve what ``--model`` names (an artifact path, a preset, the bundled model) into config, weights and
tokenizer."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model.config import PRESETS, DraftConfig, ModelConfig, preset
from ..model.memory import check_fits_memory
from ..model.weights import RawWeight, check_text_shapes
from .reader import Artifact
from .synthetic import preset_draft_config, synthetic_bytes, synthetic_drafter, synthetic_raws
from .tokenizer import ByteTokenizer, Tokenizer

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"  # the package root's models/
BUNDLED_NAME = "ninfer-code-small.ninfer"


def bundled_model_path() -> Path | None:
    """The bundled model's artifact, when this checkout ships one."""
    p = MODELS_DIR / BUNDLED_NAME
    return p if p.is_file() else None


def default_model() -> str:
    """What every suite loads when ``--model`` is not given."""
    p = bundled_model_path()
    return str(p) if p else "tiny"


@dataclass
class LoadedModel:
    config: ModelConfig
    raws: dict[str, RawWeight]
    tokenizer: object
    info: dict = field(default_factory=dict)  # artifact id, sha, format, preset, quant policy
    drafters: dict[str, tuple[DraftConfig, dict[str, RawWeight]]] = field(default_factory=dict)
    artifact: Artifact | None = None
    vision: tuple | None = None  # (VisionConfig, PreprocessConfig, {vision.* name: RawWeight}) when the model sees
    tp_shard: tuple[int, int] | None = None  # (rank, size): ``raws`` are that tensor-parallel rank's share only


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def config_eos_ids(meta: dict, cfg: ModelConfig) -> tuple[int, ...]:
    """The end-of-sequence ids the model's own configs name: config.json's ``eos_token_id`` and
    generation_config.json's (an int or a list), within the vocabulary."""
    gen = (meta.get("generation_config") or {}).get("eos_token_id")
    ids = list(cfg.eos_token_id) + ([gen] if isinstance(gen, int) else list(gen or []))
    return tuple(dict.fromkeys(int(i) for i in ids if isinstance(i, int) and 0 <= i < cfg.vocab_size))


def tokenizer_of(art: Artifact, cfg: ModelConfig):
    """The artifact's tokenizer; EOS: its end tokens plus the ids the configs name (a model without a
    tokenizer.json gets the byte tokenizer, whose own end tokens count only when the configs name none)."""
    meta = art.metadata or {}
    name = meta.get("tokenizer")
    extra = config_eos_ids(meta, cfg)
    if name:
        eos = [meta["eos_token"]] if meta.get("eos_token") else []
        try:
            tok = Tokenizer.from_json(art.blob(name), cfg.vocab_size, eos_tokens=eos,
                                      chat_template=meta.get("chat_template"))
        except ValueError as e:
            raise ValueError(f"{art.path}: {name}: {e}") from None
        tok.eos_ids = tuple(dict.fromkeys(tok.eos_ids + extra))
        return tok
    return ByteTokenizer(cfg.vocab_size, eos_ids=extra or None)


def text_identity(art: Artifact) -> str | None:
    """SHA-256 of what the text model computes from: the text component's config, the digest of every object its
    tensors (and a tied or stored ``lm_head``) are bound to, the tokenizer's digest and the metadata (special tokens,
    generation config). Drafters, the MTP head and provenance are left out, so an artifact whose drafters were
    replaced keeps its text identity (and its stored oracles). v2 artifacts carry no digests: None."""
    if art.version < 3:
        return None
    text = (art.components or {}).get("text") or {}

    def digests(name):
        target = art.bindings[name]
        return [art.objects[i].sha256 for i in (target["parts"] if isinstance(target, dict) else [target])]

    names = sorted({*text.get("tensors", []), *(n for n in ("lm_head.weight", "tokenizer.json") if art.has(n))})
    doc = {"config": text.get("config"), "objects": [[n, digests(n)] for n in names], "metadata": art.metadata}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def load_artifact(path: str | Path) -> LoadedModel:
    art = Artifact.open(path)
    cfg, raws = text_of(art, path)
    drafters = drafters_of(art, path, cfg)
    meta = art.metadata or {}
    vision = vision_of(art, path)
    info = {"path": str(Path(path).resolve()), "artifact_id": art.artifact_id, "text_id": text_identity(art),
            "format_version": art.version, "quant_policy": meta.get("quant_policy"), "model_id": meta.get("model_id"),
            "preset": None}
    return LoadedModel(cfg, raws, tokenizer_of(art, cfg), info, drafters, art, vision)


def raw_weight(art: Artifact, name: str) -> RawWeight:
    info = art.info(name)
    return RawWeight(info.format, tuple(info.shape), art.raw(name))


def text_config(art: Artifact, path) -> ModelConfig:
    """The validated config of the artifact's ``text`` component (ValueError naming ``path`` when it has none or
    it does not validate)."""
    text = (art.components or {}).get("text")
    if not text:
        raise ValueError(f"{path}: artifact has no text component")
    try:
        return ModelConfig.from_dict(dict(text["config"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: text component: {e}") from None


def text_of(art: Artifact, path) -> tuple[ModelConfig, dict[str, RawWeight]]:
    """The text model's config and weights (with the MTP head's when the artifact has an ``mtp`` component, and a
    stored tied ``lm_head``), the configs validated and the tensors checked against them."""
    comps = art.components or {}
    text, mtp = comps.get("text"), comps.get("mtp")
    cfg = text_config(art, path)
    names = list(text.get("tensors", []))
    if mtp:
        mcfg = mtp.get("config")
        layers = mcfg.get("num_hidden_layers") if isinstance(mcfg, dict) else None
        if layers != cfg.mtp_num_hidden_layers:
            raise ValueError(f"{path}: mtp component: config num_hidden_layers is {layers!r}, the text config's "
                             f"mtp_num_hidden_layers {cfg.mtp_num_hidden_layers}")
        names += list(mtp.get("tensors", []))
    else:
        cfg.mtp_num_hidden_layers = 0  # an MTP head announced but not shipped: the model runs without it
    if cfg.tie_word_embeddings and art.has("lm_head.weight") and "lm_head.weight" not in names:
        names.append("lm_head.weight")
    check_text_shapes(cfg, {n: art.shape(n) for n in names}, f"{path}: text component")
    return cfg, {n: raw_weight(art, n) for n in names}


def drafters_of(art: Artifact, path, target: ModelConfig | None = None
                ) -> dict[str, tuple[DraftConfig, dict[str, RawWeight]]]:
    """The artifact's DFlash / DFlash2 drafters: kind -> (validated config, weights), each checked against the
    target (``target``: the text config when already read)."""
    from ..model.dflash import check_drafter

    drafters = {}
    for kind in ("dflash", "dflash2"):
        comp = (art.components or {}).get(kind)
        if not comp:
            continue
        try:
            dcfg = DraftConfig.from_dict(dict(comp["config"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: {kind} component: {e}") from None
        names = list(comp.get("tensors", []))
        target = target or text_of(art, path)[0]
        check_drafter(dcfg, target, {n.split(".", 1)[-1]: art.shape(n) for n in names}, f"{path}: {kind} component")
        drafters[kind] = (dcfg, {n: raw_weight(art, n) for n in names})
    return drafters


def vision_of(art: Artifact, path) -> tuple | None:
    """The artifact's vision component, its configs validated and its tensors checked against them."""
    from ..media.decode import PreprocessConfig
    from ..model.vision import VisionConfig, check_preprocess, check_shapes

    comp = (art.components or {}).get("vision")
    if not comp:
        return None
    try:
        vcfg = VisionConfig.from_dict(dict(comp["config"]))
        pre = PreprocessConfig.from_dict(dict(comp.get("preprocess") or {}))
        check_preprocess(vcfg, pre)
        names = list(comp.get("tensors", []))
        check_shapes(vcfg, {n: art.shape(n) for n in names}, f"{path}: vision component")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: vision component: {e}") from None
    raws = {n: raw_weight(art, n) for n in names}
    return vcfg, pre, raws


def load_source(source: str | None, *, synthetic: bool = False, quant: str = "mixed", seed: int = 0,
                device="cpu") -> LoadedModel:
    """An artifact path, or a preset name (random weights need ``synthetic``; ``tiny`` is always random)."""
    source = source or default_model()
    if source in PRESETS:
        if source != "tiny" and not synthetic:
            raise ValueError(f"preset {source!r} has no weights file: add --synthetic for seeded random weights "
                             f"of its shape, or pass an artifact path")
        cfg = preset(source)
        # on a CPU the engine then holds every matrix dense too (2 bytes a weight at the least: bf16)
        cpu = torch.device(device).type == "cpu"
        check_fits_memory(synthetic_bytes(cfg, quant, 2 if cpu else 0), device,
                          f"the {source} preset's {quant} weights" + (" and their dense CPU copies" if cpu else ""),
                          "use a smaller preset (tiny), or a GPU (runtime v3 keeps the weights packed)")
        raws = synthetic_raws(cfg, quant, seed, device)
        tok = ByteTokenizer(cfg.vocab_size)
        mask = tok.token_to_id("<|mask|>")
        drafters = {}
        for kind in ("dflash", "dflash2"):
            dcfg = preset_draft_config(cfg, kind, mask)
            drafters[kind] = (dcfg, synthetic_drafter(cfg, dcfg, quant, seed, device))
        info = {"preset": source, "synthetic": True, "quant_policy": quant, "seed": seed,
                "artifact_id": None, "config_sha256": hashlib.sha256(
                    json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()}
        return LoadedModel(cfg, raws, tok, info, drafters)
    path = Path(source)
    if not path.exists():
        raise ValueError(f"no such model: {source!r} (an artifact path, or a preset: {', '.join(sorted(PRESETS))})")
    if path.is_dir():
        hint = (f"convert it first: ninfer-bench convert {source} {path.name or 'model'}.ninfer --quant mixed"
                if (path / "config.json").is_file() else "pass an artifact file (.ninfer) or a preset")
        raise ValueError(f"{source!r} is a folder, not an artifact: {hint}")
    return load_artifact(path)
