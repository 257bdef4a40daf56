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

Sampling: ``temperature``, ``top_p``, ``max_tokens``, ``stop`` (Anthropic ``stop_sequences``), ``seed``,
``top_k``. Extensions every generation route accepts in its JSON body:

- ``session_id``: a persistent session (also the ``X-Session-Id`` header); see :mod:`.sessions`.
- ``return_token_ids: true``: the generated token ids, in ``choices[0].token_ids`` (Anthropic: top-level
  ``token_ids``), and the prompt's in top-level ``prompt_token_ids``; streamed chunks (Anthropic:
  ``content_block_delta`` events) carry the ids committed with them.
- ``ignore_eos: true``: generate exactly ``max_tokens`` tokens (benchmarks with a fixed output length).

Every response (and the final chunk of a stream, Anthropic: ``message_delta``) carries ``timings``:
``prompt_n`` (prompt tokens), ``prompt_cached_n`` (of them loaded from the session instead of prefilled),
``predicted_n``, ``draft_n`` / ``draft_n_accepted`` (speculative decoding), ``queue_ms``, ``prefill_ms``,
``decode_ms``. Usage reports the cached prompt tokens too (OpenAI ``prompt_tokens_details.cached_tokens``;
Anthropic ``cache_read_input_tokens``, with ``input_tokens`` the prefilled rest, as Anthropic counts).

Errors take each API's shape (``/v1/messages*``: Anthropic ``{"type": "error", "error": {...}}``, elsewhere
OpenAI ``{"error": {...}}``): 400 malformed JSON, invalid parameters or context overflow, 413 a body over
the size limit, 404 unknown model / session / route, 503 a full queue (with Retry-After), 500 otherwise.

The engine is not thread-safe: it runs in one background thread (:meth:`Scheduler.serve_forever`); handlers
are async, submit to the scheduler, and receive tokens through callbacks bridged onto an asyncio queue per
request. A client that disconnects cancels its request, which frees its slot at the next engine iteration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from .runtime import CapacityError, Engine
from .sampling import SamplingParams
from .scheduler import QueueFull, Scheduler
from .sessions import Session, SessionStore, check_session_id

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

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0: any free port), got {self.port!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"max-queue must be a non-negative integer, got {self.max_queue!r}")
        if not isinstance(self.session_capacity, int) or self.session_capacity < 0:
            raise ValueError(f"session-capacity must be a non-negative integer, got {self.session_capacity!r}")
        if self.session_dir is not None and Path(self.session_dir).is_file():
            raise ValueError(f"session-dir {self.session_dir!r} is a file, not a folder")


class ApiError(Exception):
    """An error for the client, rendered in the shape of the API its route belongs to."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers


OPENAI_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                503: "server_error", 500: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
                   503: "overloaded_error", 500: "api_error"}


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(err: ApiError, anthropic: bool) -> dict:
    if anthropic:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(err.status, "api_error"),
                                           "message": err.message}}
    return {"error": {"message": err.message, "type": OPENAI_TYPES.get(err.status, "server_error"),
                      "param": err.param, "code": err.code}}


def error_response(request: Request, err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(err, is_anthropic(request.url.path)), status_code=err.status, headers=err.headers)


def sse(data: dict, event: str | None = None) -> str:
    """One server-sent event."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


# ---- request bodies ------------------------------------------------------------------------------------
async def read_json(request: Request, limit: int) -> dict:
    """The JSON object of the body; 413 past ``limit`` bytes, 400 when it is not a JSON object."""
    body, size = bytearray(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            body += chunk  # past the limit the rest is read and dropped, so the client sees the 413
    if size > limit:
        raise ApiError(413, f"request body of {size:,} bytes exceeds the limit of {limit:,} bytes")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
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


def sampling(max_tokens: int, temperature, top_p, top_k, seed, stop, ignore_eos) -> SamplingParams:
    if stop is not None and not isinstance(stop, str) and not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              seed=seed, stop=tuple([stop] if isinstance(stop, str) else stop or ()),
                              ignore_eos=bool(ignore_eos))
    except ValueError as e:
        raise ApiError(400, str(e)) from None


