"""``decode --url`` and ``niah --url``: the flags a run against a server takes, the engine flags it refuses, and the
run itself (``suites/remote.py``); the commands (:mod:`.suites`, :mod:`.validation`) print and save the document."""

from __future__ import annotations

import click
from click.core import ParameterSource

from .common import UserError, check_output, suite_progress

# what decode / niah take against a server; every other flag given configures an in-process engine and is refused
DECODE_URL_FLAGS = frozenset({"url", "served_model", "model", "prompt_file", "n_prompts", "max_new_tokens",
                              "stop_at_eos", "repeats", "repeats_target", "repeats_budget_s", "warmup", "label",
                              "json_path", "output", "db"})
NIAH_URL_FLAGS = frozenset({"url", "served_model", "model", "ctx", "depths", "cases", "answer_tokens", "seed",
                            "oracle_file", "require_oracle", "heatmap", "label", "json_path", "output", "db"})


def refuse_engine_flags(allowed: frozenset[str]) -> None:
    """A one-line error naming the running command's flags given (even at their default values) that ``--url``
    does not take: the server's own settings apply, and the result records what it reports."""
    ctx = click.get_current_context()
    given = [max(p.opts, key=len) for p in ctx.command.params if p.name not in allowed
             and ctx.get_parameter_source(p.name) not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)]
    if given:
        raise UserError(f"{', '.join(given)} {'configures' if len(given) == 1 else 'configure'} the in-process "
                        "engine; with --url the server's own settings apply (give them to its `serve`), and the "
                        "result records what the server reports")


def _client() -> None:
    from ..suites.remote import httpx_module

    try:
        httpx_module()
    except RuntimeError as e:
        raise UserError(str(e)) from None


def decode_url(url, served_model, *, model, prompt_file, n_prompts, max_new_tokens, stop_at_eos, repeats,
               repeats_target, repeats_budget_s, warmup, label, json_path) -> dict:
    """The decode suite against ``url``; returns its document."""
    from ..suites.common import DEFAULT_PROMPT
    from ..suites.decode import DecodeOptions
    from ..suites.remote import RemoteDecodeOptions, run_decode_url

    if url is not None:
        refuse_engine_flags(DECODE_URL_FLAGS)
    _client()
    check_output(json_path, parents=True)
    workload = DecodeOptions.make(model=model, prompt_file=prompt_file or str(DEFAULT_PROMPT), prompts=n_prompts,
                                  max_new_tokens=max_new_tokens, ignore_eos=not stop_at_eos, repeats=repeats,
                                  warmup=warmup, label=label,
                                  repeats_target=None if repeats_target is None else repeats_target / 100,
                                  repeats_budget_s=repeats_budget_s)
    opts = RemoteDecodeOptions(url, workload, served_model)
    prog, update = suite_progress("decode")
    with prog:
        return run_decode_url(opts, progress=update)


def niah_url(url, served_model, opts) -> dict:
    """The niah suite against ``url`` (``opts``: the cases' NiahOptions); returns its document."""
    from ..suites.remote import RemoteNiahOptions, run_niah_url

    _client()
    remote = RemoteNiahOptions(url, opts, served_model)
    prog, update = suite_progress("niah")
    with prog:
        return run_niah_url(remote, progress=update)
