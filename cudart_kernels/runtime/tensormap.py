"""TMA tensor maps over cuTensorMapEncodeTiled: the documented rules checked in Python first; encoded maps cached
per (role, layout, address), and re-pointable (cuTensorMapReplaceAddress) instead of re-encoded.

Dimension order follows the driver: index 0 is the innermost (contiguous) dimension.
"""
from __future__ import annotations

from cuda.bindings import driver as cu

from . import dtypes as dt
from .driver import check

_DTYPE = {
    dt.float32: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    dt.float16: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    dt.bfloat16: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    dt.float8_e4m3: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
    dt.float8_e5m2: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
    dt.int32: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_INT32,
    dt.int64: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_INT64,
}
_SWIZZLE = {
    0: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
    32: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
    64: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
    128: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
}
_L2 = {
    0: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
    64: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
    128: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
    256: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
}
_FILL = {
    "zero": cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    "nan": cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA,
}


def check_tensor_map(dtype, address: int, dims, strides, box, swizzle: int = 128,
                     element_strides=None, l2_promotion: int = 256, oob_fill: str = "zero") -> None:
    """Raise ValueError naming the broken cuTensorMapEncodeTiled rule, if any.

    dims: elements per dimension, innermost first. strides: bytes between consecutive entries of dimensions
    1..rank-1 (dimension 0 is contiguous). box: elements per dimension of the shared-memory box.
    """
    dtype = dt.as_dtype(dtype)
    rank = len(dims)
    if dtype not in _DTYPE:
        raise ValueError(f"tensor map: dtype {dtype} is not supported")
    if not 1 <= rank <= 5:
        raise ValueError(f"tensor map: rank must be 1..5, got {rank}")
    if len(strides) != rank - 1:
        raise ValueError(f"tensor map: need rank-1 = {rank - 1} strides (dims 1..), got {len(strides)}")
    if len(box) != rank:
        raise ValueError(f"tensor map: box needs {rank} entries, got {len(box)}")
    if address % 16:
        raise ValueError(f"tensor map: global address must be 16-byte aligned (got 0x{address:x})")
    for i, d in enumerate(dims):
        if not 1 <= d <= 2**32:
            raise ValueError(f"tensor map: dims[{i}]={d} must be in 1..2^32")
    for i, s in enumerate(strides):
        if s % 16:
            raise ValueError(f"tensor map: stride of dim {i + 1} = {s} bytes must be a multiple of 16")
        if not 0 < s < 2**40:
            raise ValueError(f"tensor map: stride of dim {i + 1} = {s} bytes must be in (0, 2^40)")
    for i, b in enumerate(box):
        if not 1 <= b <= 256:
            raise ValueError(f"tensor map: box[{i}]={b} must be in 1..256")
    inner = box[0] * dtype.itemsize
    if inner % 16:
        raise ValueError(f"tensor map: inner box extent {inner} bytes must be a multiple of 16")
    if swizzle not in _SWIZZLE:
        raise ValueError(f"tensor map: swizzle must be one of {sorted(_SWIZZLE)} bytes, got {swizzle}")
    if swizzle and inner > swizzle:
        raise ValueError(f"tensor map: inner box extent {inner} bytes exceeds the {swizzle}-byte swizzle span")
    for i, e in enumerate(element_strides or [1] * rank):
        if not 1 <= e <= 8:
            raise ValueError(f"tensor map: element_strides[{i}]={e} must be in 1..8")
    if l2_promotion not in _L2:
        raise ValueError(f"tensor map: l2_promotion must be one of {sorted(_L2)}")
    if oob_fill not in _FILL:
        raise ValueError("tensor map: oob_fill must be 'zero' or 'nan'")


class TensorMap:
    """One encoded CUtensorMap. `address` is the host address of its 128 bytes (what a Launcher copies)."""

    __slots__ = ("map", "address", "base")

    def __init__(self, tmap, base: int):
        self.map = tmap
        self.address = int(tmap.getPtr())
        self.base = base

    def repoint(self, base: int) -> None:
        if base != self.base:
            if base % 16:
                raise ValueError(f"tensor map: global address must be 16-byte aligned (got 0x{base:x})")
            check(cu.cuTensorMapReplaceAddress(self.map, base))
            self.base = base

    def bytes(self) -> bytes:
        import ctypes
        return ctypes.string_at(self.address, 128)


def encode_tensor_map(dtype, address: int, dims, strides, box, swizzle: int = 128, element_strides=None,
                      l2_promotion: int = 256, oob_fill: str = "zero") -> TensorMap:
    dtype = dt.as_dtype(dtype)
    check_tensor_map(dtype, address, dims, strides, box, swizzle, element_strides, l2_promotion, oob_fill)
    rank = len(dims)
    tmap = check(cu.cuTensorMapEncodeTiled(
        _DTYPE[dtype], rank, address,
        [cu.cuuint64_t(d) for d in dims],
        [cu.cuuint64_t(s) for s in strides],
        [cu.cuuint32_t(b) for b in box],
        [cu.cuuint32_t(e) for e in (element_strides or [1] * rank)],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        _SWIZZLE[swizzle], _L2[l2_promotion], _FILL[oob_fill]))
    return TensorMap(tmap, address)


class AddressedMapCache:
    """Encoded maps keyed by (layout object, base address): buffers that come back (rotating inputs, a training
    loop's reused allocations) hit the cache with no driver call. A layout is a plan's (dtype, dims, strides, box,
    swizzle[, L2 promotion]) tuple, found by identity: the hit costs one hash of two ints, and the entry keeps its
    layout alive, so the id is never reused while the entry stands. The oldest maps beyond `max_entries` are
    dropped. Keep one per thread, and never re-point a map it handed out."""

    def __init__(self, max_entries: int = 256):
        self._maps: dict = {}
        self._max = max_entries

    def get(self, layout: tuple, address: int) -> TensorMap:
        hit = self._maps.get((id(layout), address))
        if hit is not None and hit[0] is layout:
            return hit[1]
        while len(self._maps) >= self._max:
            del self._maps[next(iter(self._maps))]
        dtype, dims, strides, box, swizzle, *l2_promotion = layout  # optional sixth item: L2 promotion bytes
        m = encode_tensor_map(dtype, address, list(dims), list(strides), list(box), swizzle,
                              l2_promotion=l2_promotion[0] if l2_promotion else 256)
        self._maps[(id(layout), address)] = (layout, m)
        return m
