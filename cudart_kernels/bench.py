"""Benchmark harness (the protocol of docs/tuning.md): CUDA events over many launches after warm-up, median of repeats,
inputs rotated over more than 2x L2 so nothing is served hot from cache, peers timed in the same process.
"""
from __future__ import annotations

import ctypes
import glob
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from cuda.bindings import driver as cu

from .runtime import dtypes as dt
from .runtime.driver import check, device_properties, require_gpu, use_device
from .runtime.interop import DeviceArray


@dataclass
class Row:
    op: str
    case: str
    us: float
    gbytes: float = 0.0   # bytes moved (read + written), in GB
    tflops: float = 0.0   # work, in TFLOP
    peer: str = ""
    peer_us: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.gbytes / (self.us * 1e-6) if self.us else 0.0

    @property
    def tflops_rate(self) -> float:
        return self.tflops / (self.us * 1e-6) if self.us else 0.0

    @property
    def ratio(self) -> float:
        """Peer time over ours: > 1 means we are faster."""
        return self.peer_us / self.us if self.us and self.peer_us else 0.0


def time_us(run, n_sets: int = 1, iters: int = 20, repeats: int = 7, warmup: int = 3, stream: int = 0) -> float:
    """Median over `repeats` of the mean time per call of `run(i)` (i rotates over n_sets input sets)."""
    start = check(cu.cuEventCreate(0))
    end = check(cu.cuEventCreate(0))
    try:
        for i in range(warmup):
            run(i % n_sets)
        check(cu.cuStreamSynchronize(stream))
        samples = []
        k = 0
        for _ in range(repeats):
            check(cu.cuEventRecord(start, stream))
            for _ in range(iters):
                run(k % n_sets)
                k += 1
            check(cu.cuEventRecord(end, stream))
            check(cu.cuEventSynchronize(end))
            samples.append(check(cu.cuEventElapsedTime(start, end)) * 1e3 / iters)
        return statistics.median(samples)
    finally:
        cu.cuEventDestroy(start)
        cu.cuEventDestroy(end)


_graph_stream = None


def graph_time_us(torch, run, n_sets: int = 1, iters: int = 20, repeats: int = 7, warmup: int = 3) -> float:
    """Device time per call of one `run` (see `graph_times_us`)."""
    return graph_times_us(torch, [run], n_sets, iters, repeats, warmup)[0]


def graph_stream(torch):
    """The side stream graphs are captured on (one for the process: our split-K workspace is per stream)."""
    global _graph_stream
    if _graph_stream is None:
        _graph_stream = torch.cuda.Stream()
    return _graph_stream


def graph_times_us(torch, runs, n_sets: int = 1, iters: int = 20, repeats: int = 7, warmup: int = 3) -> list:
    """Device time per call of each `run(i, stream)` in `runs` (i rotating over n_sets; torch work goes to the
    current stream, ours must be given `stream`): `iters` calls captured in one CUDA graph per run on a side
    stream, the median over `repeats` replays. Host launch cost is left out, so a kernel shorter than its Python
    call is timed by the GPU, not by the launch rate (host cost is its own benchmark row).

    The runs take turns, in order on even rounds and reversed on odd ones: at the 700 W power cap the clock falls
    while the board heats, so whatever is timed first on a cool board gains (H100, bench order peer then ours
    against ours then peer: 5-20% on the M = 4096 GEMMs)."""
    stream = graph_stream(torch)
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were just made on the current stream
    graphs = []
    for run in runs:
        with torch.cuda.stream(stream):
            for i in range(warmup):
                run(i % n_sets, stream)  # compiles, allocates workspaces: nothing may allocate inside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(iters):
                run(i % n_sets, stream)
        graph.replay()
        torch.cuda.synchronize()
        graphs.append(graph)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = [[] for _ in runs]
    for r in range(repeats):
        order = range(len(runs)) if r % 2 == 0 else reversed(range(len(runs)))
        for j in order:
            start.record()
            graphs[j].replay()
            end.record()
            end.synchronize()
            samples[j].append(start.elapsed_time(end) * 1e3 / iters)
    del graphs
    return [statistics.median(x) for x in samples]


