"""NVRTC compiles every kernel variant the library can pick, and the compile report is clean (runs on CPU)."""
import functools
import time

import pytest

from cudart_kernels.cli import SMEM_LIMIT, compile_all, report_problems
from cudart_kernels.ops import VARIANTS
from cudart_kernels.runtime.compiler import CompileError, CompileReport, compile_kernel

ALL = [(op, v) for op in VARIANTS for v in VARIANTS[op]()]


@functools.lru_cache(maxsize=None)
def _sass_of(source: str, entry: str, defines: tuple) -> str:
    from cudart_kernels.runtime.cubin import sass

    return sass(compile_kernel(source, entry, dict(defines), "sm_90a").cubin)


def variant_sass(variant) -> str:
    """A variant's SASS, disassembled once for all the tests that read it."""
    return _sass_of(variant[0], variant[1], tuple(sorted(variant[2].items())))


@pytest.mark.parametrize("op,variant", ALL, ids=[f"{op}-{v[1]}-{v[2]}" for op, v in ALL])
def test_variant_compiles_clean(op, variant):
    c = compile_kernel(variant[0], variant[1], variant[2], "sm_90a")
    assert len(c.cubin) > 1000 and c.cubin[:4] == b"\x7fELF"
    r = c.report
    assert r.registers > 0, r.log
    assert r.spill_stores == 0 and r.spill_loads == 0, r.log  # 0 also when the log is absent: see stack_bytes
    assert r.stack_bytes == 0, r.log
    dyn = variant[3] if len(variant) > 3 else 0
    assert r.static_smem + dyn <= SMEM_LIMIT
    assert report_problems(c, dyn) == []


def test_report_parse_picks_the_entry():
    log = """ptxas info    : Compiling entry function 'other' for 'sm_90a'
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 200 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'mine' for 'sm_90a'
ptxas info    : Function properties for mine
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 64 bytes smem
"""
    r = CompileReport.parse(log, "mine")
    assert (r.registers, r.spill_stores, r.stack_bytes, r.static_smem, r.spills_known) == (40, 0, 0, 64, True)
    r = CompileReport.parse(log, "other")
    assert (r.registers, r.spill_stores, r.spill_loads, r.stack_bytes, r.static_smem) == (200, 8, 4, 16, 1024)
    assert not CompileReport.parse("", "mine").spills_known
    serial = "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to x"
    assert CompileReport.parse(log + serial, "mine").wgmma_serialized
    assert not CompileReport.parse(log, "mine").wgmma_serialized


def test_cubin_resources_match_ptxas():
    """The ELF reader agrees with ptxas on registers, stack frame and static smem (what the report relies on
    when NVRTC's driver-side cache leaves the log empty)."""
    from cudart_kernels.runtime.compiler import _nvrtc_compile
    from cudart_kernels.runtime.cubin import resources

    # A constant unique to this run: with a driver present, NVRTC reuses the driver's compute cache for PTX it
    # has seen (a second gpu_check on the same machine) and ptxas then writes no log to compare with.
    nonce = f"{time.time_ns() % 1000003}.0f"
    src = r'''
    extern "C" __global__ void smemk(float* p) { __shared__ float s[1000]; s[threadIdx.x] = p[threadIdx.x];
      __syncthreads(); p[threadIdx.x] = s[999 - threadIdx.x] + NONCE; }
    extern "C" __global__ void stacky(float* p, int j) { float a[1024];
      for (int i = 0; i < 1024; ++i) a[(i * j) & 1023] = p[i]; p[0] = a[j & 1023] + NONCE; }
    '''.replace("NONCE", nonce)
    cubin, log = _nvrtc_compile(src, "t.cu", ["-arch=sm_90a", "--ptxas-options=-v"])
    for entry in ("smemk", "stacky"):
        from_log = CompileReport.parse(log, entry)
        assert resources(cubin, entry) == {"registers": from_log.registers, "stack_bytes": from_log.stack_bytes,
                                           "static_smem": from_log.static_smem}
    assert resources(cubin, "smemk")["static_smem"] == 4000
    assert resources(cubin, "stacky")["stack_bytes"] > 0


