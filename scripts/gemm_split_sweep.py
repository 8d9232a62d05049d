"""Time forced split-K counts for a few skinny shapes (same run, events), to check the split heuristic."""
import torch

import cudart_kernels as ck
from cudart_kernels.bench import time_us
from cudart_kernels.ops import gemm as g
from cudart_kernels.runtime.driver import device_properties

props = device_properties(0)
for m, n, k in [(128, 128, 65536), (256, 256, 32768), (16, 1280, 8192), (1024, 1024, 65536)]:
    a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    b = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    d = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    cub = time_us(lambda i: torch.matmul(a[i], b[i].t(), out=d[i]), 4, iters=10, repeats=5)
    auto = g.pick_config(m, n, k, 2, props)
    row = [f"{m}x{n}x{k}: cuBLAS {cub:.1f} | auto (BN {auto.bn}, {auto.splits}) "
           f"{time_us(lambda i: ck.gemm(a[i], b[i], out=d[i]), 4, iters=10, repeats=5):.1f}"]
    for s in (1, 4, 8, 16, 32, 64, 128):
        cfg = g.pick_config(m, n, k, 2, props, split_k=s)
        us = time_us(lambda i: ck.gemm(a[i], b[i], out=d[i], split_k=s), 4, iters=10, repeats=5)
        row.append(f"s{s}/BN{cfg.bn} {us:.1f}")
    print(" | ".join(row))
