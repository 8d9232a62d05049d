"""One GEMM shape, run a few times (for ncu: -k regex:gemm_kernel). Usage: gemm_profile_case.py MxNxK [split_k]"""
import sys

import torch

import cudart_kernels as ck

m, n, k = map(int, sys.argv[1].split("x"))
split = int(sys.argv[2]) if len(sys.argv) > 2 else None
a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    ck.gemm(a, b, out=d, split_k=split)
torch.cuda.synchronize()
