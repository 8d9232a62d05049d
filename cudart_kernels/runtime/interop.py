"""Device arrays in and out: DLPack (versioned and legacy), __cuda_array_interface__, raw pointers, and the
library's own DeviceArray, so a numpy-only script needs no framework.

Strides are in elements everywhere in this module (DLPack's convention); CAI byte strides are converted.
"""
from __future__ import annotations

import atexit
import ctypes
import sys
from ctypes import POINTER, c_char_p, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

import numpy as np
from cuda.bindings import driver as cu

from . import dtypes as dt
from .driver import check, device_context, gpu_available, stream_handle, stream_is_capturing

# ---- DLPack ABI ------------------------------------------------------------------------------------------------
kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged = 1, 2, 3, 13


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32), ("dtype", DLDataType),
                ("shape", POINTER(c_int64)), ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


_Deleter = ctypes.CFUNCTYPE(None, c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", _Deleter)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", _Deleter),
                ("flags", c_uint64), ("dl_tensor", DLTensor)]


_VERSIONED = b"dltensor_versioned"
_LEGACY = b"dltensor"
_api = ctypes.pythonapi
# Two flavours of the capsule calls: on live objects (py_object) and, inside a capsule destructor, on a raw
# pointer (turning a dying capsule into a py_object would resurrect it).
_GetPointer = ctypes.PYFUNCTYPE(c_void_p, ctypes.py_object, c_char_p)(("PyCapsule_GetPointer", _api))
_GetName = ctypes.PYFUNCTYPE(c_char_p, ctypes.py_object)(("PyCapsule_GetName", _api))
_IsValidRaw = ctypes.PYFUNCTYPE(ctypes.c_int, c_void_p, c_char_p)(("PyCapsule_IsValid", _api))
_GetPointerRaw = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_char_p)(("PyCapsule_GetPointer", _api))
_CapsuleDestructor = ctypes.CFUNCTYPE(None, c_void_p)
_CapsuleNew = ctypes.PYFUNCTYPE(ctypes.py_object, c_void_p, c_char_p, _CapsuleDestructor)(("PyCapsule_New", _api))


def _dlpack_stream_arg(handle: int) -> int:
    # DLPack: 1 = legacy default stream, 2 = per-thread default, otherwise the handle itself (0 is not allowed).
    return 1 if handle == 0 else handle


def _handle_from_dlpack_stream(stream) -> int | None:
    """Consumer's `stream` argument -> CUstream handle, or None for 'do not synchronise' (-1)."""
    if stream is None or stream == 1:
        return 0
    if stream == -1:
        return None
    if not isinstance(stream, int) or stream < 0:
        raise BufferError(f"invalid DLPack stream {stream!r}")
    return stream


def _order(producer: int | None, consumer: int | None, device: int) -> None:
    """Make `consumer` wait for the work queued on `producer` so far (no-op when they are the same stream), in
    `device`'s context (the producer's: an event is recorded on a stream of its own context, and 0 means that
    context's legacy default stream)."""
    if producer is None or consumer is None or producer == consumer:
        return
    with device_context(device):
        ev = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        try:
            check(cu.cuEventRecord(ev, producer))
            check(cu.cuStreamWaitEvent(consumer, ev, 0))
        finally:
            check(cu.cuEventDestroy(ev))


# ---- device memory ---------------------------------------------------------------------------------------------

_exiting = False


@atexit.register
def _mark_exit():
    global _exiting
    _exiting = True


class _Allocation:
    """Stream-ordered device memory (cuMemAllocAsync), freed on the stream it was allocated on. A stream given as
    an object (torch, cupy, cuda.core) is kept alive until then; a raw handle must outlive the array."""

    __slots__ = ("ptr", "stream", "device", "nbytes", "_stream_owner")

    def __init__(self, nbytes: int, device: int, stream: int, stream_owner=None):
        self._stream_owner = stream_owner
        with device_context(device):  # (memory from the device's pool; stream 0 is its legacy default stream)
            if stream_is_capturing(stream):
                raise RuntimeError("cudart_kernels cannot allocate while the stream is capturing a CUDA graph: "
                                   "pass preallocated outputs (out=...) inside the capture")
            self.ptr = int(check(cu.cuMemAllocAsync(max(nbytes, 1), stream)))
        self.stream, self.device, self.nbytes = stream, device, nbytes

    def __del__(self):
        if _exiting:  # the driver tears the context down with the process; calling into it now can crash
            return
        try:  # (the caller's context comes back: this may run inside an op call on another device)
            with device_context(self.device):
                cu.cuMemFreeAsync(self.ptr, self.stream)
        except Exception:  # interpreter shutdown: the context is gone with the process
            pass


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


