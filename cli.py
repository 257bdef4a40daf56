"""``ninfer-bench``: the command line. It parses flags into the library's option objects and calls it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

console = Console(stderr=False)
err_console = Console(stderr=True, soft_wrap=True)


class UserError(click.ClickException):
    """A mistake in what the user asked for: one line on stderr, exit code 1."""

    def show(self, file=None) -> None:
        err_console.print(f"[bold red]error:[/] {self.message}", highlight=False)


class Group(click.Group):
    """Turns library errors (ValueError and subclasses, missing files) into one-line errors unless --debug."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            raise UserError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def byte_progress(description: str):
    """A rich progress bar for work measured in bytes; returns (progress, callback(done, total, name))."""
    prog = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                    console=err_console, transient=True)
    task = prog.add_task(description, total=None)

    def update(done, total, name=""):
        prog.update(task, completed=done, total=total, description=f"{description} {name}"[:60])

    return prog, update


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.version_option(package_name="ninfer-bench")
@click.pass_context
def main(ctx, debug):
    """ninfer-bench: an inference engine for the Qwen3.5 / Qwen3-Next hybrid family and its benchmark harness."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


# ---- artifacts ---------------------------------------------------------------------------------------
@main.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect(artifact, as_json):
    """Show an artifact's components, objects, formats, bytes and which checks pass."""
    from .engine.artifact import Artifact

    with Artifact.open(artifact) as art:
        summary = art.summary()
        checks = {"header": True, "bounds": True, "bindings": True}  # open() raises when any fails
        digests = art.verify()
        checks["digests"] = all(ok for _, ok, _ in digests)
        vision_ok, vision_msg = vision_check(art)
        if vision_ok is not None:
            checks["vision"] = vision_ok
        if as_json:
            console.print_json(json.dumps({"summary": summary, "checks": checks}, default=str))
            return
        console.print(f"[bold]{artifact}[/]  v{art.version}  id {art.artifact_id}  "
                      f"model {art.model_id or '-'}  policy {(art.metadata or {}).get('quant_policy', '-')}")
        table = Table(title="components")
        for col in ("component", "tensors", "bytes", "config"):
            table.add_column(col)
        for name, comp in (art.components or {}).items():
            if comp is None:
                table.add_row(name, "-", "-", "(empty)")
                continue
            cfg = comp.get("config", {})
            brief = ", ".join(f"{k}={cfg[k]}" for k in list(cfg)[:6])
            c = summary.get("components", {}).get(name, {})
            table.add_row(name, str(len(comp.get("tensors", []))), f"{c.get('bytes', 0):,}", brief)
        console.print(table)
        fmt = Table(title="formats")
        fmt.add_column("format")
        fmt.add_column("objects")
        fmt.add_column("bytes")
        for f, c in summary.get("formats", {}).items():
            fmt.add_row(f, str(c.get("objects", c.get("count", ""))), f"{c.get('bytes', 0):,}")
        console.print(fmt)
        for name, ok in checks.items():
            console.print(f"  {'[green]pass[/]' if ok else '[red]FAIL[/]'}  {name}")
        bad = [f"{label}: {msg}" for label, ok, msg in digests if not ok] + ([vision_msg] if vision_ok is False else [])
        for line in bad[:10]:
            console.print(f"    [red]{line}[/]")
        if bad:
            sys.exit(1)


def vision_check(art) -> tuple[bool | None, str]:
    """(ok, message) of the artifact's vision component: its configs and tensor shapes; (None, "") without one."""
    from .engine.loader import vision_of

    if not (art.components or {}).get("vision"):
        return None, ""
    try:
        vision_of(art, art.path)
    except ValueError as e:
        return False, str(e)
    return True, "ok"


@main.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
def verify(artifact):
    """Check every object's SHA-256 digest (and bounds), with a progress bar."""
    from .engine.artifact import Artifact

    with Artifact.open(artifact) as art:
        prog, update = byte_progress("verifying")
        with prog:
            results = art.verify(progress=update)
    bad = [(label, msg) for label, ok, msg in results if not ok]
    with Artifact.open(artifact) as art:
        vision_ok, vision_msg = vision_check(art)
    if vision_ok is False:
        bad.append(("vision component", vision_msg))
    for label, msg in bad:
        err_console.print(f"[red]FAIL[/] {label}: {msg}", highlight=False)
    if bad:
        raise UserError(f"{len(bad)} of {len(results)} objects failed verification")
    console.print(f"[green]ok[/]: {len(results)} objects verified in {artifact}")


