"""HTTP serving: OpenAI- and Anthropic-style APIs over one Engine, with continuous batching and sessions.

Endpoints::

    GET    /health                      liveness and load: slots, free slots, queue, sessions
    GET    /v1/models                   the one model served (id: the artifact's model_id, its file stem, or preset)
    POST   /v1/chat/completions         OpenAI chat, streamed (SSE) or not
    POST   /v1/completions              OpenAI text completion; ``prompt`` is text or token ids
    POST   /v1/messages                 Anthropic messages, streamed (SSE events) or not
    POST   /v1/messages/count_tokens    Anthropic prompt token count
    GET    /v1/sessions                 retained sessions: id, tokens, bytes
    DELETE /v1/sessions/{id}            forget a session (404 when unknown)
    POST   /tokenize, /detokenize       vLLM's tokenizer routes, in its shapes (:mod:`.tokenize_api`)
    GET    /metrics                     Prometheus metrics: requests, tokens, queue, latencies, speculation (.metrics)

Sampling: ``temperature``, ``top_p``, ``max_tokens``, ``stop`` (Anthropic ``stop_sequences``), ``seed``,
``top_k`` (0, or on the OpenAI routes -1 as vLLM and SGLang take it: no limit). What a request leaves out of
temperature / top_p / top_k comes from the model's ``generation_config.json``, as vLLM does (``serve
--generation-config none``: the APIs' own 1, 1 and no top-k); a default temperature above 1 is lowered to 1 on the
Anthropic route, whose requests may ask 0-1. Extensions every generation route accepts in its JSON body:

- ``session_id``: a persistent session (also the ``X-Session-Id`` header); see :mod:`.sessions`.
- ``return_token_ids: true``: the generated token ids, in ``choices[i].token_ids`` (Anthropic: top-level
  ``token_ids``), and the prompt's in top-level ``prompt_token_ids``; streamed chunks (Anthropic:
  ``content_block_delta`` events) carry the ids committed with them.
- ``ignore_eos: true``: generate exactly ``max_tokens`` tokens (benchmarks with a fixed output length).

OpenAI ``n`` (choices a prompt) and ``/v1/completions`` prompt lists: every choice is a request of its own to the
scheduler (batched with everything else running), at most 64 in a request, indexed prompt-major; a seeded
request gives choice ``i`` the seed plus ``i`` (choice 0 is the ``n`` = 1 answer), the usage counts each prompt
once, ``timings`` becomes a list in choice order, and a session takes one choice of one prompt only.

Log-probabilities (OpenAI routes): chat ``logprobs: true`` with ``top_logprobs`` (0-20), completions ``logprobs: N``
(0-20), streamed or not (:mod:`.logprobs`); a server with a drafter gives them for the first generated token
only (``max_tokens`` 1: it comes from the prefill) and refuses more. Completions ``echo: true`` puts the prompt
(text as given, token ids decoded) before the completion, and with ``logprobs`` the prompt tokens'
log-probabilities first, the first token's ``null`` (:mod:`.scoring`: made in the request's own prefill, drafter
or not); ``max_tokens: 0`` with ``echo`` scores the prompt and generates nothing (without ``echo`` it is refused,
as OpenAI does); streamed, the prompt comes in each choice's first chunk, as vLLM sends it. This is what
lm-evaluation-harness's ``local-completions`` loglikelihood requests use.

Not supported, and refused with a 400 naming the field rather than ignored (the tables of :mod:`.openai_api` and
:mod:`.anthropic_api`): tools and function calling, ``suffix``, ``best_of`` other than ``n``, ``logit_bias``,
presence / frequency penalties, a ``response_format`` other than text, audio output, reasoning and thinking
settings, web search, and vLLM's ``repetition_penalty`` / ``length_penalty`` / ``use_beam_search`` (its ``min_p`` is
implemented);
each is accepted with the value that asks for nothing. A field the route does not know is refused as unknown, as
OpenAI and Anthropic refuse it; fields that change nothing a client gets back (``user``, ``metadata``, ``store``,
``service_tier``, prompt-cache hints, ...) are accepted and ignored.
Stop strings: at most 16, of at most 1000 characters each. Generated control tokens (end tokens, chat markers)
are left out of the text, and so of what stop strings are matched in (as vLLM by default: a special token's name
is no stop string; the engine's own output text and stop check agree); ``return_token_ids`` still shows them.

Images and videos (models with a vision component): OpenAI ``image_url`` / ``video_url`` content parts whose
``url`` is a data URI, Anthropic ``image`` blocks with a base64 source. The server reads no local file a client
names unless started with ``--media-dir DIR`` (``ServerOptions.media_dir``): then a ``url`` may also be a path or
``file://`` URL, relative to DIR or absolute, that stays inside DIR once ``..`` and symlinks are resolved; any other
path is a 400 that says neither whether the file exists nor where a link leads. Remote URLs are refused (no
network); media that cannot be decoded, or exceeds the limits (``Engine.media_limits``), is a 400, and so is a
prompt whose vision placeholders (``<|image_pad|>``, ``<|video_pad|>`` typed into the text) do not match its
media, none at all included. A model without a vision component answers any media with a 400.

Every response (and, streamed, each choice's finish chunk; Anthropic: ``message_delta``) carries ``timings``, an
extension that clients keep as an unknown field:
``prompt_n`` (prompt tokens), ``prompt_cached_n`` (of them loaded from the session instead of prefilled),
``predicted_n``, ``draft_n`` / ``draft_n_accepted`` (speculative decoding), ``queue_ms``, ``prefill_ms``,
``decode_ms``. Usage reports the cached prompt tokens too (OpenAI ``prompt_tokens_details.cached_tokens``;
Anthropic ``cache_read_input_tokens``, with ``input_tokens`` the prefilled rest, as Anthropic counts). An OpenAI
stream carries the usage only when ``stream_options.include_usage`` asks for it, as OpenAI does: in a last chunk
with no choices (the other chunks then have ``"usage": null``).

Errors take each API's shape (``/v1/messages*``: Anthropic ``{"type": "error", "error": {...}}``, elsewhere
OpenAI ``{"error": {...}}``): 400 malformed JSON, invalid parameters or context overflow, 401 a missing or wrong API
key, 403 a Host or browser Origin not served, 413 a body over the size limit, 404 unknown model / session / route
(and a session whose saved state was dropped at start, once), 503 a full queue (with Retry-After), 500 otherwise. A
request past the context is refused by the engine's own check (``Engine.check_fits``), worded here in each API's
terms. Who may talk to the server - the API key, the Host of a loopback bind, browser origins - is
:mod:`.guard`'s. With ``--session-dir``, ``timings.session_persisted`` says whether a session's turn reached the
disk (a failed write never fails the request: :mod:`.sessions`). The schema, request bodies included, is at
``GET /openapi.json``.

The engine runs in one background thread; async handlers submit to it and receive tokens through callbacks
bridged onto an asyncio queue per request (:mod:`.engine_thread`). A client that disconnects cancels its request,
which frees its slot at the next engine iteration; so does shutting the server down (clients get a 503).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from ..runtime.engine import Engine
from . import anthropic_api, openai_api, tokenize_api
from .engine_thread import Backend
from .guard import AccessGuard, AccessPolicy, is_loopback
from .http import EXPECTED, ApiError, api_error, error_response, is_anthropic
from .metrics import METRICS_PATH, CountRequests
from .sessions import quoted

log = logging.getLogger("ninfer_bench.server")


@dataclass(slots=True)
class ServerOptions:
    """Where and how the server listens, queues and keeps sessions. ``max_body_bytes`` None: 64 bytes per token
    of --max-context, at least 1 MiB (a larger body cannot hold a prompt that fits)."""

    host: str = "127.0.0.1"
    port: int = 8080
    max_queue: int = 256
    session_capacity: int = 16
    session_dir: str | None = None
    max_body_bytes: int | None = None
    media_dir: str | None = None  # the one folder whose files requests may name as media (None: data URIs only)
    generation_config: str = "auto"  # "auto": the model's sampling defaults fill what a request leaves out; "none"
    api_key: str | None = None  # every /v1/ route wants it (guard.py)
    insecure: bool = False  # a bind beyond loopback without a key, meant
    allowed_hosts: tuple[str, ...] = ()  # Host names served besides loopback's (a loopback bind)
    allowed_origins: tuple[str, ...] = ()  # browser origins whose cross-origin requests are served ("*": any)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0: any free port), got {self.port!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"max-queue must be a non-negative integer, got {self.max_queue!r}")
        if not isinstance(self.session_capacity, int) or self.session_capacity < 0:
            raise ValueError(f"session-capacity must be a non-negative integer, got {self.session_capacity!r}")
        if self.session_dir is not None and Path(self.session_dir).is_file():
            raise ValueError(f"session-dir {self.session_dir!r} is a file, not a folder")
        if self.max_body_bytes is not None and (not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1):
            raise ValueError(f"max body bytes must be a positive integer, got {self.max_body_bytes!r}")
        if self.media_dir is not None:
            if not Path(self.media_dir).is_dir():
                raise ValueError(f"media-dir {self.media_dir!r} is not a folder")
            self.media_dir = str(Path(self.media_dir).resolve())  # symlinks in the folder's own path resolved once
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"generation-config must be auto or none, got {self.generation_config!r}")
        if not isinstance(self.host, str):
            raise ValueError(f"host must be a string, got {self.host!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("api-key must be a non-empty string")
        for sock in listen(self.host, self.port):  # a taken port is an error before the model loads, not after
            sock.close()
        if not is_loopback(self.host) and self.api_key is None and not self.insecure:
            raise ValueError(f"--host {self.host} serves beyond this machine: give --api-key KEY (clients send it as "
                             f"Authorization: Bearer KEY or x-api-key), or --insecure to serve without one")


def listen(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to ``host``:``port``, one for each address the host resolves to (as asyncio's
    ``create_server`` binds them, which uvicorn would call), not yet listening. ValueError naming the address when
    it cannot be bound: a port in use, a host that does not resolve or is not this machine's."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def refuse(e: OSError):
        reason = e.strerror or str(e)
        return ValueError(f"cannot listen on {where}: {reason[:1].lower()}{reason[1:]}")

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:  # socket.gaierror: no such host
        raise refuse(e) from None
    sockets = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT is free to take
            if family == socket.AF_INET6:  # "::" would otherwise take the IPv4 port too, bound next
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise refuse(e) from None
    return sockets


def create_app(backend: Backend, max_body: int, policy: AccessPolicy | None = None) -> FastAPI:
    """The FastAPI app over ``backend`` (request bodies up to ``max_body`` bytes); its lifespan starts and stops
    the engine thread. ``policy``: who may talk to it (:mod:`.guard`; None: anyone, as in-process tests do)."""
    @asynccontextmanager
    async def lifespan(app):
        backend.start()
        try:
            yield
        finally:
            backend.stop()

    # the schema (request bodies included: http.body_schema) is published for clients and fuzzers; no docs pages
    app = FastAPI(title="ninfer-bench", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.backend = backend
    if policy is not None:
        app.add_middleware(AccessGuard, policy=policy)
    if backend.metrics is not None:  # added last, so outermost: the guard's refusals are counted too
        app.add_middleware(CountRequests, metrics=backend.metrics, routes=app.router.routes)

    async def on_error(request: Request, err: Exception):
        return error_response(request, api_error(err, is_anthropic(request.url.path)))

    for kind in EXPECTED:
        app.add_exception_handler(kind, on_error)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, err: RequestValidationError):
        return error_response(request, ApiError(400, str(err.errors()[0].get("msg", err))))

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, err: HTTPException):
        return error_response(request, ApiError(err.status_code, str(err.detail), headers=err.headers))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, err: Exception):
        return error_response(request, ApiError(500, f"internal error: {type(err).__name__}: {err}"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": backend.model_id, **backend.scheduler.load, "sessions": len(backend.sessions)}

    @app.get("/v1/sessions")
    async def list_sessions():
        return {"object": "list", "data": backend.sessions.describe()}

    @app.delete("/v1/sessions/{sid}")
    async def delete_session(sid: str):
        if not await asyncio.to_thread(backend.sessions.delete, sid):
            raise ApiError(404, f"session {quoted(sid)} not found", code="session_not_found")
        return {"id": sid, "object": "session", "deleted": True}

    @app.get(METRICS_PATH, include_in_schema=False)  # Prometheus text, not a JSON API route (.metrics)
    async def metrics():
        if backend.metrics is None:
            raise ApiError(501, "metrics need prometheus-client (pip install -e '.[serve]')")
        body, kind = backend.metrics.render()
        return Response(body, media_type=kind)

    openai_api.register(app, backend, max_body)
    anthropic_api.register(app, backend, max_body)
    tokenize_api.register(app, backend, max_body)
    return app


def serve(engine: Engine, options: ServerOptions, on_ready=None) -> None:
    """Bind the socket, load the saved sessions, then serve until interrupted; ``on_ready(url, backend, restored,
    problems)`` runs once the socket listens. ValueError when the address cannot be bound (see :func:`listen`)."""
    import uvicorn

    # bound here rather than by uvicorn, which would log the OSError and exit 3: the port may have been taken
    # while the model loaded, after ServerOptions found it free
    sockets = listen(options.host, options.port)
    try:
        backend = Backend(engine, max_queue=options.max_queue, session_capacity=options.session_capacity,
                          session_dir=options.session_dir, media_dir=options.media_dir,
                          generation_config=options.generation_config)
        restored, problems = backend.sessions.load()
        max_body = options.max_body_bytes or max(1 << 20, 64 * engine.options.max_context)

        class _Server(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started and on_ready is not None:
                    host, port = self.servers[0].sockets[0].getsockname()[:2]
                    on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}", backend, restored, problems)

            async def shutdown(self, sockets=None):
                backend.drain()
                await super().shutdown(sockets)

        policy = AccessPolicy.for_bind(options.host, options.api_key, options.allowed_hosts, options.allowed_origins)
        config = uvicorn.Config(create_app(backend, max_body, policy), host=options.host, port=options.port,
                                log_level="warning", timeout_graceful_shutdown=3, ws="none", lifespan="on")
        _Server(config).run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
