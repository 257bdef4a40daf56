"""When two result documents are one experiment: the model identity, the config keys that define the workload and the
engine's settings, the GPU, and (kernels) each op's weight format. The gate fails across experiments; the report
says so instead of reading a delta as a speedup."""

from __future__ import annotations

from pathlib import Path

# config / model keys that make two runs different experiments (a gate across them fails); how many samples a run
# takes (decode's repeats, concurrency's rounds per level) is no part of the experiment: the rank test weighs them
CONFIG_KEYS = (
    "engine", "runtime", "device", "dtype", "quant", "kv_dtype",  # what runs, in which numerics
    "spec", "draft_tokens", "rollback", "lm_head_draft", "replay_acceptance",  # speculation (a replayed acceptance
    #                                                                             is never a real one)
    "prompt_file", "prompts", "images", "max_new_tokens", "temperature", "seed",  # the decode workload
    "ctxs", "depths", "answer_tokens", "cases", "near_tie",  # niah's cases and agreement rule
    "levels", "prompt_tokens",  # concurrency's load
)
# engine switches and capacities that change speed but not tokens (``--pdl off``, ``--prefill-chunk``, ...): also the
# experiment, compared where both documents record a value (documents made before a switch existed do not say, and
# in-process concurrency documents before session 27 recorded max_context null)
SETTING_KEYS = (
    "lookahead", "draft_graphs", "pdl", "side_stream", "silu_epilogue",  # decode's CUDA-graph switches
    "prefill_chunk", "interleave_chunk", "max_context", "kv_capacity", "max_concurrency", "synthetic", "ignore_eos",
)
PATH_KEYS = ("prompt_file", "images")  # compared by file name: where a checkout lies is no part of the experiment
MODEL_KEYS = ("artifact_id", "sha256", "model_id", "preset", "quant_policy", "config_sha256", "seed")



def config_value(config: dict, key: str):
    """``config[key]`` as two runs of one experiment would share it: file paths reduced to their names, tuples
    (a fresh document's) as lists (a document read back from JSON); ``quant`` only where it built the weights
    (``synthetic``: earlier documents recorded its unused default for artifacts too); ``draft_tokens`` 0 without a
    drafter."""
    value = config.get(key)
    if key == "quant" and not config.get("synthetic"):
        return None
    if key == "draft_tokens" and config.get("spec") in (None, "none"):
        return 0  # plain decoding drafts nothing (the peer's documents recorded None before its options were nested)
    if isinstance(value, (list, tuple)):
        return [_portable(key, v) for v in value]
    return _portable(key, value)


def _portable(key: str, value):
    return Path(value).name if key in PATH_KEYS and isinstance(value, (str, Path)) else value


def config_differences(baseline: dict, candidate: dict, timings: bool = True) -> list[str]:
    """What makes the two runs different experiments: model identity, workload, engine settings, GPU; for CPU runs
    whose timings are compared (``timings``), the CPU model and core count where both documents record them (exact
    metrics of CPU runs are compared across machines: CI's own vary)."""
    pairs = [(f"model.{k}", baseline["model"].get(k), candidate["model"].get(k)) for k in MODEL_KEYS]
    if all(b is None and c is None for _, b, c in pairs):  # no identity recorded: fall back to the config
        pairs = [("model", baseline["config"].get("model"), candidate["config"].get("model"))]
    pairs += [(k, config_value(baseline["config"], k), config_value(candidate["config"], k)) for k in CONFIG_KEYS]
    pairs += [(k, config_value(baseline["config"], k), config_value(candidate["config"], k)) for k in SETTING_KEYS
              if baseline["config"].get(k) is not None and candidate["config"].get(k) is not None]
    on_cpu = baseline["config"].get("device") == candidate["config"].get("device") == "cpu"
    if not on_cpu:  # the GPU a run had matters only where it ran on one
        pairs.append(("env.gpu", baseline["env"].get("gpu"), candidate["env"].get("gpu")))
    elif timings:  # a laptop's baseline against a CI box's candidate is no speed change
        pairs += [(f"env.{k}", baseline["env"].get(k), candidate["env"].get(k)) for k in ("cpu_model", "cpu_count")
                  if baseline["env"].get(k) is not None and candidate["env"].get(k) is not None]
    if baseline.get("suite") == candidate.get("suite") == "kernels":
        pairs += kernel_format_differences(baseline, candidate)
    return [f"{key} {b!r} vs {c!r}" for key, b, c in pairs if b != c]


def kernel_formats(doc: dict) -> dict[str, str]:
    """Weight format per kernel op, from its records' ``fmt`` (ops without a weight have none): records are matched
    by op, shape, variant and T, so a format change would otherwise be gated as a speed change."""
    out: dict[str, set] = {}
    for rec in doc["records"]:
        if rec.get("fmt") is not None:
            out.setdefault(rec["op"], set()).add(str(rec["fmt"]))
    return {op: ", ".join(sorted(fmts)) for op, fmts in out.items()}


def kernel_format_differences(baseline: dict, candidate: dict) -> list[tuple[str, object, object]]:
    """``("fmt of attn.o, attn.k", baseline format, candidate format)``: the ops both runs measured, in other
    formats, grouped by the change."""
    b, c = kernel_formats(baseline), kernel_formats(candidate)
    changes: dict[tuple[str, str], list[str]] = {}
    for op in b:
        if op in c and b[op] != c[op]:
            changes.setdefault((b[op], c[op]), []).append(op)
    return [(f"fmt of {', '.join(ops)}", old, new) for (old, new), ops in changes.items()]
