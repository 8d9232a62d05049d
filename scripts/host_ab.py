"""Host cost of the same op calls in two versions of the library, in ONE process (GPU machine, torch):

    python scripts/host_ab.py BASE_DIR       # BASE_DIR holds another version's cudart_kernels/ and ptx/
    (e.g. git archive 6ba4fe3 cudart_kernels ptx | tar -x -C /tmp/base, then: python scripts/host_ab.py /tmp/base)

The base package is imported as cudart_kernels_base beside this tree's cudart_kernels, and the two are timed in
interleaved batches of 200 calls (median over 60 batches a side), so that what moves a whole process on a shared
host (core placement, clocks, neighbours) hits both alike: `bench --op host` in separate processes moved 20-50%
between processes on the same H100 host. A torch.matmul row timed against itself shows the floor of the noise.
"""
import importlib
import os
import statistics
import sys
import time

import torch

from base_tree import load_base

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cases(lib, t):
    """(name, call) of the 16x64x64 calls `bench --op host` times with `out=`, for library `lib`."""
    as_array = importlib.import_module(lib.__name__ + ".runtime.interop").as_array
    dx, dy, dz = as_array(t["x"]), as_array(t["y"]), as_array(t["z"])
    qa, sa, qb, sb, dz8 = (as_array(t[k]) for k in ("qa", "sa", "qb", "sb", "z8"))
    x, y, z, z8, s, h = t["x"], t["y"], t["z"], t["z8"], t["stream"], t["stream"].cuda_stream
    fp8 = (t["qa"], t["sa"], t["qb"], t["sb"], z8)
    return [
        ("gemm, torch, stream=None", lambda: lib.gemm(x, y, out=z)),
        ("gemm, torch, stream object", lambda: lib.gemm(x, y, out=z, stream=s)),
        ("gemm, torch, int handle", lambda: lib.gemm(x, y, out=z, stream=h)),
        ("gemm, DeviceArray, int handle", lambda: lib.gemm(dx, dy, out=dz, stream=h)),
        ("gemm_fp8, torch, stream=None", lambda: lib.gemm_fp8(*fp8)),
        ("gemm_fp8, torch, stream object", lambda: lib.gemm_fp8(*fp8, stream=s)),
        ("gemm_fp8, torch, int handle", lambda: lib.gemm_fp8(*fp8, stream=h)),
        ("gemm_fp8, DeviceArray, int handle", lambda: lib.gemm_fp8(qa, sa, qb, sb, dz8, stream=h)),
    ]


def per_call_us(call, n: int = 200) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    base = load_base(sys.argv[1])
    sys.path.insert(0, REPO)
    head = importlib.import_module("cudart_kernels")
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    t = dict(x=torch.randn(16, 64, **bf16), y=torch.randn(64, 64, **bf16), z=torch.empty(16, 64, **bf16),
             z8=torch.empty(16, 64, **bf16), stream=torch.cuda.current_stream())
    t["qa"], t["sa"] = head.quantize_fp8_per_token(torch.randn(16, 128, **bf16))
    t["qb"], t["sb"] = head.quantize_fp8_per_block(torch.randn(64, 128, **bf16))
    matmul = ("torch.matmul(out=), against itself", lambda: torch.matmul(t["x"], t["y"].t(), out=t["z"]))
    pairs = [(matmul, matmul)] + list(zip(cases(base, t), cases(head, t)))
    print(f"| call (out=) | {base.__name__} (us) | this tree (us) | this tree / base |\n|---|---:|---:|---:|")
    for (name, b), (_, h) in pairs:
        for call in (b, h):
            for _ in range(300):
                call()
        tb, th = [], []
        for _ in range(60):
            tb.append(per_call_us(b))
            th.append(per_call_us(h))
            torch.cuda.synchronize()
        mb, mh = statistics.median(tb), statistics.median(th)
        print(f"| {name} | {mb:.2f} | {mh:.2f} | {mh / mb:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
