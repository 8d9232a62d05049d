"""The FP8 benchmarks with DeepGEMM as a same-run peer, on a GPU machine without network.

`cudart-kernels bench --op gemm_fp8 --op gemm_fp8_grouped` times DeepGEMM beside ours and cuBLAS whenever
`import deep_gemm` works (and says in one line why not when it does not). This script makes it work there: it
installs DeepGEMM's wheels from the repo's git-ignored .dg/ folder into /tmp/site (scripts/deepgemm_env.py: how to
download them once), then runs the bench from this tree with CK_REQUIRE_DEEPGEMM=1 (a DeepGEMM that fails to load
is then an error, not a skipped peer). DeepGEMM's JIT compiles each kernel shape with nvcc on first use (3-8 s);
the bench compiles all of an op's shapes first in parallel processes, outside the timed region.

On the GPU machine (with .dg/ copied beside the tree: name it in the run's carry), from the repo root:

    python3 scripts/bench_deepgemm.py [--quick] [--op gemm_fp8] [other bench arguments]

Without --op it runs both FP8 ops. The JSON goes to $OUT/bench_fp8_deepgemm.json (default /tmp), the output to
$OUT/bench_fp8_deepgemm.log; DeepGEMM's JIT cache is unpacked from .dg/dg_jit_cache.tgz if there and saved to
$OUT/dg_jit_cache.tgz (carry it back as .dg/dg_jit_cache.tgz to skip nvcc next time). The same by hand:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dg/*.whl
    PYTHONPATH=$PWD:/tmp/site CUDA_HOME=/usr/local/cuda DG_JIT_CACHE_DIR=/tmp/dg_jit_cache \\
        python3 -m cudart_kernels bench --op gemm_fp8 --op gemm_fp8_grouped --json /tmp/bench.json

Exit status: the bench's (2: the wheels could not be installed).
"""
from __future__ import annotations

import os
import sys

import deepgemm_env as dge


def bench_command(args: list, out: str) -> list:
    """The bench's command line: the FP8 ops unless `args` name ops, and a JSON file unless `args` name one."""
    cmd = [sys.executable, "-m", "cudart_kernels", "bench"]
    if "--op" not in args:
        cmd += ["--op", "gemm_fp8", "--op", "gemm_fp8_grouped"]
    if "--json" not in args:
        cmd += ["--json", os.path.join(out, "bench_fp8_deepgemm.json")]
    return cmd + list(args)


def main() -> int:
    out = os.environ.get("OUT") or "/tmp"
    os.makedirs(out, exist_ok=True)
    return dge.run_with_deepgemm(bench_command(sys.argv[1:], out), out, "bench_fp8_deepgemm.log")


if __name__ == "__main__":
    sys.exit(main())
