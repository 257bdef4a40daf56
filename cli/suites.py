"""The suite commands of ``ninfer-bench`` that measure speed: decode, concurrency, kernels. The validation
commands - niah, ``oracle``, report, gate - are in :mod:`.validation`."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table
from rich.text import Text

from ..reports.tables import (
    concurrency_grid,
    decode_grid,
    decode_runs_grid,
    kernels_grid,
    open_loop_grid,
    timeline_grid,
)
from .common import (
    PREFILL_CHUNK_HELP,
    UserError,
    check_output,
    comma_list,
    engine_options,
    err_console,
    int_list,
    on_ranks,
    output_options,
    pack_prefill_option,
    prefill_weights_option,
    run_label,
    save_result,
    say,
    show,
    suite_progress,
    switch_options,
)


# ---- suites ------------------------------------------------------------------------------------------
def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def repeats_count(ctx, param, value) -> int | str:
    """A click callback for decode's ``--repeats``: a count, or ``auto``."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise click.BadParameter(f"{value!r}: a number of repeats, or auto") from None


@click.command()
@click.option("--model", default=None, help="Artifact path or preset [default: the bundled model].")
@click.option("--url", default=None,
              help="Decode against an OpenAI-compatible server (streamed /v1/completions): engine flags are refused, "
                   "--model only names the tokenizer.")
@click.option("--served-model", default=None, help="Model name to send to --url [default: its first model].")
@click.option("--engine", "engines", default="ours", show_default=True,
              callback=comma_list(("ours", "hf", "llamacpp")),
              help="ours, hf (the transformers peer on the same weights) or llamacpp (llama.cpp on their exact GGUF "
                   "export, with its agreement with ours); ours,hf,llamacpp runs them all on one load.")
@click.option("--spec", "specs", default="none", show_default=True,
              help="none, mtp, dflash or dflash2, each optionally NAME:K; comma-separated to run several "
                   "(e.g. none,mtp:3,dflash2:7).")
@click.option("--draft-tokens", "-k", type=int, default=None, help="Draft tokens per round (default: MTP 3, DFlash 7).")
@click.option("--rollback", "rollbacks", default="recompute", show_default=True,
              callback=comma_list(("recompute", "snapshot")),
              help="How rejected positions' recurrent state is undone; recompute,snapshot runs both.")
@click.option("--lm-head-draft", default="0", show_default=True,
              help="Drafters score only the N most frequent tokens (0: the full vocabulary); comma-separated to "
                   "compare (0,2048).")
@switch_options
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Prompt text, or a .jsonl prompt set (e.g. suites/data/heldout_prompts.jsonl) "
                   "[default: the shipped short-code prompt].")
@click.option("--prompts", "n_prompts", type=int, default=None, help="Use the first N prompts of a .jsonl set.")
@click.option("-p", "--prompt-length", "prompt_lengths", default=None, metavar="N[,N...]",
              help="llama-bench's prompt-length grid: the whole grid once for each N, on one prompt of exactly N "
                   "tokens cut from the shipped code text (labels end -pN; --max-context grows to hold N + -n when "
                   "not given). E.g. -p 512,8192,65536 -n 128 measures prefill and long-context decode in one run.")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image before each prompt (repeatable; a model with a vision component): the result reports "
                   "the vision encode time and merged token count.")
@click.option("--max-new-tokens", "-n", type=int, default=4096, show_default=True)
@click.option("--stop-at-eos", is_flag=True, help="Stop at end-of-sequence (default: always generate -n tokens).")
@click.option("--repeats", default="3", show_default=True, callback=repeats_count, metavar="N|auto",
              help="Timed repeats, or auto: repeat until the 95% confidence interval of the median decode tok/s is "
                   "within ±--repeats-target of it (5 to 50 repeats, at most --repeats-budget-s of them).")
@click.option("--repeats-target", type=float, default=None, metavar="PCT",
              help="--repeats auto: the CI half-width to reach, in percent of the median [default: 2].")
@click.option("--repeats-budget-s", type=float, default=None,
              help="--repeats auto: seconds of timed repeats at most [default: 60].")
@click.option("--inject-delay-us", type=float, default=0.0,
              help="Testing only: make every decode step (a speculative round) N microseconds longer - a busy-wait "
                   "of that much CPU time; on CUDA a sleep kernel on the step's stream with the host waiting as long "
                   "meanwhile - a known slowdown for checking the gate (recorded as config.inject_delay_us, no part "
                   "of the experiment).")
