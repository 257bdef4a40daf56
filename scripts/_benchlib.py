"""Timing helpers shared by the GPU bench scripts (scripts/bench_*.py)."""

from __future__ import annotations

import torch

GRAPH_REPLAYS = 20


def copy_bandwidth(device="cuda") -> float:
    """Device copy bandwidth, bytes read + written per second (2 GiB buffer, as the reference-GPU anchors measure it)."""
    from triton.testing import do_bench

    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2 * 1024**3 / (ms * 1e-3)


def capture(calls) -> torch.cuda.CUDAGraph:
    """One CUDA graph making every call in ``calls`` once (each run once outside first, to compile and warm)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_us(fns, replays: int = GRAPH_REPLAYS) -> float:
    """Median us per call over replays of one CUDA graph that makes every call in ``fns`` once."""
    graph = capture(fns)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    del graph
    return sorted(times)[len(times) // 2]


def resource_report(kernels: dict) -> list:
    """Registers, spills, shared memory, warps and stages of every compiled variant of ``kernels``
    (name -> jitted kernel); best effort, since these are Triton internals."""
    rows = []
    for name, fn in kernels.items():
        for caches in getattr(fn, "device_caches", {}).values():
            for kernel in caches[0].values():
                try:
                    md = kernel.metadata
                    rows.append({"kernel": name, "regs": kernel.n_regs, "spills": kernel.n_spills,
                                 "shared": md.shared, "num_warps": md.num_warps,
                                 "num_stages": getattr(md, "num_stages", None)})
                except Exception as exc:  # internals move between Triton versions
                    rows.append({"kernel": name, "error": repr(exc)[:120]})
    return rows
