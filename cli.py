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
        bad = [f"{label}: {msg}" for label, ok, msg in digests if not ok]
        for line in bad[:10]:
            console.print(f"    [red]{line}[/]")
        if bad:
            sys.exit(1)


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
def convert(hf_dir, out, quant, format_version):
    """Convert a Hugging Face Qwen3.5 / Qwen3-Next folder into an artifact."""
    from .engine.convert import convert as do_convert

    prog, update = byte_progress("writing")
    with prog:
        do_convert(hf_dir, out, policy=quant, version=int(format_version), progress=update)
    console.print(f"[green]wrote[/] {out} ({Path(out).stat().st_size:,} bytes, quant {quant}, v{format_version})")


@main.command()
@click.argument("v2_file", type=click.Path(dir_okay=False))
@click.argument("v3_file", type=click.Path(dir_okay=False))
def upgrade(v2_file, v3_file):
    """Rewrite a v2 artifact as v3 without changing any weight bytes."""
    from .engine.artifact import upgrade as do_upgrade

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
@engine_options
def generate(artifact, prompt, prompt_file, chat, max_new_tokens, temperature, top_p, top_k, seed, stop, spec,
             draft_tokens, **options):
    """Generate text from a prompt (default model: the bundled one)."""
    if (prompt is None) == (prompt_file is None):
        raise UserError("give exactly one of --prompt or --prompt-file")
    text = prompt if prompt is not None else Path(prompt_file).read_text()
    eng = build_engine(artifact, spec=spec, draft_tokens=draft_tokens, **options)
    if chat:
        text = eng.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    ids = eng.tokenizer.encode(text)
    res = eng.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                       seed=seed, stop=stop)
    console.print(res.text, highlight=False, markup=False)
    n = res.completion_tokens
    tok_s = (n - 1) / res.decode_s if n > 1 and res.decode_s > 0 else float("nan")
    extra = ""
    if res.spec.get("rounds"):
        extra = (f", {res.spec['tokens_per_round']:.2f} tokens/round, "
                 f"acceptance {res.spec['acceptance_rate']:.2f}")
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
              help="Prompt text [default: the shipped short-code prompt].")
@click.option("--max-new-tokens", "-n", type=int, default=4096, show_default=True)
@click.option("--stop-at-eos", is_flag=True, help="Stop at end-of-sequence (default: always generate -n tokens).")
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--warmup", type=int, default=1, show_default=True)
@click.option("--label", default=None, help="Label of this run in reports [default: runtime-spec-k].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the result document.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --synthetic weights.")
@engine_options
def decode(model, engine, spec, draft_tokens, rollback, lm_head_draft, prompt_file, max_new_tokens, stop_at_eos,
           repeats, warmup, label, json_path, seed, max_concurrency, kv_capacity, **options):
    """The short-code decode test: prefill a code prompt, greedy-decode N tokens, measure speed and acceptance."""
    from .suites.common import DEFAULT_PROMPT
    from .suites.decode import DecodeOptions, run_decode

    opts = DecodeOptions(model=model, engine=engine, spec=spec, draft_tokens=draft_tokens, rollback=rollback,
                         lm_head_draft=lm_head_draft, prompt_file=prompt_file or str(DEFAULT_PROMPT),
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
def concurrency(levels, url, served_model, model, spec, draft_tokens, max_new_tokens, prompt_tokens, rounds, device,
                kv_dtype, runtime, label, json_path):
    """C1/C2/C4/C8 throughput and latency, in-process (continuous batching) or against a server."""
    from .suites.concurrency import ConcurrencyOptions, run_concurrency

    try:
        lv = tuple(int(x) for x in levels.split(",") if x.strip())
    except ValueError:
        raise UserError(f"-c must be comma-separated integers, got {levels!r}") from None
    opts = ConcurrencyOptions(levels=lv, url=url, served_model=served_model, model=model, spec=spec,
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


def cli_entry():
    main(obj={})


if __name__ == "__main__":
    cli_entry()
