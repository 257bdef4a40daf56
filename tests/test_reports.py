"""Reports: tidy frames, real PNG figures, and an HTML/Markdown release report that embeds them and escapes text."""

import base64
import json
import re
import statistics

import numpy as np
import pytest
from matplotlib.image import imread

from ninfer_bench.reports import plots
from ninfer_bench.reports.frames import frames, load_results
from ninfer_bench.reports.report import write_report
from ninfer_bench.reports.schema import ResultError, make_result, read_result, write_result

ENV = {"git_sha": "1" * 40, "gpu": "NVIDIA H200", "driver": "580.1", "torch": "2.13", "cuda": "12.9",
       "python": "3.11", "cpu": "x86_64"}
MODEL = {"artifact_id": "5f3c9a7e0b1d", "quant_policy": "mixed", "model_type": "qwen3_5_text", "layers": 64}
EVIL = "<script>alert(1)</script>"
PNG = b"\x89PNG\r\n\x1a\n"


def decode_doc(label, tok_s, *, spec="none", k=None, engine="ours", runtime="v3", sha="ab" * 32, positions=()):
    accepted = int(sum(positions) * 32)
    records = [{"repeat": i, "prompt_tokens": 500, "completion_tokens": 129, "prefill_s": 0.1, "decode_s": 1.28,
                "ttft_ms": 100.0 + i, "decode_tok_s": v, "prefill_tok_s": 5000.0 + i, "device_ms_per_round": 9.0,
                "rounds": 32, "drafted_tokens": 32 * len(positions), "accepted_tokens": accepted,
                "tokens_sha256": sha} for i, v in enumerate(tok_s)]
    summary = {"prompt_tokens": 500, "completion_tokens": 129, "tokens_sha256": sha, "prefill_tok_s": 5001.0,
               "decode_tok_s": statistics.median(tok_s), "ttft_ms": 101.0, "device_ms_per_round": 9.0,
               "rounds": 32, "drafted_tokens": 32 * len(positions), "accepted_tokens": accepted,
               "acceptance_rate": sum(positions) / len(positions) if positions else None,
               "tokens_per_round": 1 + accepted / 32, "accepted_per_position": list(positions),
               "peak_memory_bytes": 3 << 30, "roofline_fraction": None, "deterministic": True,
               "samples": {"decode_tok_s": list(tok_s), "prefill_tok_s": [5000.0 + i for i in range(len(tok_s))],
                           "ttft_ms": [100.0 + i for i in range(len(tok_s))],
                           "device_ms_per_round": [9.0] * len(tok_s)}}
    config = {"engine": engine, "runtime": runtime, "spec": spec, "draft_tokens": k, "kv_dtype": "int8",
              "device": "cuda:0", "max_new_tokens": 129, "repeats": len(tok_s)}
    return make_result("decode", label=label, config=config, records=records, summary=summary, model=MODEL, env=ENV)


def concurrency_doc(label, scale):
    levels = []
    for c in (1, 2, 4, 8):
        agg = [60.0 * c ** 0.8 * scale + 0.2 * i for i in range(5)]
        levels.append({"concurrency": c, "aggregate_tok_s": statistics.median(agg),
                       "per_request_tok_s": statistics.median(agg) / c, "ttft_ms_p50": 30.0 * c,
                       "ttft_ms_p90": 35.0 * c, "ttft_ms_p99": 40.0 * c, "itl_ms_p50": 12.0, "itl_ms_p90": 13.0,
                       "itl_ms_p99": 15.0,
                       "e2e_ms_p50": 1600.0, "e2e_ms_p99": 1700.0, "matches_sequential": True,
                       "samples": {"aggregate_tok_s": agg, "ttft_ms": [30.0 * c + 0.1 * i for i in range(5)],
                                   "itl_ms": [12.0 + 0.1 * i for i in range(5)]}})
    records = [{"concurrency": c, "request": r, "ttft_ms": 30.0, "e2e_ms": 1600.0, "completion_tokens": 128,
                "tokens_sha256": "cd" * 32} for c in (1, 2, 4, 8) for r in range(c)]
    return make_result("concurrency", label=label, config={"device": "cuda:0", "max_new_tokens": 128},
                       records=records, summary={"levels": levels}, model=MODEL, env=ENV)


def kernels_doc(label, speed):
    recs = []
    for op, shape in (("rmsnorm", [1, 5120]), ("gdn_decode", [1, 48, 128, 128]), ("q4_gemv", [17408, 5120])):
        for variant, us in (("ref", 40.0), ("v2", 12.0), ("v3", 12.0 / speed)):
            samples = [us * (1 + 0.002 * i) for i in range(20)]
            recs.append({"op": op, "shape": shape, "variant": variant, "t": 1, "us_median": statistics.median(samples),
                         "us_p10": samples[2], "us_p90": samples[17], "samples_us": samples, "bytes": 1 << 22,
                         "gbps": 4.0 / us * 1e3, "roofline_fraction": 0.3, "max_rel_err": 2e-3, "ok": True})
    return make_result("kernels", label=label, config={"device": "cuda:0", "repeats": 20}, records=recs, env=ENV,
                       summary={"ops": 3, "copy_bandwidth_gbps": 4300.0, "timer": "cuda-events"})


