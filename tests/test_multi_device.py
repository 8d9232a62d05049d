"""Several GPUs on the CPU: every per-device piece (launchers, loaded modules, plans, scratch, device properties) is
keyed by device; an op makes its arrays' device current for its driver calls and leaves the caller's context
current afterwards; arrays on two devices are refused in validation, before any driver call. The driver is stood in
for by a fake with two devices and a per-thread current context (the real thing: tests/test_multi_device_gpu.py)."""
import importlib
import itertools
import sys
import threading
import types

import pytest
from cuda.bindings import driver as cu

import cudart_kernels as ck
from cudart_kernels.ops import sm90
from cudart_kernels.runtime import compiler, driver, interop, launch
from cudart_kernels.runtime.interop import DeviceArray
from cudart_kernels.runtime.plans import PlanCache
from cudart_kernels.runtime.scratch import ScratchPool

_ptrs = itertools.count(0x7E00_0000_0000, 1 << 20)  # fake device addresses, 1 MiB apart
OK = cu.CUresult.CUDA_SUCCESS
CTX = {0: 0xC000, 1: 0xC100}  # each fake device's primary context


class FakeDriver:
    """Two devices, a current context per thread, and a log of (call, current context) for the calls it serves."""

    def __init__(self, monkeypatch):
        self.log = []
        self._local = threading.local()
        self.fail_launch = False
        ptrs = itertools.count(0x7D00_0000_0000, 1 << 20)
        monkeypatch.setattr(driver, "_device_problem", lambda device: None if device in CTX else "no such device")
        monkeypatch.setattr(driver, "_context_handles", {})
        monkeypatch.setattr(driver, "_one_gpu", [False])  # two devices (test_one_gpu_* set it to one)
        monkeypatch.setattr(driver, "_thread", threading.local())
        monkeypatch.setattr(driver, "primary_context", lambda device: cu.CUcontext(CTX[device]))
        monkeypatch.setattr(driver, "_primary_context_handle", lambda device: CTX[device])

        def served(name, result=None):
            def call(*args):
                self.log.append((name, self.current))
                return (OK,) if result is None else (OK, result(*args))
            return call

        def set_current(ctx):
            self.log.append(("cuCtxSetCurrent", int(ctx)))
            self.current = int(ctx)
            return (OK,)

        def launch_kernel(config, function, params, extra):
            self.log.append(("cuLaunchKernelEx", self.current))
            if function[1] != self.current:  # a function of another context
                return (cu.CUresult.CUDA_ERROR_INVALID_HANDLE,)
            return (cu.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,) if self.fail_launch else (OK,)

        def get_current():
            self.log.append(("cuCtxGetCurrent", self.current))
            return OK, cu.CUcontext(self.current)

        fakes = {
            "cuCtxGetCurrent": get_current,
            "cuCtxSetCurrent": set_current,
            "cuModuleLoadData": served("cuModuleLoadData", lambda cubin: ("module", self.current)),
            "cuModuleGetFunction": served("cuModuleGetFunction", lambda module, name: ("function", self.current)),
            "cuFuncSetAttribute": served("cuFuncSetAttribute"),
            "cuLaunchKernelEx": launch_kernel,
            "cuStreamIsCapturing": served("cuStreamIsCapturing",
                                          lambda s: cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE),
            "cuMemAllocAsync": served("cuMemAllocAsync", lambda n, s: next(ptrs)),
            "cuMemsetD32Async": served("cuMemsetD32Async"),
            "cuMemFreeAsync": served("cuMemFreeAsync"),
            "cuEventCreate": served("cuEventCreate", lambda flags: "event"),
            "cuEventRecord": served("cuEventRecord"),
            "cuStreamWaitEvent": served("cuStreamWaitEvent"),
            "cuEventDestroy": served("cuEventDestroy"),
            "cuGetErrorName": lambda err: (OK, err.name.encode()),
            "cuGetErrorString": lambda err: (OK, b"fake"),
        }
        for name, fake in fakes.items():
            monkeypatch.setattr(cu, name, fake)

    @property
    def current(self) -> int:
        return getattr(self._local, "ctx", 0)

    @current.setter
    def current(self, ctx: int) -> None:
        self._local.ctx = ctx

    def calls(self, name: str) -> list:
        """The current context at each call of `name`."""
        return [ctx for n, ctx in self.log if n == name]


