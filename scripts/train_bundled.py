#!/usr/bin/env python3
"""Build the bundled model (``models/ninfer-code-small.ninfer``) from scratch, seeded, on one H200.

    python3 scripts/train_bundled.py --out /tmp/bundled --ship $OUT --stage all --seed 0

Stages (each resumes from the files the previous one left in ``--out``; ``all`` runs them in order; a
comma-separated list runs those): ``corpus`` (Python source -> train / held-out files, licence note),
``tokenizer`` (BPE, token streams, held-out prompts), ``target`` (Qwen3.5 + MTP, ``--minutes-target``),
``drafters`` (DFlash, DFlash2 and the MTP head's fine-tuning on the frozen target, ``--minutes-drafters``),
``export`` (artifact, its parts and the small files into ``--ship``, then the card's measurements within
``--minutes-eval``). ``--tiny`` is a seconds-long CPU run of the same code (the test). Back here:
``python3 scripts/bundled/export.py join DIR``.

A run that ends with ``target`` ships ``checkpoint.tar.partN`` (the bf16 HF folder, the tokenizer, facts and
log: about 50 MB); a later call given those parts with ``--resume DIR`` re-derives the corpus and token
streams (deterministic, the shipped tokenizer is reused) and continues with ``drafters,export``.
"""

from __future__ import annotations

import time

START = time.time()

import argparse  # noqa: E402  (START must come first: it times the imports too)
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
from dataclasses import asdict, dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bundled import corpus, drafters, evaluate, export, target, tok  # noqa: E402
from bundled.batches import Batches  # noqa: E402
from ninfer_bench.engine.artifact.loader import BUNDLED_NAME  # noqa: E402

STAGES = ("corpus", "tokenizer", "target", "drafters", "export")
# (spec, K) measured for the card, the targets first (a tight evaluation budget skips the tail)
EVAL_PLAN = [("mtp", 3), ("dflash2", 7), ("dflash", 7), ("mtp", 1), ("mtp", 2), ("mtp", 4), ("dflash2", 3),
             ("dflash", 3), ("dflash2", 11), ("dflash", 11), ("dflash2", 15), ("dflash", 15)]
DEVICE_PREFIX = ("python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
                 "export PYTHONPATH=/tmp/site && ")


@dataclass(slots=True)
class Preset:
    """Everything that differs between the real build and ``--tiny``."""

    shape: str
    vocab: int
    max_files: int | None
    stdlib_only: bool
    holdout_mod: int
    tok_train_mb: float
    seq_len: int
    batch: int
    lr: float
    warmup: int
    target_steps: int | None
    retrieval_frac: float
    long_seq_len: int
    long_frac: float
    d_seq_len: int
    d_batch: int
    d_lr: float
    d_mtp_lr: float
    d_warmup: int
    d_steps: int | None
    block_tokens: int
    prompts: int
    prompt_tokens: tuple[int, int]
    eval_prompts: int
    eval_new: int
    needle_lengths: tuple[int, ...]
    needle_depths: tuple[float, ...]
    heldout_windows: int
    policies: tuple[str, ...]


PRESETS = {
    "full": Preset(shape="small", vocab=8192, max_files=None, stdlib_only=False, holdout_mod=50, tok_train_mb=48,
                   seq_len=2048, batch=64, lr=2e-3, warmup=100, target_steps=None, retrieval_frac=0.15,
                   long_seq_len=8192, long_frac=0.1,
                   d_seq_len=2048, d_batch=32, d_lr=1e-3, d_mtp_lr=3e-4, d_warmup=30, d_steps=None, block_tokens=1024,
                   prompts=64, prompt_tokens=(200, 1500), eval_prompts=8, eval_new=128,
                   needle_lengths=(1024, 4096, 16384, 65536), needle_depths=(0.1, 0.5, 0.9), heldout_windows=64,
                   policies=export.POLICIES),
    "tiny": Preset(shape="tiny", vocab=512, max_files=200, stdlib_only=True, holdout_mod=10, tok_train_mb=2,
                   seq_len=128, batch=4, lr=3e-3, warmup=2, target_steps=6, retrieval_frac=0.25,
                   long_seq_len=256, long_frac=0.34,
                   d_seq_len=96, d_batch=2, d_lr=1e-3, d_mtp_lr=1e-3, d_warmup=1, d_steps=4, block_tokens=32,
                   prompts=4, prompt_tokens=(48, 160), eval_prompts=2, eval_new=12,
                   needle_lengths=(256, 512), needle_depths=(0.5,), heldout_windows=4, policies=("fp32",)),
}


