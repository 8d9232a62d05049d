"""Same-run A/B of the held-in benchmark sets in two versions of the library: BF16 large and skinny
(`bench --op gemm`'s shapes, cuBLAS in the rounds) and FP8 normal at M <= 128 (DeepGEMM in the rounds where
`import deep_gemm` works). The base is another tree's cudart_kernels/ and ptx/ (`git archive BASE cudart_kernels
ptx | tar -x -C /tmp/base`), imported beside this one as cudart_kernels_base; this tree's call runs twice in each
round (the second an A/A copy: the spread of a ratio, seen beside it). Every shape is timed in CUDA-graph rounds
over inputs rotated past L2, base / new / copy / peer taking turns, the order reversed every other round; the
median of --rounds. Outputs are compared (bitwise equal, or the largest difference).

    python scripts/held_in_ab.py /tmp/base [--rounds 4] [--json out.json]
    python scripts/held_in_ab.py /tmp/base --compile    # no GPU: both trees' kernel variants into the cache

Prints one line per shape, then per set the geomean new / base and copy / base and the worst shape.
"""
import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from base_tree import load_base  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def held_in_sets(new) -> dict:
    """(set name, [(kind, M, N, K)]) of this tree's benchmark shapes."""
    bf16 = new.ops.gemm.BENCH_SHAPES
    fp8 = [s for s in new.ops.gemm_fp8.BENCH_SHAPES["normal"] if s[0] <= 128]
    return {"BF16 large": [("bf16", *s) for s in bf16["large"]],
            "BF16 skinny": [("bf16", *s) for s in bf16["skinny"]],
            "FP8 M <= 128": [("fp8", *s) for s in fp8]}


def compile_variants(libs) -> None:
    """Every GEMM kernel variant of each library (its own list and compiler) into CUDART_KERNELS_CACHE_DIR."""
    import importlib
    for lib in libs:
        compile_kernel = importlib.import_module(lib.__name__ + ".runtime.compiler").compile_kernel
        variants = lib.ops.gemm.variants() + lib.ops.gemm_fp8.variants()
        for v in variants:
            compile_kernel(v[0], v[1], v[2], "sm_90a")
        print(f"{lib.__name__}: {len(variants)} variants compiled", flush=True)


def case_runs(torch, bench, libs, kind, m, n, k, dg):
    """(runs for graph_times_us: base, new, copy, peer; the input sets; a check of the outputs)."""
    sets = bench.sets_beyond_l2((m * k + n * k) * (2 if kind == "bf16" else 1) + 2 * m * n, cap=16)
    d = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    base, new = libs
    if kind == "bf16":
        a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        b = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        calls = [lambda i, s: base.gemm(a[i], b[i], out=d[i], stream=s),
                 lambda i, s: new.gemm(a[i], b[i], out=d[i], stream=s)]
        peer = lambda i, s: torch.matmul(a[i], b[i].t(), out=d[i])  # noqa: E731
    else:
        from cudart_kernels.ops.quantize import quantize_fp8_per_block, quantize_fp8_per_token
        ops = []
        for _ in range(sets):
            qa, sa = quantize_fp8_per_token(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            qb, sb = quantize_fp8_per_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05)
            ops.append(tuple(torch.from_dlpack(t) for t in (qa, sa, qb, sb)))
        calls = [lambda i, s: base.gemm_fp8(*ops[i], d[i], stream=s),
                 lambda i, s: new.gemm_fp8(*ops[i], d[i], stream=s)]
        peer = (lambda i, s: dg.gemm(*ops[i], d[i])) if dg is not None else None

    def check() -> str:
        outs = []
        for call in calls:
            d[0].fill_(float("nan"))
            call(0, None)
            outs.append(d[0].float().clone())
        if torch.equal(outs[0], outs[1]):
            return "same"
        return f"max diff {(outs[0] - outs[1]).abs().max().item():.3g}"
    return calls + calls[1:] + ([peer] if peer else []), sets, check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="a folder holding another version's cudart_kernels/ and ptx/")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--compile", action="store_true", help="compile both trees' GEMM variants only (no GPU)")
    args = ap.parse_args()
    base = load_base(args.base)
    sys.path.insert(0, REPO)
    import cudart_kernels as new
    if args.compile:
        compile_variants([base, new])
        return 0

    import torch
    from cudart_kernels import bench
    dg = bench.deepgemm_peer(torch)
    dg = dg if dg is not None and dg.has("normal") else None
    rows = []
    for set_name, shapes in held_in_sets(new).items():
        if set_name.startswith("FP8") and dg is not None:
            bench.dg_prewarm([dict(kind="normal", m=m, n=n, k=k) for _, m, n, k in shapes])
        for kind, m, n, k in shapes:
            runs, sets, check = case_runs(torch, bench, (base, new), kind, m, n, k, dg)
            outcome = check()
            iters = max(3, min(50, int(2e5 // max(1.0, 2 * m * n * k / 700e6))))
            per_round = []
            for r in range(args.rounds):
                order = runs if r % 2 == 0 else runs[::-1]
                t = bench.graph_times_us(torch, order, sets, iters=iters)
                per_round.append(t if r % 2 == 0 else t[::-1])
            t = [statistics.median(x[i] for x in per_round) for i in range(len(runs))]
            row = dict(set=set_name, shape=f"{m}x{n}x{k}", base_us=t[0], new_us=t[1], copy_us=t[2],
                       peer_us=t[3] if len(t) > 3 else None, outputs=outcome)
            rows.append(row)
            peer = f" peer {t[3]:9.1f} new/peer {t[1] / t[3]:.3f}" if len(t) > 3 else ""
            print(f"{set_name:13s} {row['shape']:18s} base {t[0]:9.1f} new {t[1]:9.1f} copy {t[2]:9.1f}{peer} | "
                  f"new/base {t[1] / t[0]:.3f} copy/base {t[2] / t[0]:.3f} {outcome}", flush=True)
            runs = None
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    print("\n| set | new / base | copy / base | worst new / base |\n|---|---:|---:|---:|")
    for set_name in held_in_sets(new):
        sel = [r for r in rows if r["set"] == set_name]
        worst = max(sel, key=lambda r: r["new_us"] / r["base_us"])
        print(f"| {set_name} ({len(sel)}) | {gm([r['new_us'] / r['base_us'] for r in sel]):.3f} | "
              f"{gm([r['copy_us'] / r['base_us'] for r in sel]):.3f} | "
              f"{worst['new_us'] / worst['base_us']:.3f} ({worst['shape']}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