def test_problems_are_reported():
    c = compile_kernel("quantize.cu", "quantize_per_token", {"IN_KIND": "KIND_BF16"}, "sm_90a")
    assert report_problems(c, SMEM_LIMIT + 1) == [f"smem {SMEM_LIMIT + 1} B > {SMEM_LIMIT} B"]


def test_compile_error_is_clear():
    with pytest.raises(CompileError, match="NVRTC failed"):
        compile_kernel("quantize.cu", "quantize_per_token", {"IN_KIND": "not_a_kind("}, "sm_90a")


def test_compile_all_covers_every_op():
    seen = {op for op, _, _ in compile_all(list(VARIANTS), "sm_90a")}
    assert seen == set(VARIANTS)


def test_compile_leaves_interpreter_bytes_intact():
    """An empty NVRTC log has size 1; writing it into `b" " * 1` (CPython's shared one-byte object) once turned
    every later space in the process into NUL and broke `import torch`."""
    from cudart_kernels.runtime.compiler import _nvrtc_compile

    cubin, log = _nvrtc_compile('extern "C" __global__ void k(int* p) { *p = 1; }', "k.cu", ["-arch=sm_90a"])
    assert cubin[:4] == b"\x7fELF" and log == ""
    assert b" " * 1 == bytes([32]) and " ".encode() == b"\x20"


def test_smem_stages_budget():
    from cudart_kernels.runtime.driver import H100, smem_stages

    assert H100.smem_per_block_optin == 232448
    assert smem_stages(32768, 1024, H100.smem_per_block_optin) == 7
    assert smem_stages(32768, 1024, H100.smem_per_block_optin, max_stages=4) == 4
    assert smem_stages(300000, 0, H100.smem_per_block_optin) == 0
    with pytest.raises(ValueError):
        smem_stages(0, 0, 1000)


GEMM = [v for v in VARIANTS["gemm"]() if v[1] == "gemm_kernel"]
DECODE = [v for v in VARIANTS["gemm"]() if v[1] == "gemm_decode_kernel"]


@pytest.mark.parametrize("variant", GEMM, ids=[str(v[2]) for v in GEMM])
def test_gemm_sass_uses_tensor_cores(variant):
    """The main GEMM kernel runs on wgmma (HGMMA in SASS) and touches no local memory (no LDL/STL)."""
    import re

    text = variant_sass(variant)
    bn = variant[2]["BN"]
    assert re.search(rf"HGMMA\.64x{bn}x16\.F32\.BF16", text), "no HGMMA of the configured shape"
    assert not re.search(r"\b(LDL|STL)\b", text), "local memory in SASS"
    assert "UTMALDG" in text  # TMA loads
    assert ("UTMAREDG" if variant[2]["EPI"] != "EPI_STORE" else "UTMASTG") in text  # TMA reduce-add or store
    # B with an evict-first L2 policy: a cache-policy operand on its loads
    assert bool(re.search(r"UTMALDG\.2D[^;]*desc\[", text)) == bool(variant[2].get("STREAM_B"))
    # L2_WARM: B's first k block prefetched into L2 (one box, or one per 64-column panel of B as [K, N])
    assert bool(re.search(r"UTMAPF\.L2\.2D", text)) == bool(variant[2].get("L2_WARM"))


@pytest.mark.parametrize("variant", DECODE, ids=[str(v[2]) for v in DECODE])
def test_decode_gemm_sass_uses_mma(variant):
    """The decode GEMM runs on mma.sync (HMMA 16816, fp32 accumulation), loads B with 128-bit loads, and touches
    no local memory."""
    import re

    assert DECODE, "variants() lists a decode kernel"
    text = variant_sass(variant)
    assert re.search(r"HMMA\.16816\.F32\.BF16", text), "no bf16 HMMA m16n8k16"
    assert re.search(r"LDG\.E\S*\.128", text), "no 16-byte global loads"
    assert not re.search(r"\b(LDL|STL)\b", text), "local memory in SASS"


