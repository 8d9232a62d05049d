"""Where a split-K GEMM's time goes, against the floor of reading its operands (bf16 in and out, one shape).

    git apply scripts/split_bound.patch && python scripts/split_bound.py [MxNxK] [--variants base,no_epi,...]
    git checkout ptx                     # the patch adds DIAG_* switches to ptx/gemm.cu: never commit it applied

Prints, same process, CUDA-graph replays over input sets beyond 2x L2 (the bench protocol):
- the read floor: a plain kernel (cupy, 16-byte loads) that only reads A and B, per call;
- cuBLAS, the heuristic's pick and the same call with split_k=1;
- variants of the pick with parts switched off (results wrong, timing only): `no_epi` skips the split-K
  epilogue (no partial, count or finish), `no_mma` the wgmma, `no_load` the loads after the first stages,
  `no_reduce` only the partial's reduce-add, `no_finish` only the finish, `count_only` both; `one_finishes`
  (still exact) has only the last split of a slice finish it, the others leave at once (the rule beyond one wave);
- a per-CTA timeline of the pick (globaltimer and clock64 written through the unused C pointer): the SM clock,
  the first stage's arrival, the main loop's end (median and slowest CTA) and the last CTA's end, in us from the
  median CTA's release from griddepcontrol.wait, and from that end to the next call's median release ("next"),
  medians over calls 10..48 of a 50-call graph.
docs/perf-notes.md, session 22, has the 512x512x65536 numbers.
"""
import argparse
import statistics

import numpy as np
import torch

import cudart_kernels as ck
from cudart_kernels.bench import graph_times_us, sets_beyond_l2
from cudart_kernels.ops import gemm as g
from cudart_kernels.runtime.driver import device_properties, stream_handle
from cudart_kernels.runtime.interop import as_array

VARIANTS = {"base": {}, "no_epi": {"DIAG_NO_EPI": 1}, "no_mma": {"DIAG_NO_MMA": 1},
            "no_load": {"DIAG_NO_LOAD": 1}, "no_mma_no_epi": {"DIAG_NO_MMA": 1, "DIAG_NO_EPI": 1},
            "no_reduce": {"DIAG_NO_REDUCE": 1}, "no_finish": {"DIAG_NO_FINISH": 1},
            "count_only": {"DIAG_NO_REDUCE": 1, "DIAG_NO_FINISH": 1},
            "no_epi_sleep6": {"DIAG_NO_EPI": 1, "DIAG_SLEEP_END": 6000}, "one_finishes": {"DIAG_ONE_FINISHES": 1}}
EXACT = {"base", "one_finishes"}  # variants that still compute the product
ITERS = 50

ap = argparse.ArgumentParser()
ap.add_argument("shape", nargs="?", default="512x512x65536")
ap.add_argument("--variants", default="base,no_epi,no_mma,no_load")
args = ap.parse_args()
M, N, K = map(int, args.shape.split("x"))
props = device_properties(0)
sets = sets_beyond_l2((M * K + N * K + M * N) * 2, cap=16)
a = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
b = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
d = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
ref = a[0].double() @ b[0].double().t()
print(f"device: {torch.cuda.get_device_name()}; {M}x{N}x{K}, {sets} input sets")

READ_SRC = r"""
extern "C" __global__ void read2(const uint4* __restrict__ p, long long np, const uint4* __restrict__ q,
                                 long long nq, unsigned* sink) {
  unsigned x = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < np + nq; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long long e = i + j * stride;
      v[j].x = v[j].w = 0;
      if (e < np) v[j] = __ldg(p + e);
      else if (e < np + nq) v[j] = __ldg(q + e - np);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) x ^= v[j].x ^ v[j].w;
  }
  if (x == 0x9e3779b9u) sink[0] = x;  // keeps the loads
}
"""


