"""Scratch memory for every op (split-K partials and counters, re-laid-out scales, small tables), safe under CUDA
graph capture.

Eager calls use buffers kept per (device, stream, slot): work on one stream runs in order, so it may share them,
and two streams never do. They grow stream-ordered (allocate, zero if asked, then swap) and the state changes only
after every driver call succeeded; outgrown buffers are kept until `release_scratch` (a launch another thread
queued on the same stream may still read one).

While a stream captures a graph, a call never touches those buffers: a graph may be replayed on any stream, beside
eager work or another replay. The graph gets buffers of its own instead, per (capturing stream, slot), made
outside the capture (zeroed once where the kernel needs zeros: the kernels leave such buffers zero, so a replay
needs no memset node) and freed after the graph is destroyed (a CUDA user object the graph holds). One
allocation node and its free are also captured, once per graph: a graph with memory nodes cannot be instantiated
twice, so no two executable copies of it can share its buffers. Nothing needs reserving ahead of a capture.
"""
from __future__ import annotations

import collections
import ctypes
import threading

from cuda.bindings import driver as cu

from .driver import CudaError, check, device_context, relaxed_capture, stream_is_capturing

_MIN_BYTES = 1 << 16


class _Buffer:
    __slots__ = ("ptr", "nbytes")

    def __init__(self, ptr: int, nbytes: int):
        self.ptr, self.nbytes = ptr, nbytes


# Captures whose graphs the driver destroyed (its thread appends; the buffers are freed on a later call, since
# the callback may not call CUDA).
_destroyed: collections.deque = collections.deque()


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _graph_destroyed(capture_id):
    _destroyed.append(capture_id or 0)


class ScratchPool:
    def __init__(self):
        self._buffers: dict = {}  # (device, stream, slot, zeroed) -> _Buffer
        self._retired: list = []  # (device, ptr) outgrown buffers
        self._graphs: dict = {}   # capture id -> (device, {(stream, slot, zeroed): _Buffer}, [every ptr])
        self._zeroing: dict = {}  # device -> a private stream for zeroing graph buffers
        self._lock = threading.Lock()

    def acquire(self, device: int, stream: int, needs: tuple):
        """Pointers for `needs`, a tuple of (slot, bytes, zeroed), on `stream` (of `device`, whose context the
        caller made current: stream 0 is that context's legacy default stream). A zeroed buffer must be left zero
        by its user."""
        if _destroyed:
            self._free_destroyed()
        if stream_is_capturing(stream):
            return self._in_graph(device, stream, needs)
        ptrs = []
        for slot, nbytes, zeroed in needs:
            buf = self._buffers.get((device, stream, slot, zeroed))
            if buf is None or buf.nbytes < nbytes:
                buf = self._grow(device, stream, slot, nbytes, zeroed)
            ptrs.append(buf.ptr)
        return ptrs

    def _grow(self, device: int, stream: int, slot: str, nbytes: int, zeroed: bool) -> _Buffer:
        key = (device, stream, slot, zeroed)
        with self._lock:
            old = self._buffers.get(key)
            if old is not None and old.nbytes >= nbytes:
                return old
            size = max(nbytes, _MIN_BYTES, 2 * old.nbytes if old else 0)
            size += -size % 256
            with device_context(device):
                ptr = int(check(cu.cuMemAllocAsync(size, stream)))
                try:
                    if zeroed:
                        check(cu.cuMemsetD32Async(ptr, 0, size // 4, stream))
                except CudaError:
                    cu.cuMemFreeAsync(ptr, stream)
                    raise
            self._buffers[key] = buf = _Buffer(ptr, size)
            if old is not None:
                self._retired.append((device, old.ptr))
            return buf

    def _in_graph(self, device: int, stream: int, needs: tuple) -> list:
        try:
            with device_context(device):  # (the capture's device; its allocations are made there)
                _, capture_id, graph, *_ = check(cu.cuStreamGetCaptureInfo(stream))
                capture_id = int(capture_id)
                with self._lock:
                    entry = self._graphs.get(capture_id)
                    if entry is None:
                        entry = self._adopt(device, stream, capture_id, graph)
                    ptrs = []
                    for slot, nbytes, zeroed in needs:
                        buf = entry[1].get((stream, slot, zeroed))
                        if buf is None or buf.nbytes < nbytes:  # (a smaller one stays: earlier nodes use it)
                            buf = self._graph_buffer(device, nbytes, zeroed, entry)
                            entry[1][(stream, slot, zeroed)] = buf
                        ptrs.append(buf.ptr)
        except CudaError as e:
            raise CudaError(f"scratch memory ({', '.join(n[0] for n in needs)}) for the CUDA graph being captured "
                            f"on stream 0x{stream:x} could not be set up: {e}") from None
        return ptrs

    def _adopt(self, device: int, stream: int, capture_id: int, graph):
        """A new graph: its buffer list, a user object that frees them once the graph is gone, and the memory
        node pair that keeps it from being instantiated twice."""
        destroy = cu.CUhostFn(ctypes.cast(_graph_destroyed, ctypes.c_void_p).value)
        obj = check(cu.cuUserObjectCreate(capture_id, destroy, 1,
                                          cu.CUuserObject_flags.CU_USER_OBJECT_NO_DESTRUCTOR_SYNC))
        try:  # the graph takes over our reference
            check(cu.cuGraphRetainUserObject(graph, obj, 1, cu.CUuserObjectRetain_flags.CU_GRAPH_USER_OBJECT_MOVE))
        except CudaError:
            cu.cuUserObjectRelease(obj, 1)
            raise
        entry = self._graphs[capture_id] = (device, {}, [])
        guard = int(check(cu.cuMemAllocAsync(256, stream)))
        check(cu.cuMemFreeAsync(guard, stream))
        return entry

    def _graph_buffer(self, device: int, nbytes: int, zeroed: bool, entry) -> _Buffer:
        size = max(nbytes, 4) + -max(nbytes, 4) % 256
        with relaxed_capture():
            ptr = int(check(cu.cuMemAlloc(size)))
            entry[2].append(ptr)
            if zeroed:
                zs = self._zeroing.get(device)
                if zs is None:
                    zs = self._zeroing[device] = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
                check(cu.cuMemsetD32Async(ptr, 0, size // 4, zs))
                check(cu.cuStreamSynchronize(zs))
        return _Buffer(ptr, size)

    def _free_destroyed(self) -> None:
        with self._lock:
            dead = []
            while _destroyed:
                entry = self._graphs.pop(_destroyed.popleft(), None)
                if entry is not None:
                    dead.append(entry)
        for device, _, ptrs in dead:
            with device_context(device), relaxed_capture():
                for p in ptrs:
                    check(cu.cuMemFree(p))

    def graph_captures(self) -> set:
        """The capture ids of the graphs that hold scratch buffers now."""
        return set(self._graphs)

    def release(self) -> None:
        """Free every eager buffer (after the device finished the work that used them), and the buffers of
        destroyed graphs."""
        self._free_destroyed()
        with self._lock:
            buffers = [(d, b.ptr) for (d, *_), b in self._buffers.items()] + self._retired
            self._buffers, self._retired = {}, []
        for device, ptr in buffers:
            with device_context(device):
                check(cu.cuCtxSynchronize())
                check(cu.cuMemFree(ptr))


SCRATCH = ScratchPool()


def release_scratch() -> None:
    """Free the scratch buffers of eager calls (they are made again on demand)."""
    SCRATCH.release()
