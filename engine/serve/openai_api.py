"""OpenAI-style routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions`` (see :mod:`.app`)."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..media.prompt import placeholder
from .engine_thread import Backend, Generation, Outcome
from .http import (
    ApiError,
    api_error,
    body_schema,
    error_body,
    new_id,
    read_json,
    refuse_unsupported,
    session_of,
    sse,
    validate,
)
from .logprobs import MAX_TOP_LOGPROBS, chat_content, completion_logprobs
from .sessions import SHOWN_CHARS

MAX_CHOICES = 64  # choices (n x prompts) in one request: each is a request of its own to the scheduler
FINISH = {"eos": "stop", "stop_sequence": "stop", "length": "length"}
MEDIA_PARTS = {"image_url": "image", "video_url": "video"}  # {"type": kind, kind: {"url": data URI | path}}
MEDIA_URL = "expected a data URI (data:<type>;base64,<data>), or a path in the server's --media-dir"
NO_MODALITY = {"input_image": "vision", "image": "vision", "input_audio": "audio", "audio": "audio",
               "file": "file input"}

# OpenAI fields this server does not implement: accepted only with a value that asks for nothing (as clients that
# spell out every default send them), refused otherwise. Field: (those values, why any other is refused).
NO_PENALTY = "presence and frequency penalties are not implemented by this server (only 0)"
NO_TOOLS = "tool and function calling is not supported by this server"
SHARED = {"presence_penalty": ((None, 0, 0.0), NO_PENALTY),
          "frequency_penalty": ((None, 0, 0.0), NO_PENALTY),
          "logit_bias": ((None, {}), "biasing token logits is not implemented by this server"),
          # vLLM / llama.cpp sampling extensions that scripts written for those servers send at their no-op values
          "repetition_penalty": ((None, 1, 1.0), "repetition penalties are not implemented by this server (only 1)"),
          "length_penalty": ((None, 1, 1.0), "length penalties are not implemented by this server (only 1)"),
          "use_beam_search": ((None, False), "beam search is not implemented by this server")}
CHAT_UNSUPPORTED = {
    **SHARED,
    "response_format": ((None, {"type": "text"}), "only plain text output is supported by this server"),
    "tools": ((None, []), NO_TOOLS), "functions": ((None, []), NO_TOOLS),
    "tool_choice": ((None, "none", "auto"), NO_TOOLS), "function_call": ((None, "none", "auto"), NO_TOOLS),
    "audio": ((None,), "audio output is not supported by this server"),
    "modalities": ((None, ["text"]), "only text output is supported by this server"),
    "reasoning_effort": ((None,), "reasoning effort is not configurable on this server"),
    "verbosity": ((None,), "verbosity is not configurable on this server"),
    "web_search_options": ((None,), "web search is not supported by this server (no network)"),
    "moderation": ((None,), "moderation is not run by this server")}
COMPLETION_UNSUPPORTED = {
    **SHARED, "suffix": ((None, ""), "a suffix (inserting text before it) is not supported by this server")}
# accepted and ignored: they change nothing a client gets back (bookkeeping and billing on OpenAI's platform,
# caching and latency hints, what only matters alongside tools)
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                     "prompt_cache_options", "prompt_cache_retention", "prediction", "parallel_tool_calls"})


class StreamOptions(BaseModel):
    """``include_usage``; OpenAI's ``include_obfuscation`` (padding against length side channels) is accepted and
    ignored, anything else refused by :func:`start` (vLLM's ``continuous_usage_stats`` is not implemented)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # NaN is no number a sampler can take
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # NaN is no number a sampler can take
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None


class _Generate(BaseModel):
    """Fields both routes share; ``None`` means the API's default. The other fields the routes take are checked by
    :func:`.http.refuse_unsupported`."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # NaN is no number a sampler can take
    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1: no limit, as vLLM and SGLang take it (scripts for them send it)
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's: keep tokens at least min_p times the likeliest's
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)
    n: int | None = None
    session_id: str | None = None
    return_token_ids: bool | None = None
    ignore_eos: bool | None = None


class ChatRequest(_Generate):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(_Generate):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo (the prompt scored, nothing generated)
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the top N besides each token's own
    echo: bool | None = None  # the prompt before the completion, in the text and (with logprobs) the log-probabilities


def content_text(content, where: str, media: list | None = None) -> str:
    """A message's content as text: a string, or a list of ``{"type": "text"}`` parts (joined by newlines) and
    ``image_url`` / ``video_url`` parts, which become placeholders while ``media`` collects (kind, url); ``media``
    None: the model has no vision component."""
    if content is None or isinstance(content, str):
        return content or ""
    out, after_text = "", False
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            out += ("\n" if after_text else "") + part["text"]
            after_text = True
        elif kind == "text":
            raise ApiError(400, f"{where}[{i}].text: a text part needs a string 'text'", param=where)
        elif kind in MEDIA_PARTS:
            if media is None:
                raise ApiError(400, f"{where}[{i}]: this model has no vision component", param=where)
            spec = part.get(kind)
            url = spec.get("url") if isinstance(spec, dict) else spec
            if not isinstance(url, str) or not url:
                raise ApiError(400, f"{where}[{i}].{kind}.url: {MEDIA_URL}", param=where)
            media.append((MEDIA_PARTS[kind], url))
            out, after_text = out + placeholder(MEDIA_PARTS[kind]), False
        elif kind in NO_MODALITY:
            raise ApiError(400, f"{where}[{i}]: this model has no {NO_MODALITY[kind]} component", param=where)
        else:
            raise ApiError(400, f"{where}[{i}]: unsupported content part {kind!r} (text, image_url, video_url)",
                           param=where)
    return out


def render_chat(backend: Backend, messages: list[Message], media: list | None = None,
                add_generation_prompt: bool = True) -> str:
    for i, m in enumerate(messages):  # the template would drop a past call and show an empty assistant turn
        call = next((k for k in ("tool_calls", "function_call") if (m.model_extra or {}).get(k)), None)
        if call is not None:
            raise ApiError(400, f"messages[{i}].{call}: {NO_TOOLS}", param="messages")
    turns = [{"role": "system" if m.role == "developer" else m.role,
              "content": content_text(m.content, f"messages[{i}].content", media)} for i, m in enumerate(messages)]
    try:
        return backend.engine.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # the template's own raise_exception, or a Jinja error on odd input
        raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None


def usage(outs: list[Outcome], n: int = 1) -> dict:
    """Over every choice: each prompt counted once (its ``n`` choices share it), every choice's tokens."""
    prompt, cached = sum(o.prompt_n for o in outs[::n]), sum(o.cached_n for o in outs[::n])
    done = sum(len(o.tokens) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached}}


