"""Benchmark harness (the protocol of docs/tuning.md): CUDA events over many launches after warm-up, median of repeats,
inputs rotated over more than 2x L2 so nothing is served hot from cache, peers timed in the same process.
"""
from __future__ import annotations

import json
import statistics
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

    lines = ["| op | case | time (us) | GB/s | % copy BW | TFLOP/s | peer | peer (us) | peer/ours |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        pct = f"{100 * r.gbps / copy_gbps:.0f}%" if r.gbytes and copy_gbps else ""
        lines.append(f"| {r.op} | {r.case} | {r.us:.1f} | {cell(r.gbps, '.0f')} | {pct} | {cell(r.tflops_rate, '.1f')} "
                     f"| {r.peer} | {cell(r.peer_us, '.1f')} | {cell(r.ratio, '.2f')} |")
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
            json.dump({"device": props.name, "copy_gbps": copy.gbps,
                       "rows": [dict(asdict(r), gbps=r.gbps, tflops_rate=r.tflops_rate, ratio=r.ratio)
                                for r in rows]}, f, indent=1)
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


def bench_gemm_fp8(quick: bool = False, device: int = 0) -> list[Row]:
    """The 18 normal shapes against cuBLAS blockwise FP8 (torch._scaled_mm with the same 1x128 and 128x128 scales),
    both as CUDA-graph replays into the same rotating outputs, inputs from our quantization ops; cuBLAS BF16 on the
    same shapes for context."""
    from .ops.gemm_fp8 import BENCH_SHAPES, gemm_fp8
    from .ops.quantize import quantize_fp8_per_block, quantize_fp8_per_token

    torch = torch_or_none()
    if torch is None:
        raise RuntimeError("bench --op gemm_fp8 needs torch for the cuBLAS peer")
    rows = []
    shapes = [(4096, 7168, 16384), (64, 2112, 7168)] if quick else BENCH_SHAPES["normal"]
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

        peer, ours = graph_times_us(torch, [blockwise, lambda i, s: gemm_fp8(*ops[i], d[i], stream=s)], sets,
                                    iters=iters)
        tensorwise_us = graph_time_us(torch, tensorwise, sets, iters=iters)  # context: not in the peer's turns
        rows.append(Row("gemm_fp8", f"{m}x{n}x{k}", ours, gbytes=nbytes / 1e9, tflops=2 * m * n * k / 1e12,
                        peer="cuBLAS blockwise", peer_us=peer))
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


def bench_gemm_fp8_grouped(quick: bool = False, device: int = 0) -> list[Row]:
    """MoE shapes: grouped contiguous against torch._grouped_mm in BF16 (and a loop of cuBLAS blockwise FP8 per
    expert, context); grouped masked in TFLOP/s on the real rows (cuBLAS blockwise rejects their row counts on
    torch 2.11: no peer); the K-grouped weight gradient (D += ...) against torch._grouped_mm BF16 over K groups (no add)."""
    from .ops.gemm_fp8 import (BENCH_SHAPES, gemm_fp8_grouped_contiguous, gemm_fp8_grouped_masked,
                               gemm_fp8_wgrad)

    torch = torch_or_none()
    if torch is None:
        raise RuntimeError("bench --op gemm_fp8_grouped needs torch for the peers")
    out_rows = []
    bf16 = torch.bfloat16
    for groups, rows, n, k in BENCH_SHAPES["contiguous"][:1 if quick else None]:
        m = groups * rows
        a, sa = _fp8_activations(torch, m, k)
        b, sb = _fp8_weights(torch, groups, n, k)
        ids = torch.arange(groups, device="cuda", dtype=torch.int32).repeat_interleave(rows)
        d = torch.empty(m, n, device="cuda", dtype=bf16)
        flop = 2 * m * n * k / 1e12
        a16 = torch.randn(m, k, device="cuda", dtype=bf16)
        b16 = torch.randn(groups, n, k, device="cuda", dtype=bf16)
        offs = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * rows
        # The segments are multiples of 256 rows: the caller may say so, which allows 256-row tiles.
        peer, ours, ours128 = graph_times_us(torch, [
            lambda i, s: torch._grouped_mm(a16, b16.transpose(-2, -1), offs=offs),
            lambda i, s: gemm_fp8_grouped_contiguous(a, sa, b, sb, ids, d, alignment=256, stream=s),
            lambda i, s: gemm_fp8_grouped_contiguous(a, sa, b, sb, ids, d, stream=s)])
        case = f"{groups}x{rows} rows, N={n}, K={k}"
        out_rows.append(Row("gemm_fp8_contiguous", f"{case}, alignment=256", ours, tflops=flop,
                            peer="torch._grouped_mm BF16", peer_us=peer))
        out_rows.append(Row("gemm_fp8_contiguous", f"{case}, alignment=128", ours128, tflops=flop,
                            peer="torch._grouped_mm BF16", peer_us=peer))

        per_group = [(a[g * rows:(g + 1) * rows], _mmajor_copy(sa[g * rows:(g + 1) * rows])) for g in range(groups)]

        def loop(i, s):
            for g, (ag, sag) in enumerate(per_group):
                torch._scaled_mm(ag, b[g].t(), scale_a=sag, scale_b=sb[g].t(), out_dtype=bf16)
        out_rows.append(Row("gemm_fp8_context", f"{case} cuBLAS blockwise per expert (context)",
                            _context_us(torch, loop), tflops=flop))
        a = sa = b = sb = d = a16 = b16 = None
    for groups, rows, n, k in BENCH_SHAPES["masked"][:1 if quick else None]:
        a, sa = _fp8_activations(torch, groups * rows, k)
        b, sb = _fp8_weights(torch, groups, n, k)
        gen = torch.Generator().manual_seed(groups * rows)
        real = (torch.rand(groups, generator=gen) * 0.25 * rows + 0.75 * rows).int().clamp(max=rows)
        masked = real.to("cuda")
        d = torch.empty(groups, rows, n, device="cuda", dtype=bf16)
        a3, sa3 = a.view(groups, rows, k), sa.view(groups, rows, -1)
        ours = graph_time_us(torch, lambda i, s: gemm_fp8_grouped_masked(a3, sa3, b, sb, masked, d, stream=s))
        flop = 2 * int(real.sum()) * n * k / 1e12

        out_rows.append(Row("gemm_fp8_masked", f"G={groups}, M={rows} ({int(real.sum())} real rows), N={n}, K={k}",
                            ours, tflops=flop))
        a = sa = b = sb = d = a3 = sa3 = None
    for groups, tokens, m, n in BENCH_SHAPES["wgrad"][:1 if quick else None]:
        k = groups * tokens
        a, sa = _fp8_activations(torch, m, k)
        b, sb = _fp8_activations(torch, n, k)
        d = torch.zeros(groups, m, n, device="cuda", dtype=torch.float32)
        ks = [tokens] * groups
        a16 = torch.randn(m, k, device="cuda", dtype=bf16)
        b16 = torch.randn(n, k, device="cuda", dtype=bf16)
        offs = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * tokens
        peer, ours = graph_times_us(torch, [lambda i, s: torch._grouped_mm(a16, b16.t(), offs=offs),
                                            lambda i, s: gemm_fp8_wgrad(a, sa, b, sb, d, ks, stream=s)])
        out_rows.append(Row("gemm_fp8_wgrad", f"{groups} experts x {tokens} tokens, M={m}, N={n} (D += , fp32)",
                            ours, tflops=2 * m * n * k / 1e12, peer="torch._grouped_mm BF16 (K groups)",
                            peer_us=peer))
        a = sa = b = sb = d = a16 = b16 = None
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
