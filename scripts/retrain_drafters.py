#!/usr/bin/env python3
"""Train the bundled model's DFlash / DFlash2 drafters further on its frozen target, as shipped, and put them into
a copy of the artifact whose target, MTP head and tokenizer bytes are unchanged (so greedy decoding is too).

    python3 scripts/retrain_drafters.py --out /tmp/redraft --ship $OUT --minutes 5.5      # on the GPU
    python3 scripts/retrain_drafters.py --out /tmp/redraft --ship $OUT --labels path --kinds dflash2 \
        --blocks 4,8,12,8,16,8 --minutes 5.5                                              # labels on the greedy path
    python3 scripts/retrain_drafters.py --out /tmp/redraft --ship $OUT --data mix --labels path --kinds dflash2 \
        --gen-sequences 16384 --gen-batch 64 --gen-minutes 1.5 --minutes 4                 # + the target's own text
    python3 scripts/retrain_drafters.py join SHIPDIR                                     # back here

The run: the corpus and its token streams as ``train_bundled.py`` makes them, with the artifact's own tokenizer;
the target from the artifact's weights (dequantized into transformers' ``Qwen3_5ForCausalLM``: the weights the
engine serves, so the labels are its greedy tokens); the drafters from the artifact (``--fresh``: newly
initialised); ``bundled/drafters.py``'s training of the ``--kinds`` drafters for ``--minutes`` (``--labels``: see
``DrafterOptions``; ``--data self|mix``: on the target's own greedy continuations of training-code prefixes,
``bundled/selfgen.py``, alone or mixed with corpus rows) with the MTP head (and any drafter not named) left alone;
the new artifact (``bundled/graft.py``); then the acceptance of the old and the new drafters on the same held-out
prompts, in the same run, within ``--minutes-eval``. The new artifact ships in parts with ``retrain_facts.json`` and the training
log. ``join`` checks and installs the artifact into ``models/`` and records the run in ``card_facts.json`` and
``train_log.jsonl``; ``scripts/bundled/card_eval.py`` then re-measures the card.
"""

from __future__ import annotations

import time

START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

import numpy as np  # noqa: E402
import torch  # noqa: E402

import train_bundled as tb  # noqa: E402
from bundled import card, drafters, evaluate, export, graft, selfgen, target, tok  # noqa: E402
from bundled.batches import Batches  # noqa: E402
from ninfer_bench.engine.artifact.reader import Artifact  # noqa: E402
from ninfer_bench.engine.artifact.loader import BUNDLED_NAME, load_artifact  # noqa: E402
from ninfer_bench.engine.model.dflash import BlockDrafter  # noqa: E402
from ninfer_bench.suites.hf_peer import transformers_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KINDS = ("dflash", "dflash2")
PLAN = [("dflash2", 7), ("dflash", 7), ("dflash2", 3)]  # the main job's drafter first
FACTS, LOG = "retrain_facts.json", "retrain_log.jsonl"


def token_streams(args, p: tb.Preset, w: tb.Work) -> dict:
    """Corpus, token streams and held-out prompts as the build makes them, with the artifact's tokenizer."""
    with Artifact.open(args.artifact) as a:
        w.tokenizer.mkdir(parents=True, exist_ok=True)
        (w.tokenizer / "tokenizer.json").write_bytes(a.blob("tokenizer.json"))
    facts = {"corpus": tb.stage_corpus(args, p, w)}
    # stage_tokenizer keeps a tokenizer it is given; it draws the held-out prompts with seed 0, as the build did, so
    # the before / after comparison uses the same prompts in every run, whatever --seed trains with
    reuse = argparse.Namespace(resume=True, seed=0)
    facts["tokenizer"] = tb.stage_tokenizer(reuse, p, w)
    return facts


