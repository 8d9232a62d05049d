"""GEMM: config heuristics and validation on the CPU; correctness against float64 on the GPU."""
import numpy as np
import pytest

import cudart_kernels as ck
from cudart_kernels.ops import gemm as g
from cudart_kernels.runtime.driver import H100
from cudart_kernels.runtime.interop import DeviceArray

FAKE = 0x7F0000000000


def fake(shape, dtype, strides=None, offset=0):
    return DeviceArray.from_pointer(FAKE + offset, shape, dtype, strides)


@pytest.mark.parametrize("shape", g.BENCH_SHAPES["large"] + g.BENCH_SHAPES["skinny"] + [(1, 8, 8), (17, 24, 40)])
@pytest.mark.parametrize("out_bytes", [2, 4])
def test_config_fits_and_matches_the_kernel_layout(shape, out_bytes):
    m, n, k = shape
    cfg = g.pick_config(m, n, k, out_bytes, H100)
    assert cfg.bm in (64, 128) and cfg.bn % 8 == 0 and 8 <= cfg.bn <= 256
    assert 2 <= cfg.stages <= g.MAX_STAGES
    assert cfg.smem == g.smem_bytes(cfg.bm, cfg.bn, cfg.stages, out_bytes) <= H100.smem_per_block_optin
    assert g.smem_bytes(cfg.bm, cfg.bn, cfg.stages + 1, out_bytes) > H100.smem_per_block_optin or \
        cfg.stages == g.MAX_STAGES  # as many stages as fit


def test_config_choices():
    assert g.pick_config(8192, 8192, 8192, 2, H100) == g.GemmConfig(128, 256, 3, g.smem_bytes(128, 256, 3, 2))
    assert g.pick_config(16, 4096, 8192, 2, H100).bm == 64  # small M: one consumer warpgroup
    # 4096x2112: 32 row blocks; BN=176 gives 12 column blocks = 384 tiles = 3 waves, nearly full (2.9)
    assert g.pick_config(4096, 2112, 7168, 2, H100).bn == 176


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
    with pytest.raises(NotImplementedError, match="kn"):
        ck.gemm(a, b, b_layout="kn")
    with pytest.raises(TypeError, match="host"):
        ck.gemm(np.ones((64, 128), np.float32), b)


# ---- GPU -------------------------------------------------------------------------------------------------------

def _rand(rng, shape, dtype):
    return (rng.standard_normal(shape) * 0.5).astype(np.float32).astype(ck.runtime.dtypes.as_dtype(dtype).numpy)


SHAPES = [(1, 8, 8), (3, 24, 40), (17, 136, 72), (64, 64, 64), (65, 200, 1000), (128, 256, 64), (129, 264, 200),
          (300, 520, 1040), (777, 1000, 136), (1024, 2112, 512), (2048, 2048, 2048)]


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
