"""BF16/FP16 GEMM on Hopper: D = A @ B^T (+ C) with A [M, K] and B [N, K] (or D = A @ B with B [K, N]), 16-bit
inputs, fp32 accumulation, D bf16, fp16 or fp32; split-K through TMA reduce-add; D += A @ B^T in place for an
fp32 D."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from cuda.bindings import driver as cu

from ..runtime import dtypes as dt
from ..runtime.driver import DeviceProperties, check, device_properties, stream_handle
from ..runtime.interop import DeviceArray, as_array, require
from ..runtime.launch import get_launcher
from ..runtime.tensormap import AddressedMapCache

BK = 64                      # k elements per pipeline stage (128 bytes: one 128-byte swizzle span)
ALIGN_SLACK = 1024           # the kernel aligns its dynamic shared memory to 1024 bytes
_KIND = {dt.bfloat16: "KIND_BF16", dt.float16: "KIND_FP16", dt.float32: "KIND_FP32"}
_INPUTS = (dt.bfloat16, dt.float16)
_OUTPUTS = (dt.bfloat16, dt.float16, dt.float32)
_ARGS = ("tmap", "tmap", "tmap", "tmap", "tmap", "ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "i32", "i32",
         "i32", "i32", "i32")
MAX_STAGES = 16
MIN_SPLIT_STAGES = 3         # split-K configs keep at least this many stages
MIN_KBLOCKS_PER_SPLIT = 4    # 256 k elements: below this the partial's reduce costs more than its math
MAX_SPLITS = 128
# M <= 64 (one consumer, B streamed once): no split when the unsplit tiles are NARROW_MIN_BN or more columns wide
# and busy SPLIT_BELOW_FILL of the SMs. Since the A boxes load only M's rows (edge maps), such a grid streams B
# faster than the splits: H100, same process, unsplit / split pick / decode kernel, us: 16x3072x16384 37.7 / 52.8 /
# 52.7, 64x4096x8192 26.1 / 27.2, 16x7168x16384 81.0 / 90.3 / 90.3; at 61% of the SMs (16x2560x16384: 80 tiles)
# it lost. 16-column tiles stream slowly even on a full grid (64x2112x16384: 132 tiles 37.7 us; 64 x 64 x 4
# splits 27.1; cuBLAS 30.4), so they always go through the split search (docs/perf-notes.md, session 21).
SPLIT_BELOW_FILL = 0.7
NARROW_MIN_BN = 32
MULTICAST = True             # let the heuristic pair CTAs in 2-CTA clusters (scripts turn it off to compare)
MCAST_NONE, MCAST_SHARE_B, MCAST_SHARE_A = 0, 1, 2  # ptx/gemm.cu MCAST

# Split-K model, fitted to a same-run sweep of forced configs on the skinny benchmark shapes (H200, CUDA-graph
# timing, scripts/gemm_sweep.py; docs/perf-notes.md): microseconds one CTA spends per 64-deep k block for a
# BM x BN tile. Small tiles sit on a floor (pipeline round trip), large ones approach the wgmma rate.
_KB_US = {64: ((16, .181), (32, .185), (48, .190), (64, .205), (96, .185), (128, .206), (192, .278), (256, .353)),
          128: ((16, .194), (32, .206), (48, .237), (64, .302), (96, .357), (128, .405), (192, .547),
                (256, .675))}
# 192-row tiles (three consumers): 1.5x the 128-row time, as the tensor work; with no DRAM-latency floor, this
# model picks within 2% of the best of 100 forced 192-row configs on 18 shapes at M 144..384 (H100, perf-notes
# session 18).
_KB_US[192] = tuple((bn, 1.5 * us) for bn, us in _KB_US[128])
_DRAM_EFFICIENCY = 0.82        # achieved / peak DRAM bandwidth when streaming operands
_DRAM_LATENCY_US = 4.0         # a stage's load under load, when B streams from DRAM once (M <= BM): a CTA gets one
                               # stage back every latency / stages (16x4096x8192: BN32 0.28 us/kb, BN128 0.49)
_PARTIAL_BYTES_PER_S = 2e12    # fp32 partials reduce-added in L2 (refitted on the H100 with the full-grid rule
                               # over 31 M <= 1024 shapes: pick / best forced 1.038 -> 1.022; perf-notes session 9)
_FINISH_US_PER_32_COLS = 0.17  # the last split's finalisation, per 32 columns of a 64-row slice (fitted)
FULL_GRID = 0.9                # a grid of units this share of the SMs counts as full
_CLOSE = 1.05                  # estimates this close to the best: take the widest tile, then the most units
# Programmatic dependent launch of the GEMM kernels (gemm.cu, gemm_fp8.cu): a kernel's set-up (barriers, tensor
# maps, cluster sync) overlaps the previous kernel's tail in the stream; it waits for it before touching memory.
PDL = True

# Decode-shaped GEMMs (M <= DECODE_MAX_M, B as [N, K], split_k left to the heuristic) run ptx/gemm_decode.cu:
# each CTA streams 8 * G rows of B over the whole of K with mma.sync, its warps splitting K and summing in shared
# memory; no split-K workspace or counters. Every CTA also reads all of A, so the kernel pays where A is small
# against its share of B. H100, same process, decode / the wgmma kernel's pick, us (docs/perf-notes.md, sessions
# 15 and 21): 16x1280x4096 7.3 / 7.9, 1x2112x16384 26.6 / 28.5, 8x2048x5120 10.9 / 11.5; but 16x1280x16384 21.4 /
# 18.8 and 16x2112x16384 31.8 / 28.1 (A read by every CTA: 512 KB each), short K (16x7168x2048 14.6 / 13.1), few
# CTAs (16x512x8192 8.1 / 7.4), and more than one CTA per SM, where the wgmma kernel's unsplit 32-column tiles
# fill the GPU (16x3072x16384 48.2 / 38.0, 16x4096x8192 26.8 / 25.1).
DECODE = True                # scripts turn it off to compare with the wgmma kernel
DECODE_MAX_M = 16
DECODE_MIN_K = 4096
DECODE_MIN_FILL = 0.6        # 16-row CTAs must busy this share of the SMs ...
DECODE_MAX_FILL = 1.0        # ... and at most this share
DECODE_MAX_A_BYTES = 128 << 10  # A (M x K, 16-bit) that every CTA reads
_DECODE_ARGS = ("ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "i64", "i32", "i32", "i32")


@dataclass(frozen=True)
class DecodeConfig:
    g: int          # groups of 8 rows of B per CTA
    warps: int      # warps per CTA, splitting K
    depth: int = 2  # k steps (64 deep) each warp keeps in flight (3 or 4 measured no faster; more registers)

    @property
    def threads(self) -> int:
        return 32 * self.warps


def pick_decode(m: int, n: int, k: int, props: DeviceProperties, split_k=None, b_kn: bool = False):
    """The decode kernel's config, or None where the wgmma kernel is the better (or the only) choice (the limits
    above: within them it is always 16-row CTAs of 16 warps). Past DECODE_MAX_FILL (tests lift it): 32-row CTAs
    once they cover FULL_GRID of the SMs, else 16-row; 16 warps while the grid fits one CTA per SM, else 8 (two
    fit per SM). Measured (H100, same process): 16x4096x8192 G4 x 16 warps 26.9 us, G2 x 8 28.0, G8 x 8 32.8;
    16x1280x8192 G2 x 16 11.7, G4 x 16 15.7, G1 x 16 17.3."""
    if (not DECODE or m > DECODE_MAX_M or b_kn or split_k is not None or k < DECODE_MIN_K
            or 2 * m * k > DECODE_MAX_A_BYTES
            or not DECODE_MIN_FILL * props.sm_count <= -(-n // 16) <= DECODE_MAX_FILL * props.sm_count):
        return None
    g = 4 if -(-n // 32) >= FULL_GRID * props.sm_count else 2
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
    mcast: int = MCAST_NONE  # 2-CTA cluster pairing tiles along M (sharing B) or along N (sharing A)
    group_m: int = 1         # cluster-tile rows per group of the tile order
    stream_b: bool = False   # B loaded with an evict-first L2 policy (`streams_b`)

    @property
    def threads(self) -> int:
        return 128 * (self.bm // 64 + 1)

    @property
    def cluster(self) -> int:
        return 2 if self.mcast else 1


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


def _split_bn_candidates(n: int) -> list[int]:
    """BN values the split model was fitted on (and N itself, rounded up to 8, when N is smaller)."""
    fitted = [b for b, _ in _KB_US[64]]
    cands = {b for b in fitted if b < n} | ({-(-n // 8) * 8} if n <= 256 else {256})
    return sorted(cands)


def fewest_waves_bn(m: int, n: int, bm: int, candidates, props: DeviceProperties) -> int:
    """The BN that needs the fewest waves of BM x BN tiles, then fills the last wave most, then is widest (the
    DeepGEMM rule)."""
    def key(bn):
        tiles = -(-m // bm) * -(-n // bn)
        waves = -(-tiles // props.sm_count)
        return waves, -(tiles - (waves - 1) * props.sm_count), -bn
    return min(candidates, key=key)


def kblock_us(bm: int, bn: int) -> float:
    """Microseconds per k block of one BM x BN unit (linear between the fitted BN points)."""
    pts = _KB_US[bm]
    if bn <= pts[0][0]:
        return pts[0][1]
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if bn <= b1:
            return t0 + (t1 - t0) * (bn - b0) / (b1 - b0)
    return pts[-1][1] * bn / pts[-1][0]


def split_time_us(m: int, n: int, k: int, bm: int, bn: int, splits: int, props: DeviceProperties) -> float:
    """Estimated microseconds for a config: waves of units, each streaming its k blocks (or the whole operand
    traffic at DRAM speed, when that is slower), plus the split-K partials and the last split's finalisation."""
    tiles = -(-m // bm) * -(-n // bn)
    waves = -(-tiles * splits // props.sm_count)
    kb_per_unit = -(-(-(-k // BK)) // splits)
    per_kb = kblock_us(bm, bn)
    if m <= bm < 192:  # nothing is re-read from L2: every stage waits on DRAM (192 rows: measured without it)
        per_kb = max(per_kb, _DRAM_LATENCY_US / max_stages(bm, bn, 4 if splits > 1 else 2, props.smem_per_block_optin))
    main = waves * kb_per_unit * per_kb
    dram = (m + n) * k * 2 / (props.dram_bytes_per_s * _DRAM_EFFICIENCY) * 1e6
    t = max(main, dram)
    if splits > 1:
        t += splits * m * n * 4 / _PARTIAL_BYTES_PER_S * 1e6 + _FINISH_US_PER_32_COLS * -(-bn // 32)
    return t


# Split candidates that can pair tiles in 2-CTA clusters count at this fraction of their estimate: multicast
# halves one operand's L2 reads and the split main loop is bound by L2 traffic (session 8), which the per-k-block
# fit does not see. Of 27 skinny shapes only 128x128x65536 changes pick: 128x48 x 44 (18.7 us) -> 128x64 x 64
# paired along N (17.8; cuBLAS 17.1; H100, same process, 4 rounds).
PAIRED_FACTOR = 0.95
# Split-K for M <= this searches 64-row tiles (one consumer; pairs share B along M) instead of 128-row ones: fewer
# splits for the same grid, so fewer fp32 partials (H100, same process, old -> new pick, us: 128x128x65536 17.4 ->
# 16.6, 128x2048x28672 51.2 -> 47.7, 96x256x32768 14.0 -> 13.1, 128x1024x32768 33.2 -> 31.2, 128x4096x16384 56.2
# -> 54.2). Not at M = 256: 256x256x32768 18.8 -> 19.2, 256x512x65536 42.3 -> 46.6 (perf-notes, session 15).
SPLIT_BM64_MAX_M = 128
# 192-row tiles for M in 129..192 and 321..384, where 128-row ones add a row block that is mostly empty, or two
# of three row blocks re-read B. Same process, H100, 30 shapes not used for the fit, old pick -> new (us):
# 184x5120x1024 10.9 -> 8.1, 168x12288x12288 132.9 -> 116.2, 360x14336x2048 42.2 -> 35.4, every M <= 192 shape
# 4-35% faster; at M 257..320 two 192-row blocks lost up to 10% (264x14336x5120 103.9 -> 115.2), so 128 stays
# there (perf-notes, session 18). Three consumers get 152 registers: BN <= 192, and <= 160 with the split epilogue.
BM192_MAX_BN = 192
BM192_SPLIT_MAX_BN = 160


def box_rows(tile_rows: int, shared: bool) -> int:
    """The rows of an operand tile one CTA loads: all of them, or half when the pair shares the tile."""
    return tile_rows // 2 if shared else tile_rows


def edge_map(layout: tuple, rows: int) -> tuple:
    """The map of an operand's box across its last row (`rows` per group; ptx/common tma_load_rows): the same
    tensor with a box of rows % box rows, so that TMA fills no row past the tensor: its zero fill is slow (FP8,
    H100: 160x4096x7168 28.8 us with a half-filled box, 20.7 without; docs/perf-notes.md sessions 18-20). The
    layout itself where rows are a multiple of the box (the kernel then never uses it)."""
    dtype, dims, strides, box, *rest = layout
    tail = rows % box[1]
    return layout if tail == 0 else (dtype, dims, strides, (box[0], tail), *rest)


def operand_maps(maps: AddressedMapCache, role: str, layout: tuple, edge_layout: tuple, address: int) -> tuple:
    """An operand's main and edge tensor maps (one cache lookup where the rows need no edge box)."""
    main = maps.get(role, layout, address)
    return main, main if edge_layout is layout else maps.get(role, edge_layout, address)


def row_tile(m: int) -> int:
    """BM of the unsplit tiles: 64 for M <= 64, 192 where 128 would pad M to a mostly empty extra row block."""
    if m <= 64:
        return 64
    return 192 if 128 < m <= 192 or 320 < m <= 384 else 128


def _bn_fits(bm: int, bn: int, splits: int) -> bool:
    """Whether ptx/gemm.cu's BM x BN tile fits the consumers' registers."""
    return bm != 192 or bn <= (BM192_SPLIT_MAX_BN if splits > 1 else BM192_MAX_BN)


# B loaded with an evict-first L2 policy (ptx/common/sm90.cuh l2_evict_first) when M <= this: every tile of B is
# read by one CTA, or by the 64-row tiles of one column, which run at the same time; its stream then no longer evicts
# A or the split-K partials. Only where a row of B is STREAM_B_MIN_ROW_BYTES or longer, and B is [N, K]. H100, same
# process, rotating inputs, us without / with: bf16 128x8192x4096 33.7 / 30.9, 128x4096x16384 53.8 / 52.1,
# 128x2048x28672 47.6 / 45.7; fp8 64x7168x2048 8.73 / 8.16, 128x2112x7168 11.3 / 10.8. Shorter rows: neutral to 10%
# slower (bf16 128x32768x512 17.9 / 19.9); B as [K, N]: 128x4096x16384 60.2 / 64.7; above M = 128 split shapes lost
# 3-13%; the masked FP8 layout: neutral (docs/perf-notes.md, session 17).
STREAM_B_MAX_M = 128
STREAM_B_MIN_ROW_BYTES = 2048


def streams_b(m: int, k: int, in_bytes: int) -> bool:
    return m <= STREAM_B_MAX_M and k * in_bytes >= STREAM_B_MIN_ROW_BYTES


def split_candidates(m: int, n: int, k: int, bm: int, bn0: int, b_kn: bool, props: DeviceProperties) -> list:
    """(estimate us, BM, BN, splits) for the unsplit config (BM x bn0) and every split config whose units fit one
    wave (`split_time_us`; paired configs at PAIRED_FACTOR of it)."""
    split_bm = 64 if m <= SPLIT_BM64_MAX_M else bm
    k_blocks = -(-k // BK)
    cands = [(split_time_us(m, n, k, bm, bn0, 1, props), bm, bn0, 1)]
    for bn in _split_bn_candidates(n):
        if max_stages(split_bm, bn, 4, props.smem_per_block_optin, b_kn) < MIN_SPLIT_STAGES:
            continue
        if not _bn_fits(split_bm, bn, 2):
            continue
        tiles = -(-m // split_bm) * -(-n // bn)
        # Unsplit 64-row tiles too, when they fill the GPU where 128-row ones do not (H100, same process, old ->
        # new pick over the 37 shapes it changes at M 80..128, us: 128x8192x4096 30.9 -> 25.0, 128x4096x2048
        # 11.7 -> 8.6, 96x8192x2048 18.9 -> 14.1, worst 80x4096x4096 17.2 -> 18.4; on half the SMs they lost
        # up to 15%: 128x7168x16384 88.0 -> 96.3; perf-notes, session 17).
        first = 1 if split_bm < bm and tiles >= FULL_GRID * props.sm_count else 2
        for sp in range(first, min(MAX_SPLITS, k_blocks // MIN_KBLOCKS_PER_SPLIT, props.sm_count // tiles) + 1):
            t = split_time_us(m, n, k, split_bm, bn, sp, props)
            if MULTICAST and pick_multicast(m, n, split_bm, bn, sp, b_kn, props) != MCAST_NONE:
                t *= PAIRED_FACTOR
            cands.append((t, split_bm, bn, sp))
    return cands


def choose_split(cands: list, m: int, n: int, props: DeviceProperties) -> tuple:
    """The candidate to run: among those within _CLOSE of the best estimate, the ones whose units busy nearly every
    SM if any (more loads in flight: H100, same process, 16x4096x8192 64x128 x 4, 128 units, 29.2-30.0 us against
    64x192 x 4, 88 units, 32.5; 256x512x65536 128x128 x 16, 128 units, 43.3 against 128x192 x 16, 96 units,
    47.5), then the widest tile, then the most units (wide tiles stream DRAM better; the estimates of DRAM-bound
    configs are nearly equal)."""
    best = min(c[0] for c in cands)
    close = [c for c in cands if c[0] <= _CLOSE * best]
    full = [c for c in close if -(-m // c[1]) * -(-n // c[2]) * c[3] >= FULL_GRID * props.sm_count]
    return max(full or close, key=lambda c: (c[2], c[3]))


def pick_config(m: int, n: int, k: int, out_bytes: int, props: DeviceProperties, split_k: int | None = None,
                accumulate: bool = False, b_kn: bool = False) -> GemmConfig:
    """Block shape, stages and split-K count.

    Without split-K (enough tiles to fill the GPU, or split_k=1): BM is 64 for M <= 64, 192 for M in 129..192
    and 321..384, else 128 (`row_tile`; split-K searches 64-row tiles up to M = SPLIT_BM64_MAX_M); BN runs over
    multiples of 16 up to 256 (192 for 192-row tiles) and N rounded up to 8 when N is small; fewer waves win, then
    a fuller last wave, then the larger tile (the DeepGEMM approach). When the tiles do not fill the GPU, (BN,
    splits) pairs are compared with a throughput model (`_split_time`). `split_k` forces the count. Stages fill
    the smem budget.
    """
    bm = row_tile(m)
    k_blocks = -(-k // BK)
    budget = props.smem_per_block_optin
    epi_plain = 4 if accumulate else out_bytes

    def no_split():
        return fewest_waves_bn(m, n, bm, [b for b in _bn_candidates(n) if _bn_fits(bm, b, 1)
                                          and max_stages(bm, b, epi_plain, budget, b_kn) >= 2], props)

    if split_k is not None:
        splits = max(1, min(int(split_k), k_blocks))
    else:
        splits = 1
    bn0 = no_split()
    if split_k is None and not unsplit_fills(m, n, bm, bn0, props) and k_blocks >= 2 * MIN_KBLOCKS_PER_SPLIT:
        _, bm, bn, splits = choose_split(split_candidates(m, n, k, bm, bn0, b_kn, props), m, n, props)
    elif splits > 1:  # forced count: fewest waves of units, then the larger tile
        fits = [b for b in _bn_candidates(n) if _bn_fits(bm, b, splits) and max_stages(bm, b, 4, budget, b_kn) >= 2]
        bn = min(fits, key=lambda b: (-(-(-(-m // bm) * -(-n // b) * splits) // props.sm_count), -b))
    else:
        bn = bn0
    return make_config(m, n, k, out_bytes, props, bm, bn, splits, accumulate, b_kn)


def unsplit_fills(m: int, n: int, bm: int, bn: int, props: DeviceProperties) -> bool:
    """Whether BM x BN tiles keep the GPU busy without split-K: a wave of them, or for M <= 64 (a single
    consumer streaming B) tiles of NARROW_MIN_BN or more columns on SPLIT_BELOW_FILL of the SMs."""
    tiles = -(-m // bm) * -(-n // bn)
    if bm == 64:
        return bn >= NARROW_MIN_BN and tiles >= SPLIT_BELOW_FILL * props.sm_count
    return tiles >= props.sm_count


def make_config(m: int, n: int, k: int, out_bytes: int, props: DeviceProperties, bm: int, bn: int, splits: int,
                accumulate: bool = False, b_kn: bool = False) -> GemmConfig:
    """The full config of a BM x BN tile with `splits` K slices: stages fill the budget, pairs, tile order."""
    epi = 4 if (splits > 1 or accumulate) else out_bytes
    stages = max_stages(bm, bn, epi, props.smem_per_block_optin, b_kn)
    mcast = pick_multicast(m, n, bm, bn, splits, b_kn, props) if MULTICAST else MCAST_NONE
    return GemmConfig(bm, bn, stages, splits, smem_bytes(bm, bn, stages, epi, b_kn), mcast,
                      group_rows(m, n, bm, bn, mcast, props), streams_b(m, k, 2) and not b_kn)


def cluster_tiles(m: int, n: int, bm: int, bn: int, mcast: int) -> tuple[int, int]:
    """Cluster tiles along M and N (ptx/gemm.cu cl_tiles_m / cl_tiles_n): a pair of tiles along M (sharing B)
    or along N (sharing A) under multicast, else one tile; an odd count leaves a spare tile in the last pair."""
    tiles_m, tiles_n = -(-m // bm), -(-n // bn)
    if mcast == MCAST_SHARE_B:
        return -(-tiles_m // 2), tiles_n
    if mcast == MCAST_SHARE_A:
        return tiles_m, -(-tiles_n // 2)
    return tiles_m, tiles_n


def pick_multicast(m: int, n: int, bm: int, bn: int, splits: int, b_kn: bool, props: DeviceProperties,
                   share_b: bool = True) -> int:
    """Pair tiles in 2-CTA clusters when it adds no wave: along M sharing B (halves the B reads), or along N
    sharing A; the side whose half-tile saves more bytes wins. Each half must be whole 8-row swizzle atoms, and B
    as [K, N] is never shared (it comes in panels), nor, with `share_b` False, at all."""
    tiles_m, tiles_n = -(-m // bm), -(-n // bn)
    slots = props.sm_count - props.sm_count % 2

    def waves(mcast):
        cl_m, cl_n = cluster_tiles(m, n, bm, bn, mcast)
        return -(-cl_m * cl_n * (2 if mcast else 1) * splits // slots)

    best, saved = MCAST_NONE, 0
    if share_b and not b_kn and bn % 16 == 0 and tiles_m >= 2 and waves(MCAST_SHARE_B) <= waves(MCAST_NONE):
        best, saved = MCAST_SHARE_B, bn
    if bm % 128 == 0 and tiles_n >= 2 and waves(MCAST_SHARE_A) <= waves(MCAST_NONE) and bm > saved:
        best = MCAST_SHARE_A
    return best


def persistent_grid(launch, m: int, n: int, bm: int, bn: int, mcast: int, splits: int, smem: int,
                    props: DeviceProperties) -> tuple:
    """One CTA per work unit up to one per SM; under multicast, whole 2-CTA clusters, all resident at once
    (the split-K turnstile relies on it)."""
    if not mcast:
        return (max(1, min(-(-m // bm) * -(-n // bn) * splits, props.sm_count)), 1, 1)
    cl_m, cl_n = cluster_tiles(m, n, bm, bn, mcast)
    clusters = min(cl_m * cl_n * splits, props.sm_count // 2, launch.max_active_clusters())
    if clusters < 1:
        raise RuntimeError(f"no 2-CTA cluster of {smem} bytes of shared memory fits this device")
    return (2 * clusters, 1, 1)


def group_rows(m: int, n: int, bm: int, bn: int, mcast: int, props: DeviceProperties) -> int:
    """Cluster-tile rows per group of the tile order. A wave covers about `group x (wave / group)` cluster tiles;
    the group that minimises the A rows plus B rows a wave reads is sqrt(wave * tile_n / tile_m). When all
    tiles fit in one wave the order does not matter (one group: M fastest)."""
    cl_bm = bm * (2 if mcast == MCAST_SHARE_B else 1)
    cl_bn = bn * (2 if mcast == MCAST_SHARE_A else 1)
    cl_tiles_m, cl_tiles_n = cluster_tiles(m, n, bm, bn, mcast)
    wave = props.sm_count // (2 if mcast else 1)
    if cl_tiles_m * cl_tiles_n <= wave:
        return cl_tiles_m
    return max(1, min(cl_tiles_m, round((wave * cl_bn / cl_bm) ** 0.5)))


def l2_promotion(readers: int, splits: int) -> int:
    """TMA L2 promotion (bytes an L2 miss fetches) for an operand map. 256 by default: wide DRAM bursts, and the
    extra 128 bytes are the same rows' next k block. 128 for an operand of a split-K config that several CTAs re-read
    (`readers` tile columns for A, tile rows for B): there the whole grid runs at once and is bound by L2 traffic,
    and one-row fills cut it (H100, same process: 512x512x65536 69.0 -> 65.7 us, 256x256x32768 22.1 -> 20.9; on
    unsplit shapes 128 lost up to 4%: docs/perf-notes.md, session 8)."""
    return 128 if splits > 1 and readers > 1 else 256


def _defines(in_dtype, out_dtype, cfg: GemmConfig, epi: str = "EPI_STORE", c_dtype=None,
             deterministic: bool = False, b_kn: bool = False) -> dict:
    d = {"IN_KIND": _KIND[in_dtype], "OUT_KIND": _KIND[out_dtype], "BM": cfg.bm, "BN": cfg.bn,
         "STAGES": cfg.stages, "EPI": epi}
    if b_kn:
        d["B_KN"] = 1
    if c_dtype is not None:
        d["C_KIND"] = _KIND[c_dtype]
    if deterministic:
        d["DETERMINISTIC"] = 1
    if cfg.mcast:
        d["MCAST"] = cfg.mcast
    if cfg.stream_b:
        d["STREAM_B"] = 1
    return d


BENCH_SHAPES = {
    "large": [(8192, 8192, 8192), (4096, 7168, 16384), (4096, 4096, 7168), (4096, 2112, 7168),
              (4096, 24576, 1536), (4096, 7168, 2048), (4096, 32768, 512)],
    "skinny": [(16, 1280, 8192), (16, 4096, 8192), (64, 7168, 16384), (128, 128, 65536), (256, 256, 32768),
               (128, 2048, 28672), (512, 512, 65536), (1024, 1024, 65536), (2048, 2048, 32768)],
}


def variants():
    """Every kernel variant the heuristic picks for the benchmark shapes, three 192-row shapes, one M that is
    not a multiple of the tile and one decode shape (bf16 in; bf16 and fp32 out; plain, split-K, deterministic
    split-K, accumulate into fp32 D)."""
    from ..runtime.driver import H100

    seen = {}

    def add(cfg, epi, out, deterministic=False):
        d = _defines(dt.bfloat16, out, cfg, epi, deterministic=deterministic)
        seen[tuple(sorted(d.items()))] = ("gemm.cu", "gemm_kernel", d, cfg.smem)

    rows_192 = [(192, 7168, 8192), (192, 7168, 2048), (384, 7168, 8192)]  # 192-row tiles: split, unsplit, pairs
    ragged = [(777, 1000, 4096)]  # M and N not multiples of the tile: edge maps
    decode = [(16, 1280, 4096)]   # the decode kernel (no benchmark shape picks it)
    for shapes in list(BENCH_SHAPES.values()) + [rows_192, ragged, decode]:
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
    for m, n, k in ((8192, 8192, 8192), (128, 128, 65536)):  # B as [K, N]
        cfg = pick_config(m, n, k, 2, H100, b_kn=True)
        d = _defines(dt.bfloat16, dt.bfloat16, cfg, "EPI_SPLIT" if cfg.splits > 1 else "EPI_STORE", b_kn=True)
        seen[tuple(sorted(d.items()))] = ("gemm.cu", "gemm_kernel", d, cfg.smem)
    return list(seen.values())


class _PerThread(threading.local):
    def __init__(self):
        self.maps = AddressedMapCache()


_local = _PerThread()
_plans: dict = {}


class _Workspace:
    """Split-K scratch per (device, stream): an fp32 buffer and int32 counters, zero between launches (the kernel
    re-zeroes what it used). Grown on demand; growing is not possible while a stream captures a CUDA graph."""

    def __init__(self):
        self.w = self.counters = None
        self.w_elems = self.n_counters = 0

    def ensure(self, w_elems: int, n_counters: int, device: int, stream) -> None:
        if w_elems > self.w_elems:
            self.w_elems = max(w_elems, 1 << 20)
            self.w = DeviceArray.empty((self.w_elems,), dt.float32, device, stream)
            check(cu.cuMemsetD32Async(self.w.ptr, 0, self.w_elems, self.w.stream))
        if n_counters > self.n_counters:
            self.n_counters = max(n_counters, 4096)
            self.counters = DeviceArray.empty((self.n_counters,), dt.int32, device, stream)
            check(cu.cuMemsetD32Async(self.counters.ptr, 0, self.n_counters, self.counters.stream))


_workspaces: dict = {}
_ws_lock = threading.Lock()


def _workspace(device: int, h: int) -> _Workspace:
    ws = _workspaces.get((device, h))
    if ws is None:
        with _ws_lock:
            ws = _workspaces.setdefault((device, h), _Workspace())
    return ws


def _same_memory(x: DeviceArray, y: DeviceArray) -> bool:
    return x.ptr == y.ptr and x.shape == y.shape and x.strides == y.strides and x.dtype is y.dtype


@dataclass(frozen=True)
class _Plan:
    cfg: GemmConfig
    epi: str
    launch: object
    grid: tuple
    map_a: tuple       # tensor-map layouts (dtype, dims, strides, box, swizzle, L2 promotion)
    map_b: tuple
    map_a_edge: tuple  # the boxes across M and N (`edge_map`)
    map_b_edge: tuple
    map_out: tuple
    ld_w: int
    n_counters: int
    workspace: bool    # needs the split-K workspace / counters
    uses_c: bool       # C is read (not accumulate-in-place)


def _validate(av, bv, dv, cv, b_kn=False):
    require(av, "a", dtypes=_INPUTS, ndim=2)
    require(bv, "b", dtypes=_INPUTS, ndim=2)
    if bv.dtype is not av.dtype:
        raise TypeError(f"a and b must have the same dtype, got {av.dtype.name} and {bv.dtype.name}")
    m, k = av.shape
    kb, n = bv.shape if b_kn else bv.shape[::-1]
    if kb != k:
        layout = "[K, N]" if b_kn else "[N, K]"
        raise ValueError(f"a is [M, K] = {av.shape} but b is {layout} = {bv.shape}: K differs")
    require(dv, "out", dtypes=_OUTPUTS, ndim=2, shape=(m, n))
    if cv is not None:
        require(cv, "c", dtypes=_OUTPUTS, ndim=2, shape=(m, n))
    for name, x in (("b", bv), ("out", dv), ("c", cv)):
        if x is not None and x.device != av.device:
            raise ValueError(f"{name} is on cuda:{x.device} but a is on cuda:{av.device}")
    if k == 0:
        raise ValueError("K must be at least 1")


@dataclass(frozen=True)
class _DecodePlan:
    cfg: DecodeConfig
    launch: object
    grid: tuple
    uses_c: bool


def _plan(av, bv, dv, cv, accumulate, split_k, deterministic, b_kn, props):
    _validate(av, bv, dv, cv, b_kn)
    m, k = av.shape
    n = dv.shape[1]
    dc = pick_decode(m, n, k, props, split_k, b_kn)
    if dc is not None:  # bitwise reproducible by construction, so `deterministic` needs nothing more
        defines = _decode_defines(av.dtype, dv.dtype, dc, None if cv is None else cv.dtype)
        launch = get_launcher("gemm_decode.cu", "gemm_decode_kernel", defines, av.device, _DECODE_ARGS,
                              (dc.threads,), 0, pdl=PDL)
        return _DecodePlan(dc, launch, (-(-n // (8 * dc.g)), 1, 1), cv is not None)
    cfg = pick_config(m, n, k, dv.dtype.itemsize, props, split_k, accumulate, b_kn)
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
                          cluster=(cfg.cluster, 1, 1) if cfg.mcast else None, pdl=PDL)
    tiles = -(-m // cfg.bm) * -(-n // cfg.bn)
    grid = persistent_grid(launch, m, n, cfg.bm, cfg.bn, cfg.mcast, cfg.splits, cfg.smem, props)
    it = av.dtype.itemsize
    ld_w = -(-n // 4) * 4
    cl_m, cl_n = cluster_tiles(m, n, cfg.bm, cfg.bn, cfg.mcast)
    map_a = (av.dtype, (k, m), (av.strides[0] * it,), (BK, box_rows(cfg.bm, cfg.mcast == MCAST_SHARE_A)), 128,
             l2_promotion(cl_n, cfg.splits))
    if b_kn:  # [K, N]: boxes of 64 N x 64 K, loaded panel by panel (no edge map)
        map_b = map_b_edge = (bv.dtype, (n, k), (bv.strides[0] * it,), (64, BK), 128, l2_promotion(cl_m, cfg.splits))
    else:
        map_b = (bv.dtype, (k, n), (bv.strides[0] * it,), (BK, box_rows(cfg.bn, cfg.mcast == MCAST_SHARE_B)), 128,
                 l2_promotion(cl_m, cfg.splits))
        map_b_edge = edge_map(map_b, n)
    epi_bytes = 4 if epi != "EPI_STORE" else dv.dtype.itemsize
    box_out = (epilogue_chunk(cfg.bn, epi_bytes), 64)
    swz = epilogue_swizzle(cfg.bn, epi_bytes)
    if epi == "EPI_SPLIT":
        map_out = (dt.float32, (n, m), (ld_w * 4,), box_out, swz)
    else:
        map_out = (dv.dtype, (n, m), (dv.strides[0] * dv.dtype.itemsize,), box_out, swz)
    workspace = epi == "EPI_SPLIT" or (epi == "EPI_ACCUMULATE" and det)
    return _Plan(cfg, epi, launch, grid, map_a, map_b, edge_map(map_a, m), map_b_edge, map_out, ld_w,
                 tiles * (cfg.bm // 64), workspace, c_dtype is not None)


def gemm(a, b, out=None, c=None, *, b_layout: str = "nk", split_k=None, deterministic: bool = False,
         out_dtype=None, stream=None):
    """D = A @ B^T (+ C).

    A [M, K] and B [N, K] (or B [K, N] with b_layout="kn": D = A @ B), both bf16 or both fp16, fp32 accumulation.
    D [M, N] in `out`'s dtype (or `out_dtype`, default the input dtype): bf16, fp16 or fp32. `c` [M, N] (bf16,
    fp16 or fp32) is added; with `c is out` and an fp32 `out`, D += A @ B^T accumulates in place through TMA
    reduce-add. `split_k` forces the split count
    (None: the heuristic decides; 1: off); `deterministic=True` makes split-K bitwise reproducible (K order).
    Rows must be 16-byte aligned (K and N multiples of 8 for 16-bit data); every M, N, K tail is handled in the
    kernel. Runs on `stream`; returns `out` (allocated when None).
    """
    if b_layout not in ("nk", "kn"):
        raise ValueError(f"b_layout must be 'nk' (B is [N, K]) or 'kn' (B is [K, N]), got {b_layout!r}")
    b_kn = b_layout == "kn"
    if split_k is not None and (int(split_k) != split_k or split_k < 1):
        raise ValueError(f"split_k must be a positive integer or None, got {split_k!r}")
    h = stream_handle(stream)
    av = as_array(a, h)
    bv = as_array(b, h)
    if out is None:
        require(av, "a", dtypes=_INPUTS, ndim=2)
        require(bv, "b", dtypes=_INPUTS, ndim=2)
        od = dt.as_dtype(out_dtype) if out_dtype is not None else av.dtype
        if od not in _OUTPUTS:
            raise TypeError(f"out_dtype {od.name} not supported (bfloat16, float16, float32)")
        dv = DeviceArray.empty((av.shape[0], bv.shape[1] if b_kn else bv.shape[0]), od, av.device, stream)
    else:
        dv = as_array(out, h)
    cv = None if c is None else (dv if c is out else as_array(c, h))
    accumulate = cv is not None and dv.dtype is dt.float32 and _same_memory(cv, dv)
    key = (av.shape, av.strides, av.dtype, av.ptr & 15, bv.shape, bv.strides, bv.dtype, bv.ptr & 15, dv.shape,
           dv.strides, dv.dtype, dv.ptr & 15, None if cv is None else (cv.shape, cv.strides, cv.dtype, cv.ptr & 15,
           accumulate), split_k, deterministic, b_kn, av.device, bv.device, dv.device,
           None if cv is None else cv.device)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) > 1024:
            _plans.clear()
        if av.ndim == 2 and bv.ndim == 2 and dv.ndim == 2 and (dv.shape[0] == 0 or dv.shape[1] == 0):
            _validate(av, bv, dv, cv, b_kn)
            return dv if out is None else out
        plan = _plans[key] = _plan(av, bv, dv, cv, accumulate, split_k, deterministic, b_kn,
                                   device_properties(av.device))
    if isinstance(plan, _DecodePlan):
        c_ptr, ld_c = (cv.ptr, cv.strides[0]) if plan.uses_c else (0, 0)
        plan.launch(plan.grid, h, av.ptr, av.strides[0], bv.ptr, bv.strides[0], dv.ptr, dv.strides[0], c_ptr, ld_c,
                    av.shape[0], dv.shape[1], av.shape[1])
        return dv if out is None else out
    maps = _local.maps
    w_ptr = counters = 0
    if plan.workspace:
        ws = _workspace(av.device, h)
        ws.ensure(dv.shape[0] * plan.ld_w if plan.epi == "EPI_SPLIT" else 0, plan.n_counters, av.device, stream)
        counters = ws.counters.ptr
        if plan.epi == "EPI_SPLIT":
            w_ptr = ws.w.ptr
    out_ptr = w_ptr if plan.epi == "EPI_SPLIT" else dv.ptr
    c_ptr, ld_c = (cv.ptr, cv.strides[0]) if plan.uses_c else (0, 0)
    m, k = av.shape
    map_a, map_a_edge = operand_maps(maps, "a", plan.map_a, plan.map_a_edge, av.ptr)
    map_b, map_b_edge = operand_maps(maps, "b", plan.map_b, plan.map_b_edge, bv.ptr)
    plan.launch(plan.grid, h, map_a, map_b, map_a_edge, map_b_edge, maps.get("out", plan.map_out, out_ptr), dv.ptr,
                dv.strides[0], w_ptr, plan.ld_w, c_ptr, ld_c, counters, m, dv.shape[1], k, plan.cfg.splits,
                plan.cfg.group_m)
    return dv if out is None else out
