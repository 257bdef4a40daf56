"""Output formats (-o md|csv|json|jsonl|sql) and the results history (--db, ``ninfer-bench compare``): every format
parses back to the rows' fields, the history keeps a result once and names its metrics as the gate does, and compare
shows a metric across runs in time order with its change."""

import csv
import io
import json
import math
import sqlite3
import statistics

import pytest
from click.testing import CliRunner
from ninfer_bench.cli import main
from ninfer_bench.reports import history
from ninfer_bench.reports.gate import default_rules
from ninfer_bench.reports.metric_path import (
    format_path,
    instances,
    lookup,
    parse_path,
    root,
    substitute,
)
from ninfer_bench.reports.schema import make_result
from ninfer_bench.reports.tables import (
    FORMATS,
    concurrency_grid,
    decode_grid,
    kernels_grid,
    render,
)

ENV = {"git_sha": "a" * 40, "gpu": "NVIDIA H200", "python": "3.11", "cpu": "x86_64"}
MODEL = {"artifact_id": "5f3c", "model_id": "qwen-test"}
ODD = "it's a | \"label\", with commas"


def decode_doc(label="v3-none", tok_s=(99.0, 100.0, 101.0), *, sha="a" * 40, created=None, tokens="ab" * 32):
    tok_s = list(tok_s)
    summary = {"prompt_tokens": 500, "completion_tokens": 128, "tokens_sha256": tokens, "prefill_tok_s": 4000.0,
               "decode_tok_s": statistics.median(tok_s), "ttft_ms": 20.0, "device_ms_per_round": 1e3 / tok_s[0],
               "rounds": 128, "drafted_tokens": 0, "accepted_tokens": 0, "acceptance_rate": None,
               "tokens_per_round": 1.0, "accepted_per_position": [], "peak_memory_bytes": 1 << 30,
               "deterministic": True, "roofline_fraction": float("nan"),
               "samples": {"decode_tok_s": tok_s, "prefill_tok_s": [4000.0] * len(tok_s),
                           "ttft_ms": [20.0] * len(tok_s)}}
    doc = make_result("decode", label=label, config={"engine": "ours", "runtime": "v3", "spec": "none",
                                                     "device": "cuda:0", "repeats": len(tok_s)},
                      records=[], summary=summary, model=MODEL, env={**ENV, "git_sha": sha})
    if created:
        doc["created"] = created
    return doc


def concurrency_doc(label="c", scale=1.0):
    levels = []
    for c in (1, 4):
        agg = [60.0 * c * scale + i for i in range(3)]
        levels.append({"concurrency": c, "aggregate_tok_s": statistics.median(agg), "per_request_tok_s": 60.0,
                       "ttft_ms_p50": 30.0 * c, "ttft_ms_p99": 40.0 * c, "itl_ms_p50": 12.0, "itl_ms_p99": 15.0,
                       "e2e_ms_p50": 1600.0, "matches_sequential": True,
                       "samples": {"aggregate_tok_s": agg, "ttft_ms": [30.0 * c + i for i in range(3)],
                                   "itl_ms": [12.0, 12.1, 12.2]}})
    return make_result("concurrency", label=label, config={"device": "cuda:0", "max_new_tokens": 128},
                       records=[], summary={"levels": levels}, model=MODEL, env=ENV)


def kernels_doc(label="k", speed=1.0):
    recs = []
    for op, shape in (("rmsnorm", [1, 5120]), ("attn.o", [1, 48, 128])):  # a '.' in a selector value is quoted
        for variant, us in (("ref", 40.0), ("v3", 10.0 / speed)):
            samples = [us * (1 + 0.01 * i) for i in range(5)]
            recs.append({"op": op, "shape": shape, "variant": variant, "t": 1, "us_median": statistics.median(samples),
                         "us_p10": samples[0], "us_p90": samples[-1], "samples_us": samples, "bytes": 1 << 20,
                         "gbps": 100.0, "roofline_fraction": 0.3, "max_rel_err": 1e-3, "ok": True, "note": ""})
    return make_result("kernels", label=label, config={"device": "cuda:0", "dtype": "bf16"}, records=recs, env=ENV,
                       summary={"ops": 2, "copy_bandwidth_gbps": 4300.0, "timer": "cuda-events", "checks": 4,
                                "failures": [], "gpu": "NVIDIA H200", "device": "cuda:0"})


# ---- output formats -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("grid", [concurrency_grid(concurrency_doc(ODD)), kernels_grid(kernels_doc()),
                                  decode_grid(decode_doc(ODD))], ids=["concurrency", "kernels", "decode"])
