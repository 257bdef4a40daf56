"""OpenAI-style routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions`` (see :mod:`.server`)."""

from __future__ import annotations

import time
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .backend import Backend, Generation, Outcome
from .mrope import placeholder
from .server import ApiError, api_error, error_body, new_id, read_json, session_of, sse, validate

FINISH = {"eos": "stop", "stop_sequence": "stop", "length": "length"}
MEDIA_PARTS = {"image_url": "image", "video_url": "video"}  # {"type": kind, kind: {"url": data URI | path}}
NO_MODALITY = {"input_image": "vision", "image": "vision", "input_audio": "audio", "audio": "audio",
               "file": "file input"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None


class _Generate(BaseModel):
    """Fields both routes share; ``None`` means the API's default. Unknown fields are ignored."""

    model_config = ConfigDict(extra="allow")
    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)
    n: int | None = None
    session_id: str | None = None
    return_token_ids: bool | None = None
    ignore_eos: bool | None = None


class ChatRequest(_Generate):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list | None = None


class CompletionRequest(_Generate):
    prompt: str | list[int] | list[str] | list[list[int]]


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
        elif kind in MEDIA_PARTS:
            if media is None:
                raise ApiError(400, f"{where}[{i}]: this model has no vision component", param=where)
            spec = part.get(kind)
            url = spec.get("url") if isinstance(spec, dict) else spec
            if not isinstance(url, str) or not url:
                raise ApiError(400, f"{where}[{i}].{kind}.url: expected a data URI or a local file path", param=where)
            media.append((MEDIA_PARTS[kind], url))
            out, after_text = out + placeholder(MEDIA_PARTS[kind]), False
        elif kind in NO_MODALITY:
            raise ApiError(400, f"{where}[{i}]: this model has no {NO_MODALITY[kind]} component", param=where)
        else:
            raise ApiError(400, f"{where}[{i}]: unsupported content part {kind!r} (text, image_url, video_url)",
                           param=where)
    return out


def render_chat(backend: Backend, messages: list[Message], media: list | None = None) -> str:
    turns = [{"role": "system" if m.role == "developer" else m.role,
              "content": content_text(m.content, f"messages[{i}].content", media)} for i, m in enumerate(messages)]
    try:
        return backend.engine.tokenizer.apply_chat_template(turns, add_generation_prompt=True)
    except Exception as e:  # the template's own raise_exception, or a Jinja error on odd input
        raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None


def usage(out: Outcome) -> dict:
    n = len(out.tokens)
    return {"prompt_tokens": out.prompt_n, "completion_tokens": n, "total_tokens": out.prompt_n + n,
            "prompt_tokens_details": {"cached_tokens": out.cached_n}}


async def start(request: Request, backend: Backend, body: _Generate, **prompt) -> Generation:
    backend.check_model(body.model)
    if body.n not in (None, 1):
        raise ApiError(400, "n: only one choice per request is supported", param="n")
    extra = body.model_extra or {}
    if extra.get("logprobs"):
        raise ApiError(400, "logprobs: log-probabilities are not returned by this server", param="logprobs")
    if extra.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, "response_format: only plain text output is supported by this server",
                       param="response_format")
    if extra.get("echo"):
        raise ApiError(400, "echo: returning the prompt is not supported by this server", param="echo")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")
    return await backend.generate(
        **prompt, session_id=session_of(request, body.session_id),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed, stop=body.stop,
        ignore_eos=body.ignore_eos)


def stream(gen: Generation, head: dict, choice, final, body: _Generate) -> StreamingResponse:
    """SSE chunks: ``choice(text, ids)`` builds a chunk's choice, ``final(out)`` the finishing one."""
    want_ids = bool(body.return_token_ids)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events():
        try:
            first = choice(None, None)
            if first:
                yield sse({**head, "choices": [first]})
            async for text, ids in gen.deltas():
                if text or (want_ids and ids):
                    yield sse({**head, "choices": [choice(text, ids if want_ids else None)]})
            out = await gen.outcome()
            if include_usage:  # as OpenAI: the usage once, in a last chunk of its own (no choices)
                yield sse({**head, "choices": [final(out)], "usage": None, "timings": out.timings})
                yield sse({**head, "choices": [], "usage": usage(out)})
            else:  # (an extension: OpenAI sends none)
                yield sse({**head, "choices": [final(out)], "usage": usage(out), "timings": out.timings})
        except Exception as e:  # the status line is sent: the error goes in the stream
            yield sse(error_body(api_error(e), anthropic=False))
        finally:
            gen.cancel()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def register(app: FastAPI, backend: Backend, max_body: int) -> None:
    @app.get("/v1/models")
    async def models():
        opts = backend.engine.options
        return {"object": "list", "data": [{"id": backend.model_id, "object": "model", "created": backend.created,
                                            "owned_by": "ninfer-bench", "max_context": backend.context_limit,
                                            "spec": opts.spec}]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        backend.check_model(name)
        return {"id": backend.model_id, "object": "model", "created": backend.created, "owned_by": "ninfer-bench"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = validate(ChatRequest, await read_json(request, max_body))
        if body.tools:
            raise ApiError(400, "tools: tool calling is not supported by this server", param="tools")
        media = [] if backend.engine.vision is not None else None
        text = render_chat(backend, body.messages, media)
        gen = await start(request, backend, body, text=text, media=media or (),
                          max_tokens=body.max_completion_tokens or body.max_tokens)
        cid, created = new_id("chatcmpl-"), int(time.time())
        head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": backend.model_id}
        extra = {"session_id": gen.session_id} if gen.session_id else {}
        if body.stream:
            def choice(text, ids):
                delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None,
                        **({"token_ids": ids} if ids is not None else {})}

            def final(out):
                return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": FINISH[out.finish]}

            return stream(gen, {**head, **extra}, choice, final, body)
        try:
            out = await gen.collect(request.is_disconnected)
        finally:
            gen.cancel()
        msg = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
               "finish_reason": FINISH[out.finish], **({"token_ids": out.tokens} if body.return_token_ids else {})}
        return {**head, "object": "chat.completion", "choices": [msg], "usage": usage(out), "timings": out.timings,
                **extra, **({"prompt_token_ids": gen.prompt} if body.return_token_ids else {})}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = validate(CompletionRequest, await read_json(request, max_body))
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt: the prompt is empty", param="prompt")
        source = {"text": prompt} if isinstance(prompt, str) else {"ids": list(prompt)}
        gen = await start(request, backend, body, **source, max_tokens=body.max_tokens or 16)
        head = {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()),
                "model": backend.model_id, **({"session_id": gen.session_id} if gen.session_id else {})}
        if body.stream:
            def choice(text, ids):
                if text is None:
                    return None
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": None,
                        **({"token_ids": ids} if ids is not None else {})}

            def final(out):
                return {"index": 0, "text": "", "logprobs": None, "finish_reason": FINISH[out.finish]}

            return stream(gen, head, choice, final, body)
        try:
            out = await gen.collect(request.is_disconnected)
        finally:
            gen.cancel()
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": FINISH[out.finish],
                  **({"token_ids": out.tokens} if body.return_token_ids else {})}
        return {**head, "choices": [choice], "usage": usage(out), "timings": out.timings,
                **({"prompt_token_ids": gen.prompt} if body.return_token_ids else {})}
