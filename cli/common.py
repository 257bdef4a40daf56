"""What the command modules share: the consoles, one-line user errors, output-path checks, list flags, the engine
options every engine-binding command takes, progress bars and result saving."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.text import Text

# --prefill-chunk's default as engine/runtime/options.PREFILL_CHUNK resolves it (kept a literal: importing the
# engine here would load torch for every command's --help)
PREFILL_CHUNK_DEFAULT = "[default: 8192 on CUDA, 2048 on a CPU]"
PREFILL_CHUNK_HELP = f"Prompt tokens per prefill forward {PREFILL_CHUNK_DEFAULT}."

# piped into a file or a CI log, rich would assume 80 columns and squeeze wide tables: give it room
# a pipe or file gets 140 columns, or more where the caller's COLUMNS says so (a device log's wide grid table); never
# fewer (pytest-xdist's workers, for one, set COLUMNS=80)
_COLUMNS = os.environ.get("COLUMNS", "")
console = Console(stderr=False, width=None if sys.stdout.isatty()
                  else max(140, int(_COLUMNS) if _COLUMNS.isdigit() else 0))
err_console = Console(stderr=True, soft_wrap=True)


class UserError(click.ClickException):
    """A mistake in what the user asked for: one line on stderr, exit code 1."""

    def show(self, file=None) -> None:
        # the message as plain text: no markup or emoji codes inside it (``[...]``, ``:x``) are interpreted
        err_console.print(Text.assemble(("error:", "bold red"), " ", self.message), highlight=False)


# ---- output paths ------------------------------------------------------------------------------
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


# engine_options' and concurrency's (which takes its engine's options one by one)
prefill_weights_option = click.option(
    "--prefill-weights", type=click.Choice(["auto", "dense", "packed"]), default="auto", show_default=True,
    help="Prefill projections of packed (quantized) weights on CUDA: dense keeps a dense copy of each (2 bytes a "
         "weight more, refused when the GPU cannot hold them; no dequantization per chunk), packed dequantizes every "
         "chunk, auto keeps the copies when the packed weights and the copies take at most 60% of the GPU's free "
         "memory (or the packed weights are at most 4 GiB).")


# serve's and concurrency's: how a scheduler iteration runs the prompt chunks of several admitting requests
pack_prefill_option = click.option(
    "--pack-prefill", type=click.Choice(["on", "off"]), default="off", show_default=True,
    callback=lambda ctx, param, value: value == "on",
    help="The prompt chunks one scheduler iteration prefills (several admitting requests', within its token budget: "
         "--prefill-chunk, or --interleave-chunk while others decode) in one eager forward, padded to the longest "
         "chunk, each weight read once for all (off: one forward a request, a first chunk from its CUDA graph). "
         "Experimental: on an H200 the 27B's packed rows gave other tokens than each request alone from 4 rows up.")


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
        click.option("--prefill-chunk", default=None, metavar="N[,N...]",
                     help="Prompt tokens per prefill forward; comma-separated to run our engine's grid once for "
                          f"each (llama-bench's -ub), labelled -cN {PREFILL_CHUNK_DEFAULT}.") if runtime_list else
        click.option("--prefill-chunk", type=int, default=None, help=PREFILL_CHUNK_HELP),
        prefill_weights_option,
        runtime,
        click.option("--synthetic", is_flag=True, help="Seeded random weights for a preset (e.g. qwen3.8-27b)."),
        click.option("--quant", type=click.Choice(["fp32", "bf16", "q8", "q5", "q4", "mixed"]), default="mixed",
                     show_default=True, help="Formats of --synthetic weights."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def build_engine(model, *, synthetic=False, quant="mixed", seed=0, **options):
    from ..engine.runtime.engine import Engine

    return Engine.load(model, synthetic=synthetic, quant=quant, seed=seed, **options)


def _refusing(rank: int, fn, arg):
    """``fn(arg)`` on one rank of :func:`on_ranks`; a refusal (ValueError: a model the size does not divide, an
    option not split yet) comes back as its message."""
    try:
        return fn(arg)
    except ValueError as e:
        return str(e)


def on_ranks(size: int, fn, arg, tokens, collective_timeout_s: float | None = None):
    """``fn(arg)`` on each of ``size`` tensor-parallel ranks (engine/runtime/parallel.launch; ``fn`` a module-level
    function, so that a rank can import it): rank 0's result, once every rank's ``tokens(result)`` is found equal
    (each rank holds the gathered logits and picks alike: a rank that does not is a broken split, not a
    measurement). A rank's refusal is a one-line error. ``collective_timeout_s``: how long a rank may wait in a
    collective (torch's default when None; a server's ranks wait for requests)."""
    from ..engine.runtime.parallel import default_backend, launch

    say(f"tensor parallel: {size} ranks over {default_backend(size)}")
    results = launch(size, _refusing, fn, arg, collective_timeout_s=collective_timeout_s)
    refused = next((r for r in results if isinstance(r, str)), None)
    if refused is not None:
        raise UserError(refused)
    for rank, result in enumerate(results[1:], 1):
        if tokens(result) != tokens(results[0]):
            raise UserError(f"tensor parallel: rank {rank}'s tokens differ from rank 0's")
    return results[0]


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


# ---- progress and results -------------------------------------------------------------------------
def suite_progress(description: str):
    """A rich progress bar for suites counting units of work; returns (progress, callback(done, total, what)).

    Without a terminal (CI logs, a GPU box's captured output, nohup) the bar cannot redraw: one line per finished
    unit of work instead, at most every 10 s (a start and a finish always), with the time elapsed."""
    from rich.progress import MofNCompleteColumn, TimeElapsedColumn

    if not err_console.is_terminal:
        return _line_progress(description)
    prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True)
    task = prog.add_task(description, total=None)

    def update(done, total, what=""):
        prog.update(task, completed=done, total=total, description=f"{description} {what}")

    return prog, update


def _line_progress(description: str, every_s: float = 10.0):
    import contextlib
    import time

    start, last = time.perf_counter(), [None, -every_s]

    def update(done, total, what=""):
        now = time.perf_counter() - start
        if (done, total) == tuple(last[0] or ()) or (now - last[1] < every_s and done not in (0, total)):
            return
        last[0], last[1] = (done, total), now
        of = f"/{total}" if total else ""
        err_console.print(Text(f"{description} {done}{of} {what} ({now:.0f} s)"), highlight=False)

    return contextlib.nullcontext(), update


def save_result(doc: dict, json_path: str | None) -> None:
    """Write a result document to ``--json`` (when given), and add it to the ``--db`` history (when the command has
    :func:`output_options` and one was given)."""
    from ..reports.schema import write_result

    if json_path:
        write_result(doc, json_path)
        err_console.print(f"[dim]result document: {json_path}[/]")
    record_history(doc)


def switch_options(f):
    """``--NAME on|off|on,off`` for each engine switch (:data:`engine.runtime.options.SWITCHES`), defined there once:
    its help, and the label suffix of the run with it off."""
    from ..engine.runtime.options import SWITCHES

    for name, sw in reversed(SWITCHES.items()):
        f = click.option(sw.flag, name, default="on" if sw.default else "off", show_default=True,
                         callback=comma_list(("on", "off")), help=f"{sw.help} {_moved(sw)}; on,off runs both.")(f)
    return f


def one_switch_option(name: str, note: str = ""):
    """``--NAME on|off`` for one engine switch (``SWITCHES[name]``: its flag, default, help and label), for a command
    that runs one setting; ``note`` says what the command does with it."""
    from ..engine.runtime.options import SWITCHES

    sw = SWITCHES[name]
    return click.option(sw.flag, name, type=click.Choice(["on", "off"]), default="on" if sw.default else "off",
                        show_default=True, help=f"{sw.help} {note}{_moved(sw)}.")


def _moved(sw) -> str:
    """How a run with the switch away from its default is labelled."""
    return f"On is labelled {sw.on_label}" if not sw.default else f"Off is labelled {sw.off_label}"


# ---- output formats and history ------------------------------------------------------------------------------
_OUTPUT, _DB = "ninfer_bench.output", "ninfer_bench.db"


def output_options(f=None, *, db: bool = True):
    """``-o/--output table|md|csv|json|jsonl|sql`` and (``db``) ``--db FILE`` on a suite command, kept on the click
    context - the command takes no parameters for them: :func:`show` prints its table in the chosen format,
    :func:`say` a line beside it, :func:`save_result` adds each result to the history. A --db file that is there
    and is no history database is refused before the run."""
    if f is None:
        return lambda g: output_options(g, db=db)
    from ..reports.tables import FORMATS

    def keep(ctx, param, value):
        if param.name == "db" and value:
            from ..reports.history import check

            check_output(value, parents=True)
            try:
                check(value)
            except ValueError as e:
                raise click.BadParameter(str(e)) from None
        ctx.meta[f"ninfer_bench.{param.name}"] = value
        return value

    if db:
        f = click.option("--db", type=click.Path(dir_okay=False), default=None, expose_value=False, callback=keep,
                         help="Add the result to this SQLite history (made when missing; the same result twice is "
                              "one run) for `ninfer-bench compare`.")(f)
    return click.option("-o", "--output", type=click.Choice(FORMATS), default="table", show_default=True,
                        expose_value=False, callback=keep,
                        help="table: the console table; md: it as Markdown; csv, json (an array), jsonl, sql (CREATE "
                             "TABLE + INSERTs): every field of its rows. Other than table, stdout holds the output "
                             "alone (messages go to stderr).")(f)


def output_format() -> str:
    """The running command's ``-o`` (``table`` outside one, or without the option)."""
    ctx = click.get_current_context(silent=True)
    return (ctx.meta.get(_OUTPUT) if ctx else None) or "table"


def show(grid) -> None:
    """A table (:class:`reports.tables.Grid`) in the ``-o`` format: the rich table on the console, any other format
    as plain text on stdout."""
    from ..reports.tables import render, to_rich

    out = output_format()
    if out == "table":
        console.print(to_rich(grid))
    else:
        click.echo(render(grid, out), nl=False)


def say(*objects, **kwargs) -> None:
    """A line a suite prints after its table: on stdout beside a console table, on stderr when stdout carries ``-o``
    data."""
    (console if output_format() == "table" else err_console).print(*objects, **kwargs)


def record_history(doc: dict) -> None:
    """Add a result document to the running command's ``--db`` history, if it has one."""
    ctx = click.get_current_context(silent=True)
    db = ctx.meta.get(_DB) if ctx else None
    if not db:
        return
    from ..reports.history import append

    run_id, new = append(db, doc)
    err_console.print(Text(f"history: {db} (run {run_id}{'' if new else ', already there'})", style="dim"),
                      highlight=False)
