"""Framework-native results on the CPU: which framework a call's arrays belong to, what `stream=None` means, that
outputs are allocated through that framework (on the op's stream) and returned as its type, that a jax result is
made after the launch, and that every input is validated before anything is allocated. torch, cupy and jax are
stood in for by small fakes (the real ones: tests/test_native_results_gpu.py); the kernels' launchers by a
recorder, so these run without a GPU."""
import contextlib
import importlib
import itertools
import sys
import types

import ml_dtypes
import numpy as np
import pytest

import cudart_kernels as ck
from cudart_kernels.runtime import dtypes as dt
from cudart_kernels.runtime import interop
from cudart_kernels.runtime.interop import DeviceArray, HostArrayError, call_arrays, native_of
from cudart_kernels.runtime.plans import PlanCache

_ptrs = itertools.count(0x7F00_0000_0000, 1 << 20)  # fake device addresses, 1 MiB apart (aligned)


def _capsule(ptr, shape, dtype, strides, max_version):
    return DeviceArray.from_pointer(ptr, shape, dtype, strides).__dlpack__(stream=-1, max_version=max_version)


# ---- fake torch ------------------------------------------------------------------------------------------------

class FakeTorch(types.ModuleType):
    """torch.Tensor, its dtypes, torch._C._cuda_getCurrentRawStream, torch.empty / empty_strided, torch.device,
    torch.cuda.Stream / ExternalStream / stream(): what cudart_kernels uses, recording what it is asked."""

    def __init__(self):
        super().__init__("torch")
        torch = self
        self.current = {0: 0x1234}  # device -> torch's current raw stream
        self.raw_calls = 0
        self.allocs = []
        for name in ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int32", "int64"):
            setattr(self, name, type(name, (), {})())  # hashable stand-ins for torch.dtype

        class Tensor:
            def __init__(self, shape, dtype, strides=None, device=0, ptr=None):
                self.shape, self.dtype, self._device = tuple(shape), dtype, device
                self._strides = tuple(strides) if strides is not None else interop._contiguous_strides(self.shape)
                self._ptr = next(_ptrs) if ptr is None else ptr
                self.is_cuda = device >= 0
                self.device = f"cuda:{device}" if device >= 0 else "cpu"

            def data_ptr(self):
                return self._ptr

            def stride(self):
                return self._strides

            def get_device(self):
                return self._device

        class Stream:
            def __init__(self, handle, device=0):
                self.cuda_stream, self.device_index = handle, device

        class ExternalStream(Stream):
            def __init__(self, handle, device=None):
                super().__init__(handle, 0 if device is None else device[1])

        @contextlib.contextmanager
        def stream(s):
            before = torch.current[s.device_index]
            torch.current[s.device_index] = s.cuda_stream
            try:
                yield
            finally:
                torch.current[s.device_index] = before

        def raw_stream(device):
            torch.raw_calls += 1
            return torch.current[device]

        def empty_strided(shape, strides, dtype, device):
            t = Tensor(shape, dtype, strides, device[1])
            t.alloc_stream = torch.current[device[1]]
            torch.allocs.append(t)
            return t

        self.Tensor = Tensor
        self.device = lambda kind, index: (kind, index)
        self.empty = lambda shape, dtype, device: empty_strided(shape, None, dtype, device)
        self.empty_strided = empty_strided
        self.cuda = types.SimpleNamespace(Stream=Stream, ExternalStream=ExternalStream, stream=stream)
        self._C = types.SimpleNamespace(_cuda_getCurrentRawStream=raw_stream)

    def tensor(self, shape, dtype, **kw):
        return self.Tensor(shape, getattr(self, dtype), **kw)


# ---- fake cupy -------------------------------------------------------------------------------------------------

