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
                    {"fold": True}, {"warps": 4}, {"unroll": 1, "min_blocks": 2}, {"stages": 4, "xring": True},
                    {"tiles": 3, "stages": 4, "min_blocks": 1, "xring": True}, {"stages": 2, "xring": True}]
        for fmt, t, layout, even, kw in itertools.product(FMTS, (1, 8, 16, 17, 64), (0, 1, 2), (True, False),
                                                          keywords):
            if fmt == qmv_cuda.DENSE_FMT and layout == 2:  # (TiledWeight's lanes layout is the q formats')
                continue
            build_kw = {k: v for k, v in kw.items() if k != "fold"}  # (fold is a compile option only)
            try:
                b = qmv_cuda.launch_build(fmt, 17408 * 2, t, layout, SMS, even=even, **build_kw)
            except ValueError:
                continue
            for act, pdl in ((False, False), (True, True)):
                options = qmv_cuda.kernel_options(
                    qmv_cuda._FMT_ID[fmt], False, even, b.unroll, b.min_blocks, kw.get("xlate", False),
                    kw.get("pipe", False), kw.get("fold", False), pdl, layout, act, b.warps, kw.get("tail", False),
                    b.ncol, b.tiles, True, b.stages, b.xring)
                out.setdefault(options, (fmt, t, layout, even, kw, act, pdl))
        return out


# the default tables, and tuning tables of the kind NINFER_BENCH_QMV_WIDE sets (ring and row-tile entries for every
# column-group count, one format or all)
TABLES = {
    "defaults": {},
    "rings": qmv_cuda._wide_builds("2:p2u1b1,4q4:p2s3b1,8:p3s4b1,8q8:p1u2"),
    "xrings": qmv_cuda._wide_builds("2:p2s2b1v1,4:p2s3b1v1,8:p3s4b1v1,8q8:p1s4v1"),
    "registers": qmv_cuda._wide_builds("1q4:u2b2,2q5:p2u2,4:p3u1b1,8:p1,8q5:p2u1b1"),
}


@needs_cpp
@pytest.mark.parametrize("table", sorted(TABLES))
def test_every_qmv_build_passes_the_source_checks(table):
    builds = _qmv_builds(TABLES[table])
    assert len(builds) > 50, "the grid should reach many distinct builds"
    assert any("-DASYNC=0" in o for o in builds) and any("-DASYNC=4" in o for o in builds)
    assert any("-DTPW=3" in o for o in builds) and any("-DNCOL=8" in o for o in builds)
    assert any("-DXRING=1" in o for o in builds) and any("-DXRING=0" in o for o in builds)
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
    wide = qmv_cuda.launch_build("q4_g64_fp16", 34816, 64, 2, SMS)

    def xring(stages, even):
        return qmv_cuda.kernel_options(2, False, even, wide.unroll, wide.min_blocks, False, False, False, False, 2,
                                       False, wide.warps, False, wide.ncol, wide.tiles, True, stages, True)
    assert _refused(KERNELS / "qmv_cuda.cu", {xring(0, True): "x through a ring without one"})
    assert _refused(KERNELS / "qmv_cuda.cu", {xring(4, False): "x through the ring, read element by element"})
    assert not _refused(KERNELS / "qmv_cuda.cu", {xring(4, True): "x through the ring"})
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
    with pytest.raises(ValueError, match="xring"):
        lb("q4_g64_fp16", 4096, 64, 2, SMS, stages=0, xring=True)
    with pytest.raises(ValueError, match="xring"):
        lb("q4_g64_fp16", 4096, 8, 2, SMS, stages=4, xring=True)


def test_x_through_the_ring():
    """xring: from the keyword or a table's v1, only with a ring of >= 2 stages over 8 rows and x read by vectors
    (EVEN); its shared memory holds each warp's and stage's x pieces besides the weights' (two 16-byte pieces a lane and
    column group, q8 one)."""
    lb = qmv_cuda.launch_build
    b = lb("q4_g64_fp16", 34816, 64, 2, SMS, xring=True)
    assert b.xring and b.stages == 4 and b.ncol == 8
    assert b.shared == b.warps * 4 * 32 * (3 * 20 + 8 * 32) == qmv_cuda.async_shared_bytes(
        "q4_g64_fp16", b.warps, 4, 3, True, 8)
    assert not lb("q4_g64_fp16", 34816, 64, 2, SMS, xring=True, even=False).xring
    assert not lb("q4_g64_fp16", 34816, 64, 2, SMS).xring  # the committed default: off
    assert qmv_cuda.async_shared_bytes("q8_g32_fp16", 4, 2, 1, True, 2) == 4 * 2 * 32 * (20 + 2 * 16)
    with _wide_tables(qmv_cuda._wide_builds("8q5:p3s4b1v1")):
        assert lb("q5_g64_fp16", 34816, 64, 2, SMS).xring
        assert not lb("q4_g64_fp16", 34816, 64, 2, SMS).xring
        assert not lb("q5_g64_fp16", 34816, 64, 1, SMS).xring  # (no ring on the tiles layout: x from L1 / L2)
    with pytest.raises(ValueError, match="v<1"):
        qmv_cuda._wide_builds("8:p3s4x1")
    # shared memory: x's pieces take 8 KB a warp and stage at 8 column groups; a build that does not fit is refused
    # when asked for by keyword and left without xring when a table asks (8 warps a tile on a narrow weight)
    narrow = lb("q5_g64_fp16", 4096, 64, 2, SMS, stages=2, tiles=2, xring=True)
    assert narrow.warps == 8 and narrow.xring
    assert narrow.shared + qmv_cuda.static_shared_bytes(8, 8) <= qmv_cuda.SHARED_BLOCK_MAX
    with pytest.raises(ValueError, match="shared memory"):
        lb("q5_g64_fp16", 4096, 64, 2, SMS, stages=4, tiles=3, xring=True)
    with pytest.raises(ValueError, match="shared memory"):
        lb("q4_g64_fp16", 34816, 64, 2, SMS, xring=True, shared_max=160 * 1024)  # e.g. an A100's 163 KB
    with _wide_tables(qmv_cuda._wide_builds("8:p3s4b1v1")):
        assert lb("q4_g64_fp16", 34816, 64, 2, SMS).xring  # 4 warps: 178,176 bytes
        b = lb("q4_g64_fp16", 4096, 64, 2, SMS)  # 8 warps: would need 356,352
        assert not b.xring and b.shared == qmv_cuda.async_shared_bytes("q4_g64_fp16", 8, 4, 3)


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
