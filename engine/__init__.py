"""The engine: ``from ninfer_bench.engine import Engine`` (DESIGN.md's API). Imported on first use, so importing the
package (or a submodule such as ``engine.model.config``) does not load the runtime's modules."""

from __future__ import annotations

__all__ = ["Engine"]


def __getattr__(name: str):
    if name == "Engine":
        from .runtime.engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
