"""Which run a result is judged against, and how the report reads the gate's rows.

A run's baseline is the run of the baseline label (``--baseline LABEL``: that label, or a grid's labels that start
with ``LABEL-``) of the same suite and the same experiment (:func:`.experiment.config_differences`, as the gate
decides it). There are no stand-ins: a run without a baseline of its own experiment has none, and the report says so
instead of comparing it with something else.

The verdicts are the gate's (:func:`.gate.gate` with the suite's default rules); :func:`read_timing` only names a
timing row's status for a reader: "slower" where the gate fails it, "faster" where it passes it as an improvement,
"same" where it passes it within the threshold, "undecided" where it is ambiguous - with the repeats a side that
would decide, where the gate gives them (``repeats_needed``). Nothing here re-tests a run against its baseline
(:func:`read_shift`, the shared rank test, reads only two variants of one run: kernels' v3 over v2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .experiment import config_differences
from .frames import model_id
from . import gate as gate_module
from .gate import Rule, Verdict, default_rules, doc_device, expand, gate
from .render import num
from .stats import ALPHA, rank_test

# the timing a suite's speed verdict is read from (a wildcard rule's last segment for concurrency and kernels)
MAIN_TIMING = {"decode": "decode_tok_s", "concurrency": "aggregate_tok_s", "kernels": "us_median",
               "prefill": "prefill_tok_s"}


def model_name(doc: dict) -> str:
    name = model_id(doc["model"])
    return name if name != "-" else num(doc["config"].get("model"))


# ---- pairing -------------------------------------------------------------------------------------------
def of_label(label: str, baseline_label: str | None) -> bool:
    """Whether a run's label is the baseline label's: that label, or one of a grid's ``LABEL-...`` labels."""
    return baseline_label is not None and (label == baseline_label or label.startswith(baseline_label + "-"))


def _timed(suite: str) -> bool:
    return any(r.kind == "timing" for r in default_rules(suite))


def differences(base: dict, doc: dict) -> list[str]:
    """What makes two runs of a suite different experiments, as the gate sees it (empty: one experiment)."""
    return config_differences(base, doc, timings=_timed(doc["suite"]))


@dataclass(slots=True)
class Pairing:
    """A run's place in the report: ``role`` is "baseline" (a run of the baseline label), "candidate" (``base`` is
    the baseline run of its experiment) or "none" (no baseline of its experiment: ``why`` says so)."""

    role: str
    base: dict | None = None
    why: str = ""


def pair(docs: list[dict], baseline_label: str | None) -> dict[int, Pairing]:
    """``id(doc) -> Pairing`` for every document: its baseline run of the same suite and experiment, if any."""
    out = {}
    for doc in docs:
        if of_label(doc["label"], baseline_label):
            out[id(doc)] = Pairing("baseline")
            continue
        bases = [b for b in docs if b["suite"] == doc["suite"] and of_label(b["label"], baseline_label)]
        if baseline_label is None:
            out[id(doc)] = Pairing("none", why="no --baseline LABEL was given")
            continue
        found = [(differences(b, doc), b) for b in bases]
        same = [b for diffs, b in found if not diffs]
        if same:
            out[id(doc)] = Pairing("candidate", same[0])
        elif not found:
            out[id(doc)] = Pairing("none", why=f"{baseline_label} has no {doc['suite']} run")
        else:
            diffs, b = min(found, key=lambda f: len(f[0]))
            out[id(doc)] = Pairing("none", why=f"no {baseline_label} run of this experiment (the nearest, "
                                               f"{b['label']}, differs in {'; '.join(diffs)})")
    return out


# ---- the gate's rows, read -----------------------------------------------------------------------------
@dataclass(slots=True)
class Judged:
    """The gate's verdicts on a run against its baseline, with the concrete rule of each row (None: the config row)
    and ``error``, where the gate refused the pair (a malformed sample list)."""

    verdicts: list[Verdict]
    rules: dict[str, Rule]
    error: str | None = None

    @property
    def status(self) -> str:
        """The run's gate status: fail (a failed or missing row), ambiguous, or pass."""
        if self.error or any(v.status in ("fail", "missing") for v in self.verdicts):
            return "fail"
        return "ambiguous" if any(v.status == "ambiguous" for v in self.verdicts) else "pass"

    def rows(self, kind: str) -> list[Verdict]:
        return [v for v in self.verdicts if v.kind == kind]

    def main(self, suite: str) -> list[Verdict]:
        """The timing rows a suite's speed verdict is read from."""
        name = MAIN_TIMING.get(suite)
        return [v for v in self.rows("timing") if name and (v.metric == name or v.metric.endswith("." + name))]


