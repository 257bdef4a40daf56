"""Make ``ninfer_bench`` importable when a script runs from a plain checkout (no ``pip install``).

The package maps the repository root itself (``package-dir = {"ninfer_bench" = "."}``), so a plain
``sys.path`` entry cannot find it by name; this registers the root under that name instead.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def unshadow() -> None:
    """Drop the repository root from ``sys.path`` (``python -m pytest`` and ``python -c`` put the working directory
    there): its top-level folders are this package's modules, and as top-level names they shadow installed
    distributions of the same name - transformers >= 5.25 imports Hugging Face's ``kernels`` when it is installed (a
    dependency of theirs now) and got this repository's ``kernels/`` instead."""
    root = str(ROOT)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != root]


def ensure_package(name: str = "ninfer_bench") -> None:
    """Import ``name`` if installed; otherwise load the repository root as that package. Either way the root itself
    leaves ``sys.path`` first (:func:`unshadow`)."""
    unshadow()
    try:
        __import__(name)
        return
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location(name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
