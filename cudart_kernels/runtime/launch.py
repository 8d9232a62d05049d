"""Load compiled cubins through the driver and launch them with cuLaunchKernelEx on a prepared argument buffer."""
from __future__ import annotations

import ctypes
import threading

from cuda.bindings import driver as cu

from .compiler import Compiled
from .driver import check, use_device

# Kernel parameter kinds -> ctypes storage. "tmap" is a CUtensorMap passed by value (__grid_constant__).
_CTYPES = {
    "ptr": ctypes.c_uint64,
    "i32": ctypes.c_int32,
    "u32": ctypes.c_uint32,
    "i64": ctypes.c_int64,
    "f32": ctypes.c_float,
    "tmap": ctypes.c_uint64 * 16,
}

_functions: dict = {}
_load_lock = threading.Lock()


class Function:
    """A loaded kernel on one device."""

    def __init__(self, compiled: Compiled, device: int):
        use_device(device)
        self.compiled = compiled
        self.device = device
        self.module = check(cu.cuModuleLoadData(compiled.cubin))
        self.handle = check(cu.cuModuleGetFunction(self.module, compiled.entry.encode()))
        self._smem_limit = 0

    def ensure_dynamic_smem(self, nbytes: int) -> None:
        if nbytes > self._smem_limit:
            check(cu.cuFuncSetAttribute(
                self.handle, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes))
            self._smem_limit = nbytes

    def attribute(self, name: str) -> int:
        a = getattr(cu.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name.upper()}")
        return check(cu.cuFuncGetAttribute(a, self.handle))


def load(compiled: Compiled, device: int = 0) -> Function:
    """The in-process cache of loaded functions, keyed by (cubin key, entry, device)."""
    key = (compiled.key, compiled.entry, device)
    f = _functions.get(key)
    if f is None:
        with _load_lock:
            f = _functions.get(key)
            if f is None:
                f = _functions[key] = Function(compiled, device)
    return f


class _Slots(threading.local):
    """Per-thread argument storage, so concurrent launches from several threads never share a buffer."""

    def __init__(self, kinds, block, smem, cluster, pdl):
        self.values = [_CTYPES[k]() for k in kinds]
        self.pointers = (ctypes.c_void_p * max(1, len(kinds)))(*[ctypes.addressof(v) for v in self.values])
        self.address = ctypes.addressof(self.pointers)
        cfg = cu.CUlaunchConfig()
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
        cfg.sharedMemBytes = smem
        attrs = []
        if cluster is not None and cluster != (1, 1, 1):
            a = cu.CUlaunchAttribute()
            a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cluster
            attrs.append(a)
        if pdl:
            a = cu.CUlaunchAttribute()
            a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        self.config = cfg


class Launcher:
    """A prepared launch of one function with a fixed block shape, dynamic smem, cluster shape and argument kinds.

    `launcher(grid, stream, *args)` refills the argument buffer in place and calls cuLaunchKernelEx: no per-call
    allocation beyond the Python ints themselves. A "tmap" argument is a TensorMap (its 128 bytes are copied).
    """

    def __init__(self, function: Function, arg_kinds, block, smem: int = 0, cluster=None, pdl: bool = False):
        for k in arg_kinds:
            if k not in _CTYPES:
                raise ValueError(f"unknown kernel argument kind {k!r}")
        block = tuple(block) + (1,) * (3 - len(block))
        if cluster is not None:
            cluster = tuple(cluster) + (1,) * (3 - len(cluster))
        function.ensure_dynamic_smem(smem)
        self.function = function
        self.kinds = tuple(arg_kinds)
        self._tmaps = tuple(i for i, k in enumerate(self.kinds) if k == "tmap")
        self._scalars = tuple(i for i, k in enumerate(self.kinds) if k != "tmap")
        self._slots = _Slots(self.kinds, block, smem, cluster, pdl)
        self._handle = function.handle
        self._device = function.device

    def __call__(self, grid, stream: int, *args) -> None:
        if len(args) != len(self.kinds):
            raise TypeError(f"{self.function.compiled.entry} takes {len(self.kinds)} arguments, got {len(args)}")
        s = self._slots
        vals = s.values
        for i in self._scalars:
            vals[i].value = args[i]
        for i in self._tmaps:
            ctypes.memmove(vals[i], args[i].address, 128)
        cfg = s.config
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.hStream = stream
        use_device(self._device)
        err, = cu.cuLaunchKernelEx(cfg, self._handle, s.address, 0)
        if err:
            check((err,))


_launchers: dict = {}


def get_launcher(source: str, entry: str, defines: dict, device: int, arg_kinds, block, smem: int = 0,
                 cluster=None, pdl: bool = False) -> Launcher:
    """Compile (or take from cache), load and prepare one kernel variant; cached per process."""
    key = (source, entry, tuple(sorted(defines.items())), device, tuple(arg_kinds), tuple(block), smem,
           cluster, pdl)
    lau = _launchers.get(key)
    if lau is None:
        from .compiler import compile_kernel
        from .driver import target_arch

        compiled = compile_kernel(source, entry, defines, target_arch(device))
        lau = _launchers[key] = Launcher(load(compiled, device), arg_kinds, block, smem, cluster, pdl)
    return lau
