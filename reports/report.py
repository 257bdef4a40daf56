"""The release-validation report: labelled result documents -> one self-contained HTML file and a Markdown file.

The report is assembled once as a list of blocks (headings, paragraphs, tables, figures) and rendered twice: to
HTML, with every figure embedded as a base64 data URI so the single file survives being moved, and to
Markdown, which links the PNG files written next to it. All text from result documents is escaped.

It reads in three parts:

1. **The verdict**, first: one row per run - correct or not, and faster / slower / same / undecided against its
   baseline - read from the gate itself (:func:`.gate.gate`, the suite's default rules; :mod:`.baseline` names the
   rows' outcomes). Correct: every exact row of the gate passes, and the run's own checks (repeats agree, a
   speculative run's tokens equal its plain run's, NIAH cases agree with their oracle, concurrency matches
   sequential decoding, kernels pass their reference check). Speed: the suite's main timing row. Undecided says
   how many repeats a side would decide, where the gate says.
2. **The suites**, figures first, grouped by experiment with the baseline marked.
3. **Environment and configuration**, last, as key/value tables (the model's identity once).

A run's baseline is the baseline label's run (``--baseline LABEL``: that label, or a grid's ``LABEL-...`` labels) of
the same suite and experiment (:func:`.baseline.pair`); a run without one says "no baseline" - there are no stand-ins.
A label names one run per suite: two results of one suite under one label are refused.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from .baseline import MAIN_TIMING, Judged, Pairing, judge, model_name, of_label, pair, ratio_cell, read_timing
from .frames import frames
from .gate import default_rules
from .metric_path import parse_path
from .plots import plot_all
from .render import Table, html_page, markdown, num, pct, sha, size, value_text
from .sections import baseline_notes, exact_cell, kernels_section, niah_section, oracle_cases
from .stats import spread

DEFAULT_TITLE = "ninfer-bench release validation"
SUITE_ORDER = ("decode", "concurrency", "kernels", "niah", "prefill")
UNITS = {"decode_tok_s": "tok/s", "aggregate_tok_s": "tok/s", "us_median": "µs", "prefill_tok_s": "tok/s"}


# ---- the verdict ---------------------------------------------------------------------------------------
def _own_checks(d: dict) -> tuple[list[str], list[str], list[str]]:
    """(problems, doubts, what held) of a run's own correctness checks, from its document alone."""
    bad, doubt, held = [], [], []
    s = d["summary"]
    if d["suite"] == "decode":
        if s.get("deterministic") is False:
            bad.append("its repeats decoded different tokens")
        plain = s.get("plain") if isinstance(s.get("plain"), dict) else None
        if plain and plain.get("tokens_equal") is False:
            bad.append(f"tokens differ from its plain run {plain.get('label')}")
        elif plain and plain.get("tokens_equal"):
            held.append("tokens = its plain run's")
        elif s.get("deterministic") is True:
            held.append("its repeats agree")
    elif d["suite"] == "niah":
        passed, judged = oracle_cases(d)
        if judged is None:
            doubt.append("no oracle agreement recorded")
        elif judged == 0:
            doubt.append(f"no case had an oracle ({num(s.get('cases'))} cases)")
        elif passed < judged:
            bad.append(f"{judged - passed} of {judged} cases disagree with the oracle")
        else:
            held.append(f"{passed} of {judged} cases agree with the oracle")
    elif d["suite"] == "concurrency":
        levels = s.get("levels") or []
        differ = [f"C{num(lv.get('concurrency'))}" for lv in levels if lv.get("matches_sequential") is False]
        if differ:
            bad.append(f"{', '.join(differ)} differ from sequential decoding")
        elif levels and all(lv.get("matches_sequential") for lv in levels):
            held.append("every level matches sequential decoding")
    elif d["suite"] == "kernels":
        checks = [r.get("ok") for r in d["records"] if isinstance(r.get("ok"), bool)]
        if not all(checks):
            bad.append(f"{checks.count(False)} of {len(checks)} kernels fail their reference check")
        elif checks:
            held.append(f"all {len(checks)} kernels pass their reference check")
    return bad, doubt, held


