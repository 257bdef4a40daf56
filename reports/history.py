"""A history of results to compare builds over time: every result document a suite's ``--db FILE`` is given goes
into one SQLite file (stdlib ``sqlite3``), and ``ninfer-bench compare --db FILE`` shows a metric across commits and
labels (llama-bench's SQLite output and compare script, asv's history). docs/DESIGN.md, "Output formats and
history".

Schema (version :data:`VERSION`, in ``meta``)::

    meta     (key TEXT PRIMARY KEY, value TEXT)       -- schema = ninfer-bench/history, schema_version = 1
    runs     (id INTEGER PRIMARY KEY, created, suite, label, git_sha, model_id, model_name, device, gpu, cpu,
              config JSON, doc JSON, doc_sha256, added,
              UNIQUE (created, label, suite, doc_sha256))  -- the same document twice is one run
    metrics  (run_id -> runs.id, metric, value REAL, text TEXT, samples JSON,
              PRIMARY KEY (run_id, metric))

A metric is named by a metric path (:mod:`.metric_path`), the gate's names: the summary's scalars (``decode_tok_s``;
one level into an object of them: ``plain.speedup``), each concurrency level's (``levels[concurrency=4].
aggregate_tok_s``) and each kernel record's time, speed and check (``records[op=rmsnorm,shape=1x5120,variant=v3,
t=1].us_median``, selectors in the gate's order). A number or a bool (1 / 0) is ``value``; a string, list or object
is ``text`` (JSON): ``tokens_sha256``, ``accepted_per_position``. ``samples`` holds the per-repeat samples where the
document has them - the summary's ``samples.NAME``, or the samples path the gate's default rule gives the metric.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from .gate import default_rules
from .metric_path import (
    STAR,
    MetricMissing,
    format_path,
    instances,
    key_text,
    lookup,
    parse_path,
    root,
    substitute,
)
from .schema import validate
from .stats import rank_test, spread
from .tables import Column, Grid, model_name, styled

NAME = "ninfer-bench/history"
VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS runs (
  id INTEGER PRIMARY KEY,
  created TEXT NOT NULL,
  suite TEXT NOT NULL,
  label TEXT NOT NULL,
  git_sha TEXT,
  model_id TEXT,
  model_name TEXT,
  device TEXT,
  gpu TEXT,
  cpu TEXT,
  config TEXT NOT NULL,
  doc TEXT NOT NULL,
  doc_sha256 TEXT NOT NULL,
  added TEXT NOT NULL,
  UNIQUE (created, label, suite, doc_sha256)
);
CREATE TABLE IF NOT EXISTS metrics (
  run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
  metric TEXT NOT NULL,
  value REAL,
  text TEXT,
  samples TEXT,
  PRIMARY KEY (run_id, metric)
);
CREATE INDEX IF NOT EXISTS metrics_by_name ON metrics(metric);
CREATE INDEX IF NOT EXISTS runs_by_time ON runs(suite, created);
"""
# the metric a suite's history shows when none is asked for
HEADLINE = {"decode": "decode_tok_s", "concurrency": "levels[concurrency=*].aggregate_tok_s",
            "kernels": "records[op=*,shape=*,variant=*,t=*].us_median", "niah": "oracle_agreement",
            "prefill": "prefill_tok_s"}
KERNEL_METRICS = ("us_median", "gbps", "roofline_fraction", "max_rel_err", "ok")


def side_metrics(suite: str) -> list[str]:
    """What two runs are compared on when no metric is named: the gate's timing metrics of the suite (its exact
    ones where it has none)."""
    rules = default_rules(suite)
    return [r.metric for r in rules if r.kind == "timing"] or [r.metric for r in rules]


class HistoryError(ValueError):
    """A file that is not a history database of this build."""


