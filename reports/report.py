"""The release-validation report: labelled result documents -> one self-contained HTML file and a Markdown file.

The report is assembled once as a list of blocks (headings, paragraphs, tables, figures) and rendered twice: to
HTML, with every figure embedded as a base64 data URI so the single file survives being moved, and to
Markdown, which links the PNG files written next to it. All text from result documents is escaped.

Speed deltas against the baseline label use the gate's rank test over the per-repeat samples
(:func:`.stats.rank_test`): "faster" / "slower" when p < 0.05, "same within noise" when not, and
"inconclusive" when the sample counts could never reach p < 0.05 (for example 3 repeats against 3).

A label names one run per suite: two results of one suite under one label are refused, as the baseline and the
delta rows would otherwise be a guess. A suite in which the baseline label has no result takes its first result
as the baseline, and every section says which run that is and why. Rows that compare unlike runs (another model or
workload; for kernels another weight format, shape, timer, dtype or GPU) say so instead of reading as a speedup.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from .baseline import baseline_note, model_name, read_shift, stand_in
from .experiment import config_value
from .frames import frames, model_id
from .gate import default_rules, expand
from .metric_path import MetricMissing, lookup
from .plots import plot_all
from .render import Table, html_page, markdown, num, numbers, pct, sha, size
from .sections import kernels_section, niah_section
from .stats import spread

DEFAULT_TITLE = "ninfer-bench release validation"
# config keys of the workload: runs that differ in them (or in the model) do not compare like with like; the number
# of samples (decode's repeats, concurrency's rounds per level) is not the workload
WORKLOAD_KEYS = ("prompt_file", "prompts", "images", "max_new_tokens", "prompt_tokens")
UNLIKE = "differs from the baseline"


def _compare(base: dict, doc: dict, rule) -> tuple[str, str]:
    try:
        b, c = lookup(base, rule.metric), lookup(doc, rule.metric)
    except MetricMissing:
        return ("-", "")
    samples = []
    for d in (base, doc):
        try:
            samples.append(lookup(d, rule.samples))
        except MetricMissing:
            samples.append(None)
    if not numbers(b, c) or not b:
        return ("-", "")
    verdict, tone = read_shift(*samples, rule.higher_is_better)
    return f"{c / b:.3f}x ({c / b - 1:+.1%}) {verdict}", tone


def _unlike(base: dict, doc: dict) -> tuple[str, str]:
    """What makes a delta row compare unlike runs: another model or workload than the baseline's."""
    pairs = [("model", model_name(base), model_name(doc))]
    pairs += [(k, config_value(base["config"], k), config_value(doc["config"], k)) for k in WORKLOAD_KEYS]
    diffs = [f"{key} {c} (baseline {b})" for key, b, c in pairs if b != c]
    return ("NOT COMPARABLE: " + "; ".join(diffs), "bad") if diffs else ("-", "")


# ---- sections ------------------------------------------------------------------------------------------
def _overview(docs, baselines, baseline_label) -> list:
    by_suite = {}
    for d in docs:
        by_suite.setdefault(d["suite"], []).append(d["label"])
    rows = []
    for suite, labels in by_suite.items():
        base = baselines[suite]
        why = stand_in(suite, base, baseline_label)
        rows.append([suite, ", ".join(labels), base["label"] + (f" (stand-in, the first read: {why})" if why else ""),
                     model_name(base)])
    return [("p", f"Generated {datetime.now(timezone.utc).isoformat(timespec='seconds')} from {len(docs)} "
                  f"result document(s)."), ("table", Table(["suite", "labels", "baseline", "baseline model"], rows))]


