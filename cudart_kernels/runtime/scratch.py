"""Scratch memory for every op (split-K partials and counters, re-laid-out scales, small tables), safe under CUDA
graph capture.

Eager calls use buffers kept per (device, stream, slot): work on one stream runs in order, so it may share them,
and two streams never do. They grow stream-ordered (allocate, zero if asked, then swap) and the state changes only
after every driver call succeeded; outgrown buffers are kept until `release_scratch` (a launch another thread
queued on the same stream may still read one).

While a stream captures a graph, a call never touches those buffers: a graph may be replayed on any stream, beside
eager work or another replay. Its scratch is allocated inside the capture instead (cuMemAllocAsync, zeroed by a
captured memset where the kernel needs zeros, cuMemFreeAsync after the launch): the graph owns that memory, and
each replay gets its own. Nothing needs reserving ahead of a capture.
"""
from __future__ import annotations

import threading

from cuda.bindings import driver as cu

from .driver import CudaError, check, stream_is_capturing, use_device

_MIN_BYTES = 1 << 16


class _Buffer:
    __slots__ = ("ptr", "nbytes")

    def __init__(self, ptr: int, nbytes: int):
        self.ptr, self.nbytes = ptr, nbytes


class ScratchPool:
    def __init__(self):
        self._buffers: dict = {}  # (device, stream, slot, zeroed) -> _Buffer
        self._retired: list = []  # (device, ptr) outgrown buffers
        self._lock = threading.Lock()

    def acquire(self, device: int, stream: int, needs: tuple):
        """Pointers for `needs`, a tuple of (slot, bytes, zeroed), on `stream`; and a function to call once the
        launch that uses them is queued (None for eager calls). A zeroed buffer must be left zero by its user."""
        if stream_is_capturing(stream):
            return self._in_graph(device, stream, needs)
        ptrs = []
        for slot, nbytes, zeroed in needs:
            buf = self._buffers.get((device, stream, slot, zeroed))
            if buf is None or buf.nbytes < nbytes:
                buf = self._grow(device, stream, slot, nbytes, zeroed)
            ptrs.append(buf.ptr)
        return ptrs, None

    def _grow(self, device: int, stream: int, slot: str, nbytes: int, zeroed: bool) -> _Buffer:
        key = (device, stream, slot, zeroed)
        with self._lock:
            old = self._buffers.get(key)
            if old is not None and old.nbytes >= nbytes:
                return old
            size = max(nbytes, _MIN_BYTES, 2 * old.nbytes if old else 0)
            size += -size % 256
            use_device(device)
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

    @staticmethod
    def _in_graph(device: int, stream: int, needs: tuple):
        use_device(device)
        ptrs = []

        def release():
            for p in ptrs:
                check(cu.cuMemFreeAsync(p, stream))

        try:
            for slot, nbytes, zeroed in needs:
                size = max(nbytes, 4) + -max(nbytes, 4) % 4
                ptrs.append(int(check(cu.cuMemAllocAsync(size, stream))))
                if zeroed:
                    check(cu.cuMemsetD32Async(ptrs[-1], 0, size // 4, stream))
        except CudaError as e:
            raise CudaError(f"scratch memory ({', '.join(n[0] for n in needs)}) could not be allocated inside the "
                            f"CUDA graph being captured on stream 0x{stream:x}: {e}") from None
        return ptrs, release

    def release(self) -> None:
        """Free every eager buffer (after the device finished the work that used them)."""
        with self._lock:
            buffers = [(d, b.ptr) for (d, *_), b in self._buffers.items()] + self._retired
            self._buffers, self._retired = {}, []
        for device, ptr in buffers:
            use_device(device)
            check(cu.cuCtxSynchronize())
            check(cu.cuMemFree(ptr))


SCRATCH = ScratchPool()


def release_scratch() -> None:
    """Free the scratch buffers of eager calls (they are made again on demand)."""
    SCRATCH.release()
