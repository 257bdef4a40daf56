"""Model configuration of the Qwen3.5 / Qwen3-Next hybrid family, read from Hugging Face ``config.json``.

One dataclass describes the text decoder (plus the optional MTP head). It is validated once, in
``__post_init__``, and everything downstream (model, caches, artifact, oracle) reads it and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields

LINEAR = "linear_attention"
FULL = "full_attention"
HF_DEFAULT_HEAD_DIM, HF_DEFAULT_MAX_POSITIONS = 256, 32768  # transformers' when config.json has none
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next")


@dataclass(slots=True)
class ModelConfig:
    """Shape and numerics of one hybrid text decoder (Gated DeltaNet + gated full attention)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    mtp_num_hidden_layers: int = 0
    attention_bias: bool = False
    hidden_act: str = "silu"
    model_type: str = "qwen3_5_text"
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(self.num_hidden_layers))
        self.layer_types = tuple(self.layer_types)
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = (self.eos_token_id,)
        eos = self.eos_token_id or ()
        if not isinstance(eos, (list, tuple)) or not all(is_int(e) for e in eos):
            raise ValueError(f"model config: eos_token_id must be an integer or a list of integers, got {eos!r}")
        self.eos_token_id = tuple(eos)
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
        for name in positive:
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model config: unknown model_type {self.model_type!r} "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"model config: layer_types has {len(self.layer_types)} entries "
                             f"but num_hidden_layers is {self.num_hidden_layers}")
        bad = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
        if bad:
            raise ValueError(f"model config: unknown layer type(s) {bad} (expected {LINEAR!r} or {FULL!r})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"model config: num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"model config: linear_num_value_heads {self.linear_num_value_heads} is not a multiple "
                             f"of linear_num_key_heads {self.linear_num_key_heads}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive number, got {value!r}")
        if not is_int(self.max_position_embeddings) or self.max_position_embeddings < 1:
            raise ValueError(f"model config: max_position_embeddings must be a positive integer, "
                             f"got {self.max_position_embeddings!r}")
        if not is_int(self.mtp_num_hidden_layers) or self.mtp_num_hidden_layers < 0:
            raise ValueError(f"model config: mtp_num_hidden_layers must be an integer >= 0, "
                             f"got {self.mtp_num_hidden_layers!r}")
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model config: {name} must be true or false, got {getattr(self, name)!r}")
        if self.linear_layers and self.linear_conv_kernel_dim < 2:  # the conv state keeps the last W-1 inputs
            raise ValueError(f"model config: linear_conv_kernel_dim must be >= 2, got {self.linear_conv_kernel_dim}")
        if not _is_number(self.partial_rotary_factor) or not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"model config: partial_rotary_factor must be in (0, 1], "
                             f"got {self.partial_rotary_factor!r}")
        if self.rotary_dim % 2:
            raise ValueError(f"model config: rotary dim head_dim*partial_rotary_factor = {self.rotary_dim} "
                             "must be even")
        if self.hidden_act != "silu":
            raise ValueError(f"model config: hidden_act {self.hidden_act!r} is not supported (only 'silu')")

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        """Width of the GDN q (and k) projection: Hk * dk."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        """Width of the GDN v (and z) projection: Hv * dv."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise causal conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    # ---- (de)serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["eos_token_id"] = list(self.eos_token_id)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"model config: unknown field(s) {unknown}")
        return cls(**d)

    def to_hf(self) -> dict:
        """A ``qwen3_5_text`` config.json dict that transformers' ``Qwen3_5TextConfig`` accepts."""
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "layer_types": list(self.layer_types),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
            "attention_bias": self.attention_bias,
            "hidden_act": self.hidden_act,
            "eos_token_id": (list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0])
            if self.eos_token_id else None,
            "bos_token_id": self.bos_token_id,
            "pad_token_id": self.pad_token_id,
        }

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Read a Hugging Face config.json dict of model_type qwen3_5 / qwen3_5_text / qwen3_next."""
        if not isinstance(hf, dict):
            raise ValueError(f"config.json: expected a JSON object, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: unknown model_type {model_type!r} "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        top = hf
        if model_type == "qwen3_5":
            if not isinstance(hf.get("text_config"), dict):
                raise ValueError("config.json: model_type 'qwen3_5' without a text_config")
            hf = dict(hf["text_config"])
            hf.setdefault("model_type", "qwen3_5_text")
            # Qwen3_5ForConditionalGeneration keeps tie_word_embeddings at the top level.
            if "tie_word_embeddings" in top:
                hf["tie_word_embeddings"] = top["tie_word_embeddings"]
            for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
                if hf.get(key) is None and top.get(key) is not None:
                    hf[key] = top[key]
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
                    "linear_key_head_dim", "linear_value_head_dim")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"config.json: missing key(s) {missing}")
        # the layer count drives the loops below: checked here, before them (the rest in __post_init__)
        if not is_int(hf["num_hidden_layers"]) or hf["num_hidden_layers"] <= 0:
            raise ValueError(f"config.json: num_hidden_layers must be a positive integer, got "
                             f"{hf['num_hidden_layers']!r}")
        if model_type == "qwen3_next":
            experts = hf.get("num_experts", 0) or 0
            sparse = [i for i in range(hf["num_hidden_layers"])
                      if experts > 0 and i not in (hf.get("mlp_only_layers") or [])
                      and (i + 1) % (hf.get("decoder_sparse_step") or 1) == 0]
            if sparse:
                raise ValueError(f"config.json: qwen3_next with mixture-of-experts layers {sparse[:8]} is not "
                                 f"supported (only dense MLP: num_experts 0 or every layer in mlp_only_layers)")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"config.json: rope_parameters must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope", None):
            raise ValueError(f"config.json: rope_type {rope_type!r} is not supported (only default / text mRoPE)")
        layer_types = hf.get("layer_types")
        if layer_types and (not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types)):
            raise ValueError(f"config.json: layer_types must be a list of layer type names, got {layer_types!r}")
        if not layer_types:
            interval = hf.get("full_attention_interval", 4)
            if not is_int(interval) or interval <= 0:
                raise ValueError(f"config.json: full_attention_interval must be a positive integer, got {interval!r}")
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(hf["num_hidden_layers"])]
        # what config.json leaves out takes transformers' defaults for these models (Qwen3_5TextConfig and
        # Qwen3NextConfig agree): a head_dim of 256 whatever the hidden size, a 32K position limit
        head_dim = hf["head_dim"] if hf.get("head_dim") is not None else HF_DEFAULT_HEAD_DIM  # (0 is refused below)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf["num_key_value_heads"],
            head_dim=head_dim,
            linear_num_key_heads=hf["linear_num_key_heads"],
            linear_num_value_heads=hf["linear_num_value_heads"],
            linear_key_head_dim=hf["linear_key_head_dim"],
            linear_value_head_dim=hf["linear_value_head_dim"],
            linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4),
            layer_types=tuple(layer_types),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            partial_rotary_factor=rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)),
            tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
            max_position_embeddings=hf.get("max_position_embeddings", HF_DEFAULT_MAX_POSITIONS),
            mtp_num_hidden_layers=hf.get("mtp_num_hidden_layers", 0) or 0,
            attention_bias=_flag(hf, "attention_bias"),
            hidden_act=hf.get("hidden_act", "silu"),
            model_type=hf.get("model_type", model_type),
            eos_token_id=hf.get("eos_token_id") or (),
            bos_token_id=hf.get("bos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )


PRESETS: dict[str, dict] = {
    # Qwen3.5-27B text shape (docs/DESIGN.md, "The model family").
    "qwen3.8-27b": dict(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        rope_theta=1e7, partial_rotary_factor=0.25, tie_word_embeddings=False, mtp_num_hidden_layers=1,
    ),
    # A small random model for tests: awkward-ish sizes, GQA on both mixers, one MTP layer.
    "tiny": dict(
        vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=24, linear_value_head_dim=16,
        rope_theta=10000.0, partial_rotary_factor=0.25, tie_word_embeddings=False, mtp_num_hidden_layers=1,
        max_position_embeddings=65536,
    ),
}


def preset(name: str) -> ModelConfig:
    """The named preset's config (see ``PRESETS``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    return ModelConfig(**PRESETS[name])


