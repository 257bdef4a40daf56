"""The suites against any OpenAI-compatible server (``--url``: vLLM, SGLang, llama-server, our own ``serve``).

The client the concurrency, decode and niah suites share: one streamed ``/v1/completions`` request
(:func:`stream_completion`; greedy, ``ignore_eos``, ``return_token_ids``, token arrival times from the SSE chunks),
what a server reports about itself (:func:`server_settings`), its own tokenization of a text
(:func:`server_prompt_ids`), and one-line errors for an unreachable server or an HTTP error (:func:`server_errors`).

Decode and niah through it (:func:`run_decode_url`, :func:`run_niah_url`) write documents of the same suite, records
and summary keys as their in-process runs (``suites/decode.py``, ``suites/niah.py``). The engine is the server's:
every :class:`EngineOptions` field is None in the config unless the server reports it (``spec``, ``max_context``,
``max_concurrency``), ``engine`` and ``device`` are ``"server"``, and ``url`` / ``served_model`` say which one.

- Prompts go as token ids where the server takes them (ours, vLLM: a list of ints as ``prompt``), else as text
  (``config.prompt_format``). The ids are ``--model``'s tokenizer's when given (checked against the server's own
  tokenization where it returns one: a server with another tokenizer is refused), else the server's own.
- Generated tokens (``config.tokens_from``): the ids the server streams (``token_ids``); else the text tokenized by
  ``--model``'s tokenizer; else the UTF-8 bytes of the text (``tokens_sha256`` then hashes those).
- Timings per request: TTFT = first chunk carrying a token - request sent; decode tok/s = tokens after the first /
  time from the first to the last token; prefill tok/s = prompt tokens (the server's count) / TTFT; ITL per token
  (a chunk of n tokens after a gap g counts n gaps of g/n). A server's prefix cache makes a repeated prompt's
  prefill a cache hit: records keep ``cached_prompt_tokens`` where the server reports them.
- ``ignore_eos`` is asked for; ``config.ignore_eos_honoured`` is False when a completion ended early for a reason
  other than its length (a server that ignored the field), None when not asked.
- NIAH: the cases are built with ``--model``'s tokenizer (default: the bundled model's), which must be the
  server's; oracle agreement needs the generated token ids (``pass`` None, and ``summary.oracle_unavailable``
  saying why, when the server returns none or refuses token-id prompts); ``kl`` needs the server's top
  log-probabilities of the oracle's top-k ids (read by token text, or vLLM's ``token_id:N``), else None. The oracles
  are ``--model``'s: the server is taken to serve those weights.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields

from ..engine.runtime.options import EngineOptions
from ..reports.schema import make_result
from .common import median, percentile, read_prompt_set, recorded_config, tokens_sha256

CLIENT_HINT = "--url needs httpx: pip install 'ninfer-bench[client]'"
SERVER_TOP_LOGPROBS = 20  # asked of a server for the KL against an oracle (vLLM's default max_logprobs, ours' cap)
REFUSED = (400, 404, 422)  # the statuses of a request whose body the server refuses


def httpx_module():
    """httpx (the ``[client]`` extra), or a one-line RuntimeError saying how to install it."""
    try:
        import httpx
    except ImportError:
        raise RuntimeError(CLIENT_HINT) from None
    return httpx


class ServerError(RuntimeError):
    """An HTTP error answer of a server (``status``), one line: the URL, the status and the error's message."""

    def __init__(self, url: str, status: int, body: str):
        self.status = status
        super().__init__(f"{url}: HTTP {status}: {error_message(body)}")


