"""Token selection: greedy, or temperature / top-k / top-p / min-p sampling.

``probs`` gives the distribution a sampler draws from (after temperature, top-k, top-p and min-p), so that
speculative rejection sampling can compare target and draft distributions under the same processing; ``select``
draws from it with a seeded generator, one row at a time (the fp32 reference). ``sample_rows`` is the engine's
sampler: every row of a decode step in one call, per-row parameters on the device, counter-based random numbers,
nothing that needs the host or a data-dependent shape (so a CUDA graph can capture it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens, and when to stop."""

    max_new_tokens: int = 256  # 0: prefill only (scoring the prompt with prompt_logprobs): nothing generated
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely one (0: off)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # keep every generated position's log-softmax row (a drafter's rounds keep none)
    top_logprobs: int | None = None  # N: keep each generated token's log-probability and its N most likely instead,
    #                                  computed on the device in the step's batched pick (no vocabulary rows copied)
    prompt_logprobs: int | None = None  # N: each prompt token's log-probability and its N most likely (scoring.py)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be None or a non-negative integer, got {self.prompt_logprobs!r}")
        if self.top_logprobs is not None and (isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int)
                                              or self.top_logprobs < 0):
            raise ValueError(f"top_logprobs must be None or a non-negative integer, got {self.top_logprobs!r}")
        if self.top_logprobs is not None and self.logprobs:
            raise ValueError("logprobs (whole rows) and top_logprobs (each token's and its N most likely): one of them")
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and -2**63 <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(s for s in self.stop if s)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def keeps_logprobs(self) -> bool:
        """Whether generated tokens' log-probabilities are kept (whole rows or compact)."""
        return self.logprobs or self.top_logprobs is not None


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The sampling distribution ``[..., V]`` (fp32) after temperature, top-k, top-p and min-p (in that order, as
    transformers' warpers: min-p keeps the tokens at least ``min_p`` times as likely as the most likely one)."""
    x = logits.float() / max(p.temperature, 1e-6)
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    pr = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(pr, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < p.top_p  # always keeps the most likely token
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        pr = pr * keep
        pr = pr / pr.sum(-1, keepdim=True)
    if p.min_p > 0.0:
        pr = pr * (pr >= p.min_p * pr.amax(-1, keepdim=True))
        pr = pr / pr.sum(-1, keepdim=True)
    return pr


def select(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits [..., V]``: argmax when greedy, else a draw from :func:`probs`."""
    if p.greedy:
        return logits.argmax(-1)
    pr = probs(logits, p)
    flat = pr.reshape(-1, pr.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(pr.shape[:-1])


def make_generator(seed: int | None, device) -> torch.Generator:
    """A generator seeded with ``seed``, or with a fresh non-deterministic seed of its own when None (without
    reseeding torch's global generator, which the caller may have seeded for its own work)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


# ---- the batched sampler -------------------------------------------------------------------------------------------
# Every row of a step in one call: per-row parameters as device tensors, no host synchronisation and no shape that
# depends on the data, so a CUDA graph can hold it. The functions above are its fp32 reference (tests/test_sampler.py
# compares the two in distribution). Each row draws one uniform from a counter-based stream - SplitMix64 keyed by the
# request's seed, at the request's token index - and inverts the row's cumulative distribution (fp64) with it, so a
# seeded request's tokens do not depend on the rows it is batched with, and a step costs one scan and one binary
# search a row instead of a random number per vocabulary entry.

TOPK_CAP = 128  # a row with 0 < top_k <= this is filtered from its TOPK_CAP largest values (RowSampling.full)
_M64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _int64(v: int) -> int:
    """A 64-bit pattern as the signed value an int64 tensor holds."""
    v &= _M64
    return v - (1 << 64) if v >> 63 else v


def mix64(z: int) -> int:
    """SplitMix64's output function on a Python int (the reference of :func:`stream_uniform`'s hash)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def stream_key(seed: int) -> int:
    """The int64 key of a request's random stream: its seed (any int, taken mod 2**64) through SplitMix64's mixer,
    so that nearby seeds (a request's ``n`` choices take seed + i) start unrelated streams."""
    return _int64(mix64(seed))


def stream_uniform_ref(key: int, step: int) -> float:
    """Draw ``step`` (0, 1, ...) of stream ``key`` in [0, 1): SplitMix64 started at ``key``, its top 53 bits."""
    return (mix64(key + (step + 1) * _GOLDEN) >> 11) * 2.0 ** -53


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of an int64 tensor (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def stream_uniform(key: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """:func:`stream_uniform_ref` on int64 tensors (fp64 out), in torch ops on the device: int64 products wrap
    modulo 2**64 as SplitMix64's do (tests/test_sampler.py checks the bits against the reference)."""
    z = key + (step + 1) * _int64(_GOLDEN)
    z = (z ^ _srl(z, 30)) * _int64(_MIX1)
    z = (z ^ _srl(z, 27)) * _int64(_MIX2)
    z = z ^ _srl(z, 31)
    return _srl(z, 11).double() * 2.0 ** -53


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``; on CUDA through pinned memory without blocking (a pageable copy synchronises)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(slots=True)
class RowSampling:
    """Per-row parameters of a step for :func:`sample_rows`, device tensors ``[B]``: ``temperature`` (fp32, 0:
    greedy), ``top_k`` (int64, 0: off), ``top_p`` (fp32, 1: off), ``min_p`` (fp32, 0: off), ``key`` (int64, the
    row's stream: :func:`stream_key` of its seed) and ``step`` (int64, which draw of that stream: the request's token
    index). Three host-known switches fix the work (and so a captured graph's kernels): ``sort``, whether a row may
    filter by top-k or top-p (sorted values find their thresholds); ``full``, whether a row's filter may need the
    whole sorted row (top-p without a top-k of at most ``cap``, or a top-k over ``cap``) - without it only each row's
    ``cap`` largest values are sorted (``torch.topk``); and ``greedy``, every row greedy (an argmax and nothing
    else). A graph captures with static instances and :meth:`copy_` fills them before each replay."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    key: torch.Tensor
    step: torch.Tensor
    sort: bool = True
    greedy: bool = False
    full: bool = True
    cap: int = TOPK_CAP  # the sorted prefix a row with 0 < top_k <= cap is filtered from
    packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (floats [3, B], ints [3, B]) the fields are rows of

    @staticmethod
    def _host(params: list[SamplingParams], seeds: list[int], steps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
                             dtype=torch.float32),
                torch.tensor([[p.top_k for p in params], [stream_key(s) for s in seeds], list(steps)],
                             dtype=torch.long))

    @classmethod
    def make(cls, params: list[SamplingParams], seeds: list[int], steps: list[int], device,
             cap: int = TOPK_CAP) -> RowSampling:
        """The rows of ``params`` with their seeds and token indices (two host-to-device copies, no sync)."""
        floats, ints = (_to_device(t, device) for t in cls._host(params, seeds, steps))
        sort, full, greedy = cls.switches(params, cap)
        return cls(floats[0], ints[0], floats[1], floats[2], ints[1], ints[2], sort=sort, greedy=greedy, full=full,
                   cap=cap, packed=(floats, ints))

    def copy_(self, other: RowSampling) -> None:
        """Fill these (static) tensors with ``other``'s values; the switches stay this instance's."""
        for name in ("temperature", "top_k", "top_p", "min_p", "key", "step"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)

    def fill_(self, params: list[SamplingParams], seeds: list[int], steps: list[int]) -> None:
        """Write new rows into these tensors in place (an instance from :meth:`make`, as many rows): the two
        host-to-device copies of :meth:`make` and nothing else - what a captured sampler's replay reads. The
        switches stay this instance's: the caller keys its graphs by them (:meth:`switches`)."""
        for dst, src in zip(self.packed, self._host(params, seeds, steps)):
            if dst.is_cuda:  # straight from pinned memory, without blocking (torch keeps the buffer until it lands)
                dst.copy_(src.pin_memory(), non_blocking=True)
            else:
                dst.copy_(src)

    @staticmethod
    def switches(params: list[SamplingParams], cap: int = TOPK_CAP) -> tuple[bool, bool, bool]:
        """(sort, full, greedy) of :meth:`make` for these rows."""
        sampled = [p for p in params if not p.greedy]
        return (any(p.top_k > 0 or p.top_p < 1.0 for p in sampled),
                any(p.top_k > cap or (p.top_k == 0 and p.top_p < 1.0) for p in sampled),
                not sampled)


@dataclass(slots=True)
class Sampled:
    """What :func:`sample_rows` picked: ``tokens [B]`` (int64) and, when asked, each token's log-probability
    ``logprobs [B]`` and the ``n`` most likely (``top_ids``, ``top_logprobs`` ``[B, n]``, most likely first)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


CDF_CHUNK = 1024  # the inclusive scan runs in chunks of this many tokens, then over the chunks' totals (_cdf)


def _cdf(w: torch.Tensor) -> torch.Tensor:
    """The inclusive cumulative sum of each row of ``w [B, V]`` (fp64), ``[B, n * CDF_CHUNK]`` with ``n >= 2`` chunks
    (zero weight past ``V``): a scan within each chunk, then the chunks' offsets from a scan of their totals. Every
    scan has more than one row, so on CUDA each row takes the same kernel and the same order of additions whatever
    the batch (torch scans a single row with another algorithm), and a long row's scan is spread over many rows
    instead of one thread block walking the whole vocabulary."""
    b, v = w.shape
    n = max(2, -(-v // CDF_CHUNK))
    chunks = torch.nn.functional.pad(w, (0, n * CDF_CHUNK - v)).view(b, n, CDF_CHUNK).cumsum(-1)
    totals = torch.nn.functional.pad(chunks[:, :-1, -1], (1, 0, 0, 1))  # and a zero row: never a single-row scan
    offsets = totals.cumsum(-1)[:b]
    return (chunks + offsets[:, :, None]).view(b, n * CDF_CHUNK)


def _top_p_floor(s: torch.Tensor, kth: torch.Tensor, xmax: torch.Tensor, top_p: torch.Tensor,
                 total: torch.Tensor | None = None) -> torch.Tensor:
    """The smallest of the descending values ``s [B, W]`` that top-p keeps (``-inf`` where ``top_p >= 1``): a token
    stays while the mass strictly before it, over the tokens at or above ``kth`` (fp64), is below ``top_p`` times
    ``total`` (default: the mass of ``s`` itself)."""
    cum = (torch.exp(s - xmax).double() * (s >= kth)).cumsum(-1)
    before = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # the mass strictly before each sorted token
    inside = before < top_p.double() * (cum[:, -1:] if total is None else total)
    return torch.where(top_p >= 1.0, float("-inf"), torch.where(inside, s, float("inf")).amin(-1, keepdim=True))


def _filtered(logits: torch.Tensor, rows: RowSampling):
    """(tempered logits ``x`` [B, V] fp32, unnormalised probabilities ``e = exp(x - max)``, ``keep`` [B, V]): what
    temperature, top-k, top-p and min-p leave of each row, as :func:`probs` defines them. The three filters are one
    threshold on ``x``: top-k keeps ``x >= `` the k-th largest (ties with it included, as :func:`probs`); top-p keeps
    the tokens whose mass strictly before them (in descending order, after top-k) is below ``top_p``, which is
    ``x >= `` the smallest such token's (a tie at that boundary is kept whole, where :func:`probs` keeps the part its
    sort puts first); min-p keeps ``e >= min_p`` (relative to the maximum, so its place in the order does not matter
    to its own set). Sums run in fp64.

    A row with ``0 < top_k <= cap`` finds its threshold in its ``cap`` largest values alone (with its top-k mass summed
    over the whole row): every token top-p could keep is among them, and the threshold is at least the k-th value
    otherwise. So such a row's threshold is the same bits whether the batch sorts whole rows (``full``) or takes
    ``torch.topk`` of ``cap`` (its rows' need), and a seeded row draws the same token in any batch."""
    x = logits.float()
    v = x.shape[-1]
    greedy = rows.temperature <= 0
    x = x / torch.where(greedy, 1.0, rows.temperature.clamp(min=1e-6))[:, None]
    xmax = x.amax(-1, keepdim=True)
    e = torch.exp(x - xmax)
    keep = e >= rows.min_p[:, None]
    if not rows.sort:
        return x, e, keep
    width = min(rows.cap, v)
    s = torch.sort(x, dim=-1, descending=True).values if rows.full else torch.topk(x, width, dim=-1).values
    top_p = rows.top_p[:, None]
    # the prefix rule: the k-th value and the top-p boundary among each row's `width` largest values, the top-k
    # mass summed over the whole row
    k = rows.top_k.clamp(max=v)
    prefix = s[:, :width].contiguous()
    kth = torch.where((k > 0) & (k <= width), prefix.gather(-1, (k.clamp(1, width) - 1)[:, None])[:, 0],
                      float("-inf"))[:, None]
    total = (e.double() * (x >= kth)).sum(-1, keepdim=True)
    threshold = torch.maximum(kth, _top_p_floor(prefix, kth, xmax, top_p, total))
    if rows.full and width < v:  # the rows the prefix cannot settle: top-p alone, or a top-k past the prefix
        kth_f = s.gather(-1, (torch.where(k > 0, k, v) - 1)[:, None])
        whole = ((k > width) | ((k == 0) & (top_p[:, 0] < 1.0)))[:, None]
        threshold = torch.where(whole, torch.maximum(kth_f, _top_p_floor(s, kth_f, xmax, top_p)), threshold)
    return x, e, keep & (x >= threshold)


def batch_probs(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """The distribution ``[B, V]`` (fp64) :func:`sample_rows` draws each row from (:func:`probs` as a batch): for a
    greedy row, all the mass on its argmax."""
    _, e, keep = _filtered(logits, rows)
    w = (e * keep).double()
    pr = w / w.sum(-1, keepdim=True)
    first = torch.zeros_like(pr).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where((rows.temperature <= 0)[:, None], first, pr)


def sample_rows(logits: torch.Tensor, rows: RowSampling, logprobs: int | None = None,
                processed: bool = False) -> Sampled:
    """One token per row of ``logits [B, V]`` (any float dtype) under ``rows``: the argmax (its first, on ties) for a
    greedy row; for the others the first token whose cumulative filtered probability (:func:`batch_probs`, in
    vocabulary order, fp64) exceeds the row's stream draw (:func:`stream_uniform`), which picks token i with
    probability ``batch_probs[i]`` exactly up to fp64 rounding. No host synchronisation, no data-dependent shape.

    ``logprobs`` (None: none) N >= 0: each token's log-probability and its N most likely tokens'. By default under
    the model's own distribution (``log_softmax(logits)``, what the engine keeps as a token's log-probabilities:
    ``runtime/sequence.py``'s ``keep_logprobs``); ``processed``: under the distribution the token was drawn from (the
    filtered, tempered one; a greedy row's is all on its argmax; filtered tokens -inf)."""
    argmax = logits.argmax(-1)
    greedy = rows.temperature <= 0
    if rows.greedy:
        tokens = argmax
    else:
        x, e, keep = _filtered(logits, rows)
        w = (e * keep).double()
        cdf = _cdf(w)
        target = (stream_uniform(rows.key, rows.step) * cdf[:, -1])[:, None]
        # clamped: the product may round up to the total; and should a scan's rounding ever step onto a zero weight
        # (or past the vocabulary, into the scan's padding), the row's maximum (which every filter keeps) is taken
        idx = torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[-1] - 1)
        idx = torch.where(w.gather(-1, idx) > 0, idx, x.argmax(-1, keepdim=True))[:, 0]
        tokens = torch.where(greedy, argmax, idx)
    if logprobs is None:
        return Sampled(tokens)
    if processed:
        lp = torch.log(torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, argmax[:, None], 1.0))
        if not rows.greedy:
            shifted = x - x.amax(-1, keepdim=True)
            lp = torch.where(greedy[:, None], lp, torch.where(
                keep, shifted - torch.log((e * keep).sum(-1, keepdim=True)), float("-inf")))
    else:
        lp = torch.log_softmax(logits.float(), -1)
    out = Sampled(tokens, lp.gather(-1, tokens[:, None])[:, 0])
    if logprobs > 0:
        top = lp.topk(logprobs, dim=-1)
        out.top_ids, out.top_logprobs = top.indices, top.values
    return out