class Work:
    """Where each stage leaves its files under ``--out``."""

    def __init__(self, root: Path):
        self.root = root
        self.train, self.heldout = root / "corpus" / "train.jsonl", root / "corpus" / "heldout.jsonl"
        self.dists, self.licences = root / "corpus" / "dists.json", root / "corpus_LICENSES.md"
        self.tokenizer, self.tokens = root / "tokenizer", root / "tokens"
        self.prompts, self.log = root / "heldout_prompts.jsonl", root / "train_log.jsonl"
        self.hf, self.drafters, self.export = root / "hf", root / "drafters", root / "export"

    def facts(self, stage: str) -> Path:
        return self.root / "facts" / f"{stage}.json"

    def need(self, *paths: Path) -> None:
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            raise SystemExit(f"missing {missing}: run the earlier stages first (or --stage all)")

    def files(self, path: Path) -> list[corpus.SourceFile]:
        return [corpus.SourceFile.from_json(line) for line in path.read_text().splitlines()]


def log_to(path: Path, phase: str):
    """A logger appending rows to ``path`` (rows of ``phase`` from an earlier run are dropped first)."""
    keep = [ln for ln in path.read_text().splitlines() if json.loads(ln).get("phase") != phase] \
        if path.is_file() else []
    path.write_text("".join(ln + "\n" for ln in keep))

    def log(row: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        keys = ("step", "loss", "mtp_loss", "tok_s", "lr", "elapsed")
        print(f"  [{phase}] " + " ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}"
                                        for k in keys if k in row), flush=True)
    return log


# ---- stages ---------------------------------------------------------------------------------------------------
def stage_corpus(args, p: Preset, w: Work) -> dict:
    roots = corpus.source_roots()[:1] if p.stdlib_only else corpus.source_roots()
    files, dists = corpus.collect(p.max_files, roots=roots)
    train = [f for f in files if not corpus.is_heldout(f, p.holdout_mod)]
    held = [f for f in files if corpus.is_heldout(f, p.holdout_mod)]
    w.train.parent.mkdir(parents=True, exist_ok=True)
    for path, part in ((w.train, train), (w.heldout, held)):
        path.write_text("".join(f.to_json() + "\n" for f in part))
    w.dists.write_text(json.dumps(dists, indent=1, sort_keys=True))
    w.licences.write_text(corpus.licence_note(files, dists))
    return {**corpus.summary(train, held), "holdout_mod": p.holdout_mod, "python": sys.version.split()[0],
            "roots": [str(r) for _, r in roots], "licences": corpus.by_licence(files, dists)}


