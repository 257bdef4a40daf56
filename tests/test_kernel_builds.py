"""Every build the CUDA launchers choose passes its source's static checks, on the CPU.

kernels/qmv_cuda.cu and kernels/attn_cuda.cu refuse impossible builds with ``#error`` lines that NVRTC evaluates
only on the GPU, at a launch's first call. Those lines are plain preprocessor arithmetic on the launch's ``-D``
options, so a C preprocessor evaluates them here: each (format, rows, layout, keywords, tuning table) a launch may
come with is resolved by :func:`kernels.qmv_cuda.launch_build` (pure, no GPU), turned into the compile options by
:func:`kernels.qmv_cuda.kernel_options`, and the source preprocessed with them.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from ninfer_bench.kernels import attn_cuda, qmv_cuda

CPP = shutil.which("cpp")
needs_cpp = pytest.mark.skipif(CPP is None, reason="no C preprocessor (cpp) on the PATH")
KERNELS = Path(qmv_cuda.__file__).parent
FMTS = ("q8_g32_fp16", "q5_g64_fp16", "q4_g64_fp16", qmv_cuda.DENSE_FMT)
SMS = 132


@contextmanager
def _wide_tables(tables: dict):
    """qmv_cuda._WIDE (NINFER_BENCH_QMV_WIDE's entries) set to ``tables`` for the block, then restored."""
    saved = dict(qmv_cuda._WIDE)
    qmv_cuda._WIDE.clear()
    qmv_cuda._WIDE.update(tables)
    try:
        yield
    finally:
        qmv_cuda._WIDE.clear()
        qmv_cuda._WIDE.update(saved)


def _preprocess(source: Path, options: tuple[str, ...]) -> subprocess.CompletedProcess:
    defines = [o for o in options if o.startswith("-D")]
    return subprocess.run([CPP, "-P", "-x", "c++", *defines, str(source), "-o", "/dev/null"],
                          capture_output=True, text=True, timeout=60)


def _refused(source: Path, builds: dict[tuple[str, ...], object]) -> list[str]:
    """The builds whose options the source's static checks refuse, each with the preprocessor's first error."""
    bad = []
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        runs = list(zip(builds.values(), pool.map(lambda o: _preprocess(source, o), builds)))
    for what, done in runs:
        if done.returncode:
            first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip())
            bad.append(f"{what}: {first}")
    return bad


def _qmv_builds(tables: dict) -> dict[tuple[str, ...], object]:
    """The distinct compile options of every launch qmv accepts over a grid of inputs and keywords, with the
    process tables ``tables`` (qmv_cuda._WIDE's entries, NINFER_BENCH_QMV_WIDE's) in force."""
    with _wide_tables(tables):
        out = {}
        keywords = [{}, {"stages": 0}, {"stages": 3}, {"stages": 4}, {"tiles": 2},
                    {"tiles": 3, "stages": 4, "min_blocks": 1}, {"xlate": True}, {"pipe": True}, {"tail": True},
                    {"fold": True}, {"warps": 4}, {"unroll": 1, "min_blocks": 2}]
        for fmt, t, layout, even, kw in itertools.product(FMTS, (1, 8, 16, 17, 64), (0, 1, 2), (True, False),
                                                          keywords):
            if fmt == qmv_cuda.DENSE_FMT and layout == 2:  # (TiledWeight's lanes layout is the q formats')
                continue
            build_kw = {k: v for k, v in kw.items() if k != "fold"}  # (fold is a compile option only)
            try:
                b = qmv_cuda.launch_build(fmt, 17408 * 2, t, layout, SMS, **build_kw)
            except ValueError:
                continue
            for act, pdl, f32, cluster in ((False, False, False, False), (True, True, False, False),
                                           (False, True, True, False), (False, True, False, True),
                                           (False, False, True, True)):
                options = qmv_cuda.kernel_options(
                    qmv_cuda._FMT_ID[fmt], False, even, b.unroll, b.min_blocks, kw.get("xlate", False),
                    kw.get("pipe", False), kw.get("fold", False), pdl, layout, act, b.warps, kw.get("tail", False),
                    b.ncol, b.tiles, True, b.stages, f32, cluster)
                out.setdefault(options, (fmt, t, layout, even, kw, act, pdl, f32, cluster))
            # a split launch's pieces walked in one block: where qmv lets it (one column group from registers, no
            # xlate, pipe or tail; never with act or a cluster)
            if b.ncol == 1 and b.tiles == 1 and not b.stages and not any(kw.get(k) for k in ("xlate", "pipe", "tail")):
                for pieces, pdl, f32 in ((2, False, False), (8, True, True)):
                    options = qmv_cuda.kernel_options(
                        qmv_cuda._FMT_ID[fmt], False, even, b.unroll, b.min_blocks, False, False, kw.get("fold", False),
                        pdl, layout, False, b.warps, False, b.ncol, b.tiles, True, b.stages, f32, False, pieces)
                    out.setdefault(options, (fmt, t, layout, even, kw, "pieces", pieces, pdl, f32))
        return out


# the default tables, and tuning tables of the kind NINFER_BENCH_QMV_WIDE sets (ring and row-tile entries for every
# column-group count, one format or all)
TABLES = {
    "defaults": {},
    "rings": qmv_cuda._wide_builds("2:p2u1b1,4q4:p2s3b1,8:p3s4b1,8q8:p1u2"),
    "registers": qmv_cuda._wide_builds("1q4:u2b2,2q5:p2u2,4:p3u1b1,8:p1,8q5:p2u1b1"),
}