def _correct(d: dict, p: Pairing, j: Judged | None) -> tuple[str, str]:
    """The verdict's "correct" cell: yes / NO / unsure, and why."""
    bad, doubt, held = _own_checks(d)
    if j is not None:
        if j.error:
            bad.append(f"the gate refused the pair: {j.error}")
        exact = j.rows("exact")
        for v in exact:
            if v.status in ("fail", "missing"):
                bad.append(f"{v.metric} {v.status}: {v.reason}")
            elif v.status == "ambiguous":
                doubt.append(f"{v.metric}: {v.reason}")
        if exact and all(v.status == "pass" for v in exact):
            held.insert(0, f"{len(exact)} exact rows = the baseline's")
    if bad:
        return "NO: " + "; ".join(bad), "bad"
    if doubt:
        return "unsure: " + "; ".join(doubt), "warn"
    if not held:
        return "unchecked: no exact check applies", "warn"
    return "yes: " + "; ".join(held), "good"


def _where(metric: str) -> str:
    """A short name for a wildcard rule's instance: ``C4`` for a concurrency level, ``rmsnorm 1x5120 v3 T=1``."""
    segs = parse_path(metric)
    sel = segs[0][1] if isinstance(segs[0][1], tuple) else ()
    values = dict(sel)
    if "concurrency" in values:
        return f"C{values['concurrency']}"
    if "op" in values:
        return f"{values['op']} {values.get('shape', '')} {values.get('variant', '')} T={values.get('t', '')}"
    return metric


def _short_metric(metric: str) -> str:
    """``C4 aggregate_tok_s`` for ``levels[concurrency=4].aggregate_tok_s``; a plain metric as it is."""
    return f"{_where(metric)} {parse_path(metric)[-1][0]}" if "[" in metric else metric


def _plain_text(d: dict) -> str:
    plain = d["summary"].get("plain")
    if isinstance(plain, dict) and isinstance(plain.get("speedup"), (int, float)):
        return f"; {plain['speedup']:.2f}x its plain run"
    return ""


def _main_value(d: dict) -> str:
    """The main timing of a run on its own (a baseline's, or one without a baseline)."""
    s, suite = d["summary"], d["suite"]
    if suite in ("decode", "prefill"):
        return f"{num(s.get(MAIN_TIMING[suite]), 1)} tok/s" + _plain_text(d)
    if suite == "concurrency":
        return ", ".join(f"C{num(lv.get('concurrency'))} {num(lv.get('aggregate_tok_s'), 1)}"
                         for lv in s.get("levels") or []) + " tok/s"
    if suite == "kernels":
        return f"{len(d['records'])} kernel rows"
    return "-"


