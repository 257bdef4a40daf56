"""Several decode runs in one process (llama-bench style): the grid, labels, one shared load, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ninfer_bench.cli import main
from ninfer_bench.suites import decode as dec
from ninfer_bench.engine.runtime.options import refuse_cuda_switches
from ninfer_bench.suites.decode import DecodeOptions, decode_runs, parse_spec, run_decode, run_matrix

BASE = dict(model="tiny", device="cpu", max_new_tokens=10, repeats=1, warmup=0)


def test_parse_spec():
    assert parse_spec("none", 5) == ("none", None)
    assert parse_spec("mtp", None) == ("mtp", 3)
    assert parse_spec("dflash2", None) == ("dflash2", 7)
    assert parse_spec("dflash2", 4) == ("dflash2", 4)
    assert parse_spec(" mtp:2 ", 9) == ("mtp", 2)
    for bad in ("eagle", "none:3", "mtp:0", "mtp:x", "mtp:"):
        with pytest.raises(ValueError):
            parse_spec(bad, None)


def test_grid_and_labels():
    runs = decode_runs(BASE, engines=("ours", "hf"), specs=("none", "mtp:2", "dflash2"), runtimes=("v3", "v2"),
                       rollbacks=("recompute", "snapshot"))
    labels = [r.label for r in runs]
    # spec none runs once per runtime (no rollback to choose), the peer once
    assert labels == ["v3-none", "v3-mtp-k2-recompute", "v3-mtp-k2-snapshot", "v3-dflash2-k7-recompute",
                      "v3-dflash2-k7-snapshot", "v2-none", "v2-mtp-k2-recompute", "v2-mtp-k2-snapshot",
                      "v2-dflash2-k7-recompute", "v2-dflash2-k7-snapshot", "hf-peer"]
    assert runs[-1].engine == "hf" and runs[-1].engine_options.spec == "none"
    one = decode_runs(BASE, specs=("dflash2",), draft_tokens=7, label="mine")
    # a speculative run brings its plain partner (first), labelled after it
    assert [(r.label, r.baseline, r.engine_options.spec) for r in one] == [("mine-plain", True, "none"),
                                                                          ("mine", False, "dflash2")]
    assert one[1].engine_options.draft_tokens == 7
    alone = decode_runs(BASE, specs=("dflash2",), label="mine", baseline=False)
    assert [r.label for r in alone] == ["mine"]
    later = decode_runs(BASE, specs=("mtp:2", "none"))  # plain runs go first, whatever the order asked
    assert [r.label for r in later] == ["v3-none", "v3-mtp-k2"] and not any(r.baseline for r in later)
    pre = decode_runs(BASE, specs=("none", "mtp"), label="rc1")
    assert [r.label for r in pre] == ["rc1-v3-none", "rc1-v3-mtp-k3"]
    heads = decode_runs(BASE, specs=("none", "dflash2:7"), lm_heads=(0, 256))
    assert [(r.label, r.engine_options.lm_head_draft) for r in heads] == [("v3-none", 0), ("v3-dflash2-k7", 0),
                                                            ("v3-dflash2-k7-lmh256", 256)]
    ahead = decode_runs(BASE, specs=("none", "mtp:2"), switches={"lookahead": (True, False)})
    assert [(r.label, r.engine_options.lookahead) for r in ahead] == [("v3-none", True), ("v3-none-sync", False),
                                                      ("v3-mtp-k2", True), ("v3-mtp-k2-sync", False)]
    graphs = decode_runs(BASE, specs=("none", "mtp:3", "dflash2:7"), switches={"draft_graphs": (True, False)})
    assert [(r.label, r.engine_options.draft_graphs) for r in graphs] == [("v3-none", True), ("v3-mtp-k3", True),
                                                          ("v3-mtp-k3-eagerdraft", False), ("v3-dflash2-k7", True),
                                                              ("v3-dflash2-k7-eagerdraft", False)]
    pdl = decode_runs(BASE, specs=("none", "dflash2:7"), switches={"pdl": (True, False)})
    assert [(r.label, r.engine_options.pdl) for r in pdl] == [("v3-none", True), ("v3-none-nopdl", False),
                                                              ("v3-dflash2-k7", True), ("v3-dflash2-k7-nopdl", False)]
    build = decode_runs(BASE, specs=("none",),
                        switches={"side_stream": (True, False), "silu_epilogue": (True, False)})
    assert [(r.label, r.engine_options.side_stream, r.engine_options.silu_epilogue) for r in build] == [
        ("v3-none", True, True), ("v3-none-nosilu", True, False), ("v3-none-noside", False, True),
        ("v3-none-noside-nosilu", False, False)]
    nosilu = decode_runs(BASE, specs=("none", "mtp:2"), switches={"silu_epilogue": (False,)})
    assert nosilu[1].label == "v3-mtp-k2-nosilu"
    v2 = decode_runs(BASE, specs=("none",), runtimes=("v3", "v2"),
                     switches={"pdl": (False,), "side_stream": (True, False)})
    # v2: no graphs, no fused kernels, one run
    assert [(r.label, r.engine_options.pdl, r.engine_options.side_stream) for r in v2] == [
        ("v3-none-nopdl", False, True), ("v3-none-nopdl-noside", False, False), ("v2-none", True, True)]
    with pytest.raises(ValueError, match="plain greedy"):
        decode_runs(BASE, engines=("hf",), specs=("mtp",))


def test_a_speculative_runs_plain_partner_shares_every_switch_plain_runs_have():
    """The switches that apply to plain runs too (every "v3" one) are the workload a speculative run's plain partner
    shares: the baseline a speculative run brings copies them, and a drafting-only switch splits no workload."""
    from ninfer_bench.engine.runtime.options import SWITCHES

    assert set(dec.SHARED_SWITCHES) == {n for n, sw in SWITCHES.items() if sw.applies == "v3"}
    assert {"lookahead", "layer_prefill", "cudnn_prefill"} <= set(dec.SHARED_SWITCHES)
    assert not {"draft_graphs", "draft_attention"} & set(dec.SHARED_SWITCHES)
    plain, spec = decode_runs(BASE, specs=("dflash2:7",), switches={"layer_prefill": (False,), "lookahead": (False,)})
    assert plain.baseline and not plain.engine_options.layer_prefill and not plain.engine_options.lookahead
    assert plain.workload() == spec.workload()
    g = decode_runs(BASE, specs=("none", "mtp:2"), switches={"draft_graphs": (True, False)})
    assert len(g) == 3 and g[0].workload() == g[1].workload() == g[2].workload()
    ahead = decode_runs(BASE, specs=("none", "mtp:2"), switches={"lookahead": (True, False)})
    assert ahead[0].workload() != ahead[1].workload()
    assert ahead[0].workload() == ahead[2].workload() and ahead[1].workload() == ahead[3].workload()


def test_matrix_loads_once_and_equals_separate_runs(monkeypatch):
    runs = decode_runs(BASE, specs=("none", "mtp:2", "dflash2:3"), runtimes=("v3",))
    loads = []
    real = dec.load_model
    monkeypatch.setattr(dec, "load_model", lambda o: loads.append(o) or real(o))
    docs = run_matrix(runs)
    assert len(loads) == 1  # one load shared by the three runs
    for opts, doc in zip(decode_runs(BASE, specs=("none", "mtp:2", "dflash2:3")), docs):
        eo = opts.engine_options
        alone = run_decode(DecodeOptions.make(**{**BASE, "spec": eo.spec, "draft_tokens": eo.draft_tokens}))
        assert doc["summary"]["tokens_sha256"] == alone["summary"]["tokens_sha256"]
        assert doc["summary"]["accepted_tokens"] == alone["summary"]["accepted_tokens"]
        assert doc["label"] == opts.label


def test_a_run_the_weights_cannot_draft_for_is_refused_before_the_grid_starts(monkeypatch):
    """--spec none,dflash on weights without a DFlash drafter (or mtp without an MTP head): the error comes before
    the plain run, not after it (its result would be lost)."""
    started = []
    real = dec.run_decode
    monkeypatch.setattr(dec, "run_decode", lambda *a, **kw: started.append(a) or real(*a, **kw))
    real_load = dec.load_model

    def without_drafters(opts):
        loaded = real_load(opts)
        loaded.drafters.pop("dflash", None)
        return loaded

    monkeypatch.setattr(dec, "load_model", without_drafters)
    with pytest.raises(ValueError, match="--spec dflash needs a dflash drafter"):
        run_matrix(decode_runs(BASE, specs=("none", "dflash:3")))
    assert started == []


def test_plain_agreement_flags_speculative_runs_that_decode_other_tokens():
    def doc(label, engine, runtime, spec, sha):
        return {"label": label, "config": {"engine": engine, "runtime": runtime, "spec": spec},
                "summary": {"tokens_sha256": sha}}

    docs = [doc("v3-none", "ours", "v3", "none", "a"), doc("v3-mtp-k3", "ours", "v3", "mtp", "a"),
            doc("v3-dflash2-k7", "ours", "v3", "dflash2", "b"), doc("v2-mtp-k3", "ours", "v2", "mtp", "a"),
            doc("hf-peer", "hf", "v3", "none", "c")]
    assert dec.plain_agreement(docs) == {"v3-none": None, "v3-mtp-k3": True, "v3-dflash2-k7": False,
                                         "v2-mtp-k3": None, "hf-peer": None}


def test_cli_grid_writes_one_document_per_run(tmp_path):
    out = tmp_path / "runs"
    r = CliRunner().invoke(main, ["decode", "--model", "tiny", "--device", "cpu", "--spec", "none,mtp:2",
                                  "--runtime", "v3,v2", "-n", "6", "--repeats", "1", "--warmup", "0",
                                  "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["v2-mtp-k2.json", "v2-none.json", "v3-mtp-k2.json",
                                                      "v3-none.json"]
    docs = [json.loads(p.read_text()) for p in sorted(out.iterdir())]
    assert len({d["summary"]["tokens_sha256"] for d in docs}) == 1  # greedy: every run decodes the same tokens
    assert all(d["config"]["quant"] is None for d in docs)  # --quant builds only --synthetic weights
    assert "= plain" in r.output and "NO" not in r.output and "tokens differ" not in r.output
    # stderr is not a terminal here: progress comes as lines, one at each run's start
    assert all(f"decode 0/1 run {i}/4" in r.output for i in range(1, 5)), r.output
    taken = tmp_path / "file.json"
    taken.write_text("{}")
    r = CliRunner().invoke(main, ["decode", "--model", "tiny", "--spec", "none,mtp", "--json", str(taken)])
    assert r.exit_code == 1 and "folder" in r.output


def test_bad_outputs_and_options_fail_before_any_work(tmp_path):
    """Output paths that could not be written at the end, --prompts without a prompt set, and engine options are
    refused at once (a GPU run should not be thrown away at its end); the capacities reach the engine."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cases = [
        (["decode", "--model", "tiny", "--json", str(blocker / "x.json")], "cannot write"),
        (["decode", "--model", "tiny", "--prompts", "2"], "--prompts"),
        (["decode", "--model", "tiny", "--max-concurrency", "0"], "max-concurrency"),
        (["kernels", "--shape", "tiny", "--json", str(blocker / "k.json")], "cannot write"),
        (["niah", "--model", "tiny", "--ctx", "512", "--heatmap", str(blocker / "h.png")], "cannot write"),
        (["oracle", "niah", "--model", "tiny", "--ctx", "512,1024", "--out", str(tmp_path / "o.json.gz")],
         "one context"),
        (["concurrency", "--url", "localhost:9", "-c", "1"], "--url"),
        (["concurrency", "--url", "http://127.0.0.1:9", "-c", "1", "-n", "4"], "127.0.0.1:9"),
        (["decode", "--model", "tiny", "--spec", "none", "-k", "5"], "-k 5 is speculative decoding's drafts"),
        (["generate", "tiny", "-p", "x", "-k", "5"], "draft-tokens (-k 5) is speculative decoding's drafts"),
    ]
    if Path("/proc/self").is_dir():  # a folder whose permission bits allow writing, where no file can be made
        cases.append((["decode", "--model", "tiny", "--json", "/proc/nope.json"], "cannot write /proc/nope.json"))
    for args, message in cases:
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output, (args, r.output)
    for label in ("../x", "a/b", "..", ""):  # a label names a file in the grid's folder
        r = CliRunner().invoke(main, ["decode", "--model", "tiny", "--label", label, "--json", str(tmp_path / "g")])
        assert r.exit_code == 2 and "a label is a file name" in r.output, (label, r.output)
    assert not (tmp_path / "g").exists() and not (tmp_path / "x").exists()
    assert not list(tmp_path.glob("o*.json.gz"))
    opts = DecodeOptions.make(**BASE, max_concurrency=2, kv_capacity=300)
    eng_opts = opts.engine_options
    assert (eng_opts.max_concurrency, eng_opts.kv_capacity) == (2, 300)


