"""The FP8 GEMMs against DeepGEMM on random real-model cases (the general case that the benchmark's fixed shapes do
not cover), on a GPU machine without network: normal GEMMs of real layers' (N, K) at random M, MoE prefill
(contiguous, experts of uneven rows) and decode (masked, groups filled unevenly, `expected_m` the mean for both
sides) on real experts' (N, K). Each case: both outputs compared, then ours and DeepGEMM in the same CUDA-graph
rounds (`cudart_kernels.bench`'s helpers); one line per case, geomeans of ours / DeepGEMM time last.

On the GPU machine, with .dg/ (DeepGEMM's wheels: scripts/deepgemm_env.py) in the run's carry, from the repo root:

    python3 scripts/deepgemm_survey.py [--seed 1] [--normal 60] [--contiguous 20] [--masked 20] [--json F]

Single cases move by up to 10% between passes (the board's clock between rounds): a case that stands out is
measured again before it means anything. DeepGEMM's kernels compile first, in parallel processes; its JIT cache is
saved to $OUT/dg_jit_cache.tgz as by bench_deepgemm.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys

import deepgemm_env as dge

# (N, K) of FP8 linear layers: dense and attention layers, then MoE experts (gate_up: 2 x inter, hidden; down)
LAYERS = [(36864, 7168), (7168, 18432), (9216, 4096), (4096, 8192), (10240, 5120), (5120, 8192), (51200, 5120),
          (5120, 25600), (10240, 8192), (8192, 28672), (6144, 4096), (28672, 4096), (4096, 14336), (2112, 7168),
          (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (1536, 7168), (576, 7168)]
EXPERTS = [(4096, 7168), (7168, 2048), (3072, 4096), (4096, 1536), (1536, 2048), (2048, 768), (28672, 4096),
           (4096, 14336), (5760, 2816), (2816, 2048)]
M_RANGES = [(1, 32), (33, 128), (129, 384), (385, 1024), (1025, 2560), (2561, 6144)]
EXPERT_COUNTS = [4, 8, 16, 32, 64, 128]  # contiguous (masked: up to 64)
CONTIGUOUS_ROWS = (2048, 65536)  # all experts' rows together, log-uniform
MASKED_M = [64, 128, 256, 512]


def cases(seed: int, normal: int, contiguous: int, masked: int) -> list:
    """The survey's cases (dicts as `cudart_kernels.bench._dg_label` reads them), the same for a seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(normal):
        (n, k), (lo, hi) = rng.choice(LAYERS), rng.choice(M_RANGES)
        out.append(dict(kind="normal", m=round(math.exp(rng.uniform(math.log(lo), math.log(hi)))), n=n, k=k))
    for _ in range(contiguous):
        (n, k), groups = rng.choice(EXPERTS), rng.choice(EXPERT_COUNTS)
        total = int(math.exp(rng.uniform(*map(math.log, CONTIGUOUS_ROWS))))
        weights = [rng.gammavariate(2.0, 1.0) for _ in range(groups)]
        out.append(dict(kind="contiguous", rows=[int(total * w / sum(weights)) for w in weights], n=n, k=k))
    for _ in range(masked):
        (n, k), m = rng.choice(EXPERTS), rng.choice(MASKED_M)
        groups = rng.choice([g for g in EXPERT_COUNTS if g <= 64])
        real = [min(m, int(rng.gammavariate(2.0, m / 3.0))) for _ in range(groups)]
        out.append(dict(kind="masked", max_m=m, masked=real, expected_m=max(1, -(-sum(real) // groups)), n=n, k=k))
    return out


def run_case(torch, B, dg, case) -> tuple:
    """(ours us, DeepGEMM us, relative difference of the outputs) of one case, or None where DeepGEMM fails."""
    from cudart_kernels.ops.gemm_fp8 import gemm_fp8, gemm_fp8_grouped_contiguous, gemm_fp8_grouped_masked
    from cudart_kernels.ops.quantize import quantize_fp8_per_block, quantize_fp8_per_token

    bf16, n, k, kind = torch.bfloat16, case["n"], case["k"], case["kind"]
    sets, iters = 1, 20
    if kind == "normal":
        m = case["m"]
        sets = B.sets_beyond_l2(m * k + n * k + 2 * m * n, cap=16)
        iters = max(3, min(50, int(2e5 // max(1.0, 2 * m * n * k / 1400e6))))  # (as the bench: ~0.2 s a graph)
        ops = []
        for _ in range(sets):
            qa, sa = quantize_fp8_per_token(torch.randn(m, k, device="cuda", dtype=bf16))
            qb, sb = quantize_fp8_per_block(torch.randn(n, k, device="cuda", dtype=bf16) * 0.05)
            ops.append(tuple(torch.from_dlpack(t) for t in (qa, sa, qb, sb)))
        d = [torch.empty(m, n, device="cuda", dtype=bf16) for _ in range(sets)]
        check = torch.empty(m, n, device="cuda", dtype=bf16)
        ours, theirs, valid = (lambda: gemm_fp8(*ops[0], d[0])), (lambda: (dg.gemm(*ops[0], check), check)[1]), None
        runs = [lambda i, s: gemm_fp8(*ops[i], d[i], stream=s), lambda i, s: dg.gemm(*ops[i], d[i])]
    elif kind == "contiguous":
        counts = case["rows"]
        a, sa, b, sb, ids, starts = B.uneven_contiguous(torch, counts, n, k, dg.m_align)
        m = a.shape[0]
        d, check = (torch.empty(m, n, device="cuda", dtype=bf16) for _ in range(2))
        ours = lambda: gemm_fp8_grouped_contiguous(a, sa, b, sb, ids, d, alignment=dg.m_align)  # noqa: E731
        theirs = lambda: (dg.contiguous(a, sa, b, sb, ids, check), check)[1]  # noqa: E731
        valid = lambda out: [out[st:st + r] for st, r in zip(starts, counts)]  # noqa: E731
        runs = [lambda i, s: gemm_fp8_grouped_contiguous(a, sa, b, sb, ids, d, alignment=dg.m_align, stream=s),
                lambda i, s: dg.contiguous(a, sa, b, sb, ids, d)]
    else:
        real, m, e = case["masked"], case["max_m"], case["expected_m"]
        groups = len(real)
        a, sa = B._fp8_activations(torch, groups * m, k)
        a, sa = a.view(groups, m, k), sa.view(groups, m, -1)
        b, sb = B._fp8_weights(torch, groups, n, k)
        sa_dg, masked = B.dg_masked_scales(torch, sa), torch.tensor(real, device="cuda", dtype=torch.int32)
        d, check = (torch.empty(groups, m, n, device="cuda", dtype=bf16) for _ in range(2))
        ours = lambda: gemm_fp8_grouped_masked(a, sa, b, sb, masked, d, expected_m=e)  # noqa: E731
        theirs = lambda: (dg.masked(a, sa_dg, b, sb, masked, e, check), check)[1]  # noqa: E731
        valid = lambda out: [out[g, :r] for g, r in enumerate(real)]  # noqa: E731
        runs = [lambda i, s: gemm_fp8_grouped_masked(a, sa, b, sb, masked, d, expected_m=e, stream=s),
                lambda i, s: dg.masked(a, sa_dg, b, sb, masked, e, d)]
    err = B._dg_check(torch, B._dg_label(case), ours, theirs, valid or (lambda out: [out]))
    if err is None:
        return None
    us, dg_us = B.graph_times_us(torch, runs, sets, iters=iters)
    return us, dg_us, err


def survey(args) -> int:
    import torch

    from cudart_kernels import bench as B

    dg = B.deepgemm_peer(torch)
    todo = cases(args.seed, args.normal, args.contiguous, args.masked)
    B.dg_prewarm(todo)
    rows = []
    for case in todo:
        got = run_case(torch, B, dg, case)
        torch.cuda.empty_cache()
        if got is None:
            continue
        us, dg_us, err = got
        rows.append(dict(case, ours_us=us, deepgemm_us=dg_us, ratio=us / dg_us, rel_diff=err))
        flag = "" if err <= B.DG_AGREE else "  MISMATCH"
        print(f"{B._dg_label(case)[:90]:90s} {us:9.1f} {dg_us:9.1f} {us / dg_us:6.3f}{flag}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("ours / DeepGEMM time, geomean (range):")
    for kind in ("normal", "contiguous", "masked"):
        r = [x["ratio"] for x in rows if x["kind"] == kind and x["rel_diff"] <= B.DG_AGREE]
        if r:
            print(f"  {kind:10s} {len(r):3d} cases  {math.exp(sum(map(math.log, r)) / len(r)):.3f} "
                  f"({min(r):.3f}-{max(r):.3f})")
    return 0 if rows else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--normal", type=int, default=60)
    ap.add_argument("--contiguous", type=int, default=20)
    ap.add_argument("--masked", type=int, default=20)
    ap.add_argument("--json", help="write the rows to this JSON file")
    args = ap.parse_args()
    if os.environ.get("CK_REQUIRE_DEEPGEMM") == "1":  # (the child: DeepGEMM installed and on the path)
        return survey(args)
    return dge.run_with_deepgemm([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], os.environ.get("OUT"),
                                 "deepgemm_survey.log")


if __name__ == "__main__":
    sys.exit(main())
