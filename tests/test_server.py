"""The HTTP server end to end: real ``ninfer-bench serve`` subprocesses on free ports (the bundled model, or the
random ``tiny`` preset while none is bundled; CPU), driven by the official openai and anthropic clients and httpx."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from ninfer_bench.engine.artifact.loader import default_model  # noqa: E402
from ninfer_bench.engine.serve.app import ServerOptions, serve  # noqa: E402
from ninfer_bench.engine.serve.sessions import Session, SessionStore  # noqa: E402
from serveproc import ROOT, ServeProcess  # noqa: E402

MODEL = default_model()
CONTEXT = 4096
PROMPTS = [f"Write a function number {i} that adds {i} to a list." + " Be brief." * (i % 3) for i in range(8)]


class Server(ServeProcess):
    """A ``serve`` subprocess of the default model, with the official clients pointed at it."""

    def __init__(self, log: Path, *args: str):
        super().__init__(MODEL, log, *args, max_context=CONTEXT)
        self.openai = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)
        self.anthropic = anthropic.Anthropic(base_url=self.url, api_key="none", max_retries=0, timeout=120)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        deadline = time.time() + timeout
        while True:
            h = self.health()
            if (h["running"] == 0 and h["waiting"] == 0) or time.time() > deadline:
                return h
            time.sleep(0.05)

    def chat(self, content, *, max_tokens=24, **extra) -> dict:
        """A greedy non-streamed chat completion with token ids, as JSON."""
        body = {"model": self.model, "messages": content if isinstance(content, list) else
                [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, **extra}
        r = self.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    s = Server(tmp / "server.log", "--max-concurrency", "8", "--session-capacity", "4")
    yield s
    s.stop()


def start_stream(s: Server, content: str, max_tokens: int, running: bool = True):
    """A streaming chat request that was accepted and, when ``running``, produced a token (so it holds a slot);
    returns (client, response, line iterator): close them to disconnect (dropping the iterator closes the stream)."""
    client = httpx.Client(timeout=60)
    body = {"model": s.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "return_token_ids": True, "ignore_eos": True}
    resp = client.send(client.build_request("POST", f"{s.url}/v1/chat/completions", json=body), stream=True)
    assert resp.status_code == 200
    lines = (line for line in resp.iter_lines() if line.startswith("data:"))
    next(lines)  # the role chunk: accepted
    if running:
        next(lines)  # a token: admitted
    return client, resp, lines


# ---- the APIs through their official clients -------------------------------------------------------------
def test_health_and_models(server):
    h = server.health()
    assert h["status"] == "ok" and h["slots"] == 8 and h["free_slots"] == 8
    models = server.openai.models.list().data
    assert [m.id for m in models] == [server.model]


def test_openai_chat_and_completions(server):
    c = server.openai
    args = dict(model=server.model, max_tokens=16, temperature=0)
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    full = c.chat.completions.create(messages=msgs, **args)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens == full.model_extra["timings"]["predicted_n"] > 0
    assert full.usage.prompt_tokens == full.model_extra["timings"]["prompt_n"]
    assert {"prefill_ms", "decode_ms", "draft_n", "draft_n_accepted", "prompt_cached_n"} <= set(full.timings)
    chunks = list(c.chat.completions.create(messages=msgs, stream=True, stream_options={"include_usage": True},
                                            **args))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [ch.usage is not None for ch in chunks].count(True) == 1  # usage once (tools sum it over chunks)
    assert any("timings" in (ch.model_extra or {}) for ch in chunks)
    # a list of text parts is the same prompt as the string
    parts = c.chat.completions.create(messages=[{"role": "user", "content": [{"type": "text", "text": PROMPTS[0]}]}],
                                      **args)
    assert parts.choices[0].message.content == full.choices[0].message.content

    comp = c.completions.create(prompt=PROMPTS[1], **args)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(prompt=PROMPTS[1], stream=True, **args)
                       if ch.choices)
    assert comp.usage.completion_tokens > 0 and streamed == comp.choices[0].text
    # seeded sampling repeats itself
    sampled = [c.completions.create(prompt=PROMPTS[2], model=server.model, max_tokens=12, temperature=0.9, top_p=0.9,
                                    seed=7, extra_body={"return_token_ids": True}) for _ in range(2)]
    assert sampled[0].choices[0].token_ids == sampled[1].choices[0].token_ids


def test_openai_n_choices_and_prompt_lists(server):
    """``n`` choices a prompt and lists of prompts (``/v1/completions``), streamed and not: choices indexed
    prompt-major; greedy choices are the single request's; seeded choices differ, choice 0 is the n = 1 request's,
    and the request repeats itself; the usage counts each prompt once and every choice's tokens."""
    c = server.openai
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    greedy = dict(model=server.model, max_tokens=12, temperature=0)
    one = c.chat.completions.create(messages=msgs, **greedy)
    many = c.chat.completions.create(messages=msgs, n=3, **greedy)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert [ch.message.content for ch in many.choices] == [one.choices[0].message.content] * 3
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert len(many.model_extra["timings"]) == 3

    chunks = list(c.chat.completions.create(messages=msgs, n=2, stream=True, stream_options={"include_usage": True},
                                            **greedy))
    texts, finish = ["", ""], [None, None]
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [one.choices[0].message.content] * 2 and finish == [one.choices[0].finish_reason] * 2
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * one.usage.completion_tokens

    sampled = dict(model=server.model, prompt=PROMPTS[2], max_tokens=12, temperature=1.5, seed=11,
                   extra_body={"return_token_ids": True})
    single = c.completions.create(**sampled).choices[0].token_ids
    runs = [[ch.token_ids for ch in c.completions.create(n=3, **sampled).choices] for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][0] == single and len({tuple(ids) for ids in runs[0]}) == 3

    alone = [c.completions.create(prompt=p, **greedy).choices[0].text for p in PROMPTS[:2]]
    both = c.completions.create(prompt=PROMPTS[:2], n=2, **greedy)
    assert [ch.index for ch in both.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in both.choices] == [alone[0], alone[0], alone[1], alone[1]]
    streamed = ["", "", "", ""]
    for ch in c.completions.create(prompt=PROMPTS[:2], n=2, stream=True, **greedy):
        for choice in ch.choices:
            streamed[choice.index] += choice.text
    assert streamed == [ch.text for ch in both.choices]

    chat = {"model": server.model, "messages": msgs, "max_tokens": 4}
    for body, param in [({**chat, "n": 0}, "n"), ({**chat, "n": 65}, "n"), ({**chat, "n": 2, "session_id": "s-n"},
                                                                           "session_id")]:
        assert check_error(server.post("/v1/chat/completions", body), 400, False)["param"] == param
    comp = {"model": server.model, "prompt": ["x"] * 65, "max_tokens": 4}
    assert check_error(server.post("/v1/completions", comp), 400, False)["param"] == "prompt"
    too_many = {**comp, "prompt": ["x"] * 20, "n": 4}
    assert check_error(server.post("/v1/completions", too_many), 400, False)["param"] == "n"
    assert server.wait_idle()["free_slots"] == 8


