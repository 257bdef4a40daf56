"""scripts/ptxas_report.py: its knob parsing on any machine; with the [offline] extra installed (NVRTC's wheel and
Triton's ptxas), a qmv build compiled for sm_90a and ptxas's report read back."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ptxas_report.py"


def _load(script: Path = SCRIPT):
    """A script of scripts/ loaded as a module of its own name (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_knobs_parse():
    pr = _load()
    assert pr.knob_kwargs("default") == {} and pr.knob_kwargs("") == {}
    assert pr.knob_kwargs("p3s4b1") == {"tiles": 3, "stages": 4, "min_blocks": 1}
    assert pr.knob_kwargs("w8u2") == {"warps": 8, "unroll": 2}
    for bad in ("p3x", "q1", "p", "p3s4b1v1"):
        with pytest.raises(ValueError, match="knobs"):
            pr.knob_kwargs(bad)


def _offline_ready(pr) -> bool:
    try:
        pr._nvrtc()
        pr._ptxas()
        return True
    except (RuntimeError, ImportError, OSError):
        return False


def test_a_build_compiles_and_reports(monkeypatch, capsys):
    pr = _load()
    if not _offline_ready(pr):
        pytest.skip("no NVRTC wheel / ptxas (pip install -e '.[offline]')")
    monkeypatch.setattr(sys, "argv", ["ptxas_report.py", "--fmts", "q4", "--rows", "64",
                                      "--knobs", "default,p2s4b1"])
    assert pr.main() == 0
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines()[1:]]
    assert [ln[1] for ln in lines] == ["default", "p2s4b1"]
    for ln in lines:
        assert 32 <= int(ln[5]) <= 255  # registers
    assert lines[1][3:5] == ["2", "4"]  # the knobs' row tiles and ring stages
    # a build that qmv refuses (row tiles a block over 8 rows only) is reported as failed, and the exit code says so
    monkeypatch.setattr(sys, "argv", ["ptxas_report.py", "--fmts", "q4", "--rows", "8", "--knobs", "p3s4b1"])
    assert pr.main() == 1
    assert "FAILED" in capsys.readouterr().out


def test_loops_count_the_step(monkeypatch, capsys):
    """--loops adds each build's step loop from the SASS: a 64-row q4 launch's one tile a block makes 32 MMAs a step
    (8 column groups x 4), the default's three tiles 96."""
    pr = _load()
    if not _offline_ready(pr):
        pytest.skip("no NVRTC wheel / ptxas (pip install -e '.[offline]')")
    monkeypatch.setattr(sys, "argv", ["ptxas_report.py", "--fmts", "q4", "--rows", "64", "--knobs", "default,p1s4",
                                      "--loops"])
    assert pr.main() == 0
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines()[1:]]
    assert [(ln[1], ln[-1]) for ln in lines] == [("default", "96"), ("p1s4", "32")]
    assert all(int(ln[-3]) > int(ln[-1]) for ln in lines)  # more instructions than MMAs