def error_message(body: str) -> str:
    """An error body's message (OpenAI's ``{"error": {"message"}}``, FastAPI's ``{"detail"}``) on one line."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message")))
        body = str(err.get("message", err) if isinstance(err, dict) else err)
    return " ".join(body.split())[:300] or "(no body)"


@contextmanager
def server_errors(url: str):
    """Turn httpx's errors (unreachable, refused, timed out) into one-line RuntimeErrors naming the server."""
    httpx = httpx_module()
    try:
        yield
    except httpx.ConnectError as e:
        raise RuntimeError(f"{url}: cannot connect ({type(e).__name__}: {e})") from None
    except httpx.HTTPError as e:
        raise RuntimeError(f"{url}: {type(e).__name__}: {e}") from None


def stream_completion(client, url: str, model: str, prompt: str | list[int], max_tokens: int, timeout: float, *,
                      ignore_eos: bool = True, logprobs: int | None = None) -> dict:
    """One streamed /v1/completions request (``prompt``: text or token ids), greedy; token arrival times from the
    SSE chunks. Returns ``submitted``, ``times`` (one per token), ``finished``, ``text``, ``ids`` (the streamed
    ``token_ids``) and ``ids_complete`` (every token came with its id), ``n`` (the server's completion count, else
    the tokens counted), ``prompt_n`` and ``cached_n`` (its usage), ``timings`` (the llama.cpp-style extension our
    server sends), ``finish_reason`` and, asked with ``logprobs``, ``top_logprobs`` (one ``{token: logprob}`` a
    token; None unless every token has one)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, "ignore_eos": ignore_eos}
    if logprobs is not None:
        body["logprobs"] = logprobs
    submitted = time.perf_counter()
    times, text, ids, tops, usage, timings, finish = [], [], [], [], None, None, None
    missing_ids = missing_lp = 0
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as resp:
        if resp.status_code != 200:
            raise ServerError(url, resp.status_code, resp.read().decode(errors="replace"))
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):  # an error after the status line went out
                raise RuntimeError(f"{url}: error in the stream: {error_message(data)}")
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices", []):
                piece_ids = choice.get("token_ids")
                piece = choice.get("text") or ""
                lp = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else None
                n = len(piece_ids) if piece_ids is not None else len(lp.get("tokens") or []) if lp else int(bool(piece))
                finish = choice.get("finish_reason") or finish
                if n:
                    now = time.perf_counter()
                    times += [now] * n
                    text.append(piece)
                    ids += piece_ids or []
                    missing_ids += n if piece_ids is None else 0
                    page = (lp or {}).get("top_logprobs") or []
                    tops += page
                    missing_lp += n - len(page)
    finished = time.perf_counter()
    usage = usage or {}
    n = usage.get("completion_tokens") or len(times)
    return {"submitted": submitted, "times": times, "finished": finished, "text": "".join(text), "ids": ids,
            "ids_complete": bool(ids) and not missing_ids and len(ids) == n, "n": n,
            "prompt_n": usage.get("prompt_tokens"),
            "cached_n": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"), "timings": timings or {},
            "finish_reason": finish,
            "top_logprobs": tops if logprobs is not None and tops and not missing_lp else None}


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def server_settings(client, url: str, served_model: str | None) -> dict:
    """What the server reports about itself: the model it serves (the first of /v1/models unless ``served_model``),
    and where it says them its ``spec`` and ``max_context`` (our server's /v1/models entry; vLLM's
    ``max_model_len``) and its slots (``slots`` of our /health) as ``max_concurrency``; None for what it does not
    say."""
    httpx = httpx_module()
    resp = client.get(f"{url}/v1/models", timeout=30)
    if resp.status_code != 200:
        raise ServerError(f"{url}/v1/models", resp.status_code, resp.text)
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model")
    entry = next((m for m in data if m.get("id") == served_model), {}) if served_model else data[0]
    spec = entry.get("spec")
    out = {"served_model": served_model or entry["id"], "spec": spec if isinstance(spec, str) else None,
           "max_context": _count(entry.get("max_context", entry.get("max_model_len"))), "max_concurrency": None}
    try:  # optional: a server without /health, or with another body, just does not say
        health = client.get(f"{url}/health", timeout=30)
        body = health.json() if health.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        body = None
    if isinstance(body, dict):
        out["max_concurrency"] = _count(body.get("slots"))
    return out


def server_prompt_ids(client, url: str, model: str, text: str, timeout: float) -> list[int] | None:
    """The server's own tokenization of ``text`` (``prompt_token_ids`` of a one-token completion asked with
    ``return_token_ids``), or None when it does not return it."""
    body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
    resp = client.post(f"{url}/v1/completions", json=body, timeout=timeout)
    if resp.status_code != 200:
        raise ServerError(url, resp.status_code, resp.text)
    ids = resp.json().get("prompt_token_ids")
    return ids if isinstance(ids, list) and ids and all(type(i) is int for i in ids) else None


def takes_token_ids(client, url: str, model: str, ids: list[int], timeout: float) -> bool:
    """Whether the server takes a prompt as a list of token ids (a one-token completion of the first few of
    ``ids``): False when it refuses the body, an error otherwise."""
    body = {"model": model, "prompt": list(ids[:8]), "max_tokens": 1, "temperature": 0.0}
    resp = client.post(f"{url}/v1/completions", json=body, timeout=timeout)
    if resp.status_code in REFUSED:
        return False
    if resp.status_code != 200:
        raise ServerError(url, resp.status_code, resp.text)
    return True


def gives_logprobs(client, url: str, model: str, prompt, timeout: float) -> bool:
    """Whether the server answers ``logprobs`` :data:`SERVER_TOP_LOGPROBS` with top log-probabilities (False when it
    refuses the field or returns none)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "logprobs": SERVER_TOP_LOGPROBS}
    resp = client.post(f"{url}/v1/completions", json=body, timeout=timeout)
    if resp.status_code in REFUSED:
        return False
    if resp.status_code != 200:
        raise ServerError(url, resp.status_code, resp.text)
    choices = resp.json().get("choices") or [{}]
    return bool(((choices[0] or {}).get("logprobs") or {}).get("top_logprobs"))