def _speed(d: dict, p: Pairing, j: Judged | None) -> tuple[tuple[str, str], str, str, int | None]:
    """((speed cell, tone), main timing cell, speed word, repeats that would decide)."""
    suite = d["suite"]
    if suite not in MAIN_TIMING:
        return ("not timed", ""), "-", "-", None
    if p.role == "baseline":
        return ("baseline", ""), _main_value(d), "baseline", None
    if p.role == "none":
        return (f"no baseline: {p.why}", "warn"), _main_value(d), "no baseline", None
    rows = j.main(suite)
    if not rows:
        return (f"missing: {j.error or 'no ' + MAIN_TIMING[suite] + ' row'}", "bad"), _main_value(d), "missing", None
    readings = [(v, read_timing(v, j.rules.get(v.metric))) for v in rows]
    words = [r.word for _, r in readings]
    word = next((w for w in ("missing", "slower", "undecided", "faster") if w in words), "same")
    repeats = max((r.repeats for _, r in readings if r.repeats), default=None)
    tone = {"missing": "bad", "slower": "bad", "undecided": "warn", "faster": "good"}.get(word, "")
    unit = UNITS[MAIN_TIMING[suite]]
    if len(readings) == 1:
        v, r = readings[0]
        change = "" if v.change is None else f" ({v.change:+.1%})"
        return (r.text, r.tone), f"{num(v.baseline, 1)} → {num(v.candidate, 1)} {unit}{change}" + _plain_text(d), \
            r.word, r.repeats
    counts = ", ".join(f"{words.count(w)} {w}" for w in ("slower", "undecided", "faster", "same", "missing")
                       if w in words)
    if suite == "concurrency":
        main = "; ".join(f"{_where(v.metric)} {num(v.baseline, 1)} → {num(v.candidate, 1)}"
                         + ("" if v.change is None else f" ({v.change:+.1%})") for v, _ in readings) + f" {unit}"
    else:
        changed = [v for v, _ in readings if v.change is not None]
        big = max(changed, key=lambda v: abs(v.change), default=None)
        main = "-" if big is None else f"largest change: {_where(big.metric)} {num(big.baseline)} → " \
                                       f"{num(big.candidate)} {unit} ({big.change:+.1%})"
    whys = list(dict.fromkeys(r.why for _, r in readings if r.word == word and r.why))
    text = f"{word}: {counts} of {len(readings)} {'levels' if suite == 'concurrency' else 'rows'}" \
        + (f" ({'; '.join(whys[:2])})" if word in ("undecided", "missing") and whys else "") \
        + (f"; about {repeats} repeats a side would decide" if repeats else "")
    return (text, tone), main, word, repeats


def _gate_cell(p: Pairing, j: Judged | None) -> tuple[str, str]:
    if p.role != "candidate":
        return "-", ""
    off = [_short_metric(v.metric) for v in j.verdicts if v.status != "pass"]
    text = j.status + (f": {', '.join(off[:4])}{f' and {len(off) - 4} more' if len(off) > 4 else ''} not passed"
                       if off else "") + (f" ({j.error})" if j.error else "")
    return text, {"pass": "good", "fail": "bad"}.get(j.status, "warn")


def _rules_text() -> str:
    def threshold(suite):
        def of(device):
            rule = next(r for r in default_rules(suite, device) if r.kind == "timing" and
                        parse_path(r.metric)[-1][0] == MAIN_TIMING[suite])
            return f"{rule.threshold:.0%}"

        cpu, gpu = of("cpu"), of("cuda")
        return cpu if cpu == gpu else f"{cpu}, {gpu} on a GPU"

    return ("How to read it - correct: every exact row of the gate against the run's baseline passes (decode: "
            "tokens_sha256, token, round and draft counts, acceptance per position, deterministic; NIAH: cases, oracle "
            "agreement, retrieval, first divergence; concurrency: matches sequential at each level; kernels: each "
            "record's check against its reference), and so do the run's own checks (repeats agree, a speculative "
            "run's tokens equal its plain run's, NIAH cases agree with the stored oracle, concurrency levels match "
            "sequential decoding, kernels pass their reference check). Speed: the gate's main timing row (decode "
            f"tok/s, threshold {threshold('decode')}; concurrency aggregate tok/s per level, "
            f"{threshold('concurrency')}; kernels median µs per record, {threshold('kernels')}): faster or slower "
            "where the gate decides it from the per-repeat samples (an improvement its interval confirms; a failed "
            "row), same where it passes within the threshold, undecided where its row is ambiguous - with about how "
            "many repeats a side would decide, as the gate estimates it. Gate: the gate's status over all its rows, "
            "as `ninfer-bench gate` reports it (fail: a failed or missing row; ambiguous: an undecided row). A run's "
            "baseline is the run of the baseline label (or of a grid's LABEL-... labels) of the same experiment - "
            "model, workload, engine settings and hardware as the gate compares them; a run without one reads \"no "
            "baseline\" and is compared with nothing (docs/DESIGN.md, \"The release report\").")