@pytest.fixture
def fake_driver(monkeypatch):
    return FakeDriver(monkeypatch)


def _arr(shape, dtype="bfloat16", device=0, strides=None):
    return DeviceArray.from_pointer(next(_ptrs), shape, dtype, strides, device=device)


class FakeLauncher:
    """Stands in for one kernel variant's launcher on one device: records (device, stream, current context)."""

    def __init__(self, device, rec, entry=""):
        self.device, self.rec, self.entry = device, rec, entry
        self.function = types.SimpleNamespace(device=device)

    def __call__(self, grid, stream, *args):
        self.run(grid, stream, args)

    def run(self, grid, stream, args):
        self.rec.launches.append((self.device, stream, self.rec.fake.current))
        self.rec.args.append((self.entry, grid, args))

    def max_active_clusters(self):
        return 66


class Recorder:
    """Stands in for an op's get_launcher: one launcher per (source, entry, device)."""

    def __init__(self, fake):
        self.fake, self.made, self.launches, self.args = fake, {}, [], []

    def get_launcher(self, source, entry, defines, device, *args, **kw):
        return self.made.setdefault((source, entry, device), FakeLauncher(device, self, entry))


@pytest.fixture
def recorder(fake_driver, monkeypatch):
    """Every op's launchers replaced by recorders, with a fresh plan cache and scratch pool, H100 properties for
    each device and stand-in tensor maps (their encoding needs the driver)."""
    rec = Recorder(fake_driver)
    rec.plans, pool = PlanCache(), ScratchPool()
    for name in ("gemm", "gemm_fp8", "quantize", "attention", "attention_bwd"):
        mod = importlib.import_module(f"cudart_kernels.ops.{name}")
        monkeypatch.setattr(mod, "get_launcher", rec.get_launcher)
        monkeypatch.setattr(mod, "PLANS", rec.plans)
        for attr, fake in (("SCRATCH", pool), ("device_properties", lambda device=0: driver.H100)):
            if hasattr(mod, attr):
                monkeypatch.setattr(mod, attr, fake)
    monkeypatch.setattr(sm90, "thread_maps", lambda: types.SimpleNamespace(get=lambda layout, address: ("map",
                                                                                                        address)))
    return rec


M, N, K = 16, 1280, 4096  # a decode-kernel GEMM: its launch takes pointers only (no tensor maps)


def _gemm_arrays(device):
    return _arr((M, K), device=device), _arr((N, K), device=device), _arr((M, N), device=device)


# ---- the context follows the arrays ------------------------------------------------------------------------------

def test_op_on_device_1_runs_in_its_context_and_restores_the_callers(fake_driver, recorder):
    fake_driver.current = CTX[0]  # the thread works on device 0 (torch.cuda.set_device(0), say)
    a, b, d = _gemm_arrays(1)
    assert ck.gemm(a, b, out=d) is d
    assert recorder.launches[-1] == (1, 0, CTX[1])  # device 1's launcher, in device 1's context
    assert fake_driver.current == CTX[0]  # and the caller's context is current again
    assert fake_driver.calls("cuCtxSetCurrent") == [CTX[1], CTX[0]]

    x, q, s = _arr((64, 256), device=1), _arr((64, 256), "e4m3", 1), _arr((64, 2), "float32", 1, (1, 64))
    ck.quantize_fp8_per_token(x, out=q, out_scales=s)
    assert recorder.launches[-1] == (1, 0, CTX[1]) and fake_driver.current == CTX[0]


def test_no_context_switch_when_the_device_is_current(fake_driver, recorder):
    fake_driver.current = CTX[0]
    a, b, d = _gemm_arrays(0)
    for _ in range(3):
        ck.gemm(a, b, out=d)
    assert [launch[2] for launch in recorder.launches] == [CTX[0]] * 3
    assert fake_driver.calls("cuCtxSetCurrent") == []  # the fast path never switches


def test_a_thread_without_a_context_keeps_the_devices(fake_driver, recorder):
    fake_driver.current = 0
    a, b, d = _gemm_arrays(1)
    ck.gemm(a, b, out=d)
    ck.gemm(a, b, out=d)
    assert fake_driver.current == CTX[1] and fake_driver.calls("cuCtxSetCurrent") == [CTX[1]]  # switched once


