"""Speculative decoding's launch paths against each other on one model (GPU): drafting captured or eager, PDL on
or off. Prints, per path, the acceptance and whether the tokens equal plain decoding's - a drafting path that
changes the drafts shows as a different acceptance. Usage: python3 scripts/probe_spec_paths.py [--spec mtp -k 3]"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()
from ninfer_bench.engine.runtime import Engine  # noqa: E402
from ninfer_bench.suites.common import DEFAULT_PROMPT  # noqa: E402
from ninfer_bench.suites.decode import load_prompts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--spec", default="mtp")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--generates", type=int, default=3, help="generate calls per engine (state left by earlier "
                                                                "calls shows in later ones)")
    ap.add_argument("--paths", default="plain,default,eager-draft,no-pdl,eager-draft-no-pdl")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_spec_paths: needs a CUDA GPU", file=sys.stderr)
        return 2
    known = {"plain": dict(spec="none"), "default": {}, "eager-draft": dict(draft_graphs=False),
             "no-pdl": dict(pdl=False), "eager-draft-no-pdl": dict(draft_graphs=False, pdl=False)}
    prompt = None
    for name in args.paths.split(","):
        eng = Engine.load(args.model, device="cuda", **{"spec": args.spec, "draft_tokens": args.k, **known[name]})
        prompt = prompt or load_prompts(str(DEFAULT_PROMPT), eng.tokenizer)[0]
        for i in range(args.generates):
            res = eng.generate(prompt, max_new_tokens=args.n, ignore_eos=True)
            sha = hashlib.sha256(str(res.tokens).encode()).hexdigest()[:8]
            acc, drafted = res.spec.get("accepted_tokens"), res.spec.get("drafted_tokens")
            print(f"{name:20s} generate {i}: tokens {sha} accepted {acc} of {drafted}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