def test_prompt_sets_refuse_malformed_records(tmp_path):
    """A .jsonl prompt set: each record is an object with a string 'text' or a list of integer 'ids' (not both);
    anything else is refused naming the file and line, and --prompts beyond the set's size is refused."""
    from ninfer_bench.engine.artifact.tokenizer import ByteTokenizer
    from ninfer_bench.suites.common import read_prompt_set

    tok = ByteTokenizer(300)
    bad = {'[1, 2, 3]': "a JSON object", '{"text": 12345}': "'text' must be a string",
           '{"text": null, "ids": null}': "got neither", '{"ids": [[1, 2], [3]]}': "'ids' must be a list of integers",
           '{"ids": "hello"}': "'ids' must be a list of integers", '{"ids": [5.9, 7.2]}': "list of integers",
           '{"ids": [true]}': "list of integers", '{"text": "a", "ids": [97]}': "got both", '{"text": ""}': "empty"}
    for line, message in bad.items():
        path = tmp_path / "set.jsonl"
        path.write_text('{"id": "ok", "text": "x"}\n\n' + line + "\n")
        with pytest.raises(ValueError, match=message) as err:
            read_prompt_set(path, tok)
        assert f"{path}:3:" in str(err.value), line
    path.write_text('{"id": "a", "text": "xy"}\n{"ids": [1, 2]}\n')
    assert read_prompt_set(path, tok) == [{"id": "a", "prompt_ids": [120, 121]}, {"id": "2", "prompt_ids": [1, 2]}]
    r = CliRunner().invoke(main, ["decode", "--model", "tiny", "--prompt-file", str(path), "--prompts", "3"])
    assert r.exit_code == 1 and "--prompts 3" in r.output and "holds 2 prompt(s)" in r.output, r.output


