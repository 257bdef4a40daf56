"""The regression gate: compare a candidate result document with a baseline (docs/DESIGN.md, "The gate").

Exact metrics (token hashes, acceptance counts on deterministic runs, oracle agreement, kernels' checks against
their references) must be equal; a candidate whose greedy repeats disagree where the baseline's agreed fails its
``deterministic`` row (its other exact rows can then only be "ambiguous"). A timing
metric fails when its median moved the wrong way by more than its threshold *and* the per-repeat samples show
the shift is significant (two-sided Mann-Whitney U test, p < ``alpha``); a change past the threshold that enough
samples cannot confirm is "ambiguous": shown, never silently passed. Where the samples are too few for the test
ever to reach ``alpha`` (3 repeats against 3, decode's default) or there are none (peak memory), the threshold
alone decides, and the verdict says so. A metric whose value or samples hold a NaN or an infinity cannot be judged:
its row is "missing" and fails the gate.

Two runs that differ in model, workload, engine settings or GPU (CPU runs gated on timings: CPU model and core
count; for kernels: a projection's weight format) are different experiments: the gate fails them with a ``config``
row unless ``allow_config_change``. How many samples a run took (decode's ``repeats``, concurrency's ``rounds``)
is no part of the experiment. A rules list of which no rule applies is refused.

Metrics are addressed by paths into the summary (:mod:`.metric_path`): ``decode_tok_s``,
``levels[concurrency=4].aggregate_tok_s``, ``records[op=rmsnorm,variant=v3,t=1].us_median``; a wildcard
(``levels[concurrency=*]``) makes one rule per value present in either document. The rank test is
:func:`.stats.rank_test`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import tomllib

from .experiment import config_differences
from .metric_path import MetricMissing, format_path, instances, lookup, parse_path, root, stars, substitute
from .schema import SUITES
from .stats import ALPHA, rank_test

KINDS = ("exact", "timing")


# ---- rules ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Rule:
    """One gated metric. ``threshold`` is a relative change of the median (0.05 = 5%); ``samples`` is the path
    of the per-repeat sample list a timing metric's significance is tested on; ``suite`` (optional) limits a
    rule in a shared rules file to one suite."""

    metric: str
    kind: str = "timing"
    higher_is_better: bool = True
    threshold: float = 0.05
    samples: str | None = None
    suite: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"rule {self.metric!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.higher_is_better, bool):
            raise ValueError(f"rule {self.metric!r}: higher_is_better must be true or false, "
                             f"got {self.higher_is_better!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not 0 <= self.threshold < math.inf:
            raise ValueError(f"rule {self.metric!r}: threshold must be a relative change >= 0, got {self.threshold!r}")
        if self.suite is not None and self.suite not in SUITES:
            raise ValueError(f"rule {self.metric!r}: unknown suite {self.suite!r} (one of {SUITES})")
        if self.samples is not None and not stars(parse_path(self.samples)) <= stars(parse_path(self.metric)):
            raise ValueError(f"rule {self.metric!r}: samples path {self.samples!r} has a wildcard the metric lacks")


def _timing(metric, higher=True, threshold=0.05, samples=None):
    return Rule(metric, "timing", higher, threshold, samples)


def default_rules(suite: str) -> list[Rule]:
    """The gate's rules for one suite (per-level and per-kernel rules use wildcards)."""
    if suite == "decode":
        exact = ("tokens_sha256", "prompt_tokens", "completion_tokens", "rounds", "drafted_tokens",
                 "accepted_tokens", "accepted_per_position", "deterministic")
        return [Rule(m, "exact") for m in exact] + [
            _timing("decode_tok_s", True, 0.05, "samples.decode_tok_s"),
            _timing("prefill_tok_s", True, 0.05, "samples.prefill_tok_s"),
            _timing("ttft_ms", False, 0.10, "samples.ttft_ms"),
            _timing("device_ms_per_round", False, 0.05, "samples.device_ms_per_round"),
            _timing("peak_memory_bytes", False, 0.05)]
    if suite == "niah":
        return [Rule(m, "exact") for m in ("cases", "oracle_agreement", "retrieval", "first_divergence")]
    if suite == "concurrency":
        lv = "levels[concurrency=*]"
        return [Rule(f"{lv}.matches_sequential", "exact"),
                _timing(f"{lv}.aggregate_tok_s", True, 0.05, f"{lv}.samples.aggregate_tok_s"),
                _timing(f"{lv}.per_request_tok_s", True, 0.05),
                _timing(f"{lv}.ttft_ms_p50", False, 0.10, f"{lv}.samples.ttft_ms"),
                _timing(f"{lv}.itl_ms_p50", False, 0.10, f"{lv}.samples.itl_ms")]
    if suite == "kernels":
        rec = "records[op=*,shape=*,variant=*,t=*]"
        # ok: the record's check against its fp32 reference in the same run (a fast wrong kernel is no speedup)
        return [Rule(f"{rec}.ok", "exact"), _timing(f"{rec}.us_median", False, 0.05, f"{rec}.samples_us")]
    if suite == "prefill":
        return [_timing("prefill_tok_s", True, 0.05, "samples.prefill_tok_s")]
    raise ValueError(f"unknown suite {suite!r} (one of {SUITES})")