@click.option("--warmup", type=int, default=1, show_default=True)
@click.option("--warmup-prompt", type=int, default=None, metavar="N",
              help="Warm up on a prompt of N tokens cut from the shipped code text instead of the timed prompt: a "
                   "long-context run (-p 262016) warms what depends on the engine's capacity (decode graphs, "
                   "kernels) without prefilling twice; what only the long prompt reaches stays cold.")
@click.option("--label", default=None, callback=run_label,
              help="Label of this run in reports [default: runtime-spec-k; with several runs, a prefix of each "
                   "run's label].")
@click.option("--json", "json_path", type=click.Path(), default=None,
              help="Write the result document (several runs: a folder, one LABEL.json per run).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --synthetic weights.")
@click.option("--llamacpp-gguf", type=click.Path(dir_okay=False), default=None,
              help="--engine llamacpp: run llama.cpp on this export-gguf file of the same weights (checked against "
                   "them) instead of exporting them again.")
@click.option("--llamacpp-flash-attn/--no-llamacpp-flash-attn", default=None,
              help="--engine llamacpp: llama.cpp's flash attention [default: on with CUDA, as llama.cpp's own auto "
                   "picks it there; off on the CPU]. A build with -DGGML_CUDA_FA=OFF needs --no-llamacpp-flash-attn.")
@click.option("--no-baseline", is_flag=True,
              help="Run a speculative run alone: without it, each gets a plain run on the same load first and the "
                   "speed-up over it beside its result.")
@click.option("--replay-acceptance", default=None, metavar="seed|P|FILE",
              help="For weights that cannot draft (--synthetic): each draft becomes the plain run's token with "
                   "probability P a position (seed: the release's tokens per round, 5.16 for DFlash2 K=7, 3.37 for "
                   "MTP3; FILE: a JSON list, one probability a position), else a rejected one; labelled -replay.")
@click.option("--tensor-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="Split our engine over N ranks, one process each (gloo on CPUs, NCCL with N GPUs): heads, MLP rows "
                   "and the vocabulary; on CUDA without CUDA graphs so far (the fused kernels run eagerly).")
