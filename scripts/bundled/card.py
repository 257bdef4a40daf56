"""The model card: ``MODEL_CARD.md`` and ``loss_curve.png`` from ``card_facts.json`` and ``train_log.jsonl``."""

from __future__ import annotations

from pathlib import Path

TARGETS = ("DFlash2 K=7 tokens_per_round >= 4.0 and above MTP3's", "MTP3 acceptance_rate >= 0.60")


def loss_curve(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = [r for r in rows if r.get("phase") == "target"]
    draft = [r for r in rows if r.get("phase") == "drafters"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    if target:
        toks = [r["tokens"] / 1e6 for r in target]
        ax.plot(toks, [r["loss"] for r in target], label="next-token loss")
        ax.plot(toks, [r["mtp_loss"] for r in target], label="MTP (depth 0) loss", alpha=0.8)
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("target + MTP")
    ax.grid(alpha=0.3)
    ax.legend()
    ax = axes[1]
    for key, label in (("mtp_loss", "MTP (depths 0-3, mean)"), ("dflash_loss", "DFlash"),
                       ("dflash2_loss", "DFlash2 (+ selector)")):
        pts = [(r["step"], r[key]) for r in draft if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 3 else None, label=label)
    ax.set_xlabel("drafter step")
    ax.set_ylabel("weighted cross-entropy vs target greedy tokens")
    ax.set_title("drafters (target frozen)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _fmt(x, nd=3) -> str:
    if x is None:
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _spec_table(ev: dict) -> list[str]:
    acc = ev.get("acceptance", {})
    if "error" in acc or not acc.get("rows"):
        return [f"Not measured: {acc.get('error', 'no rows')}"]
    lines = [f"Greedy, {acc['prompts']} held-out prompts x {acc['max_new_tokens']} new tokens, engine runtime "
             f"{acc['runtime']} ({ev.get('device', '?')}).", "",
             "| drafter | K | acceptance rate | tokens / round | matches greedy |", "|---|---:|---:|---:|:-:|"]
    order = {"mtp": 0, "dflash": 1, "dflash2": 2}
    for r in sorted(acc["rows"], key=lambda r: (order.get(r["spec"], 3), r["k"])):
        if "skipped" in r or "error" in r:
            lines.append(f"| {r['spec']} | {r['k']} | {r.get('skipped') or r.get('error')} | | |")
            continue
        lines.append(f"| {r['spec']} | {r['k']} | {_fmt(r['acceptance_rate'])} | {_fmt(r['tokens_per_round'], 2)} "
                     f"| {'yes' if r['matches_greedy'] else 'NO'} |")
    return lines


def _row(ev: dict, spec: str, k: int) -> dict:
    for r in ev.get("acceptance", {}).get("rows", []):
        if r.get("spec") == spec and r.get("k") == k and "tokens_per_round" in r:
            return r
    return {}


def targets(ev: dict) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) of the issue's two targets."""
    d2, m3 = _row(ev, "dflash2", 7), _row(ev, "mtp", 3)
    out = []
    if d2 and m3:
        out.append((TARGETS[0], f"{d2['tokens_per_round']:.2f} vs MTP3 {m3['tokens_per_round']:.2f}",
                    d2["tokens_per_round"] >= 4.0 and d2["tokens_per_round"] > m3["tokens_per_round"]))
    else:
        out.append((TARGETS[0], "not measured", None))
    out.append((TARGETS[1], f"{m3['acceptance_rate']:.3f}" if m3 else "not measured",
                m3["acceptance_rate"] >= 0.60 if m3 else None))
    return out


def limits(facts: dict, met: list) -> list[str]:
    """Plain reasons a missed target is missed, from the facts."""
    if all(m for _, _, m in met):
        return []
    t, d = facts.get("target", {}), facts.get("drafters", {})
    out = [f"The target saw {t.get('tokens', 0) / 1e6:.0f}M tokens ({t.get('epochs', '?')} epochs of the corpus) "
           f"in {t.get('seconds', '?')} s; its held-out loss is "
           f"{_fmt(facts.get('eval', {}).get('heldout', {}).get('loss'))} nats/token. A weaker target is harder "
           f"to predict: drafts fail where its own predictions are uncertain."]
    out.append(f"The drafters trained {d.get('steps', '?')} steps ({d.get('seconds', '?')} s) on "
               f"{d.get('context_tokens', 0) / 1e6:.0f}M context tokens; their training agreement per block "
               f"position is in card_facts.json (drafters.train_agreement): acceptance follows it.")
    agree = d.get("train_agreement", {})
    firsts = {k.split("_")[0]: v[0] for k, v in agree.items() if v and k.endswith("_s8")}
    if firsts:
        out.append("At the end of training the block drafters' first draft agreed with the target's token "
                   + ", ".join(f"{k} {v:.2f}" for k, v in sorted(firsts.items()))
                   + " of the time, and each later position less: the block drafters trained "
                     f"{d.get('seconds', '?')} s in all, while the MTP head trained with the target for the whole "
                     "run. Their training time (`--minutes-drafters` in a build, `scripts/retrain_drafters.py "
                     "--minutes` on the shipped target), their labels (`scripts/retrain_drafters.py --labels path`:"
                     " only block positions on the target's greedy path) and their data (`--data mix`: the target's "
                     "own greedy continuations beside corpus rows) are the levers.")
    return out


INTRO = ("A small Qwen3.5-architecture code model trained from scratch on the Python source installed on the build "
         "machine, with an MTP head and DFlash / DFlash2 drafters. It is the default model of every suite "
         "(`models/ninfer-code-small.ninfer`), so acceptance rates and needle retrieval are measured on a real "
         "trained model on any machine, offline.")


def _model(f: dict) -> list[str]:
    m, p, tk, d, ex = f["model"], f["model"]["params"], f["tokenizer"], f["drafters"], f["export"]
    return ["## Model", "", "| | |", "|---|---|",
            f"| architecture | `Qwen3_5ForCausalLM` (`qwen3_5_text`), {m['layers']} layers = "
            f"{m['layers'] // 4} x [3 Gated DeltaNet + 1 gated full attention] |",
            f"| shape | hidden {m['hidden_size']}, MLP {m['intermediate_size']}, attention {m['attention']}, "
            f"GDN {m['gdn']}, partial RoPE 0.25 (theta 1e7), tied embeddings |",
            f"| parameters | target {p['target'] / 1e6:.1f}M ({p['target_non_embedding'] / 1e6:.1f}M without "
            f"embeddings), MTP {p['mtp'] / 1e6:.1f}M, DFlash {p['dflash'] / 1e6:.1f}M, "
            f"DFlash2 {p['dflash2'] / 1e6:.1f}M |",
            f"| tokenizer | byte-level BPE, {tk['vocab_size']} tokens, specials `<|endoftext|>` (eos) "
            f"`<|im_start|>` `<|im_end|>` `<|mask|>` (DFlash), Qwen chat template |",
            f"| drafters | DFlash: {d['configs']['dflash']}; DFlash2: {d['configs']['dflash2']} |",
            f"| artifact | v3, {ex['bytes']:,} bytes, policy `{ex['policy']}`, sha256 `{ex['sha256'][:16]}...` |"]


def _data(f: dict) -> list[str]:
    c, tk, t = f["corpus"], f["tokenizer"], f["target"]
    return ["## Data", "",
            f"{c['train_files']:,} training files ({c['train_bytes'] / 1e6:.1f} MB) and {c['heldout_files']} "
            f"held-out files ({c['heldout_bytes'] / 1e6:.2f} MB) of Python source: the standard library and "
            f"site-packages of the build machine's interpreter (Python {c.get('python', '?')}), de-duplicated by "
            f"content, held out by content hash (1 in {c['holdout_mod']}), distributions with an unknown or "
            f"proprietary licence left out. Training stream: {tk['train_tokens'] / 1e6:.1f}M tokens; "
            f"{t['retrieval_frac']:.0%} of training rows are synthetic retrieval samples (a "
            "`CONSTANTS[\"key\"] = value` line far above, `assert CONSTANTS[\"key\"] ==` at the end). Licences: "
            "see [corpus_LICENSES.md](corpus_LICENSES.md); by bytes:", "",
            "| licence | files | bytes |", "|---|---:|---:|",
            *[f"| {lic} | {n} | {b:,} |" for lic, n, b in c["licences"][:10]]]


def _training(f: dict) -> list[str]:
    t, d = f["target"], f["drafters"]
    long = (f", the last {t['long_steps']} at {t['long_seq_len']} tokens per row" if t.get("long_steps") else "")
    return ["## Training", "",
            f"Target + MTP: {t['steps']:,} steps of {t['batch'] * t['seq_len']:,} tokens ({t['batch']} x "
            f"{t['seq_len']}{long}), {t['tokens'] / 1e6:.0f}M tokens seen ({t['epochs']} epochs), peak LR "
            f"{t['peak_lr']}, {t['seconds']} s at about {(t.get('tok_s') or 0) / 1e3:.0f}K tokens/s; gated delta "
            f"rule kernel `{t['gdn']['chunk_gated_delta_rule']}`.",
            *_drafters(d), "", "![loss curve](loss_curve.png)"]


def _drafters(d: dict) -> list[str]:
    """The build's drafter stage, then each further training on the shipped target (scripts/retrain_drafters.py);
    ``d``'s steps and seconds are the totals over the build (when the first retraining continued its drafters) and
    the retrainings."""
    runs = d.get("retrained") or []
    labels = {"path": "greedy tokens along its greedy path"}.get(d["labels"], f"{d['labels']} tokens")
    head = f"Drafters (target frozen, labels = the target's {labels}): "
    shape = f"{d['batch']} x {d['seq_len']} tokens, block lengths {d['block_sizes']}"
    if not runs:
        return [f"{head}{d['steps']:,} steps of {shape}, MTP fine-tuned at depths 1..{d['mtp_depths']}, "
                f"{d['seconds']} s."]
    each = "; ".join(f"{r['steps']:,} steps in {r['seconds']} s on {r['device']}{_run_data(r, d['block_sizes'])}"
                     for r in runs)
    if runs[0]["warm_start"]:
        first = (f"{head}{runs[0]['after_steps']:,} steps of {shape} in the build, MTP fine-tuned at depths "
                 f"1..{d['mtp_depths']}, {round(d['seconds'] - sum(r['seconds'] for r in runs), 1)} s; then "
                 f"trained further on the shipped (quantized) target")
    else:
        first = f"{head}the block drafters were trained anew on the shipped (quantized) target"
    return [f"{first} by `scripts/retrain_drafters.py` ({each}; last: `{runs[-1]['command']}`), {d['steps']:,} steps "
            f"and {d['seconds']} s in all. The target, MTP head and tokenizer bytes are the build's."]


def _run_data(r: dict, build_blocks: list) -> str:
    """What a retraining run trained, when not both drafters on every corpus label."""
    out = []
    if r.get("kinds") and len(r["kinds"]) < 2:
        out.append(f"{' and '.join(r['kinds'])} only")
    if r.get("labels") == "path":
        out.append("labels on the target's greedy path: a block position counted only where the corpus tokens "
                   "before it in the block are the target's greedy tokens")
    if r.get("data") in ("self", "mix"):
        g = r.get("selfgen") or {}
        size = f" ({g['sequences']:,} sequences x {g['new_tokens']} tokens)" if "sequences" in g else ""
        out.append(f"{'partly ' if r['data'] == 'mix' else ''}on the target's own greedy continuations of "
                   f"training-code prefixes{size}")
    if r.get("block_sizes") and r["block_sizes"] != build_blocks:
        out.append(f"block lengths {r['block_sizes']}")
    return f" ({'; '.join(out)})" if out else ""


def _results(f: dict, met) -> list[str]:
    ev = f.get("eval", {})
    held, quant = ev.get("heldout", {}), ev.get("quant", {})
    loss = (f"Held-out loss ({held.get('source', 'target, transformers, bf16 weights')}): {_fmt(held.get('loss'))} "
            f"nats/token over {held.get('tokens', 0):,} tokens.")
    if quant.get("rel_rms") is not None:
        loss += (f" Artifact (engine) vs transformers logits on held-out code: relative RMS "
                 f"{_fmt(quant.get('rel_rms'), 4)}, top-1 agreement {_fmt(quant.get('top1_agreement'))}.")
    return ["## Results", "", loss, "",
            "### Speculative decoding", "", *_spec_table(ev), "",
            "### Needle retrieval", "", *_needle_table(ev), "",
            "## Targets", "", "| target | measured | met |", "|---|---|:-:|",
            *[f"| {name} | {val} | {'-' if ok is None else ('yes' if ok else 'no')} |" for name, val, ok in met],
            "", *limits(f, met)]


def _rebuild(f: dict) -> list[str]:
    r = f["rebuild"]
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in r["stage_seconds"].items())
    out = ["## Rebuild", "", "On one H200 (the fla wheel carried in `.whl/`), from a plain checkout:", "", "```",
            r["command"], "```", "",
            f"Seed {r['seed']}; this build took {r['device_minutes']:.1f} device-minutes ({stages}). Then "
            "`python3 scripts/bundled/export.py join <returned files>` installs it here."]
    if f.get("eval", {}).get("measured_by"):
        out += ["", f"The results above were measured after the build by `{f['eval']['measured_by']}` on "
                    f"{f['eval'].get('device', '?')} from the shipped files (`--niah` takes a `ninfer-bench niah` "
                    f"result for the needle table), {f['eval'].get('seconds', '?')} s."]
    return out


def write(models: Path, facts: dict, log_rows: list[dict]) -> Path:
    """Write ``MODEL_CARD.md`` and ``loss_curve.png`` into ``models``; returns the card's path."""
    models.mkdir(parents=True, exist_ok=True)
    loss_curve(log_rows, models / "loss_curve.png")
    met = targets(facts.get("eval", {}))
    sections = [["# ninfer-code-small", "", INTRO], _model(facts), _data(facts), _training(facts),
                _results(facts, met), _rebuild(facts)]
    out = models / "MODEL_CARD.md"
    out.write_text("\n\n".join("\n".join(sec) for sec in sections) + "\n")
    return out


def _needle_table(ev: dict) -> list[str]:
    nd = ev.get("needles", {})
    if "error" in nd or not nd.get("cases"):
        return [f"Not measured: {nd.get('error', 'no cases')}"]
    lines = [f"Measured by {nd['source']}." if nd.get("source") else "", "Greedy, engine, one needle per case at depths "
             f"{sorted({c['depth'] for c in nd['cases']})}; a case passes when the answer holds the value.", "",
             "| context tokens | retrieval | cases |", "|---:|---:|---:|"]
    for n, frac in nd["retrieval_by_length"].items():
        cases = sum(1 for c in nd["cases"] if str(c["length"]) == n and "retrieved" in c)
        lines.append(f"| {int(n):,} | {frac:.2f} | {cases} |")
    return lines
