"""The kernels suite: the model's hot decode ops at their real shapes, timed, checked against a reference in the
same run, and set against the device's copy bandwidth measured in the same run.

What is measured is declared, not coded into the runner: ``suites/kernel_registry.py`` (and, for the projections,
``suites/kernel_projections.py``) registers each op with ``@register(op=..., family=...)`` (the vocabulary is
``suites/kernel_cases.py``). An entry builds, for a model config
and T new tokens, seeded random inputs (never zeros), a plain fp32 (fp64 for sampling) reference and the
implementations each runtime runs:

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

Chains (CUDA, v3 projections, ``--chain``). A single timed launch also pays a CUDA graph's launch, a few
microseconds that a decode step pays once for its hundreds of kernels; at the 27B's smaller projections that is a
third of the time. So each v3 projection is also timed as one graph of ``chain_launches`` launches, each on its own
copy of the weights (no launch finds the one before's bytes in the L2), with programmatic dependent launch as the
engine captures its step: ``chain_us`` is that graph's time over its launches and ``chain_fraction`` its share of
the copy bandwidth - what the projection costs a layer inside a step. By default (auto) a chain's copies hold at
least CHAIN_BYTES (at most MAX_CHAIN launches); a weight that large alone (the lm_head) gets no chain.

Weight formats. With ``--model`` the projections are timed in the formats the artifact stores (a q8 artifact's
weights as q8); ``--quant`` overrides them with a policy's (``engine.artifact.convert.weight_format``), and the run's
``config.quant`` and default label say so. A preset (``--shape``) has no stored formats: its policy is ``--quant``,
mixed by default.

Timing. CUDA: warm-up calls, then each repeat preceded by an L2 flush and timed with CUDA events around the op only;
v2 runs eagerly, as that runtime does, and v3 as the replay of a CUDA graph of the op, as the v3 runtime runs decode
(record ``timing``: "cuda-graph", or "eager" where capture fails). The flush (``--l2-flush``) reads a 256 MB buffer by
default (``summary.timer = "cuda-events-clean-l2"``): the op then starts with an L2 of clean lines that are not its
own, as in a decode step, where the kernel before read weights. ``write`` (``summary.timer = "cuda-events"``, the
suite's flush before session 67) zeroes the buffer instead, which leaves the L2 full of dirty lines: a
memory-bound op then writes them back to HBM as its reads evict them, up to the L2's size of extra traffic (Nsight
Compute on an H100: 5-25 MB written back by 27B projections of 17-95 MB that write 10 KB, 1.14-1.27x their time).
Reports refuse to compare runs whose timers differ. CPU: ``time.perf_counter`` around each call, fewer repeats, no
flush (``summary.timer = "torch-cpu"``): CPU timings are not GPU numbers.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..engine.artifact.convert import POLICIES
from ..engine.model.config import ModelConfig, preset
from ..engine.runtime.options import EngineOptions, resolve_device
from ..reports.schema import make_result
from .common import copy_bandwidth
from .kernel_cases import CPU_CONTEXTS, LAYER_PREFIX, Case, KernelContext, max_rel_err
from .kernel_registry import entries

VARIANTS = ("v2", "v3")
CUDA_SHAPE, CPU_SHAPE = "qwen3.8-27b", "tiny"
CUDA_CONTEXTS = (8192, 65536)
FLUSH_BYTES = 256 << 20  # read (or written) before every timed CUDA repeat: several times the H200's 50 MB L2
L2_FLUSHES = {"read": "cuda-events-clean-l2", "write": "cuda-events"}  # --l2-flush -> summary.timer
# a v3 projection's chain (--chain auto): launches enough that their weight copies hold at least CHAIN_BYTES (the one
# graph launch's fixed cost spread over them), at most MAX_CHAIN; a weight of CHAIN_BYTES or more is timed alone
CHAIN_BYTES = 512 << 20
MAX_CHAIN = 32


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
    # the engine's own decode step profiled after the ops (suites/step_timeline.py): each kernel's share of it
    timeline: bool = False
    timeline_steps: int = 32
    l2_flush: str = "read"  # CUDA: how each timed repeat evicts the L2 (L2_FLUSHES)
    chain: int | None = None  # CUDA v3 projections: launches a chain (chain_launches; None: auto, 0: none)

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
        if self.chain is not None and (self.chain < 0 or self.chain == 1 or self.chain > MAX_CHAIN):
            raise ValueError(f"--chain must be auto, 0 (off) or 2..{MAX_CHAIN} launches, got {self.chain}")
        if self.l2_flush not in L2_FLUSHES:
            raise ValueError(f"--l2-flush must be one of {', '.join(L2_FLUSHES)}, got {self.l2_flush!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.timeline_steps < 1:
            raise ValueError(f"--timeline-steps must be >= 1, got {self.timeline_steps}")


def l2_flusher(buf: torch.Tensor, mode: str):
    """A callable that evicts the L2 by streaming ``buf`` (float32, several times the L2): ``read`` sums it into a
    one-element sink (the L2 then holds clean lines), ``write`` zeroes it (dirty lines, written back to memory while
    the next kernel evicts them). ``read`` first makes the buffer's own lines clean: two passes after a write."""
    if mode == "write":
        return buf.zero_
    if mode != "read":
        raise ValueError(f"l2 flush must be one of {', '.join(L2_FLUSHES)}, got {mode!r}")
    sink = torch.empty((), dtype=buf.dtype, device=buf.device)

    def read():
        torch.sum(buf.view(-1), dim=0, out=sink)
    for _ in range(2):
        read()
    return read


