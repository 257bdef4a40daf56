"""Every build the CUDA launchers choose passes its source's static checks, on the CPU.

kernels/qmv_cuda.cu and kernels/attn_cuda.cu refuse impossible builds with ``#error`` lines that NVRTC evaluates
only on the GPU, at a launch's first call. Those lines are plain preprocessor arithmetic on the launch's ``-D``
options, so a C preprocessor evaluates them here: each (format, rows, layout, GPU, keywords, tuning table) a launch
may come with is resolved by :func:`kernels.qmv_cuda.launch_build` (pure, no GPU), turned into the compile options
by :func:`kernels.qmv_cuda.kernel_options`, and the source preprocessed with them. (An explicit wgmma launch once
inherited the mma.sync default build's 3 row tiles a warp; the H200 refused it at compile time.)
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
SM90, SM80 = (9, 0), (8, 0)
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


def _qmv_builds(tables: dict, wg_defines: tuple = ()) -> dict[tuple[str, ...], object]:
    """The distinct compile options of every launch qmv accepts over a grid of inputs and keywords, with the
    process tables ``tables`` (qmv_cuda._WIDE's entries, NINFER_BENCH_QMV_WIDE's) in force."""
    with _wide_tables(tables):
        out = {}
        keywords = [{}, {"wgmma": 1}, {"wgmma": 2}, {"wgmma": 1, "stages": 3}, {"stages": 0}, {"stages": 4},
                    {"tiles": 2}, {"tiles": 3, "stages": 4, "min_blocks": 1}, {"xlate": True}, {"pipe": True},
                    {"tail": True}, {"fold": True}, {"warps": 4}, {"unroll": 1, "min_blocks": 2}]
        for fmt, t, layout, cap, even, kw in itertools.product(FMTS, (1, 8, 16, 17, 64), (0, 1, 2),
                                                              (SM90, SM80), (True, False), keywords):
            if fmt == qmv_cuda.DENSE_FMT and layout == 2:  # (TiledWeight's lanes layout is the q formats')
                continue
            try:
                b = qmv_cuda.launch_build(fmt, 17408 * 2, t, layout, cap, SMS, even=even, wg_defines=wg_defines,
                                          **kw)
            except ValueError:
                continue
            for act, pdl in ((False, False), (True, True)):
                options = qmv_cuda.kernel_options(
                    qmv_cuda._FMT_ID[fmt], False, even, b.unroll, b.min_blocks, kw.get("xlate", False),
                    kw.get("pipe", False), kw.get("fold", False), pdl, layout, act, b.warps, kw.get("tail", False),
                    b.ncol, b.tiles, True, b.stages, b.wgmma, b.defines)
                out.setdefault(options, (fmt, t, layout, cap, even, kw, act, pdl))
        return out


# the default tables, and tuning tables of the kind NINFER_BENCH_QMV_WIDE sets (wgmma and ring entries for every
# column-group count, one format or all)
TABLES = {
    "defaults": {},
    "wgmma": qmv_cuda._wide_builds("1q4:g1s4,2q5:g2s3,4:g1s4,8q4:g1s4,8q5:g2s4,8q8:g1s4"),
    "rings": qmv_cuda._wide_builds("2:p2u1b1,4q4:p2s3b1,8:p3s4b1,8q8:p1u2"),
}


@needs_cpp
@pytest.mark.parametrize("table", sorted(TABLES))
def test_every_qmv_build_passes_the_source_checks(table):
    builds = _qmv_builds(TABLES[table])
    assert len(builds) > 50, "the grid should reach many distinct builds"
    assert any("-DWGMMA=1" in o for o in builds) and any("-DWGMMA=0" in o for o in builds)
    assert _refused(KERNELS / "qmv_cuda.cu", builds) == []


@needs_cpp
@pytest.mark.parametrize("wg_defines", [(("WG_DEFER", 1),), (("WG_TMA", 1),), (("WG_DEFER", 1), ("WG_TMA", 1))])
def test_wgmma_tuning_builds_pass_the_source_checks(wg_defines):
    builds = {o: w for o, w in _qmv_builds(TABLES["wgmma"], wg_defines).items() if "-DWGMMA=0" not in o}
    assert builds
    assert _refused(KERNELS / "qmv_cuda.cu", builds) == []


@needs_cpp
def test_the_checks_refuse_what_they_should():
    """The probe itself can fail: the options of the slip this file guards against are refused."""
    b = qmv_cuda.launch_build("q4_g64_fp16", 34816, 64, 2, SM90, SMS, even=True)
    assert b.tiles == 3 and b.wgmma == 0  # the mma.sync default build at 8 column groups
    slip = qmv_cuda.kernel_options(2, False, True, b.unroll, b.min_blocks, False, False, False, False, 2, False,
                                   b.warps, False, b.ncol, b.tiles, True, b.stages, 1, ())
    assert _refused(KERNELS / "qmv_cuda.cu", {slip: "wgmma with TPW 3"})
    assert _refused(KERNELS / "attn_cuda.cu", {("-DHD=320", "-DHALF=0", "-DPOS64=0", "-DSLOT64=0"): "hd 320"})


def test_an_explicit_wgmma_launch_takes_its_own_build():
    """Not the mma.sync default build's row tiles and blocks an SM (the H200's compile refusal, session 54)."""
    for fmt, warpgroups in itertools.product(("q4_g64_fp16", "q5_g64_fp16", "q8_g32_fp16"), (1, 2)):
        b = qmv_cuda.launch_build(fmt, 34816, 64, 2, SM90, SMS, even=True, wgmma=warpgroups)
        assert (b.wgmma, b.tiles, b.stages, b.threads) == (warpgroups, 1, 4, 128 * warpgroups)
        assert b.min_blocks == max(1, 384 // b.threads) and b.per_block == 4 * warpgroups
        assert b.shared == qmv_cuda.wgmma_shared_bytes(fmt, 8, warpgroups, 4)


def test_a_default_wgmma_build_falls_back_and_an_explicit_one_is_refused():
    with _wide_tables(qmv_cuda._wide_builds("8q4:g1s4")):
        assert qmv_cuda.launch_build("q4_g64_fp16", 34816, 64, 2, SM90, SMS, even=True).wgmma == 1
        for cap, layout, even, kw in ((SM80, 2, True, {}), (SM90, 1, True, {}), (SM90, 2, False, {}),
                                      (SM90, 2, True, {"fold": True})):
            b = qmv_cuda.launch_build("q4_g64_fp16", 34816, 64, layout, cap, SMS, even=even, **kw)
            assert b.wgmma == 0 and b.defines == (), (cap, layout, even, kw)
            with pytest.raises(ValueError, match="wgmma=1"):
                qmv_cuda.launch_build("q4_g64_fp16", 34816, 64, layout, cap, SMS, even=even, wgmma=1, **kw)
        tma = (("WG_TMA", 1),)
        b = qmv_cuda.launch_build("q5_g64_fp16", 34816, 64, 2, SM90, SMS, even=True, wg_defines=tma,
                                  sections_aligned=False)
        assert b.wgmma == 0  # (8q5 has no wgmma entry here: the mma.sync default)
        b = qmv_cuda.launch_build("q4_g64_fp16", 34816, 64, 2, SM90, SMS, even=True, wg_defines=tma,
                                  sections_aligned=False)
        assert b.wgmma == 0 and b.defines == ()  # 8q4's default wgmma build leaves misaligned sections to mma.sync
        with pytest.raises(ValueError, match="16-byte aligned"):
            qmv_cuda.launch_build("q4_g64_fp16", 34816, 64, 2, SM90, SMS, even=True, wg_defines=tma,
                                  sections_aligned=False, wgmma=1)


def test_launch_build_refuses_what_qmv_refuses():
    lb = qmv_cuda.launch_build
    with pytest.raises(ValueError, match="at most 8 rows"):
        lb("q4_g64_fp16", 4096, 16, 2, SM90, SMS, even=True, xlate=True)
    with pytest.raises(ValueError, match="more than 8 rows"):
        lb("q4_g64_fp16", 4096, 8, 2, SM90, SMS, even=True, tiles=2)
    with pytest.raises(ValueError, match="lanes layout"):
        lb("q4_g64_fp16", 4096, 8, 1, SM90, SMS, even=True, stages=4)
    with pytest.raises(ValueError, match="stages"):
        lb("q4_g64_fp16", 4096, 4, 2, SM90, SMS, even=True, stages=2, tail=True)
    with pytest.raises(ValueError, match="ring of at least 2"):
        lb("q4_g64_fp16", 4096, 64, 2, SM90, SMS, even=True, wgmma=1, stages=1)
    with pytest.raises(ValueError, match="one or two warpgroups"):
        lb("q4_g64_fp16", 4096, 64, 2, SM90, SMS, even=True, wgmma=3)


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
