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


def fix_dot_rows() -> None:
    """The interpreter's ``tl.dot`` is numpy's float32 matmul, and OpenBLAS (DYNAMIC_ARCH) runs the rows of a block
    through microkernel paths that add the products in other orders: on an AVX2 AMD EPYC the odd rows of a tile came
    out in other bits than the same values at an even row, so a kernel whose rows must not depend on their place in
    a tile (token invariance) failed there and passed on an AVX-512 Intel CPU. The product is taken in float64 (each
    float32 product exact, the sums' order moving only the float64 rounding) and rounded to the accumulator's type:
    an element's value then depends on its row's values alone, wherever the row sits. Integer dots are left as they
    are (exact). Idempotent."""
    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return
    builder = interp.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_ninfer_fixed", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.dtype
        if not np.issubdtype(acc, np.floating) or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(acc)
        return interp.TensorHandle(prod + d.data, d.dtype.scalar)

    create_dot._ninfer_fixed = True
    builder.create_dot = create_dot


def skip_nested_lang_patches() -> None:
    """A speed-up, not a fix: Triton 3.6's interpreter re-patches triton.language (``_patch_lang``: an
    ``inspect.getmembers`` walk of ``tl``, ``tl.tensor``, ``tl.math``, ...) at every call of a ``@triton.jit``
    helper inside a kernel, once per program of the grid, and never undoes it; the launch around it has already
    patched the same modules, so the walk finds no builtin left to patch and only re-sets equivalent stateless
    closures (``range``, ``reduce``, ``tensor.__index__``, ...) that the launch's own restore then undoes. That walk
    was a quarter to a third of the interpreted kernels' time. Here a helper whose language modules the running
    launch has patched skips it; any other call (outside a launch, or a helper that sees a module the launch's
    kernel does not) patches as before. The kernels' semantics, the interpreter's type checks and its overflow
    sanitizer are untouched. Idempotent."""
    try:
        import inspect

        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:
        return
    if getattr(interp.InterpretedFunction.__call__, "_ninfer_fixed", False):
        return
    langs_of: dict = {}
    running: list = []  # the language modules each running launch patched (innermost last)

    def langs(fn):
        key = id(fn.__globals__)
        if key not in langs_of:  # _patch_lang's own selection
            langs_of[key] = frozenset(id(v) for v in fn.__globals__.values()
                                      if inspect.ismodule(v) and v in [tl, tl.core])
        return langs_of[key]

    launch = interp.GridExecutor.__call__

    def grid_call(self, *args, **kwargs):
        running.append(langs(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            running.pop()

    def device_call(self, *args, **kwargs):  # InterpretedFunction.__call__ of triton 3.6, the patch made conditional
        if not (running and langs(self.fn) <= running[-1]):
            interp._patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    grid_call._ninfer_fixed = device_call._ninfer_fixed = True
    interp.GridExecutor.__call__ = grid_call
    interp.InterpretedFunction.__call__ = device_call


def skip_dead_overflow_checks() -> None:
    """A speed-up, not a fix: for every integer ``+``, ``-`` and ``*`` Triton 3.6's front end builds an overflow
    check (both operands cast to int64, the operation redone, compared with the type's bounds) whose only effect is a
    ``device_assert``, and ``device_assert`` emits nothing unless the options ask for ``debug``; the interpreter's
    options never do (``InterpreterOptions.debug`` is False), so each check was dead work on every program of every
    interpreted launch (about a third of the kernels' time). Here it is skipped exactly where its assert would be
    dropped (an interpreter builder without ``debug``); results are unchanged. Idempotent."""
    try:
        import triton.language.semantic as sem
        import triton.runtime.interpreter as interp
    except ImportError:
        return
    original = sem.TritonSemantic.binary_op_sanitize_overflow_impl
    if getattr(original, "_ninfer_fixed", False):
        return

    def check(self, lhs, rhs, binary_op):
        if isinstance(self.builder, interp.InterpreterBuilder) and not self.builder.options.debug:
            return None  # the check would end in a device_assert that device_assert drops without debug
        return original(self, lhs, rhs, binary_op)

    check._ninfer_fixed = True
    sem.TritonSemantic.binary_op_sanitize_overflow_impl = check


if INTERPRET:
    fix_loop_bounds()
    fix_dot_rows()
    skip_nested_lang_patches()
    skip_dead_overflow_checks()


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