def stage_tokenizer(args, p: Preset, w: Work) -> dict:
    w.need(w.train, w.heldout, w.dists)
    train, held = w.files(w.train), w.files(w.heldout)
    t0 = time.time()
    if args.resume and (w.tokenizer / "tokenizer.json").is_file():  # the checkpoint's weights index this one
        tk = tok.load(w.tokenizer)
    else:
        tk = tok.train_tokenizer([f.text for f in train], p.vocab, int(p.tok_train_mb * 1e6))
        tok.save(tk, w.tokenizer)
    trained_s = time.time() - t0
    eot = tk.token_to_id(tok.EOT)
    train_stream = tok.stream(tok.encode_all(tk, [f.text for f in train]), eot)
    held_stream = tok.stream(tok.encode_all(tk, [f.text for f in held]), eot)
    w.tokens.mkdir(parents=True, exist_ok=True)
    np.save(w.tokens / "train.npy", train_stream)
    np.save(w.tokens / "heldout.npy", held_stream)
    np.save(w.tokens / "frequency_order.npy", tok.frequency_order(train_stream, tk.get_vocab_size()))
    enc = lambda s: tk.encode(s, add_special_tokens=False).ids  # noqa: E731
    dec = lambda ids: tk.decode(ids, skip_special_tokens=False)  # noqa: E731
    prompts = corpus.heldout_prompts(held, enc, dec, json.loads(w.dists.read_text()), p.prompts,
                                     *p.prompt_tokens, np.random.default_rng(args.seed))
    w.prompts.write_text("".join(json.dumps(x) + "\n" for x in prompts))
    train_bytes = sum(len(f.text.encode()) for f in train)
    return {"vocab_size": tk.get_vocab_size(), "train_tokens": int(len(train_stream)),
            "heldout_tokens": int(len(held_stream)), "bytes_per_token": round(train_bytes / len(train_stream), 3),
            "train_seconds": round(trained_s, 1), "prompts": len(prompts)}


