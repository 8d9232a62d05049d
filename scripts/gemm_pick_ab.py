"""Same-run A/B of the BF16 GEMM's picks in two versions of the library: every shape where the base version's
pick and this tree's differ, both timed with cuBLAS in the same CUDA-graph rounds (graphs over inputs rotated
past L2, the runs taking turns; median of --repeats), after each side's output is checked against an fp32
reference (NaN-poisoned first). The base is another tree's cudart_kernels/ and ptx/ (`git archive BASE
cudart_kernels ptx | tar -x -C /tmp/base`), imported beside this one as cudart_kernels_base.

    python scripts/gemm_pick_ab.py /tmp/base [--layout kn] [--m 144,200,257] [--random 150 --seed 7]

Shapes: the real-model layers below at each --m, plus --random shapes (M in --random-m, N and K multiples of 8;
--align-k rounds K to a multiple of 64). Without a GPU, --compile --props H100|H200 compiles both sides' kernels
for those picks into CUDART_KERNELS_CACHE_DIR (carry that folder to the GPU machine; the device's own measured
figures may still pick differently, and such kernels compile there). Prints one line per changed shape, then the
geomean new / base and against cuBLAS by M range; --json writes the rows.
"""
import argparse
import inspect
import json
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from base_tree import load_base  # noqa: E402

# (name, N, K) of real-model linear layers (weights [N, K])
LAYERS = [("dsv3 mlp gate_up", 36864, 7168), ("dsv3 mlp down", 7168, 18432), ("qwen3-235b qkv", 9216, 4096),
          ("qwen3-235b o", 4096, 8192), ("qwen3-235b expert gate_up", 3072, 4096),
          ("qwen3-235b expert down", 4096, 1536), ("qwen3-32b qkv", 10240, 5120), ("qwen3-32b o", 5120, 8192),
          ("qwen3-32b gate_up", 51200, 5120), ("qwen3-32b down", 5120, 25600), ("llama70b qkv", 10240, 8192),
          ("llama70b down", 8192, 28672), ("llama8b qkv", 6144, 4096), ("llama8b gate_up", 28672, 4096),
          ("llama8b down", 4096, 14336)]
RANGES = ((1, 128), (129, 1024), (1025, 1 << 30))


