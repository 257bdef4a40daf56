"""Continuous batching over one Engine.

Requests wait in a bounded queue. Every iteration admits waiting requests into free slots, prefills the admitting
requests' next prompt chunks within a token budget (``--prefill-chunk`` tokens, or ``--interleave-chunk`` while
others are decoding, so a long prompt or a burst of arrivals stalls their decoding by one budget at most), packed
into one forward when asked (``EngineOptions.pack_prefill``, off by default), then one decode round (plain, or draft +
verify) over every running sequence together. Tokens are reported through callbacks as
they are committed; a cancelled request frees its slot at the next iteration.

The engine is not thread-safe: all engine work happens in the thread that calls :meth:`step` (the server
runs :meth:`serve_forever` in a thread of its own); :meth:`submit` and :meth:`cancel` may be called from
any thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..sampling import SamplingParams
from .engine import CapacityError, Engine
from .sequence import Sequence


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 503)."""


@dataclass
class Request:
    """One generation request and what happened to it."""

    id: int
    prompt: list[int]
    params: SamplingParams
    on_tokens: Callable[["Request", list[int]], None] | None = None
    on_done: Callable[["Request"], None] | None = None
    seq: Sequence | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_at: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    cancelled: bool = False
    sent: int = 0  # tokens already reported
    prefill_from: int = 0  # cached prefix length (sessions)
    state_hook: Callable | None = None  # called with (engine, seq) before the slot is released
    prefix: Callable | None = None  # (engine, seq) -> cached prompt tokens loaded into the slot
    admitted_at: float | None = None  # when the request got a slot (queue time = admitted_at - submitted)
    media: object = None  # the prompt's images / videos (engine.media.prompt.MediaPrompt), encoded at its first prefill
    reference: list[int] | None = None  # replayed acceptance: the plain run's tokens on this prompt (spec/replay.py)

    @property
    def tokens(self) -> list[int]:
        return list(self.seq.tokens) if self.seq else []


