"""What the kernels suite measures, declared: :func:`register` binds an op name to a builder that makes a
:class:`Case` (seeded inputs, the fp32 reference, an :class:`Impl` per runtime variant, the bytes the op must move)
from a :class:`KernelContext` (model config, device, dtype, weight formats). ``suites/kernel_registry.py`` gathers
the declarations (``suites/kernel_projections.py``, ``suites/kernel_ops.py``), ``suites/kernels.py`` times them."""

from __future__ import annotations

import functools
import importlib
import math
import re
import zlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..engine.artifact.convert import weight_format as policy_format
from ..engine.model.config import ModelConfig

CPU_CONTEXTS = (1024, 4096)  # attention K/V lengths on a CPU (suites/kernels.py has the CUDA ones)
LAYER_PREFIX = re.compile(r"^model\.layers\.\d+\.")  # a decoder layer's weights, whichever layer


@dataclass(slots=True)
class Impl:
    """One implementation of an op. ``run()`` is what is timed; ``check()`` (default: ``run``) returns the outputs
    compared with the reference - a separate call from fresh state for ops that update caches in place."""

    run: Callable[[], object]
    note: str = ""
    check: Callable[[], object] | None = None


@dataclass(slots=True)
class Case:
    """One op at one shape and T: its reference, implementations by variant, and the bytes it must move."""

    shape: list[int]
    bytes: int
    reference: Callable[[], object]
    impls: dict[str, Impl]
    extra: dict = field(default_factory=dict)  # more record fields (weight format, context length, ...)
    # v3 as a decode step launches it layer after layer: ``chain(n)`` returns a run of n launches of the op, each on
    # its own copy of the weights (suites/kernels.py times it as one CUDA graph); None where no chain is measured
    chain: Callable[[int], Callable[[], object]] | None = None


@dataclass(frozen=True, slots=True)
class OpEntry:
    op: str
    family: str
    build: Callable  # (ctx: KernelContext, t: int, param) -> Case
    tolerance: tuple[float, float]  # relative RMS allowed with fp32 / with bf16 (fp16) compute
    params: Callable | None  # ctx -> the values one op is measured at (e.g. context lengths); None: one case
    requires: str | None  # a kernels/ module that must import for the op to be measured


REGISTRY: dict[str, OpEntry] = {}


def register(*, op: str, family: str, tolerance: tuple[float, float] = (1e-4, 1e-2), params=None,
             requires: str | None = None):
    """Declare an op: the decorated ``build(ctx, t, param) -> Case`` makes its inputs, reference and variants."""

    def deco(build):
        if op in REGISTRY:
            raise ValueError(f"kernel op {op!r} is registered twice")
        REGISTRY[op] = OpEntry(op, family, build, tuple(tolerance), params, requires)
        return build

    return deco


@functools.cache
def optional_kernels(name: str, runnable: bool = False):
    """``ninfer_bench.kernels.<name>`` when it imports (and with ``runnable``, when its Triton imports too), else
    None: a module still being written counts as absent."""
    try:
        mod = importlib.import_module(f"..kernels.{name}", __package__)
    except Exception:  # ImportError, or a half-written module failing on import
        return None
    return mod if not runnable or mod.triton_available() else None


def v3_impl(ctx: KernelContext, fast: Impl, eager: Impl, available: bool = True) -> Impl:
    """v3: ``fast`` on CUDA when its kernels are available, else what the engine runs instead (the eager path)."""
    if ctx.cuda and available:
        return fast
    where = "CPU: what the engine runs for v3 on a CPU" if not ctx.cuda else "the fast kernel does not apply here"
    return Impl(eager.run, f"{eager.note} ({where})", eager.check)


def registered(patterns: Sequence[str] = ()) -> list[OpEntry]:
    """The ops registered so far whose required module imports, filtered by op-name substrings (any of
    ``patterns``); :func:`.kernel_registry.entries` imports every declaration first."""
    out = [e for e in REGISTRY.values() if e.requires is None or optional_kernels(e.requires) is not None]
    return [e for e in out if not patterns or any(p in e.op for p in patterns)]


@dataclass(slots=True)
class KernelContext:
    """What op builders read: the model config, device, compute dtype, weight formats (an artifact's stored ones, or
    a quant policy's), attention context lengths."""

    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype
    quant: str = "mixed"  # the policy that gives the weight formats where ``formats`` is None
    contexts: tuple[int, ...] = CPU_CONTEXTS
    seed: int = 0
    formats: dict[str, str] | None = None  # an artifact's stored formats by layer-free name (:func:`stored_formats`)
    _memo: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def elt(self) -> int:
        """Bytes per activation element in the compute dtype."""
        return torch.empty(0, dtype=self.dtype).element_size()

    def weight_format(self, name: str, shape: tuple[int, int]) -> str:
        """The format projection weight ``name`` is timed in: the artifact's, where its stored formats are used,
        else the quant policy's (``engine.artifact.convert.weight_format``)."""
        if self.formats is None:
            return policy_format(name, shape, self.quant)
        key = LAYER_PREFIX.sub("", name)
        if key not in self.formats:
            raise ValueError(f"the artifact stores no {key} to take its format from (give --quant to time the op "
                             "in a policy's formats)")
        return self.formats[key]

    def memo(self, key, make):
        """``make()`` once per key until :meth:`clear` (weights shared by an op's T values)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def clear(self) -> None:
        self._memo.clear()
        if self.cuda:
            torch.cuda.empty_cache()

    def generator(self, *key) -> torch.Generator:
        """A generator seeded from the run seed and ``key``: each op's inputs stay the same when others are added."""
        g = torch.Generator(device=self.device)
        g.manual_seed(self.seed * 1_000_003 + zlib.crc32(repr(key).encode()))
        return g

    def randn(self, *shape, gen: torch.Generator, dtype=None, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32)
        return (x * scale).to(dtype or self.dtype)


def max_rel_err(out, ref) -> float:
    """The largest relative RMS error ``||out - ref|| / ||ref||`` over the outputs (a tensor or a tuple of them)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    if len(outs) != len(refs):
        raise ValueError(f"{len(outs)} outputs against {len(refs)} reference outputs")
    errs = []
    for o, r in zip(outs, refs):
        if tuple(o.shape) != tuple(r.shape):
            raise ValueError(f"output shape {tuple(o.shape)} differs from the reference's {tuple(r.shape)}")
        o, r = o.detach().double(), r.detach().to(o.device).double()
        num, den = float((o - r).norm()), float(r.norm())
        errs.append(num / den if den else (0.0 if num == 0 else math.inf))
    return math.nan if any(math.isnan(e) for e in errs) else max(errs)
