"""Stored oracle outputs and the oracle agreement rule (docs/DESIGN.md, "Metrics").

File format: one JSON document (gzip-compressed when the path ends in ``.gz``)::

    {"schema": "ninfer-bench/oracle", "schema_version": 1,
     "meta": {"artifact_id", "artifact_sha256", "text_id", "preset", "dtype", "top_k", "created", ...},
     "records": [{"id", "prompt_ids", "tokens", "topk_ids", "topk_logprobs", "device"}, ...]}

``tokens[i]`` is the oracle's greedy token at generation step i; ``topk_ids[i]`` / ``topk_logprobs[i]``
are the top-k of that step's log-softmax over the full vocabulary, best first. JSON floats round-trip
exactly, so a stored oracle compares bit-for-bit with a fresh one. ``device`` ("cpu" or "cuda") is where the
reference computed that case: a file built on the CPU may be extended with cases from a GPU. Files written before
cases recorded it have none (``UNKNOWN_DEVICE``).
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

SCHEMA = "ninfer-bench/oracle"
SCHEMA_VERSION = 1
RECORD_KEYS = ("id", "prompt_ids", "tokens", "topk_ids", "topk_logprobs")
UNKNOWN_DEVICE = "unknown"  # what a record without "device" (written before records carried one) was computed on
META_KEYS = ("artifact_id", "artifact_sha256", "dtype", "top_k")

NEAR_TIE_NATS = 0.05
"""Default near-tie tolerance: the largest gap (nats) between the oracle's top-1 log-prob and the
oracle's log-prob of the token a candidate picked instead, at which the candidate still agrees.

The candidate engine runs in bf16/fp16 with an INT8 KV cache against a float64 oracle. bf16 keeps 8
significant bits (relative rounding 2^-9, about 0.2%), and that error compounds through the layers, so
on logits of magnitude ~10-20 the two best tokens can move relative to each other by a few hundredths
of a nat from rounding alone. 0.05 nats (a 5% probability ratio) covers that; a divergence at a larger
gap is a real disagreement, not a coin flip the oracle barely called. Any token inside the band is
such a coin flip, not only the top-2: at a three-way tie (the bundled model's 8K NIAH case at 20%
depth, step 8: -1.2596 / -1.2874 / -1.3078) rounding can put the third first.
"""


# ---- file format ------------------------------------------------------------------------------------
def _validate_record(rec: dict, top_k: int) -> None:
    missing = [k for k in RECORD_KEYS if k not in rec]
    if missing:
        raise ValueError(f"oracle record {rec.get('id')!r}: missing key(s) {missing}")
    if "device" in rec and not (isinstance(rec["device"], str) and rec["device"]):
        raise ValueError(f"oracle record {rec['id']!r}: device must name where it was computed (e.g. 'cpu'), "
                         f"got {rec['device']!r}")
    steps = len(rec["tokens"])
    if len(rec["topk_ids"]) != steps or len(rec["topk_logprobs"]) != steps:
        raise ValueError(f"oracle record {rec['id']!r}: {steps} tokens but {len(rec['topk_ids'])} topk_ids "
                         f"and {len(rec['topk_logprobs'])} topk_logprobs rows")
    for i, (ids, lps) in enumerate(zip(rec["topk_ids"], rec["topk_logprobs"])):
        if len(ids) != len(lps) or not 1 <= len(ids) <= top_k:
            raise ValueError(f"oracle record {rec['id']!r} step {i}: {len(ids)} ids and {len(lps)} log-probs "
                             f"(expected the same count, 1..top_k={top_k})")


def save_oracle(path: str | Path, records: Sequence[dict], meta: dict) -> Path:
    """Write oracle records and their metadata; ``meta['created']`` defaults to now (UTC, ISO 8601)."""
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"oracle meta: missing key(s) {missing} (required: {', '.join(META_KEYS)})")
    meta = {**meta, "created": meta.get("created") or datetime.now(timezone.utc).isoformat(timespec="seconds")}
    ids = [r.get("id") for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError(f"oracle records: duplicate id(s) {sorted({i for i in ids if ids.count(i) > 1})}")
    clean = []
    for rec in records:
        _validate_record(rec, int(meta["top_k"]))
        clean.append({"id": rec["id"], "prompt_ids": [int(t) for t in rec["prompt_ids"]],
                      "tokens": [int(t) for t in rec["tokens"]],
                      "topk_ids": [[int(t) for t in row] for row in rec["topk_ids"]],
                      "topk_logprobs": [[float(v) for v in row] for row in rec["topk_logprobs"]],
                      **({"device": rec["device"]} if "device" in rec else {})})
    doc = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "meta": meta, "records": clean}
    path = Path(path)
    data = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    if path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)  # no timestamp in the header: the same records give the same bytes
    # written next to the target, then renamed over it: a build stopped mid-write leaves the previous file whole
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_oracle(path: str | Path) -> tuple[list[dict], dict]:
    """Read an oracle file written by ``save_oracle``: returns (records, meta)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError, EOFError) as e:
        raise ValueError(f"oracle file {path}: cannot read it as (gzipped) JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"oracle file {path}: schema is {doc.get('schema') if isinstance(doc, dict) else None!r}, "
                         f"expected {SCHEMA!r}")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"oracle file {path}: schema_version {doc.get('schema_version')!r}, "
                         f"this reader knows {SCHEMA_VERSION}")
    meta = doc["meta"]
    for rec in doc["records"]:
        _validate_record(rec, int(meta["top_k"]))
    return doc["records"], meta


