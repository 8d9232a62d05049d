"""The command line works with or without a GPU."""
import subprocess
import sys

import pytest

from conftest import HAS_GPU


def run(*args):
    return subprocess.run([sys.executable, "-m", "cudart_kernels", *args], capture_output=True, text=True,
                          timeout=600)


def test_info():
    r = run("info")
    assert r.returncode == 0, r.stderr
    assert "cudart-kernels 0.1.0" in r.stdout and "NVRTC: 13." in r.stdout and "cache:" in r.stdout
    assert ("no CUDA device" in r.stdout) != HAS_GPU


def test_compile_prints_report():
    r = run("compile", "--op", "quant", "--arch", "sm_90a")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [l.split() for l in r.stdout.splitlines() if l.lstrip().startswith("[")]
    assert [l[0] for l in lines] == [f"[{i}/6]" for i in range(1, 7)]
    assert all(l[1] == "quant" and l[8] in ("ok", "cached") for l in lines)
    assert r.stdout.rstrip().endswith("6 variants: 6 clean (%d from the cache), 0 with problems"
                                      % sum(l[8] == "cached" for l in lines))


def test_compile_names_the_arch_it_needs():
    r = run("compile", "--op", "quant", "--arch", "sm_80")
    assert r.returncode == 2 and r.stderr.strip() == "compile: these kernels need sm_90a (Hopper), not sm_80"


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == "cudart-kernels 0.1.0"


@pytest.mark.skipif(HAS_GPU, reason="the no-GPU path")
def test_selftest_without_gpu_compiles_and_says_nothing_ran():
    r = run("selftest")
    assert r.returncode == 3, r.stdout + r.stderr  # not 0: no op was run against its reference
    assert "no CUDA device" in r.stdout and "only the compiles are checked" in r.stdout
    assert "quantize_per_block" in r.stdout and "0 with problems" in r.stdout


def test_bench_rejects_unknown_op():
    assert run("bench", "--op", "nope").returncode == 2


def test_core_and_torch_layer_import_no_torch():
    """`import cudart_kernels` and `import cudart_kernels.torch` leave torch unimported (torch is imported when a
    function of the torch layer is first looked up)."""
    import subprocess
    import sys

    code = ("import sys, cudart_kernels, cudart_kernels.torch as ckt; "
            "assert 'torch' not in sys.modules, 'torch imported'; assert 'attention' in ckt.__all__ and 'gemm_fp8' in ckt.__all__")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_exceptions_and_type_marker_are_public():
    import importlib.resources

    import cudart_kernels as ck
    from cudart_kernels.runtime import compiler, driver, interop

    assert (ck.NoDeviceError, ck.CudaError, ck.CompileError, ck.HostArrayError) == (
        driver.NoDeviceError, driver.CudaError, compiler.CompileError, interop.HostArrayError)
    assert issubclass(ck.HostArrayError, TypeError)
    assert importlib.resources.files("cudart_kernels").joinpath("py.typed").is_file()


@pytest.mark.skipif(HAS_GPU, reason="the no-GPU path")
def test_ops_without_gpu_raise_one_line_no_device_error():
    """Every op path, with or without out=, stops at NoDeviceError (naming the cause) before NVRTC or the driver."""
    code = r"""
import cudart_kernels as ck
from cudart_kernels.runtime.interop import as_array
from cudart_kernels.runtime import compiler
a = lambda shape, dtype="bfloat16": as_array((1 << 20, shape, None, dtype))
calls = [lambda: ck.gemm(a((128, 256)), a((64, 256))),
         lambda: ck.gemm(a((128, 256)), a((64, 256)), out=a((128, 64))),
         lambda: ck.quantize_fp8_per_token(a((128, 256))),
         lambda: ck.attention(a((1, 64, 2, 64)), a((1, 64, 2, 64)), a((1, 64, 2, 64)), out=a((1, 64, 2, 64))),
         lambda: ck.attention_backward(a((1, 64, 2, 64)), a((1, 64, 2, 64)), a((1, 64, 2, 64)), a((1, 64, 2, 64)),
                                       a((1, 64, 2, 64)), a((1, 2, 64), "float32"), dq=a((1, 64, 2, 64)),
                                       dk=a((1, 64, 2, 64)), dv=a((1, 64, 2, 64)))]
for call in calls:
    try:
        call()
    except ck.NoDeviceError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith("cudart-kernels needs an sm_90a (Hopper) GPU"), msg
    else:
        raise AssertionError("no NoDeviceError")
assert not compiler._memo, "NVRTC ran before the device check"
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