def _environment(docs) -> list:
    env = Table(["label", "suites", "created", "git", "gpu", "driver", "torch", "cuda", "python", "cpu"])
    model = Table(["label", "suites", "model", "type", "layers", "quant policy", "format", "weights"])
    runs = {}  # documents with the same label, environment and model share a row
    for d in docs:
        key = (d["label"], repr(sorted(d["env"].items())), repr(sorted(d["model"].items())))
        runs.setdefault(key, []).append(d)
    for group in runs.values():
        d, suites = group[0], ", ".join(x["suite"] for x in group)
        e, m = d["env"], d["model"]
        rev = e.get("git_sha")
        git = rev[:12] + ("-dirty" if rev.endswith("-dirty") else "") if isinstance(rev, str) else "-"
        env.rows.append([d["label"], suites, d["created"], git, num(e.get("gpu")), num(e.get("driver")),
                         num(e.get("torch")), num(e.get("cuda")), num(e.get("python")),
                         num(e.get("cpu_model") or e.get("cpu")) + (f" ({e['cpu_count']} cores)"
                                                                    if e.get("cpu_count") else "")])
        model.rows.append([d["label"], suites, model_id(m) if m else "-", num(m.get("model_type")),
                           num(m.get("layers")), num(m.get("quant_policy")), num(m.get("format_version")),
                           size(m.get("weight_bytes"))])
    blocks = [("h2", "Environment and model"), ("table", env), ("table", model)]
    for suite in dict.fromkeys(d["suite"] for d in docs):
        configs = {d["label"]: {k: v for k, v in d["config"].items() if k != "label"}
                   for d in docs if d["suite"] == suite}
        keys = list(dict.fromkeys(k for c in configs.values() for k in c))
        same = [k for k in keys if len({repr(c.get(k)) for c in configs.values()}) == 1]
        varying = [k for k in keys if k not in same]
        first = next(iter(configs.values()))
        blocks.append(("h3", f"{suite} configuration"))
        blocks.append(("p", "Common: " + (", ".join(f"{k}={first.get(k)}" for k in same) or "-")))
        if varying:
            blocks.append(("table", Table(["label"] + varying, [[label] + [num(c.get(k)) for k in varying]
                                                                for label, c in configs.items()])))
    return blocks


def _agreement(decode_docs) -> Table:
    """Greedy runs of the same model, spec, KV dtype, device and workload must produce the same tokens."""
    groups = {}
    for d in decode_docs:
        c = d["config"]
        if (c.get("temperature") or 0) > 0:
            continue
        key = (model_id(d["model"]), c.get("spec"), c.get("kv_dtype"), c.get("device"),
               d["summary"].get("prompt_tokens"), c.get("max_new_tokens"))
        groups.setdefault(key, []).append(d)
    table = Table(["model", "spec", "kv", "device", "prompt / max new", "labels", "tokens_sha256", "agreement"])
    for (model, spec, kv, device, prompt, new), members in groups.items():
        hashes = {d["label"]: d["summary"].get("tokens_sha256") for d in members}
        distinct = set(hashes.values())
        if len(members) == 1:
            status = ("single run", "")
        elif len(distinct) == 1:
            status = ("equal", "good")
        else:
            ref = hashes[members[0]["label"]]
            status = ("DIFFER: " + ", ".join(k for k, h in hashes.items() if h != ref) + f" vs {members[0]['label']}",
                      "bad")
        table.rows.append([model, num(spec), num(kv), num(device), f"{num(prompt)} / {num(new)}", ", ".join(hashes),
                           ", ".join(sorted(sha(h) for h in distinct)), status])
    return table


def _per_round(base: dict, doc: dict) -> tuple[str, str] | None:
    """Why device ms per round does not compare between two decode runs (a plain step makes one token, a round of
    another drafter or K a different number), or None when it does."""
    spec = [(d["config"].get("spec"), d["config"].get("draft_tokens") or None) for d in (base, doc)]
    if spec[0] == spec[1]:
        return None
    name = [f"{s or '-'}" + (f" K={k}" if k and s != "none" else "") for s, k in spec]
    return f"NOT COMPARABLE: rounds of {name[1]} (baseline {name[0]})", "warn"


def _sd(summary: dict, key: str) -> str:
    """``± 1.30 (3)``: the sample standard deviation of a metric's per-repeat samples and how many there are."""
    sp = spread((summary.get("samples") or {}).get(key))
    return "-" if not sp.n else f"{'-' if sp.stdev is None else '± ' + num(sp.stdev)} ({sp.n})"


