"""What the CuPy-compiled kernels (kernels/qmv_cuda.py, kernels/attn_cuda.py) share: whether they can run here, and
the cupy view of a torch stream to launch on."""

from __future__ import annotations

import torch


def import_error(needs: str) -> str | None:
    """Why a CuPy kernel cannot run here (None when it can): no CUDA device, a GPU older than sm_80 (``needs`` names
    the instructions that require it), or no cupy."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() < (8, 0):
        major, minor = torch.cuda.get_device_capability()
        return f"needs an sm_80+ GPU ({needs}), found sm_{major}{minor}"
    try:
        import cupy  # noqa: F401
    except Exception as e:  # ImportError, or a cupy built for another CUDA
        return f"cupy does not import ({type(e).__name__}: {e})"
    return None


_STREAMS: dict[int, object] = {}


def stream(torch_stream: torch.cuda.Stream, device_index: int):
    """The cupy view of a torch stream (made once per stream: the launch path stays cheap)."""
    key = torch_stream.cuda_stream
    s = _STREAMS.get(key)
    if s is None:
        import warnings

        import cupy

        with warnings.catch_warnings():  # cupy 14 deprecates ExternalStream; 13 has no replacement for raw handles
            warnings.simplefilter("ignore", DeprecationWarning)
            s = _STREAMS[key] = cupy.cuda.ExternalStream(key, device_index)
    return s
