"""FP8 block-scaled GEMM: config heuristics and validation on the CPU; correctness against a float64 GEMM of the
dequantized inputs on the GPU."""
import ml_dtypes
import numpy as np
import pytest

import cudart_kernels as ck
from cudart_kernels.ops import gemm as g
from cudart_kernels.ops import gemm_fp8 as f
from cudart_kernels.ops.quantize import mmajor_stride
from cudart_kernels.runtime.driver import H100
from cudart_kernels.runtime.interop import DeviceArray

FAKE = 0x7F0000000000


def fake(shape, dtype, strides=None):
    return DeviceArray.from_pointer(FAKE, shape, dtype, strides)


@pytest.mark.parametrize("shape", f.BENCH_SHAPES["normal"] + [(1, 16, 16), (17, 136, 200), (300, 8, 4096)])
def test_config_fits_and_matches_the_kernel_layout(shape):
    m, n, k = shape
    cfg = f.pick_config(m, n, k, H100)
    assert cfg.bm == (64 if m <= 64 else 128)
    assert cfg.bn % 16 == 0 and 16 <= cfg.bn <= f.MAX_BN
    assert 3 <= cfg.stages <= f.MAX_STAGES
    assert cfg.smem == f.smem_bytes(cfg.bm, cfg.bn, cfg.stages) <= H100.smem_per_block_optin
    assert cfg.stages == f.MAX_STAGES or f.smem_bytes(cfg.bm, cfg.bn, cfg.stages + 1) > H100.smem_per_block_optin


def test_config_choices():
    # 4096 rows: 32 row blocks; BN=176 gives 41 column blocks of 7168 = 1312 tiles, 9.94 waves of 132
    cfg = f.pick_config(4096, 7168, 16384, H100)
    assert (cfg.bm, cfg.bn, cfg.mcast) == (128, 176, g.MCAST_SHARE_B)
    assert f.pick_config(64, 7168, 16384, H100).bm == 64


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
          (129, 2112, 384), (300, 1000, 1040), (777, 776, 2064), (4096, 2112, 272), (2048, 7168, 512)]


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


@pytest.fixture
def forced_multicast(monkeypatch):
    def force(mode):
        monkeypatch.setattr(g, "pick_multicast", lambda m, n, bm, bn, splits, b_kn, props:
                            mode if (mode == g.MCAST_SHARE_B or bm % 128 == 0) else g.MCAST_NONE)
        f._plans.clear()
    yield force
    f._plans.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [g.MCAST_SHARE_B, g.MCAST_SHARE_A])
@pytest.mark.parametrize("shape", [(300, 520, 1040), (129, 264, 208), (385, 1000, 144), (1024, 2112, 512)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gemm_fp8_cluster_pairs(rng, forced_multicast, mode, shape):
    forced_multicast(mode)
    m, n, k = shape
    a, sa, b, sb, ref = _operands(rng, m, n, k)
    sa_dev, keep = _mmajor(sa)
    out = DeviceArray.empty((m, n), "bf16").fill_bytes(0xFF)
    ck.gemm_fp8(DeviceArray.from_numpy(a), sa_dev, DeviceArray.from_numpy(b), DeviceArray.from_numpy(sb), out)
    _check(out, ref)
    assert mode in {p.cfg.mcast for p in f._plans.values()}  # the forced pairing really ran