def default_label(url: str, suffix: str = "") -> str:
    """``server-HOST:PORT`` (a path's slashes as dashes: a label is a file name)."""
    return "server-" + url.split("//", 1)[-1].strip("/").replace("/", "-") + suffix


def check_url(url: str | None, served_model: str | None) -> None:
    if url is None:
        if served_model is not None:
            raise ValueError("--served-model names the model sent to a server: it needs --url")
        raise ValueError("--url is required")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url {url}: expected http://HOST:PORT or https://...")


def server_config(settings: dict) -> dict:
    """The engine part of a server run's config: every :class:`EngineOptions` field None unless the server reports
    it, ``engine`` / ``device`` "server" (never this client's defaults)."""
    out = dict.fromkeys(f.name for f in fields(EngineOptions))
    out.update(synthetic=None, quant=None, engine="server", device="server", dtype=None)
    out.update({k: settings[k] for k in ("spec", "max_context", "max_concurrency")})
    return out


def _tokenizer_info(info: dict) -> dict:
    return {k: info.get(k) for k in ("path", "artifact_id", "text_id", "model_id", "preset")}


def itl_samples(token_times: list[float]) -> list[float]:
    """Inter-token latencies per token (ms): tokens arriving together share the gap before them."""
    out, i = [], 1
    while i < len(token_times):
        j = i
        while j + 1 < len(token_times) and token_times[j + 1] == token_times[i]:
            j += 1
        n = j - i + 1
        out += [(token_times[i] - token_times[i - 1]) * 1e3 / n] * n
        i = j + 1
    return out


def generated_tokens(r: dict, tokenizer) -> tuple[list[int], str]:
    """(tokens, where they came from) of one completion (see the module doc: ``tokens_from``)."""
    if r["ids_complete"]:
        return list(r["ids"]), "server"
    if tokenizer is not None:
        return list(tokenizer.encode(r["text"])), "tokenizer"
    return list(r["text"].encode()), "text"


