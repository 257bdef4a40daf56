"""The deterministic CPU runs CI gates on, and their committed baselines (tests/baselines/).

Each run is greedy on the default model (the bundled one when shipped) with fixed options, so its exact
metrics (token hash, rounds, drafted and accepted tokens, acceptance per position, NIAH oracle agreement) must
not change unless the model or the engine's numerics change on purpose — then rebuild the baselines with
``python scripts/update_ci_baselines.py`` and say why in the commit.
"""

from __future__ import annotations

from pathlib import Path

from ..reports.gate import Rule
from .decode import DecodeOptions

BASELINES = Path(__file__).resolve().parent.parent / "tests" / "baselines"
DECODE_RUNS = {"none": ("none", None), "mtp3": ("mtp", 3), "dflash2-k7": ("dflash2", 7)}
EXACT_DECODE = [Rule(m, "exact") for m in ("tokens_sha256", "prompt_tokens", "completion_tokens", "rounds",
                                           "drafted_tokens", "accepted_tokens", "accepted_per_position")]
EXACT_NIAH = [Rule(m, "exact") for m in ("cases", "oracle_agreement", "first_divergence")]


def decode_options(name: str, model: str | None = None) -> DecodeOptions:
    spec, k = DECODE_RUNS[name]
    return DecodeOptions.make(model=model, device="cpu", dtype="fp32", kv_dtype="int8", spec=spec, draft_tokens=k,
                              max_new_tokens=48, repeats=1, warmup=0, label=f"ci-{name}")


def baseline_path(name: str) -> Path:
    return BASELINES / f"decode-{name}.json"