def time_cuda(fn, repeats: int, warmup: int, flush) -> list[float]:
    """Microseconds per call: CUDA events around the op only, each repeat after ``flush()`` (:func:`l2_flusher`)."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        flush()
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


def chain_launches(op_bytes: int, chain: int | None) -> int:
    """Launches in an op's chain: ``chain`` when given (0: none), else enough that their weights hold CHAIN_BYTES,
    at most MAX_CHAIN; 0 where one launch alone moves that much (its graph launch's fixed cost is small beside it)."""
    if chain is not None:
        return chain
    n = min(MAX_CHAIN, -(-CHAIN_BYTES // max(1, op_bytes)))
    return n if n >= 2 else 0


@contextlib.contextmanager
def step_capture(pdl: bool):
    """Launches made inside are captured as the engine captures its decode step: with programmatic dependent launch
    on when ``pdl`` (the engine's default, EngineOptions.pdl), so each launch may start while the one before
    finishes; the PDL switch is restored after."""
    from ..kernels import _triton

    was = _triton.pdl_enabled()
    _triton.set_pdl(pdl)
    try:
        with _triton.graph_scope():
            yield
    finally:
        _triton.set_pdl(was)


def chain_graph(fn, pdl: bool):
    """``fn`` (a chain of launches) captured under :func:`step_capture`, as one projection follows the kernel before
    it in the step."""
    with step_capture(pdl):
        return cuda_graph(fn)


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
    from ..engine.artifact.reader import Artifact

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
            graph: bool = False, chain: int = 0) -> dict:
    """Check one implementation against the reference, then time it (``graph``: its CUDA-graph replay, as the
    v3 runtime runs decode; eagerly when capture fails): one record. With ``chain`` >= 2 and a ``case.chain``, v3
    is also timed as one graph of ``chain`` launches over as many weight copies (:func:`chain_graph`): the record's
    ``chain_launches``, ``chain_us`` (a launch) and ``chain_fraction`` (of the copy bandwidth)."""
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
    if chain >= 2 and case.chain is not None and variant == "v3" and rec["timing"] == "cuda-graph":
        try:
            us = float(np.median(timer(chain_graph(case.chain(chain), EngineOptions().pdl)))) / chain
        except Exception as e:  # the chain is an extra view: its failure is noted, the record stands
            torch.cuda.synchronize()
            rec["note"] += f"; chain of {chain} failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        else:
            rec.update(chain_launches=chain, chain_us=us,
                       chain_fraction=case.bytes / us / 1e3 / copy_gbps if us > 0 and copy_gbps else None)
    return rec


def failure_text(rec: dict) -> str:
    what = f"{rec['op']} {'x'.join(map(str, rec['shape'] or []))} {rec['variant']} t={rec['t']}"
    if rec["max_rel_err"] is None:
        return f"{what}: {rec['note']}"
    return f"{what}: max_rel_err {rec['max_rel_err']:.2e} > tolerance {rec['tolerance']:.1e}"


def step_timeline(opts: KernelOptions, model: dict, device: torch.device) -> dict:
    """The plain decode step of an engine on the suite's model (the artifact as it stores its weights, or the
    preset's seeded synthetic weights in the suite's quant policy), profiled kernel by kernel."""
    from ..engine.runtime.engine import Engine
    from .decode import free_device_memory
    from .step_timeline import decode_timeline

    source = opts.model or model["preset"]
    engine = Engine.load(source, synthetic=opts.model is None, quant=opts.quant or "mixed", seed=opts.seed,
                         device=str(device), max_context=4096)
    try:
        out = decode_timeline(engine, steps=opts.timeline_steps, seed=opts.seed)
    finally:
        del engine
        free_device_memory()
    out["weights"] = "artifact" if opts.model else f"synthetic {opts.quant or 'mixed'}"
    return out


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
        flush = l2_flusher(torch.zeros(FLUSH_BYTES // 4, dtype=torch.float32, device=device), opts.l2_flush)
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
                    n = chain_launches(case.bytes, opts.chain) if cuda and case.chain is not None else 0
                    records.append(measure(case, ref, variant, base, tol, timer, copy_gbps, cuda and variant == "v3",
                                           n))
                done += 1
                if progress:
                    progress(done, total, f"{entry.op} t={t} {variant}")
            del case, ref
        ctx.clear()  # weights and caches of this op (and param) are not needed again
    timeline = None
    if opts.timeline:
        if progress:
            progress(done, total, "the decode step's timeline")
        timeline = step_timeline(opts, model, device)
    failures = [failure_text(r) for r in records if not r["ok"]]
    summary = {"timeline": timeline,
               "ops": len({r["op"] for r in records}), "checks": len(records), "copy_bandwidth_gbps": copy_gbps,
               "timer": L2_FLUSHES[opts.l2_flush] if cuda else "torch-cpu", "device": str(device),
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