# ---- decode ---------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class RemoteDecodeOptions:
    """A decode run against ``url``: ``decode`` holds the workload (prompt file, lengths, repeats, label; its
    ``model``, when given, only names the tokenizer), recorded as the in-process suite records it."""

    url: str | None
    decode: object  # suites.decode.DecodeOptions
    served_model: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_url(self.url, self.served_model)
        self.url = self.url.rstrip("/")
        d = self.decode
        if d.engine != "ours" or d.images or d.synthetic or d.engine_options != EngineOptions():
            raise ValueError(f"against --url {self.url} the server's own engine settings apply: give them to its "
                             f"`serve` (engine options, --engine, --image and --synthetic configure an in-process "
                             f"engine)")


class _Texts:
    """A stand-in tokenizer for :func:`read_prompt_set`: a text record's "ids" are ``[its text]`` (tokenized later,
    by ``--model``'s tokenizer or the server's)."""

    @staticmethod
    def encode(text: str) -> list:
        return [text]


def _decode_prompts(client, opts: RemoteDecodeOptions, model: str, tokenizer) -> tuple[list, str]:
    """The prompts to send (token-id lists, or texts where the server takes no ids) and the format they go in."""
    d = opts.decode
    items = [rec["prompt_ids"] for rec in read_prompt_set(d.prompt_file, _Texts)]
    if d.prompts and d.prompts > len(items):
        raise ValueError(f"--prompts {d.prompts}: {d.prompt_file} holds {len(items)} prompt(s)")
    items = items[:d.prompts] if d.prompts else items
    texts = [x[0] if len(x) == 1 and isinstance(x[0], str) else None for x in items]
    ids = []
    for text, item in zip(texts, items):
        if text is None:  # an {"ids": [...]} record
            ids.append(list(item))
            continue
        theirs = server_prompt_ids(client, opts.url, model, text, opts.timeout_s)
        ours = list(tokenizer.encode(text)) if tokenizer is not None else None
        if ours is not None and theirs is not None and ours != theirs:
            raise ValueError(f"{opts.url} tokenizes the prompt otherwise than --model {d.model} "
                             f"({len(theirs)} vs {len(ours)} tokens): give --model the served model's artifact")
        ids.append(ours if ours is not None else theirs)
    first = next((x for x in ids if x), None)
    takes = first is not None and takes_token_ids(client, opts.url, model, first, opts.timeout_s)
    prompts = [x if takes and x is not None else t for x, t in zip(ids, texts)]
    if any(p is None for p in prompts):
        raise ValueError(f"{opts.url} takes no token-id prompts, and {d.prompt_file} gives prompts as ids")
    formats = sorted({"ids" if isinstance(p, list) else "text" for p in prompts})
    return prompts, ",".join(formats)


