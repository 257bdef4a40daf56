"""OpenAI completions ``echo`` and prompt log-probabilities (what lm-evaluation-harness's ``local-completions``
loglikelihood requests send), the engine's compact prompt scores, and the server's context check worded in each
API's terms. In-process servers (FastAPI's TestClient, the engine thread running) of the bundled model on the CPU,
driven by the official clients; references come from a second engine's full-vocabulary logits."""

from __future__ import annotations

import math

import pytest
import torch

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from ninfer_bench.engine import Engine  # noqa: E402
from ninfer_bench.engine.runtime import scoring  # noqa: E402
from ninfer_bench.engine.serve.engine_thread import Backend  # noqa: E402
from ninfer_bench.engine.artifact.loader import default_model  # noqa: E402
from ninfer_bench.engine.runtime.engine import ContextOverflow  # noqa: E402
from ninfer_bench.engine.serve.app import create_app  # noqa: E402

MODEL = default_model()
CONTEXT = 256
PROMPT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
TOL = 1e-4  # fp32 on the CPU: the server prefills 16-token chunks, the reference the whole prompt at once


class Served:
    """An in-process server of ``engine`` with the official clients pointed at it."""

    def __init__(self, engine: Engine, **backend):
        self.backend = Backend(engine, session_capacity=backend.pop("session_capacity", 0), **backend)
        self.http = TestClient(create_app(self.backend, 1 << 20))
        self.http.__enter__()  # the lifespan: starts the engine thread
        self.model = self.backend.model_id
        self.openai = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                                    http_client=self.http)
        self.anthropic = anthropic.Anthropic(base_url="http://testserver", api_key="none", max_retries=0,
                                             http_client=self.http)

    def close(self) -> None:
        self.http.__exit__(None, None, None)

    def complete(self, **body) -> dict:
        r = self.http.post("/v1/completions", json={"model": self.model, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def reference():
    """An engine of its own for the expected values (one prefill of the whole prompt)."""
    return Engine.load(MODEL, device="cpu", max_context=CONTEXT, max_concurrency=1)


@pytest.fixture(scope="module")
def served():
    s = Served(Engine.load(MODEL, device="cpu", max_context=CONTEXT, max_concurrency=4, prefill_chunk=16),
               session_capacity=2)
    yield s
    s.close()


def log_softmax(reference: Engine, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(reference.logits(ids), dim=-1)  # [T, V]


def check_prompt_entries(lp, ids: list[int], ref: torch.Tensor, n: int) -> None:
    """The first ``len(ids)`` entries of a completion's logprobs object against the reference rows: the first
    token's null, each later token's own log-probability and its position's n most likely plus itself."""
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for k in range(1, len(ids)):
        row, own = ref[k - 1], lp["token_logprobs"][k]
        assert math.isclose(own, float(row[ids[k]]), abs_tol=TOL), k
        top = lp["top_logprobs"][k]
        best = row.topk(n).values.tolist()
        assert n <= len(top) <= n + 1 and top[lp["tokens"][k]] == own
        assert sorted(top.values(), reverse=True)[:n] == pytest.approx(best, abs=TOL)


def test_engine_scores_match_the_full_logits(reference, monkeypatch):
    """``Engine.score``: chunk by chunk (prefill chunks of 5, log-softmax blocks of 3 rows), each token's
    log-probability and its position's top list equal the full [T, V] log-softmax rows; nothing for token 0."""
    monkeypatch.setattr(scoring, "SCORE_ROWS", 3)
    eng = Engine.load(MODEL, device="cpu", max_context=CONTEXT, max_concurrency=1, prefill_chunk=5)
    ids = eng.tokenizer.encode(PROMPT)
    ref = log_softmax(reference, ids)
    scores = eng.score(ids, top=4)
    assert scores.own.shape == (len(ids) - 1,) and scores.ids.shape == (len(ids) - 1, 4)
    torch.testing.assert_close(scores.own, ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=TOL, rtol=0)
    torch.testing.assert_close(scores.values, ref[:-1].topk(4).values, atol=TOL, rtol=0)
    assert (scores.ids[:, 0] == ref[:-1].argmax(-1)).all()
    assert eng.score(ids[:1], top=2).own.shape == (0,)  # one token: nothing to score
    assert eng.free_slots == [0]  # the scratch slot: no request's
    with pytest.raises(ContextOverflow, match="--max-context"):  # the engine's own words (the CLI's)
        eng.score(list(range(CONTEXT + 1)))


def test_echo_with_prompt_logprobs(served, reference):
    """``echo`` + ``logprobs: N`` with ``max_tokens`` 0 and 1 through the official client: the text is the prompt
    (then the completion), the logprobs cover the prompt tokens first (the first one null) with the values of the
    full log-softmax, then the generated token; ``text_offset`` runs on across both."""
    ids = served.backend.engine.tokenizer.encode(PROMPT)
    ref = log_softmax(reference, ids)
    only = served.openai.completions.create(model=served.model, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0,
                                            temperature=0)
    choice = only.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(ids)
    lp = choice.logprobs.model_dump()
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == PROMPT
    check_prompt_entries(lp, ids, ref, 3)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:k])) for k in range(len(ids))]

    one = served.openai.completions.create(model=served.model, prompt=PROMPT, echo=True, logprobs=3, max_tokens=1,
                                           temperature=0, extra_body={"return_token_ids": True})
    choice = one.choices[0]
    gen = choice.model_extra["token_ids"]
    assert len(gen) == 1 and choice.text.startswith(PROMPT)
    lp = choice.logprobs.model_dump()
    assert len(lp["tokens"]) == len(ids) + 1
    check_prompt_entries(lp, ids, ref, 3)
    full = log_softmax(reference, ids + gen)
    assert gen[0] == int(full[-2].argmax())  # greedy: the most likely after the prompt
    assert math.isclose(lp["token_logprobs"][-1], float(full[-2, gen[0]]), abs_tol=TOL)
    assert lp["text_offset"][-1] == sum(map(len, lp["tokens"][:-1]))
    # echo without logprobs: the text only
    plain = served.openai.completions.create(model=served.model, prompt=PROMPT, echo=True, max_tokens=0)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None


