"""``ninfer-bench compare``: a metric across the runs a history database holds (the suites' ``--db FILE``), as
llama-bench's compare script and asv's history show one across commits. The database and its tables are
:mod:`ninfer_bench.reports.history`."""

from __future__ import annotations

import click

from ..reports.schema import SUITES
from .common import UserError, output_options, show


@click.command()
@click.option("--db", "db_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="A history database (a suite's --db).")
@click.option("--metric", "metrics", multiple=True,
              help="A metric path, as gate rules name them (decode_tok_s, levels[concurrency=4].aggregate_tok_s, "
                   "records[op=rmsnorm,variant=v3].us_median; * or a left-out selector key: any); repeatable "
                   "[default: the suite's headline metric; side by side: its timing metrics].")
@click.option("--suite", type=click.Choice(SUITES), default=None,
              help="Only runs of this suite [default: the database's one suite].")
@click.option("--label", "labels", multiple=True,
              help="Only runs of this label (repeatable); two labels and no other: the two side by side.")
@click.option("--commit", "commits", multiple=True,
              help="Only runs of this commit (a git sha or a prefix; repeatable); two: the two side by side, "
                   "label by label.")
@click.option("--last", type=click.IntRange(min=1), default=None, help="Only the last N runs of those selected.")
@click.option("--list", "list_metrics", is_flag=True, help="List the metrics the selected suite's runs hold.")
@output_options(db=False)
def compare(db_path, metrics, suite, labels, commits, last, list_metrics):
    """A metric per run, ordered by time, with its change against the label's previous run and its first; two
    labels or two commits: side by side, with the speedup of the second over the first.

    \b
      ninfer-bench decode --db history.db               # after each build
      ninfer-bench compare --db history.db              # decode tok/s, run by run
      ninfer-bench compare --db history.db --commit 1a2b --commit 3c4d
      ninfer-bench compare --db history.db --suite kernels --metric 'records[op=rmsnorm].us_median'"""
    from ..reports import history as hist

    in_db = hist.suites(db_path)
    if not in_db:
        raise UserError(f"{db_path} holds no runs yet (add some with a suite's --db {db_path})")
    if suite is None and not metrics:
        if len(in_db) > 1:
            raise UserError(f"{db_path} holds runs of several suites ({', '.join(in_db)}): choose one with --suite")
        suite = in_db[0]
    if suite is not None and suite not in in_db:
        raise UserError(f"{db_path} holds no {suite} runs (it has {', '.join(in_db)})")
    if list_metrics:
        for name in hist.metric_names(db_path, suite):
            click.echo(name)
        return
    if len(commits) == 2 and len(labels) == 2:
        raise UserError("two commits and two labels: side by side takes two of one (give one label, or one commit)")
    side = ("commit", commits) if len(commits) == 2 else ("label", labels) if len(labels) == 2 else None
    if not metrics:
        metrics = (hist.side_metrics(suite) if side else (hist.HEADLINE[suite],))
    points = hist.query(db_path, metrics, suite=suite, labels=labels, commits=commits, last=last)
    if not points:
        known = hist.metric_names(db_path, suite)
        hint = f"; it holds {', '.join(known[:8])}{', ...' if len(known) > 8 else ''} (--list: all)" if known else ""
        raise UserError(f"no runs hold {', '.join(metrics)} in {db_path} with these filters{hint}")
    if len({p.suite for p in points}) > 1:
        raise UserError(f"{', '.join(metrics)} is in runs of several suites "
                        f"({', '.join(sorted({p.suite for p in points}))}): choose one with --suite")
    if side:
        by, (a, b) = side
        show(hist.side_by_side_grid(points, by, a, b))
    else:
        show(hist.series_grid(points))


COMMANDS = (compare,)
