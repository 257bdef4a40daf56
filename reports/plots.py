"""Figures of the report, drawn from the tidy frames of :mod:`.frames` into PNG files.

Each function takes its frame(s) and an output path and returns the path, or None when the frame holds nothing
to draw. Figures are built on ``matplotlib.figure.Figure`` with the Agg canvas - never pyplot - so drawing
needs no display and leaves the caller's pyplot state and backend alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

DPI = 100


def _figure(width: float, height: float, ncols: int = 1, nrows: int = 1):
    fig = Figure(figsize=(min(width, 40), height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _save(fig: Figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path


def _num(series: pd.Series) -> np.ndarray:
    return pd.to_numeric(series, errors="coerce").to_numpy(dtype=float)


def _labels(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df["label"].astype(str)))


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", ":", "-.")
BASELINE_HATCH = "//"


def decode_order(decode: pd.DataFrame, groups=None, baselines=()) -> list[list[str]]:
    """Bar groups of the decode figure: each group led by its baseline run (groups whose first label is a baseline),
    then every other run, fastest first."""
    labels = decode["label"].astype(str).tolist()
    value = dict(zip(labels, _num(decode["decode_tok_s"]) if "decode_tok_s" in decode else np.zeros(len(labels))))
    groups = [[x for x in g if x in value] for g in groups or []]
    led = [g for g in groups if g and g[0] in baselines]
    placed = {x for g in led for x in g}
    rest = [[x] for x in labels if x not in placed]
    rest.sort(key=lambda g: -np.nan_to_num(value[g[0]], nan=-np.inf))
    return led + rest


def plot_decode(decode: pd.DataFrame, path, repeats: pd.DataFrame | None = None, groups=None,
                baselines=()) -> Path | None:
    """Bars per run: decode tok/s (whiskers: the slowest and fastest repeat, when ``repeats`` is given) and
    tokens per round, grouped by experiment: a group's baseline run first (hatched) with a dashed line at its value
    across the group; runs without a baseline after them, fastest first."""
    if decode.empty or all(np.isnan(_num(decode[c])).all() for c in ("decode_tok_s", "tokens_per_round")
                           if c in decode):
        return None
    order = decode_order(decode, groups, baselines)
    labels, x, colours, spans, pos = [], [], [], [], 0.0
    for gi, group in enumerate(order):
        start = pos
        for label in group:
            labels.append(label)
            x.append(pos)
            colours.append(f"C{gi % 10}")
            pos += 1
        if group[0] in baselines and len(group) > 1:
            spans.append((group[0], start - 0.45, pos - 0.55))
        pos += 0.5
    x = np.array(x)
    rows = decode.assign(label=decode["label"].astype(str)).drop_duplicates("label").set_index("label").loc[labels]
    fig, axes = _figure(max(7, 1.3 * len(labels) + 3), 4.4, ncols=2)
    for ax, col, title in ((axes[0, 0], "decode_tok_s", "decode tok/s"), (axes[0, 1], "tokens_per_round",
                                                                           "tokens per round")):
        y = _num(rows[col]) if col in rows else np.full(len(labels), np.nan)
        err = None
        if col == "decode_tok_s" and repeats is not None and col in repeats:
            lo, hi = [], []
            for label, mid in zip(labels, y):
                s = _num(repeats.loc[repeats["label"].astype(str) == label, col])
                s = s[~np.isnan(s)]
                lo.append(mid - s.min() if s.size and not np.isnan(mid) else 0.0)
                hi.append(s.max() - mid if s.size and not np.isnan(mid) else 0.0)
            err = np.clip([lo, hi], 0, None)
        bars = ax.bar(x, np.nan_to_num(y), color=colours, yerr=err, capsize=4)
        for bar, label, colour in zip(bars, labels, colours):
            if label in baselines:
                bar.set(hatch=BASELINE_HATCH, alpha=0.55, edgecolor=colour)
        value = dict(zip(labels, y))
        for base, x0, x1 in spans:
            if not np.isnan(value[base]):
                ax.hlines(value[base], x0, x1, colors="k", linestyles="--", linewidth=1.2, zorder=3)
        ax.bar_label(bars, labels=["-" if np.isnan(v) else f"{v:.3g}" for v in y], padding=2, fontsize=8)
        ax.set_xticks(x, labels, rotation=30, ha="right")
        ax.set_title(title)
        ax.margins(y=0.15)
    if any(label in baselines for label in labels):
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        handles = [Patch(facecolor="0.85", edgecolor="0.3", hatch=BASELINE_HATCH, label="baseline run")]
        if spans:
            handles.append(Line2D([], [], color="k", linestyle="--", label="baseline value (its experiment)"))
        fig.legend(handles=handles, fontsize=8, loc="outside upper center", ncols=len(handles))
    return _save(fig, path)


def _series_names(frame: pd.DataFrame, value: str, x: str, baselines=()) -> dict[str, str]:
    """Legend names per label: ``(baseline)`` after a baseline run, ``(identical to X)`` after a line that lies
    exactly on an earlier one (which would hide it)."""
    names, seen = {}, {}
    for label in _labels(frame):
        sel = frame[frame["label"].astype(str) == label].sort_values(x)
        key = tuple(np.round(np.nan_to_num(_num(sel[x]), nan=-1), 9)) + ("|",) + \
            tuple(np.round(np.nan_to_num(_num(sel[value]), nan=-1), 9))
        name = label + (" (baseline)" if label in baselines else "")
        if key in seen:
            name += f" (identical to {seen[key]})"
        else:
            seen[key] = label
        names[label] = name
    return names


def _style(i: int, n: int) -> dict:
    """Line i of n: its own marker and line style (lines that coincide stay told apart)."""
    return {"marker": MARKERS[i % len(MARKERS)], "linestyle": LINESTYLES[(i // 2) % len(LINESTYLES)],
            "markersize": max(4.0, 8.0 - 0.6 * i), "markerfacecolor": "none" if i % 2 else None}


def plot_acceptance(positions: pd.DataFrame, path, baselines=()) -> Path | None:
    """Acceptance per draft position, one line per label; each line has its own marker and style and a small
    sideways offset, and a line identical to an earlier one says so in the legend."""
    if positions.empty:
        return None
    fig, axes = _figure(7, 4.2)
    ax = axes[0, 0]
    labels = _labels(positions)
    names = _series_names(positions, "acceptance", "position", baselines)
    step = min(0.06, 0.3 / max(len(labels), 1))
    for i, label in enumerate(labels):
        sel = positions[positions["label"].astype(str) == label].sort_values("position")
        style = {k: v for k, v in _style(i, len(labels)).items() if v is not None}
        ax.plot(_num(sel["position"]) + (i - (len(labels) - 1) / 2) * step, _num(sel["acceptance"]),
                label=names[label], color=f"C{i % 10}", **style)
    ax.set_xlabel("draft position (runs offset sideways to stay visible)")
    ax.set_ylabel("fraction of rounds accepted")
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("acceptance per draft position")
    return _save(fig, path)


def plot_concurrency(concurrency: pd.DataFrame, path, baselines=()) -> Path | None:
    """Aggregate and per-request tok/s against concurrency, one line per label (baseline runs drawn thicker; each
    line its own marker and style; a line identical to an earlier one says so in the legend)."""
    if concurrency.empty:
        return None
    fig, axes = _figure(10, 4.2, ncols=2)
    levels = sorted({v for v in _num(concurrency["concurrency"]) if not np.isnan(v)})
    labels = _labels(concurrency)
    for ax, col, title in ((axes[0, 0], "aggregate_tok_s", "aggregate tok/s"),
                           (axes[0, 1], "per_request_tok_s", "per-request tok/s")):
        names = _series_names(concurrency, col, "concurrency", baselines)
        for i, label in enumerate(labels):
            sel = concurrency[concurrency["label"].astype(str) == label].sort_values("concurrency")
            style = {k: v for k, v in _style(i, len(labels)).items() if v is not None}
            ax.plot(_num(sel["concurrency"]), _num(sel[col]), label=names[label], color=f"C{i % 10}",
                    linewidth=2.6 if label in baselines else 1.5, **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [f"{v:g}" for v in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    return _save(fig, path)


def kernel_series(kernels: pd.DataFrame) -> pd.Series:
    """What one bar of a kernel group stands for: the variant, the label, or both when both vary."""
    variants, labels = kernels["variant"].astype(str), kernels["label"].astype(str)
    if labels.nunique() <= 1:
        return variants
    if variants.nunique() <= 1:
        return labels
    return labels + ":" + variants


def plot_kernels(kernels: pd.DataFrame, path, baselines=()) -> Path | None:
    """Median microseconds per (op, shape, t) group, one bar per variant or label (whiskers: p10-p90; hatched:
    a baseline run's); log y."""
    if kernels.empty:
        return None
    df = kernels.assign(series=kernel_series(kernels),
                        group=kernels["op"].astype(str) + "\n" + kernels["shape"].fillna("").astype(str)
                        + "\nT=" + kernels["t"].astype(str))
    groups, series = list(dict.fromkeys(df["group"])), list(dict.fromkeys(df["series"]))
    base_series = set(df.loc[df["label"].astype(str).isin(set(baselines)), "series"]) \
        if df["label"].astype(str).nunique() > 1 else set()
    width = 0.8 / len(series)
    fig, axes = _figure(max(7, len(groups) * (0.5 + 0.35 * len(series)) + 2), 5)
    ax = axes[0, 0]
    x = np.arange(len(groups))
    for i, name in enumerate(series):
        sel = df[df["series"] == name].drop_duplicates("group").set_index("group").reindex(groups)
        mid = _num(sel["us_median"])
        err = None
        if "us_p10" in sel and "us_p90" in sel:
            err = np.clip(np.nan_to_num([mid - _num(sel["us_p10"]), _num(sel["us_p90"]) - mid]), 0, None)
        ax.bar(x + (i - (len(series) - 1) / 2) * width, mid, width, yerr=err, capsize=2,
               label=name + (" (baseline)" if name in base_series else ""), color=f"C{i % 10}",
               hatch=BASELINE_HATCH if name in base_series else None)
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_ylabel("µs (median)")
    ax.set_xticks(x, groups, fontsize=7)
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("kernel time per op (lower is better)")
    return _save(fig, path)


def _ctx_text(ctx: float) -> str:
    return f"{ctx / 1024:g}K" if ctx >= 1024 and ctx % 256 == 0 else f"{ctx:g}"


def _depth_text(depth: float, fraction: bool) -> str:
    return f"{depth:.0%}" if fraction else f"{depth:g}"


def _cell_text(rate: float, n: int, of: int, oracle: bool) -> str:
    """A heatmap cell's rate and count: the oracle panel's rate is over the cases with an oracle ("1 of 2 with an
    oracle"), so a cell where only some had one does not read as all of them."""
    if of == 0:
        return "-"
    if oracle:
        return "no oracle" if n == 0 else f"{rate:.0%}\n{n} of {of} with\nan oracle"
    return "-" if np.isnan(rate) else f"{rate:.0%}\n{n} case{'s' if n != 1 else ''}"


def plot_niah(niah: pd.DataFrame, path, baselines=()) -> Path | None:
    """Heatmaps of needle retrieval and oracle-agreement pass rate over (context length x needle depth), one
    row of panels per label, each cell annotated with its rate and case count (for agreement: of the cases with an
    oracle)."""
    if niah.empty:
        return None
    labels = _labels(niah)
    df = niah.assign(ctx=_num(niah["ctx"]), depth=_num(niah["depth"]))
    ctxs = sorted(set(df["ctx"].dropna()))
    depths = sorted(set(df["depth"].dropna()))
    if not ctxs or not depths:
        return None
    fraction = max(depths) <= 1
    fig, axes = _figure(max(8, 1.1 * len(ctxs) * 2 + 3), 0.45 * len(depths) * len(labels) + 1.6 * len(labels),
                        ncols=2, nrows=len(labels))
    image = None
    for r, label in enumerate(labels):
        sel = df[df["label"].astype(str) == label]
        for c, (col, name) in enumerate((("retrieved", "retrieval"), ("pass", "oracle agreement"))):
            ax = axes[r, c]
            values = sel.assign(v=_num(sel[col]) if col in sel else np.nan)
            rate = values.pivot_table(index="depth", columns="ctx", values="v", aggfunc="mean", dropna=False)
            count = values.pivot_table(index="depth", columns="ctx", values="v", aggfunc="count", dropna=False)
            total = values.pivot_table(index="depth", columns="ctx", values="case", aggfunc="count", dropna=False)
            rate, count = rate.reindex(index=depths, columns=ctxs), count.reindex(index=depths, columns=ctxs)
            total = total.reindex(index=depths, columns=ctxs)
            grid = rate.to_numpy(dtype=float)
            image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            for i in range(len(depths)):
                for j in range(len(ctxs)):
                    n, of = int(np.nan_to_num(count.iat[i, j])), int(np.nan_to_num(total.iat[i, j]))
                    ax.text(j, i, _cell_text(grid[i, j], n, of, col == "pass"), ha="center", va="center",
                            fontsize=7)
            ax.set_xticks(range(len(ctxs)), [_ctx_text(v) for v in ctxs])
            ax.set_yticks(range(len(depths)), [_depth_text(v, fraction) for v in depths])
            ax.set_xlabel("context")
            ax.set_ylabel("needle depth")
            ax.set_title(f"{label}{' (baseline)' if label in baselines else ''}: {name}", fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.8, label="pass rate")
    return _save(fig, path)


def plot_all(tables: dict[str, pd.DataFrame], out_dir, groups: dict | None = None,
             baselines: dict | None = None) -> dict[str, Path]:
    """Every figure the frames allow, as ``{name: png path}`` in ``out_dir`` (empty suites give none).

    ``groups``: per suite, lists of labels that are one experiment, each led by its baseline run (the decode bars
    are grouped so); ``baselines``: per suite, the labels of baseline runs (marked in every figure)."""
    out_dir = Path(out_dir)
    groups, baselines = groups or {}, baselines or {}

    def base(suite):
        return set(baselines.get(suite, ()))

    made = {
        "decode": plot_decode(tables["decode"], out_dir / "decode.png", tables.get("decode_repeats"),
                              groups.get("decode"), base("decode")),
        "acceptance": plot_acceptance(tables["decode_positions"], out_dir / "acceptance.png", base("decode")),
        "concurrency": plot_concurrency(tables["concurrency"], out_dir / "concurrency.png", base("concurrency")),
        "kernels": plot_kernels(tables["kernels"], out_dir / "kernels.png", base("kernels")),
        "niah": plot_niah(tables["niah"], out_dir / "niah.png", base("niah")),
    }
    return {name: p for name, p in made.items() if p is not None}
