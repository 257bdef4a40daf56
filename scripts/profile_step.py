#!/usr/bin/env python3
"""Where a decode step's time goes: every GPU kernel of N decode steps (CUDA-graph replays included), from the
torch profiler, grouped by kernel, with the GPU's busy time next to the step's wall time (the difference is the
step's idle gaps: graph launch, the token read-back, host work).

    python3 scripts/profile_step.py --model qwen3.8-27b --synthetic [--steps 32] [--spec none,mtp:3,dflash2:7] [--sync]
        [--no-pdl] [--no-side-stream] [--no-silu-epilogue] [--cublas-dense] [--qmv-layout L]
        [--eager-draft] [--attn-fixed-split]
        [--prefill] [--prompt-len N] [--no-flash-prefill] [--no-fused-prefill] [--prefill-weights dense]
        [--prefill-chunk N] [--no-cudnn-prefill] [--batch 1,8 --sync]  # B sequences a step, as the scheduler steps them
                         # switches against the engine's defaults, compared by step time
        [--host]         # where the host's time goes instead (cProfile of the same steps: Python, launches, syncs)
        [--gaps N]       # the GPU's N longest idle stretches in one more profiled run, with the host's ops meanwhile
        [--drop norm,silu,ba,gdn,attn]   # headroom: the step without those kernels (wrong values, true timing)

Needs CUDA. Timings are the profiler's (CUPTI) kernel durations; the step wall time is measured without the
profiler in the same process first, so the profiler's own overhead does not enter it. The kernels suite's
``--timeline`` is the default step of this, in a result document (suites/step_timeline.py, whose helpers this uses).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def host_profile(run, steps: int, top: int) -> int:
    """cProfile of ``run(steps)``: the host functions by their own time and by their cumulative time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    wall, ran = run(steps)
    prof.disable()
    print(f"with cProfile: {1e3 * wall / ran:.3f} ms a step ({ran} steps or rounds)")
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof).sort_stats(key).print_stats(top)
    return 0


DROPPABLE = {
    "norm": "add_rms_norm / rms_norm between the layers (x = the sublayer's output, no residual)",
    "silu": "silu_mul after gate_up, with --no-silu-epilogue (the down projection reads the gate half)",
    "ba": "the GDN b / a projection (one zero tensor a shape, made at capture)",
    "gdn": "a GDN layer's token mixing (gdn_decode's prep, recurrence and gated-norm launches; a zero output)",
    "attn": "full attention's prologue and attention launches (a zero output; the projections stay)",
}


