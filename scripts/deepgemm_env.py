"""DeepGEMM on a GPU machine without network, for scripts/deepgemm_compat.py and scripts/bench_deepgemm.py: its
wheels installed from the repo's git-ignored .dg/ folder into /tmp/site, the environment its JIT needs, and its
JIT cache carried between runs.

Get the wheels once, where PyPI is reachable, from the repo root (sgl-deep-gemm 0.1.5.post1 is SGLang's build of
DeepGEMM, the last one built against torch 2.11 + CUDA 13; tvm-ffi is its binding layer):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \\
        -d .dg sgl-deep-gemm==0.1.5.post1 apache-tvm-ffi==0.1.11
    echo /.dg/ >> .git/info/exclude

DeepGEMM compiles each kernel shape with nvcc on first use (a few seconds each): CUDA_HOME defaults to
/usr/local/cuda, its cache to $DG_JIT_CACHE_DIR (default /tmp/dg_jit_cache). A cache saved by an earlier run and
put back as .dg/dg_jit_cache.tgz is unpacked first; `save_cache` writes $OUT/dg_jit_cache.tgz.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(ROOT, ".dg")
SITE = "/tmp/site"  # DeepGEMM's JIT cache keys hold its include path: keep it fixed so saved caches stay valid
SAVED_CACHE = os.path.join(WHEELS, "dg_jit_cache.tgz")


def install(site: str = SITE) -> str | None:
    """pip-install the wheels of .dg/ into `site` (offline, no dependencies); None, or what went wrong."""
    wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")))
    if not any("sgl_deep_gemm" in os.path.basename(w) for w in wheels):
        return f"no sgl_deep_gemm wheel in {WHEELS}: download it first (see scripts/deepgemm_env.py)"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--upgrade", "--target", site, *wheels])
    if pip.returncode:
        return "pip could not install the wheels above (tvm-ffi's wheel needs CPython >= 3.12)"
    return None


def environment(site: str = SITE, base: dict | None = None) -> dict:
    """The environment for a child process that imports this tree and DeepGEMM (its JIT's CUDA_HOME and cache)."""
    env = dict(os.environ if base is None else base, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, site, env.get("PYTHONPATH")) if p)
    env.setdefault("CUDA_HOME", "/usr/local/cuda")
    env.setdefault("DG_JIT_CACHE_DIR", "/tmp/dg_jit_cache")
    return env


def restore_cache(env: dict, saved: str = SAVED_CACHE) -> int:
    """Unpack a saved JIT cache into env's DG_JIT_CACHE_DIR; the number of kernels it then holds (0: none saved)."""
    if not os.path.exists(saved):
        return 0
    with tarfile.open(saved) as tf:
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tf.extractall(env["DG_JIT_CACHE_DIR"], **kw)
    return len(glob.glob(os.path.join(env["DG_JIT_CACHE_DIR"], "cache", "kernel.*")))


def save_cache(env: dict, out: str | None) -> str | None:
    """Tar env's DG_JIT_CACHE_DIR/cache into out/dg_jit_cache.tgz (carry it back as .dg/dg_jit_cache.tgz to skip
    nvcc next time); the path, or None when there is no cache or no `out`."""
    cache = os.path.join(env["DG_JIT_CACHE_DIR"], "cache")
    if not out or not os.path.isdir(cache):
        return None
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "dg_jit_cache.tgz")
    with tarfile.open(path, "w:gz") as tf:
        tf.add(cache, arcname="cache")
    return path


def run_logged(cmd: list, env: dict, log: str | None) -> int:
    """Run `cmd` from the repo root, echoing its output as it comes (DeepGEMM's first compiles take minutes) and
    writing it to `log` too; its exit status."""
    lines = []
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    if log:
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
        with open(log, "w") as f:
            f.writelines(lines)
    return proc.returncode


def run_with_deepgemm(cmd: list, out: str | None, log_name: str) -> int:
    """Install the wheels, then run `cmd` from the repo root with DeepGEMM importable and CK_REQUIRE_DEEPGEMM=1, its
    JIT cache restored first (.dg/dg_jit_cache.tgz) and saved to `out` after, its output also in out/log_name;
    the child's exit status (2: the wheels could not be installed)."""
    problem = install()
    if problem:
        print(problem)
        return 2
    env = dict(environment(), CK_REQUIRE_DEEPGEMM="1")
    kernels = restore_cache(env)
    if kernels:
        print(f"DeepGEMM JIT cache: {kernels} kernels restored from {SAVED_CACHE}")
    rc = run_logged(cmd, env, os.path.join(out, log_name) if out else None)
    saved = save_cache(env, out)
    if saved:
        print(f"DeepGEMM JIT cache saved to {saved}")
    return rc
