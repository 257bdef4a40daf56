"""decode --url and niah --url: the suites against an OpenAI-compatible server (suites/remote.py). Against our own
`serve` of the bundled model they must give the tokens, oracle verdicts and KL of the in-process runs; a server that
takes no token ids, streams none and ignores ignore_eos (an httpx MockTransport) falls back and says so."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ninfer_bench.cli import main
from ninfer_bench.engine.artifact.loader import bundled_model_path
from ninfer_bench.reports.experiment import config_differences
from ninfer_bench.reports.gate import gate
from ninfer_bench.reports.schema import validate
from ninfer_bench.suites.common import tokens_sha256

BUNDLED = bundled_model_path()
DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port
pytestmark = pytest.mark.skipif(BUNDLED is None, reason="the bundled model is not in this checkout")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from serveproc import ServeProcess

    proc = ServeProcess(str(BUNDLED), tmp_path_factory.mktemp("serve") / "serve.log")
    yield proc
    proc.stop()


def invoke(*args: str):
    r = CliRunner().invoke(main, list(args))
    return r, " ".join(r.output.split())


def test_decode_url_gives_the_in_process_tokens(server, tmp_path):
    """Same prompt, same -n: the tokens a decode --url streams are the in-process run's (hash, counts); the document
    has the suite's summary keys, the server's settings and "server" for the engine; the gate sets it apart from
    the in-process run (a failing config row naming engine, device and url) but not from another run against the
    same server."""
    from ninfer_bench.suites.decode import DecodeOptions, run_decode

    local = run_decode(DecodeOptions.make(max_new_tokens=16, repeats=1, warmup=0, device="cpu"), copy_bw=1e9)
    r, out = invoke("decode", "--url", server.url, "-n", "16", "--repeats", "2", "--warmup", "0",
                    "--json", str(tmp_path / "u.json"))
    assert r.exit_code == 0, r.output
    assert "ITL p50 / p99 ms" in out and "tokens from │ server" in out
    doc = json.loads((tmp_path / "u.json").read_text())
    validate(doc)
    s, c = doc["summary"], doc["config"]
    assert s["tokens_sha256"] == local["summary"]["tokens_sha256"]
    assert (s["prompt_tokens"], s["completion_tokens"]) == (local["summary"]["prompt_tokens"], 16)
    assert set(local["summary"]) <= set(s) and s["deterministic"] and len(doc["records"]) == 2
    assert s["rounds"] == 15 and s["tokens_per_round"] == 1.0 and s["drafted_tokens"] == 0  # plain, as it reports
    assert all(len(s["samples"][k]) == 2 for k in ("decode_tok_s", "prefill_tok_s", "ttft_ms"))
    assert s["decode_tok_s"] > 0 and s["prefill_tok_s"] > 0 and s["ttft_ms"] > 0 and s["itl_ms_p50"] > 0
    assert s["peak_memory_bytes"] is None and s["device_ms_per_round"] is None  # the server's: not measured here
    assert (c["engine"], c["device"], c["url"], c["served_model"], c["spec"], c["max_context"]) == \
        ("server", "server", server.url, server.model, "none", 4096)
    assert (c["prompt_format"], c["tokens_from"], c["ignore_eos_honoured"]) == ("ids", "server", True)
    assert c["runtime"] is None and c["kv_dtype"] is None and c["prefill_chunk"] is None  # never this client's
    assert set(local["config"]) <= set(c)

    verdicts = gate(local, doc)
    assert verdicts[0].metric == "config" and verdicts[0].status == "fail"
    for what in ("engine 'ours' vs 'server'", "device 'cpu' vs 'server'", "url None vs", "model.served_model"):
        assert what in verdicts[0].reason, verdicts[0].reason

    # --model names the tokenizer: prompts tokenized here (checked against the server's), the same tokens
    r, _ = invoke("decode", "--url", server.url, "--model", str(BUNDLED), "-n", "16", "--repeats", "1", "--warmup",
                  "1", "--label", "again", "--json", str(tmp_path / "v.json"))
    assert r.exit_code == 0, r.output
    again = json.loads((tmp_path / "v.json").read_text())
    assert again["summary"]["tokens_sha256"] == s["tokens_sha256"]
    assert again["model"]["tokenizer"]["artifact_id"] == local["model"]["artifact_id"]
    assert config_differences(doc, again) == []  # one experiment: the same server, model and workload
    assert all(v.status != "fail" for v in gate(doc, again))


def test_niah_url_gives_the_in_process_verdicts(server, tmp_path):
    """A 2048-token case against the server: the answer tokens, the oracle verdict and the KL from the server's top
    log-probabilities equal the in-process run's; TTFT and prefill tok/s per case."""
    from ninfer_bench.suites.niah import NiahOptions, run_niah

    local = run_niah(NiahOptions.make(ctxs=(2048,), depths=(50,), device="cpu"))
    r, out = invoke("niah", "--url", server.url, "--ctx", "2048", "--depths", "50", "--json", str(tmp_path / "n.json"))
    assert r.exit_code == 0, r.output
    assert "oracle agreement 100% of 1" in out
    doc = json.loads((tmp_path / "n.json").read_text())
    validate(doc)
    (a,), (b,) = local["records"], doc["records"]
    assert b["tokens"] == a["tokens"] and b["answer"] == a["answer"] and b["retrieved"] == a["retrieved"]
    assert (b["pass"], b["first_divergence"]) == (a["pass"], a["first_divergence"]) and b["pass"] is True
    assert b["kl"] == pytest.approx(a["kl"], rel=1e-3, abs=1e-9)
    assert b["ttft_ms"] > 0 and b["prefill_tok_s"] > 0 and b["prompt_tokens"] == a["prompt_tokens"]
    assert doc["summary"]["oracle_agreement"] == local["summary"]["oracle_agreement"] == 1.0
    c = doc["config"]
    assert (c["device"], c["engine"], c["prompt_format"], c["tokens_from"], c["server_logprobs"]) == \
        ("server", "server", "ids", "server", True)
    assert doc["model"]["text_id"] == local["model"]["text_id"]  # the oracles' model: --model's (the bundled one)
    verdicts = gate(local, doc)
    assert verdicts[0].metric == "config" and verdicts[0].status == "fail" and "device 'cpu' vs 'server'" in \
        verdicts[0].reason


