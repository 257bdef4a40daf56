"""Producing oracle outputs: the independent reference forward over a prompt set, stored with ``store``."""

from __future__ import annotations

import torch

from ..engine.artifact.loader import file_sha256, load_source
from .reference import ReferenceModel
from .store import save_oracle

DTYPES = {"fp64": torch.float64, "fp32": torch.float32}


def reference_model(source: str | None, dtype: str = "fp64", device: str = "cpu"):
    """(ReferenceModel with weights dequantized from ``source``, on ``device`` (auto: CUDA when there is one), the
    loaded model)."""
    if dtype not in DTYPES:
        raise ValueError(f"oracle dtype must be fp64 or fp32, got {dtype!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible here (use --device cpu)")
    loaded = load_source(source, device="cpu")
    weights = {name: raw.dense(torch.float32) for name, raw in loaded.raws.items()}
    return ReferenceModel(loaded.config, weights, dtype=DTYPES[dtype], device=device), loaded


def model_meta(info: dict) -> dict:
    """The model identity an oracle file records (``store.identity_mismatch`` reads it back): the artifact id and
    file digest, the text model's identity (v3), and for a preset its name, with the digest of its config standing
    in for a file's (a preset has neither artifact id nor text identity, and without its name an oracle of one
    would carry no identity at all)."""
    sha = file_sha256(info["path"]) if info.get("path") else info.get("config_sha256", "")
    return {"artifact_id": info.get("artifact_id") or "", "artifact_sha256": sha, "text_id": info.get("text_id") or "",
            "preset": info.get("preset") or ""}


def build_oracle(source: str, prompts: list[dict], out: str, *, max_new_tokens: int, top_k: int = 8,
                 dtype: str = "fp64", progress=None) -> list[dict]:
    """Greedy tokens and per-step top-k log-probs of the reference model for every prompt; saved at ``out``.

    ``prompts``: dicts with ``id`` and ``prompt_ids``. ``progress(done, total, id)`` is called per prompt.
    """
    model, loaded = reference_model(source, dtype)
    eos = tuple(getattr(loaded.tokenizer, "eos_ids", ()))
    records = []
    for i, p in enumerate(prompts):
        res = model.greedy(p["prompt_ids"], max_new_tokens, top_k=top_k, stop_ids=eos)
        records.append({"id": p["id"], "prompt_ids": list(p["prompt_ids"]), **res, "device": model.device.type})
        if progress:
            progress(i + 1, len(prompts), p["id"])
    info = loaded.info
    meta = {**model_meta(info), "dtype": dtype, "top_k": top_k, "model": info.get("preset") or info.get("path"),
            "max_new_tokens": max_new_tokens}
    save_oracle(out, records, meta)
    return records
