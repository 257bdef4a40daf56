"""The engine: ``from ninfer_bench.engine import Engine`` (docs/DESIGN.md, "Engine and runtime"). Imported on first
use, so importing the package (or a submodule such as ``engine.model.config``) does not load the runtime's modules.

Subpackages, one concern each (dependencies point down the list; ``pyproject.toml``'s import-linter contracts):
``serve`` (HTTP), ``runtime`` (the Engine, options, scheduler), ``spec`` (drafters and the speculative round) beside
``artifact`` (files, conversion, loading), ``media`` (images and videos in prompts), ``model`` (the forward, caches,
weights, CUDA graphs), and ``sampling`` (token selection)."""

from __future__ import annotations

__all__ = ["Engine"]


def __getattr__(name: str):
    if name == "Engine":
        from .runtime.engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