def _by_experiment(docs, pairings) -> list[dict]:
    """Suite by suite, each baseline run followed by the runs judged against it, then the runs without one."""
    out = []
    for suite in SUITE_ORDER:
        members = [d for d in docs if d["suite"] == suite]
        for b in (d for d in members if pairings[id(d)].role == "baseline"):
            out += [b] + [d for d in members if pairings[id(d)].base is b]
        out += [d for d in members if pairings[id(d)].role == "none"]
    return out


def _verdict(docs, pairings, judged, baseline_label) -> list:
    table = Table(["suite", "run", "baseline", "correct", "speed", "main timing", "gate"], css="verdict")
    correct_words, speed_words, gates, repeats = [], [], [], []
    for d in _by_experiment(docs, pairings):
        p, j = pairings[id(d)], judged.get(id(d))
        correct = _correct(d, p, j)
        speed, main, word, n = _speed(d, p, j)
        gate_cell = _gate_cell(p, j)
        base = "(is the baseline)" if p.role == "baseline" else p.base["label"] if p.base else "no baseline"
        table.rows.append([d["suite"], d["label"], base, correct, speed, main, gate_cell])
        correct_words.append(correct[0].split(":")[0])
        speed_words.append(word)
        if p.role == "candidate":
            gates.append(j.status)
        if n:
            repeats.append(n)
    total = len(docs)
    wrong, unsure = correct_words.count("NO"), total - correct_words.count("yes") - correct_words.count("NO")
    head = [f"{wrong} of {total} runs NOT correct" if wrong else f"All {total} runs correct" if not unsure
            else f"{total - unsure} of {total} runs correct, {unsure} unsure or unchecked"]
    compared = [w for w in speed_words if w in ("faster", "slower", "same", "undecided", "missing")]
    if compared:
        parts = [f"{speed_words.count(w)} {w}" for w in ("slower", "faster", "same", "undecided", "missing")
                 if w in speed_words]
        head.append(f"against {baseline_label}: " + ", ".join(parts)
                    + (f" (about {max(repeats)} repeats a side would decide)" if repeats else ""))
    elif baseline_label is None:
        head.append("no baseline given (--baseline LABEL): no speed verdict")
    alone = [f"{d['suite']} {d['label']}" for d in docs if pairings[id(d)].role == "none"]
    if alone and baseline_label is not None:
        head.append(f"no baseline of their experiment: {', '.join(alone[:3])}"
                    + (f" and {len(alone) - 3} more" if len(alone) > 3 else ""))
    if gates:
        head.append("gate: " + ", ".join(f"{gates.count(s)} {s}" for s in ("fail", "ambiguous", "pass")
                                          if s in gates))
    tone = "bad" if wrong or "slower" in speed_words or "missing" in speed_words or "fail" in gates else \
        "warn" if unsure or "undecided" in speed_words or alone or "ambiguous" in gates else "good"
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return [("h2", "Verdict"), ("p", "; ".join(head) + ".", tone), ("table", table),
            ("p", f"Generated {when} from {total} result document(s); baseline label: {baseline_label or 'none'}. "
                  + _rules_text(), "note")]


# ---- the suites ----------------------------------------------------------------------------------------
def _agreement(decode_docs, several_models: bool) -> Table:
    """Greedy runs of the same engine, model, spec, KV dtype, device and workload must produce the same tokens (a
    peer engine's tokens are set against ours by :func:`_peer_agreement` instead)."""
    groups = {}
    for d in decode_docs:
        c = d["config"]
        if (c.get("temperature") or 0) > 0:
            continue
        key = (model_name(d), c.get("spec"), c.get("kv_dtype"), c.get("device"),
               d["summary"].get("prompt_tokens"), c.get("max_new_tokens"), c.get("engine") or "ours")
        groups.setdefault(key, []).append(d)
    table = Table((["model"] if several_models else []) + ["spec", "kv", "device", "prompt / max new", "labels",
                                                           "tokens_sha256", "agreement"])
    for (model, spec, kv, device, prompt, new, _engine), members in groups.items():
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
        table.rows.append(([_short_model(members[0])] if several_models else [])
                          + [num(spec), num(kv), num(device), f"{num(prompt)} / {num(new)}", ", ".join(hashes),
                             ", ".join(sorted(sha(h) for h in distinct)), status])
    return table