def test_context_restored_when_the_launch_fails(fake_driver, recorder, monkeypatch):
    fake_driver.current = CTX[0]
    a, b, d = _gemm_arrays(1)
    ck.gemm(a, b, out=d)

    def fail(self, grid, stream, args):
        raise ck.CudaError("launch failed")

    monkeypatch.setattr(FakeLauncher, "run", fail)
    with pytest.raises(ck.CudaError):
        ck.gemm(a, b, out=d)
    assert fake_driver.current == CTX[0]


def test_two_threads_two_devices(fake_driver, recorder):
    """Each thread's launches run in its arrays' device's context, whatever the other thread does."""
    arrays = {dev: _gemm_arrays(dev) for dev in (0, 1)}
    errors = []

    def work(dev):
        try:
            fake_driver.current = CTX[1 - dev]  # each thread starts on the other device
            for _ in range(200):
                ck.gemm(*arrays[dev][:2], out=arrays[dev][2])
                assert fake_driver.current == CTX[1 - dev]
        except Exception as e:  # (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(dev,)) for dev in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(recorder.launches) == 400
    assert all(ctx == CTX[dev] for dev, _, ctx in recorder.launches)


def test_torch_tensors_on_device_1_use_torchs_stream_there(fake_driver, recorder, monkeypatch):
    from test_native_results import FakeTorch

    torch = FakeTorch()
    torch.current[1] = 0x2345  # torch's current stream on device 1
    monkeypatch.setattr(interop, "_torch", None)
    monkeypatch.setattr(interop, "_NATIVE", dict(interop._NATIVE))
    monkeypatch.setitem(sys.modules, "torch", torch)
    fake_driver.current = CTX[0]
    a, b = torch.tensor((M, K), "bfloat16", device=1), torch.tensor((N, K), "bfloat16", device=1)
    out = ck.gemm(a, b)
    assert out.get_device() == 1 and out.alloc_stream == 0x2345  # allocated on device 1, on its current stream
    assert recorder.launches[-1] == (1, 0x2345, CTX[1]) and fake_driver.current == CTX[0]


def _mmajor(rows, groups, device=1):
    """fp32 scales [rows, groups] in the M-major layout the FP8 kernels read in place."""
    return _arr((rows, groups), "float32", device, (1, rows))


_EVERY_OP = {
    "gemm_fp8": lambda: ck.gemm_fp8(_arr((128, 256), "e4m3", 1), _mmajor(128, 2), _arr((64, 256), "e4m3", 1),
                                    _arr((1, 2), "float32", 1), out=_arr((128, 64), device=1)),
    "gemm_fp8 sa converted": lambda: ck.gemm_fp8(_arr((128, 256), "e4m3", 1), _arr((128, 2), "float32", 1),
                                                 _arr((64, 256), "e4m3", 1), _arr((1, 2), "float32", 1),
                                                 out=_arr((128, 64), device=1)),
    "contiguous": lambda: ck.gemm_fp8_grouped_contiguous(
        _arr((128, 256), "e4m3", 1), _mmajor(128, 2), _arr((2, 128, 256), "e4m3", 1), _arr((2, 1, 2), "float32", 1),
        _arr((128,), "int32", 1), out=_arr((128, 128), device=1)),
    "contiguous, tile list": lambda: ck.gemm_fp8_grouped_contiguous(
        _arr((1024, 256), "e4m3", 1), _mmajor(1024, 2), _arr((2, 512, 256), "e4m3", 1),
        _arr((2, 4, 2), "float32", 1), _arr((1024,), "int32", 1), out=_arr((1024, 512), device=1), alignment=64),
    "masked": lambda: ck.gemm_fp8_grouped_masked(
        _arr((2, 64, 256), "e4m3", 1), _arr((2, 64, 2), "float32", 1, (64, 1, 128)), _arr((2, 128, 256), "e4m3", 1),
        _arr((2, 1, 2), "float32", 1), _arr((2,), "int32", 1), out=_arr((2, 64, 128), device=1)),
    "wgrad": lambda: ck.gemm_fp8_wgrad(_arr((128, 256), "e4m3", 1), _mmajor(128, 2), _arr((64, 256), "e4m3", 1),
                                       _mmajor(64, 2), _arr((2, 128, 64), "float32", 1), [128, 128]),
    "per-block": lambda: ck.quantize_fp8_per_block(_arr((256, 256), device=1), out=_arr((256, 256), "e4m3", 1),
                                                   out_scales=_arr((2, 2), "float32", 1)),
    "attention": lambda: ck.attention(*(_arr((1, 64, 2, 64), device=1) for _ in range(3)), causal=True,
                                      out=_arr((1, 64, 2, 64), device=1)),
    "attention_backward": lambda: ck.attention_backward(
        *(_arr((1, 64, 2, 64), device=1) for _ in range(5)), _arr((1, 2, 64), "float32", 1),
        dq=_arr((1, 64, 2, 64), device=1), dk=_arr((1, 64, 2, 64), device=1), dv=_arr((1, 64, 2, 64), device=1)),
}