def test_hf_peer_counts_the_weight_bytes_a_step_reads_as_the_engine_does():
    """The roofline fraction of the transformers peer and of our engine must count the same bytes: an untied
    embedding table is looked up one row a step, not read whole (the 27B shape's 2.5 GB table would inflate the
    peer's fraction by 5%). On fp32 weights both hold the same numbers, so the counts are equal."""
    import torch

    from ninfer_bench.engine.artifact.loader import load_source
    from ninfer_bench.engine.runtime.options import EngineOptions
    from ninfer_bench.engine.runtime.engine import Engine
    from ninfer_bench.suites.hf_peer import HFPeer, transformers_model

    loaded = load_source("tiny", synthetic=True, quant="fp32", device=torch.device("cpu"))
    assert not loaded.config.tie_word_embeddings
    cpu = torch.device("cpu")
    peer = HFPeer(transformers_model(loaded, cpu, torch.float32), loaded, cpu, torch.float32)
    ours = Engine(loaded, EngineOptions(device="cpu")).weight_bytes_per_step
    table = peer.model.get_input_embeddings().weight
    assert table.shape[0] > 1 and peer.weight_bytes_per_step == ours
    assert sum(p.numel() * p.element_size() for p in peer.model.parameters()) - ours == \
        (table.shape[0] - 1) * table.shape[1] * 4