class FakeCupy(types.ModuleType):
    """cupy.ndarray (exporting through DLPack), cupy.empty (without bfloat16 / float8, as cupy before 14),
    cupy.cuda.alloc / get_current_stream / runtime.getDevice / Device / ExternalStream."""

    def __init__(self):
        super().__init__("cupy")
        cp = self
        self.current = {0: 0x5000}
        self.dlpack_streams = []
        self.allocs = []

        class ndarray:
            def __init__(self, shape, dtype, memptr=None, strides=None):
                self.shape, self.dtype = tuple(shape), np.dtype(dtype)
                self.data = memptr or types.SimpleNamespace(ptr=next(_ptrs), device_id=0)
                it = self.dtype.itemsize
                self.strides = tuple(strides) if strides else tuple(s * it for s in interop._contiguous_strides(shape))
                self.alloc_stream = cp.current[self.data.device_id]

            def __dlpack_device__(self):
                return (2, self.data.device_id)

            def __dlpack__(self, stream=None, max_version=None):
                cp.dlpack_streams.append(stream)
                it = self.dtype.itemsize
                return _capsule(self.data.ptr, self.shape, self.dtype, tuple(s // it for s in self.strides),
                                max_version)

        def empty(shape, dtype):
            if np.dtype(dtype).kind == "V" or np.dtype(dtype) in (np.dtype(ml_dtypes.bfloat16),
                                                                   np.dtype(ml_dtypes.float8_e4m3fn)):
                raise ValueError(f"Unsupported dtype {dtype}")
            a = ndarray(shape, dtype)
            cp.allocs.append(a)
            return a

        @contextlib.contextmanager
        def external_stream(ptr, device_id=-1):
            before = cp.current[device_id]
            cp.current[device_id] = ptr
            try:
                yield
            finally:
                cp.current[device_id] = before

        self.ndarray = ndarray
        self.empty = empty
        self.cuda = types.SimpleNamespace(
            alloc=lambda n: types.SimpleNamespace(ptr=next(_ptrs), device_id=0),
            get_current_stream=lambda device_id=-1: types.SimpleNamespace(ptr=cp.current[max(device_id, 0)]),
            runtime=types.SimpleNamespace(getDevice=lambda: 0),
            Device=lambda device: contextlib.nullcontext(),
            ExternalStream=external_stream)

    def array(self, shape, dtype):
        return self.ndarray(shape, dtype)


# ---- fake jax --------------------------------------------------------------------------------------------------

class FakeJax(types.ModuleType):
    """jax.Array (exporting through DLPack) and jax.dlpack.from_dlpack, which records when it is called."""

    def __init__(self, events):
        super().__init__("jax")
        jax = self
        self.dlpack_streams = []

        class Array:
            def __init__(self, shape, dtype, ptr=None, source=None):
                self.shape, self.dtype, self.ptr, self.source = tuple(shape), dt.as_dtype(dtype), ptr, source

            def __dlpack_device__(self):
                return (2, 0)

            def __dlpack__(self, stream=None, max_version=None):
                jax.dlpack_streams.append(stream)
                return _capsule(self.ptr, self.shape, self.dtype, None, max_version)

        def from_dlpack(x):
            events.append("from_dlpack")
            return Array(x.shape, x.dtype, x.ptr, source=x)

        self.Array = Array
        self.dlpack = types.ModuleType("jax.dlpack")
        self.dlpack.from_dlpack = from_dlpack

    def array(self, shape, dtype):
        return self.Array(shape, dtype, next(_ptrs))


# ---- fixtures --------------------------------------------------------------------------------------------------

class Recorder:
    """Stands in for get_launcher's launchers: records (grid, stream, args) of each launch."""

    def __init__(self, events):
        self.events, self.launches = events, []

    def get_launcher(self, *args, **kw):
        return self

    def __call__(self, grid, stream, *args):
        self.run(grid, stream, args)

    def run(self, grid, stream, args):
        self.events.append("launch")
        self.launches.append((grid, stream, args))


@pytest.fixture
def fresh(monkeypatch):
    """Fresh interop caches (restored afterwards, so a real torch / cupy imported elsewhere is untouched)."""
    monkeypatch.setattr(interop, "_torch", None)
    monkeypatch.setattr(interop, "_NATIVE", dict(interop._NATIVE))
    monkeypatch.setattr(interop, "_CUPY_DTYPES", {})
    return monkeypatch


@pytest.fixture
def events():
    return []


@pytest.fixture
def launches(fresh, events):
    """The GEMM and quantize launchers replaced by a recorder, with fresh plan caches."""
    rec = Recorder(events)
    for name in ("gemm", "quantize"):
        mod = importlib.import_module(f"cudart_kernels.ops.{name}")
        fresh.setattr(mod, "get_launcher", rec.get_launcher)
        fresh.setattr(mod, "PLANS", PlanCache())
        fresh.setattr(mod, "enter_device", lambda device: None)  # (no driver: no context to make current)
    return rec


@pytest.fixture
def fake_torch(fresh):
    torch = FakeTorch()
    fresh.setitem(sys.modules, "torch", torch)
    return torch


@pytest.fixture
def fake_cupy(fresh):
    cp = FakeCupy()
    fresh.setitem(sys.modules, "cupy", cp)
    return cp


@pytest.fixture
def fake_jax(fresh, events):
    jax = FakeJax(events)
    fresh.setitem(sys.modules, "jax", jax)
    fresh.setitem(sys.modules, "jax.dlpack", jax.dlpack)
    return jax


@pytest.fixture
def own_memory(fresh, events):
    """Our own allocations (DeviceArray results) made at fake addresses, recorded."""
    made = []

    def fake_empty(shape, strides, dtype, device, h, owner):
        strides = interop._contiguous_strides(shape) if strides is None else strides
        a = DeviceArray(next(_ptrs), shape, dtype, strides, device, h)
        events.append("alloc")
        made.append(a)
        return a

    fresh.setattr(interop, "_device_empty", fake_empty)
    return made


M, N, K = 16, 1280, 4096  # a decode-kernel GEMM: its launch takes pointers only (no tensor maps), CPU-testable


# ---- which framework -------------------------------------------------------------------------------------------

def test_framework_of_each_array_type(fake_torch, fake_cupy, fake_jax):
    class Param(fake_torch.Tensor):  # torch.nn.Parameter and other subclasses
        pass

    assert native_of(fake_torch.Tensor) is interop.TORCH_RESULTS and native_of(Param) is interop.TORCH_RESULTS
    assert native_of(fake_cupy.ndarray) is interop.CUPY_RESULTS
    assert native_of(fake_jax.Array) is interop.JAX_RESULTS
    for other in (DeviceArray, tuple, type(None), np.ndarray, object):
        assert native_of(other) is interop.DEVICE_RESULTS
    assert {interop._NATIVE[t].name for t in (fake_torch.Tensor, fake_cupy.ndarray, fake_jax.Array)} == {
        "torch", "cupy", "jax"}  # decided once per type


def test_no_framework_means_device_arrays_on_the_legacy_stream(fresh):
    a = (0x10000, (4, 8), None, "bf16")
    *views, h, native = call_arrays((a, None, DeviceArray.from_pointer(0x20000, (8,), "fp32")), None)
    assert h == 0 and native is interop.DEVICE_RESULTS and views[1] is None
    assert call_arrays((a,), 7)[-2] == 7
    assert call_arrays((a,), types.SimpleNamespace(__cuda_stream__=lambda: (0, 0xAB)))[-2] == 0xAB


def test_torch_stream_none_is_torchs_current_stream_read_once(fake_torch, launches):
    a, b = fake_torch.tensor((M, K), "bfloat16"), fake_torch.tensor((N, K), "bfloat16")
    out = ck.gemm(a, b)
    assert type(out) is fake_torch.Tensor and out.shape == (M, N) and out.dtype is fake_torch.bfloat16
    (_, stream, args), = launches.launches
    assert stream == 0x1234 and out.data_ptr() in args
    assert out.alloc_stream == 0x1234  # torch.empty on torch's current stream
    assert fake_torch.raw_calls == 1  # one raw stream read per call, no torch.cuda.current_stream()
    fake_torch.current[0] = 0x4321  # another current stream (a torch.cuda.stream(s) block, a graph capture)
    out2 = ck.gemm(a, b, out_dtype="float32")
    assert launches.launches[-1][1] == 0x4321 and out2.dtype is fake_torch.float32 and out2.alloc_stream == 0x4321


def test_torch_out_is_returned_as_given_and_nothing_allocated(fake_torch, launches):
    a, b = fake_torch.tensor((M, K), "bfloat16"), fake_torch.tensor((N, K), "bfloat16")
    d = fake_torch.tensor((M, N), "bfloat16")
    assert ck.gemm(a, b, out=d) is d and not fake_torch.allocs


def test_torch_explicit_stream_allocates_on_that_stream(fresh, fake_torch, launches):
    orders = []
    fresh.setattr(interop, "_order", lambda producer, consumer, device: orders.append((producer, consumer)))
    a, b = fake_torch.tensor((M, K), "bfloat16"), fake_torch.tensor((N, K), "bfloat16")
    out = ck.gemm(a, b, stream=0x9999)  # not torch's current stream: the tensor is allocated under it
    assert orders == [(0x1234, 0x9999)]  # and the op's stream waits for torch's current one (the inputs' producer)
    assert launches.launches[-1][1] == 0x9999 and out.alloc_stream == 0x9999
    assert fake_torch.current[0] == 0x1234  # and torch's current stream is restored
    s = fake_torch.cuda.Stream(0x1234)  # torch's current stream, passed explicitly: no stream switch
    out = ck.gemm(a, b, stream=s)
    assert launches.launches[-1][1] == 0x1234 and out.alloc_stream == 0x1234


def test_first_framework_array_decides(fake_torch, launches):
    a = (next(_ptrs), (M, K), None, "bf16")  # a pointer tuple first, then a torch tensor
    out = ck.gemm(a, fake_torch.tensor((N, K), "bfloat16"))
    assert type(out) is fake_torch.Tensor and launches.launches[-1][1] == 0x1234


def test_torch_quantize_results_in_their_layouts(fake_torch, launches):
    x = fake_torch.tensor((100, 640), "bfloat16")
    q, s = ck.quantize_fp8_per_token(x)
    assert q.dtype is fake_torch.float8_e4m3fn and q.shape == (100, 640)
    assert s.dtype is fake_torch.float32 and s.shape == (100, 5) and s.stride() == (1, 100)  # M-major
    q2, s2 = ck.quantize_fp8_per_token(fake_torch.tensor((99, 640), "bfloat16"), scale_layout="rowmajor")
    assert s2.stride() == (5, 1)
    qw, sw = ck.quantize_fp8_per_block(fake_torch.tensor((300, 640), "float32"))
    assert qw.shape == (300, 640) and sw.shape == (3, 5) and sw.stride() == (5, 1)
    assert all(st == 0x1234 for _, st, _ in launches.launches)


def test_torch_cpu_tensor_is_refused_before_anything(fake_torch, launches):
    a = fake_torch.tensor((M, K), "bfloat16", device=-1)
    with pytest.raises(HostArrayError, match="CUDA tensor"):
        ck.gemm(a, fake_torch.tensor((N, K), "bfloat16"))
    assert not fake_torch.allocs and not launches.launches


def test_cupy_results_and_stream(fake_cupy, launches, own_memory):
    a, b = fake_cupy.array((M, K), np.float16), fake_cupy.array((N, K), np.float16)
    out = ck.gemm(a, b)
    assert type(out) is fake_cupy.ndarray and out.shape == (M, N) and out.dtype == np.float16
    assert launches.launches[-1][1] == 0x5000 and out.alloc_stream == 0x5000  # cupy's current stream
    assert fake_cupy.dlpack_streams[:2] == [0x5000, 0x5000]  # and the inputs were exported for that stream
    out = ck.gemm(a, b, stream=0x7777)
    assert launches.launches[-1][1] == 0x7777 and out.alloc_stream == 0x7777 and fake_cupy.current[0] == 0x5000
    # float8 is not a cupy dtype (before cupy 14): those outputs are DeviceArrays, the scales cupy arrays
    q, s = ck.quantize_fp8_per_token(fake_cupy.array((64, 256), np.float32))
    assert type(q) is DeviceArray and q.dtype is dt.float8_e4m3 and q.stream == 0x5000
    assert type(s) is fake_cupy.ndarray and s.shape == (64, 2) and s.strides == (4, 256)  # M-major, in bytes


def test_jax_results_are_made_after_the_launch(fake_jax, launches, own_memory, events):
    a, b = fake_jax.array((M, K), "bf16"), fake_jax.array((N, K), "bf16")
    out = ck.gemm(a, b)
    assert type(out) is fake_jax.Array and out.source is own_memory[-1] and out.dtype is dt.bfloat16
    assert events == ["alloc", "launch", "from_dlpack"]  # handed to jax after the launch: jax's stream waits for it
    assert launches.launches[-1][1] == 0 and set(fake_jax.dlpack_streams) == {1}  # the legacy default stream
    # jax takes row-major buffers only: M-major scales stay DeviceArrays, row-major ones become jax arrays
    q, s = ck.quantize_fp8_per_token(fake_jax.array((64, 256), "bf16"))
    assert type(q) is fake_jax.Array and type(s) is DeviceArray and s.strides == (1, 64)
    q, s = ck.quantize_fp8_per_token(fake_jax.array((64, 256), "bf16"), scale_layout="rowmajor")
    assert type(q) is fake_jax.Array and type(s) is fake_jax.Array


def test_jax_import_failure_leaves_a_device_array(fake_jax, launches, own_memory):
    def refuse(x):
        raise RuntimeError("UNIMPLEMENTED: this jax cannot import float8 through DLPack")

    fake_jax.dlpack.from_dlpack = refuse
    out = ck.gemm(fake_jax.array((M, K), "bf16"), fake_jax.array((N, K), "bf16"))
    assert type(out) is DeviceArray


# ---- validation before allocation (out=None) --------------------------------------------------------------------

def _t(shape, dtype="bfloat16", strides=None):
    return (next(_ptrs), shape, strides, dtype)


_BAD_CALLS = {
    "gemm K differs": (lambda: ck.gemm(_t((128, 256)), _t((64, 128))), ValueError, "K differs"),
    "gemm dtypes differ": (lambda: ck.gemm(_t((128, 256)), _t((64, 256), "float16")), TypeError, "same dtype"),
    "gemm bad c": (lambda: ck.gemm(_t((128, 256)), _t((64, 256)), c=_t((128, 32))), ValueError, "c: expected"),
    "gemm out_dtype": (lambda: ck.gemm(_t((128, 256)), _t((64, 256)), out_dtype="int32"), TypeError, "out_dtype"),
    "gemm_fp8 a dtype": (lambda: ck.gemm_fp8(_t((128, 256)), _t((128, 2), "float32"), _t((64, 256), "e4m3"),
                                             _t((1, 2), "float32")), TypeError, "a: dtype"),
    "gemm_fp8 sa shape": (lambda: ck.gemm_fp8(_t((128, 256), "e4m3"), _t((128, 3), "float32"),
                                              _t((64, 256), "e4m3"), _t((1, 2), "float32")), ValueError, "sa"),
    "contiguous m_indices": (lambda: ck.gemm_fp8_grouped_contiguous(
        _t((128, 256), "e4m3"), _t((128, 2), "float32"), _t((2, 128, 256), "e4m3"), _t((2, 1, 2), "float32"),
        _t((64,), "int32")), ValueError, "m_indices"),
    "masked masked_m": (lambda: ck.gemm_fp8_grouped_masked(
        _t((2, 64, 256), "e4m3"), _t((2, 64, 2), "float32"), _t((2, 128, 256), "e4m3"), _t((2, 1, 2), "float32"),
        _t((3,), "int32")), ValueError, "masked_m"),
    "quantize dtype": (lambda: ck.quantize_fp8_per_token(_t((64, 256), "int32")), TypeError, "x: dtype"),
    "quantize K": (lambda: ck.quantize_fp8_per_block(_t((64, 130), "float32")), ValueError, "K=130"),
    "attention head dim": (lambda: ck.attention(_t((1, 64, 2, 40)), _t((1, 64, 2, 40)), _t((1, 64, 2, 40))),
                           ValueError, "head dim"),
    "attention scale": (lambda: ck.attention(_t((1, 64, 2, 64)), _t((1, 64, 2, 64)), _t((1, 64, 2, 64)),
                                             softmax_scale=-1.0), ValueError, "softmax_scale"),
    "attention_backward lse": (lambda: ck.attention_backward(
        _t((1, 64, 2, 64)), _t((1, 64, 2, 64)), _t((1, 64, 2, 64)), _t((1, 64, 2, 64)), _t((1, 64, 2, 64)),
        _t((1, 2, 63), "float32")), ValueError, "lse"),
}


@pytest.mark.parametrize("case", list(_BAD_CALLS))
def test_inputs_validated_before_any_allocation(fresh, case):
    def no_allocation(*args, **kw):
        raise AssertionError("allocated an output before validating the inputs")

    fresh.setattr(interop, "_device_empty", no_allocation)
    call, exc, match = _BAD_CALLS[case]
    with pytest.raises(exc, match=match):
        call()


def test_valid_inputs_reach_the_allocation(fresh):
    """(the check above is not vacuous: with good inputs the same path allocates)"""
    def allocated(*args, **kw):
        raise LookupError("allocated")

    fresh.setattr(interop, "_device_empty", allocated)
    for call in (lambda: ck.gemm(_t((128, 256)), _t((64, 256))),
                 lambda: ck.quantize_fp8_per_token(_t((64, 256))),
                 lambda: ck.attention(_t((1, 64, 2, 64)), _t((1, 64, 2, 64)), _t((1, 64, 2, 64)))):
        with pytest.raises(LookupError, match="allocated"):
            call()
