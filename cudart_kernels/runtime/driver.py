"""Thin layer over the CUDA driver API: init probe, error checks, primary contexts, device properties, streams."""
from __future__ import annotations

import functools
import json
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


# The copy rate of the H100 SXM the heuristics' constants were fitted on (device-to-device, read + write counted;
# `cudart-kernels bench` prints it: 2996 GB/s, 2026-11-27), and its share of that H100's 3.35 TB/s peak: what a
# copy is taken to reach where it cannot be measured.
FIT_STREAM_BYTES_PER_S = 2.996e12
COPY_SHARE = FIT_STREAM_BYTES_PER_S / 3.35e12


@dataclass(frozen=True)
class DeviceProperties:
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    smem_per_block_optin: int  # bytes a block may opt in to (232448 on H100)
    l2_bytes: int
    dram_bytes_per_s: float = 3.35e12  # peak: 2 x memory clock x bus width (H100 SXM: 3.35 TB/s)
    stream_bytes_per_s: float = FIT_STREAM_BYTES_PER_S  # measured copy rate, read + write (stream_rate)
    sm_clock_khz: int = 1980000  # the SMs' highest clock

    @property
    def arch(self) -> str:
        major, minor = self.compute_capability
        # Hopper's wgmma/setmaxnreg live only in the arch-specific target.
        return f"sm_{major}{minor}a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


# What config heuristics assume when no GPU is present (compile-ahead, CPU tests): an H100 SXM.
H100 = DeviceProperties("NVIDIA H100 (assumed)", (9, 0), 132, 232448, 50 * 1024 * 1024)
# An H200 SXM for the CPU tests of the picks: the H100's SMs, the 60 MiB of L2 the driver reports for it, 4.8 TB/s of
# HBM3e (copy rate assumed at the H100's share of the peak: 4.29 TB/s; 4.22-4.25 measured, 2026-11-28).
H200 = DeviceProperties("NVIDIA H200 (assumed)", (9, 0), 132, 232448, 60 * 1024 * 1024, 4.8e12, 4.8e12 * COPY_SHARE)


@functools.lru_cache(maxsize=None)
def device_properties(device: int = 0) -> DeviceProperties:
    """The device's figures the heuristics use: attributes, and for a Hopper GPU its copy rate (stream_rate)."""
    if not gpu_available():
        return H100
    dev = check(cu.cuDeviceGet(device))
    A = cu.CUdevice_attribute

    def attr(a):
        return check(cu.cuDeviceGetAttribute(a, dev))

    name = check(cu.cuDeviceGetName(256, dev)).split(b"\0", 1)[0].decode()
    cc = (attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
    l2 = attr(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
    peak = (2.0 * attr(A.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE) * 1e3
            * attr(A.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH) / 8)
    return DeviceProperties(
        name=name,
        compute_capability=cc,
        sm_count=attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        smem_per_block_optin=attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        l2_bytes=l2,
        dram_bytes_per_s=peak,
        stream_bytes_per_s=stream_rate(device, name, peak, l2) if cc == (9, 0) else peak * COPY_SHARE,
        sm_clock_khz=attr(A.CU_DEVICE_ATTRIBUTE_CLOCK_RATE),
    )


def stream_rate(device: int, name: str, peak: float, l2_bytes: int) -> float:
    """The device's copy rate in bytes/s (read + write): CUDART_KERNELS_STREAM_BW if set, else measured once per
    device (device-to-device copies of buffers 4x L2, some milliseconds; the best of three batches, so that a
    moment of other work on the GPU does not count) and kept in the kernel cache directory beside the cubins,
    keyed by the device's UUID and peak; processes sharing the cache measure one at a time and then read it.
    Where it cannot be measured (no memory free) or the figure is implausible (under 60% of the peak: the GPU
    was busy), COPY_SHARE of the peak for this process, nothing kept."""
    env = os.environ.get("CUDART_KERNELS_STREAM_BW")
    if env:
        return float(env)
    from .compiler import cache_dir, entry_lock  # (the compiler imports this module)

    uuid = bytes(check(cu.cuDeviceGetUuid(check(cu.cuDeviceGet(device)))).bytes).hex()
    path = cache_dir() / f"device-{uuid}.json"

    def kept():
        try:
            k = json.loads(path.read_text())
            return float(k["stream_bytes_per_s"]) if k.get("name") == name and k.get("peak") == peak else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    rate = kept()
    if rate is not None:
        return rate
    with entry_lock(path):
        rate = kept()  # (measured by another process while this one waited)
        if rate is not None:
            return rate
        try:
            rate = _measure_copy_rate(device, max(256 << 20, 4 * l2_bytes))
        except CudaError:
            return peak * COPY_SHARE
        if rate < 0.6 * peak:
            return peak * COPY_SHARE
        try:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"name": name, "peak": peak, "stream_bytes_per_s": rate}))
            os.replace(tmp, path)
        except OSError:
            pass  # an unwritable cache: measured again by the next process
    return rate


class relaxed_capture:
    """This thread's stream-capture mode set to relaxed for a block: allocating and freeing device memory is then
    allowed while some stream captures (the allocation is not part of the graph)."""

    def __enter__(self):
        self._mode = check(cu.cuThreadExchangeStreamCaptureMode(
            cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))

    def __exit__(self, *exc):
        check(cu.cuThreadExchangeStreamCaptureMode(self._mode))


def _measure_copy_rate(device: int, nbytes: int, batches: int = 3, copies: int = 4) -> float:
    """The best of `batches` batches of `copies` copies timed back to back (after one untimed), on a stream of our
    own, in the device's primary context pushed over the caller's (no context switch left behind), with this
    thread's capture mode relaxed (a graph being captured elsewhere does not forbid the allocations)."""
    check(cu.cuCtxPushCurrent(primary_context(device)))
    bufs, stream, events = [], None, []
    try:
        with relaxed_capture():
            try:
                bufs = [check(cu.cuMemAlloc(nbytes)) for _ in range(2)]
                stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
                events = [check(cu.cuEventCreate(0)) for _ in range(batches + 1)]
                check(cu.cuMemsetD8Async(bufs[0], 0x5A, nbytes, stream))
                check(cu.cuMemcpyDtoDAsync(bufs[1], bufs[0], nbytes, stream))
                check(cu.cuEventRecord(events[0], stream))
                for b in range(batches):
                    for _ in range(copies):
                        check(cu.cuMemcpyDtoDAsync(bufs[1], bufs[0], nbytes, stream))
                    check(cu.cuEventRecord(events[b + 1], stream))
                check(cu.cuEventSynchronize(events[-1]))
                ms = min(check(cu.cuEventElapsedTime(e0, e1)) for e0, e1 in zip(events, events[1:]))
                return 2.0 * nbytes * copies / (ms * 1e-3)
            finally:
                for e in events:
                    cu.cuEventDestroy(e)
                if stream is not None:
                    cu.cuStreamDestroy(stream)
                for b in bufs:
                    cu.cuMemFree(b)
    finally:
        cu.cuCtxPopCurrent()


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
