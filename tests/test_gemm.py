"""GEMM: config heuristics and validation on the CPU; correctness against float64 on the GPU."""
import os

import numpy as np
import pytest

import cudart_kernels as ck
from dataclasses import replace

from cudart_kernels.ops import gemm as g
from cudart_kernels.ops import sm90
from cudart_kernels.ops.sm90 import MapLayout
from cudart_kernels.runtime.launch import get_launcher
from cudart_kernels.runtime.plans import PLANS
from cudart_kernels.runtime import dtypes as dt
from cudart_kernels.runtime import driver
from cudart_kernels.runtime.driver import H100, H200
from cudart_kernels.runtime.interop import DeviceArray

FAKE = 0x7F0000000000


def fake(shape, dtype, strides=None, offset=0):
    return DeviceArray.from_pointer(FAKE + offset, shape, dtype, strides)


@pytest.mark.parametrize("shape", g.BENCH_SHAPES["large"] + g.BENCH_SHAPES["skinny"] + [
    (1, 8, 8), (17, 24, 40), (160, 7168, 8192), (192, 512, 16384), (336, 4096, 8192), (384, 7168, 2048),
    (300, 8192, 28672), (320, 8192, 8192), (257, 5120, 25600), (129, 2112, 7168)])
@pytest.mark.parametrize("out_bytes", [2, 4])
@pytest.mark.parametrize("split_k", [None, 1, 7])
def test_config_fits_and_matches_the_kernel_layout(shape, out_bytes, split_k):
    m, n, k = shape
    cfg = g.pick_config(m, n, k, out_bytes, H100, split_k)
    if cfg.swap_ab:  # D^T = B A^T: BM runs over N, BN over M (M in steps of 8)
        assert split_k is None and out_bytes == 2 and cfg.bn % 8 == 0 and cfg.bn >= -(-m // 8) * 8 / -(-m // cfg.bn)
        assert cfg.bm in (128, 192, 256) and cfg.bn <= (112 if cfg.bm == 256 else 192 if cfg.bm == 192 else 256)
        assert cfg.splits == 1 or (cfg.bm < 256 and -(-n // cfg.bm) * -(-m // cfg.bn) * cfg.splits <= H100.sm_count)
        assert cfg.mcast in g.swap_multicasts(m, n, cfg.bm, cfg.bn, H100)
        pairs = -(-m // cfg.bn) % 2 == 0
        assert cfg.mcast != sm90.MCAST_NONE or not pairs  # pairs sharing A wherever they fit, or fours
        epi = 4 if cfg.splits > 1 else 2
        assert cfg.smem == g.smem_bytes(cfg.bm, cfg.bn, cfg.stages, epi) <= H100.smem_per_block_optin
        return
    # 64-row tiles: the split search's (M <= split_bm64_max_m), clusters of four (quad_split), or one wave of
    # unsplit ones (unsplit_wave)
    one_wave = cfg.splits == 1 and -(-m // 64) * -(-n // cfg.bn) <= H100.sm_count
    quad = cfg.mcast == sm90.MCAST_SHARE_B4 and g.quad_split(m, n, cfg.bm, cfg.bn, cfg.splits, False, H100)
    ragged = cfg.splits == 1 and m > 128 and m % 128 and cfg.bm in (128, 192)  # (ragged_pick)
    assert cfg.bm == g.row_tile(m) or ragged or cfg.bm == 64 and (cfg.splits > 1 and m <= g.TUNING.split_bm64_max_m
                                                                   or one_wave or quad)
    assert cfg.bn % 8 == 0 and 8 <= cfg.bn <= (256 if cfg.bm < 192 else 160 if cfg.splits > 1 else 192)
    assert 2 <= cfg.stages <= g.MAX_STAGES
    epi = 4 if cfg.splits > 1 else out_bytes
    assert cfg.smem == g.smem_bytes(cfg.bm, cfg.bn, cfg.stages, epi) <= H100.smem_per_block_optin
    assert g.smem_bytes(cfg.bm, cfg.bn, cfg.stages + 1, epi) > H100.smem_per_block_optin or \
        cfg.stages == g.MAX_STAGES  # as many stages as fit
    k_blocks = -(-k // g.BK)
    assert 1 <= cfg.splits <= k_blocks  # never an empty split
    if split_k is not None:
        assert cfg.splits == min(split_k, k_blocks)


def test_config_choices():
    cfg = g.pick_config(8192, 8192, 8192, 2, H100)
    assert (cfg.bm, cfg.bn, cfg.stages, cfg.splits, cfg.smem) == (128, 256, 4, 1, g.smem_bytes(128, 256, 4, 2))
    # 64 x 32 tiles of 128 x 256: pairs along M share B (saves 128 rows a stage against 64 for sharing A);
    # a wave of 66 pairs covers about 8 x 8 pairs
    assert (cfg.mcast, cfg.cluster, cfg.group_m) == (g.MCAST_SHARE_B, 2, 8)
    assert g.pick_config(16, 4096, 8192, 2, H100).bm == 64  # small M: one consumer warpgroup
    # M <= 64: unsplit tiles of 32+ columns on 70% of the SMs or more stream B faster than splits (16x4096x8192
    # 64 x 32 unsplit 25.1 us, 64 x 192 x 6 26.6; 16x3072x16384 38.0 / 52.8); 16-column tiles never count as
    # filling (64x2112x16384: 132 of them 36.6 us, 64 x 96 x 6 27.4), nor do 80 32-column tiles (16x2560x16384)
    assert tuple(g.pick_config(16, 4096, 8192, 2, H100).__dict__.values())[:4] == (64, 32, 16, 1)
    assert g.pick_config(16, 3072, 16384, 2, H100).splits == 1
    assert g.pick_config(64, 2112, 16384, 2, H100).splits > 1
    assert g.pick_config(16, 2560, 16384, 2, H100).splits > 1
    # Among near-equal estimates, a grid of units that fills the SMs beats a wider tile that leaves SMs idle:
    # 256x512x65536 128x128 x 16 (128 units), not 128x192 x 16 (96 units) (without clusters of four, which
    # it runs since: 64 x 128 x 6, level with it on an H200)
    cfg = g.pick_config(256, 512, 65536, 2, H100, tuning=replace(g.TUNING, quad_clusters_share=0))
    assert (cfg.bn, cfg.splits) == (128, 16)
    # 512x512x65536: 128 x 256 tiles, 16 splits, pairs along M (61.5 us against 66.5 for 128 x 192 x 11)
    cfg = g.pick_config(512, 512, 65536, 2, H100)
    assert (cfg.bn, cfg.splits, cfg.mcast) == (256, 16, g.MCAST_SHARE_B)
    # 4096x2112: 32 row blocks; BN=176 gives 12 column blocks = 384 tiles = 3 waves, nearly full (2.9)
    assert g.pick_config(4096, 2112, 7168, 2, H100).bn == 176
    # few tiles, long K: split
    assert g.pick_config(128, 128, 65536, 2, H100).splits >= 16
    # M <= 128 splits with 64-row tiles paired along M: 128x128x65536 64x64 x 30 (16.6 us) rather than 128x64 x 64
    # paired along N (17.4); since the operand-rows filter (test below) 64 x 128, one column of tiles; M = 256 keeps
    # 128-row tiles, unless in clusters of four (test below)
    cfg = g.pick_config(128, 128, 65536, 2, H100)
    assert (cfg.bm, cfg.bn, cfg.splits, cfg.mcast) == (64, 128, 20, g.MCAST_SHARE_B)
    no_quad = replace(g.TUNING, quad_clusters_share=0)
    assert (g.pick_config(128, 2048, 28672, 2, H100).bm, g.pick_config(256, 256, 32768, 2, H100, tuning=no_quad).bm) \
        == (64, 128)
    assert g.pick_config(256, 256, 32768, 2, H100).splits >= 8
    # 2048x2048: BN=256 gives 128 tiles, one wave; no split beats a narrower tile with two waves
    assert g.pick_config(2048, 2048, 32768, 2, H100) == g.pick_config(2048, 2048, 32768, 2, H100, split_k=1)
    assert g.pick_config(2048, 2048, 32768, 2, H100).bn == 256
    # M = 128, N = 8192: 64-row tiles unsplit, paired along M, fill 128 SMs (25.0 us against 30.9 split)
    assert tuple(g.pick_config(128, 8192, 4096, 2, H100).__dict__.values())[:4] == (64, 128, 8, 1)
    # M = 128, N = 7168: one wave of 64 x 112 in pairs along M (H200, 2026-11-29: 128x7168x18432 0.883x cuBLAS's
    # time against 1.036 for the split model's 64 x 256 x 2)
    cfg = g.pick_config(128, 7168, 16384, 2, H100)
    assert (cfg.bm, cfg.bn, cfg.splits, cfg.mcast) == (64, 112, 1, g.MCAST_SHARE_B)
    # 64x7168x16384: 112 tiles already; measured 62 us unsplit vs 74 us split in two (H200)
    assert g.pick_config(64, 7168, 16384, 2, H100).splits == 1
    # 192-row tiles where 128-row ones would add a mostly empty row block (M 129..192, 321..384), split where few
    # tiles have a long K (192x512x16384); where a wave of unsplit 64-row tiles fills the GPU it runs instead
    # (unsplit_wave: 192x7168x8192 64 x 176, where 192 x 128 x 2 splits measured 55.2 us and 192 x 64 unsplit
    # 49.6 on the H100; on the H200 192x7168x4096 28.0 -> 23.8 us)
    assert [g.row_tile(m) for m in (64, 65, 128, 129, 192, 193, 320, 321, 384, 385)] == [64, 128, 128, 192, 192,
                                                                                        128, 128, 192, 192, 128]
    assert tuple(g.pick_config(192, 7168, 8192, 2, H100).__dict__.values())[:4] == (64, 176, 7, 1)
    cfg = g.pick_config(160, 512, 16384, 2, H100)
    assert cfg.bm == 192 and cfg.splits > 1 and cfg.bn <= g.TUNING.bm192_split_max_bn
    assert g.pick_config(384, 7168, 8192, 2, H100).bm == 192
    assert g.pick_config(160, 4096, 4096, 2, H100, split_k=3).bn <= g.TUNING.bm192_split_max_bn  # forced splits too
    # enough tiles: no split
    for m, n, k in g.BENCH_SHAPES["large"]:
        assert g.pick_config(m, n, k, 2, H100).splits == 1


def test_one_wave_of_unsplit_tiles_beats_a_close_split():
    # Measured on an H200 (2026-11-28): one wave of unsplit 64-row tiles ran 0.55-1.0x the time of the split
    # picks they replace on 46 of 50 changed shapes (160x2560x1024 9.2 -> 5.0 us, 384x4096x4096 31.2 -> 22.6)
    # (384x4096x4096 swaps since, on a 0.75% margin of the estimates: 128-row tiles over N, 96 columns over M,
    # in pairs along M; 384x4096x8192 / 14336 ran that at 0.984 / 0.997x the unswapped wave's time, H200)
    unswapped = g.GemmTuning(swap_ab=False)
    for p in (H100, H200):
        for (m, n, k), bn in (((1024, 1024, 4096), 128), ((384, 4096, 4096), 192), ((160, 2560, 1024), 64)):
            cfg = g.pick_config(m, n, k, 2, p, tuning=unswapped)
            assert (cfg.bm, cfg.bn, cfg.splits) == (64, bn, 1)
            assert 0.9 * p.sm_count <= -(-m // 64) * -(-n // bn) <= p.sm_count
        # long K with few tiles still splits: a wave of narrow tiles over all of K is far slower
        for m, n, k in ((512, 512, 65536), (1024, 1024, 65536), (256, 256, 32768), (128, 2048, 28672)):
            assert g.pick_config(m, n, k, 2, p).splits > 1
        assert g.unsplit_wave(512, 512, 65536, False, p)[0] > 2 * g.split_time_us(512, 512, 65536, 128, 256, 16, p)
        # (the CUDA graph tests' split-K shape: its scratch must come from inside the capture on either part)
        assert g.pick_config(200, 2048, 8192, 2, p).splits > 1 and g.pick_config(200, 2048, 8192, 4, p).splits > 1


def test_one_wave_competes_with_every_pick_and_pairs_only_with_few_readers():
    # Measured on an H200 (2026-11-28, same-run A/B against the rules before): the wave also replaces an unsplit
    # pick (1024x1024x2048: 128 x 64 paired 9.5 us -> 64 x 128 8.5) and, with split_fixed_us, short-K splits
    # (32x2048x512: 64 x 32 x 2 4.6 us -> 64 x 16 3.2); it pairs along M only up to wave_pair_max_rows rows of
    # tiles (1024x1024x4096 64 x 128: 18.2 us paired, 16.2 not; 256x7168x8192 64 x 224, 4 rows: 48.4 paired,
    # 51.7 not) and along N up to wave_pair_max_cols columns (1792x512x1536 128 x 64, 8 columns: 8.0 / 8.7; since
    # wave_fill that shape runs 64 x 128, 0.967x the time, H200; 2816x512x2048 keeps a wave of 128 x 96, 6 columns)
    t = g.TUNING
    for p in (H100, H200):
        for (m, n, k), want in (((1024, 1024, 2048), (64, 128, 1, g.MCAST_NONE)),
                                ((32, 2048, 512), (64, 16, 1, g.MCAST_NONE)),
                                ((1024, 1024, 4096), (64, 128, 1, g.MCAST_NONE)),
                                ((256, 7168, 8192), (64, 224, 1, g.MCAST_SHARE_B)),
                                ((2816, 512, 2048), (128, 96, 1, g.MCAST_SHARE_A))):
            cfg = g.pick_config(m, n, k, 2, p)
            assert (cfg.bm, cfg.bn, cfg.splits, cfg.mcast) == want, (m, n, k)
        # the split-vs-split choices do not see split_fixed_us (every split pays it): M <= 64 keeps its splits
        assert g.pick_config(16, 2560, 16384, 2, p).splits > 1
        assert g.pick_config(64, 2112, 16384, 2, p).splits > 1
        # without the limits the same waves pair (pick_multicast's rule alone)
        free = replace(t, wave_pair_max_rows=64, wave_pair_max_cols=64)
        assert g.pick_config(1024, 1024, 4096, 2, p, tuning=free).mcast == g.MCAST_SHARE_B
        for m, n, k in ((4096, 1024, 4096), (2048, 2048, 32768)):  # 32 and 16 rows of tiles: no pairs
            assert g.pick_config(m, n, k, 2, p).mcast == g.MCAST_NONE
        # more than one wave of tiles keeps its pairs
        assert g.pick_config(8192, 8192, 8192, 2, p).mcast == g.MCAST_SHARE_B


def test_a_wave_short_of_full_grid_counts_where_no_width_fills_it():
    # H200, 2026-11-28, same-run A/B: where no width of unsplit tiles busies full_grid of the SMs, a wave busying
    # wave_fill of them competes with the pick (160x3072x2048: 192 x 48 x 2 11.0 us -> 64 x 80 in 117 tiles 7.6;
    # 320x1024x2048: 128 x 48 x 2 8.6 -> 64 x 48 in 110 tiles 6.6); where one does, the lower-fill widths stay out
    # (1024x512x4096: 64 x 64 in 128 tiles 12.7 us, 64 x 80 in 112 tiles 13.9)
    full = replace(g.TUNING, wave_fill=g.TUNING.full_grid, swap_ab=False)  # (the split there would swap)
    for p in (H100, H200):
        for (m, n, k), want, before in (((160, 3072, 2048), (64, 80, 1), (192, 48, 2)),
                                        ((320, 1024, 2048), (64, 48, 1), (128, 48, 2))):
            cfg, old = g.pick_config(m, n, k, 2, p), g.pick_config(m, n, k, 2, p, tuning=full)
            assert (cfg.bm, cfg.bn, cfg.splits) == want and (old.bm, old.bn, old.splits) == before, (m, n, k)
            assert -(-m // cfg.bm) * -(-n // cfg.bn) < g.TUNING.full_grid * p.sm_count
        cfg = g.pick_config(1024, 512, 4096, 2, p, tuning=g.GemmTuning(swap_ab=False))
        assert (cfg.bm, cfg.bn, cfg.splits) == (64, 64, 1)


def test_split_pick_drops_candidates_that_load_many_more_rows():
    """choose_split keeps the close candidates loading at most split_rows_share x the fewest operand rows: N = 128 in
    one column of 128 (the pair shares B: 2 x (64 + 64) rows a k block) rather than two of 96 (4 x (64 + 48)). H200,
    2026-11-29, same rounds with cuBLAS, picks on the board's own properties: 17 changed cases 0.826-1.003x the
    time (geomean 0.942), 128x128x65536 0.935, 256x128x65536 0.826."""
    for p in (H100, H200):
        cfg = g.pick_config(128, 128, 65536, 2, p)
        assert (cfg.bm, cfg.bn, cfg.mcast) == (64, 128, g.MCAST_SHARE_B) and cfg.splits > 16
        assert g.operand_rows(128, 128, 64, 128, 20, False, p) == 2 * (64 + 64)
        assert g.operand_rows(128, 128, 64, 96, 33, False, p) == 4 * (64 + 48)
        old = g.pick_config(128, 128, 65536, 2, p, tuning=replace(g.TUNING, split_rows_share=float("inf")))
        assert old.bn < 128


def test_split_k_at_four_rows_of_64_runs_clusters_of_four():
    # H200, 2026-11-28 (forced, same rounds): 256x256x32768 64 x 128 x 14 in clusters of four 15.6 us against the
    # pick before, 128 x 96 x 22 in pairs, 16.8 (cuBLAS 16.0); 256x128x65536 64 x 128 x 28 17.8 against 22.4. Four
    # rows of 64-row tiles (M 193..256) only; B in quarters of whole swizzle atoms; the clusters within
    # quad_clusters_share of the SMs' (30 clusters of four fit an H200)
    for p in (H100, H200):
        cfg = g.pick_config(256, 256, 32768, 2, p)
        assert (cfg.bm, cfg.mcast, cfg.cluster) == (64, sm90.MCAST_SHARE_B4, 4) and cfg.splits > 1
        assert -(-256 // cfg.bn) * cfg.splits <= g.TUNING.quad_clusters_share * p.sm_count / 4
        for m, n, k in ((192, 256, 32768), (320, 256, 32768), (256, 8192, 8192)):
            assert g.pick_config(m, n, k, 2, p).mcast != sm90.MCAST_SHARE_B4, (m, n, k)
        assert not g.quad_split(256, 256, 64, 96 + 16, 8, False, p)  # 28-row quarters
        assert not g.quad_split(256, 256, 64, 128, 8, True, p)       # B as [K, N]
        assert g.pick_config(256, 256, 32768, 2, p, b_kn=True).mcast != sm90.MCAST_SHARE_B4
    assert sm90.cluster_tiles(200, 1000, 64, 96, sm90.MCAST_SHARE_B4) == (1, 11)
    assert sm90.sharers(sm90.MCAST_SHARE_B4) == (1, 4) and sm90.cluster_ctas(sm90.MCAST_SHARE_B4) == 4


def test_picks_take_the_device_figures(monkeypatch):
    # An H200 has the H100's SMs and shared memory: the compute-bound picks are the same; the split model's byte
    # floor follows the device's copy rate (256x256x65536 in 128 x 128 x 32 units: bound by the operand bytes)
    for m, n, k in g.BENCH_SHAPES["large"]:
        assert g.pick_config(m, n, k, 2, H200) == g.pick_config(m, n, k, 2, H100)
    est = {p: g.split_time_us(256, 256, 65536, 128, 128, 32, p) for p in (H100, H200)}
    floor = {p: 512 * 65536 * 2 / (p.stream_bytes_per_s * g.TUNING.stream_efficiency) * 1e6 for p in (H100, H200)}
    assert est[H100] - est[H200] == pytest.approx(floor[H100] - floor[H200])
    for m, n, k in g.BENCH_SHAPES["skinny"]:
        cfg = g.pick_config(m, n, k, 2, H200)
        assert cfg.smem <= H200.smem_per_block_optin and cfg.stages >= 2
    # the copy rate a process uses: CUDART_KERNELS_STREAM_BW where set (no measurement, nothing kept)
    monkeypatch.setenv("CUDART_KERNELS_STREAM_BW", "1.5e12")
    assert driver.stream_rate(0, "any", 3e12, 50 << 20) == 1.5e12


def test_multicast_and_tile_order():
    # (the sides and the waves, without the one-wave reader limits, which the last lines check)
    free = replace(g.TUNING, wave_pair_max_rows=1 << 20, wave_pair_max_cols=1 << 20)

    def P(*args, tuning=free):
        return sm90.pick_multicast(*args, tuning)
    assert P(8192, 8192, 128, 256, 1, False, H100) == g.MCAST_SHARE_B
    assert P(8192, 8192, 128, 256, 1, True, H100) == g.MCAST_SHARE_A  # B as [K, N] is never shared
    assert P(64, 8192, 64, 256, 1, False, H100) == g.MCAST_NONE       # one tile row, BM 64 cannot halve A
    assert P(256, 8192, 128, 200, 1, False, H100) == g.MCAST_SHARE_A  # BN/2 is not whole 8-row atoms
    # 3 x 44 = 132 tiles fill one wave; pairing along M pads to 4 x 44 = 176 (two waves), along N to 3 x 44
    assert P(384, 44 * 128, 128, 128, 1, False, H100) == g.MCAST_SHARE_A
    assert P(384, 43 * 128, 128, 128, 1, False, H100) == g.MCAST_SHARE_A  # 3 x 43 -> 3 x 44: still one wave
    assert P(128, 8192, 128, 128, 1, False, H100) == g.MCAST_SHARE_A   # one tile row: only N pairs
    # One wave of unsplit tiles: pairs only where the shared tile has few readers (wave_pair_max_rows / _cols);
    # split units and more than a wave keep them
    t = g.TUNING
    assert P(512, 4096, 128, 128, 1, False, H100, tuning=t) == g.MCAST_SHARE_B    # 4 rows read each B tile
    assert P(1024, 2048, 128, 128, 1, False, H100, tuning=t) == g.MCAST_NONE      # 8 rows
    assert P(1024, 1024, 128, 128, 1, False, H100, tuning=t) == g.MCAST_NONE      # 8 rows (64 tiles)
    assert P(1024, 1024, 128, 128, 2, False, H100, tuning=t) == g.MCAST_SHARE_B   # split: 128 units, pairs
    assert P(1792, 512, 128, 64, 1, False, H100, tuning=t) == g.MCAST_SHARE_A     # 8 columns read each A tile
    assert P(128, 8192, 128, 128, 1, False, H100, tuning=t) == g.MCAST_NONE       # 64 columns
    assert P(8192, 8192, 128, 256, 1, False, H100, tuning=t) == g.MCAST_SHARE_B   # many waves
    # one wave or less: M fastest over all rows
    assert sm90.group_rows(1024, 1024, 128, 256, g.MCAST_SHARE_B, H100) == 4
    assert sm90.group_rows(8192, 8192, 128, 128, g.MCAST_NONE, H100) == 11
    for bn, eb, ch, swz in ((256, 2, 64, 128), (256, 4, 32, 128), (176, 2, 16, 32), (40, 2, 8, 0), (40, 4, 8, 32),
                            (96, 4, 32, 128), (48, 2, 16, 32)):
        assert (g.epilogue_chunk(bn, eb), g.epilogue_swizzle(bn, eb)) == (ch, swz), (bn, eb)


def test_edge_maps():
    """A CTA loads an operand tile as one box (half the tile when a pair shares it); the box across the last row
    goes through an edge map of exactly the rows left (ptx/common tma_load_rows), or the main map where the rows
    are a multiple of the box."""
    assert (sm90.box_rows(128, 1), sm90.box_rows(128, 2), sm90.box_rows(256, 2), sm90.box_rows(128, 4)) == (128, 64, 128, 32)
    a = MapLayout(dt.bfloat16, (4096, 777), (8192,), (64, 128), 128, 256)
    assert sm90.edge_map(a, 777) == (dt.bfloat16, (4096, 777), (8192,), (64, 9), 128, 256)
    assert sm90.edge_map(a, 768) is a
    grouped = MapLayout(dt.float8_e4m3, (7168, 3 * 160), (7168,), (128, 64), 128)  # 3 groups of 160 rows
    assert sm90.edge_map(grouped, 160).box == (128, 32)  # 160 % 64 = 32


def test_l2_promotion():
    assert sm90.l2_promotion(1, 1) == sm90.l2_promotion(4, 1) == 256  # unsplit: 256-byte fills
    assert sm90.l2_promotion(1, 8) == 256                           # split, streamed by one reader
    assert sm90.l2_promotion(2, 8) == 128                           # split, re-read from L2


def test_misaligned_rows():
    """Rows off 128-byte boundaries (row stride or address): L2 promotion 128, pairs even in one wave (192-row tiles
    share A where B cannot be shared), swapped tiles only in clusters, and the swap priced with 64-row tiles' loads
    dearer; aligned rows keep every pick."""
    bf = dt.bfloat16
    assert sm90.rows_misaligned(fake((64, 4104), bf)) and not sm90.rows_misaligned(fake((64, 4096), bf))
    assert sm90.rows_misaligned(fake((64, 4096), bf, offset=16))  # a view 8 columns in
    assert sm90.rows_misaligned(fake((64, 4096), bf, (4104, 1)))
    assert not sm90.rows_misaligned(fake((64, 4104), bf, (4160, 1), offset=256))
    assert sm90.array_key(fake((8, 64), bf, offset=16)) != sm90.array_key(fake((8, 64), bf, offset=32))
    assert sm90.l2_promotion(1, 1, True) == sm90.l2_promotion(4, 8, True) == 128
    for props in (H100, H200):
        def P(*args, misaligned):
            return sm90.pick_multicast(*args, props, g.TUNING, misaligned=misaligned)
        assert P(1801, 1744, 128, 224, 1, False, misaligned=False) == g.MCAST_NONE  # one wave, 15 rows of tiles
        assert P(1801, 1744, 128, 224, 1, False, misaligned=True) == g.MCAST_SHARE_B
        assert P(1678, 3968, 192, 144, 1, False, misaligned=False) == g.MCAST_NONE  # sharing B adds a wave
        assert P(1678, 3968, 192, 144, 1, False, misaligned=True) == g.MCAST_SHARE_A
        assert P(4096, 4096, 192, 192, 1, False, misaligned=True) == g.MCAST_SHARE_B
        assert P(64, 4096, 64, 32, 1, False, misaligned=True) == g.MCAST_NONE  # one tile row, 64 rows
        # 512 x 4096: one wave of unpaired 64 x 256 tiles aligned; misaligned, swapped pairs of 128 x 128
        aligned, misaligned = (g.pick_config(512, 4096, 7176, 2, props, misaligned=x) for x in (False, True))
        assert (aligned.bm, aligned.bn, aligned.mcast, aligned.swap_ab) == (64, 256, g.MCAST_NONE, False)
        assert (misaligned.bm, misaligned.bn, misaligned.mcast, misaligned.swap_ab) == (128, 128, g.MCAST_SHARE_A, True)
        for shape in ((643, 16280, 9160), (454, 8384, 10648)):  # swapped tiles alone aligned, in pairs misaligned
            assert g.pick_config(*shape, 2, props).mcast == g.MCAST_NONE
            cfg = g.pick_config(*shape, 2, props, misaligned=True)
            assert cfg.swap_ab and cfg.mcast == g.MCAST_SHARE_A
    assert g.swap_multicasts(300, 4096, 128, 160, H200, misaligned=True) == [g.MCAST_SHARE_A, sm90.MCAST_SHARE_B4]
    assert g.swap_multicasts(257, 5120, 128, 88, H200, misaligned=True) == []
    t = g.TUNING
    assert g.busy_kblock_us(64, 96, misaligned=True) == pytest.approx(g.kblock_us(64, 96) * t.misaligned_row_cost)
    assert g.busy_kblock_us(128, 256, misaligned=True) == g.busy_kblock_us(128, 256)


def test_evict_first_b():
    """B streams with an evict-first L2 policy where M <= 128, its rows are at least 2 KB and it is [N, K]."""
    def streams(m, n, k, **kw):
        return g.pick_config(m, n, k, 2, H100, **kw).stream_b
    assert streams(64, 7168, 16384) and streams(128, 2048, 28672) and streams(16, 7168, 2048)
    assert streams(128, 8192, 1024) and not streams(128, 8192, 1016)  # 2048-byte rows and up
    assert not streams(128, 32768, 512)                 # short rows: measured 10% slower
    assert not streams(256, 256, 32768)                 # B re-read by other row blocks
    assert not streams(128, 4096, 16384, b_kn=True)     # [K, N] panels: measured 7% slower
    assert "STREAM_B" in g._defines(dt.bfloat16, dt.bfloat16, g.pick_config(64, 7168, 16384, 2, H100))
    assert "STREAM_B" not in g._defines(dt.bfloat16, dt.bfloat16, g.pick_config(4096, 7168, 16384, 2, H100))


def test_validation_before_launch():
    a, b = fake((64, 128), "bf16"), fake((256, 128), "bf16")
    with pytest.raises(TypeError, match="same dtype"):
        ck.gemm(a, fake((256, 128), "fp16"), out=fake((64, 256), "bf16"))
    with pytest.raises(ValueError, match="K differs"):
        ck.gemm(a, fake((256, 120), "bf16"), out=fake((64, 256), "bf16"))
    with pytest.raises(TypeError, match="a: dtype float32"):
        ck.gemm(fake((64, 128), "fp32"), b, out=fake((64, 256), "bf16"))
    with pytest.raises(ValueError, match=r"out: expected shape \(64, 256\)"):
        ck.gemm(a, b, out=fake((64, 255), "bf16"))
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        ck.gemm(fake((64, 100), "bf16", strides=(100, 1)), fake((256, 100), "bf16"), out=fake((64, 256), "bf16"))
    with pytest.raises(TypeError, match="out: dtype float8_e4m3"):
        ck.gemm(a, b, out=fake((64, 256), "e4m3"))
    with pytest.raises(ValueError, match="b_layout must be"):
        ck.gemm(a, b, b_layout="tn")
    with pytest.raises(ValueError, match=r"b is \[K, N\] = \(256, 128\): K differs"):
        ck.gemm(a, b, out=fake((64, 128), "bf16"), b_layout="kn")
    with pytest.raises(TypeError, match="host"):
        ck.gemm(np.ones((64, 128), np.float32), b)
    with pytest.raises(ValueError, match="split_k"):
        ck.gemm(a, b, out=fake((64, 256), "bf16"), split_k=0)
    with pytest.raises(ValueError, match=r"c: expected shape \(64, 256\)"):
        ck.gemm(a, b, out=fake((64, 256), "bf16"), c=fake((64, 128), "bf16"))


# ---- GPU -------------------------------------------------------------------------------------------------------

def _rand(rng, shape, dtype):
    return (rng.standard_normal(shape) * 0.5).astype(np.float32).astype(ck.runtime.dtypes.as_dtype(dtype).numpy)


SHAPES = [(1, 8, 8), (3, 24, 40), (17, 136, 72), (64, 64, 64), (65, 200, 1000), (128, 256, 64), (129, 264, 200),
          (300, 520, 1040), (777, 1000, 136), (1024, 2112, 512), (2048, 2048, 2048), (8192, 256, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype,out_dtype", [("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32"), ("fp16", "fp32")])
def test_gemm_matches_float64(rng, shape, dtype, out_dtype):
    m, n, k = shape
    a, b = _rand(rng, (m, k), dtype), _rand(rng, (n, k), dtype)
    out = DeviceArray.empty((m, n), out_dtype).fill_bytes(0xFF)  # NaN poison: every element must be written
    ck.gemm(DeviceArray.from_numpy(a), DeviceArray.from_numpy(b), out=out)
    got = out.numpy().astype(np.float64)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} elements not written"
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= (1e-4 if out_dtype == "fp32" else 1e-2), err


def _check(got, ref, out_dtype):
    got = got.astype(np.float64)
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} elements not written"
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= (1e-4 if out_dtype in ("fp32", "float32") else 1e-2), err


def _check_c_added_and_accumulate(rng, da, db, ref, c_dtype, tuning=None):
    """D = A @ B^T + C into a poisoned bf16 out, then D += A @ B^T twice in place into an fp32 D."""
    m, n = ref.shape
    cm = _rand(rng, (m, n), c_dtype)
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
    ck.gemm(da, db, out=out, c=DeviceArray.from_numpy(cm), tuning=tuning)
    _check(out.numpy(), ref + cm.astype(np.float64), "bf16")
    d0 = rng.standard_normal((m, n)).astype(np.float32)
    d = DeviceArray.from_numpy(d0)
    for _ in range(2):
        assert ck.gemm(da, db, out=d, c=d, tuning=tuning) is d
    _check(d.numpy(), d0.astype(np.float64) + 2 * ref, "fp32")


SPLIT_SHAPES = [(1, 8, 1024), (17, 136, 2000), (33, 104, 3000), (100, 264, 4104), (128, 128, 8192), (300, 40, 3000)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("splits", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("out_dtype", ["bf16", "fp32"])
def test_split_k_forced(rng, shape, splits, out_dtype):
    m, n, k = shape
    a, b = _rand(rng, (m, k), "bf16"), _rand(rng, (n, k), "bf16")
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    for deterministic in (False, False, True):  # twice in arrival order: the counters must come back to zero
        out = DeviceArray.empty((m, n), out_dtype).fill_bytes(0xFF)
        ck.gemm(DeviceArray.from_numpy(a), DeviceArray.from_numpy(b), out=out, split_k=splits,
                deterministic=deterministic)
        _check(out.numpy(), ref, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(128, 128, 65536), (256, 256, 32768), (17, 1280, 8192)],
                         ids=lambda s: "x".join(map(str, s)))
def test_split_k_heuristic_and_deterministic_bitwise(rng, shape):
    m, n, k = shape
    assert g.pick_config(m, n, k, 2, g.device_properties(0)).splits > 1
    a, b = _rand(rng, (m, k), "bf16"), _rand(rng, (n, k), "bf16")
    da, db = DeviceArray.from_numpy(a), DeviceArray.from_numpy(b)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    out = DeviceArray.empty((m, n), "fp32")
    first = ck.gemm(da, db, out=out, deterministic=True).numpy()
    _check(first, ref, "fp32")
    for _ in range(19):
        out.fill_bytes(0xFF)
        assert np.array_equal(ck.gemm(da, db, out=out, deterministic=True).numpy().view(np.uint32),
                              first.view(np.uint32))
    _check(ck.gemm(da, db, out=out).numpy(), ref, "fp32")  # arrival order: same function, maybe other bits


@pytest.mark.gpu
@pytest.mark.parametrize("c_dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("m,n", [(130, 264), (13, 120)])  # M <= 64 split: one consumer warpgroup
def test_c_is_added(rng, c_dtype, splits, m, n):
    k = 1000
    a, b = _rand(rng, (m, k), "bf16"), _rand(rng, (n, k), "bf16")
    cm = _rand(rng, (m, n), c_dtype)
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
    ck.gemm(DeviceArray.from_numpy(a), DeviceArray.from_numpy(b), out=out, c=DeviceArray.from_numpy(cm),
            split_k=splits)
    _check(out.numpy(), a.astype(np.float64) @ b.astype(np.float64).T + cm.astype(np.float64), "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("splits,deterministic", [(1, False), (4, False), (4, True)])
def test_accumulate_into_fp32_d_twice(rng, splits, deterministic):
    m, n, k = 200, 136, 2048
    a, b = _rand(rng, (m, k), "bf16"), _rand(rng, (n, k), "bf16")
    d0 = rng.standard_normal((m, n)).astype(np.float32)
    d = DeviceArray.from_numpy(d0)
    da, db = DeviceArray.from_numpy(a), DeviceArray.from_numpy(b)
    for _ in range(2):
        assert ck.gemm(da, db, out=d, c=d, split_k=splits, deterministic=deterministic) is d
    ab = a.astype(np.float64) @ b.astype(np.float64).T
    _check(d.numpy(), d0.astype(np.float64) + 2 * ab, "fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 8, 8), (17, 136, 72), (65, 200, 1000), (129, 264, 200), (300, 520, 1040),
                                   (1024, 2112, 512), (2048, 2048, 2048)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype,out_dtype", [("bf16", "bf16"), ("fp16", "fp32")])
def test_gemm_b_kn(rng, shape, dtype, out_dtype):
    m, n, k = shape
    a, b = _rand(rng, (m, k), dtype), _rand(rng, (k, n), dtype)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    for split in (None, 1, 4):
        out = DeviceArray.empty((m, n), out_dtype).fill_bytes(0xFF)
        ck.gemm(DeviceArray.from_numpy(a), DeviceArray.from_numpy(b), out=out, b_layout="kn", split_k=split)
        _check(out.numpy(), ref, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,tile", [((100, 1000, 1040), (128, 1)), ((128, 1000, 1040), (192, 2)),
                                        ((96, 520, 2056), (256, 3)), ((65, 136, 200), (128, 1))],
                         ids=lambda s: "x".join(map(str, s)))
def test_b_kn_pairs_split_the_panels(rng, shape, tile):
    """B as [K, N] shared by a pair of 64-row tiles, each CTA multicasting every other 64-column panel: odd panel
    counts, N past the last panel, split-K (deterministic twice, bitwise equal); every element written and right."""
    m, n, k = shape
    bn, splits = tile
    cfg = g.make_config(m, n, k, 2, driver.device_properties(0), 64, bn, splits, b_kn=True, mcast=g.MCAST_SHARE_B)
    a, b = _rand(rng, (m, k), "bf16"), _rand(rng, (k, n), "bf16")
    ref = a.astype(np.float64) @ b.astype(np.float64)
    runs = []
    for _ in range(2):
        out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
        ck.gemm(DeviceArray.from_numpy(a), DeviceArray.from_numpy(b), out=out, b_layout="kn", deterministic=True,
                tuning=g.GemmTuning(force_config=cfg))
        _check(out.numpy(), ref, "bf16")
        runs.append(out.numpy().view(np.uint16))
    assert np.array_equal(*runs)


def test_b_kn_pairs_only_whole_panels():
    """Pairs sharing [K, N] B: 64-row tiles of two or more whole 64-column panels; where the split model takes them at
    M 65..128 (H200, 2026-11-29, 60 changed shapes: 0.878x the time of the unpaired picks, 1.161 -> 1.019x
    cuBLAS's)."""
    for p in (H100, H200):
        assert g.pick_config(96, 5120, 8192, 2, p, b_kn=True).mcast == g.MCAST_SHARE_B
        for bm, bn in ((64, 64), (64, 96), (64, 160), (128, 256)):
            assert sm90.pick_multicast(128, 4096, bm, bn, 2, True, p, g.TUNING) != g.MCAST_SHARE_B, (bm, bn)
        assert sm90.pick_multicast(128, 4096, 64, 192, 2, True, p, g.TUNING) == g.MCAST_SHARE_B


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [g.MCAST_SHARE_B, g.MCAST_SHARE_A])
@pytest.mark.parametrize("shape", [(300, 520, 1040), (129, 264, 200), (385, 1000, 136), (200, 136, 2048),
                                   (1024, 2112, 512)], ids=lambda s: "x".join(map(str, s)))
def test_cluster_pairs(rng, mode, shape):
    """2-CTA clusters with a multicast A or B (forced wherever that side is legal), on odd tile counts (a spare
    tile in the last pair) and tails: plain bf16 out, C added, deterministic split-K into fp32, and accumulate in
    place."""
    tuning = replace(g.TUNING, force_mcast=mode)
    m, n, k = shape
    a, b = _rand(rng, (m, k), "bf16"), _rand(rng, (n, k), "bf16")
    da, db = DeviceArray.from_numpy(a), DeviceArray.from_numpy(b)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    for out_dtype, split, det in (("bf16", None, False), ("fp32", 3, True), ("bf16", 4, False)):
        out = DeviceArray.empty((m, n), out_dtype).fill_bytes(0xFF)
        ck.gemm(da, db, out=out, split_k=split, deterministic=det, tuning=tuning)
        _check(out.numpy(), ref, out_dtype)
    _check_c_added_and_accumulate(rng, da, db, ref, "fp16", tuning)
    used = {p.cfg.mcast for k, p in PLANS.items("gemm") if k[-1] is tuning}
    assert mode in used  # the forced pairing really ran


@pytest.mark.gpu
@pytest.mark.parametrize("shape,bn", [((256, 256, 8192), 128), ((200, 1000, 3000), 96), ((193, 520, 4160), 64),
                                      ((256, 136, 2048), 32)], ids=lambda s: "x".join(map(str, s)) if isinstance(s, tuple) else str(s))
def test_clusters_of_four(rng, shape, bn):
    """64-row tiles in clusters of four along M that share B (each CTA loads a quarter): split-K (the heuristic's,
    and forced counts, deterministic into fp32) and unsplit, with M and N tails and spare tiles past M."""
    m, n, k = shape
    a, b = _rand(rng, (m, k), "bf16"), _rand(rng, (n, k), "bf16")
    da, db = DeviceArray.from_numpy(a), DeviceArray.from_numpy(b)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    props = driver.device_properties(0)
    for splits, out_dtype, det in ((1, "bf16", False), (3, "fp32", True), (5, "bf16", False)):
        cfg = g.make_config(m, n, k, 2 if out_dtype == "bf16" else 4, props, 64, bn, splits)
        cfg = replace(cfg, mcast=sm90.MCAST_SHARE_B4, group_m=sm90.group_rows(m, n, 64, bn, sm90.MCAST_SHARE_B4, props))
        tuning = replace(g.TUNING, force_config=cfg)
        for _ in range(2):
            out = DeviceArray.empty((m, n), out_dtype).fill_bytes(0xFF)
            ck.gemm(da, db, out=out, deterministic=det, tuning=tuning)
            _check(out.numpy(), ref, out_dtype)
    pick = g.pick_config(m, n, k, 2, props)
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
    ck.gemm(da, db, out=out)
    _check(out.numpy(), ref, "bf16")
    if m == 256 and n == 256:
        assert pick.mcast == sm90.MCAST_SHARE_B4  # the heuristic's own choice there


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(129, 264, 200), (191, 1000, 1040), (192, 136, 3000), (330, 40, 520),
                                   (383, 4096, 136)], ids=lambda s: "x".join(map(str, s)))
def test_192_row_tiles(rng, shape):
    """Three consumer warpgroups (M in 129..192 and 321..384): plain bf16 and fp32 out, forced splits in both
    orders, C added, accumulate in place, B as [K, N]."""
    m, n, k = shape
    a, b = _rand(rng, (m, k), "bf16"), _rand(rng, (n, k), "bf16")
    da, db = DeviceArray.from_numpy(a), DeviceArray.from_numpy(b)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    PLANS.clear()
    rows = g.GemmTuning(swap_ab=False)  # (swapped operands would put M on the tile's columns)
    for out_dtype, split, det in (("bf16", None, False), ("fp32", 1, False), ("bf16", 3, False), ("fp32", 5, True)):
        out = DeviceArray.empty((m, n), out_dtype).fill_bytes(0xFF)
        ck.gemm(da, db, out=out, split_k=split, deterministic=det, tuning=rows)
        _check(out.numpy(), ref, out_dtype)
    _check_c_added_and_accumulate(rng, da, db, ref, "bf16", tuning=rows)
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
    ck.gemm(da, DeviceArray.from_numpy(np.ascontiguousarray(b.T)), out=out, b_layout="kn")
    _check(out.numpy(), ref, "bf16")
    assert {p.cfg.bm for p in PLANS.values("gemm")} == {192}


@pytest.mark.gpu
@pytest.mark.parametrize("shape,tile", [((300, 1000, 1040), (192, 128)), ((257, 520, 200), (192, 64)),
                                        ((190, 1000, 1040), (128, 112)), ((777, 264, 136), (128, 48)),
                                        ((140, 2000, 520), (128, 256)), ((321, 600, 1040), (192, 192))],
                         ids=lambda s: "x".join(map(str, s)))
def test_consumers_past_m_only_free_the_stages(rng, shape, tile):
    """The last row of tiles with one or two consumers whose rows are all past M (they issue no wgmma), rows
    rotated by wave: every element written and right, unsplit and paired as the heuristic pairs them."""
    m, n, k = shape
    a, b = _rand(rng, (m, k), "bf16"), _rand(rng, (n, k), "bf16")
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    props = driver.device_properties(0)
    for mcast in (sm90.MCAST_NONE, sm90.MCAST_SHARE_B):
        cfg = replace(g.make_config(m, n, k, 2, props, *tile, 1), mcast=mcast)
        out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
        ck.gemm(DeviceArray.from_numpy(a), DeviceArray.from_numpy(b), out=out,
                tuning=g.GemmTuning(force_config=cfg))
        _check(out.numpy(), ref, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("shape,tile", [((300, 1000, 1040), (128, 152)), ((257, 520, 200), (64, 136)),
                                        ((77, 200, 3000), (192, 80)), ((700, 4160, 520), (128, 240)),
                                        ((129, 264, 72), (64, 8)), ((1000, 136, 64), (128, 256)),
                                        ((257, 1000, 1040), (256, 88)), ((300, 600, 200), (256, 112)),
                                        ((288, 1000, 1040), (256, 72)), ((144, 600, 520), (192, 72))],
                         ids=lambda s: "x".join(map(str, s)))
def test_swapped_operands(rng, shape, tile):
    """D^T = B A^T written through the transposed epilogue (TRANS_OUT): M (odd or not) on the tile's columns, N
    on its rows, tails of both and of K; C (bf16 or fp32) added; fp16 too. Every element written and right."""
    m, n, k = shape
    props = driver.device_properties(0)
    cfg = g.make_config(n, m, k, 2, props, *tile, 1, swap_ab=True)
    assert cfg.mcast == (g.MCAST_SHARE_A if g.swap_pairs(m, *tile) else g.MCAST_NONE)  # (pairs: 128/192/256 x even)
    tuning = g.GemmTuning(force_config=cfg)
    for dtype, c_dtype in (("bf16", None), ("fp16", "fp32"), ("bf16", "bf16")):
        a, b = _rand(rng, (m, k), dtype), _rand(rng, (n, k), dtype)
        ref = a.astype(np.float64) @ b.astype(np.float64).T
        c = None if c_dtype is None else _rand(rng, (m, n), c_dtype)
        out = DeviceArray.empty((m, n), dtype).fill_bytes(0xFF)
        ck.gemm(DeviceArray.from_numpy(a), DeviceArray.from_numpy(b), out=out,
                c=None if c is None else DeviceArray.from_numpy(c), tuning=tuning)
        _check(out.numpy(), ref if c is None else ref + c.astype(np.float64), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,tile", [((257, 1000, 2080), (128, 88, 2, g.MCAST_NONE)),
                                        ((300, 600, 4160), (192, 104, 3, g.MCAST_NONE)),
                                        ((144, 1000, 2080), (128, 72, 2, g.MCAST_SHARE_A)),
                                        ((257, 5120, 1040), (128, 88, 2, g.MCAST_NONE)),
                                        ((77, 200, 3000), (192, 80, 4, g.MCAST_NONE)),
                                        ((257, 1000, 2080), (128, 96, 1, sm90.MCAST_SHARE_B4)),
                                        ((257, 2048, 8192), (128, 96, 2, sm90.MCAST_SHARE_B4)),
                                        ((160, 1024, 1040), (256, 96, 1, sm90.MCAST_SHARE_B4))],
                         ids=lambda s: "x".join(map(str, s)))
def test_swapped_split_and_fours(rng, shape, tile):
    """Swapped operands split over K (the workspace in D's orientation, partials reduce-added transposed: one wave,
    where the splits share the finish, and more, where the last split finishes) and in fours sharing B (the
    activations): C added, fp16, deterministic runs bitwise equal; every element written and right."""
    m, n, k = shape
    bm, bn, splits, mcast = tile
    cfg = g.make_config(n, m, k, 2, driver.device_properties(0), bm, bn, splits, swap_ab=True, mcast=mcast)
    _check_forced(rng, m, n, k, cfg, (("bf16", None, False), ("fp16", "fp32", False), ("bf16", "bf16", True)))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,offset", [((1801, 1744, 1992), 0), ((512, 4096, 1416), 0), ((300, 1000, 2048), 8),
                                          ((129, 600, 4104), 0)], ids=lambda s: "x".join(map(str, s)) if isinstance(s, tuple) else f"offset{s}")
def test_misaligned_rows_gpu(rng, shape, offset):
    """Rows off 128-byte boundaries, K % 64 != 0 or A and B views `offset` columns into wider rows: the plan takes
    the misaligned pick (1801 rows: one wave of pairs sharing B; 512: 64-row pairs; split-K at 300 and 129 rows)
    and its maps fill 128 bytes; every element written and right, with C."""
    m, n, k = shape
    a_full, b_full = _rand(rng, (m, k + offset), "bf16"), _rand(rng, (n, k + offset), "bf16")
    da, db = DeviceArray.from_numpy(a_full), DeviceArray.from_numpy(b_full)
    views = [DeviceArray.from_pointer(x.ptr + 2 * offset, (x.shape[0], k), "bf16", (k + offset, 1)) for x in (da, db)]
    assert all(sm90.rows_misaligned(v) for v in views)
    c = _rand(rng, (m, n), "bf16")
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
    PLANS.clear()
    ck.gemm(*views, out=out, c=DeviceArray.from_numpy(c))
    (plan,) = PLANS.values("gemm")
    assert plan.map_a.l2_promotion == plan.map_b.l2_promotion == 128
    assert plan.cfg == g.pick_config(m, n, k, 2, driver.device_properties(0), misaligned=True)
    if m == 1801:
        assert (plan.cfg.splits, plan.cfg.mcast) == (1, g.MCAST_SHARE_B)
        assert g.pick_config(m, n, k, 2, driver.device_properties(0)).mcast == g.MCAST_NONE
    ref = a_full[:, offset:].astype(np.float64) @ b_full[:, offset:].astype(np.float64).T + c.astype(np.float64)
    _check(out.numpy(), ref, "bf16")


def _check_forced(rng, m, n, k, cfg, runs, kn=False):
    """Run the forced config `cfg` once per (dtype, C dtype or None, deterministic) of `runs` (twice where
    deterministic: bitwise equal) into NaN-filled outputs, each checked against float64. With `kn`, B is [K, N] and a
    view with padded rows."""
    tuning = g.GemmTuning(force_config=cfg)
    for dtype, c_dtype, det in runs:
        a = _rand(rng, (m, k), dtype)
        if kn:
            b_full = _rand(rng, (k, n + 24), dtype)
            db_full = DeviceArray.from_numpy(b_full)  # (kept: the view does not own its memory)
            db = DeviceArray.from_pointer(db_full.ptr, (k, n), dtype, (n + 24, 1))
            ref = a.astype(np.float64) @ b_full[:, :n].astype(np.float64)
        else:
            b = _rand(rng, (n, k), dtype)
            db = DeviceArray.from_numpy(b)
            ref = a.astype(np.float64) @ b.astype(np.float64).T
        c = None if c_dtype is None else _rand(rng, (m, n), c_dtype)
        outs = []
        for _ in range(2 if det else 1):
            out = DeviceArray.empty((m, n), dtype).fill_bytes(0xFF)
            ck.gemm(DeviceArray.from_numpy(a), db, out=out, b_layout="kn" if kn else "nk", deterministic=det,
                    c=None if c is None else DeviceArray.from_numpy(c), tuning=tuning)
            outs.append(out.numpy())
            _check(outs[-1], ref if c is None else ref + c.astype(np.float64), dtype)
        if det:
            assert np.array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,tile", [((300, 1000, 1040), (128, 152, 1, g.MCAST_NONE)),
                                        ((257, 1000, 2080), (128, 88, 2, g.MCAST_NONE)),
                                        ((144, 1000, 2080), (192, 72, 2, g.MCAST_SHARE_A)),
                                        ((257, 2000, 1040), (128, 96, 1, sm90.MCAST_SHARE_B4)),
                                        ((300, 600, 200), (256, 104, 1, g.MCAST_NONE)),
                                        ((520, 1000, 2056), (256, 88, 1, g.MCAST_SHARE_A))],
                         ids=lambda s: "x".join(map(str, s)))
def test_swapped_kn(rng, shape, tile):
    """B as [K, N] with swapped operands: the kernel's A is B's [K, N] memory read as MN-major panels (A_MN), alone,
    shared by pairs and split over K; N (the tile's rows) ends inside a panel; B a view with padded rows; C added,
    fp16, deterministic runs bitwise equal; every element written and right."""
    m, n, k = shape
    bm, bn, splits, mcast = tile
    cfg = g.make_config(n, m, k, 2, driver.device_properties(0), bm, bn, splits, swap_ab=True, mcast=mcast)
    assert "A_MN" in g._defines(dt.bfloat16, dt.bfloat16, cfg, b_kn=True)
    _check_forced(rng, m, n, k, cfg, (("bf16", None, False), ("fp16", "fp32", splits > 1), ("bf16", "bf16", False)),
                  kn=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(384, 4096, 2056), (257, 5120, 2056)], ids=lambda s: "x".join(map(str, s)))
def test_swapped_fours_run_only_where_they_fit(rng, shape):
    """A pick of swapped fours runs them only where the device holds all of them at once, else the plan re-picks
    without them (a second round of fours about doubles the time): 384 rows take 32 fours of 128 x 96 tiles, 257
    rows 30; the result is right either way."""
    m, n, k = shape
    props = driver.device_properties(0)
    cfg = g.pick_config(m, n, k, 2, props)
    assert cfg.swap_ab and cfg.mcast == sm90.MCAST_SHARE_B4
    launch = get_launcher("gemm.cu", "gemm_kernel", g._defines(dt.bfloat16, dt.bfloat16, cfg), 0, g._ARGS,
                          (cfg.threads,), cfg.smem, cluster=(4, 1, 1), pdl=g.TUNING.pdl)
    cl_m, cl_n = sm90.cluster_tiles(n, m, cfg.bm, cfg.bn, cfg.mcast)
    a, b = _rand(rng, (m, k), "bf16"), _rand(rng, (n, k), "bf16")
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
    PLANS.clear()
    ck.gemm(DeviceArray.from_numpy(a), DeviceArray.from_numpy(b), out=out)
    (plan,) = PLANS.values("gemm")
    assert (plan.cfg.mcast == sm90.MCAST_SHARE_B4) == (cl_m * cl_n * cfg.splits <= launch.max_active_clusters())
    _check(out.numpy(), a.astype(np.float64) @ b.astype(np.float64).T, "bf16")


def test_swap_picks():
    """Swapped operands where M sits badly on 64-row tiles: 300 x 8192 x 28672 takes 152 columns over M (304
    rows, not 384), with B as [N, K] or [K, N]; never for an fp32 D, C accumulated in place, forced split-K, M or K
    out of range."""
    for props in (H100, H200):
        pick = g.pick_config(300, 8192, 28672, 2, props)
        assert pick.swap_ab and (pick.bm, pick.bn, pick.splits) == (128, 152, 1)
        # B as [K, N] takes the same swapped tiles (H200, 2026-11-29: 69 real-model layers at M 144..700 whose
        # [K, N] pick changed ran 0.802x the time of the unswapped one, 1.237 -> 0.992x cuBLAS's)
        assert g.pick_config(300, 8192, 28672, 2, props, b_kn=True) == pick
        for kw in ({"out_bytes": 4}, {"accumulate": True}, {"split_k": 1}):
            assert not g.pick_config(300, 8192, 28672, **{"out_bytes": 2, "props": props, **kw}).swap_ab
        assert not g.pick_config(4096, 8192, 28672, 2, props).swap_ab
        assert not g.pick_config(128, 10240, 8192, 2, props).swap_ab   # M <= 128: the 64-row and split paths
        assert not g.pick_config(783, 16384, 1024, 2, props).swap_ab   # short K (1.075x the unswapped time)
        assert g.pick_config(700, 8192, 28672, 2, props).swap_ab
        assert not g.pick_config(300, 8192, 28672, 2, props, tuning=g.GemmTuning(swap_ab=False)).swap_ab
        # H200, 2026-11-29, same rounds with cuBLAS: 300x10240x8192 256 x 104 (three columns over M) 1.007x cuBLAS's
        # time against 1.171 for 128 x 240 unswapped; 144x10240x5120 192 x 72 in pairs 0.856 against 0.980
        for shape, want in (((300, 10240, 8192), (256, 104, g.MCAST_NONE)),
                            ((144, 10240, 5120), (192, 72, g.MCAST_SHARE_A))):
            cfg = g.pick_config(*shape, 2, props)
            assert cfg.swap_ab and (cfg.bm, cfg.bn, cfg.mcast) == want, shape
        # H200, 2026-11-29, old pick / new pick / cuBLAS in the same rounds: fours of 128 x 96 sharing the activations
        # (cuBLAS runs 128 x 88 in fours there) 1.209 -> 1.152x cuBLAS's time; split-K over swapped tiles where one
        # wave of unsplit ones leaves SMs idle: 129x2112x7168 1.635 -> 0.960 (192 x 72 x 5 in pairs)
        cfg = g.pick_config(257, 5120, 25600, 2, props)
        assert cfg.swap_ab and (cfg.bm, cfg.bn, cfg.splits, cfg.mcast) == (128, 96, 1, sm90.MCAST_SHARE_B4)
        cfg = g.pick_config(129, 2112, 7168, 2, props)
        assert cfg.swap_ab and cfg.splits > 1 and cfg.mcast == g.MCAST_SHARE_A
        assert g.pick_config(257, 5120, 25600, 2, props, tuning=g.GemmTuning(swap_quads=False)).mcast != 3
        forced = g.GemmTuning(force_mcast=g.MCAST_NONE)  # force_mcast holds for swapped picks too
        assert g.pick_config(257, 5120, 25600, 2, props, tuning=forced).mcast == g.MCAST_NONE
        forced = g.GemmTuning(force_config=pick)  # a forced swapped config where it cannot run: a clear error
        for kw in ({"out_bytes": 4}, {"accumulate": True}):
            with pytest.raises(ValueError, match="swap_ab"):
                g.pick_config(300, 8192, 28672, **{"out_bytes": 2, "props": props, "tuning": forced, **kw})


def test_kn_whole_panels():
    """64-row tiles over a [K, N] B (loaded in whole 64-column panels) take widths of whole panels where one of them
    makes the wave, and any width where none does; taller tiles keep every width."""
    assert g._whole_panels([48, 64, 80, 128, 160], 1000, 64, True) == [64, 128]
    assert g._whole_panels([48, 64, 80], 40, 64, True) == [48, 64, 80]        # all of N in one tile
    assert g._whole_panels([80, 208], 1000, 128, True) == [80, 208]
    assert g._whole_panels([80, 208], 1000, 64, False) == [80, 208]
    for props in (H100, H200):
        # H200, 2026-11-29: 64 x 176 -> 64 x 192 ran 0.738x / 0.947x the time
        for shape in ((1044, 1216, 4080), (505, 2728, 1864)):
            cfg = g.pick_config(*shape, 2, props, b_kn=True)
            assert (cfg.bm, cfg.bn) == (64, 192) and (g.pick_config(*shape, 2, props).bn, cfg.bn) == (176, 192)
        # no whole-panel wave at 140 x 1928 or 144 x 3072: any width (140x1928x512 64 x 48 ran 0.86x the time of
        # the 192 x 16 tiles it would give way to, H200)
        for shape, bn in (((140, 1928, 512), 48), ((144, 3072, 1536), 80)):
            cfg = g.pick_config(*shape, 2, props, b_kn=True)
            assert (cfg.bm, cfg.bn) == (64, bn), shape


def test_busy_tile_price():
    """`busy_kblock_us`: wide tiles pay for their area, narrow tall ones for the rows they load (pairs sharing A load
    half of A's); a lone partial wave is cheaper per k block; swapped pairs only over an even count of columns."""
    t = g.TUNING
    assert g.busy_kblock_us(128, 256) == pytest.approx(t.area_kb_us * 128 * 256)
    assert g.busy_kblock_us(256, 64) == pytest.approx(t.row_kb_us * 320)
    assert g.busy_kblock_us(256, 64, g.MCAST_SHARE_A) == pytest.approx(t.area_kb_us * 256 * 64)  # 192 rows' load
    assert g.busy_kblock_us(64, 256) == pytest.approx(t.area_kb_us * 64 * 256)  # one consumer: the area alone
    assert g.lone_wave_share(132, H200) == 1.0 and g.lone_wave_share(66, H200) == pytest.approx(0.85)
    assert g.swap_pairs(300, 128, 152) and not g.swap_pairs(300, 256, 104) and not g.swap_pairs(300, 64, 152)
    # fours sharing B: BN in quarters of whole 8-row atoms, whole clusters, one wave; not without swap_quads
    assert g.swap_multicasts(257, 5120, 128, 96, H200) == [g.MCAST_NONE, sm90.MCAST_SHARE_B4]
    assert g.swap_multicasts(257, 5120, 128, 88, H200) == [g.MCAST_NONE]
    assert g.swap_multicasts(300, 4096, 128, 160, H200) == [g.MCAST_NONE, g.MCAST_SHARE_A, sm90.MCAST_SHARE_B4]
    assert sm90.MCAST_SHARE_B4 not in g.swap_multicasts(257, 4864, 128, 96, H200)  # 38 rows of tiles
    assert sm90.MCAST_SHARE_B4 not in g.swap_multicasts(257, 16384, 128, 96, H200)  # 384 tiles: three waves
    assert g.swap_multicasts(257, 5120, 128, 96, H200, g.GemmTuning(swap_quads=False)) == [g.MCAST_NONE]


def test_ragged_m_takes_the_least_loaded_tiles():
    """M > 128 not a multiple of 128, tiles that fill the GPU: `ragged_pick` (192-row tiles where the last row's
    idle consumers and the three consumers' rate make them cheaper); multiples of 128 and one-wave shapes keep the
    old rule."""
    for props in (H100, H200):
        pick = g.pick_config(300, 36864, 7168, 2, props, tuning=g.GemmTuning(swap_ab=False))
        assert (pick.bm, pick.bn, pick.splits) == (192, 192, 1)
        assert g.pick_config(2112, 4096, 14336, 2, props).bm == 192
        assert g.pick_config(4096, 7168, 16384, 2, props).bm == 128       # a multiple of 128: unchanged
        assert g.pick_config(129, 264, 200, 2, props).bm == 192           # one wave: row_tile
        # the estimate: a last row of 128-row tiles with one consumer's rows costs lone_consumer_share of a full row
        full = g.ragged_time_us(256, 16384, 4096, 128, 128, props)
        part = g.ragged_time_us(320, 16384, 4096, 128, 128, props)
        assert full < part < 1.5 * full


# ---- decode path (M <= 16): ptx/gemm_decode.cu --------------------------------------------------------------------

def test_decode_choices():
    assert g.pick_decode(16, 1280, 4096, H100) == g.DecodeConfig(2, 16)     # 80 CTAs of 16 rows
    assert g.pick_decode(1, 2112, 16384, H100) == g.DecodeConfig(2, 16)     # 132 CTAs; A is 32 KB
    assert g.pick_decode(8, 2048, 8192, H100) == g.DecodeConfig(2, 16)      # A at the 128 KB limit
    # None: M > 16; too few CTAs; short K; A of 256 KB or more read by every CTA (16x1280x8192: the split wgmma
    # kernel 11.5 us, decode 11.8); more than one 16-row CTA per SM (16x4096x8192: unsplit 64 x 32 wgmma tiles)
    for shape in ((17, 1280, 4096), (16, 1024, 8192), (16, 7168, 2048), (16, 32768, 512), (16, 1280, 8192),
                  (16, 4096, 8192), (1, 7168, 16384)):
        assert g.pick_decode(*shape, H100) is None, shape
    assert g.pick_decode(16, 1280, 4096, H100, split_k=1) is None          # a forced split runs the wgmma kernel
    assert g.pick_decode(16, 1280, 4096, H100, b_kn=True) is None


def test_decode_grid_past_one_cta_per_sm():
    """With decode_max_fill lifted: 32-row CTAs once they fill the SMs, 8 warps (two CTAs a SM) past one wave."""
    t = replace(g.TUNING, decode_max_fill=float("inf"), decode_max_a_bytes=float("inf"))
    assert g.pick_decode(16, 4096, 8192, H100, tuning=t) == g.DecodeConfig(4, 16)     # 128 CTAs of 32 rows
    assert g.pick_decode(1, 7168, 16384, H100, tuning=t) == g.DecodeConfig(4, 8)      # 224 CTAs: two per SM
    assert g.pick_decode(16, 3000, 8192, H100, tuning=t) == g.DecodeConfig(2, 8)


# Every M <= 16 shape with B as [N, K] to the decode kernel, short K and small N included.
DECODE_EVERYWHERE = replace(g.TUNING, decode_min_k=1, decode_min_fill=0, decode_max_fill=float("inf"),
                            decode_max_a_bytes=float("inf"))




DECODE_SHAPES = [(1, 8, 8), (3, 24, 40), (8, 1000, 72), (13, 1288, 1000), (16, 4104, 4104), (16, 2048, 8192),
                 (5, 7168, 136), (16, 600, 65536), (16, 1280, 8192), (2, 4096, 8200)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype,out_dtype", [("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32"), ("fp16", "fp32")])
def test_decode_matches_float64(rng, shape, dtype, out_dtype):
    m, n, k = shape
    assert g.pick_decode(m, n, k, g.device_properties(0), tuning=DECODE_EVERYWHERE) is not None
    a, b = _rand(rng, (m, k), dtype), _rand(rng, (n, k), dtype)
    out = DeviceArray.empty((m, n), out_dtype).fill_bytes(0xFF)
    ck.gemm(DeviceArray.from_numpy(a), DeviceArray.from_numpy(b), out=out, tuning=DECODE_EVERYWHERE)
    _check(out.numpy(), a.astype(np.float64) @ b.astype(np.float64).T, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("c_dtype", ["bf16", "fp16", "fp32"])
def test_decode_c_added_and_accumulate_in_place(rng, c_dtype):
    m, n, k = 11, 1032, 3000
    a, b = _rand(rng, (m, k), "bf16"), _rand(rng, (n, k), "bf16")
    da, db = DeviceArray.from_numpy(a), DeviceArray.from_numpy(b)
    _check_c_added_and_accumulate(rng, da, db, a.astype(np.float64) @ b.astype(np.float64).T, c_dtype,
                                  DECODE_EVERYWHERE)


@pytest.mark.gpu
def test_decode_is_bitwise_stable_and_split_k_forces_the_wgmma_kernel(rng):
    m, n, k = 16, 1280, 4096
    assert g.pick_decode(m, n, k, g.device_properties(0)) is not None
    a, b = _rand(rng, (m, k), "bf16"), _rand(rng, (n, k), "bf16")
    da, db = DeviceArray.from_numpy(a), DeviceArray.from_numpy(b)
    out = DeviceArray.empty((m, n), "fp32")
    first = ck.gemm(da, db, out=out).numpy()
    _check(first, a.astype(np.float64) @ b.astype(np.float64).T, "fp32")
    for _ in range(5):
        out.fill_bytes(0xFF)
        assert np.array_equal(ck.gemm(da, db, out=out, deterministic=True).numpy().view(np.uint32),
                              first.view(np.uint32))
    for split in (1, 4):  # forced split counts run the wgmma kernel: same function
        out.fill_bytes(0xFF)
        _check(ck.gemm(da, db, out=out, split_k=split).numpy(), a.astype(np.float64) @ b.astype(np.float64).T,
               "fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [None, 1, 3])  # None: the decode kernel
def test_padded_row_strides(rng, split_k):
    """A, B and D as views with padded rows (row strides larger than the row, 16-byte multiples)."""
    m, n, k, pad = 8, 1400, 4104, 24
    a_full, b_full = _rand(rng, (m, k + pad), "bf16"), _rand(rng, (n, k + pad), "bf16")
    da_full, db_full = DeviceArray.from_numpy(a_full), DeviceArray.from_numpy(b_full)
    d_full = DeviceArray.empty((m, n + pad), "fp32").fill_bytes(0xFF)
    da = DeviceArray.from_pointer(da_full.ptr, (m, k), "bf16", (k + pad, 1))
    db = DeviceArray.from_pointer(db_full.ptr, (n, k), "bf16", (k + pad, 1))
    d = DeviceArray.from_pointer(d_full.ptr, (m, n), "fp32", (n + pad, 1))
    assert (g.pick_decode(m, n, k, g.device_properties(0), split_k) is not None) == (split_k is None)
    ck.gemm(da, db, out=d, split_k=split_k)
    got = d_full.numpy()
    _check(got[:, :n], a_full[:, :k].astype(np.float64) @ b_full[:, :k].astype(np.float64).T, "fp32")
    assert np.isnan(got[:, n:]).all()  # the padding of D is not written


def test_pick_ab_script_compiles_without_a_gpu(tmp_path):
    """scripts/gemm_pick_ab.py --compile runs on a CPU machine: against this tree as its own base no pick
    differs, so nothing is compiled and nothing is timed."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, CUDART_KERNELS_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, str(repo / "scripts" / "gemm_pick_ab.py"), str(repo), "--compile",
                          "--m", "300", "--random", "5", "--layout", "kn"],
                         capture_output=True, text=True, env=env, cwd=repo, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "base: compiled the picks of 0 shapes" in out.stdout and "new: compiled the picks of 0 shapes" in out.stdout


def test_held_in_ab_script_sets():
    """scripts/held_in_ab.py times the benchmark's held-in sets: BF16 large and skinny whole, FP8 normal at M <= 128."""
    import importlib.util
    from pathlib import Path

    import cudart_kernels
    from cudart_kernels.ops import gemm_fp8 as f

    path = Path(__file__).resolve().parent.parent / "scripts" / "held_in_ab.py"
    spec = importlib.util.spec_from_file_location("held_in_ab", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sets = mod.held_in_sets(cudart_kernels)
    assert [s[1:] for s in sets["BF16 large"]] == list(g.BENCH_SHAPES["large"])
    assert [s[1:] for s in sets["BF16 skinny"]] == list(g.BENCH_SHAPES["skinny"])
    fp8 = [s[1:] for s in sets["FP8 M <= 128"]]
    assert fp8 and all(m <= 128 for m, _, _ in fp8)
    assert len(fp8) == sum(m <= 128 for m, _, _ in f.BENCH_SHAPES["normal"])
