"""Weight prefetch into L2 on a side stream, while the decode step's small kernels leave HBM idle.

A GDN layer's token mixing (conv, recurrence, gated norm) and an attention layer's (prologue, split, combine) are
latency-bound launches that read a few MB; the projection after them (``out_proj`` / ``o_proj``, 17-20 MB at the
27B shape) then starts cold and pays its ramp. :func:`prefetch` forks a side stream at the point it is called
(after the mixer's input projections), where one small kernel asks the TMA unit to pull the next projection's
packed weights into L2 (``cp.async.bulk.prefetch.L2``: a hint, no data moves to the SMs, nothing is written); the
side stream joins the main one at :func:`join` (end of the forward). Weights never change, so the prefetch races
with nothing; it changes when bytes arrive, never what any kernel computes.

Only inside a CUDA-graph capture (an eager prefetch would cost a host launch to save device time) and only when
switched on (:func:`set_enabled`, ``EngineOptions.l2_prefetch``); sm_90+ with cupy. The kernel is compiled at run
time (NVRTC) like ``kernels/qmv_cuda.cu``.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

CHUNK = 64 * 1024  # bytes a thread asks for with one bulk prefetch
THREADS = 128
_SOURCE = r"""
extern "C" __global__ void l2_prefetch(const unsigned char* p, unsigned long long n) {
  const unsigned long long off = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) * CHUNK;
  if (off >= n) return;
  const unsigned long long left = n - off;
  const unsigned int len = (unsigned int)((left < CHUNK ? left : CHUNK) & ~15ull);  // whole 16-byte units
  if (len) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(len) : "memory");
}
"""
# side streams by device; devices forked and not yet joined; prefetch kernels launched (captured) so far
_STATE = {"on": False, "side": {}, "forked": set(), "launches": 0}


def set_enabled(on: bool, device: torch.device | None = None) -> None:
    """Prefetch from now on (inside CUDA-graph captures on sm_90+ with cupy), or not. With ``device`` the kernel is
    compiled and the side stream made now: neither may happen inside a capture."""
    _STATE["on"] = bool(on)
    if on and device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if _capable(index):
            _kernel(index)
            _STATE["side"].setdefault(index, torch.cuda.Stream(device=device))


def enabled() -> bool:
    return _STATE["on"]


@functools.cache
def _capable(device_index: int) -> bool:
    from . import qmv_cuda

    return qmv_cuda.available() and torch.cuda.get_device_capability(device_index) >= (9, 0)


@functools.cache
def _kernel(device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_SOURCE, backend="nvrtc", options=("-std=c++17", f"-DCHUNK={CHUNK}ull"))
        return module.get_function("l2_prefetch")


def weight_tensors(lin) -> list[torch.Tensor]:
    """The device tensors a projection's decode kernel reads: qmv's tiles (codes, scales, q5 high bits), or a dense
    weight; nothing for anything else."""
    tiles = getattr(lin, "qmv_weight", None)
    if tiles is not None:
        return [t for t in (tiles.codes, tiles.scales, tiles.high) if t.numel() > 1]
    weight = getattr(lin, "weight", None)
    return [weight] if isinstance(weight, torch.Tensor) else []


def _active(device: torch.device) -> bool:
    if not _STATE["on"] or device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def prefetch(tensors: list[torch.Tensor]) -> None:
    """Pull ``tensors`` into L2 on the side stream, after everything queued on the current stream so far (only
    inside a capture, when enabled; otherwise nothing)."""
    if not tensors or not _active(tensors[0].device):
        return
    from . import qmv_cuda

    dev = tensors[0].device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    main = torch.cuda.current_stream(dev)
    side = _STATE["side"].get(index)
    if side is None:  # set_enabled without the device: nothing made outside the capture, so no prefetch
        return
    side.wait_stream(main)
    _STATE["forked"].add(index)
    kern = _kernel(index)
    import cupy

    with cupy.cuda.Device(index):
        for t in tensors:
            n = t.numel() * t.element_size()
            blocks = -(-n // (CHUNK * THREADS))
            kern((blocks,), (THREADS,), (np.uint64(t.data_ptr()), np.uint64(n)),
                 stream=qmv_cuda._stream(side, index))
            _STATE["launches"] += 1


def join(device: torch.device) -> None:
    """The current stream waits for the prefetches forked since the last join (a capture must end joined)."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _STATE["forked"]:
        _STATE["forked"].discard(index)
        torch.cuda.current_stream(device).wait_stream(_STATE["side"][index])