def _peer_agreement(decode_docs) -> Table | None:
    """Each peer run's agreement with our plain run on the same weights (summary.agreement: greedy tokens to the
    first divergence, teacher-forced top-1 and KL); None where no run has one."""
    peers = [d for d in decode_docs if d["summary"].get("agreement")]
    if not peers:
        return None
    table = Table(["peer", "against", "prompts sharing ≥ bar tokens", "first divergence (min)", "top-1 agreement",
                   "KL mean / max (nats)"])
    for d in peers:
        a = d["summary"]["agreement"]
        table.rows.append([d["label"], a["reference"], f"{a['prompts_equal_to_bar']} / {a['prompts']} "
                           f"(bar {a['bar_tokens']})", num(a.get("prefix_tokens_min")),
                           f"{a['top1_agreement']:.4f}" if a.get("top1_agreement") is not None else "-",
                           f"{a['kl_mean']:.2e} / {a['kl_max']:.2e}" if a.get("kl_mean") is not None else "-"])
    return table


def _sd(summary: dict, key: str) -> str:
    """``± 1.30 (3)``: the sample standard deviation of a metric's per-repeat samples and how many there are."""
    sp = spread((summary.get("samples") or {}).get(key))
    return "-" if not sp.n else f"{'-' if sp.stdev is None else '± ' + num(sp.stdev)} ({sp.n})"


def _over_plain(summary: dict) -> tuple[str, str] | str:
    plain = summary.get("plain")
    if not isinstance(plain, dict):
        return "-"
    x = plain.get("speedup")
    same = plain.get("tokens_equal")
    text = ("-" if not isinstance(x, (int, float)) else f"{x:.2f}x") + f" {plain.get('label', '')}" + \
        ("" if same is None else ", same tokens" if same else ", OTHER TOKENS")
    return text, "bad" if same is False else ""


def _deltas(docs, pairings, judged, metrics: list[str], columns: list[str]) -> Table:
    """One row per run with a baseline: each metric's gate row, read (ratio of medians and the verdict)."""
    table = Table(["label", "baseline"] + columns + ["gate"])
    for d in docs:
        p, j = pairings[id(d)], judged.get(id(d))
        if p.role != "candidate":
            continue
        by_metric = {v.metric: v for v in j.verdicts}
        cells = []
        for m in metrics:
            v = by_metric.get(m)
            cells.append("-" if v is None else ratio_cell(v, read_timing(v, j.rules.get(m)))
                         if v.kind != "exact" else (f"{v.status}: {v.reason}",
                                                     "good" if v.status == "pass" else "bad"))
        table.rows.append([d["label"], p.base["label"]] + cells + [_gate_cell(p, j)])
    return table


