"""When two result documents are one experiment: the model identity, the config keys that define the workload and the
engine's settings, the GPU, and (kernels) each op's weight format; where timings are compared, also the conditions
they were measured under: torch's CPU threads, the CPUs the process could use and the GPU's configured clocks. The
gate fails across experiments; the report says so instead of reading a delta as a speedup.

The machine's load is no part of the experiment (a build cannot choose it) but it moves timings: :func:`load_shift`
says when two runs were measured under different load classes (idle, busy, overloaded: the 1-minute load average per
usable CPU), and the gate then leaves their timings undecided rather than failing them. A document made before these
keys were recorded does not say; what it does not say is never held against it.
"""

from __future__ import annotations

import math
from pathlib import Path

# config / model keys that make two runs different experiments (a gate across them fails); how many samples a run
# takes (decode's repeats, concurrency's rounds per level) is no part of the experiment: the rank test weighs them
CONFIG_KEYS = (
    "engine", "runtime", "device", "dtype", "quant", "kv_dtype",  # what runs, in which numerics
    "spec", "draft_tokens", "rollback", "lm_head_draft", "replay_acceptance",  # speculation (a replayed acceptance
    #                                                                             is never a real one)
    "prompt_file", "prompts", "prompt_length", "images", "max_new_tokens", "temperature", "seed",  # the decode workload
    "ctxs", "depths", "answer_tokens", "cases", "near_tie",  # niah's cases and agreement rule
    "levels", "prompt_tokens",  # concurrency's load
    # an open-loop concurrency run's (None in a closed-loop one: the two are never one experiment)
    "request_rate", "burstiness", "num_prompts", "client_max_concurrency", "dataset", "goodput",
    "url", "tokens_from",  # a run against a server (--url): which one, and what its token hash hashes
)
# engine switches and capacities that change speed but not tokens (``--pdl off``, ``--prefill-chunk``, ...): also the
# experiment, compared where both documents record a value (documents made before a switch existed do not say, and
# in-process concurrency documents before session 27 recorded max_context null)
SETTING_KEYS = (
    "lookahead", "draft_graphs", "pdl", "side_stream", "silu_epilogue", "prefill_graphs",  # the CUDA-graph switches
    "flash_prefill", "fused_prefill", "draft_attention", "cudnn_prefill",
    "prefill_chunk", "interleave_chunk", "prefill_weights", "max_context", "kv_capacity", "max_concurrency",
    "synthetic", "ignore_eos", "pack_prefill",
    "top_p", "top_k", "sample_seed",  # concurrency's sampling (beside temperature, a workload key): newer documents
    "tensor_parallel",  # ranks the model is split over (newer documents)
)
# the engine switches of SETTING_KEYS that change only a run on CUDA (engine/runtime/options.SWITCHES without ``cpu``;
# tests/test_gate_trust.py holds the two together): two CPU runs are one experiment whatever they record for these, so a
# default moved for CUDA (--cudnn-prefill's, session 79) does not part a CPU run from its baseline
CUDA_ONLY_SETTINGS = ("lookahead", "draft_graphs", "pdl", "side_stream", "silu_epilogue", "prefill_graphs",
                      "flash_prefill", "fused_prefill", "draft_attention", "cudnn_prefill")
# compared by file name: where a checkout lies is no part of the experiment
PATH_KEYS = ("prompt_file", "images", "dataset")
MODEL_KEYS = ("artifact_id", "sha256", "model_id", "preset", "quant_policy", "config_sha256", "seed",
              "served_model")  # (the model name a --url run sent: the server's weights are not known otherwise)
# env keys of the measurement's conditions, compared where timings are and both documents record them: a run pinned
# to one thread (or one core) is another experiment than one with the machine's default
ENV_TIMING_KEYS = ("threads", "cpu_affinity")
# env.gpu_clocks keys that are settings (application clocks, the board's limits), compared like ENV_TIMING_KEYS; the
# current sm_mhz / mem_mhz are shown, not compared (they follow the load at the moment the document was written)
GPU_CLOCK_KEYS = ("app_sm_mhz", "app_mem_mhz", "max_sm_mhz", "max_mem_mhz")
# load classes by the 1-minute load average per usable CPU: below 0.5 idle, below 1.5 busy, else overloaded (runnable
# processes waiting for a CPU). A CPU run's own threads count: a 2-thread run alone on 2 CPUs reads about 1 (busy)
LOAD_CLASSES = ((0.5, "idle"), (1.5, "busy"), (math.inf, "overloaded"))


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
    if key == "temperature" and value is None:
        return 0.0  # greedy: a document made before its suite could sample does not record a temperature
    if isinstance(value, (list, tuple)):
        return [_portable(key, v) for v in value]
    return _portable(key, value)


def _portable(key: str, value):
    return Path(value).name if key in PATH_KEYS and isinstance(value, (str, Path)) else value