def drop_launches(eng, names: list[str]) -> None:
    """Replace the named glue of the v3 decode step with launch-free stand-ins (views, or one static tensor): the
    step time without them is the most fusing them into the projections could save."""
    import torch

    from ninfer_bench.kernels import fused

    if "norm" in names:
        fused.add_rms_norm = lambda y, h, w, eps: (y, h)
        fused.rms_norm = lambda x, w, eps: x
    if "silu" in names:
        fused.silu_mul = lambda gu, inter: gu[..., :inter]
    if "ba" in names:
        model = eng.model
        proj = model._proj

        def no_ba(prefix, name, members, sizes, x):
            if not name.endswith("in_proj_ba"):
                return proj(prefix, name, members, sizes, x)
            return list(torch.split(_zeros((*x.shape[:-1], sum(sizes)), x), sizes, dim=-1))

        model._proj = no_ba
    if "gdn" in names:
        from ninfer_bench.engine.model import fused_forward as fastpath

        def no_mix(qkv, z, *_, before_z=None, **__):
            if before_z is not None:
                before_z()  # the z branch still joins the main chain
            return None if z is None else _zeros(z.shape, qkv)

        fastpath.gdn_decode = no_mix
    if "attn" in names:
        from ninfer_bench.engine.model import fused_forward as fastpath

        def no_prologue(qg, *_):
            b, t, h, hd2 = qg.shape
            return _zeros((b, t, h, hd2 // 2), qg), None

        fastpath.fused.attn_prologue = no_prologue
        fastpath.decode_attention = lambda q, *_, **__: q


_STATIC: dict = {}


def _zeros(shape, like):
    """One static zero tensor a shape (graph-safe: made at the first, eager call)."""
    import torch

    key = (tuple(shape), like.dtype, like.device)
    if key not in _STATIC:
        _STATIC[key] = torch.zeros(key[0], dtype=like.dtype, device=like.device)
    return _STATIC[key]


def main() -> int:
    import _bootstrap

    _bootstrap.ensure_package()
    import torch
    from ninfer_bench.engine.runtime.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--spec", default="none", help="none, mtp, dflash2 (NAME or NAME:K), comma-separated: each profiled "
                    "in turn on one weight load")
    ap.add_argument("-k", "--draft-tokens", type=int, default=None)
    ap.add_argument("--batch", default="1", help="sequences decoded together, comma-separated (each profiled): B > 1 "
                                                 "steps B sequences with advance(), as the scheduler does (--sync)")
    ap.add_argument("--runtime", default="v3")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=True,
                    help="the step's kernels with programmatic dependent launch (EngineOptions.pdl, the default)")
    ap.add_argument("--side-stream", action=argparse.BooleanOptionalAction, default=True,
                    help="the GDN b / a and z projections on graph branches (EngineOptions.side_stream)")
    ap.add_argument("--silu-epilogue", action=argparse.BooleanOptionalAction, default=True,
                    help="qmv stores the MLP's silu(gate) * up itself (EngineOptions.silu_epilogue, the default)")
    ap.add_argument("--cublas-dense", action="store_true", help="small dense projections through cuBLAS, not qmv")
    ap.add_argument("--qmv-layout", default="lanes", choices=("tiled", "lanes", "rows"),
                    help="packed weights' layout (EngineOptions.qmv_layout)")
    ap.add_argument("--eager-draft", action="store_true", help="drafting eagerly, not from CUDA graphs")
    ap.add_argument("--sync", action="store_true", help="plain decode reads each token before the next step "
                                                          "(default: the lookahead chain, as generate() runs it)")
    ap.add_argument("--prefill", action="store_true",
                    help="profile one prefill of --prompt-len tokens (the time to first token) instead of decode steps")
    ap.add_argument("--max-context", type=int, default=None,
                    help="EngineOptions.max_context (default: the engine's, raised to fit --prompt-len)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prompt tokens a prefill forward (default: the engine's for the device)")
    ap.add_argument("--prefill-weights", default="auto", choices=("auto", "dense", "packed"))
    ap.add_argument("--flash-prefill", action=argparse.BooleanOptionalAction, default=True,
                    help="prompt chunks' attention by the flash-style kernel (EngineOptions.flash_prefill)")
    ap.add_argument("--cudnn-prefill", action=argparse.BooleanOptionalAction, default=True,
                    help="a long prompt chunk's past keys through cuDNN where it applies (EngineOptions.cudnn_prefill)")
    ap.add_argument("--fused-prefill", action=argparse.BooleanOptionalAction, default=True,
                    help="prompt chunks' GDN glue and norms through Triton kernels (EngineOptions.fused_prefill)")
    ap.add_argument("--attn-fixed-split", action="store_true",
                    help="decode attention splits the key range as for the full cache (no per-row chunk)")
    ap.add_argument("--drop", default="", help="comma list of " + ", ".join(DROPPABLE) + ": the step without "
                    "those launches (its values are wrong; only its time means something: what fusing them away "
                    "could win at most)")
    ap.add_argument("--gdn-block-v", type=int, default=None,
                    help="GDN recurrence state tile width (kernels/gdn_triton.plan's block_v; >= dv fuses the gated "
                         "norm into the recurrence: one launch fewer a layer)")
    ap.add_argument("--lm-head-draft", type=int, default=0,
                    help="drafters score the first / most frequent N tokens only (EngineOptions.lm_head_draft)")
    ap.add_argument("--rollback", default="recompute", choices=("recompute", "snapshot"))
    ap.add_argument("--host", action="store_true",
                    help="profile the host instead (cProfile of the same steps): where a host-bound step's time goes")
    ap.add_argument("--by-op", type=int, default=0, metavar="N",
                    help="also the N torch ops with the most GPU time of their own, each with the line of this package "
                         "that ran it and its input shapes (the profiler records Python stacks and shapes: slower, "
                         "the kernel table unchanged)")
    ap.add_argument("--pdl-variants", default="",
                    help="comma list, each profiled for every --spec item in place of the engine's PDL defaults: "
                         "nopdl (no PDL), l1 / l2 (PDL in every graph, batched and speculative "
                         "included; qmv reads x after its wait through L1 / through L2 only)")
    ap.add_argument("--attn-min-steps", default="",
                    help="comma list of kernels/attn_cuda.SHORT_MIN_STEPS values (16-key steps a split keeps at least "
                         "when a token's key range is short), each profiled for every --spec item in this order")
    ap.add_argument("--draft-attention", default="on",
                    help="on, off or on,off (each profiled for every --spec item): a DFlash / DFlash2 block's "
                         "attention through kernels/draft_attention.py, or the gathered rows and matmuls "
                         "(EngineOptions.draft_attention)")
    ap.add_argument("--replay-acceptance", default=None,
                    help="speculative items' drafts replaced at this acceptance (seed, P or FILE: "
                         "EngineOptions.replay_acceptance) by the continuation of the plain item, which must come "
                         "first in --spec: rounds with accepted drafts on weights that cannot draft")
    ap.add_argument("--gaps", type=int, default=0, metavar="N",
                    help="one more profiled run (kernels and torch ops, no stacks) and its N longest idle stretches "
                         "of the GPU, the lead before the first kernel and the tail after the last included: where "
                         "each falls, the kernels either side and the torch ops the host ran meanwhile")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    drop = [d for d in args.drop.split(",") if d]
    batches = [int(b) for b in args.batch.split(",") if b]
    if not batches or min(batches) < 1 or (max(batches) > 1 and (not args.sync or args.prefill)):
        ap.error("--batch: positive sizes; B > 1 steps the sequences synchronously (give --sync; not --prefill)")
    if set(drop) - set(DROPPABLE):
        ap.error(f"--drop: unknown {sorted(set(drop) - set(DROPPABLE))} (known: {', '.join(DROPPABLE)})")
    if "silu" in drop and args.silu_epilogue:
        ap.error("--drop silu: the silu epilogue launches no silu_mul; add --no-silu-epilogue")
    if args.replay_acceptance is not None and (args.spec.split(",")[0].split(":")[0] != "none" or batches != [1]
                                               or args.prefill):
        ap.error("--replay-acceptance: give the plain item first in --spec (its tokens are the continuation), one "
                 "sequence, decode steps")
    variants = [v for v in args.pdl_variants.split(",") if v] or [None]
    if set(variants) - {None, "nopdl", "l1", "l2"}:
        ap.error(f"--pdl-variants: unknown {sorted(set(variants) - {None, 'nopdl', 'l1', 'l2'})}")
    attns = [a == "on" for a in args.draft_attention.split(",") if a]
    if not attns or set(args.draft_attention.split(",")) - {"on", "off"}:
        ap.error("--draft-attention: on, off or on,off")
    steps_given = [m.strip() for m in args.attn_min_steps.split(",") if m.strip()]
    if not all(m.isdigit() and int(m) > 0 for m in steps_given):
        ap.error(f"--attn-min-steps: positive integers, got {args.attn_min_steps!r}")
    min_steps = [int(m) for m in steps_given] or [None]
    if not torch.cuda.is_available():
        print("profile_step: needs a CUDA GPU", file=sys.stderr)
        return 2

    if args.gdn_block_v:
        from ninfer_bench.kernels import gdn_triton

        plan = gdn_triton.plan
        gdn_triton.plan = lambda dk, dv, block_v=None, num_warps=None: plan(dk, dv, block_v=block_v or args.gdn_block_v,
                                                                            num_warps=num_warps)
    if args.attn_fixed_split:
        from ninfer_bench.kernels import attention_triton

        attention_triton.SHORT_MIN_BLOCKS = 1 << 30  # min_chunk = chunk: the split the grid is sized for
    from ninfer_bench.engine.artifact.loader import load_source
    from ninfer_bench.engine.runtime.options import EngineOptions
    from ninfer_bench.suites.decode import parse_spec

    t0 = time.time()
    loaded = load_source(args.model, synthetic=args.synthetic, device=torch.device("cuda"))
    print(f"loaded in {time.time() - t0:.0f} s: {args.model}", flush=True)
    out = {}
    plain_tokens: list[int] = []  # the plain item's continuation (--replay-acceptance)
    for ms, item, batch, variant, attn in [(m, i, b, v, a) for m in min_steps for i in args.spec.split(",")
                                           for b in batches for v in variants for a in attns]:
        spec, k = parse_spec(item, args.draft_tokens)
        if ms is not None:  # read by attn_cuda.plan as the engine's graphs are captured
            from ninfer_bench.kernels import attn_cuda

            attn_cuda.SHORT_MIN_STEPS = ms
        if not attn and spec not in ("dflash", "dflash2"):
            continue  # the switch changes block drafters only
        opts = EngineOptions(device="cuda", runtime=args.runtime, spec=spec, draft_tokens=k, pdl=args.pdl,
                             side_stream=args.side_stream, silu_epilogue=args.silu_epilogue,
                             qmv_dense=not args.cublas_dense, qmv_layout=args.qmv_layout,
                             draft_graphs=not args.eager_draft, prefill_chunk=args.prefill_chunk,
                             prefill_weights=args.prefill_weights, flash_prefill=args.flash_prefill,
                             fused_prefill=args.fused_prefill, cudnn_prefill=args.cudnn_prefill,
                             rollback=args.rollback,
                             lm_head_draft=args.lm_head_draft if spec != "none" else 0,
                             max_context=args.max_context or max(8192, args.prompt_len + 256),
                             max_concurrency=batch, draft_attention=attn,
                             replay_acceptance=args.replay_acceptance if spec != "none" else None)
        print(f"=== {spec}{f':{k}' if k else ''}{f' batch {batch}' if len(batches) > 1 else ''}"
              f"{f' pdl {variant}' if variant else ''}{'' if attn else ' sdpa draft'}"
              f"{f' attn min steps {ms}' if ms is not None else ''}", flush=True)
        eng = Engine(loaded, opts)
        if variant:  # after the engine's own set_pdl; its graphs are captured at the first run
            from ninfer_bench.engine.model import graphs
            from ninfer_bench.kernels import _triton, qmv_cuda

            _triton.set_pdl(variant != "nopdl")
            graphs.PDL_MAX_SEQS = 64
            qmv_cuda.set_pdl_x_l1(variant != "l2")
        key = item if len(batches) == 1 else f"{item}@B{batch}"
        key = key if not variant else f"{key}/{variant}"
        key = key if ms is None else f"{key}/minsteps{ms}"
        out[key if attn else f"{key}/sdpadraft"] = profile_one(eng, args, drop, batch, plain_tokens)
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(out if len(out) > 1 else next(iter(out.values())), indent=1))
    return 0


