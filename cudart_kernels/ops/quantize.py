"""FP8 (e4m3) quantization in DeepGEMM's recipe: 1x128 groups for activations, 128x128 blocks for weights.

scale = max(amax, 1e-4) / 448 and q = round_to_nearest_even(x * (448 / max(amax, 1e-4))), in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..runtime import dtypes as dt
from ..runtime.driver import enter_device, leave_device
from ..runtime.interop import call_arrays, require, same_device
from ..runtime.launch import get_launcher
from ..runtime.plans import PLANS

GROUP = 128
THREADS = 256  # -DTHREADS
UNROLL = 4     # -DUNROLL: 16-byte loads in flight per thread (per-token kernel)
_KIND = {dt.bfloat16: "KIND_BF16", dt.float16: "KIND_FP16", dt.float32: "KIND_FP32"}
_INPUTS = tuple(_KIND)
_ARGS = ("ptr", "i64", "ptr", "i64", "ptr", "i64", "i64", "i32", "i32")
_TOKEN_ARGS = _ARGS + ("i32",)


@dataclass(frozen=True)
class QuantTuning:
    max_grid_y: int = 65535  # per-token row blocks in the grid; beyond it blocks loop over row tiles (tests lower it)


TUNING = QuantTuning()
_MAX_ROWS = 65535 * GROUP  # per-block grid y (row blocks) <= 65535; per-token rows fit int32 too


def _vec(dtype) -> int:
    return 16 // dtype.itemsize


def token_grid(dtype, m: int, k: int, threads: int = THREADS, unroll: int = UNROLL, tuning: QuantTuning = TUNING):
    """Per-token launch shape: (grid, log2 of groups per block).

    A block spans gpb consecutive groups (a power of two up to `slots`) of (slots / gpb) * unroll rows. gpb is the
    one that leaves the fewest idle group slots in the last block column (K=7168: 56 groups -> 8 per block, not
    16 with half a column idle), preferring wider spans on ties; spans under 4 groups only when the row is short.
    """
    slots = threads // (GROUP // _vec(dtype))
    g = -(-k // GROUP)
    widest = min(slots.bit_length() - 1, max(0, (g - 1).bit_length()))
    narrowest = min(widest, 2)

    def idle(log2):
        return -(-g // (1 << log2)) * (1 << log2) - g

    log2_gpb = min(range(narrowest, widest + 1), key=lambda l2: (idle(l2) / g, -l2))
    rows = (slots >> log2_gpb) * unroll
    return (-(-g // (1 << log2_gpb)), max(1, min(-(-m // rows), tuning.max_grid_y)), 1), log2_gpb


def mmajor_stride(m: int) -> int:
    """Column stride of M-major scales: M rounded up to 4 floats, so each column starts 16-byte aligned (TMA)."""
    return (m + 3) // 4 * 4


def _defines(dtype):
    return {"IN_KIND": _KIND[dtype], "THREADS": THREADS, "UNROLL": UNROLL}


def variants():
    """Every kernel variant this module can launch: (source, entry, defines)."""
    return [("quantize.cu", e, _defines(d)) for d in _KIND for e in ("quantize_per_token", "quantize_per_block")]


def _check_input(xv, name):
    require(xv, name, dtypes=_INPUTS, ndim=2, row_align=0)
    m, k = xv.shape
    vec = _vec(xv.dtype)
    if k % vec:
        raise ValueError(f"{name}: K={k} must be a multiple of {vec} for {xv.dtype.name} input "
                         "(rows are read in 16-byte vectors)")
    require(xv, name, row_align=16)
    if m > _MAX_ROWS:
        raise ValueError(f"{name}: {m} rows is more than this kernel indexes ({_MAX_ROWS})")


def _scale_shape(kind, m, k):
    rows = 1 if kind == "token" else GROUP
    return (-(-m // rows), -(-k // GROUP))


def _plan(kind, name, xv, qv, sv, tuning: QuantTuning):
    """Validate one operand signature (done once per signature, then cached) and precompute the launch."""
    _check_input(xv, name)
    m, k = xv.shape
    vec = _vec(xv.dtype)
    require(qv, "out", dtypes=(dt.float8_e4m3,), ndim=2, shape=(m, k), align=vec, row_align=vec)
    shape_s = _scale_shape(kind, m, k)
    require(sv, "out_scales", dtypes=(dt.float32,), ndim=2, shape=shape_s, row_contiguous=False, align=4,
            row_align=0)
    if sv.size and any(st <= 0 for st, n in zip(sv.strides, sv.shape) if n > 1):
        raise ValueError(f"out_scales: strides must be positive, got {sv.strides}")
    same_device(**{name: xv}, out=qv, out_scales=sv)
    if kind == "token":
        grid, log2_gpb = token_grid(xv.dtype, m, k, tuning=tuning)
        launch = get_launcher("quantize.cu", "quantize_per_token", _defines(xv.dtype), xv.device, _TOKEN_ARGS,
                              (THREADS,))
        extra = (log2_gpb,)
    else:
        grid, extra = (shape_s[1], shape_s[0], 1), ()
        launch = get_launcher("quantize.cu", "quantize_per_block", _defines(xv.dtype), xv.device, _ARGS,
                              (THREADS,))
    args = (xv.strides[0] * xv.dtype.itemsize, qv.strides[0], sv.strides[0], sv.strides[1], m, k) + extra
    return (launch if m else None), grid, args


def _run(kind, name, x, out, out_scales, stream, layout="rowmajor", tuning=None):
    xv, qv, sv, h, native = call_arrays((x, out, out_scales), stream)
    if qv is None or sv is None:  # allocate through the input's framework: validate the input first
        _check_input(xv, name)
        m, k = xv.shape
        if qv is None:
            qv = native.empty((m, k), dt.float8_e4m3, xv.device, h, stream)
        if sv is None:
            strides = (1, mmajor_stride(m)) if layout == "mmajor" else None
            sv = native.empty(_scale_shape(kind, m, k), dt.float32, xv.device, h, stream, strides)
    key = ("quantize", kind, xv.shape, xv.strides, xv.dtype, xv.ptr & 15, xv.device, qv.shape, qv.strides,
           qv.dtype, qv.ptr & 15, qv.device, sv.shape, sv.strides, sv.dtype, sv.ptr & 15, sv.device, tuning)
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.add(key, _plan(kind, name, xv, qv, sv, tuning or TUNING))
    launch, grid, args = plan
    if launch is not None:
        caller = enter_device(xv.device)  # (the plan key holds the three arrays' devices: they are all on this one)
        try:
            launch(grid, h, xv.ptr, args[0], qv.ptr, args[1], sv.ptr, *args[2:])
        finally:
            leave_device(caller)
    return (native.result(qv) if out is None else out), (native.result(sv) if out_scales is None else out_scales)


def quantize_fp8_per_token(x, *, scale_layout: str = "mmajor", out=None, out_scales=None, stream=None,
                           tuning: QuantTuning | None = None):
    """Quantize activations `x` [M, K] (bf16, fp16 or fp32) to e4m3 with one fp32 scale per 1x128 group.

    Returns (q [M, K] e4m3, scales [M, ceil(K/128)] fp32). `scale_layout="mmajor"` (default) lays the scales out
    column by column with a column stride of M rounded up to 4 (the layout the FP8 GEMM's TMA loads); "rowmajor"
    gives a plain [M, G] array. `out` / `out_scales` may be given (any supported array type; `out_scales` may
    have any positive strides) and are then returned as passed. K must be a multiple of 16 bytes of input.
    Outputs not given are allocated in the input's framework (torch in, torch out; README: results and streams).
    Runs on `stream` (None: torch's or cupy's current stream for their arrays, else the legacy default stream; an
    int handle or any stream object).
    """
    if scale_layout not in ("mmajor", "rowmajor"):
        raise ValueError(f"scale_layout must be 'mmajor' or 'rowmajor', got {scale_layout!r}")
    return _run("token", "x", x, out, out_scales, stream, scale_layout, tuning)


def quantize_fp8_per_block(w, *, out=None, out_scales=None, stream=None):
    """Quantize weights `w` [N, K] (bf16, fp16 or fp32) to e4m3 with one fp32 scale per 128x128 block.

    Returns (q [N, K] e4m3, scales [ceil(N/128), ceil(K/128)] fp32, row-major unless `out_scales` says otherwise).
    """
    return _run("block", "w", w, out, out_scales, stream)