# ---- the database --------------------------------------------------------------------------------------------
def _connect(path: str | Path, *, create: bool) -> sqlite3.Connection:
    """An open history database; ``create``: make the file and its tables when missing."""
    path = Path(path)
    if not create and not path.is_file():
        raise HistoryError(f"no such history database: {path}")
    if path.is_dir():
        raise HistoryError(f"{path} is a folder, not a history database")
    conn = sqlite3.connect(str(path), timeout=30)  # another run adding to it holds the lock for milliseconds
    try:
        conn.execute("PRAGMA foreign_keys = ON")
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables and create:
            with conn:
                conn.executescript(SCHEMA)
                conn.executemany("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)",
                                 [("schema", NAME), ("schema_version", str(VERSION))])
            return conn
        meta = dict(conn.execute("SELECT key, value FROM meta")) if "meta" in tables else {}
        if meta.get("schema") != NAME:
            raise HistoryError(f"{path}: not a ninfer-bench history database (an SQLite file with other tables)")
        if meta.get("schema_version") != str(VERSION):
            raise HistoryError(f"{path}: history schema version {meta.get('schema_version')} is not supported "
                               f"(this build reads {VERSION})")
        return conn
    except sqlite3.DatabaseError as e:
        conn.close()
        raise HistoryError(f"{path}: cannot read it as an SQLite database ({e})") from None
    except BaseException:
        conn.close()
        raise


def check(path: str | Path) -> None:
    """Refuse, before a run, a ``--db`` file that exists and is not a history database of this build."""
    if Path(path).exists():
        _connect(path, create=False).close()


def doc_digest(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":"), default=_jsonable)
                          .encode()).hexdigest()


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def append(path: str | Path, doc: dict) -> tuple[int, bool]:
    """Add a result document (and its metrics) to the history at ``path``, made when missing; returns the run's id
    and whether it is new (the same document again is the run already there)."""
    validate(doc)
    doc = json.loads(json.dumps(doc, default=_jsonable))  # as it would be read back from its file
    digest, env, model = doc_digest(doc), doc["env"], doc["model"]
    conn = _connect(path, create=True)
    try:
        with conn:
            cur = conn.execute(
                "INSERT OR IGNORE INTO runs (created, suite, label, git_sha, model_id, model_name, device, gpu, "
                "cpu, config, doc, doc_sha256, added) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (doc["created"], doc["suite"], doc["label"], env.get("git_sha"), model.get("artifact_id"),
                 model_name(doc), doc["config"].get("device"), env.get("gpu"), env.get("cpu_model") or env.get("cpu"),
                 json.dumps(doc["config"], sort_keys=True), json.dumps(doc), digest,
                 datetime.now(timezone.utc).isoformat(timespec="seconds")))
            if not cur.rowcount:
                (run_id,) = conn.execute("SELECT id FROM runs WHERE created = ? AND label = ? AND suite = ? AND "
                                         "doc_sha256 = ?", (doc["created"], doc["label"], doc["suite"],
                                                            digest)).fetchone()
                return run_id, False
            run_id = cur.lastrowid
            conn.executemany("INSERT INTO metrics (run_id, metric, value, text, samples) VALUES (?, ?, ?, ?, ?)",
                             [(run_id, m, *_stored(v), None if s is None else json.dumps(s))
                              for m, (v, s) in metrics(doc).items()])
        return run_id, True
    except sqlite3.DatabaseError as e:  # locked past the timeout, a full disk...
        raise HistoryError(f"cannot add to {path}: {e}") from None
    finally:
        conn.close()


def _stored(v) -> tuple:
    """(value, text) of a metric: numbers and bools as numbers, anything else as text."""
    if isinstance(v, bool):
        return int(v), None
    if isinstance(v, (int, float)):
        return (v if math.isfinite(v) else None), None
    return None, v if isinstance(v, str) else json.dumps(v, sort_keys=True)


# ---- which metrics a document holds -------------------------------------------------------------------------
def _storable(v) -> bool:
    return isinstance(v, (str, int, float, bool, list)) or (isinstance(v, dict) and bool(v))


def _names(d: dict) -> bool:
    return bool(d) and all(isinstance(k, str) and k.isidentifier() for k in d)