def profile_one(eng, args, drop, batch: int = 1, plain_tokens: list | None = None):
    """Profile ``args.steps`` decode steps (rounds) of ``eng``; the record the --json file keeps. A plain engine's
    greedy tokens go into ``plain_tokens``; an engine with replayed acceptance reads them as its continuation."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ninfer_bench.engine.runtime.chain import chainable, decode_chained
    from ninfer_bench.engine.spec import chain as spec_chain
    from ninfer_bench.engine.sampling import SamplingParams
    from ninfer_bench.suites.step_timeline import busy_us, cuda_kernels

    if drop:
        drop_launches(eng, drop)
        print(f"dropped: {', '.join(drop)} (the step's values are wrong from here on; its time is what counts)")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, eng.config.vocab_size - 10, (args.prompt_len,), generator=g).tolist()

    last_stats: dict = {}

    def run_batch(steps: int, prof=None) -> tuple[float, int]:
        """``batch`` sequences (the prompt each) prefilled, then ``steps`` calls of advance() over all of them."""
        seqs = [eng.acquire(prompt, SamplingParams(max_new_tokens=steps * 16 + 16, ignore_eos=True))
                for _ in range(batch)]
        try:
            for seq in seqs:
                eng.start(seq)
            torch.cuda.synchronize()
            t = time.perf_counter()
            with prof if prof is not None else _null():
                for _ in range(steps):
                    eng.advance(seqs)
                torch.cuda.synchronize()
            return time.perf_counter() - t, steps
        finally:
            for seq in seqs:
                eng.release(seq)

    def run(steps: int, prof=None) -> tuple[float, int]:
        """(wall seconds, steps or rounds run): chained, the sequence ends after ``steps`` tokens (a round adds at
        least one: with drafts accepted, fewer rounds run); synchronous, ``steps`` calls of advance()."""
        chained = not args.sync
        limit = steps + 1 if chained else steps * 16 + 16  # the first token comes from the prefill
        seq = eng.acquire(prompt, SamplingParams(max_new_tokens=limit, ignore_eos=True))
        if eng.replay is not None:
            seq.reference = eng.replay.reference(plain_tokens, eng.device)
        try:
            eng.start(seq)
            torch.cuda.synchronize()
            n0 = len(seq.tokens)
            t = time.perf_counter()
            with prof if prof is not None else _null():
                if chained and chainable(eng, seq):
                    decode_chained(eng, seq)  # the host one step behind the GPU (generate()'s greedy path)
                elif chained and spec_chain.chainable(eng, seq):
                    spec_chain.decode_spec_chained(eng, seq)  # rounds captured, the host one round behind
                else:
                    for _ in range(steps):
                        eng.advance([seq])
                torch.cuda.synchronize()
            wall = time.perf_counter() - t
            if eng.drafter is None and plain_tokens is not None:
                plain_tokens[:] = seq.tokens
            last_stats.clear()
            last_stats.update(seq.stats)
            return wall, seq.stats.get("rounds", len(seq.tokens) - n0)
        finally:
            eng.release(seq)

    def run_prefill(_steps: int, prof=None) -> tuple[float, int]:
        seq = eng.acquire(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
        try:
            torch.cuda.synchronize()
            t = time.perf_counter()
            with prof if prof is not None else _null():
                eng.start(seq)  # the prompt's chunks and the first token
                torch.cuda.synchronize()
            return time.perf_counter() - t, 1
        finally:
            eng.release(seq)

    if args.prefill:  # one "step" is one whole prefill
        run, args.steps = run_prefill, 1
    elif batch > 1:
        run = run_batch
    run(4)  # capture the graphs, compile the kernels
    wall, steps = run(args.steps)
    print(f"{steps} steps (rounds) without the profiler: {1e3 * wall / steps:.3f} ms a step", flush=True)
    rounds = last_stats.get("rounds")
    if rounds:  # the engine's own events: drafting (and its commit) and the verify forward (and the rollback)
        print(f"a round: draft {last_stats['draft_ms'] / rounds:.3f} ms, verify {last_stats['verify_ms'] / rounds:.3f} "
              f"ms ({rounds} rounds, {last_stats.get('accepted_tokens', 0)} drafts accepted)", flush=True)
    if args.host:
        host_profile(run, args.steps, args.top)
        return {}
    prof = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], with_stack=args.by_op > 0,
                   record_shapes=args.by_op > 0)
    pwall, psteps = run(args.steps, prof)

    per, intervals = cuda_kernels(prof)
    if not intervals:
        raise SystemExit("the profiler recorded no GPU kernels (CUPTI unavailable?)")
    busy = busy_us(intervals) / psteps
    total = sum(v[0] for v in per.values()) / psteps
    step_us = 1e6 * wall / steps
    print(f"GPU busy {busy / 1e3:.3f} ms a step (kernels summed {total / 1e3:.3f} ms) of {step_us / 1e3:.3f} ms "
          f"wall ({100 * busy / step_us:.1f} % busy); with the profiler {1e3 * pwall / psteps:.3f} ms a step")
    rows = sorted(per.items(), key=lambda kv: (-kv[1][2], -kv[1][0]))
    # own: the span past every earlier-started kernel's end (step_timeline.own_times: PDL overlaps the spans)
    print(f"{'kernel':90s} {'own us':>8s} {'us/step':>9s} {'calls/step':>10s} {'us/call':>8s} {'own %':>6s}")
    for name, (us, n, own) in rows[:args.top]:
        print(f"{name[:90]:90s} {own / psteps:8.1f} {us / psteps:9.1f} {n / psteps:10.1f} {us / n:8.2f} "
              f"{100 * own / psteps / busy:5.1f}%")
    ops = op_table(prof, psteps, args.by_op) if args.by_op > 0 else []
    gaps = gap_table(run, args.steps, args.gaps) if args.gaps > 0 else []
    return {"model": args.model, "batch": batch, "spec": eng.options.spec, "draft_tokens": eng.options.draft_tokens,
            "sync": args.sync, "pdl": args.pdl, "side_stream": args.side_stream, "silu_epilogue": args.silu_epilogue,
            "cublas_dense": args.cublas_dense, "qmv_layout": args.qmv_layout, "draft_graphs": not args.eager_draft,
            "attn_fixed_split": args.attn_fixed_split, "prefill": args.prefill, "prompt_len": args.prompt_len,
            "prefill_chunk": eng.options.prefill_chunk, "prefill_weights": args.prefill_weights,
            "flash_prefill": args.flash_prefill, "fused_prefill": args.fused_prefill,
            "cudnn_prefill": args.cudnn_prefill, "dropped": drop,
            "draft_attention": eng.options.draft_attention, "replay_acceptance": eng.options.replay_acceptance,
            "runtime": args.runtime, "steps": steps, "profiled_steps": psteps,
            "step_wall_us": step_us, "gpu_busy_us": busy, "kernels_summed_us": total,
            "kernels": [{"name": k, "us_per_step": v[0] / psteps, "own_us_per_step": v[2] / psteps,
                         "calls_per_step": v[1] / psteps} for k, v in rows],
            "ops": ops, "gaps": gaps}


def _short(frame: str) -> str:
    """A frame's file relative to the repository (the package's root)."""
    root = str(Path(__file__).resolve().parents[1]) + "/"
    return frame.split(root, 1)[-1].split("ninfer_bench/")[-1]


def op_frame(event) -> str:
    """Where a profiler op event came from: the innermost Python frame above it that is not torch's or a library's
    ("file.py(line): function", through the event's CPU parents: the profiler records frames as events with
    with_stack), else its Python stack, else its outermost torch op ("aten::linear"), else "-"."""
    parent, outer = event.cpu_parent, None
    while parent is not None:
        name = parent.name
        if name.startswith("aten::"):
            outer = name
        elif "): " in name and not name.startswith(("torch/", "<")) and not any(
                part in name for part in ("site-packages", "dist-packages", "/lib/python")):
            return _short(name)
        parent = parent.cpu_parent
    for frame in getattr(event, "stack", None) or []:
        if "site-packages" not in frame and not frame.startswith(("torch/", "<")):
            return _short(frame)
    return f"under {outer}" if outer else "-"


def op_shapes(event) -> str:
    """A profiler op event's input shapes ("[1, 2048, 10240] [1, 10240, 3]"; tensors only), "" when not recorded."""
    shapes = [s for s in (getattr(event, "input_shapes", None) or []) if s]
    return " ".join("[" + ", ".join(str(d) for d in s) + "]" for s in shapes[:3])


