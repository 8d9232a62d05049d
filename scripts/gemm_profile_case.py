"""One GEMM shape, run a few times (for ncu: -k regex:gemm_kernel). Usage: gemm_profile_case.py MxNxK [split_k]
Environment: GEMM_MULTICAST=0 turns 2-CTA multicast off."""
import os
import sys

import torch

import cudart_kernels as ck
from cudart_kernels.ops import gemm as g

g.MULTICAST = os.environ.get("GEMM_MULTICAST", "1") != "0"

m, n, k = map(int, sys.argv[1].split("x"))
split = int(sys.argv[2]) if len(sys.argv) > 2 else None
a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    ck.gemm(a, b, out=d, split_k=split)
torch.cuda.synchronize()
