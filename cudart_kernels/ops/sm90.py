"""Host side of the SM90 kernel skeleton, shared by every TMA + wgmma op: tuning fields common to them, 2-CTA
clusters and the multicast side, the grouped tile order, the persistent grid, named tensor-map layouts with edge
boxes and L2 promotion, and the per-thread tensor-map cache. Pure functions of shapes, device properties and a
frozen tuning object (the kernels' side is ptx/common)."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NamedTuple

from ..runtime.driver import DeviceProperties
from ..runtime.tensormap import AddressedMapCache

# ptx MCAST: pairs along M share B, pairs along N share A, four tiles along M share B (the BF16 GEMM)
MCAST_NONE, MCAST_SHARE_B, MCAST_SHARE_A, MCAST_SHARE_B4 = 0, 1, 2, 3


def cluster_ctas(mcast: int) -> int:
    """CTAs per cluster (ptx/common/pipeline.cuh cluster_ctas)."""
    return 4 if mcast == MCAST_SHARE_B4 else 2 if mcast else 1


def sharers(mcast: int) -> tuple[int, int]:
    """The CTAs that share the A tile and the B tile, each loading a part of it (a_sharers, b_sharers)."""
    return (2 if mcast == MCAST_SHARE_A else 1,
            2 if mcast == MCAST_SHARE_B else 4 if mcast == MCAST_SHARE_B4 else 1)


@dataclass(frozen=True)
class Sm90Tuning:
    """Fields every SM90 GEMM-like op shares (docs/tuning.md). Ops subclass it with their own constants; a tuning
    object is part of every plan key, so a call with another one gets its own plans."""
    multicast: bool = True   # let the heuristic pair CTAs in 2-CTA clusters
    # One wave of unsplit tiles pairs only where the shared operand's tile has few readers: along M (sharing B) up
    # to wave_pair_max_rows rows of tiles, along N (sharing A) up to wave_pair_max_cols columns. With more, that
    # tile is read from L2 by many CTAs anyway, and the pair's lockstep costs more than the halved reads save.
    wave_pair_max_rows: int = 4
    wave_pair_max_cols: int = 8
    pdl: bool = True         # programmatic dependent launch: set-up overlaps the previous kernel's tail
    warm_l2: bool = True     # with pdl: B's first load prefetched into L2 before the wait for the previous kernel
    # B loaded with an evict-first L2 policy where M <= stream_b_max_m (each B tile read by one CTA, or by CTAs
    # running at once) and a row of B has stream_b_min_row_bytes or more
    stream_b_max_m: int = 128
    stream_b_min_row_bytes: int = 2048
    force_mcast: int | None = None  # tests: pair tiles on this side wherever it is legal


class MapLayout(NamedTuple):
    """A tensor map without its address: dims and box innermost first, strides in bytes (dims 1..)."""
    dtype: object
    dims: tuple
    strides: tuple
    box: tuple
    swizzle: int
    l2_promotion: int = 256


class _PerThread(threading.local):
    def __init__(self):
        self.maps = AddressedMapCache()


_local = _PerThread()


def thread_maps() -> AddressedMapCache:
    """This thread's encoded tensor maps (a map handed to a launch is never re-pointed under another thread)."""
    return _local.maps


def box_rows(tile_rows: int, sharers: int) -> int:
    """The rows of an operand tile one CTA loads: its part when `sharers` CTAs of a cluster share the tile."""
    return tile_rows // sharers


def edge_map(layout: MapLayout, rows: int) -> MapLayout:
    """The map of an operand's box across its last row (`rows` per group; ptx/common tma_load_rows): the same
    tensor with a box of rows % box rows, so that TMA fills no row past the tensor (its zero fill is slow: FP8,
    H100, 160x4096x7168 28.8 us with a half-filled box, 20.7 without). The layout itself where rows are a multiple
    of the box (the kernel then never uses it)."""
    tail = rows % layout.box[1]
    return layout if tail == 0 else layout._replace(box=(layout.box[0], tail))


def operand_maps(maps: AddressedMapCache, layout: MapLayout, edge_layout: MapLayout, address: int):
    """An operand's main and edge tensor maps (one cache lookup where the rows need no edge box)."""
    main = maps.get(layout, address)
    return main, main if edge_layout is layout else maps.get(edge_layout, address)


def l2_promotion(readers: int, splits: int, misaligned: bool = False) -> int:
    """TMA L2 promotion (bytes an L2 miss fetches) for an operand map. 256 by default: wide DRAM bursts, and the
    extra 128 bytes are the same rows' next k block. 128 for an operand of a split-K config that several CTAs
    re-read (`readers` tile columns for A, tile rows for B): the whole grid runs at once, bound by L2 traffic, and
    one-row fills cut it (H100: 512x512x65536 69.0 -> 65.7 us, 256x256x32768 22.1 -> 20.9; unsplit shapes lost up
    to 4%). 128 for rows that are not 128-byte aligned (`rows_misaligned`: a fill of 256 bytes then mostly fetches
    lines of other k blocks; H200, 2026-11-29: 64x4096x7176 1.57 -> 1.34x cuBLAS's time, 256x4096x14184 1.42 ->
    1.20)."""
    return 128 if misaligned or (splits > 1 and readers > 1) else 256


def rows_misaligned(x) -> bool:
    """Whether a 2-D operand's rows start off 128-byte boundaries (its address or row stride): each 128-byte box
    row of a TMA load then spans two L2 lines."""
    return (x.ptr | x.strides[0] * x.dtype.itemsize) % 128 != 0


def streams_b(m: int, k: int, in_bytes: int, tuning: Sm90Tuning) -> bool:
    return m <= tuning.stream_b_max_m and k * in_bytes >= tuning.stream_b_min_row_bytes