class DeviceArray:
    """A strided view of device memory: pointer, shape, strides (elements), dtype, device, and the stream its
    contents were last produced on. Exports itself through DLPack and the CUDA Array Interface.
    """

    __slots__ = ("ptr", "shape", "strides", "dtype", "device", "stream", "_owner", "__weakref__")

    def __init__(self, ptr: int, shape, dtype, strides=None, device: int = 0, stream: int = 0, owner=None):
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dt.as_dtype(dtype)
        self.strides = _contiguous_strides(self.shape) if strides is None else tuple(int(s) for s in strides)
        if len(self.strides) != len(self.shape):
            raise ValueError(f"shape {self.shape} and strides {self.strides} differ in length")
        self.device = int(device)
        self.stream = int(stream)
        self._owner = owner

    # -- construction --
    @classmethod
    def empty(cls, shape, dtype, device: int = 0, stream=None) -> "DeviceArray":
        dtype = dt.as_dtype(dtype)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        h = stream_handle(stream)
        alloc = _Allocation(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, device, h, _owner_of(stream))
        return _make(alloc.ptr, shape, _contiguous_strides(shape), dtype, device, h, alloc)

    @classmethod
    def empty_strided(cls, shape, strides, dtype, device: int = 0, stream=None) -> "DeviceArray":
        """Allocate enough memory for a (non-negative) strided layout, e.g. M-major scales."""
        dtype = dt.as_dtype(dtype)
        span = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0
        h = stream_handle(stream)
        alloc = _Allocation(span * dtype.itemsize, device, h, _owner_of(stream))
        return _make(alloc.ptr, tuple(shape), tuple(strides), dtype, device, h, alloc)

    @classmethod
    def from_numpy(cls, arr, dtype=None, device: int = 0, stream=None) -> "DeviceArray":
        arr = np.asarray(arr)
        if dtype is not None:
            arr = arr.astype(dt.as_dtype(dtype).numpy, copy=False)
        arr = np.ascontiguousarray(arr)
        out = cls.empty(arr.shape, dt.as_dtype(arr.dtype), device, stream)
        if arr.nbytes:
            with device_context(out.device):
                check(cu.cuMemcpyHtoDAsync(out.ptr, arr.ctypes.data, arr.nbytes, out.stream))
                check(cu.cuStreamSynchronize(out.stream))  # the host buffer may go away after we return
        return out

    @classmethod
    def from_pointer(cls, ptr: int, shape, dtype, strides=None, device: int = 0, owner=None) -> "DeviceArray":
        """Wrap memory owned elsewhere. `owner`, if given, is kept alive as long as the view."""
        return cls(ptr, shape, dtype, strides, device, 0, owner)

    # -- properties --
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def is_contiguous(self) -> bool:
        return all(s == c or n == 1 for s, c, n in zip(self.strides, _contiguous_strides(self.shape), self.shape))

    def __repr__(self) -> str:
        return (f"DeviceArray(shape={self.shape}, dtype={self.dtype.name}, strides={self.strides}, "
                f"device={self.device}, ptr=0x{self.ptr:x})")

    def _span(self) -> tuple[int, int]:
        """(first, last+1) element offsets the view touches, relative to ptr."""
        if self.size == 0:
            return 0, 0
        lo = sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s < 0)
        hi = sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s > 0)
        return lo, hi + 1

    # -- host copies --
    def numpy(self, stream=None) -> np.ndarray:
        """Copy to a new C-contiguous host array (waits for the copy)."""
        h = self.stream if stream is None else stream_handle(stream)
        if self.size == 0:
            return np.empty(self.shape, self.dtype.numpy)
        lo, hi = self._span()
        it = self.dtype.itemsize
        host = np.empty((hi - lo) * it, np.uint8)
        with device_context(self.device):
            check(cu.cuMemcpyDtoHAsync(host.ctypes.data, self.ptr + lo * it, host.nbytes, h))
            check(cu.cuStreamSynchronize(h))
        view = np.ndarray(self.shape, self.dtype.numpy, buffer=host, offset=-lo * it,
                          strides=tuple(s * it for s in self.strides))
        return np.ascontiguousarray(view)

    def fill_bytes(self, value: int, stream=None) -> "DeviceArray":
        """Set every byte of a contiguous array (used to poison outputs in tests)."""
        if not self.is_contiguous():
            raise ValueError("fill_bytes needs a contiguous array")
        h = self.stream if stream is None else stream_handle(stream)
        with device_context(self.device):
            check(cu.cuMemsetD8Async(self.ptr, value & 0xFF, self.nbytes, h))
        return self

    # -- export --
    def __dlpack_device__(self):
        return (kDLCUDA, self.device)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if dl_device is not None and tuple(dl_device) != (kDLCUDA, self.device):
            raise BufferError(f"DeviceArray lives on cuda:{self.device}; cannot export to {dl_device}")
        if copy:
            raise BufferError("DeviceArray exports without copying (copy=True is not supported)")
        _order(self.stream, _handle_from_dlpack_stream(stream), self.device)
        versioned = max_version is not None and tuple(max_version)[0] >= 1
        return _export_capsule(self, versioned)

    @property
    def __cuda_array_interface__(self) -> dict:
        it = self.dtype.itemsize
        return {
            "shape": self.shape,
            "typestr": self.dtype.numpy.str,
            "descr": [("", self.dtype.numpy.str)],
            "data": (self.ptr, False),
            "strides": None if self.is_contiguous() else tuple(s * it for s in self.strides),
            "stream": _dlpack_stream_arg(self.stream),
            "version": 3,
        }


