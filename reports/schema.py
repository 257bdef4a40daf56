"""The result document every suite run writes (docs/DESIGN.md, "The result document").

::

    {"schema": "ninfer-bench/result", "schema_version": 1, "suite": "decode", "label": "...",
     "created": ISO-8601, "env": {git sha, python, torch, cuda, gpu, driver, cpu, ...},
     "model": {artifact id, sha256, format, preset, ...}, "config": {every parameter},
     "records": [one row per measured unit, with raw per-repeat samples], "summary": {...}}

Reports and gates read only these documents.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import subprocess
import sys
import zlib
from datetime import datetime, timezone
from pathlib import Path

SCHEMA = "ninfer-bench/result"
SCHEMA_VERSION = 1
GZIP_MAGIC = b"\x1f\x8b"
SUITES = ("decode", "niah", "concurrency", "kernels", "prefill")

# summary keys each suite must provide (docs/DESIGN.md); suites may add more
REQUIRED_SUMMARY = {
    "decode": ("prompt_tokens", "completion_tokens", "tokens_sha256", "prefill_tok_s", "decode_tok_s", "ttft_ms",
               "device_ms_per_round", "rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate",
               "tokens_per_round", "accepted_per_position", "peak_memory_bytes"),
    "niah": ("cases", "oracle_agreement", "retrieval", "first_divergence"),
    "concurrency": ("levels",),
    "kernels": ("ops",),
    "prefill": ("prefill_tok_s",),
}
CONCURRENCY_LEVEL_KEYS = ("concurrency", "aggregate_tok_s", "per_request_tok_s", "ttft_ms_p50", "ttft_ms_p99",
                          "itl_ms_p50", "itl_ms_p99", "matches_sequential")
KERNEL_RECORD_KEYS = ("op", "variant", "t", "us_median", "us_p10", "us_p90", "bytes", "gbps", "roofline_fraction",
                      "max_rel_err")


class ResultError(ValueError):
    """A result document that does not follow the schema."""


def _git_sha() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        sha = out.stdout.strip()
        if not sha:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str | None:
    """The CPU's model name (``AMD EPYC 9654 96-Core Processor``), which ``platform.processor()`` does not give on
    Linux (it says ``x86_64``): CPU timings compare only between runs on the same model. None where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model") and value.strip():
                return value.strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5).stdout.strip()
            return out or None
        except (OSError, subprocess.SubprocessError):
            return None
    return None


# nvidia-smi --query-gpu fields of ``env.gpu_clocks`` (MHz): the clocks at the moment the document was written, the
# application clocks (``nvidia-smi -ac``, where set) and the most the board allows
GPU_CLOCK_FIELDS = {"sm_mhz": "clocks.sm", "mem_mhz": "clocks.mem", "app_sm_mhz": "clocks.applications.graphics",
                    "app_mem_mhz": "clocks.applications.memory", "max_sm_mhz": "clocks.max.sm",
                    "max_mem_mhz": "clocks.max.mem"}


def _mhz(text: str) -> int | None:
    """``"1980"`` -> 1980; ``"[N/A]"``, ``"[Not Supported]"`` -> None."""
    try:
        return int(float(text.strip()))
    except ValueError:
        return None


def _nvidia_smi(torch) -> tuple[str | None, dict | None]:
    """(driver version, ``gpu_clocks``) of the GPU the run used, from one nvidia-smi query; (None, None) where it
    cannot be read. The GPU is found by its UUID (CUDA_VISIBLE_DEVICES renumbers devices), or is the only one."""
    query = ["driver_version", "uuid", *GPU_CLOCK_FIELDS.values()]
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(query)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None
    rows = [[f.strip() for f in line.split(",")] for line in out.stdout.strip().splitlines()]
    rows = [r for r in rows if len(r) == len(query)]
    if not rows:
        return None, None
    try:
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    except (AttributeError, RuntimeError, AssertionError):
        uuid = None
    mine = [r for r in rows if uuid and r[1].removeprefix("GPU-") == uuid.removeprefix("GPU-")]
    row = mine[0] if mine else rows[0] if len(rows) == 1 else None
    if row is None:  # several GPUs and none known as this one: the driver is shared, the clocks are not
        return rows[0][0] or None, None
    clocks = {key: _mhz(value) for key, value in zip(GPU_CLOCK_FIELDS, row[2:])}
    return row[0] or None, clocks if any(v is not None for v in clocks.values()) else None