def devices(records: Sequence[dict]) -> dict[str, int]:
    """How many of an oracle file's cases each device computed, most first (``UNKNOWN_DEVICE`` counts the records
    written before cases recorded one)."""
    counts = Counter(rec.get("device", UNKNOWN_DEVICE) for rec in records)
    return dict(counts.most_common())


# ---- model identity ---------------------------------------------------------------------------------
def _describe(ident: dict, sha: str) -> str:
    if ident.get("preset"):
        return f"preset {ident['preset']}"
    if ident.get("text_id"):
        art = f" (artifact {ident['artifact_id']})" if ident.get("artifact_id") else ""
        return f"text model {ident['text_id'][:16]}{art}"
    if ident.get("artifact_id"):
        return f"artifact {ident['artifact_id']}"
    # an oracle built for a preset before the preset's name was recorded: its config digest is all it carries
    return f"an unnamed preset (config sha256 {sha[:16]})" if sha else "an unrecorded model"


def identity_mismatch(meta: dict, model: dict) -> str | None:
    """Why an oracle whose metadata is ``meta`` is not the reference of ``model`` (a loader ``info`` or a result's
    ``model``: text_id, artifact_id, preset, config_sha256), or None when it is.

    The text model's identity decides when both carry one (an artifact whose drafters were replaced keeps its
    oracles), else the artifact id. A preset has neither: it is known by its name and the digest of its config
    (recorded as ``artifact_sha256``), so a preset's oracle is refused for an artifact, another preset, or the same
    preset whose config changed, instead of surfacing later as "different prompt tokens"."""
    o_sha, m_sha = meta.get("artifact_sha256") or "", model.get("config_sha256") or ""
    o_art, m_art = bool(meta.get("text_id") or meta.get("artifact_id")), bool(model.get("text_id")
                                                                               or model.get("artifact_id"))
    if meta.get("text_id") and model.get("text_id"):
        same = meta["text_id"] == model["text_id"]
    elif meta.get("artifact_id") and model.get("artifact_id"):
        same = meta["artifact_id"] == model["artifact_id"]
    elif o_art or m_art:  # an artifact on one side only, or two artifacts with no identity in common
        same = False
    else:  # two presets: the name where the oracle records one, and the config digest
        same = (not meta.get("preset") or meta["preset"] == model.get("preset")) and (o_sha == m_sha or not m_sha)
    if same:
        return None
    theirs, ours = _describe(meta, o_sha), _describe(model, m_sha)
    if theirs == ours:  # the same preset name, another config
        theirs, ours = f"{theirs} with config sha256 {o_sha[:16]}", f"{ours} with config sha256 {m_sha[:16]}"
    return f"oracle made for {theirs}, this model is {ours}"


