"""Result documents as tidy pandas frames, one per suite (and per grain: a decode run, a draft position, a repeat).

Every frame has a ``label`` column; labels are made unique per suite (a second ``v3-none`` decode result
becomes ``v3-none#2``) so frames pivot without collisions. Lists and dicts in a config become JSON text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from .schema import ResultError, read_result

# the leading columns of each frame (present even when the frame is empty); other scalar keys follow
COLUMNS = {
    "decode": ["label", "model_id", "gpu"],
    "decode_positions": ["label", "position", "acceptance"],
    "decode_repeats": ["label", "repeat"],
    "niah": ["label", "case", "ctx", "depth", "pass", "retrieved", "first_divergence", "top1_agreement", "kl",
             "answer", "expected"],
    "concurrency": ["label", "concurrency", "aggregate_tok_s", "per_request_tok_s", "ttft_ms_p50", "ttft_ms_p90",
                    "ttft_ms_p99", "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p99",
                    "matches_sequential"],
    "kernels": ["label", "op", "shape", "variant", "t", "us_median", "us_p10", "us_p90", "bytes", "gbps",
                "roofline_fraction", "max_rel_err"],
    "prefill": ["label", "model_id", "gpu"],
}


def load_results(paths) -> list[dict]:
    """Read and validate result documents; a folder stands for the ``*.json`` and ``*.json.gz`` files directly in
    it. A file named twice (directly or through its folder) is read once; two files holding results of one suite
    under one label are refused, naming both."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted([*p.glob("*.json"), *p.glob("*.json.gz")])
            if not found:
                raise ResultError(f"{p}: a folder with no *.json or *.json.gz result files")
            files += found
        else:
            files.append(p)
    if not files:
        raise ResultError("no result files given")
    unique = {}
    for f in files:
        unique.setdefault(f.resolve(), f)
    docs, seen = [], {}
    for f in unique.values():
        doc = read_result(f)
        key = (doc["suite"], doc["label"])
        if key in seen:
            raise ResultError(f"{seen[key]} and {f} are both {key[0]} results labelled {key[1]!r}: a report names "
                              "runs by label, so which one is the baseline or a delta row would be a guess; give "
                              "each run its own --label, or leave one file out")
        seen[key] = f
        docs.append(doc)
    return docs


def unique_labels(docs: list[dict]) -> list[dict]:
    """The documents with labels made unique within each suite (renamed ones are shallow copies)."""
    seen, out = {}, []
    for doc in docs:
        key = (doc["suite"], doc["label"])
        seen[key] = seen.get(key, 0) + 1
        out.append(doc if seen[key] == 1 else {**doc, "label": f"{doc['label']}#{seen[key]}"})
    return out


def model_id(model: dict) -> str:
    """A short human name for the model a run used."""
    if model.get("artifact_id"):
        return str(model["artifact_id"])
    if model.get("preset"):
        notes = ["synthetic"] if model.get("synthetic") else []
        notes += [f"{k} {model[k]}" for k in ("quant_policy", "seed") if model.get(k) is not None]
        return str(model["preset"]) + (f" ({', '.join(notes)})" if notes else "")
    return str(model.get("model_id") or model.get("path") or "-")


def shape_text(shape) -> str | None:
    return "x".join(map(str, shape)) if isinstance(shape, (list, tuple)) else None if shape is None else str(shape)


def _scalar(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _scalars(d: dict, skip=()) -> dict:
    return {k: v for k, v in d.items() if _scalar(v) and k not in skip}


def _config_columns(config: dict, taken) -> dict:
    """Config parameters as columns; a name that collides with a summary key becomes ``config.<name>``."""
    out = {}
    for k, v in config.items():
        if k == "label":  # the document's label column already says it
            continue
        out[f"config.{k}" if k in taken else k] = v if _scalar(v) else json.dumps(v, sort_keys=True, default=str)
    return out


def _run_row(doc: dict) -> dict:
    summary = _scalars(doc["summary"])
    row = {"label": doc["label"], "model_id": model_id(doc["model"]), "gpu": doc["env"].get("gpu")}
    row.update(_config_columns(doc["config"], set(summary) | set(row)))
    row.update(summary)
    return row


def _frame(name: str, rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    lead = COLUMNS[name]
    for col in lead:
        if col not in df.columns:
            df[col] = pd.Series(dtype=object)
    return df[lead + [c for c in df.columns if c not in lead]]


def frames(docs: list[dict]) -> dict[str, pd.DataFrame]:
    """One tidy frame per suite and grain; frames of suites absent from ``docs`` are empty (with their columns).

    decode / prefill: one row per run (label, model_id, gpu, config columns, summary scalars);
    decode_positions: (label, position 1..K, acceptance = fraction of rounds whose draft at that position was
    accepted); decode_repeats: (label, repeat, the record's scalars); niah: one row per case; concurrency:
    one row per (label, level); kernels: one row per (label, op, shape, variant, t)."""
    rows = {name: [] for name in COLUMNS}
    for doc in unique_labels(docs):
        suite, label, summary = doc["suite"], doc["label"], doc["summary"]
        if suite in ("decode", "prefill"):
            rows[suite].append(_run_row(doc))
        if suite == "decode":
            for i, acc in enumerate(summary.get("accepted_per_position") or [], 1):
                rows["decode_positions"].append({"label": label, "position": i, "acceptance": acc})
            for i, rec in enumerate(doc["records"]):
                rows["decode_repeats"].append({"label": label, "repeat": rec.get("repeat", i), **_scalars(rec)})
        elif suite == "niah":
            rows["niah"] += [{**_scalars(rec), "label": label} for rec in doc["records"]]
        elif suite == "concurrency":
            rows["concurrency"] += [{**_scalars(lv), "label": label} for lv in summary["levels"]]
        elif suite == "kernels":
            rows["kernels"] += [{**_scalars(rec), "label": label, "shape": shape_text(rec.get("shape"))}
                                for rec in doc["records"]]
    return {name: _frame(name, r) for name, r in rows.items()}