def read_floor_us():
    """A plain kernel reading A and B once per call (16-byte loads, four in flight a thread), event-timed over
    back-to-back launches; the best of three grid sizes."""
    import cupy as cp

    kern = cp.RawKernel(READ_SRC, "read2")
    sink = cp.zeros(1, cp.uint32)
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        for blocks in (2, 4, 8):
            samples = []
            for r in range(6):
                ev0.record()
                for i in range(ITERS):
                    x, y = a[i % sets], b[i % sets]
                    kern((blocks * props.sm_count,), (512,), (cp.uint64(x.data_ptr()), cp.int64(x.numel() // 8),
                                                              cp.uint64(y.data_ptr()), cp.int64(y.numel() // 8), sink))
                ev1.record()
                ev1.synchronize()
                if r:
                    samples.append(ev0.elapsed_time(ev1) * 1e3 / ITERS)
            best = min(best, statistics.median(samples))
    return best


_defines = g._defines
DIAG = {}
g._defines = lambda in_dt, out_dt, cfg, *x, **kw: {**_defines(in_dt, out_dt, cfg, *x, **kw),
                                                   **(DIAG if cfg.splits > 1 else {})}  # not into split_k=1


def use_variant(extra):
    """Compile the DIAG switches `extra` into every split-K plan gemm() builds from now on."""
    DIAG.clear()
    DIAG.update(extra)
    g._plans.clear()


def recording_launcher(plan):
    """gemm()'s launch of `plan` with the per-CTA record in the C pointer (gemm() passes C only when it adds one,
    which would compile another kernel)."""
    def run(i, s, rec_ptr):
        h = stream_handle(s)
        av, bv, dv = as_array(a[i], h), as_array(b[i], h), as_array(d[i], h)
        ws = g._workspace(0, h)
        ws.ensure(M * plan.ld_w, plan.n_counters, 0, s)
        maps = g._local.maps
        ma, mae = g.operand_maps(maps, "a", plan.map_a, plan.map_a_edge, av.ptr)
        mb, mbe = g.operand_maps(maps, "b", plan.map_b, plan.map_b_edge, bv.ptr)
        plan.launch(plan.grid, h, ma, mb, mae, mbe, maps.get("out", plan.map_out, ws.w.ptr), dv.ptr, dv.strides[0],
                    ws.w.ptr, plan.ld_w, rec_ptr, 0, ws.counters.ptr, M, N, K, plan.cfg.splits, plan.cfg.group_m)
    return run


def timeline():
    plan = g._plan(as_array(a[0]), as_array(b[0]), as_array(d[0]), None, False, None, False, False, props)
    run = recording_launcher(plan)
    grid = plan.grid[0]
    rec = torch.zeros(ITERS, grid, 8, dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        run(0, s, rec[0].data_ptr())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        for i in range(ITERS):
            run(i % sets, s, rec[i].data_ptr())
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    # per CTA: entry, released, first stage, main end, end (ns), cycles, smid, the last consumer's end (ns)
    r = rec.cpu().numpy().astype(np.float64)
    keys = ("MHz", "first", "main med", "main max", "end max", "next")
    calls = []
    for j in range(10, ITERS - 1):
        x = r[j]
        t0 = np.median(x[:, 1])
        end = np.maximum(x[:, 4], x[:, 7]).max()
        calls.append((np.median(x[:, 5] / (x[:, 4] - x[:, 0]) * 1e3), np.median(x[:, 2] - t0) / 1e3,
                      np.median(x[:, 3] - t0) / 1e3, (x[:, 3].max() - t0) / 1e3, (end - t0) / 1e3,
                      (np.median(r[j + 1][:, 1]) - end) / 1e3))
    return dict(zip(keys, (statistics.median(c[j] for c in calls) for j in range(len(keys)))))


try:
    floor = read_floor_us()
    nbytes = (M + N) * K * 2
    print(f"read floor (A and B once, plain loads): {floor:.2f} us per call = {nbytes / floor / 1e3:.0f} GB/s")
except ImportError:
    print("read floor: cupy not importable, skipped")

cublas = lambda i, s: torch.matmul(a[i], b[i].t(), out=d[i])
unsplit = lambda i, s: ck.gemm(a[i], b[i], out=d[i], split_k=1, stream=s)
print("| variant | config | rel. error | us | cuBLAS us | split_k=1 us | MHz | first | main med | main max | end max "
      "| next |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for name in args.variants.split(","):
    extra = VARIANTS[name]
    use_variant(extra)
    err = ""
    if name in EXACT:
        d[0].fill_(float("nan"))
        ck.gemm(a[0], b[0], out=d[0])
        err = f"{((d[0].double() - ref).norm() / ref.norm()).item():.1e}"
    ours = lambda i, s: ck.gemm(a[i], b[i], out=d[i], stream=s)
    peer, t, off = graph_times_us(torch, [cublas, ours, unsplit], sets, iters=ITERS)
    c = g.pick_config(M, N, K, 2, props)
    use_variant({**extra, "DIAG_CLOCK": 1})
    tl = timeline()
    print(f"| {name} | {c.bm}x{c.bn} st{c.stages} s{c.splits} mc{c.mcast} | {err} | {t:.2f} | {peer:.2f} | {off:.1f} | "
          + " | ".join(f"{v:.0f}" if k == "MHz" else f"{v:.2f}" for k, v in tl.items()) + " |", flush=True)