def _decode_once(client, opts: RemoteDecodeOptions, model: str, prompts: list, tokenizer) -> dict:
    """One pass over the prompt set against the server: a decode record with the keys of the in-process suite's
    (``suites.decode.run_once``), summed over prompts."""
    d = opts.decode
    tot = dict(prompt_tokens=0, completion_tokens=0, ttft_s=0.0, decode_s=0.0)
    drafted = accepted = 0
    reported, tokens, finish, itl, cached, sources, short = True, [], [], [], [], set(), False
    for prompt in prompts:
        r = stream_completion(client, opts.url, model, prompt, d.max_new_tokens, opts.timeout_s,
                              ignore_eos=d.ignore_eos)
        if not r["times"]:
            raise RuntimeError(f"{opts.url}: the completion brought no token")
        n = r["n"]
        prompt_n = r["prompt_n"] if r["prompt_n"] is not None else (len(prompt) if isinstance(prompt, list) else None)
        tot["prompt_tokens"] = None if prompt_n is None or tot["prompt_tokens"] is None \
            else tot["prompt_tokens"] + prompt_n
        tot["completion_tokens"] += n
        tot["ttft_s"] += r["times"][0] - r["submitted"]
        tot["decode_s"] += r["times"][-1] - r["times"][0]
        t = r["timings"]
        if isinstance(t.get("draft_n"), int) and isinstance(t.get("draft_n_accepted"), int):
            drafted += t["draft_n"]
            accepted += t["draft_n_accepted"]
        else:
            reported = False
        toks, source = generated_tokens(r, tokenizer)
        sources.add(source)
        tokens += toks
        finish.append(r["finish_reason"] or "-")
        itl += itl_samples(r["times"])
        cached.append(r["cached_n"])
        short |= n < d.max_new_tokens and r["finish_reason"] != "length"
    decoded = tot["completion_tokens"] - len(prompts)
    # rounds: one token a round where the server says it drafted nothing; unknown where it drafted or does not say
    rounds = decoded if reported and drafted == 0 else None
    return {
        "prompts": len(prompts), "prompt_tokens": tot["prompt_tokens"], "completion_tokens": tot["completion_tokens"],
        "prefill_s": tot["ttft_s"], "decode_s": tot["decode_s"], "ttft_ms": tot["ttft_s"] * 1e3 / len(prompts),
        "prefill_tok_s": tot["prompt_tokens"] / tot["ttft_s"] if tot["prompt_tokens"] and tot["ttft_s"] else None,
        "decode_tok_s": decoded / tot["decode_s"] if decoded > 0 and tot["decode_s"] else None,
        "device_ms_per_round": None, "rounds": rounds,
        "drafted_tokens": drafted if reported else None, "accepted_tokens": accepted if reported else None,
        "accepted_per_position_counts": [], "draft_ms_per_round": None, "verify_ms_per_round": None,
        "target_forwards": rounds, "tokens_sha256": tokens_sha256(tokens),
        "finish_reason": finish[0] if len(set(finish)) == 1 else ",".join(finish),
        "itl_ms_p50": percentile(itl, 50), "itl_ms_p90": percentile(itl, 90), "itl_ms_p99": percentile(itl, 99),
        "cached_prompt_tokens": None if None in cached else sum(cached),
        "tokens_from": sources.pop() if len(sources) == 1 else ",".join(sorted(sources)), "ended_early": short,
    }


def run_decode_url(opts: RemoteDecodeOptions, progress=None, tokenizer=None, client=None) -> dict:
    """The decode suite against a server; returns the result document. ``tokenizer``: ``--model``'s (prompts
    tokenized by it, checked against the server's; generated text tokenized by it where the server streams no
    ids); loaded from ``opts.decode.model`` when given and None. ``client``: the httpx.Client to send with
    (default: a new one)."""
    httpx = httpx_module()
    if tokenizer is None and opts.decode.model is not None:
        from ..engine.artifact.loader import load_source

        loaded = load_source(opts.decode.model)
        tokenizer, tok_info = loaded.tokenizer, _tokenizer_info(loaded.info)
    else:
        tok_info = None
    with server_errors(opts.url), (client or httpx.Client()) as client:
        return _run_decode_url(client, opts, progress, tokenizer, tok_info)