def cpu_affinity() -> int | None:
    """How many CPUs this process may run on (``taskset``, cgroup cpusets); None where the OS does not say."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def load_average() -> float | None:
    """The 1-minute load average (runnable processes, this run's own included); None where the OS has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


# environment variables that switch kernels (recorded in a result's env; never secrets such as the server's API key)
KERNEL_KNOBS = ("NINFER_BENCH_ATTN", "NINFER_BENCH_ATTN_BUILD", "NINFER_BENCH_ATTN_MIN_STEPS",
               "NINFER_BENCH_ATTN_VERIFY", "NINFER_BENCH_QMV_WIDE", "NINFER_BENCH_QMV_PDL_X",
               "NINFER_BENCH_QMV_SHAPES", "NINFER_BENCH_QMV_SPLIT_CAP", "NINFER_BENCH_QMV_CLUSTER",
               "NINFER_BENCH_QMV_PIECES", "NINFER_BENCH_PREFILL_PLAN", "NINFER_BENCH_TP_IPC",
               "NINFER_BENCH_CUDNN_MIN_HEAD_DIM")


def environment() -> dict:
    """Where a run happened: software versions, GPU and CPU, and the conditions of the measurement: torch's CPU
    threads, the CPUs the process may use (``cpu_affinity``), the 1-minute load average when the document was made,
    and the GPU's clocks where nvidia-smi reads them (``gpu_clocks``, MHz, or None); ``knobs``: the kernel switches
    set in the process's environment (:data:`KERNEL_KNOBS`, e.g. ``NINFER_BENCH_ATTN=triton``), which change a run's
    kernels without changing its config. The gate treats a change of
    threads, affinity or configured clocks as another experiment, and a change of load as a reason to doubt timings
    (reports/experiment.py)."""
    import torch

    env = {"git_sha": _git_sha(), "python": sys.version.split()[0], "torch": torch.__version__,
           "platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
           "cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "cpu_affinity": cpu_affinity(),
           "threads": torch.get_num_threads(), "load_avg_1m": load_average(), "cuda": torch.version.cuda,
           "gpu": None, "driver": None, "gpu_clocks": None,
           "knobs": {k: os.environ[k] for k in KERNEL_KNOBS if k in os.environ}}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["driver"], env["gpu_clocks"] = _nvidia_smi(torch)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def make_result(suite: str, *, label: str, config: dict, records: list[dict], summary: dict,
                model: dict | None = None, env: dict | None = None) -> dict:
    """Assemble (and validate) one result document."""
    doc = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "suite": suite, "label": label,
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "env": env if env is not None else environment(), "model": model or {}, "config": config,
           "records": records, "summary": summary}
    validate(doc)
    return doc


