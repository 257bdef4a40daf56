"""The artifact commands of ``ninfer-bench``: inspect, verify, convert, upgrade, export-gguf, export-tokenizer."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import click
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

from .common import UserError, check_output, console, err_console, overwritten


def byte_progress(description: str):
    """A progress bar for work measured in bytes (bytes done, rate, time left); returns (progress, callback(done,
    total, name)). Without a terminal (CI logs, a GPU box's captured output) one line at most every 10 s instead."""
    if not err_console.is_terminal:
        return contextlib.nullcontext(), _byte_lines(description)
    prog = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=err_console, transient=True)
    task = prog.add_task(description, total=None)

    def update(done, total, name=""):
        prog.update(task, completed=done, total=total, description=f"{description} {name}"[:60])

    return prog, update


def _byte_lines(description: str, every_s: float = 10.0):
    start, last = time.perf_counter(), [0.0, False]  # when a line was last printed, whether one was

    def update(done, total, name=""):
        now = time.perf_counter() - start
        # a line every every_s seconds, and the last one where any was (work that ends sooner prints nothing)
        if now - last[0] < every_s and not (done == total and last[1]):
            return
        last[0], last[1] = now, True
        rate = done / now if now > 0 else 0.0
        left = f", {(total - done) / rate:.0f} s left" if rate and total else ""
        err_console.print(Text(f"{description} {done / 1e9:.2f} / {total / 1e9:.2f} GB, {rate / 1e6:.0f} MB/s"
                               f"{left} ({now:.0f} s)"), highlight=False)

    return update


@click.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect(artifact, as_json):
    """Show an artifact's components, objects, formats, bytes and which checks pass."""
    import math

    from ..engine.artifact.reader import Artifact

    with Artifact.open(artifact, check_header=False) as art:  # a header mismatch is one of the failures listed
        summary = art.summary()
        checks = {"header": True, "bounds": True, "bindings": True}  # open() raises when any fails
        digests = art.verify()
        # v2 objects carry no digest: "n/a" then (bounds and finite values are still checked, failures still listed)
        checks["digests"] = all(ok for _, ok, _ in digests) if art.version == 3 else None
        components = component_checks(art)
        checks.update({name: ok for name, (ok, _) in components.items()})
        bad = [f"{label}: {msg}" for label, ok, msg in digests if not ok]
        bad += [msg for ok, msg in components.values() if not ok]
        if as_json:
            console.print_json(json.dumps({"summary": summary, "checks": checks, "failures": bad}, default=str))
            if bad:
                sys.exit(1)
            return
        console.print(f"[bold]{artifact}[/]  v{art.version}  id {art.artifact_id}  "
                      f"model {art.model_id or '-'}  policy {(art.metadata or {}).get('quant_policy', '-')}")
        ranked = math.prod(art.shape("draft_head.token_ids")) if art.has("draft_head.token_ids") else 0
        console.print(f"draft vocabulary (--lm-head-draft): {f'{ranked:,} ranked token ids' if ranked else 'none'}"
                      + ("" if ranked else " (convert with --draft-vocab-corpus to add one)"), highlight=False)
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
            console.print(f"  {'[dim]n/a[/] ' if ok is None else '[green]pass[/]' if ok else '[red]FAIL[/]'}  {name}")
        for line in bad[:10]:
            console.print(Text("    " + line, style="red"), highlight=False)
        if bad:
            sys.exit(1)


def component_checks(art) -> dict[str, tuple[bool, str]]:
    """(ok, message) per part of the model the artifact holds (``text`` with its MTP head, ``drafters``,
    ``vision``, the ``tokenizer``): its configs parsed and its tensors checked against them, as loading it would."""
    from ..engine.artifact.loader import drafters_of, text_of, tokenizer_of, vision_of

    comps = art.components or {}
    parts = [("text", text_of, True), ("drafters", drafters_of, comps.get("dflash") or comps.get("dflash2")),
             ("vision", vision_of, comps.get("vision"))]
    out, text_cfg = {}, None
    for name, load, present in parts:
        if not present:
            continue
        try:
            # the drafters are checked against the text config read just before (when it read)
            got = load(art, art.path, text_cfg) if name == "drafters" else load(art, art.path)
            text_cfg = got[0] if name == "text" else text_cfg
            out[name] = (True, "ok")
        except ValueError as e:
            out[name] = (False, str(e))
    if text_cfg is not None and (art.metadata or {}).get("tokenizer"):
        try:
            tokenizer_of(art, text_cfg)
            out["tokenizer"] = (True, "ok")
        except ValueError as e:
            out["tokenizer"] = (False, str(e))
    return out


