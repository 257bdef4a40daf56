"""Prometheus metrics of a server: ``GET /metrics`` in the text exposition format (prometheus-client, the [serve]
extra). Each app has its own ``CollectorRegistry`` (several servers in one process, as the tests run them, count
apart). Names follow vLLM's where there is one (``ninfer_`` for ``vllm:``); times are seconds.

- ``ninfer_requests_total{endpoint, status}``: HTTP requests answered, by route (its path template:
  ``/v1/chat/completions``, ``/v1/sessions/{sid}``; ``other`` for a path no route has) and status code; a streamed
  response counts with the status it started with. Scrapes of ``/metrics`` are not counted.
- ``ninfer_prompt_tokens_total`` (prompt tokens of generations whose prompt was prefilled, those a session supplied
  included, as the usage's ``prompt_tokens``), ``ninfer_prompt_tokens_cached_total`` (of them, loaded from a session),
  ``ninfer_generation_tokens_total`` (tokens generated, counted as they are committed). Each choice of an ``n`` > 1
  request is a generation of its own.
- ``ninfer_requests_running`` / ``ninfer_requests_waiting``: the scheduler's admitted (prefilling or decoding)
  and queued requests at the time of the scrape.
- Histograms: ``ninfer_time_to_first_token_seconds`` (arrival to the first generated token, the queue included),
  ``ninfer_inter_token_latency_seconds`` (between one commit of tokens and the next: a speculative round that
  commits several is one observation, as vLLM counts it), ``ninfer_e2e_request_latency_seconds`` (arrival to the
  end of a generation that finished: not cancelled, no error) and ``ninfer_request_queue_time_seconds``.
- With a drafter (``--spec``): ``ninfer_spec_decode_num_drafts_total`` (speculative rounds),
  ``ninfer_spec_decode_num_draft_tokens_total``, ``ninfer_spec_decode_num_accepted_tokens_total`` and
  ``ninfer_spec_decode_num_accepted_tokens_per_pos_total{position}`` (rounds whose draft token at ``position``, 0
  first, was accepted), from each sequence's speculative statistics as its tokens are committed.

The token, latency and speculative figures are recorded in the engine thread through :class:`Track` (one per
generation); prometheus-client's metrics are thread-safe. Without prometheus-client the server runs without
metrics (``/metrics`` answers 501, one warning at start). Like the ``/v1/`` routes, ``/metrics`` wants the API key
when the server has one (:mod:`.guard`; vLLM leaves it open): a Prometheus scrape config gives it as
``authorization: {credentials: KEY}``.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger("ninfer_bench.server")

# 1 ms .. 60 s, denser where decode steps, prefills and queueing usually fall
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 40.0, 60.0)
METRICS_PATH = "/metrics"


class ServerMetrics:
    """The metrics of one app, in a registry of their own. ``load()``: the scheduler's counts (``running``,
    ``waiting``), read at each scrape; ``draft_tokens``: the drafter's block size (0: no drafter, no speculative
    metrics)."""

    def __init__(self, load: Callable[[], dict], draft_tokens: int = 0):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry()
        self.requests = Counter("ninfer_requests", "HTTP requests answered, by route and status code",
                                ["endpoint", "status"], registry=reg)
        self.prompt_tokens = Counter("ninfer_prompt_tokens", "Prompt tokens of generations whose prompt was "
                                     "prefilled (those a session supplied included)", registry=reg)
        self.cached_tokens = Counter("ninfer_prompt_tokens_cached", "Prompt tokens loaded from a session instead "
                                     "of prefilled", registry=reg)
        self.generation_tokens = Counter("ninfer_generation_tokens", "Tokens generated", registry=reg)
        Gauge("ninfer_requests_running", "Requests admitted (prefilling or decoding)",
              registry=reg).set_function(lambda: load()["running"])
        Gauge("ninfer_requests_waiting", "Requests queued for a slot",
              registry=reg).set_function(lambda: load()["waiting"])

        def hist(name, doc):
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=reg)

        self.ttft = hist("ninfer_time_to_first_token_seconds", "Arrival to the first generated token")
        self.itl = hist("ninfer_inter_token_latency_seconds", "Between successive commits of generated tokens")
        self.e2e = hist("ninfer_e2e_request_latency_seconds", "Arrival to the end of a finished generation")
        self.queue = hist("ninfer_request_queue_time_seconds", "Arrival to admission into a slot")
        self.spec = draft_tokens > 0
        if self.spec:
            self.drafts = Counter("ninfer_spec_decode_num_drafts", "Speculative rounds (one draft each)",
                                  registry=reg)
            self.draft_tokens = Counter("ninfer_spec_decode_num_draft_tokens", "Draft tokens proposed",
                                        registry=reg)
            self.accepted_tokens = Counter("ninfer_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=reg)
            self.accepted_per_pos = Counter("ninfer_spec_decode_num_accepted_tokens_per_pos",
                                            "Rounds whose draft token at this position (0 first) was accepted",
                                            ["position"], registry=reg)
            for i in range(draft_tokens):
                self.accepted_per_pos.labels(position=str(i))

    def track(self) -> "Track":
        return Track(self)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def server_metrics(load: Callable[[], dict], draft_tokens: int = 0) -> ServerMetrics | None:
    """A server's metrics, or None (one warning) when prometheus-client is not installed."""
    try:
        return ServerMetrics(load, draft_tokens)
    except ImportError:
        log.warning("no /metrics: prometheus-client is not installed (pip install -e '.[serve]')")
        return None


