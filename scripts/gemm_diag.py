"""Diagnostics against cuBLAS, same run (bf16 in and out).

    python scripts/gemm_diag.py ksweep            # time vs K on 4096x7168: intercept = fixed cost per launch/tile
    python scripts/gemm_diag.py prof MxNxK ...    # one call of ours and of cuBLAS per shape inside NVTX range
                                                  # "prof" (run under ncu --nvtx --nvtx-include prof/)
"""
import sys

import numpy as np
import torch

import cudart_kernels as ck
from cudart_kernels.bench import graph_time_us


def operands(m, n, k):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return a, b, torch.empty(m, n, device="cuda", dtype=torch.bfloat16)


def ksweep():
    m, n = 4096, 7168
    print(f"device: {torch.cuda.get_device_name()}")
    print("| K | ours us | cuBLAS us | ratio |")
    rows = []
    for k in (512, 1024, 2048, 4096, 8192):
        a, b, d = operands(m, n, k)
        iters = 20
        ours = graph_time_us(torch, lambda i, s: ck.gemm(a, b, out=d, stream=s), iters=iters)
        cub = graph_time_us(torch, lambda i, s: torch.matmul(a, b.t(), out=d), iters=iters)
        rows.append((k, ours, cub))
        print(f"| {k} | {ours:.1f} | {cub:.1f} | {cub / ours:.3f} |", flush=True)
    ks = np.array([r[0] for r in rows], float)
    for name, col in (("ours", 1), ("cuBLAS", 2)):
        t = np.array([r[col] for r in rows])
        slope, icpt = np.polyfit(ks, t, 1)
        print(f"{name}: {slope * 1024:.2f} us per 1024 K, intercept {icpt:.1f} us "
              f"({2 * m * n / (slope * 1e-6) / 1e12:.0f} TFLOP/s marginal)")


def prof(shapes):
    cases = []
    for s in shapes:
        m, n, k = map(int, s.split("x"))
        a, b, d = operands(m, n, k)
        for _ in range(2):
            ck.gemm(a, b, out=d)
            torch.matmul(a, b.t(), out=d)
        cases.append((a, b, d))
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    for a, b, d in cases:
        ck.gemm(a, b, out=d)
        torch.matmul(a, b.t(), out=d)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    if sys.argv[1] == "ksweep":
        ksweep()
    else:
        prof(sys.argv[2:])
