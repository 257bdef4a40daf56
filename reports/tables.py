"""The suites' tables, defined once and shown in any output format ``-o`` takes (docs/DESIGN.md, "Output formats
and history").

A :class:`Grid` is a title, rows and columns. A row is a dict of raw values (field -> number, text, bool, list,
None): every field the data formats carry. A column is what the console shows: a header and the text of a cell,
made from a row. The formats:

* ``table``: the rich console table (``md``: the same cells as a GitHub pipe table), for people;
* ``csv``, ``json`` (one array), ``jsonl`` (an object a line) and ``sql`` (``CREATE TABLE IF NOT EXISTS`` and one
  ``INSERT`` a row, as llama-bench's ``-o sql``: ``ninfer-bench decode -o sql | sqlite3 runs.db``): the rows' fields,
  for programs. Lists are JSON text in csv and sql; a NaN or an infinity is null.

Each row starts with where its run happened (:func:`run_context`: suite, label, created, git sha, model, device,
GPU), so rows of many runs can be poured into one file or table. The suites' grids: :func:`decode_grid` (one run)
and :func:`decode_runs_grid` (a row a run; their console tables are ``cli.suites``' decode_table and compare_table),
:func:`concurrency_grid` (a row per level; an open-loop run: :func:`open_loop_grid`, vllm bench serve's summary),
:func:`kernels_grid` (a row per record), :func:`niah_grid` (a row per case).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from rich.text import Text

FORMATS = ("table", "md", "csv", "json", "jsonl", "sql")


# ---- grids and their formats --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """A console column: ``header``, and ``text(row)`` the cell (a ``str`` shown as it is, or a styled rich
    ``Text``)."""

    header: str
    text: Callable[[dict], str | Text]
    justify: str = "left"


@dataclass
class Grid:
    """A table: ``name`` (its SQL table), ``title``, ``columns`` (what the console shows), ``rows`` (every field of
    the data formats); ``rich``: a console table built elsewhere, shown (and made Markdown) instead of columns."""

    name: str
    title: str
    columns: list[Column]
    rows: list[dict]
    caption: str | None = None
    rich: object = None  # a rich Table built elsewhere that ``table`` and ``md`` show instead of ``columns``


def fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def cell(grid_row: dict, col: Column) -> Text:
    out = col.text(grid_row)
    return out if isinstance(out, Text) else Text(str(out))


def styled(text: str, style: str) -> Text:
    return Text(text, style=style)


def to_rich(grid: Grid):
    """The rich console table."""
    from rich.table import Table

    if grid.rich is not None:
        return grid.rich
    table = Table(title=Text(grid.title), caption=Text(grid.caption) if grid.caption else None)
    for col in grid.columns:
        # a header is text ("[p10-p90]" is no markup); a long word (a metric path) folds rather than being cut
        table.add_column(Text(col.header), justify=col.justify, overflow="fold")
    for row in grid.rows:
        table.add_row(*(cell(row, col) for col in grid.columns))
    return table


def render(grid: Grid, fmt_: str) -> str:
    """``grid`` as text in one of :data:`FORMATS` (``table``: the console table as plain text)."""
    if fmt_ == "table":
        from rich.console import Console

        console = Console(width=200, record=True, file=io.StringIO())
        console.print(to_rich(grid))
        return console.export_text()
    if fmt_ == "md":
        return markdown(grid)
    if fmt_ == "csv":
        return to_csv(grid)
    if fmt_ == "json":
        return json.dumps(data_rows(grid), indent=1) + "\n"
    if fmt_ == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in data_rows(grid))
    if fmt_ == "sql":
        return to_sql(grid)
    raise ValueError(f"unknown output format {fmt_!r} (one of {', '.join(FORMATS)})")


def markdown(grid: Grid) -> str:
    """A GitHub pipe table of the console's cells (no columns and no console table: the rows' fields)."""
    if grid.rich is not None:
        header = [_cell_text(c.header) for c in grid.rich.columns]
        aligns = [c.justify for c in grid.rich.columns]
        cols = [[_cell_text(x) for x in c.cells] for c in grid.rich.columns]
        body = [list(r) for r in zip(*cols)]
    elif grid.columns:
        header, aligns = [c.header for c in grid.columns], [c.justify for c in grid.columns]
        body = [[cell(row, col).plain for col in grid.columns] for row in grid.rows]
    else:
        header = data_fields(grid)
        aligns = ["left"] * len(header)
        body = [[_text(r[k]) for k in header] for r in data_rows(grid)]
    rule = {"left": "---", "right": "---:", "center": ":---:"}

    def line(cells):
        return "| " + " | ".join(c.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return "\n".join([line(header), "|" + "|".join(rule.get(a, "---") for a in aligns) + "|",
                      *(line(r) for r in body)]) + "\n"


def _cell_text(x) -> str:
    """The plain text of a rich table's cell (markup strings read as rich reads them)."""
    if isinstance(x, Text):
        return x.plain
    if isinstance(x, str):
        return Text.from_markup(x).plain
    return str(x)


