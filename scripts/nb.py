#!/usr/bin/env python3
"""``ninfer-bench`` from a plain checkout (no pip install), e.g. on the GPU machine: python3 scripts/nb.py decode ..."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

from ninfer_bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main(obj={})