def stage_target(args, p: Preset, w: Work) -> dict:
    w.need(w.tokenizer / "tokenizer.json", w.tokens / "train.npy")
    tk = tok.load(w.tokenizer)
    cfg = target.model_config(p.shape, tk.get_vocab_size())
    t0 = time.perf_counter()
    model, mtp = target.new_model(cfg, args.seed)
    gdn = target.gdn_kernels(args.device, cfg)
    gdn["check_s"] = round(time.perf_counter() - t0, 1)  # model init + the fla gradient check (Triton compiles)
    print(f"  gated delta rule: {gdn['chunk_gated_delta_rule']}; conv: {gdn['causal_conv1d_fn']}; fla {gdn['fla']}; "
          f"fla gradients vs torch reference: {gdn.get('fla_grad_check', 'not checked')} ({gdn['check_s']} s)",
          flush=True)
    stream, enc = np.load(w.tokens / "train.npy"), lambda s: tk.encode(s, add_special_tokens=False).ids
    newline = tok.newline_mask(tk, cfg.vocab_size)
    batches = Batches(stream, p.seq_len, p.batch, args.seed, p.retrieval_frac, enc, newline)
    longer = Batches(stream, p.long_seq_len, p.batch * p.seq_len // p.long_seq_len, args.seed + 2,
                     p.retrieval_frac, enc, newline)
    opts = target.TargetOptions(seq_len=p.seq_len, batch=p.batch, lr=p.lr, warmup=p.warmup,
                                budget_s=args.minutes_target * 60 - 10, max_steps=p.target_steps,
                                long_frac=p.long_frac)
    setup_s = round(time.perf_counter() - t0, 1)
    facts = target.train(model, mtp, batches, opts, args.device, log_to(w.log, "target"), longer)
    t1 = time.perf_counter()
    target.save_hf(w.hf, cfg, model, mtp, w.tokenizer)
    facts.update(setup_s=setup_s, save_s=round(time.perf_counter() - t1, 1))
    print(f"  set-up {setup_s} s, training {facts['seconds']} s, saving {facts['save_s']} s", flush=True)
    rows = [json.loads(ln) for ln in w.log.read_text().splitlines()]
    speeds = sorted(r["tok_s"] for r in rows if r.get("phase") == "target" and r["step"] > 3)
    return {**facts, "gdn": gdn, "params": target.param_counts(model, mtp), "retrieval_frac": p.retrieval_frac,
            "tok_s": speeds[len(speeds) // 2] if speeds else None, "device": str(args.device),
            "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if args.device.type == "cuda"
            else None}


def stage_drafters(args, p: Preset, w: Work) -> dict:
    w.need(w.hf / "model.safetensors")
    tk = tok.load(w.tokenizer)
    model, mtp, cfg = target.load_hf(w.hf, args.device)
    target.gdn_kernels(args.device, cfg)
    nets = drafters.new_drafters(cfg, p.shape, tk.token_to_id(tok.MASK), args.seed)
    batches = Batches(np.load(w.tokens / "train.npy"), p.d_seq_len, p.d_batch, args.seed + 1, 0.0,
                      lambda s: tk.encode(s, add_special_tokens=False).ids, tok.newline_mask(tk, cfg.vocab_size))
    opts = drafters.DrafterOptions(seq_len=p.d_seq_len, batch=p.d_batch, lr=p.d_lr, mtp_lr=p.d_mtp_lr,
                                   warmup=p.d_warmup, budget_s=args.minutes_drafters * 60 - 5, max_steps=p.d_steps,
                                   block_tokens=p.block_tokens)
    facts = drafters.train(model, mtp, nets, batches, opts, args.device, args.seed, log_to(w.log, "drafters"))
    drafters.save(w.drafters, nets, mtp)
    facts["configs"] = {k: f"{n.c.num_layers} layers, block {n.c.block_size}, taps {list(n.c.target_layer_ids)}"
                        + (f", window {n.c.window}, top-{n.c.candidates} rank-{n.c.scorer_rank} selector"
                           if k == "dflash2" else "") for k, n in nets.items()}
    facts["params"] = {k: drafters.param_count(n) for k, n in nets.items()}
    return facts


def stage_export(args, p: Preset, w: Work) -> dict:
    w.need(w.hf / "model.safetensors", w.drafters / "dflash2.json")
    hf = export.final_hf(w.root, w.export / "hf")
    model, _, cfg = target.load_hf(hf, args.device)
    nets = drafters.load(w.drafters, cfg)
    art = w.export / BUNDLED_NAME
    facts = export.write(hf, nets, np.load(w.tokens / "frequency_order.npy"), art, p.policies)
    args.ship.mkdir(parents=True, exist_ok=True)
    facts["parts"] = export.split(art, args.ship)
    for src in (w.prompts, w.log, w.licences):
        shutil.copyfile(src, args.ship / src.name)
    save_facts(w, "export", facts)
    write_card_facts(args, p, w, {"status": "pending"})  # the weights ship even if the evaluation dies
    ev = evaluation(args, p, w, art, model)
    write_card_facts(args, p, w, ev)
    return facts


def evaluation(args, p: Preset, w: Work, art: Path, model) -> dict:
    """Held-out loss, quantization error, acceptance and needles (within ``--minutes-eval``)."""
    t0 = time.perf_counter()
    budget = args.minutes_eval * 60
    tk = tok.load(w.tokenizer)
    enc = lambda s: tk.encode(s, add_special_tokens=False).ids  # noqa: E731
    held = np.load(w.tokens / "heldout.npy")
    ev = {"device": torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu"}
    ev["heldout"] = evaluate.guarded(evaluate.heldout_loss, model, held, p.seq_len, p.heldout_windows, 8, args.device)
    ev["quant"] = evaluate.guarded(evaluate.quant_error, art, model, held[:512].astype(np.int64).tolist(),
                                   args.device)
    prompts = [enc(json.loads(ln)["text"]) for ln in w.prompts.read_text().splitlines()][: p.eval_prompts]
    ctx = max(len(x) for x in prompts) + p.eval_new + 16
    ev["acceptance"] = with_fallback(evaluate.acceptance, art, prompts, EVAL_PLAN, p.eval_new, args.device,
                                     t0 + 0.6 * budget, ctx)
    texts, size = [], 0
    for f in w.files(w.heldout):  # enough held-out code for the longest haystack (about 3.5 bytes a token)
        texts.append(f.text)
        size += len(f.text)
        if size > 5 * max(p.needle_lengths):
            break
    filler = enc("\n\n".join(texts))
    ev["needles"] = with_fallback(evaluate.needles, art, filler, tk, p.needle_lengths, p.needle_depths,
                                  args.device, t0 + budget, args.seed)
    ev["seconds"] = round(time.perf_counter() - t0, 1)
    return ev


def with_fallback(fn, *args) -> dict:
    """``fn`` through the engine's current runtime (v3); if that fails as a whole, the eager v2 runtime, with
    v3's error kept."""
    got = evaluate.guarded(fn, *args, runtime="v3")
    if "error" in got:
        got = {**evaluate.guarded(fn, *args, runtime="v2"), "v3_error": got["error"], "v3_traceback": got["traceback"]}
    return got


CHECKPOINT = ("hf", "tokenizer", "facts", "train_log.jsonl")


def ship_checkpoint(w: Work, ship: Path) -> list[str]:
    """The target checkpoint as ``checkpoint.tar.partN`` in ``ship`` (for ``--resume`` in a later call)."""
    tar = w.root / "checkpoint.tar"
    with tarfile.open(tar, "w") as t:
        for name in CHECKPOINT:
            t.add(w.root / name, arcname=name)
    return export.split(tar, ship, beside=0)


def resume(w: Work, parts: Path) -> None:
    """Unpack ``checkpoint.tar.part*`` from ``parts`` into the work folder."""
    names = sorted(parts.glob("checkpoint.tar.part*"), key=lambda q: int(q.name.rsplit("part", 1)[1]))
    if not names:
        raise SystemExit(f"--resume {parts}: no checkpoint.tar.part* files there")
    tar = w.root / "checkpoint.tar"
    with open(tar, "wb") as f:
        for q in names:
            f.write(q.read_bytes())
    with tarfile.open(tar) as t:
        for m in t.getmembers():  # what ship_checkpoint writes: files and folders under CHECKPOINT's names
            parts_of = Path(m.name).parts
            if not (m.isfile() or m.isdir()) or not parts_of or parts_of[0] not in CHECKPOINT or ".." in parts_of:
                raise SystemExit(f"--resume {parts}: {m.name!r} in checkpoint.tar is not part of a checkpoint")
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: the library's own checks too
            t.extractall(w.root, filter="data")
        else:
            t.extractall(w.root)


def save_facts(w: Work, stage: str, facts: dict) -> None:
    w.facts(stage).parent.mkdir(parents=True, exist_ok=True)
    w.facts(stage).write_text(json.dumps(facts, indent=1, default=str))


def write_card_facts(args, p: Preset, w: Work, ev: dict) -> None:
    """card_facts.json (into ``--out`` and ``--ship``): every stage's facts, the evaluation, the rebuild."""
    f = {s: json.loads(w.facts(s).read_text()) for s in STAGES if w.facts(s).is_file()}
    cfg = target.model_config(p.shape, f["tokenizer"]["vocab_size"])
    f["model"] = {"layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
                  "intermediate_size": cfg.intermediate_size,
                  "attention": f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} kv heads x {cfg.head_dim}",
                  "gdn": f"{cfg.linear_num_key_heads} k / {cfg.linear_num_value_heads} v heads x "
                         f"{cfg.linear_key_head_dim}", "config": cfg.to_hf(),
                  "params": {**f["target"]["params"], **f["drafters"]["params"]}}
    f["eval"] = ev
    seconds = {s: f[s]["stage_seconds"] for s in STAGES if s in f and "stage_seconds" in f[s]}
    f["rebuild"] = {"command": DEVICE_PREFIX + "python3 scripts/train_bundled.py --out /tmp/bundled --ship $OUT "
                    f"--stage all --seed {args.seed} --minutes-target {args.minutes_target} "
                    f"--minutes-drafters {args.minutes_drafters} --minutes-eval {args.minutes_eval}"
                    + (" --tiny" if args.tiny else ""),
                    "seed": args.seed, "stage_seconds": seconds,
                    "device_minutes": (sum(seconds.values()) + f.get("corpus", {}).get("imports_s", 0)
                                       + (0 if "export" in seconds else ev.get("seconds", 0))) / 60,
                    "preset": asdict(p), "versions": versions()}
    text = json.dumps(f, indent=1, default=str)
    (w.root / "card_facts.json").write_text(text)
    (args.ship / "card_facts.json").write_text(text)


def versions() -> dict:
    import tokenizers
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
           "python": sys.version.split()[0], "cuda": torch.version.cuda}
    try:
        import fla

        out["fla"] = getattr(fla, "__version__", "?")
    except Exception:  # no fla: CPU build
        out["fla"] = None
    return out


