"""CUDA-graph capture of the decode and verify forwards, and of a prompt's first prefill chunk (runtime v3 on CUDA).

One graph per (mode, T, batch bucket), captured on first use, largest bucket first where several are asked
for, all in one memory pool. Inputs are copied into static buffers; rows past the real batch are padding that
reads and writes the engine's scratch slot. Speculative verification also captures the rollback (``commit``)
of its bucket, so a whole round replays with no host synchronisation other than reading the accepted tokens.
A greedy single-sequence decode can also be chained (:meth:`GraphRunner.chain`): a small captured link feeds each
step's picked token to the next, so the host launches step n + 1 before it reads token n.
A prompt's first chunk (from position 0) replays a graph captured for its length bucket (:func:`prefill_buckets`): the
tokens past the real ones are padding (``Step.valid``), inert in the recurrent state and attended by no real token;
their K/V land past the prompt, where decoding writes before anything reads. A prefill replay is one copy of its input
(ids, start, slot, real length) and the replay; a prompt's final chunk has a graph of its own that ends in the last real
row's logits and argmax, so its first token needs no launch outside the graph. A later chunk (a long prompt's, or the
scheduler's interleaved pieces) replays one too when it is short (a bucket of at most ``LATER_MAX_T`` tokens, where the
host's launches would otherwise bound it) and the keys it attends fit ``LATER_MAX_KV``: its graph reads the keys up to a
power-of-two bucket of its end (the positions past a token's own are masked). Longer chunks are bound by the device and
run eagerly. A capture that fails (an operation that cannot be captured) turns prefill graphs off for the engine, with a
warning: prefill runs eagerly.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from ...kernels import select
from ...kernels._triton import graph_scope, pdl_held
from ..sampling import RowSampling, SamplingParams, sample_rows
from .hybrid import DECODE, PREFILL, VERIFY, Step


def buckets(max_batch: int) -> list[int]:
    """Batch sizes graphs are captured for: powers of two up to ``max_batch``, and ``max_batch`` itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def prefill_buckets(limit: int) -> list[int]:
    """Prompt lengths prefill graphs are captured for, up to ``limit`` (the prefill chunk, or a slot's capacity when
    smaller): 16, 32, 64, then every multiple of 128 and ``limit`` itself, so padding stays under 128 tokens (or
    under the real length, below 128)."""
    out, b = [], 16
    while b < min(128, limit):
        out.append(b)
        b *= 2
    return out + list(range(128, limit, 128)) + [limit]


LATER_MAX_T = 512  # a later chunk's bucket at most this long is replayed from a graph (longer: device-bound, eager)
LATER_MAX_KV = 8192  # ... when the keys it attends (a power-of-two bucket of its end, >= 256) fit this many


def key_bucket(end: int) -> int:
    """The keys a later chunk's graph reads: the power of two (at least 256) holding positions ``0 .. end - 1``."""
    b = 256
    while b < end:
        b *= 2
    return b


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    pos: torch.Tensor  # (a prefill graph's: 0 .. T - 1, the positions past its start)
    slots: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor
    taps: list
    pending: object = None
    keep: torch.Tensor | None = None
    commit_graph: torch.cuda.CUDAGraph | None = None
    valid: torch.Tensor | None = None  # [B] a prefill graph's real tokens
    inp: torch.Tensor | None = None  # a prefill graph's one input: ids, start, slot, real length
    token: torch.Tensor | None = None  # [1] a prefill graph's argmax of its last real row (with its head)


_WARM_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def warm_stream(device) -> torch.cuda.Stream:
    """The one side stream of the process (a device) that capture warm-ups run on. One, not a new stream a capture:
    cuBLAS allocates a workspace for every stream it sees, so each new stream added about 32 MiB to the peak memory
    of whichever run first captured a cuBLAS call on it (an A/A gate pair differed by up to 17% on the bundled model,
    scripts/gate_trust.py on the H200, until torch's stream pool came round)."""
    device = torch.device(device)
    if device not in _WARM_STREAMS:
        _WARM_STREAMS[device] = torch.cuda.Stream(device=device)
    return _WARM_STREAMS[device]


def capture(fn, pool, device, *, warmups: int = 2, warm=None):
    """(graph, fn's result captured): ``warm`` (default ``fn``) runs ``warmups`` times on a side stream first, so
    kernels are compiled and allocations settled outside the capture; the graph allocates from ``pool``."""
    side = warm_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with graph_scope():  # the warm-ups launch as the capture will (PDL variants compiled before it)
        with torch.cuda.stream(side):
            for _ in range(warmups):
                (warm or fn)()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    return graph, out