def sse_chunks(s: Server, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed request, as sent (the raw ``data:`` lines up to ``[DONE]``)."""
    with httpx.stream("POST", f"{s.url}{path}", json={"model": s.model, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_openai_stream_usage_only_when_asked(server):
    """As OpenAI streams: without ``stream_options.include_usage`` no chunk has a usage field; with it every chunk
    has ``"usage": null`` but a last one without choices that holds it. Each choice's finish chunk carries its
    ``timings`` (the documented extension); the official client parses every chunk."""
    chat = {"messages": [{"role": "user", "content": PROMPTS[6]}], "max_tokens": 8, "temperature": 0}
    comp = {"prompt": PROMPTS[6], "max_tokens": 8, "temperature": 0}
    for path, body, choices in [("/v1/chat/completions", chat, 1), ("/v1/chat/completions", {**chat, "n": 2}, 2),
                                ("/v1/completions", comp, 1), ("/v1/completions", {**comp, "prompt": PROMPTS[:2]}, 2)]:
        chunks = sse_chunks(server, path, body)
        assert not any("usage" in ch for ch in chunks), (path, body, chunks[-1])
        finals = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"] is not None]
        assert len(finals) == choices and all(ch["timings"]["predicted_n"] > 0 for ch in finals)
        asked = sse_chunks(server, path, {**body, "stream_options": {"include_usage": True}})
        assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] > 0
        assert all("usage" in ch and ch["usage"] is None for ch in asked[:-1])
    c, args = server.openai, dict(model=server.model, max_tokens=8, temperature=0)
    chunks = list(c.chat.completions.create(messages=chat["messages"], stream=True, **args))
    assert chunks and all(ch.usage is None for ch in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].model_extra["timings"]
    chunks = list(c.completions.create(prompt=PROMPTS[6], stream=True, **args))
    assert chunks and all(ch.usage is None for ch in chunks)


def test_anthropic_messages(server):
    c = server.anthropic
    # (this client version has no sampling arguments: they go in the body)
    args = dict(model=server.model, max_tokens=16, extra_body={"temperature": 0},
                messages=[{"role": "user", "content": PROMPTS[3]}], system="You are terse.")
    msg = c.messages.create(**args)
    assert msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens == msg.model_extra["timings"]["predicted_n"]
    assert c.messages.count_tokens(model=server.model, messages=args["messages"],
                                   system=args["system"]).input_tokens == msg.usage.input_tokens
    with c.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text == final.content[0].text
    assert final.usage.output_tokens == msg.usage.output_tokens and final.stop_reason == msg.stop_reason
    events = list(c.messages.create(stream=True, **args))
    start, delta = events[0].message.usage, events[-2].usage
    assert start.input_tokens == delta.input_tokens and start.cache_read_input_tokens == delta.cache_read_input_tokens
    kinds = [ev.type for ev in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == \
        ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}


def test_stop_strings(server):
    full = server.chat(PROMPTS[4], max_tokens=32)
    text = full["choices"][0]["message"]["content"]
    # a two-character stop string from the middle of the greedy text (clear of replacement characters)
    spots = [i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2]]
    assert spots, f"greedy text too short to cut: {text!r}"
    at = min(spots, key=lambda i: abs(i - len(text) // 2))
    stop = text[at:at + 2]
    cut = server.chat(PROMPTS[4], max_tokens=32, stop=[stop, "\x00never\x00"])
    assert cut["choices"][0]["message"]["content"] == text[:text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in server.openai.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": PROMPTS[4]}], max_tokens=32, temperature=0,
        stop=stop, stream=True) if ch.choices)
    assert streamed == text[:text.index(stop)]
    msg = server.anthropic.messages.create(model=server.model, max_tokens=32, extra_body={"temperature": 0},
                                           stop_sequences=[stop],
                                           messages=[{"role": "user", "content": PROMPTS[4]}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]


# ---- batching -----------------------------------------------------------------------------------------
def stream_ids(s: Server, content: str, max_tokens: int = 24) -> tuple[list[int], str]:
    ids, text = [], ""
    for ch in s.openai.chat.completions.create(model=s.model, messages=[{"role": "user", "content": content}],
                                               max_tokens=max_tokens, temperature=0, stream=True,
                                               extra_body={"return_token_ids": True}):
        if ch.choices:
            ids += getattr(ch.choices[0], "token_ids", None) or []
            text += ch.choices[0].delta.content or ""
    return ids, text


def test_concurrent_streams_match_sequential(server):
    sequential = [server.chat(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent = list(pool.map(lambda p: stream_ids(server, p), PROMPTS))
    for seq, (ids, text) in zip(sequential, concurrent):
        assert ids == seq["choices"][0]["token_ids"]
        assert text == seq["choices"][0]["message"]["content"]


def test_disconnect_frees_slots(server):
    open_streams = [start_stream(server, p, CONTEXT - 200) for p in PROMPTS]
    assert server.health()["free_slots"] == 0
    for client, resp, _ in open_streams:
        resp.close()
        client.close()
    assert server.wait_idle()["free_slots"] == 8
    # a non-streamed request whose client gives up is cancelled too (its ~4000 tokens would take many seconds)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": PROMPTS[0],
                                                         "max_tokens": CONTEXT - 200, "ignore_eos": True},
                   timeout=0.5)
    assert server.wait_idle(timeout=5)["free_slots"] == 8
    t0 = time.time()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: server.chat(p, max_tokens=8), PROMPTS))
    assert all(r["usage"]["completion_tokens"] == 8 for r in results)
    assert time.time() - t0 < 30


# ---- errors -------------------------------------------------------------------------------------------
def check_error(r: httpx.Response, status: int, anthropic_shape: bool) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    if anthropic_shape:
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}
    else:
        assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


def test_errors_in_each_api_shape(server):
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    msgs = {**chat}
    long_text = "word " * (CONTEXT * 2)
    cases = [  # (path, body, status, check of the error object)
        ("/v1/chat/completions", b'{"model": "x", "messages": [', 400, None),
        ("/v1/chat/completions", b"[1, 2]", 400, None),
        ("/v1/chat/completions", {**chat, "temperature": "hot"}, 400, lambda e: e["param"] == "temperature"),
        ("/v1/chat/completions", {**chat, "messages": "hi"}, 400, lambda e: e["param"] == "messages"),
        ("/v1/chat/completions", {**chat, "max_tokens": 0}, 400, lambda e: e["param"] == "max_tokens"),
        ("/v1/chat/completions", {k: v for k, v in chat.items() if k != "model"}, 400, lambda e: e["param"] == "model"),
        ("/v1/chat/completions", {**chat, "model": "nope"}, 404, lambda e: e["code"] == "model_not_found"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": long_text}]}, 400,
         lambda e: e["code"] == "context_length_exceeded"),
        ("/v1/chat/completions", {**chat, "max_tokens": CONTEXT * 4}, 400,  # in the API's words, not the engine's
         lambda e: e["code"] == "context_length_exceeded" and "max_tokens" in e["message"]
         and "--max-context" not in e["message"]),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400, lambda e: "vision" in e["message"]),
        ("/v1/chat/completions", {**chat, "session_id": "../etc"}, 400, lambda e: e["param"] == "session_id"),
        ("/v1/completions", {"model": server.model, "prompt": [1, 10**9]}, 400, lambda e: "vocabulary" in e["message"]),
        ("/v1/completions", {"model": server.model, "prompt": "x" * (65 * CONTEXT + (1 << 20))}, 413, None),
        ("/v1/messages", b"{not json", 400, lambda e: e["type"] == "invalid_request_error"),
        ("/v1/messages", {k: v for k, v in msgs.items() if k != "max_tokens"}, 400,
         lambda e: "max_tokens" in e["message"]),
        ("/v1/messages", {**msgs, "temperature": [1]}, 400, lambda e: e["type"] == "invalid_request_error"),
        ("/v1/messages", {**msgs, "model": "nope"}, 404, lambda e: e["type"] == "not_found_error"),
        ("/v1/messages", {**msgs, "messages": [{"role": "user", "content": long_text}]}, 400,
         lambda e: e["type"] == "invalid_request_error"),
        ("/v1/messages", {**msgs, "max_tokens": CONTEXT * 4}, 400, lambda e: e["type"] == "invalid_request_error"),
        ("/v1/messages", {**msgs, "messages": [{"role": "user", "content": []}]}, 400,  # as Anthropic refuses them
         lambda e: "non-empty content" in e["message"]),
        ("/v1/messages", {**msgs, "messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "def f(): "}]}, 400,
         lambda e: "trailing whitespace" in e["message"]),
        ("/v1/messages", {**msgs, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         400, lambda e: "vision" in e["message"]),
        ("/v1/messages/count_tokens", "x" * (65 * CONTEXT + (1 << 20)), 413,
         lambda e: e["type"] == "request_too_large"),
        # a seed no generator takes: refused before the request holds a slot (the last check: all slots free)
        ("/v1/chat/completions", {**chat, "temperature": 1, "seed": 2**64}, 400, lambda e: e["param"] == "seed"),
        ("/v1/messages", {**msgs, "temperature": 1, "seed": -2**63 - 1}, 400, lambda e: "seed" in e["message"]),
        # legal JSON that is no request: a lone surrogate, nesting deeper than the parser goes
        ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
         lambda e: "Unicode" in e["message"]),
        ("/v1/messages/count_tokens", b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', 400,
         lambda e: "Unicode" in e["message"]),
        ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400, lambda e: "nested" in e["message"]),
        # bounded stop strings (a long one costs every later token a scan)
        ("/v1/chat/completions", {**chat, "stop": [f"s{i}" for i in range(17)]}, 400, lambda e: e["param"] == "stop"),
        ("/v1/messages", {**msgs, "stop_sequences": ["x" * 1001]}, 400, lambda e: "stop" in e["message"]),
        # what this server cannot honour is refused, not ignored
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}}, 400,
         lambda e: e["param"] == "response_format"),
        ("/v1/completions", {"model": server.model, "prompt": "x", "max_tokens": 0}, 400,  # 0 only with echo
         lambda e: e["param"] == "max_tokens"),
        ("/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}, 400,
         lambda e: e["param"] == "stream_options"),
    ]
    for path, body, status, check in cases:
        err = check_error(server.post(path, body), status, path.startswith("/v1/messages"))
        assert check is None or check(err), (path, err)
        assert server.chat("ok?", max_tokens=2)["usage"]["completion_tokens"] == 2  # still serving
    check_error(httpx.delete(f"{server.url}/v1/sessions/never-made"), 404, False)
    check_error(httpx.get(f"{server.url}/v1/nothing-here"), 404, False)
    assert check_error(httpx.get(f"{server.url}/v1/chat/completions"), 405, False)["type"] == "invalid_request_error"
    # the official clients recognise the shapes
    with pytest.raises(openai.NotFoundError):
        server.openai.chat.completions.create(model="nope", messages=chat["messages"], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context"):
        server.openai.completions.create(model=server.model, prompt="x", max_tokens=CONTEXT * 4)
    with pytest.raises(anthropic.NotFoundError):
        server.anthropic.messages.create(model="nope", messages=msgs["messages"], max_tokens=4)
    with pytest.raises(anthropic.BadRequestError):
        server.anthropic.messages.create(model=server.model, messages=msgs["messages"], max_tokens=CONTEXT * 4)
    assert server.wait_idle()["free_slots"] == 8


def test_unimplemented_fields_refused_harmless_ones_accepted(server):
    """A field the server does not implement is a 400 naming it unless its value asks for nothing; a field of
    neither API is refused as unknown; fields whose loss changes nothing the client gets back are accepted."""
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    comp = {"model": server.model, "prompt": "hi", "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    refused = [  # (path, extra fields, the field the error names)
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"n": 2, "best_of": 3}, "best_of"),
        ("/v1/completions", {"logit_bias": {"5": 10}}, "logit_bias"),
        ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
        ("/v1/chat/completions", {"logit_bias": {"5": -100}}, "logit_bias"),
        ("/v1/chat/completions", {"frequency_penalty": -1.0}, "frequency_penalty"),
        ("/v1/chat/completions", {"tools": [tool]}, "tools"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"functions": [tool["function"]]}, "functions"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
        ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
        ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
        ("/v1/completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
        ("/v1/chat/completions", {"top_a": 0.5}, "top_a"),  # a field neither API nor the usual servers have
        ("/v1/chat/completions", {"best_of": 1}, "best_of"),  # a /v1/completions field only
        ("/v1/messages", {"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools"),
        ("/v1/messages", {"tool_choice": {"type": "any"}}, "tool_choice"),
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ("/v1/messages", {"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config"),
        ("/v1/messages", {"top_a": 0.5}, "top_a"),
        ("/v1/messages/count_tokens", {"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools"),
    ]
    for path, extra, field in refused:
        anthropic_shape = path.startswith("/v1/messages")
        err = check_error(server.post(path, {**(comp if "/v1/completions" == path else chat), **extra}), 400,
                          anthropic_shape)
        named = err["message"].startswith((f"{field}:", f"{field}[")) or f"unknown field {field!r}" in err["message"]
        assert named, (path, err)
        assert anthropic_shape or err["param"] == field, (path, err)
    accepted = [
        ("/v1/completions", {"best_of": 1, "suffix": "", "echo": False, "logprobs": None, "presence_penalty": 0,
                             "frequency_penalty": 0.0, "logit_bias": {}, "user": "u"}),
        ("/v1/completions", {"n": 2, "best_of": 2}),
        ("/v1/completions", {"repetition_penalty": 1.0, "min_p": 0, "length_penalty": 1, "use_beam_search": False}),
        ("/v1/chat/completions", {"repetition_penalty": 1, "min_p": 0.0}),  # scripts written for vLLM send these
        ("/v1/chat/completions", {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                                  "parallel_tool_calls": True, "tools": [], "tool_choice": "none",
                                  "response_format": {"type": "text"}, "modalities": ["text"], "logprobs": False,
                                  "top_logprobs": 0, "prompt_cache_key": "k"}),
        ("/v1/messages", {"metadata": {"user_id": "u"}, "service_tier": "auto", "thinking": {"type": "disabled"},
                          "tools": [], "tool_choice": {"type": "auto"}}),
        ("/v1/messages/count_tokens", {"tools": [], "thinking": {"type": "disabled"}}),
    ]
    for path, extra in accepted:
        r = server.post(path, {**(comp if "/v1/completions" == path else chat), **extra})
        assert r.status_code == 200, (path, r.text)
    # the official clients: harmless arguments pass, the rest is refused naming the argument
    args = dict(model=server.model, messages=chat["messages"], max_tokens=2)
    server.openai.chat.completions.create(**args, user="u", store=False, presence_penalty=0)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        server.openai.chat.completions.create(**args, logit_bias={"5": 10})
    with pytest.raises(openai.BadRequestError, match="suffix"):
        server.openai.completions.create(model=server.model, prompt="hi", max_tokens=2, suffix="x")
    server.anthropic.messages.create(**args, metadata={"user_id": "u"})
    with pytest.raises(anthropic.BadRequestError, match="tools"):
        server.anthropic.messages.create(**args, tools=[{"name": "f", "input_schema": {"type": "object"}}])
    assert server.wait_idle()["free_slots"] == 8


def test_long_ids_are_not_echoed_whole(server):
    """A 5000-character session id or model name comes back in the error cut to its first 64 characters."""
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    long_id = "a" * 4999 + "!"
    shown = f"{'a' * 64!r}... (5,000 characters)"
    replies = [  # (response, status, in Anthropic's shape)
        (server.post("/v1/chat/completions", {**chat, "session_id": long_id}), 400, False),
        (server.post("/v1/completions", {"model": server.model, "prompt": "hi", "session_id": long_id}), 400, False),
        (server.post("/v1/messages", {**chat, "session_id": long_id}), 400, True),
        (httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "session_id": "x"},
                    headers={"X-Session-Id": long_id}), 400, False),
        (server.post("/v1/chat/completions", {**chat, "model": long_id}), 404, False),
        (httpx.delete(f"{server.url}/v1/sessions/{long_id}"), 404, False),
    ]
    for r, status, anthropic_shape in replies:
        err = check_error(r, status, anthropic_shape)
        assert shown in err["message"] and len(err["message"]) < 300, err


def test_vllm_style_top_k_and_stream_options(server):
    """``top_k: -1`` (vLLM's and SGLang's "no limit") samples as ``top_k: 0``; a ``stream_options`` key other than
    OpenAI's is refused naming it rather than dropped (vLLM's ``continuous_usage_stats`` would promise a usage in
    every chunk); a text part without its text says so."""
    sampled = dict(model=server.model, prompt=PROMPTS[2], max_tokens=6, temperature=1.0, seed=3,
                   extra_body={"return_token_ids": True})
    off = server.openai.completions.create(**sampled).choices[0].token_ids
    assert server.openai.completions.create(**{**sampled, "extra_body": {"return_token_ids": True, "top_k": -1}}
                                            ).choices[0].token_ids == off
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert check_error(server.post("/v1/chat/completions", {**chat, "top_k": -2}), 400, False)["param"] == "top_k"
    # vLLM's min_p: 1 keeps only the likeliest token, so sampling at any temperature decodes the greedy tokens
    greedy = server.openai.completions.create(**{**sampled, "temperature": 0.0}).choices[0].token_ids
    assert server.openai.completions.create(**{**sampled, "temperature": 1.5, "extra_body": {
        "return_token_ids": True, "min_p": 1.0}}).choices[0].token_ids == greedy
    assert check_error(server.post("/v1/chat/completions", {**chat, "min_p": 1.5}), 400, False)["param"] == "min_p"
    err = check_error(server.post("/v1/chat/completions", {**chat, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}), 400, False)
    assert err["param"] == "stream_options" and "continuous_usage_stats" in err["message"]
    chunks = sse_chunks(server, "/v1/chat/completions", {k: v for k, v in chat.items() if k != "model"} | {
        "stream_options": {"include_usage": True, "include_obfuscation": False}, "ignore_eos": True})  # (2 tokens)
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    err = check_error(server.post("/v1/chat/completions", {**chat, "messages": [
        {"role": "user", "content": [{"type": "text", "txt": "hi"}]}]}), 400, False)
    assert "needs a string 'text'" in err["message"]
    err = check_error(server.post("/v1/messages", {**chat, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 3}]}]}), 400, True)
    assert "needs a string 'text'" in err["message"]


def test_model_ids_with_a_slash(tmp_path):
    """A model id in Hugging Face's ``org/name`` form (what ``convert`` records from ``_name_or_path``) is found by
    ``GET /v1/models/{id}``, which the official client sends with the slash as %2F."""
    from fastapi.testclient import TestClient

    from ninfer_bench.engine import Engine
    from ninfer_bench.engine.serve.engine_thread import Backend
    from ninfer_bench.engine.serve.app import create_app

    backend = Backend(Engine.load(MODEL, device="cpu", max_context=256, max_concurrency=1), session_capacity=0)
    backend.model_id = "org/ninfer-code-small"
    with TestClient(create_app(backend, 1 << 20)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=http)
        assert client.models.retrieve("org/ninfer-code-small").id == "org/ninfer-code-small"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("org/other")


def test_sampling_defaults_come_from_the_generation_config():
    """What a request leaves out of temperature / top_p / top_k comes from the model's generation_config.json (as
    vLLM does); values out of range, and settings the server does not implement, are ignored and named;
    ``--generation-config none`` keeps the APIs' own defaults (temperature 1: sampling)."""
    from fastapi.testclient import TestClient

    from ninfer_bench.engine import Engine
    from ninfer_bench.engine.serve.engine_thread import Backend, generation_defaults
    from ninfer_bench.engine.serve.app import create_app

    gen = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
           "repetition_penalty": 1.05}
    assert generation_defaults({"generation_config": gen}) == (
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05}, ["repetition_penalty 1.05: not implemented"])
    assert generation_defaults({"generation_config": {"min_p": 1.5}}) == ({}, ["min_p 1.5: out of range"])
    assert generation_defaults({"generation_config": {"temperature": -1, "top_p": 0, "top_k": 2.5}}) == (
        {}, ["temperature -1: out of range", "top_p 0: out of range", "top_k 2.5: out of range"])
    assert generation_defaults({}) == ({}, [])

    eng = Engine.load(MODEL, device="cpu", max_context=256, max_concurrency=1)
    eng.loaded.artifact.metadata["generation_config"] = {"temperature": 0.0}  # a model whose default is greedy
    texts = {}
    for mode in ("auto", "none"):
        backend = Backend(eng, session_capacity=0, generation_config=mode)
        with TestClient(create_app(backend, 1 << 20)) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=http)
            ask = dict(model=backend.model_id, prompt="def main(", max_tokens=16, seed=3)
            texts[mode] = client.completions.create(**ask).choices[0].text
            texts["greedy"] = client.completions.create(**ask, temperature=0).choices[0].text
            claude = anthropic.Anthropic(base_url="http://testserver", api_key="none", max_retries=0, http_client=http)
            texts[f"{mode}-messages"] = [claude.messages.create(
                model=backend.model_id, max_tokens=16, messages=[{"role": "user", "content": "def main("}],
                extra_body={"return_token_ids": True}).model_extra["token_ids"] for _ in range(2)]
    assert texts["auto"] == texts["greedy"]
    assert texts["none"] != texts["greedy"]  # temperature 1 with seed 3: sampled tokens
    first, second = texts["auto-messages"]
    assert first == second and len(first) == 16  # greedy by the model's default: the same tokens without a seed


