"""The shipped bundled model (models/ninfer-code-small.ninfer): intact, as its card says, and exact under
speculation. CI's deterministic gates on it live in test_ci_gate.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ninfer_bench.engine.artifact.reader import Artifact
from ninfer_bench.engine.artifact.loader import BUNDLED_NAME, default_model, load_source
from ninfer_bench.engine.runtime.engine import Engine

MODELS = Path(__file__).resolve().parent.parent / "models"
ART = MODELS / BUNDLED_NAME
PROMPTS = Path(__file__).resolve().parent.parent / "suites" / "data" / "heldout_prompts.jsonl"


def test_is_shipped_default_and_small():
    assert ART.is_file(), "the bundled model is committed: models/ninfer-code-small.ninfer"
    assert Path(default_model()).resolve() == ART.resolve()
    assert ART.stat().st_size <= 40 * 10**6


def test_every_object_verifies():
    with Artifact.open(ART) as art:
        results = art.verify()
    assert results and all(ok for _, ok, _ in results), [r for r in results if not r[1]]


def test_config_matches_the_card():
    card = json.loads((MODELS / "card_facts.json").read_text())
    loaded = load_source(str(ART))
    hf = loaded.config.to_hf()
    special = ("eos_token_id", "bos_token_id", "pad_token_id")  # the artifact keeps these with its tokenizer
    for key, want in card["model"]["config"].items():
        if key not in special:
            assert hf.get(key) == want, key
    assert card["model"]["config"]["eos_token_id"] in loaded.tokenizer.eos_ids
    text = (MODELS / "MODEL_CARD.md").read_text()
    m = card["model"]
    assert f"{m['layers']} layers" in text and f"hidden {m['hidden_size']}" in text
    assert card["export"]["sha256"][:16] in text
    assert set(loaded.drafters) >= {"dflash", "dflash2"} and loaded.config.mtp_num_hidden_layers == 1


def test_heldout_prompts_ship():
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    assert len(rows) == 64 and all(r["text"] for r in rows)


@pytest.mark.parametrize("spec,k", [("mtp", 3), ("dflash", 3), ("dflash2", 7)])
def test_speculation_equals_plain_greedy(spec, k):
    eng = Engine.load(str(ART), device="cpu", max_context=2048)
    prompts = [eng.tokenizer.encode(json.loads(line)["text"])[:300] for line in PROMPTS.read_text().splitlines()[:2]]
    want = [eng.generate(p, max_new_tokens=48, ignore_eos=True).tokens for p in prompts]
    fast = Engine.load(str(ART), device="cpu", max_context=2048, spec=spec, draft_tokens=k)
    for p, w in zip(prompts, want):
        res = fast.generate(p, max_new_tokens=48, ignore_eos=True)
        assert res.tokens == w
        assert res.spec["rounds"] < 48  # some drafts were accepted: the drafters are trained, not random