# ---- text ----------------------------------------------------------------------------------------------
class TextStream:
    """Incremental detokenization: never releases part of a UTF-8 character or a possible start of a stop
    string, and ends the text at the first stop string (``stopped`` names it)."""

    def __init__(self, tokenizer, stop=(), hide=()):
        self.tok, self.stop, self.hide = tokenizer, tuple(stop), set(hide)
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] decode to text already in self.text (context for BPE)
        self.text, self.sent, self.stopped = "", 0, None

    def _decode(self, final: bool) -> None:
        head = self.tok.decode(self.ids[self.prefix:self.read])
        full = self.tok.decode(self.ids[self.prefix:])
        # a trailing U+FFFD is an incomplete multi-byte character: wait for its next token unless this is the end
        if len(full) > len(head) and (final or not full.endswith("\ufffd")):
            self.text += full[len(head):]
            self.prefix, self.read = self.read, len(self.ids)

    def _release(self, final: bool) -> str:
        if self.stopped is not None:
            return ""
        tail = self.text[self.sent:]
        hits = [(tail.find(s), s) for s in self.stop if s in tail]
        if hits:
            at, self.stopped = min(hits)
            self.sent = len(self.text)
            return tail[:at]
        hold = 0 if final else max((k for s in self.stop for k in range(1, len(s)) if tail.endswith(s[:k])),
                                   default=0)
        out = tail[:len(tail) - hold]
        self.sent += len(out)
        return out

    def push(self, ids: list[int]) -> str:
        """Text that ``ids`` complete and that is safe to release."""
        self.ids += [t for t in ids if t not in self.hide]
        self._decode(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """Everything still held back."""
        self._decode(final=True)
        return self._release(final=True)


# ---- the bridge between handlers and the engine thread -------------------------------------------------
@dataclass
class Outcome:
    """A finished generation."""

    text: str
    tokens: list[int]
    finish: str  # "eos", "stop_sequence" or "length"
    stop_sequence: str | None
    prompt_n: int
    cached_n: int
    timings: dict = field(default_factory=dict)


class Generation:
    """One request handed to the engine thread; its tokens arrive on an asyncio queue."""

    def __init__(self, backend: "Backend", ids: list[int], params: SamplingParams, session_id: str | None,
                 saved: Session | None, prompt_text: str | None):
        self.backend, self.prompt, self.params = backend, ids, params
        self.session_id, self.saved, self.prompt_text = session_id, saved, prompt_text
        self.stream = TextStream(backend.engine.tokenizer, params.stop, backend.eos)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.text, self.req, self.state, self.admitted_at = "", None, None, None
        self.finished = self.cancelled = False

    # engine thread
    def _prefix(self, eng: Engine, seq) -> int:
        self.admitted_at = time.perf_counter()
        return eng.import_state(seq, self.saved.state) if self.saved else 0

    def _keep(self, eng: Engine, seq) -> None:
        if self.session_id is None or self.cancelled or self.backend.sessions.capacity == 0:
            return
        state = eng.export_state(seq)
        # a speculative round that stopped inside its block leaves the cache past the tokens kept, and recurrent
        # state cannot be cut back: such a turn is not retained
        if len(state["ids"]) == state["cache"]["length"]:
            self.state = state

    def _post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    # event loop
    def submit(self) -> None:
        sched = self.backend.scheduler
        try:
            self.req = sched.submit(self.prompt, self.params, on_tokens=lambda r, ids: self._post(ids),
                                    on_done=lambda r: self._post(None), prefix=self._prefix, state_hook=self._keep)
        except CapacityError as e:
            raise ApiError(400, str(e), code="context_length_exceeded") from None
        except QueueFull as e:
            raise ApiError(503, str(e), code="queue_full", headers={"Retry-After": "1"}) from None

    def cancel(self) -> None:
        """Stop the request if it is still running (client gone); safe to call any time."""
        if not self.finished and not self.cancelled and self.req is not None:
            self.cancelled = True
            self.backend.scheduler.cancel(self.req)

    async def deltas(self, request: Request | None = None):
        """Yields (text, token ids) as tokens are committed, then the held-back text; polls ``request`` for a
        disconnect while waiting."""
        while True:
            try:
                ids = await asyncio.wait_for(self.queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    self.cancel()
                    raise ApiError(499, "client disconnected")  # nobody reads this; the slot is freed
                continue
            if ids is None:
                break
            text = self.stream.push(ids)
            self.text += text
            yield text, ids
        self.finished = True
        if self.req.finish_reason == "error":
            raise ApiError(500, f"generation failed: {self.req.error}")
        tail = self.stream.finish()
        self.text += tail
        if tail:
            yield tail, []

    async def collect(self, request: Request) -> Outcome:
        async for _ in self.deltas(request):
            pass
        return await self.outcome()

    async def outcome(self) -> Outcome:
        """The result; retains the session state first, so the client's next turn finds it."""
        req, seq = self.req, self.req.seq
        tokens = list(seq.tokens)
        if self.stream.stopped is not None:
            finish = "stop_sequence"
        elif req.finish_reason == "length":
            finish = "length"
        else:
            finish = "eos"
        if self.state is not None:
            text = None
            if self.prompt_text is not None and finish != "stop_sequence":
                eos = self.backend.engine.tokenizer.decode(tokens[-1:]) if tokens and tokens[-1] in self.backend.eos \
                    else ""
                text = self.prompt_text + self.text + eos
            sess = Session(self.session_id, self.state, self.prompt + tokens, text, time.time())
            await asyncio.to_thread(self.backend.sessions.put, sess)
        stats, admitted = seq.stats, self.admitted_at or req.submitted
        first = req.first_token_at or req.finished_at
        timings = {"prompt_n": len(self.prompt), "prompt_cached_n": req.prefill_from, "predicted_n": len(tokens),
                   "draft_n": stats.get("drafted_tokens", 0), "draft_n_accepted": stats.get("accepted_tokens", 0),
                   "queue_ms": round((admitted - req.submitted) * 1e3, 3),
                   "prefill_ms": round((first - admitted) * 1e3, 3),
                   "decode_ms": round((req.finished_at - first) * 1e3, 3)}
        return Outcome(self.text, tokens, finish, self.stream.stopped, len(self.prompt), req.prefill_from, timings)


class ServingScheduler(Scheduler):
    """The scheduler of a server: an exception in the engine thread fails the requests in flight (their
    clients get a 500) instead of killing the thread and leaving every later request waiting forever."""

    def serve_forever(self) -> None:
        while not self._stop:
            try:
                super().serve_forever()
            except Exception as e:
                log.exception("engine step failed")
                for req in self.prefilling + self.running:
                    req.error = f"{type(e).__name__}: {e}"
                    self._done(req, "error")
                self.prefilling, self.running = [], []


class Backend:
    """The engine, its scheduler thread and the sessions, shared by every route."""

    def __init__(self, engine: Engine, options: ServerOptions):
        self.engine, self.options = engine, options
        self.scheduler = ServingScheduler(engine, max_queue=options.max_queue)
        info = engine.loaded.info
        self.model_id = info.get("model_id") or (Path(info["path"]).stem if info.get("path") else None) \
            or info.get("preset") or "model"
        key = info.get("artifact_id") or info.get("config_sha256") or self.model_id
        self.sessions = SessionStore(options.session_capacity, options.session_dir, model_key=str(key))
        opts = engine.options
        self.context_limit = min(opts.max_context, opts.slot_capacity)
        self.max_body = options.max_body_bytes or max(1 << 20, 64 * opts.max_context)
        self.eos = set(engine.tokenizer.eos_ids)
        self.created = int(time.time())
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.scheduler.serve_forever, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.scheduler.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def check_model(self, name: str) -> None:
        if name != self.model_id:
            raise ApiError(404, f"model {name!r} not found: this server serves {self.model_id!r}",
                           code="model_not_found", param="model")

    def session_id(self, request: Request, body_id) -> str | None:
        header = request.headers.get("x-session-id")
        if body_id is not None and header is not None and body_id != header:
            raise ApiError(400, f"session_id {body_id!r} and header X-Session-Id {header!r} disagree",
                           param="session_id")
        sid = body_id if body_id is not None else header
        try:
            return None if sid is None else check_session_id(sid)
        except ValueError as e:
            raise ApiError(400, str(e), param="session_id") from None

    async def generate(self, request: Request, *, text: str | None = None, ids: list[int] | None = None,
                       max_tokens: int | None, session_id: str | None = None, **sampling_args) -> Generation:
        """Tokenize (continuing the session's tokens when the text extends them), check the capacities and
        submit; 400 on overflow, 503 on a full queue."""
        saved = self.sessions.get(session_id) if session_id else None
        if ids is None:  # tokenizing a long prompt takes a while: off the event loop
            encode = self.engine.tokenizer.encode
            ids = await asyncio.to_thread(lambda: (saved.prompt_ids(text, encode) if saved else None) or encode(text))
        vocab = self.engine.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        if max_tokens is None:  # as many as fit
            max_tokens = self.context_limit - len(ids)
            if max_tokens < 1:
                raise ApiError(400, f"prompt of {len(ids)} tokens leaves no room to generate within the context "
                               f"of {self.context_limit} tokens", code="context_length_exceeded")
        params = sampling(max_tokens, **sampling_args)
        try:
            self.engine.check_fits(len(ids), max_tokens)
        except CapacityError as e:
            raise ApiError(400, str(e), code="context_length_exceeded") from None
        gen = Generation(self, ids, params, session_id, saved, text)
        gen.submit()
        return gen


# ---- the app -------------------------------------------------------------------------------------------
def create_app(backend: Backend) -> FastAPI:
    """The FastAPI app over ``backend``; its lifespan starts and stops the engine thread."""
    from . import api_anthropic, api_openai

    @asynccontextmanager
    async def lifespan(app):
        backend.start()
        try:
            yield
        finally:
            backend.stop()

    app = FastAPI(title="ninfer-bench", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, err: ApiError):
        return error_response(request, err)

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
            raise ApiError(404, f"session {sid!r} not found", code="session_not_found")
        return {"id": sid, "object": "session", "deleted": True}

    api_openai.register(app, backend)
    api_anthropic.register(app, backend)
    return app


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def serve(engine: Engine, options: ServerOptions, on_ready=None) -> None:
    """Load the saved sessions, then serve until interrupted; ``on_ready(url, backend, restored, problems)`` runs
    once the socket listens."""
    import uvicorn

    backend = Backend(engine, options)
    restored, problems = backend.sessions.load()

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started and on_ready is not None:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                on_ready(f"http://{host}:{port}", backend, restored, problems)

    config = uvicorn.Config(create_app(backend), host=options.host, port=options.port, log_level="warning",
                            timeout_graceful_shutdown=3, ws="none", lifespan="on")
    _Server(config).run()