def test_every_output_format_parses_back(grid, tmp_path):
    rows = grid.rows
    keys = list(dict.fromkeys(k for r in rows for k in r))

    parsed = list(csv.DictReader(io.StringIO(render(grid, "csv"))))
    assert [list(r) for r in parsed] == [keys] * len(rows)
    assert [r["label"] for r in parsed] == [r["label"] for r in rows]
    for got, want in zip(parsed, rows):
        for k in ("aggregate_tok_s", "us_median", "decode_tok_s"):
            if k in want:
                assert float(got[k]) == pytest.approx(want[k])

    as_json = json.loads(render(grid, "json"))
    lines = [json.loads(line) for line in render(grid, "jsonl").splitlines()]
    assert as_json == lines and len(lines) == len(rows) and list(lines[0]) == keys
    assert lines[0]["label"] == rows[0]["label"]
    if isinstance(rows[0].get("roofline_fraction"), float) and math.isnan(rows[0]["roofline_fraction"]):
        assert lines[0]["roofline_fraction"] is None  # NaN: null, and the JSON stays valid

    db = sqlite3.connect(tmp_path / "out.db")
    db.executescript(render(grid, "sql"))
    db.executescript(render(grid, "sql"))  # CREATE TABLE IF NOT EXISTS: a second run's output appends
    cur = db.execute(f'SELECT * FROM "{grid.name}"')
    names = [d[0] for d in cur.description]
    got = [dict(zip(names, r)) for r in cur.fetchall()]
    assert names == keys and len(got) == 2 * len(rows)
    assert [g["label"] for g in got[:len(rows)]] == [r["label"] for r in rows]

    md = render(grid, "md").splitlines()
    assert md[0].startswith("| ") and md[0].endswith(" |")
    assert set(md[1]) <= set("|-: ") and md[1].count("|") == md[0].count("|") - md[0].count("\\|")
    assert len(md) >= 3


def test_markdown_shows_the_console_cells():
    md = render(concurrency_grid(concurrency_doc()), "md")
    assert "| C | agg tok/s |" in md and "| 4 | 241.0 |" in md and "30.0 / 40.0" in md
    md = render(kernels_grid(kernels_doc()), "md")
    assert "us [p10-p90]" in md and "| attn.o | 1x48x128 | 1 | v3 |" in md
    assert "% chain" not in md  # no record was timed in a chain
    doc = kernels_doc()
    doc["records"][-1].update(chain_launches=12, chain_us=3.25, chain_fraction=0.8125)
    md = render(kernels_grid(doc), "md")
    assert "| chain us (n) | % chain |" in md and "| 3.2 (12) | 81.2 |" in md
    assert FORMATS == ("table", "md", "csv", "json", "jsonl", "sql")


# ---- the history ---------------------------------------------------------------------------------------------
def test_append_makes_the_database_and_keeps_a_result_once(tmp_path):
    db = tmp_path / "h.db"
    doc = decode_doc()
    first = history.append(db, doc)
    assert first[1] and history.append(db, json.loads(json.dumps(doc))) == (first[0], False)
    other = history.append(db, decode_doc(tok_s=(50.0, 51.0, 52.0)))
    assert other[1] and other[0] != first[0]
    conn = sqlite3.connect(db)
    assert dict(conn.execute("SELECT key, value FROM meta")) == {"schema": history.NAME,
                                                                  "schema_version": str(history.VERSION)}
    assert conn.execute("SELECT count(*) FROM runs").fetchone() == (2,)
    stored = json.loads(conn.execute("SELECT doc FROM runs WHERE id = ?", (first[0],)).fetchone()[0])
    assert stored["summary"]["decode_tok_s"] == 100.0
    value, text, samples = conn.execute("SELECT value, text, samples FROM metrics WHERE run_id = ? AND metric = ?",
                                        (first[0], "decode_tok_s")).fetchone()
    assert value == 100.0 and text is None and json.loads(samples) == [99.0, 100.0, 101.0]
    assert conn.execute("SELECT text FROM metrics WHERE metric = 'tokens_sha256'").fetchone() == ("ab" * 32,)


def test_history_names_metrics_as_the_gate_does():
    """Every metric a default gate rule names in a document is stored under that path, with the same value, and a
    timing rule's samples beside it."""
    for doc in (decode_doc(), concurrency_doc(), kernels_doc()):
        stored = history.metrics(doc)
        for rule in default_rules(doc["suite"]):
            for concrete in instances(root(doc), parse_path(rule.metric)):
                path = format_path(concrete)
                try:
                    want = lookup(doc, path)
                except KeyError:
                    continue
                if want is None or (isinstance(want, float) and math.isnan(want)):
                    continue
                assert path in stored, path
                assert stored[path][0] == want, path
                if rule.samples:
                    try:
                        samples = lookup(doc, substitute(rule.samples, concrete))
                    except KeyError:
                        continue
                    assert stored[path][1] == samples, path
    conc = history.metrics(concurrency_doc())
    assert conc["levels[concurrency=4].ttft_ms_p50"] == (120.0, [120.0, 121.0, 122.0])
    assert 'records[op="attn.o",shape=1x48x128,variant=v3,t=1].us_median' in history.metrics(kernels_doc())


