"""FP8 block-scaled GEMMs (the DeepGEMM recipe): D[bf16] = (A[e4m3] * sA) @ (B[e4m3] * sB)^T, with sA one fp32
scale per 1x128 group of A's rows ([M, ceil(K/128)]) and sB one per 128x128 block of B ([ceil(N/128), ceil(K/128)]),
exactly what `quantize_fp8_per_token` and `quantize_fp8_per_block` produce; the MoE grouped forms (contiguous
rows per expert, masked per-expert batches) and the K-grouped weight gradient with 1x128 scales on both sides,
accumulated into an fp32 D. One kernel, ptx/gemm_fp8.cu, compiled per layout."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace

from ..runtime import dtypes as dt
from ..runtime.driver import DeviceProperties, device_properties, enter_device, leave_device
from ..runtime.interop import DeviceArray, call_arrays, require, same_device
from ..runtime.launch import ArgsMemo, get_launcher
from ..runtime.plans import PLANS
from ..runtime.scratch import SCRATCH
from . import sm90
from .quantize import mmajor_stride
from .sm90 import MCAST_NONE, MCAST_SHARE_A, MCAST_SHARE_B, MapLayout

BK = 128                 # k per stage: 128 e4m3 bytes, one scale block
MAX_BN = 256             # above 192 a k block runs as two column halves through one scratch set (A in registers)
MAX_STAGES = 12
ALIGN_SLACK = 1024
_ARGS = ("tmap", "tmap", "tmap", "tmap", "tmap", "tmap", "tmap", "ptr", "i64", "i64", "i64", "ptr", "ptr", "ptr",
         "i64", "i32", "i32", "i32", "i32", "i32")
# ptx/gemm_fp8.cu LAYOUT values
NORMAL, CONTIGUOUS, MASKED, KGROUPED = "LAYOUT_NORMAL", "LAYOUT_CONTIGUOUS", "LAYOUT_MASKED", "LAYOUT_KGROUPED"
_CONVERT_ARGS = ("ptr", "i64", "i64", "ptr", "i64", "i32", "i32", "i32", "i32")
_CONVERT_THREADS = 256
_FILL_ARGS = ("ptr", "i32", "i32[512]")  # ptx/fill.cu
_FILL_MAX = 512
_LIST_ARGS = ("ptr", "i32", "i32", "i32", "i32", "ptr")  # ptx/contiguous_tiles.cu
_LIST_THREADS = 1024


@dataclass(frozen=True)
class Fp8Tuning(sm90.Sm90Tuning):
    """The FP8 GEMMs' heuristic constants (docs/tuning.md: what each controls, how it was fitted). Pass one to
    the ops' `tuning=` or to `pick_config`; plans are cached per tuning object."""
    max_bn_memory_bound: int = 192  # one wave of 256-wide tiles ran 10-25% slower than two of 128
    min_stages: int = 4             # the stage cap at one tile's k blocks never goes below this
    # Time of one tile in a wave, microseconds: ((BM, BN), (fixed, per 128-deep k block)); other widths of
    # 128-row tiles scale 128 x 128 per column and k block by bn_cost (bn_cost_wgrad for the weight gradient).
    # The 64-row entries are the widths of the one-wave 64-row tiles that may replace a few rows of 128.
    tile_us: tuple = (((128, 128), (1.12, 0.514)), ((128, 192), (1.23, 0.705)), ((128, 256), (1.93, 1.057)),
                      ((256, 128), (1.5, 0.94)), ((192, 128), (1.0, 0.68)), ((64, 80), (1.0, 0.265)),
                      ((64, 96), (1.0, 0.275)),
                      ((64, 128), (1.0, 0.30)))
    bn_cost: tuple = ((64, 1.35), (96, 1.27), (160, 0.94))
    bn_cost_wgrad: tuple = ((64, 1.35), (96, 1.27), (128, 1.0), (160, 1.06), (192, 0.85), (256, 0.9))
    # The weight gradient's other tiles, as tile_us: 192 x 128 (three consumers), a candidate from
    # wgrad_tall_min_kb k blocks a tile, taken where its estimate is at most wgrad_tall_gain of the best 128-row
    # tile's (H200: 0.95-0.98x the time there; 1.03-1.10x at estimates of 0.991-0.994, 1.02x at 8 k blocks).
    tile_us_wgrad: tuple = (((192, 128), (1.43, 0.636)),)
    wgrad_tall_min_kb: int = 16
    wgrad_tall_gain: float = 0.985
    # One row of 128-row tiles: 64-row tiles of up to narrow_rows_max_bn columns where they stream at most
    # narrow_rows_gain of the fill per CTA.
    narrow_rows_max_bn: int = 64
    narrow_rows_gain: float = 0.85
    # Those two rows of 64-row tiles (M 65..128, no split) pair along M, sharing B, where the tiles are at least
    # narrow_pair_min_bn wide; an unsplit row of 128 x BN tiles becomes such pairs of 64 x 2BN tiles (the same
    # CTAs, half of A each) up to narrow_pair_max_bn.
    narrow_pair_min_bn: int = 64
    narrow_pair_max_bn: int = 128
    # Split-K in two where it cuts each CTA's fill to split_gain or less, K >= split_min_k, and B is at most
    # split_max_b_bytes (split_wide_max_b_bytes where the unsplit tiles are split_wide_bn or more columns wide and
    # busy half the SMs); one row of tiles at least unsplit_min_bn wide that busies unsplit_fill of the SMs (and
    # M >= unsplit_min_m) does not split, except a row of 64-row tiles narrower than split_wide_bn on a part whose
    # copy rate gives each SM more than unsplit_max_sm_stream bytes/s, which splits whatever B's size: there B no
    # longer streams at DRAM speed either way, and the split's smaller fill per CTA wins (H200, 32 GB/s an SM: 64 x
    # 32 -> 64 x 64 split in two 0.66-0.99x the time, but 64 x 48 -> 64 x 80 1.03-1.09x; on the H100, 22.7 GB/s an
    # SM, the split lost).
    split_gain: float = 0.67
    split_max_b_bytes: int = 64 << 20
    split_wide_max_b_bytes: int = 32 << 20
    split_wide_bn: int = 48
    unsplit_fill: float = 0.8
    unsplit_min_m: int = 8
    unsplit_min_bn: int = 32
    split_min_k: int = 4096
    unsplit_max_sm_stream: float = 27e9
    # The normal GEMM's 256 x 128 tiles pair along N (sharing A), and the masked layout's 128-row tiles pair at
    # all, only on a part whose copy rate per SM is at most pair_a_max_sm_stream: the pair's lockstep costs more
    # than the halved reads save where DRAM is fast (H200, 32 GB/s an SM: normal 256 x 128 unpaired 0.967-0.994x
    # the paired time on 14 shapes at M 1024-4096; masked 128-row tiles of uneven groups, along N 0.980x geomean
    # on 18 cases, along M 0.968x on 20, 0.89-1.002; 256 x 128 masked 0.99-1.015x and contiguous 0.996-0.999x, so
    # those stay paired; not measured on the H100, 22.7 GB/s an SM, whose picks stay paired as measured there).
    pair_a_max_sm_stream: float = 27e9
    # Contiguous 128-row tiles (pairs along N, sharing A) unpair on such a part too where the groups average at
    # least this many rows of tiles: H200, 0.974x geomean on 58 cases at alignment 128 (0.92-1.011), 0.978x on 50
    # at 64; where a group is about one row of tiles the pair's halved A reads pay (1.0-1.16 rows: 0.98-1.08x
    # unpaired, 1.012x geomean on 11 cases).
    contiguous_pair_max_group_rows: float = 1.25
    # The normal GEMM's unsplit 128-row tiles of up to 128 columns, and one row of 64-row tiles (M <= 64) of
    # scales_at_issue_bn columns, load a k block's scales when its wgmma group is issued (SCALES_AT_ISSUE), from
    # K = scales_at_issue_min_k: H200, 128 x 80..128 0.94-0.98x the time, 64 x 64 0.92-0.97x, 64 x 96 0.97-1.0x;
    # 64 x 48 1.01-1.07x, two rows of 64-row tiles (M 65..128) 1.01-1.06x and K = 512 1.03-1.05x keep the loads
    # after the wait. The masked layout's alike (M: a group's rows): H200, 128 x 64..128 0.92-0.995x, 64 x 96
    # 0.96-0.97x; 64 x 48 1.02-1.03x.
    scales_at_issue_bn: tuple = (64, 96)
    scales_at_issue_min_k: int = 2048
    force_tile: tuple | None = None  # tests: (BM, BN) for every GEMM (the heuristic picks the rest)
    force_splits: int | None = None  # tests, with force_tile: split-K over clusters of this many CTAs