# PDL (EngineOptions.pdl) in the graphs of at most this many sequences: one sequence's decode step and speculative
# verify (up to MAX_DRAFT_TOKENS + 1 rows) and drafting; batched graphs capture without it. The 27B's decode step of 8
# sequences took 10.56 ms with PDL (qmv 7.5 ms of it) and 8.72 ms without (qmv 5.0 ms), with qmv then reading x
# through L2 only under PDL (docs/perf/2026-12-03d-scheduler-budget-h200.md); with x through L1 one sequence's
# DFlash2 K=7 round went from 7.30 ms without PDL to 6.80 ms with it (docs/perf/2026-12-04e-spec-round-pdl-h200.md)
PDL_MAX_SEQS = 1


def pdl_scope(seqs: int):
    """The context a graph of ``seqs`` sequences is captured in: PDL held off above :data:`PDL_MAX_SEQS`."""
    return pdl_held() if seqs > PDL_MAX_SEQS else contextlib.nullcontext()


MAX_STOP_IDS = 64  # token ids a chained decode can stop on inside the graph (EOS + the request's stop ids)


@dataclass
class Chain:
    """The in-graph link between two greedy decode steps of one sequence (bucket 1): the picked token becomes the
    next step's input and position, and once it is a stop id the following steps write the scratch slot."""

    graph: torch.cuda.CUDAGraph
    cap: Captured
    tok: torch.Tensor  # [1] the token the last replay picked
    done: torch.Tensor  # [1] bool: a stop id was picked
    slot: torch.Tensor  # [1] the sequence's own slot
    stop: torch.Tensor  # [MAX_STOP_IDS] stop ids, padded with -1
    work: object = None  # the link's scratch (kernels/select.LinkScratch): the graph writes it, so it lives here