@pytest.mark.parametrize("case", list(_EVERY_OP))
def test_every_op_launches_in_its_arrays_context(fake_driver, recorder, case):
    fake_driver.current = CTX[0]
    _EVERY_OP[case]()
    assert recorder.launches and all(launch == (1, 0, CTX[1]) for launch in recorder.launches)  # (conversions too)
    assert fake_driver.current == CTX[0]
    assert set(fake_driver.calls("cuMemAllocAsync")) <= {CTX[1]}  # scratch, if any, on device 1


def test_contiguous_tile_list_launch(fake_driver, recorder):
    """Tiles taller than the alignment: the list kernel runs first on the call's stream, on the ids, into a scratch
    buffer that the GEMM then gets as its tile list (the argument after the ids); without, the GEMM gets none."""
    m, ids = 1024, _arr((1024,), "int32", 1)
    args = (_arr((m, 256), "e4m3", 1), _mmajor(m, 2), _arr((2, 512, 256), "e4m3", 1), _arr((2, 4, 2), "float32", 1),
            ids)
    ck.gemm_fp8_grouped_contiguous(*args, out=_arr((m, 512), device=1), alignment=64, stream=0x2345)
    (lst, lst_grid, lst_args), (gemm, _, gemm_args) = recorder.args
    assert (lst, gemm) == ("contiguous_tile_list", "gemm_fp8_kernel") and lst_grid == (1, 1, 1)
    assert lst_args[:5] == (ids.ptr, m, 2, 128, 64) and lst_args[5] not in (0, ids.ptr)
    assert gemm_args[11:13] == (ids.ptr, lst_args[5])
    assert [launch[1] for launch in recorder.launches] == [0x2345, 0x2345]
    recorder.args.clear()
    ck.gemm_fp8_grouped_contiguous(*args, out=_arr((m, 512), device=1), alignment=256, stream=0x2345)
    [(gemm, _, gemm_args)] = recorder.args
    assert gemm == "gemm_fp8_kernel" and gemm_args[11:13] == (ids.ptr, 0)


# ---- caches keyed per device -------------------------------------------------------------------------------------

def test_plans_per_device(fake_driver, recorder):
    fake_driver.current = CTX[0]
    for dev in (0, 1, 0, 1):
        ck.gemm(*_gemm_arrays(dev)[:2], out=_gemm_arrays(dev)[2])
    plans = recorder.plans.items("gemm")
    assert len(plans) == 2  # one per device (the same shapes), each hit the second time
    assert sorted(plan.launch.device for _, plan in plans) == [0, 1]
    assert [dev for dev, _, _ in recorder.launches] == [0, 1, 0, 1]


@pytest.fixture
def fake_compile(monkeypatch):
    """Empty launcher and module caches, and a compiler that returns one stand-in cubin for any kernel."""
    monkeypatch.setattr(launch, "_launchers", {})
    monkeypatch.setattr(launch, "_functions", {})
    monkeypatch.setattr(driver, "target_arch", lambda device=0: "sm_90a")
    compiled = types.SimpleNamespace(key="cubin-key", entry="kernel", cubin=b"")
    monkeypatch.setattr(compiler, "compile_kernel", lambda source, entry, defines, arch: compiled)


def test_launchers_and_modules_per_device(fake_driver, fake_compile):
    fake_driver.current = CTX[0]

    def get(device):
        return launch.get_launcher("gemm.cu", "kernel", {"X": 1}, device, ("ptr",), (128,), smem=1024)

    l0, l1 = get(0), get(1)
    assert l0 is get(0) and l1 is get(1) and l0 is not l1
    assert l0.function.device == 0 and l1.function.device == 1
    assert l0.function.module == ("module", CTX[0]) and l1.function.module == ("module", CTX[1])  # loaded there
    assert fake_driver.calls("cuFuncSetAttribute") == [CTX[0], CTX[1]]
    assert fake_driver.current == CTX[0]
    l1.run((1, 1, 1), 0, (0x1000,))  # a launch from outside an op (benchmarks): in its own context too
    assert fake_driver.calls("cuLaunchKernelEx") == [CTX[0], CTX[1]]  # (the wrong one first, then the retry)
    assert fake_driver.current == CTX[0]


