"""The decode suite: the reference short-code test (a fixed code prompt, greedy, long completion).

Measures prefill and decode speed, TTFT, device time per round, speculative acceptance, memory and the
fraction of the device's copy bandwidth the weight reads achieve, for our engine, the transformers peer
(``engine="hf"``) or llama.cpp on a GGUF export of the same weights (``engine="llamacpp"``, with its agreement with
our engine), and writes one result document.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine.runtime.options import DEFAULT_CONTEXT, SWITCHES, EngineOptions, switch_labels
from ..reports.schema import make_result
from ..reports.stats import median_ci
from .common import (
    CODE_TEXT,
    DEFAULT_PROMPT,
    code_prompt,
    copy_bandwidth,
    forward_flops,
    measured_matmul_peak,
    median,
    peak_memory_bytes,
    read_prompt_set,
    recorded_config,
    reset_peak_memory,
    split_options,
    tokens_sha256,
)

# --repeats auto (nvbench's noise stopping): at least AUTO_MIN_REPEATS timed repeats, then stop as soon as the 95%
# confidence interval of the median decode tok/s is within ±target of it, or the next repeat would end past the time
# budget, or at AUTO_MAX_REPEATS
AUTO_MIN_REPEATS, AUTO_MAX_REPEATS = 5, 50
AUTO_TARGET, AUTO_BUDGET_S = 0.02, 60.0
AUTO_METRIC = "decode_tok_s"


def relative_half_width(samples) -> float | None:
    """Half the width of the 95% confidence interval of the samples' median (:func:`median_ci`, order statistics),
    relative to the median; None where the samples cannot bound it (fewer than 6) or the median is not positive."""
    vals = [v for v in samples if v is not None]
    lo, hi = median_ci(vals)
    mid = median(vals)
    if not math.isfinite(lo) or not math.isfinite(hi) or not mid or mid <= 0:
        return None
    return (hi - lo) / 2 / mid


def auto_stop(samples: list, elapsed_s: float, target: float, budget_s: float) -> str | None:
    """Why ``--repeats auto`` stops after these samples of :data:`AUTO_METRIC` (``elapsed_s``: the timed repeats'
    seconds so far): "max", "target" (the CI half-width reached), "budget" (one more repeat of the mean length so far
    would end past it); None: run another."""
    n = len(samples)
    if n >= AUTO_MAX_REPEATS:
        return "max"
    if n < AUTO_MIN_REPEATS:
        return None
    width = relative_half_width(samples)
    if width is not None and width <= target:
        return "target"
    if elapsed_s * (n + 1) / n > budget_s:
        return "budget"
    return None


# the switches a plain run has as well as a speculative one (applies "v3"; the others change drafting only): a
# speculative run's plain partner is the plain run with the same values (DecodeOptions.workload, with_baselines)
SHARED_SWITCHES = tuple(name for name, sw in SWITCHES.items() if sw.applies == "v3")


@dataclass(slots=True)
class DecodeOptions:
    """Everything a decode run depends on (recorded flat as the result's ``config``: the suite's own fields and
    ``engine_options``'). ``engine_options`` is what our engine is bound to; the transformers peer takes its device
    and dtype."""

    model: str | None = None
    engine: str = "ours"
    synthetic: bool = False
    quant: str = "mixed"
    engine_options: EngineOptions = field(default_factory=EngineOptions)
    prompt_file: str = str(DEFAULT_PROMPT)
    prompts: int | None = None  # with a .jsonl prompt set: how many of its prompts (default all)
    prompt_length: int | None = None  # -p: one prompt of exactly this many tokens cut from the shipped code text
    #                                   (common.code_prompt) instead of prompt_file's
    images: tuple[str, ...] = ()  # images placed before each prompt (a model with a vision component)
    max_new_tokens: int = 4096
    ignore_eos: bool = True
    repeats: int | str = 3  # or "auto": repeat until the median decode tok/s is known well enough (auto_stop)
    repeats_target: float | None = None  # "auto": the relative 95% CI half-width to reach (default 2%)
    repeats_budget_s: float | None = None  # "auto": seconds of timed repeats at most (default 60)
    warmup: int = 1
    warmup_prompt: int | None = None  # the warm-ups' prompt: this many tokens cut from the shipped code text (None:
    #                                   the timed runs' first prompt). It warms what depends on the engine's capacity
    #                                   (decode graphs, kernels built for it) without prefilling a long prompt twice;
    #                                   what only the long prompt reaches (its later prefill chunks) stays cold
    label: str | None = None
    seed: int = 0
    llamacpp_gguf: str | None = None  # --engine llamacpp: this GGUF export of the weights (checked) instead of a new one
    llamacpp_flash_attn: bool | None = None  # --engine llamacpp: its flash attention (None: on with CUDA, off on CPU)
    baseline: bool = field(default=False, metadata={"record": False})  # a plain run added for the speculative
    #                                                                      runs beside it (decode_runs)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.repeats == "auto":
            self.repeats_target = AUTO_TARGET if self.repeats_target is None else self.repeats_target
            self.repeats_budget_s = AUTO_BUDGET_S if self.repeats_budget_s is None else self.repeats_budget_s
            for name, value in (("repeats-target", self.repeats_target), ("repeats-budget-s", self.repeats_budget_s)):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                    raise ValueError(f"{name} must be a positive number, got {value!r}")
        elif isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1 or 'auto', got {self.repeats!r}")
        elif self.repeats_target is not None or self.repeats_budget_s is not None:
            raise ValueError("--repeats-target and --repeats-budget-s set when --repeats auto stops: give --repeats auto")
        if self.engine != "ours" and self.engine_options.inject_delay_us:
            raise ValueError("--inject-delay-us delays our engine's steps: use --engine ours")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.warmup_prompt is not None:
            if isinstance(self.warmup_prompt, bool) or not isinstance(self.warmup_prompt, int) \
                    or self.warmup_prompt < 1:
                raise ValueError(f"--warmup-prompt takes a positive prompt length in tokens, got "
                                 f"{self.warmup_prompt!r}")
            if self.warmup == 0:
                raise ValueError("--warmup-prompt sets the warm-ups' prompt: give it with --warmup 1 or more")
            if self.engine_options.replay_acceptance is not None:
                raise ValueError("--warmup-prompt with --replay-acceptance: a warm-up on another prompt has no plain "
                                 "tokens to replay; warm up on the timed prompt (leave --warmup-prompt out)")
            if self.images:
                raise ValueError("--warmup-prompt cuts a text prompt: give it without --image")
        if self.max_new_tokens < 2:
            raise ValueError(f"max-new-tokens must be >= 2 to measure decode speed, got {self.max_new_tokens}")
        if not Path(self.prompt_file).is_file():
            raise ValueError(f"prompt file not found: {self.prompt_file}")
        if self.prompt_length is not None:
            if isinstance(self.prompt_length, bool) or not isinstance(self.prompt_length, int) \
                    or self.prompt_length < 1:
                raise ValueError(f"-p takes positive prompt lengths in tokens, got {self.prompt_length!r}")
            if self.prompts is not None or self.images or Path(self.prompt_file) not in (Path(DEFAULT_PROMPT),
                                                                                          Path(CODE_TEXT)):
                raise ValueError("-p cuts its prompts from the shipped code text: give it without --prompt-file, "
                                 "--prompts or --image")
            self.prompt_file = str(CODE_TEXT)  # what the prompt is cut from (recorded)
        if self.prompts is not None and (self.prompts < 1 or Path(self.prompt_file).suffix != ".jsonl"):
            raise ValueError(f"--prompts takes a positive count of a .jsonl prompt set's prompts, got {self.prompts} "
                             f"for {self.prompt_file}")
        if self.llamacpp_gguf is not None and not Path(self.llamacpp_gguf).is_file():
            raise ValueError(f"--llamacpp-gguf: no such file: {self.llamacpp_gguf}")
        if self.engine != "ours" and self.engine_options.spec != "none":
            raise ValueError(f"--engine {self.engine} runs plain greedy decoding: use --spec none")
        self.images = tuple(self.images)
        if self.images and self.engine != "ours":
            raise ValueError("--image runs with our engine only: use --engine ours")

    @classmethod
    def make(cls, **kw) -> "DecodeOptions":
        """Options from one flat set of keywords: the suite's fields, the rest :class:`EngineOptions`'."""
        return split_options(cls, kw)

    def default_label(self) -> str:
        return self._label() + (f"-p{self.prompt_length}" if self.prompt_length else "")

    def _label(self) -> str:
        if self.engine != "ours":
            return f"{self.engine}-peer"
        eo = self.engine_options
        spec = eo.spec != "none"
        k = f"-k{eo.draft_tokens}" if spec and eo.draft_tokens else ""
        head = f"-lmh{eo.lm_head_draft}" if spec and eo.lm_head_draft else ""
        off = switch_labels(eo)
        replay = "-replay" if spec and eo.replay_acceptance is not None else ""
        tp = f"-tp{eo.tensor_parallel}" if eo.tensor_parallel > 1 else ""
        return f"{eo.runtime}-{eo.spec}{k}{head}{off}{replay}{tp}"

    def load(self) -> tuple:
        """The weights, prompts and lengths a run decodes (whatever engine, runtime and switches decode them): what
        a peer and our plain run it is set against share."""
        return (model_key(self), self.prompt_file, self.prompts, self.prompt_length, tuple(self.images),
                self.max_new_tokens, self.ignore_eos)

    def workload(self) -> tuple:
        """What a speculative run and its plain partner share: :meth:`load`, the runtime and its numerics, and the
        switches plain runs have too (SHARED_SWITCHES)."""
        eo = self.engine_options
        return (self.load(), eo.runtime, eo.dtype, eo.kv_dtype, eo.max_context, eo.kv_capacity, eo.prefill_chunk,
                tuple(getattr(eo, name) for name in SHARED_SWITCHES))


def _spec_summary(rec: dict) -> dict:
    rounds, drafted, accepted = rec["rounds"], rec["drafted_tokens"], rec["accepted_tokens"]
    per_pos = rec.get("accepted_per_position_counts") or []
    return {
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_round": 1 + accepted / rounds if rounds else None,
        "accepted_per_position": [c / rounds for c in per_pos] if rounds else [],
    }


def run_once(engine, prompts: list[list[int]], opts: DecodeOptions, references=None, tokens_out=None) -> dict:
    """One measured pass over the prompt set (usually one prompt): a decode record, summed over prompts.

    Rates are totals over totals (all completion tokens after the first of each prompt / all decode time);
    ``tokens_sha256`` hashes every prompt's tokens in order. ``references``: per prompt, the plain run's tokens
    (replayed acceptance); ``tokens_out``, a list, receives each prompt's tokens."""
    tot = dict(prompt_tokens=0, completion_tokens=0, prefill_s=0.0, decode_s=0.0, ttft_s=0.0, device_ms=0.0,
               rounds=0, drafted_tokens=0, accepted_tokens=0, draft_ms=0.0, verify_ms=0.0, target_forwards=0,
               prefill_flops=0)
    cfg = getattr(getattr(engine, "loaded", None), "config", None)  # (a server's runner: none, no FLOPs)
    per_pos, tokens, finish, vision = [], [], [], []
    if tokens_out is not None:
        tokens_out.clear()
    for i, ids in enumerate(prompts):
        ids, media = ids if isinstance(ids, tuple) else (ids, None)  # (ids, MediaPrompt) with --image
        ref = {"reference": references[i]} if references is not None else {}
        res = engine.generate(ids, max_new_tokens=opts.max_new_tokens, ignore_eos=opts.ignore_eos,
                              **fresh_media(engine, media), **ref)
        if tokens_out is not None:
            tokens_out.append(list(res.tokens))
        vision += [res.vision] if res.vision else []
        spec, n = res.spec, res.completion_tokens
        rounds = spec.get("rounds", max(n - 1, 0))
        for key, value in (("prompt_tokens", res.prompt_tokens), ("completion_tokens", n),
                           ("prefill_s", res.prefill_s), ("decode_s", res.decode_s), ("ttft_s", res.ttft_s),
                           ("device_ms", res.device_decode_ms), ("rounds", rounds),
                           ("drafted_tokens", spec.get("drafted_tokens", 0)),
                           ("accepted_tokens", spec.get("accepted_tokens", 0)), ("draft_ms", spec.get("draft_ms", 0.0)),
                           ("verify_ms", spec.get("verify_ms", 0.0)),
                           ("target_forwards", spec.get("target_forwards", rounds)),
                           ("prefill_flops", forward_flops(cfg, res.prompt_tokens) if cfg is not None else 0)):
            tot[key] += value
        counts = spec.get("accepted_per_position", [])
        per_pos = [a + b for a, b in zip(per_pos, counts)] if per_pos else list(counts)
        tokens += res.tokens
        finish.append(res.finish_reason)
    rounds, spec_run = tot["rounds"], opts.engine_options.spec != "none"
    decoded = tot["completion_tokens"] - len(prompts)
    return {
        "prompts": len(prompts), "prompt_tokens": tot["prompt_tokens"], "completion_tokens": tot["completion_tokens"],
        **({"vision_encode_ms": sum(v["encode_ms"] for v in vision),
            "vision_tokens": sum(v["tokens"] for v in vision)} if vision else {}),
        "prefill_s": tot["prefill_s"], "decode_s": tot["decode_s"], "ttft_ms": tot["ttft_s"] * 1e3 / len(prompts),
        "prefill_tok_s": tot["prompt_tokens"] / tot["prefill_s"] if tot["prefill_s"] else None,
        "prefill_tflops": tot["prefill_flops"] / tot["prefill_s"] / 1e12 if tot["prefill_flops"] and tot["prefill_s"]
        else None,
        "decode_tok_s": decoded / tot["decode_s"] if decoded > 0 and tot["decode_s"] else None,
        "device_ms_per_round": tot["device_ms"] / rounds if rounds else None,
        "rounds": rounds, "drafted_tokens": tot["drafted_tokens"], "accepted_tokens": tot["accepted_tokens"],
        "accepted_per_position_counts": per_pos,
        "draft_ms_per_round": tot["draft_ms"] / rounds if rounds and spec_run else None,
        "verify_ms_per_round": tot["verify_ms"] / rounds if rounds and spec_run else None,
        "target_forwards": tot["target_forwards"], "tokens_sha256": tokens_sha256(tokens),
        "finish_reason": finish[0] if len(set(finish)) == 1 else ",".join(finish),
    }


def with_images(engine, prompts: list[list[int]], paths: tuple[str, ...]) -> list[tuple[list[int], object]]:
    """Each prompt as (ids, MediaPrompt) with the images placed before its text."""
    from ..engine.media.prompt import placeholder

    budget = engine.media_budget()  # all the prompt's images together
    items = [engine.load_media("image", p, budget) for p in paths]
    head = engine.tokenizer.encode("".join(placeholder("image") for _ in items))
    return [engine.media_prompt(head + ids, items) for ids in prompts]


def fresh_media(engine, media) -> dict:
    """``generate`` arguments for a prompt's media, emptied of encoder outputs (the media cache too) so every
    measured generation includes the vision encode."""
    if media is None:
        return {}
    engine.media_cache.clear()
    return {"media": dataclasses.replace(media, embeds=None, stats={})}


def load_prompts(path: str, tokenizer, limit: int | None = None) -> list[list[int]]:
    """Token ids of the prompt file (see :func:`read_prompt_set`), the first ``limit`` of them."""
    ids = [rec["prompt_ids"] for rec in read_prompt_set(path, tokenizer)]
    if limit and limit > len(ids):
        raise ValueError(f"--prompts {limit}: {path} holds {len(ids)} prompt(s)")
    return ids[:limit] if limit else ids


def summarize(records: list[dict], *, weight_bytes: int | None, copy_bw: float | None, peak: int,
              matmul_flops: float | None = None) -> dict:
    last = records[-1]
    timing = ("prefill_tok_s", "prefill_tflops", "decode_tok_s", "ttft_ms", "device_ms_per_round",
              "draft_ms_per_round", "verify_ms_per_round")
    summary = {k: median([r.get(k) for r in records]) for k in timing}  # (a server's records: no FLOPs)
    summary.update({k: last[k] for k in ("prompt_tokens", "completion_tokens", "tokens_sha256", "rounds",
                                         "drafted_tokens", "accepted_tokens")})
    summary["prompts"] = last.get("prompts", 1)
    if "vision_encode_ms" in last:  # --image: the vision tower's time per pass, and the merged tokens it made
        summary["vision_encode_ms"] = median([r["vision_encode_ms"] for r in records])
        summary["vision_tokens"] = last["vision_tokens"]
    summary.update(_spec_summary(last))
    summary["deterministic"] = len({r["tokens_sha256"] for r in records}) == 1
    summary["peak_memory_bytes"] = peak
    summary["weight_bytes_per_step"] = weight_bytes
    summary["copy_bandwidth_gbps"] = copy_bw / 1e9 if copy_bw else None
    forwards_per_s = median([r["target_forwards"] / r["decode_s"] for r in records
                             if r["decode_s"] and r["target_forwards"] is not None])  # (None: a server's, unknown)
    if weight_bytes and copy_bw and forwards_per_s:
        summary["achieved_gbps"] = weight_bytes * forwards_per_s / 1e9
        summary["roofline_fraction"] = weight_bytes * forwards_per_s / copy_bw
    else:
        summary["achieved_gbps"] = summary["roofline_fraction"] = None
    # the prefill against the compute roofline: model FLOP/s over the dense matmul throughput measured in this run
    summary["matmul_tflops"] = matmul_flops / 1e12 if matmul_flops else None
    summary["prefill_compute_fraction"] = summary["prefill_tflops"] * 1e12 / matmul_flops \
        if summary["prefill_tflops"] and matmul_flops else None
    summary["samples"] = {k: [r[k] for r in records] for k in ("decode_tok_s", "prefill_tok_s", "ttft_ms",
                                                              "device_ms_per_round")}
    if "vision_encode_ms" in last:
        summary["samples"]["vision_encode_ms"] = [r["vision_encode_ms"] for r in records]
    # how well the repeats pin the gated median down: the 95% CI of the median decode tok/s (order statistics; None
    # below 6 repeats) and its half-width relative to the median (what --repeats auto stops on)
    summary["repeats_run"] = len(records)
    lo, hi = median_ci(summary["samples"][AUTO_METRIC])
    summary[f"{AUTO_METRIC}_ci95"] = [lo, hi] if math.isfinite(lo) and math.isfinite(hi) else None
    summary[f"{AUTO_METRIC}_ci_half_width"] = relative_half_width(summary["samples"][AUTO_METRIC])
    return summary


SPECS = ("none", "mtp", "dflash", "dflash2")
ENGINES = ("ours", "hf", "llamacpp")  # our engine, the transformers peer, llama.cpp on the GGUF export


def parse_spec(item: str, draft_tokens: int | None) -> tuple[str, int | None]:
    """``NAME`` or ``NAME:K`` -> (spec, K); K defaults to ``draft_tokens``, then to the drafter's default."""
    from ..engine.runtime.options import DEFAULT_DRAFT

    name, colon, k = item.strip().partition(":")
    if name not in SPECS:
        raise ValueError(f"--spec: unknown drafter {name!r} (one of {', '.join(SPECS)}, optionally NAME:K)")
    if name == "none":
        if colon:
            raise ValueError("--spec none takes no :K")
        return name, None
    if colon:
        if not k.isdigit() or int(k) < 1:
            raise ValueError(f"--spec {item}: K must be a positive integer")
        return name, int(k)
    return name, draft_tokens if draft_tokens is not None else DEFAULT_DRAFT[name]


def decode_runs(base: dict, *, engines=("ours",), specs=("none",), runtimes=("v3",), rollbacks=("recompute",),
                lm_heads=(0,), switches: dict[str, tuple[bool, ...]] | None = None, draft_tokens: int | None = None,
                label: str | None = None, baseline: bool = True, replay: str | None = None,
                prompt_lengths: tuple[int, ...] = (), prefill_chunks: tuple[int, ...] = ()) -> list[DecodeOptions]:
    """The grid of decode runs a command line asks for: every runtime x spec x rollback x lm-head-draft size of
    our engine (the last two only where there is a drafter) x the values of each engine switch (``switches``,
    {name of :data:`SWITCHES`: values}; each only on the runs it applies to, the others keep its default), and the
    transformers peer once (plain greedy). ``base``: the other keywords of :meth:`DecodeOptions.make`.
    ``replay``: replayed acceptance for every speculative run (``EngineOptions.replay_acceptance``).
    ``baseline``: each speculative run gets a plain run on the same workload (added where the grid has none,
    flagged ``baseline``); plain runs go first, so a speculative run can be set against its partner (and replay
    its tokens). ``prompt_lengths`` (``-p``): the whole grid once for each length, on a prompt of exactly that many
    tokens cut from the shipped code text, labelled ``-pN``, with a max-context that holds it when none is given.
    ``prefill_chunks`` (``--prefill-chunk A,B``, llama-bench's ``-ub`` grid): our runs once for each prompt-chunk
    size, labelled ``-cN`` when there are several; a peer (whose prefill does not chunk) once.
    Labels are unique: with several rollbacks each speculative label names its own, and ``label`` prefixes them all
    (an added baseline alone beside one run: ``LABEL-plain``)."""
    switches = switches or {}
    if draft_tokens is not None and all(parse_spec(x, None)[0] == "none" for x in specs):
        raise ValueError(f"-k {draft_tokens} is speculative decoding's drafts per round: give it with --spec mtp, "
                         f"dflash or dflash2, not --spec none")
    if base.get("llamacpp_gguf") and "llamacpp" not in engines:
        raise ValueError("--llamacpp-gguf is the llama.cpp peer's file: add --engine llamacpp")
    if base.get("llamacpp_flash_attn") is not None and "llamacpp" not in engines:
        raise ValueError("--llamacpp-flash-attn is the llama.cpp peer's switch: add --engine llamacpp")
    peers = set(engines) - {"ours"}
    if peers == set(engines) and any(parse_spec(x, None)[0] != "none" for x in specs):
        raise ValueError(f"--engine {','.join(engines)} runs plain greedy decoding: use --spec none (or add ours)")
    chunks = tuple(dict.fromkeys(prefill_chunks))
    if len(chunks) > 1 and "ours" not in engines:
        raise ValueError(f"--prefill-chunk {','.join(map(str, chunks))} compares our engine's prompt chunks: add "
                         "--engine ours (a peer's prefill does not chunk)")
    runs = []
    for one in [base] if not prompt_lengths else [_at_length(base, n) for n in dict.fromkeys(prompt_lengths)]:
        grid = []
        for engine, chunk in itertools.product(dict.fromkeys(engines), chunks or (None,)):
            one_c = one if chunk is None else {**one, "prefill_chunk": chunk}
            if engine != "ours":
                if chunk is None or chunk == chunks[0]:
                    grid.append(DecodeOptions.make(**one_c, engine=engine))
                continue
            for runtime in dict.fromkeys(runtimes):
                for item in dict.fromkeys(specs):
                    spec, k = parse_spec(item, draft_tokens)
                    names = [n for n in switches if SWITCHES[n].applies_to(runtime, spec)]
                    for rollback in dict.fromkeys(rollbacks if spec != "none" else rollbacks[:1]):
                        for head in dict.fromkeys(lm_heads if spec != "none" else (0,)):
                            for values in itertools.product(*(dict.fromkeys(switches[n]) for n in names)):
                                grid.append(DecodeOptions.make(**one_c, engine=engine, runtime=runtime, spec=spec,
                                                               draft_tokens=k, rollback=rollback, lm_head_draft=head,
                                                               replay_acceptance=replay if spec != "none" else None,
                                                               **dict(zip(names, values))))
        if not grid:
            raise ValueError("no decode run: give at least one engine, runtime and spec")
        runs += with_baselines(grid, one) if baseline else grid  # (a partner shares its run's chunk: workload)
    missing = [r.default_label() for r in runs if r.engine_options.replay_acceptance is not None
               and not _has_partner(r, runs)]
    if missing:
        raise ValueError(f"{', '.join(missing)}: replayed acceptance replays a plain run's tokens; drop --no-baseline")
    asked = [r for r in runs if not r.baseline]
    if len(asked) == 1:
        asked[0].label = label
        for r in runs:
            if r.baseline:
                r.label = f"{label}-plain" if label else None
        return runs
    for r in runs:
        spec_run = r.engine_options.spec != "none"
        name = r.default_label() + (f"-{r.engine_options.rollback}" if len(set(rollbacks)) > 1 and spec_run else "")
        name += f"-c{r.engine_options.prefill_chunk}" if len(chunks) > 1 and r.engine == "ours" else ""
        r.label = f"{label}-{name}" if label else name
    seen = [r.label for r in runs]
    if len(set(seen)) != len(seen):
        raise ValueError(f"two runs would share a label: {seen}")
    return runs


def _at_length(base: dict, length: int) -> dict:
    """``base`` for ``-p length``: its prompt, and a max-context that holds it and the new tokens when none is given
    and the default would not (llama-bench sizes its context to each test)."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"-p takes positive prompt lengths in tokens, got {length!r}")
    out = {**base, "prompt_length": length}
    need = length + out.get("max_new_tokens", DecodeOptions.__dataclass_fields__["max_new_tokens"].default)
    if out.get("max_context") is None and need > DEFAULT_CONTEXT:
        out["max_context"] = need
    return out


def _plain(opts: DecodeOptions) -> bool:
    return opts.engine == "ours" and opts.engine_options.spec == "none"


def _has_partner(run: DecodeOptions, runs: list[DecodeOptions]) -> bool:
    """Whether ``runs`` hold a plain run of ours on ``run``'s workload."""
    return any(p.workload() == run.workload() and _plain(p) for p in runs)


def with_baselines(runs: list[DecodeOptions], base: dict) -> list[DecodeOptions]:
    """``runs`` with a plain run (flagged ``baseline``) for each speculative workload that has none, and every
    plain run of ours before the speculative runs (the peer keeps its place at the end)."""
    out = list(runs)
    for r in runs:
        if r.engine != "ours" or _plain(r) or _has_partner(r, out):
            continue
        eo = r.engine_options
        out.append(DecodeOptions.make(**{**base, "prefill_chunk": eo.prefill_chunk}, engine="ours",
                                      runtime=eo.runtime, baseline=True,
                                      **{name: getattr(eo, name) for name in SHARED_SWITCHES}))
    runtimes = list(dict.fromkeys(r.engine_options.runtime for r in out))
    # stable: the grid's order otherwise (runtime by runtime, the peer last)
    return sorted(out, key=lambda r: (r.engine != "ours", runtimes.index(r.engine_options.runtime), not _plain(r)))


def attach_plain(doc: dict, plain: dict) -> None:
    """A speculative run's document with its plain partner's speed beside it: ``summary.plain`` holds the
    partner's label, decode tok/s, this run's speed-up over it and whether the tokens are the same."""
    s, p = doc["summary"], plain["summary"]
    speedup = s["decode_tok_s"] / p["decode_tok_s"] if s.get("decode_tok_s") and p.get("decode_tok_s") else None
    s["plain"] = {"label": plain["label"], "decode_tok_s": p.get("decode_tok_s"), "speedup": speedup,
                  "tokens_equal": s["tokens_sha256"] == p["tokens_sha256"]}


def plain_agreement(docs: list[dict]) -> dict[str, bool | None]:
    """Per run label: whether our engine's speculative run decoded the tokens of the grid's plain run on the same
    runtime and prompts (greedy speculative decoding must reproduce greedy decoding; in bf16 a verify forward may
    still flip a near-tie); None where there is nothing to compare (plain runs, the peer, no plain run beside it)."""
    def key(c: dict) -> tuple:
        return tuple(c.get(k) for k in ("runtime", "prompt_file", "prompts", "prompt_length", "max_new_tokens"))

    plain = {}
    for d in docs:
        c = d["config"]
        if c.get("engine") == "ours" and c.get("spec") == "none":
            plain.setdefault(key(c), d["summary"]["tokens_sha256"])
    out = {}
    for d in docs:
        c = d["config"]
        ref = plain.get(key(c)) if c.get("engine") == "ours" and c.get("spec") != "none" else None
        out[d["label"]] = None if ref is None else d["summary"]["tokens_sha256"] == ref
    return out


def load_model(opts: DecodeOptions):
    """The weights a run of ``opts`` decodes with (what several runs on one model share)."""
    from ..engine.artifact.loader import load_source

    device = opts.engine_options.torch_device
    return load_source(opts.model, synthetic=opts.synthetic, quant=opts.quant, seed=opts.seed, device=device)


def model_key(opts: DecodeOptions) -> tuple:
    return opts.model, opts.synthetic, opts.quant, opts.seed, opts.engine_options.device


def timed_repeats(one, opts: DecodeOptions, progress=None) -> tuple[list[dict], str | None]:
    """The timed repeats of a decode run after its warm-up: ``one()`` makes a record, ``opts.repeats`` times, or
    with ``--repeats auto`` until :func:`auto_stop` says why to stop (returned beside the records; None for a fixed
    count). ``progress(done, total, what)`` counts on from the warm-up's ``opts.warmup`` steps."""
    auto = opts.repeats == "auto"
    most = AUTO_MAX_REPEATS if auto else opts.repeats
    total = opts.warmup + most
    records, stopped, start = [], None, time.perf_counter()
    for i in range(most):
        rec = one()
        rec["repeat"] = i
        records.append(rec)
        if auto:
            stopped = auto_stop([r[AUTO_METRIC] for r in records], time.perf_counter() - start, opts.repeats_target,
                                opts.repeats_budget_s)
        if progress:
            progress(opts.warmup + i + 1, opts.warmup + i + 1 if stopped else total, f"repeat {i + 1}")
        if stopped:
            break
    return records, stopped


def run_decode(opts: DecodeOptions, progress=None, loaded=None, references=None, tokens_out=None,
               copy_bw: float | None = None, peer_out: list | None = None) -> dict:
    """Run the decode suite; returns the result document. ``progress(done, total, what)`` reports repeats.
    ``loaded``: the weights (``load_model(opts)``), when the caller shares one load between runs; ``references``:
    per prompt, the plain run's tokens (for replayed acceptance); ``tokens_out``, a list, receives each prompt's
    tokens of the last repeat; ``copy_bw``: the device's copy bandwidth (bytes/s) when the caller measured it
    already (a machine's property, not the run's: on a CPU filling its 256 MiB buffer alone takes seconds);
    ``peer_out``, a list: a peer with a ``close`` (llama.cpp) is appended with its prompts, open, for the caller
    to close."""
    if opts.engine_options.replay_acceptance is not None and references is None:
        raise ValueError("replayed acceptance needs a plain run on the same load first (its tokens are the "
                         "continuation drafts are replaced by)")
    if opts.engine == "hf":
        from .hf_peer import HFPeer

        runner = HFPeer.load(opts, loaded)
    elif opts.engine == "llamacpp":
        from .llamacpp_peer import LlamaCppPeer

        runner = LlamaCppPeer.load(opts, loaded)
    else:
        from ..engine.runtime.engine import Engine

        # the engine binds a copy (its capacities resolved against the model); the run records max-context as bound
        runner = Engine(loaded if loaded is not None else load_model(opts), dataclasses.replace(opts.engine_options))
        opts.engine_options.max_context = runner.options.max_context
        opts.engine_options.cuda_graphs = runner.options.cuda_graphs  # off where the ranks' collectives are not IPC
    prompts = ([code_prompt(runner.tokenizer, opts.prompt_length)] if opts.prompt_length
               else load_prompts(opts.prompt_file, runner.tokenizer, opts.prompts))
    if opts.images:
        prompts = with_images(runner, prompts, opts.images)
    auto = opts.repeats == "auto"
    most = AUTO_MAX_REPEATS if auto else opts.repeats
    total = opts.warmup + most
    # the warm-up covers every length the timed runs reach on a GPU (kernels compiled and buffers grown for the
    # longest keys first: a 64-token warm-up left MTP's first 256-token repeat 11x slower on the H200); on a CPU,
    # with nothing compiled at first use, 64 tokens
    # (--warmup-prompt: a prompt of that many tokens instead, e.g. a short one before a 262K-token run: what only the
    # long prompt reaches stays cold, which that option trades for not prefilling it twice)
    cuda = torch.device(runner.device).type == "cuda"
    warm = dataclasses.replace(opts, max_new_tokens=opts.max_new_tokens if cuda else min(opts.max_new_tokens, 64))
    warm_prompts = [code_prompt(runner.tokenizer, opts.warmup_prompt)] if opts.warmup_prompt else prompts[:1]
    for i in range(opts.warmup):
        run_once(runner, warm_prompts, warm, references[:1] if references is not None else None)
        if progress:
            progress(i + 1, total, "warm-up")
    reset_peak_memory(runner.device)
    records, stopped = timed_repeats(lambda: run_once(runner, prompts, opts, references, tokens_out), opts, progress)
    # a peer in a process of its own (llama.cpp): this process's peak says nothing of its memory
    peak = None if getattr(runner, "worker", None) is not None else peak_memory_bytes(runner.device)
    bw = copy_bw or copy_bandwidth(runner.device)
    dtype = getattr(runner, "dtype", None)
    flops = measured_matmul_peak(str(runner.device), dtype) if isinstance(dtype, torch.dtype) else None
    summary = summarize(records, weight_bytes=runner.weight_bytes_per_step, copy_bw=bw, peak=peak,
                        matmul_flops=flops)
    if peer_out is not None:  # the caller sets the peer against our engine before it is closed
        peer_out.append((runner, prompts))
    elif hasattr(runner, "close"):
        runner.close()
    summary["repeats_stopped_by"] = stopped  # --repeats auto: max, target or budget; None for a fixed count
    config = recorded_config(opts)
    config["label"] = opts.label or opts.default_label()
    config["device"] = str(runner.device)
    config["dtype"] = str(runner.dtype).replace("torch.", "")
    # what a peer ran with where our engine's options do not apply; our engine's settings as applied (Engine.recorded)
    config.update(getattr(runner, "recorded", {}))
    if getattr(runner, "replay", None) is not None:
        config["replay_profile"] = runner.replay.probs  # the per-position conditional acceptance replayed
    return make_result("decode", label=config["label"], config=config, records=records, summary=summary,
                       model=dict(runner.model_info))


def run_matrix(runs: list[DecodeOptions], progress=None, done=None) -> list[dict]:
    """Several decode runs in one process, as llama-bench runs its parameter grid: consecutive runs on the same
    weights share one load (a 27B synthetic build takes minutes on a GPU). ``done(doc)`` is called after each."""
    docs, key, loaded = [], None, None
    plain: dict[tuple, tuple[dict, list]] = {}  # workload -> (a plain run's document, its tokens per prompt)
    for i, opts in enumerate(runs):
        if model_key(opts) != key:
            loaded = None
            free_device_memory()
            key, loaded = model_key(opts), load_model(opts)
            check_drafters(loaded, [r for r in runs[i:] if model_key(r) == key])  # before the first run on them
        if progress:
            progress(0, 1, f"run {i + 1}/{len(runs)}: {opts.label or opts.default_label()}")
        work = opts.workload()  # before the run resolves its capacities
        partner = plain.get(work) if opts.engine == "ours" else None
        replay = opts.engine_options.replay_acceptance is not None
        if replay and partner is None:
            raise ValueError(f"{opts.label or opts.default_label()}: replayed acceptance needs a plain run on the "
                             "same workload before it")
        tokens = [] if _plain(opts) or opts.engine == "llamacpp" else None
        peer = [] if opts.engine == "llamacpp" else None
        doc = run_decode(opts, progress, loaded=loaded, references=partner[1] if replay else None, tokens_out=tokens,
                         peer_out=peer)
        if peer:
            try:
                ours = next((v for k, v in plain.items() if k[0] == work[0]), None)  # the same load()
                if ours is not None:
                    doc["summary"]["agreement"] = peer_agreement(peer[0], loaded, ours, tokens, runs)
            finally:
                peer[0][0].close()
            tokens = None
        free_device_memory()  # the run's engine (its caches, graphs and packed weights) is gone: give it back
        if tokens is not None:
            plain.setdefault(work, (doc, tokens))
        elif partner is not None:
            attach_plain(doc, partner[0])
        docs.append(doc)
        if done:
            done(doc)
    return docs


def peer_agreement(peer, loaded, ours: tuple[dict, list], theirs: list[list[int]], runs: list[DecodeOptions]) -> dict:
    """llama.cpp's agreement with our plain run on the same workload (``ours``: its document and tokens per
    prompt): :func:`.llamacpp_peer.agreement`, with our engine's logits from a fresh engine of that run's options."""
    from ..engine.runtime.engine import Engine
    from .llamacpp_peer import agreement

    runner, prompts = peer
    doc, tokens = ours
    mine = next(r for r in runs if (r.label or r.default_label()) == doc["label"])
    engine = Engine(loaded, dataclasses.replace(mine.engine_options))
    try:
        return agreement(runner, engine.path_logits, prompts, tokens, theirs, doc["label"])
    finally:
        del engine
        free_device_memory()


def check_drafters(loaded, runs: list[DecodeOptions]) -> None:
    """Refuse, before any of ``runs`` starts, a speculative run the weights cannot draft for (a grid would
    otherwise lose the runs before it to the error)."""
    from ..engine.spec.drafters import missing_drafter

    for opts in runs:
        if opts.engine == "ours" and (why := missing_drafter(loaded, opts.engine_options.spec)):
            raise ValueError(why)


def free_device_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_time(fn, device) -> tuple[object, float]:
    """(fn(), wall seconds) with device synchronisation around the call."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t
