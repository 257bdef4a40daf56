"""What the HTTP routes share: the engine thread, the bridge from its callbacks to asyncio, sessions, and the
incremental text of a generation. Nothing here knows HTTP; :mod:`.http` maps these errors to statuses.

The engine is not thread-safe: it runs in one background thread (:meth:`Scheduler.serve_forever`). A handler
submits a :class:`Generation` and awaits its tokens, which the engine thread's callbacks post onto an asyncio
queue of that generation (``loop.call_soon_threadsafe``). Cancelling a generation (client gone) frees its slot
at the next engine iteration.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..media.sources import request_source
from ..runtime.engine import CapacityError, ContextOverflow, Engine
from ..runtime.scheduler import QueueFull, Scheduler
from ..sampling import SamplingParams
from .logprobs import TokenLogprob, prompt_token_logprobs, token_logprobs
from .metrics import server_metrics
from .sessions import Session, SessionStore, check_session_id, quoted

log = logging.getLogger("ninfer_bench.server")

__all__ = ["Backend", "BadRequest", "CapacityError", "ClientGone", "ContextOverflow", "GenerationFailed", "Generation",
           "ModelNotFound", "Outcome", "QueueFull", "SessionUnusable", "ShuttingDown", "TextStream"]


class BadRequest(ValueError):
    """An invalid parameter (HTTP 400); ``param`` names it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelNotFound(LookupError):
    """A request for a model this server does not serve (404)."""


class SessionUnusable(LookupError):
    """A request named a session whose saved state was dropped at start (damaged, or not for this engine)."""


class ShuttingDown(RuntimeError):
    """The request was ended because the server is stopping (503)."""


class GenerationFailed(RuntimeError):
    """The engine failed while running the request (500)."""


class ClientGone(Exception):
    """The client disconnected; nobody reads the answer."""


MAX_STOPS, MAX_STOP_CHARS = 16, 1000  # stop strings a request may give, and characters in each


def sampling_params(max_tokens: int, temperature, top_p, top_k, seed, stop, ignore_eos,
                    top_logprobs: int | None = None, prompt_logprobs: int | None = None,
                    min_p: float = 0.0) -> SamplingParams:
    if stop is not None and not isinstance(stop, str) and not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest(f"stop: at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each",
                         "stop")
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              min_p=min_p, seed=seed, stop=tuple(stops), ignore_eos=bool(ignore_eos),
                              top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs)
    except ValueError as e:
        raise BadRequest(str(e)) from None


GENERATION_DEFAULTS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_k": (0, None),
                       "min_p": (0.0, 1.0)}  # key: accepted range
API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}  # where the model's config is silent


def generation_defaults(meta: dict) -> tuple[dict, list[str]]:
    """The sampling defaults a model's ``generation_config.json`` sets (temperature, top_p, top_k, min_p: what vLLM
    takes from it, ``do_sample`` aside) and a line for each value it gives that is ignored (out of range, or a setting
    this server does not implement, such as a repetition penalty)."""
    gen = meta.get("generation_config") or {}
    out, ignored = {}, []
    for key, (lo, hi) in GENERATION_DEFAULTS.items():
        v = gen.get(key)
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v and (hi is None or v <= hi) \
            and (key != "top_k" or float(v).is_integer()) and (key != "top_p" or v > 0)
        if ok:
            out[key] = int(v) if key == "top_k" else float(v)
        else:
            ignored.append(f"{key} {v!r}: out of range")
    for key, noop in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        if gen.get(key) not in (None, noop):
            ignored.append(f"{key} {gen[key]!r}: not implemented")
    return out, ignored


def _held(tail: str, stops) -> int:
    """Length of the longest end of ``tail`` that begins a stop string (no whole stop is in ``tail``): text held
    back, since the next tokens may complete it. Only ends shorter than the stop string are tried, each from an
    occurrence of the stop's first character (linear in the text, not quadratic in the stop's length)."""
    hold = 0
    for s in stops:
        j = tail.find(s[0], max(0, len(tail) - len(s) + 1))
        while j != -1 and len(tail) - j > hold:
            if s.startswith(tail[j:]):
                hold = len(tail) - j
                break
            j = tail.find(s[0], j + 1)
    return hold


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
        hold = 0 if final else _held(tail, self.stop)
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
    logprobs: list | None = None  # TokenLogprob per generated token, when the request asked for them
    prompt_logprobs: list | None = None  # TokenLogprob per prompt token (the first has none), when asked for