@output_options
@engine_options(runtime_list=True)
def decode(model, engines, specs, draft_tokens, rollbacks, lm_head_draft, prompt_file, n_prompts, prompt_lengths, images,
           max_new_tokens, stop_at_eos, repeats, repeats_target, repeats_budget_s, inject_delay_us, warmup,
           warmup_prompt, label, json_path, seed, no_baseline, replay_acceptance, runtime, tensor_parallel, **options):
    """The short-code decode test: prefill a code prompt, greedy-decode N tokens, measure speed and acceptance.

    Comma-separated --engine, --runtime, --spec, --rollback and --lm-head-draft run every combination in one
    process, the weights loaded once (as llama-bench runs its grid), and end with a side-by-side table.

    The on / off switches (--lookahead, --draft-graphs, --pdl, --side-stream, --prefill-graphs, --flash-prefill,
    --silu-epilogue) change only runs on CUDA: off is refused on a CPU."""
    url, served_model = options.pop("url"), options.pop("served_model")
    lengths = tuple(int_list(prompt_lengths, "-p")) if prompt_lengths is not None else ()
    chunk_text = options.pop("prefill_chunk")
    chunks = tuple(int_list(chunk_text, "--prefill-chunk")) if chunk_text is not None else (None,)
    options["prefill_chunk"] = chunks[0]  # (several: decode_runs sets each run's; None: the device's default)
    if lengths and (prompt_file or n_prompts or images):
        raise UserError("-p cuts its prompts from the shipped code text: give it without --prompt-file, --prompts "
                        "or --image")
    if lengths and (url is not None or served_model is not None):
        raise UserError("-p runs in-process (its prompts are token ids): give it without --url")
    if tensor_parallel > 1 and (url is not None or served_model is not None or set(engines) != {"ours"}):
        raise UserError("--tensor-parallel splits our engine over ranks in this process's children: give it with "
                        "--engine ours and without --url")
    if url is not None or served_model is not None:  # against a server (cli/remote.py, suites/remote.py)
        from .remote import decode_url

        if warmup_prompt is not None:
            raise UserError("--warmup-prompt cuts token ids in-process: give it without --url")

        doc = decode_url(url, served_model, model=model, prompt_file=prompt_file, n_prompts=n_prompts,
                         max_new_tokens=max_new_tokens, stop_at_eos=stop_at_eos, repeats=repeats,
                         repeats_target=repeats_target, repeats_budget_s=repeats_budget_s, warmup=warmup,
                         label=label, json_path=json_path)
        show(decode_grid(doc, decode_table(doc)))
        save_result(doc, json_path)
        return
    from ..engine.runtime.options import SWITCHES, refuse_cuda_switches
    from ..suites.common import DEFAULT_PROMPT
    from ..suites.decode import decode_runs, plain_agreement, run_matrix

    switches = {name: tuple(v == "on" for v in options.pop(name)) for name in SWITCHES}
    refuse_cuda_switches(options["device"], switches)
    base = dict(model=model, prompt_file=prompt_file or str(DEFAULT_PROMPT), prompts=n_prompts, images=images,
                max_new_tokens=max_new_tokens, ignore_eos=not stop_at_eos, repeats=repeats, warmup=warmup,
                warmup_prompt=warmup_prompt, seed=seed,
                repeats_target=None if repeats_target is None else repeats_target / 100,
                repeats_budget_s=repeats_budget_s, inject_delay_us=inject_delay_us, tensor_parallel=tensor_parallel,
                **options)
    runs = decode_runs(base, engines=engines, specs=tuple(specs.split(",")), runtimes=runtime, rollbacks=rollbacks,
                       lm_heads=tuple(int_list(lm_head_draft, "--lm-head-draft")), switches=switches,
                       draft_tokens=draft_tokens, label=label, baseline=not no_baseline,
                       replay=replay_acceptance, prompt_lengths=lengths,
                       prefill_chunks=chunks if len(set(chunks)) > 1 else ())
    many = sum(not r.baseline for r in runs) > 1  # an added plain partner of one run is no grid
    if many and json_path and Path(json_path).is_file():
        raise UserError(f"--json {json_path}: several runs write a folder (one LABEL.json each), not a file")
    if not many and json_path and Path(json_path).is_dir():
        raise UserError(f"--json {json_path}: one run writes a file, and this is a folder")
    check_output(json_path, folder=many, parents=True)

    partners = {r.label or r.default_label() for r in runs if r.baseline}

    def done(doc):
        if many:
            save_result(doc, str(Path(json_path) / f"{doc['label']}.json") if json_path else None)
        elif doc["label"] not in partners:  # one run: its table (with the speed-up over its partner) and file
            show(decode_grid(doc, decode_table(doc)))
            save_result(doc, json_path)

    if tensor_parallel > 1:
        docs = on_ranks(tensor_parallel, run_matrix, runs,
                        lambda ds: [d["summary"].get("tokens_sha256") for d in ds])
        for d in docs:
            done(d)
    else:
        prog, update = suite_progress("decode")
        with prog:
            docs = run_matrix(runs, progress=update, done=done)
    if many:
        same = plain_agreement(docs)
        show(decode_runs_grid(docs, same, compare_table(docs, same)))
        for d in docs:
            if d["summary"].get("agreement"):
                say(agreement_table(d))
        differ = [label for label, agrees in same.items() if agrees is False]
        if differ:
            err_console.print(f"[bold red]tokens differ from the plain run on the same runtime: {', '.join(differ)}[/] "
                              "(greedy speculative decoding should reproduce them)")


def timed(summary: dict, key: str, spec: str = ".1f") -> str:
    """A timing metric of a decode summary: its median over the repeats ± their sample standard deviation and the
    number of repeats (``91.7 ± 1.3 (n=3)``), as llama-bench shows ``t/s`` with its spread; the bare value where the
    document holds no samples of it."""
    from ..reports.stats import spread

    samples = (summary.get("samples") or {}).get(key)
    if not samples:
        return fmt(summary.get(key), spec)
    return spread(samples).text(spec)


