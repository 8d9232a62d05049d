"""Host (numpy / ml_dtypes) references for the ops, used by the tests and `cudart-kernels selftest`.

The quantization references follow the kernels' fp32 arithmetic step by step, so results match bit for bit.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_MAX = np.float32(448.0)
_FLOOR = np.float32(1e-4)


def _quantize_tiles(x32: np.ndarray, rows: int, cols: int):
    """Quantize x32 [M, K] with one scale per rows x cols tile; returns (q e4m3 [M, K], scales [ceil, ceil])."""
    m, k = x32.shape
    gm, gk = -(-m // rows), -(-k // cols)
    padded = np.zeros((gm * rows, gk * cols), np.float32)
    padded[:m, :k] = x32
    tiles = padded.reshape(gm, rows, gk, cols)
    amax = np.maximum(np.abs(tiles).max(axis=(1, 3)), _FLOOR).astype(np.float32)
    inv = (_MAX / amax).astype(np.float32)
    q = (tiles * inv[:, None, :, None]).astype(np.float32).reshape(gm * rows, gk * cols)[:m, :k]
    return q.astype(E4M3), (amax / _MAX).astype(np.float32)


def quantize_per_token(x) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] (any float dtype) -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)])."""
    return _quantize_tiles(np.asarray(x).astype(np.float32), 1, 128)


def quantize_per_block(w) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] -> (e4m3 [N, K], fp32 scales [ceil(N/128), ceil(K/128)])."""
    return _quantize_tiles(np.asarray(w).astype(np.float32), 128, 128)


def random_activations(rng: np.random.Generator, m: int, k: int, dtype) -> np.ndarray:
    """Random rows with magnitudes spread over several decades, one all-zero group and tiny values included."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    x *= np.exp2(rng.integers(-12, 8, size=(m, 1))).astype(np.float32)
    if m > 1 and k >= 128:
        x[m // 2, :128] = 0.0  # exercises the all-zero guard
    if m > 2:
        x[1] *= np.float32(1e-6)  # fp8 subnormals after scaling
    return x.astype(np.dtype(dtype))
