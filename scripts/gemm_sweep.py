"""Time forced GEMM configs (BN, split count, multicast) on skinny shapes, same run as cuBLAS, to calibrate the
split-K model. Kernels are compiled in parallel first. Writes a CSV (--csv) and prints the best per shape.

    python scripts/gemm_sweep.py [skinny|MxNxK ...] [--csv out.csv]
"""
import argparse
import csv
import multiprocessing as mp
import os

import torch

import cudart_kernels as ck
from cudart_kernels.bench import graph_time_us, sets_beyond_l2
from dataclasses import replace

from cudart_kernels.ops import gemm as g
from cudart_kernels.ops import sm90
from cudart_kernels.runtime import dtypes as dt
from cudart_kernels.runtime.compiler import compile_kernel
from cudart_kernels.runtime.driver import device_properties


def configs(m, n, k, props, bms=None):
    for bm in bms or [64 if m <= 64 else 128]:
        yield from _configs(m, n, k, bm, props)


def _configs(m, n, k, bm, props):
    k_blocks = -(-k // g.BK)
    budget = props.smem_per_block_optin
    for bn in sorted({b for b in (16, 32, 48, 64, 96, 128, 192, 256) if b <= max(16, -(-n // 8) * 8)}):
        tiles = -(-m // bm) * -(-n // bn)
        for sp in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128):
            if sp > k_blocks // 2 and sp > 1 or tiles * sp > 3 * props.sm_count:
                continue
            epi = 4 if sp > 1 else 2
            stages = g.max_stages(bm, bn, epi, budget)
            if stages < 2:
                continue
            smem = g.smem_bytes(bm, bn, stages, epi)
            for mc in {0, sm90.pick_multicast(m, n, bm, bn, sp, False, props, g.TUNING)}:
                yield g.GemmConfig(bm, bn, stages, sp, smem, mc, sm90.group_rows(m, n, bm, bn, mc, props),
                                   sm90.streams_b(m, k, 2, g.TUNING))


def defines(cfg):
    return g._defines(dt.bfloat16, dt.bfloat16, cfg, "EPI_SPLIT" if cfg.splits > 1 else "EPI_STORE")


def _compile(d):
    compile_kernel("gemm.cu", "gemm_kernel", d, "sm_90a")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["skinny"])
    ap.add_argument("--bm", type=int, action="append", help="BM to sweep (repeatable; default: the heuristic's)")
    ap.add_argument("--csv", default=os.path.join(os.environ.get("OUT", "."), "gemm_sweep.csv"))
    args = ap.parse_args()
    shapes = []
    for s in args.shapes:
        shapes += g.BENCH_SHAPES[s] if s in g.BENCH_SHAPES else [tuple(map(int, s.split("x")))]
    props = device_properties(0)
    todo = {m_n_k: list(configs(*m_n_k, props, args.bm)) for m_n_k in shapes}
    uniq = {tuple(sorted(defines(c).items())): defines(c) for cs in todo.values() for c in cs}
    with mp.get_context("spawn").Pool(min(16, os.cpu_count())) as pool:
        pool.map(_compile, list(uniq.values()))
    print(f"device: {torch.cuda.get_device_name()}, {sum(map(len, todo.values()))} configs")
    rows = []
    for (m, n, k), cfgs in todo.items():
        sets = sets_beyond_l2((m * k + n * k + m * n) * 2, cap=16)
        a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        b = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        d = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        iters = 20
        cub = graph_time_us(torch, lambda i, s: torch.matmul(a[i], b[i].t(), out=d[i]), sets, iters, repeats=5)
        auto = g.pick_config(m, n, k, 2, props)
        t_auto = graph_time_us(torch, lambda i, s: ck.gemm(a[i], b[i], out=d[i], stream=s), sets, iters, repeats=5)
        best = None
        for cfg in cfgs:
            t = replace(g.TUNING, force_config=cfg)
            us = graph_time_us(torch, lambda i, s: ck.gemm(a[i], b[i], out=d[i], stream=s, tuning=t), sets, iters,
                               repeats=5)
            rows.append(dict(m=m, n=n, k=k, bm=cfg.bm, bn=cfg.bn, splits=cfg.splits, mcast=cfg.mcast,
                             stages=cfg.stages, us=round(us, 2), cublas=round(cub, 2)))
            if best is None or us < best[0]:
                best = (us, cfg)
        b_us, b_cfg = best
        print(f"{m}x{n}x{k}: cuBLAS {cub:.1f} | auto {t_auto:.1f} (BN{auto.bn} s{auto.splits} mc{auto.mcast}) | "
              f"best {b_us:.1f} (BM{b_cfg.bm} BN{b_cfg.bn} s{b_cfg.splits} mc{b_cfg.mcast} st{b_cfg.stages}) "
              f"| best x {cub / b_us:.2f}", flush=True)
        a = b = d = None
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
