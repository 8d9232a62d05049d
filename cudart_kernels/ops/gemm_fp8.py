"""FP8 block-scaled GEMM (the DeepGEMM recipe): D[bf16] = (A[e4m3] * sA) @ (B[e4m3] * sB)^T, with sA one fp32
scale per 1x128 group of A's rows ([M, ceil(K/128)]) and sB one per 128x128 block of B ([ceil(N/128), ceil(K/128)]),
exactly what `quantize_fp8_per_token` and `quantize_fp8_per_block` produce."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from ..runtime import dtypes as dt
from ..runtime.driver import DeviceProperties, device_properties, stream_handle
from ..runtime.interop import DeviceArray, as_array, require
from ..runtime.launch import get_launcher
from . import gemm as _gemm
from .quantize import mmajor_stride

BK = 128                 # k per stage: 128 e4m3 bytes, one scale block
MAX_BN = 192             # two fp32 accumulator sets (scratch and result) must fit the consumer's registers
MAX_STAGES = 12
ALIGN_SLACK = 1024
_ARGS = ("tmap", "tmap", "tmap", "tmap", "ptr", "i64", "i64", "i32", "i32", "i32", "i32")
_CONVERT_ARGS = ("ptr", "i64", "i64", "ptr", "i64", "i32", "i32")
_CONVERT_THREADS = 256


@dataclass(frozen=True)
class Fp8Config:
    bm: int
    bn: int
    stages: int
    smem: int                      # dynamic shared memory bytes, alignment slack included
    mcast: int = _gemm.MCAST_NONE  # 2-CTA pairs along M (sharing B) or along N (sharing A)
    group_m: int = 1               # cluster-tile rows per group of the tile order

    @property
    def threads(self) -> int:
        return 128 * (self.bm // 64 + 1)

    @property
    def cluster(self) -> int:
        return 2 if self.mcast else 1


def _chunk(bn: int) -> int:
    """bf16 output columns per epilogue chunk (ptx/gemm_fp8.cu CH)."""
    return 64 if bn % 64 == 0 else 32 if bn % 32 == 0 else 16


def smem_bytes(bm: int, bn: int, stages: int) -> int:
    """Mirror of ptx/gemm_fp8.cu's layout: A, B and sA stages, the output chunks from a 1024-byte boundary, two
    barriers per stage, alignment slack."""
    stages_end = stages * (bm * BK + bn * BK + bm * 4)
    d = -(-stages_end // 1024) * 1024
    return d + (bm // 64) * 2 * 64 * _chunk(bn) * 2 + 16 * stages + ALIGN_SLACK


def max_stages(bm: int, bn: int, budget: int) -> int:
    s = MAX_STAGES
    while s > 0 and smem_bytes(bm, bn, s) > budget:
        s -= 1
    return s


def pick_config(m: int, n: int, k: int, props: DeviceProperties) -> Fp8Config:
    """BM 64 for M <= 64 (one consumer warpgroup), else 128; BN a multiple of 16 up to MAX_BN (or N rounded up to
    16 when smaller) with the fewest waves, then the fullest last wave, then the widest; stages fill the shared
    memory budget; 2-CTA multicast and the tile order as for the BF16 GEMM."""
    bm = 64 if m <= 64 else 128
    budget = props.smem_per_block_optin
    top = min(MAX_BN, max(16, -(-n // 16) * 16))
    cands = [b for b in range(16, top + 1, 16) if max_stages(bm, b, budget) >= 3]
    bn = _gemm.fewest_waves_bn(m, n, bm, cands, props)
    stages = max_stages(bm, bn, budget)
    mcast = _gemm.pick_multicast(m, n, bm, bn, 1, False, props) if _gemm.MULTICAST else _gemm.MCAST_NONE
    return Fp8Config(bm, bn, stages, smem_bytes(bm, bn, stages), mcast,
                     _gemm.group_rows(m, n, bm, bn, mcast, props))


def _defines(cfg: Fp8Config) -> dict:
    d = {"BM": cfg.bm, "BN": cfg.bn, "STAGES": cfg.stages}
    if cfg.mcast:
        d["MCAST"] = cfg.mcast
    return d


BENCH_SHAPES = {
    "normal": [(m, n, k) for m in (64, 128, 4096)
               for n, k in ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048))],
}


def variants():
    """Every kernel variant the heuristic picks for the benchmark shapes."""
    from ..runtime.driver import H100

    seen = {}
    for m, n, k in BENCH_SHAPES["normal"]:
        cfg = pick_config(m, n, k, H100)
        d = _defines(cfg)
        seen[tuple(sorted(d.items()))] = ("gemm_fp8.cu", "gemm_fp8_kernel", d, cfg.smem)
    return list(seen.values()) + [("fp8_scales.cu", "scales_to_mmajor", {}, 0)]


_plans: dict = {}


class _ScaleBuffer:
    """M-major copy of row-major A scales, per (device, stream); grown on demand."""

    def __init__(self):
        self.buf = None

    def get(self, elems: int, device: int, stream) -> DeviceArray:
        if self.buf is None or self.buf.shape[0] < elems:
            self.buf = DeviceArray.empty((max(elems, 1 << 16),), dt.float32, device, stream)
        return self.buf


_scale_buffers: dict = {}
_buf_lock = threading.Lock()


@dataclass(frozen=True)
class _Plan:
    cfg: Fp8Config
    launch: object
    grid: tuple
    map_a: tuple
    map_b: tuple
    map_sa: tuple
    map_d: tuple
    convert: object  # launcher of the scale conversion, or None when sA is already M-major and TMA-aligned
    convert_grid: tuple


def _mmajor_ok(sv: DeviceArray, m: int) -> bool:
    """sA as [M, G] with unit stride along M, a column stride that keeps every column 16-byte aligned, and an
    aligned base: the kernel loads it with TMA as is."""
    g = sv.shape[1]
    return ((sv.strides[0] == 1 or m == 1) and (g == 1 or (sv.strides[1] >= m and sv.strides[1] % 4 == 0))
            and sv.ptr % 16 == 0)


def _validate(av, sav, bv, sbv, dv):
    require(av, "a", dtypes=(dt.float8_e4m3,), ndim=2)
    require(bv, "b", dtypes=(dt.float8_e4m3,), ndim=2)
    m, k = av.shape
    n, kb = bv.shape
    if kb != k:
        raise ValueError(f"a is [M, K] = {av.shape} but b is [N, K] = {bv.shape}: K differs")
    if k == 0:
        raise ValueError("K must be at least 1")
    groups = -(-k // 128)
    require(sav, "sa", dtypes=(dt.float32,), ndim=2, shape=(m, groups), row_contiguous=False, align=4,
            row_align=0)
    require(sbv, "sb", dtypes=(dt.float32,), ndim=2, shape=(-(-n // 128), groups), row_contiguous=False, align=4,
            row_align=0)
    if min(sav.strides) < 0 or min(sbv.strides) < 0:
        raise ValueError("sa and sb: strides must not be negative")
    require(dv, "out", dtypes=(dt.bfloat16,), ndim=2, shape=(m, n))
    for name, x in (("sa", sav), ("b", bv), ("sb", sbv), ("out", dv)):
        if x.device != av.device:
            raise ValueError(f"{name} is on cuda:{x.device} but a is on cuda:{av.device}")


def _plan(av, sav, bv, sbv, dv, props) -> _Plan:
    _validate(av, sav, bv, sbv, dv)
    m, k = av.shape
    n = bv.shape[0]
    cfg = pick_config(m, n, k, props)
    launch = get_launcher("gemm_fp8.cu", "gemm_fp8_kernel", _defines(cfg), av.device, _ARGS, (cfg.threads,),
                          cfg.smem, cluster=(cfg.cluster, 1, 1) if cfg.mcast else None)
    grid = _gemm.persistent_grid(launch, m, n, cfg.bm, cfg.bn, cfg.mcast, 1, cfg.smem, props)
    groups = -(-k // 128)
    a_rows = cfg.bm // 2 if cfg.mcast == _gemm.MCAST_SHARE_A else cfg.bm
    b_rows = cfg.bn // 2 if cfg.mcast == _gemm.MCAST_SHARE_B else cfg.bn
    map_a = (dt.float8_e4m3, (k, m), (av.strides[0],), (BK, a_rows), 128)
    map_b = (dt.float8_e4m3, (k, n), (bv.strides[0],), (BK, b_rows), 128)
    convert, convert_grid = None, ()
    if _mmajor_ok(sav, m):
        ld_sa = sav.strides[1] if groups > 1 else mmajor_stride(m)
    else:
        ld_sa = mmajor_stride(m)
        convert = get_launcher("fp8_scales.cu", "scales_to_mmajor", {}, av.device, _CONVERT_ARGS,
                               (_CONVERT_THREADS,))
        convert_grid = (-(-m * groups // _CONVERT_THREADS), 1, 1)
    map_sa = (dt.float32, (m, groups), (ld_sa * 4,), (cfg.bm, 1), 0)
    ch = _chunk(cfg.bn)
    map_d = (dt.bfloat16, (n, m), (dv.strides[0] * 2,), (ch, 64), ch * 2)
    return _Plan(cfg, launch, grid, map_a, map_b, map_sa, map_d, convert, convert_grid)


def gemm_fp8(a, sa, b, sb, out=None, *, stream=None):
    """D = (A * sA) @ (B * sB)^T in bf16.

    a: [M, K] e4m3, sa: [M, ceil(K/128)] fp32 (one scale per 1x128 group of a row), b: [N, K] e4m3, sb:
    [ceil(N/128), ceil(K/128)] fp32 (one scale per 128x128 block), out: [M, N] bf16 (allocated when None). K and N
    must keep rows 16-byte aligned (K % 16 == 0, N % 8 == 0); every M, N, K tail is handled in the kernel.

    sa is read in place when it is M-major with 16-byte aligned columns (`quantize_fp8_per_token`'s default
    layout: strides (1, ld) with ld >= M a multiple of 4). Any other layout (row-major, say) is first copied into
    that layout by a small kernel on the same stream: one extra launch and M x ceil(K/128) x 8 bytes of traffic.
    sb may have any strides. Runs on `stream`; returns `out`.
    """
    h = stream_handle(stream)
    av, sav, bv, sbv = (as_array(x, h) for x in (a, sa, b, sb))
    if out is None:
        require(av, "a", dtypes=(dt.float8_e4m3,), ndim=2)
        require(bv, "b", dtypes=(dt.float8_e4m3,), ndim=2)
        dv = DeviceArray.empty((av.shape[0], bv.shape[0]), dt.bfloat16, av.device, stream)
    else:
        dv = as_array(out, h)
    key = tuple((x.shape, x.strides, x.dtype, x.ptr & 15, x.device) for x in (av, sav, bv, sbv, dv))
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) > 1024:
            _plans.clear()
        _validate(av, sav, bv, sbv, dv)
        if dv.shape[0] == 0 or dv.shape[1] == 0:
            return dv if out is None else out
        plan = _plans[key] = _plan(av, sav, bv, sbv, dv, device_properties(av.device))
    m, k = av.shape
    n = bv.shape[0]
    sa_ptr = sav.ptr
    if plan.convert is not None:
        groups = -(-k // 128)
        ld = mmajor_stride(m)
        with _buf_lock:
            sb_buf = _scale_buffers.setdefault((av.device, h), _ScaleBuffer())
        buf = sb_buf.get(ld * groups, av.device, stream)
        plan.convert(plan.convert_grid, h, sav.ptr, sav.strides[0], sav.strides[1], buf.ptr, ld, m, groups)
        sa_ptr = buf.ptr
    maps = _gemm._local.maps  # the GEMM module's per-thread tensor-map cache
    plan.launch(plan.grid, h, maps.get("a8", plan.map_a, av.ptr), maps.get("b8", plan.map_b, bv.ptr),
                maps.get("sa", plan.map_sa, sa_ptr), maps.get("d8", plan.map_d, dv.ptr), sbv.ptr,
                sbv.strides[0], sbv.strides[1], m, n, k, plan.cfg.group_m)
    return dv if out is None else out
