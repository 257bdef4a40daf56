"""One-shot all-reduce and all-gather between the ranks of a tensor-parallel group over CUDA IPC:
``kernels/ipc_collectives.cu``.

A decode step all-reduces a few KB twice a layer. NCCL's latency, or gloo's trip through host memory, is then the
step's cost, and neither can be captured here (gloo not at all), so a tensor-parallel engine would run its kernels
eagerly. Here every rank allocates one region of device memory, the ranks exchange its IPC handle once (over their
torch.distributed group) and open each other's, and one kernel a call copies the rank's part into its region,
exchanges a flag per block with every rank and reads the others' parts directly (vLLM's custom all-reduce follows
the same plan). The buffers are fixed and the epochs are counted on the device, so a call can be captured in a CUDA
graph and replayed.

- :meth:`IpcCollectives.reduce_` sums in rank order in fp32 and rounds once, so every rank gets the same bits;
  messages larger than the buffer go in pieces, one launch each.
- :meth:`IpcCollectives.gather_last` puts every rank's ``[..., cols]`` side by side.

Needs every rank on a GPU that can map the others' memory (peer access between the GPUs, or one GPU shared by the
ranks: a check of the code, whose spin-waits then take turns with the other processes), cupy (the ``[gpu]``
extra) and a process group to exchange the handles. :func:`create` returns None with the reason where that fails,
and the caller keeps torch.distributed's collectives.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from . import _cupy

__all__ = ["IpcCollectives", "alloc_region", "create", "kernel_options", "DEFAULT_MAX_BYTES", "NBLK", "THREADS"]

_SOURCE = Path(__file__).with_name("ipc_collectives.cu")
NBLK = 32  # blocks a call (every rank the same grid: block b takes the same elements on every rank)
THREADS = 512
HEAD = 4096  # flags [NBLK][ranks] and counters [NBLK] (u32) at the start of a region
MAX_RANKS = 8
DEFAULT_MAX_BYTES = 8 << 20  # one data buffer (there are two, by epoch parity): a piece of a larger message
_DT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def kernel_options(ranks: int, dt: int, vec: bool, max_bytes: int) -> tuple[str, ...]:
    """NVRTC's options for a build: ``ranks``, element type ``dt`` (0 bf16, 1 fp16, 2 fp32), 16-byte vectors
    ``vec``, a data buffer of ``max_bytes``."""
    return (f"-DNR={ranks}", f"-DDT={dt}", f"-DVEC={int(vec)}", f"-DNBLK={NBLK}", f"-DHEAD={HEAD}",
            f"-DMAXB={max_bytes}")


@functools.lru_cache(maxsize=None)
def _kernels(ranks: int, dt: int, vec: bool, max_bytes: int, device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_SOURCE.read_text(), backend="nvrtc",
                                options=kernel_options(ranks, dt, vec, max_bytes))
        out = module.get_function("ipc_reduce"), module.get_function("ipc_gather")
        for fn in out:
            if not fn.kernel.ptr:
                raise RuntimeError("ipc_collectives: a kernel did not load")
    return out


class IpcCollectives:
    """This rank's region and the opened regions of the others (``regions``: a device tensor of their addresses, rank
    order). Made by :func:`create`; :meth:`close` unmaps the others' regions and frees this one."""

    def __init__(self, rank: int, size: int, device: torch.device, base: int, opened: list[int], max_bytes: int):
        self.rank, self.size, self.device, self.max_bytes = rank, size, device, max_bytes
        self._base, self._opened = base, opened
        ptrs = [base if r == rank else opened[r] for r in range(size)]
        self.regions = torch.tensor(ptrs, dtype=torch.int64, device=device)
        for dt in _DT.values():  # every build loaded now: a first call may come inside a CUDA-graph capture
            for vec in (False, True):
                _kernels(size, dt, vec, max_bytes, device.index)

    def supports(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can go through here: on this rank's GPU, a dtype the kernels take, contiguous."""
        return x.device == self.device and x.dtype in _DT and x.is_contiguous()

    def _check(self, x: torch.Tensor) -> None:
        if not self.supports(x):
            raise ValueError(f"ipc_collectives: needs a contiguous bf16 / fp16 / fp32 tensor on {self.device}, got "
                             f"{x.dtype} on {x.device}")

    def _launch(self, kernel, args) -> None:
        stream = torch.cuda.current_stream(self.device)
        kernel((NBLK,), (THREADS,), args, stream=_cupy.stream(stream, self.device.index))

    def reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (in place) = the sum of every rank's ``x`` (the same shape on each), added in rank order in fp32 and
        rounded once to x's dtype; a message over ``max_bytes`` in pieces."""
        self._check(x)
        flat = x.view(-1)
        per = self.max_bytes // x.element_size()
        regions = np.uint64(self.regions.data_ptr())
        for start in range(0, flat.numel(), per):
            piece = flat[start:start + per]
            vec = piece.data_ptr() % 16 == 0 and (piece.numel() * x.element_size()) % 16 == 0
            kern = _kernels(self.size, _DT[x.dtype], vec, self.max_bytes, self.device.index)[0]
            self._launch(kern, (np.uint64(piece.data_ptr()), np.int64(piece.numel()), regions, np.int32(self.rank)))
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` ([..., cols], the same shape on each) side by side along the last dimension, rank order:
        a new tensor [..., size cols]."""
        self._check(x)
        cols = x.shape[-1]
        rows = x.numel() // max(cols, 1)
        out = torch.empty(*x.shape[:-1], cols * self.size, dtype=x.dtype, device=x.device)
        src, dst = x.reshape(rows, cols), out.view(rows, cols * self.size)
        regions = np.uint64(self.regions.data_ptr())
        kern = _kernels(self.size, _DT[x.dtype], False, self.max_bytes, self.device.index)[1]
        per = self.max_bytes // x.element_size()  # elements a piece: whole rows, else column blocks of rows
        width = max(1, min(cols, per))
        for c0 in range(0, cols, width):
            block = src[:, c0:c0 + width]
            w = block.shape[1]
            block = block if w == cols else block.contiguous()
            step = max(1, per // w)
            for r0 in range(0, rows, step):
                a = block[r0:r0 + step]
                self._launch(kern, (np.uint64(a.data_ptr()), np.uint64(dst[r0:, c0:].data_ptr()),
                                    np.int64(a.shape[0]), np.int64(w), np.int64(cols * self.size), np.int64(cols),
                                    regions, np.int32(self.rank)))
        return out

    def close(self) -> None:
        """Unmap the other ranks' regions and free this one (after every rank is done with them)."""
        _release(self.device, self.rank, self._base, self._opened)
        self._opened, self._base = [], 0
        for key in [k for k, v in _MADE.items() if v is self]:
            del _MADE[key]


def alloc_region(device: torch.device, max_bytes: int) -> int:
    """A rank's region (its flags and counters zeroed, two data buffers of ``max_bytes``), ready on return: its
    device address (free it with :func:`_release`, or through the :class:`IpcCollectives` made over it)."""
    import cupy

    with cupy.cuda.Device(device.index):
        base = cupy.cuda.runtime.malloc(HEAD + 2 * max_bytes)
        cupy.cuda.runtime.memset(base, 0, HEAD + 2 * max_bytes)
        cupy.cuda.runtime.deviceSynchronize()
    return base


def _release(device: torch.device, rank: int, base: int, opened: list[int]) -> None:
    import cupy

    with cupy.cuda.Device(device.index):
        for r, p in enumerate(opened):
            if r != rank and p:
                cupy.cuda.runtime.ipcCloseMemHandle(p)
        if base:
            cupy.cuda.runtime.free(base)


# the collectives this process made, by (rank, size, device index, buffer bytes, group): the engines of a grid's runs
# share them (every rank makes the same engines in the same order, so every rank finds its own at once)
_MADE: dict[tuple, IpcCollectives] = {}


def create(rank: int, size: int, device: torch.device, group=None,
           max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[IpcCollectives | None, str | None]:
    """(this rank's :class:`IpcCollectives`, None), or (None, why not). Collective: every rank of ``group`` (a
    torch.distributed group, None the default) must call it, in the same order as its other collectives. A second
    call with the same arguments returns the first one's (until it is closed)."""
    import torch.distributed as dist

    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (rank, size, device.index, max_bytes, id(group))
    if key in _MADE:
        return _MADE[key], None
    why = None
    if device.type != "cuda":
        why = "not on a GPU"
    elif not 2 <= size <= MAX_RANKS:
        why = f"{size} ranks (2..{MAX_RANKS} go through IPC)"
    elif max_bytes % 16 or max_bytes < 4096:
        why = f"a buffer of {max_bytes} bytes (a multiple of 16, at least 4096)"
    else:
        why = _cupy.import_error("IPC collectives")
    base, handle = 0, None
    if why is None:
        try:
            import cupy

            base = alloc_region(device, max_bytes)
            with cupy.cuda.Device(device.index):
                handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(base))
        except Exception as e:  # noqa: BLE001 - reported, and the caller keeps torch.distributed's collectives
            why = f"IPC handle: {type(e).__name__}: {e}"
    # every rank learns whether every rank got this far, and the handles
    mine = (why, handle)
    every = [None] * size
    dist.all_gather_object(every, mine, group=group)
    bad = [f"rank {r}: {w}" for r, (w, _) in enumerate(every) if w]
    opened = [0] * size
    if not bad:
        try:
            import cupy

            with cupy.cuda.Device(device.index):
                for r, (_, h) in enumerate(every):
                    if r != rank:
                        opened[r] = cupy.cuda.runtime.ipcOpenMemHandle(h)
        except Exception as e:  # noqa: BLE001
            bad = [f"rank {rank}: opening the others' handles: {type(e).__name__}: {e}"]
    # every rank must agree to use them (one that could not open a handle makes them all fall back)
    agree = [None] * size
    dist.all_gather_object(agree, bad, group=group)
    bad = [b for got in agree for b in got]
    if bad:
        if base or any(opened):
            _release(device, rank, base, opened)
        return None, "; ".join(dict.fromkeys(bad))
    made = _MADE[key] = IpcCollectives(rank, size, device, base, opened, max_bytes)
    return made, None