@click.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
def verify(artifact):
    """Check every object's SHA-256 digest (and bounds), with a progress bar, and that the model's configs load."""
    from ..engine.artifact.reader import Artifact

    with Artifact.open(artifact, check_header=False) as art:  # a header mismatch is reported below, with the rest
        prog, update = byte_progress("verifying")
        with prog:
            results = art.verify(progress=update)
        components = component_checks(art)
    bad = [f"{label}: {msg}" for label, ok, msg in results if not ok]
    for line in bad + [msg for ok, msg in components.values() if not ok]:
        err_console.print(Text.assemble(("FAIL", "red"), " ", line), highlight=False)
    n = len(art.objects)
    whole = [label for label, ok, _ in results[:len(results) - n] if not ok]  # the header's and the file end's
    problems = [f"the {label} failed verification" for label in whole]
    problems += [f"{len(bad) - len(whole)} of {n} objects failed verification"] if len(bad) > len(whole) else []
    problems += [f"the {name} component does not load" for name, (ok, _) in components.items() if not ok]
    if problems:
        raise UserError("; ".join(problems))
    if art.version == 2:
        console.print(f"[green]ok[/]: {n} objects bounds-checked in {artifact} (a v2 artifact carries no "
                      f"digests; `upgrade` writes a v3 that does)", soft_wrap=True)
    else:
        if art.provenance.get("header_sha256"):
            console.print(f"[green]ok[/]: {n} objects and the header verified in {artifact}", soft_wrap=True)
        else:
            console.print(f"[green]ok[/]: {n} objects verified in {artifact}; [yellow]it has no header digest[/], so "
                          f"its configs, metadata and object table are not checked (`ninfer-bench upgrade` adds one)",
                          soft_wrap=True)


@click.command()
@click.argument("hf_dir", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--quant", type=click.Choice(["fp32", "bf16", "q8", "q5", "q4", "mixed"]), default="mixed",
              show_default=True, help="Quantization policy.")
@click.option("--format-version", type=click.Choice(["2", "3"]), default="3", show_default=True)
@click.option("--drafter", "drafters", multiple=True, type=click.Path(file_okay=False, exists=True),
              help="A z-lab style DFlash / DFlash2 drafter folder to add as a component (repeatable).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where to quantize (auto: the GPU when there is one); the bytes written are the same either way.")
@click.option("--draft-vocab-corpus", "corpus", multiple=True, type=click.Path(exists=True),
              help="Text / JSON-lines files or folders (repeatable): rank the vocabulary by this corpus's token counts "
                   "for --lm-head-draft (stored as draft_head.token_ids). Use text like what the model will write.")
def convert(hf_dir, out, quant, format_version, drafters, device, corpus):
    """Convert a Hugging Face Qwen3.5 / Qwen3-Next folder (bf16, fp16, fp32 or FP8) and drafter folders into an
    artifact. The checkpoint is streamed a row block at a time: memory stays near one tensor, whatever its size."""
    from ..engine.artifact.convert import convert as do_convert
    from ..engine.runtime.options import resolve_device

    where = resolve_device(device)
    existed = check_output(out)
    counting, count_update = byte_progress("counting tokens")
    prog, update = byte_progress("writing")
    with counting, prog:
        stats = do_convert(hf_dir, out, policy=quant, version=int(format_version), progress=update,
                           drafters=drafters, device=where, draft_vocab_corpus=corpus, corpus_progress=count_update)
    console.print(f"[green]wrote[/] {out} ({Path(out).stat().st_size:,} bytes, quant {quant}, v{format_version})")
    if stats is not None:
        console.print(stats.describe(), highlight=False)
    overwritten(out, existed)