def timings(outs: list[Outcome]):
    """The ``timings`` extension: one choice's dict, or a list of them in choice order."""
    return outs[0].timings if len(outs) == 1 else [o.timings for o in outs]


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice ``i``'s seed: the request's plus ``i``, wrapped into 64 bits - seeded choices differ from each other
    and choice 0 is what the same request with ``n`` = 1 gives."""
    return None if seed is None else (seed + i + 2**63) % 2**64 - 2**63


async def start(request: Request, backend: Backend, body: _Generate, sources: list[dict], **common
                ) -> list[Generation]:
    """Every choice of the request submitted: ``n`` for each prompt in ``sources`` (prompt-major, the order of
    ``choices[].index``); the first of each prompt tokenizes it, the others reuse its ids."""
    backend.check_model(body.model)
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_CHOICES // len(sources):
        raise ApiError(400, f"n: between 1 and {MAX_CHOICES // len(sources)} choices for {len(sources)} prompt(s) "
                       f"(at most {MAX_CHOICES} in a request), got {n}", param="n")
    session = session_of(request, body.session_id)
    if session is not None and n * len(sources) > 1:
        raise ApiError(400, "session_id: a session continues one conversation, so n must be 1 with one prompt",
                       param="session_id")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")
    unknown = next(iter(body.stream_options.model_extra or {}), None) if body.stream_options else None
    if unknown is not None:
        raise ApiError(400, f"stream_options.{unknown[:SHOWN_CHARS]}: not an option this server implements "
                            f"(include_usage, include_obfuscation)", param="stream_options")
    sampling = dict(backend.sampling(body.temperature, body.top_p, body.top_k, min_p=body.min_p), stop=body.stop,
                    ignore_eos=body.ignore_eos, top_logprobs=top_logprobs(body))
    gens: list[Generation] = []
    try:
        for source in sources:
            first = await backend.generate(**source, **common, session_id=session, seed=body.seed, **sampling)
            gens.append(first)
            gens += [backend.again(first, choice_seed(body.seed, i)) for i in range(1, n)]
    except BaseException:  # a later choice refused (queue full): the earlier ones are not left running
        cancel(gens)
        raise
    return gens


def top_logprobs(body: _Generate) -> int | None:
    """How many most likely tokens to list beside each generated token's own log-probability (None: no
    log-probabilities): chat's ``logprobs: true`` with ``top_logprobs``, a completion's ``logprobs: N``."""
    if isinstance(body, ChatRequest):
        if body.top_logprobs and not body.logprobs:  # (0 asks for nothing: clients that spell out defaults send it)
            raise ApiError(400, "top_logprobs: only with logprobs true", param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def cancel(gens: list[Generation]) -> None:
    for gen in gens:
        gen.cancel()


async def collect(request: Request, gens: list[Generation]) -> list[Outcome]:
    try:
        return list(await asyncio.gather(*(gen.collect(request.is_disconnected) for gen in gens)))
    finally:
        cancel(gens)


async def merged(gens: list[Generation]):
    """``(index, text, ids, logprobs, None)`` as any of the generations commits tokens, ``(index, None, None, None,
    outcome)`` as each ends; one generation's order is its own (for a single one: its deltas, then its outcome)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for text, ids, entries in gen.deltas():
                queue.put_nowait((i, text, ids, entries, None))
            queue.put_nowait((i, None, None, None, await gen.outcome()))
        except Exception as e:
            queue.put_nowait((i, None, None, None, e))

    tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, text, ids, entries, end = await queue.get()
            if isinstance(end, Exception):
                raise end
            if end is not None:
                left -= 1
            yield i, text, ids, entries, end
    finally:
        for task in tasks:
            task.cancel()


