"""Learning-rate schedule and step budget of a wall-clock-limited training phase.

Linear warm-up, then cosine decay to ``min_frac`` of the peak. The number of steps is fixed when
``max_steps`` is given; otherwise it is measured: after ``calibrate`` steps the total becomes the steps that fit
the remaining budget at the median step time so far, and it is measured again (median of the steps since) each
time the step count doubles. A median, not a mean: steps that compile or autotune kernels for a new shape (rows of
many lengths do that well past the first steps) would otherwise cut the phase to a fraction of its budget. The
first two steps never enter the timing. The phase also stops when the budget runs out, whatever the total.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Schedule:
    peak_lr: float
    warmup: int
    budget_s: float
    max_steps: int | None = None
    calibrate: int = 20
    min_frac: float = 0.1
    total: int | None = None
    measured_at: int = 0  # the step count of the last measurement (0: the total is not measured yet)
    start: float = field(default_factory=time.perf_counter)
    marks: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.peak_lr <= 0 or self.warmup < 0 or self.budget_s <= 0:
            raise ValueError(f"schedule: bad peak_lr {self.peak_lr}, warmup {self.warmup} or budget {self.budget_s}")
        if self.max_steps is not None:
            self.total = self.max_steps

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def lr(self, step: int) -> float:
        """Learning rate of (0-based) ``step``."""
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        total = self.total or max(self.warmup + 1, 10 * self.warmup)
        frac = min(1.0, (step - self.warmup) / max(1, total - self.warmup))
        return self.peak_lr * (self.min_frac + (1 - self.min_frac) * 0.5 * (1 + math.cos(math.pi * frac)))

    def done(self, steps_done: int) -> bool:
        """Record that ``steps_done`` steps have finished; whether the phase should stop now."""
        self.marks.append(time.perf_counter())
        due = self.calibrate if not self.measured_at else 2 * self.measured_at
        if self.max_steps is None and steps_done == due:
            first = max(min(2, steps_done - 1), self.measured_at)  # the first two steps compile and autotune
            times = sorted(b - a for a, b in zip(([self.start] + self.marks)[first:], self.marks[first:]))
            per = times[len(times) // 2]
            self.total = steps_done + max(1, int((self.budget_s - self.elapsed) / per))
            self.measured_at = steps_done
        return (self.total is not None and steps_done >= self.total) or self.elapsed >= self.budget_s