def _owner_of(stream):
    return None if stream is None or type(stream) is int else stream


def _make(ptr, shape, strides, dtype, device, stream, owner) -> DeviceArray:
    """Construct without normalising arguments (hot path: callers pass tuples of ints and a DType)."""
    a = DeviceArray.__new__(DeviceArray)
    a.ptr, a.shape, a.strides, a.dtype, a.device, a.stream, a._owner = ptr, shape, strides, dtype, device, stream, owner
    return a


# ---- DLPack export ---------------------------------------------------------------------------------------------
# Everything a live capsule points to stays in this registry (keyed by the managed struct's address) until the
# consumer's deleter call or, for a capsule nobody consumed, the capsule destructor.
_exports: dict = {}


@_Deleter
def _dlpack_deleter(addr):
    _exports.pop(addr, None)


@_CapsuleDestructor
def _capsule_destructor(capsule):
    for name in (_VERSIONED, _LEGACY):
        if _IsValidRaw(capsule, name):  # still named "dltensor*": nobody consumed it
            addr = _GetPointerRaw(capsule, name)
            _exports.pop(addr, None)
            return


def _export_capsule(arr: DeviceArray, versioned: bool):
    shape = (c_int64 * max(1, arr.ndim))(*arr.shape)
    strides = (c_int64 * max(1, arr.ndim))(*arr.strides)
    managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    t = managed.dl_tensor
    t.data = arr.ptr
    t.device = DLDevice(kDLCUDA, arr.device)
    t.ndim = arr.ndim
    t.dtype = DLDataType(arr.dtype.dlpack_code, arr.dtype.itemsize * 8, 1)
    t.shape = ctypes.cast(shape, POINTER(c_int64))
    t.strides = ctypes.cast(strides, POINTER(c_int64))
    t.byte_offset = 0
    managed.deleter = _dlpack_deleter
    if versioned:
        managed.version = DLPackVersion(1, 0)
        managed.flags = 0
    addr = ctypes.addressof(managed)
    _exports[addr] = (managed, shape, strides, arr)
    return _CapsuleNew(addr, _VERSIONED if versioned else _LEGACY, _capsule_destructor)


