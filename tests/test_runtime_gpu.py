"""Runtime on the GPU: device properties, load + launch with every argument kind, launch errors."""
import struct

import numpy as np
import pytest

from cudart_kernels.runtime import compiler, driver
from cudart_kernels.runtime.interop import DeviceArray
from cudart_kernels.runtime.launch import Launcher, load
from cudart_kernels.runtime.tensormap import encode_tensor_map

pytestmark = pytest.mark.gpu


def test_device_properties():
    p = driver.device_properties(0)
    assert p.sm_count > 0 and p.l2_bytes > 0 and p.smem_per_block_optin >= 48 * 1024
    if p.compute_capability == (9, 0):
        assert p.arch == "sm_90a" and p.smem_per_block_optin == 232448
        # the copy rate: measured once, kept beside the cubins, read back by the next process (the same figure)
        assert 0.5 * p.dram_bytes_per_s <= p.stream_bytes_per_s <= 1.02 * p.dram_bytes_per_s
        assert p.sm_clock_khz > 500_000
        kept = list(compiler.cache_dir().glob("device-*.json"))
        assert kept and driver.stream_rate(0, p.name, p.dram_bytes_per_s, p.l2_bytes) == p.stream_bytes_per_s


@pytest.fixture
def probe(monkeypatch, tmp_path):
    root = tmp_path / "ptx"
    (root / "common").mkdir(parents=True)
    src = compiler.ptx_dir()
    (root / "common" / "types.cuh").write_text((src / "common" / "types.cuh").read_text())
    from pathlib import Path

    (root / "probe.cu").write_text((Path(__file__).parent / "kernels" / "probe.cu").read_text())
    monkeypatch.setattr(compiler, "ptx_dir", lambda: root)
    c = compiler.compile_kernel("probe.cu", "probe", {}, driver.target_arch())
    return load(c, 0)


def test_launcher_packs_every_kind(probe):
    out = DeviceArray.empty((21,), "int64").fill_bytes(0xEE)
    buf = DeviceArray.empty((64, 256), "bf16")
    tm = encode_tensor_map("bf16", buf.ptr, [256, 64], [512], [64, 32])
    lau = Launcher(probe, ["i32", "i64", "f32", "ptr", "tmap", "u32"], (32,))
    for grid in ((3, 2, 1), (1, 1, 5)):
        lau(grid, 0, -7, -(2**40) - 3, 1.5, out.ptr, tm, 4000000000)
        got = out.numpy().view(np.uint64)
        assert got[0] == np.uint64(2**64 - 7) and got[1] == np.uint64(2**64 - 2**40 - 3)
        assert got[2] == struct.unpack("<I", struct.pack("<f", 1.5))[0] and got[3] == 4000000000
        assert got[4:20].tobytes() == tm.bytes()
        assert got[20] == grid[0] * 1000000 + grid[1] * 1000 + grid[2]


def test_launcher_run_repacks_only_a_new_tuple(probe):
    out = DeviceArray.empty((21,), "int64")
    buf = DeviceArray.empty((64, 256), "bf16")
    tm = encode_tensor_map("bf16", buf.ptr, [256, 64], [512], [64, 32])
    lau = Launcher(probe, ["i32", "i64", "f32", "ptr", "tmap", "u32"], (32,))
    first, second = (-7, 5, 1.5, out.ptr, tm, 1), (3, 6, 2.5, out.ptr, tm, 2)

    def check(args):
        out.fill_bytes(0xEE)
        lau.run((1, 1, 1), 0, args)
        got = out.numpy().view(np.uint64)
        assert got[0] == np.uint64(args[0] % 2**64) and got[1] == args[1] and got[3] == args[5]
        assert got[4:20].tobytes() == tm.bytes()

    for args in (first, first, second, first, second):
        check(args)
    with pytest.raises(struct.error):  # (packing stops part way: the buffer may hold a mix)
        lau.run((1, 1, 1), 0, (9, 9, 9.0, "not a pointer", tm, 9))
    check(second)  # the tuple packed last before the failure is packed again


