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


def _mirrored_scheduler(rank: int, tp: int) -> list:
    """Rank 0: a Scheduler on a MirroredEngine (the others follow it, engine/runtime/mirror.lead_or_follow): requests
    of several kinds - greedy, seeded and unseeded sampling, one that finishes early, one cancelled while it waits -
    over two slots; returns [each request's tokens (rank 0; None elsewhere), the tokens this rank released (None on
    one rank)]."""
    from ninfer_bench.engine.runtime.engine import Engine
    from ninfer_bench.engine.runtime.mirror import lead_or_follow
    from ninfer_bench.engine.runtime.scheduler import Scheduler
    from ninfer_bench.engine.sampling import SamplingParams

    def run(engine) -> list:
        sched = Scheduler(engine)
        kinds = [SamplingParams(max_new_tokens=10, ignore_eos=True),
                 SamplingParams(max_new_tokens=9, ignore_eos=True, temperature=0.9, top_k=40, seed=5),
                 SamplingParams(max_new_tokens=3, ignore_eos=True),
                 SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.1, top_p=0.9),
                 SamplingParams(max_new_tokens=6, ignore_eos=True)]
        reqs = [sched.submit(PROMPT[: 5 + 2 * i], p) for i, p in enumerate(kinds)]
        sched.cancel(reqs[4])  # still waiting: it never reaches a slot
        sched.run_until_idle()
        return [r.tokens for r in reqs]

    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_context=128, max_concurrency=2,
                      tensor_parallel=tp, prefill_chunk=8, interleave_chunk=4)
    return [run(eng), None] if tp == 1 else list(lead_or_follow(eng, run))


def _fused_run(rank: int, tp: int, kernels: str = "triton") -> dict:
    """One rank's greedy tokens on the tiny preset through the fused kernels (v3's decode / verify path; Triton's
    interpreter without CUDA; ``kernels`` torch: the eager path instead), plain and with MTP3, int8 K/V."""
    import triton_interp  # noqa: F401  (before triton is imported: the interpreter without CUDA)
    from ninfer_bench.engine.runtime.engine import Engine

    out = {}
    for spec, k, n in (("none", 0, 4), ("mtp", 3, 3)):  # (the interpreter: about 1.5 s a step, 7 s a round)
        eng = Engine.load("tiny", device="cpu", kv_dtype="int8", dtype="fp32", kernels=kernels, max_context=128,
                          tensor_parallel=tp, spec=spec, draft_tokens=k or None)
        assert (eng.model.fast is not None) == (kernels == "triton")
        res = eng.generate(PROMPT, max_new_tokens=n, ignore_eos=True)
        out[spec] = res.tokens
    return out