TUNING = Fp8Tuning()


@dataclass(frozen=True)
class Fp8Config:
    bm: int
    bn: int
    stages: int
    smem: int                      # dynamic shared memory bytes, alignment slack included
    mcast: int = MCAST_NONE        # 2-CTA pairs along M (sharing B) or along N (sharing A)
    group_m: int = 1               # cluster-tile rows per group of the tile order
    layout: str = NORMAL
    splits: int = 1                # split-K: a cluster of `splits` CTAs per tile, one K slice each
    stream_b: bool = False         # B loaded with an evict-first L2 policy (sm90.streams_b)
    tile_list: int = 0             # contiguous tiles that the segments' alignment (this) is not a multiple of:
                                   # from a list (TILE_LIST)
    warm_l2: bool = False          # B's first k block into L2 before pdl_wait (L2_WARM; normal layout, PDL)
    scales_at_issue: bool = False  # a k block's scales loaded at its wgmma issue (SCALES_AT_ISSUE; Fp8Tuning)

    @property
    def consumers(self) -> int:
        return _consumers(self.bm)

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def cluster(self) -> int:
        return 2 if self.mcast else self.splits


def _consumers(bm: int) -> int:
    """Consumer warpgroups of a BM-row tile (ptx/gemm_fp8.cu CONSUMERS)."""
    return 1 if bm == 64 else 3 if bm == 192 else 2


def fits_segments(bm: int, alignment: int) -> bool:
    """Whether a BM-row tile row holds the rows of at most two contiguous segments that start at multiples of
    `alignment` (ptx/contiguous_tiles.cu: at most one segment start inside it)."""
    return bm <= alignment + math.gcd(alignment, bm)


def _straddles(bm: int, alignment: int) -> float:
    """The share of segment starts that fall inside a BM-row tile row rather than on its first row."""
    return 1 - alignment / math.lcm(alignment, bm)


def _out_bytes(layout: str) -> int:
    return 4 if layout == KGROUPED else 2


def _chunk(bn: int, out_bytes: int = 2) -> int:
    """Output columns per epilogue chunk (ptx/gemm_fp8.cu CH): rows of at most 128 bytes (64 for BN > 192)."""
    top = (64 if bn > 192 else 128) // out_bytes
    return top if bn % top == 0 else 32 if bn % 32 == 0 else 16