def test_decode_tables_show_the_spread_of_the_repeats(tmp_path):
    """``--repeats N`` reports the median with the repeats' sample standard deviation and their count (llama-bench's
    t/s ± stddev), computed from the per-repeat samples in the document."""
    import statistics

    from rich.console import Console

    from ninfer_bench.cli.suites import compare_table, decode_table

    doc = run_decode(DecodeOptions.make(**{**BASE, "repeats": 3}))
    samples = doc["summary"]["samples"]["decode_tok_s"]
    assert len(samples) == 3 and doc["summary"]["decode_tok_s"] == statistics.median(samples)
    console = Console(width=200, record=True)
    console.print(decode_table(doc))
    console.print(compare_table([doc], {}))
    text = console.export_text()
    sd = statistics.stdev(samples)
    assert f"{statistics.median(samples):.1f} ± {sd:.1f} (n=3)" in text
    assert "± sd" in text and f"{sd:.1f}" in text.split("± sd")[1]


@pytest.mark.parametrize("flags, named", [(["--pdl", "off"], "--pdl off"),
                                          (["--lookahead", "on,off", "--silu-epilogue", "off"],
                                           "--lookahead off, --silu-epilogue off"),
                                          (["--cudnn-prefill", "off"], "--cudnn-prefill off")])
