"""How the report reads a run against its baseline: the rank test's verdict, which run a suite's baseline is."""

from __future__ import annotations

from .frames import model_id
from .render import num
from .stats import ALPHA, rank_test


def read_shift(b_samples, c_samples, higher_is_better: bool) -> tuple[str, str]:
    """``("faster, p=0.008", tone)``: the rank test's reading of candidate samples against baseline samples."""
    shift = rank_test(b_samples, c_samples, ALPHA)
    if shift.powerless:
        return f"inconclusive ({shift.n_baseline} vs {shift.n_candidate} samples)", "warn"
    if not shift.significant:
        return f"same within noise, p={shift.p:.2g}", ""
    better = (shift.direction > 0) == higher_is_better
    return f"{'faster' if better else 'slower'}, p={shift.p:.2g}", "good" if better else "bad"


def model_name(doc: dict) -> str:
    name = model_id(doc["model"])
    return name if name != "-" else num(doc["config"].get("model"))


def stand_in(suite: str, base: dict, baseline_label: str | None) -> str | None:
    """Why a suite's baseline is a stand-in, not the baseline label's run (None when it is that run)."""
    if base["label"] == baseline_label:
        return None
    return "no baseline label was given" if baseline_label is None else f"{baseline_label} has no {suite} result"


def baseline_note(suite: str, base: dict, baseline_label: str | None) -> str:
    """Which run a suite's deltas are taken against, and why that one."""
    run = f"{base['label']} ({model_name(base)}, created {base['created']})"
    why = stand_in(suite, base, baseline_label)
    if why is None:
        return f"Baseline: {run}, the baseline label."
    return (f"Baseline: {run}, standing in as the first {suite} result read (a folder's files are read in name "
            f"order): {why}. Name another with --baseline LABEL.")