def decode_table(doc: dict) -> Table:
    """One decode result, metric by metric (timings: median of the repeats ± sample standard deviation)."""
    s = doc["summary"]
    table = Table(title=f"decode: {doc['label']} on {doc['config']['device']} ({doc['env'].get('gpu') or 'cpu'})")
    for col in ("metric", "value"):
        table.add_column(col)
    rows = [("prompt / completion tokens", f"{s['prompt_tokens']} / {s['completion_tokens']}"),
            ("prefill tok/s", timed(s, "prefill_tok_s")),
            ("prefill TFLOP/s (model)", fmt(s.get("prefill_tflops"), ".3g")),
            ("matmul TFLOP/s (measured)", fmt(s.get("matmul_tflops"), ".3g")),
            ("prefill MFU (of matmul)", fmt(s.get("prefill_compute_fraction"), ".3f")),
            ("decode tok/s", timed(s, "decode_tok_s")),
            ("TTFT ms", timed(s, "ttft_ms")), ("device ms / round", timed(s, "device_ms_per_round", ".3f")),
            ("rounds", str(s["rounds"])), ("tokens / round", fmt(s["tokens_per_round"])),
            ("acceptance rate", fmt(s["acceptance_rate"], ".3f")),
            ("accepted per position", " ".join(f"{a:.2f}" for a in s["accepted_per_position"]) or "-"),
            ("weight bytes / step", f"{s['weight_bytes_per_step']:,}" if s["weight_bytes_per_step"] else "-"),
            ("copy bandwidth GB/s", fmt(s["copy_bandwidth_gbps"], ".0f")),
            ("achieved GB/s (weights)", fmt(s["achieved_gbps"], ".0f")),
            ("roofline fraction", fmt(s["roofline_fraction"], ".3f")),
            ("peak memory", "-" if s["peak_memory_bytes"] is None else f"{s['peak_memory_bytes'] / 2**20:,.0f} MiB"),
            ("tokens sha256", s["tokens_sha256"][:16] + ("" if s["deterministic"] else " (varies!)"))]
    if s.get("repeats_run") is not None:  # how well the repeats pin the median decode tok/s down
        width = s.get("decode_tok_s_ci_half_width")
        stopped = f" (auto: {s['repeats_stopped_by']})" if s.get("repeats_stopped_by") else ""
        rows += [("repeats", f"{s['repeats_run']}{stopped}"),
                 ("decode tok/s median 95% CI", "-" if width is None else f"±{width:.1%}")]
    if doc["config"].get("url"):  # decode --url: the server, its inter-token latency, where the tokens came from
        c = doc["config"]
        rows += [("server", f"{c['url']} ({c['served_model']}, prompts as {c['prompt_format']})"),
                 ("ITL p50 / p99 ms", f"{fmt(s.get('itl_ms_p50'))} / {fmt(s.get('itl_ms_p99'))}"),
                 ("tokens from", c["tokens_from"] + ("" if c.get("ignore_eos_honoured") is not False
                                                     else " ([bold red]ignore_eos not honoured[/])"))]
    if doc["config"].get("inject_delay_us"):
        rows.append(("injected delay / step (testing)", f"{doc['config']['inject_delay_us']:g} µs"))
    c = doc["config"]
    if c.get("warmup") == 0 and str(c.get("device", "")).startswith("cuda"):  # a cold run's times are not steady
        rows.append(("warm-up", "[bold yellow]none: the times include first-use compiles and graph captures[/]"))
    elif c.get("warmup_prompt"):
        rows.append(("warm-up", f"{c['warmup']} on a {c['warmup_prompt']:,}-token prompt"))
    if s.get("plain"):  # a speculative run against plain decoding on the same load
        p = s["plain"]
        rows += [("plain decode tok/s (same load)", fmt(p["decode_tok_s"], ".1f")),
                 ("speed-up over plain", f"{fmt(p['speedup'])}x"),
                 ("tokens = plain", "yes" if p["tokens_equal"] else "[bold red]NO[/]")]
    if doc["config"].get("replay_profile"):
        rows.append(("replayed acceptance", " ".join(f"{x:.3f}" for x in doc["config"]["replay_profile"])))
    if s.get("agreement"):  # a peer against our plain run on the same weights
        rows += agreement_rows(s["agreement"])
    if "vision_encode_ms" in s:
        rows += [("vision encode ms", fmt(s["vision_encode_ms"], ".1f")), ("vision tokens", str(s["vision_tokens"]))]
    for k, v in rows:
        table.add_row(k, v)
    return table


def agreement_table(doc: dict) -> Table:
    table = Table(title=f"{doc['label']} against {doc['summary']['agreement']['reference']} (same weights)")
    for col in ("metric", "value"):
        table.add_column(col)
    for k, v in agreement_rows(doc["summary"]["agreement"]):
        table.add_row(k, v)
    return table