def test_cuda_only_switches_off_are_refused_on_a_cpu(monkeypatch, flags, named):
    """On a CPU the engine takes no graphs and no fused kernels: a run with a switch away from its default would be
    the default run relabelled (-nopdl, -sync, -nocudnnpast, ...), so it is refused before the weights load; the
    default runs."""
    monkeypatch.setattr(dec, "load_model", lambda o: pytest.fail("the weights loaded"))
    r = CliRunner().invoke(main, ["decode", "--model", "tiny", "--device", "cpu", *flags])
    assert r.exit_code == 1 and f"error: {named}: " in r.output and "CUDA" in r.output, r.output
    with pytest.raises(ValueError, match="--side-stream off"):
        refuse_cuda_switches("cpu", {"pdl": (True,), "side_stream": (True, False)})
    refuse_cuda_switches("cpu", {"pdl": (True,), "side_stream": (True,), "cudnn_prefill": (True,)})


def test_niah_takes_the_cudnn_split_on_cuda_only(monkeypatch, tmp_path):
    """``niah --cudnn-prefill on|off`` (the split on by default): off is refused on a CPU before any work (the CPU
    never splits); on CUDA the engine gets the switch, the default run keeps the plain label and one with it off is
    labelled ``-nocudnnpast``."""
    import ninfer_bench.suites.niah as niah_suite

    r = CliRunner().invoke(main, ["niah", "--model", "tiny", "--ctx", "256", "--device", "cpu",
                                  "--cudnn-prefill", "off"])
    assert r.exit_code == 1 and "error: --cudnn-prefill off: " in r.output, r.output
    seen = {}

    def fake_run(opts, progress=None):
        seen["eo"], seen["opts"] = opts.engine_options, opts
        raise SystemExit(0)

    monkeypatch.setattr(niah_suite, "run_niah", fake_run)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # run_niah is faked: nothing touches a GPU
    for value, label in (("on", "v3-niah"), ("off", "v3-niah-nocudnnpast")):
        r = CliRunner().invoke(main, ["niah", "--model", "tiny", "--ctx", "256", "--device", "cuda",
                                      "--cudnn-prefill", value])
        assert r.exit_code == 0 and seen["eo"].cudnn_prefill is (value == "on"), r.output
        assert niah_suite.niah_label(seen["opts"]) == label
    assert niah_suite.niah_label(niah_suite.NiahOptions.make(tensor_parallel=2)) == "v3-niah-tp2"


