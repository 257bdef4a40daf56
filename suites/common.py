"""What every suite shares: measuring the device's copy bandwidth, peak memory, token hashes, statistics."""

from __future__ import annotations

import functools
import hashlib
import math
import resource
import statistics
import time
import warnings
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


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 10) -> float | None:
    """Dense matmul throughput in FLOP/s: an n x n x n product in ``dtype`` (n = 8,192 on CUDA, 1,024 on a CPU), the
    best of ``repeats`` timings after warm-ups - what torch's GEMM reaches on this device in this run, the compute
    roofline a prefill's model FLOP/s are set against (as :func:`copy_bandwidth` is a decode step's). It runs after
    the engine is built: on CUDA the allocator's unused cached blocks are released first and its three operands
    (3 n^2 values) after, and where they still do not fit the result is None (no MFU is reported, with a warning)
    rather than a failed run or a smaller product's other roofline."""
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 1024)
    if cuda:
        torch.cuda.empty_cache()
    a = b = c = None
    try:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):
            c = a @ b
        best = math.inf
        for _ in range(repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                c = a @ b
                end.record()
                torch.cuda.synchronize(device)
                best = min(best, start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                c = a @ b
                best = min(best, time.perf_counter() - t)
    except torch.OutOfMemoryError:
        warnings.warn(f"matmul peak: {n} x {n} operands in {dtype} do not fit beside the engine on {device}; "
                      "no MFU is reported", stacklevel=2)
        return None
    finally:
        a = b = c = None  # noqa: F841  (the operands freed before the cache is emptied)
        if cuda:
            torch.cuda.empty_cache()
    return 2 * n ** 3 / best


@functools.cache
def measured_matmul_peak(device: str, dtype: torch.dtype) -> float | None:
    """:func:`matmul_peak` once a process per device and dtype (a machine's property, as the copy bandwidth is: a
    decode grid's runs and a niah run share it)."""
    return matmul_peak(torch.device(device), dtype)


def forward_flops(cfg, tokens: int, past: int = 0, logits_rows: int = 1) -> int:
    """Model FLOPs of one forward of ``tokens`` new tokens after ``past`` cached ones (a prompt's prefill: past 0,
    the last row's logits), counted as the field counts them (2 per multiply-add):
    - every text layer's projections (its 2-D weights: q / k / v / o, GDN qkv / z / b / a / out, gate / up / down),
      per token, and the lm_head for ``logits_rows`` rows;
    - causal attention, Q K^T and P V over the keys each query sees (its own position and all before it);
    - the GDN recurrence: per token and value head, S^T k, the rank-1 delta update and q^T S (3 dk x dv
      multiply-adds; the chunked form's extra intra-chunk products are the kernel's choice, not the model's),
      and the depthwise causal conv;
    not norms, activations, gates or the embedding lookup (a few FLOPs a value: under 1 % at any 27B prompt)."""
    from ..engine.model.weights import expected_shapes

    if tokens < 0 or past < 0:
        raise ValueError(f"forward_flops: tokens and past are counts >= 0, got {tokens} and {past}")
    shapes = expected_shapes(cfg)
    params = sum(math.prod(s) for name, s in shapes.items()
                 if name.startswith("model.layers.") and len(s) == 2)
    flops = 2 * params * tokens + 2 * cfg.vocab_size * cfg.hidden_size * min(logits_rows, tokens)
    keys = tokens * past + tokens * (tokens + 1) // 2  # summed over the new queries: each sees past + its index + 1
    flops += len(cfg.full_layers) * 4 * cfg.num_attention_heads * cfg.head_dim * keys
    gdn = 3 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim \
        + cfg.conv_dim * cfg.linear_conv_kernel_dim
    flops += len(cfg.linear_layers) * 2 * gdn * tokens
    return flops


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