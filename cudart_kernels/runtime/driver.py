"""Thin layer over the CUDA driver API: init probe, error checks, primary contexts, device properties, streams."""
from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

from cuda.bindings import driver as cu


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


class NoDeviceError(RuntimeError):
    """No usable CUDA device (no driver, or no GPU)."""


def check(result):
    """Unpack a cuda.bindings result tuple, raising CudaError on failure."""
    err = result[0]
    if err:
        _, name = cu.cuGetErrorName(err)
        _, msg = cu.cuGetErrorString(err)
        raise CudaError(f"{name.decode() if name else err}: {msg.decode() if msg else ''}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


@functools.lru_cache(maxsize=None)
def _init() -> str | None:
    """Initialise the driver once; return None on success or the reason there is no device."""
    try:
        err, = cu.cuInit(0)
    except RuntimeError as e:  # libcuda.so missing
        return f"no CUDA driver ({e})"
    if err:
        return f"cuInit failed ({err.name})"
    err, n = cu.cuDeviceGetCount()
    if err or n == 0:
        return "no CUDA device"
    return None


def gpu_available() -> bool:
    return _init() is None


def require_gpu() -> None:
    reason = _init()
    if reason is not None:
        raise NoDeviceError(reason)


def device_count() -> int:
    return check(cu.cuDeviceGetCount()) if gpu_available() else 0


def driver_version() -> int | None:
    return check(cu.cuDriverGetVersion()) if gpu_available() else None


@functools.lru_cache(maxsize=None)
def primary_context(device: int):
    require_gpu()
    dev = check(cu.cuDeviceGet(device))
    return check(cu.cuDevicePrimaryCtxRetain(dev))


@functools.lru_cache(maxsize=None)
def _primary_context_handle(device: int) -> int:
    return int(primary_context(device))


@functools.lru_cache(maxsize=None)
def _device_problem(device: int) -> str | None:
    """Why `device` cannot run these kernels (no driver, no such GPU, not Hopper), or None."""
    reason = _init()
    if reason is not None:
        return f"cudart-kernels needs an sm_90a (Hopper) GPU: {reason}"
    n = device_count()
    if not 0 <= device < n:
        return f"cudart-kernels: there is no CUDA device {device} ({n} present)"
    p = device_properties(device)
    if p.compute_capability != (9, 0):
        major, minor = p.compute_capability
        return f"cudart-kernels needs an sm_90a (Hopper) GPU; device {device} is {p.name} (sm_{major}{minor})"
    return None


def require_device(device: int) -> None:
    """Raise NoDeviceError (one line naming the cause) unless `device` is a Hopper GPU the driver can use."""
    problem = _device_problem(device)
    if problem is not None:
        raise NoDeviceError(problem)


# Per device: its primary context's handle, once the device has been checked (a hit is one dict read).
_context_handles: dict = {}
# With one GPU in the process, a thread that has had its primary context current at an op keeps it: only the
# caller's own contexts (cuCtxCreate, green contexts) could take its place, and a launch or memset in such a
# context fails and is retried in the primary one (device_context). Such threads skip the per-call query.
_one_gpu: list = []  # [True or False] once known
_thread = threading.local()


def enter_device(device: int):
    """Make `device`'s primary context (the one torch, cupy and jax use) current on this thread for the driver
    calls that follow. Returns the context that was current before when it was another one, for `leave_device`
    to make current again, else None. A thread with no current context keeps the device's. With several GPUs
    every call asks the driver which context is current (a thread-local read): torch.cuda.set_device and friends
    change it behind our back, so no copy of it is kept; with one, a thread asks once (_one_gpu)."""
    if getattr(_thread, "settled", False):  # (set only with one GPU, after its context handle was cached)
        return None
    return _switch_to(device)


def _switch_to(device: int):
    """enter_device without the one-GPU shortcut."""
    want = _context_handles.get(device)
    if want is None:
        require_device(device)
        want = _context_handles[device] = _primary_context_handle(device)
        if not _one_gpu:
            _one_gpu.append(device_count() == 1)
    current = cu.cuCtxGetCurrent()[1]
    previous = current if current is not None and int(current) else None
    if previous is not None and int(previous) == want:
        previous = None
    else:
        check(cu.cuCtxSetCurrent(primary_context(device)))
    if previous is None and _one_gpu[0]:
        _thread.settled = True  # (the primary context stays current after the op)
    return previous


def leave_device(previous) -> None:
    """Undo `enter_device`: make the caller's context current again (nothing to do for None)."""
    if previous is not None:
        check(cu.cuCtxSetCurrent(previous))


class device_context:
    """`with device_context(d):` runs the block's driver calls in device d's primary context and leaves the
    caller's context current afterwards (for the runtime's slower paths; ops use enter_device / leave_device
    around their launches, which costs less)."""

    __slots__ = ("device", "previous")

    def __init__(self, device: int):
        self.device = device

    def __enter__(self):
        self.previous = _switch_to(self.device)
        return self

    def __exit__(self, *exc):
        leave_device(self.previous)


def use_device(device: int) -> None:
    """Make `device`'s primary context current on this thread and leave it current (scripts and benchmarks; the
    library's own calls restore the caller's context); NoDeviceError first when it cannot run these kernels."""
    _switch_to(device)


@dataclass(frozen=True)
class DeviceProperties:
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    smem_per_block_optin: int  # bytes a block may opt in to (232448 on H100)
    l2_bytes: int
    dram_bytes_per_s: float = 3.35e12  # peak: 2 x memory clock x bus width (H100 SXM: 3.35 TB/s)

    @property
    def arch(self) -> str:
        major, minor = self.compute_capability
        # Hopper's wgmma/setmaxnreg live only in the arch-specific target.
        return f"sm_{major}{minor}a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


# What config heuristics assume when no GPU is present (compile-ahead, CPU tests): an H100 SXM.
H100 = DeviceProperties("NVIDIA H100 (assumed)", (9, 0), 132, 232448, 50 * 1024 * 1024)


@functools.lru_cache(maxsize=None)
def device_properties(device: int = 0) -> DeviceProperties:
    if not gpu_available():
        return H100
    dev = check(cu.cuDeviceGet(device))
    A = cu.CUdevice_attribute

    def attr(a):
        return check(cu.cuDeviceGetAttribute(a, dev))

    name = check(cu.cuDeviceGetName(256, dev)).split(b"\0", 1)[0].decode()
    return DeviceProperties(
        name=name,
        compute_capability=(attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                            attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
        sm_count=attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        smem_per_block_optin=attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        l2_bytes=attr(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        dram_bytes_per_s=2.0 * attr(A.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE) * 1e3
        * attr(A.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH) / 8,
    )


def target_arch(device: int | None = 0) -> str:
    """The arch to compile for: CUDART_KERNELS_ARCH, else the device's, else sm_90a (compile-ahead without a GPU)."""
    env = os.environ.get("CUDART_KERNELS_ARCH")
    if env:
        return env
    return device_properties(device or 0).arch if gpu_available() else "sm_90a"


def smem_stages(per_stage: int, fixed: int, budget: int, max_stages: int = 32) -> int:
    """How many pipeline stages of `per_stage` bytes fit beside `fixed` bytes in a `budget`-byte block."""
    if per_stage <= 0:
        raise ValueError("per_stage must be positive")
    return max(0, min(max_stages, (budget - fixed) // per_stage))


# ---- streams ---------------------------------------------------------------------------------------------------

def stream_handle(stream) -> int:
    """A CUstream handle from None (legacy default stream), an int, or any stream object.

    Accepted: objects with ``__cuda_stream__`` (cuda.core, torch >= 2.5, cupy >= 13), ``.cuda_stream`` (torch),
    ``.ptr`` (cupy), ``cuda.bindings`` CUstream.
    """
    if stream is None:
        return 0
    if type(stream) is int:
        if stream < 0:
            raise ValueError(f"invalid stream handle {stream}")
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        res = proto() if callable(proto) else proto
        return int(res[1])
    for attr in ("cuda_stream", "ptr"):
        h = getattr(stream, attr, None)
        if isinstance(h, int):
            return h
    if isinstance(stream, cu.CUstream):
        return int(stream)
    raise TypeError(f"cannot interpret {type(stream).__name__} as a CUDA stream")


def stream_is_capturing(handle: int) -> bool:
    status = check(cu.cuStreamIsCapturing(handle))
    return status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
