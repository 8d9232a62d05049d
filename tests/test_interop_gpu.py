"""Interop on the GPU: DeviceArray basics, DLPack round trips with torch, cupy and jax in both directions,
stream ordering on non-default streams (graph capture: test_graphs_gpu.py; each op's framework-native results:
test_native_results_gpu.py)."""
import numpy as np
import pytest

import cudart_kernels as ck
from cudart_kernels import reference as ref
from cudart_kernels.runtime.interop import DeviceArray, as_array

pytestmark = pytest.mark.gpu


def test_device_array_numpy_round_trip(rng):
    for dtype in ("fp32", "fp16", "bf16", "e4m3", "e5m2", "int32", "int64"):
        host = rng.standard_normal((37, 19)).astype(np.float32).astype(ck.runtime.dtypes.as_dtype(dtype).numpy)
        back = DeviceArray.from_numpy(host).numpy()
        assert back.dtype == host.dtype and np.array_equal(back.view(np.uint8), host.view(np.uint8))


def test_strided_numpy_copy(rng):
    host = rng.standard_normal((6, 10)).astype(np.float32)
    d = DeviceArray.from_numpy(host)
    t = DeviceArray(d.ptr, (10, 6), "fp32", strides=(1, 10), owner=d)  # transposed view
    assert np.array_equal(t.numpy(), host.T)


# ---- torch -----------------------------------------------------------------------------------------------------

def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "int64", "float8_e4m3fn"])
def test_torch_both_directions(dtype):
    torch = _torch()
    t = (torch.randn(33, 48, device="cuda") * 4).to(getattr(torch, dtype))
    a = as_array(t)
    assert a.ptr == t.data_ptr() and a.shape == (33, 48) and a.strides == (48, 1)
    back = torch.from_dlpack(a)  # our export, consumed by torch
    assert back.dtype == t.dtype and back.data_ptr() == t.data_ptr()
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    sliced = t[3:, 5:37]
    b = as_array(sliced)
    assert b.ptr == sliced.data_ptr() and b.strides == (48, 1)


def test_torch_results_are_torch_tensors(rng):
    torch = _torch()
    x = torch.randn(100, 640, device="cuda", dtype=torch.bfloat16)
    tq, ts = ck.quantize_fp8_per_token(x)  # torch in, torch out (allocated by torch, on its current stream)
    assert isinstance(tq, torch.Tensor) and isinstance(ts, torch.Tensor)
    assert tq.dtype == torch.float8_e4m3fn and tuple(ts.stride()) == (1, 100)
    rq, rs = ref.quantize_per_token(x.float().cpu().numpy().astype(ck.bfloat16.numpy))
    assert np.array_equal(tq.view(torch.uint8).cpu().numpy(), rq.view(np.uint8))
    assert np.array_equal(ts.cpu().numpy(), rs)