def test_logprobs_as_the_openai_client_reads_them(server):
    """Chat ``logprobs`` + ``top_logprobs`` and completions ``logprobs: N``, streamed and not, through the official
    client: one entry a generated token; greedy, the sampled token is the most likely one; top lists most likely
    first; a completion's ``top_logprobs`` hold the N most likely and the sampled token, and its tokens' texts add
    up to the text at ``text_offset``; streamed equals non-streamed."""
    ask = dict(model=server.model, max_tokens=8, temperature=0,
               extra_body={"ignore_eos": True, "return_token_ids": True})
    msgs = [{"role": "user", "content": "def main("}]
    chat = server.openai.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=3, **ask)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens == 8
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and sum(map(math.exp, tops)) <= 1 + 1e-6
        assert (e.token, e.logprob) == (e.top_logprobs[0].token, tops[0]) and e.bytes == list(e.token.encode())
    streamed = [e for chunk in server.openai.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=3,
                                                                      stream=True, **ask)
                for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = server.openai.chat.completions.create(messages=msgs, **ask)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content

    comp = server.openai.completions.create(prompt="def main(", logprobs=2, **ask)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == comp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for tok, own, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 2 <= len(top) <= 3 and top[tok] == own == max(top.values())
    chunks = [c.logprobs for chunk in server.openai.completions.create(prompt="def main(", logprobs=2, stream=True,
                                                                        **ask)
              for c in chunk.choices if c.logprobs]
    assert sum((c.tokens for c in chunks), []) == lp.tokens
    assert sum((c.text_offset for c in chunks), []) == lp.text_offset


