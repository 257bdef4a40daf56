"""Pulling weight bytes into L2 ahead of the projection that reads them (``kernels/l2_prefetch.cu``).

Used by engine/fastpath.py on a CUDA-graph branch (``EngineOptions.l2_prefetch_mb``): while a layer's latency-bound
token mixing runs, HBM is nearly idle, and the layer's next projections can be on their way into L2. Needs what
:mod:`kernels.qmv_cuda` needs (CUDA, CuPy); reads the weights qmv reads, changes nothing.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from .qmv_cuda import DENSE_FMT, DenseWeight, TiledWeight, _stream, available

_SOURCE = Path(__file__).with_name("l2_prefetch.cu")
CHUNK = 4096  # bytes a thread asks for (one bulk prefetch on sm_90+)
THREADS = 128


@functools.cache
def _kernel(device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_SOURCE.read_text(), backend="nvrtc", options=("-std=c++17",))
        return module.get_function("l2_prefetch")


def prepare(device) -> bool:
    """Compile and load the prefetch kernel for ``device`` now (a CUDA-graph capture must not be the first to launch
    it); False where it cannot run."""
    if not available():
        return False
    _kernel(device.index if device.index is not None else torch.cuda.current_device())
    return True


def weight_sections(lin) -> list[torch.Tensor]:
    """The tensors qmv reads for the weight ``lin`` (a PackedLinear / DenseLinear kept for qmv, or its tiled copy),
    each in the order qmv's blocks take its tiles (codes, scales, q5 high bits; a dense weight's values); [] for a
    weight qmv does not read in place."""
    lin = getattr(lin, "qmv_weight", None) or lin
    if not isinstance(lin, (TiledWeight, DenseWeight)):
        return []
    if lin.fmt == DENSE_FMT:
        return [lin.weight]
    return [t for t in (lin.codes, lin.scales, lin.high if lin.fmt == "q5_g64_fp16" else None) if t is not None]


def prefetch(tensors, budget: int) -> int:
    """Pull the leading bytes of ``tensors`` (one weight's :func:`weight_sections`) into L2 on the current stream, at
    most ``budget`` bytes in all, each tensor the same share (so the first tiles arrive with their scales): for a
    CUDA-graph branch beside latency-bound kernels, so that the projection that runs next finds its first tiles in
    L2 instead of HBM. Changes no value. Returns the bytes asked for."""
    tensors = [t for t in tensors if t is not None and t.is_cuda and t.numel()]
    total = sum(t.numel() * t.element_size() for t in tensors)
    if not tensors or budget <= 0 or not available():
        return 0
    frac = min(1.0, budget / total)
    dev = tensors[0].device.index if tensors[0].device.index is not None else torch.cuda.current_device()
    kern, stream = _kernel(dev), torch.cuda.current_stream(tensors[0].device)
    asked = 0
    import cupy

    with cupy.cuda.Device(dev):
        for t in tensors:
            nbytes = int(t.numel() * t.element_size() * frac)
            if nbytes < CHUNK:
                continue
            blocks = -(-nbytes // (CHUNK * THREADS))
            kern((blocks,), (THREADS,), (np.uint64(t.data_ptr()), np.int64(nbytes), np.int32(CHUNK)),
                 stream=_stream(stream, dev))
            asked += nbytes
    return asked