class Track:
    """One generation's figures, fed by the engine thread as its tokens are committed and when it ends."""

    __slots__ = ("m", "last", "prefilled", "queued", "spec")

    def __init__(self, metrics: ServerMetrics):
        self.m, self.last, self.prefilled, self.queued = metrics, None, False, False
        self.spec = {"rounds": 0, "drafted_tokens": 0, "accepted_tokens": 0, "accepted_per_position": []}

    def tokens(self, req, n: int) -> None:
        """``n`` tokens of scheduler request ``req`` were just committed."""
        try:
            self._tokens(req, n)
        except Exception:  # noqa: BLE001 - figures must never fail a request (the engine thread would)
            _broken()

    def done(self, req) -> None:
        """``req`` ended (its ``finish_reason`` and ``finished_at`` set)."""
        try:
            self._done(req)
        except Exception:  # noqa: BLE001
            _broken()

    def _tokens(self, req, n: int) -> None:
        times = getattr(req, "token_times", None)
        m, now = self.m, times[-1] if times else time.perf_counter()
        if self.last is None:
            self._prefilled(req)
            m.ttft.observe(max(now - req.submitted, 0.0))
        else:
            m.itl.observe(max(now - self.last, 0.0))
        self.last = now
        m.generation_tokens.inc(n)
        self._speculation(req.seq)

    def _done(self, req) -> None:
        if req.finish_reason not in ("cancelled", "error") and req.seq is not None:
            self._prefilled(req)  # a prefill with nothing generated (max_tokens 0) ends here
            self.m.e2e.observe(max(req.finished_at - req.submitted, 0.0))
        if req.seq is not None:
            self._speculation(req.seq)

    def _prefilled(self, req) -> None:
        if not self.queued and req.admitted_at is not None:
            self.queued = True
            self.m.queue.observe(max(req.admitted_at - req.submitted, 0.0))
        if not self.prefilled:
            self.prefilled = True
            self.m.prompt_tokens.inc(len(req.prompt))
            self.m.cached_tokens.inc(req.prefill_from)

    def _speculation(self, seq) -> None:
        """Add what the sequence's cumulative speculative statistics gained since the last call."""
        if not self.m.spec or seq is None:
            return
        st, seen, m = seq.stats, self.spec, self.m
        for key, counter in (("rounds", m.drafts), ("drafted_tokens", m.draft_tokens),
                             ("accepted_tokens", m.accepted_tokens)):
            now = st.get(key, 0)
            if now > seen[key]:
                counter.inc(now - seen[key])
                seen[key] = now
        per, old = list(st.get("accepted_per_position") or ()), seen["accepted_per_position"]
        for i, count in enumerate(per):
            before = old[i] if i < len(old) else 0
            if count > before:
                m.accepted_per_pos.labels(position=str(i)).inc(count - before)
        seen["accepted_per_position"] = per


_warned = []


def _broken() -> None:
    if not _warned:
        _warned.append(True)
        log.exception("recording metrics failed (the request goes on; later failures are not logged)")


class CountRequests:
    """ASGI middleware: every HTTP request answered (a refusal of the guard's included, ``/metrics`` left out) into
    ``ninfer_requests_total``, labelled with the path template of the route that matches it. ``routes``: the app's
    route list (read at each request, so routes added later count)."""

    def __init__(self, app, metrics: ServerMetrics, routes: list):
        self.app, self.metrics, self.routes = app, metrics, routes

    def endpoint(self, scope) -> str:
        from starlette.routing import Match

        for route in self.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:  # PARTIAL: the path of a route, another method (a 405)
                return getattr(route, "path", "other")
        return "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") == METRICS_PATH:
            return await self.app(scope, receive, send)
        status: list[int] = []

        async def send_status(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(endpoint=self.endpoint(scope), status=str(status[0] if status else 500)).inc()