def niah_doc(label, fail_at=()):
    recs, fd = [], {}
    for ctx in (4096, 16384, 65536):
        for depth in (0.0, 0.5, 1.0):
            case = f"ctx{ctx}-d{depth}"
            ok = (ctx, depth) not in fail_at
            recs.append({"case": case, "ctx": ctx, "depth": depth, "pass": ok, "retrieved": ok,
                         "first_divergence": None if ok else 7, "top1_agreement": 1.0 if ok else 0.9,
                         "kl": 1e-4, "answer": "4721" if ok else "4712", "expected": "4721"})
            fd[case] = None if ok else 7
    n = len(recs)
    passed = sum(r["pass"] for r in recs)
    return make_result("niah", label=label, config={"device": "cuda:0"}, records=recs, model=MODEL, env=ENV,
                       summary={"cases": n, "oracle_agreement": passed / n, "retrieval": passed / n,
                                "first_divergence": fd, "seconds": 12.5})


@pytest.fixture(scope="module")
def docs():
    """Two grids (labels base-... and cand-...) of decode runs with runs of no baseline beside them; concurrency and
    kernels under base and cand; NIAH under cand only."""
    tight = np.linspace(-0.5, 0.5, 10)
    mtp = (0.8, 0.6, 0.4)
    return [
        decode_doc("hf-peer", 40 + tight, engine="hf"),
        decode_doc("base-v2-none", 70 + tight, runtime="v2"),
        decode_doc("cand-v2-none", 77 + tight, runtime="v2"),  # +10%, 10 vs 10 separated samples: faster
        decode_doc("base-v3-mtp-k3", 120 + tight, spec="mtp", k=3, positions=mtp),
        decode_doc("cand-v3-mtp-k3", 120.1 + tight, spec="mtp", k=3, positions=mtp),  # same; identical acceptance
        decode_doc("v3-dflash2-k7", 180 + tight, spec="dflash2", k=7,
                   positions=(0.9, 0.8, 0.7, 0.5, 0.4, 0.2, 0.1)),
        decode_doc(EVIL, [41.0, 40.0, 39.0], engine="hf", sha="ee" * 32),
        concurrency_doc("base", 1.0),
        concurrency_doc("cand", 1.6),
        kernels_doc("cand", 1.5),
        kernels_doc("base", 1.0),
        niah_doc("cand", fail_at={(65536, 1.0)}),
    ]


@pytest.fixture(scope="module")
def report(docs, tmp_path_factory):
    """(html path, md path) of the full report against the base grid (drawn once: figures take seconds)."""
    return write_report(docs, tmp_path_factory.mktemp("report") / "out", baseline_label="base")


def test_frames_are_tidy(docs):
    f = frames(docs)
    assert len(f["decode"]) == 7 and f["decode"]["label"].tolist()[0] == "hf-peer"
    assert {"engine", "spec", "decode_tok_s", "tokens_sha256", "model_id"} <= set(f["decode"].columns)
    assert "samples" not in f["decode"].columns and "accepted_per_position" not in f["decode"].columns
    pos = f["decode_positions"]
    assert len(pos) == 3 + 3 + 7 and pos[pos.label == "v3-dflash2-k7"]["position"].tolist() == list(range(1, 8))
    assert len(f["decode_repeats"]) == 6 * 10 + 3
    assert len(f["concurrency"]) == 8 and set(f["concurrency"]["concurrency"]) == {1, 2, 4, 8}
    assert len(f["kernels"]) == 2 * 9 and "1x48x128x128" in set(f["kernels"]["shape"])
    assert len(f["niah"]) == 9 and f["niah"]["pass"].sum() == 8
    assert f["prefill"].empty and "label" in f["prefill"].columns


def test_frames_of_nothing_are_empty_with_columns():
    f = frames([])
    assert all(df.empty for df in f.values())
    assert list(f["kernels"].columns)[:4] == ["label", "op", "shape", "variant"]
    assert all(getattr(plots, fn)(df, "unused.png") is None for fn, df in (
        ("plot_decode", f["decode"]), ("plot_acceptance", f["decode_positions"]),
        ("plot_concurrency", f["concurrency"]), ("plot_kernels", f["kernels"]), ("plot_niah", f["niah"])))


def test_duplicate_labels_are_made_unique():
    a = decode_doc("same", [1.0, 2.0, 3.0])
    f = frames([a, a])
    assert f["decode"]["label"].tolist() == ["same", "same#2"]


def _check_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG, path
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] >= 200 and img.shape[1] >= 300, (path, img.shape)
    assert img[..., :3].std() > 0.01  # not a blank canvas


def test_report_embeds_every_figure_and_links_existing_files(report):
    html_path, md_path = report
    pngs = sorted(html_path.parent.glob("*.png"))
    assert {p.name for p in pngs} == {"decode.png", "acceptance.png", "concurrency.png", "kernels.png", "niah.png"}
    html_text = html_path.read_text()
    embedded = [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html_text)]
    assert len(embedded) == len(pngs)
    for p in pngs:
        _check_png(p)
        assert p.read_bytes() in embedded, p.name
    assert "src=\"decode.png\"" not in html_text  # self-contained: no file references
    md = md_path.read_text()
    links = re.findall(r"!?\[[^\]]*\]\(([^)]+)\)", md)
    assert sorted(links) == sorted(p.name for p in pngs)
    assert all((md_path.parent / link).is_file() for link in links)
    for heading in ("Verdict", "Decode", "Concurrency", "Kernels", "Needle in a haystack",
                    "Environment and configuration"):
        assert f"<h2>{heading}</h2>" in html_text and f"## {heading}" in md


