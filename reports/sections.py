"""The kernels and needle-in-a-haystack sections of the release-validation report (:mod:`.report`)."""

from __future__ import annotations

from .baseline import read_shift, read_timing
from .frames import shape_text
from .metric_path import format_path, key_text
from .render import Table, num, numbers, pct


def _kernel_run_differences(base: dict, doc: dict) -> list[str]:
    """What makes every timing of a kernels run unlike its baseline's beyond the experiment: another timer."""
    b, c = base["summary"].get("timer"), doc["summary"].get("timer")
    return [] if b == c else [f"timer {num(c)} (baseline {num(b)})"]


def record_path(rec: dict, metric: str = "us_median") -> str:
    """The gate's metric path of a kernel record (its wildcard rule, expanded)."""
    sel = tuple((k, key_text(rec.get(k))) for k in ("op", "shape", "variant", "t"))
    return format_path((("records", sel), (metric, None)))


def _speedup(ref: dict | None, rec: dict, ref_shapes=()) -> tuple[str, str]:
    """``rec``'s speedup over ``ref`` in its own run (median µs ref / rec, with the rank test's verdict); refused,
    saying why, where the two rows are unlike: another weight format."""
    if ref is None:
        return "-", ""
    if ref.get("fmt") != rec.get("fmt"):
        return f"NOT COMPARABLE: format {num(rec.get('fmt'))} (v2 {num(ref.get('fmt'))})", "bad"
    b, c = ref.get("us_median"), rec.get("us_median")
    if not numbers(b, c) or not c:
        return "-", ""
    verdict, tone = read_shift(ref.get("samples_us"), rec.get("samples_us"), False)
    return f"{b / c:.2f}x speedup, {verdict}", tone


def _against(pairing, judged, rec: dict, base_shapes: dict) -> tuple[str, str]:
    """The cell of a record against its baseline run's record of the same op, shape, T and variant: the gate's
    us_median row, read; refused, saying why, where the shape has no counterpart or the timers differ."""
    if pairing.role == "baseline":
        return "baseline", ""
    if pairing.role == "none":
        return "no baseline", ""
    unlike = _kernel_run_differences(pairing.base, rec["_doc"])
    if unlike:
        return "NOT COMPARABLE: " + "; ".join(unlike), "bad"
    v = next((v for v in judged.verdicts if v.metric == record_path(rec)), None)
    shapes = base_shapes.get((rec["op"], rec["t"], rec["variant"]), {})
    if v is None or v.baseline is None and shapes:
        shape = num(shape_text(rec.get("shape")))
        return (f"NOT COMPARABLE: shape {shape} (baseline {', '.join(map(num, shapes))})", "bad") if shapes \
            else ("-", "")
    reading = read_timing(v, judged.rules.get(v.metric))
    b, c = v.baseline, v.candidate
    if not numbers(b, c) or not c:
        return reading.text, reading.tone
    return f"{b / c:.2f}x speedup, {reading.text}", reading.tone


def kernels_section(docs, pairings, judged, figures) -> list:
    """Per (op, shape, T), every label and variant with its weight format, and two speedups: over its baseline
    run's row of the same op, shape, T and variant (the gate's row; refused where the shape or the timer differ),
    and over its own run's v2 row (v2 -> v3, before/after)."""
    def key(rec):
        return rec["op"], shape_text(rec.get("shape")), rec["t"], rec["variant"]

    groups = {}
    for d in docs:
        for rec in d["records"]:
            groups.setdefault(key(rec)[:3], []).append((d, rec))
    table = Table(["label", "op", "shape", "T", "variant", "format", "µs median [p10-p90]", "GB/s", "roofline",
                   "max rel err", "against its baseline", "over v2 (same run)"])
    for (op, shape, t), rows in groups.items():
        own_v2 = {id(d): rec for d, rec in rows if rec["variant"] == "v2"}
        for d, rec in rows:
            p = pairings[id(d)]
            base_shapes = {}
            for brec in p.base["records"] if p.base else ():
                base_shapes.setdefault((brec["op"], brec["t"], brec["variant"]), {})[shape_text(brec.get("shape"))] \
                    = None
            against = _against(p, judged.get(id(d)), {**rec, "_doc": d}, base_shapes)
            over_v2 = ("-", "") if rec["variant"] == "v2" else _speedup(own_v2.get(id(d)), rec)
            err = rec.get("max_rel_err")
            table.rows.append([d["label"], op, num(shape), num(t), num(rec["variant"]), num(rec.get("fmt")),
                               f"{num(rec['us_median'])} [{num(rec.get('us_p10'))}-{num(rec.get('us_p90'))}]",
                               num(rec.get("gbps"), 1), pct(rec.get("roofline_fraction")),
                               "-" if err is None else f"{err:.2e}", against, over_v2])
    notes = "; ".join(f"{d['label']}: timer {d['summary'].get('timer', '-')}, copy bandwidth "
                      f"{num(d['summary'].get('copy_bandwidth_gbps'), 1)} GB/s" for d in docs)
    blocks = [("h2", "Kernels")]
    if "kernels" in figures:
        blocks.append(("figure", "kernels", "median microseconds per op, shape and T (log scale; hatched: the "
                                            "baseline's runs)"))
    blocks += [("p", notes), ("p", baseline_notes(docs, pairings)),
               ("p", "Speedups are ratios of median µs (reference / row) with the verdict on them: against the "
                     "baseline run of the same experiment (the gate's row of the same op, shape, T and variant), "
                     "refused where the shape or the timer differ; and v3 over the same run's v2 (the rank test)."),
               ("table", table)]
    return blocks


