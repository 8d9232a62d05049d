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
            "assert 'torch' not in sys.modules, 'torch imported'; assert ckt.__all__ == ['attention']")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_exceptions_and_type_marker_are_public():
    import importlib.resources

    import cudart_kernels as ck
    from cudart_kernels.runtime import compiler, driver, interop

    assert (ck.NoDeviceError, ck.CudaError, ck.CompileError, ck.HostArrayError) == (
        driver.NoDeviceError, driver.CudaError, compiler.CompileError, interop.HostArrayError)
    assert issubclass(ck.HostArrayError, TypeError)
    assert importlib.resources.files("cudart_kernels").joinpath("py.typed").is_file()
