"""The concurrency suite: C1/C2/C4/C8 clients at once, in-process through the Engine's continuous-batching
scheduler or against any OpenAI-compatible server (``--url``) with streaming.

Per request: TTFT, inter-token latency per token (a chunk of n tokens after a gap g counts n gaps of g/n),
end-to-end latency, tokens. Per level, medians over its rounds:

- ``aggregate_tok_s``: output tokens of the round / the round's wall time (the first request sent to the last one
  finished: queueing, prefill and the tail included), one definition at every level, as vLLM's benchmark_serving
  and SGLang's bench_serving report output throughput (their whole run is one of our rounds);
- ``steady_tok_s``: tokens in the steady window (from the moment every request of the round has its first token to
  the moment the first one finishes: all clients decoding at once) / its length; None when a round has no such
  window (more clients than the server's slots: some finish before others start);
- per-request decode tok/s, p50/p90/p99 latencies (TTFT; ITL; TPOT, a request's time after its first token / its
  tokens after the first, as vLLM's benchmark_serving; end-to-end), and whether greedy outputs equal the same prompts
  run alone.

Against a server the engine is the server's: the options that build an in-process engine (``ENGINE_FIELDS``) are
refused, and the result's ``config`` records what the server reports about itself (our server: ``spec`` and
``max_context`` in ``/v1/models``, ``slots`` in ``/health`` as ``max_concurrency``), ``device`` "server" and None
for every engine setting it does not report, never this client's defaults. Prompts are cut to ``prompt_tokens``
from the server's own tokenization (``prompt_token_ids`` of ``return_token_ids``) and sent as token ids; a server
that does not return them gets the texts whole, and ``config.prompt_tokens`` is None.

``--url --request-rate R`` makes the load open-loop, as ``vllm bench serve`` sends it (``suites/open_loop.py``):
requests at seeded arrival times whatever the earlier ones did, one level in the summary. In-process runs are
closed-loop only (the scheduler is stepped by its caller: arrivals would wait for its steps).
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields

import numpy as np

from ..engine.runtime.options import EngineOptions
from ..engine.sampling import SamplingParams
from ..reports.schema import make_result
from .common import DATA, DEFAULT_PROMPT, percentile, recorded_config, split_options, tokens_sha256
from .remote import httpx_module, itl_samples, server_errors, server_prompt_ids, server_settings, stream_completion

# the suite's options that only build an in-process engine (with every EngineOptions field): refused with a url,
# recorded from the server (or None) instead
OWN_ENGINE_FIELDS = ("model", "synthetic", "quant")
ENGINE_FIELDS = OWN_ENGINE_FIELDS + tuple(f.name for f in fields(EngineOptions))
# the options of an open-loop run (suites/open_loop.py), all None in a closed-loop one
OPEN_LOOP_FIELDS = ("burstiness", "num_prompts", "seed", "client_max_concurrency", "dataset", "goodput",
                    "percentiles")
OPEN_LOOP_NEEDS_URL = ("--request-rate sends open-loop load over HTTP: it needs --url (run `ninfer-bench serve` and "
                       "point --url at it); an in-process run is closed-loop (-c)")
OPEN_LOOP_FLAGS = {"client_max_concurrency": "--max-concurrency"}
DEFAULT_NUM_PROMPTS = 100
DEFAULT_PERCENTILES = "50,90,99"


@dataclass(slots=True)
class ConcurrencyOptions:
    """Everything a concurrency run depends on (recorded flat as the result's ``config``). ``engine_options``: the
    in-process engine's (its ``max_concurrency`` is the highest level)."""

    levels: tuple[int, ...] = (1, 2, 4, 8)
    url: str | None = None
    model: str | None = None
    synthetic: bool = False
    quant: str = "mixed"
    served_model: str | None = None  # the `model` field sent to a server (default: the first of /v1/models)
    engine_options: EngineOptions = field(default_factory=EngineOptions)
    max_new_tokens: int = 128
    rounds: int = 2
    prompt_tokens: int = 256
    label: str | None = None
    timeout_s: float = 600.0
    # in-process sampling (greedy when temperature is 0): request i of a level draws from seed sample_seed + i, so
    # its tokens do not depend on what it is batched with and equal the sequential reference's
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    sample_seed: int | None = None  # None: 0 when sampling, None when greedy (nothing drawn)
    # open loop (suites/open_loop.py; --url only): None for a closed-loop run, which records them so
    request_rate: float | str | None = None  # requests a second, or "inf"
    burstiness: float | None = None  # gamma shape of the gaps (default 1: Poisson)
    num_prompts: int | None = None  # requests a round (default: the dataset's lines, else 100)
    seed: int | None = None  # of the arrival times (default 0)
    client_max_concurrency: int | None = None  # --max-concurrency: requests in flight at most (None: no cap)
    dataset: str | None = None  # JSONL prompts (else the shipped prompts cut to prompt_tokens)
    goodput: dict | None = None  # {"ttft" | "tpot" | "e2el": ms}
    percentiles: tuple[float, ...] | None = None  # reported besides p50 and p99 (default 50, 90, 99)

    def __post_init__(self) -> None:
        self._open_loop()
        self.levels = tuple(sorted({int(c) for c in self.levels}))
        if not self.levels or self.levels[0] < 1:
            raise ValueError(f"concurrency levels must be positive integers, got {self.levels}")
        if self.rounds < 1 or self.max_new_tokens < 2:
            raise ValueError("rounds must be >= 1 and max-new-tokens >= 2")
        eo = self.engine_options
        if eo.interleave_chunk is not None and eo.interleave_chunk > eo.prefill_chunk:
            raise ValueError(f"--interleave-chunk ({eo.interleave_chunk}) must be at most --prefill-chunk "
                             f"({eo.prefill_chunk})")
        if self.sampling:
            SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)  # raises when invalid
            if self.url is not None:
                raise ValueError("--temperature / --top-p / --top-k sample in the in-process engine; against --url "
                                 "the requests are greedy")
            if self.engine_options.replay_acceptance is not None:
                raise ValueError("--replay-acceptance replays greedy acceptance: it cannot sample (--temperature 0)")
            self.sample_seed = 0 if self.sample_seed is None else int(self.sample_seed)
        elif self.top_p != 1.0 or self.top_k != 0 or self.sample_seed is not None:
            raise ValueError("--top-p, --top-k and --sample-seed shape sampling: give --temperature > 0 with them")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url {self.url}: expected http://HOST:PORT or https://...")
        if self.url is not None:  # (the CLI also refuses these given explicitly at their default values)
            own = [f.name for f in fields(self) if f.name in OWN_ENGINE_FIELDS and getattr(self, f.name) != f.default]
            default = EngineOptions()
            own += [f.name for f in fields(eo) if getattr(eo, f.name) != getattr(default, f.name)]
            if own:
                raise ValueError(f"{', '.join(own)} configure an in-process engine; against --url {self.url} the "
                                 "server's own settings apply (give them to its `serve`)")
        elif self.served_model is not None:
            raise ValueError("served-model names the model sent to a server: it needs --url")
        if eo.tensor_parallel > 1 and eo.replay_acceptance is not None:
            raise ValueError(f"--tensor-parallel {eo.tensor_parallel}: --replay-acceptance is not mirrored to the "
                             "other ranks yet (engine/runtime/mirror.py); run it on one rank")

    def _open_loop(self) -> None:
        """Resolve and check the open-loop options; a closed-loop run has none of them."""
        from .open_loop import parse_goodput, parse_percentiles, parse_rate, read_dataset

        given = [OPEN_LOOP_FLAGS.get(k, f"--{k.replace('_', '-')}") for k in OPEN_LOOP_FIELDS
                 if getattr(self, k) is not None]
        if self.request_rate is None:
            if given:
                verb = "configures" if len(given) == 1 else "configure"
                raise ValueError(f"{', '.join(given)} {verb} an open-loop run: it needs --request-rate")
            return
        if self.url is None:
            raise ValueError(OPEN_LOOP_NEEDS_URL)
        self.request_rate = parse_rate(self.request_rate)
        self.burstiness = 1.0 if self.burstiness is None else float(self.burstiness)
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness {self.burstiness:g}: a positive gamma shape (1: Poisson)")
        self.seed = 0 if self.seed is None else int(self.seed)
        if self.dataset is not None:
            lines = len(read_dataset(self.dataset))
            self.num_prompts = lines if self.num_prompts is None else self.num_prompts
        self.num_prompts = DEFAULT_NUM_PROMPTS if self.num_prompts is None else int(self.num_prompts)
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts {self.num_prompts}: at least one request")
        if self.client_max_concurrency is not None and int(self.client_max_concurrency) < 1:
            raise ValueError(f"--max-concurrency {self.client_max_concurrency}: at least 1")
        self.goodput = parse_goodput(self.goodput) if not isinstance(self.goodput, dict) else \
            parse_goodput([f"{k}:{v}" for k, v in self.goodput.items()])
        self.goodput = self.goodput or None
        self.percentiles = parse_percentiles(DEFAULT_PERCENTILES if self.percentiles is None else self.percentiles)
        # the one "level": the most requests the client lets be in flight
        self.levels = (min(self.num_prompts, self.client_max_concurrency or self.num_prompts),)
        if self.dataset is not None:
            self.prompt_tokens = None  # the dataset's prompts go as they are

    @property
    def sampling(self) -> bool:
        return self.temperature > 0

    def params(self, i: int, max_new_tokens: int):
        """Request ``i``'s sampling parameters (greedy, or seeded sampling)."""
        extra = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                     seed=self.sample_seed + i) if self.sampling else {}
        return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **extra)

    @property
    def open_loop(self) -> bool:
        return self.request_rate is not None

    @classmethod
    def make(cls, **kw) -> "ConcurrencyOptions":
        """Options from one flat set of keywords: the suite's fields, the rest :class:`EngineOptions`'."""
        return split_options(cls, kw)

    def default_label(self) -> str:
        if self.url and self.open_loop:  # another experiment than the closed loop's: another file in a folder
            rate = self.request_rate if self.request_rate == "inf" else f"{self.request_rate:g}"
            return f"server-{self.url.split('//')[-1]}-rate{rate}"
        if self.url:
            return f"server-{self.url.split('//')[-1]}"
        eo = self.engine_options
        k = f"-k{eo.draft_tokens}" if eo.spec != "none" and eo.draft_tokens else ""
        replay = "-replay" if eo.spec != "none" and eo.replay_acceptance is not None else ""
        sample = f"-t{self.temperature:g}" if self.sampling else ""
        tp = f"-tp{eo.tensor_parallel}" if eo.tensor_parallel > 1 else ""
        return f"{eo.runtime}-{eo.spec}{k}{replay}{sample}{tp}-conc"