def baseline_notes(docs, pairings) -> str:
    """Which run each run of a section is judged against, or why none."""
    parts = []
    for d in docs:
        p = pairings[id(d)]
        parts.append(f"{d['label']}: " + ("the baseline" if p.role == "baseline" else
                                          f"against {p.base['label']}" if p.role == "candidate" else
                                          f"no baseline ({p.why})"))
    return "Baselines (the baseline label's run of the same experiment, never another): " + "; ".join(parts) + "."


def oracle_cases(doc: dict) -> tuple[int | None, int | None]:
    """(cases that passed the oracle agreement rule, cases that had an oracle): counted from the records where they
    carry verdicts (``pass`` null: no oracle), else from the summary; (None, None) when neither says."""
    verdicts = [r["pass"] for r in doc["records"] if "pass" in r]
    if verdicts:
        judged = [v for v in verdicts if v is not None]
        return sum(bool(v) for v in judged), len(judged)
    s = doc["summary"]
    judged, agree = s.get("oracle_cases"), s.get("oracle_agreement")
    if not numbers(judged):
        return None, None
    return (round(agree * judged) if numbers(agree) else 0), judged


def oracle_agreement(doc: dict) -> tuple[str, str]:
    """The agreement cell with its denominator: "100.0% (1 of 1 cases with an oracle)"; "warn" where cases lacked
    an oracle, "bad" where one failed."""
    agree, cases = doc["summary"].get("oracle_agreement"), doc["summary"].get("cases")
    passed, judged = oracle_cases(doc)
    if judged is None:
        return pct(agree), "" if agree is None else "good" if agree == 1 else "bad"
    if judged == 0:
        return f"no oracle (0 of {num(cases)} cases)", "warn"
    partial = numbers(cases) and judged < cases
    text = f"{pct(passed / judged)} ({passed} of {judged} cases with an oracle" + \
        (f"; {cases - judged} without)" if partial else ")")
    return text, "bad" if passed < judged else "warn" if partial else "good"


def exact_cell(pairing, judged) -> tuple[str, str]:
    """The gate's exact rows of a run against its baseline, in one cell: "equal (4 rows)", or what differs."""
    if pairing.role == "baseline":
        return "baseline", ""
    if pairing.role == "none":
        return "no baseline", ""
    if judged.error:
        return f"gate refused: {judged.error}", "bad"
    rows = judged.rows("exact")
    bad = [v for v in rows if v.status != "pass"]
    if not bad:
        return f"equal to {pairing.base['label']} ({len(rows)} exact rows)", "good"
    tone = "bad" if any(v.status in ("fail", "missing") for v in bad) else "warn"
    return "; ".join(f"{v.metric} {v.status}: {v.reason}" for v in bad), tone


def niah_section(docs, pairings, judged, figures) -> list:
    summary = Table(["label", "cases", "oracle agreement", "retrieval", "seconds", "against its baseline"])
    for d in docs:
        s = d["summary"]
        summary.rows.append([d["label"], num(s.get("cases")), oracle_agreement(d), pct(s.get("retrieval")),
                             num(s.get("seconds"), 1), exact_cell(pairings[id(d)], judged.get(id(d)))])
    cases = Table(["label", "case", "ctx", "depth", "oracle pass", "retrieved", "first divergence",
                   "top-1 agreement", "KL"])
    for d in docs:
        for r in d["records"]:
            cases.rows.append([d["label"], num(r.get("case")), num(r.get("ctx")), num(r.get("depth")),
                               ("no oracle", "") if r.get("pass") is None else
                               (num(r["pass"]), "good" if r["pass"] else "bad"), num(r.get("retrieved")),
                               num(r.get("first_divergence")), pct(r.get("top1_agreement")),
                               "-" if r.get("kl") is None else f"{r['kl']:.2e}"])
    blocks = [("h2", "Needle in a haystack")]
    if "niah" in figures:
        blocks.append(("figure", "niah", "retrieval and oracle-agreement pass rate by context length and depth "
                                         "(agreement over the cases with an oracle)"))
    return blocks + [("p", baseline_notes(docs, pairings) + " NIAH has no timing rule: its runs are judged on "
                                                            "agreement with the stored oracle outputs."),
                     ("table", summary), ("h3", "Cases"), ("table", cases)]
