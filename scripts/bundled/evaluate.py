"""The card's measurements: held-out loss (transformers), the artifact's logits error, and, through the engine
on the exported artifact, speculative acceptance and needle retrieval.

Every engine measurement is guarded: an error is recorded in the facts (``error``) instead of losing the run,
and a deadline stops the remaining cases (recorded as ``skipped``). Acceptance rows also say whether the
speculative tokens equal plain greedy decoding (they must).
"""

from __future__ import annotations

import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F

from ninfer_bench.engine.runtime.engine import Engine

from .corpus import build_haystack, make_needle
from .target import run


def guarded(fn, *args, **kwargs) -> dict:
    """``fn(...)``'s dict, or ``{"error": ...}`` when it raises."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # record whatever the engine or kernels raise: the weights still ship
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}


@torch.no_grad()
def heldout_loss(model, stream: np.ndarray, seq_len: int, max_windows: int, batch: int, device) -> dict:
    """Mean next-token loss of the target over the first ``max_windows`` windows of the held-out stream."""
    n = min(max_windows, (len(stream) - 1) // seq_len)
    if n < 1:
        return {"error": f"held-out stream of {len(stream)} tokens is shorter than one window of {seq_len}"}
    rows = np.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int64)
    total, count = 0.0, 0
    model.eval()
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    for i in range(0, n, batch):
        x = torch.from_numpy(rows[i:i + batch]).to(device)
        with amp:
            hidden, _ = run(model, x[:, :-1])
            logits = model.lm_head(hidden).float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"))
        count += x[:, 1:].numel()
    return {"loss": total / count, "tokens": count, "windows": n, "seq_len": seq_len}


@torch.no_grad()
def quant_error(path, model, ids: list[int], device) -> dict:
    """The artifact's logits (engine) against the fp32 transformers model on ``ids``: relative RMS, top-1."""
    eng = Engine.load(str(path), device=device.type, max_context=len(ids) + 8)
    ours = eng.logits(ids)
    model.float().eval()
    hidden, _ = run(model, torch.tensor([ids], device=device))
    ref = model.lm_head(hidden)[0].float().cpu()
    rel = float((ours.double() - ref.double()).norm() / ref.double().norm())
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    return {"rel_rms": rel, "top1_agreement": top1, "tokens": len(ids), "engine_dtype": str(eng.dtype)}


def acceptance(path, prompts: list[list[int]], plan, max_new: int, device, deadline: float, max_context: int,
               runtime: str = "v3") -> dict:
    """Speculative decoding statistics per (spec, K) over ``prompts``, greedy, ``max_new`` tokens each."""
    plain = Engine.load(str(path), device=device.type, max_context=max_context, runtime=runtime)
    ref = [plain.generate(p, max_new_tokens=max_new, ignore_eos=True).tokens for p in prompts]
    del plain
    rows = []
    for spec, k in plan:
        if time.perf_counter() > deadline:
            rows.append({"spec": spec, "k": k, "skipped": "evaluation time budget"})
            continue
        rows.append(guarded(_spec_row, path, prompts, ref, spec, k, max_new, device, max_context, runtime))
        rows[-1].update(spec=spec, k=k)
    return {"runtime": runtime, "prompts": len(prompts), "max_new_tokens": max_new, "rows": rows}


def _spec_row(path, prompts, ref, spec, k, max_new, device, max_context, runtime) -> dict:
    eng = Engine.load(str(path), device=device.type, max_context=max_context, runtime=runtime, spec=spec,
                      draft_tokens=k)
    rounds = drafted = accepted = 0
    per = np.zeros(k)
    same, t0 = True, time.perf_counter()
    for p, want in zip(prompts, ref):
        res = eng.generate(p, max_new_tokens=max_new, ignore_eos=True)
        st = res.spec
        rounds += st.get("rounds", 0)
        drafted += st.get("drafted_tokens", 0)
        accepted += st.get("accepted_tokens", 0)
        per += np.array(st.get("accepted_per_position", [0] * k))
        same &= res.tokens == want
    return {"rounds": rounds, "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "tokens_per_round": 1 + accepted / rounds if rounds else None,
            "accepted_per_position": (per / max(1, rounds)).round(4).tolist(), "matches_greedy": same,
            "seconds": round(time.perf_counter() - t0, 2)}


def needles(path, filler_ids: list[int], tok, lengths, depths, device, deadline: float, seed: int,
            runtime: str = "v3") -> dict:
    """Greedy needle retrieval through the engine: one case per (context length, depth); a case passes when
    the answer contains the value."""
    encode = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    eng = Engine.load(str(path), device=device.type, max_context=max(lengths), runtime=runtime,
                      prefill_chunk=2048 if device.type == "cuda" else 512)
    rng = np.random.default_rng(seed)
    cases = []
    for n in lengths:
        for depth in depths:
            key, value = make_needle(rng)
            if time.perf_counter() > deadline:
                cases.append({"length": n, "depth": depth, "skipped": "evaluation time budget"})
                continue
            ids = encode(build_haystack(filler_ids, decode, n - 16, depth, key, value, encode))
            ids = ids[max(0, len(ids) - (n - 10)):]  # re-encoding may add a few tokens: drop them at the front
            res = eng.generate(ids, max_new_tokens=10)
            answer = decode(res.tokens)
            cases.append({"length": n, "depth": depth, "prompt_tokens": len(ids), "value": value,
                          "answer": answer, "retrieved": str(value) in answer})
    by_len = {}
    for c in cases:
        if "retrieved" in c:
            by_len.setdefault(c["length"], []).append(c["retrieved"])
    return {"runtime": runtime, "cases": cases,
            "retrieval_by_length": {str(n): sum(v) / len(v) for n, v in by_len.items()}}