class Generation:
    """One request handed to the engine thread; its tokens arrive on an asyncio queue."""

    def __init__(self, backend: "Backend", ids: list[int], params: SamplingParams, session_id: str | None,
                 saved: Session | None, prompt_text: str | None, media=None, top_logprobs: int | None = None):
        self.backend, self.prompt, self.params, self.media = backend, ids, params, media
        self.top_logprobs = top_logprobs  # None: no log-probabilities; N: each token's and the N most likely
        self.logprobs: list[TokenLogprob] = []
        self._prompt_logprobs: list[TokenLogprob] | None = None
        self.session_id, self.saved, self.prompt_text = session_id, saved, prompt_text
        self.stream = TextStream(backend.engine.tokenizer, params.stop, backend.hidden)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.text, self.req, self.state, self.admitted_at = "", None, None, None
        self.finished = self.cancelled = False
        self.track = backend.metrics.track() if backend.metrics is not None else None  # its figures for /metrics

    @property
    def expected_cached(self) -> int:
        """Prompt tokens the session's saved state will cover once the request is admitted (usage's cached part)."""
        return self.backend.engine.reusable(self.saved.state, self.prompt, self.media) if self.saved else 0

    # ---- engine thread ----
    def _prefix(self, eng: Engine, seq) -> int:
        self.admitted_at = time.perf_counter()
        return eng.import_state(seq, self.saved.state) if self.saved else 0

    def _keep(self, eng: Engine, seq) -> None:
        if self.session_id is None or self.cancelled or self.backend.sessions.capacity == 0:
            return
        # not kept: a state with media (its pad tokens do not say which image they stood for), a prefill only
        # (max_tokens 0 with echo: no turn to continue)
        if self.media is not None or not seq.tokens:
            return
        state = eng.export_state(seq)
        # a speculative round that stopped inside its block leaves the cache past the tokens kept, and recurrent
        # state cannot be cut back: such a turn is not retained
        if len(state["ids"]) == state["cache"]["length"]:
            self.state = state

    def _tokens(self, req, ids: list[int]) -> None:
        """Engine thread: the newly committed ``ids`` (with their log-probabilities: each token's and its top N, which
        the engine's batched pick computed on the device and keeps until here)."""
        entries = None
        if self.top_logprobs is not None:
            kept = req.seq.logprobs[:len(ids)]
            del req.seq.logprobs[:len(ids)]
            entries = token_logprobs(kept, ids)
        if self.track is not None:
            self.track.tokens(req, len(ids))
        self._post((ids, entries))

    def _ended(self, req) -> None:
        """Engine thread: the request ended (its figures recorded, then the end posted)."""
        if self.track is not None:
            self.track.done(req)
        self._post(None)

    def _post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    # ---- event loop ----
    def submit(self) -> None:
        """Queue the request (CapacityError, QueueFull)."""
        self.req = self.backend.scheduler.submit(
            self.prompt, self.params, on_tokens=self._tokens, on_done=self._ended,
            prefix=self._prefix, state_hook=self._keep, media=self.media)
        self.backend.active.add(self)

    def cancel(self) -> None:
        """Stop the request if it is still running; safe to call any time (handlers call it on the way out)."""
        self.backend.active.discard(self)
        if not self.finished and not self.cancelled and self.req is not None:
            self.cancelled = True
            self.backend.scheduler.cancel(self.req)

    async def deltas(self, gone=None):
        """Yields (text, token ids, their TokenLogprobs or None) as tokens are committed, then the held-back text.
        ``gone``: an async callable polled about once a second, True when the client has disconnected (ClientGone
        then)."""
        check_at = time.monotonic() + 1.0
        while True:
            try:
                item = await asyncio.wait_for(self.queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                item = ((), None)
            if gone is not None and time.monotonic() >= check_at:
                check_at = time.monotonic() + 1.0
                if await gone():
                    self.cancel()
                    raise ClientGone()
            if item is None:
                break
            ids, entries = item
            if not ids:
                continue
            text = self.stream.push(ids)
            self.text += text
            if entries is not None:
                self.logprobs += entries
            yield text, ids, entries
        self.finished = True
        self.backend.active.discard(self)
        if self.req.finish_reason == "error":
            raise GenerationFailed(f"generation failed: {self.req.error}")
        if self.req.finish_reason == "cancelled":  # by Backend.drain
            raise ShuttingDown("the server is shutting down")
        tail = self.stream.finish()
        self.text += tail
        if tail:
            yield tail, [], [] if self.top_logprobs is not None else None

    def prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The prompt tokens' entries once the prompt is prefilled (after the first delta, or at the outcome), when
        the request asked for them (``params.prompt_logprobs``); the first token's has no log-probability."""
        scores = self.req.seq.prompt_scores if self.req is not None and self.req.seq is not None else None
        if self._prompt_logprobs is None and scores is not None and scores.own is not None:
            self._prompt_logprobs = prompt_token_logprobs(self.prompt, scores.rows())
        return self._prompt_logprobs

    async def collect(self, gone=None) -> Outcome:
        async for _ in self.deltas(gone):
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
        persisted = False
        if self.state is not None:
            persisted = await asyncio.to_thread(self.backend.sessions.put, self._session(tokens, finish))
        stats, admitted = seq.stats, self.admitted_at or req.submitted
        first = req.first_token_at or req.finished_at
        timings = {"prompt_n": len(self.prompt), "prompt_cached_n": req.prefill_from, "predicted_n": len(tokens),
                   "draft_n": stats.get("drafted_tokens", 0), "draft_n_accepted": stats.get("accepted_tokens", 0),
                   "queue_ms": round((admitted - req.submitted) * 1e3, 3),
                   "prefill_ms": round((first - admitted) * 1e3, 3),
                   "decode_ms": round((req.finished_at - first) * 1e3, 3)}
        if self.session_id is not None and self.backend.sessions.dir is not None:  # kept on disk for a restart?
            timings["session_persisted"] = persisted
        return Outcome(self.text, tokens, finish, self.stream.stopped, len(self.prompt), req.prefill_from, timings,
                       list(self.logprobs) if self.top_logprobs is not None else None, self.prompt_logprobs())

    def _session(self, tokens: list[int], finish: str) -> Session:
        """This turn as a session. Its text is what the client saw plus the end-of-turn token's text, which the
        chat template writes back; a text cut at a stop string no longer matches the tokens, so it gets none."""
        text = None
        if self.prompt_text is not None and finish != "stop_sequence":
            eos = tokens[-1:] if tokens and tokens[-1] in self.backend.eos else []
            text = self.prompt_text + self.text + self.backend.engine.tokenizer.decode(eos)
        return Session(self.session_id, self.state, self.prompt + tokens, text, time.time())


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

    def __init__(self, engine: Engine, *, max_queue: int = 256, session_capacity: int = 16,
                 session_dir: str | None = None, media_dir: str | None = None, generation_config: str = "auto"):
        self.engine = engine
        # what a request leaves out: the model's generation_config.json ("auto", as vLLM), or the APIs' own defaults
        meta = engine.loaded.artifact.metadata if engine.loaded.artifact is not None else {}
        self.sampling_defaults, self.ignored_defaults = generation_defaults(meta) if generation_config == "auto" \
            else ({}, [])
        self.media_dir = media_dir  # the one folder whose files requests may name (None: data URIs only)
        self.scheduler = ServingScheduler(engine, max_queue=max_queue)
        info = engine.loaded.info
        self.model_id = info.get("model_id") or (Path(info["path"]).stem if info.get("path") else None) \
            or info.get("preset") or "model"
        key = info.get("artifact_id") or info.get("config_sha256") or self.model_id
        self.sessions = SessionStore(session_capacity, session_dir, model_key=str(key), check=engine.check_state)
        self.context_limit = engine.context_limit
        self.eos = set(engine.tokenizer.eos_ids)
        # token ids left out of the text: end tokens and control tokens (chat markers), as OpenAI-style servers do
        self.hidden = engine.stops.control_ids
        self.created = int(time.time())
        self.active: set[Generation] = set()
        self._thread: threading.Thread | None = None
        # /metrics (None without prometheus-client); the speculative counters only with a drafter
        self.metrics = server_metrics(lambda: self.scheduler.load,
                                      (engine.options.draft_tokens or 0) if engine.drafter is not None else 0)

    def sampling(self, temperature, top_p, top_k, max_temperature: float | None = None, min_p=None) -> dict:
        """A request's temperature / top_p / top_k / min_p, with what it leaves out from the model's generation
        config (then the APIs' own: 1, 1, no top-k, no min-p); top_k -1 is vLLM's "no limit", as 0 here.
        ``max_temperature``: the highest the route's API takes; a default above it is lowered to it (a generation
        config's 1.5 samples at 1 on the Anthropic route, whose requests may ask 0-1)."""
        given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}
        out = {k: v if v is not None else self.sampling_defaults.get(k, API_DEFAULTS[k]) for k, v in given.items()}
        out["top_k"] = max(out["top_k"], 0)
        if max_temperature is not None:
            out["temperature"] = min(out["temperature"], max_temperature)
        return out

    def start(self) -> None:
        self._thread = threading.Thread(target=self.scheduler.serve_forever, name="engine", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """End every request in flight (shutdown): their clients get a 503 instead of a cut connection."""
        for gen in list(self.active):
            gen.cancel()

    def stop(self) -> None:
        self.scheduler.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def check_model(self, name: str) -> None:
        if name != self.model_id:
            raise ModelNotFound(f"model {quoted(name)} not found: this server serves {self.model_id!r}")

    def media_prompt(self, ids: list[int], media, param: str = "messages") -> tuple[list[int], object]:
        """Read and preprocess ``media`` ((kind, source) pairs, in prompt order) and widen their placeholders in
        ``ids``: (ids, MediaPrompt or None). Sources are data URIs, or paths inside ``media_dir`` when the server
        was given one (:func:`..media.sources.request_source`). Any problem with the media, or placeholders in ``ids``
        that the media does not match (none at all included), is a BadRequest naming ``param``."""
        limits = self.engine.media_limits
        if len(media) > limits.max_items:  # before any decoding
            raise BadRequest(f"{len(media)} media inputs exceed the limit of {limits.max_items} per request", param)
        try:
            budget = self.engine.media_budget()  # all the request's items together
            items = [self.engine.load_media(kind, request_source(source, self.media_dir, limits), budget)
                     for kind, source in media]
            return self.engine.media_prompt(ids, items)
        except ValueError as e:
            raise BadRequest(str(e), param) from None

    async def generate(self, *, text: str | None = None, ids: list[int] | None = None, max_tokens: int | None,
                       session_id: str | None = None, media=(), prompt_param: str = "messages",
                       prompt_logprobs: int | None = None, **sampling) -> Generation:
        """Tokenize (continuing the session's tokens when the text extends them), read the media, check the
        capacities (the engine's :meth:`~.runtime.Engine.check_fits`) and submit. ``max_tokens`` None: as many as
        fit, 0: the prompt is only prefilled (to score it); ``prompt_logprobs`` N: each prompt token's
        log-probability and the N most likely (every position is prefilled then: a session's saved state is not
        loaded); ``prompt_param``: the request field the prompt came from (errors name it). Raises BadRequest,
        CapacityError (ContextOverflow past the context: the routes word it in their API's terms), QueueFull."""
        if session_id is not None:
            try:
                check_session_id(session_id)
            except ValueError as e:
                raise BadRequest(str(e), "session_id") from None
            if (why := self.sessions.take_damaged(session_id)) is not None:
                raise SessionUnusable(f"session {quoted(session_id)} cannot be continued: {why}; send the whole "
                                      f"conversation (the id now starts a new session)")
        saved = self.sessions.get(session_id) if session_id and not media and prompt_logprobs is None else None
        if ids is None:  # tokenizing a long prompt takes a while: off the event loop
            encode = self.engine.tokenizer.encode
            ids = await asyncio.to_thread(lambda: (saved.prompt_ids(text, encode) if saved else None) or encode(text))
        mm = None
        # decoding and resizing images or frames takes a while too; a vision model checks a prompt without media as
        # well: a placeholder token typed into the text would otherwise take the pad embedding with no image behind
        if media or self.engine.vision is not None:
            ids, mm = await asyncio.to_thread(self.media_prompt, ids, media, prompt_param)
        try:
            self.engine.check_ids(ids)
        except ValueError as e:
            raise BadRequest(str(e), prompt_param) from None
        self.engine.check_fits(len(ids), max_tokens)
        if max_tokens is None:
            max_tokens = self.context_limit - len(ids)
        top = sampling.pop("top_logprobs", None)
        if top is not None and self.engine.drafter is not None and max_tokens > 1:  # (see Engine.acquire)
            raise BadRequest(f"logprobs: this server decodes speculatively (--spec {self.engine.options.spec}); "
                             f"log-probabilities past the first generated token are returned by servers without a "
                             f"drafter (max_tokens 1 works here, and completions' echo with 0)", "logprobs")
        params = sampling_params(max_tokens, **sampling, top_logprobs=top, prompt_logprobs=prompt_logprobs)
        gen = Generation(self, ids, params, session_id, saved, text, mm, top)
        gen.submit()
        return gen

    def again(self, gen: Generation, seed: int | None) -> Generation:
        """Another generation of ``gen``'s prompt (ids and media already read) with another seed and no session:
        a further choice of the same request (QueueFull)."""
        other = Generation(self, gen.prompt, replace(gen.params, seed=seed), None, None, gen.prompt_text, gen.media,
                           gen.top_logprobs)
        other.submit()
        return other
