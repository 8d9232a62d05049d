"""BF16/FP16 GEMM on Hopper: D = A @ B^T with A [M, K], B [N, K] (16-bit), fp32 accumulation, D bf16/fp16/fp32.

Work in progress (issue 3): the persistent warp-specialised TMA + wgmma kernel for K-major B. Split-K, B as
[K, N] (b_layout="kn") and C / accumulate-into-D come next; asking for them raises NotImplementedError.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from ..runtime import dtypes as dt
from ..runtime.driver import DeviceProperties, device_properties, stream_handle
from ..runtime.interop import DeviceArray, as_array, require
from ..runtime.launch import get_launcher
from ..runtime.tensormap import TensorMapCache

BK = 64                      # k elements per pipeline stage (128 bytes: one 128-byte swizzle span)
ALIGN_SLACK = 1024           # the kernel aligns its dynamic shared memory to 1024 bytes
_KIND = {dt.bfloat16: "KIND_BF16", dt.float16: "KIND_FP16", dt.float32: "KIND_FP32"}
_INPUTS = (dt.bfloat16, dt.float16)
_OUTPUTS = (dt.bfloat16, dt.float16, dt.float32)
_ARGS = ("tmap", "tmap", "tmap", "i32", "i32", "i32")
MAX_STAGES = 8


@dataclass(frozen=True)
class GemmConfig:
    bm: int
    bn: int
    stages: int
    smem: int  # dynamic shared memory bytes, alignment slack included

    @property
    def threads(self) -> int:
        return 128 * (self.bm // 64 + 1)


def smem_bytes(bm: int, bn: int, stages: int, out_bytes: int) -> int:
    """Mirror of ptx/gemm.cu's layout: A and B stages, the output tile, 2 barriers per stage, alignment slack."""
    return stages * (bm + bn) * BK * 2 + bm * bn * out_bytes + 16 * stages + ALIGN_SLACK