def _decode(docs, base, baseline_label, figures) -> list:
    table = Table(["label", "engine", "runtime", "spec", "K", "decode tok/s", "± sd (repeats)", "prefill tok/s",
                   "TTFT ms", "device ms/round", "tokens/round", "acceptance", "roofline", "peak memory", "tokens"])
    for d in docs:
        c, s = d["config"], d["summary"]
        table.rows.append([d["label"], num(c.get("engine")), num(c.get("runtime")), num(c.get("spec")),
                           num(c.get("draft_tokens")), num(s.get("decode_tok_s")), _sd(s, "decode_tok_s"),
                           num(s.get("prefill_tok_s"), 1),
                           num(s.get("ttft_ms")), num(s.get("device_ms_per_round"), 3), num(s.get("tokens_per_round")),
                           pct(s.get("acceptance_rate")), pct(s.get("roofline_fraction")),
                           size(s.get("peak_memory_bytes")), sha(s.get("tokens_sha256"))])
    blocks = [("h2", "Decode"), ("p", "Timings are medians of each run's repeats (decode tok/s: completion tokens "
                                       "after the first / decode seconds); ± sd is the sample standard deviation of "
                                       "its decode tok/s repeats, with their count."), ("table", table)]
    if "decode" in figures:
        blocks.append(("figure", "decode", "decode tok/s and tokens per round by configuration"))
    if base is not None and len(docs) > 1:
        rules = [r for r in default_rules("decode") if r.kind == "timing" and r.samples]
        deltas = Table(["label"] + [r.metric for r in rules] + [UNLIKE])
        deltas.rows = [[d["label"]] + [_per_round(base, d) or _compare(base, d, r) if r.metric == "device_ms_per_round"
                                       else _compare(base, d, r) for r in rules] + [_unlike(base, d)]
                       for d in docs if d is not base]
        blocks += [("h3", f"Against the baseline {base['label']}"),
                   ("p", baseline_note("decode", base, baseline_label)),
                   ("p", "Ratio of medians candidate/baseline; verdicts from a two-sided Mann-Whitney U test over "
                         "the per-repeat samples (p < 0.05). A row whose last column is not '-' ran another model "
                         "or workload than the baseline: its ratios compare unlike runs."), ("table", deltas)]
    blocks += [("h3", "Exact-metric agreement"),
               ("p", "Greedy runs of the same model, spec, KV dtype, device and workload must produce identical "
                     "tokens (tokens_sha256)."), ("table", _agreement(docs))]
    k = max((len(d["summary"].get("accepted_per_position") or []) for d in docs), default=0)
    if k:
        acc = Table(["label"] + [f"p{i}" for i in range(1, k + 1)])
        for d in docs:
            per = list(d["summary"].get("accepted_per_position") or [])
            if per:
                acc.rows.append([d["label"]] + [pct(v) for v in per + [None] * (k - len(per))])
        blocks += [("h3", "Acceptance per draft position"), ("table", acc)]
        if "acceptance" in figures:
            blocks.append(("figure", "acceptance", "fraction of rounds whose draft at each position was accepted"))
    return blocks


def _concurrency(docs, base, baseline_label, figures) -> list:
    table = Table(["label", "C", "aggregate tok/s", "per-request tok/s", "TTFT p50 ms", "TTFT p99 ms",
                   "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms", "E2E p50 ms", "E2E p99 ms",
                   "matches sequential"])
    for d in docs:
        for lv in d["summary"]["levels"]:
            match = lv.get("matches_sequential")
            table.rows.append([d["label"], num(lv.get("concurrency"))]
                              + [num(lv.get(k)) for k in ("aggregate_tok_s", "per_request_tok_s", "ttft_ms_p50",
                                                         "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p50",
                                                         "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p99")]
                              + [(num(match), "good" if match else "bad")])
    blocks = [("h2", "Concurrency"), ("table", table)]
    if "concurrency" in figures:
        blocks.append(("figure", "concurrency", "aggregate and per-request tok/s against concurrency"))
    if base is not None and len(docs) > 1:
        deltas = Table(["label", "metric", "against " + base["label"], UNLIKE])
        for d in docs:
            if d is base:
                continue
            rules = [r for r in expand(default_rules("concurrency"), base, d) if r.kind == "timing" and r.samples]
            deltas.rows += [[d["label"], r.metric, _compare(base, d, r), _unlike(base, d)] for r in rules]
        blocks += [("h3", f"Against the baseline {base['label']}"),
                   ("p", baseline_note("concurrency", base, baseline_label)), ("table", deltas)]
    return blocks


