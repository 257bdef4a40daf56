"""Anthropic-style routes: ``/v1/messages`` and ``/v1/messages/count_tokens`` (see :mod:`.app`)."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..media.prompt import placeholder
from .engine_thread import Backend, Outcome
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

STOP_REASON = {"eos": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens"}
MAX_TEMPERATURE = 1.0  # Anthropic's range is 0-1: a model default above it (generation_config.json) is lowered to it
NO_MODALITY = {"document": "document"}

# Anthropic fields this server does not implement: accepted only with a value that asks for nothing, refused
# otherwise. Field: (those values, why any other is refused).
NO_TOOLS = "tool use is not supported by this server"
UNSUPPORTED = {
    "tools": ((None, []), NO_TOOLS), "tool_choice": ((None, {"type": "auto"}, {"type": "none"}), NO_TOOLS),
    "mcp_servers": ((None, []), NO_TOOLS), "container": ((None,), NO_TOOLS),
    "thinking": ((None, {"type": "disabled"}), "extended thinking is not configurable on this server"),
    "output_config": ((None, {}), "output configuration (format, effort) is not supported by this server"),
    "context_management": ((None,), "context management is not supported by this server"),
    "diagnostics": ((None,), "diagnostics are not returned by this server")}
# accepted and ignored: they change nothing a client gets back (bookkeeping, routing, caching and speed hints)
IGNORED = frozenset({"metadata", "service_tier", "inference_geo", "speed", "cache_control", "user_profile_id",
                     "workspace_id"})


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # NaN is no number a sampler can take
    role: Literal["user", "assistant"]
    content: str | list[dict]


class CountRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # NaN is no number a sampler can take
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict] | None = None


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    stream: bool | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)
    session_id: str | None = None
    return_token_ids: bool | None = None
    ignore_eos: bool | None = None


# count_tokens may be sent a whole messages body: what only steers the generation leaves the count as it is
COUNT_IGNORED = IGNORED | frozenset(MessagesRequest.model_fields)


def image_block(block: dict, where: str, media: list | None) -> str:
    """An ``image`` block (base64 source) as a placeholder, its data URI appended to ``media``."""
    if media is None:
        raise ApiError(400, f"{where}: this model has no vision component")
    src = block.get("source")
    if not isinstance(src, dict) or src.get("type") != "base64":
        kind = src.get("type") if isinstance(src, dict) else None
        hint = " (no network: remote images are not fetched)" if kind == "url" else ""
        raise ApiError(400, f"{where}.source: expected {{'type': 'base64', 'media_type', 'data'}}, got type "
                            f"{kind!r}{hint}")
    if not isinstance(src.get("data"), str) or not isinstance(src.get("media_type"), str):
        raise ApiError(400, f"{where}.source: 'media_type' and 'data' must be strings")
    media.append(("image", f"data:{src['media_type']};base64,{src['data']}"))
    return placeholder("image")


def blocks_text(content, where: str, media: list | None = None) -> str:
    """A string, or a list of ``{"type": "text"}`` blocks (joined by newlines) and ``image`` blocks, which become
    placeholders while ``media`` collects them (None: the model has no vision component)."""
    if isinstance(content, str):
        return content
    out, after_text = "", False
    for i, block in enumerate(content):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            out += ("\n" if after_text else "") + block["text"]
            after_text = True
        elif kind == "text":
            raise ApiError(400, f"{where}[{i}].text: a text block needs a string 'text'")
        elif kind == "image":
            out, after_text = out + image_block(block, f"{where}[{i}]", media), False
        elif kind in NO_MODALITY:
            raise ApiError(400, f"{where}[{i}]: this model has no {NO_MODALITY[kind]} component")
        else:
            raise ApiError(400, f"{where}[{i}]: unsupported content block {kind!r} (text and image blocks)")
    return out


def render(backend: Backend, body: CountRequest, media: list | None = None) -> str:
    """The prompt text (``media`` collects the images, see :func:`blocks_text`). A final assistant message is a
    prefill: the reply continues it. As Anthropic's API: every message but that prefill needs content, and the
    prefill may not end in whitespace."""
    turns = [{"role": "system", "content": blocks_text(body.system, "system", media)}] if body.system else []
    for i, m in enumerate(body.messages):
        last_assistant = i == len(body.messages) - 1 and m.role == "assistant"
        if not m.content and not last_assistant:  # "" or []
            raise ApiError(400, f"messages.{i}: all messages must have non-empty content except for the optional "
                                f"final assistant message", param=f"messages.{i}.content")
        turns.append({"role": m.role, "content": blocks_text(m.content, f"messages.{i}.content", media)})
    prefill = turns.pop()["content"] if turns[-1]["role"] == "assistant" else ""
    if prefill != prefill.rstrip():
        raise ApiError(400, "final assistant content cannot end with trailing whitespace",
                       param=f"messages.{len(body.messages) - 1}.content")
    try:
        return backend.engine.tokenizer.apply_chat_template(turns, add_generation_prompt=True) + prefill
    except Exception as e:  # the template's own raise_exception, or a Jinja error on odd input
        raise ApiError(400, f"the chat template rejected the messages: {e}") from None


def usage(out: Outcome) -> dict:
    return {"input_tokens": out.prompt_n - out.cached_n, "output_tokens": len(out.tokens),
            "cache_read_input_tokens": out.cached_n, "cache_creation_input_tokens": 0}


def register(app: FastAPI, backend: Backend, max_body: int) -> None:
    @app.post("/v1/messages/count_tokens", openapi_extra=body_schema(CountRequest))
    async def count_tokens(request: Request):
        body = validate(CountRequest, await read_json(request, max_body))
        refuse_unsupported(body.model_extra or {}, UNSUPPORTED, COUNT_IGNORED)
        backend.check_model(body.model)
        media = [] if backend.engine.vision is not None else None
        text = render(backend, body, media)
        ids = await asyncio.to_thread(backend.engine.tokenizer.encode, text)
        if media is not None:  # a vision model: the placeholders are checked even without media, as generating does
            ids, _ = await asyncio.to_thread(backend.media_prompt, ids, media)
        return {"input_tokens": len(ids)}

    @app.post("/v1/messages", openapi_extra=body_schema(MessagesRequest))
    async def messages(request: Request):
        body = validate(MessagesRequest, await read_json(request, max_body))
        refuse_unsupported(body.model_extra or {}, UNSUPPORTED, IGNORED)
        backend.check_model(body.model)
        media = [] if backend.engine.vision is not None else None
        text = render(backend, body, media)
        gen = await backend.generate(
            text=text, media=media or (), max_tokens=body.max_tokens, session_id=session_of(request, body.session_id),
            **backend.sampling(body.temperature, body.top_p, body.top_k, MAX_TEMPERATURE), seed=body.seed,
            stop=body.stop_sequences, ignore_eos=body.ignore_eos)
        msg = {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": backend.model_id,
               **({"session_id": gen.session_id} if gen.session_id else {})}
        want_ids = bool(body.return_token_ids)
        if not body.stream:
            try:
                out = await gen.collect(request.is_disconnected)
            finally:
                gen.cancel()
            return {**msg, "content": [{"type": "text", "text": out.text}], "stop_reason": STOP_REASON[out.finish],
                    "stop_sequence": out.stop_sequence, "usage": usage(out), "timings": out.timings,
                    **({"token_ids": out.tokens, "prompt_token_ids": gen.prompt} if want_ids else {})}

        async def events():
            try:
                cached = gen.expected_cached
                start = {**msg, "content": [], "stop_reason": None, "stop_sequence": None,
                         "usage": {"input_tokens": len(gen.prompt) - cached, "output_tokens": 0,
                                   "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}
                yield sse({"type": "message_start", "message": start}, "message_start")
                yield sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                          "content_block_start")
                async for text, ids, _ in gen.deltas():
                    if text or (want_ids and ids):
                        delta = {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": text},
                                 **({"token_ids": ids} if want_ids else {})}
                        yield sse(delta, "content_block_delta")
                out = await gen.outcome()
                yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                yield sse({"type": "message_delta", "delta": {"stop_reason": STOP_REASON[out.finish],
                                                              "stop_sequence": out.stop_sequence},
                           "usage": usage(out), "timings": out.timings}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
            except Exception as e:  # the status line is sent: the error goes in the stream
                yield sse(error_body(api_error(e, anthropic=True), anthropic=True), "error")
            finally:
                gen.cancel()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