FP8 = [v for v in VARIANTS["gemm_fp8"]() if v[1] == "gemm_fp8_kernel"]


@pytest.mark.parametrize("variant", FP8, ids=[str(v[2]) for v in FP8])
def test_fp8_gemm_sass_uses_fp8_tensor_cores(variant):
    """The FP8 GEMM runs on FP8 wgmma (QGMMA e4m3) of its configured shape, with TMA, and no local memory."""
    import re

    text = variant_sass(variant)
    bn = variant[2]["BN"]
    wgrad = variant[2].get("LAYOUT") == "LAYOUT_KGROUPED"
    # wider tiles run as two halves (A from registers), and so do 144..192 columns of up to 128 rows (halves in flight)
    halves = bn > 192 or (bn > 128 and variant[2]["BM"] <= 128 and not wgrad)
    wgmma_n = bn // 2 if halves else bn
    assert re.search(rf"QGMMA\.64x{wgmma_n}x32\.F32\.E4M3\.E4M3 R\d+, (R\d+|gdesc)", text), \
        "no QGMMA of the configured shape"
    assert not re.search(r"\b(LDL|STL)\b", text), "local memory in SASS"
    assert "UTMALDG" in text
    assert bool(re.search(r"UTMALDG\.2D[^;]*desc\[", text)) == bool(variant[2].get("STREAM_B"))
    assert bool(re.search(r"UTMAPF\.L2\.2D", text)) == bool(variant[2].get("L2_WARM"))  # B's first k block to L2
    if bn <= 192 and variant[2]["BM"] <= 128 and not wgrad:
        # two scratch sets: a k block's (or half's) wgmma group is waited for while the next one is in flight
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in text
    if variant[2].get("KSPLIT", 1) > 1:  # split-K: partials summed from the cluster's shared memory, direct stores
        assert "STG.E.64" in text and "UTMASTG" not in text
    else:
        assert ("UTMAREDG" if variant[2].get("LAYOUT") == "LAYOUT_KGROUPED" else "UTMASTG") in text  # D += via TMA


# Unpaired contiguous GEMMs reading a tile list: ptxas hoisted an __ldg of the list's count above
# griddepcontrol.wait there (the tests force these tiles; the picks take the 192-row one).
TILE_LIST = [("gemm_fp8.cu", "gemm_fp8_kernel", {"BM": bm, "BN": 128, "STAGES": 3, "LAYOUT": "LAYOUT_CONTIGUOUS",
                                                  "TILE_LIST": 1}) for bm in (128, 192, 256)]
PDL_WAITS = ALL + [("gemm_fp8", v) for v in TILE_LIST]


@pytest.mark.parametrize("op,variant", PDL_WAITS, ids=[f"{op}-{v[1]}-{v[2]}" for op, v in PDL_WAITS])
def test_no_global_load_before_pdl_wait(op, variant):
    """A kernel launched with PDL starts while the previous one still runs: no global load, store or atomic (TMA
    included; L2 prefetches are fine) may come before griddepcontrol.wait (ACQBULK) in its SASS, e.g. a read of
    ids, counts or a tile list that the previous kernel writes."""
    import re

    text = variant_sass(variant)
    head, wait, _ = text.partition("ACQBULK")
    assert wait or variant[2].get("LAYOUT") != "LAYOUT_CONTIGUOUS", "the contiguous GEMM waits for the list kernel"
    if not wait:
        return  # (no PDL wait: nothing to order the loads against)
    early = re.findall(r"\b(?:LDG|LD|STG|ST|ATOMG|ATOM|RED|UTMALDG|UTMASTG|UTMAREDG|UBLKCP|UBLKRED)\b[^;]*;", head)
    assert not early, f"global memory accessed before griddepcontrol.wait: {early[:3]}"