class DraftConfigError(ValueError):
    """A bad :class:`DraftConfig` value: ``name`` is the field and ``problem`` what is wrong with it, so a reader of
    another format (a z-lab ``config.json``) can name its own key."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"draft config: {name} {problem}")
        self.name, self.problem = name, problem


def _flag(hf: dict, key: str):
    """A config.json flag as given (false when absent or null): ``__post_init__`` refuses what is not a boolean,
    where ``bool("no")`` would have read a string as true."""
    value = hf.get(key)
    return False if value is None else value


def is_int(value) -> bool:
    """An integer as config.json gives one: JSON's true / false arrive as Python bools, which are ints too."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


@dataclass(slots=True)
class DraftConfig:
    """A DFlash / DFlash2 block drafter: a few non-causal layers over target tap features."""

    kind: str  # "dflash" or "dflash2"
    num_layers: int
    block_size: int  # K + 1: the last committed token plus K mask slots
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    window: int = 0  # DFlash2: context ring length (0 = the whole context)
    candidates: int = 16  # DFlash2: top-k candidates per block position
    scorer_rank: int = 0  # DFlash2: rank of the previous-token scorer (0 = none)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # every value the drafter cannot run with is refused here (or, when it depends on the target, in
        # ``model.dflash.check_drafter``), not left to fail as an index or shape error at the first decode
        bad = DraftConfigError
        if self.kind not in ("dflash", "dflash2"):
            raise bad("kind", f"must be 'dflash' or 'dflash2', got {self.kind!r}")
        for name in ("num_layers", "block_size", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "candidates"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise bad(name, f"must be a positive integer, got {value!r}")
        for name in ("mask_token_id", "window", "scorer_rank"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise bad(name, f"must be a non-negative integer, got {value!r}")
        if self.block_size < 2:
            raise bad("block_size", f"must be >= 2 (the last committed token plus mask slots), got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_attention_heads", f"{self.num_attention_heads} is not a multiple of num_key_value_heads "
                                             f"{self.num_key_value_heads}")
        if self.head_dim % 2:
            raise bad("head_dim", f"must be even (rotary over the whole head), got {self.head_dim}")
        taps = self.target_layer_ids
        if not isinstance(taps, (list, tuple)) or not all(is_int(i) for i in taps):
            raise bad("target_layer_ids", f"must be a list of integers, got {taps!r}")
        if not taps:
            raise bad("target_layer_ids", "is empty")
        if min(taps) < 0:
            raise bad("target_layer_ids", f"{list(taps)} has a negative layer")
        repeated = sorted({i for i in taps if taps.count(i) > 1})
        if repeated:  # the target hands over each tap layer's output once: fc would get fewer inputs than it reads
            raise bad("target_layer_ids", f"{list(taps)} repeats layer(s) {repeated}")
        self.target_layer_ids = tuple(taps)
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise bad(name, f"must be a positive number, got {value!r}")
        if not isinstance(self.extra, dict):
            raise bad("extra", f"must be a dict, got {self.extra!r}")
        for name in ("logit_scale", "logit_softcap"):
            value = self.extra.get(name, 0.0)
            if not _is_number(value) or (name == "logit_softcap" and value < 0):
                raise bad(name, f"must be a finite number{' >= 0' if name == 'logit_softcap' else ''}, "
                                f"got {value!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"draft config: unknown field(s) {unknown}")
        missing = [f.name for f in fields(cls)
                   if f.name not in d and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ValueError(f"draft config: missing field(s) {missing}")
        return cls(**d)
