"""lm-evaluation-harness against ``serve``: a loglikelihood task through ``local-completions`` with the tokenizer of
``export-tokenizer`` and no network, each sample's log-likelihood and greediness equal to the engine's own scoring
(``Engine.score``). lm_eval is the ``[eval]`` extra and in ``[test]`` (CI runs the task); the test skips only where
it is not installed. The contract it relies on - token-id prompts tokenized by the exported tokenizer, ``echo`` +
``logprobs: 1`` + ``max_tokens: 1``, read as lm_eval reads the answer - is tested here in process either way."""

from __future__ import annotations

import json
import math

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from ninfer_bench.engine import Engine  # noqa: E402
from ninfer_bench.engine.artifact.loader import default_model  # noqa: E402
from ninfer_bench.engine.artifact.tokenizer_export import export_tokenizer, tokenizer_source  # noqa: E402
from ninfer_bench.engine.serve.app import create_app  # noqa: E402
from ninfer_bench.engine.serve.engine_thread import Backend  # noqa: E402

MODEL = default_model()
CONTEXT = 256
TOL = 2e-3  # a sum of a few fp32 log-probabilities, prefilled in other chunks than the reference's
DOCS = [{"context": "def add(a, b):\n    return", "target": " a + b"},
        {"context": "for i in range(10):\n    print(", "target": "i)"},
        {"context": "import numpy as", "target": " np"},
        {"context": "class Stack:\n    def push(self, item):\n        self.items.", "target": "append(item)"},
        {"context": "# sum of a list\ntotal = ", "target": "sum(values)\n"}]


def encode_pair(hf, context: str, target: str) -> tuple[list[int], list[int]]:
    """lm_eval's split of a request (``TemplateLM._encode_pair``): trailing spaces move to the continuation, the
    whole is encoded once and the context's length cut off it."""
    n = len(context) - len(context.rstrip())
    if n:
        context, target = context[:-n], context[-n:] + target
    whole = hf.encode(context + target, add_special_tokens=False)
    ctx = hf.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    tok, meta, data = tokenizer_source(MODEL)
    export_tokenizer(tok, folder, meta, data)
    return folder, transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def engine_and_expected(exported):
    """An engine, and each doc's (log-likelihood, greedy) from its own scoring of the ids lm_eval would send (made
    before the engine serves: scoring runs in the caller's thread)."""
    eng = Engine.load(MODEL, device="cpu", max_context=CONTEXT, max_concurrency=2)
    hf = exported[1]
    out = []
    for doc in DOCS:
        ctx, cont = encode_pair(hf, doc["context"], doc["target"])
        ids = ctx + cont
        assert ids == eng.tokenizer.encode(doc["context"] + doc["target"])  # the exported tokenizer: the engine's ids
        scores = eng.score(ids, top=1)
        span = range(len(ctx) - 1, len(ids) - 1)  # rows predicting the continuation's tokens
        out.append((sum(float(scores.own[k]) for k in span),
                    all(int(scores.ids[k, 0]) == ids[k + 1] for k in span)))
    return eng, out


def test_loglikelihood_requests_score_as_the_engine_does(exported, engine_and_expected):
    """What local-completions sends for a batch of loglikelihood requests (token ids from the exported tokenizer,
    ``echo``, ``logprobs: 1``, ``max_tokens: 1``, ``temperature: 0``, a seed), read as it reads the answer
    (``token_logprobs[ctxlen:-1]`` summed, greedy when each is its top list's best): the engine's own scores."""
    hf = exported[1]
    eng, expected = engine_and_expected
    pairs = [encode_pair(hf, d["context"], d["target"]) for d in DOCS]
    backend = Backend(eng, session_capacity=0)
    with TestClient(create_app(backend, 1 << 20)) as http:
        r = http.post("/v1/completions", json={"model": backend.model_id, "prompt": [c + t for c, t in pairs],
                                               "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
                                               "echo": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(DOCS)
    for (ctx, cont), choice, (ll, greedy) in zip(pairs, choices, expected):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ctx) + len(cont) + 1  # the prompt's, then the generated token's
        got = lp["token_logprobs"][len(ctx):-1]
        assert math.isclose(sum(got), ll, abs_tol=TOL), (sum(got), ll)
        best = all(t == max(top.values()) for t, top in zip(got, lp["top_logprobs"][len(ctx):-1]))
        assert best == greedy


TASK = """task: ninfer_offline_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def test_lm_eval_local_completions_runs_a_loglikelihood_task_offline(tmp_path, monkeypatch, exported,
                                                                     engine_and_expected):
    """lm_eval's ``local-completions`` (tokenizer_backend huggingface: the exported folder; tokenized requests, two
    a batch) against a ``serve`` subprocess on a locally defined task (a JSONL file, no download): every sample's
    log-likelihood and greediness are the engine's, and the accuracy is their mean."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # the datasets cache of the JSON file: not the user's
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    from serveproc import ServeProcess

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(docs=docs))
    server = ServeProcess(MODEL, tmp_path / "serve.log", max_context=CONTEXT)
    try:
        res = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": f"{server.url}/v1/completions", "model": server.model,
                        "tokenizer_backend": "huggingface", "tokenizer": str(exported[0]), "tokenized_requests": True,
                        "max_length": CONTEXT, "num_concurrent": 1, "max_retries": 1, "batch_size": 2},
            tasks=["ninfer_offline_ll"], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
            log_samples=True, bootstrap_iters=0)
    finally:
        server.stop()
    expected = engine_and_expected[1]
    samples = sorted(res["samples"]["ninfer_offline_ll"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    for s, (ll, greedy) in zip(samples, expected):
        got_ll, got_greedy = s["filtered_resps"][0]
        assert math.isclose(got_ll, ll, abs_tol=TOL), (s["doc"], got_ll, ll)
        assert got_greedy == greedy, s["doc"]
    acc = res["results"]["ninfer_offline_ll"]["acc,none"]
    assert math.isclose(acc, sum(g for _, g in expected) / len(DOCS))
