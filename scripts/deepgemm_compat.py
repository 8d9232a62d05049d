"""cudart_kernels.deep_gemm against the real DeepGEMM, on a GPU machine without network.

Installs DeepGEMM's wheels from the repo's git-ignored .dg/ folder into /tmp/site (scripts/deepgemm_env.py: how
to download them, where its JIT and cache go) and runs tests/test_deep_gemm.py and tests/test_deep_gemm_gpu.py with
CK_REQUIRE_DEEPGEMM=1, so that every GPU test also runs the same calls on DeepGEMM and compares (a DeepGEMM that
fails to import is then an error, not a skip).

On the GPU machine (with .dg/ copied beside the tree), from the repo root:

    python3 scripts/deepgemm_compat.py [extra pytest arguments]

A cache saved by an earlier run (.dg/dg_jit_cache.tgz) is unpacked first; with $OUT set, the cache is saved to
$OUT/dg_jit_cache.tgz and the log to $OUT/deepgemm_compat.log. Exit status: pytest's.
"""
from __future__ import annotations

import os
import sys

import deepgemm_env as dge


def main() -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "tests/test_deep_gemm.py", "tests/test_deep_gemm_gpu.py",
           *sys.argv[1:]]
    return dge.run_with_deepgemm(cmd, os.environ.get("OUT"), "deepgemm_compat.log")


if __name__ == "__main__":
    sys.exit(main())
