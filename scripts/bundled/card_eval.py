#!/usr/bin/env python3
"""The model card's measurements on any machine, from what ships: the artifact and the held-out prompts.

    python3 scripts/bundled/card_eval.py [--device cpu] [--niah RESULT.json]

Held-out loss through the engine (the shipped weights, fp32 compute) over the held-out code prefixes in
``suites/data/heldout_prompts.jsonl``; speculative acceptance for MTP 1-4 and DFlash / DFlash2 K = 3, 7, 11, 15
on the first ``--prompts`` of them (greedy, and checked to equal plain greedy); needle retrieval by context
length from a ``ninfer-bench niah`` result document (``--niah``: the grid is long, so it is run where a GPU is).
The results replace ``eval`` in ``models/card_facts.json`` and the card is rewritten. The build's own evaluation
(the last part of ``train_bundled.py``) measures the same on the GPU when its time budget allows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bundled import card, evaluate  # noqa: E402
from ninfer_bench.engine.artifact.loader import BUNDLED_NAME  # noqa: E402
from ninfer_bench.engine.runtime.engine import Engine  # noqa: E402

REPO = HERE.parent.parent
PLAN = [("mtp", 1), ("mtp", 2), ("mtp", 3), ("mtp", 4), ("dflash", 3), ("dflash", 7), ("dflash", 11),
        ("dflash", 15), ("dflash2", 3), ("dflash2", 7), ("dflash2", 11), ("dflash2", 15)]


def heldout_loss(art: Path, prompts: list[list[int]], device: str) -> dict:
    """Mean next-token loss of the shipped weights over the held-out prompts (each scored from its own start)."""
    eng = Engine.load(str(art), device=device, dtype="fp32", kv_dtype="fp32", max_context=max(map(len, prompts)) + 8)
    total, count = 0.0, 0
    for ids in prompts:
        logits = eng.logits(ids)
        total += float(F.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    return {"loss": total / count, "tokens": count, "prompts": len(prompts),
            "source": "engine, fp32 compute over the artifact's weights, suites/data/heldout_prompts.jsonl"}


def needles_from(doc: dict, path: Path) -> dict:
    """A ``niah`` result document as the card's needle facts."""
    cases = [{"length": r["ctx"], "depth": r["depth"] / 100, "prompt_tokens": r["prompt_tokens"],
              "value": r["value"], "answer": r["answer"], "retrieved": r["retrieved"]} for r in doc["records"]]
    by = doc["summary"]["retrieval_by_ctx"]
    env = doc.get("env", {})
    return {"runtime": doc["config"].get("runtime"), "cases": cases, "retrieval_by_length": by,
            "source": f"{path.name}: ninfer-bench niah on {env.get('gpu') or env.get('cpu')}, "
                      f"kv {doc['config'].get('kv_dtype')}, {doc['summary'].get('seconds', 0):.0f} s"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, default=REPO / "models")
    ap.add_argument("--prompts-file", type=Path, default=REPO / "suites" / "data" / "heldout_prompts.jsonl")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts for the acceptance rows")
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt for the acceptance rows")
    ap.add_argument("--minutes", type=float, default=30.0, help="acceptance rows left after this are skipped")
    ap.add_argument("--niah", type=Path, default=None, help="a niah result document for the needle table")
    args = ap.parse_args(argv)
    art, facts_path = args.models / BUNDLED_NAME, args.models / "card_facts.json"
    facts = json.loads(facts_path.read_text())
    eng = Engine.load(str(art), device="cpu")
    prompts = [eng.tokenizer.encode(json.loads(ln)["text"]) for ln in args.prompts_file.read_text().splitlines()]
    t0 = time.perf_counter()
    ev = {"device": torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} "
          "threads)", "measured_by": "scripts/bundled/card_eval.py"}
    ev["heldout"] = evaluate.guarded(heldout_loss, art, prompts, args.device)
    print(f"held-out loss: {ev['heldout']}", flush=True)
    sel = prompts[: args.prompts]
    ev["acceptance"] = evaluate.guarded(evaluate.acceptance, art, sel, PLAN, args.new, torch.device(args.device),
                                        t0 + args.minutes * 60, max(map(len, sel)) + args.new + 16)
    for r in ev["acceptance"].get("rows", []):
        print(f"  {r['spec']} k={r['k']}: " + (f"tokens/round {r['tokens_per_round']:.2f} acceptance "
              f"{r['acceptance_rate']:.3f} matches greedy {r['matches_greedy']}" if "tokens_per_round" in r
              else str(r.get("skipped") or r.get("error"))), flush=True)
    if args.niah:
        ev["needles"] = needles_from(json.loads(args.niah.read_text()), args.niah)
    elif "needles" in facts.get("eval", {}):
        ev["needles"] = facts["eval"]["needles"]
    ev["seconds"] = round(time.perf_counter() - t0, 1)
    facts["eval"] = ev
    facts_path.write_text(json.dumps(facts, indent=1, default=str))
    log = [json.loads(ln) for ln in (args.models / "train_log.jsonl").read_text().splitlines() if ln.strip()]
    print(f"wrote {card.write(args.models, facts, log)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
