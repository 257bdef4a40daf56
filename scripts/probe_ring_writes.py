#!/usr/bin/env python3
"""What DFlash2's acceptance was on a GPU before its window ring's prompt writes were fixed, measured on a CPU.

    python3 scripts/probe_ring_writes.py [--prompts 8] [-n 256] [--prompt-file suites/data/heldout_prompts.jsonl]

DFlash2 keeps its drafter context in a ring of ``window`` entries, position ``p`` at entry ``p % window``. Before
the fix, a prompt chunk longer than the window (prefill chunks are 2,048 tokens, the window 512) was written in one
scatter in which several positions land on one entry; a CPU keeps the last write, a CUDA scatter keeps either, and
the K/V tensor and the position table are two scatters, so an entry could hold one token's keys under another's
position. Drafts go wrong, tokens stay right (verification), acceptance drops.

This probe runs the bundled model's DFlash2 K=7 over held-out prompts twice in one process, greedy, on the CPU:
``engine``, the ring as the engine writes it now; ``mixed``, the prompt's ring written as a CUDA scatter may have
resolved the old writes (each entry's K/V from the oldest position written to it, its position from the newest).
Both decode plain greedy's tokens; only the tokens a round differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _bootstrap

_bootstrap.ensure_package()

import torch  # noqa: E402

from ninfer_bench.engine.runtime.engine import Engine  # noqa: E402
from ninfer_bench.engine.spec.drafters import BlockDraftRunner  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def begin_mixed(self: BlockDraftRunner, seq, start, hidden, taps) -> None:
    """The old ``begin`` (every prompt position of the chunk written), each ring entry's K/V taken from the oldest
    position written to it and its position from the newest."""
    if start == 0:
        self.pos[seq.slot] = -1
    pos = torch.arange(start, start + taps.shape[0], device=self.e.device)[None]
    ks, vs = self.net.context_kv(self.net.context(taps[None].to(self.e.dtype)), pos)
    idx = pos[0] % self.cap if self.window else pos[0]
    for j in reversed(range(pos.shape[1])):  # oldest last: its K/V stay
        for layer in range(len(ks)):
            self.kv[0, layer, seq.slot, idx[j]] = ks[layer][0, j]
            self.kv[1, layer, seq.slot, idx[j]] = vs[layer][0, j]
    self.pos[seq.slot, idx] = pos[0]  # a CPU scatter: the newest position stays


def run(eng: Engine, prompts: list[list[int]], new: int) -> dict:
    rounds = accepted = 0
    shas = []
    for ids in prompts:
        r = eng.generate(ids, max_new_tokens=new, ignore_eos=True)
        rounds += r.spec["rounds"]
        accepted += r.spec["accepted_tokens"]
        shas.append(tuple(r.tokens))
    return {"rounds": rounds, "accepted": accepted, "tokens_per_round": round((rounds + accepted) / rounds, 3),
            "tokens": shas}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-file", type=Path, default=REPO / "suites" / "data" / "heldout_prompts.jsonl")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("-n", "--new", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    eng = Engine.load(str(REPO / "models" / "ninfer-code-small.ninfer"), device="cpu", spec="dflash2", draft_tokens=7)
    texts = [json.loads(ln)["text"] for ln in args.prompt_file.read_text().splitlines()][: args.prompts]
    prompts = [eng.tokenizer.encode(t) for t in texts]
    print(f"{len(prompts)} prompts, {min(map(len, prompts))}-{max(map(len, prompts))} tokens, window "
          f"{eng.drafter.window}, prefill chunk {eng.options.prefill_chunk}", flush=True)
    out = {"engine": run(eng, prompts, args.new)}
    saved = BlockDraftRunner.begin
    BlockDraftRunner.begin = begin_mixed
    try:
        out["mixed"] = run(eng, prompts, args.new)
    finally:
        BlockDraftRunner.begin = saved
    same = out["engine"].pop("tokens") == out["mixed"].pop("tokens")
    for k, v in out.items():
        print(f"  {k:6s} tokens a round {v['tokens_per_round']:.3f} ({v['rounds']} rounds, {v['accepted']} drafts "
              f"accepted)")
    print(f"  same tokens: {same}")
    if args.json:
        args.json.write_text(json.dumps({**out, "same_tokens": same, "prompts": len(prompts), "new": args.new},
                                        indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