def _decode(docs, pairings, judged, figures, several_models: bool) -> list:
    blocks = [("h2", "Decode")]
    if "decode" in figures:
        blocks.append(("figure", "decode", "decode tok/s and tokens per round, grouped by experiment: each group's "
                                           "baseline run first (hatched), a dashed line at its value; runs without "
                                           "a baseline after them, fastest first"))
    table = Table(["label", "engine", "runtime", "spec", "K", "decode tok/s", "± sd (repeats)", "over plain",
                   "prefill tok/s", "prefill MFU", "TTFT ms", "device ms/round", "tokens/round", "acceptance",
                   "roofline", "peak memory", "tokens"])
    for d in docs:
        c, s = d["config"], d["summary"]
        table.rows.append([d["label"], num(c.get("engine")), num(c.get("runtime")), num(c.get("spec")),
                           num(c.get("draft_tokens")), num(s.get("decode_tok_s")), _sd(s, "decode_tok_s"),
                           _over_plain(s), num(s.get("prefill_tok_s"), 1), pct(s.get("prefill_compute_fraction")),
                           num(s.get("ttft_ms")),
                           num(s.get("device_ms_per_round"), 3), num(s.get("tokens_per_round")),
                           pct(s.get("acceptance_rate")), pct(s.get("roofline_fraction")),
                           size(s.get("peak_memory_bytes")), sha(s.get("tokens_sha256"))])
    blocks += [("p", "Timings are medians of each run's repeats (decode tok/s: completion tokens after the first / "
                     "decode seconds); ± sd is the sample standard deviation of its decode tok/s repeats, with their "
                     "count; over plain: a speculative run's speed-up over the plain run on the same load (its "
                     "summary.plain); prefill MFU: the prompt's model FLOPs a second over the dense matmul "
                     "throughput measured in the same run; roofline: decode's weight bytes a second over the "
                     "copy bandwidth measured in the same run."), ("table", table)]
    if any(pairings[id(d)].role == "candidate" for d in docs):
        metrics = ["decode_tok_s", "prefill_tok_s", "ttft_ms", "device_ms_per_round", "peak_memory_bytes"]
        blocks += [("h3", "Against the baseline of each experiment"),
                   ("p", "The gate's timing rows: ratio of medians candidate/baseline and the gate's reading (same "
                         "within the threshold; faster where its interval confirms an improvement, slower where it "
                         "fails the row; undecided where the row is ambiguous, with the repeats that would decide)."),
                   ("table", _deltas(docs, pairings, judged, metrics, metrics))]
    blocks.append(("p", baseline_notes(docs, pairings)))
    blocks += [("h3", "Exact-metric agreement"),
               ("p", "Greedy runs of the same engine, model, spec, KV dtype, device and workload must produce "
                     "identical tokens (tokens_sha256)."), ("table", _agreement(docs, several_models))]
    if (peer_table := _peer_agreement(docs)) is not None:
        blocks += [("h3", "Peers against ours"),
                   ("p", "A peer engine on the same weights (llama.cpp on their exact GGUF export) against our plain "
                         "run: the generated tokens two greedy runs share before the first divergence, and "
                         "teacher-forced on ours' path the peer's top-1 against ours' token and KL(ours || peer). "
                         "Other arithmetic (llama.cpp quantizes activations for its quantized products) makes small "
                         "differences expected; random weights (--synthetic) have near-flat distributions, where "
                         "top-1 flips at tiny KL."), ("table", peer_table)]
    k = max((len(d["summary"].get("accepted_per_position") or []) for d in docs), default=0)
    if k:
        blocks.append(("h3", "Acceptance per draft position"))
        if "acceptance" in figures:
            blocks.append(("figure", "acceptance", "fraction of rounds whose draft at each position was accepted (a "
                                                   "line identical to another is named so in the legend)"))
        acc = Table(["label"] + [f"p{i}" for i in range(1, k + 1)])
        for d in docs:
            per = list(d["summary"].get("accepted_per_position") or [])
            if per:
                acc.rows.append([d["label"]] + [pct(v) for v in per + [None] * (k - len(per))])
        blocks.append(("table", acc))
    return blocks


def _concurrency(docs, pairings, judged, figures) -> list:
    blocks = [("h2", "Concurrency")]
    if "concurrency" in figures:
        blocks.append(("figure", "concurrency", "aggregate and per-request tok/s against concurrency (baseline runs "
                                                "drawn thicker)"))
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
    blocks.append(("table", table))
    rows = []
    for d in docs:
        p, j = pairings[id(d)], judged.get(id(d))
        if p.role != "candidate":
            continue
        for v in j.rows("timing"):
            reading = read_timing(v, j.rules.get(v.metric))
            rows.append([d["label"], p.base["label"], _where(v.metric), parse_path(v.metric)[-1][0],
                         ratio_cell(v, reading), v.status])
    if rows:
        blocks += [("h3", "Against the baseline of each experiment"),
                   ("table", Table(["label", "baseline", "level", "metric", "candidate/baseline", "gate row"], rows))]
    return blocks + [("p", baseline_notes(docs, pairings))]