def op_table(prof, steps: int, top: int, own: str = "self_device_time_total") -> list[dict]:
    """The ``top`` (torch op, source line, input shapes) triples by GPU time of their own a step, printed and
    returned: which eager op launched the step's anonymous elementwise / copy kernels, and on what (the shapes tell
    ops apart where the profiler links no Python frames)."""
    agg: dict = {}
    for ev in prof.events():
        us_own = getattr(ev, own, 0.0)
        if us_own <= 0 or not ev.name.startswith("aten::"):
            continue
        key = (ev.name, op_frame(ev), op_shapes(ev))
        us, n = agg.get(key, (0.0, 0))
        agg[key] = (us + us_own, n + 1)
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]
    print(f"{'torch op':28s} {'us/step':>10s} {'calls/step':>10s}  source / input shapes")
    out = []
    for (name, frame, shapes), (us, n) in rows:
        print(f"{name[:28]:28s} {us / steps:10.1f} {n / steps:10.1f}  {frame[:70]}  {shapes[:60]}")
        out.append({"op": name, "source": frame, "shapes": shapes, "us_per_step": us / steps,
                    "calls_per_step": n / steps})
    return out


REGION = "profile_step.run"


@contextmanager
def _region(prof):
    """The profiler ``prof`` entered with a torch op named REGION around the run, so the run's bounds are on the
    trace's clock."""
    import torch

    with prof, torch.profiler.record_function(REGION):
        yield


