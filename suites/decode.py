"""The decode suite: the reference short-code test (a fixed code prompt, greedy, long completion).

Measures prefill and decode speed, TTFT, device time per round, speculative acceptance, memory and the
fraction of the device's copy bandwidth the weight reads achieve, for our engine or the transformers
peer (``engine="hf"``), and writes one result document.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..reports.schema import make_result
from .common import DEFAULT_PROMPT, copy_bandwidth, median, peak_memory_bytes, reset_peak_memory, tokens_sha256


@dataclass(slots=True)
class DecodeOptions:
    """Everything a decode run depends on (recorded as the result's ``config``)."""

    model: str | None = None
    engine: str = "ours"
    synthetic: bool = False
    quant: str = "mixed"
    device: str = "auto"
    dtype: str = "auto"
    kv_dtype: str = "int8"
    max_context: int | None = None
    prefill_chunk: int = 512
    runtime: str = "v3"
    spec: str = "none"
    draft_tokens: int | None = None
    rollback: str = "recompute"
    lm_head_draft: int = 0
    prompt_file: str = str(DEFAULT_PROMPT)
    max_new_tokens: int = 4096
    ignore_eos: bool = True
    repeats: int = 3
    warmup: int = 1
    label: str | None = None
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.engine not in ("ours", "hf"):
            raise ValueError(f"engine must be 'ours' or 'hf', got {self.engine!r}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.max_new_tokens < 2:
            raise ValueError(f"max-new-tokens must be >= 2 to measure decode speed, got {self.max_new_tokens}")
        if not Path(self.prompt_file).is_file():
            raise ValueError(f"prompt file not found: {self.prompt_file}")
        if self.engine == "hf" and self.spec != "none":
            raise ValueError("--engine hf runs plain greedy decoding: use --spec none")

    def default_label(self) -> str:
        if self.engine == "hf":
            return "hf-peer"
        k = f"-k{self.draft_tokens}" if self.spec != "none" and self.draft_tokens else ""
        return f"{self.runtime}-{self.spec}{k}"


def _spec_summary(rec: dict) -> dict:
    rounds, drafted, accepted = rec["rounds"], rec["drafted_tokens"], rec["accepted_tokens"]
    per_pos = rec.get("accepted_per_position_counts") or []
    return {
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_round": 1 + accepted / rounds if rounds else None,
        "accepted_per_position": [c / rounds for c in per_pos] if rounds else [],
    }


def run_once(engine, prompt_ids: list[int], opts: DecodeOptions) -> dict:
    """One measured generation with our engine: a decode record."""
    res = engine.generate(prompt_ids, max_new_tokens=opts.max_new_tokens, ignore_eos=opts.ignore_eos)
    n = res.completion_tokens
    spec = res.spec
    rounds = spec.get("rounds", max(n - 1, 0))
    return {
        "prompt_tokens": res.prompt_tokens, "completion_tokens": n,
        "prefill_s": res.prefill_s, "decode_s": res.decode_s, "ttft_ms": res.ttft_s * 1e3,
        "prefill_tok_s": res.prompt_tokens / res.prefill_s if res.prefill_s else None,
        "decode_tok_s": (n - 1) / res.decode_s if n > 1 and res.decode_s else None,
        "device_ms_per_round": res.device_decode_ms / rounds if rounds else None,
        "rounds": rounds, "drafted_tokens": spec.get("drafted_tokens", 0),
        "accepted_tokens": spec.get("accepted_tokens", 0),
        "accepted_per_position_counts": spec.get("accepted_per_position", []),
        "draft_ms_per_round": spec.get("draft_ms", 0.0) / rounds if rounds and "draft_ms" in spec else None,
        "verify_ms_per_round": spec.get("verify_ms", 0.0) / rounds if rounds and "verify_ms" in spec else None,
        "target_forwards": spec.get("target_forwards", rounds),
        "tokens_sha256": tokens_sha256(res.tokens), "finish_reason": res.finish_reason,
    }


def summarize(records: list[dict], *, weight_bytes: int | None, copy_bw: float | None, peak: int) -> dict:
    last = records[-1]
    timing = ("prefill_tok_s", "decode_tok_s", "ttft_ms", "device_ms_per_round", "draft_ms_per_round",
              "verify_ms_per_round")
    summary = {k: median([r[k] for r in records]) for k in timing}
    summary.update({k: last[k] for k in ("prompt_tokens", "completion_tokens", "tokens_sha256", "rounds",
                                         "drafted_tokens", "accepted_tokens")})
    summary.update(_spec_summary(last))
    summary["deterministic"] = len({r["tokens_sha256"] for r in records}) == 1
    summary["peak_memory_bytes"] = peak
    summary["weight_bytes_per_step"] = weight_bytes
    summary["copy_bandwidth_gbps"] = copy_bw / 1e9 if copy_bw else None
    forwards_per_s = median([r["target_forwards"] / r["decode_s"] for r in records if r["decode_s"]])
    if weight_bytes and copy_bw and forwards_per_s:
        summary["achieved_gbps"] = weight_bytes * forwards_per_s / 1e9
        summary["roofline_fraction"] = weight_bytes * forwards_per_s / copy_bw
    else:
        summary["achieved_gbps"] = summary["roofline_fraction"] = None
    summary["samples"] = {k: [r[k] for r in records] for k in ("decode_tok_s", "prefill_tok_s", "ttft_ms",
                                                              "device_ms_per_round")}
    return summary


def run_decode(opts: DecodeOptions, progress=None) -> dict:
    """Run the decode suite; returns the result document. ``progress(done, total, what)`` reports repeats."""
    if opts.engine == "hf":
        from .hf_peer import HFPeer

        runner = HFPeer.load(opts)
    else:
        from ..engine.runtime import Engine

        runner = Engine.load(opts.model, synthetic=opts.synthetic, quant=opts.quant, seed=opts.seed,
                             device=opts.device, dtype=opts.dtype, kv_dtype=opts.kv_dtype,
                             max_context=opts.max_context, prefill_chunk=opts.prefill_chunk, runtime=opts.runtime,
                             spec=opts.spec, draft_tokens=opts.draft_tokens, rollback=opts.rollback,
                             lm_head_draft=opts.lm_head_draft)
        opts.draft_tokens = runner.options.draft_tokens
        opts.max_context = runner.options.max_context
    prompt = runner.tokenizer.encode(Path(opts.prompt_file).read_text())
    total = opts.warmup + opts.repeats
    warm = DecodeOptions(**{**asdict(opts), "max_new_tokens": min(opts.max_new_tokens, 64)})
    for i in range(opts.warmup):
        run_once(runner, prompt, warm)
        if progress:
            progress(i + 1, total, "warm-up")
    reset_peak_memory(runner.device)
    records = []
    for i in range(opts.repeats):
        rec = run_once(runner, prompt, opts)
        rec["repeat"] = i
        records.append(rec)
        if progress:
            progress(opts.warmup + i + 1, total, f"repeat {i + 1}")
    peak = peak_memory_bytes(runner.device)
    bw = copy_bandwidth(runner.device)
    summary = summarize(records, weight_bytes=runner.weight_bytes_per_step, copy_bw=bw, peak=peak)
    config = asdict(opts)
    config["label"] = opts.label or opts.default_label()
    config["device"] = str(runner.device)
    config["dtype"] = str(runner.dtype).replace("torch.", "")
    return make_result("decode", label=config["label"], config=config, records=records, summary=summary,
                       model=dict(runner.model_info))


def measure_time(fn, device) -> tuple[object, float]:
    """(fn(), wall seconds) with device synchronisation around the call."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t