@main.command()
@click.argument("hf_dir", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--quant", type=click.Choice(["fp32", "bf16", "q8", "q5", "q4", "mixed"]), default="mixed",
              show_default=True, help="Quantization policy.")
@click.option("--format-version", type=click.Choice(["2", "3"]), default="3", show_default=True)
@click.option("--drafter", "drafters", multiple=True, type=click.Path(file_okay=False, exists=True),
              help="A z-lab style DFlash / DFlash2 drafter folder to add as a component (repeatable).")
def convert(hf_dir, out, quant, format_version, drafters):
    """Convert a Hugging Face Qwen3.5 / Qwen3-Next folder (and drafter folders) into an artifact."""
    from .engine.convert import convert as do_convert

    prog, update = byte_progress("writing")
    with prog:
        do_convert(hf_dir, out, policy=quant, version=int(format_version), progress=update, drafters=drafters)
    console.print(f"[green]wrote[/] {out} ({Path(out).stat().st_size:,} bytes, quant {quant}, v{format_version})")


@main.command()
@click.argument("v2_file", type=click.Path(dir_okay=False))
@click.argument("v3_file", type=click.Path(dir_okay=False))
def upgrade(v2_file, v3_file):
    """Rewrite a v2 artifact as v3 without changing any weight bytes."""
    from .engine.artifact_write import upgrade as do_upgrade

    prog, update = byte_progress("upgrading")
    with prog:
        do_upgrade(v2_file, v3_file, progress=update)
    console.print(f"[green]wrote[/] {v3_file}")


