"""cudart_kernels.deep_gemm against the real DeepGEMM, on a GPU machine without network.

Installs DeepGEMM's wheels from the repo's git-ignored .dg/ folder into /tmp/site and runs
tests/test_deep_gemm.py and tests/test_deep_gemm_gpu.py with CK_REQUIRE_DEEPGEMM=1, so that every GPU test also
runs the same calls on DeepGEMM and compares (a DeepGEMM that fails to import is then an error, not a skip).

Get the wheels once, where PyPI is reachable, from the repo root (sgl-deep-gemm 0.1.5.post1 is SGLang's build of
DeepGEMM, the last one built against torch 2.11 + CUDA 13; tvm-ffi is its binding layer):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \\
        -d .dg sgl-deep-gemm==0.1.5.post1 apache-tvm-ffi==0.1.11
    echo /.dg/ >> .git/info/exclude

Then on the GPU machine (with .dg/ copied beside the tree), from the repo root:

    python3 scripts/deepgemm_compat.py [extra pytest arguments]

DeepGEMM compiles each kernel shape with nvcc on first use (a few seconds each): CUDA_HOME defaults to
/usr/local/cuda, its cache to $DG_JIT_CACHE_DIR (default /tmp/dg_jit_cache). A cache saved by an earlier run
(.dg/dg_jit_cache.tgz) is unpacked first; with $OUT set, the cache is saved to $OUT/dg_jit_cache.tgz and the
log to $OUT/deepgemm_compat.log. Exit status: pytest's.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = "/tmp/site"  # DeepGEMM's JIT cache keys hold its include path: keep it fixed so saved caches stay valid


def main() -> int:
    wheels = sorted(glob.glob(os.path.join(ROOT, ".dg", "*.whl")))
    if not any("sgl_deep_gemm" in w for w in wheels):
        print(f"no sgl_deep_gemm wheel in {ROOT}/.dg: download it first (see this script's docstring)")
        return 2
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--upgrade", "--target", SITE, *wheels])
    if pip.returncode:
        print("pip could not install the wheels above (tvm-ffi's wheel needs CPython >= 3.12)")
        return 2
    env = dict(os.environ, CK_REQUIRE_DEEPGEMM="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, SITE, os.environ.get("PYTHONPATH")) if p)
    env.setdefault("CUDA_HOME", "/usr/local/cuda")
    env.setdefault("DG_JIT_CACHE_DIR", "/tmp/dg_jit_cache")
    saved = os.path.join(ROOT, ".dg", "dg_jit_cache.tgz")
    if os.path.exists(saved):
        with tarfile.open(saved) as tf:
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tf.extractall(env["DG_JIT_CACHE_DIR"], **kw)
    out = os.environ.get("OUT")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "tests/test_deep_gemm.py", "tests/test_deep_gemm_gpu.py",
           *sys.argv[1:]]
    lines = []
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as run:
        for line in run.stdout:  # as it comes (DeepGEMM's first compiles take minutes)
            print(line, end="", flush=True)
            lines.append(line)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "deepgemm_compat.log"), "w") as f:
            f.writelines(lines)
        cache = os.path.join(env["DG_JIT_CACHE_DIR"], "cache")
        if os.path.isdir(cache):
            with tarfile.open(os.path.join(out, "dg_jit_cache.tgz"), "w:gz") as tf:
                tf.add(cache, arcname="cache")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