def _plain(v):
    """A JSON-able value: numpy scalars and arrays as Python ones, tuples as lists, NaN and infinities as None."""
    if hasattr(v, "tolist") and not isinstance(v, (list, tuple, dict, str)):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


def data_fields(grid: Grid) -> list[str]:
    """The data formats' fields: every field of the rows, in the order first seen."""
    return list(dict.fromkeys(k for r in grid.rows for k in r))


def data_rows(grid: Grid) -> list[dict]:
    keys = data_fields(grid)
    return [{k: _plain(r.get(k)) for k in keys} for r in grid.rows]


def _text(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


def to_csv(grid: Grid) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    keys = data_fields(grid)
    writer.writerow(keys)
    for r in data_rows(grid):
        writer.writerow([_text(r[k]) for k in keys])
    return out.getvalue()


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _sql_type(values) -> str:
    """The column type of a field's values: INTEGER, REAL or TEXT; none when every value is null (SQLite then
    stores whatever later rows bring, unconverted)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return ""
    if all(isinstance(v, (bool, int)) for v in vals):
        return "INTEGER"
    if all(isinstance(v, (bool, int, float)) for v in vals):
        return "REAL"
    return "TEXT"


def _sql_value(v) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, (int, float)):
        return repr(v)
    return "'" + _text(v).replace("'", "''") + "'"


def to_sql(grid: Grid) -> str:
    """``CREATE TABLE IF NOT EXISTS`` the grid's table and one ``INSERT`` a row (SQLite's dialect)."""
    keys = data_fields(grid)
    rows = data_rows(grid)
    cols = ",\n".join(f"  {_ident(k)} {_sql_type(r[k] for r in rows)}".rstrip() for k in keys)
    lines = [f"CREATE TABLE IF NOT EXISTS {_ident(grid.name)} (\n{cols}\n);"]
    names = ", ".join(map(_ident, keys))
    lines += [f"INSERT INTO {_ident(grid.name)} ({names}) VALUES ({', '.join(_sql_value(r[k]) for k in keys)});"
              for r in rows]
    return "\n".join(lines) + "\n"


# ---- the rows of a result document --------------------------------------------------------------------------
def model_name(doc: dict) -> str | None:
    """A short name of a run's model: its artifact's model id, else its preset, else its path's file name, else the
    model a --url run asked the server for."""
    m = doc.get("model") or {}
    name = m.get("model_id") or m.get("preset") or m.get("path") or m.get("served_model") \
        or (doc.get("config") or {}).get("model")
    return str(name).rstrip("/").rsplit("/", 1)[-1] if name else None


def run_context(doc: dict) -> dict:
    """The fields every row of a run starts with: where and when it ran."""
    env, config = doc.get("env") or {}, doc.get("config") or {}
    return {"suite": doc.get("suite"), "label": doc.get("label"), "created": doc.get("created"),
            "git_sha": env.get("git_sha"), "model": model_name(doc), "device": config.get("device"),
            "gpu": env.get("gpu"), "cpu": env.get("cpu_model") or env.get("cpu")}


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _col(header: str, key: str, spec: str = ".2f", justify: str = "left") -> Column:
    return Column(header, lambda r: fmt(r.get(key), spec), justify)


def _pair(header: str, a: str, b: str, spec: str) -> Column:
    return Column(header, lambda r: f"{fmt(r.get(a), spec)} / {fmt(r.get(b), spec)}")


# ---- decode ---------------------------------------------------------------------------------------------------
# decode's console tables are cli.suites.decode_table / compare_table: a decode grid carries one as ``rich``
DECODE_CONFIG = ("engine", "runtime", "spec", "draft_tokens", "rollback", "lm_head_draft", "dtype", "kv_dtype",
                 "max_new_tokens", "repeats")


def decode_row(doc: dict) -> dict:
    """One decode run's fields: its settings and its summary's values; each timing with per-repeat samples as the
    median of the repeats with their sample standard deviation (``_sd``) and count (``_n``), as llama-bench gives
    ``avg_ts`` and ``stddev_ts``; the plain partner's as ``plain_...``."""
    from .stats import spread  # (numpy: not on the command line's start-up path)

    s, c = doc["summary"], doc.get("config") or {}
    row = run_context(doc)
    row.update({k: c.get(k) for k in DECODE_CONFIG})
    samples = s.get("samples") or {}
    for key, v in s.items():
        if key == "samples":
            continue
        if isinstance(v, dict):  # the plain partner's numbers
            row.update({f"{key}_{k}": x for k, x in v.items() if _scalar(x)})
            continue
        row[key] = v
        if samples.get(key):
            sp = spread(samples[key])
            row.update({f"{key}_sd": sp.stdev, f"{key}_n": sp.n})
    if c.get("replay_profile"):
        row["replay_profile"] = list(c["replay_profile"])
    return row