def test_launcher_errors(probe):
    lau = Launcher(probe, ["i32", "i64", "f32", "ptr", "tmap", "u32"], (32,))
    with pytest.raises(TypeError, match="takes 6 arguments"):
        lau((1, 1, 1), 0, 1, 2)
    with pytest.raises(ValueError, match="unknown kernel argument kind"):
        Launcher(probe, ["double"], (32,))
    too_big = Launcher(probe, ["i32", "i64", "f32", "ptr", "tmap", "u32"], (2048,))  # > 1024 threads a block
    with pytest.raises(driver.CudaError, match="INVALID_VALUE"):
        too_big((1, 1, 1), 0, 1, 2, 3.0, 0, encode_tensor_map("bf16", 0x10000000, [64], [], [64]), 1)


def test_driver_agrees_with_cubin_report(probe):
    """The compile report (read from the cubin) matches what the driver says about the loaded function."""
    r = probe.compiled.report
    assert probe.attribute("num_regs") == r.registers
    assert probe.attribute("local_size_bytes") == r.stack_bytes
    assert probe.attribute("shared_size_bytes") == r.static_smem


@pytest.mark.parametrize("cluster,pdl", [((2, 1, 1), False), (None, True), ((2, 1, 1), True)])
def test_cluster_and_pdl_launches(probe, cluster, pdl):
    out = DeviceArray.empty((21,), "int64").fill_bytes(0)
    buf = DeviceArray.empty((64, 256), "bf16")
    tm = encode_tensor_map("bf16", buf.ptr, [256, 64], [512], [64, 32])
    lau = Launcher(probe, ["i32", "i64", "f32", "ptr", "tmap", "u32"], (32,), cluster=cluster, pdl=pdl)
    lau((4, 1, 1), 0, 5, 6, 7.0, out.ptr, tm, 8)
    got = out.numpy()
    assert got[0] == 5 and got[1] == 6 and got[3] == 8 and got[20] == 4001001


def _own_context(device: int):
    """A context of the caller's own on `device` (cuCtxCreate), made current; the bindings of CUDA 12 and 13 differ."""
    from cuda.bindings import driver as cu

    dev = driver.check(cu.cuDeviceGet(device))
    try:
        return driver.check(cu.cuCtxCreate(None, 0, dev))
    except TypeError:
        return driver.check(cu.cuCtxCreate(0, dev))


def test_ops_beside_a_callers_own_context():
    """A thread that works in a context of its own on the op's GPU: the op runs in the primary context (its kernels
    and the arrays' memory live there) and gives the caller's context back, before and after the thread has run an
    op in the primary context (with one GPU such a thread no longer asks which context is current: the launch fails
    in the caller's context and is retried in the primary one). Checked on a fresh thread, results against numpy."""
    import threading

    import cudart_kernels as ck
    from cuda.bindings import driver as cu

    rng = np.random.default_rng()
    a_h = rng.standard_normal((128, 256)).astype(np.float32)
    b_h = rng.standard_normal((192, 256)).astype(np.float32)
    errors = []

    def work():
        try:
            import ml_dtypes

            a16, b16 = a_h.astype(ml_dtypes.bfloat16), b_h.astype(ml_dtypes.bfloat16)
            ref = a16.astype(np.float64) @ b16.astype(np.float64).T
            a, b = DeviceArray.from_numpy(a16), DeviceArray.from_numpy(b16)

            def check_gemm():
                d = ck.gemm(a, b, out_dtype="float32")
                assert np.abs(d.numpy() - ref).max() < 1e-2 * np.abs(ref).max()

            own = _own_context(0)  # before any op on this thread
            try:
                check_gemm()
                assert int(driver.check(cu.cuCtxGetCurrent())) == int(own)
                driver.check(cu.cuCtxSetCurrent(driver.primary_context(0)))
                check_gemm()  # in the primary context: the thread is now settled (one GPU)
                driver.check(cu.cuCtxSetCurrent(own))
                check_gemm()  # the caller's own context again
                assert int(driver.check(cu.cuCtxGetCurrent())) == int(own)
            finally:
                driver.check(cu.cuCtxSetCurrent(driver.primary_context(0)))
                driver.check(cu.cuCtxDestroy(own))
        except Exception as e:  # reported on the main thread
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors[0]
