"""FP8 (e4m3) quantization in DeepGEMM's recipe: 1x128 groups for activations, 128x128 blocks for weights.

scale = max(amax, 1e-4) / 448 and q = round_to_nearest_even(x * (448 / max(amax, 1e-4))), in fp32.
"""
from __future__ import annotations

from ..runtime import dtypes as dt
from ..runtime.driver import stream_handle
from ..runtime.interop import DeviceArray, as_array, require
from ..runtime.launch import get_launcher

GROUP = 128
THREADS = 256
UNROLL = 4  # matches ptx/quantize.cu
_KIND = {dt.bfloat16: "KIND_BF16", dt.float16: "KIND_FP16", dt.float32: "KIND_FP32"}
_INPUTS = tuple(_KIND)
_ARGS = ("ptr", "i64", "ptr", "i64", "ptr", "i64", "i64", "i32", "i32")
_MAX_GRID_Y = 65535


def _vec(dtype) -> int:
    return 16 // dtype.itemsize


def rows_per_block(dtype) -> int:
    """Rows one per-token block covers: (THREADS / threads-per-group) * UNROLL."""
    return THREADS // (GROUP // _vec(dtype)) * UNROLL


def mmajor_stride(m: int) -> int:
    """Column stride of M-major scales: M rounded up to 4 floats, so each column starts 16-byte aligned (TMA)."""
    return (m + 3) // 4 * 4


def variants():
    """Every kernel variant this module can launch: (source, entry, defines)."""
    return [("quantize.cu", e, {"IN_KIND": k}) for k in _KIND.values()
            for e in ("quantize_per_token", "quantize_per_block")]


def _check_input(x, h, name="x"):
    xv = require(as_array(x, h), name, dtypes=_INPUTS, ndim=2, row_align=0)
    k = xv.shape[1]
    vec = _vec(xv.dtype)
    if k % vec:
        raise ValueError(f"{name}: K={k} must be a multiple of {vec} for {xv.dtype.name} input "
                         "(rows are read in 16-byte vectors)")
    require(xv, name, row_align=16)
    if (k + GROUP - 1) // GROUP > _MAX_GRID_Y:
        raise ValueError(f"{name}: K={k} too large (at most {_MAX_GRID_Y * GROUP})")
    return xv


def _q_out(out, shape, xv, h, name="out"):
    if out is None:
        return DeviceArray.empty(shape, dt.float8_e4m3, xv.device, h), None
    ov = require(as_array(out, h), name, dtypes=(dt.float8_e4m3,), ndim=2, shape=shape,
                 align=_vec(xv.dtype), row_align=_vec(xv.dtype))
    if ov.device != xv.device:
        raise ValueError(f"{name} is on cuda:{ov.device} but x is on cuda:{xv.device}")
    return ov, out


def _scales_out(out_scales, shape, xv, h, layout="rowmajor"):
    if out_scales is None:
        if layout == "mmajor":
            sv = DeviceArray.empty_strided(shape, (1, mmajor_stride(shape[0])), dt.float32, xv.device, h)
        else:
            sv = DeviceArray.empty(shape, dt.float32, xv.device, h)
        return sv, None
    sv = require(as_array(out_scales, h), "out_scales", dtypes=(dt.float32,), ndim=2, shape=shape,
                 row_contiguous=False, align=4, row_align=0)
    if any(s <= 0 for s, n in zip(sv.strides, sv.shape) if n > 1):
        raise ValueError(f"out_scales: strides must be positive, got {sv.strides}")
    if sv.device != xv.device:
        raise ValueError(f"out_scales is on cuda:{sv.device} but x is on cuda:{xv.device}")
    return sv, out_scales


def quantize_fp8_per_token(x, *, scale_layout: str = "mmajor", out=None, out_scales=None, stream=None):
    """Quantize activations `x` [M, K] (bf16, fp16 or fp32) to e4m3 with one fp32 scale per 1x128 group.

    Returns (q [M, K] e4m3, scales [M, ceil(K/128)] fp32). `scale_layout="mmajor"` (default) lays the scales out
    column by column with a column stride of M rounded up to 4 (the layout the FP8 GEMM's TMA loads); "rowmajor"
    gives a plain [M, G] array. `out` / `out_scales` may be given (any supported array type; `out_scales` may
    have any positive strides) and are then returned as passed. K must be a multiple of 16 bytes of input.
    """
    if scale_layout not in ("mmajor", "rowmajor"):
        raise ValueError(f"scale_layout must be 'mmajor' or 'rowmajor', got {scale_layout!r}")
    h = stream_handle(stream)
    xv = _check_input(x, h)
    m, k = xv.shape
    g = (k + GROUP - 1) // GROUP
    qv, q_user = _q_out(out, (m, k), xv, h)
    sv, s_user = _scales_out(out_scales, (m, g), xv, h, scale_layout)
    if m:
        launch = get_launcher("quantize.cu", "quantize_per_token", {"IN_KIND": _KIND[xv.dtype]}, xv.device,
                              _ARGS, (THREADS,))
        rows = rows_per_block(xv.dtype)
        launch(((m + rows - 1) // rows, g, 1), h,
               xv.ptr, xv.strides[0] * xv.dtype.itemsize, qv.ptr, qv.strides[0],
               sv.ptr, sv.strides[0], sv.strides[1], m, k)
    return (qv if q_user is None else q_user), (sv if s_user is None else s_user)


def quantize_fp8_per_block(w, *, out=None, out_scales=None, stream=None):
    """Quantize weights `w` [N, K] (bf16, fp16 or fp32) to e4m3 with one fp32 scale per 128x128 block.

    Returns (q [N, K] e4m3, scales [ceil(N/128), ceil(K/128)] fp32, row-major unless `out_scales` says otherwise).
    """
    h = stream_handle(stream)
    wv = _check_input(w, h, "w")
    n, k = wv.shape
    shape_s = ((n + GROUP - 1) // GROUP, (k + GROUP - 1) // GROUP)
    qv, q_user = _q_out(out, (n, k), wv, h)
    sv, s_user = _scales_out(out_scales, shape_s, wv, h)
    if n:
        launch = get_launcher("quantize.cu", "quantize_per_block", {"IN_KIND": _KIND[wv.dtype]}, wv.device,
                              _ARGS, (THREADS,))
        launch((shape_s[0], shape_s[1], 1), h,
               wv.ptr, wv.strides[0] * wv.dtype.itemsize, qv.ptr, qv.strides[0],
               sv.ptr, sv.strides[0], sv.strides[1], n, k)
    return (qv if q_user is None else q_user), (sv if s_user is None else s_user)