def smem_bytes(bm: int, bn: int, stages: int, layout: str = NORMAL) -> int:
    """Mirror of ptx/gemm_fp8.cu's layout: A, B, sA (and for the weight gradient sB) stages, the output buffers
    (WHOLE_OUT or two chunks per consumer) from a 1024-byte boundary, two barriers per stage, alignment slack."""
    sb = -(-bn * 4 // 128) * 128 if layout == KGROUPED else 0  # each stage's at a 128-byte boundary
    stages_end = stages * (bm * BK + bn * BK + bm * 4 + sb)
    d = -(-stages_end // 1024) * 1024
    ob = _out_bytes(layout)
    if 128 <= bn <= 192 and layout != KGROUPED:  # WHOLE_OUT: every consumer stages its whole slice of the tile
        out = bm * bn * ob
    else:                                 # a ring of two 64-row chunk buffers per consumer
        out = _consumers(bm) * 2 * 64 * _chunk(bn, ob) * ob
    return d + out + 16 * stages + ALIGN_SLACK


def max_stages(bm: int, bn: int, budget: int, layout: str = NORMAL) -> int:
    s = MAX_STAGES
    while s > 0 and smem_bytes(bm, bn, s, layout) > budget:
        s -= 1
    return s


def _tile_us(bm: int, bn: int, k_blocks: int, layout: str, tuning: Fp8Tuning) -> float:
    """Estimated time of one BM x BN tile over `k_blocks` k blocks (tile_us, else scaled from 128 x 128)."""
    table = dict(tuning.tile_us_wgrad if layout == KGROUPED else tuning.tile_us)
    if (bm, bn) in table:
        fixed, per_kb = table[bm, bn]
    else:
        fixed, per_kb = dict(tuning.tile_us)[128, 128]
        rel = dict(tuning.bn_cost_wgrad if layout == KGROUPED else tuning.bn_cost)[bn]
        fixed, per_kb = fixed * bn / 128, per_kb * bn / 128 * rel
    return fixed + per_kb * k_blocks


def _fill(m: int, n: int, k: int, bm: int, bn: int, splits: int, props: DeviceProperties) -> float:
    """Bytes each CTA streams into shared memory: waves of (tile x split) units, (BM + BN) x K / splits each."""
    units = -(-m // bm) * -(-n // bn) * splits
    return -(-units // props.sm_count) * (bm + bn) * k / splits


def _split_in_two(m: int, n: int, k: int, unsplit: tuple, props: DeviceProperties, tuning: Fp8Tuning,
                  idle: bool = False, any_b: bool = False) -> tuple | None:
    """(BM, BN) of a 2-way split-K with one wave of (tile, split) units and the least fill per CTA, when it cuts
    the fill of the `unsplit` (BM, BN) tiles by split_gain, K is at least split_min_k and B within the limits
    (`idle`: the unsplit tiles leave half the SMs idle; `any_b`: no limit); else None."""
    t = tuning
    wide = unsplit[1] >= t.split_wide_bn and not idle
    if k < t.split_min_k or not any_b and n * k > (t.split_wide_max_b_bytes if wide else t.split_max_b_bytes):
        return None
    split = []  # per tile height, the narrowest width with one wave of (tile, split) units
    for rows in (64, 128) if m > 64 else (64,):
        widths = [b for b in range(16, t.max_bn_memory_bound + 1, 16)
                  if -(-m // rows) * -(-n // b) * 2 <= props.sm_count]
        if widths:
            split.append((_fill(m, n, k, rows, widths[0], 2, props), rows, widths[0]))
    if split:
        fill, rows, cols = min(split)
        if fill <= t.split_gain * _fill(m, n, k, *unsplit, 1, props):
            return rows, cols
    return None


def _small_m(m: int, n: int, k: int, bm: int, bn: int, props: DeviceProperties, tuning: Fp8Tuning) -> tuple:
    """For one row of BM x BN tiles (M <= 128, memory-bound): (BM, BN, splits). For BM = 128, 64-row tiles when
    they cut the fill per CTA to narrow_rows_gain or less; then a 2-way split-K (`_split_in_two`) unless one row
    of tiles already busies unsplit_fill of the SMs (`under_dram`: not for a row of 64-row tiles narrower than
    split_wide_bn on a part with more than unsplit_max_sm_stream of copy rate per SM, which splits whatever B's
    size); else, for M > 64, a row of 128 x BN tiles becomes two rows of 64 x 2BN (up to narrow_pair_max_bn), which
    pick_config pairs."""
    t = tuning
    best = (bm, bn)
    if bm == 128:
        narrow = min(range(16, t.narrow_rows_max_bn + 1, 16), key=lambda b: (_fill(m, n, k, 64, b, 1, props), -b))
        if _fill(m, n, k, 64, narrow, 1, props) <= t.narrow_rows_gain * _fill(m, n, k, 128, bn, 1, props):
            best = (64, narrow)
    # (a row that runs under the DRAM rate: Fp8Tuning's comment on unsplit_max_sm_stream)
    under_dram = (best[0] == 64 and best[1] < t.split_wide_bn
                  and props.stream_bytes_per_s > t.unsplit_max_sm_stream * props.sm_count)
    fills = (not under_dram and t.unsplit_min_m <= m <= best[0] and best[1] >= t.unsplit_min_bn
             and -(-n // best[1]) >= t.unsplit_fill * props.sm_count)
    # (one row of tiles that fills the SMs does not split: two rows of 64 at 96x2112x16384 split ran 1.22x slower)
    split = None if fills else _split_in_two(m, n, k, best, props, t, any_b=under_dram)
    if split:
        return split + (2,)
    # One row of 128 x BN tiles, M > 64: as many pairs of 64 x 2BN tiles along M (pick_config pairs them), each
    # CTA with half of A's rows and, multicast, half of B's 2BN (H100: 0.84-0.98x the time at BN 48 and 64).
    if best[0] == 128 and m > 64 and 2 * best[1] <= t.narrow_pair_max_bn:
        best = (64, 2 * best[1])
    return best + (1,)


def pick_config(m: int, n: int, k: int, props: DeviceProperties, layout: str = NORMAL, groups: int = 1,
                alignment: int = 256, tuning: Fp8Tuning = TUNING, expected_m: int | None = None) -> Fp8Config:
    """The tile, stages, 2-CTA pairing and tile order for one GEMM (for the masked and K-grouped layouts m is one
    group's rows and the waves count all `groups` groups' tiles). Contiguous: the segments start at multiples of
    `alignment` rows; tiles whose rows the alignment is not a multiple of (128 rows at alignment 64, 192 at 128
    or 256, 256 at 128: `fits_segments`) come from a tile list (`tile_list`), where a tile row that holds two
    segments' rows counts once per segment: the tile cost counts that share of the groups more rows of them
    (`_straddles`; segment sizes that are random multiples of the alignment). At alignment 64 that is always
    128-row tiles.

    BM 64 for M <= 64 (one consumer warpgroup). With several row blocks of 128 (compute-bound), the tile with the
    least waves x estimated tile time (`_tile_us`) among 128 x (64..256), 256 x 128 (normal GEMM from 512
    rows, masked from 256 rows a group, contiguous when the segments allow it) and 192 x 128 (three consumer
    warpgroups; normal GEMM from 512 rows and contiguous at alignment 128 or 256, where tile_us has it), then,
    for the normal GEMM where that pick does not split, one wave of 64-row tiles where cheaper; otherwise
    (memory-bound) BM 128 and BN a multiple of 16 up to max_bn_memory_bound (or N rounded up to 16) with the
    fewest waves, then the fullest last wave, then the widest; for M <= 128, 64-row tiles when they stream less
    per CTA (`_small_m`; their two rows pair along M, sharing B, from narrow_pair_min_bn columns). Either way, a
    2-way split-K over 2-CTA clusters where it streams much less per CTA and, for several rows of tiles,
    where the tiles would leave half the SMs idle (`_split_in_two`). Stages fill the shared-memory budget, up to
    one tile's k blocks (at least min_stages). Pairs and tile order as for the BF16 GEMM, but no pairs with a
    single row of tiles (sharing A there saved nothing and cost 3-8%) or for the weight gradient (10% slower
    there), none along N for the normal GEMM's 256 x 128 tiles and none for the masked layout's 128-row tiles on
    a part with more than pair_a_max_sm_stream of copy rate per SM (nor contiguous 128-row tiles there, unless the
    groups average fewer than contiguous_pair_max_group_rows rows of tiles), and contiguous tiles pair along N only
    (two tiles along M may belong to two experts).
    Unsplit 128-row tiles of up to 128 columns and a single row of 64-row tiles of scales_at_issue_bn columns load
    their scales at the wgmma issue (SCALES_AT_ISSUE) from K = scales_at_issue_min_k (normal and masked layouts).
    Masked, `expected_m` (the rows a group is expected to hold, at most M) replaces M in all of this, a group
    counting rows / BM + 0.5 tiles (at least one, at most M's)."""
    t = tuning
    # (masked: the rows a group is expected to hold, which the tiles are counted for; at most M)
    rows = min(m, max(1, expected_m)) if layout == MASKED and expected_m is not None else m
    bm = 64 if rows <= 64 else 128
    splits = 1
    per_group = layout in (MASKED, KGROUPED)

    def group_tiles(tbm):  # a group's tile rows: as many as M needs, or fewer for the hint (the last half full)
        return -(-m // tbm) if rows == m else min(-(-m // tbm), max(1.0, rows / tbm + 0.5))

    def tile_rows_of_groups(tbm):
        return math.ceil(groups * group_tiles(tbm))
    m_all = tile_rows_of_groups(bm) * bm if per_group else m  # rows that the tile count sees
    tiles_m = -(-m_all // bm)
    budget = props.smem_per_block_optin
    top = min(MAX_BN, max(16, -(-n // 16) * 16))
    k_blocks = -(-(k // groups if layout == KGROUPED else k) // BK)  # one tile's k blocks
    if t.force_tile is not None:
        bm, bn = t.force_tile
        if layout == CONTIGUOUS and not fits_segments(bm, alignment):
            raise ValueError(f"force_tile has {bm} rows: at alignment {alignment} a tile row could hold the rows of "
                             "three segments (two at most)")
        if bm not in (64, 128, 192, 256) or bn % 16 or not 16 <= bn <= (128 if bm >= 192 else MAX_BN):
            raise ValueError(f"force_tile {(bm, bn)}: BM is 64, 128, 192 or 256 and BN a multiple of 16 up to "
                             f"{MAX_BN} (128 for 192 and 256 rows)")
        if bm == 192 and layout == MASKED:
            raise ValueError("force_tile: 192-row tiles are for the normal, contiguous and K-grouped layouts")
        splits = t.force_splits or 1
        if splits > 1 and (bm > 128 or splits > 8 or layout != NORMAL):
            raise ValueError(f"force_splits {splits}: split-K takes tiles of at most 128 rows, 2..8 slices, "
                             "the normal layout")
        m_all = tile_rows_of_groups(bm) * bm if per_group else m
        tiles_m = -(-m_all // bm)
    elif bm == 128 and tiles_m >= 2 and n > 128:
        widths = dict(t.bn_cost_wgrad) if layout == KGROUPED else {*dict(t.bn_cost), *(b for (a, b), _ in t.tile_us
                                                                                          if a == 128)}
        cands = [(128, b) for b in widths if b <= top]
        tall = {NORMAL: m >= 512, MASKED: m >= 256, CONTIGUOUS: True, KGROUPED: k_blocks >= t.wgrad_tall_min_kb}[layout]
        def tall_fits(tbm):
            return tall and (layout != CONTIGUOUS or fits_segments(tbm, alignment))
        if tall_fits(256) and layout != KGROUPED:
            cands.append((256, 128))
        if tall_fits(192) and layout != MASKED and (192, 128) in dict(  # (masked: not measured)
                t.tile_us_wgrad if layout == KGROUPED else t.tile_us):
            cands.append((192, 128))

        def cost(c):
            tbm, tbn = c
            straddling = int(groups * _straddles(tbm, alignment)) if layout == CONTIGUOUS else 0
            tile_rows = tile_rows_of_groups(tbm) if per_group else -(-m_all // tbm) + straddling
            tiles = tile_rows * -(-n // tbn)
            est = -(-tiles // props.sm_count) * _tile_us(tbm, tbn, k_blocks, layout, t)
            if layout == KGROUPED and tbm == 192:  # (near ties went to the 128-row tiles, measured)
                est /= t.wgrad_tall_gain
            return est, -tbn, tbm
        bm, bn = min(cands, key=cost)
        m_all = tile_rows_of_groups(bm) * bm if per_group else m
        tiles_m = -(-m_all // bm)
        # Tiles that leave half the SMs idle (small N at a few rows of tiles): a 2-way split fills them (H100, 69
        # shapes at M 136..1000, all faster: 192x1536x7168 18.1 -> 12.1 us, 512x256x16384 37.5 -> 17.4; where the
        # tiles already fill the SMs it lost: 192x4096x7168 20.0 -> 21.0).
        def split_idle(bm, bn):
            if layout == NORMAL and -(-m_all // bm) * -(-n // bn) <= props.sm_count // 2:
                return _split_in_two(m, n, k, (bm, bn), props, t, idle=True)
            return None
        split = split_idle(bm, bn)
        # Where that pick does not split: one wave of 64-row tiles (one consumer, two scratch sets) if cheaper:
        # fewer idle rows than a few rows of 128-row tiles, more SMs busy, no 64-column wgmma. The widest of them
        # split in two where they leave half the SMs idle (681x768x16384: 0.85x the time of unsplit 64 x 80).
        narrow = [c for c, _ in t.tile_us if c[0] == 64 and -(-m // 64) * -(-n // c[1]) <= props.sm_count]
        cheapest = min(narrow, key=cost) if narrow and not split and layout == NORMAL else None
        if cheapest and cost(cheapest) < cost((bm, bn)):
            widest = max(narrow, key=lambda c: c[1])
            split = split_idle(*widest)
            bm, bn = widest if split else cheapest
            tiles_m = -(-m // 64)
        if split:
            (bm, bn), splits = split, 2
    else:
        widths = [b for b in range(16, min(top, t.max_bn_memory_bound) + 1, 16)
                  if max_stages(bm, b, budget, layout) >= 3]
        bn = sm90.fewest_waves_bn(m_all, n, bm, widths, props)
        if layout == NORMAL and tiles_m == 1:
            bm, bn, splits = _small_m(m, n, k, bm, bn, props, t)
            # Two rows of 64-row tiles: paired they read B once (H100, 128x4096x7168 14.8 -> 13.4 us); narrower
            # tiles gained nothing (bn 16..48: 0.98-1.02x). A row of 128 stays unpaired (tiles_m stays 1).
            if bm == 64 and m > 64 and splits == 1 and bn >= t.narrow_pair_min_bn:
                tiles_m = 2
    # Stages beyond one tile's k blocks (at least min_stages) only prefetch the next tile, which competes for DRAM
    # with this tile's loads: H100, 64x32768x512 (four k blocks) 9.5 us with 4 stages against 10.6 with 8.
    stages = min(max_stages(bm, bn, budget, layout), max(k_blocks, t.min_stages))
    if t.force_tile is not None:
        stages = max_stages(bm, bn, budget, layout)
    # Tiles paired along M share B: they must be of one group (masked, K-grouped: pairs form within a group, and
    # masked rows left over run unshared, so groups of one row of tiles would share nothing; contiguous: never).
    share_b = layout == NORMAL or (per_group and group_tiles(bm) >= 2)
    mcast = MCAST_NONE
    if (tiles_m >= 2 or t.force_mcast is not None) and layout != KGROUPED and splits == 1:  # (forced: spare tiles too)
        mcast = sm90.pick_multicast(m_all, n, bm, bn, 1, False, props, t, share_b)
        fast_part = props.stream_bytes_per_s > t.pair_a_max_sm_stream * props.sm_count
        tall_groups = layout == CONTIGUOUS and m >= t.contiguous_pair_max_group_rows * bm * groups
        if fast_part and t.force_mcast is None and (
                (layout, bm, mcast) == (NORMAL, 256, MCAST_SHARE_A) or bm == 128 and (layout == MASKED or tall_groups)):
            mcast = MCAST_NONE
    group_m = 1 if t.force_splits else sm90.group_rows(m if per_group else m_all, n, bm, bn, mcast, props)
    stream_b = layout == NORMAL and sm90.streams_b(m, k, 1, t)
    tile_list = alignment if layout == CONTIGUOUS and alignment % bm else 0
    warm_l2 = layout == NORMAL and t.pdl and t.warm_l2
    scales_at_issue = layout in (NORMAL, MASKED) and k >= t.scales_at_issue_min_k and (
        bm == 128 and bn <= 128 and splits == 1 or bm == 64 and m <= 64 and bn in t.scales_at_issue_bn)
    return Fp8Config(bm, bn, stages, smem_bytes(bm, bn, stages, layout), mcast, group_m, layout, splits, stream_b,
                     tile_list, warm_l2, scales_at_issue)


def _defines(cfg: Fp8Config) -> dict:
    d = {"BM": cfg.bm, "BN": cfg.bn, "STAGES": cfg.stages}
    if cfg.mcast:
        d["MCAST"] = cfg.mcast
    if cfg.layout != NORMAL:
        d["LAYOUT"] = cfg.layout
    if cfg.splits > 1:
        d["KSPLIT"] = cfg.splits
    if cfg.stream_b:
        d["STREAM_B"] = 1
    if cfg.tile_list:
        d["TILE_LIST"] = 1
    if cfg.warm_l2:
        d["L2_WARM"] = 1
    if cfg.scales_at_issue:
        d["SCALES_AT_ISSUE"] = 1
    return d


BENCH_SHAPES = {
    "normal": [(m, n, k) for m in (64, 128, 4096)
               for n, k in ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048))],
    # (groups, rows per group, N, K)
    "contiguous": [(g, rows, n, k) for g, rows in ((4, 8192), (8, 4096)) for n, k in ((4096, 7168), (7168, 2048))],
    "masked": [(g, rows, n, k) for g, rows in ((1, 1024), (2, 512), (4, 256), (16, 64))
               for n, k in ((4096, 7168), (7168, 2048))],
    # (groups, tokens per group, M, N): D[g] [M, N] += over the group's tokens
    "wgrad": [(8, 4096, 7168, 2048), (8, 4096, 2048, 7168), (4, 8192, 4096, 7168)],
}


def _bench_configs(props):
    for m, n, k in BENCH_SHAPES["normal"]:
        yield pick_config(m, n, k, props)
    no192 = Fp8Tuning(tile_us=tuple(e for e in TUNING.tile_us if e[0] != (192, 128)))
    for g, rows, n, k in BENCH_SHAPES["contiguous"]:
        for alignment in (64, 128, 256):
            yield pick_config(g * rows, n, k, props, CONTIGUOUS, g, alignment)
            # (and the contiguous kernels the pick takes elsewhere: 256 x 128 with and without a list)
            yield pick_config(g * rows, n, k, props, CONTIGUOUS, g, alignment, no192)
    for g, rows, n, k in BENCH_SHAPES["masked"]:
        yield pick_config(rows, n, k, props, MASKED, g)
    for g, tokens, m, n in BENCH_SHAPES["wgrad"]:
        yield pick_config(m, n, g * tokens, props, KGROUPED, g)


def variants():
    """Every kernel variant the heuristic picks for the benchmark shapes on an H100 and an H200, for two M that are
    not multiples of the tile (the edge maps' shapes; their picks differ from the bench's), for a 128-row tile
    and masked tiles that load their scales at the wgmma issue (no benchmark shape picks one), for the weight
    gradient's 128 x 192 and 128 x 256 tiles (short K a group: the benchmark's take 192 x 128), and for masked
    tiles picked for an expected_m."""
    from ..runtime.driver import H100, H200

    seen = {}
    ragged = [pick_config(m, 4096, 7168, H100) for m in (160, 1000)] + [pick_config(250, 5120, 7168, H100)]
    ragged += [pick_config(7168, 2048, 16 * 1024, H100, KGROUPED, 16),
               pick_config(2048, 2048, 4 * 1024, H100, KGROUPED, 4)]
    # masked, tiles picked for expected_m (real MoE experts, groups about half full)
    ragged += [pick_config(m, n, k, H200, MASKED, g, expected_m=e) for m, n, k, g, e in (
        (256, 4096, 7168, 64, 144), (512, 5760, 2816, 32, 288), (512, 3072, 4096, 4, 336), (128, 28672, 4096, 8, 48),
        (128, 1536, 2048, 8, 84), (64, 1536, 2048, 8, 42))]  # (the last two load their scales at the issue)
    for cfg in list(_bench_configs(H100)) + list(_bench_configs(H200)) + ragged:
        d = _defines(cfg)
        seen[tuple(sorted(d.items()))] = ("gemm_fp8.cu", "gemm_fp8_kernel", d, cfg.smem)
    return list(seen.values()) + [("fp8_scales.cu", "scales_to_mmajor", {}, 0), ("fill.cu", "fill_i32", {}, 0),
                                  ("contiguous_tiles.cu", "contiguous_tile_list", {}, 0)]


# ---- scales ---------------------------------------------------------------------------------------------------

def _mmajor_ok(sv: DeviceArray, m: int) -> bool:
    """Scales as [M, G] with unit stride along M, a column stride that keeps every column 16-byte aligned, and an
    aligned base: the kernel loads them with TMA as they are."""
    g = sv.shape[1]
    return ((sv.strides[0] == 1 or m == 1) and (g == 1 or (sv.strides[1] >= m and sv.strides[1] % 4 == 0))
            and sv.ptr % 16 == 0)


@dataclass(frozen=True)
class _MMajor:
    """How a kernel gets [rows, G] scales M-major: in place (convert None) or through a copy of leading
    dimension `ld` made by `convert` (one extra launch)."""
    ld: int
    rows: int  # rows of the M-major layout (the masked layout's groups padded to multiples of 4 rows)
    convert: object = None
    grid: tuple = ()
    args: tuple = ()  # the copy's: the source's (row, column) strides, then (rows, G, rows a group, padded)


def _mmajor_plan(sv: DeviceArray, device: int, group_rows: int = 0) -> _MMajor:
    """`group_rows`: the masked layout's rows per group. TMA starts a box of the inner dimension only at a 16-byte
    boundary, so each group's scales must start at a multiple of 4 rows: a copy pads the groups where not."""
    rows, cols = sv.shape
    per = group_rows if 0 < group_rows < rows and group_rows % 4 else rows
    if per == rows and _mmajor_ok(sv, rows):
        return _MMajor(sv.strides[1] if cols > 1 else mmajor_stride(rows), rows)
    convert = get_launcher("fp8_scales.cu", "scales_to_mmajor", {}, device, _CONVERT_ARGS, (_CONVERT_THREADS,))
    pad = mmajor_stride(per) if per != rows else rows
    padded = rows // per * pad
    return _MMajor(mmajor_stride(padded), padded, convert, (-(-rows * cols // _CONVERT_THREADS), 1, 1),
                   (*sv.strides, rows, cols, per, pad))


def _scales_ptr(mm: _MMajor, ptr: int, slots, h: int) -> int:
    """The M-major scales' address: `ptr` itself, or the next scratch slot of `slots` after the copy kernel filled
    it from `ptr`."""
    if mm.convert is None:
        return ptr
    slot_ptr = next(slots)
    in_row, in_col, *dims = mm.args
    mm.convert(mm.grid, h, ptr, in_row, in_col, slot_ptr, mm.ld, *dims)
    return slot_ptr


# ---- validation helpers ---------------------------------------------------------------------------------------

def _flatten(v: DeviceArray, name: str) -> DeviceArray:
    """[G, R, C] -> the [G * R, C] view the kernel's 2D tensor maps read (G's stride must be R rows)."""
    g, r, c = v.shape
    if g > 1 and r > 0 and v.strides[0] != r * v.strides[1]:
        raise ValueError(f"{name}: the groups must follow each other in memory (stride of dimension 0 = rows x "
                         f"stride of dimension 1), got shape {v.shape} strides {v.strides}")
    return DeviceArray(v.ptr, (g * r, c), v.dtype, (v.strides[1], v.strides[2]), v.device, v.stream, v)


def _check_scales(v: DeviceArray, name: str, shape: tuple) -> None:
    require(v, name, dtypes=(dt.float32,), ndim=len(shape), shape=shape, row_contiguous=False, align=4,
            row_align=0)
    if min(v.strides, default=0) < 0:
        raise ValueError(f"{name}: strides must not be negative")


def _check_operands(av, sav, bv, sbv, b_groups: int | None):
    """a [.., K] e4m3, b [N, K] or [G, N, K] e4m3, and their scales (sb per 128x128 block); returns (N, K)."""
    require(av, "a", dtypes=(dt.float8_e4m3,))
    require(bv, "b", dtypes=(dt.float8_e4m3,), ndim=2 if b_groups is None else 3)
    k = av.shape[-1]
    n = bv.shape[-2]
    if bv.shape[-1] != k:
        raise ValueError(f"a has K = {k} but b is {bv.shape}: K differs")
    if k == 0:
        raise ValueError("K must be at least 1")
    if b_groups is not None and bv.shape[0] != b_groups:
        raise ValueError(f"b: expected {b_groups} groups, got shape {bv.shape}")
    kb = -(-k // 128)
    _check_scales(sav, "sa", av.shape[:-1] + (kb,))
    _check_scales(sbv, "sb", ((b_groups,) if b_groups is not None else ()) + (-(-n // 128), kb))
    return n, k


def _check_group_ids(v: DeviceArray, name: str, n: int) -> None:
    require(v, name, dtypes=(dt.int32,), ndim=1, shape=(n,), align=4, row_align=0)
    if n > 1 and v.strides[0] != 1:
        raise ValueError(f"{name}: must be contiguous, got stride {v.strides[0]}")


# ---- plans and launch -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    cfg: Fp8Config
    launch: object
    grid: tuple
    map_a: MapLayout
    map_b: MapLayout
    map_a_edge: MapLayout  # the boxes across the last row of A and B (sm90.edge_map)
    map_b_edge: MapLayout
    map_sa: MapLayout
    map_sb: MapLayout | None  # KGROUPED: B's scales; otherwise None (the sA map is passed in its place, unused)
    map_d: MapLayout
    sa: _MMajor
    sb: _MMajor | None     # KGROUPED only
    scratch: tuple         # (slot, bytes, zeroed): the scales' M-major copies, the K-grouped offsets, the tile list
    sb_strides: tuple      # sB's (group, row, column) strides as the kernel takes them
    ld_d: int
    args: tuple            # M, N, K, groups as the kernel takes them
    tile_list: object = None  # contiguous_tiles.cu's launcher (cfg.tile_list), run before the GEMM
    memo: ArgsMemo = field(default_factory=ArgsMemo, compare=False, repr=False)


def _launcher(cfg: Fp8Config, device: int, tuning: Fp8Tuning):
    return get_launcher("gemm_fp8.cu", "gemm_fp8_kernel", _defines(cfg), device, _ARGS, (cfg.threads,), cfg.smem,
                        cluster=(cfg.cluster, 1, 1) if cfg.cluster > 1 else None, pdl=tuning.pdl)


def _make_plan(layout, av, sav, bv, sbv, dv, sb_strides, m, n, k, groups, alignment, tuning: Fp8Tuning,
               expected_m: int | None = None) -> _Plan:
    """av / bv / sav / dv are the 2D views the maps read; m, n, k, groups the kernel's arguments."""
    props = device_properties(av.device)
    cfg = pick_config(m, n, k, props, layout, groups, alignment, tuning, expected_m)
    launch = _launcher(cfg, av.device, tuning)
    m_all = groups * -(-m // cfg.bm) * cfg.bm if layout in (MASKED, KGROUPED) else m
    tiles = -(-m // cfg.bm) * -(-n // cfg.bn)
    if cfg.splits > 1 and tiles > launch.max_active_clusters():  # the clusters that do not fit would run later
        cfg = replace(cfg, splits=1)
        launch = _launcher(cfg, av.device, tuning)
    if cfg.splits > 1:  # one tile per cluster
        grid = (tiles * cfg.splits, 1, 1)
    else:  # (a tile list holds up to one more row of tiles per group: a CTA for each where they fit)
        rows = m_all + (min(groups, -(-m // cfg.bm)) * cfg.bm if cfg.tile_list else 0)
        grid = sm90.persistent_grid(launch, rows, n, cfg.bm, cfg.bn, cfg.mcast, 1, cfg.smem, props)
    kb = -(-k // 128)
    a_box = sm90.box_rows(cfg.bm, sm90.sharers(cfg.mcast)[0])
    b_box = sm90.box_rows(cfg.bn, sm90.sharers(cfg.mcast)[1])
    map_a = MapLayout(dt.float8_e4m3, (k, av.shape[0]), (av.strides[0],), (BK, a_box), 128,
                      sm90.l2_promotion(1, 1, sm90.rows_misaligned(av)))
    map_b = MapLayout(dt.float8_e4m3, (k, bv.shape[0]), (bv.strides[0],), (BK, b_box), 128,
                      sm90.l2_promotion(1, 1, sm90.rows_misaligned(bv)))
    scratch = []
    sa = _mmajor_plan(sav, av.device, m if layout == MASKED else 0)
    if sa.convert is not None:
        scratch.append(("fp8_sa_mmajor", sa.ld * sav.shape[1] * 4, False))
    map_sa = MapLayout(dt.float32, (sa.rows, kb), (sa.ld * 4,), (cfg.bm, 1), 0)
    sb = map_sb = None
    if layout == KGROUPED:
        sb = _mmajor_plan(sbv, av.device)
        if sb.convert is not None:
            scratch.append(("fp8_sb_mmajor", sb.ld * sbv.shape[1] * 4, False))
        map_sb = MapLayout(dt.float32, (n, kb), (sb.ld * 4,), (cfg.bn, 1), 0)
        scratch.append(("kgrouped_offsets", (groups + 1) * 4, False))
    tile_list = None
    if cfg.tile_list:  # the count, then up to two (tile row, group) int2 entries per tile row (any ids)
        tile_list = get_launcher("contiguous_tiles.cu", "contiguous_tile_list", {}, av.device, _LIST_ARGS,
                                 (_LIST_THREADS,), pdl=tuning.pdl)
        scratch.append(("fp8_tile_list", 8 * (1 + 2 * -(-m // cfg.bm)), False))
    ob = _out_bytes(layout)
    ch = _chunk(cfg.bn, ob)
    map_d = MapLayout(dt.float32 if ob == 4 else dt.bfloat16, (n, dv.shape[0]), (dv.strides[0] * ob,), (ch, 64),
                      ch * ob)
    # m / n: the rows of a group of A / B (the maps' row counts are multiples of them): their boxes across the end
    return _Plan(cfg, launch, grid, map_a, map_b, sm90.edge_map(map_a, m), sm90.edge_map(map_b, n), map_sa, map_sb,
                 map_d, sa, sb, tuple(scratch), sb_strides, dv.strides[0], (m, n, k, groups), tile_list)


def _fill_offsets(ks: tuple, dst: int, device: int, h: int) -> None:
    """The K-grouped layout's group offsets (0, ks[0], ks[0] + ks[1], ...) written by a kernel that takes them as
    parameters: no host copy to wait for, and capturable into a graph."""
    fill = get_launcher("fill.cu", "fill_i32", {}, device, _FILL_ARGS, (128,))
    offsets = [0]
    for x in ks:
        offsets.append(offsets[-1] + x)
    for i in range(0, len(offsets), _FILL_MAX):
        part = offsets[i:i + _FILL_MAX]
        fill((1, 1, 1), h, dst + 4 * i, len(part), tuple(part) + (0,) * (_FILL_MAX - len(part)))


def _key(layout, tuning, *arrays) -> tuple:
    """The plan key of one call: the layout, what of each array decides the plan (None for an output to
    allocate), the tuning."""
    return ("gemm_fp8", layout, tuning, *[None if x is None else sm90.array_key(x) for x in arrays])


def _plan(key, layout, av, sav, bv, sbv, dv, sb_strides, m, n, k, groups, alignment, tuning, expected_m=None):
    """The cached plan for a validated call (None when there is nothing to compute)."""
    if not (m and n and groups and k):
        return _NOTHING  # (not cached: the plan cache holds plans only)
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.add(key, _make_plan(layout, av, sav, bv, sbv, dv, sb_strides, m, n, k, groups, alignment,
                                         tuning or TUNING, expected_m))
    return plan


_NOTHING = "nothing to compute"  # the plan of a call with an empty dimension


def _launch(plan, h, a_ptr, sa_ptr, b_ptr, sb_ptr, d_ptr, info_ptr, ks=None):
    if plan is _NOTHING:
        return
    device = plan.launch.function.device  # (the plan key holds every array's device: they are all on this one)
    caller = enter_device(device)
    try:
        if not plan.scratch:  # the arguments are a function of the pointers alone
            ptrs = (a_ptr, sa_ptr, b_ptr, sb_ptr, d_ptr, info_ptr)
            args = plan.memo.get(ptrs)
            if args is None:
                args = plan.memo.add(ptrs, _args(plan, a_ptr, sa_ptr, b_ptr, sb_ptr, d_ptr, info_ptr))
            plan.launch.run(plan.grid, h, args)
            return
        slots = iter(SCRATCH.acquire(device, h, plan.scratch))  # in plan.scratch's order
        sa_ptr = _scales_ptr(plan.sa, sa_ptr, slots, h)
        if plan.sb is not None:
            sb_mmajor = _scales_ptr(plan.sb, sb_ptr, slots, h)
            info_ptr = next(slots)
            _fill_offsets(ks, info_ptr, device, h)
        else:
            sb_mmajor = 0
        list_ptr = 0
        if plan.tile_list is not None:
            list_ptr = next(slots)
            m, _, _, groups = plan.args
            plan.tile_list.run((1, 1, 1), h, (info_ptr, m, groups, plan.cfg.bm, plan.cfg.tile_list, list_ptr))
        plan.launch.run(plan.grid, h, _args(plan, a_ptr, sa_ptr, b_ptr, sb_ptr, d_ptr, info_ptr, sb_mmajor, list_ptr))
    finally:
        leave_device(caller)


def _args(plan, a_ptr, sa_mmajor, b_ptr, sb_ptr, d_ptr, info_ptr, sb_mmajor=0, list_ptr=0) -> tuple:
    """The kernel's arguments; sa_mmajor / sb_mmajor: the scales the sA / sB maps read (sB: K-grouped only);
    list_ptr: the tile list (contiguous with cfg.tile_list)."""
    maps = sm90.thread_maps()
    map_sa = maps.get(plan.map_sa, sa_mmajor)
    map_sb = map_sa if plan.map_sb is None else maps.get(plan.map_sb, sb_mmajor)  # (unused without K groups)
    map_a, map_a_edge = sm90.operand_maps(maps, plan.map_a, plan.map_a_edge, a_ptr)
    map_b, map_b_edge = sm90.operand_maps(maps, plan.map_b, plan.map_b_edge, b_ptr)
    return (map_a, map_b, map_a_edge, map_b_edge, map_sa, map_sb, maps.get(plan.map_d, d_ptr), sb_ptr,
            *plan.sb_strides, info_ptr, list_ptr, d_ptr, plan.ld_d, *plan.args, plan.cfg.group_m)


def _output(dv, av, shape, dtype, native, h, stream) -> DeviceArray:
    """Check the given output view, or allocate one through the call's framework on a's device (after every
    input was validated)."""
    if dv is None:
        return native.empty(shape, dtype, av.device, h, stream)
    require(dv, "out", dtypes=(dtype,), ndim=len(shape), shape=shape)
    same_device(a=av, out=dv)
    return dv


# ---- public ops -----------------------------------------------------------------------------------------------

def gemm_fp8(a, sa, b, sb, out=None, *, stream=None, tuning: Fp8Tuning | None = None):
    """D = (A * sA) @ (B * sB)^T in bf16.

    a: [M, K] e4m3, sa: [M, ceil(K/128)] fp32 (one scale per 1x128 group of a row), b: [N, K] e4m3, sb:
    [ceil(N/128), ceil(K/128)] fp32 (one scale per 128x128 block), out: [M, N] bf16 (allocated when None). K and N
    must keep rows 16-byte aligned (K % 16 == 0, N % 8 == 0); every M, N, K tail is handled in the kernel.

    sa is read in place when it is M-major with 16-byte aligned columns (`quantize_fp8_per_token`'s default
    layout: strides (1, ld) with ld >= M a multiple of 4). Any other layout (row-major, say) is first copied into
    that layout by a small kernel on the same stream: one extra launch and M x ceil(K/128) x 8 bytes of traffic.
    sb may have any strides. Runs on `stream` (None: torch's or cupy's current stream for their arrays, else the
    legacy default stream); returns `out`, or a new array of the inputs' framework.
    """
    av, sav, bv, sbv, dv, h, native = call_arrays((a, sa, b, sb, out), stream)
    key = _key(NORMAL, tuning, av, sav, bv, sbv, dv)
    plan = PLANS.get(key) if dv is not None else None
    if plan is None:  # validate once per plan
        require(av, "a", dtypes=(dt.float8_e4m3,), ndim=2)
        n, k = _check_operands(av, sav, bv, sbv, None)
        m = av.shape[0]
        same_device(a=av, sa=sav, b=bv, sb=sbv)
        dv = _output(dv, av, (m, n), dt.bfloat16, native, h, stream)
        plan = _plan(key, NORMAL, av, sav, bv, sbv, dv, (0, sbv.strides[0], sbv.strides[1]), m, n, k, 1, 256, tuning)
    _launch(plan, h, av.ptr, sav.ptr, bv.ptr, sbv.ptr, dv.ptr, 0)
    return native.result(dv) if out is None else out


def gemm_fp8_grouped_contiguous(a, sa, b, sb, m_indices, out=None, *, alignment: int = 128, stream=None,
                                tuning: Fp8Tuning | None = None):
    """MoE prefill: the rows of A are the experts' tokens back to back; row m is multiplied by expert
    m_indices[m]'s weights: D[m] = (A[m] * sA[m]) @ (B[g] * sB[g])^T, bf16.

    a: [M, K] e4m3, sa: [M, ceil(K/128)] fp32, b: [G, N, K] e4m3, sb: [G, ceil(N/128), ceil(K/128)] fp32,
    m_indices: [M] int32 on the GPU, the expert of each row or -1 for a padding row; out: [M, N] bf16.
    Each expert's segment must start at a multiple of `alignment` rows (64, 128 or 256), the padding rows of a
    segment after its tokens. Tiles need not divide the alignment (128 rows at alignment 64, 192 at 128 or 256,
    256 at 128): a small kernel first lists the rows of tiles per expert on the GPU (a row of tiles that holds
    the end of one segment and the start of the next runs once per expert), so that every unit of the
    persistent grid is one tile of work. At alignment 64, 128-row tiles run 1.3-1.5x faster than 64-row ones (16
    to 64 experts on 32k rows, H100); at 128 and 256, 192-row tiles (0.93-0.98x the time of 256-row ones on 4 to
    16 experts, H200). Tiles of padding rows only are skipped entirely (no loads, no math, no writes); padding
    rows are never written. Scales as for `gemm_fp8`. Not checked on the host (it would need a device sync): a
    segment that starts off the alignment leaves the rows of its first tile that belong to it unwritten.
    """
    if alignment not in (64, 128, 256):
        raise ValueError(f"alignment must be 64, 128 or 256 rows, got {alignment}")
    av, sav, bv, sbv, iv, dv, h, native = call_arrays((a, sa, b, sb, m_indices, out), stream)
    key = _key(CONTIGUOUS, tuning, av, sav, bv, sbv, iv, dv) + (alignment,)
    plan = PLANS.get(key) if dv is not None else None
    if plan is None:  # validate once per plan
        require(av, "a", dtypes=(dt.float8_e4m3,), ndim=2)
        require(bv, "b", dtypes=(dt.float8_e4m3,), ndim=3)
        groups = bv.shape[0]
        n, k = _check_operands(av, sav, bv, sbv, groups)
        m = av.shape[0]
        _check_group_ids(iv, "m_indices", m)
        same_device(a=av, sa=sav, b=bv, sb=sbv, m_indices=iv)
        dv = _output(dv, av, (m, n), dt.bfloat16, native, h, stream)
        plan = _plan(key, CONTIGUOUS, av, sav, _flatten(bv, "b"), sbv, dv, sbv.strides, m, n, k, groups, alignment,
                     tuning)
    _launch(plan, h, av.ptr, sav.ptr, bv.ptr, sbv.ptr, dv.ptr, iv.ptr)
    return native.result(dv) if out is None else out


def gemm_fp8_grouped_masked(a, sa, b, sb, masked_m, out=None, *, expected_m: int | None = None, stream=None,
                            tuning: Fp8Tuning | None = None):
    """MoE decode: G independent GEMMs of which only the first masked_m[g] rows count:
    D[g, :masked_m[g]] = (A[g] * sA[g]) @ (B[g] * sB[g])^T for those rows, bf16.

    a: [G, M, K] e4m3, sa: [G, M, ceil(K/128)] fp32, b: [G, N, K] e4m3, sb: [G, ceil(N/128), ceil(K/128)] fp32,
    masked_m: [G] int32 on the GPU (read by the kernel: no host sync, CUDA-graph friendly; values above M count as
    M), out: [G, M, N] bf16. Rows from masked_m[g] on are neither computed (whole tiles skipped) nor written. The
    groups of a, sa (as [G * M, ...]) and out must follow each other in memory. Scales as for `gemm_fp8`; where M
    is not a multiple of 4 (and G > 1) they are always copied, each group's padded to a multiple of 4 rows (TMA
    loads them from 16-byte boundaries only).

    expected_m: a host hint, the rows a group typically holds (DeepGEMM's expected_m; the mean of masked_m, say).
    The tiles are picked for that many rows a group instead of M: where groups hold far fewer rows than M, shorter
    tiles waste less (H200, 18 real MoE decode cases whose pick it changes: 0.905x the time geomean, 0.79-1.14x).
    It changes no result; None (the default) picks for M rows.
    """
    hint = None
    if expected_m is not None:
        try:
            hint = operator.index(expected_m)  # (an int or a numpy integer, not a float or a bool)
        except TypeError:
            hint = 0
        if hint < 1 or isinstance(expected_m, bool):
            raise ValueError(f"expected_m must be a positive int (rows a group typically holds), got {expected_m!r}")
        hint = -(-hint // 16) * 16  # (plans per 16 rows of the hint)
    av, sav, bv, sbv, iv, dv, h, native = call_arrays((a, sa, b, sb, masked_m, out), stream)
    key = _key(MASKED, tuning, av, sav, bv, sbv, iv, dv) + (hint,)
    plan = PLANS.get(key) if dv is not None else None
    if plan is None:  # validate once per plan
        require(av, "a", dtypes=(dt.float8_e4m3,), ndim=3)
        require(bv, "b", dtypes=(dt.float8_e4m3,), ndim=3)
        groups, m, _ = av.shape
        n, k = _check_operands(av, sav, bv, sbv, groups)
        _check_group_ids(iv, "masked_m", groups)
        same_device(a=av, sa=sav, b=bv, sb=sbv, masked_m=iv)
        dv = _output(dv, av, (groups, m, n), dt.bfloat16, native, h, stream)
        plan = _plan(key, MASKED, _flatten(av, "a"), _flatten(sav, "sa"), _flatten(bv, "b"), sbv, _flatten(dv, "out"),
                     sbv.strides, m, n, k, groups, 256, tuning, hint)
    _launch(plan, h, av.ptr, sav.ptr, bv.ptr, sbv.ptr, dv.ptr, iv.ptr)
    return native.result(dv) if out is None else out


def gemm_fp8_wgrad(a, sa, b, sb, d, ks, *, stream=None, tuning: Fp8Tuning | None = None):
    """K-grouped weight gradient, accumulated: D[g] += (A_g * sA_g) @ (B_g * sB_g)^T in fp32 for each group g,
    where group g owns the columns ks[0] + ... + ks[g-1] onwards (ks[g] of them) of A and B: for MoE backward,
    A = dY^T and B = X^T with each expert's tokens along K.

    a: [M, K] e4m3 and b: [N, K] e4m3 (K = sum(ks), the tokens), sa: [M, K/128] and sb: [N, K/128] fp32, one
    scale per 1x128 group of a row on both sides (as `quantize_fp8_per_token` makes them from dY^T and X^T);
    d: [G, M, N] fp32, added to (D += ..., through TMA reduce-add: run it twice and D holds twice the product).
    ks: the host list of tokens per group, each a multiple of 128 (a group may have none). Scales are read in
    place when M-major with 16-byte aligned columns, else copied first (one extra launch each).
    """
    ks = tuple(int(x) for x in ks)
    if any(x < 0 or x % 128 for x in ks):
        raise ValueError(f"ks: each group's K must be a non-negative multiple of 128, got {ks}")
    av, sav, bv, sbv, dv, h, _ = call_arrays((a, sa, b, sb, d), stream)
    key = _key(KGROUPED, tuning, av, sav, bv, sbv, dv)
    plan = PLANS.get(key)
    if plan is not None and sum(ks) == av.shape[1] and len(ks) == dv.shape[0]:  # validated with this plan
        _launch(plan, h, av.ptr, sav.ptr, bv.ptr, sbv.ptr, dv.ptr, 0, ks)
        return d
    require(av, "a", dtypes=(dt.float8_e4m3,), ndim=2)
    require(bv, "b", dtypes=(dt.float8_e4m3,), ndim=2)
    m, k = av.shape
    n = bv.shape[0]
    if bv.shape[1] != k:
        raise ValueError(f"a is [M, K] = {av.shape} but b is [N, K] = {bv.shape}: K differs")
    if sum(ks) != k:
        raise ValueError(f"ks sums to {sum(ks)} but A and B have K = {k}")
    groups = len(ks)
    _check_scales(sav, "sa", (m, k // 128))
    _check_scales(sbv, "sb", (n, k // 128))
    require(dv, "d", dtypes=(dt.float32,), ndim=3, shape=(groups, m, n))
    same_device(a=av, sa=sav, b=bv, sb=sbv, d=dv)
    plan = _plan(key, KGROUPED, av, sav, bv, sbv, _flatten(dv, "d"), (0, 0, 0), m, n, k, groups, 256, tuning)
    _launch(plan, h, av.ptr, sav.ptr, bv.ptr, sbv.ptr, dv.ptr, 0, ks)
    return d
