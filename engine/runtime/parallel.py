"""Start the ranks of a tensor-parallel run: one process each, a torch.distributed group between them (gloo on
CPUs, NCCL on GPUs, one GPU a rank), as ``torchrun`` would, from inside Python.

``launch(size, fn, *args)`` runs ``fn(rank, *args)`` in ``size`` fresh (spawned) processes and returns their results
in rank order; ``fn`` and its arguments must pickle (a module-level function). A rank that raises ends the run with
that rank's traceback. NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``),
as the machines this project measures on need.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback

import torch

__all__ = ["default_backend", "launch"]


def default_backend(size: int) -> str:
    """NCCL when this machine has ``size`` GPUs, else gloo: CPU ranks, or ranks that share this machine's GPUs (the
    collectives staged through host memory, engine/model/tensor_parallel.TPGroup: a check of the split, not a
    speed)."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= size else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, size: int, port: int, backend: str, fn, args, results, collective_timeout_s) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    timeout = None if collective_timeout_s is None else datetime.timedelta(seconds=collective_timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timeout)
    try:
        out = (rank, fn(rank, *args), None)
    except BaseException:  # noqa: BLE001 - the parent raises it, with this traceback
        out = (rank, None, traceback.format_exc())
    try:
        dist.destroy_process_group()
    finally:
        # by value (plain pickle): torch's queue would share tensors through this process's memory, which ends here
        results.put(pickle.dumps(out))
        results.close()
        results.join_thread()  # the message is in the pipe before the process ends


def launch(size: int, fn, *args, backend: str | None = None, timeout_s: float | None = None,
           collective_timeout_s: float | None = None) -> list:
    """``[fn(0, *args), ..., fn(size - 1, *args)]``, each in a process of its own that is a rank of a
    ``size``-rank group (``backend``: gloo or nccl, default :func:`default_backend`). ``timeout_s``: give up on
    ranks still running after that long (None: wait while they live; a rank that ends without a result is reported
    at once either way); ``collective_timeout_s``: how long a collective may wait (None: torch's default)."""
    import torch.multiprocessing as mp

    if size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {size}")
    backend = backend or default_backend(size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = mp.start_processes(_rank, args=(size, _free_port(), backend, fn, args, results, collective_timeout_s),
                               nprocs=size, join=False, start_method="spawn")
    got: dict[int, object] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while len(got) < size:
            try:
                rank, value, err = pickle.loads(results.get(timeout=1.0))
            except queue.Empty:
                missing = sorted(set(range(size)) - set(got))
                dead = [r for r in missing if not procs.processes[r].is_alive()]
                if dead:  # a rank that ended: its message may still be on its way, else it ended without a word
                    try:
                        rank, value, err = pickle.loads(results.get(timeout=5.0))
                    except queue.Empty:
                        codes = [procs.processes[r].exitcode for r in dead]
                        raise RuntimeError(f"tensor parallel: rank(s) {dead} ended with exit code(s) {codes} and "
                                           "no result") from None
                elif deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"tensor parallel: no result from ranks {missing} in {timeout_s:.0f} s") \
                        from None
                else:
                    continue
            if err is not None:  # the exception's own line first (a one-line error shows that much)
                last = next((ln for ln in reversed(err.strip().splitlines()) if ln.strip()), "")
                raise RuntimeError(f"tensor parallel rank {rank} failed: {last.strip()}\n{err}")
            got[rank] = value
    finally:
        done = len(got) == size
        for p in procs.processes:
            if p.is_alive() and not done:
                p.terminate()
        try:
            while not procs.join():
                pass
        except Exception:  # a rank that failed (or was stopped): its error is the one raised above
            if done:
                raise
    return [got[r] for r in range(size)]
