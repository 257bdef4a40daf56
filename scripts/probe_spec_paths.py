"""Speculative decoding's launch paths against each other on one model (GPU): drafting captured or eager, PDL on
or off, several generates an engine. Prints, per generate, whether the tokens equal plain decoding's and the
acceptance (a path that changes the drafts shows as another acceptance); exits 1 when any differ.
``--stress`` runs a second process of back-to-back matmuls on the same GPU meanwhile: the GPU then switches between
the two, so kernels finish at other moments than alone - a launch path whose result depends on timing shows.
Usage: python3 scripts/probe_spec_paths.py [--spec mtp -k 3] [--generates 3] [--model tiny --dtype bf16] [--stress]"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()
from ninfer_bench.engine.runtime.engine import Engine  # noqa: E402
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
    ap.add_argument("--dtype", default=None, help="engine compute dtype (default: the engine's)")
    ap.add_argument("--kv-dtype", default=None)
    ap.add_argument("--max-context", type=int, default=None)
    ap.add_argument("--stress", action="store_true", help="a second process keeps the GPU busy meanwhile")
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
    base = {k: v for k, v in (("dtype", args.dtype), ("kv_dtype", args.kv_dtype), ("max_context", args.max_context))
            if v is not None}
    hog = subprocess.Popen([sys.executable, "-c", HOG]) if args.stress else None
    try:
        return probe(args, names, known, base)
    finally:
        if hog is not None:
            hog.kill()


HOG = "import torch\na = torch.randn(4096, 4096, device='cuda')\nwhile True:\n    a = (a @ a).clamp_(-1, 1)\n"


def probe(args, names, known, base) -> int:
    prompt, want, accepted, draft_sets, bad = None, None, set(), set(), 0
    for name in names:
        spec = {"spec": args.spec, "draft_tokens": args.k} if name != "plain" else {}
        eng = Engine.load(args.model, device="cuda", **{**base, **spec, **known[name]})
        prompt = prompt or load_prompts(str(DEFAULT_PROMPT), eng.tokenizer)[0]
        drafts = record_drafts(eng)
        for i in range(args.generates):
            drafts.clear()
            res = eng.generate(prompt, max_new_tokens=args.n, ignore_eos=True)
            want = want or res.tokens
            sha = hashlib.sha256(str(res.tokens).encode()).hexdigest()[:8]
            acc, drafted = res.spec.get("accepted_tokens"), res.spec.get("drafted_tokens")
            same = res.tokens == want
            bad += not same
            if acc is not None:
                accepted.add(acc)
            dsha = hashlib.sha256(str([d.tolist() for d in drafts]).encode()).hexdigest()[:8] if drafts else "-"
            if drafts:
                draft_sets.add(dsha)
            print(f"{name:16s} generate {i}: tokens {sha} {'= plain' if same else 'DIFFER FROM PLAIN'}, "
                  f"accepted {acc} of {drafted}, drafts {dsha}", flush=True)
    varies = "the same everywhere" if len(accepted) <= 1 else f"varies: {sorted(accepted)}"
    print(f"{bad} generate(s) differ from plain; acceptance {varies}; {len(draft_sets)} different draft sequence(s)")
    return 1 if bad or len(accepted) > 1 or len(draft_sets) > 1 else 0


def record_drafts(eng) -> list:
    """Every round's drafts [B, K] of ``eng``'s generates, kept on the device (no read between rounds)."""
    out = []
    if eng.drafter is None:
        return out
    draft = eng.drafter.draft

    def keep(seqs, k):
        toks, q = draft(seqs, k)
        out.append(toks.clone())
        return toks, q

    eng.drafter.draft = keep
    return out


if __name__ == "__main__":
    sys.exit(main())