def _verdict_rows(md: str) -> dict:
    """The verdict table's rows of a Markdown report: (suite, run) -> its cells."""
    table = md.split("## Verdict", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        if len(cells) == 7 and cells[0] != "suite" and not set(cells[0]) <= {"-"}:
            rows[(cells[0], cells[1])] = dict(zip(("suite", "run", "baseline", "correct", "speed", "main", "gate"),
                                                  cells))
    return rows


def test_report_verdicts_against_the_baseline(report):
    """Each run against the base grid's run of its experiment, read from the gate's rows; runs without one (another
    engine, a drafter the base grid lacks, a suite it has no run of) say "no baseline" and are compared with nothing."""
    md = report[1].read_text()
    rows = _verdict_rows(md)
    v2 = rows[("decode", "cand-v2-none")]
    assert v2["baseline"] == "base-v2-none" and v2["speed"].startswith("faster, p=") and v2["gate"] == "pass"
    assert v2["main"] == "70.0 → 77.0 tok/s (+10.0%)" and v2["correct"].startswith("yes: 8 exact rows = the baseline's")
    assert rows[("decode", "cand-v3-mtp-k3")]["speed"] == "same (within ±4%)"
    assert rows[("decode", "base-v2-none")]["baseline"] == "(is the baseline)"
    peer = rows[("decode", "hf-peer")]
    assert peer["baseline"] == "no baseline" and peer["speed"].startswith("no baseline: no base run of this experiment")
    assert "engine 'ours' vs 'hf'" in peer["speed"]
    conc = rows[("concurrency", "cand")]
    assert conc["speed"] == "faster: 4 faster of 4 levels" and "C8 " in conc["main"] and conc["gate"] == "pass"
    assert rows[("kernels", "cand")]["speed"] == "faster: 3 faster, 6 same of 9 rows"
    niah = rows[("niah", "cand")]
    assert niah["baseline"] == "no baseline" and niah["speed"] == "not timed"
    assert niah["correct"] == "NO: 1 of 9 cases disagree with the oracle"
    head = md.split("## Verdict", 1)[1].split("|", 1)[0]
    assert "1 of 12 runs NOT correct" in head and "against base: 3 faster, 1 same" in head
    assert "stand-in" not in md
    # the suites' delta tables read the same gate rows
    assert "| cand-v2-none | base-v2-none | 1.100x (+10.0%) faster, p=" in md
    assert "| cand | base | C8 | aggregate_tok_s | 1.599x (+59.9%) faster, p=0.0079, 99% CI +59.7%..+60.2% | pass |" in md
    assert rows[("kernels", "cand")]["main"] == "largest change: rmsnorm 1x5120 v3 T=1 12.23 → 8.15 µs (-33.3%)"
    assert "| cand | rmsnorm | 1x5120 | 1 | v3 | - |" in md and "| 1.50x speedup, faster, p=" in md


def test_report_puts_the_verdict_first_and_the_environment_last(report):
    html_text, md = report[0].read_text(), report[1].read_text()
    for text, h2 in ((md, "## {}"), (html_text, "<h2>{}</h2>")):
        where = [text.index(h2.format(h)) for h in ("Verdict", "Decode", "Concurrency", "Kernels",
                                                     "Needle in a haystack", "Environment and configuration")]
        assert where == sorted(where)
        assert text.index(h2.format("Verdict")) < text.index("<table" if text is html_text else "| suite | run |")
    assert '<table class="verdict">' in html_text and '<td class="good">faster, p=' in html_text


def test_report_checks_token_agreement(report):
    md = report[1].read_text()
    # runs of one engine sharing spec none, model and workload: the peer's two differ, ours agree (a peer is never
    # set against ours here)
    assert ("| hf-peer, &lt;script&gt;alert(1)&lt;/script&gt; | abababababab, eeeeeeeeeeee | "
            "DIFFER: &lt;script&gt;alert(1)&lt;/script&gt; vs hf-peer |") in md
    assert "| base-v2-none, cand-v2-none | abababababab | equal |" in md
    assert "| base-v3-mtp-k3, cand-v3-mtp-k3 | abababababab | equal |" in md
    assert "| v3-dflash2-k7 | abababababab | single run |" in md


def test_report_escapes_labels(report):
    html_text, md = report[0].read_text(), report[1].read_text()
    assert EVIL not in html_text and "<script" not in html_text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html_text
    assert EVIL not in md and "<script" not in md


def test_report_skips_empty_suites(tmp_path):
    only = [decode_doc("v2-none", [70.0, 71.0, 69.0]), decode_doc("v3-none", [90.0, 91.0, 89.0])]
    html_path, md_path = write_report(only, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["decode.png"]  # no drafts: no acceptance figure
    html_text = html_path.read_text()
    assert "Concurrency" not in html_text and "Kernels" not in html_text and "haystack" not in html_text
    assert html_text.count("data:image/png;base64,") == 1
    md = md_path.read_text()
    assert "no baseline given (--baseline LABEL): no speed verdict" in md
    assert _verdict_rows(md)[("decode", "v3-none")]["speed"] == "no baseline: no --baseline LABEL was given"


def test_report_rejects_an_unknown_baseline(docs, tmp_path):
    with pytest.raises(ValueError, match="baseline label 'nope'"):
        write_report(docs, tmp_path, baseline_label="nope")


def test_load_results_reads_files_and_folders(docs, tmp_path):
    for i, doc in enumerate(docs[:3]):
        write_result(doc, tmp_path / "runs" / f"{i}.json")
    assert [d["label"] for d in load_results([tmp_path / "runs"])] == ["hf-peer", "base-v2-none", "cand-v2-none"]
    assert len(load_results([tmp_path / "runs" / "0.json"])) == 1
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ResultError, match="bad.json: not JSON"):
        load_results([tmp_path / "bad.json"])
    with pytest.raises(ResultError, match="no such result file"):
        load_results([tmp_path / "missing.json"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ResultError, match="no \\*.json"):
        load_results([tmp_path / "empty"])


def test_report_of_documents_without_measurements(tmp_path):
    """Suites that measured nothing (no records, no levels, null metrics) give tables but no figures."""
    env = {"gpu": None}
    decode_keys = ("prompt_tokens", "completion_tokens", "tokens_sha256", "prefill_tok_s", "decode_tok_s", "ttft_ms",
                   "device_ms_per_round", "rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                   "tokens_per_round", "accepted_per_position", "peak_memory_bytes")
    docs = [make_result("niah", label="n", config={}, records=[], env=env,
                        summary={"cases": 0, "oracle_agreement": None, "retrieval": None, "first_divergence": {}}),
            make_result("concurrency", label="c", config={}, records=[], env=env, summary={"levels": []}),
            make_result("kernels", label="k", config={}, records=[], env=env, summary={"ops": 0}),
            make_result("prefill", label="p", config={}, records=[], env=env, summary={"prefill_tok_s": None}),
            make_result("decode", label="d", config={}, records=[], env=env, summary=dict.fromkeys(decode_keys))]
    html_path, md_path = write_report(docs, tmp_path)
    assert list(tmp_path.glob("*.png")) == []
    assert "data:image/png" not in html_path.read_text()
    md = md_path.read_text()
    assert "## Prefill" in md and "| d | - | - | - | - | - |" in md


@pytest.mark.parametrize("where, value, match", [
    ("env", None, "env must be an object, got None"),
    ("config", [], "config must be an object"),
    ("records", {}, "records must be a list of objects"),
    ("records", [3], r"records\[0\] must be an object"),
    ("samples", "abc", "summary.samples.decode_tok_s must be a list of numbers, got 'abc'"),
    ("samples", [1.0, "x"], "summary.samples.decode_tok_s must be a list of numbers"),
])
def test_malformed_documents_name_the_file_and_key(tmp_path, where, value, match):
    doc = decode_doc("d", [1.0, 2.0, 3.0])
    if where == "samples":
        doc["summary"]["samples"]["decode_tok_s"] = value
    else:
        doc[where] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ResultError, match=f"bad.json: {match}"):
        read_result(path)


def test_a_niah_record_without_a_case_is_refused(tmp_path):
    doc = niah_doc("n")
    doc["records"][2] = {}
    write_result(doc, tmp_path / "n.json")
    with pytest.raises(ResultError, match=r"n.json: niah records\[2\] has no case name"):
        read_result(tmp_path / "n.json")


def test_cli_gate_and_report_give_one_line_errors_for_malformed_documents(tmp_path):
    from click.testing import CliRunner

    from ninfer_bench.cli import main

    good = write_result(decode_doc("d", [1.0, 2.0, 3.0]), tmp_path / "good.json")
    bad = decode_doc("d", [1.0, 2.0, 3.0])
    bad["env"] = None
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    for args in (["gate", "--baseline", str(good), "--candidate", str(tmp_path / "bad.json")],
                 ["report", str(good), str(tmp_path / "bad.json"), "--out", str(tmp_path / "out")]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and "bad.json: env must be an object" in r.output, r.output
        assert "Traceback" not in r.output and not isinstance(r.exception, AttributeError)


def test_gzipped_results_are_read_and_other_files_are_named(tmp_path):
    doc = decode_doc("d", [1.0, 2.0, 3.0])
    path = write_result(doc, tmp_path / "runs" / "d.json.gz")
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    assert read_result(path) == json.loads(json.dumps(doc))
    assert [d["label"] for d in load_results([tmp_path / "runs"])] == ["d"]
    (tmp_path / "bin.json").write_bytes(b"\x8b\x00\xff")
    with pytest.raises(ResultError, match="bin.json: not a JSON result document .not UTF-8"):
        read_result(tmp_path / "bin.json")
    (tmp_path / "cut.json.gz").write_bytes(path.read_bytes()[:40])
    with pytest.raises(ResultError, match="cut.json.gz: not a readable gzip file"):
        read_result(tmp_path / "cut.json.gz")
    (tmp_path / "plain.json.gz").write_text(json.dumps(doc))
    with pytest.raises(ResultError, match="plain.json.gz: named .gz but not a gzip file"):
        read_result(tmp_path / "plain.json.gz")
    with pytest.raises(OSError, match=f"cannot write {tmp_path / 'bin.json'}/x.json: "):
        write_result(doc, tmp_path / "bin.json" / "x.json")


def test_a_file_given_twice_is_one_document(docs, tmp_path):
    write_result(docs[0], tmp_path / "runs" / "a.json")
    write_result(docs[1], tmp_path / "runs" / "b.json")
    a = tmp_path / "runs" / "a.json"
    loaded = load_results([a, tmp_path / "runs", tmp_path / "runs" / ".." / "runs" / "a.json"])
    assert [d["label"] for d in loaded] == ["hf-peer", "base-v2-none"]


def test_runs_of_another_model_or_workload_have_no_baseline(tmp_path):
    """The baseline label's run of another model or workload is no baseline: the run says "no baseline", naming what
    differs, and nothing is compared."""
    base = decode_doc("base", [70.0, 71.0, 69.0])
    other_model = decode_doc("v3-none-tiny", [90.0, 91.0, 89.0])
    other_model["model"] = {"preset": "tiny", "synthetic": True}
    longer = decode_doc("v3-long", [90.0, 91.0, 89.0])
    longer["config"]["max_new_tokens"] = 256
    md = write_report([base, other_model, longer], tmp_path, baseline_label="base")[1].read_text()
    rows = _verdict_rows(md)
    assert "model.artifact_id '5f3c9a7e0b1d' vs None" in rows[("decode", "v3-none-tiny")]["speed"]
    assert "max_new_tokens 129 vs 256" in rows[("decode", "v3-long")]["speed"]
    assert all(rows[("decode", k)]["baseline"] == "no baseline" for k in ("v3-none-tiny", "v3-long"))
    assert "Against the baseline of each experiment" not in md and "x (+" not in md


def test_concurrency_runs_differing_only_in_rounds_are_comparable(tmp_path):
    """--rounds is how many samples a level takes, not the load: one experiment (decode's --repeats alike); another
    prompt length is another experiment, with no baseline."""
    one, two = concurrency_doc("c-r1", 1.0), concurrency_doc("c-r2", 1.0)
    one["config"]["rounds"], two["config"]["rounds"] = 1, 2
    longer = concurrency_doc("c-long", 1.0)
    longer["config"].update(rounds=1, prompt_tokens=512)
    md = write_report([one, two, longer], tmp_path, baseline_label="c-r1")[1].read_text()
    rows = _verdict_rows(md)
    assert rows[("concurrency", "c-r2")]["baseline"] == "c-r1"
    assert rows[("concurrency", "c-r2")]["speed"] == "same: 4 same of 4 levels"
    assert rows[("concurrency", "c-long")]["speed"].startswith("no baseline: no c-r1 run of this experiment")
    assert "prompt_tokens None vs 512" in rows[("concurrency", "c-long")]["speed"]


def kernel_rec(op, shape, variant, us, fmt=None):
    samples = [us * (1 + 0.002 * i) for i in range(10)]
    rec = {"op": op, "shape": shape, "variant": variant, "t": 1, "us_median": statistics.median(samples),
           "us_p10": samples[1], "us_p90": samples[8], "samples_us": samples, "bytes": 1 << 20, "gbps": 100.0,
           "roofline_fraction": 0.1, "max_rel_err": 1e-3, "ok": True}
    return rec if fmt is None else {**rec, "fmt": fmt}


def test_kernel_rows_show_their_format_and_unlike_rows_get_no_speedup(tmp_path):
    """A fp32 run of attn.o against the default q5 one is another experiment (no baseline, its format shown); a row
    of another shape or a run with another timer gets no speedup; like rows get the gate's reading."""
    def doc(label, fmt, o_us, shape=(512, 384), timer="torch-cpu"):
        recs = [kernel_rec("attn.o", list(shape), v, us, fmt) for v, us in (("v2", 2 * o_us), ("v3", o_us))]
        recs += [kernel_rec("norm.rms", [1, 512], v, 5.0) for v in ("v2", "v3")]
        return make_result("kernels", label=label, config={"device": "cpu", "dtype": "float32"}, records=recs,
                           env=ENV, summary={"ops": 2, "copy_bandwidth_gbps": 10.0, "timer": timer})

    docs = [doc("k-fp32", "fp32", 30.0), doc("kernels-model-cpu", "q5_g64_fp16", 20.0),
            doc("k-wide", "q5_g64_fp16", 10.0, shape=(1024, 384)),
            doc("k-gpu", "q5_g64_fp16", 5.0, timer="cuda-events"), doc("k-fast", "q5_g64_fp16", 10.0)]
    md = write_report(docs, tmp_path, baseline_label="kernels-model-cpu")[1].read_text()
    rows = {tuple(line.split(" | ")[:5]): line for line in md.splitlines() if line.startswith("| k")}
    fp32 = rows[("| k-fp32", "attn.o", "512x384", "1", "v3")]
    assert "| v3 | fp32 |" in fp32 and "| no baseline |" in fp32
    assert "| 2.00x speedup, faster" in fp32  # v3 over its own v2: one format
    assert "fmt of attn.o 'q5_g64_fp16' vs 'fp32'" in _verdict_rows(md)[("kernels", "k-fp32")]["speed"]
    assert "| v3 | q5_g64_fp16 |" in rows[("| kernels-model-cpu", "attn.o", "512x384", "1", "v3")]
    assert "NOT COMPARABLE: shape 1024x384 (baseline 512x384)" in rows[("| k-wide", "attn.o", "1024x384", "1", "v3")]
    assert "NOT COMPARABLE: timer cuda-events (baseline torch-cpu)" in rows[("| k-gpu", "attn.o", "512x384", "1", "v3")]
    assert "| 2.00x speedup, faster, p=" in rows[("| k-fast", "attn.o", "512x384", "1", "v3")]
    assert "| 1.00x speedup, same (within ±5%) |" in rows[("| k-fast", "norm.rms", "1x512", "1", "v3")]


def test_duplicate_labels_are_refused_naming_the_files(tmp_path):
    a, b = decode_doc("v3-none", [70.0, 71.0, 69.0]), decode_doc("v3-none", [90.0, 91.0, 89.0])
    b["model"] = {"preset": "tiny", "synthetic": True}
    write_result(a, tmp_path / "runs" / "a.json")
    write_result(b, tmp_path / "runs" / "b.json")
    write_result(concurrency_doc("v3-none", 1.0), tmp_path / "runs" / "c.json")  # another suite: no clash
    with pytest.raises(ResultError, match=r"runs/a.json and .*runs/b.json are both decode results labelled 'v3-none'"):
        load_results([tmp_path / "runs"])
    assert len(load_results([tmp_path / "runs" / "a.json", tmp_path / "runs" / "c.json"])) == 2
    with pytest.raises(ValueError, match=r"two decode results are labelled 'v3-none' \(5f3c9a7e0b1d, .*tiny \(synthetic\)"):
        write_report([a, b], tmp_path / "out")


def test_a_suite_without_a_baseline_run_has_no_stand_in(tmp_path):
    """The baseline label has no concurrency run: the concurrency runs have no baseline (the first one read does not
    stand in), and the report says why."""
    docs = [decode_doc("hf-peer", [40.0, 41.0, 39.0], engine="hf"), decode_doc("v3-none", [90.0, 91.0, 89.0]),
            concurrency_doc("b-conc", 1.0), concurrency_doc("a-conc", 1.2)]
    md = write_report(docs, tmp_path, baseline_label="hf-peer")[1].read_text()
    rows = _verdict_rows(md)
    assert rows[("concurrency", "b-conc")]["speed"] == "no baseline: hf-peer has no concurrency run"
    assert rows[("concurrency", "a-conc")]["baseline"] == "no baseline"
    assert rows[("decode", "hf-peer")]["baseline"] == "(is the baseline)"
    assert "stand-in" not in md and "standing in" not in md
    assert "b-conc: no baseline (hf-peer has no concurrency run)" in md


def test_niah_oracle_agreement_shows_its_denominator(tmp_path):
    """Two cases, one with an oracle (which passed): 100% of 1, not of 2."""
    recs = [{"case": "ctx1024-d0", "ctx": 1024, "depth": 0, "pass": True, "retrieved": True, "first_divergence": None,
             "top1_agreement": 1.0, "kl": 0.0},
            {"case": "ctx1024-d100", "ctx": 1024, "depth": 100, "pass": None, "retrieved": True,
             "first_divergence": None, "top1_agreement": None, "kl": None}]
    half = make_result("niah", label="half", config={}, records=recs, model=MODEL, env=ENV,
                       summary={"cases": 2, "oracle_cases": 1, "oracle_agreement": 1.0, "retrieval": 1.0,
                                "first_divergence": {"ctx1024-d0": None}})
    none = make_result("niah", label="none", config={}, records=[{**recs[1], "case": "c"}], model=MODEL, env=ENV,
                       summary={"cases": 1, "oracle_cases": 0, "oracle_agreement": None, "retrieval": 1.0,
                                "first_divergence": {}})
    html_path, md_path = write_report([half, none], tmp_path)
    md = md_path.read_text()
    assert "| half | 2 | 100.0% (1 of 1 cases with an oracle; 1 without) | 100.0% |" in md
    assert "| none | 1 | no oracle (0 of 1 cases) |" in md
    assert "| half | ctx1024-d100 | 1,024 | 100 | no oracle |" in md
    assert '<td class="warn">100.0% (1 of 1 cases with an oracle; 1 without)</td>' in html_path.read_text()
    assert plots._cell_text(1.0, 1, 2, oracle=True) == "100%\n1 of 2 with\nan oracle"
    assert plots._cell_text(float("nan"), 0, 2, oracle=True) == "no oracle"


def test_report_shows_the_spread_of_the_repeats_and_the_speedup_over_the_plain_partner(report, docs, tmp_path):
    """Decode rows show their repeats' sample standard deviation (computed from the samples in the document) beside
    the median, and a speculative run's speed-up over its plain partner (summary.plain)."""
    md = report[1].read_text()
    evil = next(d for d in docs if d["label"] == EVIL)
    sd = statistics.stdev(evil["summary"]["samples"]["decode_tok_s"])  # 41, 40, 39: 1.0
    assert "| decode tok/s | ± sd (repeats) | over plain |" in md
    assert f"| 40.00 | ± {sd:.2f} (3) | - |" in md
    spec = decode_doc("mtp", [120.0, 121.0, 119.0], spec="mtp", k=3, positions=(0.8, 0.6, 0.4))
    spec["summary"]["plain"] = {"label": "none", "decode_tok_s": 80.0, "speedup": 1.5, "tokens_equal": False}
    md = write_report([spec], tmp_path)[1].read_text()
    assert "| 1.50x none, OTHER TOKENS |" in md
    row = _verdict_rows(md)[("decode", "mtp")]
    assert row["correct"] == "NO: tokens differ from its plain run none" and "1.50x its plain run" in row["main"]


def test_report_names_the_cpu_model_of_cpu_runs(tmp_path):
    """``env.cpu`` is ``x86_64`` on Linux; the report names the CPU model and core count a run measured."""
    from ninfer_bench.reports.schema import cpu_model, environment

    env = environment()
    assert env["cpu_model"] == cpu_model()
    doc = decode_doc("cpu-run", [10.0, 11.0, 12.0])
    doc["env"] = {**ENV, "gpu": None, "cpu_model": "AMD EPYC 9654 96-Core Processor", "cpu_count": 2}
    md = write_report([doc], tmp_path)[1].read_text()
    assert "| cpu | AMD EPYC 9654 96-Core Processor |" in md and "| cores | 2 |" in md


def test_report_writes_its_frames_as_csv(report, docs):
    """The report's tables as CSV beside it (llama-bench's -o csv): one row per decode run, per repeat, per level,
    per case, the numbers read back equal to the documents'."""
    import pandas as pd

    out = report[0].parent
    decode = pd.read_csv(out / "decode.csv")
    decode_docs = [d for d in docs if d["suite"] == "decode"]
    assert len(decode) == len(decode_docs)
    for d in decode_docs:
        row = decode[decode["label"] == d["label"]].iloc[0]
        assert row["decode_tok_s"] == pytest.approx(d["summary"]["decode_tok_s"])
    repeats = pd.read_csv(out / "decode_repeats.csv")
    assert len(repeats) == sum(len(d["records"]) for d in decode_docs)
    conc = pd.read_csv(out / "concurrency.csv")
    assert sorted(conc["concurrency"].unique()) == [1, 2, 4, 8] and len(conc) == 8
    assert {"niah.csv", "kernels.csv"} <= {p.name for p in out.iterdir()}
    assert not (out / "prefill.csv").exists()  # no prefill result: no empty file
    assert "decode.csv" in report[1].read_text()


def test_a_decisively_slower_candidate_reads_slower(tmp_path):
    """10% slower than its baseline, 10 repeats against 10 well apart: slower, and the gate fails it."""
    tight = np.linspace(-0.5, 0.5, 10)
    docs = [decode_doc("base-v3-none", 100 + tight), decode_doc("cand-v3-none", 90 + tight)]
    html_path, md_path = write_report(docs, tmp_path, baseline_label="base")
    row = _verdict_rows(md_path.read_text())[("decode", "cand-v3-none")]
    assert row["speed"].startswith("slower, p=") and row["gate"].startswith("fail: decode_tok_s")
    assert row["main"] == "100.0 → 90.0 tok/s (-10.0%)" and row["correct"].startswith("yes")
    assert '<td class="bad">slower, p=' in html_path.read_text()


def _with_repeats_needed(monkeypatch, n):
    """The gate's timing rows beyond their threshold carry ``repeats_needed = n`` (as the gate gives them)."""
    import dataclasses

    from ninfer_bench.reports import baseline
    from ninfer_bench.reports.gate import Verdict

    if "repeats_needed" in {f.name for f in dataclasses.fields(Verdict)}:
        def counted(v):
            return dataclasses.replace(v, repeats_needed=n)
    else:
        @dataclasses.dataclass(slots=True)
        class Counted(Verdict):
            repeats_needed: int | None = None

        def counted(v):
            return Counted(**{f.name: getattr(v, f.name) for f in dataclasses.fields(Verdict)}, repeats_needed=n)

    real = baseline.gate

    def gate(base, doc, *args, **kwargs):
        return [counted(v) if v.kind == "timing" and v.change is not None and abs(v.change) > 0.05 else v
                for v in real(base, doc, *args, **kwargs)]

    monkeypatch.setattr(baseline, "gate", gate)


def test_two_repeats_against_two_read_undecided_with_the_repeats_that_would_decide(tmp_path, monkeypatch):
    docs = [decode_doc("base-v3-none", [100.0, 101.0]), decode_doc("cand-v3-none", [80.0, 81.0])]
    md = write_report(docs, tmp_path / "plain", baseline_label="base")[1].read_text()
    row = _verdict_rows(md)[("decode", "cand-v3-none")]
    assert row["speed"].startswith("undecided: -19.9%, slower beyond ±4% (")
    _with_repeats_needed(monkeypatch, 9)
    md = write_report(docs, tmp_path / "counted", baseline_label="base")[1].read_text()
    row = _verdict_rows(md)[("decode", "cand-v3-none")]
    assert row["speed"].startswith("undecided: -19.9%") and row["speed"].endswith("about 9 repeats a side would decide")
    assert "(about 9 repeats a side would decide)" in md.split("## Verdict", 1)[1].split("|", 1)[0]
    assert "about 9 repeats a side would decide |" in md  # the decode delta table too


def test_a_run_without_a_baseline_of_its_experiment_reads_no_baseline(tmp_path):
    """A grid whose baseline lacks the candidate's drafter, and a NIAH run the baseline label has none of: each
    reads "no baseline" and is compared with nothing (no stand-in)."""
    docs = [decode_doc("base-v3-none", [70.0, 71.0, 69.0]), decode_doc("cand-v3-none", [70.5, 71.0, 69.0]),
            decode_doc("cand-v3-mtp-k3", [90.0, 91.0, 89.0], spec="mtp", k=3, positions=(0.8, 0.6, 0.4)),
            niah_doc("cand")]
    md = write_report(docs, tmp_path, baseline_label="base")[1].read_text()
    rows = _verdict_rows(md)
    mtp = rows[("decode", "cand-v3-mtp-k3")]
    assert mtp["baseline"] == "no baseline" and mtp["gate"] == "-"
    assert mtp["speed"].startswith("no baseline: no base run of this experiment (the nearest, base-v3-none, differs "
                                   "in spec 'none' vs 'mtp'")
    niah = rows[("niah", "cand")]
    assert niah["baseline"] == "no baseline" and niah["correct"] == "yes: 9 of 9 cases agree with the oracle"
    assert "| cand | 9 | 100.0% (9 of 9 cases with an oracle) | 100.0% | 12.5 | no baseline |" in md
    assert rows[("decode", "cand-v3-none")]["baseline"] == "base-v3-none"
    assert "stand-in" not in md and not any(line.startswith("| cand-v3-mtp-k3 | base") for line in md.splitlines())


def test_environment_and_configuration_are_key_value_tables_with_the_model_once(report, docs):
    md, html_text = report[1].read_text(), report[0].read_text()
    assert md.count("5f3c9a7e0b1d") == 1 and html_text.count("5f3c9a7e0b1d") == 1
    env = md.split("## Environment and configuration", 1)[1]
    assert "| key | value |" in env and "| gpu | NVIDIA H200 |" in env and "| artifact | 5f3c9a7e0b1d |" in env
    assert "| key | the same in every run |" in env and "| max_new_tokens | 129 |" in env
    assert "Common:" not in md and "{'" not in env and "['" not in env
    assert md.index("## Environment and configuration") > md.index("## Needle in a haystack")


def test_config_values_are_written_as_text_not_reprs():
    from ninfer_bench.reports.render import value_text

    assert value_text([1, 2, 4, 8]) == "1, 2, 4, 8"
    assert value_text({"label": "x", "speedup": 1.5}) == "label=x, speedup=1.5"
    assert value_text(None) == "-" and value_text(True) == "yes" and value_text([]) == "(none)"


def test_decode_bars_lead_with_the_baseline_and_identical_lines_say_so(docs):
    f = frames(docs)
    order = plots.decode_order(f["decode"], [["base-v2-none", "cand-v2-none"], ["base-v3-mtp-k3", "cand-v3-mtp-k3"]],
                               {"base-v2-none", "base-v3-mtp-k3"})
    assert order[:2] == [["base-v2-none", "cand-v2-none"], ["base-v3-mtp-k3", "cand-v3-mtp-k3"]]
    rest = [g[0] for g in order[2:]]
    values = dict(zip(f["decode"]["label"], f["decode"]["decode_tok_s"]))
    assert rest == sorted(rest, key=lambda label: -values[label])  # the runs without a baseline: fastest first
    names = plots._series_names(f["decode_positions"], "acceptance", "position", {"base-v3-mtp-k3"})
    assert names["base-v3-mtp-k3"] == "base-v3-mtp-k3 (baseline)"
    assert names["cand-v3-mtp-k3"] == "cand-v3-mtp-k3 (identical to base-v3-mtp-k3)"
    assert names["v3-dflash2-k7"] == "v3-dflash2-k7"


def test_report_shows_a_peers_agreement_with_ours(tmp_path):
    ours = decode_doc("v3-none", [90.0, 91.0, 89.0])
    peer = decode_doc("llamacpp-peer", [50.0, 51.0, 49.0], engine="llamacpp", sha="cd" * 32)
    peer["summary"]["agreement"] = {
        "reference": "v3-none", "prompts": 64, "prompts_equal_to_bar": 58, "bar_tokens": 64, "prefix_tokens_min": 0,
        "top1_agreement": 0.99834, "kl_mean": 6.3e-05, "kl_max": 1.9e-03, "per_prompt": []}
    md = write_report([ours, peer], tmp_path)[1].read_text()
    assert "### Peers against ours" in md
    assert "| llamacpp-peer | v3-none | 58 / 64 (bar 64) | 0 | 0.9983 | 6.30e-05 / 1.90e-03 |" in md
    assert "DIFFER" not in md  # another engine's tokens are not ours' to equal
    assert "### Peers against ours" not in write_report([ours], tmp_path / "alone")[1].read_text()