def test_token_id_prompts_as_lm_eval_sends_them(served, reference):
    """A list of token-id prompts with ``echo``, ``logprobs: 1``, ``max_tokens: 1``, ``temperature: 0`` (lm-eval's
    loglikelihood request): each choice echoes its decoded prompt; ``token_logprobs[ctxlen:-1]`` sums to the
    continuation's log-likelihood, and ``is_greedy`` compares each to its top list's best."""
    tok = served.backend.engine.tokenizer
    context, continuation = tok.encode("def add(a, b):\n    return"), tok.encode(" a + b\n")
    other = tok.encode("print('hello')")
    out = served.complete(prompt=[context + continuation, other], echo=True, logprobs=1, max_tokens=1, seed=1234)
    first, second = sorted(out["choices"], key=lambda c: c["index"])
    assert first["text"].startswith(tok.decode(context + continuation)) and second["text"].startswith(tok.decode(other))
    lp = first["logprobs"]
    assert len(lp["tokens"]) == len(context) + len(continuation) + 1
    ref = log_softmax(reference, context + continuation)
    expected = sum(float(ref[k - 1, t]) for k, t in enumerate(context + continuation) if k >= len(context))
    assert math.isclose(sum(lp["token_logprobs"][len(context):-1]), expected, abs_tol=len(continuation) * TOL)
    greedy = all(own == max(top.values()) for own, top in zip(lp["token_logprobs"][len(context):-1],
                                                              lp["top_logprobs"][len(context):-1]))
    assert greedy == all(int(ref[k - 1].argmax()) == t for k, t in enumerate(context + continuation)
                         if k >= len(context))
    check_prompt_entries(second["logprobs"], other, log_softmax(reference, other), 1)
    # one token-id prompt, and n choices of it: each choice echoes it
    n2 = served.complete(prompt=other, echo=True, max_tokens=2, n=2, ignore_eos=True)
    assert [c["text"][:len(tok.decode(other))] for c in n2["choices"]] == [tok.decode(other)] * 2


def test_echo_streamed(served):
    """Streamed, each choice's first chunk carries its prompt text and entries (as vLLM sends them) and the chunks
    add up to the non-streamed answer; with ``max_tokens`` 0 the prompt comes with the finish chunk."""
    ask = dict(model=served.model, prompt=[PROMPT, "x = 1"], echo=True, logprobs=2, max_tokens=3, temperature=0,
               extra_body={"ignore_eos": True})
    whole = served.openai.completions.create(**ask)
    texts, tokens, values, offsets, firsts = {}, {}, {}, {}, {}
    for chunk in served.openai.completions.create(stream=True, **ask):
        for c in chunk.choices:
            firsts.setdefault(c.index, c.text)
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens[c.index] = tokens.get(c.index, []) + c.logprobs.tokens
                values[c.index] = values.get(c.index, []) + c.logprobs.token_logprobs
                offsets[c.index] = offsets.get(c.index, []) + c.logprobs.text_offset
    for c in whole.choices:
        assert firsts[c.index].startswith(ask["prompt"][c.index]) and texts[c.index] == c.text
        assert tokens[c.index] == c.logprobs.tokens and offsets[c.index] == c.logprobs.text_offset
        assert values[c.index] == c.logprobs.token_logprobs and values[c.index][0] is None
    chunks = [c for chunk in served.openai.completions.create(stream=True, **{**ask, "max_tokens": 0})
              for c in chunk.choices]
    assert sorted((c.index, c.text, c.finish_reason) for c in chunks) == [(0, PROMPT, "length"),
                                                                         (1, "x = 1", "length")]
    assert [c.logprobs.token_logprobs[0] for c in chunks] == [None, None]