def starting_drafters(loaded, p: tb.Preset, fresh: bool, seed: int) -> dict[str, BlockDrafter]:
    cfg = loaded.config
    missing = [k for k in KINDS if k not in loaded.drafters]
    if missing and not fresh:
        raise SystemExit(f"the artifact has no {missing} drafter to continue from: pass --fresh")
    if fresh:
        mask = loaded.tokenizer.token_to_id(tok.MASK)
        if mask is None:
            raise SystemExit(f"--fresh: the artifact's tokenizer has no {tok.MASK} token to fill the drafters' blocks")
        return drafters.new_drafters(cfg, p.shape, mask, seed)
    return {k: BlockDrafter.from_raws(*loaded.drafters[k], cfg.hidden_size, cfg.vocab_size) for k in KINDS}


def run(args) -> None:
    p = tb.PRESETS["tiny" if args.tiny else "full"]
    w = tb.Work(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    facts = {"data": token_streams(args, p, w)}
    facts["data"]["seconds"] = round(time.time() - t0, 1)
    print(f"token streams ready in {facts['data']['seconds']} s", flush=True)

    loaded = load_artifact(args.artifact)
    cfg, device = loaded.config, args.device
    model = transformers_model(loaded, device, torch.float32)  # bf16 autocast in training, as the build
    facts["gdn"] = target.gdn_kernels(device)
    nets = {k: n for k, n in starting_drafters(loaded, p, args.fresh, args.seed).items() if k in args.kinds}
    tk = tok.load(w.tokenizer)
    log = tb.log_to(args.out / LOG, "drafters")  # its own log file: every row is this run's
    stream, newline = np.load(w.tokens / "train.npy"), tok.newline_mask(tk, cfg.vocab_size)
    corpus_rows = Batches(stream, p.d_seq_len, args.batch or p.d_batch, args.seed + 7, 0.0,
                          lambda s: tk.encode(s, add_special_tokens=False).ids, newline)
    own = None
    if args.data == "corpus":
        batches = corpus_rows
    else:
        gen = self_generated(args, p, stream, newline, tk, device)
        facts["selfgen"] = {k: v for k, v in gen.items() if k not in ("groups", "prompt_lengths")}
        own = selfgen.SelfBatches(gen, args.batch or p.d_batch, args.seed + 11)
        batches = own if args.data == "self" else selfgen.Mixed(own, corpus_rows, args.self_fraction, args.seed + 13)
    opts = drafters.DrafterOptions(seq_len=p.d_seq_len, batch=args.batch or p.d_batch, lr=args.lr or p.d_lr,
                                   mtp_lr=p.d_mtp_lr,
                                   warmup=p.d_warmup, budget_s=args.minutes * 60, max_steps=args.steps or p.d_steps,
                                   block_tokens=p.block_tokens, block_sizes=args.blocks, labels=args.labels)
    facts["drafters"] = drafters.train(model, None, nets, batches, opts, device, args.seed, log)
    if args.data != "corpus":  # how often each self-generated row was seen (a set seen many times is memorised)
        facts["selfgen"]["epochs"] = round(own.rows / max(1, gen["sequences"]), 2)
        print(f"self-generated rows seen {facts['selfgen']['epochs']} times each on average", flush=True)
    facts["drafters"].update(warm_start=not args.fresh, params={k: drafters.param_count(n) for k, n in nets.items()},
                             kinds=sorted(nets), data=args.data)
    del model

    new = w.export / BUNDLED_NAME
    w.export.mkdir(parents=True, exist_ok=True)
    note = {"by": "scripts/retrain_drafters.py", "steps": facts["drafters"]["steps"],
            "seconds": facts["drafters"]["seconds"], "warm_start": not args.fresh}
    facts["artifact"] = graft.replace_drafters(args.artifact, {k: n.cpu() for k, n in nets.items()}, new, note)
    facts["artifact"].update(bytes=new.stat().st_size, sha256=export.sha256(new))
    facts["acceptance"] = compare(args, p, w, tk, new)
    args.ship.mkdir(parents=True, exist_ok=True)
    facts["artifact"]["parts"] = export.split(new, args.ship, beside=2)
    facts.update(command=" ".join(["python3", "scripts/retrain_drafters.py", *args.argv]), seed=args.seed,
                 versions=tb.versions(), seconds=round(time.time() - START, 1),
                 device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    (args.ship / FACTS).write_text(json.dumps(facts, indent=1, default=str))
    shutil.copyfile(args.out / LOG, args.ship / LOG)
    print(f"shipped {facts['artifact']['parts']} + {FACTS}, {LOG}; total {facts['seconds']} s", flush=True)


def self_generated(args, p: tb.Preset, stream, newline, tk, device) -> dict:
    """The target's greedy continuations (``bundled/selfgen.py``), read back from ``OUT/selfgen.npz`` when an
    earlier run with the same settings left them there."""
    eot = tk.token_to_id(tok.EOT)
    opts = selfgen.GenOptions(sequences=args.gen_sequences, new_tokens=args.gen_tokens, batch=args.gen_batch,
                              prompt_tokens=args.gen_prompt_tokens or p.prompt_tokens, budget_s=args.gen_minutes * 60,
                              seed=args.seed)
    path, meta = args.out / "selfgen.npz", args.out / "selfgen.json"
    key = {"sequences": opts.sequences, "new_tokens": opts.new_tokens, "prompt_tokens": list(opts.prompt_tokens),
           "seed": opts.seed, "artifact": export.sha256(args.artifact), "train_tokens": int(len(stream))}
    if path.is_file() and meta.is_file() and json.loads(meta.read_text()).get("key") == key:
        got = selfgen.load(path)
        print(f"self-generated data read back: {got['sequences']} sequences from {path}", flush=True)
        return {**got, **json.loads(meta.read_text())["facts"], "reused": True}
    got = selfgen.generate(args.artifact, stream, eot, newline, opts, device)
    print(f"self-generated {got['sequences']} sequences x {got['new_tokens']} tokens in {got['seconds']} s "
          f"({got['tok_s']:,} tokens/s)", flush=True)
    selfgen.save(path, got)
    facts = {k: v for k, v in got.items() if k not in ("groups", "prompt_lengths")}
    meta.write_text(json.dumps({"key": key, "facts": facts}, indent=1))
    return got


def compare(args, p: tb.Preset, w: tb.Work, tk, new: Path) -> dict:
    """Acceptance of the artifact's drafters and of the retrained ones on the same held-out prompts (greedy)."""
    prompts = [tk.encode(json.loads(ln)["text"], add_special_tokens=False).ids
               for ln in w.prompts.read_text().splitlines()][: args.eval_prompts or p.eval_prompts]
    new_tokens = args.eval_new or p.eval_new
    ctx = max(len(x) for x in prompts) + new_tokens + 16
    t0 = time.perf_counter()
    out = {}
    for i, (label, path) in enumerate((("before", args.artifact), ("after", new))):
        deadline = t0 + args.minutes_eval * 60 * (i + 1) / 2
        out[label] = tb.with_fallback(evaluate.acceptance, path, prompts, PLAN, new_tokens, args.device, deadline,
                                      ctx)
        for r in out[label].get("rows", []):
            print(f"  {label} {r['spec']} k={r['k']}: " + (f"tokens/round {r['tokens_per_round']:.2f}, matches "
                  f"greedy {r['matches_greedy']}" if "tokens_per_round" in r else str(r.get("skipped")
                                                                                       or r.get("error"))), flush=True)
    return out


# ---- back here --------------------------------------------------------------------------------------------------
def join(ship: Path, models: Path) -> Path:
    """Install the shipped artifact (its SHA-256 checked) and record the run in card_facts.json (the drafters'
    facts: totals over the runs when the retraining continued the shipped drafters, each run in ``retrained``) and
    train_log.jsonl (its rows continue the drafter curve, marked ``retrain``); then rewrite the card."""
    if not (ship / FACTS).is_file():
        raise SystemExit(f"{ship}: no {FACTS} there: pass the folder a run of this script shipped its files to")
    facts = json.loads((ship / FACTS).read_text())
    art, new = facts["artifact"], facts["drafters"]
    card_path, log_path = models / "card_facts.json", models / "train_log.jsonl"
    cf = json.loads(card_path.read_text())
    if cf["export"].get("sha256") == art["sha256"]:
        raise SystemExit(f"{ship}: this artifact is installed already")
    try:
        tmp = export.assemble(ship, art["parts"], art["sha256"], models / (BUNDLED_NAME + ".tmp"), FACTS)
    except RuntimeError as e:
        raise SystemExit(f"{ship}: {e}") from None
    old = cf["drafters"]
    keep = ("steps", "seconds", "context_tokens")
    prior = {k: old.get(k, 0) for k in keep} if new["warm_start"] else dict.fromkeys(keep, 0)
    merged = {k: {**old.get(k, {}), **new.get(k, {})} for k in ("params", "train_agreement")}  # kinds not trained
    if new["warm_start"]:  # the top level describes the build's stage; each run's own settings go in `retrained`
        merged.update({k: old[k] for k in ("labels", "block_sizes", "batch", "seq_len") if k in old})
    cf["drafters"] = {**old, **new, **merged, **{k: round(prior[k] + new[k], 1) if k == "seconds" else prior[k] + new[k]
                                                 for k in keep},
                      "mtp_depths": old.get("mtp_depths", 0), "final_mtp_depth_loss": old.get("final_mtp_depth_loss"),
                      "retrained": [*(old.get("retrained", []) if new["warm_start"] else []), {
                          "steps": new["steps"], "seconds": new["seconds"], "warm_start": new["warm_start"],
                          "after_steps": prior["steps"], "command": facts["command"], "device": facts["device"],
                          "labels": new.get("labels", "greedy"), "kinds": new.get("kinds", list(KINDS)),
                          "data": new.get("data", "corpus"), **({"selfgen": facts["selfgen"]} if "selfgen" in facts
                                                                 else {}),
                          "block_sizes": new.get("block_sizes"),
                          "from_artifact": art["from_artifact"], "acceptance": facts["acceptance"]}]}
    cf["export"].update(bytes=art["bytes"], sha256=art["sha256"], parts=art["parts"])
    rows = [json.loads(ln) for ln in log_path.read_text().splitlines() if ln.strip()]
    last = max((r for r in rows if r.get("phase") == "drafters"), key=lambda r: r["step"], default=None)
    step0, t0 = (last["step"], last["elapsed"]) if last and new["warm_start"] else (0, 0.0)
    if not new["warm_start"]:
        rows = [r for r in rows if r.get("phase") != "drafters"]
    for ln in (ship / LOG).read_text().splitlines():
        r = json.loads(ln)
        rows.append({**r, "retrain": True, "step": r["step"] + step0, "elapsed": round(r["elapsed"] + t0, 2)})
    tmp.replace(models / BUNDLED_NAME)
    log_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    card_path.write_text(json.dumps(cf, indent=1, default=str))
    card.write(models, cf, rows)
    return models / BUNDLED_NAME


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Back here, `retrain_drafters.py join SHIPDIR` installs what a run shipped.")
    ap.add_argument("--artifact", type=Path, default=REPO / "models" / BUNDLED_NAME, help="default: the bundled model")
    ap.add_argument("--out", type=Path, required=True, help="work folder")
    ap.add_argument("--ship", type=Path, default=None, help="where the new artifact's parts go (default OUT/ship)")
    ap.add_argument("--minutes", type=float, default=5.5, help="training time budget")
    ap.add_argument("--minutes-eval", type=float, default=1.5, help="the before / after acceptance budget")
    ap.add_argument("--steps", type=int, default=None, help="fixed number of training steps (tests)")
    ap.add_argument("--fresh", action="store_true", help="start from newly initialised drafters")
    ap.add_argument("--labels", choices=["greedy", "path"], default="greedy",
                    help="greedy: the target's greedy token at every corpus position; path: the same, each block "
                         "position counted only where the corpus tokens before it in the block are the target's "
                         "greedy tokens (so every label is the greedy continuation a round's drafts must equal)")
    ap.add_argument("--kinds", type=lambda v: tuple(sorted(set(v.split(",")))), default=KINDS,
                    help="comma-separated drafters to train (the others are kept as they are)")
    ap.add_argument("--blocks", type=lambda v: tuple(int(x) for x in v.split(",")), default=drafters.BLOCK_SIZES,
                    help="the training steps' block lengths in turn (K + 1; repeat one to weight it)")
    ap.add_argument("--data", choices=["corpus", "self", "mix"], default="corpus",
                    help="corpus: training-corpus rows (--labels decides which positions count); self: the target's "
                         "own greedy continuations of training-corpus prefixes, blocks anchored after the prompt (a "
                         "round's context exactly); mix: both, --self-fraction of the steps on self-generated rows")
    ap.add_argument("--self-fraction", type=float, default=0.5, help="--data mix: the share of self-generated steps")
    ap.add_argument("--gen-sequences", type=int, default=4096, help="prompts to continue (--data self / mix)")
    ap.add_argument("--gen-tokens", type=int, default=256, help="greedy tokens generated after each prompt")
    ap.add_argument("--gen-batch", type=int, default=64, help="prompts generated together")
    ap.add_argument("--gen-minutes", type=float, default=1.0, help="generation stops after this (between batches)")
    ap.add_argument("--gen-prompt-tokens", type=lambda v: tuple(int(x) for x in v.split(",")), default=None,
                    help="LO,HI prompt lengths (default: the held-out prompts' range)")
    ap.add_argument("--batch", type=int, default=None, help="training rows a step (default: the preset's)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    ap.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts for before / after")
    ap.add_argument("--eval-new", type=int, default=None, help="new tokens a held-out prompt for before / after")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="the tiny preset's sizes (a tiny artifact, tests)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = ap.parse_args(argv)
    args.argv = list(argv)
    if not args.artifact.is_file():
        ap.error(f"--artifact {args.artifact}: no such file")
    if not args.kinds or set(args.kinds) - set(KINDS):
        ap.error(f"--kinds: choose from {', '.join(KINDS)}")
    try:  # refused here, before the corpus is read, with DrafterOptions' own check
        drafters.check_block_sizes(args.blocks)
    except ValueError as e:
        ap.error(f"--blocks: {e}")
    args.artifact = args.artifact.resolve()
    if not 0 < args.self_fraction <= 1:
        ap.error("--self-fraction must be in (0, 1]")
    if args.gen_prompt_tokens is not None and (len(args.gen_prompt_tokens) != 2 or
                                               not 1 <= args.gen_prompt_tokens[0] <= args.gen_prompt_tokens[1]):
        ap.error("--gen-prompt-tokens: LO,HI with 1 <= LO <= HI")
    return tb.finish_args(ap, args, ("minutes", "minutes_eval", "steps", "gen_sequences", "gen_tokens", "gen_batch",
                                     "gen_minutes", "batch", "lr", "eval_prompts", "eval_new"))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["join"]:
        ap = argparse.ArgumentParser(description="Install a retrained artifact shipped by a run of this script.")
        ap.add_argument("ship", type=Path)
        ap.add_argument("--models", type=Path, default=REPO / "models")
        a = ap.parse_args(argv[1:])
        out = join(a.ship, a.models)
        print(f"installed {out}; now re-measure the card: python3 scripts/bundled/card_eval.py")
        return
    torch.manual_seed(0)
    run(parse(argv))


if __name__ == "__main__":
    main()
