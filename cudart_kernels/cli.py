"""The `cudart-kernels` command: info, compile, selftest, bench."""
from __future__ import annotations

import argparse
import logging
import sys

from . import __version__
from .ops import VARIANTS
from .runtime import compiler, driver

SMEM_LIMIT = 232448  # opt-in bytes per block on H100


def cmd_info(args) -> int:
    print(f"cudart-kernels {__version__}")
    if driver.gpu_available():
        for d in range(driver.device_count()):
            p = driver.device_properties(d)
            print(f"device {d}: {p.name}, sm_{p.compute_capability[0]}{p.compute_capability[1]}, {p.sm_count} SMs, "
                  f"{p.smem_per_block_optin} B smem/block, L2 {p.l2_bytes >> 20} MiB (compiles for {p.arch})")
        v = driver.driver_version()
        print(f"driver: CUDA {v // 1000}.{v % 1000 // 10}")
    else:
        print(f"device: no CUDA device ({driver._init()})")
        print("driver: none")
    print("NVRTC: %d.%d" % compiler.nvrtc_version())
    n, size = compiler.cache_size()
    print(f"cache: {compiler.cache_dir()} ({n} entries, {size / 1e6:.1f} MB)")
    print(f"kernel sources: {compiler.ptx_dir()}")
    return 0


def report_problems(c, dynamic_smem: int = 0) -> list[str]:
    """What the compile report says is wrong with a variant (empty when it is clean)."""
    r = c.report
    problems = []
    if r.spill_stores or r.spill_loads:
        problems.append(f"spills ({r.spill_stores} B stores, {r.spill_loads} B loads)")
    if r.stack_bytes:
        problems.append(f"local memory ({r.stack_bytes} B stack frame)")
    if r.static_smem + dynamic_smem > SMEM_LIMIT:
        problems.append(f"smem {r.static_smem + dynamic_smem} B > {SMEM_LIMIT} B")
    if r.wgmma_serialized:
        problems.append("ptxas serialized the wgmma (C7514/C7517/C7520: each one waits for the previous)")
    return problems


def compile_all(ops, arch: str):
    """Compile every variant of `ops`; yields (op, compiled, dynamic_smem)."""
    for op in ops:
        for v in VARIANTS[op]():
            source, entry, defines = v[:3]
            dyn = v[3] if len(v) > 3 else 0
            yield op, compiler.compile_kernel(source, entry, defines, arch), dyn


def cmd_compile(args) -> int:
    arch = args.arch or driver.target_arch()
    ops = args.op or list(VARIANTS)
    print(f"compiling for {arch} into {compiler.cache_dir()}")
    hdr = f"{'op':6} {'kernel':22} {'config':40} {'regs':>4} {'spills':>7} {'stack':>5} {'smem':>7} {'secs':>6}  status"
    print(hdr)
    bad = 0
    for op, c, dyn in compile_all(ops, arch):
        cfg = ",".join(f"{k}={v}" for k, v in c.defines)
        problems = report_problems(c, dyn)
        bad += bool(problems)
        r = c.report
        status = "; ".join(problems) or ("ok (cached)" if c.from_disk else "ok")
        spills = r.spill_stores + r.spill_loads if r.spills_known else "-"
        print(f"{op:6} {c.entry:22} {cfg:40} {r.registers:>4} {spills:>7} "
              f"{r.stack_bytes:>5} {r.static_smem + dyn:>7} {c.seconds:>6.2f}  {status}")
    return 1 if bad else 0


def cmd_selftest(args) -> int:
    if not driver.gpu_available():
        print(f"selftest: no CUDA device ({driver._init()}); checking that every kernel compiles instead.\n")
        args.op, args.arch = None, None
        return cmd_compile(args)
    from . import selftest

    return 0 if selftest.run() else 1


def cmd_bench(args) -> int:
    if not driver.gpu_available():
        print(f"bench: needs a CUDA device ({driver._init()})", file=sys.stderr)
        return 2
    from . import bench

    bench.run(args.op or list(bench.BENCHES), args.json, args.quick)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="cudart-kernels", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log compiles (INFO)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="package, device, driver, NVRTC and cache")
    c = sub.add_parser("compile", help="compile (or take from cache) every kernel variant; print the compile report")
    c.add_argument("--op", action="append", choices=sorted(VARIANTS))
    c.add_argument("--arch", help="target arch (default: the device's, or sm_90a without a GPU)")
    sub.add_parser("selftest", help="run each op against a reference (compile only without a GPU)")
    b = sub.add_parser("bench", help="benchmarks against same-run peers (protocol: docs/tuning.md)")
    b.add_argument("--op", action="append", choices=["quant", "gemm", "gemm_fp8", "gemm_fp8_grouped", "host", "attention", "attention_bwd"])
    b.add_argument("--json", help="write the rows to this JSON file")
    b.add_argument("--quick", action="store_true", help="fewer shapes")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    return {"info": cmd_info, "compile": cmd_compile, "selftest": cmd_selftest, "bench": cmd_bench}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
