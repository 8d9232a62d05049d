"""A tensor-parallel MLP block across the GPUs of one node: y = gelu(x @ W1^T) @ W2^T, with W1 split by rows
(column-parallel: each GPU makes its own slice of the hidden activations, no communication) and W2 split by
columns (row-parallel: each GPU makes a partial y, summed by one NCCL all-reduce). The GEMMs are cudart_kernels'
(BF16 `gemm`, or with --fp8 the per-token / per-block quantization and `gemm_fp8`); torch.distributed and NCCL
move the data. Every rank checks its result against the whole block computed on its own GPU, and rank 0 prints the
time per step against the same block with torch.matmul (CUDA events, after warm-up, median of the steps).

    torchrun --nproc-per-node 8 examples/tensor_parallel_mlp.py [--fp8] [--tokens 4096 --hidden 4096 --ffn 16384]

(Without torchrun it runs as a single rank on GPU 0.)
"""
import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cudart_kernels as ck

TOLERANCE = 2e-2  # relative error against the single-GPU block


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384, help="the MLP's inner width, split over the GPUs")
    p.add_argument("--fp8", action="store_true", help="FP8 GEMMs (quantize + gemm_fp8) instead of BF16 gemm")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    return p.parse_args()


class LibraryBlock:
    """One rank's part of the block with this library's GEMMs: w1 [ffn / N, hidden] and w2 [hidden, ffn / N]."""

    def __init__(self, w1, w2, fp8: bool):
        self.fp8 = fp8
        if fp8:  # the weights are quantized once, per 128x128 block
            self.w1, self.w2 = ck.quantize_fp8_per_block(w1), ck.quantize_fp8_per_block(w2)
        else:
            self.w1, self.w2 = w1, w2

    def partial(self, x):
        """This rank's partial y (the whole y on one GPU)."""
        if self.fp8:
            h = ck.gemm_fp8(*ck.quantize_fp8_per_token(x), *self.w1)
            return ck.gemm_fp8(*ck.quantize_fp8_per_token(F.gelu(h, approximate="tanh")), *self.w2)
        h = ck.gemm(x, self.w1)
        return ck.gemm(F.gelu(h, approximate="tanh"), self.w2)

    def __call__(self, x):
        y = self.partial(x)
        dist.all_reduce(y)
        return y


def torch_block(x, w1, w2):
    """The same part of the block with torch.matmul."""
    y = torch.matmul(F.gelu(torch.matmul(x, w1.T), approximate="tanh"), w2.T)
    dist.all_reduce(y)
    return y


def time_ms(runs: dict, steps: int, warmup: int) -> dict:
    """Median milliseconds per call of each function in `runs`, taking turns (the order reversed every other
    step, so that neither always runs on a cooler or warmer GPU)."""
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    events = {name: [] for name in runs}
    for step in range(steps):
        names = list(runs) if step % 2 == 0 else list(runs)[::-1]
        for name in names:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runs[name]()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


def rel_error(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def main():
    args = parse_args()
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                          ("MASTER_PORT", "29500")):
        os.environ.setdefault(name, default)  # (a single rank without torchrun)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)  # (for NCCL and torch's allocations; the library goes by the arrays)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    t, hidden, ffn = args.tokens, args.hidden, args.ffn
    if ffn % (128 * world) or hidden % 128:
        raise SystemExit(f"--ffn must be a multiple of 128 x {world} GPUs and --hidden of 128 (FP8 scale blocks)")

    # The whole block's input and weights, the same on every rank (rank 0's, broadcast).
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(t, hidden, device=device, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(ffn, hidden, device=device, generator=g) / hidden ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(hidden, ffn, device=device, generator=g) / ffn ** 0.5).to(torch.bfloat16)
    for tensor in (x, w1, w2):
        dist.broadcast(tensor, 0)

    # This rank's shards: rows of W1 (column-parallel), the same columns of W2 (row-parallel).
    cols = slice(rank * ffn // world, (rank + 1) * ffn // world)
    w1_r, w2_r = w1[cols].contiguous(), w2[:, cols].contiguous()
    ours = LibraryBlock(w1_r, w2_r, args.fp8)

    # Correctness: the parallel block against the whole block on this GPU alone (the same recipe: BF16 against
    # fp32, FP8 against the unsplit FP8 block, whose scale groups the split keeps).
    y = ours(x)
    exact = F.gelu(x.float() @ w1.float().T, approximate="tanh") @ w2.float().T
    single = LibraryBlock(w1, w2, True).partial(x) if args.fp8 else exact
    err = rel_error(y, single)
    worst = torch.tensor([err], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)

    # Time per step: this library's block against torch.matmul's, the all-reduce included in both.
    ms = time_ms({"cudart_kernels": lambda: ours(x), "torch.matmul": lambda: torch_block(x, w1_r, w2_r)},
                 args.steps, args.warmup)
    slowest = torch.tensor([ms["cudart_kernels"], ms["torch.matmul"]], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        ours_ms, torch_ms = slowest.tolist()
        tflops = 4 * t * hidden * ffn / 1e9  # two GEMMs, over all GPUs (per ms: TFLOP/s)
        kind = "FP8 gemm_fp8" if args.fp8 else "BF16 gemm"
        print(f"tensor-parallel MLP on {world} GPU(s): tokens {t}, hidden {hidden}, ffn {ffn} ({ffn // world} a GPU)")
        print(f"  relative error against the single-GPU block: {worst.item():.2e} (limit {TOLERANCE:g})")
        if args.fp8:
            print(f"  FP8 against the fp32 block (rounding of the recipe): {rel_error(y, exact):.2e}")
        print(f"  cudart_kernels ({kind}): {ours_ms:.3f} ms/step ({tflops / ours_ms:.0f} TFLOP/s)")
        print(f"  torch.matmul (BF16):    {torch_ms:.3f} ms/step ({tflops / torch_ms:.0f} TFLOP/s)")
        print(f"  torch / cudart_kernels: {torch_ms / ours_ms:.2f}x")
    dist.destroy_process_group()
    if worst.item() > TOLERANCE:
        raise SystemExit(f"rank {rank}: relative error {err:.2e} above {TOLERANCE:g}")


if __name__ == "__main__":
    main()
