"""The kernels and needle-in-a-haystack sections of the release-validation report (:mod:`.report`)."""

from __future__ import annotations

from .baseline import baseline_note, read_shift
from .frames import shape_text
from .render import Table, num, numbers, pct


def _kernel_run_differences(base: dict, doc: dict) -> list[str]:
    """What makes every timing of a kernels run unlike the baseline's: another timer, compute dtype, GPU or CPU."""
    pairs = [("timer", base["summary"].get("timer"), doc["summary"].get("timer")),
             ("dtype", base["config"].get("dtype"), doc["config"].get("dtype")),
             ("gpu", base["env"].get("gpu"), doc["env"].get("gpu"))]
    if base["env"].get("cpu_model") and doc["env"].get("cpu_model"):  # (documents before it say nothing)
        pairs.append(("cpu", base["env"]["cpu_model"], doc["env"]["cpu_model"]))
    return [f"{key} {num(c)} (baseline {num(b)})" for key, b, c in pairs if b != c]


def _speedup(ref: dict | None, rec: dict, ref_shapes=()) -> tuple[str, str]:
    """``rec``'s speedup over ``ref`` (median µs ref / rec, with the rank test's verdict); refused, saying why, where
    the two rows are unlike: another weight format, or no ``ref`` at this shape but at ``ref_shapes``."""
    if ref is None:
        if ref_shapes:
            shape = num(shape_text(rec.get("shape")))
            return f"NOT COMPARABLE: shape {shape} (baseline {', '.join(map(num, ref_shapes))})", "bad"
        return "-", ""
    if ref.get("fmt") != rec.get("fmt"):
        return f"NOT COMPARABLE: format {num(rec.get('fmt'))} (baseline {num(ref.get('fmt'))})", "bad"
    b, c = ref.get("us_median"), rec.get("us_median")
    if not numbers(b, c) or not c:
        return "-", ""
    verdict, tone = read_shift(ref.get("samples_us"), rec.get("samples_us"), False)
    return f"{b / c:.2f}x speedup, {verdict}", tone


def kernels_section(docs, base, baseline_label, figures) -> list:
    """Per (op, shape, T), every label and variant with its weight format, and two speedups: over the baseline
    run's row of the same op, shape, T and variant (refused where the format, the shape or the run's timer, dtype
    or GPU differ), and over its own run's v2 row (v2 -> v3, before/after)."""
    def key(rec):
        return rec["op"], shape_text(rec.get("shape")), rec["t"], rec["variant"]

    base_rows = {key(rec): rec for rec in base["records"]}
    base_shapes = {}  # (op, T, variant) -> the baseline's shapes, to name where a row's shape has no counterpart
    for rec in base["records"]:
        base_shapes.setdefault((rec["op"], rec["t"], rec["variant"]), {})[shape_text(rec.get("shape"))] = None
    groups = {}
    for d in docs:
        for rec in d["records"]:
            groups.setdefault(key(rec)[:3], []).append((d, rec))
    table = Table(["label", "op", "shape", "T", "variant", "format", "µs median [p10-p90]", "GB/s", "roofline",
                   "max rel err", f"against {base['label']}", "over v2 (same run)"])
    for (op, shape, t), rows in groups.items():
        own_v2 = {id(d): rec for d, rec in rows if rec["variant"] == "v2"}
        for d, rec in rows:
            unlike = _kernel_run_differences(base, d)
            if d is base:
                against = ("baseline", "")
            elif unlike:
                against = ("NOT COMPARABLE: " + "; ".join(unlike), "bad")
            else:
                against = _speedup(base_rows.get(key(rec)), rec, base_shapes.get((op, t, rec["variant"]), ()))
            over_v2 = ("-", "") if rec["variant"] == "v2" else _speedup(own_v2.get(id(d)), rec)
            err = rec.get("max_rel_err")
            table.rows.append([d["label"], op, num(shape), num(t), num(rec["variant"]), num(rec.get("fmt")),
                               f"{num(rec['us_median'])} [{num(rec.get('us_p10'))}-{num(rec.get('us_p90'))}]",
                               num(rec.get("gbps"), 1), pct(rec.get("roofline_fraction")),
                               "-" if err is None else f"{err:.2e}", against, over_v2])
    notes = "; ".join(f"{d['label']}: timer {d['summary'].get('timer', '-')}, copy bandwidth "
                      f"{num(d['summary'].get('copy_bandwidth_gbps'), 1)} GB/s" for d in docs)
    blocks = [("h2", "Kernels"), ("p", notes), ("p", baseline_note("kernels", base, baseline_label)),
              ("p", "Speedups are ratios of median µs (reference / row) with the rank test's verdict: against the "
                    "baseline run's row of the same op, shape, T and variant, refused where the weight format, the "
                    "shape or the run's timer, dtype or GPU differ; and v3 over the same run's v2."),
              ("table", table)]
    if "kernels" in figures:
        blocks.append(("figure", "kernels", "median microseconds per op, shape and T (log scale)"))
    return blocks


def _oracle_cases(doc: dict) -> tuple[int | None, int | None]:
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


def _oracle_agreement(doc: dict) -> tuple[str, str]:
    """The agreement cell with its denominator: "100.0% (1 of 1 cases with an oracle)"; "warn" where cases lacked
    an oracle, "bad" where one failed."""
    agree, cases = doc["summary"].get("oracle_agreement"), doc["summary"].get("cases")
    passed, judged = _oracle_cases(doc)
    if judged is None:
        return pct(agree), "" if agree is None else "good" if agree == 1 else "bad"
    if judged == 0:
        return f"no oracle (0 of {num(cases)} cases)", "warn"
    partial = numbers(cases) and judged < cases
    text = f"{pct(passed / judged)} ({passed} of {judged} cases with an oracle" + \
        (f"; {cases - judged} without)" if partial else ")")
    return text, "bad" if passed < judged else "warn" if partial else "good"


def niah_section(docs, figures) -> list:
    summary = Table(["label", "cases", "oracle agreement", "retrieval", "seconds"])
    for d in docs:
        s = d["summary"]
        summary.rows.append([d["label"], num(s.get("cases")), _oracle_agreement(d), pct(s.get("retrieval")),
                             num(s.get("seconds"), 1)])
    cases = Table(["label", "case", "ctx", "depth", "oracle pass", "retrieved", "first divergence",
                   "top-1 agreement", "KL"])
    for d in docs:
        for r in d["records"]:
            cases.rows.append([d["label"], num(r.get("case")), num(r.get("ctx")), num(r.get("depth")),
                               ("no oracle", "") if r.get("pass") is None else
                               (num(r["pass"]), "good" if r["pass"] else "bad"), num(r.get("retrieved")),
                               num(r.get("first_divergence")), pct(r.get("top1_agreement")),
                               "-" if r.get("kl") is None else f"{r['kl']:.2e}"])
    blocks = [("h2", "Needle in a haystack"), ("table", summary)]
    if "niah" in figures:
        blocks.append(("figure", "niah", "retrieval and oracle-agreement pass rate by context length and depth "
                                         "(agreement over the cases with an oracle)"))
    return blocks + [("h3", "Cases"), ("table", cases)]
