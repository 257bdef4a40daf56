"""``ninfer-bench``: the command line. It parses flags into the library's option objects and calls it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.progress import Progress
from rich.text import Text

# piped into a file or a CI log, rich would assume 80 columns and squeeze wide tables: give it room
console = Console(stderr=False, width=None if sys.stdout.isatty() else 140)
err_console = Console(stderr=True, soft_wrap=True)


class UserError(click.ClickException):
    """A mistake in what the user asked for: one line on stderr, exit code 1."""

    def show(self, file=None) -> None:
        # the message as plain text: no markup or emoji codes inside it (``[...]``, ``:x``) are interpreted
        err_console.print(Text.assemble(("error:", "bold red"), " ", self.message), highlight=False)


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


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.version_option(package_name="ninfer-bench")
@click.pass_context
def main(ctx, debug):
    """ninfer-bench: an inference engine for the Qwen3.5 / Qwen3-Next hybrid family and its benchmark harness."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


# ---- shared helpers ------------------------------------------------------------------------------
def check_output(path: str | None, *, folder: bool = False, parents: bool = False) -> bool:
    """Refuse, before any work, an output path that could not be written at the end: a folder where a file goes (or
    the other way round), or no writable folder to put it in (``parents``: the writer makes missing folders, so the
    nearest existing one must be writable). Returns whether something is there already (it will be replaced)."""
    if not path:
        return False
    p = Path(path)
    if p.exists() and p.is_dir() != folder:
        raise UserError(f"cannot write {path}: {'not a folder' if folder else 'it is a folder'}")
    parent = (p if folder else p.parent).resolve()
    while parents and not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"cannot write {path}: folder {parent} "
                        f"{'is a file' if parent.exists() else 'does not exist'}")
    if not os.access(parent, os.W_OK | os.X_OK) or not _can_create(parent):
        raise UserError(f"cannot write {path}: folder {parent} is not writable")
    return p.exists()