def fewest_waves_bn(m: int, n: int, bm: int, candidates, props: DeviceProperties) -> int:
    """The BN that needs the fewest waves of BM x BN tiles, then fills the last wave most, then is widest."""
    def key(bn):
        tiles = -(-m // bm) * -(-n // bn)
        waves = -(-tiles // props.sm_count)
        return waves, -(tiles - (waves - 1) * props.sm_count), -bn
    return min(candidates, key=key)


def cluster_tiles(m: int, n: int, bm: int, bn: int, mcast: int) -> tuple[int, int]:
    """Cluster tiles along M and N (the kernels' cl_tiles_m / cl_tiles_n): the tiles along M that share B (a pair,
    or four) or along N that share A (a pair) under multicast, else one tile; a count not a multiple of the
    cluster's leaves spare tiles in the last cluster."""
    share_a, share_b = sharers(mcast)
    tiles_m, tiles_n = -(-m // bm), -(-n // bn)
    return -(-tiles_m // share_b), -(-tiles_n // share_a)


def pick_multicast(m: int, n: int, bm: int, bn: int, splits: int, b_kn: bool, props: DeviceProperties,
                   tuning: Sm90Tuning, share_b: bool = True, misaligned: bool = False) -> int:
    """Pair tiles in 2-CTA clusters when it adds no wave: along M sharing B (halves the B reads), or along N
    sharing A; the side whose half-tile saves more bytes wins; one wave of unsplit tiles only where the shared tile
    has few readers (wave_pair_max_rows / _cols). Where an operand's rows are `misaligned` (not 128-byte aligned:
    each box row spans two L2 lines, and halving a CTA's rows pays more than the pair's lockstep costs) one wave
    pairs too, and 192-row tiles that cannot share B share A (halves of 96 rows; where both can, B ran faster).
    Each half must be whole 8-row swizzle atoms; B as [K, N] (64-column panels) is shared only by 64-row tiles of
    two or more whole panels (measured at M 65..128, docs/tuning.md), and with `share_b` False not at all.
    `tuning.force_mcast` pairs on its side wherever that is legal."""
    legal_b = share_b and (bm == 64 and bn % 64 == 0 and bn >= 128 if b_kn else bn % 16 == 0)
    if tuning.force_mcast is not None:  # (192-row halves of 96 rows are legal too)
        f = tuning.force_mcast
        return f if (f == MCAST_SHARE_B and legal_b) or (f == MCAST_SHARE_A and bm >= 128) else MCAST_NONE
    if not tuning.multicast:
        return MCAST_NONE
    tiles_m, tiles_n = -(-m // bm), -(-n // bn)
    slots = props.sm_count - props.sm_count % 2

    def waves(mcast):
        cl_m, cl_n = cluster_tiles(m, n, bm, bn, mcast)
        return -(-cl_m * cl_n * (2 if mcast else 1) * splits // slots)

    best, saved = MCAST_NONE, 0
    if legal_b and tiles_m >= 2 and waves(MCAST_SHARE_B) <= waves(MCAST_NONE):
        best, saved = MCAST_SHARE_B, bn
    if ((bm % 128 == 0 and bm > saved or misaligned and bm >= 128 and best == MCAST_NONE)
            and tiles_n >= 2 and waves(MCAST_SHARE_A) <= waves(MCAST_NONE)):
        best = MCAST_SHARE_A
    if splits == 1 and tiles_m * tiles_n <= props.sm_count and not misaligned and (  # one wave of unsplit tiles
            (best == MCAST_SHARE_B and tiles_m > tuning.wave_pair_max_rows)
            or (best == MCAST_SHARE_A and tiles_n > tuning.wave_pair_max_cols)):
        return MCAST_NONE
    return best


def persistent_grid(launch, m: int, n: int, bm: int, bn: int, mcast: int, splits: int, smem: int,
                    props: DeviceProperties) -> tuple:
    """One CTA per work unit up to one per SM; under multicast, whole clusters, all resident at once (the split-K
    turnstile relies on it)."""
    if not mcast:
        return (max(1, min(-(-m // bm) * -(-n // bn) * splits, props.sm_count)), 1, 1)
    ctas = cluster_ctas(mcast)
    cl_m, cl_n = cluster_tiles(m, n, bm, bn, mcast)
    clusters = min(cl_m * cl_n * splits, props.sm_count // ctas, launch.max_active_clusters())
    if clusters < 1:
        raise RuntimeError(f"no {ctas}-CTA cluster of {smem} bytes of shared memory fits this device")
    return (ctas * clusters, 1, 1)


def group_rows(m: int, n: int, bm: int, bn: int, mcast: int, props: DeviceProperties) -> int:
    """Cluster-tile rows per group of the tile order. A wave covers about `group x (wave / group)` cluster tiles;
    the group that minimises the A rows plus B rows a wave reads is sqrt(wave * tile_n / tile_m). When all
    tiles fit in one wave the order does not matter (one group: M fastest)."""
    share_a, share_b = sharers(mcast)
    cl_bm, cl_bn = bm * share_b, bn * share_a
    cl_tiles_m, cl_tiles_n = cluster_tiles(m, n, bm, bn, mcast)
    wave = props.sm_count // cluster_ctas(mcast)
    if cl_tiles_m * cl_tiles_n <= wave:
        return cl_tiles_m
    return max(1, min(cl_tiles_m, round((wave * cl_bn / cl_bm) ** 0.5)))


def array_key(x) -> tuple:
    """What of a DeviceArray decides a plan: shape, strides, dtype, 128-byte alignment (`rows_misaligned`), device."""
    return x.shape, x.strides, x.dtype, x.ptr & 127, x.device