def load_rules(path: str | Path) -> list[Rule]:
    """Rules from a JSON file (a list of rule objects, or ``{"rules": [...]}``) or a TOML file (``[[rules]]``
    tables). Keys: metric, kind, higher_is_better, threshold, samples, suite."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such rules file: {path}")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(path.read_text())
        elif path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            raise ValueError(f"{path}: rules files are .json or .toml, got {path.suffix or 'no extension'!r}")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: cannot parse rules ({e})") from None
    if isinstance(data, dict):
        extra = sorted(set(data) - {"rules"})
        if extra:
            raise ValueError(f"{path}: unknown top-level key(s) {extra}; expected only 'rules'")
        data = data.get("rules", [])
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of rules")
    allowed = [f.name for f in fields(Rule)]
    rules = []
    for i, item in enumerate(data, 1):
        if not isinstance(item, dict):
            raise ValueError(f"{path}: rule {i} is not a table/object")
        unknown = sorted(set(item) - set(allowed))
        if unknown:
            raise ValueError(f"{path}: rule {i} has unknown key(s) {unknown}; allowed: {allowed}")
        if "metric" not in item:
            raise ValueError(f"{path}: rule {i} has no 'metric'")
        try:
            rules.append(Rule(**item))
        except ValueError as e:
            raise ValueError(f"{path}: rule {i}: {e}") from None
    if not rules:
        raise ValueError(f"{path}: no rules (a gate with nothing to check would always pass)")
    return rules


def expand(rules: list[Rule], baseline: dict, candidate: dict) -> list[Rule]:
    """Concrete rules: each wildcard rule once per value present in either document (baseline order first)."""
    out = []
    for rule in rules:
        segs = parse_path(rule.metric)
        if not stars(segs):
            out.append(rule)
            continue
        found = {}
        for doc in (baseline, candidate):
            for inst in instances(root(doc), segs):
                found.setdefault(format_path(inst), inst)
        if not found:  # nothing to expand in either document: keep the wildcard rule so it reports "missing"
            out.append(rule)
        for text, inst in found.items():
            samples = None if rule.samples is None else substitute(rule.samples, inst)
            out.append(Rule(text, rule.kind, rule.higher_is_better, rule.threshold, samples, rule.suite))
    return out


# ---- the gate ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Verdict:
    """One gate row. ``change`` is the signed relative change of the candidate vs the baseline median
    ((candidate - baseline) / |baseline|); ``p`` the rank test's p-value where one was computed."""

    metric: str
    kind: str
    baseline: object
    candidate: object
    change: float | None
    status: str
    reason: str
    p: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _seeded(doc: dict) -> bool:
    """Whether a run's settings make it deterministic: greedy, or sampling with a fixed seed."""
    temperature = doc["config"].get("temperature") or 0
    return temperature <= 0 or doc["config"].get("seed") is not None


def _deterministic(doc: dict) -> bool:
    """Greedy runs are deterministic unless the suite saw its repeats disagree; sampling needs a fixed seed."""
    return doc["summary"].get("deterministic") is not False and _seeded(doc)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _relative(b, c) -> float | None:
    if not _number(b) or not _number(c):
        return None
    if b == 0:
        return 0.0 if c == 0 else math.copysign(math.inf, c)
    return (c - b) / abs(b)


