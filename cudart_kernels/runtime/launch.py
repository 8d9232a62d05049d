"""Load compiled cubins through the driver and launch them with cuLaunchKernelEx on a prepared argument buffer."""
from __future__ import annotations

import ctypes
import operator
import struct
import threading

from cuda.bindings import driver as cu

from .compiler import Compiled
from .driver import CudaError, check, device_context

# Kernel parameter kinds -> (struct format, size = alignment). "tmap" is a CUtensorMap passed by value
# (__grid_constant__), copied in from its TensorMap's 128 bytes. "i32[N]" is a struct of N ints passed by value,
# given as a sequence of N ints.
_KINDS = {"ptr": ("Q", 8), "i32": ("i", 4), "u32": ("I", 4), "i64": ("q", 8), "f32": ("f", 4), "tmap": (None, 64)}
_TMAP_BYTES = 128


def _kind(k: str):
    """(struct format, alignment, size) of one parameter kind."""
    if k.startswith("i32[") and k.endswith("]") and k[4:-1].isdigit():
        n = int(k[4:-1])
        return f"{n}i", 4, 4 * n
    if k not in _KINDS:
        raise ValueError(f"unknown kernel argument kind {k!r}")
    code, align = _KINDS[k]
    return code, align, _TMAP_BYTES if code is None else align

# A launch that names a CUfunction of another context fails with one of these. Ops make their arrays' device
# current before launching (enter_device); a launch from elsewhere (benchmarks, tests) that meets one of these
# retries once in the function's context.
_WRONG_CONTEXT = {cu.CUresult.CUDA_ERROR_INVALID_CONTEXT, cu.CUresult.CUDA_ERROR_INVALID_HANDLE,
                  cu.CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED}


def _layout(kinds):
    """Byte offsets of each parameter in one packed buffer, the struct format of the scalars, the total size."""
    fmt, offsets, off = "<", [], 0
    for k in kinds:
        code, align, size = _kind(k)
        pad = -off % align
        fmt += f"{pad}x" if pad else ""
        off += pad
        offsets.append(off)
        fmt += f"{size}x" if code is None else code
        off += size
    return fmt, offsets, max(off, 8)


def _scalar_runs(kinds) -> list:
    """(offset, pack_into, getter) per run of scalar parameters between tensor maps: each run is packed on its own,
    so packing never writes over the bytes of a map (a struct's pad bytes are written as zeros)."""
    _, offsets, _ = _layout(kinds)
    runs, run = [], []
    for i, k in enumerate(kinds):
        if k == "tmap":
            runs, run = runs + [run] if run else runs, []
        else:
            run.append(i)
    runs += [run] if run else []
    out = []
    for run in runs:
        fmt, cur = "<", offsets[run[0]]
        for i in run:
            code, _, size = _kind(kinds[i])
            fmt += (f"{offsets[i] - cur}x" if offsets[i] > cur else "") + code
            cur = offsets[i] + size
        get = operator.itemgetter(*run) if len(run) > 1 else (lambda args, i=run[0]: (args[i],))
        out.append((offsets[run[0]], struct.Struct(fmt).pack_into, get))
    return out


_functions: dict = {}
_load_lock = threading.Lock()


class Function:
    """A loaded kernel on one device."""

    def __init__(self, compiled: Compiled, device: int):
        self.compiled = compiled
        self.device = device
        with device_context(device):  # (a module belongs to the context current when it is loaded)
            self.module = check(cu.cuModuleLoadData(compiled.cubin))
            self.handle = check(cu.cuModuleGetFunction(self.module, compiled.entry.encode()))
        self._smem_limit = 0

    def ensure_dynamic_smem(self, nbytes: int) -> None:
        if nbytes > self._smem_limit:
            with device_context(self.device):
                check(cu.cuFuncSetAttribute(
                    self.handle, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes))
            self._smem_limit = nbytes

    def attribute(self, name: str) -> int:
        a = getattr(cu.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name.upper()}")
        with device_context(self.device):
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
    """Per-thread parameter buffer and launch config, so concurrent launches never share them."""

    def __init__(self, kinds, block, smem, cluster, pdl):
        _, offsets, size = _layout(kinds)
        self.buffer = ctypes.create_string_buffer(size + 64)
        base = ctypes.addressof(self.buffer)
        self.base = base + (-base % 64)  # 64-byte aligned start, for the tensor maps
        self.pointers = (ctypes.c_void_p * max(1, len(kinds)))(*[self.base + o for o in offsets])
        self.address = ctypes.addressof(self.pointers)
        self.view = (ctypes.c_char * size).from_address(self.base)
        self.tmap_addresses = [self.base + o for o, k in zip(offsets, kinds) if k == "tmap"]
        self.tmaps = [None] * len(self.tmap_addresses)  # the TensorMap whose bytes each slot holds
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
        self.grid = None
        self.stream = None
        self.args = None  # the tuple last packed into the buffer