def _prefill(docs, pairings, judged) -> list:
    table = Table(["label", "prefill tok/s", "prompt tokens", "model TFLOP/s", "MFU (of measured matmul)",
                   "against its baseline"])
    for d in docs:
        p, j = pairings[id(d)], judged.get(id(d))
        cell = exact_cell(p, j)
        if p.role == "candidate" and j.main("prefill"):
            v = j.main("prefill")[0]
            cell = ratio_cell(v, read_timing(v, j.rules.get(v.metric)))
        table.rows.append([d["label"], num(d["summary"].get("prefill_tok_s"), 1),
                           num(d["summary"].get("prompt_tokens")), num(d["summary"].get("prefill_tflops"), 1),
                           num(d["summary"].get("prefill_compute_fraction"), 3), cell])
    return [("h2", "Prefill"), ("table", table)]


# ---- environment and configuration ---------------------------------------------------------------------
MODEL_FIELDS = (("model_id", "name"), ("artifact_id", "artifact"), ("preset", "preset"), ("synthetic", "synthetic"),
                ("model_type", "type"), ("layers", "layers"), ("hidden_size", "hidden size"),
                ("vocab_size", "vocabulary"), ("quant_policy", "quant policy"), ("format_version", "format"),
                ("weight_bytes", "weights"), ("drafters", "drafters"), ("seed", "seed"), ("path", "file"))
ENV_FIELDS = (("gpu", "gpu"), ("driver", "driver"), ("cuda", "cuda"), ("torch", "torch"), ("python", "python"),
              ("transformers", "transformers"), ("triton", "triton"), ("cpu_model", "cpu"), ("cpu_count", "cores"),
              ("cpu", "arch"), ("platform", "platform"))


def _short_model(d: dict) -> str:
    m = d["model"]
    name = m.get("model_id") or m.get("preset") or (Path(str(m["path"])).stem if m.get("path") else None)
    return str(name) if name else model_name(d)


def _columns(docs, key) -> list[tuple[dict, list[str]]]:
    """(the first document, the labels of all) per distinct ``key(doc)``, in first-seen order."""
    out = {}
    for d in docs:
        out.setdefault(key(d), (d, []))[1].append(d["label"])
    return list(out.values())


def _heading(labels: list[str]) -> str:
    return ", ".join(labels) if len(labels) <= 3 else f"{', '.join(labels[:2])} and {len(labels) - 2} more"


def _key_value(fields, values: list[dict], headings: list[str], fmt) -> Table:
    """Rows = fields that any column has; one value column per distinct object (``value`` when there is one)."""
    table = Table(["key"] + (headings if len(values) > 1 else ["value"]))
    for key, name in fields:
        if any(v.get(key) not in (None, "", [], {}) for v in values):
            table.rows.append([name] + [fmt(key, v.get(key)) for v in values])
    return table


def _model_value(key, v):
    if key == "weight_bytes":
        return size(v)
    if key == "path" and v:
        return Path(str(v)).name
    return value_text(v)