def agreement_rows(a: dict) -> list[tuple[str, str]]:
    """A peer's agreement with our engine (suites.llamacpp_peer.agreement) as table rows."""
    split = sorted(p["prefix_tokens"] for p in a["per_prompt"] if p["prefix_tokens"] < p["tokens"])
    where = (f"{len(split)} diverge, after {', '.join(map(str, split))} tokens" if split else "none diverges")
    return [(f"greedy tokens = {a['reference']}'s",
             f"{a['prompts_equal_to_bar']}/{a['prompts']} prompts share >= {a['bar_tokens']} ({where})"),
            ("teacher-forced top-1 agreement", fmt(a["top1_agreement"], ".4f")),
            ("KL(ours || peer) mean / max nats", f"{fmt(a['kl_mean'], '.2e')} / {fmt(a['kl_max'], '.2e')}")]


def compare_table(docs: list[dict], same: dict[str, bool | None]) -> Table:
    """Several decode results side by side; speed also as a ratio to the first run; whether each speculative run
    decoded the plain run's tokens (``same``: suites.decode.plain_agreement of ``docs``); tok/s is the median of the
    repeats, ± sd their sample standard deviation."""
    from ..reports.stats import spread

    first = docs[0]["summary"]["decode_tok_s"]
    table = Table(title=f"decode: {len(docs)} runs on {docs[0]['config']['device']} "
                        f"({docs[0]['env'].get('gpu') or 'cpu'}), x = decode speed / {docs[0]['label']}'s")
    lengths = any(d["config"].get("prompt_length") for d in docs)  # a -p grid: each run's prefill beside its decode
    cols = ("run", *(("prompt", "prefill tok/s", "MFU", "TTFT ms") if lengths else ()), "tok/s", "± sd", "x",
            "ms/round", "draft/verify", "tok/round", "accept", "roofline", "MiB", "sha256", "= plain")
    for c in cols:
        table.add_column(c, justify="left" if c in ("run", "sha256") else "right", no_wrap=True)
    for d in docs:
        s = d["summary"]
        prefill = (fmt(s.get("prompt_tokens"), ","), fmt(s.get("prefill_tok_s"), ",.0f"),
                   fmt(s.get("prefill_compute_fraction"), ".3f"), fmt(s.get("ttft_ms"), ",.1f")) if lengths else ()
        split = (f"{fmt(s.get('draft_ms_per_round'), '.1f')}/{fmt(s.get('verify_ms_per_round'), '.1f')}"
                 if s.get("draft_ms_per_round") is not None else "-")
        ratio = s["decode_tok_s"] / first if first and s["decode_tok_s"] else None
        sd = spread((s.get("samples") or {}).get("decode_tok_s")).stdev
        table.add_row(d["label"], *prefill, fmt(s["decode_tok_s"], ".1f"), fmt(sd, ".1f"), fmt(ratio, ".2f"),
                      fmt(s["device_ms_per_round"], ".2f"), split, fmt(s["tokens_per_round"]),
                      fmt(s["acceptance_rate"], ".3f"), fmt(s["roofline_fraction"], ".3f"),
                      "-" if s["peak_memory_bytes"] is None else f"{s['peak_memory_bytes'] / 2**20:,.0f}",
                      s["tokens_sha256"][:8],
                      {None: "-", True: "yes", False: "[bold red]NO[/]"}[same.get(d["label"])])
    return table


class SloOption(click.Option):
    """``--goodput ttft:500 tpot:50``, as vLLM takes it: the option also takes the ``NAME:MS`` words that follow
    it (the command has no positional arguments for them to be)."""

    def add_to_parser(self, parser, ctx) -> None:
        super().add_to_parser(parser, ctx)
        for name in self.opts:
            opt = getattr(parser, "_long_opt", {}).get(name)
            if opt is None or not hasattr(opt, "process"):
                continue  # (another click: one NAME:MS a --goodput still works)
            process = opt.process

            def greedy(value, state, process=process):
                words = [value]
                while state.rargs and not state.rargs[0].startswith("-") and ":" in state.rargs[0]:
                    words.append(state.rargs.pop(0))
                process(" ".join(words) if isinstance(value, str) else value, state)

            opt.process = greedy


@click.command()
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
@click.option("--prompt-tokens", type=int, default=256, show_default=True,
              help="Prompt length in tokens, each client's prompt cut or repeated to it (--url: from the server's "
                   "own tokenization, sent as token ids; a server that returns no prompt_token_ids gets the texts "
                   "whole).")
