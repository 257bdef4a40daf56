"""Open-loop load against a server (``concurrency --url --request-rate R``), as vLLM's ``vllm bench serve`` sends it.

Requests arrive at times drawn in advance (:func:`arrival_times`: gamma-distributed gaps of shape ``burstiness``
and mean ``1 / request_rate``, Poisson at burstiness 1, rescaled so that the last arrival is at ``N / R``, as vLLM
does; ``inf``: all at once), seeded, and each is sent at its time whether or not the earlier ones have finished (a
closed loop waits for them). ``--max-concurrency`` caps the requests in flight: a request whose time has come
waits for one of them to finish (its TTFT and latency count from when it is sent, as vLLM's; the wait is its
``send_delay_ms``).

Per request: TTFT, TPOT (time after the first token / tokens after the first, for more than one token), ITL (per
token: a chunk of n tokens after a gap g counts n gaps of g/n), end-to-end latency; ``good`` when it meets every
SLO of ``--goodput`` (vLLM's names ``ttft``, ``tpot``, ``e2el``, in ms; a one-token request's TPOT counts as 0 there,
as vLLM's). Per round (the whole schedule once; ``--rounds`` replays it): the duration (first arrival scheduled to
the last request finished), request throughput (completed / duration), output token throughput (output tokens /
duration), total token throughput and goodput (good requests / duration); the summary holds their medians over
rounds, and mean, median, standard deviation (numpy's, of the population, as vLLM's) and the chosen percentiles of
every latency over all the rounds' completed requests. A failed request (an HTTP error) is counted, not timed.
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .common import percentile, read_text, tokens_sha256
from .remote import itl_samples, stream_completion

SLO_NAMES = ("ttft", "tpot", "e2el")  # vLLM's --goodput keys, in ms
SLO_METRIC = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms"}
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
GATE_PERCENTILES = (50.0, 99.0)  # always in the summary: the schema's and the gate's keys
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


# ---- options --------------------------------------------------------------------------------------------
def parse_rate(value) -> float | str:
    """``--request-rate``: a positive number of requests a second, or ``"inf"`` (every request at once)."""
    text = str(value).strip().lower()
    if text in ("inf", "infinity"):
        return "inf"
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"--request-rate {value!r}: requests per second (a positive number) or inf") from None
    if math.isinf(rate) and rate > 0:
        return "inf"
    if not rate > 0 or math.isnan(rate):
        raise ValueError(f"--request-rate {value!r}: requests per second (a positive number) or inf")
    return rate


def parse_goodput(items) -> dict[str, float]:
    """``--goodput ttft:500 tpot:50`` (vLLM's names and ms; items may also be given comma- or space-separated in one
    value) -> ``{"ttft": 500.0, "tpot": 50.0}``."""
    out: dict[str, float] = {}
    values = [] if items is None else [items] if isinstance(items, str) else items
    for item in [word for v in values for word in str(v).replace(",", " ").split()]:
        name, colon, ms = item.partition(":")
        name = name.strip().lower()
        if not colon or name not in SLO_NAMES:
            raise ValueError(f"--goodput {item!r}: expected NAME:MS with NAME one of {', '.join(SLO_NAMES)}")
        try:
            value = float(ms)
        except ValueError:
            value = math.nan
        if not value >= 0 or math.isinf(value):
            raise ValueError(f"--goodput {item!r}: the SLO is a number of milliseconds >= 0")
        if name in out and out[name] != value:
            raise ValueError(f"--goodput gives {name} twice ({out[name]:g} and {value:g} ms)")
        out[name] = value
    return out


def parse_percentiles(text) -> tuple[float, ...]:
    """``--percentiles 50,90,99`` (vLLM's --metric-percentiles) -> ``(50.0, 90.0, 99.0)``, sorted, each in [0, 100]."""
    items = [text] if isinstance(text, (int, float)) else str(text).split(",") if isinstance(text, str) else text
    try:
        qs = sorted({float(str(q).strip()) for q in items if str(q).strip()})
    except ValueError:
        raise ValueError(f"--percentiles {text!r}: comma-separated numbers from 0 to 100") from None
    if not qs or any(not 0 <= q <= 100 for q in qs):
        raise ValueError(f"--percentiles {text!r}: comma-separated numbers from 0 to 100")
    return tuple(qs)


def pct_key(q: float) -> str:
    """A percentile's key suffix: ``p50``, ``p99_9`` (a metric path has no ``.`` inside a key)."""
    return "p" + f"{q:g}".replace(".", "_")


def read_dataset(path: str | Path) -> list[dict]:
    """A JSONL dataset: one object a line with ``prompt`` (text) or ``prompt_ids`` (token ids), and optionally
    ``max_tokens`` or ``output_len`` (the completion length; else ``-n``) and ``id``. Returns ``{"id", "prompt",
    "max_tokens"}`` a line (``prompt``: the text, or the list of ids)."""
    out = []
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or ("prompt" in rec) == ("prompt_ids" in rec):
            raise ValueError(f"{where}: a line is a JSON object with 'prompt' (text) or 'prompt_ids', one of the two")
        if "prompt" in rec:
            prompt = rec["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        else:
            prompt = rec["prompt_ids"]
            if not isinstance(prompt, list) or not prompt or \
                    any(type(i) is not int or i < 0 for i in prompt):
                raise ValueError(f"{where}: 'prompt_ids' must be a non-empty list of token ids")
        lengths = {rec[k] for k in ("max_tokens", "output_len") if rec.get(k) is not None}
        if len(lengths) > 1:
            raise ValueError(f"{where}: 'max_tokens' and 'output_len' disagree")
        max_tokens = lengths.pop() if lengths else None
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            raise ValueError(f"{where}: 'max_tokens' / 'output_len' must be a positive integer")
        out.append({"id": str(rec.get("id", n)), "prompt": prompt, "max_tokens": max_tokens})
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


# ---- the schedule ------------------------------------------------------------------------------------------
def arrival_times(n: int, rate: float | str, burstiness: float = 1.0, seed: int = 0, *,
                  normalize: bool = True) -> np.ndarray:
    """Seconds from the start at which ``n`` requests arrive: the running sum of gamma-distributed gaps of shape
    ``burstiness`` and scale ``1 / (rate * burstiness)`` (mean ``1 / rate``; burstiness 1: exponential gaps, a
    Poisson process; below 1 burstier, above 1 more even; ``inf``: every gap ``1 / rate``), then (``normalize``, as
    vLLM's ``get_request``) rescaled so that the last arrival is at ``n / rate`` exactly: throughput does not move
    with the seed. ``rate`` ``"inf"``: every request at 0."""
    if n < 1:
        raise ValueError(f"--num-prompts {n}: at least one request")
    if rate == "inf" or math.isinf(float(rate)):
        return np.zeros(n)
    rate = float(rate)
    if not rate > 0:
        raise ValueError(f"--request-rate {rate}: a positive number of requests a second, or inf")
    if not burstiness > 0:
        raise ValueError(f"--burstiness {burstiness}: a positive gamma shape (1: Poisson)")
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if normalize and times[-1] > 0:
        times *= (n / rate) / times[-1]
    return times


def send_schedule(client, url: str, model: str, items: list[dict], arrivals, cap: int | None, timeout: float,
                  progress=None) -> tuple[list[dict], float, float]:
    """Send ``items`` (``{"id", "prompt", "max_tokens"}``) at their ``arrivals`` (seconds from now), each in its own
    thread whether or not the others finished; at most ``cap`` in flight (None: no cap). Returns one raw result a
    request (``stream_completion``'s, with ``item``, ``scheduled`` (absolute), ``error``, ``peak_in_flight``) in the
    items' order, the start and the end (absolute: the last request finished)."""
    n = len(items)
    workers = min(n, cap) if cap else n
    results: list[dict | None] = [None] * n
    lock = threading.Lock()
    state = {"in_flight": 0, "peak": 0, "done": 0}

    def one(i: int, scheduled: float) -> None:
        with lock:
            state["in_flight"] += 1
            state["peak"] = max(state["peak"], state["in_flight"])
        try:
            r = stream_completion(client, url, model, items[i]["prompt"], items[i]["max_tokens"], timeout)
            r["error"] = None
        except Exception as e:  # a failed request is counted, never timed (as vLLM's)
            now = time.perf_counter()
            r = {"submitted": now, "finished": now, "times": [], "error": " ".join(f"{type(e).__name__}: {e}".split())}
        finally:
            with lock:
                state["in_flight"] -= 1
                state["done"] += 1
        r.update(item=items[i], scheduled=scheduled, index=i)
        results[i] = r

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = []
        for i, at in enumerate(arrivals):
            wait = start + float(at) - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            futures.append(pool.submit(one, i, start + float(at)))
            if progress:
                progress(state["done"], n, f"sent {i + 1}/{n}")
        for f in futures:
            f.result()
            if progress:
                progress(state["done"], n, "finishing")
    end = time.perf_counter()
    for r in results:
        r["peak_in_flight"] = state["peak"]
    return results, start, end


# ---- per request and summary -------------------------------------------------------------------------------
def request_record(r: dict, level: int, rnd: int, start: float, slos: dict[str, float]) -> dict:
    """One request's record from its raw result (``send_schedule``'s): its latencies (ms), tokens and whether it
    met every SLO (``good``; None without SLOs or when it failed)."""
    item = r["item"]
    rec = {"concurrency": level, "round": rnd, "prompt_id": item["id"], "arrival_s": r["scheduled"] - start,
           "send_delay_ms": (r["submitted"] - r["scheduled"]) * 1e3, "max_tokens": item["max_tokens"],
           "error": r["error"]}
    if r["error"] is not None:
        rec.update(prompt_tokens=None, completion_tokens=0, ttft_ms=None, tpot_ms=None, e2e_ms=None,
                   decode_tok_s=None, itl_ms=[], good=None if not slos else False)
        return rec
    times, n = r["times"], r["n"]
    first = times[0] if times else r["finished"]
    ttft, e2e = (first - r["submitted"]) * 1e3, (r["finished"] - r["submitted"]) * 1e3
    tpot = (e2e - ttft) / (n - 1) if n > 1 else None
    toks = r["ids"] if r["ids"] else list(r["text"].encode())
    t = r["timings"]
    prompt = item["prompt"]
    rec.update(prompt_tokens=r["prompt_n"] if r["prompt_n"] is not None else
               (len(prompt) if isinstance(prompt, list) else None),
               completion_tokens=n, ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e,
               decode_tok_s=(n - 1) / (r["finished"] - first) if n > 1 and r["finished"] > first else None,
               itl_ms=itl_samples(times), tokens_sha256=tokens_sha256(toks), finish_reason=r["finish_reason"],
               drafted_tokens=t.get("draft_n"), accepted_tokens=t.get("draft_n_accepted"),
               good=is_good(rec | {"ttft_ms": ttft, "tpot_ms": tpot, "e2e_ms": e2e}, slos) if slos else None)
    return rec


def is_good(rec: dict, slos: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (ms; vLLM's ``--goodput``): TTFT, TPOT (0 for a request of one
    token, as vLLM counts it) and end-to-end latency each at most its bound."""
    for name, bound in slos.items():
        value = rec[SLO_METRIC[name]]
        if value is None and name == "tpot":
            value = 0.0
        if value is None or value > bound:
            return False
    return True


def latency_stats(name: str, values: list[float], percentiles=DEFAULT_PERCENTILES) -> dict:
    """``{name}_mean``, ``_median``, ``_std`` (numpy's: of the population, as vLLM's) and ``_pQ`` for every chosen
    percentile and the gate's (50, 99); None each when there are no values."""
    vals = [v for v in values if v is not None]
    out = {f"{name}_mean": float(np.mean(vals)) if vals else None,
           f"{name}_median": float(np.median(vals)) if vals else None,
           f"{name}_std": float(np.std(vals)) if vals else None}
    for q in sorted(set(percentiles) | set(GATE_PERCENTILES)):
        out[f"{name}_{pct_key(q)}"] = percentile(vals, q)
    return out


def round_figures(recs: list[dict], duration: float, slos: dict[str, float]) -> dict:
    """One round's throughputs: completed and good requests, input and output tokens, each over its duration."""
    done = [r for r in recs if r["error"] is None]
    inp = sum(r["prompt_tokens"] or 0 for r in done)
    out = sum(r["completion_tokens"] for r in done)
    good = sum(1 for r in done if r["good"]) if slos else None
    return {"duration_s": duration, "completed": len(done), "failed": len(recs) - len(done),
            "request_throughput": len(done) / duration, "output_throughput": out / duration,
            "total_token_throughput": (inp + out) / duration, "goodput": None if good is None else good / duration,
            "good_requests": good, "input_tokens": inp, "output_tokens": out}


def level_summary(level: int, records: list[dict], rounds: list[dict], opts) -> dict:
    """The open-loop run as one entry of ``summary.levels``: the concurrency suite's level keys (``concurrency``:
    the most requests the client lets be in flight, ``aggregate_tok_s``: the output token throughput, the median
    over rounds; ``matches_sequential`` None: no sequential reference is run) and the serving figures."""
    done = [r for r in records if r["error"] is None]
    per_req = [r["decode_tok_s"] for r in done if r["decode_tok_s"]]
    lat = {"ttft_ms": [r["ttft_ms"] for r in done], "tpot_ms": [r["tpot_ms"] for r in done if r["tpot_ms"] is not None],
           "itl_ms": [x for r in done for x in r["itl_ms"]], "e2e_ms": [r["e2e_ms"] for r in done]}
    slos = opts.goodput or {}

    def med(key):
        vals = [rd[key] for rd in rounds if rd[key] is not None]
        return float(np.median(vals)) if vals else None

    out = {"concurrency": level, "request_rate": opts.request_rate, "burstiness": opts.burstiness,
           "aggregate_tok_s": med("output_throughput"), "steady_tok_s": None,
           "per_request_tok_s": percentile(per_req, 50), "matches_sequential": None,
           "requests": len(records), "completed": len(done), "failed": len(records) - len(done),
           "duration_s": med("duration_s"), "request_throughput": med("request_throughput"),
           "output_throughput": med("output_throughput"), "total_token_throughput": med("total_token_throughput"),
           "goodput": med("goodput") if slos else None,
           "good_requests": sum(1 for r in done if r["good"]) if slos else None,
           "total_input_tokens": sum(rd["input_tokens"] for rd in rounds),
           "total_output_tokens": sum(rd["output_tokens"] for rd in rounds),
           "peak_in_flight": max(rd["peak_in_flight"] for rd in rounds),
           "send_delay_ms_p99": percentile([r["send_delay_ms"] for r in records], 99),
           "percentiles": list(opts.percentiles)}
    for name in LATENCIES:
        out.update(latency_stats(name, lat[name], opts.percentiles))
    drafted = sum(r.get("drafted_tokens") or 0 for r in done)
    if drafted:
        out["acceptance_rate"] = sum(r.get("accepted_tokens") or 0 for r in done) / drafted
    out["samples"] = {"aggregate_tok_s": [rd["output_throughput"] for rd in rounds],
                      "request_throughput": [rd["request_throughput"] for rd in rounds],
                      **({"goodput": [rd["goodput"] for rd in rounds]} if slos else {}), **lat}
    return out


def run_rounds(client, url: str, model: str, items: list[dict], opts, progress=None) -> tuple[list[dict], dict]:
    """Every round of the schedule against ``url``: (records, the level summary)."""
    arrivals = arrival_times(len(items), opts.request_rate, opts.burstiness, opts.seed)
    level = opts.levels[0]
    records, rounds = [], []
    for rnd in range(opts.rounds):
        def step(done, total, what, rnd=rnd):
            if progress:
                progress(rnd * len(items) + done, opts.rounds * len(items), f"round {rnd + 1}: {what}")

        raw, start, end = send_schedule(client, url, model, items, arrivals, opts.client_max_concurrency,
                                        opts.timeout_s, step)
        recs = [request_record(r, level, rnd, start, opts.goodput or {}) for r in raw]
        rounds.append({**round_figures(recs, end - start, opts.goodput or {}),
                       "peak_in_flight": raw[0]["peak_in_flight"]})
        records += recs
    if not any(r["error"] is None for r in records):
        raise RuntimeError(f"{url}: every request failed ({records[0]['error']})")
    return records, level_summary(level, records, rounds, opts)