RUNNERS = {"corpus": stage_corpus, "tokenizer": stage_tokenizer, "target": stage_target,
           "drafters": stage_drafters, "export": stage_export}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="work folder (each stage's files; resumable)")
    ap.add_argument("--ship", type=Path, default=None, help="where export puts the returned files "
                                                            "(default OUT/ship; on the device: $OUT)")
    ap.add_argument("--stage", default="all", help=f"all, or a comma-separated list of {', '.join(STAGES)}")
    ap.add_argument("--resume", type=Path, default=None, help="folder with checkpoint.tar.partN from a target run")
    ap.add_argument("--minutes-target", type=float, default=4.75)
    ap.add_argument("--minutes-drafters", type=float, default=1.5)
    ap.add_argument("--minutes-eval", type=float, default=1.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-steps", type=int, default=None,
                    help="train the target exactly this many steps (default: as many as --minutes-target allows)")
    ap.add_argument("--drafter-steps", type=int, default=None,
                    help="train the drafters exactly this many steps (default: as many as --minutes-drafters allows)")
    ap.add_argument("--tiny", action="store_true", help="a seconds-long CPU run of every stage (tests)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = ap.parse_args(argv)
    args.stages = STAGES if args.stage == "all" else tuple(args.stage.split(","))
    bad = [s for s in args.stages if s not in STAGES]
    if bad:
        ap.error(f"--stage: unknown stage(s) {bad} (known: all, {', '.join(STAGES)})")
    return finish_args(ap, args, ("minutes_target", "minutes_drafters", "minutes_eval", "target_steps",
                                  "drafter_steps"))


def finish_args(ap, args, positive: tuple[str, ...]):
    """Shared by this script and retrain_drafters.py: the ``positive`` options checked, ``--device`` resolved to a
    torch.device, ``--ship`` defaulted to OUT/ship."""
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here")
    args.device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                               ("cpu" if args.device == "auto" else args.device))
    args.ship = args.ship or args.out / "ship"
    return args