def _can_create(folder: Path) -> bool:
    """Whether a file can be made in ``folder`` (permission bits say yes on read-only mounts and /proc)."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ninfer-bench-check-"):
            return True
    except OSError:
        return False


def overwritten(path: str, existed: bool) -> None:
    if existed:
        err_console.print(f"[yellow]note:[/] the existing {path} was overwritten", highlight=False)


# ---- running a model ---------------------------------------------------------------------------------
def comma_list(choices):
    """A click callback: a comma-separated list of ``choices`` -> tuple (order kept, duplicates dropped)."""
    def parse(ctx, param, value):
        items = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
        bad = [v for v in items if v not in choices]
        if bad or not items:
            raise click.BadParameter(f"{value!r}: comma-separated values from {', '.join(choices)}")
        return items
    return parse


def run_label(ctx, param, value):
    """A click callback for ``--label``: a run's label names its result file in a grid's folder and its rows in
    reports, so it is one file name - no path separator, not ``.`` / ``..``, no control character."""
    if value is None:
        return None
    bad = not value.strip() or value in (".", "..") or any(c in value for c in "/\\") \
        or any(ord(c) < 32 for c in value)
    if bad:
        raise click.BadParameter(f"{value!r}: a label is a file name (no '/', '\\', control characters; not empty, "
                                 f"'.' or '..')")
    return value


def engine_options(f=None, *, kv_default: str = "int8", runtime_list: bool = False):
    """The options every command that binds an Engine takes (``runtime_list``: --runtime takes v3,v2)."""
    if f is None:
        return lambda g: engine_options(g, kv_default=kv_default, runtime_list=runtime_list)
    runtime = click.option("--runtime", default="v3", show_default=True, callback=comma_list(("v2", "v3")),
                           help="v3 (fused kernels, CUDA graphs) or v2 (eager); comma-separated to run both.") \
        if runtime_list else click.option("--runtime", type=click.Choice(["v2", "v3"]), default="v3",
                                          show_default=True)
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
        click.option("--prefill-chunk", type=int, default=2048, show_default=True,
                     help="Prompt tokens per prefill forward."),
        runtime,
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


def int_list(text: str, flag: str) -> list[int]:
    """Comma-separated integers of a flag (``1,2,3``; repeats kept), or a one-line error naming the flag."""
    items = [v.strip() for v in text.split(",")]
    if not text.strip():
        raise UserError(f"{flag} is empty")
    if "" in items:
        raise UserError(f"{flag} has an empty item (item {items.index('') + 1} of {text!r})")
    try:
        return [int(v) for v in items]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None


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
    prompt = int_list(ids, "--ids") if ids is not None else None
    check_output(out)
    eng = build_engine(artifact, **options)
    out_logits = eng.logits(prompt if prompt is not None else eng.tokenizer.encode(text)).numpy()
    bad_rows = np.flatnonzero(~np.isfinite(out_logits).all(axis=-1))
    if bad_rows.size:
        raise UserError(f"the logits of {bad_rows.size} of {len(out_logits)} positions (the first: {bad_rows[0]}) "
                        f"are not finite: the weights hold NaN / inf or the computation overflows; nothing written")
    with open(out, "wb") as f:  # np.save(path) would add .npy to a name without it
        np.save(f, out_logits)
    console.print(f"[green]wrote[/] {out}  shape {list(out_logits.shape)}  dtype {out_logits.dtype}")


@main.command()
@click.argument("artifact", required=False)
@click.option("--prompt", "-p", default=None, help="Prompt text.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read the prompt from a file.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user turn with the artifact's chat template.")
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=128, show_default=True)
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
    from .suites.common import read_text

    if (prompt is None) == (prompt_file is None):
        raise UserError("give exactly one of --prompt or --prompt-file")
    text = prompt if prompt is not None else read_text(prompt_file)
    eng = build_engine(artifact, spec=spec, draft_tokens=draft_tokens, **options)
    budget = eng.media_budget()  # all the prompt's items together
    items = [eng.load_media("image", p, budget) for p in images] + [eng.load_media("video", p, budget) for p in videos]
    text = "".join(placeholder(it.kind) for it in items) + text
    if chat:
        text = eng.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    ids, media = eng.media_prompt(eng.tokenizer.encode(text), items)
    res = eng.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                       seed=seed, stop=stop, media=media)
    # the completion as generated: no wrapping at the console width, no :name: emoji codes replaced
    console.print(res.text, highlight=False, markup=False, emoji=False, soft_wrap=True)
    n = res.completion_tokens
    tok_s = f"{(n - 1) / res.decode_s:.1f}" if n > 1 and res.decode_s > 0 else "-"  # one token: no decode step
    extra = ""
    if res.spec.get("rounds"):
        extra = (f", {res.spec['tokens_per_round']:.2f} tokens/round, "
                 f"acceptance {res.spec['acceptance_rate']:.2f}")
    if res.vision:
        extra += f"; vision: {res.vision['tokens']} tokens encoded in {res.vision['encode_ms']:.1f} ms"
    err_console.print(f"[dim]{len(ids)} prompt + {n} tokens ({res.finish_reason}); ttft {res.ttft_s * 1e3:.1f} ms, "
                      f"decode {tok_s} tok/s{extra}[/]", highlight=False)


@main.group()
def oracle():
    """Produce oracle outputs with the independent reference forward (float64, sequential)."""


@oracle.command("prompts")
@click.argument("artifact")
@click.option("--prompts", "prompts_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help=".jsonl prompt set ({id, text} per line) or a .txt prompt.")
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--top-k", type=int, default=8, show_default=True)
@click.option("--dtype", type=click.Choice(["fp64", "fp32"]), default="fp64", show_default=True)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output file (.json or .json.gz).")
def oracle_prompts(artifact, prompts_path, max_new_tokens, top_k, dtype, out):
    """Greedy tokens and per-step top-k log-probs of the reference model for a prompt set."""

    from .engine.loader import load_source
    from .oracles.build import build_oracle
    from .suites.common import read_prompt_set

    prompts = read_prompt_set(prompts_path, load_source(artifact).tokenizer)
    with Progress(console=err_console, transient=True) as prog:
        task = prog.add_task("oracle", total=len(prompts))
        build_oracle(artifact, prompts, out, max_new_tokens=max_new_tokens, top_k=top_k, dtype=dtype,
                     progress=lambda done, total, pid: prog.update(task, completed=done))
    console.print(f"[green]wrote[/] {out}: {len(prompts)} prompts x {max_new_tokens} tokens")


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
@click.option("--media-dir", type=click.Path(file_okay=False), default=None,
              help="Let requests name image / video files (a path or file:// URL) inside this folder; "
                   "without it media must be sent as data URIs and no local file is read.")
@click.option("--interleave-chunk", type=int, default=512, show_default=True,
              help="Prompt tokens prefilled per scheduler iteration while other requests decode (at most "
                   "--prefill-chunk): smaller lowers their inter-token latency, raises the newcomer's TTFT.")
@click.option("--generation-config", type=click.Choice(["auto", "none"]), default="auto", show_default=True,
              help="auto: the model's generation_config.json sampling defaults (temperature, top_p, top_k) fill what "
                   "a request leaves out, as vLLM does; none: the APIs' own (temperature 1, top_p 1, no top-k).")
@engine_options
def serve(artifact, host, port, spec, draft_tokens, lm_head_draft, max_queue, session_capacity, session_dir,
          media_dir, generation_config, **options):
    """Serve OpenAI- and Anthropic-style HTTP APIs (default: the bundled model on 127.0.0.1:8080)."""
    import importlib.util

    # the HTTP stack is the [serve] extra, not a core dependency: say so before the model loads, not in a traceback
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"serve needs {' and '.join(missing)} (the [serve] extra): pip install -e '.[serve]'")
    from .engine.api_anthropic import MAX_TEMPERATURE
    from .engine.server import ServerOptions, serve as run_server

    server_opts = ServerOptions(host=host, port=port, max_queue=max_queue, session_capacity=session_capacity,
                                session_dir=session_dir, media_dir=media_dir, generation_config=generation_config)
    eng = build_engine(artifact, spec=spec, draft_tokens=draft_tokens, lm_head_draft=lm_head_draft, **options)

    def ready(url, backend, restored, problems):
        for line in problems:
            err_console.print(f"[yellow]session file[/] {line}", highlight=False)
        o = eng.options
        spec_txt = f"spec {o.spec}" + (f" k={o.draft_tokens}" if o.spec != "none" else "")
        sessions = f", {restored} sessions restored" if session_dir else ""
        defaults = ", ".join(f"{k} {v}" for k, v in backend.sampling_defaults.items())
        if backend.sampling_defaults.get("temperature", 0) > MAX_TEMPERATURE:
            defaults += f" ({MAX_TEMPERATURE:g} on /v1/messages, whose requests may ask 0-{MAX_TEMPERATURE:g})"
        console.print(f"[green]ready:[/] {url} (model {backend.model_id}, {o.max_concurrency} slots, {spec_txt}, "
                      f"kv {o.kv_dtype}, context {backend.context_limit}, {eng.device.type}{sessions}"
                      f"{f'; sampling defaults from generation_config.json: {defaults}' if defaults else ''})",
                      highlight=False, soft_wrap=True)
        for line in backend.ignored_defaults:
            err_console.print(f"[yellow]generation_config.json[/] {line}: ignored", highlight=False)

    try:
        run_server(eng, server_opts, on_ready=ready)
    except KeyboardInterrupt:
        pass
    err_console.print("[dim]server stopped[/]")


from . import cli_artifacts, cli_suites, cli_validation  # noqa: E402,F401  (register their commands on `main`)
