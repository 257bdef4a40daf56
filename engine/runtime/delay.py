"""A fixed delay added to every decode step (``EngineOptions.inject_delay_us``) - testing only: a known slowdown
that the gate must catch (``scripts/gate_trust.py`` measures how often it does).

On a CPU it is a busy-wait until the thread has spent that much CPU time (a sleep would give the core away and wake
late): on a core shared with other processes it stretches as the step's own work does, so the slowdown it makes is
the same share of the step whatever the load, as a regression's extra work would be.

On CUDA the step is held on both of its sides at once: ``torch.cuda._sleep`` (a kernel that spins a number of clock
cycles, calibrated once per device against CUDA events: the clock a GPU boosts to is not its nominal rate) is queued
on the current stream behind the step's kernels, and the host busy-waits as long meanwhile. The two overlap, so a
step bound by the GPU (the device sleep counts, the host's wait hides in its slack) and one bound by the host's
launches and bookkeeping (the other way round) are both ``us`` longer - a device-only delay would vanish into the idle
gaps of a host-bound decode loop."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

_CYCLES_PER_US: dict[int, float] = {}


def cycles_per_us(device: torch.device) -> float:
    """The clock cycles ``torch.cuda._sleep`` spins per microsecond on ``device`` (measured once, then cached)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CYCLES_PER_US:
        with torch.cuda.device(index):
            cycles = 2_000_000  # about 1 ms at a GPU's clock: launch overhead is lost in it
            torch.cuda._sleep(cycles)  # the kernel loaded, the clock up
            rates = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
                rates.append(cycles / (start.elapsed_time(end) * 1e3))
        _CYCLES_PER_US[index] = statistics.median(rates)
    return _CYCLES_PER_US[index]


def spin_cpu_ns(ns: int) -> None:
    """Busy-wait until the calling thread has spent ``ns`` nanoseconds of CPU time."""
    end = time.thread_time_ns() + ns
    while time.thread_time_ns() < end:
        pass


def step_delay(us: float, device: torch.device) -> Callable[[], None] | None:
    """A call that makes the current step ``us`` microseconds longer on ``device``; None for no delay."""
    if not us:
        return None
    ns = round(us * 1e3)
    if device.type != "cuda":
        return lambda: spin_cpu_ns(ns)
    cycles = max(1, round(us * cycles_per_us(device)))

    def both() -> None:
        torch.cuda._sleep(cycles)  # queued: the device holds the step's stream
        spin_cpu_ns(ns)  # meanwhile the host holds the next launch

    return both
