"""scripts/sass_loops.py: with the [offline] extra installed (NVRTC's wheel, Triton's ptxas and nvdisasm), the
int8 decode attention compiled for sm_90a and its hot loops found and counted."""

from pathlib import Path

import pytest

from test_ptxas_report import _load as _load_script
from test_ptxas_report import _offline_ready

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sass_loops.py"


def _load():
    return _load_script(SCRIPT)


def test_loops_are_backward_branches_with_mma():
    sl = _load()
    text = """\t.text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, RZ ;
        /*0020*/                   MOV R5, UR4 ;
        /*0030*/                   IMAD.U32 R6, RZ, RZ, UR5 ;
        /*0040*/              @!P0 BRA `(.L_x_1) ;
        /*0050*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0060*/                   EXIT ;
"""
    fns = sl.functions(text)
    assert list(fns) == ["k"]
    (lp,) = sl.loops(fns["k"], min_mma=1)
    assert (lp["label"], lp["instructions"], lp["mma"], lp["from_uniform"]) == (".L_x_1", 4, 1, 2)
    assert sl.loops(fns["k"], min_mma=2) == []  # too few MMAs; the forward branch is no loop
    # integer MMAs count as tensor-core MMAs too
    (lp,) = sl.loops(sl.functions(text.replace("HMMA.16816.F32", "IMMA.16832.S8.S8"))["k"], min_mma=1)
    assert (lp["mma"], lp["ops"]["IMMA"], lp["ops"]["HMMA"]) == (1, 1, 0)


def test_the_attention_loops_keep_their_selectors_in_registers():
    """The int8 codes' magic word is a register (attn_cuda.cu's magic_reg), so ptxas does not refill prmt's selectors
    from uniform registers inside the loops (it did about 100 times a step, session 71)."""
    if not _offline_ready(_load_script()):
        pytest.skip("no NVRTC wheel / ptxas (pip install -e '.[offline]')")
    sl = _load()
    from ninfer_bench.kernels import attn_cuda

    src = attn_cuda._SOURCE.read_bytes()
    seen = set()
    for build in attn_cuda._builds(()):
        for kernel, lines in sl.functions(sl.attention_sass(src, 64, False, build)).items():
            for lp in sl.loops(lines):
                seen.add(kernel)
                assert lp["mma"] == (16 if kernel == "attn_verify" else 8), (kernel, lp)
                assert lp["from_uniform"] <= 8, (kernel, lp)
    assert seen == {"attn_split", "attn_verify"}


def test_a_malformed_build_is_refused_by_name(capsys):
    """--build takes NINFER_BENCH_ATTN_BUILD's NAME=INTEGER items; anything else is refused before any compiling."""
    sl = _load()
    assert sl.main(["--build", "PART16"]) == 2
    assert "--build: a build define is NAME=INTEGER, got 'PART16'" in capsys.readouterr().err