def max_stages(bm: int, bn: int, out_bytes: int, budget: int) -> int:
    fixed = bm * bn * out_bytes + ALIGN_SLACK
    per_stage = (bm + bn) * BK * 2 + 16
    return min(MAX_STAGES, (budget - fixed) // per_stage)


def pick_config(m: int, n: int, k: int, out_bytes: int, props: DeviceProperties) -> GemmConfig:
    """Block shape by wave count and last-wave utilisation (the DeepGEMM approach), stages from the smem budget.

    BM is 64 for M <= 64 (one consumer warpgroup), else 128. BN runs over multiples of 16 up to 256 (and N itself,
    rounded up to 8, when N is small); fewer waves win, then a fuller last wave, then the larger tile.
    """
    bm = 64 if m <= 64 else 128
    tiles_m = -(-m // bm)
    candidates = set(range(16, 257, 16))
    if n <= 256:
        candidates.add(-(-n // 8) * 8)
    best = None
    for bn in sorted(candidates):
        if bn > 8 * -(-n // 8) and bn != 16:
            continue  # wider than N (rounded up to 8) only wastes work
        if max_stages(bm, bn, out_bytes, props.smem_per_block_optin) < 2:
            continue
        tiles = tiles_m * -(-n // bn)
        waves = -(-tiles // props.sm_count)
        last = tiles - (waves - 1) * props.sm_count
        key = (waves, -last / props.sm_count, -bn)
        if best is None or key < best[0]:
            best = (key, bn)
    bn = best[1]
    stages = max_stages(bm, bn, out_bytes, props.smem_per_block_optin)
    return GemmConfig(bm, bn, stages, smem_bytes(bm, bn, stages, out_bytes))


def _defines(in_dtype, out_dtype, cfg: GemmConfig) -> dict:
    return {"IN_KIND": _KIND[in_dtype], "OUT_KIND": _KIND[out_dtype], "BM": cfg.bm, "BN": cfg.bn,
            "STAGES": cfg.stages}


BENCH_SHAPES = {
    "large": [(8192, 8192, 8192), (4096, 7168, 16384), (4096, 4096, 7168), (4096, 2112, 7168),
              (4096, 24576, 1536), (4096, 7168, 2048), (4096, 32768, 512)],
    "skinny": [(16, 1280, 8192), (16, 4096, 8192), (64, 7168, 16384), (128, 128, 65536), (256, 256, 32768),
               (128, 2048, 28672), (512, 512, 65536), (1024, 1024, 65536), (2048, 2048, 32768)],
}


def variants():
    """Every kernel variant the heuristic picks for the benchmark shapes (bf16 in; bf16 and fp32 out)."""
    from ..runtime.driver import H100

    seen = {}
    for shapes in BENCH_SHAPES.values():
        for m, n, k in shapes:
            for out in (dt.bfloat16, dt.float32):
                cfg = pick_config(m, n, k, out.itemsize, H100)
                d = _defines(dt.bfloat16, out, cfg)
                seen[tuple(sorted(d.items()))] = ("gemm.cu", "gemm_kernel", d, cfg.smem)
    return list(seen.values())


class _Maps(threading.local):
    def __init__(self):
        self.cache = TensorMapCache()


_maps = _Maps()
_plans: dict = {}


def _plan(av, bv, dv, props):
    m, k = av.shape
    n = bv.shape[0]
    cfg = pick_config(m, n, k, dv.dtype.itemsize, props)
    launch = get_launcher("gemm.cu", "gemm_kernel", _defines(av.dtype, dv.dtype, cfg), av.device, _ARGS,
                          (cfg.threads,), cfg.smem)
    tiles = -(-m // cfg.bm) * -(-n // cfg.bn)
    grid = (max(1, min(tiles, props.sm_count)), 1, 1)
    return cfg, launch, grid


def gemm(a, b, out=None, c=None, *, b_layout: str = "nk", split_k=None, deterministic: bool = False,
         out_dtype=None, stream=None):
    """D = A @ B^T: A [M, K], B [N, K], both bf16 or both fp16; D [M, N] in `out`'s dtype (or `out_dtype`, default
    the input dtype). Rows must be 16-byte aligned (K and N multiples of 8 for 16-bit data, N a multiple of 4
    for fp32 D); every M, N, K tail is handled by the kernel. Returns `out` (allocated when None)."""
    if b_layout != "nk":
        raise NotImplementedError("b_layout='kn' is not implemented yet (issue 3 in progress)")
    if c is not None or split_k not in (None, 1) or deterministic:
        raise NotImplementedError("c=, split_k and deterministic are not implemented yet (issue 3 in progress)")
    h = stream_handle(stream)
    av = require(as_array(a, h), "a", dtypes=_INPUTS, ndim=2)
    bv = require(as_array(b, h), "b", dtypes=_INPUTS, ndim=2)
    if bv.dtype is not av.dtype:
        raise TypeError(f"a and b must have the same dtype, got {av.dtype.name} and {bv.dtype.name}")
    m, k = av.shape
    n, kb = bv.shape
    if kb != k:
        raise ValueError(f"a is [M, K] = {av.shape} but b is [N, K] = {bv.shape}: K differs")
    if bv.device != av.device:
        raise ValueError(f"a is on cuda:{av.device} but b is on cuda:{bv.device}")
    if out is None:
        od = dt.as_dtype(out_dtype) if out_dtype is not None else av.dtype
        if od not in _OUTPUTS:
            raise TypeError(f"out_dtype {od.name} not supported (bfloat16, float16, float32)")
        dv = DeviceArray.empty((m, n), od, av.device, stream)
    else:
        dv = as_array(out, h)
    require(dv, "out", dtypes=_OUTPUTS, ndim=2, shape=(m, n))
    if dv.device != av.device:
        raise ValueError(f"out is on cuda:{dv.device} but a is on cuda:{av.device}")
    if m == 0 or n == 0:
        return dv if out is None else out
    if k == 0:
        raise ValueError("K must be at least 1")
    key = (av.shape, av.strides, av.dtype, bv.shape, bv.strides, dv.shape, dv.strides, dv.dtype, av.device)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) > 1024:
            _plans.clear()
        plan = _plans[key] = _plan(av, bv, dv, device_properties(av.device))
    cfg, launch, grid = plan
    maps = _maps.cache
    it = av.dtype.itemsize
    tm_a = maps.get(av.dtype, av.ptr, [k, m], [av.strides[0] * it], [BK, cfg.bm], 128)
    tm_b = maps.get(bv.dtype, bv.ptr, [k, n], [bv.strides[0] * it], [BK, cfg.bn], 128)
    tm_d = maps.get(dv.dtype, dv.ptr, [n, m], [dv.strides[0] * dv.dtype.itemsize], [cfg.bn, 64], 0)
    launch(grid, h, tm_a, tm_b, tm_d, m, n, k)
    return dv if out is None else out