def decode_grid(doc: dict, console=None) -> Grid:
    """One decode result: its row; ``console`` the rich table that ``table`` and ``md`` show."""
    c, env = doc.get("config") or {}, doc.get("env") or {}
    return Grid("decode", f"decode: {doc['label']} on {c.get('device')} ({env.get('gpu') or 'cpu'})", [],
                [decode_row(doc)], rich=console)


def decode_runs_grid(docs: list[dict], same: dict[str, bool | None], console=None) -> Grid:
    """Several decode results, a row each, with the speed as a ratio to the first run's (``speedup_vs_first``) and
    whether a speculative run decoded the plain run's tokens (``equals_plain``: ``same``,
    suites.decode.plain_agreement of ``docs``); ``console`` the rich table that ``table`` and ``md`` show."""
    first = docs[0]["summary"]["decode_tok_s"]
    rows = []
    for d in docs:
        row = decode_row(d)
        tok_s = row.get("decode_tok_s")
        row.update(speedup_vs_first=tok_s / first if first and tok_s else None, equals_plain=same.get(d["label"]))
        rows.append(row)
    return Grid("decode", f"decode: {len(docs)} runs", [], rows, rich=console)


# ---- concurrency, kernels, niah -----------------------------------------------------------------------------------
CONCURRENCY_CONFIG = ("spec", "draft_tokens", "kv_dtype", "runtime", "max_concurrency", "max_new_tokens",
                      "prompt_tokens", "rounds")


def concurrency_grid(doc: dict) -> Grid:
    """One concurrency result, a row per level; the caption defines the two throughput columns."""
    c = doc.get("config") or {}
    base = {**run_context(doc), **{k: c.get(k) for k in CONCURRENCY_CONFIG}}
    rows = [{**base, **{k: v for k, v in lv.items() if _scalar(v)}} for lv in doc["summary"]["levels"]]
    engine = ", ".join(f"{k} {c[k]}" for k in ("device", "spec", "draft_tokens", "kv_dtype", "runtime",
                                                "max_concurrency") if c.get(k) is not None)
    cols = [Column("C", lambda r: str(r["concurrency"])), _col("agg tok/s", "aggregate_tok_s", ".1f"),
            _col("steady tok/s", "steady_tok_s", ".1f"), _col("req tok/s", "per_request_tok_s", ".1f"),
            _pair("TTFT p50/p99 ms", "ttft_ms_p50", "ttft_ms_p99", ".1f"),
            _pair("TPOT p50/p99 ms", "tpot_ms_p50", "tpot_ms_p99", ".2f"),
            _pair("ITL p50/p99 ms", "itl_ms_p50", "itl_ms_p99", ".2f"), _col("e2e p50 ms", "e2e_ms_p50", ".0f"),
            Column("= sequential", lambda r: Text("-") if r["matches_sequential"] is None  # (open loop: not run)
                   else styled("yes", "green") if r["matches_sequential"] else styled("NO", "red"))]
    return Grid("concurrency", f"concurrency: {doc['label']} ({engine})", cols, rows,
                caption="agg tok/s: output tokens / round wall time (first request sent to last one finished, "
                        "queueing and prefill included), the same at every level; steady tok/s: while every "
                        "client decodes at once (-: never, e.g. more clients than slots)")