def test_torch_out_tensors_are_returned():
    torch = _torch()
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    q = torch.empty(64, 256, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty_strided((64, 2), (1, 64), device="cuda", dtype=torch.float32)
    rq, rs = ck.quantize_fp8_per_token(x, out=q, out_scales=s)
    assert rq is q and rs is s
    eq, es = ref.quantize_per_token(x.cpu().numpy())
    assert np.array_equal(q.view(torch.uint8).cpu().numpy(), eq.view(np.uint8))
    assert np.array_equal(s.cpu().numpy(), es)


def test_result_consumed_on_a_non_default_stream():
    """Our result is produced on stream A behind a long sleep; torch consumes it on stream B through DLPack.
    Without the event the DLPack export inserts, B would read the poison."""
    torch = _torch()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    q = DeviceArray.empty((4096, 1024), "e4m3", stream=a).fill_bytes(0x7F)
    s = DeviceArray.empty((4096, 8), "fp32", stream=a).fill_bytes(0xFF)
    with torch.cuda.stream(a):
        torch.cuda._sleep(200_000_000)  # ~0.1 s on stream A
    ck.quantize_fp8_per_token(x, out=q, out_scales=s, stream=a)
    with torch.cuda.stream(b):
        tq = torch.from_dlpack(q).view(torch.uint8).clone()
        ts = torch.from_dlpack(s).clone()
    torch.cuda.synchronize()
    eq, es = ref.quantize_per_token(x.float().cpu().numpy().astype(ck.bfloat16.numpy))
    assert np.array_equal(tq.cpu().numpy(), eq.view(np.uint8))
    assert np.array_equal(ts.cpu().numpy(), es)


def test_input_produced_on_another_stream_is_ordered():
    """torch writes x on its current stream behind a sleep; we consume on stream B; DLPack makes B wait."""
    torch = _torch()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    base = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros_like(base)
    torch.cuda.synchronize()
    with torch.cuda.stream(a):
        torch.cuda._sleep(200_000_000)
        x.copy_(base)
        q, s = ck.quantize_fp8_per_token(x, scale_layout="rowmajor", stream=b)  # torch tensors made on b
    torch.cuda.synchronize()
    eq, es = ref.quantize_per_token(base.float().cpu().numpy().astype(ck.bfloat16.numpy))
    assert np.array_equal(q.view(torch.uint8).cpu().numpy(), eq.view(np.uint8))
    assert np.array_equal(s.cpu().numpy(), es)


# ---- cupy ------------------------------------------------------------------------------------------------------

def test_cupy_both_directions(rng):
    cp = pytest.importorskip("cupy")
    host = ref.random_activations(rng, 70, 512, np.float32)
    x = cp.asarray(host)
    q, s = ck.quantize_fp8_per_token(x)  # cupy -> us (DLPack); scales back as cupy, e4m3 as a DeviceArray
    assert isinstance(s, cp.ndarray)     # (cupy has no float8)
    eq, es = ref.quantize_per_token(host)
    assert np.array_equal(cp.asnumpy(s), es)
    assert np.array_equal(cp.asnumpy(cp.from_dlpack(as_array(s))), es)  # us -> cupy (DLPack)
    qh = q.numpy() if isinstance(q, DeviceArray) else cp.asnumpy(q)
    assert np.array_equal(qh.view(np.uint8), eq.view(np.uint8))
    via_cai = cp.asarray(DeviceArray.from_numpy(host))  # us -> cupy (CUDA Array Interface)
    assert np.array_equal(cp.asnumpy(via_cai), host)

    class CAIOnly:  # a producer that only speaks __cuda_array_interface__
        def __init__(self, arr):
            self.__cuda_array_interface__ = arr.__cuda_array_interface__
    q2, s2 = ck.quantize_fp8_per_token(CAIOnly(x))
    assert np.array_equal(s2.numpy(), es)
    stream = cp.cuda.Stream(non_blocking=True)
    q3, s3 = ck.quantize_fp8_per_token(x, stream=stream)
    stream.synchronize()
    assert np.array_equal(cp.asnumpy(s3), es)


# ---- jax -------------------------------------------------------------------------------------------------------

def test_jax_both_directions(rng):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax without GPU")
    host = ref.random_activations(rng, 40, 384, ck.bfloat16.numpy)
    x = jnp.asarray(host)
    q, s = ck.quantize_fp8_per_token(x, scale_layout="rowmajor")  # jax -> us -> jax (row-major results)
    assert isinstance(s, jax.Array)
    s_j = jax.dlpack.from_dlpack(as_array(s))  # us -> jax
    eq, es = ref.quantize_per_token(host)
    assert np.array_equal(np.asarray(s_j), es) and np.array_equal(np.asarray(s), es)
    qh = q.numpy() if isinstance(q, DeviceArray) else np.asarray(q)  # (a jax without float8 DLPack: DeviceArray)
    assert np.array_equal(qh.view(np.uint8), eq.view(np.uint8))
    xb = jax.dlpack.from_dlpack(DeviceArray.from_numpy(host))
    assert np.array_equal(np.asarray(xb).view(np.uint16), host.view(np.uint16))