def test_launch_error_names_the_device_and_stream(fake_driver, fake_compile):
    fake_driver.current, fake_driver.fail_launch = CTX[1], True
    lau = launch.get_launcher("gemm.cu", "kernel", {}, 1, ("ptr",), (128,))
    with pytest.raises(ck.CudaError, match="launching kernel on stream 0x77: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
        lau.run((1, 1, 1), 0x77, (0x1000,))


def test_scratch_per_device(fake_driver):
    pool = ScratchPool()
    fake_driver.current = CTX[0]
    needs = (("splitk_partials", 4096, False), ("splitk_counters", 256, True))
    p0, p1 = pool.acquire(0, 0x55, needs), pool.acquire(1, 0x55, needs)
    assert set(p0).isdisjoint(p1)  # the same stream handle and slots, another device: other buffers
    assert pool.acquire(0, 0x55, needs) == p0 and pool.acquire(1, 0x55, needs) == p1
    assert fake_driver.calls("cuMemAllocAsync") == [CTX[0], CTX[0], CTX[1], CTX[1]]  # each in its device's context
    assert fake_driver.calls("cuMemsetD32Async") == [CTX[0], CTX[1]]
    assert fake_driver.current == CTX[0]


def test_device_properties_ask_their_device(monkeypatch):
    asked = []
    monkeypatch.setattr(driver, "gpu_available", lambda: True)
    monkeypatch.setattr(cu, "cuDeviceGet", lambda ordinal: (asked.append(ordinal) or OK, ordinal))
    monkeypatch.setattr(cu, "cuDeviceGetName", lambda n, dev: (OK, f"GPU {dev}".encode()))
    monkeypatch.setattr(cu, "cuDeviceGetAttribute", lambda attr, dev: (OK, 100 + dev))
    uncached = driver.device_properties.__wrapped__
    p0, p1 = uncached(0), uncached(1)
    assert asked == [0, 1] and (p0.name, p1.name) == ("GPU 0", "GPU 1") and p1.sm_count == 101
    assert driver.device_properties.cache_parameters()["maxsize"] is None  # cached per device argument


def test_device_array_memory_in_its_devices_context(fake_driver):
    fake_driver.current = CTX[0]
    x = DeviceArray.empty((64,), "float32", device=1)
    assert x.device == 1 and fake_driver.calls("cuMemAllocAsync") == [CTX[1]]
    del x
    assert fake_driver.calls("cuMemFreeAsync") == [CTX[1]] and fake_driver.current == CTX[0]


def test_stream_ordering_in_the_producers_context(fake_driver):
    fake_driver.current = CTX[0]
    interop._order(0x77, 0x88, 1)
    assert fake_driver.calls("cuEventRecord") == [CTX[1]] and fake_driver.current == CTX[0]


# ---- arrays on two devices: refused in validation, before any driver call ----------------------------------------

def _on(dev, shape, dtype="bfloat16", strides=None):
    return _arr(shape, dtype, dev, strides)


def _bwd(moved):
    shapes = dict(dout=(1, 64, 2, 64), q=(1, 64, 2, 64), k=(1, 64, 2, 64), v=(1, 64, 2, 64), out=(1, 64, 2, 64),
                  lse=(1, 2, 64), dk=(1, 64, 2, 64))
    arrays = {n: _on(1 if n == moved else 0, s, "float32" if n == "lse" else "bfloat16") for n, s in shapes.items()}
    dk = arrays.pop("dk")
    return lambda: ck.attention_backward(*arrays.values(), dk=dk)


_TWO_DEVICES = {
    "gemm b": (lambda: ck.gemm(_on(0, (128, 256)), _on(1, (64, 256))), "b is on cuda:1 but a is on cuda:0"),
    "gemm out": (lambda: ck.gemm(_on(0, (128, 256)), _on(0, (64, 256)), out=_on(1, (128, 64))),
                 "out is on cuda:1 but a is on cuda:0"),
    "gemm c": (lambda: ck.gemm(_on(1, (128, 256)), _on(1, (64, 256)), c=_on(0, (128, 64), "float32")),
               "c is on cuda:0 but a is on cuda:1"),
    "gemm accumulate": (lambda: (lambda acc: ck.gemm(_on(0, (128, 256)), _on(0, (64, 256)), out=acc, c=acc))(
        _on(1, (128, 64), "float32")), "out is on cuda:1 but a is on cuda:0"),
    "gemm_fp8 sb": (lambda: ck.gemm_fp8(_on(0, (128, 256), "e4m3"), _on(0, (128, 2), "float32"),
                                        _on(0, (64, 256), "e4m3"), _on(1, (1, 2), "float32")),
                    "sb is on cuda:1 but a is on cuda:0"),
    "gemm_fp8 out": (lambda: ck.gemm_fp8(_on(0, (128, 256), "e4m3"), _on(0, (128, 2), "float32"),
                                         _on(0, (64, 256), "e4m3"), _on(0, (1, 2), "float32"),
                                         out=_on(1, (128, 64))), "out is on cuda:1 but a is on cuda:0"),
    "contiguous m_indices": (lambda: ck.gemm_fp8_grouped_contiguous(
        _on(0, (128, 256), "e4m3"), _on(0, (128, 2), "float32"), _on(0, (2, 128, 256), "e4m3"),
        _on(0, (2, 1, 2), "float32"), _on(1, (128,), "int32")), "m_indices is on cuda:1 but a is on cuda:0"),
    "masked masked_m": (lambda: ck.gemm_fp8_grouped_masked(
        _on(0, (2, 64, 256), "e4m3"), _on(0, (2, 64, 2), "float32"), _on(0, (2, 128, 256), "e4m3"),
        _on(0, (2, 1, 2), "float32"), _on(1, (2,), "int32")), "masked_m is on cuda:1 but a is on cuda:0"),
    "masked out": (lambda: ck.gemm_fp8_grouped_masked(
        _on(1, (2, 64, 256), "e4m3"), _on(1, (2, 64, 2), "float32"), _on(1, (2, 128, 256), "e4m3"),
        _on(1, (2, 1, 2), "float32"), _on(1, (2,), "int32"), out=_on(0, (2, 64, 128))),
        "out is on cuda:0 but a is on cuda:1"),
    "wgrad d": (lambda: ck.gemm_fp8_wgrad(_on(0, (128, 256), "e4m3"), _on(0, (128, 2), "float32"),
                                          _on(0, (64, 256), "e4m3"), _on(0, (64, 2), "float32"),
                                          _on(1, (1, 128, 64), "float32"), [256]), "d is on cuda:1 but a is on cuda:0"),
    "wgrad sa": (lambda: ck.gemm_fp8_wgrad(_on(0, (128, 256), "e4m3"), _on(1, (128, 2), "float32"),
                                           _on(0, (64, 256), "e4m3"), _on(0, (64, 2), "float32"),
                                           _on(0, (2, 128, 64), "float32"), [128, 128]),
                 "sa is on cuda:1 but a is on cuda:0"),
    "per-token out_scales": (lambda: ck.quantize_fp8_per_token(
        _on(0, (64, 256)), out=_on(0, (64, 256), "e4m3"), out_scales=_on(1, (64, 2), "float32", (1, 64))),
        "out_scales is on cuda:1 but x is on cuda:0"),
    "per-block out": (lambda: ck.quantize_fp8_per_block(
        _on(1, (256, 256)), out=_on(0, (256, 256), "e4m3"), out_scales=_on(1, (2, 2), "float32")),
        "out is on cuda:0 but w is on cuda:1"),
    "attention v": (lambda: ck.attention(_on(0, (1, 64, 2, 64)), _on(0, (1, 64, 2, 64)), _on(1, (1, 64, 2, 64))),
                    "v is on cuda:1 but q is on cuda:0"),
    "attention lse": (lambda: ck.attention(_on(0, (1, 64, 2, 64)), _on(0, (1, 64, 2, 64)), _on(0, (1, 64, 2, 64)),
                                           lse=_on(1, (1, 2, 64), "float32")), "lse is on cuda:1 but q is on cuda:0"),
    "attention cu_seqlens_k": (lambda: ck.attention(
        _on(0, (64, 2, 64)), _on(0, (64, 2, 64)), _on(0, (64, 2, 64)), cu_seqlens_q=_on(0, (2,), "int32"),
        cu_seqlens_k=_on(1, (2,), "int32"), max_seqlen_q=64, max_seqlen_k=64),
        "cu_seqlens_k is on cuda:1 but q is on cuda:0"),
    "attention_backward dout": (_bwd("dout"), "dout is on cuda:1 but q is on cuda:0"),
    "attention_backward lse": (_bwd("lse"), "lse is on cuda:1 but q is on cuda:0"),
    "attention_backward dk": (_bwd("dk"), "dk is on cuda:1 but k is on cuda:0"),
}


@pytest.fixture
def no_driver(monkeypatch):
    """Every driver entry point raises: a call that reaches one failed to validate first."""
    for name in dir(cu):
        if name.startswith("cu") and callable(getattr(cu, name)):
            def forbidden(*args, _name=name, **kw):
                raise AssertionError(f"{_name} called before the arrays' devices were checked")
            monkeypatch.setattr(cu, name, forbidden)


@pytest.mark.parametrize("case", list(_TWO_DEVICES))
def test_two_devices_refused_before_any_driver_call(no_driver, case):
    call, message = _TWO_DEVICES[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_same_device_names_both_arrays():
    a, b = _arr((4,), device=0), _arr((4,), device=1)
    assert interop.same_device(a=a, b=None, c=a) == 0
    with pytest.raises(ValueError, match="b is on cuda:1 but a is on cuda:0: an op's arrays must all be on one"):
        interop.same_device(a=a, b=b)
    with pytest.raises(ValueError, match="array 1 is on cuda:1 but array 0 is on cuda:0"):
        interop.same_device(a, b)


# ---- one GPU: a thread asks for the current context once -----------------------------------------------------------

def test_one_gpu_thread_asks_once(fake_driver, recorder, monkeypatch):
    monkeypatch.setattr(driver, "_one_gpu", [True])
    fake_driver.current = 0  # a fresh thread: no context
    a, b, d = _gemm_arrays(0)
    for _ in range(3):
        ck.gemm(a, b, out=d)
    assert len(fake_driver.calls("cuCtxGetCurrent")) == 1  # the first call made the primary context current
    assert fake_driver.calls("cuCtxSetCurrent") == [CTX[0]] and fake_driver.current == CTX[0]
    assert [launch[2] for launch in recorder.launches] == [CTX[0]] * 3

    seen = []  # another thread asks once for itself
    t = threading.Thread(target=lambda: (ck.gemm(a, b, out=d), seen.append(fake_driver.current)))
    t.start()
    t.join()
    assert seen == [CTX[0]] and len(fake_driver.calls("cuCtxGetCurrent")) == 2


def test_one_gpu_caller_context_is_restored_and_asked_again(fake_driver, recorder, monkeypatch):
    """A caller working in a context of its own (not the primary one) gets it back after each op; such a thread is
    never taken as settled, so every op asks."""
    monkeypatch.setattr(driver, "_one_gpu", [True])
    own = 0xC0FF
    fake_driver.current = own
    a, b, d = _gemm_arrays(0)
    for _ in range(2):
        ck.gemm(a, b, out=d)
        assert recorder.launches[-1][2] == CTX[0] and fake_driver.current == own
    assert len(fake_driver.calls("cuCtxGetCurrent")) == 2


def test_one_gpu_launch_in_a_foreign_context_retries_in_the_primary(fake_driver, fake_compile, monkeypatch):
    """A settled thread that switched to a context of its own afterwards: enter_device no longer asks, the launch
    fails in that context and is retried in the primary one, and the caller's context is current again."""
    monkeypatch.setattr(driver, "_one_gpu", [True])
    fake_driver.current = CTX[0]
    launcher = launch.get_launcher("gemm.cu", "kernel", {"X": 1}, 0, ("ptr",), (128,), smem=1024)
    assert driver.enter_device(0) is None  # (settles the thread)
    asked = len(fake_driver.calls("cuCtxGetCurrent"))
    own = 0xC0FF
    fake_driver.current = own
    assert driver.enter_device(0) is None and len(fake_driver.calls("cuCtxGetCurrent")) == asked  # no query
    launcher.run((1, 1, 1), 0, (0x1000,))
    assert fake_driver.calls("cuLaunchKernelEx") == [own, CTX[0]]  # (the foreign context first, then the retry)
    assert fake_driver.current == own
