"""The kernels suite: the model's hot decode ops at their real shapes, timed, checked against a reference in the
same run, and set against the device's copy bandwidth measured in the same run.

What is measured is declared, not coded into the runner: ``suites/kernel_registry.py`` registers each op with
``@register(op=..., family=...)``. An entry builds, for a model config and T new tokens, seeded random inputs
(never zeros), a plain fp32 (fp64 for sampling) reference and the implementations each runtime runs:

- ``v2``, the previous generation: dense weights in the compute dtype and torch ops (F.linear on the dequantized
  weight, SDPA on a dequantized K/V copy, the torch GDN step loop, eager glue);
- ``v3``, the current one: packed-quant Triton qlinear, Triton decode attention on the int8 cache, the fused GDN and
  glue kernels when ``kernels/gdn_triton.py`` / ``kernels/fused.py`` import. On a CPU v3 runs what the engine runs
  there (the torch path) and the record's ``note`` says so.

One record per (op, shape, variant, t): ``us_median``/``us_p10``/``us_p90`` over the per-repeat ``samples_us``;
``bytes``, the fewest bytes the op must move with the model's stored formats (weights as stored + activations in
and out; K/V codes + scales for the valid length; the fp32 GDN state read and written) - the same for every variant,
so ``gbps = bytes / median time`` is an effective bandwidth and ``roofline_fraction = gbps / copy bandwidth`` says
how close the variant gets to the op's memory floor; ``max_rel_err``, the largest relative RMS error
``||out - ref|| / ||ref||`` over the op's outputs (e.g. a GDN step's o and new state), with the op's ``tolerance``
and ``ok``; ``note``, what ran; ``fmt``, a projection's weight format.

Weight formats. With ``--model`` the projections are timed in the formats the artifact stores (a q8 artifact's
weights as q8); ``--quant`` overrides them with a policy's (``engine.convert.weight_format``), and the run's
``config.quant`` and default label say so. A preset (``--shape``) has no stored formats: its policy is ``--quant``,
mixed by default.

Timing. CUDA: warm-up calls, then each repeat preceded by an L2 flush (a 256 MB write) and timed with CUDA events
around the op only (``summary.timer = "cuda-events"``); v2 runs eagerly, as that runtime does, and v3 as the replay
of a CUDA graph of the op, as the v3 runtime runs decode (record ``timing``: "cuda-graph", or "eager" where capture
fails). CPU: ``time.perf_counter`` around each call, fewer repeats, no flush (``summary.timer = "torch-cpu"``): CPU
timings are not GPU numbers.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..engine.config import ModelConfig, preset
from ..engine.convert import POLICIES, weight_format as policy_format
from ..reports.schema import make_result
from .common import copy_bandwidth

VARIANTS = ("v2", "v3")
CUDA_SHAPE, CPU_SHAPE = "qwen3.8-27b", "tiny"
CUDA_CONTEXTS, CPU_CONTEXTS = (8192, 65536), (1024, 4096)
FLUSH_BYTES = 256 << 20  # written before every timed CUDA repeat: several times the H200's 50 MB L2
LAYER_PREFIX = re.compile(r"^model\.layers\.\d+\.")  # a decoder layer's weights, whichever layer


# ---- the registry ------------------------------------------------------------------------------------------
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


def entries(patterns: Sequence[str] = ()) -> list[OpEntry]:
    """The registered ops whose required module imports, filtered by op-name substrings (any of ``patterns``)."""
    from . import kernel_registry  # noqa: F401  (the declarations register themselves on import)

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
        else the quant policy's (``engine.convert.weight_format``)."""
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