def test_prompt_length_grid_cuts_exact_prompts_from_the_code_text(tmp_path):
    """-p N,M: the grid once for each length, on a prompt of exactly that many tokens of the shipped code text, each
    run labelled -pN, its prefill beside its decode in the table, and different lengths different experiments."""
    from ninfer_bench.reports.experiment import config_differences
    from ninfer_bench.suites.common import CODE_TEXT, code_prompt

    out = tmp_path / "p"
    r = CliRunner().invoke(main, ["decode", "--model", "tiny", "--device", "cpu", "-p", "24,40", "--spec", "none,mtp:2",
                                  "-n", "5", "--repeats", "1", "--warmup", "0", "--json", str(out)])
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in out.iterdir())
    assert names == ["v3-mtp-k2-p24.json", "v3-mtp-k2-p40.json", "v3-none-p24.json", "v3-none-p40.json"]
    docs = {p.stem: json.loads(p.read_text()) for p in out.iterdir()}
    for name, doc in docs.items():
        n = int(name.rsplit("-p", 1)[1])
        assert doc["summary"]["prompt_tokens"] == n and doc["config"]["prompt_length"] == n
        assert Path(doc["config"]["prompt_file"]).name == CODE_TEXT.name
    assert docs["v3-none-p24"]["summary"]["tokens_sha256"] == docs["v3-mtp-k2-p24"]["summary"]["tokens_sha256"]
    assert "prompt" in r.output and "NO" not in r.output and "differ" not in r.output
    assert any("prompt_length" in d for d in config_differences(docs["v3-none-p24"], docs["v3-none-p40"]))

    from ninfer_bench.engine.runtime.engine import Engine

    tok = Engine.load("tiny", device="cpu").tokenizer
    whole = tok.encode(CODE_TEXT.read_text(encoding="utf-8"))
    assert code_prompt(tok, 40) == whole[:40]
    long = code_prompt(tok, 2 * len(whole) + 3)  # longer than the text: its tokens again, then cut
    assert len(long) == 2 * len(whole) + 3 and long[len(whole):2 * len(whole)] == whole
    for bad in (0, -5, True, 2.5):
        with pytest.raises(ValueError):
            code_prompt(tok, bad)


def test_prompt_lengths_size_the_context_and_refuse_other_prompts(tmp_path):
    runs = decode_runs(dict(BASE, max_new_tokens=100), prompt_lengths=(512, 9000, 512))
    assert [(r.label, r.prompt_length, r.engine_options.max_context) for r in runs] == [
        ("v3-none-p512", 512, None), ("v3-none-p9000", 9000, 9100)]  # the default holds 612; 9,100 it must be told
    given = decode_runs(dict(BASE, max_context=4096), prompt_lengths=(9000,))
    assert given[0].engine_options.max_context == 4096  # given: kept (the engine then refuses what does not fit)
    with pytest.raises(ValueError, match="positive prompt lengths"):
        decode_runs(BASE, prompt_lengths=(0,))
    with pytest.raises(ValueError, match="without --prompt-file"):
        DecodeOptions.make(**BASE, prompt_length=64, prompts=2)
    prompt = tmp_path / "q.txt"
    prompt.write_text("x = 1\n")
    for extra in (["--prompt-file", str(prompt)], ["--url", "http://127.0.0.1:9"], ["--prompts", "2"]):
        r = CliRunner().invoke(main, ["decode", "--model", "tiny", "-p", "64", *extra])
        assert r.exit_code == 1 and "-p" in r.output, r.output
    r = CliRunner().invoke(main, ["decode", "--model", "tiny", "-p", "64,x"])
    assert r.exit_code == 1 and "comma-separated integers" in r.output