# ---- import ----------------------------------------------------------------------------------------------------

class HostArrayError(TypeError):
    """A host (CPU) array was given where device memory is needed."""


def _from_capsule(capsule, owner) -> DeviceArray:
    name = _GetName(capsule)
    if name == _VERSIONED:
        m = DLManagedTensorVersioned.from_address(_GetPointer(capsule, _VERSIONED))
        if m.version.major > 1:
            raise BufferError(f"DLPack {m.version.major}.{m.version.minor} is newer than this consumer (1.x)")
    elif name == _LEGACY:
        m = DLManagedTensor.from_address(_GetPointer(capsule, _LEGACY))
    else:
        raise BufferError(f"not an unconsumed DLPack capsule (name {name!r})")
    t = m.dl_tensor
    dev_type, dev_id = t.device.device_type, t.device.device_id
    if dev_type in (kDLCPU, kDLCUDAHost):
        raise HostArrayError("expected a CUDA device array, got a host (CPU) array; copy it to the GPU first "
                             "(e.g. cudart_kernels.DeviceArray.from_numpy)")
    if dev_type not in (kDLCUDA, kDLCUDAManaged):
        raise TypeError(f"unsupported DLPack device type {dev_type}")
    ndim = t.ndim
    shape = tuple(t.shape[i] for i in range(ndim))
    dtype = dt.from_dlpack_code(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    strides = tuple(t.strides[i] for i in range(ndim)) if t.strides else None
    # The capsule (kept as owner) frees the producer's struct when it dies; `owner` keeps the memory alive.
    return DeviceArray((t.data or 0) + t.byte_offset, shape, dtype, strides, dev_id, 0, (capsule, owner))


def parse_dlpack(capsule, owner=None) -> DeviceArray:
    """Describe a DLPack capsule (host or device). Host arrays raise HostArrayError; the CPU tests use numpy."""
    return _from_capsule(capsule, owner)


def _from_cai(obj, consumer: int) -> DeviceArray:
    cai = obj.__cuda_array_interface__
    dtype = dt.as_dtype(np.dtype(cai["typestr"]))
    shape = tuple(cai["shape"])
    ptr = cai["data"][0] or 0
    strides = cai.get("strides")
    if strides is not None:
        if any(s % dtype.itemsize for s in strides):
            raise ValueError(f"byte strides {strides} are not multiples of the element size {dtype.itemsize}")
        strides = tuple(s // dtype.itemsize for s in strides)
    device = 0
    if ptr:
        attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        err, dev = cu.cuPointerGetAttribute(attr, ptr)
        if err:
            raise HostArrayError(f"pointer 0x{ptr:x} from __cuda_array_interface__ is not device memory")
        device = int(dev)
    producer = cai.get("stream")
    if producer is not None and cai.get("version", 0) >= 3:
        _order(0 if producer == 1 else producer, consumer, device)
    return DeviceArray(ptr, shape, dtype, strides, device, consumer, obj)


_torch = None  # (Tensor type, {torch dtype: DType}, current raw stream fn, {DType: torch dtype}, {index: device})


def _torch_support():
    global _torch
    import torch

    table = {getattr(torch, n): d for n, d in (("float32", dt.float32), ("float16", dt.float16),
                                               ("bfloat16", dt.bfloat16), ("float8_e4m3fn", dt.float8_e4m3),
                                               ("float8_e5m2", dt.float8_e5m2), ("int32", dt.int32),
                                               ("int64", dt.int64)) if hasattr(torch, n)}
    # (a CPU-only torch has no CUDA streams, and no CUDA tensors to ask about)
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda device: 0)
    _torch = (torch.Tensor, table, raw_stream, {d: t for t, d in table.items()}, {})
    return _torch


def _host_tensor(t) -> HostArrayError:
    return HostArrayError(f"expected a CUDA tensor, got one on {t.device}; move it to the GPU first")


def _torch_view(t, consumer: int, table) -> DeviceArray:
    """torch.Tensor without a DLPack round trip (the caller orders `consumer` after torch's current stream)."""
    if not t.is_cuda:
        raise _host_tensor(t)
    dtype = table.get(t.dtype)
    if dtype is None:
        raise TypeError(f"unsupported dtype {t.dtype}")
    return _make(t.data_ptr(), t.shape, t.stride(), dtype, t.get_device(), consumer, t)  # torch.Size is a tuple


def as_arrays(objs, stream: int) -> list:
    """`as_array` over the arrays of one call (None stays None), on the stream handle `stream`. Torch tensors get
    the ordering torch's __dlpack__(stream) gives, once: `stream` waits for torch's current stream on the
    tensors' device (arrays on several devices are left to the op's validation, which refuses them)."""
    return _views(objs, stream, False)


def _views(objs, stream: int, on_torch_stream: bool) -> list:
    """as_arrays; `on_torch_stream`: `stream` is torch's current stream (nothing to order)."""
    if "torch" not in sys.modules:
        return [x if x is None or type(x) is DeviceArray else as_array(x, stream) for x in objs]
    tensor, table, raw_stream = (_torch or _torch_support())[:3]
    views, device, devices = [], None, set()
    for x in objs:
        if x is None:
            pass
        elif type(x) is DeviceArray:
            devices.add(x.device)
        elif isinstance(x, tensor):
            x = _torch_view(x, stream, table)
            if device is None:
                device = x.device
            devices.add(x.device)
        else:
            x = as_array(x, stream)
            devices.add(x.device)
        views.append(x)
    if device is not None and not on_torch_stream and len(devices) == 1:
        producer = raw_stream(device)
        if producer != stream:
            _order(producer, stream, device)
    return views


# ---- framework-native results ------------------------------------------------------------------------------------
# An op call's outputs are allocated through the framework of its first torch / cupy / jax array and returned as
# that framework's type, and `stream=None` means that framework's current stream (torch, cupy) or the legacy
# default stream (jax, and calls with no framework array). README.md's "Arrays, streams, memory" has the table.

def _device_empty(shape: tuple, strides, dtype, device: int, h: int, owner) -> DeviceArray:
    """Our own stream-ordered memory for `shape` (contiguous, or the non-negative `strides`) on stream `h`."""
    if strides is None:
        strides = _contiguous_strides(shape)
        n = int(np.prod(shape, dtype=np.int64))
    else:
        n = 1 + sum((d - 1) * s for d, s in zip(shape, strides)) if all(shape) else 0
    alloc = _Allocation(n * dtype.itemsize, device, h, owner)
    return _make(alloc.ptr, shape, strides, dtype, device, h, alloc)


class Native:
    """How one op call allocates and returns the outputs it was not given, and what its `stream=None` means.

    This base serves calls with no framework array (DeviceArray, pointer tuples, other DLPack or CUDA Array
    Interface producers): our stream-ordered memory, a DeviceArray back, the legacy default stream."""

    __slots__ = ()
    name = "cudart_kernels"

    def current_stream(self, x) -> int:
        """The stream handle `stream=None` means, given the call's first array of this framework."""
        return 0

    def empty(self, shape: tuple, dtype, device: int, h: int, stream, strides=None) -> DeviceArray:
        """A new output on stream handle `h`, as a view whose owner is the framework's array. `stream` is the call's
        own argument (None: `h` is this framework's current stream); `strides` in elements (default contiguous)."""
        return _device_empty(shape, strides, dtype, device, h, _owner_of(stream))

    def result(self, view: DeviceArray):
        """What the op returns for an output `empty` made (called after the launch)."""
        return view

    def __repr__(self) -> str:
        return f"<results as {self.name}>"


def _native_array(view: DeviceArray):
    """The framework array behind an output `empty` made, or the view where it fell back to our own memory."""
    owner = view._owner
    return view if owner is None or type(owner) is _Allocation else owner


class _TorchResults(Native):
    """torch in, torch out: torch.empty on the op's device and stream (caching allocator, graph-capture pools)."""

    __slots__ = ()
    name = "torch"

    def current_stream(self, t) -> int:
        device = t.get_device()
        if device < 0:
            raise _host_tensor(t)
        return (_torch or _torch_support())[2](device)

    def empty(self, shape, dtype, device, h, stream, strides=None):
        _, _, raw_stream, to_torch, devices = _torch or _torch_support()
        tdtype = to_torch.get(dtype)
        torch = sys.modules["torch"]
        if tdtype is None:  # (float8 in a torch older than 2.1) our memory, freed on a stream kept alive meanwhile
            current = torch.cuda.current_stream(device) if stream is None else stream
            return Native.empty(self, shape, dtype, device, h, current, strides)
        dev = devices.get(device)
        if dev is None:
            dev = devices[device] = torch.device("cuda", device)
        if stream is not None and raw_stream(device) != h:  # allocate on the op's stream, as torch ops under it do
            s = stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.ExternalStream(h, device=dev)
            with torch.cuda.stream(s):
                t = _torch_empty(torch, shape, strides, tdtype, dev)
        else:
            t = _torch_empty(torch, shape, strides, tdtype, dev)
        return _make(t.data_ptr(), shape, t.stride(), dtype, device, h, t)

    result = staticmethod(_native_array)


def _torch_empty(torch, shape, strides, tdtype, dev):
    if strides is None:
        return torch.empty(shape, dtype=tdtype, device=dev)
    return torch.empty_strided(shape, strides, dtype=tdtype, device=dev)


_CUPY_DTYPES: dict = {}  # DType -> whether this cupy has it (no bfloat16 / float8 before cupy 14)


def _cupy_current_stream(cp, device: int):
    """cupy's current stream object on `device` (cupy keeps one per device and thread: no object made)."""
    try:
        return cp.cuda.get_current_stream(device)
    except TypeError:  # an older cupy: the current device's
        return cp.cuda.get_current_stream()


def _cupy_has(cp, dtype) -> bool:
    """Whether cupy makes arrays of `dtype` that export through DLPack (asked once per dtype, with one element)."""
    ok = _CUPY_DTYPES.get(dtype)
    if ok is None:
        try:
            as_array(cp.empty((1,), dtype=dtype.numpy))
            ok = True
        except Exception:  # (cupy raises TypeError, ValueError or BufferError, by version): our arrays instead
            ok = False
        _CUPY_DTYPES[dtype] = ok
    return ok


class _CupyResults(Native):
    """cupy in, cupy out: cupy's memory pool on the op's device and stream; a DeviceArray for a dtype cupy lacks."""

    __slots__ = ()
    name = "cupy"

    def current_stream(self, x) -> int:
        return _cupy_current_stream(sys.modules["cupy"], x.data.device_id).ptr

    def empty(self, shape, dtype, device, h, stream, strides=None):
        cp = sys.modules["cupy"]
        if not _cupy_has(cp, dtype):  # our memory, freed on the op's stream: keep cupy's stream object alive till then
            current = _cupy_current_stream(cp, device) if stream is None else stream
            return Native.empty(self, shape, dtype, device, h, current, strides)
        if cp.cuda.runtime.getDevice() == device and (stream is None or _cupy_current_stream(cp, device).ptr == h):
            a = _cupy_empty(cp, shape, strides, dtype)
        else:
            with cp.cuda.Device(device), cp.cuda.ExternalStream(h, device):
                a = _cupy_empty(cp, shape, strides, dtype)
        return _make(a.data.ptr, shape, _contiguous_strides(shape) if strides is None else strides, dtype, device, h,
                     a)

    result = staticmethod(_native_array)


def _cupy_empty(cp, shape, strides, dtype):
    if strides is None:
        return cp.empty(shape, dtype=dtype.numpy)
    span = 1 + sum((d - 1) * s for d, s in zip(shape, strides)) if all(shape) else 0
    it = dtype.itemsize
    return cp.ndarray(shape, dtype.numpy, cp.cuda.alloc(max(span, 1) * it), strides=tuple(s * it for s in strides))


class _JaxResults(Native):
    """jax in, jax out where jax's DLPack import takes the result: our memory, handed to jax without a copy after
    the launch (its stream waits for ours). jax imports row-major buffers only, so other layouts (M-major scales),
    and dtypes this jax cannot import, stay DeviceArrays."""

    __slots__ = ()
    name = "jax"

    def result(self, view):
        if not view.is_contiguous():
            return view
        try:
            return _jax_from_dlpack()(view)
        except (RuntimeError, TypeError, ValueError, BufferError, NotImplementedError):  # dtype jax cannot import
            return view


def _jax_from_dlpack():
    import jax.dlpack

    return jax.dlpack.from_dlpack


DEVICE_RESULTS, TORCH_RESULTS, CUPY_RESULTS, JAX_RESULTS = Native(), _TorchResults(), _CupyResults(), _JaxResults()
_NATIVE: dict = {type(None): DEVICE_RESULTS, DeviceArray: DEVICE_RESULTS, tuple: DEVICE_RESULTS}  # type -> Native


def native_of(tp: type) -> Native:
    """The results rule for arrays of type `tp` (decided once per type)."""
    results = _NATIVE.get(tp)
    if results is None:
        results = DEVICE_RESULTS
        for module, attr, candidate in (("torch", "Tensor", TORCH_RESULTS), ("cupy", "ndarray", CUPY_RESULTS),
                                        ("jax", "Array", JAX_RESULTS)):
            base = getattr(sys.modules.get(module), attr, None)
            if isinstance(base, type) and issubclass(tp, base):
                results = candidate
                break
        _NATIVE[tp] = results
    return results


def call_arrays(objs, stream) -> list:
    """One op call's arrays as views (None stays None), followed by the stream handle the call runs on and the
    `Native` that allocates and returns its outputs: `[*views, h, native]`.

    The first torch / cupy / jax array among `objs` decides the framework. `stream=None` is that framework's
    current stream for torch and cupy (on that array's device), the legacy default stream otherwise; any other
    `stream` is taken as given (`stream_handle`)."""
    native, first, plain = DEVICE_RESULTS, None, True
    for x in objs:
        if x is None or type(x) is DeviceArray:
            continue
        plain = False
        results = _NATIVE.get(type(x)) or native_of(type(x))
        if results is not DEVICE_RESULTS:
            native, first = results, x
            break
    if native is TORCH_RESULTS:
        views = _torch_call(objs, first, stream)
        if views is not None:
            return views
    if stream is None:
        h = 0 if first is None else native.current_stream(first)
    elif type(stream) is int and stream >= 0:
        h = stream
    else:
        h = stream_handle(stream)
    views = list(objs) if plain else _views(objs, h, stream is None and native is TORCH_RESULTS)
    views.append(h)
    views.append(native)
    return views


def _torch_call(objs, first, stream):
    """call_arrays for a call of torch tensors (DeviceArrays and None beside them), in one pass with the fewest
    tensor attribute reads (each is a call into torch): None when another kind of array is among them."""
    tensor, table, raw_stream = (_torch or _torch_support())[:3]
    device = first.get_device()
    if device < 0:
        raise _host_tensor(first)
    if stream is None:
        h = raw_stream(device)
    else:
        h = stream if type(stream) is int and stream >= 0 else stream_handle(stream)
    views, mixed = [], False
    for x in objs:
        if x is not None and type(x) is not DeviceArray:
            if not isinstance(x, tensor):
                return None
            d = x.get_device()
            if d != device:
                if d < 0:
                    raise _host_tensor(x)
                mixed = True  # (the op's validation names the two arrays)
            dtype = table.get(x.dtype)
            if dtype is None:
                raise TypeError(f"unsupported dtype {x.dtype}")
            x = _make(x.data_ptr(), x.shape, x.stride(), dtype, d, h, x)  # (torch.Size is a tuple)
        elif x is not None and x.device != device:
            mixed = True
        views.append(x)
    if stream is not None and not mixed:  # torch's __dlpack__(stream) ordering: the op waits for torch's stream
        producer = raw_stream(device)
        if producer != h:
            _order(producer, h, device)
    views.append(h)
    views.append(TORCH_RESULTS)
    return views


def as_array(obj, stream=None) -> DeviceArray:
    """View any supported device array as a DeviceArray, ordered on the consumer `stream` (a handle or object).

    Accepted: DeviceArray; objects with __dlpack__ (torch, cupy, jax, ...); objects with __cuda_array_interface__;
    a tuple (pointer, shape, strides_or_None, dtype[, device]). Host arrays raise HostArrayError.
    """
    if type(obj) is DeviceArray:
        return obj
    h = stream if type(stream) is int else stream_handle(stream)
    if "torch" in sys.modules:
        ts = _torch or _torch_support()
        if isinstance(obj, ts[0]):
            return as_arrays((obj,), h)[0]
    if hasattr(obj, "__dlpack__"):
        if hasattr(obj, "__dlpack_device__"):
            dev_type = obj.__dlpack_device__()[0]
            if dev_type in (kDLCPU, kDLCUDAHost):
                raise HostArrayError(f"expected a CUDA device array, got a host array ({type(obj).__name__}); "
                                     "copy it to the GPU first (e.g. cudart_kernels.DeviceArray.from_numpy)")
        try:
            cap = obj.__dlpack__(stream=_dlpack_stream_arg(h), max_version=(1, 0))
        except TypeError:  # producers from before DLPack 1.0 take no max_version
            cap = obj.__dlpack__(stream=_dlpack_stream_arg(h))
        return _from_capsule(cap, obj)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cai(obj, h)
    if isinstance(obj, tuple) and len(obj) in (4, 5):
        ptr, shape, strides, dtype = obj[:4]
        return DeviceArray(ptr, shape, dtype, strides, obj[4] if len(obj) == 5 else 0, h)
    if isinstance(obj, np.ndarray):
        raise HostArrayError("expected a CUDA device array, got a numpy (host) array; copy it to the GPU first "
                             "(cudart_kernels.DeviceArray.from_numpy)")
    raise TypeError(f"cannot use {type(obj).__name__} as a device array: it has neither __dlpack__ nor "
                    "__cuda_array_interface__")


# ---- validation helpers shared by the ops ---------------------------------------------------------------------

def require(a: DeviceArray, name: str, dtypes=None, ndim: int | None = None, shape=None,
            row_contiguous: bool = True, align: int = 16, row_align: int = 16) -> DeviceArray:
    """Check an operand and raise a clear ValueError/TypeError naming it."""
    if dtypes is not None and a.dtype not in dtypes:
        names = ", ".join(d.name for d in dtypes)
        raise TypeError(f"{name}: dtype {a.dtype.name} not supported (expected {names})")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(a.shape, shape)):
            if want is not None and got != want:
                raise ValueError(f"{name}: expected shape {tuple('*' if w is None else w for w in shape)}, "
                                 f"got {a.shape} (dimension {i})")
    if row_contiguous and a.ndim >= 1 and a.shape[-1] > 1 and a.strides[-1] != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {a.strides}")
    if a.ptr % align:
        raise ValueError(f"{name}: data pointer must be {align}-byte aligned (got 0x{a.ptr:x})")
    if row_align and a.ndim >= 2:
        for i, (n, s) in enumerate(zip(a.shape[:-1], a.strides[:-1])):
            if n > 1 and (s * a.dtype.itemsize) % row_align:
                raise ValueError(f"{name}: stride of dimension {i} ({s * a.dtype.itemsize} bytes) must be a "
                                 f"multiple of {row_align} bytes")
    return a


def same_device(*arrays, **named) -> int:
    """The device of an op's arrays (None skipped; keyword names are used in the message), or a ValueError naming
    two arrays on different devices: an op runs on one GPU, its arrays' (the caller's current device plays no
    part)."""
    first = first_name = None
    items = named.items() if not arrays else [(f"array {i}", x) for i, x in enumerate(arrays)] + list(named.items())
    for name, x in items:
        if x is None:
            continue
        if first is None:
            first, first_name = x, name
        elif x.device != first.device:
            raise ValueError(f"{name} is on cuda:{x.device} but {first_name} is on cuda:{first.device}: an op's "
                             "arrays must all be on one device")
    if first is None:
        raise ValueError("same_device: no arrays given")
    return first.device


__all__ = ["DeviceArray", "Native", "as_array", "call_arrays", "native_of", "parse_dlpack", "require", "same_device",
           "HostArrayError", "gpu_available"]