# ---- options and timing ------------------------------------------------------------------------------------
@dataclass(slots=True)
class KernelOptions:
    """Everything a kernels run depends on (recorded as the result's ``config``)."""

    shape: str | None = None  # a preset; default: qwen3.8-27b on CUDA, tiny on a CPU
    model: str | None = None  # an artifact path whose config gives the shapes
    ts: tuple[int, ...] = (1, 8)
    variants: tuple[str, ...] = VARIANTS
    ops: tuple[str, ...] = ()  # op-name substrings; empty: every op
    quant: str | None = None  # a policy; default: an artifact's stored formats (--model), mixed (a preset)
    contexts: tuple[int, ...] | None = None  # attention K/V lengths; default 8K, 64K on CUDA and 1K, 4K on a CPU
    repeats: int | None = None  # default 50 on CUDA, 10 on a CPU
    warmup: int | None = None  # default 5 on CUDA, 1 on a CPU
    device: str = "auto"
    label: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.shape is not None and self.model is not None:
            raise ValueError("give --shape (a preset) or --model (an artifact), not both")
        if not self.ts or any(t < 1 for t in self.ts):
            raise ValueError(f"--t must list token counts >= 1, got {list(self.ts)}")
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise ValueError(f"--kernels must list variants among {', '.join(VARIANTS)}, got {list(self.variants)}")
        if self.quant is not None and self.quant not in POLICIES:
            raise ValueError(f"--quant must be one of {', '.join(POLICIES)}, got {self.quant!r}")
        if self.contexts is not None and (not self.contexts or any(c < max(self.ts) for c in self.contexts)):
            raise ValueError(f"--contexts must be K/V lengths >= the largest T, got {list(self.contexts)}")
        for name in ("repeats", "warmup"):
            v = getattr(self, name)
            if v is not None and v < (1 if name == "repeats" else 0):
                raise ValueError(f"--{name} must be >= {1 if name == 'repeats' else 0}, got {v}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible here (use --device cpu)")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def time_cuda(fn, repeats: int, warmup: int, flush: torch.Tensor) -> list[float]:
    """Microseconds per call: CUDA events around the op only, each repeat after an L2 flush."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in events]


def cuda_graph(fn):
    """``fn`` captured in a CUDA graph (after warm-up calls on a side stream, as capture needs); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_cpu(fn, repeats: int, warmup: int) -> list[float]:
    """Microseconds per call by the host clock (torch on a CPU runs synchronously)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return samples


# ---- the run -----------------------------------------------------------------------------------------------
def stored_formats(art) -> dict[str, str]:
    """An artifact's weight formats by name with the decoder-layer prefix dropped (``self_attn.o_proj.weight``,
    ``lm_head.weight``); where layers store one weight in several formats, the most common one."""
    counts: dict[str, Counter] = {}
    for name in art.names("model.") + art.names("lm_head"):
        target = art.bindings[name]
        ids = target["parts"] if isinstance(target, dict) else [target]
        counts.setdefault(LAYER_PREFIX.sub("", name), Counter()).update(art.objects[i].format for i in ids)
    return {key: c.most_common(1)[0][0] for key, c in counts.items()}


def model_config(opts: KernelOptions, device: torch.device) -> tuple[ModelConfig, dict, dict[str, str] | None]:
    """The shapes to measure at: an artifact's text config (``--model``) or a preset; the result's ``model``; and
    the artifact's stored weight formats, which the projections are timed in unless ``--quant`` names a policy
    (None: the policy's formats)."""
    if opts.model is None:
        name = opts.shape or (CUDA_SHAPE if device.type == "cuda" else CPU_SHAPE)
        return preset(name), {"preset": name, "synthetic": True, "quant_policy": opts.quant or "mixed"}, None
    from ..engine.artifact import Artifact

    if not Path(opts.model).is_file():
        raise ValueError(f"--model {opts.model}: no such artifact file")
    with Artifact.open(opts.model) as art:
        text = (art.components or {}).get("text")
        if not text:
            raise ValueError(f"{opts.model}: artifact has no text component")
        cfg = ModelConfig.from_dict(dict(text["config"]))
        info = {"path": str(Path(opts.model).resolve()), "artifact_id": art.artifact_id, "preset": None,
                "format_version": art.version, "model_id": (art.metadata or {}).get("model_id"),
                "quant_policy": (art.metadata or {}).get("quant_policy")}  # how the artifact was converted
        formats = stored_formats(art) if opts.quant is None else None
    return cfg, info, formats


def default_label(opts: KernelOptions, model: dict, device: torch.device) -> str:
    """``kernels-<preset or artifact file>[-<quant>]-<device>``: a --quant that overrides an artifact's stored
    formats is named, as those timings are not the artifact's."""
    if opts.model is None:
        return f"kernels-{model['preset']}-{device.type}"
    quant = f"-{opts.quant}" if opts.quant is not None else ""
    return f"kernels-{Path(opts.model).stem}{quant}-{device.type}"


def _failed(rec: dict, err: Exception) -> dict:
    rec.update(us_median=None, us_p10=None, us_p90=None, samples_us=[], gbps=None, roofline_fraction=None,
               max_rel_err=None, ok=False, note=f"error: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    return rec


def measure(case: Case, ref, variant: str, base: dict, tolerance: float, timer, copy_gbps: float,
            graph: bool = False) -> dict:
    """Check one implementation against the reference, then time it (``graph``: its CUDA-graph replay, as the
    v3 runtime runs decode; eagerly when capture fails): one record."""
    impl = case.impls[variant]
    rec = {**base, "variant": variant, "bytes": case.bytes, "tolerance": tolerance, "note": impl.note,
           "timing": "eager"}
    try:
        err = max_rel_err((impl.check or impl.run)(), ref)
        run = impl.run
        if graph:
            try:
                run, rec["timing"] = cuda_graph(impl.run), "cuda-graph"
            except Exception as e:  # e.g. an op that synchronises with the host cannot be captured
                torch.cuda.synchronize()
                rec["note"] += f"; graph capture failed ({type(e).__name__}), timed eagerly"
        samples = timer(run)
    except Exception as e:  # a broken kernel is a failed record, not an aborted run
        return _failed(rec, e)
    med = float(np.median(samples))
    gbps = case.bytes / med / 1e3 if med > 0 else None  # bytes / us -> GB/s
    rec.update(us_median=med, us_p10=float(np.percentile(samples, 10)), us_p90=float(np.percentile(samples, 90)),
               samples_us=samples, gbps=gbps, roofline_fraction=gbps / copy_gbps if gbps and copy_gbps else None,
               max_rel_err=err, ok=math.isfinite(err) and err <= tolerance)
    return rec


def failure_text(rec: dict) -> str:
    what = f"{rec['op']} {'x'.join(map(str, rec['shape'] or []))} {rec['variant']} t={rec['t']}"
    if rec["max_rel_err"] is None:
        return f"{what}: {rec['note']}"
    return f"{what}: max_rel_err {rec['max_rel_err']:.2e} > tolerance {rec['tolerance']:.1e}"


def run_kernels(opts: KernelOptions, progress=None) -> dict:
    """Run the kernels suite; returns the result document. ``progress(done, total, what)`` reports each record."""
    device = resolve_device(opts.device)
    cfg, model, formats = model_config(opts, device)
    cuda = device.type == "cuda"
    repeats = opts.repeats or (50 if cuda else 10)
    warmup = opts.warmup if opts.warmup is not None else (5 if cuda else 1)
    ctx = KernelContext(cfg, device, torch.bfloat16 if cuda else torch.float32, opts.quant or "mixed",
                        tuple(opts.contexts or (CUDA_CONTEXTS if cuda else CPU_CONTEXTS)), opts.seed, formats)
    todo = entries(opts.ops)
    if not todo:
        raise ValueError(f"--ops {','.join(opts.ops)}: no registered op matches")
    copy_gbps = copy_bandwidth(device, None if cuda else 64 << 20, repeats=10 if cuda else 5) / 1e9
    if cuda:
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
        timer = functools.partial(time_cuda, repeats=repeats, warmup=warmup, flush=flush)
    else:
        timer = functools.partial(time_cpu, repeats=repeats, warmup=warmup)
    plan = [(e, p) for e in todo for p in (e.params(ctx) if e.params else (None,))]
    total, done = len(plan) * len(opts.ts) * len(opts.variants), 0
    records = []
    for entry, param in plan:
        tol = entry.tolerance[0 if ctx.dtype == torch.float32 else 1]
        for t in opts.ts:
            base = {"op": entry.op, "family": entry.family, "t": t, "shape": None}
            try:
                case = entry.build(ctx, t, param)
                base.update(shape=list(case.shape), **case.extra)
                ref = case.reference()
            except Exception as e:  # inputs or reference could not be made: every variant fails
                case, ref, built = None, None, e
            for variant in opts.variants:
                if case is None:
                    records.append(_failed({**base, "variant": variant, "bytes": None, "tolerance": tol,
                                            "timing": None}, built))
                elif variant in case.impls:
                    records.append(measure(case, ref, variant, base, tol, timer, copy_gbps, cuda and variant == "v3"))
                done += 1
                if progress:
                    progress(done, total, f"{entry.op} t={t} {variant}")
            del case, ref
        ctx.clear()  # weights and caches of this op (and param) are not needed again
    failures = [failure_text(r) for r in records if not r["ok"]]
    summary = {"ops": len({r["op"] for r in records}), "checks": len(records), "copy_bandwidth_gbps": copy_gbps,
               "timer": "cuda-events" if cuda else "torch-cpu", "device": str(device),
               "gpu": torch.cuda.get_device_name(device) if cuda else None, "failures": failures,
               "families": sorted({r["family"] for r in records})}
    config = asdict(opts)
    config.update(shape=model.get("preset"), ts=list(opts.ts), variants=list(opts.variants), ops=list(opts.ops),
                  contexts=list(ctx.contexts), repeats=repeats, warmup=warmup, device=str(device),
                  dtype=str(ctx.dtype).replace("torch.", ""), quant=None if formats is not None else ctx.quant,
                  weight_formats="artifact" if formats is not None else "quant policy",
                  label=opts.label or default_label(opts, model, device))
    return make_result("kernels", label=config["label"], config=config, records=records, summary=summary,
                       model=model)
