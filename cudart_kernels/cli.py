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
                  f"{p.smem_per_block_optin} B smem/block, L2 {p.l2_bytes >> 20} MiB, SM clock {p.sm_clock_khz // 1000} "
                  f"MHz, DRAM {p.dram_bytes_per_s / 1e9:.0f} GB/s peak, copy {p.stream_bytes_per_s / 1e9:.0f} GB/s"
                  f" (compiles for {p.arch})")
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


SUPPORTED_ARCHS = ("sm_90a",)  # the kernels use wgmma, setmaxnreg and TMA: Hopper's sm_90a features
NO_GPU_EXIT = 3  # `selftest` without a GPU: the kernels compiled, nothing ran


def cmd_compile(args) -> int:
    arch = args.arch or driver.target_arch()
    if arch not in SUPPORTED_ARCHS:
        print(f"compile: these kernels need {' or '.join(SUPPORTED_ARCHS)} (Hopper), not {arch}", file=sys.stderr)
        return 2
    ops = args.op or list(VARIANTS)
    variants = [(op, v) for op in ops for v in VARIANTS[op]()]
    print(f"compiling {len(variants)} kernel variants for {arch} into {compiler.cache_dir()}")
    w_op = max(len(op) for op, _ in variants)
    w_entry = max(len(v[1]) for _, v in variants)
    count = f"[{len(variants)}/{len(variants)}]"
    print(f"{'':{len(count)}} {'op':{w_op}} {'kernel':{w_entry}} {'regs':>4} {'spills':>6} {'stack':>5} {'smem':>6} "
          f"{'secs':>5}  {'status':11} config")
    bad = cached = 0
    for i, (op, c, dyn) in enumerate(compile_all(ops, arch), 1):
        cfg = ",".join(f"{k}={v}" for k, v in c.defines)
        problems = report_problems(c, dyn)
        bad += bool(problems)
        cached += c.from_disk
        r = c.report
        status = "; ".join(problems) or ("cached" if c.from_disk else "ok")
        spills = r.spill_stores + r.spill_loads if r.spills_known else "-"
        print(f"{f'[{i}/{len(variants)}]':>{len(count)}} {op:{w_op}} {c.entry:{w_entry}} {r.registers:>4} {spills:>6} "
              f"{r.stack_bytes:>5} {r.static_smem + dyn:>6} {c.seconds:>5.2f}  {status:11} {cfg}")
    print(f"{len(variants)} variants: {len(variants) - bad} clean ({cached} from the cache), {bad} with problems")
    return 1 if bad else 0


def cmd_selftest(args) -> int:
    if not driver.gpu_available():
        print(f"selftest: no CUDA device ({driver._init()}): nothing can run here, so only the compiles are checked. "
              f"Exit status {NO_GPU_EXIT} means they are all clean.\n")
        args.op, args.arch = None, None
        rc = cmd_compile(args)
        return NO_GPU_EXIT if rc == 0 else rc
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
    p.add_argument("--version", action="version", version=f"cudart-kernels {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log compiles (INFO)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="package, device, driver, NVRTC and cache")
    c = sub.add_parser("compile", help="compile (or take from cache) every kernel variant; print the compile report")
    c.add_argument("--op", action="append", choices=sorted(VARIANTS))
    c.add_argument("--arch", help="target arch: sm_90a (the default, also without a GPU)")
    sub.add_parser("selftest", help=f"run each op against a reference (without a GPU: compile only, exit status "
                                    f"{NO_GPU_EXIT} when clean)")
    b = sub.add_parser("bench", help="benchmarks against same-run peers (protocol: docs/tuning.md)")
    b.add_argument("--op", action="append", choices=["quant", "gemm", "gemm_fp8", "gemm_fp8_grouped", "host", "attention", "attention_bwd"])
    b.add_argument("--json", help="write the rows to this JSON file")
    b.add_argument("--quick", action="store_true", help="fewer shapes")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    return {"info": cmd_info, "compile": cmd_compile, "selftest": cmd_selftest, "bench": cmd_bench}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