@click.command()
@click.argument("v2_file", type=click.Path(dir_okay=False))
@click.argument("v3_file", type=click.Path(dir_okay=False))
def upgrade(v2_file, v3_file):
    """Rewrite a v2 artifact as v3 without changing any weight bytes; a v3 artifact without a header digest is
    rewritten with one."""
    from ..engine.artifact.writer import upgrade as do_upgrade

    existed = check_output(v3_file)
    prog, update = byte_progress("upgrading")
    with prog:
        do_upgrade(v2_file, v3_file, progress=update)
    console.print(f"[green]wrote[/] {v3_file}")
    err_console.print(f"[dim]its digests certify the bytes as they were read from {v2_file} (damage already there "
                      f"is not detected: run verify on it first)[/]", highlight=False)
    overwritten(v3_file, existed)


@click.command("export-gguf")
@click.argument("model")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--synthetic", is_flag=True, help="MODEL is a preset: export its seeded random weights.")
@click.option("--quant", type=click.Choice(["mixed", "q8", "q5", "q4", "bf16", "fp32"]), default="mixed",
              show_default=True, help="With --synthetic: the preset's quantization policy.")
@click.option("--seed", type=int, default=0, show_default=True, help="With --synthetic: the weights' seed.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="With --synthetic: where the seeded weights are built (auto: the GPU when there is one, as decode "
                   "builds them; the seeded weights differ between a CPU and a GPU).")
def export_gguf(model, out, synthetic, quant, seed, device):
    """Write MODEL's text decoder (an artifact, or a preset with --synthetic) as a GGUF file that llama.cpp loads as
    qwen35: q8 -> Q8_0, q4 -> Q4_0 and q5 -> Q5_0 (a group of 64 as two blocks with its scale), fp32 / bf16 as
    they are, so every weight dequantizes to ours bit for bit; what cannot be exported exactly is refused. The
    tokenizer and chat template go in; the MTP head, drafters and a vision tower do not."""
    from ..engine.artifact.gguf_export import export_gguf as do_export
    from ..engine.artifact.loader import load_source

    try:
        import gguf  # noqa: F401  (the clear error before any weight loads)
    except ImportError:
        raise UserError("export-gguf needs the gguf package: pip install 'ninfer-bench[peers]'") from None
    from ..engine.runtime.options import resolve_device

    existed = check_output(out)
    loaded = load_source(model, synthetic=synthetic, quant=quant, seed=seed, device=resolve_device(device))
    prog, update = byte_progress("writing")
    with prog:
        res = do_export(loaded, out, progress=update)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(res.types.items()))
    console.print(f"[green]wrote[/] {out} ({res.bytes:,} bytes; {res.tensors} tensors: {kinds}; "
                  f"pre-tokenizer {res.pre_tokenizer})")
    if res.skipped:
        err_console.print(f"[dim]not exported: {', '.join(res.skipped)}[/]", highlight=False)
    overwritten(out, existed)


@click.command("export-tokenizer")
@click.argument("model")
@click.argument("folder", type=click.Path(file_okay=False))
def export_tokenizer(model, folder):
    """Write MODEL's tokenizer (an artifact's, or a preset's byte tokenizer) into FOLDER as a Hugging Face tokenizer
    that transformers' AutoTokenizer.from_pretrained(FOLDER) loads with no network: tokenizer.json,
    tokenizer_config.json (end / padding tokens, the chat template) and special_tokens_map.json. It encodes and
    decodes as the engine does (checked before writing); clients that tokenize for themselves (lm-evaluation-harness
    local-completions, tokenizer_backend=huggingface) then send the server's own ids. No weight is read."""
    from ..engine.artifact.tokenizer_export import FILES, tokenizer_source
    from ..engine.artifact.tokenizer_export import export_tokenizer as do_export

    check_output(folder, folder=True, parents=True)
    tok, meta, data = tokenizer_source(model)
    replaced = [name for name in FILES if (Path(folder) / name).exists()]
    res = do_export(tok, folder, meta, data)
    what = "the artifact's tokenizer.json" if res.kind == "tokenizer.json" else "the byte tokenizer as byte-level BPE"
    console.print(f"[green]wrote[/] {folder} ({', '.join(res.files)}; {what}, {res.vocab:,} tokens, eos "
                  f"{res.eos_token}, pad {res.pad_token})", highlight=False)
    if replaced:
        err_console.print(f"[yellow]note:[/] replaced {', '.join(replaced)} in {folder}", highlight=False)


COMMANDS = (inspect, verify, convert, upgrade, export_gguf, export_tokenizer)