@click.option("--rounds", type=int, default=None,
              help="Rounds per level (samples) [default: 2]; open loop: times the schedule is sent [default: 1].")
@click.option("--request-rate", default=None, metavar="R|inf",
              help="Open loop (--url only), as vllm bench serve: send --num-prompts requests at seeded arrival times "
                   "(R a second on average; inf: all at once) whether or not earlier ones finished.")
@click.option("--burstiness", type=float, default=None,
              help="Open loop: gamma shape of the gaps between arrivals (1: Poisson; below 1 burstier) [default: 1].")
@click.option("--num-prompts", type=int, default=None,
              help="Open loop: requests a round [default: the --dataset's lines, else 100].")
@click.option("--seed", type=int, default=None, help="Open loop: seed of the arrival times [default: 0].")
@click.option("--max-concurrency", "client_max_concurrency", type=int, default=None,
              help="Open loop: requests in flight at most (a request whose time has come waits) [default: no cap].")
@click.option("--dataset", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Open loop: JSONL prompts, an object a line with \"prompt\" (text) or \"prompt_ids\", optionally "
                   "\"max_tokens\" or \"output_len\" (else -n); used in turn [default: the shipped prompts cut to "
                   "--prompt-tokens].")
@click.option("--goodput", cls=SloOption, multiple=True, metavar="NAME:MS...",
              help="Open loop: SLOs (vLLM's ttft, tpot, e2el; ms) a good request meets, e.g. --goodput ttft:500 "
                   "tpot:50; reports goodput, good requests a second.")
@click.option("--percentiles", default=None,
              help="Open loop: latency percentiles to show (vLLM's --metric-percentiles) [default: 50,90,99].")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="In-process: sample every request at this temperature (0: greedy), request i from seed "
                   "--sample-seed + i, so that its tokens do not depend on its batch (= sequential still holds).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="In-process sampling: nucleus mass.")
@click.option("--top-k", type=int, default=0, show_default=True, help="In-process sampling: top-k (0: off).")
@click.option("--sample-seed", type=int, default=None, help="In-process sampling: request i's seed is this + i "
                                                             "[default: 0].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--kv-dtype", type=click.Choice(["fp32", "bf16", "fp16", "int8"]), default="int8", show_default=True)
@click.option("--runtime", type=click.Choice(["v2", "v3"]), default="v3", show_default=True)
@click.option("--max-context", type=int, default=None,
              help="Longest prompt + completion a request may have [default: 8192, or the model's limit].")
@click.option("--prefill-chunk", type=int, default=None, help=PREFILL_CHUNK_HELP)
@click.option("--interleave-chunk", type=int, default=512, show_default=True,
              help="Prompt tokens (of all admitting requests) prefilled per iteration while other requests decode "
                   "(at most --prefill-chunk).")
@pack_prefill_option
@prefill_weights_option
@click.option("--replay-acceptance", default=None, metavar="seed|P|FILE",
              help="For weights that cannot draft (--synthetic), in-process: each draft becomes the sequential "
                   "reference's token with probability P a position (seed: the release's tokens per round), else a "
                   "rejected one; labelled -replay (as decode's).")
@click.option("--tensor-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="In-process: split the engine over N ranks, one process each (as decode --tensor-parallel); rank "
                   "0's scheduler drives the others (engine/runtime/mirror.py).")