def judge(base: dict, doc: dict) -> Judged:
    """The gate on ``doc`` against ``base`` with the suite's default rules."""
    rules = {r.metric: r for r in expand(default_rules(doc["suite"], doc_device(base, doc)), base, doc)}
    try:
        return Judged(gate(base, doc), rules)
    except ValueError as e:
        return Judged([], rules, str(e))


@dataclass(slots=True)
class Reading:
    """A timing row, read: ``word`` is same, faster, slower, undecided or missing (better / worse for a quantity
    judged on its threshold alone, such as peak memory); ``text`` the cell's wording, ``why`` its reason alone;
    ``repeats`` how many repeats a side would decide (the gate's ``repeats_needed``) where undecided."""

    word: str
    text: str
    tone: str
    repeats: int | None = None
    why: str = ""


def repeats_needed(v: Verdict) -> int | None:
    n = getattr(v, "repeats_needed", None)  # the gate's field (gates before it have none)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _stats(v: Verdict) -> str:
    """``p=0.0079, 99% CI +9.4%..+10.6%``: what the gate measured the row with, where it did."""
    parts = [] if v.p is None else [f"p={v.p:.2g}"]
    ci = getattr(v, "ci", None)
    if isinstance(ci, (tuple, list)) and len(ci) == 2 and all(isinstance(x, (int, float)) for x in ci):
        level = getattr(gate_module, "GATE_ALPHA", None)
        parts.append(f"{'' if level is None else f'{(1 - level) * 100:g}% '}CI {ci[0]:+.1%}..{ci[1]:+.1%}")
    return ", ".join(parts)


def _why(reason: str) -> str:
    """The gate's reason without what the report says itself: the change it starts with, the repeats it ends with."""
    why = re.sub(r"^[+-]?(\d+(\.\d+)?|inf)%: ", "", reason)
    why = re.sub(r"^undecided: ", "", why)
    return re.sub(r"; needs about [\d,]+ repeats a side", "", why)


def read_timing(v: Verdict, rule: Rule | None) -> Reading:
    """What a timing row of the gate says about speed: its status decides (module docstring); the words are the
    report's."""
    if v.status == "missing" or rule is None:
        return Reading("missing", f"missing: {v.reason}", "bad", why=v.reason)
    if v.change is None:
        return Reading("same", v.reason, "", why=v.reason)  # null on both sides, or not a number
    timed = rule.kind == "timing"
    good, bad = ("faster", "slower") if timed else ("better", "worse")
    better = (v.change > 0) == rule.higher_is_better
    word = good if better else bad
    stats = _stats(v)
    n = repeats_needed(v)
    if v.status == "fail":
        return Reading(bad, f"{bad}, {stats}" if stats else f"{bad}: {v.reason}", "bad", why=v.reason)
    beyond = abs(v.change) > rule.threshold
    if v.status == "ambiguous" or n is not None:
        moved = f"{v.change:+.1%}" + (f", {word} beyond ±{rule.threshold:.0%}" if beyond else "")
        why = _why(v.reason)
        return Reading("undecided", f"undecided: {moved} ({why})" + (f"; about {n} repeats a side would decide"
                                                                       if n else ""), "warn", n, why)
    if v.reason.startswith("improved"):
        return Reading(good, f"{good}, {stats}" if stats else f"{good}: {v.reason}", "good", why=v.reason)
    if not beyond:
        return Reading("same", f"same (within ±{rule.threshold:.0%})", "", why=v.reason)
    return Reading("same", f"same or {good}: {v.change:+.1%}, not past the gate's ±{rule.threshold:.0%} at its "
                           f"interval" + (f" ({stats})" if stats else ""), "", why=v.reason)


def ratio_cell(v: Verdict, reading: Reading) -> tuple[str, str]:
    """A delta table's cell: ``1.023x (+2.3%) same (within ±5%)``."""
    b, c = v.baseline, v.candidate
    text = f"undecided: {reading.why}" + (f"; about {reading.repeats} repeats a side would decide"
                                          if reading.repeats else "") if reading.word == "undecided" else reading.text
    if isinstance(b, (int, float)) and isinstance(c, (int, float)) and b and not isinstance(b, bool):
        return f"{c / b:.3f}x ({c / b - 1:+.1%}) {text}", reading.tone
    return text, reading.tone


def read_shift(b_samples, c_samples, higher_is_better: bool) -> tuple[str, str]:
    """``("faster, p=0.008", tone)``: the rank test's reading of two sample lists of one run (v3 over its v2), where
    no gate row exists."""
    shift = rank_test(b_samples, c_samples, ALPHA)
    if shift.powerless:
        return f"undecided ({shift.n_baseline} vs {shift.n_candidate} samples can never reach p<{ALPHA:g})", "warn"
    if not shift.significant:
        return f"same within noise, p={shift.p:.2g}", ""
    better = (shift.direction > 0) == higher_is_better
    return f"{'faster' if better else 'slower'}, p={shift.p:.2g}", "good" if better else "bad"
