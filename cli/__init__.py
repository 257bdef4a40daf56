"""``ninfer-bench``: the command line. It parses flags into the library's option objects and calls it.

One module per family of commands, each declaring plain click commands that this module registers on :func:`main`:
:mod:`.engine_commands` (logits, generate, serve), :mod:`.suites` (decode, concurrency, kernels), :mod:`.validation`
(report, gate, niah, oracle), :mod:`.artifacts` (inspect, verify, convert, upgrade), :mod:`.history` (compare);
:mod:`.common` holds what they share."""

from __future__ import annotations

import click

from . import artifacts, engine_commands, history, suites, validation
from .common import UserError


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


for _module in (engine_commands, suites, validation, artifacts, history):
    for _command in _module.COMMANDS:
        main.add_command(_command)