def stream(gens: list[Generation], head: dict, choice, final, body: _Generate) -> StreamingResponse:
    """SSE chunks: ``choice(index, text, ids, logprobs)`` builds a chunk's choice, ``final(index, out)`` a choice's
    last one (with that choice's ``timings``, an extension clients keep as an unknown field). As OpenAI streams
    them: the usage only when ``stream_options.include_usage`` asks for it, in a last chunk without choices, every
    other chunk then carrying ``"usage": null``; without it no chunk has a usage field."""
    want_ids = bool(body.return_token_ids)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if include_usage:
        head = {**head, "usage": None}
    n = body.n or 1  # choices a prompt

    async def events():
        try:
            for i in range(len(gens)):
                first = choice(i, None, None, None)
                if first:
                    yield sse({**head, "choices": [first]})
            outs: list[Outcome | None] = [None] * len(gens)
            async for i, text, ids, entries, out in merged(gens):
                if out is None:
                    if text or (want_ids and ids) or entries:
                        yield sse({**head, "choices": [choice(i, text, ids if want_ids else None, entries)]})
                    continue
                outs[i] = out
                yield sse({**head, "choices": [final(i, out)], "timings": out.timings})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(outs, n)})
        except Exception as e:  # the status line is sent: the error goes in the stream
            yield sse(error_body(api_error(e), anthropic=False))
        finally:
            cancel(gens)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def register(app: FastAPI, backend: Backend, max_body: int) -> None:
    @app.get("/v1/models")
    async def models():
        opts = backend.engine.options
        return {"object": "list", "data": [{"id": backend.model_id, "object": "model", "created": backend.created,
                                            "owned_by": "ninfer-bench", "max_context": backend.context_limit,
                                            "spec": opts.spec}]}

    @app.get("/v1/models/{name:path}")  # a Hugging Face style id has a slash ("org/name"; clients send it as %2F)
    async def model(name: str):
        backend.check_model(name)
        return {"id": backend.model_id, "object": "model", "created": backend.created, "owned_by": "ninfer-bench"}

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatRequest))
    async def chat(request: Request):
        body = validate(ChatRequest, await read_json(request, max_body))
        refuse_unsupported(body.model_extra or {}, CHAT_UNSUPPORTED, IGNORED)
        media = [] if backend.engine.vision is not None else None
        text = render_chat(backend, body.messages, media)
        gens = await start(request, backend, body, [{"text": text, "media": media or ()}],
                           max_tokens=body.max_completion_tokens or body.max_tokens)
        cid, created = new_id("chatcmpl-"), int(time.time())
        head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": backend.model_id}
        extra = {"session_id": gens[0].session_id} if gens[0].session_id else {}
        tok = backend.engine.tokenizer
        if body.stream:
            def choice(i, text, ids, entries):
                delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
                lp = chat_content(tok, entries) if entries is not None else None
                return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": None,
                        **({"token_ids": ids} if ids is not None else {})}

            def final(i, out):
                return {"index": i, "delta": {}, "logprobs": None, "finish_reason": FINISH[out.finish]}

            return stream(gens, {**head, **extra}, choice, final, body)
        outs = await collect(request, gens)
        msgs = [{"index": i, "message": {"role": "assistant", "content": out.text},
                 "logprobs": chat_content(tok, out.logprobs) if out.logprobs is not None else None,
                 "finish_reason": FINISH[out.finish], **({"token_ids": out.tokens} if body.return_token_ids else {})}
                for i, out in enumerate(outs)]
        return {**head, "object": "chat.completion", "choices": msgs, "usage": usage(outs, len(outs)),
                "timings": timings(outs), **extra,
                **({"prompt_token_ids": gens[0].prompt} if body.return_token_ids else {})}

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request):
        body = validate(CompletionRequest, await read_json(request, max_body))
        refuse_unsupported(body.model_extra or {}, COMPLETION_UNSUPPORTED, IGNORED)
        if body.best_of not in (None, body.n or 1):  # best_of == n: every candidate is returned, as n choices
            raise ApiError(400, f"best_of: generating best_of candidates to return the n most likely is not "
                                f"supported by this server (leave best_of out, or equal to n), got {body.best_of}",
                           param="best_of")
        prompts = body.prompt
        if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
            prompts = [prompts]  # one prompt: a string or a list of token ids
        if len(prompts) > MAX_CHOICES:
            raise ApiError(400, f"prompt: at most {MAX_CHOICES} prompts in a request, got {len(prompts)}",
                           param="prompt")
        for j, prompt in enumerate(prompts):
            if not prompt:
                raise ApiError(400, "prompt: the prompt is empty" if len(prompts) == 1 else f"prompt[{j}]: empty",
                               param="prompt")
        if body.max_tokens == 0 and not body.echo:  # as OpenAI: scoring a prompt (echo) is the one use of 0
            raise ApiError(400, "max_tokens: 0 is less than the minimum of 1 (0 only with echo: the prompt is "
                                "returned, nothing generated)", param="max_tokens")
        sources = [{"text": p} if isinstance(p, str) else {"ids": list(p)} for p in prompts]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        gens = await start(request, backend, body, sources, max_tokens=max_tokens, prompt_param="prompt",
                           prompt_logprobs=body.logprobs if body.echo else None)
        head = {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()),
                "model": backend.model_id, **({"session_id": gens[0].session_id} if gens[0].session_id else {})}
        tok, offsets, n = backend.engine.tokenizer, [0] * len(gens), body.n or 1  # n: choices a prompt
        # echo: a text prompt as given, token ids decoded
        echoes = [p if isinstance(p, str) else tok.decode(p) for p in prompts] if body.echo else None
        if body.stream:
            pending = [bool(body.echo)] * len(gens)  # choices whose prompt is still to be sent

            def choice(i, text, ids, entries, finish=None):
                if text is None:
                    return None
                if pending[i]:  # the prompt (text and entries) in the choice's first chunk, as vLLM sends it
                    pending[i] = False
                    text, prompt = echoes[i // n] + text, gens[i].prompt_logprobs()
                    entries = None if prompt is None else [*prompt, *(entries or [])]
                lp = None
                if entries is not None:
                    lp = completion_logprobs(tok, entries, offsets[i])
                    offsets[i] += sum(map(len, lp["tokens"]))  # the next chunk's first offset
                return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish,
                        **({"token_ids": ids} if ids is not None else {})}

            def final(i, out):  # (with the prompt when no text came before: max_tokens 0, or only end tokens)
                return choice(i, "", None, None, FINISH[out.finish])

            return stream(gens, head, choice, final, body)
        outs = await collect(request, gens)

        def logprobs(out: Outcome) -> dict | None:
            if out.logprobs is None:
                return None
            return completion_logprobs(tok, [*(out.prompt_logprobs or []), *out.logprobs])

        choices = [{"index": i, "text": (echoes[i // n] if echoes else "") + out.text, "logprobs": logprobs(out),
                    "finish_reason": FINISH[out.finish], **({"token_ids": out.tokens} if body.return_token_ids else {})}
                   for i, out in enumerate(outs)]
        ids = [gen.prompt for gen in gens[::n]]
        return {**head, "choices": choices, "usage": usage(outs, n), "timings": timings(outs),
                **({"prompt_token_ids": ids[0] if len(ids) == 1 else ids} if body.return_token_ids else {})}