# ---- agreement --------------------------------------------------------------------------------------
def agreement(candidate_tokens: Sequence[int], oracle_record: dict, near_tie: float = NEAR_TIE_NATS) -> dict:
    """The oracle agreement rule for one case.

    Tokens are compared over the steps both sides generated (``compared_steps``; a run that stopped
    earlier or later is not by itself a disagreement). Identical -> pass. At the first differing step
    d the case passes only if the candidate's token is among the oracle's top-k there with a log-prob
    at most ``near_tie`` below the top-1's (a near tie, :data:`NEAR_TIE_NATS`). Later steps are never
    compared: after d the two runs continue from different prefixes.

    Returns {"pass", "first_divergence" (step index or None), "top1_agreement" (fraction of compared
    steps whose candidate token is the oracle's top-1 on the oracle's own path, i.e. before the first
    divergence; steps from d on count as not agreeing), "gap_at_divergence" (nats: the oracle's
    top-1 log-prob minus that of the candidate's token; where the candidate's token is outside the
    oracle's top-k, minus the last of them, a lower bound; None without a divergence),
    "compared_steps"}.
    """
    oracle_tokens = oracle_record["tokens"]
    steps = min(len(candidate_tokens), len(oracle_tokens))
    divergence = next((i for i in range(steps) if int(candidate_tokens[i]) != int(oracle_tokens[i])), None)
    on_path = steps if divergence is None else divergence
    top1 = sum(int(candidate_tokens[i]) == int(oracle_record["topk_ids"][i][0]) for i in range(on_path))
    result = {"pass": divergence is None, "first_divergence": divergence,
              "top1_agreement": top1 / steps if steps else 1.0, "gap_at_divergence": None,
              "compared_steps": steps}
    if divergence is not None:
        ids = [int(i) for i in oracle_record["topk_ids"][divergence]]
        lps = [float(v) for v in oracle_record["topk_logprobs"][divergence]]
        if len(lps) >= 2:
            mine = int(candidate_tokens[divergence])
            known = mine in ids
            gap = lps[0] - (lps[ids.index(mine)] if known else lps[-1])
            result["gap_at_divergence"] = gap
            result["pass"] = known and gap <= near_tie
    return result


def kl(p_logprobs: Sequence[float], q_logprobs: Sequence[float]) -> float:
    """KL(p || q) in nats over a top-k support, each side renormalised to sum to 1 on it.

    The two sequences are aligned: the same token ids in the same order, typically the oracle's top-k
    ids with p = the oracle's log-probs and q = the candidate's log-probs gathered at those ids. Both
    are top-k truncations of full distributions, so each is renormalised over the k ids before the
    sum ``sum_i p_i (log p_i - log q_i)``; the result is 0 for identical inputs and >= 0 otherwise.
    A q of -inf where p has mass gives inf.
    """
    p, q = [float(v) for v in p_logprobs], [float(v) for v in q_logprobs]
    if len(p) != len(q) or not p:
        raise ValueError(f"kl: need two aligned non-empty log-prob lists, got lengths {len(p)} and {len(q)}")

    def renormalised(lps: list[float]) -> list[float]:
        top = max(lps)
        if top == -math.inf:
            raise ValueError("kl: every log-prob is -inf")
        log_total = top + math.log(sum(math.exp(v - top) for v in lps))
        return [v - log_total for v in lps]

    p, q = renormalised(p), renormalised(q)
    return max(0.0, sum(math.exp(pi) * (pi - qi) for pi, qi in zip(p, q) if pi > -math.inf))