@needs_cpp
@pytest.mark.parametrize("table", sorted(TABLES))
def test_every_qmv_build_passes_the_source_checks(table):
    builds = _qmv_builds(TABLES[table])
    assert len(builds) > 50, "the grid should reach many distinct builds"
    assert any("-DASYNC=0" in o for o in builds) and any("-DASYNC=4" in o for o in builds)
    assert any("-DTPW=3" in o for o in builds) and any("-DNCOL=8" in o for o in builds)
    assert any("-DOUT_F32=1" in o for o in builds) and any("-DCLUSTER=1" in o for o in builds)
    assert any("-DPIECES=8" in o for o in builds)
    assert _refused(KERNELS / "qmv_cuda.cu", builds) == []


@needs_cpp
def test_the_checks_refuse_what_they_should():
    """The probe itself can fail: the options of slips the source's checks guard against are refused."""
    b = qmv_cuda.launch_build("q4_g64_fp16", 34816, 8, 2, SMS)
    assert b.ncol == 1 and b.tiles == 1
    tpw = qmv_cuda.kernel_options(2, False, True, b.unroll, b.min_blocks, False, False, False, False, 2, False,
                                  b.warps, False, b.ncol, 3, True, b.stages)
    ring = qmv_cuda.kernel_options(2, False, True, b.unroll, b.min_blocks, False, False, False, False, 1, False,
                                   b.warps, False, b.ncol, 1, True, 4)
    assert _refused(KERNELS / "qmv_cuda.cu", {tpw: "TPW 3 at one column group"})
    assert _refused(KERNELS / "qmv_cuda.cu", {ring: "a ring on the tiles layout"})
    act_f32 = qmv_cuda.kernel_options(2, False, True, b.unroll, b.min_blocks, False, False, False, False, 2, True,
                                      b.warps, False, b.ncol, 1, True, b.stages, True)
    assert _refused(KERNELS / "qmv_cuda.cu", {act_f32: "fp32 out with the gate / up epilogue"})
    act_cluster = qmv_cuda.kernel_options(2, False, True, b.unroll, b.min_blocks, False, False, False, False, 2, True,
                                          b.warps, False, b.ncol, 1, True, b.stages, False, True)
    assert _refused(KERNELS / "qmv_cuda.cu", {act_cluster: "a split-K cluster with the gate / up epilogue"})
    for what, cluster, tiles, ncol in (("pieces in a cluster", True, 1, 1), ("pieces at 2 column groups", False, 1, 2),
                                       ("pieces with 2 tiles a block", False, 2, 2)):
        options = qmv_cuda.kernel_options(2, False, True, b.unroll, b.min_blocks, False, False, False, False, 2, False,
                                          b.warps, False, ncol, tiles, True, 0, False, cluster, 4)
        assert _refused(KERNELS / "qmv_cuda.cu", {options: what}), what
    assert _refused(KERNELS / "attn_cuda.cu", {("-DHD=320", "-DHALF=0", "-DPOS64=0", "-DSLOT64=0"): "hd 320"})


def test_the_default_wide_builds():
    """At 8 column groups q4 and q5 take 3 row tiles a block through a 4-stage ring, one block an SM, on the lanes
    layout (unroll 1 from registers on another); q8 and narrower launches one tile a block from registers."""
    for fmt in ("q4_g64_fp16", "q5_g64_fp16"):
        b = qmv_cuda.launch_build(fmt, 34816, 64, 2, SMS)
        assert (b.ncol, b.tiles, b.stages, b.unroll, b.min_blocks) == (8, 3, 4, 1, 1)
        assert (b.threads, b.shared) == (b.warps * 32, qmv_cuda.async_shared_bytes(fmt, b.warps, 4, 3))
        b = qmv_cuda.launch_build(fmt, 34816, 64, 1, SMS)
        assert (b.tiles, b.stages, b.unroll, b.shared) == (3, 0, 1, 0)
    b = qmv_cuda.launch_build("q8_g32_fp16", 34816, 64, 2, SMS)
    assert (b.tiles, b.stages, b.unroll, b.shared) == (1, 0, 4, 0)
    b = qmv_cuda.launch_build("q4_g64_fp16", 34816, 8, 2, SMS)
    assert (b.ncol, b.tiles, b.stages) == (1, 1, 0)


def test_launch_build_refuses_what_qmv_refuses():
    lb = qmv_cuda.launch_build
    with pytest.raises(ValueError, match="at most 8 rows"):
        lb("q4_g64_fp16", 4096, 16, 2, SMS, xlate=True)
    with pytest.raises(ValueError, match="more than 8 rows"):
        lb("q4_g64_fp16", 4096, 8, 2, SMS, tiles=2)
    with pytest.raises(ValueError, match="lanes layout"):
        lb("q4_g64_fp16", 4096, 8, 1, SMS, stages=4)
    with pytest.raises(ValueError, match="stages"):
        lb("q4_g64_fp16", 4096, 4, 2, SMS, stages=2, tail=True)
    with pytest.raises(ValueError, match="stages must be >= 0"):
        lb("q4_g64_fp16", 4096, 64, 2, SMS, stages=-1)


@needs_cpp
def test_every_attention_build_passes_the_source_checks():
    builds = {}
    for hd, half, pos64, slot64 in itertools.product((64, 128, 192, 256), (False, True), (False, True),
                                                     (False, True)):
        for build in attn_cuda._builds(()):
            builds[attn_cuda._options(hd, half, pos64, slot64, build)] = (hd, half, pos64, slot64, build)
        wgv = (*attn_cuda._options(hd, half, pos64, slot64, attn_cuda._builds(())[0]), "-DWGV=1")
        builds[wgv] = (hd, half, pos64, slot64, "wgv")
    assert _refused(KERNELS / "attn_cuda.cu", builds) == []