# ---- running a model ---------------------------------------------------------------------------------
def engine_options(f=None, *, kv_default: str = "int8"):
    """The options every command that binds an Engine takes."""
    if f is None:
        return lambda g: engine_options(g, kv_default=kv_default)
    opts = [
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True),
        click.option("--dtype", type=click.Choice(["auto", "fp32", "bf16", "fp16"]), default="auto",
                     show_default=True, help="Compute dtype (auto: bf16 on CUDA, fp32 on CPU)."),
        click.option("--kv-dtype", type=click.Choice(["fp32", "bf16", "fp16", "int8"]), default=kv_default,
                     show_default=True, help="K/V cache format (int8: one fp16 scale per 64 values)."),
        click.option("--max-context", type=int, default=None,
                     help="Longest prompt + completion one request may have [default: 8192, or the model's limit]."),
        click.option("--kv-capacity", type=int, default=None,
                     help="Total K/V tokens over all slots (default max-context x max-concurrency)."),
        click.option("--max-concurrency", type=int, default=1, show_default=True),
        click.option("--prefill-chunk", type=int, default=512, show_default=True),
        click.option("--runtime", type=click.Choice(["v2", "v3"]), default="v3", show_default=True),
        click.option("--synthetic", is_flag=True, help="Seeded random weights for a preset (e.g. qwen3.8-27b)."),
        click.option("--quant", type=click.Choice(["fp32", "bf16", "q8", "q5", "q4", "mixed"]), default="mixed",
                     show_default=True, help="Formats of --synthetic weights."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def build_engine(model, *, synthetic=False, quant="mixed", seed=0, **options):
    from .engine.runtime import Engine

    return Engine.load(model, synthetic=synthetic, quant=quant, seed=seed, **options)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"--ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UserError("--ids is empty")
    return ids


@main.command()
@click.argument("artifact")
@click.option("--text", default=None, help="Prompt text (tokenized with the artifact's tokenizer).")
@click.option("--ids", default=None, help="Comma-separated token ids.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Where to write the [T, V] .npy.")
@engine_options(kv_default="fp32")
def logits(artifact, text, ids, out, **options):
    """Write the full-prefill logits [T, vocab] of a prompt to a .npy file."""
    import numpy as np

    if (text is None) == (ids is None):
        raise UserError("give exactly one of --text or --ids")
    eng = build_engine(artifact, **options)
    prompt = parse_ids(ids) if ids is not None else eng.tokenizer.encode(text)
    out_logits = eng.logits(prompt).numpy()
    np.save(out, out_logits)
    console.print(f"[green]wrote[/] {out}  shape {list(out_logits.shape)}  dtype {out_logits.dtype}")


@main.command()
@click.argument("artifact", required=False)
@click.option("--prompt", "-p", default=None, help="Prompt text.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), default=None, help="Read the prompt from a file.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user turn with the artifact's chat template.")
@click.option("--max-new-tokens", "-n", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--spec", type=click.Choice(["none", "mtp", "dflash", "dflash2"]), default="none", show_default=True)
@click.option("--draft-tokens", "-k", type=int, default=None, help="Draft tokens per round (default: MTP 3, DFlash 7).")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image placed before the prompt text (repeatable; needs a model with a vision component).")
@click.option("--video", "videos", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A video before the prompt text: .npy / .npz frames or animated GIF / PNG / WebP (repeatable).")
@engine_options
def generate(artifact, prompt, prompt_file, chat, max_new_tokens, temperature, top_p, top_k, seed, stop, spec,
             draft_tokens, images, videos, **options):
    """Generate text from a prompt, optionally about images and videos (default model: the bundled one)."""
    from .engine.mrope import placeholder

    if (prompt is None) == (prompt_file is None):
        raise UserError("give exactly one of --prompt or --prompt-file")
    text = prompt if prompt is not None else Path(prompt_file).read_text()
    eng = build_engine(artifact, spec=spec, draft_tokens=draft_tokens, **options)
    items = [eng.load_media("image", p) for p in images] + [eng.load_media("video", p) for p in videos]
    text = "".join(placeholder(it.kind) for it in items) + text
    if chat:
        text = eng.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    ids, media = eng.media_prompt(eng.tokenizer.encode(text), items)
    res = eng.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                       seed=seed, stop=stop, media=media)
    console.print(res.text, highlight=False, markup=False)
    n = res.completion_tokens
    tok_s = (n - 1) / res.decode_s if n > 1 and res.decode_s > 0 else float("nan")
    extra = ""
    if res.spec.get("rounds"):
        extra = (f", {res.spec['tokens_per_round']:.2f} tokens/round, "
                 f"acceptance {res.spec['acceptance_rate']:.2f}")
    if res.vision:
        extra += f"; vision: {res.vision['tokens']} tokens encoded in {res.vision['encode_ms']:.1f} ms"
    err_console.print(f"[dim]{len(ids)} prompt + {n} tokens ({res.finish_reason}); ttft {res.ttft_s * 1e3:.1f} ms, "
                      f"decode {tok_s:.1f} tok/s{extra}[/]", highlight=False)


def read_prompt_set(path: str, tokenizer) -> list[dict]:
    """Prompts from a .jsonl file (``{"id", "text"}`` or ``{"id", "ids"}`` per line) or one prompt per .txt file."""
    p = Path(path)
    if p.suffix == ".jsonl":
        out = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: not JSON ({e.msg})") from None
            ids = rec.get("ids") or tokenizer.encode(rec.get("text", ""))
            if not ids:
                raise UserError(f"{path}:{n}: prompt has no 'text' or 'ids'")
            out.append({"id": str(rec.get("id", n)), "prompt_ids": [int(t) for t in ids]})
        return out
    return [{"id": p.stem, "prompt_ids": tokenizer.encode(p.read_text())}]


@main.group()
def oracle():
    """Produce oracle outputs with the independent reference forward (float64, sequential)."""


@oracle.command("prompts")
@click.argument("artifact")
@click.option("--prompts", "prompts_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help=".jsonl prompt set ({id, text} per line) or a .txt prompt.")
@click.option("--max-new-tokens", "-n", type=int, default=32, show_default=True)
@click.option("--top-k", type=int, default=8, show_default=True)
@click.option("--dtype", type=click.Choice(["fp64", "fp32"]), default="fp64", show_default=True)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output file (.json or .json.gz).")
def oracle_prompts(artifact, prompts_path, max_new_tokens, top_k, dtype, out):
    """Greedy tokens and per-step top-k log-probs of the reference model for a prompt set."""
    from rich.progress import Progress

    from .engine.loader import load_source
    from .oracles.build import build_oracle

    prompts = read_prompt_set(prompts_path, load_source(artifact).tokenizer)
    with Progress(console=err_console, transient=True) as prog:
        task = prog.add_task("oracle", total=len(prompts))
        build_oracle(artifact, prompts, out, max_new_tokens=max_new_tokens, top_k=top_k, dtype=dtype,
                     progress=lambda done, total, pid: prog.update(task, completed=done))
    console.print(f"[green]wrote[/] {out}: {len(prompts)} prompts x {max_new_tokens} tokens")


# ---- suites ------------------------------------------------------------------------------------------
def suite_progress(description: str):
    """A rich progress bar for suites counting units of work; returns (progress, callback(done, total, what))."""
    from rich.progress import MofNCompleteColumn, TimeElapsedColumn

    prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True)
    task = prog.add_task(description, total=None)

    def update(done, total, what=""):
        prog.update(task, completed=done, total=total, description=f"{description} {what}")

    return prog, update


def save_result(doc: dict, json_path: str | None) -> None:
    from .reports.schema import write_result

    if json_path:
        write_result(doc, json_path)
        err_console.print(f"[dim]result document: {json_path}[/]")


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


@main.command()
@click.option("--model", default=None, help="Artifact path or preset [default: the bundled model].")
@click.option("--engine", type=click.Choice(["ours", "hf"]), default="ours", show_default=True,
              help="ours, or the transformers peer on the same weights.")
@click.option("--spec", type=click.Choice(["none", "mtp", "dflash", "dflash2"]), default="none", show_default=True)
@click.option("--draft-tokens", "-k", type=int, default=None, help="Draft tokens per round (default: MTP 3, DFlash 7).")
@click.option("--rollback", type=click.Choice(["recompute", "snapshot"]), default="recompute", show_default=True,
              help="How rejected positions' recurrent state is undone.")
@click.option("--lm-head-draft", type=int, default=0, show_default=True,
              help="Drafters score only the N most frequent tokens (0: the full vocabulary).")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Prompt text, or a .jsonl prompt set (e.g. suites/data/heldout_prompts.jsonl) "
                   "[default: the shipped short-code prompt].")
@click.option("--prompts", "n_prompts", type=int, default=None, help="Use the first N prompts of a .jsonl set.")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image before each prompt (repeatable; a model with a vision component): the result reports "
                   "the vision encode time and merged token count.")
@click.option("--max-new-tokens", "-n", type=int, default=4096, show_default=True)
@click.option("--stop-at-eos", is_flag=True, help="Stop at end-of-sequence (default: always generate -n tokens).")
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--warmup", type=int, default=1, show_default=True)
@click.option("--label", default=None, help="Label of this run in reports [default: runtime-spec-k].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the result document.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --synthetic weights.")
@engine_options
def decode(model, engine, spec, draft_tokens, rollback, lm_head_draft, prompt_file, n_prompts, images, max_new_tokens,
           stop_at_eos, repeats, warmup, label, json_path, seed, max_concurrency, kv_capacity, **options):
    """The short-code decode test: prefill a code prompt, greedy-decode N tokens, measure speed and acceptance."""
    from .suites.common import DEFAULT_PROMPT
    from .suites.decode import DecodeOptions, run_decode

    opts = DecodeOptions(model=model, engine=engine, spec=spec, draft_tokens=draft_tokens, rollback=rollback,
                         lm_head_draft=lm_head_draft, prompt_file=prompt_file or str(DEFAULT_PROMPT), prompts=n_prompts,
                         images=images,
                         max_new_tokens=max_new_tokens, ignore_eos=not stop_at_eos, repeats=repeats, warmup=warmup,
                         label=label, seed=seed, **options)
    prog, update = suite_progress("decode")
    with prog:
        doc = run_decode(opts, progress=update)
    s = doc["summary"]
    table = Table(title=f"decode: {doc['label']} on {doc['config']['device']} ({doc['env'].get('gpu') or 'cpu'})")
    for col in ("metric", "value"):
        table.add_column(col)
    rows = [("prompt / completion tokens", f"{s['prompt_tokens']} / {s['completion_tokens']}"),
            ("prefill tok/s", fmt(s["prefill_tok_s"], ".1f")), ("decode tok/s", fmt(s["decode_tok_s"], ".1f")),
            ("TTFT ms", fmt(s["ttft_ms"], ".1f")), ("device ms / round", fmt(s["device_ms_per_round"], ".3f")),
            ("rounds", str(s["rounds"])), ("tokens / round", fmt(s["tokens_per_round"])),
            ("acceptance rate", fmt(s["acceptance_rate"], ".3f")),
            ("accepted per position", " ".join(f"{a:.2f}" for a in s["accepted_per_position"]) or "-"),
            ("weight bytes / step", f"{s['weight_bytes_per_step']:,}" if s["weight_bytes_per_step"] else "-"),
            ("copy bandwidth GB/s", fmt(s["copy_bandwidth_gbps"], ".0f")),
            ("achieved GB/s (weights)", fmt(s["achieved_gbps"], ".0f")),
            ("roofline fraction", fmt(s["roofline_fraction"], ".3f")),
            ("peak memory", f"{s['peak_memory_bytes'] / 2**20:,.0f} MiB"),
            ("tokens sha256", s["tokens_sha256"][:16] + ("" if s["deterministic"] else " (varies!)"))]
    if "vision_encode_ms" in s:
        rows += [("vision encode ms", fmt(s["vision_encode_ms"], ".1f")), ("vision tokens", str(s["vision_tokens"]))]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    save_result(doc, json_path)


# ---- reports and gates -------------------------------------------------------------------------------
@main.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--baseline", "baseline_label", default=None, help="Label the deltas are computed against.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output folder.")
@click.option("--title", default=None, help="Report title.")
def report(results, baseline_label, out_dir, title):
    """Release-validation report (HTML + Markdown + PNG figures) from result documents or folders of them."""
    from .reports.frames import load_results
    from .reports.report import DEFAULT_TITLE, write_report

    docs = load_results(list(results))
    html, md = write_report(docs, out_dir, baseline_label=baseline_label, title=title or DEFAULT_TITLE)
    console.print(f"[green]wrote[/] {html} and {md} ({len(docs)} result documents)")


@main.command()
@click.option("--baseline", required=True, type=click.Path(exists=True, dir_okay=False), help="Baseline result.")
@click.option("--candidate", required=True, type=click.Path(exists=True, dir_okay=False), help="Candidate result.")
@click.option("--rules", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Rules file (.json or .toml) [default: the suite's rules].")
@click.option("--json", "as_json", is_flag=True, help="Print the verdicts as JSON.")
def gate(baseline, candidate, rules, as_json):
    """Compare a candidate result to a baseline: exit 1 on any failed or missing metric."""
    from .reports.gate import exit_code, gate as run_gate, load_rules, render_table
    from .reports.schema import read_result

    verdicts = run_gate(read_result(baseline), read_result(candidate), load_rules(rules) if rules else None)
    if as_json:
        console.print_json(json.dumps([v.to_dict() for v in verdicts], default=str))
    else:
        console.print(render_table(verdicts))
    code = exit_code(verdicts)
    counts = {s: sum(v.status == s for v in verdicts) for s in ("pass", "fail", "ambiguous", "missing")}
    err_console.print(", ".join(f"{n} {s}" for s, n in counts.items()))
    sys.exit(code)


@main.command()
@click.option("-c", "--concurrency", "levels", default="1,2,4,8", show_default=True,
              help="Comma-separated numbers of simultaneous clients.")
@click.option("--url", default=None, help="Run against an OpenAI-compatible server (streaming /v1/completions).")
@click.option("--served-model", default=None, help="Model name to send to --url [default: its first model].")
@click.option("--model", default=None, help="Artifact path or preset for in-process runs [default: bundled].")
@click.option("--synthetic", is_flag=True, help="Seeded random weights for a preset (e.g. qwen3.8-27b).")
@click.option("--quant", type=click.Choice(["fp32", "bf16", "q8", "q5", "q4", "mixed"]), default="mixed",
              show_default=True, help="Formats of --synthetic weights.")
@click.option("--spec", type=click.Choice(["none", "mtp", "dflash", "dflash2"]), default="none", show_default=True)
@click.option("--draft-tokens", "-k", type=int, default=None)
@click.option("--max-new-tokens", "-n", type=int, default=128, show_default=True)
@click.option("--prompt-tokens", type=int, default=256, show_default=True, help="Prompt length (tokens).")
@click.option("--rounds", type=int, default=2, show_default=True, help="Rounds per level (samples).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--kv-dtype", type=click.Choice(["fp32", "bf16", "fp16", "int8"]), default="int8", show_default=True)
@click.option("--runtime", type=click.Choice(["v2", "v3"]), default="v3", show_default=True)
@click.option("--label", default=None)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the result document.")
def concurrency(levels, url, served_model, model, synthetic, quant, spec, draft_tokens, max_new_tokens, prompt_tokens,
                rounds, device, kv_dtype, runtime, label, json_path):
    """C1/C2/C4/C8 throughput and latency, in-process (continuous batching) or against a server."""
    from .suites.concurrency import ConcurrencyOptions, run_concurrency

    try:
        lv = tuple(int(x) for x in levels.split(",") if x.strip())
    except ValueError:
        raise UserError(f"-c must be comma-separated integers, got {levels!r}") from None
    opts = ConcurrencyOptions(levels=lv, url=url, served_model=served_model, model=model, synthetic=synthetic,
                              quant=quant, spec=spec,
                              draft_tokens=draft_tokens, max_new_tokens=max_new_tokens, prompt_tokens=prompt_tokens,
                              rounds=rounds, device=device, kv_dtype=kv_dtype, runtime=runtime, label=label)
    prog, update = suite_progress("concurrency")
    with prog:
        doc = run_concurrency(opts, progress=update)
    table = Table(title=f"concurrency: {doc['label']}")
    for col in ("C", "agg tok/s", "req tok/s", "TTFT p50/p99 ms", "ITL p50/p99 ms", "e2e p50 ms", "= sequential"):
        table.add_column(col)
    for lv_ in doc["summary"]["levels"]:
        table.add_row(str(lv_["concurrency"]), fmt(lv_["aggregate_tok_s"], ".1f"), fmt(lv_["per_request_tok_s"], ".1f"),
                      f"{fmt(lv_['ttft_ms_p50'], '.1f')} / {fmt(lv_['ttft_ms_p99'], '.1f')}",
                      f"{fmt(lv_['itl_ms_p50'], '.2f')} / {fmt(lv_['itl_ms_p99'], '.2f')}", fmt(lv_["e2e_ms_p50"], ".0f"),
                      "[green]yes[/]" if lv_["matches_sequential"] else "[red]NO[/]")
    console.print(table)
    save_result(doc, json_path)
    if not all(lv_["matches_sequential"] for lv_ in doc["summary"]["levels"]):
        raise UserError("concurrent greedy outputs differ from the sequential ones")


# ---- serving -----------------------------------------------------------------------------------------
@main.command()
@click.argument("artifact", required=False)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8080, show_default=True, help="0 picks a free port (printed when ready).")
@click.option("--spec", type=click.Choice(["none", "mtp", "dflash", "dflash2"]), default="none", show_default=True)
@click.option("--draft-tokens", "-k", type=int, default=None, help="Draft tokens per round (default: MTP 3, DFlash 7).")
@click.option("--lm-head-draft", type=int, default=0, show_default=True,
              help="Drafters score only the N most frequent tokens (0: the full vocabulary).")
@click.option("--max-queue", type=int, default=256, show_default=True,
              help="Requests that may wait for a slot; more get 503.")
@click.option("--session-capacity", type=int, default=16, show_default=True,
              help="Session states retained (least recently used are dropped).")
@click.option("--session-dir", type=click.Path(file_okay=False), default=None,
              help="Write session states here and restore them on start.")
@engine_options
def serve(artifact, host, port, spec, draft_tokens, lm_head_draft, max_queue, session_capacity, session_dir,
          **options):
    """Serve OpenAI- and Anthropic-style HTTP APIs (default: the bundled model on 127.0.0.1:8080)."""
    from .engine.server import ServerOptions, serve as run_server

    server_opts = ServerOptions(host=host, port=port, max_queue=max_queue, session_capacity=session_capacity,
                                session_dir=session_dir)
    eng = build_engine(artifact, spec=spec, draft_tokens=draft_tokens, lm_head_draft=lm_head_draft, **options)

    def ready(url, backend, restored, problems):
        for line in problems:
            err_console.print(f"[yellow]session file[/] {line}", highlight=False)
        o = eng.options
        spec_txt = f"spec {o.spec}" + (f" k={o.draft_tokens}" if o.spec != "none" else "")
        sessions = f", {restored} sessions restored" if session_dir else ""
        console.print(f"[green]ready:[/] {url} (model {backend.model_id}, {o.max_concurrency} slots, {spec_txt}, "
                      f"kv {o.kv_dtype}, context {backend.context_limit}, {eng.device.type}{sessions})",
                      highlight=False, soft_wrap=True)

    try:
        run_server(eng, server_opts, on_ready=ready)
    except KeyboardInterrupt:
        pass
    err_console.print("[dim]server stopped[/]")


@main.command()
@click.option("--shape", default=None, help="Model preset whose shapes to measure [default: qwen3.8-27b on CUDA, "
              "tiny on a CPU].")
@click.option("--model", default=None, type=click.Path(dir_okay=False), help="Artifact whose config gives the shapes.")
@click.option("--t", "ts", default="1,8", show_default=True, help="New tokens per call (comma-separated).")
@click.option("--kernels", "variants", default="v2,v3", show_default=True, help="Variants to run: v2, v3.")
@click.option("--ops", default=None, help="Only ops whose name contains one of these (comma-separated).")
@click.option("--quant", type=click.Choice(["fp32", "bf16", "q8", "q5", "q4", "mixed"]), default="mixed",
              show_default=True, help="Weight format policy of the projections.")
@click.option("--contexts", default=None,
              help="Attention K/V lengths [default: 8192,65536 on CUDA, 1024,4096 on a CPU].")
@click.option("--repeats", type=int, default=None, help="Timed calls per record [default: 50 on CUDA, 10 on a CPU].")
@click.option("--warmup", type=int, default=None, help="Untimed calls first [default: 5 on CUDA, 1 on a CPU].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--label", default=None, help="Label of this run in reports [default: kernels-SHAPE-DEVICE].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the result document.")
def kernels(shape, model, ts, variants, ops, quant, contexts, repeats, warmup, device, seed, label, json_path):
    """Per-op microseconds, GB/s and % of copy bandwidth of the model's hot decode ops, each checked against its
    fp32 reference in the same run; exit 1 when any check fails."""
    from .suites.kernels import KernelOptions, run_kernels

    def ints(text, flag):
        try:
            return tuple(int(v) for v in text.replace(" ", "").split(",") if v)
        except ValueError:
            raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None

    def names(text):
        return tuple(v.strip() for v in text.split(",") if v.strip())

    opts = KernelOptions(shape=shape, model=model, ts=ints(ts, "--t"), variants=names(variants),
                         ops=names(ops or ""), quant=quant, contexts=ints(contexts, "--contexts") if contexts else None,
                         repeats=repeats, warmup=warmup, device=device, label=label, seed=seed)
    import torch

    if opts.device == "cpu" or (opts.device == "auto" and not torch.cuda.is_available()):
        err_console.print("[yellow]CPU run: torch timers on the host; these timings are not GPU numbers[/]")
    prog, update = suite_progress("kernels")
    with prog:
        doc = run_kernels(opts, progress=update)
    s = doc["summary"]
    table = Table(title=f"kernels: {doc['label']} on {s['gpu'] or s['device']} ({doc['config']['dtype']}, "
                        f"timer {s['timer']})")
    for col in ("op", "shape", "t", "variant", "us [p10-p90]", "GB/s", "% roofline", "max rel err", "ok"):
        table.add_column(col, justify="left" if col in ("op", "shape", "variant") else "right")
    for r in doc["records"]:
        us = f"{fmt(r['us_median'], '.1f')} [{fmt(r['us_p10'], '.1f')}-{fmt(r['us_p90'], '.1f')}]"
        roof = fmt(None if r["roofline_fraction"] is None else 100 * r["roofline_fraction"], ".1f")
        table.add_row(r["op"], "x".join(map(str, r["shape"] or [])), str(r["t"]), r["variant"], us,
                      fmt(r["gbps"], ".1f"), roof, fmt(r["max_rel_err"], ".1e"),
                      "[green]ok[/]" if r["ok"] else "[red]FAIL[/]")
    console.print(table)
    console.print(f"copy bandwidth (read + write) measured in this run: {s['copy_bandwidth_gbps']:.1f} GB/s")
    for note in sorted({f"{r['variant']}: {r['note']}" for r in doc["records"] if r["ok"] and r["note"]}):
        console.print(f"[dim]  {note}[/]", highlight=False)
    save_result(doc, json_path)
    if s["failures"]:
        for line in s["failures"]:
            err_console.print(f"[red]FAIL[/] {line}", highlight=False)
        raise UserError(f"{len(s['failures'])} of {s['checks']} kernel checks failed")


def _int_list(text: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise UserError(f"{name} must be comma-separated integers, got {text!r}") from None


def _niah_options(model, ctx, depths, cases, answer_tokens, seed, **kw):
    from .suites.niah import DEFAULT_DEPTHS, NiahOptions

    ctxs = tuple(x for c in ctx for x in _int_list(c, "--ctx")) or (65536,)
    return NiahOptions(model=model, ctxs=ctxs, depths=_int_list(depths, "--depths") if depths else DEFAULT_DEPTHS,
                       cases=cases, answer_tokens=answer_tokens, seed=seed, **kw)


def niah_case_options(f):
    for o in reversed([
        click.option("--model", default=None, help="Artifact path or preset [default: the bundled model]."),
        click.option("--ctx", multiple=True, help="Context length(s), repeatable or comma-separated [default: 65536]."),
        click.option("--depths", default=None, help="Needle depths in percent [default: 0,10,...,100]."),
        click.option("--cases", type=int, default=1, show_default=True, help="Cases per (ctx, depth)."),
        click.option("--answer-tokens", type=int, default=10, show_default=True),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--prefill-chunk", type=int, default=2048, show_default=True),
    ]):
        f = o(f)
    return f


@main.command()
@niah_case_options
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--kv-dtype", type=click.Choice(["fp32", "bf16", "fp16", "int8"]), default="int8", show_default=True)
@click.option("--runtime", type=click.Choice(["v2", "v3"]), default="v3", show_default=True)
@click.option("--oracle", "oracle_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Stored oracle outputs [default: oracles/data/niah-<model>-<ctx>.json.gz].")
@click.option("--require-oracle", is_flag=True, help="Fail when a case has no stored oracle output.")
@click.option("--heatmap", type=click.Path(dir_okay=False), default=None, help="Write the ctx x depth heatmap PNG.")
@click.option("--label", default=None)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the result document.")
def niah(model, ctx, depths, cases, answer_tokens, seed, prefill_chunk, device, kv_dtype, runtime, oracle_file,
         require_oracle, heatmap, label, json_path):
    """Needle in a haystack: retrieval, and agreement with stored float64 oracle outputs."""
    from .suites.niah import run_niah

    opts = _niah_options(model, ctx, depths, cases, answer_tokens, seed, prefill_chunk=prefill_chunk, device=device,
                         kv_dtype=kv_dtype, runtime=runtime, oracle=oracle_file, label=label)
    prog, update = suite_progress("niah")
    with prog:
        doc = run_niah(opts, progress=update)
    s = doc["summary"]
    table = Table(title=f"niah: {doc['label']} ({s['cases']} cases, {s['seconds']:.1f} s)")
    for col in ("case", "tokens", "retrieved", "oracle", "first divergence", "answer"):
        table.add_column(col)
    for r in doc["records"]:
        verdict = "-" if r["pass"] is None else ("[green]pass[/]" if r["pass"] else "[red]FAIL[/]")
        table.add_row(r["case"], str(r["prompt_tokens"]), "yes" if r["retrieved"] else "no", verdict,
                      "-" if r["first_divergence"] is None else str(r["first_divergence"]),
                      repr(r["answer"][:24]))
    console.print(table)
    agree = "no oracle" if s["oracle_agreement"] is None else f"{s['oracle_agreement']:.0%} of {s['oracle_cases']}"
    console.print(f"retrieval {s['retrieval']:.0%}, oracle agreement {agree}")
    save_result(doc, json_path)
    if heatmap or json_path:
        from .reports.frames import frames
        from .reports.plots import plot_niah

        out = heatmap or str(Path(json_path).with_suffix("")) + "_heatmap.png"
        if plot_niah(frames([doc])["niah"], out):
            err_console.print(f"[dim]heatmap: {out}[/]")
    if require_oracle and s["oracle_cases"] < s["cases"]:
        raise UserError(f"{s['cases'] - s['oracle_cases']} case(s) have no stored oracle output")
    if s["oracle_agreement"] is not None and s["oracle_agreement"] < 1.0:
        raise UserError("some cases disagree with the oracle beyond the near-tie tolerance")


@oracle.command("niah")
@niah_case_options
@click.option("--dtype", type=click.Choice(["fp64", "fp32"]), default="fp64", show_default=True)
@click.option("--top-k", type=int, default=8, show_default=True)
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Output file (one context only) [default: oracles/data/niah-<model>-<ctx>.json.gz].")
def oracle_niah(model, ctx, depths, cases, answer_tokens, seed, prefill_chunk, dtype, top_k, out):
    """Reference-model answers for the NIAH cases, stored for `ninfer-bench niah` to compare against."""
    from .suites.niah import build_niah_oracle

    opts = _niah_options(model, ctx, depths, cases, answer_tokens, seed, prefill_chunk=prefill_chunk)
    prog, update = suite_progress("oracle niah")
    with prog:
        paths = build_niah_oracle(model, opts, out, top_k=top_k, dtype=dtype, progress=update)
    for p in paths:
        console.print(f"[green]wrote[/] {p}")


def cli_entry():
    main(obj={})


if __name__ == "__main__":
    cli_entry()