@click.option("--label", default=None, callback=run_label)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the result document.")
@output_options
def concurrency(levels, url, served_model, model, synthetic, quant, spec, draft_tokens, max_new_tokens, prompt_tokens,
                rounds, request_rate, burstiness, num_prompts, seed, client_max_concurrency, dataset, goodput,
                percentiles, temperature, top_p, top_k, sample_seed, device, kv_dtype, runtime, max_context,
                prefill_chunk, interleave_chunk, pack_prefill, prefill_weights, replay_acceptance, tensor_parallel, label,
                json_path):
    """C1/C2/C4/C8 throughput and latency, in-process (continuous batching) or against a server.

    With --url the engine is the server's: --model, --synthetic, --quant, --spec, -k, --device, --kv-dtype,
    --runtime, --max-context, --prefill-chunk, --interleave-chunk, --prefill-weights and --replay-acceptance are
    refused (give them to `serve`), and the result records the settings the server reports about itself, null for
    those it does not report.

    With --url and --request-rate the load is open-loop, as vllm bench serve sends it: requests at seeded arrival
    times (--burstiness, --num-prompts, --seed, --max-concurrency), prompts from --dataset, goodput under --goodput
    SLOs, and request / output token throughput and TTFT, TPOT, ITL and end-to-end latency (mean, median, std,
    --percentiles) in vllm bench serve's summary table."""
    from click.core import ParameterSource

    from ..suites.concurrency import (ENGINE_FIELDS, OPEN_LOOP_NEEDS_URL, ConcurrencyOptions, run_concurrency,
                                      run_tensor_parallel)

    ctx = click.get_current_context()
    given = [p for p in ctx.command.params if ctx.get_parameter_source(p.name) is not ParameterSource.DEFAULT]
    engine_flags = [max(p.opts, key=len) for p in given if p.name in ENGINE_FIELDS]
    if url and engine_flags:  # even at their default values: the server's settings are not this client's defaults
        raise UserError(f"{', '.join(engine_flags)} {'configures' if len(engine_flags) == 1 else 'configure'} the "
                        "in-process engine; with --url the server's own "
                        "settings apply (give them to `serve`), and the result records what the server reports")
    names = {p.name for p in given}
    if request_rate is not None:  # open loop: refused before any work where it cannot be
        if not url:
            raise UserError(OPEN_LOOP_NEEDS_URL)
        if "levels" in names:
            raise UserError("-c sets closed-loop clients; an open-loop run's cap on requests in flight is "
                            "--max-concurrency")
        if dataset and "prompt_tokens" in names:
            raise UserError("--prompt-tokens cuts the shipped prompts; --dataset gives the prompts as they are")
    lv = tuple(int_list(levels, "-c"))
    check_output(json_path, parents=True)
    open_loop = dict(request_rate=request_rate, burstiness=burstiness, num_prompts=num_prompts, seed=seed,
                     client_max_concurrency=client_max_concurrency, dataset=dataset, goodput=goodput or None,
                     percentiles=percentiles)
    rounds = rounds if rounds is not None else 1 if request_rate is not None else 2
    opts = ConcurrencyOptions.make(levels=lv, url=url, served_model=served_model, max_new_tokens=max_new_tokens,
                                   prompt_tokens=prompt_tokens, rounds=rounds, label=label, **open_loop,
                                   temperature=temperature, top_p=top_p, top_k=top_k, sample_seed=sample_seed,
                                   **({} if url else dict(model=model, synthetic=synthetic, quant=quant, spec=spec,
                                                          draft_tokens=draft_tokens, device=device, kv_dtype=kv_dtype,
                                                          runtime=runtime, max_context=max_context,
                                                          prefill_chunk=prefill_chunk,
                                                          interleave_chunk=interleave_chunk,
                                                          pack_prefill=pack_prefill,
                                                          prefill_weights=prefill_weights,
                                                          replay_acceptance=replay_acceptance,
                                                          tensor_parallel=tensor_parallel)))
    if tensor_parallel > 1:  # every rank's released sequences' tokens must agree (mirror.py)
        doc = on_ranks(tensor_parallel, run_tensor_parallel, opts, lambda r: r[1])[0]
    else:
        prog, update = suite_progress("concurrency")
        with prog:
            doc = run_concurrency(opts, progress=update)
    if opts.open_loop:
        show(open_loop_grid(doc))
        lv_ = doc["summary"]["levels"][0]
        if lv_["failed"]:  # (the server's message as plain text: no markup in it is interpreted)
            first = next(r["error"] for r in doc["records"] if r["error"])
            err_console.print(Text.assemble((f"{lv_['failed']} of {lv_['requests']} requests failed", "bold red"),
                                            f" (first: {first})"), highlight=False)
    else:
        show(concurrency_grid(doc))
    if url and doc["config"]["prompt_tokens"] is None and "prompt_tokens" in names:
        err_console.print(f"[yellow]{url} returns no prompt_token_ids: the prompt texts went whole, not cut to "
                          f"--prompt-tokens {prompt_tokens}[/]")
    save_result(doc, json_path)
    if any(lv_["matches_sequential"] is False for lv_ in doc["summary"]["levels"]):  # (open loop: not checked)
        raise UserError("concurrent greedy outputs differ from the sequential ones")


@click.command()
@click.option("--shape", default=None, help="Model preset whose shapes to measure [default: qwen3.8-27b on CUDA, "
              "tiny on a CPU].")