def validate(doc: dict, source: str = "result") -> dict:
    """Raise :class:`ResultError` naming the file (``source``) and the key that is wrong; return ``doc`` when it
    follows the schema: the sections of the right types, the suite's summary keys, per-repeat samples as lists
    of numbers."""
    if not isinstance(doc, dict):
        raise ResultError(f"{source}: not a JSON object")
    if doc.get("schema") != SCHEMA:
        raise ResultError(f"{source}: schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ResultError(f"{source}: schema_version {doc.get('schema_version')!r} is not supported "
                          f"(this build reads {SCHEMA_VERSION})")
    for key in ("suite", "label", "created", "env", "model", "config", "records", "summary"):
        if key not in doc:
            raise ResultError(f"{source}: missing key {key!r}")
    suite = doc["suite"]
    if suite not in SUITES:
        raise ResultError(f"{source}: unknown suite {suite!r}")
    if not isinstance(doc["label"], str):
        raise ResultError(f"{source}: label must be a string, got {_brief(doc['label'])}")
    for key in ("env", "model", "config", "summary"):
        _object(doc[key], source, key)
    _objects(doc["records"], source, "records")
    summary = doc["summary"]
    missing = [k for k in REQUIRED_SUMMARY[suite] if k not in summary]
    if missing:
        raise ResultError(f"{source}: {suite} summary lacks {missing}")
    _samples(summary.get("samples"), source, "summary.samples")
    if suite == "concurrency":
        _objects(summary["levels"], source, "summary.levels")
        for i, lv in enumerate(summary["levels"]):
            miss = [k for k in CONCURRENCY_LEVEL_KEYS if k not in lv]
            if miss:
                raise ResultError(f"{source}: concurrency level {lv.get('concurrency')} lacks {miss}")
            _samples(lv.get("samples"), source, f"summary.levels[{i}].samples")
    if suite == "kernels":
        for i, rec in enumerate(doc["records"]):
            miss = [k for k in KERNEL_RECORD_KEYS if k not in rec]
            if miss:
                raise ResultError(f"{source}: kernel record {rec.get('op')} lacks {miss}")
            _numbers(rec.get("samples_us", []), source, f"records[{i}].samples_us")
    if suite == "niah":
        for i, rec in enumerate(doc["records"]):
            if not isinstance(rec.get("case"), str):
                raise ResultError(f"{source}: niah records[{i}] has no case name")
    return doc


def _brief(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _object(value, source: str, key: str) -> None:
    if not isinstance(value, dict):
        raise ResultError(f"{source}: {key} must be an object, got {_brief(value)}")


def _objects(value, source: str, key: str) -> None:
    if not isinstance(value, list):
        raise ResultError(f"{source}: {key} must be a list of objects, got {_brief(value)}")
    for i, item in enumerate(value):
        _object(item, source, f"{key}[{i}]")


def _numbers(value, source: str, key: str) -> None:
    """A list of per-repeat samples: numbers, or null for a repeat that measured nothing."""
    bad = not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, (int, float, type(None)))
                                             for v in value)
    if bad:
        raise ResultError(f"{source}: {key} must be a list of numbers, got {_brief(value)}")


def _samples(samples, source: str, key: str) -> None:
    """``{metric: [numbers]}`` (absent is fine: the gate then decides on its thresholds alone)."""
    if samples is None:
        return
    _object(samples, source, key)
    for name, values in samples.items():
        _numbers(values, source, f"{key}.{name}")


def write_result(doc: dict, path: str | Path) -> Path:
    """Write a result document as indented JSON (atomically); gzip-compressed when ``path`` ends in ``.gz``, as
    oracle files are."""
    path = Path(path)
    data = (json.dumps(doc, indent=1, default=_jsonable) + "\n").encode()
    if path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:  # named by the path asked for, not the temporary file
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        raise OSError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def read_result(path: str | Path) -> dict:
    """Load and validate a result document (plain or gzip-compressed JSON)."""
    path = Path(path)
    if not path.is_file():
        raise ResultError(f"no such result file: {path}")
    data = path.read_bytes()
    if path.suffix == ".gz" and data[:2] != GZIP_MAGIC:
        raise ResultError(f"{path}: named .gz but not a gzip file")
    try:
        if data[:2] == GZIP_MAGIC:
            data = gzip.decompress(data)
        doc = json.loads(data.decode("utf-8"))
    except (OSError, EOFError, zlib.error) as e:  # a truncated or corrupt gzip stream
        raise ResultError(f"{path}: not a readable gzip file ({e})") from None
    except UnicodeDecodeError:
        raise ResultError(f"{path}: not a JSON result document (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ResultError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    return validate(doc, str(path))