def test_a_file_that_is_no_history_is_refused_before_the_run(tmp_path):
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE runs (x)").connection.commit()
    text = tmp_path / "notes.txt"
    text.write_text("hello " * 200)
    for path in (other, text):
        with pytest.raises(history.HistoryError):
            history.append(path, decode_doc())
        r = CliRunner().invoke(main, ["decode", "--model", "tiny", "--db", str(path)])
        assert r.exit_code == 2 and "history" in r.output and "decode 0/" not in r.output, r.output


# ---- compare ---------------------------------------------------------------------------------------------------
@pytest.fixture
def two_commits(tmp_path):
    db = tmp_path / "h.db"
    history.append(db, decode_doc(tok_s=(99.0, 100.0, 101.0), sha="1" * 40, created="2025-01-01T00:00:00+00:00"))
    history.append(db, decode_doc(tok_s=(109.0, 110.0, 111.0), sha="2" * 40, created="2025-01-02T00:00:00+00:00",
                                  tokens="cd" * 32))
    history.append(db, decode_doc("v3-mtp", tok_s=(150.0, 150.0, 150.0), sha="2" * 40,
                                  created="2025-01-02T00:00:01+00:00"))
    return db


def test_compare_shows_a_metric_across_runs_in_time_order(two_commits):
    r = CliRunner().invoke(main, ["compare", "--db", str(two_commits), "-o", "json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [(x["label"], x["value"]) for x in rows] == [("v3-none", 100.0), ("v3-none", 110.0), ("v3-mtp", 150.0)]
    assert rows[0]["change_vs_previous"] is None
    assert rows[1]["change_vs_previous"] == pytest.approx(0.10) and rows[1]["change_vs_first"] == pytest.approx(0.10)
    assert rows[2]["change_vs_previous"] is None  # another label: another series
    assert [x["git_sha"][:1] for x in rows] == ["1", "2", "2"] and rows[0]["sd"] == pytest.approx(1.0)

    r = CliRunner().invoke(main, ["compare", "--db", str(two_commits), "--label", "v3-none", "--last", "1",
                                  "--metric", "tokens_sha256", "-o", "csv"])
    assert r.exit_code == 0, r.output
    (only,) = list(csv.DictReader(io.StringIO(r.stdout)))
    assert only["value"] == "cd" * 32 and only["change_vs_previous"] == ""

    r = CliRunner().invoke(main, ["compare", "--db", str(two_commits)])
    assert r.exit_code == 0 and "+10.0%" in r.stdout and "11111111" in r.stdout, r.output


def test_compare_two_commits_or_labels_side_by_side(two_commits):
    r = CliRunner().invoke(main, ["compare", "--db", str(two_commits), "--commit", "1111", "--commit", "2222",
                                  "-o", "json"])
    assert r.exit_code == 0, r.output
    rows = {(x["label"], x["metric"]): x for x in json.loads(r.stdout)}
    tok = rows[("v3-none", "decode_tok_s")]
    assert (tok["value_a"], tok["value_b"]) == (100.0, 110.0) and tok["speedup"] == pytest.approx(1.1)
    ms = rows[("v3-none", "device_ms_per_round")]  # lower is better: A / B
    assert ms["speedup"] == pytest.approx((1e3 / 99) / (1e3 / 109))
    assert rows[("v3-mtp", "decode_tok_s")]["value_a"] is None  # no run of it at the first commit

    r = CliRunner().invoke(main, ["compare", "--db", str(two_commits), "--label", "v3-none", "--label", "v3-mtp"])
    assert r.exit_code == 0 and "1.36x" in r.stdout and "decode_tok_s" in r.stdout, r.output  # 150 / 110

    r = CliRunner().invoke(main, ["compare", "--db", str(two_commits), "--metric", "nope"])
    assert r.exit_code == 1 and "decode_tok_s" in r.output, r.output  # names what there is


# ---- the wiring, on the bundled model ----------------------------------------------------------------------------
def test_a_suite_run_prints_csv_on_stdout_and_adds_to_the_history(tmp_path):
    db = tmp_path / "tmp.db"
    args = ["decode", "-n", "8", "--repeats", "1", "--warmup", "0", "--no-baseline", "--device", "cpu", "-o", "csv",
            "--db", str(db)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    (row,) = list(csv.DictReader(io.StringIO(r.stdout)))  # stdout: the csv alone
    assert row["suite"] == "decode" and row["label"] == "v3-none" and float(row["decode_tok_s"]) > 0
    assert int(row["completion_tokens"]) == 8 and "history:" in r.stderr
    (point,) = history.query(db, "decode_tok_s")
    assert point.value == pytest.approx(float(row["decode_tok_s"])) and point.label == "v3-none"
