"""Importing a z-lab style DFlash drafter folder (``config.json`` + safetensors, as published with DFlash).

The folder's ``dflash_config`` (or top-level keys) gives ``target_layer_ids``, ``block_size`` and
``mask_token_id``; its weights use Qwen3 names (``layers.{i}.self_attn.q_proj``, ``layers.{i}.mlp.gate_proj``,
``fc``, ``hidden_norm``, ``norm``; DFlash2's ``candidate_selector.*``). Two conventions differ from ours and are
converted: Qwen3's RMSNorm multiplies by ``w`` where ours multiplies by ``1 + w`` (so ``w - 1`` is stored), and
the logit ``output_multiplier`` / ``final_logit_softcapping`` travel in ``DraftConfig.extra``. Drafters with
DFlash2's dynamic causal convolutions (``conv_kernel_size``) are refused: this engine does not run them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..model.config import DraftConfig, DraftConfigError

_NORMS = re.compile(r"(^|\.)(input_layernorm|post_attention_layernorm|q_norm|k_norm|hidden_norm|norm)\.weight$")
_RENAMES = [
    (re.compile(r"^layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight$"),
     r"layers.\1.\2.weight"),
    (re.compile(r"^layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$"), r"layers.\1.\2.weight"),
    (re.compile(r"^layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$"), r"layers.\1.\2.weight"),
    (re.compile(r"^(fc|hidden_norm|norm)\.weight$"), r"\1.weight"),
    (re.compile(r"^candidate_selector\.predecessor_codebook(\.weight)?$"), "selector.pred.weight"),
    (re.compile(r"^candidate_selector\.successor_codebook(\.weight)?$"), "selector.succ.weight"),
    (re.compile(r"^candidate_selector\.hidden_projection\.weight$"), "selector.proj.weight"),
]
# DraftConfig fields under their config.json names, so a refused value names the key the user wrote
_ZLAB_KEYS = {"num_layers": "num_hidden_layers", "window": "sliding_window", "candidates": "selector_top_k",
              "scorer_rank": "selector_rank", "logit_scale": "output_multiplier",
              "logit_softcap": "final_logit_softcapping"}


def _our_name(name: str) -> str | None:
    for pattern, repl in _RENAMES:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return None


def read_zlab_config(folder: Path) -> tuple[DraftConfig, bool]:
    """(DraftConfig, whether it is a DFlash2 drafter) from a z-lab ``config.json``; a missing key or a value the
    drafter cannot run with is refused in one line naming the file and the key."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no config.json (not a drafter folder)")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    for key, kind in (("dflash_config", dict), ("rope_parameters", dict), ("layer_types", list)):
        if cfg.get(key) is not None and not isinstance(cfg[key], kind):
            raise ValueError(f"{path}: {key} must be a JSON {'object' if kind is dict else 'array'}, got {cfg[key]!r}")
    dc = cfg.get("dflash_config") or {}

    def get(key, default=None):
        return dc.get(key, cfg.get(key, default))

    if get("conv_kernel_size"):
        raise ValueError(f"{folder}: DFlash2 drafters with dynamic convolutions (conv_kernel_size) are not supported")
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads"):
        if key not in cfg:
            raise ValueError(f"{path}: missing {key!r}")
    for key in ("target_layer_ids", "mask_token_id"):
        if get(key) is None:
            raise ValueError(f"{path}: missing {key!r} (in dflash_config or at the top level)")
    dflash2 = get("selector_rank") is not None
    sliding = cfg.get("use_sliding_window") and "sliding_attention" in (cfg.get("layer_types") or [])
    rope = cfg.get("rope_parameters") or {}
    extra = {k: v for k, v in (("logit_scale", get("output_multiplier")),
                               ("logit_softcap", get("final_logit_softcapping"))) if v not in (None, 1.0, 0.0)}
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    # without head_dim, hidden // heads; bad sizes are left for DraftConfig to name (it checks them before head_dim)
    derived = hidden // heads if all(isinstance(v, int) and v > 0 for v in (hidden, heads)) else None
    try:
        dcfg = DraftConfig(
            kind="dflash2" if dflash2 else "dflash", num_layers=cfg["num_hidden_layers"],
            block_size=get("block_size", 16), target_layer_ids=get("target_layer_ids"),
            mask_token_id=get("mask_token_id"), hidden_size=hidden, intermediate_size=cfg["intermediate_size"],
            num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or derived, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 1e6)),
            window=(cfg.get("sliding_window") or 0) if sliding and dflash2 else 0,
            candidates=get("selector_top_k", 16), scorer_rank=get("selector_rank") or 0, extra=extra)
    except DraftConfigError as e:
        raise ValueError(f"{path}: {_ZLAB_KEYS.get(e.name, e.name)} {e.problem}") from None
    return dcfg, dflash2


def read_zlab_drafter(folder: str | Path) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """A z-lab drafter folder as (our DraftConfig, fp32 tensors under ``{kind}.<our names>``)."""
    folder = Path(folder)
    dcfg, _ = read_zlab_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                name = _our_name(key)
                if name is None:
                    raise ValueError(f"{f}: unexpected tensor {key!r} (not a DFlash / DFlash2 weight name)")
                t = sf.get_tensor(key).float()
                if _NORMS.search(name):
                    t = t - 1.0  # w * x  ->  (1 + w') * x
                out[f"{dcfg.kind}.{name}"] = t
    return dcfg, out


def write_zlab_drafter(folder: str | Path, dcfg: DraftConfig, tensors: dict[str, torch.Tensor]) -> None:
    """The inverse of :func:`read_zlab_drafter` (tests, and exporting our drafters for other engines)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    inverse = {}
    for name, t in tensors.items():
        ours = name.split(".", 1)[1]
        m = re.match(r"^layers\.(\d+)\.(.+)\.weight$", ours)
        if m and m.group(2) in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            key = f"layers.{m.group(1)}.self_attn.{m.group(2)}.weight"
        elif m and m.group(2) in ("gate_proj", "up_proj", "down_proj"):
            key = f"layers.{m.group(1)}.mlp.{m.group(2)}.weight"
        else:
            key = {"selector.pred.weight": "candidate_selector.predecessor_codebook",
                   "selector.succ.weight": "candidate_selector.successor_codebook",
                   "selector.proj.weight": "candidate_selector.hidden_projection.weight"}.get(ours, ours)
        inverse[key] = (t + 1.0 if _NORMS.search(ours) else t).contiguous()
    save_file(inverse, str(folder / "model.safetensors"))
    dc = {"target_layer_ids": list(dcfg.target_layer_ids), "block_size": dcfg.block_size,
          "mask_token_id": dcfg.mask_token_id}
    if dcfg.kind == "dflash2":
        dc.update(selector_rank=dcfg.scorer_rank, selector_top_k=dcfg.candidates)
    cfg = {"architectures": ["DFlash2DraftModel" if dcfg.kind == "dflash2" else "DFlashDraftModel"],
           "model_type": "qwen3", "num_hidden_layers": dcfg.num_layers, "hidden_size": dcfg.hidden_size,
           "intermediate_size": dcfg.intermediate_size, "num_attention_heads": dcfg.num_attention_heads,
           "num_key_value_heads": dcfg.num_key_value_heads, "head_dim": dcfg.head_dim,
           "rms_norm_eps": dcfg.rms_norm_eps,
           "rope_parameters": {"rope_type": "default", "rope_theta": dcfg.rope_theta},
           "is_causal": False, "dflash_config": dc}
    if dcfg.window:
        cfg.update(use_sliding_window=True, sliding_window=dcfg.window,
                   layer_types=["sliding_attention"] * dcfg.num_layers)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
