"""The validation commands of ``ninfer-bench``: niah, ``oracle prompts`` / ``oracle niah``, report, gate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.progress import Progress

from .common import (
    PREFILL_CHUNK_HELP,
    UserError,
    check_output,
    console,
    err_console,
    int_list,
    on_ranks,
    one_switch_option,
    output_options,
    run_label,
    save_result,
    say,
    show,
    suite_progress,
)


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


@click.command(context_settings={"max_content_width": 120})
@click.option("--baseline", required=True, type=click.Path(exists=True),
              help="Baseline result document, or a folder of them (a grid).")
@click.option("--candidate", required=True, type=click.Path(exists=True),
              help="Candidate result document, or a folder of them (paired with the baseline's by suite and label).")
@click.option("--rules", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Rules file (.toml or .json) merged into each suite's default rules (format below).")
@click.option("--threshold", "thresholds", multiple=True, metavar="METRIC=PCT",
              help="Set a rule's threshold in percent, e.g. --threshold decode_tok_s=10 (repeatable; a wildcard "
                   "rule's instance, levels[concurrency=4].aggregate_tok_s=8, changes that instance only).")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.01, show_default=True,
              help="Timings are decided on two-sided 1-alpha intervals.")
@click.option("--json", "as_json", is_flag=True, help="Print the verdicts as JSON (format in docs/DESIGN.md).")
@click.option("--allow-config-change", is_flag=True,
              help="Gate runs of different settings (model, prompt, lengths, engine options, threads, clocks...) "
                   "anyway: their config row is then ambiguous, not a failure.")
def gate(baseline, candidate, rules, thresholds, alpha, as_json, allow_config_change):
    """Compare a candidate result to a baseline (or a grid to a grid): exact metrics must match; timings are decided
    on confidence intervals over their per-repeat samples.

    --baseline and --candidate are both result files, or both folders: a folder's *.json / *.json.gz results are
    paired by suite and label, one table per pair; a baseline run without a candidate fails the gate, a candidate run
    without a baseline is listed.

    \b
    Exit codes (the worst over all pairs):
      0  every row passed
      1  a row failed or is missing, a baseline run has no candidate, or nothing was compared
         (also a bad rules file or result document: one line on stderr)
      2  a usage error
      3  nothing failed, but some row is ambiguous: its samples cannot tell (the reason says
         about how many repeats a side would), a config change was allowed, or the load differed

    A timing passes when the 99% interval (--alpha) of its change stays within the threshold, and fails when the
    interval reaches past the threshold, the estimated slowdown is at least 3/4 of it and the interval excludes
    every slowdown under half of it;
    anything else is ambiguous, and so is every timing with fewer than 5 samples a side (at the default
    --alpha). A timing without samples passes within its threshold and is ambiguous beyond it; peak memory (kind
    threshold) is judged on its threshold alone. Default thresholds: decode tok/s and device ms a round 5%, 4% when
    both runs ran on a GPU; prefill tok/s and TTFT 10%; concurrency and kernels timings 5% (TTFT, ITL 10%).

    Rules: --rules FILE and --threshold merge into each suite's default rules (those of the pair's device). An entry
    whose metric (and suite) is a default rule's replaces the keys it gives; one naming an instance of a wildcard rule
    overrides that instance; any other adds a rule; remove = true drops one. Dropping an exact rule (or changing its
    kind) prints a warning and is listed in the JSON's "removed": exact checks are never switched off silently.

    \b
    Rule keys:
      metric            required: a path into the summary (decode_tok_s,
                        levels[concurrency=*].aggregate_tok_s, records[op=*,shape=*,variant=*,t=*].us_median)
      kind              exact | timing | threshold                       [timing]
      higher_is_better  true | false                                     [true]
      threshold         a fraction: 0.05 is 5% (--threshold takes percent) [0.05]
      samples           path of the per-repeat sample list (timing)      [none]
      suite             decode | niah | concurrency | kernels | prefill: only that suite's results
      remove            true: drop the rule of this metric (with metric and suite only)

    \b
    rules.toml:
      [[rules]]
      metric = "decode_tok_s"
      threshold = 0.10
    \b
      [[rules]]
      metric = "peak_memory_bytes"
      remove = true

    \b
    rules.json:
      {"rules": [{"metric": "decode_tok_s", "threshold": 0.10},
                 {"metric": "levels[concurrency=*].ttft_ms_p50", "suite": "concurrency", "threshold": 0.2}]}
    """
    from ..reports.gate import (EXIT_CODES, STATUSES, Pair, doc_device, env_line, env_summary, load_rule_changes,
                                merge_rules, pair_results, parse_threshold, read_folder, render_table, status_of,
                                worst)
    from ..reports.gate import gate as run_gate
    from ..reports.schema import read_result

    folders = [Path(p).is_dir() for p in (baseline, candidate)]
    if folders[0] != folders[1]:
        raise UserError(f"--baseline is a {'folder' if folders[0] else 'file'} and --candidate a "
                        f"{'folder' if folders[1] else 'file'}: give two result files or two folders")
    try:
        changes = [parse_threshold(t) for t in thresholds]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--threshold") from None
    changes = (load_rule_changes(rules) if rules else []) + changes
    if folders[0]:
        pairs, unpaired = pair_results(read_folder(baseline), read_folder(candidate))
    else:
        b, c = read_result(baseline), read_result(candidate)
        pairs, unpaired = [Pair(b["suite"], c["label"], baseline, candidate, b, c)], []
    def rules_of(p):  # a suite's rules per device its pairs ran on (decode's step timings: default_rules)
        return p.suite, doc_device(p.baseline, p.candidate)

    merged = {k: merge_rules(k[0], changes, device=k[1]) for k in dict.fromkeys(map(rules_of, pairs))}
    suites = list(dict.fromkeys(k[0] for k in merged))
    used = [id(ch) for m in merged.values() for ch in m.used]
    for ch in changes:
        if id(ch) not in used and ch.adjust_only:
            raise UserError(f"{ch.source}: no rule of the gated {', '.join(suites) or 'results'} has metric "
                            f"{ch.metric!r}")
        if id(ch) not in used and (ch.suite is None or ch.suite in suites):
            err_console.print(f"[yellow]warning:[/] {ch.source} ({ch.metric}) applies to none of the gated results",
                              highlight=False)
    removed = list({(r["suite"], r["metric"], r["source"], r["what"]): r  # once, though merged for several devices
                    for m in merged.values() for r in m.removed}.values())
    for r in removed:
        tag = "[yellow]warning:[/]" if r["kind"] == "exact" else "note:"
        checked = "; it is no longer checked" if r["what"] == "removed" else "; it is no longer checked exactly"
        err_console.print(f"{tag} {r['source']} {r['what']} the {r['kind']} {r['suite']} rule {r['metric']}"
                          + (checked if r["kind"] == "exact" else ""), highlight=False)
    results = []
    for p in pairs:
        verdicts = run_gate(p.baseline, p.candidate, merged[rules_of(p)].rules, alpha=alpha,
                            allow_config_change=allow_config_change)
        results.append((p, verdicts, status_of(verdicts), env_summary(p.baseline, p.candidate)))
    status = worst([s for *_, s, _ in results] + ["fail" for u in unpaired if u["side"] == "baseline"])
    code = EXIT_CODES[status]
    if as_json:
        out = {"status": status, "exit_code": code, "alpha": alpha,
               "rules": {"changes": [ch.to_dict() for ch in changes], "removed": removed},
               "pairs": [{"suite": p.suite, "label": p.label, "status": s, "env": env,
                          "baseline": {"path": p.baseline_path, "label": p.baseline["label"]},
                          "candidate": {"path": p.candidate_path, "label": p.candidate["label"]},
                          "verdicts": [v.to_dict() for v in verdicts]} for p, verdicts, s, env in results],
               "unpaired": unpaired}
        console.print_json(json.dumps(out, default=str))
    for p, verdicts, s, env in results:
        name = p.label if p.baseline["label"] == p.label else f"{p.baseline['label']} -> {p.label}"
        if not as_json:
            console.print(render_table(verdicts, title=f"{p.suite} {name}: {s}"))
        counts = ", ".join(f"{n} {st}" for st in STATUSES if (n := sum(v.status == st for v in verdicts)))
        err_console.print(f"{p.suite} {name}: {s} ({counts or 'nothing compared'}); {env_line(env)}",
                          highlight=False)
    for u in unpaired:
        what = "no candidate run: fails the gate" if u["side"] == "baseline" else "no baseline run: not gated"
        err_console.print(f"{'[red]' if u['side'] == 'baseline' else '[yellow]'}{u['suite']} {u['label']}[/] "
                          f"({u['path']}): {what}", highlight=False)
    err_console.print(f"gate: {status} (exit {code})", highlight=False)
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
    ]):
        f = o(f)
    return f


@click.command()
@niah_case_options
@click.option("--prefill-chunk", type=int, default=None, help=PREFILL_CHUNK_HELP)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--kv-dtype", type=click.Choice(["fp32", "bf16", "fp16", "int8"]), default="int8", show_default=True)
@click.option("--runtime", type=click.Choice(["v2", "v3"]), default="v3", show_default=True)
@one_switch_option("cudnn_prefill", "Here the cases check the split's oracle agreement where it applies (CUDA only). ")
@click.option("--oracle", "oracle_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Stored oracle outputs [default: oracles/data/niah-<model>-<ctx>.json.gz].")
@click.option("--require-oracle", is_flag=True, help="Fail when a case has no stored oracle output.")
@click.option("--heatmap", type=click.Path(dir_okay=False), default=None, help="Write the ctx x depth heatmap PNG.")
@click.option("--label", default=None, callback=run_label)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the result document.")
@click.option("--rescore", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Judge an earlier niah result document against the oracles stored now (nothing is run; its "
                   "cases and model come from the document).")
@click.option("--url", default=None,
              help="Run the cases against an OpenAI-compatible server: engine flags are refused; --model names the "
                   "tokenizer that builds the cases (the server's) and whose oracles judge them.")
@click.option("--served-model", default=None, help="Model name to send to --url [default: its first model].")
@click.option("--tensor-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="Split our engine over N ranks, one process each (as decode --tensor-parallel).")
@click.option("--warmup-prompt", type=click.IntRange(min=0), default=None, metavar="N",
              help="Generate once on an N-token code prompt before the cases, so the first case's TTFT holds no "
                   "first-use costs (compiles, graph captures, a long prompt's first allocations); 0: no warm-up "
                   "[default: the longest case's own prompt on CUDA, none on the CPU].")
@output_options
def niah(model, ctx, depths, cases, answer_tokens, seed, prefill_chunk, device, kv_dtype, runtime, cudnn_prefill,
         oracle_file, require_oracle, heatmap, label, json_path, rescore, url, served_model, tensor_parallel, warmup_prompt):
    """Needle in a haystack: retrieval, and agreement with stored float64 oracle outputs."""
    from ..reports.tables import niah_grid
    from ..suites.niah import rescore_niah, run_niah

    check_output(json_path, parents=True)
    check_output(heatmap, parents=True)
    if tensor_parallel > 1 and (url is not None or served_model is not None or rescore):
        raise UserError("--tensor-parallel splits our engine over ranks: give it without --url and --rescore")
    if url is not None or served_model is not None:  # against a server (cli/remote.py, suites/remote.py)
        from .remote import NIAH_URL_FLAGS, niah_url, refuse_engine_flags

        if rescore:
            raise UserError("--rescore judges a saved document again: it runs nothing, against --url or otherwise")
        if url is not None:
            refuse_engine_flags(NIAH_URL_FLAGS)
        doc = niah_url(url, served_model, _niah_options(model, ctx, depths, cases, answer_tokens, seed,
                                                        oracle=oracle_file, label=label))
    elif rescore:
        from ..reports.schema import read_result

        if warmup_prompt is not None:
            raise UserError("--warmup-prompt warms up an engine: --rescore runs none")

        doc = rescore_niah(read_result(rescore), oracle_file)
    else:
        from ..engine.runtime.options import refuse_cuda_switches

        refuse_cuda_switches(device, {"cudnn_prefill": (cudnn_prefill == "on",)})
        opts = _niah_options(model, ctx, depths, cases, answer_tokens, seed, prefill_chunk=prefill_chunk,
                             device=device, kv_dtype=kv_dtype, runtime=runtime, oracle=oracle_file, label=label,
                             tensor_parallel=tensor_parallel, warmup_prompt=warmup_prompt,
                             cudnn_prefill=cudnn_prefill == "on")
        if tensor_parallel > 1:
            doc = on_ranks(tensor_parallel, run_niah, opts, lambda d: [r.get("tokens") for r in d["records"]])
        else:
            prog, update = suite_progress("niah")
            with prog:
                doc = run_niah(opts, progress=update)
    s = doc["summary"]
    show(niah_grid(doc))
    agree = (s.get("oracle_unavailable") or "no oracle") if s["oracle_agreement"] is None else f"{s['oracle_agreement']:.0%} of {s['oracle_cases']}"
    say(f"retrieval {s['retrieval']:.0%}, oracle agreement {agree}")
    save_result(doc, json_path)
    if heatmap or json_path:
        from ..reports.frames import frames
        from ..reports.plots import plot_niah

        out = heatmap or str(Path(json_path).with_suffix("")) + "_heatmap.png"
        if plot_niah(frames([doc])["niah"], out):
            err_console.print(f"[dim]heatmap: {out}[/]")
    if require_oracle and s["oracle_cases"] < s["cases"]:
        raise UserError(s.get("oracle_unavailable") or f"{s['cases'] - s['oracle_cases']} case(s) have no stored "
                                                       f"oracle output")
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
@click.option("--prefill-chunk", type=int, default=2048, show_default=True,
              help="Prompt tokens per forward of the reference model (its memory bound at long contexts).")
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