class Launcher:
    """A prepared launch of one function with a fixed block shape, dynamic smem, cluster shape and argument kinds.

    `launcher(grid, stream, *args)` packs the arguments into a buffer made once (one struct.pack_into) and calls
    cuLaunchKernelEx; grid and stream are written to the config only when they change. A "tmap" argument is a
    TensorMap (its 128 bytes are copied).
    """

    def __init__(self, function: Function, arg_kinds, block, smem: int = 0, cluster=None, pdl: bool = False):
        for k in arg_kinds:
            _kind(k)
        block = tuple(block) + (1,) * (3 - len(block))
        if cluster is not None:
            cluster = tuple(cluster) + (1,) * (3 - len(cluster))
        function.ensure_dynamic_smem(smem)
        self.function = function
        self.kinds = tuple(arg_kinds)
        self._pack = struct.Struct(_layout(self.kinds)[0]).pack_into
        self._tmaps = tuple(i for i, k in enumerate(self.kinds) if k == "tmap")
        self._tables = tuple(i for i, k in enumerate(self.kinds) if k.startswith("i32["))
        if self._tables and self._tmaps:
            raise ValueError("a launch takes tensor maps or i32[N] tables, not both")
        self._runs = _scalar_runs(self.kinds)
        self._slots = _Slots(self.kinds, block, smem, cluster, pdl)
        self._handle = function.handle
        self._device = function.device

    def max_active_clusters(self) -> int:
        """How many clusters of this launch's shape (block, smem, cluster dims) can be resident at once."""
        src = self._slots.config
        cfg = cu.CUlaunchConfig()
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = src.blockDimX, src.blockDimY, src.blockDimZ
        cfg.sharedMemBytes = src.sharedMemBytes
        cfg.attrs = src.attrs
        cfg.numAttrs = src.numAttrs
        cx = next((a.value.clusterDim.x for a in src.attrs
                   if a.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION), 1)
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = cx * 1024, 1, 1
        with device_context(self._device):
            return check(cu.cuOccupancyMaxActiveClusters(self._handle, cfg))

    def __call__(self, grid, stream: int, *args) -> None:
        self.run(grid, stream, args)

    def run(self, grid, stream: int, args: tuple) -> None:
        """Launch with the arguments as one tuple. Passing the same tuple object as this thread's last launch
        skips packing it again (callers keep one tuple per set of pointers: `ArgsMemo`)."""
        s = self._slots
        if args is not s.args:
            self._pack_args(s, args)
        cfg = s.config
        if grid != s.grid:
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
            s.grid = grid
        if stream != s.stream:
            cfg.hStream = stream
            s.stream = stream
        err, = cu.cuLaunchKernelEx(cfg, self._handle, s.address, 0)
        if err:
            if err in _WRONG_CONTEXT:
                with device_context(self._device):
                    err, = cu.cuLaunchKernelEx(cfg, self._handle, s.address, 0)
            if err:
                self._fail(err, stream)

    def _fail(self, err, stream: int) -> None:
        try:
            check((err,))
        except CudaError as e:
            hint = (f" (the kernel runs on cuda:{self._device}: a stream given with stream= must belong to that "
                    "device)" if err in _WRONG_CONTEXT and stream else "")
            raise CudaError(f"launching {self.function.compiled.entry} on stream 0x{stream:x}: {e}{hint}") from None

    def _pack_args(self, s, args) -> None:
        s.args = None  # (a failed packing leaves the buffer half written: never skip the next one)
        if len(args) != len(self.kinds):
            raise TypeError(f"{self.function.compiled.entry} takes {len(self.kinds)} arguments, got {len(args)}")
        if self._tables:  # (rare: no tensor maps beside them) flatten the tables' values into the scalars
            self._pack(s.view, 0, *[x for i, a in enumerate(args) for x in (a if i in self._tables else (a,))])
        elif self._tmaps:
            for off, pack, get in self._runs:
                pack(s.view, off, *get(args))
            last = s.tmaps
            for j, i in enumerate(self._tmaps):
                m = args[i]
                if m is not last[j]:  # (a map object is never re-pointed: the same object, the same bytes)
                    ctypes.memmove(s.tmap_addresses[j], m.address, _TMAP_BYTES)
                    last[j] = m
        else:
            self._pack(s.view, 0, *args)
        s.args = args


class ArgsMemo:
    """One plan's launch-argument tuples by the pointers they were made from: a call on buffers seen before
    reuses its tuple (no tensor-map lookups; `Launcher.run` skips packing the tuple it launched last). Bounded,
    oldest dropped first; safe across threads (dict operations are atomic, the tuples immutable)."""

    def __init__(self, max_entries: int = 64):
        self._args: dict = {}
        self._max = max_entries

    def get(self, pointers: tuple):
        return self._args.get(pointers)

    def add(self, pointers: tuple, args: tuple) -> tuple:
        while len(self._args) >= self._max:
            self._args.pop(next(iter(self._args), None), None)
        self._args[pointers] = args
        return args


_launchers: dict = {}


def get_launcher(source: str, entry: str, defines: dict, device: int, arg_kinds, block, smem: int = 0,
                 cluster=None, pdl: bool = False) -> Launcher:
    """Compile (or take from cache), load and prepare one kernel variant; cached per process."""
    key = (source, entry, tuple(sorted(defines.items())), device, tuple(arg_kinds), tuple(block), smem,
           cluster, pdl)
    lau = _launchers.get(key)
    if lau is None:
        from .compiler import compile_kernel
        from .driver import require_device, target_arch

        require_device(device)  # (before NVRTC: without a usable GPU one line says why)

        compiled = compile_kernel(source, entry, defines, target_arch(device))
        lau = _launchers[key] = Launcher(load(compiled, device), arg_kinds, block, smem, cluster, pdl)
    return lau
