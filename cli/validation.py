"""The validation commands of ``ninfer-bench``: niah, ``oracle prompts`` / ``oracle niah``, report, gate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.progress import Progress
from rich.table import Table

from .common import UserError, check_output, console, err_console, int_list, run_label, save_result, suite_progress


# ---- reports and gates -------------------------------------------------------------------------------
@click.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--baseline", "baseline_label", default=None, help="Label the deltas are computed against.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output folder.")
@click.option("--title", default=None, help="Report title.")
def report(results, baseline_label, out_dir, title):
    """Release-validation report (HTML + Markdown + PNG figures + CSV tables) from result documents or folders of
    them."""
    from ..reports.frames import load_results
    from ..reports.report import DEFAULT_TITLE, write_report

    docs = load_results(list(results))
    html, md = write_report(docs, out_dir, baseline_label=baseline_label, title=title or DEFAULT_TITLE)
    console.print(f"[green]wrote[/] {html} and {md} ({len(docs)} result documents)")


@click.command()
@click.option("--baseline", required=True, type=click.Path(exists=True, dir_okay=False), help="Baseline result.")
@click.option("--candidate", required=True, type=click.Path(exists=True, dir_okay=False), help="Candidate result.")
@click.option("--rules", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Rules file (.json or .toml) [default: the suite's rules].")
@click.option("--json", "as_json", is_flag=True, help="Print the verdicts as JSON.")
@click.option("--allow-config-change", is_flag=True,
              help="Gate runs of different settings (model, prompt, lengths, engine options...) anyway: their "
                   "config row is then ambiguous, not a failure.")
def gate(baseline, candidate, rules, as_json, allow_config_change):
    """Compare a candidate result to a baseline: exit 1 on any failed or missing metric."""
    from ..reports.gate import exit_code, load_rules, render_table
    from ..reports.gate import gate as run_gate
    from ..reports.schema import read_result

    verdicts = run_gate(read_result(baseline), read_result(candidate), load_rules(rules) if rules else None,
                        allow_config_change=allow_config_change)
    if as_json:
        console.print_json(json.dumps([v.to_dict() for v in verdicts], default=str))
    else:
        console.print(render_table(verdicts))
    code = exit_code(verdicts)
    counts = {s: sum(v.status == s for v in verdicts) for s in ("pass", "fail", "ambiguous", "missing")}
    err_console.print(", ".join(f"{n} {s}" for s, n in counts.items()))
    sys.exit(code)


# ---- needle in a haystack ----------------------------------------------------------------------------
def _niah_options(model, ctx, depths, cases, answer_tokens, seed, **kw):
    from ..suites.niah import DEFAULT_DEPTHS, NiahOptions

    ctxs = tuple(dict.fromkeys(x for c in ctx for x in int_list(c, "--ctx"))) or (65536,)
    depths = tuple(dict.fromkeys(int_list(depths, "--depths"))) if depths else DEFAULT_DEPTHS
    return NiahOptions.make(model=model, ctxs=ctxs, depths=depths, cases=cases, answer_tokens=answer_tokens, seed=seed,
                            **kw)


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


@click.command()
@niah_case_options
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--kv-dtype", type=click.Choice(["fp32", "bf16", "fp16", "int8"]), default="int8", show_default=True)
@click.option("--runtime", type=click.Choice(["v2", "v3"]), default="v3", show_default=True)
@click.option("--oracle", "oracle_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Stored oracle outputs [default: oracles/data/niah-<model>-<ctx>.json.gz].")
@click.option("--require-oracle", is_flag=True, help="Fail when a case has no stored oracle output.")
@click.option("--heatmap", type=click.Path(dir_okay=False), default=None, help="Write the ctx x depth heatmap PNG.")
@click.option("--label", default=None, callback=run_label)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the result document.")
@click.option("--rescore", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Judge an earlier niah result document against the oracles stored now (nothing is run; its "
                   "cases and model come from the document).")
def niah(model, ctx, depths, cases, answer_tokens, seed, prefill_chunk, device, kv_dtype, runtime, oracle_file,
         require_oracle, heatmap, label, json_path, rescore):
    """Needle in a haystack: retrieval, and agreement with stored float64 oracle outputs."""
    from ..suites.niah import rescore_niah, run_niah

    check_output(json_path, parents=True)
    check_output(heatmap, parents=True)
    if rescore:
        from ..reports.schema import read_result

        doc = rescore_niah(read_result(rescore), oracle_file)
    else:
        opts = _niah_options(model, ctx, depths, cases, answer_tokens, seed, prefill_chunk=prefill_chunk,
                             device=device, kv_dtype=kv_dtype, runtime=runtime, oracle=oracle_file, label=label)
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
        from ..reports.frames import frames
        from ..reports.plots import plot_niah

        out = heatmap or str(Path(json_path).with_suffix("")) + "_heatmap.png"
        if plot_niah(frames([doc])["niah"], out):
            err_console.print(f"[dim]heatmap: {out}[/]")
    if require_oracle and s["oracle_cases"] < s["cases"]:
        raise UserError(f"{s['cases'] - s['oracle_cases']} case(s) have no stored oracle output")
    if s["oracle_agreement"] is not None and s["oracle_agreement"] < 1.0:
        raise UserError("some cases disagree with the oracle beyond the near-tie tolerance")


@click.group()
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
    from ..engine.artifact.loader import load_source
    from ..oracles.build import build_oracle
    from ..suites.common import read_prompt_set

    prompts = read_prompt_set(prompts_path, load_source(artifact).tokenizer)
    with Progress(console=err_console, transient=True) as prog:
        task = prog.add_task("oracle", total=len(prompts))
        build_oracle(artifact, prompts, out, max_new_tokens=max_new_tokens, top_k=top_k, dtype=dtype,
                     progress=lambda done, total, pid: prog.update(task, completed=done))
    console.print(f"[green]wrote[/] {out}: {len(prompts)} prompts x {max_new_tokens} tokens")


@oracle.command("niah")
@niah_case_options
@click.option("--dtype", type=click.Choice(["fp64", "fp32"]), default="fp64", show_default=True)
@click.option("--top-k", type=int, default=8, show_default=True)
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Output file (one context only) [default: oracles/data/niah-<model>-<ctx>.json.gz].")
@click.option("--force", is_flag=True,
              help="Replace the output file: drop the cases it holds and compute the requested ones afresh (needed "
                   "when its model or settings differ from this run's). Default: keep its cases and add the new ones.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the reference runs its plain torch ops (auto: CUDA when there is one).")
def oracle_niah(model, ctx, depths, cases, answer_tokens, seed, prefill_chunk, dtype, top_k, out, force, device):
    """Reference-model answers for the NIAH cases, stored for `ninfer-bench niah` to compare against."""
    from ..oracles.store import UNKNOWN_DEVICE, devices, load_oracle
    from ..suites.niah import build_niah_oracle

    opts = _niah_options(model, ctx, depths, cases, answer_tokens, seed, prefill_chunk=prefill_chunk)
    if out and len(opts.ctxs) > 1:
        raise UserError(f"--out names one file, for one context length; got {len(opts.ctxs)} (--ctx "
                        f"{','.join(map(str, opts.ctxs))}): run once per context, or leave --out to the default files")
    check_output(out)  # (save_oracle makes no folders)
    prog, update = suite_progress("oracle niah")
    with prog:
        paths = build_niah_oracle(model, opts, out, top_k=top_k, dtype=dtype, force=force, device=device,
                                  progress=update)
    for p in paths:  # where each case was computed: --device auto may have added GPU cases to a CPU-built file
        records, _ = load_oracle(p)
        built = ", ".join(f"{n} on {'an unrecorded device' if d == UNKNOWN_DEVICE else d}"
                          for d, n in devices(records).items())
        console.print(f"[green]wrote[/] {p}: {len(records)} cases ({built or 'none'})")


COMMANDS = (report, gate, niah, oracle)