def test_url_errors_are_one_line(monkeypatch):
    """An unreachable server, engine flags with --url (even at their defaults), --served-model without --url,
    --rescore with --url, and a missing httpx: each one line, exit 1, before any work."""
    for args, says in (
            (["decode", "--url", DEAD, "-n", "4"], f"{DEAD}: cannot connect (ConnectError"),
            (["niah", "--url", DEAD, "--ctx", "512"], f"{DEAD}: cannot connect (ConnectError"),
            (["decode", "--url", DEAD, "--spec", "mtp", "--device", "cpu"], "--spec, --device configure the in-process"),
            (["decode", "--url", DEAD, "--runtime", "v3"], "--runtime configures the in-process engine"),
            (["niah", "--url", DEAD, "--kv-dtype", "int8"], "--kv-dtype configures the in-process engine"),
            (["niah", "--url", DEAD, "--prefill-chunk", "64"], "--prefill-chunk configures the in-process engine"),
            (["decode", "--served-model", "x"], "it needs --url"),
            (["niah", "--url", DEAD, "--rescore", __file__], "--rescore judges a saved document"),
            (["decode", "--url", "127.0.0.1:9"], "expected http://HOST:PORT")):
        r, out = invoke(*args)
        assert r.exit_code == 1 and says in out and "Traceback" not in r.output, (args, r.output)
        assert len(r.output.strip().splitlines()) <= 2, r.output  # (niah's progress line, then the error)
    monkeypatch.setitem(__import__("sys").modules, "httpx", None)  # as if it were not installed
    for cmd in ("decode", "niah"):
        r, out = invoke(cmd, "--url", DEAD)
        assert r.exit_code == 1 and "--url needs httpx: pip install 'ninfer-bench[client]'" in out, r.output