def _non_finite(value) -> list[float]:
    """The NaN and infinite numbers in ``value`` (a number, or lists and dicts of them)."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _non_finite(v)]
    return []


def _not_finite(named: list[tuple[str, object]]) -> str | None:
    """Why a metric cannot be judged when a NaN or an infinity is among its (label, value) pairs; None if none is.
    An infinite tok/s would otherwise read as an unbounded improvement, and NaN compares unequal to everything."""
    bad = []
    for label, value in named:
        found = ", ".join(dict.fromkeys(map(repr, _non_finite(value))))  # inf, -inf, nan, each once
        if found:
            bad.append(f"{label} {'is' if isinstance(value, float) else 'holds'} {found}")
    return "not finite: " + "; ".join(bad) if bad else None


def _typed(value) -> str:
    """A value with its type, strings quoted: ``str "32"``, ``int 32``, ``null``."""
    if value is None:
        return "null"
    shown = f'"{_show(value)}"' if isinstance(value, str) else _show(value)
    return f"{type(value).__name__} {shown}"


def _judge_exact(rule: Rule, b, c, deterministic: bool) -> Verdict:
    not_finite = _not_finite([("baseline", b), ("candidate", c)])
    if not_finite:
        return Verdict(rule.metric, "exact", b, c, None, "missing", not_finite)
    change = _relative(b, c)
    if b == c:
        return Verdict(rule.metric, "exact", b, c, change, "pass", "null on both sides" if b is None else "equal")
    # "32" and 32 show alike in the table: name the types where they differ
    differs = "differs" if type(b) is type(c) else f"differs: {_typed(b)} vs {_typed(c)}"
    if not deterministic:
        return Verdict(rule.metric, "exact", b, c, change, "ambiguous",
                       f"{differs}, but a run is not deterministic (sampling without a seed, or repeats disagreed)")
    return Verdict(rule.metric, "exact", b, c, change, "fail", differs)


def _judge_determinism(rule: Rule, b, c, sampling: bool) -> Verdict:
    """``deterministic`` (whether a run's repeats decoded the same tokens) lost is a failure, not an excuse: the
    exact metrics of a candidate whose greedy repeats disagree are only "ambiguous", so without this row a build that
    made decoding nondeterministic (a race, an uninitialised buffer) would pass the gate."""
    if b is c or not isinstance(b, bool) or not isinstance(c, bool):
        return _judge_exact(rule, b, c, True)
    if b is False:
        return Verdict(rule.metric, "exact", b, c, None, "pass", "improved: the candidate's repeats agree")
    if sampling:
        return Verdict(rule.metric, "exact", b, c, None, "ambiguous",
                       "the candidate's repeats differ, but it samples without a seed")
    return Verdict(rule.metric, "exact", b, c, None, "fail",
                   "the candidate's repeats decoded different tokens; the baseline's agreed")


def _judge_check(rule: Rule, b, c) -> Verdict:
    """A record's ``ok`` (its check against the reference in the candidate's own run) is judged on the candidate:
    a kernel that fails its check fails the gate whatever the baseline did, one that passes it passes (fixed, when
    the baseline's failed)."""
    if not isinstance(c, bool):
        return _judge_exact(rule, b, c, True)
    if not c:
        return Verdict(rule.metric, "exact", b, c, None, "fail", "the candidate fails its check against the reference")
    return Verdict(rule.metric, "exact", b, c, None, "pass", "fixed: the baseline failed its check" if b is False
                   else "passes its check")


def _samples(rule: Rule, doc: dict, side: str) -> list | None:
    """The rule's per-repeat samples in one document; None when it has none."""
    if rule.samples is None:
        return None
    try:
        values = lookup(doc, rule.samples)
    except MetricMissing:
        return None
    if not isinstance(values, list) or not all(v is None or _number(v) for v in values):
        raise ValueError(f"{side} {rule.samples}: expected a list of numbers, got {_show(values)}")
    return values


def _judge_timing(rule: Rule, baseline: dict, candidate: dict, b, c, alpha: float) -> Verdict:
    def verdict(status, reason, change=None, p=None):
        return Verdict(rule.metric, "timing", b, c, change, status, reason, p)

    if b is None and c is None:
        return verdict("pass", "not measured on either side")
    if b is None or c is None:
        return verdict("missing", f"null in the {'baseline' if b is None else 'candidate'}")
    b_samples, c_samples = _samples(rule, baseline, "baseline"), _samples(rule, candidate, "candidate")
    not_finite = _not_finite([("baseline", b), ("candidate", c), (f"baseline {rule.samples}", b_samples),
                              (f"candidate {rule.samples}", c_samples)])
    if not_finite:
        return verdict("missing", not_finite)
    change = _relative(b, c)
    if change is None:
        return verdict("missing", f"not a number: {_typed(b)} vs {_typed(c)}")
    worse = -change if rule.higher_is_better else change
    limit = f"{rule.threshold * 100:g}%"
    if abs(worse) <= rule.threshold:
        return verdict("pass", f"within ±{limit}", change)
    shift = None if b_samples is None or c_samples is None else rank_test(b_samples, c_samples, alpha)
    stats = "" if shift is None else f"{shift.n_baseline} vs {shift.n_candidate} samples"
    stats = stats if shift is None or shift.p is None else f"p={shift.p:.3g}, {stats}"
    p = shift.p if shift else None
    if worse < 0:
        return verdict("pass", f"improved by {-worse:.1%}" + (f" ({stats})" if stats else ""), change, p)
    moved = f"{worse:.1%} worse (threshold {limit})"
    if shift is None or shift.powerless:
        # no test could confirm the change: the threshold alone decides, or a gate on decode's default 3 repeats
        # (or on peak memory, which has no samples) could never fail
        if shift is None:
            why = "no samples" if rule.samples is None else f"no {rule.samples}"
        else:
            why = f"too few samples to ever reach p<{alpha:g} ({stats})"
        return verdict("fail", f"{moved}; decided on the threshold alone, without a significance test: {why}",
                       change, p)
    if not shift.significant:
        return verdict("ambiguous", f"{moved}, not significant at p<{alpha:g} ({stats})", change, p)
    wrong_way = -1 if rule.higher_is_better else 1
    if shift.direction != wrong_way:
        return verdict("ambiguous", f"{moved}, but the samples shift the other way ({stats})", change, p)
    return verdict("fail", f"{moved}, significant ({stats})", change, p)


def gate(baseline: dict, candidate: dict, rules: list[Rule] | None = None, alpha: float = ALPHA,
         allow_config_change: bool = False) -> list[Verdict]:
    """Compare two result documents of the same suite; one :class:`Verdict` per (expanded) rule, preceded by a
    ``config`` row when the runs are different experiments (model, workload, spec, KV dtype, device...): "fail",
    or "ambiguous" with ``allow_config_change``. Raises ValueError when no rule applies to the suite."""
    suite = baseline.get("suite")
    if suite != candidate.get("suite"):
        raise ValueError(f"cannot gate a {candidate.get('suite')} result against a {suite} baseline")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    applicable = default_rules(suite) if rules is None else [r for r in rules if r.suite in (None, suite)]
    if not applicable:
        others = sorted({r.suite for r in rules})
        raise ValueError(f"no gate rule applies to a {suite} result"
                         + (f" (the rules are for {', '.join(others)})" if others else " (the rules list is empty)"))
    verdicts = []
    diffs = config_differences(baseline, candidate, timings=any(r.kind == "timing" for r in applicable))
    if diffs:
        status, note = ("ambiguous", "allowed") if allow_config_change else ("fail", "different experiments")
        verdicts.append(Verdict("config", "config", None, None, None, status,
                                f"config differs ({note}): " + "; ".join(diffs)))
    deterministic = _deterministic(baseline) and _deterministic(candidate)
    for rule in expand(applicable, baseline, candidate):
        (b, b_missing), (c, c_missing) = _value(baseline, rule.metric), _value(candidate, rule.metric)
        if b_missing or c_missing:
            reason = "; ".join(f"{side}: {why}" for side, why in (("baseline", b_missing), ("candidate", c_missing))
                               if why)
            verdicts.append(Verdict(rule.metric, rule.kind, b, c, None, "missing", reason))
        elif rule.kind == "exact" and parse_path(rule.metric) == (("deterministic", None),):
            verdicts.append(_judge_determinism(rule, b, c, not _seeded(baseline) or not _seeded(candidate)))
        elif rule.kind == "exact" and parse_path(rule.metric)[-1] == ("ok", None):
            verdicts.append(_judge_check(rule, b, c))
        elif rule.kind == "exact":
            verdicts.append(_judge_exact(rule, b, c, deterministic))
        else:
            verdicts.append(_judge_timing(rule, baseline, candidate, b, c, alpha))
    return verdicts


def _value(doc: dict, path: str) -> tuple[object, str | None]:
    """(value, None), or (None, why it is missing)."""
    try:
        return lookup(doc, path), None
    except MetricMissing as e:
        return None, str(e)


def exit_code(verdicts: list[Verdict]) -> int:
    """1 when any verdict failed or is missing, or there is none (nothing was compared); ambiguous rows are shown
    but do not fail."""
    return int(not verdicts or any(v.status in ("fail", "missing") for v in verdicts))


def _show(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str) and len(value) == 64 and all(ch in "0123456789abcdef" for ch in value):
        return value[:12] + "…"  # a SHA-256
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text if len(text) <= 40 else text[:39] + "…"


def render_table(verdicts: list[Verdict], title: str = "gate"):
    """A rich Table of the verdicts, coloured by status."""
    from rich.table import Table
    from rich.text import Text

    colour = {"pass": "green", "fail": "bold red", "missing": "bold red", "ambiguous": "yellow"}
    table = Table(title=title)
    for col, justify in (("metric", "left"), ("kind", "left"), ("baseline", "right"), ("candidate", "right"),
                         ("change", "right"), ("status", "left"), ("reason", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    for v in verdicts:
        change = "-" if v.change is None else f"{v.change:+.1%}" if math.isfinite(v.change) else "inf"
        table.add_row(Text(v.metric), v.kind, Text(_show(v.baseline)), Text(_show(v.candidate)), change,
                      Text(v.status, style=colour.get(v.status, "")), Text(v.reason))
    return table