def metrics(doc: dict) -> dict[str, tuple]:
    """The metrics of a result document: metric path -> (value, per-repeat samples or None)."""
    suite, s = doc["suite"], doc["summary"]
    out: dict[str, tuple] = {}

    def put(path, value, samples=None):
        if _storable(value):
            out[path] = (value, samples if isinstance(samples, list) else None)

    for key, v in s.items():
        if key == "samples" or (suite == "concurrency" and key == "levels"):
            continue
        if isinstance(v, dict) and _names(v) and all(not isinstance(x, (dict, list)) for x in v.values()):
            for k2, v2 in v.items():  # decode's plain.decode_tok_s, plain.speedup...
                put(f"{key}.{k2}", v2)
        else:
            put(key, v, (s.get("samples") or {}).get(key))
    if suite == "concurrency":
        for lv in s.get("levels") or []:
            sel = (("concurrency", key_text(lv.get("concurrency"))),)
            for k, v in lv.items():
                if k not in ("concurrency", "samples") and not isinstance(v, dict):
                    put(format_path([("levels", sel), (k, None)]), v, (lv.get("samples") or {}).get(k))
    if suite == "kernels":
        def ident(r):
            return tuple(key_text(r.get(k)) for k in ("op", "shape", "variant", "t"))

        count = Counter(map(ident, doc["records"]))
        for r in doc["records"]:
            if count[ident(r)] != 1:  # two records of one (op, shape, variant, t): no path names either
                continue
            sel = tuple(zip(("op", "shape", "variant", "t"), ident(r)))
            for k in KERNEL_METRICS:
                if r.get(k) is not None:
                    put(format_path([("records", sel), (k, None)]), r[k], r.get("samples_us") if k == "us_median"
                        else None)
    # samples the gate's rules name for a metric (a concurrency level's ttft_ms_p50: its ttft_ms samples)
    start = root(doc)
    for rule in default_rules(suite):
        if not rule.samples:
            continue
        for concrete in instances(start, parse_path(rule.metric)):
            path = format_path(concrete)
            if path in out and out[path][1] is None:
                try:
                    samples = lookup(doc, substitute(rule.samples, concrete))
                except MetricMissing:
                    continue
                out[path] = (out[path][0], samples if isinstance(samples, list) else None)
    return out


# ---- reading it back ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Point:
    """One metric of one run."""

    run_id: int
    created: str
    suite: str
    label: str
    git_sha: str | None
    model: str | None
    device: str | None
    metric: str
    value: float | None
    text: str | None
    samples: list | None

    @property
    def shown(self):
        return self.value if self.text is None else self.text

    @property
    def commit(self) -> str:
        sha = self.git_sha or "-"
        return sha[:8] + ("-dirty" if sha.endswith("-dirty") else "")


_parsed = lru_cache(maxsize=1 << 16)(parse_path)


def matches(pattern: str, metric: str) -> bool:
    """Whether a stored metric path is one ``pattern`` names: the same names, selectors whose every key=value of the
    pattern's the metric's has (``*``: any value; keys the pattern leaves out: any)."""
    pat, segs = _parsed(pattern), _parsed(metric)
    if len(pat) != len(segs):
        return False
    for (pn, ps), (mn, ms) in zip(pat, segs):
        if pn != mn:
            return False
        if ps is None or isinstance(ps, int):
            if ps != ms:
                return False
            continue
        have = dict(ms) if isinstance(ms, tuple) else {}
        if any(k not in have or (v is not STAR and have[k] != v) for k, v in ps):
            return False
    return True


def suites(path: str | Path) -> list[str]:
    conn = _connect(path, create=False)
    try:
        return [r[0] for r in conn.execute("SELECT DISTINCT suite FROM runs ORDER BY suite")]
    finally:
        conn.close()


def metric_names(path: str | Path, suite: str | None = None) -> list[str]:
    """The metrics stored for a suite's runs (all suites: None), sorted."""
    conn = _connect(path, create=False)
    try:
        sql = "SELECT DISTINCT metric FROM metrics JOIN runs ON runs.id = run_id"
        rows = conn.execute(sql + (" WHERE suite = ?" if suite else "") + " ORDER BY metric",
                            (suite,) if suite else ())
        return [r[0] for r in rows]
    finally:
        conn.close()


