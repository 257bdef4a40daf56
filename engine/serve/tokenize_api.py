"""vLLM's tokenizer routes: ``POST /tokenize`` and ``POST /detokenize``, in vLLM's request and response shapes.

``/tokenize`` takes a text (``{"prompt": str, "add_special_tokens"?: bool}``, default true) or a conversation
(``{"messages": [...], "add_generation_prompt"?: bool, "continue_final_message"?: bool, "add_special_tokens"?:
bool}``: the chat template rendered as ``/v1/chat/completions`` renders it - generation prompt on by default, media
parts widened to their vision tokens - special tokens off by default), with ``model`` optional (when given it must
be the served one) and ``return_token_strs`` for the tokens' vocabulary strings; it answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` null unless asked for). ``add_special_tokens``
adds what the tokenizer's post-processor adds (none, for the Qwen family: the generation routes never add any).

``/detokenize`` takes ``{"model"?, "tokens": [int]}`` and answers ``{"prompt": str}``, special tokens kept as text;
an id the tokenizer has no token for (negative, past the vocabulary, or one of a padded vocabulary's unnamed rows) is
a 400 naming it. Errors take the OpenAI shape (:mod:`.http`); with ``serve --api-key`` both routes want the key
(:mod:`.guard`).
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from .engine_thread import Backend
from .http import ApiError, body_schema, read_json, refuse_unsupported, validate
from .openai_api import NO_TOOLS, Message, content_text, render_chat

# vLLM's chat tokenization fields this server does not implement: accepted only at the value that asks for nothing
CHAT_UNSUPPORTED = {
    "chat_template": ((None,), "a request's own chat template is not supported by this server (the model's is used)"),
    "chat_template_kwargs": ((None, {}), "chat template arguments are not supported by this server"),
    "tools": ((None, []), NO_TOOLS),
    "mm_processor_kwargs": ((None, {}), "media processor arguments are not supported by this server")}


class TokenizeCompletion(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None  # vLLM's default: true
    return_token_strs: bool | None = None


class TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool | None = None  # vLLM's default: true
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None  # vLLM's default: false (the template writes the markers)
    return_token_strs: bool | None = None


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


def encode(tok, text: str, special: bool) -> list[int]:
    """``text``'s ids; ``special``: with what the tokenizer's post-processor adds (a byte tokenizer adds nothing)."""
    backend = getattr(tok, "backend", None)
    try:
        if special and backend is not None:
            return backend.encode(text, add_special_tokens=True).ids
        return tok.encode(text)
    except ValueError as e:  # the byte tokenizer of a vocabulary under 256: a byte with no id
        raise ApiError(400, str(e)) from None


def continue_final(rendered: str, final: str) -> str:
    """The rendered conversation cut right after the final message's content (its end-of-turn markers dropped),
    found as Hugging Face finds it: the content as given, else stripped (templates that trim it)."""
    for text in (final, final.strip()):
        at = rendered.rfind(text)
        if at >= 0:
            return rendered[:at + len(text)]
    raise ApiError(400, "continue_final_message: the final message's content is not in the rendered conversation",
                   param="continue_final_message")


def either(data: dict) -> type[BaseModel]:
    if "messages" in data and "prompt" in data:
        raise ApiError(400, "give prompt (a text) or messages (a conversation), not both", param="prompt")
    if "messages" in data:
        return TokenizeChat
    if "prompt" not in data:
        raise ApiError(400, "prompt: this field is required (or messages, a conversation)", param="prompt")
    return TokenizeCompletion


def tokenize_schema() -> dict:
    """The published body: either request shape."""
    one, other = (body_schema(m)["requestBody"]["content"]["application/json"]["schema"]
                  for m in (TokenizeCompletion, TokenizeChat))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": [one, other]}}}}}


def register(app: FastAPI, backend: Backend, max_body: int) -> None:
    tok = backend.engine.tokenizer

    @app.post("/tokenize", openapi_extra=tokenize_schema())
    async def tokenize(request: Request):
        data = await read_json(request, max_body)
        body = validate(either(data), data)
        if body.model is not None:
            backend.check_model(body.model)
        if isinstance(body, TokenizeChat):
            refuse_unsupported(body.model_extra or {}, CHAT_UNSUPPORTED, frozenset())
            cont, gen = bool(body.continue_final_message), body.add_generation_prompt
            if cont and gen is not False:  # (vLLM: add_generation_prompt is true unless set false)
                raise ApiError(400, "continue_final_message: cannot continue the final message and add a generation "
                                    "prompt; set add_generation_prompt false", param="continue_final_message")
            media = [] if backend.engine.vision is not None else None
            text = render_chat(backend, body.messages, media, add_generation_prompt=not cont and gen is not False)
            if cont:
                last = body.messages[-1]
                text = continue_final(text, content_text(last.content, f"messages[{len(body.messages) - 1}].content",
                                                         [] if media is not None else None))
            ids = await asyncio.to_thread(encode, tok, text, bool(body.add_special_tokens))
            if media is not None:  # a vision model: placeholders widened (and checked) as generating does
                ids, _ = await asyncio.to_thread(backend.media_prompt, ids, media)
        else:
            refuse_unsupported(body.model_extra or {}, {}, frozenset())
            ids = await asyncio.to_thread(encode, tok, body.prompt, body.add_special_tokens is not False)
        strs = [tok.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": backend.context_limit, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", openapi_extra=body_schema(Detokenize))
    async def detokenize(request: Request):
        body = validate(Detokenize, await read_json(request, max_body))
        refuse_unsupported(body.model_extra or {}, {}, frozenset())
        if body.model is not None:
            backend.check_model(body.model)
        for i, t in enumerate(body.tokens):
            if not 0 <= t < tok.vocab_size or tok.id_to_token(t) is None:
                raise ApiError(400, f"tokens[{i}]: token id {t} is not in the tokenizer's vocabulary",
                               param="tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}