def main(argv=None) -> None:
    args = parse(argv)
    p = PRESETS["tiny" if args.tiny else "full"]
    p = replace(p, target_steps=args.target_steps or p.target_steps, d_steps=args.drafter_steps or p.d_steps)
    torch.manual_seed(args.seed)
    w = Work(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.resume:
        resume(w, args.resume)
    print(f"imports done in {time.time() - START:.1f} s; device {args.device}", flush=True)
    for stage in args.stages:
        t0 = time.time()
        print(f"[{stage}] start", flush=True)
        try:
            facts = RUNNERS[stage](args, p, w)
        except BaseException:
            shipped = list(args.ship.glob(BUNDLED_NAME + ".part*")) if args.ship.is_dir() else []
            if stage in ("drafters", "export") and (w.hf / "model.safetensors").is_file() and not shipped:
                # the trained target is the expensive part: ship it so that a later call can --resume
                print(f"[{stage}] failed; checkpoint shipped for --resume: {ship_checkpoint(w, args.ship)}",
                      flush=True)
            raise
        facts["stage_seconds"] = round(time.time() - t0, 1)
        if stage == "corpus":
            facts["imports_s"] = round(t0 - START, 1)
        save_facts(w, stage, facts)
        print(f"[{stage}] done in {facts['stage_seconds']:.1f} s", flush=True)
    if args.stages[-1] == "export":
        write_card_facts(args, p, w, json.loads((w.root / "card_facts.json").read_text())["eval"])
    elif args.stages[-1] == "target":
        print(f"checkpoint shipped: {ship_checkpoint(w, args.ship)}", flush=True)
    print(f"total {time.time() - START:.1f} s", flush=True)


if __name__ == "__main__":
    main()