class GraphRunner:
    """Replays captured forwards of ``engine.model`` over ``engine.cache`` (an Engine's attributes)."""

    def __init__(self, engine):
        self.e = engine
        self.buckets = buckets(engine.options.max_concurrency)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, Captured] = {}
        self._chain: Chain | None = None
        opts = engine.options
        self.prefill_sizes = prefill_buckets(min(opts.prefill_chunk, engine.capacity))
        self.prefill_off: str | None = None if opts.prefill_graphs else "--prefill-graphs off"
        # captured samplers: (rows, vocabulary, dtype, sort, full, greedy) -> (graph, static logits, static rows,
        # tokens)
        self.samplers: dict[tuple, tuple] = {}

    def bucket(self, b: int) -> int:
        return next(x for x in self.buckets if x >= b)

    def _capture(self, mode: str, t: int, b: int, taps: tuple[int, ...]) -> Captured:
        e = self.e
        dev = e.device
        ids = torch.zeros(b, t, dtype=torch.long, device=dev)
        pos = torch.arange(t, device=dev).repeat(b, 1)
        slots = torch.full((b,), e.scratch_slot, dtype=torch.long, device=dev)
        step = Step(ids, pos, slots, kv_len=e.capacity, mode=mode, taps=taps)
        keep = torch.full((b,), t, dtype=torch.long, device=dev)

        def forward():
            hidden, tp = e.model.forward(step, e.cache)
            return hidden, e.model.logits(hidden), tp

        def warm():  # verification's warm-up rolls back too, as its replays do
            forward()
            if mode == VERIFY:
                e.cache.commit(keep)

        with pdl_scope(b):
            graph, (hidden, logits, tp) = capture(forward, self.pool, dev, warm=warm)
        cap = Captured(graph, ids, pos, slots, hidden, logits, tp)
        if mode == VERIFY:
            cap.pending, cap.keep = e.cache.pending, keep
            cap.commit_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cap.commit_graph, pool=self.pool):
                e.cache.commit(keep)
            e.cache.pending = None
        return cap

    def _captured(self, mode: str, t: int, b: int, taps: tuple[int, ...] = ()) -> Captured:
        key = (mode, t, self.bucket(b), taps)
        cap = self.graphs.get(key)
        if cap is None:
            cap = self.graphs[key] = self._capture(mode, t, key[2], taps)
        return cap

    def prefill_plan(self, t: int, start: int = 0) -> tuple[int, int] | None:
        """(the captured length, the keys it reads) a chunk of ``t`` tokens at position ``start`` runs at; None: it
        runs eagerly (prefill graphs off, no bucket fits, or a later chunk too long or reaching too far)."""
        if self.prefill_off is not None:
            return None
        size = next((x for x in self.prefill_sizes if x >= t), None)
        if size is None or start == 0:
            return None if size is None else (size, size)
        keys = key_bucket(start + size)
        if size > LATER_MAX_T or keys > min(LATER_MAX_KV, self.e.capacity):
            return None
        return size, keys

    def _capture_prefill(self, t: int, keys: int, taps: tuple[int, ...], head: bool, all_rows: bool) -> Captured:
        """A prefill graph of ``t`` tokens reading ``keys`` keys. Its one input is ``inp [t + 3]``: the ids (padded),
        then the chunk's start position, its slot and its real length, so a replay needs one host-to-device copy;
        the positions are ``start + 0 .. t - 1``, made in the graph. ``head``: the graph also ends in the last real
        row's logits and their argmax (a prompt's final chunk: its first token). With ``--last-rows`` its hidden
        output holds every row where ``all_rows``, else the last real row's with ``head`` and none without
        (Step.rows); without it, every row."""
        e = self.e
        dev = e.device
        inp = torch.zeros(t + 3, dtype=torch.long, device=dev)
        inp[t], inp[t + 1], inp[t + 2] = keys - t, e.scratch_slot, t  # warm-ups write the scratch slot
        steps = torch.arange(t, device=dev)[None]
        ids, slots, valid = inp[:t][None], inp[t + 1:t + 2], inp[t + 2:t + 3]

        def forward():
            rows = None  # --last-rows: the row read, made in the graph from the replayed real length
            if e.options.last_rows:
                rows = (valid - 1)[None] if head else torch.empty(1, 0, dtype=torch.long, device=dev)
            step = Step(ids, steps + inp[t], slots, kv_len=keys, mode=PREFILL, taps=taps, valid=valid, rows=rows,
                        all_rows=all_rows)
            hidden, tp = e.model.forward(step, e.cache)
            if not head:
                return hidden, tp, None, None
            row = step.head[0] if rows is not None else hidden[0].index_select(0, valid - 1)
            logits = e.model.logits(row)  # [1, V]: the last real row's
            return hidden, tp, logits, logits.argmax(-1)  # the same pick as Engine.pick's greedy rows

        graph, (hidden, tp, logits, token) = capture(forward, self.pool, dev)
        # the graph reads ``steps`` too: held here (freed, its memory would be reused under the graph)
        return Captured(graph, ids, steps, slots, hidden, logits, tp, valid=valid, inp=inp, token=token)

    def prefill(self, piece: list[int], slot: int, taps: tuple[int, ...] = (), start: int = 0, head: bool = False,
                all_rows: bool = True):
        """(hidden, taps, head) of a prompt chunk ``piece`` (T host ids) at position ``start`` into ``slot`` via its
        bucket's graph, or None when it has none (:meth:`prefill_plan`). ``head``: (logits ``[1, V]`` of the chunk's
        last token, their argmax ``[1]``) from the same replay, else None. hidden: ``[1, T, H]``, or with
        ``--last-rows`` and not ``all_rows`` the final hidden state of the rows read (none, or the last with
        ``head``: Step.rows). One
        host-to-device copy and one replay. The outputs are views of the graph's buffers: read them before the next
        prefill replay."""
        t = len(piece)
        plan = self.prefill_plan(t, start)
        if plan is None:
            return None
        size, keys = plan
        key = (PREFILL, size, keys, taps, head, all_rows)
        cap = self.graphs.get(key)
        if cap is None:
            try:
                cap = self.graphs[key] = self._capture_prefill(size, keys, taps, head, all_rows)
            except RuntimeError as err:  # an operation the capture refused: prefill stays eager from now on
                self.prefill_off = f"capture failed: {str(err).splitlines()[0][:200]}"
                warnings.warn(f"prefill CUDA graphs off ({self.prefill_off}); prefill runs eagerly", stacklevel=2)
                torch.cuda.synchronize(self.e.device)
                return None
        # pinned (torch's caching host allocator keeps it until the copy is done), copied without blocking
        staged = torch.tensor([*piece, *[0] * (size - t), start, slot, t], dtype=torch.long, pin_memory=True)
        cap.inp.copy_(staged, non_blocking=True)
        cap.graph.replay()
        return cap.hidden[:, :t], [x[:, :t] for x in cap.taps], (cap.logits, cap.token) if head else None

    def chain(self, last: int, pos: int, slot: int, stop_ids) -> Chain:
        """The greedy decode chain of one sequence, primed with its newest token ``last`` at position ``pos``:
        each :meth:`step` replays the decode forward and the link, with no host work in between."""
        stop_ids = sorted({int(i) for i in stop_ids})
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"a chained decode stops on at most {MAX_STOP_IDS} token ids, got {len(stop_ids)}")
        cap = self._captured(DECODE, 1, 1)
        ch = self._chain
        if ch is None or ch.cap is not cap:
            dev, scratch = self.e.device, self.e.scratch_slot
            picked, done = torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.bool, device=dev)
            own = torch.zeros(1, dtype=torch.long, device=dev)
            stops = torch.full((MAX_STOP_IDS,), -1, dtype=torch.long, device=dev)

            # the same pick as Engine.advance's greedy rows (logits.argmax), in one launch (kernels/select.chain_link:
            # the torch ops' bits); the torch ops themselves where Triton is missing
            link_args = (cap.logits[:, -1], stops, own, scratch, picked, cap.ids[:, 0], cap.pos, done, cap.slots)
            work = None
            if select.triton_available():
                work = select.LinkScratch(cap.logits.shape[-1], dev)

                def link():
                    select.chain_link(*link_args, work=work)
            else:
                def link():
                    select.chain_link_ref(*link_args)

            # one warm-up run (it changes nothing that the priming below does not set again)
            graph, _ = capture(link, self.pool, dev, warmups=1)
            ch = self._chain = Chain(graph, cap, picked, done, own, stops, work)
        cap.ids.fill_(last)
        cap.pos.fill_(pos)
        cap.slots.fill_(slot)
        ch.slot.fill_(slot)
        ch.done.fill_(False)
        ch.stop.fill_(-1)
        if stop_ids:
            ch.stop[:len(stop_ids)].copy_(torch.tensor(stop_ids, dtype=torch.long))
        return ch

    @staticmethod
    def step(ch: Chain) -> None:
        """One chained greedy step: forward at the primed input, then the link (token -> next input)."""
        ch.cap.graph.replay()
        ch.graph.replay()

    def forward(self, mode: str, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                taps: tuple[int, ...] = ()):
        """(hidden, logits, taps) for the real rows of ``ids [B, T]`` via the bucket's graph."""
        b, t = ids.shape
        cap = self._captured(mode, t, b, taps)
        cap.ids[:b].copy_(ids)
        cap.pos[:b].copy_(pos)
        cap.slots[:b].copy_(slots)
        if b < cap.ids.shape[0]:
            cap.slots[b:].fill_(self.e.scratch_slot)
        cap.graph.replay()
        if mode == VERIFY:
            self.e.cache.pending = cap
        return cap.hidden[:b], cap.logits[:b], [x[:b] for x in cap.taps]

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
               steps: list[int]) -> torch.Tensor:
        """``sample_rows(logits, RowSampling.make(params, seeds, steps)).tokens`` from a graph captured per (rows,
        vocabulary, dtype, the rows' switches): per call two host-to-device copies of the rows' parameters, one
        copy of the logits and one replay, where the eager sampler launches some fifty kernels. The same kernels on
        the same inputs: the same tokens. The result is the graph's own buffer: read it before the next call."""
        key = (logits.shape[0], logits.shape[-1], logits.dtype, *RowSampling.switches(params))
        entry = self.samplers.get(key)
        if entry is None:
            dev = self.e.device
            static_logits = logits.contiguous().clone()
            rows = RowSampling.make(params, seeds, steps, dev)
            graph, tokens = capture(lambda: sample_rows(static_logits, rows).tokens, self.pool, dev, warmups=1)
            entry = self.samplers[key] = (graph, static_logits, rows, tokens)
        graph, static_logits, rows, tokens = entry
        static_logits.copy_(logits)
        rows.fill_(params, seeds, steps)
        graph.replay()
        return tokens

    def commit(self, cap: Captured, keep: torch.Tensor) -> None:
        """Replay the captured rollback with ``keep [B]`` (padding rows keep everything)."""
        b = keep.shape[0]
        cap.keep[:b].copy_(keep)
        cap.keep[b:].fill_(cap.ids.shape[1])
        cap.commit_graph.replay()
