"""What every suite shares: measuring the device's copy bandwidth, peak memory, token hashes, statistics."""

from __future__ import annotations

import hashlib
import resource
import statistics
import time
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path

import numpy as np
import torch

from ..engine.jsonl import json_lines

DATA = Path(__file__).resolve().parent / "data"
DEFAULT_PROMPT = DATA / "short_code.py.txt"
CODE_TEXT = DATA / "haystack.py.txt"  # CPython standard-library code (HAYSTACK_LICENSE.md): NIAH's haystack, -p's text


def tokens_sha256(tokens) -> str:
    """SHA-256 of token ids as little-endian int32 bytes (docs/DESIGN.md, "Metrics")."""
    return hashlib.sha256(np.asarray(list(tokens), dtype="<i4").tobytes()).hexdigest()


def copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 10) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written (as the anchors do)."""
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    x.random_(0, 255)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            y.copy_(x)
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3 / repeats
    else:
        t = time.perf_counter()
        for _ in range(repeats):
            y.copy_(x)
        seconds = (time.perf_counter() - t) / repeats
    del x, y
    return 2 * nbytes / seconds


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's allocator statistics, or on a CPU the process's resident-set high-water mark
    (Linux: /proc/self/clear_refs; elsewhere the peak stays the whole process's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory allocated (CUDA), or the peak resident set size since :func:`reset_peak_memory` (CPU;
    the weights count, as they do on CUDA)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def median(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def percentile(values, q: float):
    vals = [v for v in values if v is not None]
    return float(np.percentile(vals, q)) if vals else None


def read_text(path: str | Path) -> str:
    """A prompt file's text (a leading byte-order mark, as some editors write, left out); a file that is not UTF-8
    is refused by name and byte offset."""
    try:
        return Path(path).read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def code_prompt(tokenizer, length: int) -> list[int]:
    """A prompt of exactly ``length`` tokens cut from the shipped code text (:data:`CODE_TEXT`, tokenized whole, its
    tokens repeated as often as the length needs): llama-bench's ``-p`` prompts, made of code instead of random
    tokens, so a model reads what it was trained on at any length."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"a prompt length is a positive number of tokens, got {length!r}")
    ids = tokenizer.encode(read_text(CODE_TEXT))
    if not ids:
        raise ValueError(f"{CODE_TEXT.name} encodes to no tokens")
    return (ids * -(-length // len(ids)))[:length]


def read_prompt_set(path: str | Path, tokenizer) -> list[dict]:
    """Prompts as ``{"id", "prompt_ids"}``: one per line of a .jsonl set (``{"id", "text"}`` or ``{"id", "ids"}``),
    or the whole text of any other file as one prompt."""
    p = Path(path)
    if p.suffix != ".jsonl":
        return [{"id": p.stem, "prompt_ids": tokenizer.encode(read_text(p))}]
    out = []
    for n, rec in json_lines(read_text(p), str(path)):
        out.append({"id": str(rec.get("id", n)) if isinstance(rec, dict) else None,
                    "prompt_ids": _record_ids(rec, tokenizer, f"{path}:{n}")})
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def _record_ids(rec, tokenizer, where: str) -> list[int]:
    """A prompt-set record's token ids: its ``text`` (a string) encoded, or its ``ids`` (a list of integers) - one of
    the two, never both (they could disagree)."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record is a JSON object with 'text' or 'ids', got {type(rec).__name__}")
    has_text, has_ids = rec.get("text") is not None, rec.get("ids") is not None
    if has_text == has_ids:
        raise ValueError(f"{where}: a record has 'text' or 'ids' (one of them), " +
                         ("got both" if has_text else "got neither"))
    if has_text:
        if not isinstance(rec["text"], str):
            raise ValueError(f"{where}: 'text' must be a string, got {type(rec['text']).__name__}")
        ids = tokenizer.encode(rec["text"])
    else:
        ids = rec["ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{where}: 'ids' must be a list of integers")
    if not ids:
        raise ValueError(f"{where}: the prompt is empty")
    return list(ids)


def flat_config(opts) -> dict:
    """A suite's options as one flat dict: every field of the suite's own, and every field of the engine options it
    holds (``engine_options``) beside them."""
    flat, config = asdict(opts), {}
    for f in fields(opts):
        if not f.metadata.get("record", True):  # bookkeeping of the suite, no part of the run
            continue
        if is_dataclass(getattr(opts, f.name)):
            config.update(flat[f.name])
        else:
            config[f.name] = flat[f.name]
    return config


def recorded_config(opts) -> dict:
    """A decode or concurrency run's options as its result document's ``config`` (:func:`flat_config`), ``quant``
    None when the weights are not ``--synthetic`` (the policy only builds synthetic weights; an artifact's own is
    ``model.quant_policy``)."""
    config = flat_config(opts)
    if not config.get("synthetic"):
        config["quant"] = None
    return config


def split_options(cls, kw: dict):
    """``cls(**suite keywords, engine_options=EngineOptions(**the rest))`` from one flat set of keywords."""
    from ..engine.runtime.options import EngineOptions

    own = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in kw.items() if k in own},
               engine_options=EngineOptions(**{k: v for k, v in kw.items() if k not in own}))