def test_max_tokens_zero_and_the_context(served):
    """``max_tokens: 0`` is refused without ``echo`` (as OpenAI refuses it); with it a prompt of the whole context
    fits (nothing is generated), one token more is refused before any work in the API's words; a session's saved
    state is not loaded for an echo with log-probabilities (every position is scored)."""
    err = served.http.post("/v1/completions", json={"model": served.model, "prompt": "x", "max_tokens": 0}).json()
    assert err["error"]["param"] == "max_tokens" and "echo" in err["error"]["message"]
    full = list(range(100, 100 + CONTEXT))
    assert len(served.complete(prompt=full, echo=True, logprobs=0, max_tokens=0)["choices"][0]["logprobs"]
               ["tokens"]) == CONTEXT
    r = served.http.post("/v1/completions", json={"model": served.model, "prompt": full + [5], "echo": True,
                                                  "logprobs": 1, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert f"context is {CONTEXT} tokens" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        served.openai.completions.create(model=served.model, prompt=full, echo=True, max_tokens=1)

    first = served.complete(prompt=PROMPT, max_tokens=2, session_id="echo-s", ignore_eos=True)
    turn = PROMPT + first["choices"][0]["text"] + "\nprint(1)"
    scored = served.complete(prompt=turn, echo=True, logprobs=1, max_tokens=0, session_id="echo-s")
    assert scored["timings"]["prompt_cached_n"] == 0 and scored["choices"][0]["text"] == turn
    assert len(scored["choices"][0]["logprobs"]["tokens"]) == scored["usage"]["prompt_tokens"]
    assert served.backend.scheduler.load["free_slots"] == 4


def test_context_overflow_in_each_api_s_words(served):
    """The engine's check refuses a request past the context; each API words it its own way (the engine's message
    names its flags instead)."""
    long_chat = [{"role": "user", "content": "word " * CONTEXT}]
    chat = served.http.post("/v1/chat/completions", json={"model": served.model, "messages": long_chat}).json()
    assert chat["error"]["code"] == "context_length_exceeded" and "leaves no room" in chat["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="input length and `max_tokens` exceed context limit"):
        served.anthropic.messages.create(model=served.model, max_tokens=CONTEXT, messages=[
            {"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: \d+ tokens > 256 maximum"):
        served.anthropic.messages.create(model=served.model, max_tokens=1, messages=long_chat)
    with pytest.raises(ContextOverflow, match="exceeds --max-context 256"):
        served.backend.engine.check_fits(CONTEXT, 1)


def test_echo_logprobs_on_a_speculative_server(reference):
    """A drafter changes no prompt score (they come from the target's prefill), nor the first generated token's
    (picked from the prefill's last row): echo with log-probabilities works at ``max_tokens`` 0 and 1; more
    generated tokens' log-probabilities are refused naming --spec."""
    s = Served(Engine.load(MODEL, device="cpu", max_context=CONTEXT, max_concurrency=1, spec="mtp"))
    try:
        ids = s.backend.engine.tokenizer.encode(PROMPT)
        for max_tokens in (0, 1):
            lp = s.complete(prompt=PROMPT, echo=True, logprobs=2, max_tokens=max_tokens)["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == len(ids) + max_tokens
            check_prompt_entries(lp, ids, log_softmax(reference, ids), 2)
        r = s.http.post("/v1/completions", json={"model": s.model, "prompt": PROMPT, "echo": True, "logprobs": 2,
                                                 "max_tokens": 2})
        assert r.status_code == 400 and "--spec mtp" in r.json()["error"]["message"], r.text
    finally:
        s.close()


def test_anthropic_default_temperature_is_at_most_1():
    """A generation_config.json temperature above 1 is the OpenAI routes' default as it is, and 1 on the Anthropic
    route (whose requests may only ask 0-1): a seeded request without a temperature samples as one asking 1."""
    eng = Engine.load(MODEL, device="cpu", max_context=CONTEXT, max_concurrency=1)
    eng.loaded.artifact.metadata["generation_config"] = {"temperature": 1.7}
    s = Served(eng)
    try:
        assert s.backend.sampling(None, None, None)["temperature"] == 1.7
        assert s.backend.sampling(None, None, None, max_temperature=1.0)["temperature"] == 1.0
        msgs = dict(model=s.model, max_tokens=12, messages=[{"role": "user", "content": "def main("}])

        def ids(**extra):
            return s.anthropic.messages.create(**msgs, extra_body={"return_token_ids": True, "seed": 5, **extra}
                                               ).model_extra["token_ids"]

        assert ids() == ids(temperature=1.0)
        comp = dict(model=s.model, prompt="def main(", max_tokens=12, seed=5, extra_body={"return_token_ids": True})
        left_out = s.openai.completions.create(**comp).choices[0].token_ids
        assert left_out == s.openai.completions.create(**comp, temperature=1.7).choices[0].token_ids
    finally:
        s.close()


def test_only_a_context_overflow_is_named_so():
    """The server's error for a capacity refusal that is not past the context (an empty prompt) carries no
    ``context_length_exceeded`` code; an overflow does."""
    from ninfer_bench.engine.runtime.engine import CapacityError
    from ninfer_bench.engine.serve.http import api_error

    assert api_error(CapacityError("empty prompt: at least one token is needed")).code is None
    over = api_error(ContextOverflow("prompt (9 tokens) + max_new_tokens (4) = 13 exceeds --max-context 8", 9, 4, 8))
    assert over.status == 400 and over.code == "context_length_exceeded" and "context is 8 tokens" in over.message
