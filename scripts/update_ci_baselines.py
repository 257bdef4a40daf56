#!/usr/bin/env python3
"""Rebuild the committed CI baselines (tests/baselines/decode-*.json) from the current engine and default model."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

from ninfer_bench.reports.schema import write_result  # noqa: E402
from ninfer_bench.suites.ci import DECODE_RUNS, baseline_path, decode_options  # noqa: E402
from ninfer_bench.suites.decode import run_decode  # noqa: E402

for name in DECODE_RUNS:
    doc = run_decode(decode_options(name))
    write_result(doc, baseline_path(name))
    s = doc["summary"]
    print(f"{name}: {s['tokens_sha256'][:16]} rounds {s['rounds']} accepted {s['accepted_tokens']}/{s['drafted_tokens']}")
