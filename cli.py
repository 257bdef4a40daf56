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
err_console = Console(stderr=True)


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
def engine_options(f):
    """The options every command that binds an Engine takes."""
    opts = [
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True),
        click.option("--dtype", type=click.Choice(["auto", "fp32", "bf16", "fp16"]), default="auto",
                     show_default=True, help="Compute dtype (auto: bf16 on CUDA, fp32 on CPU)."),
        click.option("--kv-dtype", type=click.Choice(["bf16", "fp16", "int8"]), default="int8", show_default=True),
        click.option("--max-context", type=int, default=8192, show_default=True,
                     help="Longest prompt + completion one request may have."),
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
@engine_options
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


def cli_entry():
    main(obj={})


if __name__ == "__main__":
    cli_entry()