def config_differences(baseline: dict, candidate: dict, timings: bool = True) -> list[str]:
    """What makes the two runs different experiments: model identity, workload, engine settings (on two CPU runs,
    those that change only a CUDA run excepted: CUDA_ONLY_SETTINGS), GPU; where timings
    are compared (``timings``) and both documents record them, torch's threads, the CPU affinity, the GPU's configured
    clocks (GPU runs) and the CPU model and core count (CPU runs). Exact metrics are compared across machines (CI's
    own vary)."""
    pairs = [(f"model.{k}", baseline["model"].get(k), candidate["model"].get(k)) for k in MODEL_KEYS]
    if all(b is None and c is None for _, b, c in pairs):  # no identity recorded: fall back to the config
        pairs = [("model", baseline["config"].get("model"), candidate["config"].get("model"))]
    pairs += [(k, config_value(baseline["config"], k), config_value(candidate["config"], k)) for k in CONFIG_KEYS]
    on_cpu = baseline["config"].get("device") == candidate["config"].get("device") == "cpu"
    pairs += [(k, config_value(baseline["config"], k), config_value(candidate["config"], k)) for k in SETTING_KEYS
              if baseline["config"].get(k) is not None and candidate["config"].get(k) is not None
              and not (on_cpu and k in CUDA_ONLY_SETTINGS)]
    # two runs against servers (--url): this client's GPU, CPU, threads and clocks measured nothing
    remote = baseline["config"].get("device") == candidate["config"].get("device") == "server"
    if not on_cpu and not remote:  # the GPU a run had matters only where it ran on one
        pairs.append(("env.gpu", baseline["env"].get("gpu"), candidate["env"].get("gpu")))
    elif on_cpu and timings:  # a laptop's baseline against a CI box's candidate is no speed change
        pairs += [(f"env.{k}", baseline["env"].get(k), candidate["env"].get(k)) for k in ("cpu_model", "cpu_count")
                  if baseline["env"].get(k) is not None and candidate["env"].get(k) is not None]
    if timings and not remote:  # the conditions of the measurement, where both documents record them
        pairs += _recorded([(f"env.{k}", baseline["env"].get(k), candidate["env"].get(k)) for k in ENV_TIMING_KEYS])
        if not on_cpu:
            b_clocks, c_clocks = (d["env"].get("gpu_clocks") for d in (baseline, candidate))
            if isinstance(b_clocks, dict) and isinstance(c_clocks, dict):
                pairs += _recorded([(f"env.gpu_clocks.{k}", b_clocks.get(k), c_clocks.get(k)) for k in GPU_CLOCK_KEYS])
    if baseline.get("suite") == candidate.get("suite") == "kernels":
        pairs += kernel_format_differences(baseline, candidate)
    return [f"{key} {b!r} vs {c!r}" for key, b, c in pairs if b != c]


def _recorded(pairs: list[tuple[str, object, object]]) -> list[tuple[str, object, object]]:
    """The pairs both documents record (a document made before a key existed does not say)."""
    return [(k, b, c) for k, b, c in pairs if b is not None and c is not None]


def usable_cpus(env: dict) -> int | None:
    """The CPUs a run could use: its affinity where recorded, else the machine's count."""
    n = env.get("cpu_affinity") or env.get("cpu_count")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def load_per_cpu(env: dict) -> float | None:
    """The 1-minute load average per usable CPU when the document was written; None where not recorded."""
    load, cpus = env.get("load_avg_1m"), usable_cpus(env)
    if cpus is None or isinstance(load, bool) or not isinstance(load, (int, float)) or not math.isfinite(load):
        return None
    return load / cpus


def load_class(env: dict) -> str | None:
    """``idle``, ``busy`` or ``overloaded`` (:data:`LOAD_CLASSES`); None where the load is not recorded."""
    per = load_per_cpu(env)
    return None if per is None else next(name for bound, name in LOAD_CLASSES if per < bound)


def load_text(env: dict) -> str:
    """``"overloaded (load 4.1 on 2 CPUs)"``; ``"not recorded"``."""
    cls = load_class(env)
    return "not recorded" if cls is None else f"{cls} (load {env['load_avg_1m']:.2f} on {usable_cpus(env)} CPUs)"


def load_shift(baseline: dict, candidate: dict) -> tuple[str, bool] | None:
    """(what differs, whether the candidate ran under the heavier load) when the two runs' load classes differ;
    None when they agree or either is not recorded."""
    b, c = load_class(baseline["env"]), load_class(candidate["env"])
    if b is None or c is None or b == c:
        return None
    names = [name for _, name in LOAD_CLASSES]
    return (f"the machine's load differs: baseline {load_text(baseline['env'])}, candidate "
            f"{load_text(candidate['env'])}"), names.index(c) > names.index(b)


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
