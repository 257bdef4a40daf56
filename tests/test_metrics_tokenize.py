"""``/metrics`` (Prometheus, a registry per app), ``/tokenize`` and ``/detokenize`` (vLLM's shapes) and the API key
over them: in-process servers (FastAPI's TestClient, the engine thread running) of the bundled model on the CPU."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
prometheus_client = pytest.importorskip("prometheus_client")

from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ninfer_bench.engine import Engine  # noqa: E402
from ninfer_bench.engine.artifact.loader import default_model  # noqa: E402
from ninfer_bench.engine.serve.app import create_app  # noqa: E402
from ninfer_bench.engine.serve.engine_thread import Backend  # noqa: E402
from ninfer_bench.engine.serve.guard import AccessPolicy  # noqa: E402
from ninfer_bench.engine.sampling import SamplingParams  # noqa: E402

MODEL = default_model()
CONTEXT = 256
KEY = "sesame"


class Served:
    def __init__(self, engine: Engine, policy: AccessPolicy | None = None):
        self.backend = Backend(engine, session_capacity=0)
        self.http = TestClient(create_app(self.backend, 1 << 20, policy))
        self.http.__enter__()  # the lifespan: starts the engine thread
        self.model = self.backend.model_id

    def close(self) -> None:
        self.http.__exit__(None, None, None)

    def metrics(self, **headers) -> dict:
        """{sample name: {labels as a sorted tuple: value}} of a scrape."""
        r = self.http.get("/metrics", headers=headers)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        out: dict = {}
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out


def value(m: dict, name: str, **labels) -> float:
    return m.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


@pytest.fixture(scope="module")
def plain():
    s = Served(Engine.load(MODEL, device="cpu", max_context=CONTEXT, max_concurrency=2))
    yield s
    s.close()


@pytest.fixture(scope="module")
def keyed():
    """A server with an API key: the random tiny preset (its byte tokenizer)."""
    s = Served(Engine.load("tiny", device="cpu", max_context=128, max_concurrency=1),
               AccessPolicy(api_key=KEY))
    yield s
    s.close()


def test_metrics_count_requests_tokens_and_latencies(plain):
    """Requests by route and status (a streamed chat, completions with n = 2, a 400, an unknown path), prompt and
    generated tokens as the usage counts them, one TTFT / e2e / queue observation per generation and one inter-token
    gap per further token (plain decoding commits one at a time); /metrics scrapes themselves are not counted."""
    s = plain
    before = s.metrics()
    r = s.http.post("/v1/completions", json={"model": s.model, "prompt": "def add(a, b):", "max_tokens": 5, "n": 2,
                                             "temperature": 0.7, "seed": 1, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage1 = r.json()["usage"]
    with s.http.stream("POST", "/v1/chat/completions", json={
            "model": s.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}) as resp:
        events = [json.loads(line[5:]) for line in resp.iter_lines()
                  if line.startswith("data:") and line.strip() != "data: [DONE]"]
    assert resp.status_code == 200
    usage2 = events[-1]["usage"]
    assert s.http.post("/v1/completions", json={"model": s.model, "prompt": "x", "max_tokens": 0}).status_code == 400
    assert s.http.get("/v1/nowhere").status_code == 404
    m = s.metrics()

    def grew(name, **labels):
        return value(m, name, **labels) - value(before, name, **labels)

    assert grew("ninfer_requests_total", endpoint="/v1/completions", status="200") == 1
    assert grew("ninfer_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert grew("ninfer_requests_total", endpoint="/v1/completions", status="400") == 1
    assert grew("ninfer_requests_total", endpoint="other", status="404") == 1
    assert not any(dict(k).get("endpoint") == "/metrics" for k in m["ninfer_requests_total"])
    # usage counts a prompt once for its n choices; each choice is prefilled (and counted) on its own
    prompt1 = usage1["prompt_tokens"] * 2
    assert grew("ninfer_prompt_tokens_total") == prompt1 + usage2["prompt_tokens"]
    assert grew("ninfer_prompt_tokens_cached_total") == 0
    generated = [5, 5, 4]
    assert usage1["completion_tokens"] + usage2["completion_tokens"] == sum(generated)
    assert grew("ninfer_generation_tokens_total") == sum(generated)
    for h in ("ninfer_time_to_first_token_seconds", "ninfer_e2e_request_latency_seconds",
              "ninfer_request_queue_time_seconds"):
        assert grew(f"{h}_count") == 3 and grew(f"{h}_bucket", le="+Inf") == 3, h
    assert grew("ninfer_time_to_first_token_seconds_sum") > 0
    assert grew("ninfer_inter_token_latency_seconds_count") == sum(n - 1 for n in generated)
    e2e = grew("ninfer_e2e_request_latency_seconds_sum")
    assert e2e >= grew("ninfer_time_to_first_token_seconds_sum")
    les = [float(dict(k)["le"]) for k in m["ninfer_e2e_request_latency_seconds_bucket"]]
    assert min(les) == 0.001 and max(x for x in les if x != float("inf")) == 60.0
    assert value(m, "ninfer_requests_running") == 0 and value(m, "ninfer_requests_waiting") == 0
    assert "ninfer_spec_decode_num_draft_tokens_total" not in m  # no drafter, no speculative metrics


def test_running_and_waiting_gauges_read_the_scheduler():
    """The gauges are the scheduler's queue and admitted requests at the time of the scrape (no engine thread
    here: the scheduler is stepped by hand)."""
    backend = Backend(Engine.load("tiny", device="cpu", max_context=64, max_concurrency=2), session_capacity=0)
    scrape = {}

    def read():
        fams = text_string_to_metric_families(backend.metrics.render()[0].decode())
        return {s.name: s.value for f in fams for s in f.samples if s.name.startswith("ninfer_requests_")
                and not s.labels}

    for _ in range(3):
        backend.scheduler.submit([5, 6, 7], SamplingParams(max_new_tokens=4))
    scrape["queued"] = read()
    backend.scheduler.step()  # two admitted into the two slots, one left waiting
    scrape["admitted"] = read()
    backend.scheduler.run_until_idle()
    scrape["idle"] = read()
    assert scrape["queued"] == {"ninfer_requests_running": 0, "ninfer_requests_waiting": 3}
    assert scrape["admitted"] == {"ninfer_requests_running": 2, "ninfer_requests_waiting": 1}
    assert scrape["idle"] == {"ninfer_requests_running": 0, "ninfer_requests_waiting": 0}


def test_speculative_counters_follow_the_drafter():
    """With a drafter: rounds, draft tokens and accepted tokens as the response's own timings count them, and the
    accepted tokens by draft position (0..k-1, each present, non-increasing: a position is accepted only after
    every earlier one) summing to the accepted tokens."""
    k = 3
    s = Served(Engine.load(MODEL, device="cpu", max_context=CONTEXT, max_concurrency=1, spec="dflash2",
                           draft_tokens=k))
    try:
        r = s.http.post("/v1/completions", json={"model": s.model, "prompt": "def fib(n):", "max_tokens": 24,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        t = r.json()["timings"]
        m = s.metrics()
    finally:
        s.close()
    assert t["draft_n"] > 0
    assert value(m, "ninfer_spec_decode_num_draft_tokens_total") == t["draft_n"]
    assert value(m, "ninfer_spec_decode_num_accepted_tokens_total") == t["draft_n_accepted"]
    assert value(m, "ninfer_spec_decode_num_drafts_total") * k == t["draft_n"]
    per = [value(m, "ninfer_spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(k)]
    assert len(m["ninfer_spec_decode_num_accepted_tokens_per_pos_total"]) == k
    assert sum(per) == t["draft_n_accepted"] and per == sorted(per, reverse=True)
    assert value(m, "ninfer_generation_tokens_total") == 24


def test_metrics_tokenize_and_detokenize_want_the_api_key(keyed, plain):
    """With an API key, /metrics, /tokenize and /detokenize refuse a request without it (401, OpenAI's shape) and
    answer one with it; /health stays open. Each app counts in its own registry: the refusals show in the keyed
    app's metrics, not in the other's."""
    s = keyed
    for method, path, body in (("GET", "/metrics", None), ("POST", "/tokenize", {"prompt": "a"}),
                               ("POST", "/detokenize", {"tokens": [97]})):
        r = s.http.request(method, path, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        r = s.http.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, (path, r.text)
        assert s.http.request(method, path, json=body, headers={"x-api-key": KEY}).status_code == 200
    assert s.http.get("/health").status_code == 200
    m = s.metrics(authorization=f"Bearer {KEY}")
    assert value(m, "ninfer_requests_total", endpoint="/tokenize", status="401") == 1
    assert value(m, "ninfer_requests_total", endpoint="/detokenize", status="200") == 2
    assert value(plain.metrics(), "ninfer_requests_total", endpoint="/tokenize", status="401") == 0


def test_tokenize_in_vllms_shape(plain):
    """A text or a conversation (the chat route's rendering: generation prompt on by default, off, or continuing
    the final message), the count and max_model_len beside the ids, the vocabulary strings when asked."""
    s, tok = plain, plain.backend.engine.tokenizer
    text = "def fib(n):\n    return n  # é 漢字 <|im_end|>"
    r = s.http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    ids = tok.encode(text)
    assert r.json() == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids, "token_strs": None}
    r = s.http.post("/tokenize", json={"model": s.model, "prompt": text, "add_special_tokens": False,
                                       "return_token_strs": True}).json()
    assert r["tokens"] == ids and r["token_strs"] == [tok.backend.id_to_token(i) for i in ids]
    assert "".join(r["token_strs"]).startswith("def\u0120f")  # byte-level: a space is \u0120
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Sure: "}]
    r = s.http.post("/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
    r = s.http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=False))
    r = s.http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False,
                                       "continue_final_message": True}).json()
    assert tok.decode(r["tokens"]).endswith("<|im_start|>assistant\nSure: ")
    # the chat route tokenizes the conversation the same way
    chat = s.http.post("/v1/chat/completions", json={"model": s.model, "messages": msgs[:2], "max_tokens": 1,
                                                     "return_token_ids": True}).json()
    assert s.http.post("/tokenize", json={"messages": msgs[:2]}).json()["tokens"] == chat["prompt_token_ids"]


def test_detokenize_and_the_refusals(plain, keyed):
    """/detokenize decodes with special tokens kept; ids the tokenizer has no token for (negative, past the
    vocabulary, a byte tokenizer's unnamed rows) are 400s naming the position; malformed bodies, both or neither of
    prompt / messages, unknown fields and another model are refused in the OpenAI shape."""
    s, tok = plain, plain.backend.engine.tokenizer
    ids = tok.encode("<|im_start|>user\nhé<|im_end|>")
    assert s.http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "<|im_start|>user\nhé<|im_end|>"}
    assert s.http.post("/detokenize", json={"model": s.model, "tokens": []}).json() == {"prompt": ""}
    bad = {"/detokenize": [({"tokens": [1, -1]}, 400, "tokens[1]"), ({"tokens": [tok.vocab_size]}, 400, "tokens[0]"),
                           ({"tokens": [2 ** 70]}, 400, "tokens[0]"), ({"tokens": [True]}, 400, "tokens"),
                           ({"tokens": "12"}, 400, "tokens"), ({}, 400, "tokens"),
                           ({"tokens": [1], "model": "other"}, 404, "not found"),
                           ({"tokens": [1], "skip_special_tokens": True}, 400, "unknown field")],
           "/tokenize": [({}, 400, "prompt"), ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400,
                                                 "not both"),
                         ({"prompt": 5}, 400, "prompt"), ({"prompt": "a", "model": "other"}, 404, "not found"),
                         ({"prompt": "a", "add_generation_prompt": True}, 400, "unknown field"),
                         ({"messages": []}, 400, "messages"),
                         ({"messages": [{"role": "user", "content": "a"}], "continue_final_message": True}, 400,
                          "add_generation_prompt false"),
                         ({"messages": [{"role": "user", "content": "a"}], "chat_template": "{{ x }}"}, 400,
                          "chat template"),
                         ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
                             "url": "data:image/png;base64,AA=="}}]}]}, 400, "no vision")]}
    for path, cases in bad.items():
        for body, status, words in cases:
            r = s.http.post(path, json=body)
            assert r.status_code == status, (path, body, r.text)
            err = r.json()["error"]
            assert words in err["message"] and err["type"] == "invalid_request_error", (path, body, err)
    assert s.http.post("/tokenize", content=b"{not json", headers={"content-type": "application/json"}
                       ).status_code == 400
    # the byte tokenizer (tiny preset): ids 260.. of its 512 rows have no token
    h = {"Authorization": f"Bearer {KEY}"}
    assert keyed.http.post("/detokenize", json={"tokens": [104, 105, 258]}, headers=h).json() == {
        "prompt": "hi<|im_end|>"}
    r = keyed.http.post("/detokenize", json={"tokens": [104, 300]}, headers=h)
    assert r.status_code == 400 and "token id 300" in r.json()["error"]["message"]
    r = keyed.http.post("/tokenize", json={"prompt": "a b", "return_token_strs": True}, headers=h).json()
    assert r["tokens"] == [97, 32, 98] and r["token_strs"] == ["a", "\u0120", "b"]
