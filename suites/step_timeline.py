"""A decode step's own timeline: where the engine's plain decode step spends its time, kernel by kernel.

The kernels suite times each op alone; this profiles the step as the engine runs it - on CUDA the chained,
graph-captured decode of ``generate()``'s greedy path, on a CPU the eager step - with the torch profiler, and
groups what it recorded by name:

- CUDA: every GPU kernel (CUPTI durations, CUDA-graph replays included), its microseconds and launches a step, and
  its share of the step's wall time; the GPU's busy time (the union of the kernels' intervals) beside the wall time
  says how much of the step is idle gaps (graph launch, the token read-back, host work). With programmatic dependent
  launch a kernel starts while the one before it still runs and waits inside for its results, so the recorded
  spans overlap and sum past the step (the 27B step on the H200: qmv's spans alone came to 113% of it). Each
  kernel's own time (``own_us_per_step``, the share's basis) therefore counts only the part of its span after
  every kernel that started before it ended: the overlap goes to the kernel that started first, and the own times
  sum to the busy time.
- CPU: every torch op by its self time (what the op spent outside the ops it called), the same columns.

The step's wall time is measured without the profiler first, in the same process, so the profiler's overhead does
not enter the shares. ``scripts/profile_step.py`` is the switch-by-switch tool built on the same helpers.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def own_times(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Each name's own time over ``(start, end, name)`` spans: a span counts only from where every span that started
    before it has ended (overlap goes to the span that started first), so the own times sum to the union's length."""
    own: dict[str, float] = defaultdict(float)
    reached = None
    for start, end, name in sorted(spans):
        begin = start if reached is None else max(start, reached)
        own[name] += max(0.0, end - begin)
        reached = end if reached is None else max(reached, end)
    return dict(own)


def idle_gaps(spans: list[tuple[float, float, str]], top: int, begin: float | None = None,
              end: float | None = None) -> list[dict]:
    """The ``top`` longest stretches in which no span of ``(start, end, name)`` runs, longest first: each gap's
    length (``us``), where it starts (``at_us``, from ``begin`` or else the first span's start), and the kernel that
    ended last before it and the one that starts after it. ``begin`` / ``end`` (the profiled region's own bounds,
    the same clock) add the lead before the first kernel and the tail after the last as gaps named ``(start)`` /
    ``(end)``."""
    if not spans:
        return []
    order = sorted(spans)
    origin = order[0][0] if begin is None else begin
    gaps = []
    if begin is not None and order[0][0] > begin:
        gaps.append((order[0][0] - begin, begin, "(start)", order[0][2]))
    reached, last = order[0][1], order[0][2]
    for start, stop, name in order[1:]:
        if start > reached:
            gaps.append((start - reached, reached, last, name))
        if stop >= reached:
            reached, last = stop, name
    if end is not None and end > reached:
        gaps.append((end - reached, reached, last, "(end)"))
    gaps.sort(key=lambda g: -g[0])
    return [{"us": us, "at_us": at - origin, "after": before, "before": after}
            for us, at, before, after in gaps[:top]]


def cuda_kernels(prof) -> tuple[dict[str, list], list[tuple[float, float]]]:
    """The GPU kernels a profile recorded: {name: [span us, calls, own us]} (memcpy / memset by kind; own time as
    :func:`own_times` counts it) and their intervals."""
    per: dict[str, list] = defaultdict(lambda: [0.0, 0, 0.0])
    spans = []
    for start, end, name in kernel_spans(prof):
        if name.startswith(("Memcpy", "Memset")):
            name = name.split()[0]
        per[name][0] += end - start
        per[name][1] += 1
        spans.append((start, end, name))
    for name, us in own_times(spans).items():
        per[name][2] = us
    return dict(per), [(s, e) for s, e, _ in spans]


def on_gpu(evt) -> bool:
    """Whether a profiler event ran on the GPU (a kernel, copy or fill), not on the host."""
    return str(getattr(evt, "device_type", "")).endswith("CUDA")


def kernel_spans(prof) -> list[tuple[float, float, str]]:
    """Every GPU kernel / copy a profile recorded as ``(start us, end us, name)``."""
    return [(evt.time_range.start, evt.time_range.end, evt.name) for evt in prof.events()
            if on_gpu(evt) and evt.time_range.elapsed_us() > 0]


def cpu_ops(prof) -> dict[str, list]:
    """The torch ops a CPU profile recorded, by self time: {name: [us, calls]}."""
    return {a.key: [float(a.self_cpu_time_total), int(a.count)] for a in prof.key_averages()
            if a.self_cpu_time_total > 0}


def decode_timeline(engine, *, steps: int = 32, prompt_len: int = 256, seed: int = 0) -> dict:
    """Profile ``steps`` plain decode steps of ``engine`` after a ``prompt_len``-token random prompt (a warm-up run
    first: graphs captured, kernels compiled). Returns the timeline: the step's wall time, the busy time, and a row
    per kernel (CUDA) or op (CPU), largest first."""
    from torch.profiler import ProfilerActivity, profile

    from ..engine.runtime.chain import chainable, decode_chained
    from ..engine.sampling import SamplingParams

    if engine.drafter is not None:
        raise ValueError("decode_timeline profiles plain decode steps: an engine without a drafter")
    if steps < 1 or prompt_len < 1:
        raise ValueError(f"steps and prompt_len must be >= 1, got {steps} and {prompt_len}")
    cuda = engine.device.type == "cuda"
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(10, engine.config.vocab_size - 10, (prompt_len,), generator=g).tolist()

    def sync():
        if cuda:
            torch.cuda.synchronize(engine.device)

    def run(n: int, prof=None) -> tuple[float, int]:
        seq = engine.acquire(prompt, SamplingParams(max_new_tokens=n + 1, ignore_eos=True))
        try:
            engine.start(seq)  # the prompt, and the first token from its last position
            sync()
            n0 = len(seq.tokens)
            t = time.perf_counter()
            if prof is not None:
                prof.start()
            try:
                if cuda and chainable(engine, seq):
                    decode_chained(engine, seq)  # the host one step behind the GPU, as generate() runs it
                else:
                    for _ in range(n):
                        engine.advance([seq])
                sync()
            finally:
                if prof is not None:
                    prof.stop()
            return time.perf_counter() - t, len(seq.tokens) - n0
        finally:
            engine.release(seq)

    run(min(steps, 4))  # graphs captured, kernels compiled
    wall, made = run(steps)
    if made < 1:
        raise RuntimeError("the timeline's decode made no tokens")
    step_us = 1e6 * wall / made
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    _, pmade = run(steps, prof)
    if cuda:
        per, intervals = cuda_kernels(prof)
        if not intervals:
            raise RuntimeError("the profiler recorded no GPU kernels (CUPTI unavailable?)")
        busy = busy_us(intervals) / pmade
    else:
        per = {name: [us, n, us] for name, (us, n) in cpu_ops(prof).items()}  # self time: nothing overlaps
        busy = sum(v[0] for v in per.values()) / pmade
    rows = sorted(per.items(), key=lambda kv: (-kv[1][2], -kv[1][0]))
    return {"device": str(engine.device), "source": "cuda kernels (CUPTI)" if cuda else "torch ops, self CPU time",
            "steps": made, "prompt_len": prompt_len, "step_wall_us": step_us, "busy_us": busy,
            "summed_us": sum(v[0] for v in per.values()) / pmade,
            "kernels": [{"name": name, "us_per_step": us / pmade, "own_us_per_step": own / pmade,
                         "calls_per_step": n / pmade, "share_of_step": own / pmade / step_us}
                        for name, (us, n, own) in rows]}