class Scheduler:
    """Continuous batching: admit, prefill chunks within the token budget, decode a round; repeat."""

    def __init__(self, engine: Engine, max_queue: int = 256):
        self.e = engine
        self.max_queue = max_queue
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False

    # ---- any thread ------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, *, on_tokens=None, on_done=None,
               prefix=None, state_hook=None, media=None, reference: list[int] | None = None) -> Request:
        """Queue a request. Capacity is checked now (CapacityError); a full queue raises QueueFull.

        ``prefix``: a callable ``(engine, seq) -> int`` run when the request gets its slot, which may load a
        saved state into the slot and returns how many prompt tokens it already covers (sessions). ``reference``:
        with replayed acceptance (which then needs it), the plain run's tokens on this prompt."""
        self.e.check_fits(len(prompt), params.max_new_tokens)
        if self.e.replay is not None and not reference:
            raise ValueError("replayed acceptance needs the plain run's tokens on this prompt (reference=...)")
        req = Request(next(self._ids), list(prompt), params, on_tokens, on_done, state_hook=state_hook, prefix=prefix,
                      media=media, reference=reference)
        with self._lock:
            # requests that will find a free slot do not wait: only the excess counts against the bound
            if len(self.waiting) >= self.max_queue + len(self.e.free_slots):
                raise QueueFull(f"the queue holds {self.max_queue} waiting requests; retry later")
            self.waiting.append(req)
        self._wake.set()
        return req

    def cancel(self, req: Request) -> None:
        req.cancelled = True
        with self._lock:  # a request still waiting leaves the queue now (it must not hold a place in the bound)
            try:
                self.waiting.remove(req)
            except ValueError:
                req = None
        if req is not None:
            self._done(req, "cancelled")
        self._wake.set()

    @property
    def load(self) -> dict:
        return {"waiting": len(self.waiting), "running": len(self.running) + len(self.prefilling),
                "slots": self.e.options.max_concurrency, "free_slots": len(self.e.free_slots)}

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    # ---- the engine thread -----------------------------------------------------------------------
    def _admit(self) -> None:
        while self.e.free_slots:
            with self._lock:
                if not self.waiting:
                    return
                req = self.waiting.popleft()
            if req.cancelled:
                self._done(req, "cancelled")
                continue
            req.admitted_at = time.perf_counter()
            try:
                req.seq = self.e.acquire(req.prompt, req.params, req.media)
                if req.reference is not None and self.e.replay is not None:
                    req.seq.reference = self.e.replay.reference(req.reference, self.e.device)
                if req.prefix is not None:
                    req.seq.length = req.prefill_from = req.prefix(self.e, req.seq)
            except Exception as err:  # noqa: BLE001 - refused or failed: the request ends, its slot (if any) is freed
                req.error = str(err) if isinstance(err, (CapacityError, ValueError)) else f"{type(err).__name__}: {err}"
                self._done(req, "error")
                continue
            self.prefilling.append(req)

    def _report(self, req: Request) -> None:
        now = time.perf_counter()
        new = req.seq.tokens[req.sent:]
        if not new:
            return
        if req.first_token_at is None:
            req.first_token_at = now
        req.token_times.extend([now] * len(new))
        req.sent += len(new)
        if req.on_tokens:
            req.on_tokens(req, new)

    def _done(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.finished_at = time.perf_counter()
        if req.seq is not None:
            if req.state_hook and reason != "error":
                req.state_hook(self.e, req.seq)
            self.e.release(req.seq)
        if req.on_done:
            req.on_done(req)

    def _sweep(self, group: list[Request]) -> list[Request]:
        keep = []
        for req in group:
            if req.cancelled:
                self._done(req, "cancelled")
            elif req.seq.finish_reason is not None:
                self._report(req)
                self._done(req, req.seq.finish_reason)
            else:
                keep.append(req)
        return keep

    def _prefill_work(self) -> list[tuple[Request, int]]:
        """This iteration's prompt chunks: admitting requests in order, each its next min(prompt left, budget left,
        --prefill-chunk) tokens, until the token budget is spent. The budget is --prefill-chunk when nothing else
        decodes; while others do, --interleave-chunk (so an admission stalls them by one budget's prefill, however
        many requests arrive). With EngineOptions.pack_prefill the engine packs the chunks into one forward."""
        opts = self.e.options
        budget = (opts.interleave_chunk or opts.prefill_chunk) if self.running else opts.prefill_chunk
        work = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(len(req.seq.prompt) - req.seq.length, budget, opts.prefill_chunk)
            work.append((req, n))  # (admission leaves every request at least one prompt token: Engine.reusable)
            budget -= n
        return work

    def step(self) -> bool:
        """One iteration; returns False when there was nothing to do."""
        self.prefilling = self._sweep(self.prefilling)
        self.running = self._sweep(self.running)
        self._admit()
        if not self.prefilling and not self.running:
            return False
        if self.prefilling:
            work = self._prefill_work()

            def first_token(i: int) -> None:  # out as soon as its prompt is done, not after the others' chunks
                req = work[i][0]
                self.prefilling.remove(req)
                self._report(req)
                self.running.append(req)

            self.e.prefill_steps([(r.seq, n) for r, n in work], on_final=first_token)
        live = [r for r in self.running if r.seq.finish_reason is None]
        if live:
            self.e.advance([r.seq for r in live])
            for r in live:
                self._report(r)
        self.running = self._sweep(self.running)
        return True

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def fail_inflight(self, error: str) -> None:
        """End every admitted request with ``error`` (after an engine failure), freeing their slots."""
        for req in self.prefilling + self.running:
            req.error = error
            self._done(req, "error")
        self.prefilling, self.running = [], []

    def serve_forever(self) -> None:
        """The engine loop of a server: step while there is work, sleep until woken otherwise. An engine
        error fails the requests in flight and the loop goes on serving."""
        while not self._stop:
            try:
                busy = self.step()
            except Exception as err:  # noqa: BLE001 - reported to every request in flight, then keep serving
                self.fail_inflight(f"engine error: {type(err).__name__}: {err}")
                busy = True
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