def _prefill(docs) -> list:
    table = Table(["label", "prefill tok/s", "prompt tokens"])
    table.rows = [[d["label"], num(d["summary"].get("prefill_tok_s"), 1), num(d["summary"].get("prompt_tokens"))]
                  for d in docs]
    return [("h2", "Prefill"), ("table", table)]


def write_csv(tables: dict, out_dir: Path) -> list[Path]:
    """Each non-empty frame of :func:`.frames.frames` as ``<name>.csv`` in ``out_dir`` (llama-bench's ``-o csv``; the
    report's tables for a spreadsheet or a script); the paths written."""
    written = []
    for name, df in tables.items():
        if not df.empty:
            path = out_dir / f"{name}.csv"
            df.to_csv(path, index=False)
            written.append(path)
    return written


def write_report(docs: list[dict], out_dir, baseline_label: str | None = None,
                 title: str = DEFAULT_TITLE) -> tuple[Path, Path]:
    """Write ``report.html`` (self-contained), ``report.md``, the figures' PNGs and the frames as CSV into ``out_dir``.

    ``baseline_label``: the label deltas are taken against, in every suite where it has a result; the first
    document of a suite otherwise (and when no label is given), which the report names as a stand-in. Two
    documents of one suite under one label are refused."""
    if not docs:
        raise ValueError("write_report needs at least one result document")
    seen = {}
    for d in docs:
        other = seen.setdefault((d["suite"], d["label"]), d)
        if other is not d:
            raise ValueError(f"two {d['suite']} results are labelled {d['label']!r} ({model_name(other)}, created "
                             f"{other['created']}; {model_name(d)}, created {d['created']}): a report names runs by "
                             "label, so give each its own")
    labels = {d["label"] for d in docs}
    if baseline_label is not None and baseline_label not in labels:
        raise ValueError(f"baseline label {baseline_label!r} is not among the results' labels {sorted(labels)}")
    by_suite: dict[str, list[dict]] = {}
    for d in docs:
        by_suite.setdefault(d["suite"], []).append(d)
    baselines = {suite: next((d for d in ds if d["label"] == baseline_label), ds[0]) for suite, ds in by_suite.items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = frames(docs)
    figures = plot_all(tables, out_dir)
    csvs = write_csv(tables, out_dir)
    blocks = _overview(docs, baselines, baseline_label) + _environment(docs)
    if "decode" in by_suite:
        blocks += _decode(by_suite["decode"], baselines["decode"], baseline_label, figures)
    if "prefill" in by_suite:
        blocks += _prefill(by_suite["prefill"])
    if "concurrency" in by_suite:
        blocks += _concurrency(by_suite["concurrency"], baselines["concurrency"], baseline_label, figures)
    if "kernels" in by_suite:
        blocks += kernels_section(by_suite["kernels"], baselines["kernels"], baseline_label, figures)
    if "niah" in by_suite:
        blocks += niah_section(by_suite["niah"], figures)
    if csvs:
        blocks += [("h2", "Data"), ("p", "Every number above, one row per run, repeat, level, kernel or case, as CSV "
                                         "(pandas-readable) beside this report: " + ", ".join(p.name for p in csvs))]
    html_path, md_path = out_dir / "report.html", out_dir / "report.md"
    html_path.write_text(html_page(title, blocks, figures), encoding="utf-8")
    md_path.write_text(markdown(title, blocks, figures), encoding="utf-8")
    return html_path, md_path
