"""Launch helpers every kernel module shares: Triton loaded lazily (so ``kernels.*`` import, and their CPU references
run, on machines without Triton, and ``TRITON_INTERPRET`` is read only when a kernel is first used), programmatic
dependent launch, the CUDA-graph and split-K scopes, each device's split-K scratch, and the kernels' counted knobs
from the environment (:func:`env_count`)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch


def env_count(var: str, default: int, what: str) -> int:
    """A positive-integer knob from the environment (``what`` it counts, for the error): ``default`` when unset or
    blank; anything else is refused by name."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{var}: {raw!r}: expected {what} (a positive integer)")
    return int(raw)


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


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): a tile dimension (Triton's aranges need powers of two)."""
    return 1 << max(0, (n - 1).bit_length())


def num_sms(device: torch.device | str | int) -> int:
    """Multiprocessors of a CUDA device (a device, its name or its index; ``cuda`` is the current one); 8 for any
    other device, where the Triton interpreter runs programs one by one and only a plan's split logic matters."""
    if isinstance(device, int):
        return _cuda_sms(device)
    device = torch.device(device)
    if device.type != "cuda":
        return 8
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def ready(op: str, kernels, x: torch.Tensor) -> dict:
    """``kernels()`` (a module's jitted kernels) for a launch of ``op`` on ``x``'s device: a RuntimeError when triton
    does not import, a ValueError for CPU tensors unless the kernels run in the interpreter."""
    err = import_error()
    if err is not None:
        raise RuntimeError(f"{op} needs triton, which does not import here ({err})")
    kern = kernels()
    if x.device.type != "cuda" and not kern["interpreted"]:
        raise ValueError(f"{op}: the kernels run on CUDA tensors (or with TRITON_INTERPRET=1 set before their first "
                         f"use), got {x.device}")
    return kern


def jit_module(namespace: dict, helpers: tuple[str, ...], kernels: dict[str, str]) -> dict:
    """Jit a kernel module's functions in place: bind ``tl``, ``pdl_enter(PDL)`` (see :func:`pdl_args`) and each
    ``@triton.jit`` helper in ``namespace`` (the module's globals, where kernels look their helpers up when they
    compile) and return the jitted kernels by key, plus ``"interpreted"`` (True under TRITON_INTERPRET=1)."""
    import triton
    import triton.language

    namespace["tl"] = triton.language
    namespace["pdl_enter"] = _jit_pdl_enter()
    for name in helpers:
        namespace[name] = triton.jit(namespace[name])
    out = {key: triton.jit(namespace[fn]) for key, fn in kernels.items()}
    out["interpreted"] = not isinstance(next(iter(out.values())), triton.runtime.JITFunction)
    return out


@functools.lru_cache(maxsize=None)
def _jit_pdl_enter():
    import triton
    import triton.language
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    globals().update(tl=triton.language, gdc_wait=gdc_wait, gdc_launch_dependents=gdc_launch_dependents)
    return triton.jit(_pdl_enter)


# ---- programmatic dependent launch (PDL), process-wide; off here, the engine sets it from EngineOptions.pdl -------
# With it on, the decode step's kernels (these Triton glue kernels and qmv) launch with programmatic stream
# serialization on sm_90+: a kernel may start while the one before it finishes. Each Triton kernel then waits
# (griddepcontrol.wait) before its first load and at once lets the next kernel launch
# (griddepcontrol.launch_dependents), so the next kernel's launch, and qmv's first weight loads, overlap its work.
# A kernel launched without PDL (torch's) waits for the one before to finish, as always; CUDA graphs keep the
# programmatic edges. Only launches into a CUDA-graph capture use it (and the warm-up runs before one, inside
# :func:`graph_scope`, so the PDL variants compile outside the capture): an eager launch is host-bound, PDL cannot
# overlap anything there, and qmv's PDL launch goes through ctypes.
_PDL = {"on": False, "scope": 0, "held": 0}


def set_pdl(on: bool) -> None:
    """Launch the Triton decode kernels with programmatic dependent launch from now on (sm_90+ CUDA only)."""
    _PDL["on"] = bool(on)


def pdl_enabled() -> bool:
    return _PDL["on"]


@contextlib.contextmanager
def pdl_held():
    """Launches inside go without PDL whatever the switch says (the engine captures its batched decode steps so:
    engine/model/graphs.py, PDL_MAX_SEQS; and spec/draft_graphs.py)."""
    _PDL["held"] += 1
    try:
        yield
    finally:
        _PDL["held"] -= 1


@functools.lru_cache(maxsize=None)
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


@contextlib.contextmanager
def graph_scope():
    """Launches inside count as launches into a CUDA-graph capture (the engine's graph capture wraps its warm-up runs
    and
    the capture in it)."""
    _PDL["scope"] += 1
    try:
        yield
    finally:
        _PDL["scope"] -= 1


_SPLIT_K = {"off": 0}


@contextlib.contextmanager
def single_pass():
    """Projections launched inside take K in one pass (no split-K). Every split-K launch of a device shares one
    scratch (kernels/qlinear.py, kernels/qmv_cuda.py): launches that may run beside others on another stream (the
    fast path's CUDA-graph branches) must not use it."""
    _SPLIT_K["off"] += 1
    try:
        yield
    finally:
        _SPLIT_K["off"] -= 1


def split_k_allowed() -> bool:
    return not _SPLIT_K["off"]


def in_graph_scope() -> bool:
    """Inside :func:`graph_scope`, or capturing on the current stream."""
    if _PDL["scope"]:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def pdl_now(device) -> bool:
    """Whether a launch on ``device`` now uses PDL: the switch is on, the device is an sm_90+ GPU (never under the
    interpreter: its tensors are on the CPU) and the launch is for a CUDA graph (:func:`in_graph_scope`)."""
    if not _PDL["on"] or _PDL["held"] or device.type != "cuda":
        return False
    return _sm90(device.index if device.index is not None else 0) and in_graph_scope()


def pdl_args(device) -> dict:
    """The launch arguments of a PDL-aware kernel on ``device``: its ``PDL`` constexpr, and Triton's ``launch_pdl``
    when :func:`pdl_now`."""
    return {"PDL": True, "launch_pdl": True} if pdl_now(device) else {"PDL": False}


def _pdl_enter(PDL: tl.constexpr):  # noqa: F821 - tl and gdc_* are bound by jit_module, as in the kernel modules
    """First call of every PDL-aware kernel (bound as ``pdl_enter`` by :func:`jit_module`)."""
    if PDL:
        gdc_wait()  # noqa: F821 - the kernel before has finished and its writes are visible
        gdc_launch_dependents()  # noqa: F821 - the next kernel may launch now, overlapping this kernel's work


_MAX_TILES = 1 << 16  # split-K arrival counters a device's scratch holds


def split_k_scratch(store: dict, device, floats: int, tiles: int, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``store[device]``: (fp32 sums of at least ``floats``, ``_MAX_TILES`` int32 arrival counters), made zeroed
    and grown on demand - never inside a CUDA-graph capture, where allocating is not allowed."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # one scratch a GPU, however the device is spelled
        device = torch.device("cuda", torch.cuda.current_device())
    if tiles > _MAX_TILES:
        raise ValueError(f"{who}: {tiles} output tiles exceed the split-K counters ({_MAX_TILES})")
    ws, counters = store.get(device, (None, None))
    if ws is None or ws.numel() < floats:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{who}: the split-K workspace must grow outside CUDA-graph capture "
                               "(build the PackedLinear, or call once, before capturing)")
        ws = torch.zeros(max(floats, 1 << 20), dtype=torch.float32, device=device)
        counters = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
        store[device] = (ws, counters)
    return ws, counters