def shapes(args) -> list:
    out = [(m, n, k) for m in args.m for _, n, k in LAYERS]
    rng = random.Random(args.seed)
    lo, hi = args.random_m
    for _ in range(args.random):
        k = 8 * rng.randint(64, 2048)
        out.append((rng.randint(lo, hi), 8 * rng.randint(32, 2048), -(-k // 64) * 64 if args.align_k else k))
    return out


def describe(c) -> str:
    if not hasattr(c, "bm"):
        return "decode"
    return f"{c.bm}x{c.bn}x{c.splits}{' swapped' if c.swap_ab else ''}{' m' + str(c.mcast) if c.mcast else ''}"


def misaligned(n, k, kn: bool) -> bool:
    """Whether contiguous bf16 operands of this shape have rows off 128-byte boundaries (A's K, or a [K, N] B's N)."""
    return k % 64 != 0 or (kn and n % 64 != 0)


def pick(lib, m, n, k, props, kn: bool):
    """The config a library runs for bf16 in and out (its decode config, or its tiled one; a version that tells
    misaligned rows apart is told)."""
    g = lib.ops.gemm
    dc = g.pick_decode(m, n, k, props, b_kn=kn)
    if dc is not None:
        return dc
    if "misaligned" in inspect.signature(g.pick_config).parameters:
        return g.pick_config(m, n, k, 2, props, b_kn=kn, misaligned=misaligned(n, k, kn))
    return g.pick_config(m, n, k, 2, props, b_kn=kn)


def differs(base, new, m, n, k, base_props, props, kn: bool) -> bool:
    """Whether the two versions run this shape differently: another config, or misaligned rows that only the new
    one tells apart (its TMA maps differ)."""
    c_base, c_new = pick(base, m, n, k, base_props, kn), pick(new, m, n, k, props, kn)
    aware = ["misaligned" in inspect.signature(lib.ops.gemm.pick_config).parameters for lib in (base, new)]
    return key(c_base) != key(c_new) or (aware[0] != aware[1] and misaligned(n, k, kn) and hasattr(c_new, "bm"))


def key(c) -> tuple:
    return tuple(sorted(vars(c).items()))


def compile_both(base, new, todo, props, kn: bool) -> None:
    for lib, label in ((base, "base"), (new, "new")):
        g, dt = lib.ops.gemm, lib.runtime.dtypes
        compile_kernel = lib.runtime.compiler.compile_kernel
        for m, n, k in todo:
            c = pick(lib, m, n, k, props, kn)
            if hasattr(c, "bm"):  # (decode kernels compile on the GPU machine)
                epi = "EPI_SPLIT" if c.splits > 1 else "EPI_STORE"
                compile_kernel("gemm.cu", "gemm_kernel", g._defines(dt.bfloat16, dt.bfloat16, c, epi, b_kn=kn))
        print(f"{label}: compiled the picks of {len(todo)} shapes", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="folder holding the base version's cudart_kernels/ and ptx/")
    ap.add_argument("--layout", choices=("nk", "kn"), default="nk", help="B as [N, K] or [K, N]")
    ap.add_argument("--m", type=lambda s: [int(x) for x in s.split(",") if x], default=[144, 200, 257, 300, 520, 700])
    ap.add_argument("--random", type=int, default=0, help="random shapes besides the layers")
    ap.add_argument("--random-m", type=lambda s: tuple(int(x) for x in s.split("..")), default=(33, 2048),
                    help="M range of the random shapes, LO..HI")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--align-k", action="store_true", help="random K a multiple of 64 (128-byte rows)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--compile", action="store_true", help="compile both sides' kernels only (no GPU needed)")
    ap.add_argument("--props", choices=("H100", "H200"), default="H200", help="device figures for --compile")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    kn = args.layout == "kn"
    base = load_base(args.base)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cudart_kernels as new
    import cudart_kernels.ops.gemm  # noqa: F401 (new.ops.gemm below)

    if args.compile:
        props = getattr(new.runtime.driver, args.props)
        base_props = getattr(base.runtime.driver, args.props)
        todo = [s for s in shapes(args) if differs(base, new, *s, base_props, props, kn)]
        compile_both(base, new, todo, props, kn)
        return 0

    import torch
    from cudart_kernels.bench import graph_times_us, sets_beyond_l2

    props, base_props = new.runtime.driver.device_properties(0), base.runtime.driver.device_properties(0)
    rows, worst = [], 0.0
    for m, n, k in shapes(args):
        if not differs(base, new, m, n, k, base_props, props, kn):
            continue
        c_base, c_new = pick(base, m, n, k, base_props, kn), pick(new, m, n, k, props, kn)
        sets = sets_beyond_l2((m * k + n * k + m * n) * 2, cap=8)
        a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        b = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) if kn else
             torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        d = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        ref = a[0].float() @ (b[0].float() if kn else b[0].float().t())
        errs = []
        for lib in (base, new):
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            lib.gemm(a[0], b[0], out=out, b_layout=args.layout)
            err = float((out.float() - ref).norm() / ref.norm())
            errs.append(err)
            worst = max(worst, err if not math.isnan(err) else math.inf)

        def cublas(i, s):
            return torch.matmul(a[i], b[i] if kn else b[i].t(), out=d[i])

        def runner(lib):
            return lambda i, s: lib.gemm(a[i], b[i], out=d[i], stream=s, b_layout=args.layout)

        iters = max(3, min(50, int(2e5 // max(1.0, 2 * m * n * k / 700e6))))
        cub, t_base, t_new = graph_times_us(torch, [cublas, runner(base), runner(new)], sets, iters=iters,
                                            repeats=args.repeats)
        rows.append(dict(shape=[m, n, k], base=describe(c_base), new=describe(c_new), cublas_us=cub,
                         base_us=t_base, new_us=t_new, errors=errs))
        print(f"{m}x{n}x{k}: base {describe(c_base)} {t_base / cub:.3f}x cuBLAS, new {describe(c_new)} "
              f"{t_new / cub:.3f}x, new / base {t_new / t_base:.3f} (errors {errs[0]:.1e} / {errs[1]:.1e})",
              flush=True)
        a = b = d = None

    def gm(v):
        return math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")

    for lo, hi in RANGES:
        sub = [r for r in rows if lo <= r["shape"][0] <= hi]
        if sub:
            ratio = [r["new_us"] / r["base_us"] for r in sub]
            print(f"M {lo}..{min(hi, max(r['shape'][0] for r in sub))}: {len(sub)} changed, new / base "
                  f"{gm(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f}, above 1.03: {sum(x > 1.03 for x in ratio)}), "
                  f"base / cuBLAS {gm([r['base_us'] / r['cublas_us'] for r in sub]):.3f}, "
                  f"new / cuBLAS {gm([r['new_us'] / r['cublas_us'] for r in sub]):.3f}")
    print(f"{len(rows)} changed shapes; worst relative error {worst:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(layout=args.layout, rows=rows), f, indent=1)
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
