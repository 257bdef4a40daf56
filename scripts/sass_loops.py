#!/usr/bin/env python3
"""The hot loops of the int8 decode attention's kernels in SASS for sm_90a, on a machine without a GPU.

Each build that kernels/attn_cuda.py launches (attn_split, and attn_verify's narrow and wide builds) is compiled the
way scripts/ptxas_report.py compiles qmv's (NVRTC from the ``[offline]`` extra, Triton's ptxas, its nvdisasm), and
every loop of a kernel with at least ``--min-mma`` tensor-core instructions (a backward branch's body) is counted:
instructions in all, tensor-core MMAs (HMMA + IMMA), the most frequent opcodes. The counts are static (one pass of
the loop body, every branch inside it included) and come from Triton's ptxas, which may be older than the GPU
driver's: they show what the compiler made of a source change, not its time, which only a GPU measures.

    pip install -e '.[offline]'
    python scripts/sass_loops.py --hd 256,64
    python scripts/sass_loops.py --source /path/to/older/attn_cuda.cu   # the same builds of another source
    python scripts/sass_loops.py --build PART16=0    # extra defines over every build (NINFER_BENCH_ATTN_BUILD's form)
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

import ptxas_report  # noqa: E402

from ninfer_bench.kernels import attn_cuda  # noqa: E402
from ninfer_bench.kernels._cupy import parse_build  # noqa: E402

_INSTR = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")
_FUNCTION = re.compile(r"^\s*\.text\.(\w+):")
# a uniform register copied into a general one: what ptxas emits when it rematerializes a constant operand
_FROM_UNIFORM = re.compile(r"\b(?:MOV|IMAD\.U32)\s+R\d+,\s+(?:RZ,\s+RZ,\s+)?UR\d+\s*;")


def functions(sass: str) -> dict[str, list[str]]:
    """nvdisasm's text split into its functions' lines."""
    out: dict[str, list[str]] = {}
    name = None
    for line in sass.splitlines():
        m = _FUNCTION.match(line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name:
            out[name].append(line)
    return out


def loops(lines: list[str], min_mma: int = 8) -> list[dict]:
    """The loops of one function (a branch back to a label above it) with at least ``min_mma`` tensor-core MMAs
    (HMMA, IMMA: ``mma``): their opcode counts and how many general registers they fill from uniform ones."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    found = []
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        top = labels.get(m.group(1)) if m else None
        if top is None or top >= i:
            continue
        body = lines[top:i + 1]
        ops = collections.Counter(m.group(1) for x in body if (m := _INSTR.match(x)))
        mma = ops["HMMA"] + ops["IMMA"]
        if mma >= min_mma:
            found.append({"label": lines[top].rstrip(":"), "instructions": sum(ops.values()), "mma": mma,
                          "from_uniform": sum(bool(_FROM_UNIFORM.search(x)) for x in body), "ops": ops})
    return found


def attention_sass(source: bytes, hd: int, half: bool, build: tuple) -> str:
    """nvdisasm's text of one attention build (its module: attn_split and attn_verify)."""
    nvrtc, ptxas = ptxas_report._nvrtc(), ptxas_report._ptxas()
    ptx = ptxas_report.compile_ptx(nvrtc, source, attn_cuda._options(hd, half, True, True, build))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        ptxas_report.assemble(ptxas, ptx, cubin=cubin)
        return ptxas_report.disassemble(ptxas, cubin)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default=str(attn_cuda._SOURCE), help="the kernels' source (default: this tree's)")
    ap.add_argument("--hd", default="256", help="head dims, a comma list (multiples of 64 up to 256)")
    ap.add_argument("--fp16", action="store_true", help="fp16 queries (default bf16)")
    ap.add_argument("--min-mma", type=int, default=8, help="loops with fewer MMAs (HMMA + IMMA) are not reported")
    ap.add_argument("--top", type=int, default=10, help="opcodes listed a loop")
    ap.add_argument("--build", default="", help="extra defines over every build, NAME=VALUE:NAME=VALUE "
                                                "(as NINFER_BENCH_ATTN_BUILD takes them)")
    args = ap.parse_args(argv)
    try:
        extra = tuple(sorted(parse_build(args.build, "--build").items()))
        ptxas_report._nvrtc(), ptxas_report._ptxas()
    except (ValueError, RuntimeError) as e:
        print(f"sass_loops: {e}", file=sys.stderr)
        return 2
    source = Path(args.source).read_bytes()
    print(f"{'hd':>3} {'build':6} {'kernel':12} {'loop':10} {'instr':>5} {'MMA':>4} {'from UR':>7}  top opcodes")
    for hd in (int(x) for x in args.hd.split(",") if x.strip()):
        for name, build in zip(("narrow", "wide"), attn_cuda._builds(extra)):
            sass = attention_sass(source, hd, args.fp16, build)
            for kernel, lines in functions(sass).items():
                if kernel == "attn_split" and name == "wide":
                    continue  # the same attn_split in both modules
                for lp in loops(lines, args.min_mma):
                    top = ", ".join(f"{op} {n}" for op, n in lp["ops"].most_common(args.top))
                    print(f"{hd:3d} {name:6} {kernel:12} {lp['label']:10} {lp['instructions']:5d} {lp['mma']:4d} "
                          f"{lp['from_uniform']:7d}  {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
