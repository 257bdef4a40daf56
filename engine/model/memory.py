"""Memory a model's weights will take, checked against what the device has before they are made: a 27B synthetic
build or a CPU run of a large artifact is refused in one line instead of failing in torch's allocator minutes in."""

from __future__ import annotations

from pathlib import Path

import torch

GiB = 1 << 30


def available_bytes(device) -> int | None:
    """Bytes the device can still allocate: free GPU memory on CUDA, the kernel's MemAvailable on a Linux CPU;
    None where that cannot be read (no check then)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits_memory(need: int, device, what: str, hint: str) -> None:
    """ValueError when ``need`` bytes of ``what`` exceed what ``device`` has available (``hint``: what to do)."""
    have = available_bytes(device)
    if have is not None and need > have:
        where = "the GPU" if torch.device(device).type == "cuda" else "this machine"
        raise ValueError(f"{what} need {need / GiB:.1f} GiB, {where} has {have / GiB:.1f} GiB available: {hint}")
