"""Learning-rate schedule and step budget of a wall-clock-limited training phase.

Linear warm-up, then cosine decay to ``min_frac`` of the peak. The number of steps is fixed when
``max_steps`` is given; otherwise it is measured: after ``calibrate`` steps (the first two, which include
kernel compilation and autotuning, are left out of the timing) the total becomes the steps that fit the
remaining budget. The phase also stops when the budget runs out, whatever the total.
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
        if self.total is None and steps_done == self.calibrate:
            skip = min(2, steps_done - 1)  # steps whose time includes compilation and autotuning
            t0 = self.marks[skip - 1] if skip else self.start
            per = (self.marks[-1] - t0) / (steps_done - skip)
            self.total = steps_done + max(1, int((self.budget_s - self.elapsed) / per))
        return (self.total is not None and steps_done >= self.total) or self.elapsed >= self.budget_s
