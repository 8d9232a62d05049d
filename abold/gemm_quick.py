"""Quick same-run timing of ck.gemm against cuBLAS (torch.matmul) on a few shapes; bf16 in and out."""
import sys

import torch

import cudart_kernels as ck
from cudart_kernels.bench import time_us

shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[1:]] or [(8192, 8192, 8192), (4096, 7168, 16384),
                                                                    (4096, 2112, 7168), (128, 128, 65536)]
print("| MxNxK | ours us | TFLOP/s | cuBLAS us | TFLOP/s | ours/cuBLAS speed |")
for m, n, k in shapes:
    sets = max(1, min(8, int(2 * 50e6 // ((m * k + n * k) * 2)) + 1))
    a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    b = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    d = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    ref = a[0].float() @ b[0].float().t()
    ck.gemm(a[0], b[0], out=d[0])
    err = ((d[0].float() - ref).norm() / ref.norm()).item()
    ours = time_us(lambda i: ck.gemm(a[i], b[i], out=d[i]), sets, iters=10, repeats=5)
    cub = time_us(lambda i: torch.matmul(a[i], b[i].t(), out=d[i]), sets, iters=10, repeats=5)
    fl = 2 * m * n * k
    print(f"| {m}x{n}x{k} | {ours:.1f} | {fl / ours / 1e6:.0f} | {cub:.1f} | {fl / cub / 1e6:.0f} | "
          f"{cub / ours:.2f} | err {err:.1e}")