def _run_decode_url(client, opts: RemoteDecodeOptions, progress, tokenizer, tok_info) -> dict:
    from .decode import AUTO_MAX_REPEATS, summarize, timed_repeats

    d = opts.decode
    settings = server_settings(client, opts.url, opts.served_model)
    model = settings["served_model"]
    prompts, how = _decode_prompts(client, opts, model, tokenizer)
    auto = d.repeats == "auto"
    most = AUTO_MAX_REPEATS if auto else d.repeats
    total = d.warmup + most
    for i in range(d.warmup):  # the whole length, as on a GPU: a server compiles and grows buffers per length
        _decode_once(client, opts, model, prompts[:1], tokenizer)
        if progress:
            progress(i + 1, total, "warm-up")
    records, stopped = timed_repeats(lambda: _decode_once(client, opts, model, prompts, tokenizer), d, progress)
    summary = summarize(records, weight_bytes=None, copy_bw=None, peak=None)
    summary["repeats_stopped_by"] = stopped
    for key in ("itl_ms_p50", "itl_ms_p99"):
        summary[key] = median([r[key] for r in records])
    config = recorded_config(d)
    config.update(server_config(settings))
    config.update(seed=None, url=opts.url, served_model=model, temperature=0.0, prompt_format=how,
                  tokens_from=records[-1]["tokens_from"],
                  ignore_eos_honoured=not any(r["ended_early"] for r in records) if d.ignore_eos else None)
    config["label"] = d.label or default_label(opts.url)
    return make_result("decode", label=config["label"], config=config, records=records, summary=summary,
                       model={"url": opts.url, "served_model": model, "tokenizer": tok_info})


# ---- needle in a haystack ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class RemoteNiahOptions:
    """A niah run against ``url``: ``niah`` holds the cases (its ``model``: the tokenizer that builds them and the
    model whose stored oracles judge them, default the bundled one; its engine options stay at their defaults)."""

    url: str | None
    niah: object  # suites.niah.NiahOptions
    served_model: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_url(self.url, self.served_model)
        self.url = self.url.rstrip("/")
        if self.niah.engine_options != EngineOptions():
            raise ValueError(f"against --url {self.url} the server's own engine settings apply: give them to its "
                             f"`serve`")


def server_rows(tops: list[dict] | None, oracle: dict, tokenizer) -> list[dict] | None:
    """Per generated step, ``{token id: log-prob}`` of the oracle's top-k ids found in the server's top
    log-probabilities there (keyed by token text, or vLLM's ``token_id:N``); an id whose text another of the step's
    top-k ids shares is left out. ``suites.niah.path_kl`` reads these rows; one lacking an id it needs gives no KL."""
    if not tops:
        return None
    rows = []
    for i, top in enumerate(tops):
        row, by_text = {}, {}
        for key, lp in (top or {}).items():
            m = re.fullmatch(r"token_id:(\d+)", str(key))
            if m:
                row[int(m[1])] = float(lp)
            else:
                by_text[key] = float(lp)
        wanted = [int(t) for t in oracle["topk_ids"][i]] if i < len(oracle["topk_ids"]) else []
        texts = {t: tokenizer.decode([t]) for t in wanted}
        for t, text in texts.items():
            if t not in row and text in by_text and list(texts.values()).count(text) == 1:
                row[t] = by_text[text]
        rows.append(row)
    return rows


def run_niah_url(opts: RemoteNiahOptions, progress=None, client=None) -> dict:
    """The NIAH suite against a server; returns the result document. ``client``: the httpx.Client to send with
    (default: a new one)."""
    from ..engine.artifact.loader import load_source

    httpx = httpx_module()
    if progress:
        progress(0, None, "loading the tokenizer")
    loaded = load_source(opts.niah.model)
    with server_errors(opts.url), (client or httpx.Client()) as client:
        return _run_niah_url(client, opts, loaded, progress)