OPEN_LOOP_CONFIG = ("request_rate", "burstiness", "num_prompts", "client_max_concurrency", "seed", "dataset",
                    "max_new_tokens", "prompt_tokens", "rounds", "max_concurrency", "spec", "url")
OPEN_LOOP_LATENCIES = (("ttft_ms", "TTFT", "Time to First Token"),
                       ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "ITL", "Inter-token Latency"), ("e2e_ms", "E2EL", "End-to-end Latency"))


def open_loop_grid(doc: dict) -> Grid:
    """An open-loop concurrency result (``config.request_rate`` set): one row (the run's settings, and its level's
    scalars), shown as vllm bench serve's summary: counts, throughputs, goodput, then mean, median, std and the
    chosen percentiles of TTFT, TPOT, ITL and end-to-end latency (ms)."""
    from rich.table import Table

    c, lv = doc.get("config") or {}, doc["summary"]["levels"][0]
    row = {**run_context(doc), **{k: c.get(k) for k in OPEN_LOOP_CONFIG},
           **{k: v for k, v in lv.items() if _scalar(v)}}
    rate = c.get("request_rate")
    rounds = c.get("rounds") or 1
    per = f" (median of {rounds} rounds)" if rounds > 1 else ""
    slos = c.get("goodput") or {}
    table = Table(title=Text(f"serving benchmark: {doc['label']} (open loop)"), show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    cap = c.get("client_max_concurrency")
    lines = [("Successful requests", str(lv["completed"])), ("Failed requests", str(lv["failed"])),
             ("Request rate configured (RPS)", "inf" if rate == "inf" else fmt(rate)),
             ("Burstiness factor", f"{c.get('burstiness'):g}" + (" (Poisson process)" if c.get("burstiness") == 1
                                                                else "")),
             ("Maximum request concurrency", "-" if cap is None else str(cap)),
             (f"Benchmark duration (s){per}", fmt(lv["duration_s"])),
             ("Total input tokens", str(lv["total_input_tokens"])),
             ("Total generated tokens", str(lv["total_output_tokens"])),
             (f"Request throughput (req/s){per}", fmt(lv["request_throughput"]))]
    if slos:
        bounds = ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items())
        lines += [(f"Request goodput (req/s){per}", fmt(lv["goodput"])),
                  ("Good requests (SLOs)", f"{lv['good_requests']} ({bounds})")]
    lines += [(f"Output token throughput (tok/s){per}", fmt(lv["output_throughput"])),
              ("Peak concurrent requests", str(lv["peak_in_flight"])),
              (f"Total token throughput (tok/s){per}", fmt(lv["total_token_throughput"]))]
    for k, v in lines:
        table.add_row(k, v)
    qs = lv.get("percentiles") or [50, 90, 99]
    for key, short, title in OPEN_LOOP_LATENCIES:
        table.add_section()
        table.add_row(Text(title, style="bold"), "")
        stats = [("Mean", f"{key}_mean"), ("Median", f"{key}_median"), ("Std", f"{key}_std")]
        stats += [(f"P{q:g}", f"{key}_p" + f"{q:g}".replace(".", "_")) for q in qs]
        for name, k in stats:
            table.add_row(f"{name} {short} (ms)", fmt(lv.get(k)))
    return Grid("concurrency_open_loop", f"serving benchmark: {doc['label']} (open loop)", [], [row], rich=table)


