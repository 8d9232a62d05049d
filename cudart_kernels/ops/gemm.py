"""BF16/FP16 GEMM on Hopper: D = A @ B^T (+ C) with A [M, K] and B [N, K] (or D = A @ B with B [K, N]), 16-bit
inputs, fp32 accumulation, D bf16, fp16 or fp32; split-K through TMA reduce-add; D += A @ B^T in place for an
fp32 D."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..runtime import dtypes as dt
from ..runtime.driver import DeviceProperties, device_properties, enter_device, leave_device
from ..runtime.interop import DeviceArray, call_arrays, require, same_device
from ..runtime.launch import ArgsMemo, get_launcher
from ..runtime.plans import PLANS
from ..runtime.scratch import SCRATCH
from . import sm90
from .sm90 import MCAST_NONE, MCAST_SHARE_A, MCAST_SHARE_B, MapLayout

BK = 64                      # k elements per pipeline stage (128 bytes: one 128-byte swizzle span)
ALIGN_SLACK = 1024           # the kernel aligns its dynamic shared memory to 1024 bytes
MAX_STAGES = 16
_KIND = {dt.bfloat16: "KIND_BF16", dt.float16: "KIND_FP16", dt.float32: "KIND_FP32"}
_INPUTS = (dt.bfloat16, dt.float16)
_OUTPUTS = (dt.bfloat16, dt.float16, dt.float32)
_ARGS = ("tmap", "tmap", "tmap", "tmap", "tmap", "ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "i32", "i32",
         "i32", "i32", "i32")
_DECODE_ARGS = ("ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "i64", "i32", "i32", "i32")


@dataclass(frozen=True)
class GemmTuning(sm90.Sm90Tuning):
    """The BF16/FP16 GEMM's heuristic constants (docs/tuning.md: what each controls, how it was fitted). Pass one
    to `gemm(tuning=...)` or the pick functions to try others; plans are cached per tuning object."""
    min_split_stages: int = 3        # split-K configs keep at least this many stages
    min_kblocks_per_split: int = 4   # 256 k elements: below this a partial's reduce costs more than its math
    max_splits: int = 128
    # M <= 64 (one consumer, B streamed once): no split where the unsplit tiles are narrow_min_bn or more columns
    # wide and busy split_below_fill of the SMs (the A boxes load only M's rows, so such a grid streams B faster).
    split_below_fill: float = 0.7
    narrow_min_bn: int = 32
    # Split-K model: microseconds one CTA spends per 64-deep k block of a BM x BN tile, (BN, us) points per BM;
    # 192-row tiles cost 1.5x the 128-row ones (the tensor work).
    kb_us: tuple = ((64, ((16, .181), (32, .185), (48, .190), (64, .205), (96, .185), (128, .206), (192, .278),
                          (256, .353))),
                    (128, ((16, .194), (32, .206), (48, .237), (64, .302), (96, .357), (128, .405), (192, .547),
                           (256, .675))))
    stream_efficiency: float = 0.917    # achieved / copy rate when streaming operands (0.82 of the H100's peak)
    dram_latency_us: float = 4.0        # a stage's load under load when B streams from DRAM once (M <= BM)
    partial_bytes_per_s: float = 2e12   # fp32 partials reduce-added in L2
    finish_us_per_32_cols: float = 0.17  # the last split's finalisation, per 32 columns of a 64-row slice
    # What else a split-K call costs (turnstile, count, the finish's wait), charged only where a split pick meets
    # the one-wave unsplit alternative (`unsplit_wave`): every split candidate pays it alike.
    split_fixed_us: float = 2.0
    full_grid: float = 0.9              # a grid of units this share of the SMs counts as full
    wave_fill: float = 0.8              # unsplit_wave: a wave on this share competes where none reaches full_grid
    close: float = 1.05                 # estimates this close to the best: widest tile, then most units
    split_rows_share: float = 1.4       # ... of those loading at most this x the fewest operand rows (`choose_split`)
    paired_factor: float = 0.95         # split candidates that pair tiles count at this share of their estimate
    split_bm64_max_m: int = 128         # split-K up to this M searches 64-row tiles
    quad_clusters_share: float = 0.85   # ... and at M 193..256 in clusters of four sharing B, up to this share (quad_split)
    # Swapped operands (`swap_candidate`): D^T = B A^T, so that M runs over the tile's columns (steps of 8, not
    # 64), unsplit or (where the unswapped pick is unsplit) split-K. For 16-bit D (B as [N, K] or [K, N]), no
    # forced split count, M in swap_min_m..swap_max_m and K >= swap_min_k, where its best estimate is below
    # swap_share of the pick's (both priced by `busy_kblock_us`).
    swap_ab: bool = True
    swap_min_m: int = 129
    swap_max_m: int = 1024
    swap_min_k: int = 2048
    swap_min_bn: int = 64
    swap_share: float = 1.0
    swap_quads: bool = True             # B shared by four swapped tiles where they fit (`swap_multicasts`)
    # `busy_kblock_us`: an unsplit tile's k block where every SM works costs area_kb_us per output element (the
    # tensor rate the grid sustains) or, for 128 rows and more, row_kb_us per operand row the CTA loads (a pair's
    # shared operand counts half), whichever is more; a lone partial wave scales it by (1 - lone_wave_gain) +
    # lone_wave_gain x its share of the SMs (less contention for L2 and DRAM).
    area_kb_us: float = 2.6e-5
    row_kb_us: float = 2e-3
    # Rows not 128-byte aligned (`sm90.rows_misaligned`) span two L2 lines per box row: a 64-row tile's loads then
    # cost this many times as much in `busy_kblock_us` (H200, 2026-11-29: 64 x 256 tiles 2.4x the time of the
    # aligned view's, 128 x 224 tiles unpaired 1.6x; pricing 128-row and wider tiles so too lost on the swap).
    misaligned_row_cost: float = 1.8
    lone_wave_gain: float = 0.3
    bm192_max_bn: int = 192             # three consumers get 152 registers each
    bm192_split_max_bn: int = 160
    bm256_max_bn: int = 112             # four consumers get 104 registers each (unsplit, stored: swapped only)
    # Unsplit tiles where M > 128 is not a multiple of 128 (`ragged_pick`): the last row of tiles has consumers
    # whose rows are all past M, which skip their wgmma. A 192-row tile's k block costs tall_kb_share x 1.5 x a
    # 128-row one's (the per-flop rate of three consumers), and a 128-row tile with one consumer's rows
    # lone_consumer_share of a whole one (it runs without the other's groups to overlap).
    tall_kb_share: float = 0.9
    lone_consumer_share: float = 0.8
    # Decode-shaped GEMMs (ptx/gemm_decode.cu): M <= decode_max_m, B as [N, K], split_k left to the heuristic,
    # K >= decode_min_k, A (read by every CTA) at most decode_max_a_bytes, 16-row CTAs busy between
    # decode_min_fill and decode_max_fill of the SMs.
    decode: bool = True
    decode_max_m: int = 16
    decode_min_k: int = 4096
    decode_min_fill: float = 0.6
    decode_max_fill: float = 1.0
    decode_max_a_bytes: int = 128 << 10
    force_config: object = None  # calibration and tests: a GemmConfig every wgmma-kernel call runs
    kb_us_table: dict = field(init=False, repr=False, compare=False, hash=False, default=None)

    def __post_init__(self):
        table = {bm: pts for bm, pts in self.kb_us}
        table.setdefault(192, tuple((bn, 1.5 * us) for bn, us in table[128]))
        object.__setattr__(self, "kb_us_table", table)


TUNING = GemmTuning()


@dataclass(frozen=True)
class DecodeConfig:
    g: int          # groups of 8 rows of B per CTA
    warps: int      # warps per CTA, splitting K
    depth: int = 2  # k steps (64 deep) each warp keeps in flight (3 or 4 measured no faster; more registers)

    @property
    def threads(self) -> int:
        return 32 * self.warps


def pick_decode(m: int, n: int, k: int, props: DeviceProperties, split_k=None, b_kn: bool = False,
                tuning: GemmTuning = TUNING):
    """The decode kernel's config (ptx/gemm_decode.cu: each CTA streams 8 * G rows of B over the whole of K with
    mma.sync, its warps splitting K; no split-K scratch), or None where the wgmma kernel is the better (or the
    only) choice (`GemmTuning.decode_*`: within them it is always 16-row CTAs of 16 warps). Past decode_max_fill
    (tests lift it): 32-row CTAs once they cover full_grid of the SMs, else 16-row; 16 warps while the grid fits
    one CTA per SM, else 8 (two fit per SM). H100: 16x4096x8192 G4 x 16 warps 26.9 us, G2 x 8 28.0, G8 x 8 32.8;
    16x1280x8192 G2 x 16 11.7, G4 x 16 15.7, G1 x 16 17.3."""
    t = tuning
    if (not t.decode or m > t.decode_max_m or b_kn or split_k is not None or k < t.decode_min_k
            or 2 * m * k > t.decode_max_a_bytes
            or not t.decode_min_fill * props.sm_count <= -(-n // 16) <= t.decode_max_fill * props.sm_count):
        return None
    g = 4 if -(-n // 32) >= t.full_grid * props.sm_count else 2
    return DecodeConfig(g, 16 if -(-n // (8 * g)) <= props.sm_count else 8)


def _decode_defines(in_dtype, out_dtype, cfg: DecodeConfig, c_dtype=None) -> dict:
    d = {"IN_KIND": _KIND[in_dtype], "OUT_KIND": _KIND[out_dtype], "G": cfg.g, "WARPS": cfg.warps,
         "DEPTH": cfg.depth}
    if c_dtype is not None:
        d["C_KIND"] = _KIND[c_dtype]
    return d


@dataclass(frozen=True)
class GemmConfig:
    bm: int
    bn: int
    stages: int
    splits: int
    smem: int  # dynamic shared memory bytes, alignment slack included
    mcast: int = MCAST_NONE  # clusters of tiles along M sharing B (2 or 4 CTAs) or along N sharing A (sm90.MCAST_*)
    group_m: int = 1         # cluster-tile rows per group of the tile order
    stream_b: bool = False   # B loaded with an evict-first L2 policy (sm90.streams_b)
    warm_l2: bool = False    # B's (swapped: A's) first k block into L2 before pdl_wait (L2_WARM)
    swap_ab: bool = False    # D^T = B A^T (TRANS_OUT): the tile's BM rows run over N, its BN columns over M

    @property
    def threads(self) -> int:
        return 128 * (self.bm // 64 + 1)

    @property
    def cluster(self) -> int:
        return sm90.cluster_ctas(self.mcast)


def epilogue_chunk(bn: int, epi_bytes: int) -> int:
    """Columns per epilogue chunk (ptx/gemm.cu CH): the largest power of two dividing BN whose row is at most
    128 bytes (one swizzle span)."""
    return next(c for c in (64, 32, 16, 8) if bn % c == 0 and c * epi_bytes <= 128)


def epilogue_swizzle(bn: int, epi_bytes: int) -> int:
    """The output map's swizzle span: one chunk row (no swizzle below 32 bytes)."""
    row = epilogue_chunk(bn, epi_bytes) * epi_bytes
    return row if row >= 32 else 0


