"""The rank functions of tests/test_tensor_parallel.py, in a module of their own: a spawned rank finds a function by its
module's name, and the test modules' names (pytest's importlib mode) are not importable there; this one is, from the
tests folder on ``sys.path`` (the pytest config's ``pythonpath``)."""

from __future__ import annotations

import math

PROMPT = [5, 17, 3, 99, 42, 7, 256, 300, 11, 64, 12, 500]


def _rank_run(rank: int, tp: int) -> dict:
    """One rank's engine on the tiny preset: the prompt's logits and 16 greedy tokens."""
    from ninfer_bench.engine.runtime.engine import Engine

    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", max_context=128, tensor_parallel=tp)
    logits = eng.logits(PROMPT)
    tokens = eng.generate(PROMPT, max_new_tokens=16, ignore_eos=True).tokens
    return {"logits": logits, "tokens": tokens, "heads": eng.model_config.num_attention_heads,
            "head_rows": eng.weights.linears["lm_head.weight"].out_features,
            "embed_rows": eng.weights.embeddings["model.embed_tokens.weight"].shape[0],
            "shard": eng.loaded.tp_shard, "step_bytes": eng.weight_bytes_per_step,
            "loaded_qkv_rows": eng.loaded.raws["model.layers.0.linear_attn.in_proj_qkv.weight"].shape[0]}


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


def _ipc_part(case: int, rank: int, n: int, dtype, device):
    """Rank ``rank``'s input of IPC case ``case``: n values drawn from a seed of (case, rank), any rank can make it."""
    import torch

    g = torch.Generator().manual_seed(1000 * case + rank)
    return (torch.randn(n, generator=g) * 3).to(dtype).to(device)


def _ipc_on_cpu(rank: int) -> str | None:
    """create on CPU ranks: None and why not (the same on every rank)."""
    import torch

    from ninfer_bench.kernels import ipc_collectives as ic

    coll, why = ic.create(rank, 2, torch.device("cpu"))
    assert coll is None
    return why


def _ipc_collectives(rank: int, size: int) -> dict:
    """One rank's checks of kernels/ipc_collectives.py against the sums and concatenations torch makes of every
    rank's inputs: sizes on and off 16-byte vectors, an unaligned view, pieces of a message over the (small) buffer,
    the gather, and a reduce captured in a CUDA graph and replayed with new inputs."""
    import torch
    import torch.distributed as dist

    from ninfer_bench.kernels import ipc_collectives as ic

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    coll, why = ic.create(rank, size, dev, max_bytes=64 << 10)
    if coll is None:
        return {"why": why}

    def want_sum(case, n, dtype):
        parts = [_ipc_part(case, r, n, dtype, dev).float() for r in range(size)]
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc.to(dtype)

    out = {"why": None, "reduce": [], "gather": [], "graph": []}
    cases = [(torch.bfloat16, 5120), (torch.float16, 77), (torch.float32, 3001), (torch.bfloat16, 100_003),
             (torch.float32, 40_000), (torch.bfloat16, 8 * 5120)]
    for case, (dt, n) in enumerate(cases):
        got = coll.reduce_(_ipc_part(case, rank, n, dt, dev))
        out["reduce"].append(bool(torch.equal(got, want_sum(case, n, dt))))
    whole = torch.zeros(4097, dtype=torch.bfloat16, device=dev)  # a view 2 bytes past a 16-byte boundary
    whole[1:] = _ipc_part(90, rank, 4096, torch.bfloat16, dev)
    coll.reduce_(whole[1:])
    out["reduce"].append(bool(torch.equal(whole[1:], want_sum(90, 4096, torch.bfloat16))))
    # one row; a few rows; rows in pieces of whole rows; rows longer than the buffer, in column blocks
    for case, (dt, shape) in enumerate(((torch.float32, (1, 1000)), (torch.bfloat16, (3, 77)),
                                        (torch.float32, (300, 1000)), (torch.float16, (2, 5, 40_000))), start=50):
        parts = [_ipc_part(case, r, math.prod(shape), dt, dev).view(shape) for r in range(size)]
        out["gather"].append(bool(torch.equal(coll.gather_last(parts[rank]), torch.cat(parts, dim=-1))))
    static = torch.zeros(6000, dtype=torch.bfloat16, device=dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        coll.reduce_(static)  # a warm-up outside the capture, as the engine's
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        coll.reduce_(static)
    for case in range(70, 73):
        static.copy_(_ipc_part(case, rank, 6000, torch.bfloat16, dev))
        graph.replay()
        out["graph"].append(bool(torch.equal(static, want_sum(case, 6000, torch.bfloat16))))
    torch.cuda.synchronize(dev)
    dist.barrier()  # every rank done with the others' regions before any frees its own
    coll.close()
    return out


def _ipc_engine(rank: int, tp: int, ipc: bool) -> dict:
    """One rank's greedy tokens on the tiny preset on the GPU, plain and MTP3, with its collectives through CUDA IPC
    (captured in the engine's graphs) or through torch.distributed (NINFER_BENCH_TP_IPC=0: eager)."""
    import os

    from ninfer_bench.engine.runtime.engine import Engine

    os.environ["NINFER_BENCH_TP_IPC"] = "1" if ipc else "0"
    out = {}
    for spec, k in (("none", 0), ("mtp", 3)):
        eng = Engine.load("tiny", device="cuda", kv_dtype="int8", max_context=128, tensor_parallel=tp, spec=spec,
                          draft_tokens=k or None)
        out[spec] = eng.generate(PROMPT, max_new_tokens=24, ignore_eos=True).tokens
        out["graphs"] = eng.graphs is not None
        out["why"] = eng.tp_ipc_off
    return out