def test_logprobs_are_refused_by_a_speculative_server():
    """A drafter's rounds keep no log-probabilities: such a server refuses them naming the field and the spec."""
    from fastapi.testclient import TestClient

    from ninfer_bench.engine import Engine
    from ninfer_bench.engine.serve.engine_thread import Backend
    from ninfer_bench.engine.serve.app import create_app

    eng = Engine.load(MODEL, device="cpu", max_context=256, max_concurrency=1, spec="mtp")
    with TestClient(create_app(Backend(eng, session_capacity=0), 1 << 20)) as http:
        r = http.post("/v1/completions", json={"model": "ninfer-code-small", "prompt": "x", "max_tokens": 2,
                                               "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert "--spec mtp" in r.json()["error"]["message"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_refuses_an_address_it_cannot_bind(tmp_path):
    """A port in use or a host that does not resolve: one line in the CLI's error form and exit code 1, before the
    model loads; a port taken after the options were checked (during the load) gives the same error."""
    with socket.socket() as taker:
        taker.bind(("127.0.0.1", 0))
        taker.listen()
        port = taker.getsockname()[1]
        env = {**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
        for args, reason in [(["--port", str(port)], f"127.0.0.1:{port}: address already in use"),
                             (["--host", "999.1.1.1"], "999.1.1.1:8080: name or service not known")]:
            res = subprocess.run([sys.executable, str(ROOT / "scripts" / "nb.py"), "serve", str(MODEL), "--device",
                                  "cpu", *args], capture_output=True, text=True, timeout=120, env=env)
            assert (res.returncode, res.stdout, res.stderr) == (1, "", f"error: cannot listen on {reason}\n")

    port = free_port()
    options = ServerOptions(port=port)
    with socket.socket() as taker:
        taker.bind(("127.0.0.1", port))
        taker.listen()
        with pytest.raises(ValueError, match=f"^cannot listen on 127.0.0.1:{port}: address already in use$"):
            serve(None, options)  # refused before the engine is touched


# ---- sessions -----------------------------------------------------------------------------------------
def complete(s: Server, prompt, max_tokens=16, **extra) -> dict:
    r = s.post("/v1/completions", {"model": s.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                   "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_session_continuation_skips_prefill(server):
    prompt = server.openai.completions.create(model=server.model, prompt=PROMPTS[5], max_tokens=1,
                                              extra_body={"return_token_ids": True}).prompt_token_ids
    first = complete(server, prompt, session_id="ids-1")
    reply = first["choices"][0]["token_ids"]
    turn2 = prompt + reply + prompt[:20]
    cont = complete(server, turn2, session_id="ids-1")
    fresh = complete(server, turn2)
    assert cont["choices"][0]["token_ids"] == fresh["choices"][0]["token_ids"]
    cached = cont["timings"]["prompt_cached_n"]
    assert cached == len(prompt) + len(reply) - 1 == cont["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert fresh["timings"]["prompt_cached_n"] == 0

    # chat: the client sends the reply back as text; the session continues from the tokens it came from
    msgs = [{"role": "user", "content": PROMPTS[6]}]
    r1 = server.chat(msgs, session_id="chat-1")
    msgs += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And now in one line?"}]
    r2 = server.chat(msgs, session_id="chat-1")
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == r1["usage"]["total_tokens"] - 1
    again = complete(server, r2["prompt_token_ids"], 24)
    assert again["choices"][0]["token_ids"] == r2["choices"][0]["token_ids"]

    # Anthropic, naming the session with the header
    args = dict(model=server.model, max_tokens=12, extra_body={"temperature": 0},
                extra_headers={"X-Session-Id": "anth-1"})
    first_turn = [{"role": "user", "content": PROMPTS[7]}]
    a1 = server.anthropic.messages.create(**args, messages=first_turn)
    a2 = server.anthropic.messages.create(**args, messages=first_turn + [
        {"role": "assistant", "content": a1.content[0].text}, {"role": "user", "content": "More."}])
    assert a2.usage.cache_read_input_tokens == a1.usage.input_tokens + a1.usage.output_tokens - 1
    assert a2.model_extra["timings"]["prompt_cached_n"] == a2.usage.cache_read_input_tokens

    listed = {s["id"]: s for s in httpx.get(f"{server.url}/v1/sessions").json()["data"]}
    assert {"ids-1", "chat-1", "anth-1"} <= set(listed) and listed["ids-1"]["tokens"] == \
        len(turn2) + len(cont["choices"][0]["token_ids"]) - 1
    assert listed["ids-1"]["bytes"] > 0
    assert httpx.delete(f"{server.url}/v1/sessions/ids-1").status_code == 200
    assert httpx.delete(f"{server.url}/v1/sessions/ids-1").status_code == 404
    gone = complete(server, turn2, session_id="ids-1")
    assert gone["timings"]["prompt_cached_n"] == 0
    assert gone["choices"][0]["token_ids"] == fresh["choices"][0]["token_ids"]


def test_session_lru_bound(server):
    for i in range(6):  # the module's server keeps 4
        complete(server, PROMPTS[i], 2, session_id=f"lru-{i}")
    ids = [s["id"] for s in httpx.get(f"{server.url}/v1/sessions").json()["data"]]
    assert ids == ["lru-5", "lru-4", "lru-3", "lru-2"]


def test_sessions_survive_a_restart(tmp_path):
    folder = tmp_path / "sessions"
    s = Server(tmp_path / "a.log", "--session-dir", str(folder))
    try:
        prompt = complete(s, PROMPTS[0], 1)["prompt_token_ids"]
        first = complete(s, prompt, session_id="keep")
    finally:
        s.stop()
    [mine] = folder.iterdir()  # the model's own folder
    assert (mine / "keep.pt").is_file()
    (mine / "cut.pt").write_bytes((mine / "keep.pt").read_bytes()[:100])
    s = Server(tmp_path / "b.log", "--session-dir", str(folder))
    try:
        log = s.log.read_text()
        assert "1 sessions restored" in log and "weights_only" not in log
        assert f"session file {mine.name}/cut.pt: not a session file (truncated or corrupt); skipped" in log
        turn2 = prompt + first["choices"][0]["token_ids"] + prompt[:10]
        cont = complete(s, turn2, session_id="keep")
        assert cont["timings"]["prompt_cached_n"] == len(turn2) - 10 - 1
        assert cont["choices"][0]["token_ids"] == complete(s, turn2)["choices"][0]["token_ids"]
        assert httpx.delete(f"{s.url}/v1/sessions/keep").status_code == 200
        assert not (mine / "keep.pt").exists()
    finally:
        s.stop()


def a_session(sid: str, first: int = 0) -> Session:
    """A small session as Engine.export_state makes them (ids and a cache of tensors), told apart by ``first``."""
    ids = list(range(first, first + 4))
    return Session(sid, {"ids": ids, "cache": {"length": 4, "k": torch.full((2, 4), float(first))}}, ids + [9], "t")


def session_ids(store: SessionStore) -> list[str]:
    return [d["id"] for d in store.describe()]


def test_session_file_name_is_its_id(tmp_path):
    """A renamed session file is restored under its new name, so deleting that session deletes the file."""
    SessionStore(4, tmp_path, "model-a").put(a_session("s2"))
    store = SessionStore(4, tmp_path, "model-a")
    (store.dir / "s2.pt").rename(store.dir / "renamed.pt")
    assert store.load() == (1, [f"{store.dir.name}/renamed.pt: saved as session 's2', restored as session "
                                "'renamed' (a session is named by its file)"])
    assert session_ids(store) == ["renamed"] and not store.delete("s2")
    assert store.delete("renamed") and not list(store.dir.glob("*.pt"))
    assert SessionStore(4, tmp_path, "model-a").load() == (0, [])  # nothing comes back


def test_session_files_that_do_not_load_are_reported_in_one_line(tmp_path):
    store = SessionStore(4, tmp_path, "model-a")
    store.put(a_session("good"))
    data = (store.dir / "good.pt").read_bytes()
    bad = {"half.pt": data[: len(data) // 2], "three.pt": data[:3], "empty.pt": b"", "junk.pt": b"not a torch file"}
    for name, content in bad.items():
        (store.dir / name).write_bytes(content)
    torch.save({"weights": torch.zeros(2)}, store.dir / "tensors.pt")
    torch.save(Path("x"), store.dir / "object.pt")  # a pickle of a class: weights_only refuses it
    torch.save({"format": "ninfer-bench/session", "version": 1, "model": "model-a", "id": "x"}, store.dir / "x.pt")
    (store.dir / "bad name.pt").write_bytes(data)
    loaded, problems = SessionStore(4, tmp_path, "model-a").load()
    folder = store.dir.name
    corrupt = "not a session file (truncated or corrupt); skipped"
    assert loaded == 1 and sorted(problems) == sorted(
        [f"{folder}/{name}: {corrupt}" for name in [*bad, "object.pt"]]
        + [f"{folder}/tensors.pt: not a session file (a torch file of something else); skipped",
           f"{folder}/x.pt: a session file of version 1, this version reads version 2; skipped",
           f"{folder}/bad name.pt: 'bad name' is not a session id (letters, digits and '._:-'); skipped"])


def test_session_dir_shared_by_two_models(tmp_path):
    """Servers of two models on one --session-dir both use session s1 without touching each other's file."""
    SessionStore(4, tmp_path, "model-a").put(a_session("s1", first=1))
    other = SessionStore(4, tmp_path, "model-b")
    assert other.load()[0] == 0
    other.put(a_session("s1", first=2))
    assert other.delete("s1") and not other.delete("s1")
    again = SessionStore(4, tmp_path, "model-a")
    assert again.load() == (1, []) and again.get("s1").ids == [1, 2, 3, 4, 9]


def test_session_files_at_the_top_level_move_into_the_model_folder(tmp_path):
    """Files an older version wrote to DIR/<id>.pt are adopted by their model's server, left alone by others."""
    old = SessionStore(4, None, "model-a")
    old.dir = tmp_path  # the old layout
    old._write(a_session("s1", first=1))
    (tmp_path / "junk.pt").write_bytes(b"junk")
    assert SessionStore(4, tmp_path, "model-b").load() == (0, ["junk.pt: not a session file (truncated or corrupt); "
                                                                "skipped"])
    assert (tmp_path / "s1.pt").is_file()
    store = SessionStore(4, tmp_path, "model-a")
    assert store.load()[0] == 1 and store.get("s1").ids == [1, 2, 3, 4, 9]
    assert not (tmp_path / "s1.pt").exists() and (store.dir / "s1.pt").is_file()


# ---- speculative decoding and the queue ---------------------------------------------------------------------
def drafter_kind() -> str:
    """A speculative method the served model has (the tiny preset has them all)."""
    if MODEL == "tiny":
        return "mtp"
    from ninfer_bench.engine.artifact.reader import Artifact

    with Artifact.open(MODEL) as art:
        components = art.components or {}
    kind = next((k for k in ("mtp", "dflash2", "dflash") if components.get(k)), None)
    if kind is None:
        pytest.skip(f"{MODEL} has no drafter to decode speculatively with")
    return kind


def test_spec_batched_and_queue_full(tmp_path):
    s = Server(tmp_path / "spec.log", "--spec", drafter_kind(), "--max-concurrency", "2", "--max-queue", "2")
    try:
        sequential = [s.chat(p, max_tokens=16) for p in PROMPTS[:2]]
        assert all(r["timings"]["draft_n"] > 0 for r in sequential)
        with ThreadPoolExecutor(2) as pool:
            concurrent = list(pool.map(lambda p: stream_ids(s, p, 16), PROMPTS[:2]))
        assert [ids for ids, _ in concurrent] == [r["choices"][0]["token_ids"] for r in sequential]

        # two slots busy, two requests waiting: the queue is full
        streams = [start_stream(s, p, CONTEXT - 200, running=i < 2) for i, p in enumerate(PROMPTS[:4])]
        assert s.health()["waiting"] == 2
        err = check_error(s.post("/v1/chat/completions", {"model": s.model, "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "hi"}]}), 503, False)
        assert err["code"] == "queue_full"
        r = s.post("/v1/messages", {"model": s.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert check_error(r, 503, True)["type"] == "overloaded_error" and r.headers["retry-after"]
        # a waiting client that leaves gives its place in the queue back at once
        client, resp, _ = streams.pop()
        resp.close()
        client.close()
        deadline = time.time() + 10
        while s.health()["waiting"] != 1 and time.time() < deadline:
            time.sleep(0.05)
        assert s.health()["waiting"] == 1
        streams.append(start_stream(s, PROMPTS[5], 8, running=False))  # accepted: not a 503
        for client, resp, _ in streams:
            resp.close()
            client.close()
        assert s.wait_idle()["free_slots"] == 2
        assert s.chat("again", max_tokens=4)["usage"]["completion_tokens"] == 4
    finally:
        s.stop()


# ---- the concurrency suite against a running server ----------------------------------------------------
def test_concurrency_suite_against_server(server, tmp_path):
    if importlib.util.find_spec("ninfer_bench.suites.concurrency") is None:
        pytest.skip("ninfer_bench.suites.concurrency is not written yet (its `concurrency --url` command runs "
                    "against this server once it exists)")
    from ninfer_bench.cli import main

    flags = {p.name: next(o for o in p.opts if o.startswith("--")) for p in main.commands["concurrency"].params}
    args = ["concurrency", "--url", server.url, "--json", str(tmp_path / "c.json")]
    for name, value in (("levels", "1,2"), ("max_new_tokens", "8"), ("prompt_tokens", "32"), ("rounds", "1")):
        if name in flags:  # keep the run small where the command lets us
            args += [flags[name], value]
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "nb.py"), *args], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads((tmp_path / "c.json").read_text())
    assert [lv["matches_sequential"] for lv in doc["summary"]["levels"]] == [True] * len(doc["summary"]["levels"])
