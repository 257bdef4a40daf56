"""The rank functions of tests/test_tensor_parallel.py, in a module of their own: a spawned rank finds a function by its
module's name, and the test modules' names (pytest's importlib mode) are not importable there; this one is, from the
tests folder on ``sys.path`` (the pytest config's ``pythonpath``)."""

from __future__ import annotations

PROMPT = [5, 17, 3, 99, 42, 7, 256, 300, 11, 64, 12, 500]


def _rank_run(rank: int, tp: int) -> dict:
    """One rank's engine on the tiny preset: the prompt's logits and 16 greedy tokens."""
    from ninfer_bench.engine.runtime.engine import Engine

    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_context=128, tensor_parallel=tp)
    logits = eng.logits(PROMPT)
    tokens = eng.generate(PROMPT, max_new_tokens=16, ignore_eos=True).tokens
    return {"logits": logits, "tokens": tokens, "heads": eng.model_config.num_attention_heads,
            "head_rows": eng.weights.linears["lm_head.weight"].out_features,
            "embed_rows": eng.weights.embeddings["model.embed_tokens.weight"].shape[0]}


def _spec_run(rank: int, tp: int) -> dict:
    """One rank's greedy tokens on the tiny preset, plain and with each drafter (MTP split like the model, the DFlash
    drafters whole on every rank, every head's logits gathered)."""
    from ninfer_bench.engine.runtime.engine import Engine

    out = {}
    for spec, k in (("none", 0), ("mtp", 3), ("dflash2", 7)):
        eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_context=128, tensor_parallel=tp, spec=spec,
                          draft_tokens=k)
        res = eng.generate(PROMPT, max_new_tokens=20, ignore_eos=True)
        out[spec] = (res.tokens, res.spec.get("rounds"))
    return out


def _fail_on_one(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank one breaks")
    return rank

def _die_on_one(rank: int) -> int:
    import os

    if rank == 1:
        os._exit(3)
    return rank