def _run_niah_url(client, opts: RemoteNiahOptions, loaded, progress) -> dict:
    from .needle import needle_text, question_text
    from .niah import NEEDLE_PLACEMENT, _load_oracles, cases, judge, retrieved, summarize

    n_opts, tok = opts.niah, loaded.tokenizer
    settings = server_settings(client, opts.url, opts.served_model)
    model = settings["served_model"]
    top = max(n_opts.ctxs)
    if settings["max_context"] is not None and settings["max_context"] < top:
        raise ValueError(f"{opts.url} serves contexts up to {settings['max_context']} tokens: --ctx {top} does not "
                         f"fit")
    all_cases = cases(tok, n_opts)
    first = all_cases[0]
    probe = needle_text(first["key"], first["value"]) + question_text(first["key"])
    ours, theirs = list(tok.encode(probe)), server_prompt_ids(client, opts.url, model, probe, opts.timeout_s)
    if theirs is not None and theirs != ours:
        raise ValueError(f"{opts.url} tokenizes otherwise than --model {n_opts.model or '(the bundled model)'}: the "
                         f"cases are built with its tokenizer; give --model the served model's artifact")
    ids_ok = takes_token_ids(client, opts.url, model, ours, opts.timeout_s)
    oracles = _load_oracles(n_opts, loaded.info)
    lp_ok = bool(oracles) and gives_logprobs(client, opts.url, model, ours if ids_ok else probe, opts.timeout_s)
    unavailable = None if ids_ok else (f"{opts.url} takes no token-id prompts: the cases went as text, "
                                       f"re-tokenized by the server")
    total = sum(len(c["prompt_ids"]) for c in all_cases)
    records, before, t0, sources = [], 0, time.perf_counter(), set()
    for n, case in enumerate(all_cases, 1):
        if progress:
            progress(before, total, f"prompt tokens, case {n}/{len(all_cases)} {case['case']}")
        oracle = oracles.get(case["case"])
        prompt = case["prompt_ids"] if ids_ok else tok.decode(case["prompt_ids"])
        r = stream_completion(client, opts.url, model, prompt, n_opts.answer_tokens, opts.timeout_s,
                              logprobs=SERVER_TOP_LOGPROBS if oracle is not None and lp_ok else None)
        before += len(case["prompt_ids"])
        toks, source = generated_tokens(r, tok)
        sources.add(source)
        ttft = (r["times"][0] if r["times"] else r["finished"]) - r["submitted"]
        prompt_n = r["prompt_n"] if r["prompt_n"] is not None else (len(prompt) if ids_ok else None)
        rec = {k: case[k] for k in ("case", "ctx", "depth", "key", "value")}
        rec.update(prompt_tokens=len(case["prompt_ids"]), answer=r["text"], tokens=toks,
                   retrieved=retrieved(r["text"], case["value"]), seconds=r["finished"] - r["submitted"],
                   ttft_ms=ttft * 1e3, prefill_tok_s=prompt_n / ttft if prompt_n and ttft > 0 else None,
                   server_prompt_tokens=r["prompt_n"], finish_reason=r["finish_reason"])
        if oracle is not None and unavailable is None and source != "server":
            unavailable = f"{opts.url} returns no token ids: the generated tokens cannot be compared exactly"
        if oracle is None or unavailable is not None:
            records.append(judge(rec, case, None, n_opts.near_tie))
            continue
        rows = server_rows(r["top_logprobs"], oracle, tok)
        try:
            records.append(judge(rec, case, oracle, n_opts.near_tie, rows))
        except KeyError:  # an oracle top-k id the server's list lacks: no KL, rather than one over fewer ids
            records.append(judge(rec, case, oracle, n_opts.near_tie, None))
    summary = summarize(records, n_opts.ctxs, time.perf_counter() - t0)
    if unavailable is not None and oracles:
        summary["oracle_unavailable"] = unavailable
    config = {k: v for k, v in dataclasses.asdict(n_opts).items() if k != "engine_options"}
    config.update(server_config(settings))
    config.update(url=opts.url, served_model=model, temperature=0.0, needle_placement=NEEDLE_PLACEMENT,
                  prompt_format="ids" if ids_ok else "text",
                  tokens_from=sources.pop() if len(sources) == 1 else ",".join(sorted(sources)),
                  server_logprobs=lp_ok if oracles else None)
    config["label"] = n_opts.label or default_label(opts.url, "-niah")
    model_doc = {**loaded.info, "url": opts.url, "served_model": model}
    return make_result("niah", label=config["label"], config=config, records=records, summary=summary,
                       model=model_doc)
