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


def parse_build(text: str, where: str = "a kernel build") -> dict[str, int]:
    """``"NAME=VALUE:NAME=VALUE"`` (extra ``-D`` defines of a CUDA source's build, e.g. ``VDEPTH=3:QSMEM=1``) as a
    dict; ValueError naming ``where`` the text came from when an item is not NAME=INTEGER."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(":"))):
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier() or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"{where}: a build define is NAME=INTEGER, got {item!r}")
        out[name] = int(value)
    return out


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


class ArchKernel:
    """A kernel compiled for an arch-specific target (``sm_90a``: wgmma, setmaxnreg), which CuPy's own compile path
    cannot name: it passes ``-arch=sm_<cc>`` itself. Called as a ``cupy.RawKernel`` is (``kernel(grid, block, args,
    stream=, shared_mem=)``); ``.kernel.ptr`` is the CUfunction (for cuLaunchKernelEx)."""

    def __init__(self, function):
        self.kernel = function  # cupy.cuda.function.Function (holds its module)

    def __call__(self, grid, block, args, stream=None, shared_mem=0):
        self.kernel(tuple(grid), tuple(block), args, shared_mem=shared_mem, stream=stream)

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        from cupy_backends.cuda.api import driver

        return driver.funcGetAttribute(_MAX_DYNAMIC_SHARED, self.kernel.ptr)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        from cupy_backends.cuda.api import driver

        driver.funcSetAttribute(self.kernel.ptr, _MAX_DYNAMIC_SHARED, int(value))


_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def arch_options(options, arch: str, cubin: bool = True) -> tuple[str, ...]:
    """NVRTC's options for an ``arch``-specific build (``"90a"``): the caller's, the target (machine code for
    ``sm_<arch>``, or with ``cubin`` false PTX for ``compute_<arch>``), and what CuPy's compile path adds
    (``-ftz=true``), so that the float arithmetic the two builds share rounds alike."""
    return (*options, f"-arch={'sm' if cubin else 'compute'}_{arch}", "-ftz=true")


def arch_kernel(source: str, options, arch: str, name: str, device_index: int) -> ArchKernel:
    """``name`` from ``source`` compiled by NVRTC for ``sm_<arch>`` and loaded on device ``device_index``: machine
    code (an NVRTC without ``getCUBIN`` gives PTX for ``compute_<arch>``, which the driver compiles). The image is kept
    in CuPy's kernel cache folder (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``) under a hash of the source,
    the options and NVRTC's version, so a later process skips NVRTC. RuntimeError with NVRTC's log when the source
    does not build."""
    import cupy
    from cupy.cuda import function

    image = _arch_image(source, tuple(options), arch, name)
    with cupy.cuda.Device(device_index):
        module = function.Module()
        module.load(image)
        return ArchKernel(module.get_function(name))


def _arch_image(source: str, options: tuple[str, ...], arch: str, name: str) -> bytes:
    """The cubin (or NUL-terminated PTX) of ``source`` for ``arch``, from the disk cache or NVRTC."""
    import hashlib
    import os
    import tempfile

    from cupy_backends.cuda.libs import nvrtc

    cubin = hasattr(nvrtc, "getCUBIN")
    options = arch_options(options, arch, cubin)
    key = hashlib.sha256("\0".join((source, *options, repr(nvrtc.getVersion()))).encode()).hexdigest()[:32]
    folder = os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")
    path = os.path.join(folder, f"ninfer_{name}_{key}.{'cubin' if cubin else 'ptx'}")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        pass
    prog = nvrtc.createProgram(source, f"{name}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC ({name}, {' '.join(options)}): {e}\n{nvrtc.getProgramLog(prog)}") from e
        image = nvrtc.getCUBIN(prog) if cubin else nvrtc.getPTX(prog)  # bytes in CuPy 14 (PTX a str before)
    finally:
        nvrtc.destroyProgram(prog)
    if isinstance(image, str):
        image = image.encode()
    image = _elf_whole(image) if cubin else image.rstrip(b"\0") + b"\0"  # PTX goes to the driver as a C string
    try:  # a cache that cannot be written (read-only home) only costs the next process a compile
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        os.replace(tmp, path)
    except OSError:
        pass
    return image


def _elf_whole(image: bytes) -> bytes:
    """A cubin (ELF64) as long as its headers say: CuPy's ``getCUBIN`` drops the last byte as if it were a string's
    NUL, and that byte belongs to the program headers at the file's end (tools such as cuobjdump then refuse it)."""
    import struct

    if len(image) < 64 or image[:4] != b"\x7fELF":
        return image
    phoff, shoff = struct.unpack_from("<QQ", image, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 54)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return image + b"\0" * (end - len(image)) if end > len(image) else image