def query(path: str | Path, patterns, *, suite: str | None = None, labels=(), commits=(),
          last: int | None = None) -> list[Point]:
    """The points of the metrics ``patterns`` name (metric paths; ``*`` selects any value) in the runs of ``suite``
    whose label is one of ``labels`` and whose git sha starts with one of ``commits`` (empty: any), of the last
    ``last`` of those runs by time; ordered by run time."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    for p in patterns:
        parse_path(p)  # a malformed path is an error, not an empty answer
    where, args = [], []
    if suite:
        where.append("suite = ?")
        args.append(suite)
    if labels:
        where.append(f"label IN ({', '.join('?' * len(labels))})")
        args += list(labels)
    if commits:
        where.append("(" + " OR ".join("git_sha LIKE ? ESCAPE '\\'" for _ in commits) + ")")
        args += [c.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%" for c in commits]
    conn = _connect(path, create=False)
    try:
        runs = conn.execute("SELECT id, created, suite, label, git_sha, model_name, device FROM runs"
                            + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY created, id",
                            args).fetchall()
        if last:
            runs = runs[-last:]
        by_id = {r[0]: r for r in runs}
        # narrowed in SQL by each pattern's last name (``*.us_median``; names are identifiers: no GLOB characters)
        lasts = [parse_path(p)[-1] for p in patterns]
        narrow = "" if any(sel is not None for _, sel in lasts) else \
            " WHERE " + " OR ".join("metric = ? OR metric GLOB ?" for _ in lasts)
        points = []
        for run_id, metric, value, text, samples in conn.execute(
                "SELECT run_id, metric, value, text, samples FROM metrics" + narrow + " ORDER BY run_id, metric",
                [x for name, _ in (lasts if narrow else []) for x in (name, "*." + name)]):
            run = by_id.get(run_id)
            if run is None or not any(matches(p, metric) for p in patterns):
                continue
            points.append(Point(run_id, run[1], run[2], run[3], run[4], run[5], run[6], metric, value, text,
                                None if samples is None else json.loads(samples)))
    finally:
        conn.close()
    order = {r[0]: i for i, r in enumerate(runs)}

    def first_pattern(metric):
        return next(i for i, p in enumerate(patterns) if matches(p, metric))

    return sorted(points, key=lambda p: (order[p.run_id], first_pattern(p.metric), p.metric))


# ---- the compare tables -------------------------------------------------------------------------------------------
def higher_is_better(suite: str, metric: str) -> bool | None:
    """Which way a metric improves: the gate's rule for it, else its name (tok/s, GB/s, rates up; ms, us, bytes,
    seconds down); None when neither says."""
    for rule in default_rules(suite) if suite in HEADLINE else []:
        if rule.kind == "timing" and matches(rule.metric, metric):
            return rule.higher_is_better
    name = parse_path(metric)[-1][0]
    if any(w in name for w in ("tok_s", "gbps", "speedup", "rate", "agreement", "retrieval", "fraction",
                               "tokens_per_round")):
        return True
    if any(w in name for w in ("_ms", "ms_", "us_", "bytes", "seconds")) or name.endswith(("_us", "_s")):
        return False
    return None


def num(v) -> str:
    """A value as a compare table shows it: 4 significant digits or so, thousands separated."""
    if v is None:
        return "-"
    if isinstance(v, str):
        return v[:16]
    if float(v).is_integer() and abs(v) < 1e15:
        return f"{int(v):,}"
    a = abs(v)
    return f"{v:,.0f}" if a >= 1000 else f"{v:.2f}" if a >= 10 else f"{v:.3f}" if a >= 0.01 else f"{v:.3e}"


def _change(p: Point, ref: Point | None):
    if ref is None or p is ref:
        return None
    if p.text is not None or ref.text is not None:
        return "same" if p.shown == ref.shown else "changed"
    if p.value is None or ref.value is None or ref.value == 0:
        return None
    return p.value / ref.value - 1


def _change_cell(key: str):
    def text(r):
        c = r.get(key)
        if c is None:
            return "-"
        if isinstance(c, str):
            return styled(c, "yellow") if c == "changed" else c
        better = higher_is_better(r["suite"], r["metric"])
        style = "" if better is None or abs(c) < 0.005 else "green" if (c > 0) == better else "red"
        return styled(f"{c:+.1%}", style)
    return text


def series_grid(points: list[Point]) -> Grid:
    """A metric per run ordered by time (``points`` are, :func:`query`), metric by metric: the value (± the sample
    standard deviation of its repeats, where stored), its change against the previous and the first run of the same
    label - a label is one experiment, followed over commits (llama-bench's compare script, asv's history)."""
    by_metric: dict[str, list[Point]] = {}
    for p in points:
        by_metric.setdefault(p.metric, []).append(p)
    rows = []
    for metric, series in by_metric.items():
        seen: dict[str, list[Point]] = {}  # label -> its runs so far
        for p in series:
            before = seen.setdefault(p.label, [])
            sp = spread(p.samples)
            rows.append({"metric": metric, "suite": p.suite, "label": p.label, "git_sha": p.git_sha,
                         "commit": p.commit, "created": p.created, "run_id": p.run_id, "model": p.model,
                         "device": p.device, "value": p.shown, "sd": sp.stdev, "n": sp.n or None,
                         "change_vs_previous": _change(p, before[-1] if before else None),
                         "change_vs_first": _change(p, before[0] if before else None)})
            before.append(p)
    many = len({r["metric"] for r in rows}) > 1
    R = "right"
    cols = ([Column("metric", lambda r: r["metric"])] if many else []) + [
        Column("commit", lambda r: r["commit"]), Column("label", lambda r: r["label"]),
        Column("created", lambda r: (r["created"] or "")[:19].replace("T", " ")), Column("value", lambda r: num(r["value"]), R),
        Column("± sd", lambda r: "-" if r["sd"] is None else f"{num(r['sd'])} (n={r['n']})", R),
        Column("vs previous", _change_cell("change_vs_previous"), R),
        Column("vs first", _change_cell("change_vs_first"), R)]
    metric = "several metrics" if many else rows[0]["metric"] if rows else "nothing"
    return Grid("compare", f"history: {metric}, {len({r['run_id'] for r in rows})} runs", cols, rows)


def side_by_side_grid(points: list[Point], by: str, a: str, b: str) -> Grid:
    """Two labels (``by="label"``) or two commits (``by="commit"``: git sha prefixes) side by side, metric by
    metric (two commits: also label by label), each side's latest run; ``speedup``: how many times better B is
    than A (B / A where higher is better, A / B where lower is), as llama-bench's compare script; ``p`` the rank
    test of their repeats (where both stored at least 3)."""
    def side(p: Point):
        if by == "label":
            return "a" if p.label == a else "b" if p.label == b else None
        sha = p.git_sha or ""
        return "a" if sha.startswith(a) else "b" if sha.startswith(b) else None

    latest: dict[tuple, Point] = {}
    for p in points:  # in time order: the last one stays
        s = side(p)
        if s:
            latest[(p.metric if by == "label" else (p.label, p.metric), s)] = p
    keys = list(dict.fromkeys(k for k, _ in latest))
    rows = []
    for k in keys:
        pa, pb = latest.get((k, "a")), latest.get((k, "b"))
        any_p = pa or pb
        row = {"label": any_p.label} if by == "commit" else {}
        row.update({"metric": any_p.metric, "a": a, "b": b, "value_a": pa.shown if pa else None,
                    "value_b": pb.shown if pb else None, "run_a": pa.run_id if pa else None,
                    "run_b": pb.run_id if pb else None, "speedup": None, "ratio": None, "p": None, "same": None})
        if pa and pb and (pa.text is not None or pb.text is not None):
            row["same"] = pa.shown == pb.shown
        elif pa and pb and pa.value and pb.value:
            better = higher_is_better(any_p.suite, any_p.metric)
            row["ratio"] = pb.value / pa.value
            row["speedup"] = None if better is None else row["ratio"] if better else 1 / row["ratio"]
            shift = rank_test(pa.samples, pb.samples)
            row["p"] = None if shift.powerless else shift.p
        rows.append(row)

    def speed(r):
        if r.get("same") is not None:
            return "same" if r["same"] else styled("changed", "yellow")
        if r["speedup"] is None:
            return "-" if r.get("ratio") is None else f"({r['ratio']:.2f})"
        return styled(f"{r['speedup']:.2f}x", "" if abs(r["speedup"] - 1) < 0.005
                      else "green" if r["speedup"] > 1 else "red")

    R = "right"
    cols = ([Column("label", lambda r: r["label"])] if by == "commit" else []) + [
        Column("metric", lambda r: r["metric"]), Column(a, lambda r: num(r["value_a"]), R),
        Column(b, lambda r: num(r["value_b"]), R), Column("speedup", speed, R),
        Column("p", lambda r: "-" if r["p"] is None else f"{r['p']:.3f}", R)]
    return Grid("compare", f"{a} vs {b} (each one's latest run)", cols, rows,
                caption=f"speedup: how many times better {b} is than {a} (higher tok/s, lower ms); (ratio {b} / {a}) "
                        "where a metric has no better direction; p: rank test of the repeats")
