#!/usr/bin/env python3
"""Registers, spills and shared memory of qmv builds for sm_90a, on a machine without a GPU.

Each build is what :func:`kernels.qmv_cuda.launch_build` makes of (format, weight rows, x rows, knobs). Its source is
compiled to PTX by NVRTC, from the ``nvidia-cuda-nvrtc`` wheel (the ``[offline]`` extra), and the PTX is assembled by
the ptxas that Triton ships (``ptxas -v``). That ptxas may be older than NVRTC: the PTX's ``.version`` line is then
lowered to the newest ptxas takes. This holds as long as the kernel uses no instruction newer than that, and ptxas
says so when it does. The numbers are ptxas's own. Whether a build is faster is a question for a GPU.

    pip install -e '.[offline]'
    python scripts/ptxas_report.py --fmts q4,q5 --rows 64 --knobs default,p3s4b1,p2s4b1
    python scripts/ptxas_report.py --fmts q4 --rows 64 --knobs default,p1s4 --loops   # + the step loop's SASS counts
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

from ninfer_bench.kernels import qmv_cuda, quant  # noqa: E402

def knob_kwargs(spec: str) -> dict:
    """``p3s4b1`` -> launch_build keywords (tiles 3, stages 4, min_blocks 1); '' -> the defaults."""
    if spec in ("", "default"):
        return {}
    if not re.fullmatch(rf"(?:[{''.join(qmv_cuda.KNOB_LETTERS)}]\d+)+", spec):
        raise ValueError(f"knobs {spec!r}: letters p<tiles> u<unroll> b<blocks an SM> s<stages> w<warps> "
                         "with a number each, e.g. p3s4b1")
    return qmv_cuda.knob_kwargs(spec)


def _nvrtc():
    """NVRTC from the nvidia-cuda-nvrtc wheel (its builtins library loaded first, so NVRTC finds it)."""
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for lib in (d for r in roots for d in sorted(r.glob("cu*/lib")) + [r / "cuda_nvrtc" / "lib"]):
        main = sorted(lib.glob("libnvrtc.so.*"))
        builtins = sorted(lib.glob("libnvrtc-builtins.so.*"))
        if main and builtins:
            ctypes.CDLL(str(builtins[0]), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(str(main[0]))
    raise RuntimeError("NVRTC not found: pip install -e '.[offline]' (the nvidia-cuda-nvrtc wheel)")


def _ptxas() -> Path:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not path.exists():
        raise RuntimeError(f"no ptxas at {path} (Triton's NVIDIA backend ships it)")
    return path


def compile_ptx(nvrtc, source: bytes, options: tuple[str, ...], arch: str = "compute_90a") -> str:
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"qmv_cuda.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        opts = [o.encode() for o in (*options, f"--gpu-architecture={arch}")]
        rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        if rc:
            raise RuntimeError(f"NVRTC ({' '.join(options)}):\n{log.value.decode(errors='replace')}")
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


# the PTX ISA each CUDA release's ptxas takes at most (NVIDIA's PTX ISA release notes)
PTX_ISA = {(12, 0): "8.0", (12, 1): "8.1", (12, 2): "8.2", (12, 3): "8.3", (12, 4): "8.4", (12, 5): "8.5",
           (12, 6): "8.5", (12, 8): "8.7", (12, 9): "8.8", (13, 0): "9.0", (13, 1): "9.1"}


def ptxas_version(ptxas: Path) -> str | None:
    """The newest PTX ISA this ptxas takes (None: a release not in PTX_ISA, the PTX left as NVRTC wrote it)."""
    out = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return PTX_ISA.get((int(m.group(1)), int(m.group(2)))) if m else None


def assemble(ptxas: Path, ptx: str, arch: str = "sm_90a", cubin: Path | None = None) -> dict:
    """ptxas -v of the PTX: registers, spill stores / loads (bytes), static shared memory (bytes); ``cubin``: also
    keep the assembled module there (for nvdisasm: scripts/sass_loops.py)."""
    isa = ptxas_version(ptxas)
    m = re.search(r"^\.version (\d+)\.(\d+)", ptx, flags=re.M)
    if isa and m and tuple(map(int, m.groups())) > tuple(map(int, isa.split("."))):
        ptx = ptx[:m.start()] + f".version {isa}" + ptx[m.end():]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        done = subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(src), "-o", str(cubin or Path(tmp) / "k.cubin")],
                              capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ptxas: {done.stderr.strip()[:600]}")
    text = done.stderr

    def num(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "static_smem": num(r"(\d+) bytes smem")}


def disassemble(ptxas: Path, cubin: Path) -> str:
    """nvdisasm's text of an assembled module (the nvdisasm beside ``ptxas``)."""
    done = subprocess.run([str(ptxas.parent / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvdisasm: {done.stderr.strip()[:400]}")
    return done.stdout


def step_loop(ptxas: Path, cubin: Path) -> str:
    """``  instructions / MMA`` of the qmv kernel's shortest loop with at least 8 MMAs (its step), from nvdisasm."""
    import sass_loops  # (it imports this module: loaded only when asked for)

    found = [lp for lines in sass_loops.functions(disassemble(ptxas, cubin)).values() for lp in sass_loops.loops(lines)]
    if not found:
        return "  (no loop with MMAs)"
    lp = min(found, key=lambda f: f["instructions"])
    return f"  {lp['instructions']:5d} / {lp['mma']:<4d}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmts", default="q4,q5", help="comma list of q4, q5, q8")
    ap.add_argument("--n", type=int, default=34816, help="weight rows (34816: the 27B's gate_up)")
    ap.add_argument("--rows", type=int, default=64, help="rows of x a launch (1..64)")
    ap.add_argument("--knobs", default="default", help="comma list of builds, e.g. default,p3s4b1,p2s4b1")
    ap.add_argument("--sms", type=int, default=132, help="the GPU's SMs (132: H100 / H200 SXM)")
    ap.add_argument("--no-pdl", action="store_true", help="builds without programmatic dependent launch")
    ap.add_argument("--loops", action="store_true",
                    help="also each build's step loop in SASS (nvdisasm; scripts/sass_loops.py's counting): the "
                         "instructions and MMAs of the shortest loop with at least 8 MMAs, one pass of its body")
    ap.add_argument("--pieces", type=int, default=1,
                    help="split-K pieces one block walks (PIECES; > 1 needs --rows <= 8 and the default build; "
                         "the walk's register cap unless a b knob sets it)")
    args = ap.parse_args()
    try:
        nvrtc, ptxas = _nvrtc(), _ptxas()
    except RuntimeError as e:
        print(f"ptxas_report: {e}", file=sys.stderr)
        return 2
    source = (Path(qmv_cuda.__file__).parent / "qmv_cuda.cu").read_bytes()
    print(f"{'fmt':4} {'knobs':10} {'warps':>5} {'tiles':>5} {'stages':>6} {'regs':>4} {'spill st/ld':>11} "
          f"{'smem dyn+static':>16}" + ("  loop instr / MMA" if args.loops else ""))
    bad = 0
    for short in (f.strip() for f in args.fmts.split(",") if f.strip()):
        fmt = quant.QUANT_SHORT[short]
        for spec in (k.strip() for k in args.knobs.split(",") if k.strip()):
            try:
                kw = knob_kwargs(spec)
                b = qmv_cuda.launch_build(fmt, args.n, args.rows, 2, args.sms, **kw)
                if args.pieces > 1 and "min_blocks" not in kw:  # a walk's register cap, as qmv builds it
                    b = qmv_cuda.walk_build(b)
                options = qmv_cuda.kernel_options(qmv_cuda._FMT_ID[fmt], False, True, b.unroll, b.min_blocks, False,
                                                  False, False, not args.no_pdl, 2, False, b.warps, False, b.ncol,
                                                  b.tiles, True, b.stages, pieces=args.pieces)
                with tempfile.TemporaryDirectory() as tmp:
                    cubin = Path(tmp) / "k.cubin"
                    r = assemble(ptxas, compile_ptx(nvrtc, source, options), cubin=cubin)
                    loop = step_loop(ptxas, cubin) if args.loops else ""
            except (ValueError, RuntimeError) as e:
                bad += 1
                print(f"{short:4} {spec:10} FAILED: {str(e).splitlines()[0][:160]}")
                continue
            print(f"{short:4} {spec:10} {b.warps:5d} {b.tiles:5d} {b.stages:6d} {r['registers']:4d} "
                  f"{r['spill_stores']:5d}/{r['spill_loads']:<5d} {b.shared:8d}+{r['static_smem']:<7d}" + loop)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
