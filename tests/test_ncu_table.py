"""scripts/ncu_table.py: an Nsight Compute raw page (CSV) to one line a launch with the chosen metrics."""

from __future__ import annotations

import io

import ncu_table  # scripts/ (conftest puts it on sys.path)

RAW = (
    '"ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread",'
    '"smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct","smsp__warp_issue_stalled_wait_per_warp_active.pct",'
    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","dram__bytes_read.sum"\n'
    '"","","usecond","register/thread","%","%","","byte"\n'
    '"0","qmv","112.5","255","34.2","0.5","0.72","1,000"\n'
    '"1","qmv","43.1","162","12.0","1.5","0.01","2,000"\n'
)


def test_one_line_a_launch_with_the_default_metrics(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(RAW))
    assert ncu_table.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[0 qmv]") and "gpu__time_duration.sum=112.5usecond" in lines[0]
    assert "launch__registers_per_thread=255register/thread" in lines[0]
    assert "stall%:long_scoreboard=34.2" in lines[0] and "stall/issue:barrier=0.72" in lines[0]
    assert "stall%:wait" not in lines[0]  # under 1 %: left out
    assert "stall%:wait=1.5" in lines[1] and "barrier" not in lines[1]  # a ratio under 0.05: left out
    assert "dram__bytes_read" not in lines[0]  # not a default metric


def test_chosen_metrics_and_an_empty_report(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(RAW))
    assert ncu_table.main([r"^dram__bytes_read\.sum$"]) == 0
    assert capsys.readouterr().out.splitlines() == ["[0 qmv] dram__bytes_read.sum=1000byte",
                                                    "[1 qmv] dram__bytes_read.sum=2000byte"]
    monkeypatch.setattr("sys.stdin", io.StringIO(RAW.split("\n")[0] + "\n"))
    assert ncu_table.main([]) == 1