def kernels_grid(doc: dict) -> Grid:
    """One kernels result, a row per record (op, shape, tokens, variant): microseconds (median [p10-p90]), GB/s,
    percent of the copy bandwidth, a v3 projection's time a launch and share of the copy bandwidth in a chain of
    launches (where measured), the error against the fp32 reference and its check."""
    s, base = doc["summary"], run_context(doc)
    rows = []
    for r in doc["records"]:  # a shape as a metric path's selector writes it: 1x5120
        rows.append({**base, **{k: ("x".join(map(str, v or [])) or None) if k == "shape" else v
                                for k, v in r.items() if k == "shape" or _scalar(v)}})

    def us(r):
        return f"{fmt(r.get('us_median'), '.1f')} [{fmt(r.get('us_p10'), '.1f')}-{fmt(r.get('us_p90'), '.1f')}]"

    R = "right"
    cols = [Column("op", lambda r: r["op"]), Column("shape", lambda r: r.get("shape") or ""),
            Column("t", lambda r: str(r["t"]), R), Column("variant", lambda r: r["variant"]),
            Column("us [p10-p90]", us, R), _col("GB/s", "gbps", ".1f", R),
            Column("% roofline", lambda r: fmt(None if r.get("roofline_fraction") is None
                                               else 100 * r["roofline_fraction"], ".1f"), R),
            _col("max rel err", "max_rel_err", ".1e", R),
            Column("ok", lambda r: styled("ok", "green") if r.get("ok") else styled("FAIL", "red"), R)]
    if any(r.get("chain_fraction") is not None for r in rows):  # v3 projections also timed in a chain of launches
        cols[7:7] = [Column("chain us (n)", lambda r: "" if r.get("chain_us") is None else
                            f"{r['chain_us']:.1f} ({r['chain_launches']})", R),
                     Column("% chain", lambda r: fmt(None if r.get("chain_fraction") is None
                                                     else 100 * r["chain_fraction"], ".1f"), R)]
    return Grid("kernels", f"kernels: {doc['label']} on {s.get('gpu') or s.get('device')} "
                           f"({(doc.get('config') or {}).get('dtype')}, timer {s.get('timer')})", cols, rows)


def timeline_grid(doc: dict, top: int = 25) -> Grid:
    """A kernels result's decode-step timeline (``summary.timeline``), a row per kernel (CUDA) or torch op (CPU),
    largest own time first (the first ``top``): own and recorded microseconds and calls a step, and the own time's
    share of the step's wall time (suites/step_timeline.py: spans overlap under programmatic dependent launch)."""
    tl, base = doc["summary"]["timeline"], run_context(doc)
    rows = [{**base, **k} for k in tl["kernels"][:top]]
    R = "right"
    cols = [Column("kernel" if tl["device"].startswith("cuda") else "op", lambda r: r["name"][:90]),
            Column("own us/step", lambda r: fmt(r.get("own_us_per_step", r["us_per_step"]), ".1f"), R),
            _col("span us/step", "us_per_step", ".1f", R), _col("calls/step", "calls_per_step", ".1f", R),
            Column("% of step", lambda r: fmt(100 * r["share_of_step"], ".1f"), R)]
    return Grid("timeline", f"decode step timeline: {doc['label']} ({tl['source']}; {tl['steps']} steps after a "
                            f"{tl['prompt_len']}-token prompt, {tl['step_wall_us']:.1f} us a step, busy "
                            f"{100 * tl['busy_us'] / tl['step_wall_us']:.1f} %)", cols, rows)


def niah_grid(doc: dict) -> Grid:
    """One niah result, a row per case: its prompt length, its TTFT, prefill speed and prefill MFU (model FLOP/s
    over the run's measured matmul throughput), whether the needle was retrieved, the oracle's verdict and where the
    tokens first diverged from it."""
    s, base = doc["summary"], run_context(doc)
    rows = [{**base, **{k: v for k, v in r.items() if _scalar(v)}} for r in doc["records"]]

    def verdict(r):
        return Text("-") if r.get("pass") is None else styled("pass", "green") if r["pass"] else styled("FAIL", "red")

    cols = [Column("case", lambda r: r["case"]), Column("tokens", lambda r: str(r.get("prompt_tokens"))),
            Column("TTFT ms", lambda r: "-" if r.get("ttft_ms") is None else f"{r['ttft_ms']:,.0f}"),
            Column("prefill tok/s", lambda r: "-" if r.get("prefill_tok_s") is None else f"{r['prefill_tok_s']:,.0f}"),
            Column("MFU", lambda r: "-" if r.get("prefill_tflops") is None or not s.get("matmul_tflops")
                   else f"{r['prefill_tflops'] / s['matmul_tflops']:.3f}"),
            Column("retrieved", lambda r: "yes" if r.get("retrieved") else "no"), Column("oracle", verdict),
            Column("first divergence", lambda r: "-" if r.get("first_divergence") is None
                   else str(r["first_divergence"])),
            Column("answer", lambda r: repr((r.get("answer") or "")[:24]))]
    return Grid("niah", f"niah: {doc['label']} ({s['cases']} cases, {s.get('seconds') or 0:.1f} s)", cols, rows)