@click.option("--model", default=None, type=click.Path(dir_okay=False), help="Artifact whose config gives the shapes.")
@click.option("--t", "ts", default="1,8", show_default=True, help="New tokens per call (comma-separated).")
@click.option("--kernels", "variants", default="v2,v3", show_default=True, help="Variants to run: v2, v3.")
@click.option("--ops", default=None, help="Only ops whose name contains one of these (comma-separated).")
@click.option("--quant", type=click.Choice(["fp32", "bf16", "q8", "q5", "q4", "mixed"]), default=None,
              help="Weight format policy of the projections [default: the artifact's stored formats with --model, "
                   "mixed for a --shape preset].")
@click.option("--contexts", default=None,
              help="Attention K/V lengths [default: 8192,65536 on CUDA, 1024,4096 on a CPU].")
@click.option("--repeats", type=int, default=None, help="Timed calls per record [default: 50 on CUDA, 10 on a CPU].")
@click.option("--warmup", type=int, default=None, help="Untimed calls first [default: 5 on CUDA, 1 on a CPU].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--label", default=None, callback=run_label,
              help="Label of this run in reports [default: kernels-SHAPE-DEVICE].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the result document.")
@click.option("--timeline", is_flag=True, help="Also profile the engine's own decode step on the model and show each "
              "kernel's share of it (CUDA: the captured step's kernels; a CPU: torch ops by self time).")
@click.option("--timeline-steps", type=int, default=32, show_default=True, help="Decode steps the timeline profiles.")
@click.option("--l2-flush", type=click.Choice(["read", "write"]), default="read", show_default=True,
              help="CUDA: how each timed call's L2 is evicted first: read a 256 MB buffer (clean lines, as in a decode "
                   "step), or write it (dirty lines the op then writes back: up to the L2's size of extra traffic).")
@click.option("--chain", default="auto", show_default=True,
              help="CUDA v3 projections: also time a graph of this many launches over as many weight copies, as a "
                   "step launches them layer after layer (auto: copies of at least 512 MB, at most 32; off or 0: "
                   "none).")
@output_options
def kernels(shape, model, ts, variants, ops, quant, contexts, repeats, warmup, device, seed, label, json_path, timeline,
            timeline_steps, l2_flush, chain):
    """Per-op microseconds, GB/s and % of copy bandwidth of the model's hot decode ops, each checked against its
    fp32 reference in the same run; exit 1 when any check fails."""
    from ..suites.kernels import KernelOptions, run_kernels

    def names(text):
        return tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))

    def numbers(text, flag):
        return tuple(dict.fromkeys(int_list(text, flag)))

    def chain_option(text):
        if text in ("auto", "off"):
            return None if text == "auto" else 0
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"--chain must be auto, off or a number of launches, got {text!r}") from None

    check_output(json_path, parents=True)
    opts = KernelOptions(shape=shape, model=model, ts=numbers(ts, "--t"), variants=names(variants),
                         ops=names(ops or ""), quant=quant,
                         contexts=numbers(contexts, "--contexts") if contexts else None,
                         repeats=repeats, warmup=warmup, device=device, label=label, seed=seed, timeline=timeline,
                         timeline_steps=timeline_steps, l2_flush=l2_flush, chain=chain_option(chain))
    import torch

    if opts.device == "cpu" or (opts.device == "auto" and not torch.cuda.is_available()):
        err_console.print("[yellow]CPU run: torch timers on the host; these timings are not GPU numbers[/]")
    prog, update = suite_progress("kernels")
    with prog:
        doc = run_kernels(opts, progress=update)
    s = doc["summary"]
    show(kernels_grid(doc))
    say(f"copy bandwidth (read + write) measured in this run: {s['copy_bandwidth_gbps']:.1f} GB/s")
    for note in sorted({f"{r['variant']}: {r['note']}" for r in doc["records"] if r["ok"] and r["note"]}):
        say(f"[dim]  {note}[/]", highlight=False)
    if s.get("timeline"):
        show(timeline_grid(doc))
    save_result(doc, json_path)
    if s["failures"]:
        for line in s["failures"]:
            err_console.print(f"[red]FAIL[/] {line}", highlight=False)
        raise UserError(f"{len(s['failures'])} of {s['checks']} kernel checks failed")


COMMANDS = (decode, concurrency, kernels)