def sets_beyond_l2(bytes_per_set: int, device: int = 0, cap: int = 64) -> int:
    """How many input sets together exceed 2x L2."""
    l2 = device_properties(device).l2_bytes
    return max(1, min(cap, -(-2 * l2 // max(1, bytes_per_set)) + 1))


def copy_bandwidth_row(nbytes: int = 1 << 30, device: int = 0) -> Row:
    """Device-to-device copy: the memory roofline the memory-bound kernels are judged against."""
    src = DeviceArray.empty((nbytes,), "e4m3", device).fill_bytes(0x5A)
    dst = DeviceArray.empty((nbytes,), "e4m3", device)
    us = time_us(lambda i: check(cu.cuMemcpyDtoDAsync(dst.ptr, src.ptr, nbytes, 0)), iters=10)
    return Row("copy", f"{nbytes >> 20} MiB D2D", us, gbytes=2 * nbytes / 1e9)


def host_overhead_us(call, n: int = 200, batches: int = 60) -> float:
    """Median over batches of the mean wall time of one Python call (to launch return), cached config."""
    for _ in range(200):
        call()
    per = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        per.append((time.perf_counter() - t0) / n * 1e6)
        check(cu.cuCtxSynchronize())
    return statistics.median(per)


def torch_or_none():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def markdown(rows: list[Row], copy_gbps: float) -> str:
    def cell(v, fmt):
        return format(v, fmt) if v else ""

    # DeepGEMM, the FP8 GEMMs' second peer: its columns only where a row has it (its ratio is ours / DeepGEMM in
    # time, < 1: ours faster; MISMATCH: its output differed from ours, so its time is not a comparison)
    dg = any(r.extra.get("deepgemm_us") for r in rows)
    lines = ["| op | case | time (us) | GB/s | % copy BW | TFLOP/s | peer | peer (us) | peer/ours |"
             + (" DeepGEMM (us) | DeepGEMM TFLOP/s | ours/DeepGEMM time |" if dg else ""),
             "|---|---|---:|---:|---:|---:|---|---:|---:|" + ("---:|---:|---:|" if dg else "")]
    for r in rows:
        pct = f"{100 * r.gbps / copy_gbps:.0f}%" if r.gbytes and copy_gbps else ""
        line = (f"| {r.op} | {r.case} | {r.us:.1f} | {cell(r.gbps, '.0f')} | {pct} | {cell(r.tflops_rate, '.1f')} "
                f"| {r.peer} | {cell(r.peer_us, '.1f')} | {cell(r.ratio, '.2f')} |")
        if dg:
            x = r.extra
            flag = " MISMATCH" if x.get("deepgemm_us") and not x.get("deepgemm_agrees") else ""
            line += (f" {cell(x.get('deepgemm_us'), '.1f')} | {cell(x.get('deepgemm_tflops'), '.1f')} "
                     f"| {cell(x.get('ours_over_deepgemm'), '.3f')}{flag} |")
        lines.append(line)
    return "\n".join(lines)


def run(ops: list[str], json_path: str | None = None, quick: bool = False, device: int = 0) -> list[Row]:
    require_gpu()
    use_device(device)
    props = device_properties(device)
    copy = copy_bandwidth_row(device=device)
    rows = [copy]
    for op in ops:
        rows += BENCHES[op](quick=quick, device=device)
    table = markdown(rows, copy.gbps)
    print(f"device: {props.name}, {props.sm_count} SMs, L2 {props.l2_bytes >> 20} MiB; "
          f"copy bandwidth {copy.gbps:.0f} GB/s (read + write)\n")
    print(table)
    if json_path:
        with open(json_path, "w") as f:
            body = {"device": props.name, "copy_gbps": copy.gbps,
                    "rows": [dict(asdict(r), gbps=r.gbps, tflops_rate=r.tflops_rate, ratio=r.ratio) for r in rows]}
            if _dg_state:  # an FP8 bench looked for DeepGEMM: which one ran, or why none
                body["deepgemm"] = deepgemm_summary()
            json.dump(body, f, indent=1)
    return rows


# ---- per-op benchmark sets --------------------------------------------------------------------------------------

def _torch_quant(torch, x, block_rows: int):
    """DeepGEMM's quantization recipe in eager torch (context row; K a multiple of 128)."""
    m, k = x.shape
    if block_rows == 1:
        v = x.view(m, k // 128, 128).float()
        amax = v.abs().amax(-1, keepdim=True).clamp(1e-4)
    else:
        v = x.view(m // 128, 128, k // 128, 128).float()
        amax = v.abs().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    return (v * (448.0 / amax)).to(torch.float8_e4m3fn).view(m, k), amax / 448.0


def bench_quant(quick: bool = False, device: int = 0) -> list[Row]:
    from .ops.quantize import quantize_fp8_per_block, quantize_fp8_per_token

    torch = torch_or_none()
    rng = np.random.default_rng(0)
    token_cases = [((4096, 7168), "bf16"), ((16384, 7168), "bf16"), ((8192, 7168), "fp32")]
    block_cases = [((7168, 16384), "bf16"), ((24576, 1536), "bf16"), ((7168, 16384), "fp32")]
    if quick:
        token_cases, block_cases = token_cases[1:2], block_cases[:1]
    rows = []
    for kind, cases, fn in (("per_token", token_cases, quantize_fp8_per_token),
                            ("per_block", block_cases, quantize_fp8_per_block)):
        for (m, k), name in cases:
            dtype = dt.as_dtype(name)
            g_rows = 1 if kind == "per_token" else 128
            nbytes = m * k * (dtype.itemsize + 1) + 4 * (-(-m // g_rows)) * (-(-k // 128))
            n = sets_beyond_l2(nbytes, device)
            host = rng.standard_normal((m, k), dtype=np.float32).astype(dtype.numpy)
            xs = [DeviceArray.from_numpy(host, device=device) for _ in range(n)]
            outs = [fn(x) for x in xs]  # also warms the compile cache
            us = time_us(lambda i: fn(xs[i], out=outs[i][0], out_scales=outs[i][1]), n)
            row = Row(f"quant_{kind}", f"{m}x{k} {name}", us, gbytes=nbytes / 1e9, extra={"sets": n})
            if torch is not None:
                ts = [torch.from_dlpack(x) for x in xs]
                row.peer = "torch eager recipe"
                row.peer_us = time_us(lambda i: _torch_quant(torch, ts[i], g_rows), n)
            rows.append(row)
            xs = outs = None  # free this shape's buffers before the next
    # Host overhead: Python call to launch return, cached config, preallocated outputs.
    x = DeviceArray.from_numpy(rng.standard_normal((128, 7168), dtype=np.float32), "bf16", device)
    q, s = quantize_fp8_per_token(x)
    us = host_overhead_us(lambda: quantize_fp8_per_token(x, out=q, out_scales=s))
    rows.append(Row("host", "quantize_fp8_per_token call, DeviceArray in/out", us))
    if torch is not None:
        tx, tq, ts_ = (torch.from_dlpack(a) for a in (x, q, s))
        us = host_overhead_us(lambda: quantize_fp8_per_token(tx, out=tq, out_scales=ts_))
        rows.append(Row("host", "quantize_fp8_per_token call, torch in/out", us))
        w = torch.randn(128, 7168, device="cuda", dtype=torch.bfloat16)
        rows.append(Row("host", "torch.matmul call (128x7168 @ 7168x128, bf16), reference",
                        host_overhead_us(lambda: torch.matmul(w, w.t()))))
    return rows


def _torch_addmm_fp32(torch):
    """torch's D(fp32) += A @ B^T for bf16 A, B: addmm with out_dtype where torch has it, else in fp32."""
    def with_out_dtype(d, a, b):
        return torch.addmm(d, a, b.t(), out_dtype=torch.float32, out=d)

    def upcast(d, a, b):
        return d.addmm_(a.float(), b.float().t())

    try:
        x = torch.zeros(16, 16, device="cuda", dtype=torch.float32)
        y = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        with_out_dtype(x, y, y)
        return with_out_dtype, "torch.addmm(out_dtype=fp32)"
    except Exception:
        return upcast, "torch addmm_ in fp32 (upcast inputs)"


def bench_gemm(quick: bool = False, device: int = 0) -> list[Row]:
    """Large and skinny sets against cuBLAS (torch.matmul) in the same run, both timed as CUDA-graph replays
    (device time); skinny also with split-K off; D(fp32) += A @ B^T against torch's addmm; host-overhead rows."""
    from .ops.gemm import BENCH_SHAPES, gemm

    torch = torch_or_none()
    if torch is None:
        raise RuntimeError("bench --op gemm needs torch for the cuBLAS peer")
    rows = []
    sets_of = {"large": BENCH_SHAPES["large"], "skinny": BENCH_SHAPES["skinny"]}
    if quick:
        sets_of = {"large": [(8192, 8192, 8192)], "skinny": [(128, 128, 65536)]}
    for name, shapes in sets_of.items():
        for m, n, k in shapes:
            nbytes = (m * k + n * k + m * n) * 2
            sets = sets_beyond_l2(nbytes, device, cap=16)
            a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
            b = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
            d = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
            iters = max(3, min(50, int(2e5 // max(1.0, 2 * m * n * k / 700e6))))
            runs = [lambda i, s: torch.matmul(a[i], b[i].t(), out=d[i]),
                    lambda i, s: gemm(a[i], b[i], out=d[i], stream=s)]
            if name == "skinny":
                runs.append(lambda i, s: gemm(a[i], b[i], out=d[i], split_k=1, stream=s))
            peer, ours, *off = graph_times_us(torch, runs, sets, iters=iters)
            rows.append(Row(f"gemm_{name}", f"{m}x{n}x{k} bf16", ours, gbytes=nbytes / 1e9,
                            tflops=2 * m * n * k / 1e12, peer="cuBLAS", peer_us=peer))
            if off:
                rows.append(Row("gemm_skinny_nosplit", f"{m}x{n}x{k} bf16, split_k=1", off[0], gbytes=nbytes / 1e9,
                                tflops=2 * m * n * k / 1e12, peer="cuBLAS", peer_us=peer,
                                extra={"split_speedup": off[0] / ours}))
            a = b = d = None
    if not quick:
        m, n, k = 4096, 4096, 7168
        fn, label = _torch_addmm_fp32(torch)
        sets = sets_beyond_l2((m * k + n * k) * 2 + m * n * 4, device, cap=16)
        a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        b = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        d = [torch.randn(m, n, device="cuda", dtype=torch.float32) for _ in range(sets)]
        peer, ours = graph_times_us(torch, [lambda i, s: fn(d[i], a[i], b[i]),
                                            lambda i, s: gemm(a[i], b[i], out=d[i], c=d[i], stream=s)], sets, iters=10)
        rows.append(Row("gemm_accumulate", f"{m}x{n}x{k}, D(fp32) += A @ B^T", ours, tflops=2 * m * n * k / 1e12,
                        peer=label, peer_us=peer))
    return rows


def bench_host(quick: bool = False, device: int = 0) -> list[Row]:
    """Host cost of one call with a cached plan (Python call to launch return), 16x64x64 bf16 and fp8, for each way
    of passing arrays and streams, with and without `out=` (without: the result is a torch tensor from torch's
    caching allocator), beside torch.matmul(out=) and torch._scaled_mm in the same run."""
    from .ops.gemm import gemm
    from .ops.gemm_fp8 import gemm_fp8
    from .ops.quantize import quantize_fp8_per_block, quantize_fp8_per_token
    from .runtime.interop import as_array

    torch = torch_or_none()
    if torch is None:
        raise RuntimeError("bench --op host needs torch")
    m, n, k = 16, 64, 64
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    z = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.current_stream()
    handle = stream.cuda_stream
    dx, dy, dz = as_array(x), as_array(y), as_array(z)
    ta, tsa = quantize_fp8_per_token(torch.randn(m, 128, device="cuda", dtype=torch.bfloat16))  # torch tensors
    tb, tsb = quantize_fp8_per_block(torch.randn(n, 128, device="cuda", dtype=torch.bfloat16))
    qa, sa, qb, sb = (as_array(v) for v in (ta, tsa, tb, tsb))
    tz = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    dz8 = as_array(tz)
    sa_t, sb_t = tsa.t().contiguous().t(), tsb.t()  # torch._scaled_mm's blockwise scale layouts
    cases = [
        ("torch.matmul(out=), torch", lambda: torch.matmul(x, y.t(), out=z)),
        ("torch.matmul (allocating), torch", lambda: torch.matmul(x, y.t())),
        ("gemm, torch, stream=None", lambda: gemm(x, y, out=z)),
        ("gemm, torch, torch stream object", lambda: gemm(x, y, out=z, stream=stream)),
        ("gemm, torch, int stream handle", lambda: gemm(x, y, out=z, stream=handle)),
        ("gemm, DeviceArray, int stream handle", lambda: gemm(dx, dy, out=dz, stream=handle)),
        ("gemm, torch, stream=None, no out= (torch result)", lambda: gemm(x, y)),
        ("gemm_fp8, torch, stream=None", lambda: gemm_fp8(ta, tsa, tb, tsb, tz)),
        ("gemm_fp8, torch, torch stream object", lambda: gemm_fp8(ta, tsa, tb, tsb, tz, stream=stream)),
        ("gemm_fp8, torch, int stream handle", lambda: gemm_fp8(ta, tsa, tb, tsb, tz, stream=handle)),
        ("gemm_fp8, DeviceArray, int stream handle", lambda: gemm_fp8(qa, sa, qb, sb, dz8, stream=handle)),
        ("gemm_fp8, torch, stream=None, no out= (torch result)", lambda: gemm_fp8(ta, tsa, tb, tsb)),
        ("quantize_fp8_per_token, torch, stream=None, no out= (torch results)", lambda: quantize_fp8_per_token(x)),
    ]
    try:
        torch._scaled_mm(ta, tb.t(), scale_a=sa_t, scale_b=sb_t, out_dtype=torch.bfloat16)
        cases.append(("torch._scaled_mm (blockwise), torch",
                      lambda: torch._scaled_mm(ta, tb.t(), scale_a=sa_t, scale_b=sb_t, out_dtype=torch.bfloat16)))
    except Exception:  # a torch build without blockwise scaling
        pass
    rounds = 1 if quick else 3
    rows = []
    for name, call in cases:
        times = [host_overhead_us(call) for _ in range(rounds)]
        rows.append(Row("host", f"{name}, {m}x{n}x{k}", statistics.median(times),
                        extra={"rounds_us": [round(t, 2) for t in times]}))
    return rows


# ---- DeepGEMM: the FP8 GEMMs' same-run peer ----------------------------------------------------------------------
#
# Where `import deep_gemm` works (DeepGEMM itself, e.g. sgl-deep-gemm 0.1.5.post1: scripts/bench_deepgemm.py installs
# it on the GPU machine), `bench --op gemm_fp8` and `--op gemm_fp8_grouped` time it on the same shapes and the same
# inputs as ours (our quantizer's outputs, in the layouts DeepGEMM reads in place), in the same alternating graph
# rounds, after checking that its output matches ours; cuBLAS stays the first peer. Its JIT compiles each kernel
# shape with nvcc on first use (3-8 s): worker processes compile all of an op's shapes first, in parallel, outside
# any timed region. Where it does not import, one line says why and the rows are as without it.

DG_AGREE = 1e-2  # ours against DeepGEMM: relative (Frobenius) difference allowed; both round to bf16
# MoE prefill with uneven groups (as routing gives them), each padded with -1 rows to the 128-row alignment:
# (rows per group, N, K)
CONTIGUOUS_UNEVEN = [((7000, 9100, 8192, 6450), 4096, 7168)]
# DeepGEMM's FP8 calls, by the names its builds give them (sgl-deep-gemm 0.1.5.post1 calls the masked GEMM
# fp8_m_grouped_gemm_nt_masked; m_grouped_fp8_gemm_nt_masked is DeepGEMM's own name for it)
DG_CALLS = {"normal": ("fp8_gemm_nt",), "contiguous": ("m_grouped_fp8_gemm_nt_contiguous",),
            "masked": ("fp8_m_grouped_gemm_nt_masked", "m_grouped_fp8_gemm_nt_masked"),
            "wgrad": ("k_grouped_fp8_gemm_nt_contiguous",)}
_dg_state: dict = {}  # "peer": the DeepGemmPeer or None, "skipped": why none, "missing": calls reported absent


def _first_line(e: BaseException, n: int = 200) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else "")[:n]


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class DeepGemmPeer:
    """DeepGEMM's SM90 FP8 GEMMs, called with our inputs in the layouts DeepGEMM reads without a copy: sA one fp32
    scale per 1x128 group of a row, M-major with the column stride M rounded up to 4 (our quantizer's default
    layout: one tensor feeds both libraries), sB one per 128x128 block, row-major; the masked GEMM's sA M-major per
    group (`dg_masked_scales`); the K-grouped GEMM's operands each group's [rows, k_g] block after the previous
    group's (`dg_k_grouped_operand`). Everything runs on torch's current stream, as DeepGEMM does."""

    def __init__(self, mod):
        self.mod = mod
        self.version = str(getattr(mod, "__version__", "?"))
        self.names, self.fns = {}, {}
        for kind, names in DG_CALLS.items():
            name = next((n for n in names if callable(getattr(mod, n, None))), None)
            if name:
                self.names[kind], self.fns[kind] = name, getattr(mod, name)
        # DeepGEMM's own default for the normal GEMM compiles N and K into the kernel ("nk"); the sgl build's
        # wrapper defaults to "": ask for "nk", as DeepGEMM's users get it.
        fn = self.fns.get("normal")
        self.normal_kw = {"compiled_dims": "nk"} if fn is not None and _accepts(fn, "compiled_dims") else {}
        align = getattr(mod, "get_mk_alignment_for_contiguous_layout", None)
        self.m_align = int(align()) if callable(align) else 128

    def has(self, kind: str) -> bool:
        """Whether this build has the call for `kind`; one printed line the first time it has not."""
        if kind in self.fns:
            return True
        missing = _dg_state.setdefault("missing", [])
        if kind not in missing:
            missing.append(kind)
            print(f"DeepGEMM peer: deep_gemm {self.version} has no {' / '.join(DG_CALLS[kind])}: "
                  f"the {kind} rows are timed without it")
        return False

    def info(self) -> dict:
        return {"version": self.version, "file": str(getattr(self.mod, "__file__", "?")), "calls": dict(self.names),
                "normal_kw": dict(self.normal_kw), "m_alignment": self.m_align}

    def gemm(self, a, sa, b, sb, d):
        """D [M, N] bf16 = (A * sA) @ (B * sB)^T."""
        self.fns["normal"]((a, sa), (b, sb), d, **self.normal_kw)

    def contiguous(self, a, sa, b, sb, m_indices, d):
        """MoE prefill: row m of A times expert m_indices[m]'s weights (-1: a padding row)."""
        self.fns["contiguous"]((a, sa), (b, sb), d, m_indices)

    def masked(self, a, sa, b, sb, masked_m, expected_m: int, d):
        """MoE decode: the first masked_m[g] rows of each group; sa in `dg_masked_scales`' layout."""
        self.fns["masked"]((a, sa), (b, sb), d, masked_m, expected_m)

    def wgrad(self, a, sa, b, sb, d, ks, ks_tensor):
        """MoE weight gradient, D[g] += A_g @ B_g^T in fp32 (c=d, as ours adds to D); operands from
        `dg_k_grouped_operand`."""
        self.fns["wgrad"]((a, sa), (b, sb), d, list(ks), ks_tensor, c=d, recipe=(1, 1, 128))


def _preload_cuda_libs(torch) -> None:
    """deep_gemm's _C.so links libcudart / libnvrtc / libcublas(Lt) of CUDA 13 by soname: load the copies torch
    ships (else the toolkit's) where they are not loaded yet."""
    try:
        with open("/proc/self/maps") as f:
            loaded = f.read()
    except OSError:
        return
    torch_file = getattr(torch, "__file__", None)
    dirs = glob.glob(os.path.join(os.path.dirname(os.path.dirname(torch_file)), "nvidia", "*", "lib")) \
        if torch_file else []
    dirs.append(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64"))
    for lib in ("libcudart.so.13", "libnvrtc.so.13", "libcublasLt.so.13", "libcublas.so.13"):
        for d in dirs if lib not in loaded else ():
            path = os.path.join(d, lib)
            if os.path.exists(path):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    break
                except OSError:
                    pass


def deepgemm_peer(torch):
    """The DeepGEMM peer where `import deep_gemm` works, else None after one printed line saying why (once per
    process). CK_BENCH_DEEPGEMM=0 leaves it out; CK_REQUIRE_DEEPGEMM=1 makes a failed import an error."""
    if "peer" in _dg_state:
        return _dg_state["peer"]
    peer, why = None, None
    if os.environ.get("CK_BENCH_DEEPGEMM", "1") == "0":
        why = "CK_BENCH_DEEPGEMM=0"
    else:
        try:
            _preload_cuda_libs(torch)
            import deep_gemm
            peer = DeepGemmPeer(deep_gemm)
        except Exception as e:  # noqa: BLE001 (whatever stops it loading means: no DeepGEMM peer)
            why = f"import deep_gemm failed ({type(e).__name__}: {_first_line(e)})"
            if os.environ.get("CK_REQUIRE_DEEPGEMM") == "1":
                raise RuntimeError(f"{why}, and CK_REQUIRE_DEEPGEMM=1") from e
    _dg_state.update(peer=peer, skipped=why)
    if peer is None:
        print(f"DeepGEMM peer skipped: {why}; the FP8 rows are timed without it "
              "(scripts/bench_deepgemm.py installs it on the GPU machine)")
    else:
        print(f"DeepGEMM peer: deep_gemm {peer.version} ({', '.join(peer.names.values())})")
    return peer


def deepgemm_summary() -> dict:
    """For the JSON: the DeepGEMM that ran (version, calls) or why none did."""
    peer = _dg_state.get("peer")
    if peer is None:
        return {"skipped": _dg_state.get("skipped")}
    return dict(peer.info(), missing=list(_dg_state.get("missing", [])))


def dg_masked_scales(torch, sa):
    """[G, M, KB] fp32 scales in DeepGEMM's masked layout, each group M-major on its own with the column stride M
    rounded up to 4 (its get_mn_major_tma_aligned_tensor; it copies any other layout on every call): a copy."""
    g, m, kb = sa.shape
    am = -(-m // 4) * 4
    out = torch.empty_strided((g, m, kb), (am * kb, 1, am), device=sa.device, dtype=torch.float32)
    out.copy_(sa)
    return out


def dg_k_grouped_operand(torch, x, sx, ks):
    """Our K-grouped operand, x [R, K] e4m3 (group g: the columns after the previous groups') with sx [R, K/128]
    fp32, as DeepGEMM's SM90 K-grouped GEMM takes it: flat, each group's [R, k_g] block row-major after the
    previous group's (a copy); the scales [R, K/128] M-major with column stride R (as they are when R % 4 == 0)."""
    r = x.shape[0]
    flat = torch.empty(r * sum(ks), device=x.device, dtype=x.dtype)
    start = 0
    for kg in ks:
        if kg:
            flat[start * r:(start + kg) * r].view(r, kg).copy_(x[:, start:start + kg])
        start += kg
    return flat, (sx if tuple(sx.stride()) == (1, r) else sx.t().contiguous().t())


def _rel_err(pairs) -> float:
    """sqrt(sum |x - y|^2 / sum |y|^2) over (x, y) tensor pairs, in fp32 (NaN anywhere gives NaN)."""
    num = den = 0.0
    for x, y in pairs:
        x, y = x.float(), y.float()
        num += float((x - y).norm()) ** 2
        den += float(y.norm()) ** 2
    return math.sqrt(num / den) if den else (0.0 if num == 0 else math.inf)


def _dg_check(torch, label: str, ours, theirs, valid):
    """Before timing: `ours()` and `theirs()` each write their output and return it; `valid(out)` lists the parts
    that hold results. Returns the relative difference, or None (one printed line) where DeepGEMM's call fails;
    a difference over DG_AGREE is printed and flags the row (a wrong peer call, not a comparison)."""
    mine = ours()
    try:
        peer_out = theirs()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (a call DeepGEMM does not take: the row goes on without it)
        print(f"DeepGEMM peer failed on {label}: {type(e).__name__}: {_first_line(e)}; the row is timed without it")
        return None
    err = _rel_err(zip(valid(mine), valid(peer_out)))
    if not err <= DG_AGREE:
        print(f"DeepGEMM peer MISMATCH on {label}: its output differs from ours by {err:.2e} (relative; allowed "
              f"{DG_AGREE:g}): its time is reported flagged")
    return err


def _times_with_dg(torch, runs, dg_run, label: str, n_sets: int = 1, iters: int = 20, peers: int = 0):
    """graph_times_us of `runs` and DeepGEMM's run (where given): (the runs' times, DeepGEMM's or 0.0). `runs[:peers]`
    are other peers (cuBLAS, torch), the rest ours. With DeepGEMM, ours take turns with it alone and the other peers
    get rounds of their own: at the power cap a kernel runs faster after a lighter one, and a third kernel in the
    rounds would precede ours every other turn and DeepGEMM never (graph_times_us reverses the order each round).
    Where DeepGEMM's run fails there, one line, and `runs` are timed again together."""
    if dg_run is not None:
        try:
            *ours, dg_us = graph_times_us(torch, list(runs[peers:]) + [dg_run], n_sets, iters=iters)
        except Exception as e:  # noqa: BLE001
            print(f"DeepGEMM peer failed on {label} in the timed graphs: {type(e).__name__}: {_first_line(e)}; "
                  "timing the row without it")
            torch.cuda.synchronize()
        else:
            return (graph_times_us(torch, list(runs[:peers]), n_sets, iters=iters) if peers else []) + ours, dg_us
    return graph_times_us(torch, list(runs), n_sets, iters=iters), 0.0


def _dg_columns(row: Row, dg_us: float, err, call: str) -> Row:
    """The DeepGEMM columns of a row: its time, TFLOP/s and ours / DeepGEMM in time (< 1: ours faster)."""
    if dg_us:
        row.extra.update(deepgemm_us=dg_us, deepgemm_tflops=row.tflops / (dg_us * 1e-6) if row.tflops else 0.0,
                         ours_over_deepgemm=row.us / dg_us, deepgemm_rel_err=err,
                         deepgemm_agrees=err is not None and err <= DG_AGREE, deepgemm_call=call)
    return row


# -- JIT prewarm: every case's DeepGEMM kernel compiled in worker processes before the op's timing

def _dg_label(case: dict) -> str:
    kind = case["kind"]
    if kind == "normal":
        return f"normal {case['m']}x{case['n']}x{case['k']}"
    if kind == "contiguous":
        return f"contiguous {len(case['rows'])} groups {case['rows']} N={case['n']} K={case['k']}"
    if kind == "masked":
        return (f"masked G={len(case['masked'])} M={case['max_m']} rows {case['masked']} N={case['n']} "
                f"K={case['k']} expected_m={case['expected_m']}")
    return f"wgrad ks {case['ks']} M={case['m']} N={case['n']}"


def _dg_kernel_key(case: dict) -> tuple:
    """Cases that may share a DeepGEMM kernel (N and K compiled in): compiled by one worker, in turn."""
    return (case["kind"], case["m"], case["n"]) if case["kind"] == "wgrad" else (case["kind"], case["n"], case["k"])


def dg_random_call(torch, peer: DeepGemmPeer, case: dict, device="cuda"):
    """DeepGEMM's call for `case` (a dict as `_dg_label` reads it) on random inputs of the case's shapes and the
    layouts the bench passes (DeepGEMM picks and compiles its kernel from those, not from the values): a closure."""
    f8, f32, bf16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16

    def fp8(*shape):
        return torch.randn(*shape, device=device).to(f8)

    def ones_strided(shape, strides):
        return torch.empty_strided(shape, strides, device=device, dtype=f32).fill_(1.0)

    kind, n = case["kind"], case["n"]
    if kind == "wgrad":
        ks, m = list(case["ks"]), case["m"]
        total = sum(ks)
        a, b = fp8(total * m), fp8(total * n)
        sa, sb = ones_strided((m, total // 128), (1, m)), ones_strided((n, total // 128), (1, n))
        d = torch.zeros(len(ks), m, n, device=device, dtype=f32)
        ks_tensor = torch.tensor(ks, device=device, dtype=torch.int32)
        return lambda: peer.wgrad(a, sa, b, sb, d, ks, ks_tensor)
    k = case["k"]
    kb, nb = -(-k // 128), -(-n // 128)
    if kind == "normal":
        m = case["m"]
        a, b = fp8(m, k), fp8(n, k)
        sa, sb = ones_strided((m, kb), (1, -(-m // 4) * 4)), torch.ones(nb, kb, device=device, dtype=f32)
        d = torch.empty(m, n, device=device, dtype=bf16)
        return lambda: peer.gemm(a, sa, b, sb, d)
    if kind == "contiguous":
        ids, starts = _contiguous_ids(case["rows"], peer.m_align)
        m, groups = len(ids), len(case["rows"])
        x = torch.randn(m, k, device=device, dtype=bf16)
        for start, r, end in zip(starts, case["rows"], starts[1:] + [m]):
            x[start + r:end] = 0  # padding rows zero, as DeepGEMM's usage has them
        a, b = x.to(f8), fp8(groups, n, k)
        sa, sb = ones_strided((m, kb), (1, -(-m // 4) * 4)), torch.ones(groups, nb, kb, device=device, dtype=f32)
        m_indices = torch.tensor(ids, device=device, dtype=torch.int32)
        d = torch.empty(m, n, device=device, dtype=bf16)
        return lambda: peer.contiguous(a, sa, b, sb, m_indices, d)
    if kind == "masked":
        groups, max_m = len(case["masked"]), case["max_m"]
        am = -(-max_m // 4) * 4
        a, b = fp8(groups, max_m, k), fp8(groups, n, k)
        sa = ones_strided((groups, max_m, kb), (am * kb, 1, am))
        sb = torch.ones(groups, nb, kb, device=device, dtype=f32)
        masked_m = torch.tensor(case["masked"], device=device, dtype=torch.int32)
        d = torch.empty(groups, max_m, n, device=device, dtype=bf16)
        return lambda: peer.masked(a, sa, b, sb, masked_m, case["expected_m"], d)
    raise ValueError(f"unknown DeepGEMM case kind {kind!r}")


def _contiguous_ids(rows, align: int):
    """The m_indices of groups of `rows` rows, each segment padded with -1 rows to a multiple of `align`; and the
    segments' first rows."""
    ids, starts = [], []
    for g, r in enumerate(rows):
        starts.append(len(ids))
        ids += [g] * r + [-1] * (-r % align)
    return ids, starts


def _dg_prewarm_worker(cases: list) -> None:
    """One prewarm process: each case's DeepGEMM call once (compiling its kernel into DG_JIT_CACHE_DIR); prints
    `ok <case> <s>` or `FAILED <case>: <error>` per case."""
    import torch

    _preload_cuda_libs(torch)
    import deep_gemm

    peer = DeepGemmPeer(deep_gemm)
    for case in cases:
        t0 = time.time()
        try:
            dg_random_call(torch, peer, case)()
            torch.cuda.synchronize()
            print(f"ok {_dg_label(case)} {time.time() - t0:.1f}s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"FAILED {_dg_label(case)}: {type(e).__name__}: {_first_line(e, 300)}", flush=True)
        torch.cuda.empty_cache()


def _dg_worker_argv(cases: list) -> list:
    code = ("import json, sys; from cudart_kernels.bench import _dg_prewarm_worker; "
            "_dg_prewarm_worker(json.loads(sys.argv[1]))")
    return [sys.executable, "-c", code, json.dumps(cases)]


def dg_prewarm(cases: list) -> None:
    """Compile DeepGEMM's kernels for `cases` in parallel worker processes before anything is timed (they share
    its JIT cache, DG_JIT_CACHE_DIR; cases that may share a kernel go to one worker). CK_BENCH_DG_WORKERS sets
    the number of processes (default: the CPU count, at most 8; 0: none, each case compiles at its cross-check
    instead), CK_BENCH_DG_PREWARM_TIMEOUT the seconds they may take (default 400). Failures are printed; a case
    DeepGEMM cannot run then fails its cross-check and is timed without it."""
    workers = int(os.environ.get("CK_BENCH_DG_WORKERS", min(8, os.cpu_count() or 1)))
    if workers <= 0 or not cases:
        return
    groups: dict = {}
    for case in cases:
        groups.setdefault(_dg_kernel_key(case), []).append(case)
    chunks: list = [[] for _ in range(min(workers, len(groups)))]
    for group in sorted(groups.values(), key=len, reverse=True):
        min(chunks, key=len).extend(group)
    t0 = time.time()
    deadline = t0 + float(os.environ.get("CK_BENCH_DG_PREWARM_TIMEOUT", 400))
    procs = [subprocess.Popen(_dg_worker_argv(chunk), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for chunk in chunks]
    problems, done = [], 0
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            problems.append(f"a worker ran past CK_BENCH_DG_PREWARM_TIMEOUT and was stopped (pid {proc.pid})")
        lines = (out or "").splitlines()
        done += sum(ln.startswith("ok ") for ln in lines)
        failed = [ln for ln in lines if ln.startswith("FAILED ")]
        problems += failed
        if proc.returncode and not failed:  # died before or between cases (import error, crash): its last words
            problems.append(f"worker exited {proc.returncode}: " + " | ".join(ln.strip() for ln in lines[-3:]))
    print(f"DeepGEMM JIT prewarm: {done} of {len(cases)} shapes compiled or cached by {len(procs)} processes in "
          f"{time.time() - t0:.0f} s")
    for line in problems:
        print("  " + line[:400])


def bench_gemm_fp8(quick: bool = False, device: int = 0) -> list[Row]:
    """The 18 normal shapes against cuBLAS blockwise FP8 (torch._scaled_mm with the same 1x128 and 128x128 scales)
    and, where `import deep_gemm` works, DeepGEMM (its output checked against ours first), all as CUDA-graph
    replays into the same rotating outputs in alternating rounds, inputs from our quantization ops; cuBLAS BF16 on
    the same shapes for context."""
    from .ops.gemm_fp8 import BENCH_SHAPES, gemm_fp8
    from .ops.quantize import quantize_fp8_per_block, quantize_fp8_per_token

    torch = torch_or_none()
    if torch is None:
        raise RuntimeError("bench --op gemm_fp8 needs torch for the cuBLAS peer")
    rows = []
    shapes = [(4096, 7168, 16384), (64, 2112, 7168)] if quick else BENCH_SHAPES["normal"]
    dg = deepgemm_peer(torch)
    dg = dg if dg is not None and dg.has("normal") else None
    if dg is not None:
        dg_prewarm([dict(kind="normal", m=m, n=n, k=k) for m, n, k in shapes])
    for m, n, k in shapes:
        nbytes = m * k + n * k + m * n * 2
        sets = sets_beyond_l2(nbytes, device, cap=16)
        ops = []
        for _ in range(sets):
            qa, sa = quantize_fp8_per_token(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            qb, sb = quantize_fp8_per_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05)
            ops.append(tuple(torch.from_dlpack(t) for t in (qa, sa, qb, sb)))
        d = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        iters = max(3, min(50, int(2e5 // max(1.0, 2 * m * n * k / 1400e6))))

        # The peers write into the same rotating outputs as we do (`out=`). Left to allocate, torch._scaled_mm gets
        # the same graph-pool buffer on every call, which stays in L2, while ours rotate over `sets` buffers whose
        # dirty lines go back to DRAM: 128x32768x512 (8 MB of output) measured 10.5 us allocating against 12.2 us
        # into d[i] (H100).
        def blockwise(i, s):
            a, sa, b, sb = ops[i]
            return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16, out=d[i])

        one = torch.ones((), device="cuda")

        def tensorwise(i, s):
            return torch._scaled_mm(ops[i][0], ops[i][2].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                    out=d[i])

        # DeepGEMM reads the same tensors as we do (sA M-major with the aligned column stride, sB row-major)
        label, dg_run, err = f"gemm_fp8 {m}x{n}x{k}", None, None
        if dg is not None:
            check = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            err = _dg_check(torch, label, lambda: gemm_fp8(*ops[0], d[0]),
                            lambda: (dg.gemm(*ops[0], check), check)[1], lambda out: [out])
            check = None
            if err is not None:
                dg_run = lambda i, s: dg.gemm(*ops[i], d[i])  # noqa: E731
        (peer, ours), dg_us = _times_with_dg(torch, [blockwise, lambda i, s: gemm_fp8(*ops[i], d[i], stream=s)],
                                             dg_run, label, sets, iters=iters, peers=1)
        tensorwise_us = graph_time_us(torch, tensorwise, sets, iters=iters)  # context: not in the peer's turns
        rows.append(_dg_columns(Row("gemm_fp8", f"{m}x{n}x{k}", ours, gbytes=nbytes / 1e9, tflops=2 * m * n * k / 1e12,
                                    peer="cuBLAS blockwise", peer_us=peer), dg_us, err, dg and dg.names["normal"]))
        rows.append(Row("gemm_fp8_context", f"{m}x{n}x{k} cuBLAS FP8 per-tensor (context)", tensorwise_us,
                        tflops=2 * m * n * k / 1e12))
        a16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf16 = graph_time_us(torch, lambda i, s: torch.matmul(a16, b16.t(), out=d[0]), 1, iters=iters)
        rows.append(Row("gemm_fp8_context", f"{m}x{n}x{k} cuBLAS BF16 (context)", bf16, tflops=2 * m * n * k / 1e12))
        ops = d = a16 = b16 = None
    return rows


def _fp8_activations(torch, rows: int, k: int):
    """Random [rows, k] quantized per 1x128 group (M-major scales), as torch tensors."""
    from .ops.quantize import quantize_fp8_per_token

    q, s = quantize_fp8_per_token(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
    return torch.from_dlpack(q), torch.from_dlpack(s)


def uneven_contiguous(torch, counts, n: int, k: int, align: int):
    """Contiguous-layout inputs for groups of `counts` rows, each segment padded with -1 rows (zero in A) to a
    multiple of `align`: (a, sa, b, sb, m_indices, the segments' first rows), quantized by our ops."""
    from .ops.quantize import quantize_fp8_per_token

    id_list, starts = _contiguous_ids(counts, align)
    m = len(id_list)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for start, r, end in zip(starts, counts, starts[1:] + [m]):
        x[start + r:end] = 0
    qa, qsa = quantize_fp8_per_token(x)
    b, sb = _fp8_weights(torch, len(counts), n, k)
    return (torch.from_dlpack(qa), torch.from_dlpack(qsa), b, sb,
            torch.tensor(id_list, device="cuda", dtype=torch.int32), starts)


def _fp8_weights(torch, groups: int, n: int, k: int):
    """Random [groups, n, k] weights quantized per 128x128 block (n % 128 == 0: no block spans two groups)."""
    from .ops.quantize import quantize_fp8_per_block

    q, s = quantize_fp8_per_block(torch.randn(groups * n, k, device="cuda", dtype=torch.bfloat16) * 0.05)
    return torch.from_dlpack(q).view(groups, n, k), torch.from_dlpack(s).view(groups, n // 128, -1)


def _mmajor_copy(s):
    """A row slice of M-major scales as its own M-major tensor (what cuBLAS blockwise takes)."""
    return s.t().contiguous().t()


def _context_us(torch, run) -> float:
    """A context peer's time, or 0 (no column) when torch rejects the call on this build."""
    try:
        return graph_time_us(torch, run)
    except (RuntimeError, ValueError) as e:
        print(f"context peer skipped: {str(e).splitlines()[0][:120]}")
        return 0.0


def _masked_rows(torch, groups: int, rows: int):
    """The real rows of each group of a masked case: 75-100% of M, the same every run (a CPU int tensor)."""
    gen = torch.Generator().manual_seed(groups * rows)
    return (torch.rand(groups, generator=gen) * 0.25 * rows + 0.75 * rows).int().clamp(max=rows)


def bench_gemm_fp8_grouped(quick: bool = False, device: int = 0) -> list[Row]:
    """MoE shapes: grouped contiguous against torch._grouped_mm in BF16 (and a loop of cuBLAS blockwise FP8 per
    expert, context); grouped masked in TFLOP/s on the real rows (cuBLAS blockwise rejects their row counts on
    torch 2.11: no torch peer); the K-grouped weight gradient (D += ...) against torch._grouped_mm BF16 over K
    groups (no add). Where `import deep_gemm` works, DeepGEMM on each (its output checked against ours first) in
    the same alternating rounds, and on contiguous groups of uneven sizes (CONTIGUOUS_UNEVEN; no torch peer)."""
    from .ops.gemm_fp8 import (BENCH_SHAPES, gemm_fp8_grouped_contiguous, gemm_fp8_grouped_masked,
                               gemm_fp8_wgrad)

    torch = torch_or_none()
    if torch is None:
        raise RuntimeError("bench --op gemm_fp8_grouped needs torch for the peers")
    out_rows = []
    bf16 = torch.bfloat16
    contiguous = BENCH_SHAPES["contiguous"][:1 if quick else None]
    uneven = [] if quick else CONTIGUOUS_UNEVEN
    masked_cases = [(g, rows, n, k, [int(x) for x in _masked_rows(torch, g, rows).tolist()])
                    for g, rows, n, k in BENCH_SHAPES["masked"][:1 if quick else None]]
    wgrad_cases = BENCH_SHAPES["wgrad"][:1 if quick else None]
    dg = deepgemm_peer(torch)
    m_align = dg.m_align if dg is not None else 128
    if dg is not None:
        cases = []
        if dg.has("contiguous"):
            cases += [dict(kind="contiguous", rows=[rows] * g, n=n, k=k) for g, rows, n, k in contiguous
                      if rows % m_align == 0]
            cases += [dict(kind="contiguous", rows=list(counts), n=n, k=k) for counts, n, k in uneven]
        if dg.has("masked"):
            cases += [dict(kind="masked", max_m=rows, masked=real, expected_m=-(-sum(real) // g), n=n, k=k)
                      for g, rows, n, k, real in masked_cases]
        if dg.has("wgrad"):
            cases += [dict(kind="wgrad", ks=[tokens] * g, m=m, n=n) for g, tokens, m, n in wgrad_cases]
        dg_prewarm(cases)
    for groups, rows, n, k in contiguous:
        m = groups * rows
        a, sa = _fp8_activations(torch, m, k)
        b, sb = _fp8_weights(torch, groups, n, k)
        ids = torch.arange(groups, device="cuda", dtype=torch.int32).repeat_interleave(rows)
        d = torch.empty(m, n, device="cuda", dtype=bf16)
        flop = 2 * m * n * k / 1e12
        a16 = torch.randn(m, k, device="cuda", dtype=bf16)
        b16 = torch.randn(groups, n, k, device="cuda", dtype=bf16)
        offs = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * rows
        case = f"{groups}x{rows} rows, N={n}, K={k}"
        dg_run = err = None
        if dg is not None and dg.has("contiguous") and rows % m_align == 0:
            check = torch.empty(m, n, device="cuda", dtype=bf16)
            err = _dg_check(torch, f"gemm_fp8_contiguous {case}",
                            lambda: gemm_fp8_grouped_contiguous(a, sa, b, sb, ids, d),
                            lambda: (dg.contiguous(a, sa, b, sb, ids, check), check)[1], lambda out: [out])
            check = None
            if err is not None:
                dg_run = lambda i, s: dg.contiguous(a, sa, b, sb, ids, d)  # noqa: E731
        # The segments are multiples of 256 rows: the caller may say so, which allows 256-row tiles. Each
        # alignment is a row of its own, timed with its peers alone (a third kernel in the rounds moved the first
        # one's time against the second's by 0.8-3.7%: H200, 2026-11-29).
        call = dg.names.get("contiguous") if dg is not None else None
        for alignment in (256, 128):
            (peer, ours), dg_us = _times_with_dg(torch, [
                lambda i, s: torch._grouped_mm(a16, b16.transpose(-2, -1), offs=offs),
                lambda i, s: gemm_fp8_grouped_contiguous(a, sa, b, sb, ids, d, alignment=alignment, stream=s)],
                dg_run, case, peers=1)
            out_rows.append(_dg_columns(Row("gemm_fp8_contiguous", f"{case}, alignment={alignment}", ours,
                                            tflops=flop, peer="torch._grouped_mm BF16", peer_us=peer), dg_us, err,
                                        call))

        per_group = [(a[g * rows:(g + 1) * rows], _mmajor_copy(sa[g * rows:(g + 1) * rows])) for g in range(groups)]

        def loop(i, s):
            for g, (ag, sag) in enumerate(per_group):
                torch._scaled_mm(ag, b[g].t(), scale_a=sag, scale_b=sb[g].t(), out_dtype=bf16)
        out_rows.append(Row("gemm_fp8_context", f"{case} cuBLAS blockwise per expert (context)",
                            _context_us(torch, loop), tflops=flop))
        a = sa = b = sb = d = a16 = b16 = per_group = None
    for counts, n, k in uneven:
        # Uneven groups, each segment padded with -1 rows (zero in A) to DeepGEMM's alignment (ours: 128 rows).
        groups = len(counts)
        a, sa, b, sb, ids, starts = uneven_contiguous(torch, counts, n, k, m_align)
        m = a.shape[0]
        d = torch.empty(m, n, device="cuda", dtype=bf16)
        case = f"{groups} groups of [{', '.join(map(str, counts))}] rows (segments padded to {m_align}), N={n}, K={k}"
        dg_run = err = None
        if dg is not None and dg.has("contiguous"):
            check = torch.empty(m, n, device="cuda", dtype=bf16)
            err = _dg_check(torch, f"gemm_fp8_contiguous {case}",
                            lambda: gemm_fp8_grouped_contiguous(a, sa, b, sb, ids, d, alignment=128),
                            lambda: (dg.contiguous(a, sa, b, sb, ids, check), check)[1],
                            lambda out: [out[st:st + r] for st, r in zip(starts, counts)])
            check = None
            if err is not None:
                dg_run = lambda i, s: dg.contiguous(a, sa, b, sb, ids, d)  # noqa: E731
        (ours,), dg_us = _times_with_dg(torch, [
            lambda i, s: gemm_fp8_grouped_contiguous(a, sa, b, sb, ids, d, alignment=128, stream=s)], dg_run, case)
        out_rows.append(_dg_columns(Row("gemm_fp8_contiguous", f"{case}, alignment=128", ours,
                                        tflops=2 * sum(counts) * n * k / 1e12), dg_us, err,
                                    dg.names.get("contiguous") if dg is not None else None))
        a = sa = b = sb = d = None
    for groups, rows, n, k, real in masked_cases:
        a, sa = _fp8_activations(torch, groups * rows, k)
        b, sb = _fp8_weights(torch, groups, n, k)
        masked = torch.tensor(real, device="cuda", dtype=torch.int32)
        d = torch.empty(groups, rows, n, device="cuda", dtype=bf16)
        a3, sa3 = a.view(groups, rows, k), sa.view(groups, rows, -1)
        flop = 2 * sum(real) * n * k / 1e12
        case = f"G={groups}, M={rows} ({sum(real)} real rows), N={n}, K={k}"
        dg_run = err = None
        expected_m = -(-sum(real) // groups)  # (the host hint both take: rows a group typically holds)
        if dg is not None and dg.has("masked"):
            sa_dg = dg_masked_scales(torch, sa3)
            check = torch.empty(groups, rows, n, device="cuda", dtype=bf16)
            err = _dg_check(torch, f"gemm_fp8_masked {case}",
                            lambda: gemm_fp8_grouped_masked(a3, sa3, b, sb, masked, d, expected_m=expected_m),
                            lambda: (dg.masked(a3, sa_dg, b, sb, masked, expected_m, check), check)[1],
                            lambda out: [out[g, :r] for g, r in enumerate(real)])
            check = None
            if err is not None:
                dg_run = lambda i, s: dg.masked(a3, sa_dg, b, sb, masked, expected_m, d)  # noqa: E731
        (ours,), dg_us = _times_with_dg(torch, [
            lambda i, s: gemm_fp8_grouped_masked(a3, sa3, b, sb, masked, d, expected_m=expected_m, stream=s)],
            dg_run, case)
        out_rows.append(_dg_columns(Row("gemm_fp8_masked", case, ours, tflops=flop), dg_us, err,
                                    dg.names.get("masked") if dg is not None else None))
        a = sa = b = sb = d = a3 = sa3 = sa_dg = None
    for groups, tokens, m, n in wgrad_cases:
        k = groups * tokens
        ks = [tokens] * groups
        a, sa = _fp8_activations(torch, m, k)
        b, sb = _fp8_activations(torch, n, k)
        d = torch.zeros(groups, m, n, device="cuda", dtype=torch.float32)
        a16 = torch.randn(m, k, device="cuda", dtype=bf16)
        b16 = torch.randn(n, k, device="cuda", dtype=bf16)
        offs = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * tokens
        case = f"{groups} experts x {tokens} tokens, M={m}, N={n} (D += , fp32)"
        dg_run = err = None
        if dg is not None and dg.has("wgrad"):
            # DeepGEMM's K-grouped operands are each group's [rows, tokens] block in turn: copies of ours
            a_dg, sa_dg = dg_k_grouped_operand(torch, a, sa, ks)
            b_dg, sb_dg = dg_k_grouped_operand(torch, b, sb, ks)
            ks_tensor = torch.tensor(ks, device="cuda", dtype=torch.int32)
            check = torch.zeros(groups, m, n, device="cuda", dtype=torch.float32)
            err = _dg_check(torch, f"gemm_fp8_wgrad {case}", lambda: gemm_fp8_wgrad(a, sa, b, sb, d, ks),
                            lambda: (dg.wgrad(a_dg, sa_dg, b_dg, sb_dg, check, ks, ks_tensor), check)[1],
                            lambda out: [out])  # both from zeros: one product each
            check = None
            if err is not None:
                dg_run = lambda i, s: dg.wgrad(a_dg, sa_dg, b_dg, sb_dg, d, ks, ks_tensor)  # noqa: E731
        (peer, ours), dg_us = _times_with_dg(torch, [lambda i, s: torch._grouped_mm(a16, b16.t(), offs=offs),
                                                     lambda i, s: gemm_fp8_wgrad(a, sa, b, sb, d, ks, stream=s)],
                                             dg_run, case, peers=1)
        out_rows.append(_dg_columns(Row("gemm_fp8_wgrad", case, ours, tflops=2 * m * n * k / 1e12,
                                        peer="torch._grouped_mm BF16 (K groups)", peer_us=peer), dg_us, err,
                                    dg.names.get("wgrad") if dg is not None else None))
        a = sa = b = sb = d = a16 = b16 = a_dg = sa_dg = b_dg = sb_dg = None
    return out_rows


# ---- attention -------------------------------------------------------------------------------------------------

ATTN_TOKENS, ATTN_HIDDEN = 16384, 2048
ATTN_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


def attention_flops(batch: int, heads: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """4 B H S_q S_k D, halved for causal (the square-mask convention of FlashAttention's benchmarks)."""
    return 4 * batch * heads * sq * sk * d / (2 if causal else 1)


def _sdpa(torch, backend):
    """torch SDPA pinned to one backend, on [B, S, H, D] tensors (seen as [B, H, S, D] through a transpose)."""
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F

    def run(q, k, v, causal, gqa=False):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal, enable_gqa=gqa)
    return run


def sdpa_backward_run(torch, sdpa, q, k, v, do, causal: bool, gqa: bool = False):
    """A `graph_times_us` run of an SDPA backend's backward: autograd.grad of its output for dO (the forward runs
    once here, on the graph stream: autograd runs a backward op on its forward's stream, the capture stream)."""
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    graph_stream(torch).wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(graph_stream(torch)):
        og = sdpa(qg, kg, vg, causal, gqa)
    torch.cuda.synchronize()
    dog = do.transpose(1, 2)
    return lambda i, st: torch.autograd.grad(og, (qg, kg, vg), dog, retain_graph=True)


def _varlen_lengths(total: int, longest: int, seed: int = 0) -> list[int]:
    """Mixed sequence lengths in 1..longest summing to `total` (fixed seed: the same mix every run)."""
    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < total:
        lens.append(int(min(total - sum(lens), rng.integers(1, longest + 1))))
    return lens


def bench_attention(quick: bool = False, device: int = 0) -> list[Row]:
    """The forward grid of the attention issue (16384 tokens, hidden 2048, D 64 / 128 / 256, causal and not) against
    cuDNN (torch SDPA, cuDNN backend) in the same graph-timed rounds, FA2 (SDPA flash backend) for context; GQA
    32 / 8 at D 128, S 8192, causal; varlen (mixed lengths 1..8192, causal) against FA2's varlen entry."""
    from torch.nn.attention import SDPBackend

    from .ops.attention import attention

    torch = torch_or_none()
    if torch is None:
        raise RuntimeError("bench --op attention needs torch for the cuDNN peer")
    cudnn, fa2 = _sdpa(torch, SDPBackend.CUDNN_ATTENTION), _sdpa(torch, SDPBackend.FLASH_ATTENTION)
    rows = []
    grid = [(d, s, c) for d in (64, 128, 256) for c in (False, True) for s in ATTN_SEQLENS]
    if quick:
        grid = [(128, 4096, False), (128, 4096, True)]
    cases = [(d, s, c, ATTN_HIDDEN // d, ATTN_HIDDEN // d) for d, s, c in grid]
    if not quick:
        cases.append((128, 8192, True, 32, 8))
    for d, s, causal, hq, hkv in cases:
        b = ATTN_TOKENS // s
        mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q, k, v, o = mk(hq), mk(hkv), mk(hkv), mk(hq)
        gqa = hq != hkv
        runs = [lambda i, st: cudnn(q, k, v, causal, gqa),
                lambda i, st: attention(q, k, v, causal=causal, out=o, stream=st)]
        peer, ours = graph_times_us(torch, runs, 1, iters=10)
        try:
            fa2_us = graph_time_us(torch, lambda i, st: fa2(q, k, v, causal, gqa), 1, iters=10)
        except Exception:  # noqa: BLE001 (a backend that does not take the case: no context number)
            fa2_us = 0.0
        label = f"S {s} D {d}{' causal' if causal else ''}{f' GQA {hq}/{hkv}' if gqa else ''}"
        fl = attention_flops(b, hq, s, s, d, causal)
        rows.append(Row("attention", label, ours, tflops=fl / 1e12, peer="cuDNN", peer_us=peer,
                        extra={"fa2_us": fa2_us, "fa2_tflops": fl / 1e12 / (fa2_us * 1e-6) if fa2_us else 0.0}))
        q = k = v = o = None
    if not quick:
        rows += _bench_attention_varlen(torch, attention)
    return rows


def _bench_attention_varlen(torch, attention) -> list[Row]:
    lens = _varlen_lengths(ATTN_TOKENS, 8192)
    h, d = ATTN_HIDDEN // 128, 128
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), device="cuda", dtype=torch.int32)
    q, k, v, o = (torch.randn(ATTN_TOKENS, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    mx = max(lens)
    ours_run = lambda i, st: attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,  # noqa: E731
                                       max_seqlen_q=mx, max_seqlen_k=mx, out=o, stream=st)
    fl = sum(attention_flops(1, h, n, n, d, True) for n in lens)

    def fa2(i, st):
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False)
    try:
        peer, ours = graph_times_us(torch, [fa2, ours_run], 1, iters=10)
        name = "FA2 varlen"
    except Exception:  # noqa: BLE001
        ours, peer, name = graph_time_us(torch, ours_run, 1, iters=10), 0.0, ""
    return [Row("attention", f"varlen {len(lens)} seqs 1..8192 (16384 tokens) D 128 causal", ours, tflops=fl / 1e12,
                peer=name, peer_us=peer)]


def bench_attention_bwd(quick: bool = False, device: int = 0) -> list[Row]:
    """The attention backward on the forward's grid (16384 tokens, hidden 2048, D 64 / 128, causal and not), GQA
    32 / 8 at D 128, S 8192, causal, and varlen (mixed lengths 1..8192, causal), against cuDNN's backward (torch
    SDPA, cuDNN backend: autograd.grad of its output, captured in the same graph-timed rounds; FA2's in context).
    FLOPs: 2.5 times the forward's."""
    from torch.nn.attention import SDPBackend

    from .ops.attention import attention
    from .ops.attention_bwd import HEAD_DIMS, attention_backward

    torch = torch_or_none()
    if torch is None:
        raise RuntimeError("bench --op attention_bwd needs torch for the cuDNN peer")
    cudnn, fa2 = _sdpa(torch, SDPBackend.CUDNN_ATTENTION), _sdpa(torch, SDPBackend.FLASH_ATTENTION)
    grid = [(d, s, c) for d in HEAD_DIMS for c in (False, True) for s in ATTN_SEQLENS]
    if quick:
        grid = [(128, 4096, False), (128, 4096, True)]
    cases = [(d, s, c, ATTN_HIDDEN // d, ATTN_HIDDEN // d) for d, s, c in grid]
    if not quick:
        cases.append((128, 8192, True, 32, 8))
    rows = []
    for d, s, causal, hq, hkv in cases:
        b = ATTN_TOKENS // s
        mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q, k, v, do = mk(hq), mk(hkv), mk(hkv), mk(hq)
        gqa = hq != hkv
        out, lse = attention(q, k, v, causal=causal, return_lse=True)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        def peer_run(sdpa):
            return sdpa_backward_run(torch, sdpa, q, k, v, do, causal, gqa)
        ours_run = lambda i, st: attention_backward(do, q, k, v, out, lse, causal=causal, dq=dq, dk=dk,  # noqa
                                                    dv=dv, stream=st)
        peer, ours = graph_times_us(torch, [peer_run(cudnn), ours_run], 1, iters=10)
        try:
            fa2_us = graph_time_us(torch, peer_run(fa2), 1, iters=10)
        except Exception:  # noqa: BLE001 (a backend that does not take the case: no context number)
            fa2_us = 0.0
        label = f"S {s} D {d}{' causal' if causal else ''}{f' GQA {hq}/{hkv}' if gqa else ''}"
        fl = 2.5 * attention_flops(b, hq, s, s, d, causal)
        rows.append(Row("attention_bwd", label, ours, tflops=fl / 1e12, peer="cuDNN", peer_us=peer,
                        extra={"fa2_us": fa2_us, "fa2_tflops": fl / 1e12 / (fa2_us * 1e-6) if fa2_us else 0.0}))
        q = k = v = do = out = lse = dq = dk = dv = None
    if not quick:
        rows += _bench_attention_bwd_varlen(torch, attention, attention_backward)
    return rows


def _bench_attention_bwd_varlen(torch, attention, attention_backward) -> list[Row]:
    lens = _varlen_lengths(ATTN_TOKENS, 8192)
    h, d = ATTN_HIDDEN // 128, 128
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), device="cuda", dtype=torch.int32)
    q, k, v, do = (torch.randn(ATTN_TOKENS, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    mx = max(lens)
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx)
    out, lse = attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ours_run = lambda i, st: attention_backward(do, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, stream=st,  # noqa
                                                **kw)
    fl = 2.5 * sum(attention_flops(1, h, n, n, d, True) for n in lens)
    try:
        o2, lse2, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False)
        seed = torch.zeros(2, dtype=torch.int64, device="cuda")

        def fa2(i, st):
            return torch.ops.aten._flash_attention_backward(do, q, k, v, o2, lse2, cu, cu, mx, mx, 0.0, True,
                                                            seed, seed)
        peer, ours = graph_times_us(torch, [fa2, ours_run], 1, iters=10)
        name = "FA2 varlen"
    except Exception:  # noqa: BLE001
        ours, peer, name = graph_time_us(torch, ours_run, 1, iters=10), 0.0, ""
    return [Row("attention_bwd", f"varlen {len(lens)} seqs 1..8192 (16384 tokens) D 128 causal", ours,
                tflops=fl / 1e12, peer=name, peer_us=peer)]


BENCHES = {"quant": bench_quant, "gemm": bench_gemm, "gemm_fp8": bench_gemm_fp8,
           "gemm_fp8_grouped": bench_gemm_fp8_grouped, "host": bench_host,
           "attention": bench_attention, "attention_bwd": bench_attention_bwd}
