"""What the HTTP routes of both APIs share: the error type and its two renderings (OpenAI's and Anthropic's shapes,
statuses from the engine thread's exceptions), server-sent events, reading and validating a JSON body, refusing
unsupported fields, and a request's session id."""

from __future__ import annotations

import json
import logging
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from .engine_thread import (
    BadRequest,
    CapacityError,
    ClientGone,
    ContextOverflow,
    GenerationFailed,
    ModelNotFound,
    QueueFull,
    SessionUnusable,
    ShuttingDown,
)
from .sessions import SHOWN_CHARS, quoted

log = logging.getLogger("ninfer_bench.server")


class ApiError(Exception):
    """An error for the client, rendered in the shape of the API its route belongs to."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers


RETRY = {"Retry-After": "1"}
EXPECTED = (ApiError, BadRequest, CapacityError, ModelNotFound, SessionUnusable, QueueFull, ShuttingDown,
            GenerationFailed, ClientGone)


def overflow_message(err: ContextOverflow, anthropic: bool) -> str:
    """A request past the context in its API's words (the engine's own message names its flags)."""
    prompt, new, limit = err.prompt_tokens, err.new_tokens, err.context
    if anthropic:  # Anthropic's wording of both cases (its requests always give max_tokens)
        if prompt > limit:
            return f"prompt is too long: {prompt} tokens > {limit} maximum"
        return (f"input length and `max_tokens` exceed context limit: {prompt} + {1 if new is None else new} > "
                f"{limit}, decrease input length or `max_tokens` and try again")
    if new is None:  # max_tokens left out: as many as fit
        return f"prompt of {prompt} tokens leaves no room to generate within the context of {limit} tokens"
    return (f"this model's context is {limit} tokens, but {prompt + new} were requested ({prompt} in the prompt, "
            f"{new} in max_tokens): shorten the prompt or lower max_tokens")


def api_error(err: BaseException, anthropic: bool = False) -> ApiError:
    """The HTTP error of an exception raised while serving a request (``anthropic``: on an Anthropic route)."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, ContextOverflow):
        return ApiError(400, overflow_message(err, anthropic), code="context_length_exceeded")
    if isinstance(err, CapacityError):  # not past the context (an empty prompt): no context code
        return ApiError(400, str(err))
    if isinstance(err, BadRequest):
        return ApiError(400, str(err), param=err.param)
    if isinstance(err, SessionUnusable):
        return ApiError(404, str(err), code="session_not_found", param="session_id")
    if isinstance(err, ModelNotFound):
        return ApiError(404, str(err), code="model_not_found", param="model")
    if isinstance(err, QueueFull):
        return ApiError(503, str(err), code="queue_full", headers=RETRY)
    if isinstance(err, ShuttingDown):
        return ApiError(503, str(err), code="shutting_down", headers=RETRY)
    if isinstance(err, ClientGone):
        return ApiError(499, "client disconnected")  # nobody reads it
    if not isinstance(err, GenerationFailed):
        log.error("request failed", exc_info=err)
    return ApiError(500, f"internal error: {err}" if isinstance(err, GenerationFailed) else
                    f"internal error: {type(err).__name__}: {err}")


OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
                404: "invalid_request_error", 413: "invalid_request_error", 503: "server_error", 500: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 503: "overloaded_error", 500: "api_error"}


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(err: ApiError, anthropic: bool) -> dict:
    if anthropic:
        kind = ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}
    kind = OPENAI_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "server_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def error_response(request: Request, err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(err, is_anthropic(request.url.path)), status_code=err.status, headers=err.headers)


def sse(data: dict, event: str | None = None) -> str:
    """One server-sent event."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


# ---- request bodies ------------------------------------------------------------------------------------
async def read_json(request: Request, limit: int) -> dict:
    """The JSON object of the body; 413 past ``limit`` bytes, 400 when it is not a JSON object; ClientGone when the
    client goes away before it sent the whole body (nobody is left to answer, nothing to log)."""
    body, size = bytearray(), 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                body += chunk  # past the limit the rest is read and dropped, so the client sees the 413
    except ClientDisconnect:
        raise ClientGone() from None
    if size > limit:
        raise ApiError(413, f"request body of {size:,} bytes exceeds the limit of {limit:,} bytes")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply") from None
    try:  # legal JSON may still hold a lone surrogate escape ("\ud800"): a string no tokenizer can take
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the JSON body holds a string that is not valid Unicode ({e.reason})") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the JSON body must be an object, got {type(data).__name__}")
    return data


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validate(model: type[BaseModel], data: dict) -> BaseModel:
    """``data`` as ``model`` (strict types); the first problem as a 400 naming the parameter."""
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        path = []
        for part in err["loc"]:  # union branches add type tags ("str", "list[int]") to the location: drop them
            if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part):
                break
            path.append(f"[{part}]" if isinstance(part, int) else f".{part}")
        param = "".join(path).lstrip(".") or None
        msg = err["msg"] if err["type"] != "missing" else "this field is required"
        raise ApiError(400, f"{param}: {msg}" if param else msg, param=param) from None


def refuse_unsupported(extra: dict, unsupported: dict[str, tuple[tuple, str]], ignored: frozenset[str]) -> None:
    """A 400 naming the first of a request's undeclared fields (``extra``) that this server would otherwise drop
    unseen: one of ``unsupported`` ({field: (the values that ask for nothing, why any other is refused)}) holding
    another value, or one in neither that nor ``ignored`` (fields whose loss changes nothing the client gets back),
    which OpenAI and Anthropic refuse as unknown too."""
    for name, value in extra.items():
        if name in ignored:
            continue
        if name not in unsupported:
            raise ApiError(400, f"unknown field {quoted(name)}: not part of the API, or not implemented by this server",
                           param=name[:SHOWN_CHARS])
        off, why = unsupported[name]
        # of the same type too: a JSON 0 is not false (OpenAI completions' ``logprobs: 0`` asks for log-probabilities)
        if not any(type(value) is type(v) and value == v for v in off):
            raise ApiError(400, f"{name}: {why}", param=name)


# ---- headers -------------------------------------------------------------------------------------------
def session_of(request: Request, body_id: str | None) -> str | None:
    """The session a request names: its ``session_id`` field or its ``X-Session-Id`` header."""
    header = request.headers.get("x-session-id")
    if body_id is not None and header is not None and body_id != header:
        raise ApiError(400, f"session_id {quoted(body_id)} and header X-Session-Id {quoted(header)} disagree",
                       param="session_id")
    return body_id if body_id is not None else header


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def body_schema(model: type[BaseModel]) -> dict:
    """A route's ``openapi_extra``: its JSON body as ``model`` validates it, references inlined (the routes read
    their bodies themselves, so FastAPI would otherwise publish none: clients and fuzzers read this schema)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}

