"""Running the Triton kernels on the CPU: the interpreter, and a fix for one of its bugs.

Import this module before anything imports triton: without CUDA it sets TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def fix_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a loop bound into an int with int(shape-(1,) array), which numpy >= 2.4
    rejects (triton-lang/triton#9171); the kernels' loops start and stop at run-time values. Idempotent."""
    try:
        int(np.zeros(1))
        return
    except TypeError:
        pass
    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return
    patch = interp._patch_lang_tensor
    if getattr(patch, "_ninfer_fixed", False):
        return

    def fixed(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    fixed._ninfer_fixed = True
    interp._patch_lang_tensor = fixed


if INTERPRET:
    fix_loop_bounds()


def assert_imports_without_triton(module: str) -> None:
    """``ninfer_bench.kernels.<module>`` imports, and says triton is unavailable, in a Python where triton cannot be
    imported (a fresh process, so this one's imports do not count; the checkout is bootstrapped as on the GPU box)."""
    import subprocess
    import sys
    from pathlib import Path

    scripts = Path(__file__).resolve().parent.parent / "scripts"
    code = (f"import sys; sys.modules['triton'] = None; sys.path.insert(0, {str(scripts)!r})\n"
            "import _bootstrap; _bootstrap.ensure_package()\n"
            f"from ninfer_bench.kernels import {module} as m\n"
            "assert not m.triton_available()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