def gap_table(run, steps: int, top: int) -> list[dict]:
    """The GPU's ``top`` longest idle stretches in one more profiled run of ``steps`` (suites/step_timeline.idle_gaps),
    each with the three torch ops that overlapped it longest on the host, printed and returned."""
    from torch.profiler import ProfilerActivity, profile

    from ninfer_bench.suites.step_timeline import busy_us, idle_gaps, kernel_spans, on_gpu

    prof = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU])
    run(steps, _region(prof))
    events = list(prof.events())
    region = next((e for e in events if e.name == REGION), None)
    spans = kernel_spans(prof)
    if region is None or not spans:
        print("gaps: the profile recorded no run region or no kernels")
        return []
    begin, end = region.time_range.start, region.time_range.end
    cpu = [e for e in events if e.name != REGION and not on_gpu(e)]
    idle = (end - begin) - busy_us([(a, b) for a, b, _ in spans])
    print(f"idle {idle / 1e3:.3f} ms of the profiled run's {(end - begin) / 1e3:.3f} ms; the longest stretches:")
    print(f"{'us':>9s} {'at ms':>9s}  after -> before  | host ops meanwhile (us of overlap)")
    out = []
    for gap in idle_gaps(spans, top, begin, end):
        lo = begin + gap["at_us"]
        hi = lo + gap["us"]
        over: dict[str, float] = {}
        for e in cpu:
            o = min(hi, e.time_range.end) - max(lo, e.time_range.start)
            if o > 0:
                over[e.name] = over.get(e.name, 0.0) + o
        host = sorted(over.items(), key=lambda kv: -kv[1])[:3]
        gap["host"] = [{"op": k, "us": v} for k, v in host]
        print(f"{gap['us']:9.1f} {gap['at_us'] / 1e3:9.3f}  {gap['after'][:40]} -> {gap['before'][:40]}  | "
              + ", ".join(f"{k[:40]} ({v:.0f})" for k, v in host))
        out.append(gap)
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
