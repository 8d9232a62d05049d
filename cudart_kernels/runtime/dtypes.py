"""Element types the library understands, with their DLPack codes and host (numpy / ml_dtypes) twins."""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True, eq=False)
class DType:
    """One instance per type (the module's constants): equality and hashing are identity, cheap in plan keys."""
    name: str
    itemsize: int
    dlpack_code: int  # DLDataTypeCode (DLPack 1.1)
    numpy: np.dtype

    def __repr__(self) -> str:
        return f"cudart_kernels.{self.name}"

    def __reduce__(self):  # unpickles to the module's constant, keeping the one-instance rule
        return self.name


float32 = DType("float32", 4, 2, np.dtype(np.float32))
float16 = DType("float16", 2, 2, np.dtype(np.float16))
bfloat16 = DType("bfloat16", 2, 4, np.dtype(ml_dtypes.bfloat16))
float8_e4m3 = DType("float8_e4m3", 1, 10, np.dtype(ml_dtypes.float8_e4m3fn))
float8_e5m2 = DType("float8_e5m2", 1, 12, np.dtype(ml_dtypes.float8_e5m2))
int32 = DType("int32", 4, 0, np.dtype(np.int32))
int64 = DType("int64", 8, 0, np.dtype(np.int64))

ALL = (float32, float16, bfloat16, float8_e4m3, float8_e5m2, int32, int64)
_BY_DLPACK = {(d.dlpack_code, d.itemsize * 8): d for d in ALL}
_BY_NUMPY = {d.numpy: d for d in ALL}
_ALIASES = {
    "fp32": float32, "f32": float32, "float": float32,
    "fp16": float16, "f16": float16, "half": float16,
    "bf16": bfloat16,
    "e4m3": float8_e4m3, "fp8": float8_e4m3, "float8_e4m3fn": float8_e4m3,
    "e5m2": float8_e5m2,
}


def from_dlpack_code(code: int, bits: int, lanes: int = 1) -> DType:
    d = _BY_DLPACK.get((code, bits))
    if d is None or lanes != 1:
        raise TypeError(f"unsupported DLPack dtype (code={code}, bits={bits}, lanes={lanes})")
    return d


def as_dtype(x) -> DType:
    """Accept a DType, a name ('bf16', 'float8_e4m3', ...), a numpy dtype or an object with a .dtype name (torch)."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        x = x.rsplit(".", 1)[-1]  # 'torch.bfloat16' -> 'bfloat16'
        d = _ALIASES.get(x) or next((t for t in ALL if t.name == x), None)
        if d is None:
            raise TypeError(f"unknown dtype {x!r}")
        return d
    try:
        return _BY_NUMPY[np.dtype(x)]
    except (TypeError, KeyError):
        pass
    if type(x).__module__.split(".")[0] in ("torch", "jax", "jaxlib", "cupy"):  # framework dtype objects
        return as_dtype(str(x))
    raise TypeError(f"unsupported dtype {x!r}")