def prompt_texts(n: int) -> list[str]:
    """``n`` distinct code prompts: held-out prefixes when shipped, else variations of the short-code prompt."""
    held = DATA / "heldout_prompts.jsonl"
    if held.is_file():
        texts = [json.loads(line)["text"] for line in held.read_text().splitlines() if line.strip()]
        if texts:
            return [texts[i % len(texts)] for i in range(n)]
    base = DEFAULT_PROMPT.read_text()
    return [f"# task {i}: {['parse', 'merge', 'render', 'index', 'score', 'batch', 'cache', 'route'][i % 8]}\n{base}"
            for i in range(n)]


def round_throughput(rows: list[dict]) -> tuple[float, float | None]:
    """(output tokens / wall time, tokens / steady window or None) of one round's requests (see the module doc)."""
    t0, t1 = min(r["submitted_abs"] for r in rows), max(r["finished_abs"] for r in rows)
    wall = sum(r["completion_tokens"] for r in rows) / (t1 - t0)
    start, end = max(r["first_abs"] for r in rows), min(r["finished_abs"] for r in rows)
    if end <= start:  # a request finished before another had its first token: never all decoding at once
        return wall, None
    return wall, sum(sum(1 for t in r["times_abs"] if start < t <= end) for r in rows) / (end - start)