def _environment(docs) -> list:
    blocks = [("h2", "Environment and configuration")]
    known = {k for k, _ in ENV_FIELDS} | {"git_sha"}
    extra = list(dict.fromkeys(k for d in docs for k, v in d["env"].items() if k not in known and v is not None))
    runs = Table(["label", "suite", "created", "git"] + extra)  # per-run context (load, threads) stays per run
    for d in docs:
        rev = d["env"].get("git_sha")
        git = rev[:12] + ("-dirty" if rev.endswith("-dirty") else "") if isinstance(rev, str) else "-"
        runs.rows.append([d["label"], d["suite"], d["created"], git] + [value_text(d["env"].get(k)) for k in extra])
    blocks += [("h3", "Runs"), ("table", runs)]
    envs = _columns(docs, lambda d: repr([repr(d["env"].get(k)) for k, _ in ENV_FIELDS]))
    blocks += [("h3", "Environment" + (f"s ({len(envs)})" if len(envs) > 1 else "")),
               ("table", _key_value(ENV_FIELDS, [d["env"] for d, _ in envs], [_heading(v) for _, v in envs],
                                    lambda k, v: value_text(v)))]
    models = _columns([d for d in docs if d["model"]], lambda d: repr(sorted((k, repr(v))
                                                                             for k, v in d["model"].items())))
    if models:
        blocks += [("h3", "Model" + (f"s ({len(models)})" if len(models) > 1 else "")),
                   ("table", _key_value(MODEL_FIELDS, [d["model"] for d, _ in models],
                                        [_heading(v) for _, v in models], _model_value))]
    for suite in SUITE_ORDER:
        members = [d for d in docs if d["suite"] == suite]
        if not members:
            continue
        configs = {d["label"]: {k: v for k, v in d["config"].items() if k != "label"} for d in members}
        keys = list(dict.fromkeys(k for c in configs.values() for k in c))
        same = [k for k in keys if len({repr(c.get(k)) for c in configs.values()}) == 1]
        varying = [k for k in keys if k not in same]
        first = next(iter(configs.values()))
        blocks.append(("h3", f"{suite} configuration"))
        if same:
            label = "the same in every run" if len(configs) > 1 else "value"
            blocks.append(("table", Table(["key", label], [[k, value_text(first.get(k))] for k in same])))
        if varying:
            blocks.append(("table", Table(["label"] + varying, [[label] + [value_text(c.get(k)) for k in varying]
                                                                for label, c in configs.items()])))
    return blocks


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

    ``baseline_label``: the label (or a grid's label prefix) whose runs are the baselines: each run is judged by the
    gate against the baseline run of its suite and experiment, and a run without one reads "no baseline". Two
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
    if baseline_label is not None and not any(of_label(label, baseline_label) for label in labels):
        raise ValueError(f"baseline label {baseline_label!r} is not among the results' labels (nor a prefix "
                         f"'{baseline_label}-' of one) {sorted(labels)}")
    by_suite: dict[str, list[dict]] = {}
    for d in docs:
        by_suite.setdefault(d["suite"], []).append(d)
    pairings = pair(docs, baseline_label)
    judged = {id(d): judge(pairings[id(d)].base, d) for d in docs if pairings[id(d)].role == "candidate"}
    groups, baselines = {}, {}
    for suite, members in by_suite.items():
        bases = [d for d in members if pairings[id(d)].role == "baseline"]
        baselines[suite] = [d["label"] for d in bases]
        groups[suite] = [[b["label"]] + [d["label"] for d in members if pairings[id(d)].base is b] for b in bases]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = frames(docs)
    figures = plot_all(tables, out_dir, groups, baselines)
    csvs = write_csv(tables, out_dir)
    several_models = len({model_name(d) for d in by_suite.get("decode", [])}) > 1
    blocks = _verdict(docs, pairings, judged, baseline_label)
    if "decode" in by_suite:
        blocks += _decode(by_suite["decode"], pairings, judged, figures, several_models)
    if "concurrency" in by_suite:
        blocks += _concurrency(by_suite["concurrency"], pairings, judged, figures)
    if "kernels" in by_suite:
        blocks += kernels_section(by_suite["kernels"], pairings, judged, figures)
    if "niah" in by_suite:
        blocks += niah_section(by_suite["niah"], pairings, judged, figures)
    if "prefill" in by_suite:
        blocks += _prefill(by_suite["prefill"], pairings, judged)
    blocks += _environment(docs)
    if csvs:
        blocks += [("h2", "Data"), ("p", "Every number above, one row per run, repeat, level, kernel or case, as CSV "
                                         "(pandas-readable) beside this report: " + ", ".join(p.name for p in csvs))]
    html_path, md_path = out_dir / "report.html", out_dir / "report.md"
    html_path.write_text(html_page(title, blocks, figures), encoding="utf-8")
    md_path.write_text(markdown(title, blocks, figures), encoding="utf-8")
    return html_path, md_path
