"""Speculative decoding's launch paths against each other on one model (GPU): drafting captured or eager, PDL on
or off, several generates an engine. Prints, per generate, whether the tokens equal plain decoding's and the
acceptance (a path that changes the drafts shows as another acceptance); exits 1 when any differ.
Usage: python3 scripts/probe_spec_paths.py [--spec mtp -k 3] [--generates 3]"""

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
    ap.add_argument("--paths", default="plain,captured,eager-draft,nopdl,nopdl-eager-draft",
                    help="plain first: the others are checked against its tokens")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_spec_paths: needs a CUDA GPU", file=sys.stderr)
        return 2
    known = {"plain": dict(spec="none"), "captured": {}, "eager-draft": dict(draft_graphs=False),
             "nopdl": dict(pdl=False), "nopdl-eager-draft": dict(draft_graphs=False, pdl=False)}
    names = args.paths.split(",")
    unknown = [n for n in names if n not in known]
    if unknown or names[0] != "plain":
        print(f"probe_spec_paths: --paths starts with plain and names some of {', '.join(known)}", file=sys.stderr)
        return 2
    prompt, want, accepted, bad = None, None, set(), 0
    for name in names:
        eng = Engine.load(args.model, device="cuda", **{"spec": args.spec, "draft_tokens": args.k, **known[name]})
        prompt = prompt or load_prompts(str(DEFAULT_PROMPT), eng.tokenizer)[0]
        for i in range(args.generates):
            res = eng.generate(prompt, max_new_tokens=args.n, ignore_eos=True)
            want = want or res.tokens
            sha = hashlib.sha256(str(res.tokens).encode()).hexdigest()[:8]
            acc, drafted = res.spec.get("accepted_tokens"), res.spec.get("drafted_tokens")
            same = res.tokens == want
            bad += not same
            if acc is not None:
                accepted.add(acc)
            print(f"{name:16s} generate {i}: tokens {sha} {'= plain' if same else 'DIFFER FROM PLAIN'}, "
                  f"accepted {acc} of {drafted}", flush=True)
    varies = "the same everywhere" if len(accepted) <= 1 else f"varies: {sorted(accepted)}"
    print(f"{bad} generate(s) differ from plain; acceptance {varies}")
    return 1 if bad or len(accepted) > 1 else 0


if __name__ == "__main__":
    sys.exit(main())
