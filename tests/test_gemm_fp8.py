"""FP8 block-scaled GEMM: config heuristics and validation on the CPU; correctness against a float64 GEMM of the
dequantized inputs on the GPU."""
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

import cudart_kernels as ck
from cudart_kernels.ops import gemm as g
from cudart_kernels.ops import gemm_fp8 as f
from cudart_kernels.runtime.plans import PLANS
from cudart_kernels.ops.quantize import mmajor_stride
from cudart_kernels.runtime.driver import H100, H200
from cudart_kernels.runtime.interop import DeviceArray
from cudart_kernels.runtime.launch import get_launcher

FAKE = 0x7F0000000000


def fake(shape, dtype, strides=None):
    return DeviceArray.from_pointer(FAKE, shape, dtype, strides)


@pytest.mark.parametrize("shape", f.BENCH_SHAPES["normal"] + [(1, 16, 16), (17, 136, 200), (300, 8, 4096),
                                                            (192, 1536, 7168), (150, 512, 16384),
                                                            (1000, 512, 16384), (297, 3072, 4096)])
def test_config_fits_and_matches_the_kernel_layout(shape):
    m, n, k = shape
    cfg = f.pick_config(m, n, k, H100)
    one_wave_64 = -(-m // 64) * -(-n // 128) <= H100.sm_count  # (64 x 128 tiles may replace a few rows of 128)
    assert cfg.bm == 64 if m <= 64 else cfg.bm in ((64, 128) if m <= 128 or cfg.splits > 1 or one_wave_64
                                                    else (128, 192, 256))
    assert cfg.bn % 16 == 0 and 16 <= cfg.bn <= (128 if cfg.bm in (192, 256) else f.MAX_BN)
    assert 3 <= cfg.stages <= f.MAX_STAGES
    assert cfg.smem == f.smem_bytes(cfg.bm, cfg.bn, cfg.stages) <= H100.smem_per_block_optin
    # As many stages as fit, capped at one tile's k blocks (never below MIN_STAGES).
    cap = min(f.MAX_STAGES, max(f.TUNING.min_stages, -(-k // f.BK)))
    assert cfg.stages == cap or f.smem_bytes(cfg.bm, cfg.bn, cfg.stages + 1) > H100.smem_per_block_optin
    if cfg.splits > 1:  # one wave of (tile, split) units, every CTA of a cluster on one tile
        assert cfg.mcast == g.MCAST_NONE and cfg.bm <= 128 and cfg.cluster == cfg.splits
        assert -(-m // cfg.bm) * -(-n // cfg.bn) * cfg.splits <= H100.sm_count


def tile_and_splits(cfg):
    return cfg.bm, cfg.bn, cfg.splits


def test_config_choices():
    # 4096 rows, N = 7168, K = 16384: 128 k blocks (H100, 132 SMs). 128 x 128: 1792 tiles, 14 waves x (1.12 +
    # 128 x 0.514) = 937 us; 128 x 192: 1216 tiles, 10 waves x 91.5 = 915; 256 x 128: 896 tiles, 7 waves x 121.8 =
    # 853 (measured 872, 842, 791) -> 256 x 128, pairs along N sharing the 256-row A tile, three stages (its
    # whole-slice output buffers take the fourth one's room).
    cfg = f.pick_config(4096, 7168, 16384, H100)
    assert (cfg.bm, cfg.bn, cfg.mcast, cfg.stages) == (256, 128, g.MCAST_SHARE_A, 3)
    assert f._tile_us(256, 128, 128, f.NORMAL, f.TUNING) == pytest.approx(121.82)
    assert f._chunk(128) == 64 and f._chunk(256) == 32
    # Short K: the fixed cost per tile counts. N = 32768, K = 512: 256 x 128 in 32 waves x 5.26 = 168 us against
    # 128 x 192 in 42 waves x 4.05 = 170 and 192 x 128 in 43 waves x 3.72 = 160 (H200, 2026-11-28, same run:
    # 148.5 us against 154.4 for 256 x 128; the 256 x 128 fixed cost 1.04 -> 1.5 flipped it)
    assert f.pick_config(4096, 32768, 512, H100).bm == 192
    # 192 x 128 (three consumers): 22 x 56 = 1232 tiles, 10 waves x (1.0 + 128 x 0.68) = 880 here, so 256 x 128
    # stays. N = 2112: 192 x 128 is 22 x 17 = 374 tiles, 3 waves x 39.1; 128 x 192 is 32 x 11 = 352 tiles, 3 waves
    # x 40.7; 256 x 128 is 16 x 17 = 272 tiles, 3 waves x 54.1.
    assert f._tile_us(192, 128, 128, f.NORMAL, f.TUNING) == pytest.approx(88.04)
    assert (f.pick_config(4096, 2112, 7168, H100).bm, f.pick_config(4096, 2112, 7168, H100).bn) == (192, 128)
    # 192 x 128 where it takes no more waves than 128 x 192 (the same rows x columns; H200, 2026-11-28, same run
    # with DeepGEMM, 18 shapes: 0.955x the time of the earlier picks, bitwise equal, 576x5120x8192 0.75x); 128 x
    # 192 against 128 x 128 and 256 x 128 where waves round differently (H100, 2026-11-27: 2048 x 7168 x 7168
    # 178.5 us against 185.4 for 128 x 128; 6144 x 5120 x 7168 0.92x the 256 x 128 time)
    assert (f.pick_config(2048, 7168, 7168, H100).bm, f.pick_config(2048, 7168, 7168, H100).bn) == (192, 128)
    assert (f.pick_config(6144, 5120, 7168, H100).bm, f.pick_config(6144, 5120, 7168, H100).bn) == (192, 128)
    # 3072 x 2112: 128 x 192 in 24 x 11 = 264 tiles, 2 waves x 40.7; 192 x 128 in 16 x 17 = 272, 3 waves x 39.1
    assert (f.pick_config(3072, 2112, 7168, H100).bm, f.pick_config(3072, 2112, 7168, H100).bn) == (128, 192)
    # one row of tiles: memory-bound, fewest waves (128 x 64 here, and 128 x 128 at N = 16384), no pairs along N;
    # at most 64 wide and M > 64 it runs as two rows of 64 x 2BN tiles paired along M (H100, 2026-11-27: 93 shapes
    # M 72..128, N 4608..8192, 0.841-0.981x the time; wider pairs lost, 1.048x over 96 shapes)
    small = f.pick_config(128, 7168, 16384, H100)
    assert (small.bm, small.bn, small.mcast, small.splits) == (64, 128, g.MCAST_SHARE_B, 1)
    assert (f.pick_config(72, 5120, 7168, H100).bm, f.pick_config(72, 5120, 7168, H100).bn) == (64, 96)
    wide = f.pick_config(128, 16384, 7168, H100)
    assert (wide.bm, wide.bn, wide.mcast) == (128, 128, g.MCAST_NONE)
    assert f.pick_config(64, 7168, 16384, H100).mcast == g.MCAST_NONE  # one row of 64: nothing to pair
    # ... unless 64-row tiles stream much less per CTA: 128 x 16 tiles (144 rows of K per CTA) -> 64 x 32 (96)
    # Its two rows of 64 x 64 tiles pair along M, sharing B (H100, 2026-11-27: 160 shapes M 65..128, N 3200..4096,
    # 0.876-0.988x the unpaired time); 64 x 48 tiles do not (no gain measured).
    narrow = f.pick_config(128, 4096, 7168, H100)
    assert (narrow.bm, narrow.bn, narrow.mcast, narrow.splits, narrow.cluster) == (64, 64, g.MCAST_SHARE_B, 1, 2)
    for m, n, k, bn in ((100, 4000, 3088, 64), (72, 3600, 1040, 64), (80, 7000, 2064, 128), (120, 5000, 1040, 96)):
        cfg = f.pick_config(m, n, k, H100)  # the GPU tests' shapes for these pairs
        assert (cfg.bm, cfg.bn, cfg.mcast) == (64, bn, g.MCAST_SHARE_B)
    assert f.pick_config(128, 3072, 7168, H100).mcast == g.MCAST_NONE
    assert f.pick_config(64, 4096, 7168, H100).mcast == g.MCAST_NONE  # one row of 64
    # split-K in two when it cuts the fill to 2/3 or less: 128 x 2112 x 7168, 64 x 32 tiles (132 tiles, 96 rows
    # of 7168 a CTA) -> 64 x 64 tiles, two K halves (66 x 2 units, 128 rows of 3584)
    split = f.pick_config(128, 2112, 7168, H100)
    assert (split.bm, split.bn, split.splits, split.cluster) == (64, 64, 2, 2)
    assert (f.pick_config(64, 2112, 7168, H100).bn, f.pick_config(64, 2112, 7168, H100).splits) == (32, 2)
    # ... but not with a short K (the fixed costs win) or a large B (DRAM-bound either way)
    assert f.pick_config(128, 7168, 2048, H100).splits == 1
    assert f.pick_config(64, 7168, 16384, H100).splits == 1
    assert f.pick_config(64, 7168, 16384, H100).bm == 64
    # ... nor where one row of tiles of 32+ columns busies 80% of the SMs (M >= 8): 64x4096x7168 64 x 32 x 128
    # tiles (13.0 us against 14.1 split); 128x7168x4096 128 x 64 (14.3 against 17.0); M = 4 still splits
    assert tile_and_splits(f.pick_config(64, 4096, 7168, H100)) == (64, 32, 1)
    assert tile_and_splits(f.pick_config(128, 7168, 4096, H100)) == (64, 128, 1)  # (128 x 64 as paired 64 x 128)
    assert tile_and_splits(f.pick_config(4, 4096, 7168, H100)) == (64, 64, 2)
    # On the H200 (32 GB/s of copy rate an SM against the H100's 22.7) a row of 64 x 32 tiles splits all the same:
    # 64 x 64 in two ran 0.83-0.99x the time on 24 shapes (M 8..64, N 3456..4224, K 4096..18432; 64x4096x7168
    # 0.933x, 12x4096x7168 0.859x); 64 x 48 -> 64 x 80 in two lost (64x5120x4096 1.078x), and so does a row of
    # 128-row tiles (H100: 128x7168x4096 above)
    assert tile_and_splits(f.pick_config(64, 4096, 7168, H200)) == (64, 64, 2)
    assert tile_and_splits(f.pick_config(12, 4096, 7168, H200)) == (64, 64, 2)
    assert tile_and_splits(f.pick_config(64, 5120, 4096, H200)) == (64, 48, 1)
    assert tile_and_splits(f.pick_config(128, 7168, 4096, H200)) == (64, 128, 1)
    assert tile_and_splits(f.pick_config(4, 4096, 7168, H200)) == (64, 64, 2)
    # ... and past the B limits (B at DRAM speed either way is the H100's reason): 64x4096x65536 0.723x the time,
    # 2x2048x65536 (64 x 16 unsplit) 0.662x, 64x3072x32768 0.728x
    assert tile_and_splits(f.pick_config(64, 4096, 65536, H100)) == (64, 32, 1)
    assert tile_and_splits(f.pick_config(64, 4096, 65536, H200)) == (64, 64, 2)
    assert tile_and_splits(f.pick_config(2, 2048, 65536, H200)) == (64, 32, 2)
    assert tile_and_splits(f.pick_config(64, 3072, 32768, H200)) == (64, 48, 2)
    assert f.pick_config(64, 7168, 16384, H200).splits == 1  # (64 x 64 unsplit: as wide as split_wide_bn)
    # B of 32-64 MB splits where the unsplit tiles are narrower than 48 columns (16x3072x16384: 64 x 32 x 96
    # tiles, 23.6 us -> 64 x 48 x 2, 21.1) or leave half the SMs idle (136x2112x16384: 37.2 -> 22.2), not
    # otherwise (32x4864x9728: 64 x 48 unsplit 19.8, split 21.4)
    assert tile_and_splits(f.pick_config(16, 3072, 16384, H100)) == (64, 48, 2)
    assert f.pick_config(136, 2112, 16384, H100).splits == 2
    assert f.pick_config(32, 4864, 9728, H100).splits == 1
    # Tiles of several rows that fill at most half the SMs split in two as well: 192 x 1536 x 7168 runs 2 x 24
    # tiles of 128 x 64 (192 rows of 7168 a CTA) -> 64 x 80 tiles, two K halves (3 x 20 x 2 units, 144 rows of
    # 3584); 240 x 2112 x 7168 -> 128 x 64 x 2 (2 x 33 x 2 units: 64 x 144 would stream 208 rows)
    assert tile_and_splits(f.pick_config(192, 1536, 7168, H100)) == (64, 80, 2)
    assert tile_and_splits(f.pick_config(240, 2112, 7168, H100)) == (128, 64, 2)
    assert tile_and_splits(f.pick_config(1000, 512, 16384, H100)) == (64, 128, 2)  # 8 x 8 tiles -> 16 x 4 x 2
    # ... not where the tiles already fill the SMs (2 x 64 tiles: the split lost, 20.0 -> 21.0 us)
    assert tile_and_splits(f.pick_config(192, 4096, 7168, H100))[2] == 1
    # contiguous: pairs along N only. 4 x 8192 rows, N = 4096: 128 x 192 in 43 waves x 40.7 = 1750 us against
    # 128 x 256 in 32 x 61.1 = 1956 and 128 x 128 in 63 x 29.9 = 1884; 256 x 128 in 32 x 54.1 = 1732, from a tile
    # list where it is taller than the alignment, with groups / 2 more rows of tiles (32 + 1 waves at 128); 192 x
    # 128 (three consumers, unpaired: 96-row halves ran 1.02x the time) from a list at alignment 128 and 256, with
    # 2 / 3 of the groups more rows: 171 + 2 rows of 32 tiles, 42 waves x 39.1 = 1641 (H200, 2026-11-28, same run
    # with DeepGEMM: 0.963x the time of 256 x 128 over 7 cases, 0.93x at K 2048)
    def contiguous(m, groups, alignment, n=4096, k=7168):
        c = f.pick_config(m, n, k, H100, f.CONTIGUOUS, groups, alignment)
        return c.bm, c.bn, c.mcast, c.tile_list
    assert contiguous(32768, 4, 256) == (192, 128, g.MCAST_NONE, 256)
    assert contiguous(32768, 4, 128) == (192, 128, g.MCAST_NONE, 128)
    assert contiguous(30976, 4, 128)[3]  # uneven experts (7000, 9100, 8192, 6450 rows, segments of 128)
    # 16 experts: 181 rows of 192 (44 waves, 1720) against 128 x 192 (1750) and 256 x 128 (33 waves, 1787); the
    # three ran level (H200, same run: 1710 / 1719 / 1712 us)
    assert contiguous(32768, 16, 128) == (192, 128, g.MCAST_NONE, 128)
    # without 192 x 128 in tile_us: 256 x 128 for few experts a row, 128 x 192 for many (H100, 2026-11-27, same
    # run, 16 experts: 1775 us against 1693)
    no192 = f.Fp8Tuning(tile_us=tuple(e for e in f.TUNING.tile_us if e[0] != (192, 128)))
    assert f.pick_config(32768, 4096, 7168, H100, f.CONTIGUOUS, 4, 128, no192).bm == 256
    assert f.pick_config(32768, 4096, 7168, H100, f.CONTIGUOUS, 16, 128, no192).bn == 192
    # segments aligned to 64: 128-row tiles from the list for any number of experts (same run, 16 to 64 experts:
    # 1.3-1.5x faster than 64-row tiles); 64 rows or fewer in all: one 64-row tile row
    for groups in (4, 28, 64, 256):
        assert contiguous(32768, groups, 64)[::3] == (128, 64)
    assert contiguous(64, 4, 64)[::3] == (64, 0)
    with pytest.raises(ValueError, match="force_tile has 256 rows"):  # three segments' rows in a tile row
        f.pick_config(32768, 4096, 7168, H100, f.CONTIGUOUS, 4, 64, tuning=f.Fp8Tuning(force_tile=(256, 128)))
    def pick_tile(m, n, k):
        c = f.pick_config(m, n, k, H100)
        return c.bm, c.bn, c.splits, c.mcast

    # 160 columns where the waves favour them (H100, 2026-11-27, same run against the previous pick: 2048x5120x7168
    # 128 x 128 -> 128 x 160 0.969, 2048x2112x2048 128 x 64 -> 128 x 160 0.821)
    assert f.pick_config(2048, 5120, 7168, H100).bn == 160
    assert f.pick_config(2048, 2112, 2048, H100).bn == 160
    # and, since its main loop runs in unrolled laps, over 256 x 128 at one wave of 128 x 160 against two of
    # 256 x 128 (H100, 2026-11-28, same run: 1024x7168x16384 0.956, 512x14336x7168 0.965)
    assert pick_tile(1024, 7168, 16384)[:2] == (128, 160)
    assert pick_tile(512, 14336, 7168)[:2] == (128, 160)
    # a few rows of 128-row tiles: one wave of 64-row tiles where cheaper (H100, 2026-11-28, same runs: 297x3072x4096
    # 128 x 96 -> 64 x 128 0.81x the time; against 64 x 128, 192x4096x7168 64 x 96 0.96x and 600x1024x7168 64 x 80
    # pairs 0.86x; 681x768x7168 128 x 64 -> 64 x 128 split in two 0.69x) ...
    assert pick_tile(297, 3072, 4096) == (64, 128, 1, f.MCAST_NONE)
    assert pick_tile(192, 4096, 7168) == (64, 96, 1, f.MCAST_NONE)
    # (unpaired since 2026-11-28: one wave of 10 rows of tiles, wave_pair_max_rows; H200 same-run A/B of the
    # one-wave pairs dropped, 12 normal shapes 0.95-1.00x the time, e.g. 512x1024x2048 64 x 80 0.973x)
    assert pick_tile(600, 1024, 7168) == (64, 80, 1, f.MCAST_NONE)
    assert pick_tile(681, 768, 7168)[::2] == (64, 2)
    # ... but not where the 128-row pick splits (201x2112x16384 128 x 64 split in two: 64 x 128 ran 1.34x its time),
    # nor where they take two waves (450x3072x4096)
    assert pick_tile(201, 2112, 16384)[::2] == (128, 2)
    assert pick_tile(450, 3072, 4096)[0] == 128
    assert pick_tile(4096, 7168, 16384)[0] == 256
    # memory-bound shapes never take 256 columns (one wave of them lost to two of 128 x 128)
    assert f.pick_config(128, 32768, 512, H100).bn == 128
    # masked, 1024 rows in one group: 256 x 128 (4096 x 7168: 4 waves x 53.7 against 6 x 43.3 for 128 x 192)
    assert f.pick_config(1024, 4096, 7168, H100, f.MASKED, 1).bm == 256


@pytest.mark.parametrize("props", [H100, H200], ids=["H100", "H200"])
def test_masked_pick_follows_expected_m(props):
    """expected_m counts a group's tiles for that many rows (the last half full), at most M's: groups holding about
    half of M take 128-row tiles where M alone picks 256 (H200: 0.77-0.81x the time), a few rows 64-row tiles;
    groups nearly full pick as without the hint (the bench's cases)."""
    def pick(m, n, k, groups, hint=None):
        c = f.pick_config(m, n, k, props, f.MASKED, groups, expected_m=hint)
        return c.bm, c.bn
    assert pick(256, 4096, 7168, 64)[0] == 256
    assert pick(256, 4096, 7168, 64, 144)[0] == 128
    assert pick(256, 28672, 4096, 8, 144)[0] == 128
    assert pick(256, 4096, 7168, 16, 32)[0] == 64
    for m, g_, real in ((1024, 1, 975), (512, 2, 486), (256, 4, 236), (64, 16, 56)):
        for n, k in ((4096, 7168), (7168, 2048)):
            assert pick(m, n, k, g_, -(-real // 16) * 16) == pick(m, n, k, g_)
    assert pick(256, 4096, 7168, 4, 10_000) == pick(256, 4096, 7168, 4)  # (a hint above M counts M)
    # pairs along M only where a group is expected to fill both tiles of the pair
    assert f.pick_config(256, 2816, 2048, props, f.MASKED, 64, expected_m=160).mcast != g.MCAST_SHARE_B


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8", np.float32(8), np.int64(0), np.bool_(True)])
def test_masked_expected_m_is_checked(bad):
    a, sa = fake((2, 64, 256), "e4m3"), fake((2, 64, 2), "fp32", (128, 1, 128))
    with pytest.raises(ValueError, match="expected_m"):
        ck.gemm_fp8_grouped_masked(a, sa, fake((2, 96, 256), "e4m3"), fake((2, 1, 2), "fp32"), fake((2,), "int32"),
                                   fake((2, 64, 96), "bf16"), expected_m=bad)


def _gemm_args(m, n, k, sa_strides=None):
    groups = -(-k // 128)
    sa = fake((m, groups), "fp32", sa_strides or (1, mmajor_stride(m)))
    return fake((m, k), "e4m3"), sa, fake((n, k), "e4m3"), fake((-(-n // 128), groups), "fp32")


def test_validation_before_launch():
    a, sa, b, sb = _gemm_args(64, 256, 512)
    out = fake((64, 256), "bf16")
    with pytest.raises(TypeError, match="a: dtype bfloat16"):
        ck.gemm_fp8(fake((64, 512), "bf16"), sa, b, sb, out)
    with pytest.raises(ValueError, match="K differs"):
        ck.gemm_fp8(a, sa, fake((256, 496), "e4m3"), sb, out)
    with pytest.raises(ValueError, match=r"sa: expected shape \(64, 4\)"):
        ck.gemm_fp8(a, fake((64, 3), "fp32", (1, 64)), b, sb, out)
    with pytest.raises(ValueError, match=r"sb: expected shape \(2, 4\)"):
        ck.gemm_fp8(a, sa, b, fake((4, 4), "fp32"), out)
    with pytest.raises(TypeError, match="sb: dtype bfloat16"):
        ck.gemm_fp8(a, sa, b, fake((2, 4), "bf16"), out)
    with pytest.raises(TypeError, match="out: dtype float32"):
        ck.gemm_fp8(a, sa, b, sb, fake((64, 256), "fp32"))
    with pytest.raises(ValueError, match=r"out: expected shape \(64, 256\)"):
        ck.gemm_fp8(a, sa, b, sb, fake((64, 248), "bf16"))
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        ck.gemm_fp8(fake((64, 500), "e4m3", (500, 1)), *_gemm_args(64, 256, 500)[1:2],
                    fake((256, 500), "e4m3", (500, 1)), _gemm_args(64, 256, 500)[3], out)
    with pytest.raises(TypeError, match="host"):
        ck.gemm_fp8(np.ones((64, 512), np.float32), sa, b, sb, out)


# ---- GPU -------------------------------------------------------------------------------------------------------

def _operands(rng, m, n, k):
    """Random e4m3 A and B (the full range, no zeros forced) and positive fp32 scales."""
    groups = -(-k // 128)
    a = np.clip(rng.standard_normal((m, k)) * 64, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    b = np.clip(rng.standard_normal((n, k)) * 64, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    sa = (rng.uniform(0.5, 2.0, (m, groups)) / 448).astype(np.float32)
    sb = (rng.uniform(0.5, 2.0, (-(-n // 128), groups)) / 448).astype(np.float32)
    deq_a = a.astype(np.float64) * np.repeat(sa.astype(np.float64), 128, axis=1)[:, :k]
    deq_b = (b.astype(np.float64) * np.repeat(np.repeat(sb.astype(np.float64), 128, axis=0), 128, axis=1)[:n, :k])
    return a, sa, b, sb, deq_a @ deq_b.T


def _mmajor(sa):
    """Upload [M, G] scales in the TMA-aligned M-major layout (column stride M rounded up to 4)."""
    m, groups = sa.shape
    ld = mmajor_stride(m)
    host = np.zeros((groups, ld), np.float32)
    host[:, :m] = sa.T
    base = DeviceArray.from_numpy(host)
    view = DeviceArray.from_pointer(base.ptr, (m, groups), "fp32", (1, ld), device=base.device)
    return view, base  # keep `base` alive while `view` is used


def _check(out, ref):
    got = out.numpy().astype(np.float64)
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} elements not written"
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= 5e-3, err


SHAPES = [(1, 16, 16), (3, 24, 48), (17, 136, 208), (64, 256, 128), (65, 264, 1008), (128, 520, 4112),
          (129, 2112, 384), (300, 1000, 1040), (777, 776, 2064), (4096, 2112, 272), (2048, 7168, 512),
          (150, 520, 8208), (250, 1000, 4112),  # two rows of tiles split in two by the pick
          (20, 3000, 16400), (140, 2104, 16400),  # B of 32-64 MB split in two (narrow tiles; half the SMs idle)
          (40, 4000, 4112), (100, 7000, 4112),  # one row of tiles that fills the SMs: unsplit (H200: the first split)
          (40, 5200, 4112),  # ... 64 x 48, unsplit on both parts
          (100, 4000, 3088), (72, 3600, 1040),  # two rows of 64 x 64 tiles paired along M (the second partial)
          (80, 7000, 2064), (120, 5000, 1040),  # ... of 64 x 128 and 64 x 96 (a row of 128 x 64 / 128 x 48 before)
          (297, 3000, 4112), (681, 760, 7200),  # a few rows of 128: one wave of 64 x 128 tiles (the second split)
          (192, 4000, 3104),  # ... of 64 x 96 (777x776x2064 above: 64 x 80)
          (240, 1000, 1040), (129, 392, 384)]  # one wave that pairs: 4 rows of 64 x 80 (B), 7 columns of 128 x 64 (A)


def test_gpu_shapes_take_the_paths_they_stand_for():
    """SHAPES (the GPU correctness tests) keep exercising each kind of pick on either part: a pick rule that moves
    one of them elsewhere fails here, on the CPU, rather than leaving a path untested."""
    for p in (H100, H200):
        picks = {s: f.pick_config(*s, p) for s in SHAPES}
        for s in ((128, 520, 4112), (150, 520, 8208), (250, 1000, 4112), (20, 3000, 16400), (140, 2104, 16400),
                  (681, 760, 7200)):
            assert picks[s].splits == 2, (p.name, s)
        for s in ((100, 7000, 4112), (40, 5200, 4112)):  # unsplit, one row busying 80% of the SMs
            c = picks[s]
            assert c.splits == 1 and -(-s[0] // c.bm) * -(-s[1] // c.bn) >= 0.8 * p.sm_count, (p.name, s)
        for s in ((100, 4000, 3088), (72, 3600, 1040), (80, 7000, 2064), (120, 5000, 1040), (240, 1000, 1040)):
            assert (picks[s].bm, picks[s].mcast) == (64, g.MCAST_SHARE_B), (p.name, s)
        # one wave whose shared tile has many readers runs unpaired (wave_pair_max_rows / _cols)
        assert picks[300, 1000, 1040].mcast == picks[129, 2112, 384].mcast == g.MCAST_NONE
        for s in ((297, 3000, 4112), (192, 4000, 3104), (777, 776, 2064)):  # one wave of 64-row tiles, M > 128
            assert (picks[s].bm, picks[s].splits) == (64, 1), (p.name, s)
        assert {picks[s].bm for s in ((4096, 2112, 272), (2048, 7168, 512))} == {192}
        assert (picks[129, 392, 384].bm, picks[129, 392, 384].mcast) == (128, g.MCAST_SHARE_A)
    assert tile_and_splits(f.pick_config(40, 4000, 4112, H100)) == (64, 32, 1)
    assert tile_and_splits(f.pick_config(40, 4000, 4112, H200)) == (64, 64, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["mmajor", "rowmajor"])
def test_gemm_fp8_matches_float64(rng, shape, layout):
    m, n, k = shape
    a, sa, b, sb, ref = _operands(rng, m, n, k)
    if layout == "mmajor":
        sa_dev, keep = _mmajor(sa)
    else:  # converted by the op (documented cost)
        sa_dev = keep = DeviceArray.from_numpy(sa)
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)  # NaN poison: every element must be written
    ck.gemm_fp8(DeviceArray.from_numpy(a), sa_dev, DeviceArray.from_numpy(b), DeviceArray.from_numpy(sb), out)
    del keep
    _check(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("k,promotion", [(4112, 128), (4096, 256)])
def test_misaligned_rows_fill_128_bytes(rng, k, promotion):
    """Rows off 128-byte boundaries (K % 128 != 0) load through maps with 128-byte L2 fills (H200, 2026-11-29:
    0.86-0.95x the time of 256-byte fills on ten such shapes, outputs bitwise equal), aligned rows through 256."""
    m, n = 300, 1000
    a, sa, b, sb, ref = _operands(rng, m, n, k)
    sa_dev, keep = _mmajor(sa)
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
    PLANS.clear()
    ck.gemm_fp8(DeviceArray.from_numpy(a), sa_dev, DeviceArray.from_numpy(b), DeviceArray.from_numpy(sb), out)
    (plan,) = PLANS.values("gemm_fp8")
    assert plan.map_a.l2_promotion == plan.map_b.l2_promotion == promotion
    _check(out, ref)


@pytest.mark.gpu
def test_gemm_fp8_from_quantize_ops(rng):
    """The quantization ops' outputs go straight in (zero-copy scales), against the dequantized float64 GEMM."""
    m, n, k = 200, 392, 1008
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    qa, sa = ck.quantize_fp8_per_token(DeviceArray.from_numpy(x))
    qb, sb = ck.quantize_fp8_per_block(DeviceArray.from_numpy(w))
    out = ck.gemm_fp8(qa, sa, qb, sb)
    sa_h, sb_h = sa.numpy().astype(np.float64), sb.numpy().astype(np.float64)
    deq_a = qa.numpy().astype(np.float64) * np.repeat(sa_h, 128, axis=1)[:, :k]
    deq_b = qb.numpy().astype(np.float64) * np.repeat(np.repeat(sb_h, 128, axis=0), 128, axis=1)[:n, :k]
    _check(out, deq_a @ deq_b.T)


def forced(mode=None, tile=None, splits=None):
    """A tuning that pairs tiles on side `mode` wherever legal, runs BM x BN `tile`s and `splits` K slices."""
    return replace(f.TUNING, force_mcast=mode, force_tile=tile, force_splits=splits)


def plans_under(tuning):
    """The FP8 plans made with `tuning`."""
    return [p for k, p in PLANS.items("gemm_fp8") if any(x is tuning for x in k)]


def _check_forced(rng, m, n, k, tuning):
    """A random m x n x k FP8 GEMM under `tuning` into a poisoned output, against the float64 reference."""
    a, sa, b, sb, ref = _operands(rng, m, n, k)
    sa_dev, keep = _mmajor(sa)
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
    ck.gemm_fp8(DeviceArray.from_numpy(a), sa_dev, DeviceArray.from_numpy(b), DeviceArray.from_numpy(sb), out,
                tuning=tuning)
    _check(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [g.MCAST_SHARE_B, g.MCAST_SHARE_A])
@pytest.mark.parametrize("shape", [(300, 520, 1040), (129, 264, 208), (385, 1000, 144), (1024, 2112, 512)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gemm_fp8_cluster_pairs(rng, mode, shape):
    m, n, k = shape
    # (sharing A takes 128-row tiles, which the pick leaves for one wave of 64-row ones at 300x520x1040)
    t = forced(mode, (128, 64) if mode == g.MCAST_SHARE_A and f.pick_config(m, n, k, H100).bm == 64 else None)
    _check_forced(rng, m, n, k, t)
    assert mode in {p.cfg.mcast for p in plans_under(t)}  # the forced pairing really ran


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [g.MCAST_NONE, g.MCAST_SHARE_B, g.MCAST_SHARE_A])
@pytest.mark.parametrize("shape", [(200, 392, 1040), (577, 1000, 400), (1000, 264, 2064), (384, 256, 128),
                                   (2000, 3000, 656)], ids=lambda s: "x".join(map(str, s)))
def test_gemm_fp8_192_row_tiles(rng, mode, shape):
    """Three consumer warpgroups (192-row tiles) with tails in M, N and K, unpaired and in either pairing; 2000 x
    3000: 264 tiles, so CTAs run a second tile (the ring's phase, laps from a later stage, output buffers reused)."""
    m, n, k = shape
    t = forced(mode, (192, 128))
    _check_forced(rng, m, n, k, t)
    cfgs = {(p.cfg.bm, p.cfg.mcast) for p in plans_under(t)}
    assert (192, mode) in cfgs  # the forced tile and pairing really ran


@pytest.mark.gpu
@pytest.mark.parametrize("mnks", [(200, 264, (256, 0, 384)), (400, 136, (2048, 128)), (1000, 520, (640, 1152, 256))],
                         ids=lambda s: f"{s[0]}x{s[1]}x{'-'.join(map(str, s[2]))}")
def test_wgrad_192_row_tiles(rng, mnks):
    """The weight gradient on three consumers (192-row tiles, the one-set loop without unrolled laps): tails in M
    (a tile row's last slices written by fp32 atomic adds, not TMA: the next group's rows follow in D) and N, a
    group without tokens, 16 k blocks in one group, CTAs running several tiles; added to a random D."""
    m, n, ks = mnks
    k = sum(ks)
    t = forced(None, (192, 128))
    a, sa = _e4m3(rng, (m, k)), _scales(rng, (m, k // 128))
    b, sb = _e4m3(rng, (n, k)), _scales(rng, (n, k // 128))
    d0 = rng.standard_normal((len(ks), m, n)).astype(np.float32)
    d = DeviceArray.from_numpy(d0)
    ck.gemm_fp8_wgrad(DeviceArray.from_numpy(a), DeviceArray.from_numpy(sa), DeviceArray.from_numpy(b),
                      DeviceArray.from_numpy(sb), d, ks, tuning=t)
    got = d.numpy().astype(np.float64) - d0
    da, db = _deq_rows(a, sa), _deq_rows(b, sb)
    start = 0
    for e, ke in enumerate(ks):
        if ke == 0:
            assert (got[e] == 0).all(), "a group without tokens changed D"
        else:
            assert _rel_err(got[e], da[:, start:start + ke] @ db[:, start:start + ke].T) <= 5e-3, e
        start += ke
    assert {(p.cfg.bm, p.cfg.mcast) for p in plans_under(t)} == {(192, g.MCAST_NONE)}  # (never paired)


def test_192_row_tiles_not_for_the_masked_layout():
    with pytest.raises(ValueError, match="192-row tiles"):
        f.pick_config(1024, 4096, 7168, H100, f.MASKED, 2, tuning=forced(None, (192, 128)))
    assert f.pick_config(1024, 4096, 7168, H100, f.KGROUPED, 2, tuning=forced(None, (192, 128))).bm == 192
    # contiguous: a 192-row tile row may hold three segments that start at multiples of 64
    with pytest.raises(ValueError, match="three segments"):
        f.pick_config(1024, 4096, 7168, H100, f.CONTIGUOUS, 4, 64, tuning=forced(None, (192, 128)))
    for alignment in (128, 256):
        assert f.pick_config(1024, 4096, 7168, H100, f.CONTIGUOUS, 4, alignment,
                             tuning=forced(None, (192, 128))).tile_list == alignment
    for tile in ((192, 256), (256, 160), (96, 128), (128, 72)):  # (tiles the kernel does not build)
        with pytest.raises(ValueError, match="force_tile"):
            f.pick_config(1024, 4096, 7168, H100, tuning=forced(None, tile))
    for tile, splits in (((192, 128), 2), ((256, 128), 2), ((128, 64), 16)):
        with pytest.raises(ValueError, match="force_splits"):
            f.pick_config(1024, 4096, 7168, H100, tuning=forced(None, tile, splits))


def test_picks_follow_the_device():
    """The FP8 picks read the SM count and shared memory (their costs are per tile and wave, fitted in same-run
    sweeps), and the copy rate in one place: a row of 64-row tiles narrower than 48 columns that busies the SMs
    splits in two where each SM's share of the copy rate is above unsplit_max_sm_stream, and 256 x 128 tiles pair
    along N only where it is at most pair_a_max_sm_stream, masked 128-row tiles pair at all only there. An H200
    (the H100's SMs, 1.4x the bandwidth) gets the H100's benchmark picks but those; a part with fewer SMs gets its
    own."""
    h100_pcie = replace(H100, name="NVIDIA H100 PCIe (assumed)", sm_count=114)
    differ = [(a, b) for a, b in zip(f._bench_configs(H100), f._bench_configs(H200)) if a != b]
    unpaired = [(a, b) for a, b in differ if (a.mcast, b.mcast) == (g.MCAST_SHARE_A, g.MCAST_NONE)
                and (a.bm == 256 or (a.layout, a.bm) == (f.CONTIGUOUS, 128))]
    assert unpaired and all(replace(a, mcast=g.MCAST_NONE, group_m=b.group_m) == b for a, b in unpaired)
    assert [(tile_and_splits(a), tile_and_splits(b)) for a, b in differ if (a, b) not in unpaired] == [
        ((64, 32, 1), (64, 64, 2))]
    assert list(f._bench_configs(h100_pcie)) != list(f._bench_configs(H100))
    for cfg in f._bench_configs(h100_pcie):
        assert cfg.smem <= h100_pcie.smem_per_block_optin
    for _, cfg in differ:  # CI compiles the H200's picks as well
        assert f._defines(cfg) in [v[2] for v in f.variants()]
    # the normal GEMM's 256 x 128 tiles: pairs sharing A at the H100's copy rate per SM, none at the H200's; the
    # masked layout keeps its pairs on both
    assert f.pick_config(4096, 7168, 16384, H100).mcast == g.MCAST_SHARE_A
    h200 = f.pick_config(4096, 7168, 16384, H200)
    assert (h200.bm, h200.mcast) == (256, g.MCAST_NONE)
    assert f.pick_config(1024, 7168, 2048, H200, f.MASKED, 1).mcast == g.MCAST_SHARE_A
    # masked 128-row tiles of half-full groups: paired at the H100's copy rate (along M, and along N), never at the
    # H200's; the same tiles either way
    for m, n, k, groups, hint, mode in ((512, 4096, 14336, 64, 288, g.MCAST_SHARE_B),
                                        (256, 2816, 2048, 32, 160, g.MCAST_SHARE_A)):
        h100 = f.pick_config(m, n, k, H100, f.MASKED, groups, expected_m=hint)
        h200 = f.pick_config(m, n, k, H200, f.MASKED, groups, expected_m=hint)
        assert (h100.bm, h100.mcast) == (128, mode)
        assert (h200.bm, h200.bn, h200.mcast) == (128, h100.bn, g.MCAST_NONE)
    # contiguous 128-row tiles pair along N at the H100's copy rate; at the H200's only where the groups average
    # under contiguous_pair_max_group_rows rows of tiles (128 experts of 132 rows of 128 a pair; of 210, none)
    for m, groups, h200_mode in ((128 * 132, 128, g.MCAST_SHARE_A), (128 * 210, 128, g.MCAST_NONE),
                                 (128 * 26, 16, g.MCAST_NONE)):
        h100 = f.pick_config(m, 4096, 7168, H100, f.CONTIGUOUS, groups, 128)
        h200 = f.pick_config(m, 4096, 7168, H200, f.CONTIGUOUS, groups, 128)
        assert (h100.bm, h100.mcast) == (128, g.MCAST_SHARE_A)
        assert (h200.bm, h200.bn, h200.mcast) == (128, h100.bn, h200_mode)


# ---- grouped layouts and the weight gradient: CPU --------------------------------------------------------------

def test_grouped_configs():
    for g_, rows, n, k in f.BENCH_SHAPES["contiguous"]:
        cfg = f.pick_config(g_ * rows, n, k, H100, f.CONTIGUOUS, g_)
        assert cfg.mcast != g.MCAST_SHARE_B  # tiles paired along M could belong to two experts
        assert f.pick_config(g_ * rows, n, k, H100, f.CONTIGUOUS, g_, 64).bm == 128  # (from the tile list)
    for g_, rows, n, k in f.BENCH_SHAPES["masked"]:
        cfg = f.pick_config(rows, n, k, H100, f.MASKED, g_)
        assert cfg.bm == 64 if rows <= 64 else cfg.bm in (128, 256) and cfg.bm <= rows
        # pairs along M only inside a group: a group of one row of tiles never pairs with a spare
        assert cfg.mcast != g.MCAST_SHARE_B or -(-rows // cfg.bm) >= 2
    for g_, tokens, m, n in f.BENCH_SHAPES["wgrad"]:
        cfg = f.pick_config(m, n, g_ * tokens, H100, f.KGROUPED, g_)
        assert cfg.smem == f.smem_bytes(cfg.bm, cfg.bn, cfg.stages, f.KGROUPED) <= H100.smem_per_block_optin
        # one more 1x128 scale column of B per stage
        def four_stages(layout=f.NORMAL):
            return f.smem_bytes(cfg.bm, cfg.bn, 8, layout) - f.smem_bytes(cfg.bm, cfg.bn, 4, layout)
        assert four_stages(f.KGROUPED) - four_stages() >= 4 * cfg.bn * 4 - 1024


@pytest.mark.parametrize("props", [H100, H200], ids=["H100", "H200"])
def test_wgrad_192_row_tiles_from_16_k_blocks(props):
    """The weight gradient takes 192 x 128 tiles (three consumers) where waves x tile_us_wgrad is at most
    wgrad_tall_gain of the best 128-row tile's, from 16 k blocks a tile. 8 experts x 4096 tokens, M 7168, N 2048:
    8 x 38 x 16 = 4864 tiles, 37 waves x (1.43 + 32 x 0.636) = 806 us against 128 x 192's 8 x 56 x 11 = 4928, 38
    waves x (1.68 + 32 x 0.655) = 861: 0.936 (H200, 2026-11-28, same rounds: 0.952x the time, bitwise equal).
    M 2048, N 7168: 0.988, and M 4096, N 7168 (4 x 8192): 0.992, stay 128 x 192 (measured 0.999x and 0.992x)."""
    def tile(g_, tokens, m, n):
        cfg = f.pick_config(m, n, g_ * tokens, props, f.KGROUPED, g_)
        assert cfg.mcast == g.MCAST_NONE
        return cfg.bm, cfg.bn
    assert [tile(*s) for s in f.BENCH_SHAPES["wgrad"]] == [(192, 128), (128, 192), (128, 192)]
    assert f._tile_us(192, 128, 32, f.KGROUPED, f.TUNING) == pytest.approx(1.43 + 32 * 0.636)
    assert f._tile_us(128, 192, 32, f.KGROUPED, f.TUNING) == pytest.approx(1.12 * 1.5 + 32 * 0.514 * 1.5 * 0.85)
    assert tile(8, 2048, 2048, 2048) == (192, 128)    # 16 k blocks
    assert tile(16, 1024, 7168, 2048) == (128, 192)   # 8 (1.02x the time as 192 x 128)
    assert tile(4, 8192, 7168, 1024) == (192, 128)    # against 128 x 256: 0.77x
    # 192 rows counted per group: M 256 takes two tile rows a group (3 waves against 128 x 192's 2; 1.25x)
    assert tile(4, 2048, 256, 5120) == (128, 192)
    assert tile(1, 2048, 2048, 5120) == (128, 128)    # an estimate of 0.994 (1.06x the time)


def test_fp8_evict_first_b():
    """As the BF16 GEMM's rule (gemm.streams_b) with 1-byte elements, for the normal layout only."""
    assert f.pick_config(128, 7168, 2048, H100).stream_b and f.pick_config(64, 2112, 7168, H100).stream_b
    assert not f.pick_config(128, 24576, 1536, H100).stream_b   # 1536-byte rows
    assert not f.pick_config(4096, 7168, 2048, H100).stream_b   # B re-read by 32 row blocks
    assert not f.pick_config(64, 7168, 2048, H100, f.MASKED, 16).stream_b  # measured neutral
    assert f._defines(f.pick_config(128, 7168, 2048, H100))["STREAM_B"] == 1


def test_warm_l2_normal_layout_with_pdl_only():
    """B's first k block goes to L2 before pdl_wait only where the tiles need nothing the previous kernel wrote
    (normal layout) and the kernel is launched with PDL."""
    assert "L2_WARM" in f._defines(f.pick_config(4096, 7168, 16384, H100))
    assert "L2_WARM" in f._defines(f.pick_config(64, 2112, 7168, H100))
    for layout in (f.CONTIGUOUS, f.MASKED, f.KGROUPED):
        assert "L2_WARM" not in f._defines(f.pick_config(4096, 4096, 7168, H100, layout, 4))
    assert "L2_WARM" not in f._defines(f.pick_config(4096, 7168, 16384, H100, tuning=f.Fp8Tuning(pdl=False)))
    assert "L2_WARM" not in f._defines(f.pick_config(4096, 7168, 16384, H100, tuning=f.Fp8Tuning(warm_l2=False)))


def test_scales_at_issue_for_128_row_tiles_and_one_row_of_64_and_96_wide_tiles():
    """SCALES_AT_ISSUE: the normal and masked layouts' unsplit 128-row tiles of up to 128 columns and single row of
    64 x 64 / 64 x 96 tiles (split or not), from scales_at_issue_min_k; not other 64-row widths, two rows of 64-row
    tiles, 256- or 192-row tiles, the contiguous and K-grouped layouts, or with scales_at_issue_bn empty."""
    for p in (H100, H200):
        for s in ((64, 7168, 16384), (64, 7168, 2048), (16, 12288, 7168), (128, 12288, 7168), (384, 5120, 4096)):
            c = f.pick_config(*s, p)
            assert c.scales_at_issue and (c.bm, c.splits) in ((64, 1), (64, 2), (128, 1)), (p.name, s, c)
            assert f._defines(c)["SCALES_AT_ISSUE"] == 1
        for s in ((128, 4096, 7168), (96, 4096, 7168), (64, 5120, 7168), (4096, 7168, 2048), (128, 32768, 512),
                  (64, 7168, 1024)):
            assert not f.pick_config(*s, p).scales_at_issue, (p.name, s)
        assert not f.pick_config(64, 7168, 2048, p, f.MASKED, 16).scales_at_issue
        for s, e in (((128, 1536, 2048, p, f.MASKED, 8), 84), ((64, 1536, 2048, p, f.MASKED, 8), 42)):
            c = f.pick_config(*s, expected_m=e)
            assert c.scales_at_issue and (c.bm, c.bn) in ((128, 96), (64, 96)), (p.name, s, c)
            assert not f.pick_config(*s[:3], p, f.MASKED, 8, tuning=f.Fp8Tuning(scales_at_issue_min_k=4096),
                                     expected_m=e).scales_at_issue
        # (64-row tiles in groups of M 128)
        assert not f.pick_config(128, 1536, 2048, p, f.MASKED, 8, expected_m=48).scales_at_issue
        for layout in (f.CONTIGUOUS, f.KGROUPED):
            assert not f.pick_config(1024, 1536, 2048, p, layout, 8).scales_at_issue
        assert not f.pick_config(64, 7168, 16384, p, tuning=f.Fp8Tuning(scales_at_issue_bn=())).scales_at_issue
        assert not f.pick_config(128, 12288, 7168, p, tuning=f.Fp8Tuning(scales_at_issue_min_k=8192)).scales_at_issue
    assert f.pick_config(40, 4000, 4112, H200).scales_at_issue  # a GPU test shape (64 x 64 split in two)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(64, 64, 1), (64, 96, 1), (64, 64, 2), (64, 96, 4), (128, 80, 1), (128, 128, 1)],
                         ids=lambda t: f"{t[0]}x{t[1]}s{t[2]}")
@pytest.mark.parametrize("shape", [(64, 1000, 4112), (37, 776, 2064), (200, 1000, 2064)],
                         ids=lambda s: "x".join(map(str, s)))
def test_scales_at_issue_bitwise(rng, tile, shape):
    """Scales loaded at the wgmma issue give the same bits as loaded after the wait (each element sees the same
    FFMAs in the same order): tails in M, N, K, splits with CTAs that get no k block."""
    m, n, k = shape
    a, sa, b, sb, ref = _operands(rng, m, n, k)
    args = [DeviceArray.from_numpy(x) for x in (a, sa, b, sb)]
    bits = []
    for min_k in (2048, 1 << 30):
        t = replace(forced(tile=tile[:2], splits=tile[2]), scales_at_issue_min_k=min_k)
        out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
        ck.gemm_fp8(*args, out, tuning=t)
        _check(out, ref)
        bits.append(out.numpy().view(np.uint16).copy())
        if tile[0] == 64 and m > 64:  # two rows of 64-row tiles: never at issue
            assert not any(p.cfg.scales_at_issue for p in plans_under(t))
        else:
            assert {p.cfg.scales_at_issue for p in plans_under(t)} == {min_k == 2048}
    assert np.array_equal(bits[0], bits[1])


def test_grouped_validation_before_launch():
    m, n, k, groups = 256, 264, 512, 3
    a, sa = fake((m, k), "e4m3"), fake((m, 4), "fp32", (1, m))
    b, sb = fake((groups, n, k), "e4m3"), fake((groups, 3, 4), "fp32")
    ids = fake((m,), "int32")
    out = fake((m, n), "bf16")
    with pytest.raises(ValueError, match="alignment must be 64, 128 or 256"):
        ck.gemm_fp8_grouped_contiguous(a, sa, b, sb, ids, out, alignment=32)
    with pytest.raises(TypeError, match="m_indices: dtype int64"):
        ck.gemm_fp8_grouped_contiguous(a, sa, b, sb, fake((m,), "int64"), out)
    with pytest.raises(ValueError, match=r"m_indices: expected shape \(256,\)"):
        ck.gemm_fp8_grouped_contiguous(a, sa, b, sb, fake((m - 1,), "int32"), out)
    with pytest.raises(ValueError, match="b: expected 3 dimensions"):
        ck.gemm_fp8_grouped_contiguous(a, sa, fake((n, k), "e4m3"), sb, ids, out)
    with pytest.raises(ValueError, match=r"sb: expected shape \(3, 3, 4\)"):
        ck.gemm_fp8_grouped_contiguous(a, sa, b, fake((3, 2, 4), "fp32"), ids, out)
    with pytest.raises(ValueError, match="groups must follow each other"):
        ck.gemm_fp8_grouped_contiguous(a, sa, fake((groups, n, k), "e4m3", (2 * n * k, k, 1)), sb, ids, out)

    ma, msa = fake((groups, 64, k), "e4m3"), fake((groups, 64, 4), "fp32")
    with pytest.raises(ValueError, match=r"masked_m: expected shape \(3,\)"):
        ck.gemm_fp8_grouped_masked(ma, msa, b, sb, fake((2,), "int32"), fake((groups, 64, n), "bf16"))
    with pytest.raises(ValueError, match=r"out: expected shape \(3, 64, 264\)"):
        ck.gemm_fp8_grouped_masked(ma, msa, b, sb, fake((3,), "int32"), fake((groups, 64, n + 8), "bf16"))
    with pytest.raises(ValueError, match=r"b: expected 3 groups"):
        ck.gemm_fp8_grouped_masked(ma, msa, fake((2, n, k), "e4m3"), sb, fake((3,), "int32"))

    wa, wsa, wb, wsb = fake((m, k), "e4m3"), fake((m, 4), "fp32"), fake((n, k), "e4m3"), fake((n, 4), "fp32")
    d = fake((2, m, n), "fp32")
    with pytest.raises(ValueError, match="multiple of 128"):
        ck.gemm_fp8_wgrad(wa, wsa, wb, wsb, d, [448, 64])
    with pytest.raises(ValueError, match="ks sums to 384"):
        ck.gemm_fp8_wgrad(wa, wsa, wb, wsb, d, [256, 128])
    with pytest.raises(TypeError, match="d: dtype bfloat16"):
        ck.gemm_fp8_wgrad(wa, wsa, wb, wsb, fake((2, m, n), "bf16"), [256, 256])
    with pytest.raises(ValueError, match=r"d: expected shape \(3, 256, 264\)"):
        ck.gemm_fp8_wgrad(wa, wsa, wb, wsb, d, [256, 0, 256])
    with pytest.raises(ValueError, match=r"sb: expected shape \(264, 4\)"):
        ck.gemm_fp8_wgrad(wa, wsa, wb, fake((3, 4), "fp32"), d, [256, 256])


# ---- grouped layouts and the weight gradient: GPU --------------------------------------------------------------

def _e4m3(rng, shape):
    return np.clip(rng.standard_normal(shape) * 64, -448, 448).astype(ml_dtypes.float8_e4m3fn)


def _scales(rng, shape):
    return (rng.uniform(0.5, 2.0, shape) / 448).astype(np.float32)


def _deq_rows(x, s):
    """x [R, K] e4m3 with one scale per 1x128 group of a row."""
    return x.astype(np.float64) * np.repeat(s.astype(np.float64), 128, axis=-1)[..., :x.shape[-1]]


def _deq_blocks(x, s):
    """x [N, K] e4m3 with one scale per 128x128 block."""
    n, k = x.shape
    return x.astype(np.float64) * np.repeat(np.repeat(s.astype(np.float64), 128, axis=0), 128, axis=1)[:n, :k]


def _rel_err(got, ref):
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)


@pytest.mark.gpu
@pytest.mark.parametrize("alignment, bm", [(128, 128), (64, 64), (256, 256), (128, 256), (64, 128), (128, 192),
                                           (256, 192)])
@pytest.mark.parametrize("nk", [(264, 1040), (2112, 512)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", [g.MCAST_NONE, g.MCAST_SHARE_A])
def test_grouped_contiguous(rng, alignment, bm, nk, mode):
    """Tiles of the alignment's height, and from a tile list: twice it (in units of the alignment, expert 0 |
    padding, padding | expert 2, expert 2, expert 3 | expert 4: two entries of the list, padding only: skipped)
    and 192 rows (three consumers; tile rows that hold two segments' rows at either cut of the alignment)."""
    tuning = forced(mode, (bm, 128))
    n, k = nk
    tokens = [100, 0, 257, alignment, 1]  # per expert; each segment padded to `alignment` rows
    ids = []
    for e, t in enumerate(tokens):
        ids += [e] * t + [-1] * (-t % alignment) + [-1] * 2 * alignment * (e == 0)  # (expert 0: two more units)
    ids += [-1] * 2 * alignment  # tiles of padding only: skipped, never written
    ids = np.array(ids, np.int32)
    m, groups = len(ids), len(tokens)
    a, sa = _e4m3(rng, (m, k)), _scales(rng, (m, -(-k // 128)))
    b, sb = _e4m3(rng, (groups, n, k)), _scales(rng, (groups, -(-n // 128), -(-k // 128)))
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
    sa_dev, keep = _mmajor(sa)
    ck.gemm_fp8_grouped_contiguous(DeviceArray.from_numpy(a), sa_dev, DeviceArray.from_numpy(b),
                                   DeviceArray.from_numpy(sb), DeviceArray.from_numpy(ids), out,
                                   alignment=alignment, tuning=tuning)
    got = out.numpy().astype(np.float64)
    for e in range(groups):
        rows = ids == e
        ref = _deq_rows(a[rows], sa[rows]) @ _deq_blocks(b[e], sb[e]).T
        assert np.isfinite(got[rows]).all(), f"expert {e}: rows not written"
        assert _rel_err(got[rows], ref) <= 5e-3, e
    assert np.isnan(got[ids < 0]).all(), "a padding row was written"
    assert {(p.cfg.bm, p.cfg.tile_list) for p in plans_under(tuning)} == {(bm, alignment if alignment % bm else 0)}


@pytest.mark.gpu
def test_contiguous_tile_list_per_call(rng):
    """Calls back to back on one stream with other ids each rebuild the tile list (the same scratch buffer, the
    list kernel of one call under the tail of the previous GEMM): each output matches its own ids."""
    n, k, groups, m = 264, 512, 4, 1024
    a, sa = _e4m3(rng, (m, k)), _scales(rng, (m, k // 128))
    b, sb = _e4m3(rng, (groups, n, k)), _scales(rng, (groups, 3, k // 128))
    sa_dev, keep = _mmajor(sa)
    a_dev, b_dev, sb_dev = DeviceArray.from_numpy(a), DeviceArray.from_numpy(b), DeviceArray.from_numpy(sb)
    layouts = [np.repeat(np.array(order, np.int32), m // 16) for order in  # segments of 64 rows: 16 a call
               ([0] * 4 + [1] * 5 + [2] * 3 + [3] * 4, [3, 2, 1, 0] * 4, [-1, 0, 0, 1, 1, 1, 2, 3] * 2)]
    ids_dev = [DeviceArray.from_numpy(ids) for ids in layouts]
    outs = [DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF) for _ in layouts]
    for i, o in zip(ids_dev, outs):  # (no synchronisation between the calls)
        ck.gemm_fp8_grouped_contiguous(a_dev, sa_dev, b_dev, sb_dev, i, o, alignment=64)
    for ids, o in zip(layouts, outs):
        got = o.numpy().astype(np.float64)
        for e in range(groups):
            rows = ids == e
            ref = _deq_rows(a[rows], sa[rows]) @ _deq_blocks(b[e], sb[e]).T
            assert _rel_err(got[rows], ref) <= 5e-3, e
        assert np.isnan(got[ids < 0]).all()
    assert f.pick_config(m, n, k, H100, f.CONTIGUOUS, groups, 64).tile_list


def _tile_list_reference(ids, groups, tile_m, align):
    """contiguous_tiles.cu's entries: per tile row, the group of its first row, then, where a segment starts inside
    the row (at its first multiple of `align`) with another group, that group (ids outside [0, groups) count as
    padding), as (2 x tile row + whole, group): whole when every row of the tile row is the group's."""
    def group(row):
        return int(ids[row]) if row < len(ids) and 0 <= ids[row] < groups else -1
    entries = []
    for r in range(-(-len(ids) // tile_m)):
        m0 = r * tile_m
        cut = (m0 // align + 1) * align
        first, second = group(m0), group(cut) if cut < min(m0 + tile_m, len(ids)) else -1
        whole = first >= 0 and all(group(row) == first for row in range(m0, m0 + tile_m))
        entries += [(2 * r + (whole and x == first), x) for x in (first, second if second != first else -1)
                    if x >= 0]
    return entries


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m, align, segments", [(128, 64, "random"), (256, 128, "random"),
                                                     (128, 64, "every start"), (256, 128, "alternating"),
                                                     (192, 128, "random"), (192, 256, "random"),
                                                     (192, 128, "alternating")])
def test_contiguous_tile_list(rng, tile_m, align, segments):
    """The list kernel against its reference over more tile rows than one pass of its CTA (1024), with ids past
    the groups, padding, a last tile row cut short, and ids that alternate (each aligned piece its own entry)."""
    groups = 37
    ids = []
    if segments == "random":
        for e in range(groups + 3):  # (the last three ids are past the groups: padding alike)
            t = int(rng.integers(80 * align, 110 * align)) if e % 5 else 0  # (and some experts without tokens)
            ids += [e] * t + [-1] * (-t % align)
    else:  # a new segment at every multiple of the alignment (alternating: two groups taking turns)
        ids = [(i // align) % (groups if segments == "every start" else 2) for i in range(2100 * align)]
    ids = np.array(ids + [5] * (align // 2), np.int32)  # a segment that ends inside the last piece
    rows = -(-len(ids) // tile_m)
    assert rows > 1024
    lst = DeviceArray.empty((2 + 4 * rows,), "int32").fill_bytes(0xFF)
    launch = get_launcher("contiguous_tiles.cu", "contiguous_tile_list", {}, 0, f._LIST_ARGS, (f._LIST_THREADS,))
    ids_dev = DeviceArray.from_numpy(ids)
    launch.run((1, 1, 1), 0, (ids_dev.ptr, len(ids), groups, tile_m, align, lst.ptr))
    got = lst.numpy()
    ref = _tile_list_reference(ids, groups, tile_m, align)
    assert got[0] == len(ref)
    assert [tuple(e) for e in got[2:2 + 2 * len(ref)].reshape(-1, 2)] == ref
    assert (got[2 + 2 * len(ref):] == -1).all(), "an entry past the count was written"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 200, 264, 1040), (4, 64, 2112, 512), (2, 384, 136, 256)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", [g.MCAST_NONE, g.MCAST_SHARE_B, g.MCAST_SHARE_A])
def test_grouped_masked(rng, shape, mode):
    groups, m, n, k = shape
    masked = rng.integers(0, m + 1, groups).astype(np.int32)
    masked[0], masked[-1] = 0, m + 5  # an empty group, and a count above M (means M)
    _run_masked(rng, m, n, k, masked, forced(mode))


@pytest.mark.gpu
@pytest.mark.parametrize("shape, tile", [((4, 1, 32, 96), None), ((6, 20, 264, 1040), (64, 128)),
                                         ((5, 40, 520, 512), (128, 128)), ((3, 100, 136, 256), (256, 128)),
                                         ((4, 64, 16, 256), (64, 64)), ((3, 200, 24, 384), (128, 128)),
                                         ((7, 33, 136, 640), None), ((2, 6, 264, 128), None)],
                         ids=lambda s: "x".join(map(str, s)) if s else "pick")
@pytest.mark.parametrize("mode", [g.MCAST_NONE, g.MCAST_SHARE_B, g.MCAST_SHARE_A])
@pytest.mark.parametrize("scales", ["rowmajor", "mmajor"])
def test_grouped_masked_short_groups(rng, shape, tile, mode, scales):
    """Groups of fewer rows (of A: M, of B: N) than half a tile, so that the tiles of several groups cross the
    last row of all groups: each box stops at its own group's last row (the bytes its barrier expects); and M not
    a multiple of 4, where each group's scales start off a 16-byte boundary unless padded (until 2026-11-29 both
    faulted, e.g. G = 4, M = 1)."""
    groups, m, n, k = shape
    masked = np.full(groups, m, np.int32)
    masked[1] = m // 2
    _run_masked(rng, m, n, k, masked, forced(mode, tile), mmajor=scales == "mmajor")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [g.MCAST_NONE, g.MCAST_SHARE_A])
def test_grouped_contiguous_narrower_than_a_tile(rng, mode):
    """N of less than half the tile's columns: the B tiles of several experts cross the last row of B."""
    n, k, align = 24, 512, 64
    ids = np.repeat(np.array([0, 1, 2, 3, -1, 4], np.int32), align)
    groups, m = 5, len(ids)
    tuning = forced(mode, (64, 128))
    a, sa = _e4m3(rng, (m, k)), _scales(rng, (m, k // 128))
    b, sb = _e4m3(rng, (groups, n, k)), _scales(rng, (groups, 1, k // 128))
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
    ck.gemm_fp8_grouped_contiguous(DeviceArray.from_numpy(a), DeviceArray.from_numpy(sa), DeviceArray.from_numpy(b),
                                   DeviceArray.from_numpy(sb), DeviceArray.from_numpy(ids), out, alignment=align,
                                   tuning=tuning)
    got = out.numpy().astype(np.float64)
    for e in range(groups):
        rows = ids == e
        assert _rel_err(got[rows], _deq_rows(a[rows], sa[rows]) @ _deq_blocks(b[e], sb[e]).T) <= 5e-3, e
    assert np.isnan(got[ids < 0]).all()
    assert {p.cfg.bn for p in plans_under(tuning)} == {128}


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(64, 64), (128, 128), (256, 128), None], ids=lambda t: "x".join(map(str, t or ["pick"])))
@pytest.mark.parametrize("mode", [g.MCAST_NONE, g.MCAST_SHARE_B, g.MCAST_SHARE_A])
def test_grouped_masked_many_uneven_groups(rng, tile, mode):
    """More groups than a warp (the scheduler counts the live tiles across one) and than its walk loads at a time,
    filled unevenly, a third of them empty: only tiles with rows are walked, and every counted row is right. Without
    a tile, the pick for an expected_m of the mean rows."""
    groups, m, n, k = 70, 300, 136, 384
    masked = rng.integers(1, m + 1, groups).astype(np.int32)
    masked[rng.random(groups) < 0.35] = 0
    masked[[3, 40]] = m + 7, 0
    hint = None if tile else max(1, int(masked.clip(max=m).mean()))
    _run_masked(rng, m, n, k, masked, forced(mode, tile), expected_m=hint)


def _run_masked(rng, m, n, k, masked, tuning=None, mmajor=False, expected_m=None):
    """A masked GEMM of len(masked) groups of M rows on fresh data: the counted rows right, the others untouched.
    `mmajor`: the scales as the quantizer lays out [G * M, K/128] (M-major over all groups), else row-major."""
    groups, kb = len(masked), -(-k // 128)
    a, sa = _e4m3(rng, (groups, m, k)), _scales(rng, (groups, m, kb))
    b, sb = _e4m3(rng, (groups, n, k)), _scales(rng, (groups, -(-n // 128), kb))
    out = DeviceArray.empty((groups, m, n), "bf16").fill_bytes(0xFF)
    if mmajor:
        flat, keep = _mmajor(sa.reshape(groups * m, kb))
        sa_dev = DeviceArray.from_pointer(flat.ptr, (groups, m, kb), "fp32", (m, 1, flat.strides[1]),
                                          device=flat.device)
    else:
        sa_dev = DeviceArray.from_numpy(sa)
    ck.gemm_fp8_grouped_masked(DeviceArray.from_numpy(a), sa_dev, DeviceArray.from_numpy(b),
                               DeviceArray.from_numpy(sb), DeviceArray.from_numpy(masked), out, tuning=tuning,
                               expected_m=expected_m)
    got = out.numpy().astype(np.float64)
    for e in range(groups):
        rows = min(int(masked[e]), m)
        assert np.isnan(got[e, rows:]).all(), f"group {e}: a masked row was written"
        if rows:
            ref = _deq_rows(a[e, :rows], sa[e, :rows]) @ _deq_blocks(b[e], sb[e]).T
            assert np.isfinite(got[e, :rows]).all(), f"group {e}: rows not written"
            assert _rel_err(got[e, :rows], ref) <= 5e-3, e
    return out.numpy().view(np.uint16)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(128, 96), (128, 128), (64, 96)], ids=lambda t: "x".join(map(str, t)))
def test_masked_scales_at_issue_bitwise(tile):
    """The masked layout's tiles that load their scales at the wgmma issue give the bits of loading them after the
    wait: uneven and empty groups, N across three of B's scale blocks with a tail, K with a tail."""
    m = 64 if tile[0] == 64 else 200
    n, k = 296, 2176
    masked = np.array([m, 0, m // 3, m + 9, 1], np.int32)
    bits = []
    for min_k in (2048, 1 << 30):
        t = replace(forced(g.MCAST_NONE, tile), scales_at_issue_min_k=min_k)
        bits.append(_run_masked(np.random.default_rng(7), m, n, k, masked, t))
        assert {p.cfg.scales_at_issue for p in plans_under(t)} == {min_k == 2048}
    assert np.array_equal(bits[0], bits[1])


@pytest.mark.gpu
@pytest.mark.parametrize("mnks", [(200, 264, (256, 0, 128, 384)), (256, 2112, (512, 1024)), (72, 16, (128,)),
                                  (130, 144, (384, 256))],
                         ids=lambda s: f"{s[0]}x{s[1]}x{'-'.join(map(str, s[2]))}")
@pytest.mark.parametrize("scales", ["mmajor", "rowmajor"])
@pytest.mark.parametrize("mode", [g.MCAST_NONE, g.MCAST_SHARE_B])
def test_wgrad_accumulates(rng, mnks, scales, mode):
    t = forced(mode)
    m, n, ks = mnks
    k = sum(ks)
    a, sa = _e4m3(rng, (m, k)), _scales(rng, (m, k // 128))
    b, sb = _e4m3(rng, (n, k)), _scales(rng, (n, k // 128))
    d0 = rng.standard_normal((len(ks), m, n)).astype(np.float32)
    d = DeviceArray.from_numpy(d0)
    if scales == "mmajor":
        uploads = [_mmajor(sa), _mmajor(sb)]  # (view, owner) pairs, alive until the end
        sa_dev, sb_dev = uploads[0][0], uploads[1][0]
    else:
        sa_dev, sb_dev = DeviceArray.from_numpy(sa), DeviceArray.from_numpy(sb)
    args = (DeviceArray.from_numpy(a), sa_dev, DeviceArray.from_numpy(b), sb_dev, d, ks)
    ck.gemm_fp8_wgrad(*args, tuning=t)
    ck.gemm_fp8_wgrad(*args, tuning=t)  # D += twice
    got = (d.numpy().astype(np.float64) - d0) / 2
    da, db = _deq_rows(a, sa), _deq_rows(b, sb)
    start = 0
    for e, ke in enumerate(ks):
        ref = da[:, start:start + ke] @ db[:, start:start + ke].T
        if ke == 0:
            assert (got[e] == 0).all(), "a group without tokens changed D"
        else:
            assert _rel_err(got[e], ref) <= 5e-3, e
        start += ke


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [g.MCAST_NONE, g.MCAST_SHARE_B, g.MCAST_SHARE_A])
@pytest.mark.parametrize("tile", [(256, 128), (128, 256), (64, 256), (128, 208), (128, 240), (128, 160),
                                  (128, 96), (128, 192), (128, 144), (64, 176)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_tall_and_wide_tiles(rng, mode, tile):
    """BM = 256 (two m64 row blocks per consumer), BN > 192 (two column halves, A from registers; 208 and 240
    columns cross three scale blocks of B), 144..192 columns (two column halves in flight, one consumer at BM = 64;
    the normal layout's 128 x 144 and 128 x 160 in one set), and widths whose tiles start 32 columns into B's scale
    blocks (160, 96: the loop instantiated per offset): tails in M, N, K, every layout but contiguous."""
    t = forced(mode, tile)
    m, n, k = 300, 520, 1040
    a, sa, b, sb, ref = _operands(rng, m, n, k)
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
    ck.gemm_fp8(DeviceArray.from_numpy(a), DeviceArray.from_numpy(sa), DeviceArray.from_numpy(b),
                DeviceArray.from_numpy(sb), out, tuning=t)
    _check(out, ref)
    _run_masked(rng, 280, n, k, np.array([259, 100], np.int32), t)
    ks = (256, 0, 384)
    kt = sum(ks)
    wa, wsa, wb, wsb = _e4m3(rng, (m, kt)), _scales(rng, (m, kt // 128)), _e4m3(rng, (n, kt)), _scales(rng, (n, kt // 128))
    d = DeviceArray.from_numpy(np.zeros((3, m, n), np.float32))
    ck.gemm_fp8_wgrad(DeviceArray.from_numpy(wa), DeviceArray.from_numpy(wsa), DeviceArray.from_numpy(wb),
                      DeviceArray.from_numpy(wsb), d, ks, tuning=t)
    got = d.numpy().astype(np.float64)
    da, db = _deq_rows(wa, wsa), _deq_rows(wb, wsb)
    assert _rel_err(got[0], da[:, :256] @ db[:, :256].T) <= 5e-3
    assert (got[1] == 0).all()
    assert _rel_err(got[2], da[:, 256:] @ db[:, 256:].T) <= 5e-3
    assert {(p.cfg.bm, p.cfg.bn) for p in plans_under(t)} == {tile}


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(64, 32, 2), (64, 64, 4), (128, 64, 3), (128, 128, 2), (64, 16, 8),
                                  (128, 256, 2), (128, 176, 4)], ids=lambda t: f"{t[0]}x{t[1]}s{t[2]}")
@pytest.mark.parametrize("shape", [(128, 520, 2064), (77, 264, 1040), (1, 136, 384), (200, 1000, 4112)],
                         ids=lambda s: "x".join(map(str, s)))
def test_split_k(rng, tile, shape):
    """Split-K through the cluster's shared memory: tails in M, N, K; K blocks that do not divide by the splits
    (1 x 136 x 384 with 4 or 8 splits: some CTAs get no k block); bitwise the same on a second run."""
    t = forced(tile=tile[:2], splits=tile[2])
    m, n, k = shape
    a, sa, b, sb, ref = _operands(rng, m, n, k)
    args = [DeviceArray.from_numpy(x) for x in (a, sa, b, sb)]
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
    ck.gemm_fp8(*args, out, tuning=t)
    _check(out, ref)
    first = out.numpy().view(np.uint16).copy()
    out.fill_bytes(0xFF)
    ck.gemm_fp8(*args, out, tuning=t)
    assert np.array_equal(out.numpy().view(np.uint16), first)
    plan, = plans_under(t)
    tiles = -(-m // tile[0]) * -(-n // tile[1])
    if plan.cfg.splits == 1:  # more tiles than clusters of this size fit at once: the plan falls back
        assert tiles * tile[2] > 64, "a split this small always fits"
    else:
        assert plan.cfg.splits == tile[2] and plan.grid == (tiles * tile[2], 1, 1)