def text_only_server(answer: list[str], prompt_tokens: int = 7):
    """An httpx MockTransport of an OpenAI-compatible server that refuses token-id prompts, returns no token ids and
    no prompt_token_ids, and ends every completion after ``answer`` (finish "stop") whatever ignore_eos says."""
    import httpx

    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            if request.url.path == "/v1/models":
                return httpx.Response(200, json={"data": [{"id": "fake"}]})
            return httpx.Response(404, json={"detail": "Not Found"})
        body = json.loads(request.content)
        seen.append(body)
        if not isinstance(body["prompt"], str):
            return httpx.Response(400, json={"error": {"message": "prompt must be a string"}})
        if not body.get("stream"):
            return httpx.Response(200, json={"choices": [{"text": answer[0], "finish_reason": "length"}]})
        chunks = [{"choices": [{"text": piece, "finish_reason": None}]} for piece in answer]
        chunks += [{"choices": [{"text": "", "finish_reason": "stop"}]},
                   {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(answer)}}]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})

    return httpx.Client(transport=httpx.MockTransport(handle)), seen


def test_a_server_without_token_ids_falls_back_and_says_so():
    """Prompts go as text once the server refuses ids; tokens are the text's bytes (or --model's tokenization of
    it); a completion that ended early despite ignore_eos is recorded; nothing claims a drafting count the server
    did not report. NIAH: oracle agreement not available (None, with the reason), never a failure."""
    from ninfer_bench.engine.artifact.loader import load_source
    from ninfer_bench.suites.decode import DecodeOptions
    from ninfer_bench.suites.niah import NiahOptions
    from ninfer_bench.suites.remote import RemoteDecodeOptions, RemoteNiahOptions, run_decode_url, run_niah_url

    answer = [" return", " x", "\n"]
    url = "http://fake:8000"
    client, seen = text_only_server(answer)
    doc = run_decode_url(RemoteDecodeOptions(url, DecodeOptions.make(max_new_tokens=8, repeats=2, warmup=0)),
                         client=client)
    validate(doc)
    s, c = doc["summary"], doc["config"]
    assert (c["prompt_format"], c["tokens_from"], c["ignore_eos_honoured"], c["served_model"]) == \
        ("text", "text", False, "fake")
    assert s["tokens_sha256"] == tokens_sha256("".join(answer).encode())
    assert (s["completion_tokens"], s["prompt_tokens"]) == (3, 7) and s["prefill_tok_s"] > 0
    assert s["rounds"] is None and s["drafted_tokens"] is None and s["tokens_per_round"] is None
    assert all(isinstance(b["prompt"], str) for b in seen)  # no ids to offer: neither --model's nor the server's
    assert all(b["ignore_eos"] is True and b["temperature"] == 0.0 for b in seen if b.get("stream"))

    tok = load_source(None).tokenizer
    client, seen = text_only_server(answer)
    doc = run_decode_url(RemoteDecodeOptions(url, DecodeOptions.make(max_new_tokens=8, repeats=1, warmup=0,
                                                                     ignore_eos=False)), tokenizer=tok, client=client)
    assert doc["config"]["tokens_from"] == "tokenizer" and doc["config"]["ignore_eos_honoured"] is None
    assert doc["config"]["prompt_format"] == "text" and any(isinstance(b["prompt"], list) for b in seen)  # refused
    assert doc["summary"]["tokens_sha256"] == tokens_sha256(tok.encode("".join(answer)))

    client, seen = text_only_server([" 12", "\n"], prompt_tokens=2000)
    doc = run_niah_url(RemoteNiahOptions(url, NiahOptions.make(ctxs=(2048,), depths=(50,))), client=client)
    validate(doc)
    s, (rec,) = doc["summary"], doc["records"]
    assert s["oracle_agreement"] is None and s["oracle_cases"] == 0 and "takes no token-id prompts" in \
        s["oracle_unavailable"]
    assert rec["pass"] is None and rec["retrieved"] is False and rec["ttft_ms"] > 0
    assert rec["prefill_tok_s"] == pytest.approx(2000 / (rec["ttft_ms"] / 1e3))
    assert doc["config"]["prompt_format"] == "text" and isinstance(seen[-1]["prompt"], str)
