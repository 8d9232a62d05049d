"""Same-run comparison of GEMM heuristic variants against cuBLAS on the benchmark shapes (bf16 in and out).

    python scripts/gemm_variants.py [large|skinny|MxNxK ...] [--variants base,nomcast]

A variant is a set of GemmTuning fields (see VARIANTS; "_split_k" forces the split count); each gets its own plans.
"""
from dataclasses import replace

import argparse

import torch

import cudart_kernels as ck
from cudart_kernels.bench import graph_time_us, sets_beyond_l2
from cudart_kernels.ops import gemm as g
from cudart_kernels.runtime.driver import device_properties
from cudart_kernels.runtime.plans import PLANS

VARIANTS = {
    "base": {},
    "nomcast": {"multicast": False},
    "nosplit": {"_split_k": 1},
    "nodecode": {"decode": False},
}

ap = argparse.ArgumentParser()
ap.add_argument("shapes", nargs="*", default=["large", "skinny"])
ap.add_argument("--variants", default="base,nomcast")
args = ap.parse_args()
shapes = []
for s in args.shapes:
    shapes += g.BENCH_SHAPES[s] if s in g.BENCH_SHAPES else [tuple(map(int, s.split("x")))]
names = args.variants.split(",")
props = device_properties(0)

print(f"device: {torch.cuda.get_device_name()}")
print("| MxNxK | cuBLAS us | " + " | ".join(f"{n} us (cfg) | {n} x" for n in names) + " |")
ratios = {n: [] for n in names}
for m, n, k in shapes:
    sets = sets_beyond_l2((m * k + n * k + m * n) * 2, cap=16)
    a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    b = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    d = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    ref = a[0].double() @ b[0].double().t()
    iters = max(3, min(50, int(2e5 // max(1.0, 2 * m * n * k / 700e6))))
    cub = graph_time_us(torch, lambda i, s: torch.matmul(a[i], b[i].t(), out=d[i]), sets, iters=iters)
    cells = []
    for name in names:
        over = dict(VARIANTS[name])
        split = over.pop("_split_k", None)
        t = replace(g.TUNING, **over)
        cfg = g.pick_config(m, n, k, 2, props, split, tuning=t)
        d[0].fill_(float("nan"))
        ck.gemm(a[0], b[0], out=d[0], split_k=split, tuning=t)
        err = ((d[0].double() - ref).norm() / ref.norm()).item()
        us = graph_time_us(torch, lambda i, s: ck.gemm(a[i], b[i], out=d[i], split_k=split, stream=s, tuning=t),
                           sets, iters=iters)
        ratios[name].append(cub / us)
        bad = "" if err < 1e-2 else f" ERR {err:.1e}"
        grid = next(p for k, p in PLANS.items("gemm") if t in k).grid[0]
        cells.append(f"{us:.1f} ({cfg.bm}x{cfg.bn} st{cfg.stages} s{cfg.splits} mc{cfg.mcast} g{cfg.group_m} "
                     f"grid{grid}){bad} "
                     f"| {cub / us:.2f}")
    print(f"| {m}x{n}x{k} | {cub:.1f} | " + " | ".join(cells) + " |", flush=True)
    a = b = d = None
geo = {n: torch.tensor(r).log().mean().exp().item() for n, r in ratios.items()}
print("geomean cuBLAS/ours: " + ", ".join(f"{n} {v:.3f}" for n, v in geo.items()))
