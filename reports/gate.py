"""The regression gate: compare a candidate result document with a baseline (docs/DESIGN.md, "The gate").

Exact metrics (token hashes, acceptance counts on deterministic runs, oracle agreement, kernels' checks against
their references) must be equal; a candidate whose greedy repeats disagree where the baseline's agreed fails its
``deterministic`` row (its other exact rows can then only be "ambiguous"). A metric whose value or samples hold a
NaN or an infinity cannot be judged: its row is "missing" and fails the gate.

A timing with per-repeat samples is decided on a confidence interval, never on its threshold alone. ``s`` is the
relative shift toward worse (slower, or more latency) of the candidate against the baseline: the Hodges-Lehmann
shift of the samples (the median of all candidate - baseline differences) over the baseline's value, with its
two-sided ``1 - alpha`` interval [lo, hi] (Moses: order statistics of those differences; distribution-free, so a
load spike moves it by one order statistic, not by its size). With ``t`` the rule's threshold:

- pass: hi <= t (the change is at most the threshold, or an improvement);
- fail: hi > t, s >= 3/4 t (:data:`FAIL_FRACTION`) and lo >= t / 2 (:data:`FAIL_LOW`): the slowdown is estimated
  at three quarters of the threshold or more, and the interval excludes every slowdown under half of it. An
  interval over one run's repeats cannot see drift between two runs (on a shared CPU a whole run moves by several
  percent), so a slowdown that is significant but could still be that small is left to more repeats:
  "ambiguous" (a 2-core CPU's A/A pairs failed 5 in 40 under the earlier rule, lo > 0 and s >= 3/4 t;
  docs/perf/2026-12-02d-prefill-weights-scales-ahead-h200.md, scripts/simulate_gate.py);
- ambiguous otherwise, or when the samples are too few for any interval (below 5 a side at the default alpha
  0.01: 2 or 3 repeats never fail and never pass), with ``repeats_needed``: the samples a side at which the
  interval would be narrow enough to decide, estimated from the samples' spread (a robust standard deviation).

The default ``alpha`` is :data:`GATE_ALPHA` (0.01): an A/A pair fails one metric about 1 time in 200 or less. A timing
without samples (no ``samples`` path, or none in a document) passes within its threshold and is "ambiguous" beyond
it: one number is never failed. A ``threshold`` rule (peak memory: no per-repeat noise) is decided on its threshold
alone, and says so. Timings of two runs measured under different load classes (:func:`.experiment.load_shift`) are
not failed: such a row is "ambiguous", and so is a pass when the candidate ran under the lighter load.

Two runs that differ in model, workload, engine settings or GPU (where timings are compared: torch's threads, CPU
affinity, the GPU's configured clocks; CPU runs: CPU model and core count; for kernels: a projection's weight
format) are different experiments: the gate fails them with a ``config`` row unless ``allow_config_change``. How
many samples a run took (decode's ``repeats``, concurrency's ``rounds``) is no part of the experiment. A rules list
of which no rule applies is refused.

Metrics are addressed by paths into the summary (:mod:`.metric_path`): ``decode_tok_s``,
``levels[concurrency=4].aggregate_tok_s``, ``records[op=rmsnorm,variant=v3,t=1].us_median``; a wildcard
(``levels[concurrency=*]``) makes one rule per value present in either document, and a later rule for the same
concrete metric replaces an earlier one. ``ninfer-bench gate`` merges a rules file and ``--threshold`` into the
defaults (:func:`merge_rules`); its exit code is :func:`exit_code`: 0 pass, 1 fail or missing, 3 ambiguous.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from statistics import NormalDist

import tomllib

from .experiment import config_differences, load_shift, load_text
from .metric_path import (STAR, MetricMissing, format_path, instances, lookup, parse_path, root, stars,
                          substitute)
from .schema import SUITES, ResultError, read_result
from .stats import (mann_whitney_u, min_interval_samples, robust_sd, samples_for_half_width, shift_interval)

KINDS = ("exact", "timing", "threshold")
GATE_ALPHA = 0.01  # the gate's default: two-sided 99% intervals
FAIL_FRACTION = 0.75  # a slowdown fails only when estimated at >= 3/4 of the threshold (module docstring)
FAIL_LOW = 0.5  # ... and when its interval excludes every slowdown under half of the threshold
MAX_REPEATS_NEEDED = 10_000
DECIDE_Z = NormalDist().inv_cdf(0.9)  # repeats_needed aims to decide 9 times in 10 (repeats_to_decide)
EXIT_PASS, EXIT_FAIL, EXIT_AMBIGUOUS = 0, 1, 3  # 2 is click's usage error
STATUSES = ("pass", "fail", "ambiguous", "missing")


# ---- rules ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Rule:
    """One gated metric. ``threshold`` is a relative change of the median (0.05 = 5%); ``samples`` is the path
    of the per-repeat sample list a timing metric is judged on; ``suite`` (optional) limits a rule in a shared rules
    file to one suite. Kinds: ``exact`` (must be equal), ``timing`` (judged on its samples' interval), ``threshold``
    (a quantity without per-repeat noise, such as peak memory: judged on its threshold alone)."""

    metric: str
    kind: str = "timing"
    higher_is_better: bool = True
    threshold: float = 0.05
    samples: str | None = None
    suite: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str):
            raise ValueError(f"rule metric must be a metric path (text), got {self.metric!r}")
        parse_path(self.metric)
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
        if self.samples is not None and not isinstance(self.samples, str):
            raise ValueError(f"rule {self.metric!r}: samples must be a metric path (text), got {self.samples!r}")
        if self.samples is not None and self.kind == "threshold":
            raise ValueError(f"rule {self.metric!r}: a threshold rule is judged on its threshold alone and takes no "
                             f"samples (make it a timing rule)")
        if self.samples is not None and not stars(parse_path(self.samples)) <= stars(parse_path(self.metric)):
            raise ValueError(f"rule {self.metric!r}: samples path {self.samples!r} has a wildcard the metric lacks")


RULE_KEYS = tuple(f.name for f in fields(Rule))
CHANGE_KEYS = (*RULE_KEYS, "remove")


def _timing(metric, higher=True, threshold=0.05, samples=None):
    return Rule(metric, "timing", higher, threshold, samples)


# decode's per-step timings on a GPU. A threshold is the change the gate tolerates, so a slowdown of exactly it is
# caught only about half the time; on a GPU the run-to-run spread is small enough to sit the threshold under the 5%
# slowdown a gate must catch. H200, bundled model, 110 A/A pairs twice: decode medians apart by p95 1.9% / 2.6%, max
# 2.6% / 3.2%; at 5% an injected 5% slowdown was caught in 47 of 50 pairs both times (a slow baseline read it as
# 3.3-4.4%), at 4% in 50 and 49 of 50 with no decode A/A failure
# (docs/perf/2026-12-04-gate-gpu-threshold-prefill-head-h200.md).
# A CPU keeps 5%: its whole runs move by several percent.
GPU_DECODE_THRESHOLD = 0.04


def on_gpu(device) -> bool:
    """Whether a result's ``config.device`` is a GPU (``cuda``, ``cuda:1``)."""
    return isinstance(device, str) and device.startswith("cuda")


def doc_device(*docs) -> str | None:
    """The ``config.device`` every one of ``docs`` ran on; None when they differ (a different experiment) or none
    says."""
    devices = {(d.get("config") or {}).get("device") for d in docs}
    return devices.pop() if len(devices) == 1 else None


def default_rules(suite: str, device: str | None = None) -> list[Rule]:
    """The gate's rules for one suite (per-level and per-kernel rules use wildcards); ``device``: the runs'
    ``config.device``, which sets decode's step timings' threshold (:data:`GPU_DECODE_THRESHOLD` on a GPU)."""
    if suite == "decode":
        exact = ("tokens_sha256", "prompt_tokens", "completion_tokens", "rounds", "drafted_tokens",
                 "accepted_tokens", "accepted_per_position", "deterministic")
        step = GPU_DECODE_THRESHOLD if on_gpu(device) else 0.05
        return [Rule(m, "exact") for m in exact] + [
            _timing("decode_tok_s", True, step, "samples.decode_tok_s"),
            # a short prompt's prefill is compute-bound and follows the SM clock between runs: its run medians spread
            # 0.91-1.03x on the H200 (scripts/probe_prefill_drift.py, captured prefill), so its threshold is TTFT's
            # (asv's default factor, 1.1), not decode's 4-5%
            _timing("prefill_tok_s", True, 0.10, "samples.prefill_tok_s"),
            _timing("ttft_ms", False, 0.10, "samples.ttft_ms"),
            _timing("device_ms_per_round", False, step, "samples.device_ms_per_round"),
            Rule("peak_memory_bytes", "threshold", False, 0.05)]
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


@dataclass(slots=True)
class RuleChange:
    """One entry of a rules file (or one ``--threshold``), merged into a suite's default rules by
    :func:`merge_rules`: ``given`` holds the rule keys it sets (kind, higher_is_better, threshold, samples);
    ``remove`` drops the rule of that metric; ``adjust_only`` (``--threshold``) may only change an existing rule;
    ``source`` names it in messages (``rules.toml rule 2``)."""

    metric: str
    given: dict = field(default_factory=dict)
    suite: str | None = None
    remove: bool = False
    adjust_only: bool = False
    source: str = ""

    def to_dict(self) -> dict:
        return {"metric": self.metric, "suite": self.suite, **self.given, **({"remove": True} if self.remove else {}),
                "source": self.source}


def _read_rules_file(path: Path) -> list:
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
    if not data:
        raise ValueError(f"{path}: no rules (a gate with nothing to check would always pass)")
    return data


def load_rule_changes(path: str | Path) -> list[RuleChange]:
    """The entries of a rules file (docs/DESIGN.md, "The gate"; ``ninfer-bench gate --help``): a JSON list of rule
    objects or ``{"rules": [...]}``, or TOML ``[[rules]]`` tables. Keys: metric (required), kind, higher_is_better,
    threshold, samples, suite, and ``remove = true`` (with metric and suite only) to drop a default rule."""
    path = Path(path)
    changes = []
    for i, item in enumerate(_read_rules_file(path), 1):
        where = f"{path.name} rule {i}"
        if not isinstance(item, dict):
            raise ValueError(f"{path}: rule {i} is not a table/object")
        unknown = sorted(set(item) - set(CHANGE_KEYS))
        if unknown:
            raise ValueError(f"{path}: rule {i} has unknown key(s) {unknown}; allowed: {list(CHANGE_KEYS)}")
        if "metric" not in item:
            raise ValueError(f"{path}: rule {i} has no 'metric'")
        remove = item.get("remove", False)
        if not isinstance(remove, bool):
            raise ValueError(f"{path}: rule {i}: remove must be true or false, got {remove!r}")
        given = {k: v for k, v in item.items() if k not in ("metric", "suite", "remove")}
        if remove and given:
            raise ValueError(f"{path}: rule {i} removes {item['metric']!r} and sets {sorted(given)}: a removal takes "
                             "only metric and suite")
        try:  # the values alone must make a rule (a change's combination with its default is checked on merging)
            Rule(item["metric"], **({} if remove else given), suite=item.get("suite"))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: rule {i}: {e}") from None
        changes.append(RuleChange(item["metric"], given, item.get("suite"), remove, source=where))
    return changes


def load_rules(path: str | Path) -> list[Rule]:
    """The rules of a file taken as the whole rule list (the library's ``gate(rules=...)``), each key it does not
    give at its :class:`Rule` default; ``ninfer-bench gate`` merges a file into the defaults instead
    (:func:`load_rule_changes`, :func:`merge_rules`)."""
    rules = []
    for ch in load_rule_changes(path):
        if ch.remove:
            raise ValueError(f"{path}: {ch.source.split(' ', 1)[1]} removes {ch.metric!r}: a removal applies only "
                             "when a rules file merges into the defaults (ninfer-bench gate --rules)")
        rules.append(Rule(ch.metric, **ch.given, suite=ch.suite))
    return rules


def parse_threshold(text: str) -> RuleChange:
    """``--threshold METRIC=PCT`` (``decode_tok_s=10``: 10%, a ``%`` allowed) -> a change of that rule's threshold."""
    metric, eq, pct = str(text).rpartition("=")
    try:
        value = float(pct.strip().removesuffix("%"))
    except ValueError:
        value = math.nan
    if not eq or not metric.strip() or not 0 <= value < math.inf:
        raise ValueError(f"--threshold {text!r}: expected METRIC=PCT with PCT a percentage >= 0 (decode_tok_s=10)")
    metric = metric.strip()
    parse_path(metric)
    return RuleChange(metric, {"threshold": value / 100}, adjust_only=True, source=f"--threshold {text}")


def _narrows(child, parent) -> dict | None:
    """Where the parsed path ``child`` is ``parent`` or an instance of its wildcards (every selector with the same
    keys, each value the parent's or one in place of its ``*``): the child's value for each selector key
    ``{(list name, key): value}``; None where it is not."""
    if len(child) != len(parent):
        return None
    binding = {}
    for (cname, csel), (pname, psel) in zip(child, parent):
        if cname != pname or isinstance(csel, tuple) != isinstance(psel, tuple):
            return None
        if not isinstance(psel, tuple):
            if csel != psel:
                return None
            continue
        cvals, pvals = dict(csel), dict(psel)
        if set(cvals) != set(pvals) or len(cvals) != len(csel):
            return None
        for key, pv in pvals.items():
            cv = cvals[key]
            if pv is STAR:
                binding[(pname, key)] = cv
            elif cv != pv:
                return None
    return binding


def _bind(path: str, binding: dict) -> str:
    """``path`` with the wildcards of :func:`_narrows`'s binding filled in (in the path's own key order)."""
    return format_path([(name, tuple((k, binding.get((name, k), v) if v is STAR else v) for k, v in sel)
                         if isinstance(sel, tuple) else sel) for name, sel in parse_path(path)])


@dataclass(slots=True)
class Merged:
    """A suite's rules after :func:`merge_rules`: ``removed`` lists each rule a change dropped (or turned from exact to
    another kind) as ``{"suite", "metric", "kind", "source", "what"}``; ``used`` the changes that applied."""

    rules: list[Rule]
    removed: list[dict]
    used: list[RuleChange]


def merge_rules(suite: str, changes: list[RuleChange], base: list[Rule] | None = None,
                device: str | None = None) -> Merged:
    """The suite's rules (``base``, default: :func:`default_rules` for ``device``) with ``changes`` applied in order. A
    change of the suite (or of no suite) whose metric is a rule's replaces the keys it gives; one whose metric narrows a
    wildcard rule (``levels[concurrency=4].x`` of ``levels[concurrency=*].x``) adds that instance with the wildcard
    rule's keys and its own (a later rule for a concrete metric wins, :func:`expand`); any other adds a rule (unless
    ``adjust_only``); ``remove`` drops the rule. Dropping an exact rule, or changing its kind, is listed in ``removed``:
    exact checks are never switched off silently."""
    rules = list(default_rules(suite, device) if base is None else base)
    removed, used = [], []
    for ch in changes:
        if ch.suite not in (None, suite):
            continue
        segs = parse_path(ch.metric)
        same = next((i for i, r in enumerate(rules) if parse_path(r.metric) == segs), None)
        if ch.remove:
            if same is None:
                if ch.suite == suite:
                    raise ValueError(f"{ch.source} removes {ch.metric!r}, which no {suite} rule has")
                continue
            old = rules.pop(same)
            removed.append({"suite": suite, "metric": old.metric, "kind": old.kind, "source": ch.source,
                            "what": "removed"})
            used.append(ch)
            continue
        if same is not None:
            old = rules[same]
            if ch.adjust_only and old.kind == "exact":
                raise ValueError(f"{ch.source}: {old.metric} is an exact {suite} rule; it has no threshold")
            try:
                new = Rule(**{**asdict(old), **ch.given, "suite": old.suite if ch.suite is None else ch.suite})
            except ValueError as e:
                raise ValueError(f"{ch.source}: {e}") from None
            if old.kind == "exact" and new.kind != "exact":
                removed.append({"suite": suite, "metric": old.metric, "kind": old.kind, "source": ch.source,
                                "what": f"made a {new.kind} rule"})
            rules[same] = new
            used.append(ch)
            continue
        parents = [(r, b) for r in rules if stars(parse_path(r.metric)) for b in [_narrows(segs, parse_path(r.metric))]
                   if b is not None]
        if parents:
            parent, binding = parents[-1]
            if ch.adjust_only and parent.kind == "exact":
                raise ValueError(f"{ch.source}: {parent.metric} is an exact {suite} rule; it has no threshold")
            base_keys = {**asdict(parent), "metric": _bind(parent.metric, binding),
                         "samples": None if parent.samples is None else _bind(parent.samples, binding)}
            try:
                rules.append(Rule(**{**base_keys, **ch.given, "suite": ch.suite if ch.suite else parent.suite}))
            except ValueError as e:
                raise ValueError(f"{ch.source}: {e}") from None
            used.append(ch)
        elif not ch.adjust_only:
            try:
                rules.append(Rule(ch.metric, **ch.given, suite=ch.suite))
            except ValueError as e:
                raise ValueError(f"{ch.source}: {e}") from None
            used.append(ch)
    return Merged(rules, removed, used)


def expand(rules: list[Rule], baseline: dict, candidate: dict) -> list[Rule]:
    """Concrete rules: each wildcard rule once per value present in either document (baseline order first); a later
    rule for the same concrete metric replaces an earlier one (in its place)."""
    out: dict[str, Rule] = {}
    for rule in rules:
        segs = parse_path(rule.metric)
        if not stars(segs):
            out[format_path(segs)] = rule
            continue
        found = {}
        for doc in (baseline, candidate):
            for inst in instances(root(doc), segs):
                found.setdefault(format_path(inst), inst)
        if not found:  # nothing to expand in either document: keep the wildcard rule so it reports "missing"
            out[rule.metric] = rule
        for text, inst in found.items():
            samples = None if rule.samples is None else substitute(rule.samples, inst)
            out[text] = Rule(text, rule.kind, rule.higher_is_better, rule.threshold, samples, rule.suite)
    return list(out.values())


# ---- the gate ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Verdict:
    """One gate row. ``change`` is the signed relative change of the candidate vs the baseline median
    ((candidate - baseline) / |baseline|); ``p`` the Mann-Whitney p-value where samples were compared; ``ci`` the
    ``1 - alpha`` interval of the relative change (signed like ``change``: the Hodges-Lehmann shift's, over the
    baseline's value) where the samples give one; ``repeats_needed`` (ambiguous timing rows only) about how many
    samples a side would decide it."""

    metric: str
    kind: str
    baseline: object
    candidate: object
    change: float | None
    status: str
    reason: str
    p: float | None = None
    repeats_needed: int | None = None
    ci: tuple[float, float] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _seeded(doc: dict) -> bool:
    """Whether a run's settings make it deterministic: greedy, or sampling with a fixed seed (a concurrency run's
    ``sample_seed``: request i draws from seed sample_seed + i)."""
    temperature = doc["config"].get("temperature") or 0
    return temperature <= 0 or doc["config"].get("seed") is not None or doc["config"].get("sample_seed") is not None


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


def _pct(x: float) -> str:
    return f"{x:+.1%}" if math.isfinite(x) else ("+inf" if x > 0 else "-inf")


def _level(alpha: float) -> str:
    return f"{(1 - alpha) * 100:g}%"


def repeats_to_decide(b_samples, c_samples, scale: float, worse: float, threshold: float, alpha: float) -> int:
    """Samples a side (as many on each) at which the interval would decide a timing row 9 times in 10 if the shift is
    what it looks like: half-width below ``threshold - worse`` (to pass) or below ``worse - FAIL_LOW * threshold``
    (to fail, where the estimate is at least FAIL_FRACTION of the threshold), whichever is wider, less the
    estimate's own wobble; from the samples' pooled robust spread; at least the fewest samples that give an
    interval at all, and more than either side has."""
    have = min(sum(v is not None for v in b_samples), sum(v is not None for v in c_samples))
    floor = max(min_interval_samples(alpha), have + 1)
    sds = [sd for sd in (robust_sd(b_samples), robust_sd(c_samples)) if sd is not None]
    if not sds or scale <= 0:
        return floor
    sd = math.sqrt(sum(x * x for x in sds) / len(sds)) / scale
    room = max([threshold - worse] + ([worse - FAIL_LOW * threshold] if worse >= FAIL_FRACTION * threshold else []))
    # the estimate moves as samples come (its sd is about half-width / z): leave it room to, so that a shift that is
    # what it looks like now is decided 9 times in 10
    z = NormalDist().inv_cdf(1 - alpha / 2)
    need = samples_for_half_width(sd, room / (1 + DECIDE_Z / z), alpha)
    return min(MAX_REPEATS_NEEDED, max(need, floor))


def _judge_threshold(rule: Rule, b, c, change: float, worse: float) -> Verdict:
    """A quantity without per-repeat noise (peak memory): the threshold alone decides."""
    limit = f"{rule.threshold * 100:g}%"
    alone = "judged on the threshold alone (no per-repeat noise)"
    if worse < -rule.threshold:
        return Verdict(rule.metric, rule.kind, b, c, change, "pass", f"improved by {-worse:.1%}; {alone}")
    if worse <= rule.threshold:
        return Verdict(rule.metric, rule.kind, b, c, change, "pass", f"within ±{limit}; {alone}")
    return Verdict(rule.metric, rule.kind, b, c, change, "fail", f"{worse:.1%} worse (threshold {limit}); {alone}")


def _judge_timing(rule: Rule, baseline: dict, candidate: dict, b, c, alpha: float) -> Verdict:
    def verdict(status, reason, change=None, p=None, needed=None, ci=None):
        return Verdict(rule.metric, rule.kind, b, c, change, status, reason, p, needed, ci)

    if b is None and c is None:
        return verdict("pass", "not measured on either side")
    if b is None or c is None:
        return verdict("missing", f"null in the {'baseline' if b is None else 'candidate'}")
    if rule.kind == "timing":
        b_samples, c_samples = _samples(rule, baseline, "baseline"), _samples(rule, candidate, "candidate")
    else:
        b_samples = c_samples = None
    not_finite = _not_finite([("baseline", b), ("candidate", c), (f"baseline {rule.samples}", b_samples),
                              (f"candidate {rule.samples}", c_samples)])
    if not_finite:
        return verdict("missing", not_finite)
    change = _relative(b, c)
    if change is None:
        return verdict("missing", f"not a number: {_typed(b)} vs {_typed(c)}")
    sign = -1 if rule.higher_is_better else 1  # worse = sign * change
    worse = sign * change
    limit = f"{rule.threshold * 100:g}%"
    if rule.kind == "threshold":
        return _judge_threshold(rule, b, c, change, worse)
    b_vals = [v for v in b_samples or [] if v is not None]
    c_vals = [v for v in c_samples or [] if v is not None]
    if not b_vals or not c_vals:  # one number a side: screened by the threshold, never failed
        why = "no samples" if rule.samples is None else \
            f"no {rule.samples} in the {'baseline' if not b_vals else 'candidate'}"
        if worse < -rule.threshold:
            return verdict("pass", f"improved by {-worse:.1%} ({why})", change)
        if worse <= rule.threshold:
            return verdict("pass", f"within ±{limit} ({why}: screened by the threshold alone)", change)
        return verdict("ambiguous", f"{worse:.1%} worse (threshold {limit}), but {why}: a timing is not failed on "
                                    "one number; record per-repeat samples", change)
    scale = abs(b) if b else abs(float(sorted(b_vals)[len(b_vals) // 2]))
    counts = f"{len(b_vals)} vs {len(c_vals)} samples"
    p = mann_whitney_u(b_vals, c_vals).p
    if scale == 0:  # a baseline of zeros: no relative shift to speak of
        if all(v == 0 for v in c_vals):
            return verdict("pass", f"zero on both sides ({counts})", change, p)
        return verdict("ambiguous", f"the baseline is zero: no relative change to judge ({counts})", change, p)
    shift = shift_interval(b_vals, c_vals, alpha)
    estimate = sign * shift.estimate / scale  # the Hodges-Lehmann shift toward worse, relative
    level = _level(alpha)
    if shift.low is None:
        needed = repeats_to_decide(b_vals, c_vals, scale, estimate, rule.threshold, alpha)
        return verdict("ambiguous", f"{_pct(change)}: {counts} are too few for a {level} interval; needs about "
                                    f"{needed} repeats a side", change, p, needed)
    ci = (shift.low / scale, shift.high / scale)  # of the signed relative change
    lo, hi = sorted(sign * x for x in ci)
    interval = f"{level} CI {_pct(ci[0])}..{_pct(ci[1])}, {counts}"
    if hi <= rule.threshold:
        if hi < 0:
            return verdict("pass", f"improved by {-estimate:.1%} ({interval})", change, p, None, ci)
        return verdict("pass", f"within ±{limit} ({interval})", change, p, None, ci)
    floor = FAIL_LOW * rule.threshold
    if lo >= floor and estimate >= FAIL_FRACTION * rule.threshold:
        return verdict("fail", f"{_pct(change)}: a significant slowdown (p={p:.2g}) at or past the {limit} threshold, "
                               f"of at least {floor:.2%} ({interval})", change, p, None, ci)
    needed = repeats_to_decide(b_vals, c_vals, scale, estimate, rule.threshold, alpha)
    what = f"a significant slowdown (p={p:.2g}), but the interval reaches both past the {limit} threshold and " \
           f"under {floor:.2%} (or the estimate is short of {FAIL_FRACTION * rule.threshold:.2%})" if lo > 0 else \
        f"undecided: the interval spans no change and a slowdown past the {limit} threshold (p={p:.2g})"
    return verdict("ambiguous", f"{_pct(change)}: {what} ({interval}); needs about {needed} repeats a side", change,
                   p, needed, ci)


def _under_load(v: Verdict, shift: tuple[str, bool] | None) -> Verdict:
    """A timing row of two runs measured under different load classes: a fail is not trusted (ambiguous), nor a pass
    where the candidate ran under the lighter load."""
    if shift is None or v.kind != "timing" or v.status not in ("pass", "fail", "ambiguous"):
        return v
    what, candidate_heavier = shift
    if v.status == "fail":
        v.status, v.repeats_needed = "ambiguous", None
        v.reason += f"; not failed: {what}"
    elif v.status == "pass" and not candidate_heavier and v.reason != "not measured on either side":
        v.status = "ambiguous"
        v.reason += f"; but {what}: the candidate had the lighter load"
    elif v.status == "ambiguous":
        v.reason += f"; {what}"
    return v


def gate(baseline: dict, candidate: dict, rules: list[Rule] | None = None, alpha: float = GATE_ALPHA,
         allow_config_change: bool = False) -> list[Verdict]:
    """Compare two result documents of the same suite; one :class:`Verdict` per (expanded) rule, preceded by a
    ``config`` row when the runs are different experiments (model, workload, spec, KV dtype, device, threads...):
    "fail", or "ambiguous" with ``allow_config_change``. ``rules`` is the whole rule list (default: the suite's
    :func:`default_rules` for the runs' device; :func:`merge_rules` makes one from changes). Timings are decided on
    ``1 - alpha`` intervals (module docstring). Raises ValueError when no rule applies to the suite."""
    suite = baseline.get("suite")
    if suite != candidate.get("suite"):
        raise ValueError(f"cannot gate a {candidate.get('suite')} result against a {suite} baseline")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    applicable = default_rules(suite, doc_device(baseline, candidate)) if rules is None else \
        [r for r in rules if r.suite in (None, suite)]
    if not applicable:
        others = sorted({r.suite for r in rules})
        raise ValueError(f"no gate rule applies to a {suite} result"
                         + (f" (the rules are for {', '.join(others)})" if others else " (the rules list is empty)"))
    verdicts = []
    timed = any(r.kind != "exact" for r in applicable)
    diffs = config_differences(baseline, candidate, timings=timed)
    if diffs:
        status, note = ("ambiguous", "allowed") if allow_config_change else ("fail", "different experiments")
        verdicts.append(Verdict("config", "config", None, None, None, status,
                                f"config differs ({note}): " + "; ".join(diffs)))
    deterministic = _deterministic(baseline) and _deterministic(candidate)
    load = load_shift(baseline, candidate) if timed else None
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
            verdicts.append(_under_load(_judge_timing(rule, baseline, candidate, b, c, alpha), load))
    return verdicts


def _value(doc: dict, path: str) -> tuple[object, str | None]:
    """(value, None), or (None, why it is missing)."""
    try:
        return lookup(doc, path), None
    except MetricMissing as e:
        return None, str(e)


def status_of(verdicts: list[Verdict]) -> str:
    """"fail" when any verdict failed or is missing, or there is none (nothing was compared); else "ambiguous" when
    any is; else "pass"."""
    if not verdicts or any(v.status in ("fail", "missing") for v in verdicts):
        return "fail"
    return "ambiguous" if any(v.status == "ambiguous" for v in verdicts) else "pass"


EXIT_CODES = {"pass": EXIT_PASS, "fail": EXIT_FAIL, "ambiguous": EXIT_AMBIGUOUS}


def exit_code(verdicts: list[Verdict]) -> int:
    """``ninfer-bench gate``'s exit code: 1 when any verdict failed or is missing, or there is none (nothing was
    compared); 3 when none did but some are ambiguous; 0 when every one passed."""
    return EXIT_CODES[status_of(verdicts)]


def worst(statuses) -> str:
    """The gate status of several pairs: fail over ambiguous over pass (fail when there is none)."""
    statuses = list(statuses)
    return "fail" if not statuses or "fail" in statuses else "ambiguous" if "ambiguous" in statuses else "pass"


# ---- grids: folders of result documents, paired by (suite, label) --------------------------------------
@dataclass(slots=True)
class Pair:
    suite: str
    label: str
    baseline_path: str
    candidate_path: str
    baseline: dict
    candidate: dict


def read_folder(folder: str | Path) -> list[tuple[str, dict]]:
    """(path, document) of each ``*.json`` / ``*.json.gz`` result directly in ``folder``, in name order; two of one
    suite and label are refused (a pair would be a guess)."""
    folder = Path(folder)
    files = sorted([*folder.glob("*.json"), *folder.glob("*.json.gz")])
    if not files:
        raise ResultError(f"{folder}: a folder with no *.json or *.json.gz result files")
    out, seen = [], {}
    for f in files:
        doc = read_result(f)
        key = (doc["suite"], doc["label"])
        if key in seen:
            raise ResultError(f"{seen[key]} and {f} are both {key[0]} results labelled {key[1]!r}: runs are paired by "
                              "suite and label; give each run its own --label, or move one out")
        seen[key] = f
        out.append((str(f), doc))
    return out


def pair_results(baseline: list[tuple[str, dict]], candidate: list[tuple[str, dict]]) \
        -> tuple[list[Pair], list[dict]]:
    """Pairs of baseline and candidate documents of one suite and label (baseline order), and the documents without
    a partner as ``{"side", "suite", "label", "path"}``."""
    cands = {(d["suite"], d["label"]): (p, d) for p, d in candidate}
    pairs, unpaired, taken = [], [], set()
    for path, doc in baseline:
        key = (doc["suite"], doc["label"])
        if key in cands:
            c_path, c_doc = cands[key]
            pairs.append(Pair(*key, path, c_path, doc, c_doc))
            taken.add(key)
        else:
            unpaired.append({"side": "baseline", "suite": key[0], "label": key[1], "path": path})
    unpaired += [{"side": "candidate", "suite": d["suite"], "label": d["label"], "path": p} for p, d in candidate
                 if (d["suite"], d["label"]) not in taken]
    return pairs, unpaired


def env_summary(baseline: dict, candidate: dict) -> dict:
    """The conditions of the two measurements, as recorded (``None`` where a document does not say): load, threads,
    CPU affinity, GPU clocks."""
    out = {"load": [load_text(baseline["env"]), load_text(candidate["env"])]}
    for key in ("threads", "cpu_affinity", "gpu_clocks"):
        out[key] = [baseline["env"].get(key), candidate["env"].get(key)]
    return out


def env_line(summary: dict) -> str:
    """One line of :func:`env_summary` for the console."""
    parts = [f"load {summary['load'][0]} vs {summary['load'][1]}"]
    for key in ("threads", "cpu_affinity"):
        b, c = summary[key]
        if b is not None or c is not None:
            parts.append(f"{key.replace('_', ' ')} {_show(b)} vs {_show(c)}")
    clocks = [(x or {}).get("sm_mhz") for x in summary["gpu_clocks"]]
    if any(v is not None for v in clocks):
        parts.append(f"SM clock now {_show(clocks[0])} vs {_show(clocks[1])} MHz")
    return "; ".join(parts)


# ---- output --------------------------------------------------------------------------------------------
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
        change = "-" if v.change is None else _pct(v.change)
        table.add_row(Text(v.metric), v.kind, Text(_show(v.baseline)), Text(_show(v.candidate)), change,
                      Text(v.status, style=colour.get(v.status, "")), Text(v.reason))
    return table