def test_prefill_chunk_grid_runs_ours_once_a_chunk_and_the_peer_once(tmp_path):
    """--prefill-chunk A,B (llama-bench's -ub grid): our runs once for each chunk size, labelled -cN, a speculative
    run beside the plain run of its own chunk; the peer (its prefill does not chunk) once a prompt length; the
    same tokens at every chunk (the chunk changes how the prompt is cut, not what it computes, on the CPU)."""
    runs = decode_runs(BASE, engines=("ours", "hf"), specs=("mtp:2",), prompt_lengths=(40,),
                       prefill_chunks=(16, 64))
    assert [(r.label, r.engine_options.prefill_chunk, r.baseline) for r in runs] == [
        ("v3-none-p40-c16", 16, True), ("v3-none-p40-c64", 64, True), ("v3-mtp-k2-p40-c16", 16, False),
        ("v3-mtp-k2-p40-c64", 64, False), ("hf-peer-p40", 16, False)]
    with pytest.raises(ValueError, match="add --engine ours"):
        decode_runs(BASE, engines=("hf",), prefill_chunks=(16, 64))
    one = decode_runs(BASE, prefill_chunks=(32,))  # one size: no -c in the label
    assert [(r.label, r.engine_options.prefill_chunk) for r in one] == [(None, 32)]

    out = tmp_path / "c"
    r = CliRunner().invoke(main, ["decode", "--model", "tiny", "--device", "cpu", "-p", "40", "--prefill-chunk",
                                  "16,64", "-n", "4", "--repeats", "1", "--warmup", "0", "--json", str(out)])
    assert r.exit_code == 0, r.output
    docs = {p.stem: json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(docs) == ["v3-none-p40-c16", "v3-none-p40-c64"]
    hashes = {d["summary"]["tokens_sha256"] for d in docs.values()}
    assert hashes == {docs["v3-none-p40-c16"]["summary"]["tokens_sha256"]}
    assert docs["v3-none-p40-c16"]["config"]["prefill_chunk"] == 16
    r = CliRunner().invoke(main, ["decode", "--model", "tiny", "--prefill-chunk", "16,x"])
    assert r.exit_code == 1 and "comma-separated integers" in r.output


def test_warmup_prompt_warms_up_on_a_short_prompt_and_times_the_long_one(monkeypatch, tmp_path):
    """--warmup-prompt N: each warm-up runs a prompt of N tokens cut from the code text (a 262K-token run warms its
    kernels and graphs without prefilling twice); the timed repeats run the -p prompt; the result records N."""
    seen = []
    real = dec.run_once

    def spy(engine, prompts, opts, references=None, tokens_out=None):
        seen.append([len(p) for p in prompts])
        return real(engine, prompts, opts, references, tokens_out)

    monkeypatch.setattr(dec, "run_once", spy)
    out = tmp_path / "w.json"
    r = CliRunner().invoke(main, ["decode", "--model", "tiny", "--device", "cpu", "-p", "60", "-n", "4", "--repeats",
                                  "1", "--warmup", "2", "--warmup-prompt", "12", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert seen == [[12], [12], [60]]
    doc = json.loads(out.read_text())
    assert doc["config"]["warmup_prompt"] == 12 and doc["summary"]["prompt_tokens"] == 60
    assert "2 on a 12-token prompt" in r.output  # the table says how the run was warmed up
    from ninfer_bench.cli.suites import decode_table
    from rich.console import Console

    def rendered(config):
        console = Console(width=200, record=True)
        console.print(decode_table({**doc, "config": {**doc["config"], **config}}))
        return console.export_text()

    assert "first-use compiles" in rendered({"warmup": 0, "warmup_prompt": None, "device": "cuda:0"})
    assert "warm-up" not in rendered({"warmup": 0, "warmup_prompt": None, "device": "cpu"})  # nothing compiled at first use
    assert "warm-up" not in rendered({"warmup": 1, "warmup_prompt": None, "device": "cuda:0"})
    seen.clear()
    run_decode(DecodeOptions.make(**dict(BASE, warmup=1), prompt_length=30))  # without it: the timed prompt
    assert seen == [[30], [30]]
    for kw, match in ((dict(warmup=0, warmup_prompt=8), "--warmup 1 or more"),
                      (dict(warmup=1, warmup_prompt=0), "positive prompt length"),
                      (dict(warmup=1, warmup_prompt=True), "positive prompt length"),
                      (dict(warmup=1, warmup_prompt=8, replay_acceptance=0.5), "replay")):
        with pytest.raises(ValueError, match=match):
            DecodeOptions.make(**{**BASE, **kw})
    r = CliRunner().invoke(main, ["decode", "--url", "http://127.0.0.1:9", "--model", "tiny", "--warmup-prompt", "8"])
    assert r.exit_code != 0 and "--warmup-prompt" in r.output