def stage_bytes(bm: int, bn: int, b_kn: bool = False) -> int:
    """One pipeline stage: the A tile and the B tile (B as [K, N] comes in 64-column panels)."""
    b_cols = -(-bn // 64) * 64 if b_kn else bn
    return (bm + b_cols) * BK * 2


def smem_bytes(bm: int, bn: int, stages: int, epi_bytes: int, b_kn: bool = False) -> int:
    """Mirror of ptx/gemm.cu's layout: A and B stages, two 64 x CH output chunks per consumer, 2 barriers per
    stage, flags, alignment slack."""
    return (stages * stage_bytes(bm, bn, b_kn) + bm * 2 * epilogue_chunk(bn, epi_bytes) * epi_bytes + 16 * stages
            + 16 + ALIGN_SLACK)


def max_stages(bm: int, bn: int, epi_bytes: int, budget: int, b_kn: bool = False) -> int:
    fixed = bm * 2 * epilogue_chunk(bn, epi_bytes) * epi_bytes + 16 + ALIGN_SLACK
    per_stage = stage_bytes(bm, bn, b_kn) + 16
    return min(MAX_STAGES, (budget - fixed) // per_stage)


def _bn_candidates(n: int) -> list[int]:
    cands = set(range(16, 257, 16))
    if n <= 256:
        cands.add(-(-n // 8) * 8)
    return sorted(b for b in cands if b <= max(16, 8 * -(-n // 8)))


def _whole_panels(widths: list[int], n: int, bm: int, b_kn: bool) -> list[int]:
    """The widths of 64-row tiles whose B is whole 64-column panels (or all of N) where B is [K, N]: a panel is
    loaded whole, so a 64 x 80 tile loads 128 columns of B (1.2-1.7x the time of the same tile over [N, K],
    H200, 2026-11-29). Taller tiles spread B over more rows."""
    return [b for b in widths if b % 64 == 0 or b >= n] if b_kn and bm == 64 else widths


def _split_bn_candidates(n: int, tuning: GemmTuning) -> list[int]:
    """BN values the split model was fitted on (and N itself, rounded up to 8, when N is smaller)."""
    fitted = [b for b, _ in tuning.kb_us_table[64]]
    cands = {b for b in fitted if b < n} | ({-(-n // 8) * 8} if n <= 256 else {256})
    return sorted(cands)


def kblock_us(bm: int, bn: int, tuning: GemmTuning = TUNING) -> float:
    """Microseconds per k block of one BM x BN unit (linear between the fitted BN points)."""
    pts = tuning.kb_us_table[bm]
    if bn <= pts[0][0]:
        return pts[0][1]
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if bn <= b1:
            return t0 + (t1 - t0) * (bn - b0) / (b1 - b0)
    return pts[-1][1] * bn / pts[-1][0]


def split_time_us(m: int, n: int, k: int, bm: int, bn: int, splits: int, props: DeviceProperties,
                  tuning: GemmTuning = TUNING) -> float:
    """Estimated microseconds for a config: waves of units, each streaming its k blocks (or the whole operand
    traffic at DRAM speed, when that is slower), plus the split-K partials and the last split's finalisation."""
    tiles = -(-m // bm) * -(-n // bn)
    waves = -(-tiles * splits // props.sm_count)
    kb_per_unit = -(-(-(-k // BK)) // splits)
    per_kb = kblock_us(bm, bn, tuning)
    if m <= bm < 192:  # nothing is re-read from L2: every stage waits on DRAM (192 rows: measured without it)
        stages = max_stages(bm, bn, 4 if splits > 1 else 2, props.smem_per_block_optin)
        per_kb = max(per_kb, tuning.dram_latency_us / stages)
    t = max(waves * kb_per_unit * per_kb, stream_us(m, n, k, props, tuning))
    if splits > 1:
        t += split_extra_us(m, n, bn, splits, tuning)
    return t


def stream_us(m: int, n: int, k: int, props: DeviceProperties, tuning: GemmTuning = TUNING) -> float:
    """Microseconds to stream A and B from DRAM once."""
    return (m + n) * k * 2 / (props.stream_bytes_per_s * tuning.stream_efficiency) * 1e6


def row_tile(m: int) -> int:
    """BM of the unsplit tiles: 64 for M <= 64, 192 where 128 would pad M to a mostly empty extra row block."""
    if m <= 64:
        return 64
    return 192 if 128 < m <= 192 or 320 < m <= 384 else 128


def ragged_time_us(m: int, n: int, k: int, bm: int, bn: int, props: DeviceProperties,
                   tuning: GemmTuning = TUNING) -> float:
    """Estimated time of unsplit BM x BN tiles (BM 128 or 192): the load of the busiest CTA of the persistent
    grid, which takes every step-th cluster tile of the grouped order with each column's rows rotated by its wave
    (ptx/common/scheduler.cuh ROTATE_ROWS). A tile costs its k blocks (`kblock_us` of 128 rows; tall_kb_share x 1.5
    of it for 192) times the share of its consumers with rows below M (one of two: lone_consumer_share); a pair
    sharing B costs its dearer tile."""
    return ragged_load(m, n, bm, bn, props, tuning) * tile_kblock_us(bm, bn, tuning) * -(-k // BK)


def ragged_load(m: int, n: int, bm: int, bn: int, props: DeviceProperties, tuning: GemmTuning = TUNING) -> float:
    """The busiest CTA's work in whole BM x BN tiles (BM 128 or 192) under `ragged_time_us`'s order and shares."""
    t = tuning
    mcast = sm90.pick_multicast(m, n, bm, bn, 1, False, props, t)
    share_a, share_b = sm90.sharers(mcast)
    cl_m, cl_n = sm90.cluster_tiles(m, n, bm, bn, mcast)
    step = props.sm_count // (share_a * share_b)
    group = sm90.group_rows(m, n, bm, bn, mcast, props)
    consumers = bm // 64
    share = np.zeros(cl_m)  # per cluster tile row: the cost share of its dearest tile
    for row in range(cl_m):
        live = max(min(consumers, -(-(m - (row * share_b + j) * bm) // 64)) for j in range(share_b))
        share[row] = 0.0 if live <= 0 else t.lone_consumer_share if (live, consumers) == (1, 2) else live / consumers
    unit = np.arange(cl_m * cl_n)
    gsize = group * cl_n
    first = unit // gsize * group
    rows = np.minimum(group, cl_m - first)
    r = unit % gsize % rows
    load = np.bincount(unit % step, weights=share[first + (r + (unit - r) // step) % rows], minlength=step)
    return float(load.max())


def tile_kblock_us(bm: int, bn: int, tuning: GemmTuning = TUNING) -> float:
    """Microseconds per k block of a whole BM x BN tile (BM 128 or 192) in a busy grid."""
    return kblock_us(128, bn, tuning) * (1.5 * tuning.tall_kb_share if bm == 192 else 1.0)


def ragged_pick(m: int, n: int, k: int, epi_bytes: int, props: DeviceProperties, tuning: GemmTuning = TUNING) -> tuple:
    """(BM, BN) of unsplit tiles for M > 128 not a multiple of 128 and B as [N, K]: the least `ragged_time_us`
    among 128 x BN and 192 x BN (BN up to bm192_max_bn), ties to the wider tile, then 128 rows."""
    budget = props.smem_per_block_optin
    cands = [(bm, bn) for bm in (128, 192) for bn in _bn_candidates(n)
             if _bn_fits(bm, bn, 1, tuning) and max_stages(bm, bn, epi_bytes, budget) >= 2]
    return min(cands, key=lambda c: (round(ragged_time_us(m, n, k, *c, props, tuning), 3), -c[1], c[0]))


def _bn_fits(bm: int, bn: int, splits: int, tuning: GemmTuning) -> bool:
    """Whether ptx/gemm.cu's BM x BN tile fits the consumers' registers."""
    if bm == 256:
        return splits == 1 and bn <= tuning.bm256_max_bn
    return bm != 192 or bn <= (tuning.bm192_split_max_bn if splits > 1 else tuning.bm192_max_bn)


def split_candidates(m: int, n: int, k: int, bm: int, bn0: int, b_kn: bool, props: DeviceProperties,
                     tuning: GemmTuning = TUNING) -> list:
    """(estimate us, BM, BN, splits) for the unsplit config (BM x bn0) and every split config whose units fit one
    wave (`split_time_us`; paired configs at paired_factor of it). Unsplit 64-row tiles count too where they
    fill the GPU and 128-row ones do not."""
    t = tuning
    split_bm = 64 if m <= t.split_bm64_max_m else bm
    k_blocks = -(-k // BK)
    cands = [(split_time_us(m, n, k, bm, bn0, 1, props, t), bm, bn0, 1)]
    for bn in _whole_panels(_split_bn_candidates(n, t), n, split_bm, b_kn):
        if max_stages(split_bm, bn, 4, props.smem_per_block_optin, b_kn) < t.min_split_stages:
            continue
        if not _bn_fits(split_bm, bn, 2, t):
            continue
        tiles = -(-m // split_bm) * -(-n // bn)
        first = 1 if split_bm < bm and tiles >= t.full_grid * props.sm_count else 2
        for sp in range(first, min(t.max_splits, k_blocks // t.min_kblocks_per_split, props.sm_count // tiles) + 1):
            est = split_time_us(m, n, k, split_bm, bn, sp, props, t)
            if sm90.pick_multicast(m, n, split_bm, bn, sp, b_kn, props, t) != MCAST_NONE:
                est *= t.paired_factor
            cands.append((est, split_bm, bn, sp))
    return cands


def quad_candidate(m: int, n: int, k: int, b_kn: bool, props: DeviceProperties,
                   tuning: GemmTuning = TUNING) -> tuple | None:
    """(estimate us, 64, BN, splits) of the cheapest split-K config in clusters of four (`quad_split`), at
    paired_factor of its estimate, or None where there is none."""
    t = tuning
    cands = []
    for bn in _split_bn_candidates(n, t):
        if max_stages(64, bn, 4, props.smem_per_block_optin, b_kn) < t.min_split_stages:
            continue
        for sp in range(2, min(t.max_splits, -(-k // BK) // t.min_kblocks_per_split) + 1):
            if quad_split(m, n, 64, bn, sp, b_kn, props, t):
                cands.append((split_time_us(m, n, k, 64, bn, sp, props, t) * t.paired_factor, 64, bn, sp))
    return min(cands) if cands else None


def quad_split(m: int, n: int, bm: int, bn: int, splits: int, b_kn: bool, props: DeviceProperties,
               tuning: GemmTuning = TUNING) -> bool:
    """Whether split-K units of 64-row tiles run in clusters of four along M that share B (MCAST_SHARE_B4): M in
    193..256 (four rows of tiles, one cluster tall), B as [N, K] in quarters of whole swizzle atoms, and the clusters
    within quad_clusters_share of the SMs' (a 4-CTA cluster needs four free SMs of one GPC: 30 fit an H200's 132)."""
    return (bm == 64 and splits > 1 and 192 < m <= 256 and not b_kn and bn % 32 == 0 and tuning.multicast
            and -(-n // bn) * splits <= tuning.quad_clusters_share * props.sm_count / 4)


def operand_rows(m: int, n: int, bm: int, bn: int, splits: int, b_kn: bool, props: DeviceProperties,
                 tuning: GemmTuning = TUNING) -> float:
    """Operand rows the grid's tiles load per k block: each tile its BM rows of A and BN of B, a pair's shared
    tile once. BN as is also with B as [K, N] (whose loads come in 64-column panels): measured so, docs/tuning.md."""
    share_a, share_b = sm90.sharers(sm90.pick_multicast(m, n, bm, bn, splits, b_kn, props, tuning))
    return -(-m // bm) * -(-n // bn) * (bm / share_a + bn / share_b)


def choose_split(cands: list, m: int, n: int, b_kn: bool, props: DeviceProperties,
                 tuning: GemmTuning = TUNING) -> tuple:
    """The candidate to run: among those within `close` of the best estimate and loading at most
    split_rows_share x the fewest `operand_rows` of them, the ones whose units busy nearly every SM if any (more
    loads in flight), then the widest tile, then the most units (wide tiles stream DRAM better; the estimates of
    DRAM-bound configs are nearly equal)."""
    best = min(c[0] for c in cands)
    close = [c for c in cands if c[0] <= tuning.close * best]
    rows = {c: operand_rows(m, n, c[1], c[2], c[3], b_kn, props, tuning) for c in close}
    close = [c for c in close if rows[c] <= tuning.split_rows_share * min(rows.values())]
    full = [c for c in close if -(-m // c[1]) * -(-n // c[2]) * c[3] >= tuning.full_grid * props.sm_count]
    return max(full or close, key=lambda c: (c[2], c[3]))


def pick_config(m: int, n: int, k: int, out_bytes: int, props: DeviceProperties, split_k: int | None = None,
                accumulate: bool = False, b_kn: bool = False, tuning: GemmTuning = TUNING,
                misaligned: bool = False) -> GemmConfig:
    """Block shape, stages and split-K count.

    Without split-K (enough tiles to fill the GPU, or split_k=1): BM is 64 for M <= 64, 192 for M in 129..192
    and 321..384, else 128 (`row_tile`; split-K searches 64-row tiles up to split_bm64_max_m); BN runs over
    multiples of 16 up to 256 (192 for 192-row tiles) and N rounded up to 8 when N is small; fewer waves win, then
    a fuller last wave, then the larger tile. When the tiles do not fill the GPU, (BN, splits) pairs are compared
    with a throughput model (`split_time_us`); at M 193..256 split-K in clusters of four 64-row tiles takes over
    where the model puts it lower (`quad_candidate`), and the pick gives way to one wave of unsplit tiles that the
    model puts within `close` of it (`unsplit_wave`). `split_k` forces the count. Stages fill the smem budget.
    Last, at M 129..1024 with a 16-bit D and no forced split, swapped operands (D^T = B A^T, the config's BM over
    N and BN over M; split-K too where the pick is unsplit) take over where `swap_candidate` puts them below
    swap_share of the pick; B as [K, N] the same (the kernel's A is then MN-major). 64-row tiles over a [K, N] B
    are whole 64-column panels (`_whole_panels`; `unsplit_wave` takes any width where no such width makes a wave).
    `misaligned` (A's or B's rows not 128-byte aligned, `sm90.rows_misaligned`): the unswapped tiles chosen as
    above, paired wherever a pair adds no wave (`sm90.pick_multicast`); swapped tiles only in clusters
    (`swap_multicasts`), the swap priced with unsplit 64-row tiles' loads at misaligned_row_cost (split picks keep
    `split_time_us`; docs/tuning.md).
    """
    t = tuning
    if t.force_config is not None:
        cfg = t.force_config
        if cfg.swap_ab and (accumulate or out_bytes != 2):
            raise ValueError("a swapped-operand config (swap_ab) needs a 16-bit D that is not C accumulated in place")
        return cfg
    bm = row_tile(m)
    k_blocks = -(-k // BK)
    budget = props.smem_per_block_optin
    epi_plain = 4 if accumulate else out_bytes
    splits = max(1, min(int(split_k), k_blocks)) if split_k is not None else 1
    bn0 = sm90.fewest_waves_bn(m, n, bm, [b for b in _whole_panels(_bn_candidates(n), n, bm, b_kn)
                                          if _bn_fits(bm, b, 1, t) and max_stages(bm, b, epi_plain, budget, b_kn) >= 2],
                               props)
    if split_k is None and not unsplit_fills(m, n, bm, bn0, props, t) and k_blocks >= 2 * t.min_kblocks_per_split:
        est, bm, bn, splits = choose_split(split_candidates(m, n, k, bm, bn0, b_kn, props, t), m, n, b_kn, props, t)
        quad = quad_candidate(m, n, k, b_kn, props, t)
        if quad is not None and quad[0] < est:
            est, bm, bn, splits = quad
        wave = unsplit_wave(m, n, k, b_kn, props, t)
        if wave is not None and wave[0] <= t.close * (est + (t.split_fixed_us if splits > 1 else 0.0)):
            _, bm, bn, splits = wave
    elif splits > 1:  # forced count: fewest waves of units, then the larger tile
        fits = [b for b in _whole_panels(_bn_candidates(n), n, bm, b_kn)
                if _bn_fits(bm, b, splits, t) and max_stages(bm, b, 4, budget, b_kn) >= 2]
        bn = min(fits, key=lambda b: (-(-(-(-m // bm) * -(-n // b) * splits) // props.sm_count), -b))
    elif split_k is None and m > 128 and m % 128 and not b_kn and unsplit_fills(m, n, bm, bn0, props, t):
        bm, bn = ragged_pick(m, n, k, epi_plain, props, t)
    else:
        bn = bn0
    if (split_k is None and not accumulate and out_bytes == 2 and t.swap_ab
            and t.swap_min_m <= m <= t.swap_max_m and k >= t.swap_min_k):
        swap = swap_candidate(m, n, k, props, t, split=splits == 1, misaligned=misaligned)
        if swap is not None and swap[0] < t.swap_share * busiest_cta_us(m, n, k, bm, bn, splits, props, t,
                                                                         misaligned):
            return make_config(n, m, k, out_bytes, props, *swap[1:4], tuning=t, swap_ab=True,
                               mcast=swap[4] if t.force_mcast is None else None)
    return make_config(m, n, k, out_bytes, props, bm, bn, splits, accumulate, b_kn, t, misaligned=misaligned)


def busy_kblock_us(bm: int, bn: int, mcast: int = MCAST_NONE, tuning: GemmTuning = TUNING,
                   misaligned: bool = False) -> float:
    """Microseconds per k block of an unsplit BM x BN tile where every SM works: area_kb_us per output element or,
    from 128 rows, row_kb_us per row of A and B the CTA loads (a cluster's shared one over its sharers), whichever
    is more (narrow tiles wait on their loads); 64 rows at least `kblock_us`. Fitted on 121 shapes at M 129..1024
    (H200, docs/tuning.md). `misaligned` rows: the 64-row floor times misaligned_row_cost."""
    t = tuning
    area = t.area_kb_us * bm * bn
    if bm < 128:  # one consumer: narrow tiles keep the split model's per-k-block floor (their loads')
        return max(area, kblock_us(64, bn, t) * (t.misaligned_row_cost if misaligned else 1.0))
    share_a, share_b = sm90.sharers(mcast)
    return max(area, t.row_kb_us * (bm / share_a + bn / share_b))


def lone_wave_share(tiles: int, props: DeviceProperties, tuning: GemmTuning = TUNING) -> float:
    """Scale of `busy_kblock_us` for a grid of `tiles`: below one wave, the SMs that work share L2 and DRAM with
    fewer others."""
    if tiles >= props.sm_count:
        return 1.0
    return 1.0 - tuning.lone_wave_gain + tuning.lone_wave_gain * tiles / props.sm_count


def busy_time_us(load: float, tiles: int, k: int, bm: int, bn: int, mcast: int, props: DeviceProperties,
                 tuning: GemmTuning = TUNING, misaligned: bool = False) -> float:
    """`load` tiles' worth of k blocks for the busiest CTA of a grid of `tiles` BM x BN tiles, at `busy_kblock_us`
    and `lone_wave_share`: the one price of both sides of the swap decision."""
    return (load * -(-k // BK) * busy_kblock_us(bm, bn, mcast, tuning, misaligned)
            * lone_wave_share(tiles, props, tuning))


def busiest_cta_us(m: int, n: int, k: int, bm: int, bn: int, splits: int, props: DeviceProperties,
                   tuning: GemmTuning = TUNING, misaligned: bool = False) -> float:
    """Estimated time of an unswapped config for the swap decision. Unsplit ones priced like `swap_candidate`'s: the
    busiest CTA's tiles (`ragged_load` for 128 and 192 rows, else waves of tiles) at `busy_kblock_us`. Split ones
    keep `split_time_us` (the `kb_us` table, below `busy_kblock_us` for wide tiles: a swap must win by more there;
    the fit had few such shapes; it prices aligned loads even for `misaligned` rows)."""
    if splits > 1:
        return split_time_us(m, n, k, bm, bn, splits, props, tuning)
    tiles = -(-m // bm) * -(-n // bn)
    load = ragged_load(m, n, bm, bn, props, tuning) if bm in (128, 192) else -(-tiles // props.sm_count)
    mcast = sm90.pick_multicast(m, n, bm, bn, 1, False, props, tuning, misaligned=misaligned)
    return busy_time_us(load, tiles, k, bm, bn, mcast, props, tuning, misaligned)


def swap_pairs(m: int, bm: int, bn: int, tuning: GemmTuning = TUNING) -> bool:
    """Whether swapped BM x BN tiles (BM >= 128) run in pairs along D's rows sharing A (the weights): where D's M
    takes an even count of column tiles (an odd count leaves a spare tile in every cluster: 2.15x the time)."""
    return tuning.multicast and bm >= 128 and -(-m // bn) % 2 == 0


def swap_multicasts(m: int, n: int, bm: int, bn: int, props: DeviceProperties, tuning: GemmTuning = TUNING,
                    misaligned: bool = False) -> list:
    """The cluster shapes a swapped BM x BN tile may take over D = [M, N]: alone (not for `misaligned` rows:
    swapped tiles alone then ran 1.47-1.73x cuBLAS's time, H200, 2026-11-29); pairs along D's rows sharing A
    (`swap_pairs`); with swap_quads, fours along N sharing B (the activations, a quarter of whole 8-row swizzle
    atoms each), no spare tiles, in one wave (the plan checks it against the clusters that fit: `_plan`). Pairs
    sharing B ran no faster than these at the same price (H200, 2026-11-29: 0.94-1.05x the time of the others)."""
    t = tuning
    out = [] if misaligned else [MCAST_NONE]
    if not t.multicast:
        return out
    rows, cols = -(-n // bm), -(-m // bn)
    if swap_pairs(m, bm, bn, t):
        out.append(MCAST_SHARE_A)
    if t.swap_quads and bn % 32 == 0 and rows % 4 == 0 and rows * cols <= props.sm_count:
        out.append(sm90.MCAST_SHARE_B4)
    return out


_SWAP_TIE = {MCAST_SHARE_A: 0, MCAST_NONE: 1, sm90.MCAST_SHARE_B4: 2}  # at equal price: A2 ran fastest


def swap_candidate(m: int, n: int, k: int, props: DeviceProperties, tuning: GemmTuning = TUNING,
                   split: bool = True, misaligned: bool = False) -> tuple | None:
    """(estimate us, BM, BN, splits, mcast) of the cheapest config of D^T = B A^T: BM (128, 192 or 256) over N,
    BN over M the narrowest multiple of 8, of 16 and of 32 (fours need 32) for each count of column tiles, down to
    swap_min_bn; every cluster shape of `swap_multicasts`; unsplit (waves of tiles) or, with `split`,
    split-K in one wave (128 and 192 rows). Priced by `busy_time_us` (a tile's columns past M cost as much as the
    others); a split's main loop at least `stream_us`, plus its partials and finish (`split_extra_us`) and
    split_fixed_us. None where none fits."""
    t = tuning
    k_blocks = -(-k // BK)
    budget = props.smem_per_block_optin
    dram = stream_us(m, n, k, props, t)
    cands = []
    for bm in (128, 192, 256):
        widths = {-(-m // (q * c)) * q for q in (8, 16, 32) for c in range(1, -(-m // t.swap_min_bn) + 1)}
        for bn in sorted(w for w in widths if t.swap_min_bn <= w <= 256):
            tiles = -(-n // bm) * -(-m // bn)
            for mcast in swap_multicasts(m, n, bm, bn, props, t, misaligned):
                if _bn_fits(bm, bn, 1, t) and max_stages(bm, bn, 2, budget) >= 2:
                    est = busy_time_us(-(-tiles // props.sm_count), tiles, k, bm, bn, mcast, props, t, misaligned)
                    cands.append((est, bm, bn, 1, mcast))
                if not (split and _bn_fits(bm, bn, 2, t) and max_stages(bm, bn, 4, budget) >= t.min_split_stages):
                    continue
                for sp in range(2, min(t.max_splits, k_blocks // t.min_kblocks_per_split,
                                       props.sm_count // tiles) + 1):
                    est = max(busy_time_us(1, tiles * sp, -(-k_blocks // sp) * BK, bm, bn, mcast, props, t,
                                           misaligned), dram)
                    cands.append((est + split_extra_us(m, n, bn, sp, t) + t.split_fixed_us, bm, bn, sp, mcast))
    return min(cands, key=lambda c: (round(c[0], 3), c[3], -c[2], c[1], _SWAP_TIE[c[4]])) if cands else None



def split_extra_us(m: int, n: int, bn: int, splits: int, tuning: GemmTuning = TUNING) -> float:
    """What split-K adds to a config's main loop: its fp32 partials reduce-added in L2 and the finish of a 64 x BN
    slice."""
    return splits * m * n * 4 / tuning.partial_bytes_per_s * 1e6 + tuning.finish_us_per_32_cols * -(-bn // 32)


def unsplit_fills(m: int, n: int, bm: int, bn: int, props: DeviceProperties, tuning: GemmTuning = TUNING) -> bool:
    """Whether BM x BN tiles keep the GPU busy without split-K: a wave of them, or for M <= 64 (a single
    consumer streaming B) tiles of narrow_min_bn or more columns on split_below_fill of the SMs."""
    tiles = -(-m // bm) * -(-n // bn)
    if bm == 64:
        return bn >= tuning.narrow_min_bn and tiles >= tuning.split_below_fill * props.sm_count
    return tiles >= props.sm_count


def unsplit_wave(m: int, n: int, k: int, b_kn: bool, props: DeviceProperties,
                 tuning: GemmTuning = TUNING) -> tuple | None:
    """(estimate us, BM, BN, 1) of the cheapest single wave of unsplit tiles that busies `full_grid` of the SMs, or
    where no width does, `wave_fill` of them: row_tile(M) rows, or 64 (with B as [K, N] only above
    split_bm64_max_m: its 64-row tiles cannot share B, and at M 65..128 ran up to 1.45x the split pick's time).
    None when no width gives such a wave. The pick (split or not) gives way to it within `close` of its estimate:
    it busies more SMs than an unsplit pick, and a split's epilogue costs more than the model has
    (docs/tuning.md)."""
    def waves_of(bm: int, widths: list) -> list:
        out = []
        for bn in widths:
            tiles = -(-m // bm) * -(-n // bn)
            if (tuning.wave_fill * props.sm_count <= tiles <= props.sm_count and _bn_fits(bm, bn, 1, tuning)
                    and max_stages(bm, bn, 2, props.smem_per_block_optin, b_kn) >= 2):
                out.append((split_time_us(m, n, k, bm, bn, 1, props, tuning), bm, bn, 1,
                            tiles >= tuning.full_grid * props.sm_count))
        return out

    waves = []
    for bm in {row_tile(m)} | ({64} if m > tuning.split_bm64_max_m or not b_kn else set()):
        # (whole panels of [K, N] B where they make a wave; else any width: 140x1928x512 64 x 48 ran 0.86x the
        # time of the 192 x 16 tiles it would give way to)
        waves += waves_of(bm, _whole_panels(_bn_candidates(n), n, bm, b_kn)) or waves_of(bm, _bn_candidates(n))
    full = [w for w in waves if w[4]]
    return min(full or waves)[:4] if waves else None


def make_config(m: int, n: int, k: int, out_bytes: int, props: DeviceProperties, bm: int, bn: int, splits: int,
                accumulate: bool = False, b_kn: bool = False, tuning: GemmTuning = TUNING,
                swap_ab: bool = False, mcast: int | None = None, misaligned: bool = False) -> GemmConfig:
    """The full config of a BM x BN tile with `splits` K slices: stages fill the budget, pairs (or `mcast`; with
    `misaligned` rows, `sm90.pick_multicast`'s rule for them), tile order. M, N: the kernel's (`swap_ab`: D's N and
    M)."""
    epi = 4 if (splits > 1 or accumulate) else out_bytes
    stages = max_stages(bm, bn, epi, props.smem_per_block_optin, b_kn)
    if mcast is None:
        if swap_ab and tuning.force_mcast is None:
            mcast = MCAST_SHARE_A if swap_pairs(n, bm, bn, tuning) else MCAST_NONE
        elif quad_split(m, n, bm, bn, splits, b_kn, props, tuning):
            mcast = sm90.MCAST_SHARE_B4
        else:
            mcast = sm90.pick_multicast(m, n, bm, bn, splits, b_kn, props, tuning, misaligned=misaligned)
    return GemmConfig(bm, bn, stages, splits, smem_bytes(bm, bn, stages, epi, b_kn), mcast,
                      sm90.group_rows(m, n, bm, bn, mcast, props), sm90.streams_b(m, k, 2, tuning) and not b_kn,
                      tuning.pdl and tuning.warm_l2, swap_ab)


def _defines(in_dtype, out_dtype, cfg: GemmConfig, epi: str = "EPI_STORE", c_dtype=None,
             deterministic: bool = False, b_kn: bool = False) -> dict:
    d = {"IN_KIND": _KIND[in_dtype], "OUT_KIND": _KIND[out_dtype], "BM": cfg.bm, "BN": cfg.bn,
         "STAGES": cfg.stages, "EPI": epi}
    if b_kn:  # B as [K, N]: swapped, the kernel's A is [K, M]
        d["A_MN" if cfg.swap_ab else "B_KN"] = 1
    if c_dtype is not None:
        d["C_KIND"] = _KIND[c_dtype]
    if deterministic:
        d["DETERMINISTIC"] = 1
    if cfg.mcast:
        d["MCAST"] = cfg.mcast
    if cfg.stream_b:
        d["STREAM_B"] = 1
    if cfg.warm_l2:
        d["L2_WARM"] = 1
    if cfg.swap_ab:
        d["TRANS_OUT"] = 1
    return d


BENCH_SHAPES = {
    "large": [(8192, 8192, 8192), (4096, 7168, 16384), (4096, 4096, 7168), (4096, 2112, 7168),
              (4096, 24576, 1536), (4096, 7168, 2048), (4096, 32768, 512)],
    "skinny": [(16, 1280, 8192), (16, 4096, 8192), (64, 7168, 16384), (128, 128, 65536), (256, 256, 32768),
               (128, 2048, 28672), (512, 512, 65536), (1024, 1024, 65536), (2048, 2048, 32768)],
}


def variants():
    """Every kernel variant the heuristic picks for the benchmark shapes, four 192-row shapes, two whose M and N
    are not multiples of the tile, two with misaligned rows and one decode shape (bf16 in; bf16 and fp32 out; plain,
    split-K, deterministic split-K, accumulate into fp32 D)."""
    from ..runtime.driver import H100

    seen = {}

    def add(cfg, epi, out, deterministic=False):
        d = _defines(dt.bfloat16, out, cfg, epi, deterministic=deterministic)
        seen[tuple(sorted(d.items()))] = ("gemm.cu", "gemm_kernel", d, cfg.smem)

    # 192 rows: 192-row tiles split, unsplit and paired; a wave of 64-row tiles in three rows
    rows_192 = [(192, 512, 16384), (192, 14336, 2048), (384, 7168, 8192), (192, 7168, 2048)]
    # D^T = B A^T: 128, 192 and 256 rows, alone, in pairs sharing A and in fours sharing B; split-K
    swapped = [(300, 8192, 28672), (129, 28672, 4096), (300, 10240, 8192), (144, 10240, 5120), (700, 36864, 7168),
               (257, 5120, 25600), (129, 2112, 7168), (672, 1024, 21504)]
    ragged = [(777, 1000, 4096), (777, 600, 8192)]  # M and N not multiples of the tile: edge maps (unsplit, split)
    decode = [(16, 1280, 4096)]   # the decode kernel (no benchmark shape picks it)
    for shapes in list(BENCH_SHAPES.values()) + [rows_192, ragged, decode, swapped]:
        for m, n, k in shapes:
            for out in (dt.bfloat16, dt.float32):
                cfg = pick_config(m, n, k, out.itemsize, H100)
                if cfg.splits > 1:
                    add(cfg, "EPI_SPLIT", out)
                    add(cfg, "EPI_SPLIT", out, deterministic=True)
                else:
                    add(cfg, "EPI_STORE", out)
            dc = pick_decode(m, n, k, H100)
            if dc is not None:
                d = _decode_defines(dt.bfloat16, out, dc)
                seen[tuple(sorted(d.items()))] = ("gemm_decode.cu", "gemm_decode_kernel", d, 0)
    m, n, k = 4096, 4096, 7168  # the accumulate-into-fp32 benchmark
    add(pick_config(m, n, k, 4, H100, accumulate=True), "EPI_ACCUMULATE", dt.float32)
    # rows off 128-byte boundaries: 192-row tiles in pairs sharing A
    for m, n, k in ((1678, 3968, 12632), (1976, 6208, 2168)):
        add(pick_config(m, n, k, 2, H100, misaligned=True), "EPI_STORE", dt.bfloat16)
    # B as [K, N]: plain, and swapped (the kernel's A MN-major: A_MN)
    for m, n, k in ((8192, 8192, 8192), (128, 128, 65536), (300, 8192, 28672), (129, 2112, 7168)):
        cfg = pick_config(m, n, k, 2, H100, b_kn=True)
        d = _defines(dt.bfloat16, dt.bfloat16, cfg, "EPI_SPLIT" if cfg.splits > 1 else "EPI_STORE", b_kn=True)
        seen[tuple(sorted(d.items()))] = ("gemm.cu", "gemm_kernel", d, cfg.smem)
    return list(seen.values())


# ---- plans and launch -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    cfg: GemmConfig
    epi: str
    launch: object
    grid: tuple
    map_a: MapLayout
    map_b: MapLayout
    map_a_edge: MapLayout  # the boxes across M and N (`sm90.edge_map`)
    map_b_edge: MapLayout
    map_out: MapLayout
    ld_w: int
    scratch: tuple     # (slot, bytes, zeroed) for the split-K workspace and counters; () when none
    uses_c: bool       # C is read (not accumulate-in-place)
    ld_d: int
    mnk: tuple         # M, N, K as the kernel takes them
    memo: ArgsMemo = field(default_factory=ArgsMemo, compare=False, repr=False)


@dataclass(frozen=True)
class _DecodePlan:
    cfg: DecodeConfig
    launch: object
    grid: tuple
    uses_c: bool



def _args(plan: _Plan, a_ptr: int, b_ptr: int, d_ptr: int, c_ptr: int, ld_c: int, w_ptr: int, counters: int) -> tuple:
    """The tiled kernel's arguments; w_ptr / counters: the split-K workspace and tile counters (0 without)."""
    maps = sm90.thread_maps()
    if plan.cfg.swap_ab:  # the kernel's A is B, its B is A
        a_ptr, b_ptr = b_ptr, a_ptr
    map_a, map_a_edge = sm90.operand_maps(maps, plan.map_a, plan.map_a_edge, a_ptr)
    map_b, map_b_edge = sm90.operand_maps(maps, plan.map_b, plan.map_b_edge, b_ptr)
    map_out = maps.get(plan.map_out, w_ptr if plan.epi == "EPI_SPLIT" else d_ptr)
    return (map_a, map_b, map_a_edge, map_b_edge, map_out, d_ptr, plan.ld_d, w_ptr, plan.ld_w, c_ptr, ld_c, counters,
            *plan.mnk, plan.cfg.splits, plan.cfg.group_m)

def _check_inputs(av, bv, cv, b_kn: bool) -> tuple[int, int, int]:
    """Validate A, B and C (everything but the output); return (M, N, K)."""
    require(av, "a", dtypes=_INPUTS, ndim=2)
    require(bv, "b", dtypes=_INPUTS, ndim=2)
    if bv.dtype is not av.dtype:
        raise TypeError(f"a and b must have the same dtype, got {av.dtype.name} and {bv.dtype.name}")
    m, k = av.shape
    kb, n = bv.shape if b_kn else bv.shape[::-1]
    if kb != k:
        layout = "[K, N]" if b_kn else "[N, K]"
        raise ValueError(f"a is [M, K] = {av.shape} but b is {layout} = {bv.shape}: K differs")
    if k == 0:
        raise ValueError("K must be at least 1")
    if cv is not None:
        require(cv, "c", dtypes=_OUTPUTS, ndim=2, shape=(m, n))
    same_device(a=av, b=bv, c=cv)
    return m, n, k


def _check_out(dv, av, m: int, n: int) -> None:
    require(dv, "out", dtypes=_OUTPUTS, ndim=2, shape=(m, n))
    same_device(a=av, out=dv)


def _plan(av, bv, dv, cv, accumulate, split_k, deterministic, b_kn, tuning: GemmTuning):
    m, n, k = _check_inputs(av, bv, None if accumulate else cv, b_kn)
    _check_out(dv, av, m, n)
    props = device_properties(av.device)
    dc = pick_decode(m, n, k, props, split_k, b_kn, tuning)
    if dc is not None:  # bitwise reproducible by construction, so `deterministic` needs nothing more
        defines = _decode_defines(av.dtype, dv.dtype, dc, None if cv is None else cv.dtype)
        launch = get_launcher("gemm_decode.cu", "gemm_decode_kernel", defines, av.device, _DECODE_ARGS,
                              (dc.threads,), 0, pdl=tuning.pdl)
        return _DecodePlan(dc, launch, (-(-n // (8 * dc.g)), 1, 1), cv is not None)
    misaligned = sm90.rows_misaligned(av) or sm90.rows_misaligned(bv)
    cfg = pick_config(m, n, k, dv.dtype.itemsize, props, split_k, accumulate, b_kn, tuning, misaligned)
    if accumulate:
        epi = "EPI_ACCUMULATE"
    elif cfg.splits > 1:
        epi = "EPI_SPLIT"
    else:
        epi = "EPI_STORE"
    det = deterministic and cfg.splits > 1
    c_dtype = cv.dtype if (cv is not None and not accumulate) else None
    defines = _defines(av.dtype, dv.dtype, cfg, epi, c_dtype, det, b_kn)
    launch = get_launcher("gemm.cu", "gemm_kernel", defines, av.device, _ARGS, (cfg.threads,), cfg.smem,
                          cluster=(cfg.cluster, 1, 1) if cfg.mcast else None, pdl=tuning.pdl)
    # the kernel's A and B, M and N (swap_ab: D^T = B A^T)
    ka, kb_, km, kn = (bv, av, n, m) if cfg.swap_ab else (av, bv, m, n)
    if cfg.swap_ab and cfg.mcast == sm90.MCAST_SHARE_B4 and tuning.swap_quads and tuning.force_config is None:
        cl_m, cl_n = sm90.cluster_tiles(km, kn, cfg.bm, cfg.bn, cfg.mcast)
        if cl_m * cl_n * cfg.splits > launch.max_active_clusters():  # a second round of fours: about 2x the time
            return _plan(av, bv, dv, cv, accumulate, split_k, deterministic, b_kn, replace(tuning, swap_quads=False))
    tiles = -(-km // cfg.bm) * -(-kn // cfg.bn)
    grid = sm90.persistent_grid(launch, km, kn, cfg.bm, cfg.bn, cfg.mcast, cfg.splits, cfg.smem, props)
    ld_w = -(-n // 4) * 4
    cl_m, cl_n = sm90.cluster_tiles(km, kn, cfg.bm, cfg.bn, cfg.mcast)
    share_a, share_b = sm90.sharers(cfg.mcast)
    # a [K, N] B is the kernel's A when swapped (A_MN), else its B (B_KN)
    map_a, map_a_edge = _operand_maps(ka, k, km, cfg.bm, share_a, cl_n, cfg.splits, b_kn and cfg.swap_ab)
    map_b, map_b_edge = _operand_maps(kb_, k, kn, cfg.bn, share_b, cl_m, cfg.splits, b_kn and not cfg.swap_ab)
    epi_bytes = 4 if epi != "EPI_STORE" else dv.dtype.itemsize
    box_out = (epilogue_chunk(cfg.bn, epi_bytes), 64)
    swz = epilogue_swizzle(cfg.bn, epi_bytes)
    if epi == "EPI_SPLIT" and cfg.swap_ab:  # the workspace laid out as D, reduce-added transposed in 32-row halves
        map_out = MapLayout(dt.float32, (n, m), (ld_w * 4,), (32, box_out[0]), 128)
    elif epi == "EPI_SPLIT":
        map_out = MapLayout(dt.float32, (n, m), (ld_w * 4,), box_out, swz)
    elif cfg.swap_ab:  # D^T tiles: 64 of D's columns (128 bytes) by a chunk of its rows
        map_out = MapLayout(dv.dtype, (n, m), (dv.strides[0] * dv.dtype.itemsize,), box_out[::-1], 128)
    else:
        map_out = MapLayout(dv.dtype, (n, m), (dv.strides[0] * dv.dtype.itemsize,), box_out, swz)
    counters = ("splitk_counters", tiles * (cfg.bm // 64) * 4, True)  # one int per 64-row slice of every tile
    if epi == "EPI_SPLIT":
        scratch = (("splitk_partials", m * ld_w * 4, True), counters)
    elif epi == "EPI_ACCUMULATE" and det:
        scratch = (counters,)
    else:
        scratch = ()
    return _Plan(cfg, epi, launch, grid, map_a, map_b, map_a_edge, map_b_edge, map_out, ld_w,
                 scratch, c_dtype is not None, dv.strides[0], (km, kn, k))


def _operand_maps(x: DeviceArray, k: int, rows: int, tile_rows: int, sharers: int, readers: int, splits: int,
                  mn_major: bool) -> tuple:
    """The TMA map of one of the kernel's operands (`rows` of M or N by K) and the map for its edge box: K-major,
    boxes of BK x the tile rows a CTA loads, and the box across the last row (`sm90.edge_map`); MN-major ([K, rows]
    memory), boxes of 64 rows x BK loaded panel by panel (no edge map). L2 promotion per `sm90.l2_promotion`, from
    the operand's own row alignment."""
    promotion = sm90.l2_promotion(readers, splits, sm90.rows_misaligned(x))
    stride = (x.strides[0] * x.dtype.itemsize,)
    if mn_major:
        panels = MapLayout(x.dtype, (rows, k), stride, (64, BK), 128, promotion)
        return panels, panels
    tiles = MapLayout(x.dtype, (k, rows), stride, (BK, sm90.box_rows(tile_rows, sharers)), 128, promotion)
    return tiles, sm90.edge_map(tiles, rows)


def _same_memory(x: DeviceArray, y: DeviceArray) -> bool:
    return x.ptr == y.ptr and x.shape == y.shape and x.strides == y.strides and x.dtype is y.dtype


def gemm(a, b, out=None, c=None, *, b_layout: str = "nk", split_k=None, deterministic: bool = False,
         out_dtype=None, stream=None, tuning: GemmTuning | None = None):
    """D = A @ B^T (+ C).

    A [M, K] and B [N, K] (or B [K, N] with b_layout="kn": D = A @ B), both bf16 or both fp16, fp32 accumulation.
    D [M, N] in `out`'s dtype (or `out_dtype`, default the input dtype): bf16, fp16 or fp32. `c` [M, N] (bf16,
    fp16 or fp32) is added; with `c is out` and an fp32 `out`, D += A @ B^T accumulates in place through TMA
    reduce-add. `split_k` forces the split count (None: the heuristic decides; 1: off); `deterministic=True`
    makes split-K bitwise reproducible (K order). Rows must be 16-byte aligned (K and N multiples of 8 for
    16-bit data); every M, N, K tail is handled in the kernel. Runs on `stream` (None: torch's or cupy's current
    stream for their arrays, else the legacy default stream); returns `out`, or when None a new array of the
    inputs' framework (README: results and streams). `tuning`: the heuristic's constants (default `TUNING`).
    Inside a CUDA graph capture, pass `out` unless the inputs are torch tensors (torch allocates from the graph's
    pool).
    """
    if b_layout not in ("nk", "kn"):
        raise ValueError(f"b_layout must be 'nk' (B is [N, K]) or 'kn' (B is [K, N]), got {b_layout!r}")
    b_kn = b_layout == "kn"
    if split_k is not None and (int(split_k) != split_k or split_k < 1):
        raise ValueError(f"split_k must be a positive integer or None, got {split_k!r}")
    av, bv, dv, cv, h, native = call_arrays((a, b, out, None if c is out else c), stream)
    if c is not None and c is out:
        cv = dv
    if out is None:
        m, n, _ = _check_inputs(av, bv, cv, b_kn)
        od = dt.as_dtype(out_dtype) if out_dtype is not None else av.dtype
        if od not in _OUTPUTS:
            raise TypeError(f"out_dtype {od.name} not supported (bfloat16, float16, float32)")
        dv = native.empty((m, n), od, av.device, h, stream)
    accumulate = cv is not None and dv.dtype is dt.float32 and _same_memory(cv, dv)
    key = ("gemm", sm90.array_key(av), sm90.array_key(bv), sm90.array_key(dv),
           None if cv is None else (sm90.array_key(cv), accumulate), split_k, deterministic, b_kn, tuning)
    plan = PLANS.get(key)
    if plan is None:
        if dv.ndim == 2 and 0 in dv.shape:
            _check_inputs(av, bv, None if accumulate else cv, b_kn)
            _check_out(dv, av, av.shape[0], bv.shape[1] if b_kn else bv.shape[0])
            return native.result(dv) if out is None else out
        plan = PLANS.add(key, _plan(av, bv, dv, cv, accumulate, split_k, deterministic, b_kn, tuning or TUNING))
    c_ptr, ld_c = (cv.ptr, cv.strides[0]) if plan.uses_c else (0, 0)
    caller = enter_device(av.device)  # (the plan key holds every array's device: they are all on this one)
    try:
        if type(plan) is _DecodePlan:
            plan.launch(plan.grid, h, av.ptr, av.strides[0], bv.ptr, bv.strides[0], dv.ptr, dv.strides[0], c_ptr,
                        ld_c, av.shape[0], dv.shape[1], av.shape[1])
        elif not plan.scratch:  # the arguments are a function of the pointers alone
            ptrs = (av.ptr, bv.ptr, dv.ptr, c_ptr)
            args = plan.memo.get(ptrs)
            if args is None:
                args = plan.memo.add(ptrs, _args(plan, av.ptr, bv.ptr, dv.ptr, c_ptr, ld_c, 0, 0))
            plan.launch.run(plan.grid, h, args)
        else:
            ptrs = SCRATCH.acquire(av.device, h, plan.scratch)
            w_ptr = ptrs[0] if plan.epi == "EPI_SPLIT" else 0
            plan.launch.run(plan.grid, h, _args(plan, av.ptr, bv.ptr, dv.ptr, c_ptr, ld_c, w_ptr, ptrs[-1]))
    finally:
        leave_device(caller)
    return native.result(dv) if out is None else out