def level_summary(c: int, reqs: list[dict], baseline: dict[str, str]) -> dict:
    """Aggregate one level's per-request records (dicts with submitted, first, finished, times, tokens...)."""
    ttft = [r["ttft_ms"] for r in reqs]
    itl = [x for r in reqs for x in r["itl_ms"]]
    e2e = [r["e2e_ms"] for r in reqs]
    # TPOT as vLLM's benchmark_serving defines it: a request's time after its first token / its tokens after the first
    tpot = [(r["e2e_ms"] - r["ttft_ms"]) / (r["completion_tokens"] - 1) for r in reqs if r["completion_tokens"] > 1]
    rounds = [round_throughput([r for r in reqs if r["round"] == rnd]) for rnd in sorted({r["round"] for r in reqs})]
    agg = [wall for wall, _ in rounds]
    steady = [s for _, s in rounds] if all(s is not None for _, s in rounds) else []  # every round's, or none
    per_req = [r["decode_tok_s"] for r in reqs if r["decode_tok_s"]]
    matches = all(baseline.get(r["prompt_id"]) == r["tokens_sha256"] for r in reqs)
    out = {"concurrency": c, "aggregate_tok_s": float(np.median(agg)),
           "steady_tok_s": float(np.median(steady)) if steady else None, "per_request_tok_s": percentile(per_req, 50),
           "matches_sequential": matches, "requests": len(reqs),
           "samples": {"aggregate_tok_s": agg, **({"steady_tok_s": steady} if steady else {}), "ttft_ms": ttft,
                       "itl_ms": itl}}
    for name, vals in (("ttft_ms", ttft), ("itl_ms", itl), ("tpot_ms", tpot), ("e2e_ms", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(vals, q)
    drafted = sum(r.get("drafted_tokens") or 0 for r in reqs)
    if drafted:
        out["acceptance_rate"] = sum(r.get("accepted_tokens") or 0 for r in reqs) / drafted
    return out


def _record(c, rnd, pid, submitted, times, tokens_or_n, finished, extra=None) -> dict:
    n = tokens_or_n if isinstance(tokens_or_n, int) else len(tokens_or_n)
    first = times[0] if times else finished
    dec = (n - 1) / (finished - first) if n > 1 and finished > first else None
    rec = {"concurrency": c, "round": rnd, "prompt_id": pid, "ttft_ms": (first - submitted) * 1e3,
           "e2e_ms": (finished - submitted) * 1e3, "completion_tokens": n, "decode_tok_s": dec,
           "itl_ms": itl_samples(times), "submitted_abs": submitted, "first_abs": first, "finished_abs": finished,
           "times_abs": times}
    if not isinstance(tokens_or_n, int):
        rec["tokens_sha256"] = tokens_sha256(tokens_or_n)
    rec.update(extra or {})
    return rec


# ---- in-process ---------------------------------------------------------------------------------------
def make_engine(opts: ConcurrencyOptions):
    """The in-process run's engine: ``opts``' model and engine options with a slot for every client of the top
    level (under tensor parallelism: this rank's share)."""
    from ..engine.artifact.loader import load_source
    from ..engine.runtime.engine import Engine

    eo = dataclasses.replace(opts.engine_options, max_concurrency=max(opts.levels))
    return Engine(load_source(opts.model, synthetic=opts.synthetic, quant=opts.quant, device=eo.torch_device), eo)


def run_in_process(opts: ConcurrencyOptions, progress=None, engine=None):
    """``engine``: the one to run on (under tensor parallelism rank 0's :class:`~..engine.runtime.mirror.
    MirroredEngine`); default :func:`make_engine`'s."""
    from ..engine.runtime.scheduler import Scheduler

    top = max(opts.levels)
    eng = engine if engine is not None else make_engine(opts)
    opts.engine_options.max_context = eng.options.max_context  # recorded as resolved (the model's limit, or 8192)
    opts.engine_options.cuda_graphs = eng.options.cuda_graphs  # off where the ranks' collectives are not IPC
    prompts = [exact_length(eng.tokenizer.encode(t), opts.prompt_tokens) for t in prompt_texts(top)]
    sched = Scheduler(eng)
    records, baseline, refs = [], {}, [None] * top
    total = top + sum(opts.rounds for _ in opts.levels)
    done = 0
    # the sequential reference first: each prompt alone, greedy. With replayed acceptance its tokens are also the
    # continuations the drafts are replaced by, so it runs with the drafter's own proposals (greedy speculative
    # tokens are plain decoding's whatever was drafted)
    replay, eng.replay = eng.replay, None
    for i, p in enumerate(prompts):
        req = sched.submit(p, opts.params(i, opts.max_new_tokens))
        sched.run_until_idle()
        baseline[f"p{i}"] = tokens_sha256(req.tokens)
        refs[i] = req.tokens if replay is not None else None
        done += 1
        if progress:
            progress(done, total, f"sequential p{i}")
    eng.replay = replay
    # warm-up at every batch size up to the top level, not only the levels: requests of a level finish unevenly
    # (a speculative round's acceptance differs between them), so a timed round also steps the smaller batches its
    # stragglers leave, and each size's graphs and kernels (a verify of 8 b rows takes another qmv build for each
    # column-group count) must be captured and compiled before it (a -c 8 run stalled 4 s on two stragglers' first
    # 2-sequence round: docs/perf/2026-12-03f-sampler-prefix-h200.md)
    for c in range(1, top + 1):
        for i in range(c):
            sched.submit(prompts[i], opts.params(i, min(8, opts.max_new_tokens)), reference=refs[i])
        sched.run_until_idle()
    for c in opts.levels:
        for rnd in range(opts.rounds):
            reqs = [sched.submit(prompts[i], opts.params(i, opts.max_new_tokens), reference=refs[i])
                    for i in range(c)]
            sched.run_until_idle()
            for i, r in enumerate(reqs):
                if r.error:
                    raise RuntimeError(f"request failed at concurrency {c}: {r.error}")
                st = r.seq.stats
                rec = _record(c, rnd, f"p{i}", r.submitted, r.token_times, r.tokens, r.finished_at,
                              {"prompt_tokens": len(prompts[i]), "drafted_tokens": st.get("drafted_tokens"),
                               "accepted_tokens": st.get("accepted_tokens")})
                records.append(rec)
            done += 1
            if progress:
                progress(done, total, f"C{c} round {rnd + 1}")
    settings = {"device": str(eng.device), "max_concurrency": top, **eng.recorded}  # settings as applied
    if replay is not None:
        settings["replay_profile"] = replay.probs  # the per-position conditional acceptance replayed
    return records, baseline, dict(eng.model_info), settings


def exact_length(ids: list[int], n: int) -> list[int]:
    """``ids`` cut or repeated to exactly ``n`` tokens (every client's prompt as long as asked for)."""
    if not ids:
        raise ValueError("a concurrency prompt encodes to no tokens")
    return (ids * -(-n // len(ids)))[:n]


# ---- against a server (the client: suites/remote.py) -------------------------------------------------
def run_against_url(opts: ConcurrencyOptions, progress=None):
    httpx = httpx_module()
    with server_errors(opts.url):  # unreachable, refused, timed out: one line naming the server
        return _run_against_url(opts, httpx, progress)


def _run_against_url(opts: ConcurrencyOptions, httpx, progress=None):
    url = opts.url.rstrip("/")
    texts = prompt_texts(max(opts.levels))
    records, baseline = [], {}
    total = len(texts) + len(opts.levels) * opts.rounds
    done = 0
    with httpx.Client() as client:
        settings = server_settings(client, url, opts.served_model)
        model = settings["served_model"]
        ids = [server_prompt_ids(client, url, model, t, opts.timeout_s) for t in texts]
        cut = all(x is not None for x in ids)  # else the texts whole: their length is the server's tokenization
        prompts = [exact_length(x, opts.prompt_tokens) for x in ids] if cut else texts
        settings["prompt_tokens"] = opts.prompt_tokens if cut else None
        stream_completion(client, url, model, prompts[0], 4, opts.timeout_s)  # warm-up
        for i, prompt in enumerate(prompts):  # the sequential reference: each prompt alone
            r = stream_completion(client, url, model, prompt, opts.max_new_tokens, opts.timeout_s)
            baseline[f"p{i}"] = tokens_sha256(r["ids"] if r["ids"] else list(r["text"].encode()))
            done += 1
            if progress:
                progress(done, total, f"sequential p{i}")
        with ThreadPoolExecutor(max_workers=max(opts.levels)) as pool:
            for c in opts.levels:
                for rnd in range(opts.rounds):
                    futs = [pool.submit(stream_completion, client, url, model, prompts[i], opts.max_new_tokens,
                                        opts.timeout_s) for i in range(c)]
                    for i, f in enumerate(futs):
                        r = f.result()
                        toks = r["ids"] if r["ids"] else list(r["text"].encode())
                        t = r["timings"]
                        rec = _record(c, rnd, f"p{i}", r["submitted"], r["times"], toks, r["finished"],
                                      {"prompt_tokens": r["prompt_n"], "drafted_tokens": t.get("draft_n"),
                                       "accepted_tokens": t.get("draft_n_accepted")})
                        rec["completion_tokens"] = r["n"]
                        records.append(rec)
                    done += 1
                    if progress:
                        progress(done, total, f"C{c} round {rnd + 1}")
    return records, baseline, {"url": url, "served_model": model}, settings


def _run_open_loop(opts: ConcurrencyOptions, httpx, progress=None):
    """An open-loop run against ``opts.url`` (suites/open_loop.py): (records, level summary, model, settings)."""
    from .open_loop import read_dataset, run_rounds

    url = opts.url.rstrip("/")
    n = opts.num_prompts
    workers = min(n, opts.client_max_concurrency or n)
    limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
    with httpx.Client(limits=limits) as client:  # (httpx's default pool of 100 would cap the load unasked)
        settings = server_settings(client, url, opts.served_model)
        model = settings["served_model"]
        if opts.dataset is not None:
            lines = read_dataset(opts.dataset)
            items = [{**lines[i % len(lines)], "max_tokens": lines[i % len(lines)]["max_tokens"] or
                      opts.max_new_tokens} for i in range(n)]
            settings["prompt_tokens"] = None
        else:  # the closed loop's prompts, cut to --prompt-tokens from the server's own tokenization
            texts = prompt_texts(n)
            known = {t: server_prompt_ids(client, url, model, t, opts.timeout_s) for t in dict.fromkeys(texts)}
            cut = all(x is not None for x in known.values())
            items = [{"id": f"p{i}", "prompt": exact_length(known[t], opts.prompt_tokens) if cut else t,
                      "max_tokens": opts.max_new_tokens} for i, t in enumerate(texts)]
            settings["prompt_tokens"] = opts.prompt_tokens if cut else None
        settings["prompt_format"] = ",".join(sorted({"ids" if isinstance(x["prompt"], list) else "text"
                                                     for x in items}))
        stream_completion(client, url, model, items[0]["prompt"], 4, opts.timeout_s)  # warm-up
        records, level = run_rounds(client, url, model, items, opts, progress)
    return records, level, {"url": url, "served_model": model}, settings


def run_concurrency(opts: ConcurrencyOptions, progress=None, engine=None) -> dict:
    """Run every level (an open-loop run: its schedule, as one level); returns the result document. ``engine``: an
    in-process run's engine (:func:`run_in_process`)."""
    if opts.open_loop:
        httpx = httpx_module()
        with server_errors(opts.url):
            records, level, model, settings = _run_open_loop(opts, httpx, progress)
        settings = {**dict.fromkeys(ENGINE_FIELDS), **settings, "device": "server"}
        settings.pop("served_model")
        config = {**recorded_config(opts), **settings, "label": opts.label or opts.default_label()}
        config["ignore_eos"] = True
        summary = {"levels": [level], "mode": "open-loop",
                   "throughput": "open loop: requests sent at seeded arrival times whatever the earlier ones did; "
                                 "aggregate_tok_s = output_throughput: output tokens / (first arrival to last "
                                 "finish), the median over rounds; goodput: requests meeting every SLO / that time"}
        return make_result("concurrency", label=config["label"], config=config, records=records, summary=summary,
                           model=dict(model))
    if opts.url:
        records, baseline, model, settings = run_against_url(opts, progress)
        settings = {**dict.fromkeys(ENGINE_FIELDS), **settings, "device": "server"}  # never this client's defaults
        settings.pop("served_model")
    else:  # the device the engine ran on, not "auto"
        records, baseline, model, settings = run_in_process(opts, progress, engine)
    levels = [level_summary(c, [r for r in records if r["concurrency"] == c], baseline) for c in opts.levels]
    for r in records:  # raw times are bulky; the summary keeps the samples
        r.pop("times_abs")
    config = {**recorded_config(opts), **settings}
    config["label"] = opts.label or opts.default_label()
    summary = {"levels": levels, "baseline": "each prompt run alone, greedy, same max-new-tokens",
               "throughput": "aggregate_tok_s: output tokens / round wall time (first request sent to last one "
                             "finished); steady_tok_s: while every client decodes at once"}
    return make_result("concurrency", label=config["label"], config=config, records=records, summary=summary,
                       model=dict(model))


def run_tensor_parallel(opts: ConcurrencyOptions) -> tuple[dict | None, list[list[int]]]:
    """One rank of an in-process run under tensor parallelism (engine/runtime/parallel.launch, through the CLI's
    ``on_ranks``): (rank 0's result document or None, the tokens of every sequence this rank released, in order).
    Rank 0 runs the suite on a :class:`~..engine.runtime.mirror.MirroredEngine`; the others replay its calls."""
    from ..engine.runtime.mirror import lead_or_follow

    return lead_or_follow(make_engine(opts), lambda mirror: run_concurrency(opts, engine=mirror))
