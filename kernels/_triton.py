"""Loading Triton lazily, for every kernel module: so ``kernels.*`` import (and their CPU references run)
on machines without Triton, and ``TRITON_INTERPRET`` is read only when a kernel is first used."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def import_error(module: str = "triton") -> str | None:
    """Why ``module`` does not import here, or None when it does."""
    try:
        __import__(module)
    except Exception as exc:  # ImportError, or the package failing to initialise (e.g. no driver)
        return f"{type(exc).__name__}: {exc}"
    return None


def available(module: str = "triton") -> bool:
    """True when ``module`` imports (Triton kernels then run on CUDA tensors, or on CPU under TRITON_INTERPRET=1)."""
    return import_error(module) is None


def jit_module(namespace: dict, helpers: tuple[str, ...], kernels: dict[str, str]) -> dict:
    """Jit a kernel module's functions in place: bind ``tl`` and each ``@triton.jit`` helper in ``namespace``
    (the module's globals, where kernels look their helpers up when they compile) and return the jitted
    kernels by key, plus ``"interpreted"`` (True under TRITON_INTERPRET=1)."""
    import triton
    import triton.language

    namespace["tl"] = triton.language
    for name in helpers:
        namespace[name] = triton.jit(namespace[name])
    out = {key: triton.jit(namespace[fn]) for key, fn in kernels.items()}
    out["interpreted"] = not isinstance(next(iter(out.values())), triton.runtime.JITFunction)
    return out
