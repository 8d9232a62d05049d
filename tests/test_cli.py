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
    lines = [l for l in r.stdout.splitlines() if l.startswith("quant ")]
    assert len(lines) == 6 and all(" ok" in l for l in lines)


@pytest.mark.skipif(HAS_GPU, reason="the no-GPU path")
def test_selftest_without_gpu_compiles():
    r = run("selftest")
    assert r.returncode == 0 and "no CUDA device" in r.stdout and "quantize_per_block" in r.stdout


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
