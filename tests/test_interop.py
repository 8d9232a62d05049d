"""Interop on the CPU: DLPack parsing (numpy's capsules), our own capsule export, dtype and stream parsing."""
import ml_dtypes
import numpy as np
import pytest

import cudart_kernels as ck
from cudart_kernels.runtime import dtypes as dt
from cudart_kernels.runtime.driver import stream_handle
from cudart_kernels.runtime.interop import DeviceArray, HostArrayError, as_array, kDLCPU, parse_dlpack, require


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64])
def test_numpy_dlpack_capsule_is_parsed_and_refused_as_host(dtype):
    x = np.arange(24, dtype=dtype).reshape(4, 6)[:, 1:5]
    with pytest.raises(HostArrayError, match="host"):
        parse_dlpack(x.__dlpack__())
    with pytest.raises(HostArrayError, match="from_numpy"):
        as_array(x)


def test_host_array_rejected_by_op_before_launch():
    x = np.ones((4, 128), np.float32)
    with pytest.raises(HostArrayError):
        ck.quantize_fp8_per_token(x)


@pytest.mark.parametrize("versioned", [True, False])
@pytest.mark.parametrize("dtype", list(dt.ALL), ids=lambda d: d.name)
def test_export_capsule_round_trip(versioned, dtype):
    a = DeviceArray.from_pointer(0x7F0000001000, (3, 5), dtype, strides=(10, 2), device=0)
    cap = a.__dlpack__(stream=-1, max_version=(1, 0) if versioned else None)
    b = parse_dlpack(cap)
    assert (b.ptr, b.shape, b.strides, b.dtype, b.device) == (a.ptr, a.shape, a.strides, a.dtype, 0)
    del cap, b  # the capsule destructor releases the export registry entry
    from cudart_kernels.runtime import interop

    assert not interop._exports


def test_export_refuses_copy_and_other_device():
    a = DeviceArray.from_pointer(0x1000, (4,), "fp32")
    with pytest.raises(BufferError):
        a.__dlpack__(stream=-1, copy=True)
    with pytest.raises(BufferError):
        a.__dlpack__(stream=-1, dl_device=(kDLCPU, 0))
    assert a.__dlpack_device__() == (2, 0)


def test_cuda_array_interface_export():
    a = DeviceArray.from_pointer(0x2000, (3, 4), "fp32", strides=(8, 1))
    cai = a.__cuda_array_interface__
    assert cai["data"] == (0x2000, False) and cai["shape"] == (3, 4) and cai["strides"] == (32, 4)
    assert cai["typestr"] == "<f4" and cai["version"] == 3 and cai["stream"] == 1
    assert DeviceArray.from_pointer(0x2000, (3, 4), "fp32").__cuda_array_interface__["strides"] is None


def test_explicit_pointer_tuple():
    a = as_array((0x3000, (2, 8), None, "bf16"), stream=0)
    assert a.ptr == 0x3000 and a.strides == (8, 1) and a.dtype is dt.bfloat16


@pytest.mark.parametrize("name,want", [("bf16", dt.bfloat16), ("float8_e4m3", dt.float8_e4m3), ("fp32", dt.float32),
                                       (np.float16, dt.float16), (ml_dtypes.float8_e5m2, dt.float8_e5m2),
                                       ("torch.bfloat16", dt.bfloat16), ("int64", dt.int64)])
def test_dtype_aliases(name, want):
    assert dt.as_dtype(name) is want


def test_unknown_dtype():
    with pytest.raises(TypeError, match="unknown dtype"):
        dt.as_dtype("complex32")
    with pytest.raises(TypeError):
        dt.from_dlpack_code(5, 64)


class _ProtoStream:
    def __cuda_stream__(self):
        return (0, 0xABC)


class _TorchLike:
    cuda_stream = 0xDEF


def test_stream_forms():
    assert stream_handle(None) == 0
    assert stream_handle(7) == 7
    assert stream_handle(_ProtoStream()) == 0xABC
    assert stream_handle(_TorchLike()) == 0xDEF
    with pytest.raises(TypeError, match="stream"):
        stream_handle("default")
    with pytest.raises(ValueError):
        stream_handle(-3)


def test_require_messages():
    a = DeviceArray.from_pointer(0x1000, (4, 6), "bf16", strides=(6, 1))
    with pytest.raises(TypeError, match="x: dtype bfloat16 not supported"):
        require(a, "x", dtypes=(dt.float32,))
    with pytest.raises(ValueError, match="expected 3 dimensions"):
        require(a, "x", ndim=3)
    with pytest.raises(ValueError, match="stride of dimension 0 \\(12 bytes\\)"):
        require(a, "x")
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        require(DeviceArray.from_pointer(0x1000, (4, 8), "bf16", strides=(16, 2)), "x")
    with pytest.raises(ValueError, match="16-byte aligned"):
        require(DeviceArray.from_pointer(0x1008, (4, 8), "bf16"), "x")
    with pytest.raises(ValueError, match=r"expected shape \(4, 9\)"):
        require(DeviceArray.from_pointer(0x1000, (4, 8), "bf16"), "x", shape=(4, 9))
