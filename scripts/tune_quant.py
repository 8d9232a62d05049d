"""Time quantization kernel variants (THREADS, UNROLL) against the copy roofline; each variant is first checked
bit for bit against the numpy reference. Usage: python scripts/tune_quant.py  (on a GPU)."""
import numpy as np

from cudart_kernels import reference as ref
from cudart_kernels.bench import copy_bandwidth_row, sets_beyond_l2, time_us
from cudart_kernels.ops.quantize import _ARGS, _KIND, _TOKEN_ARGS, GROUP, token_grid
from cudart_kernels.runtime import dtypes as dt
from cudart_kernels.runtime.interop import DeviceArray
from cudart_kernels.runtime.launch import get_launcher


def launcher(kind, dtype, threads, unroll):
    entry = "quantize_per_token" if kind == "token" else "quantize_per_block"
    return get_launcher("quantize.cu", entry, {"IN_KIND": _KIND[dtype], "THREADS": threads, "UNROLL": unroll}, 0,
                        _TOKEN_ARGS if kind == "token" else _ARGS, (threads,))


def run(kind, dtype, threads, unroll, x, q, s, waves=0):
    m, k = x.shape
    if kind == "token":
        grid, log2 = token_grid(dtype, m, k, threads, unroll)
        if waves:  # persistent-style: about `waves` resident waves of blocks, each looping over row tiles
            resident = 132 * (2048 // threads)
            grid = (grid[0], max(1, min(grid[1], waves * resident // grid[0])), 1)
        extra = (log2,)
    else:
        grid, extra = (-(-k // GROUP), -(-m // GROUP), 1), ()
    launcher(kind, dtype, threads, unroll)(grid, 0, x.ptr, k * dtype.itemsize, q.ptr, k, s.ptr, s.strides[0],
                                           s.strides[1], m, k, *extra)


def outputs(kind, m, k):
    q = DeviceArray.empty((m, k), "e4m3").fill_bytes(0x7F)
    s = DeviceArray.empty((m if kind == "token" else -(-m // GROUP), -(-k // GROUP)), "fp32").fill_bytes(0xFF)
    return q, s


def correct(kind, dtype, threads, unroll, rng):
    x = ref.random_activations(rng, 9000, 1032 if dtype.itemsize == 2 else 1028, dtype.numpy)
    q, s = outputs(kind, *x.shape)
    run(kind, dtype, threads, unroll, DeviceArray.from_numpy(x), q, s, waves=1)  # also checks the row-tile loop
    rq, rs = (ref.quantize_per_token if kind == "token" else ref.quantize_per_block)(x)
    return np.array_equal(q.numpy().view(np.uint8), rq.view(np.uint8)) and np.array_equal(s.numpy(), rs)


def main():
    rng = np.random.default_rng(0)
    copy = copy_bandwidth_row().gbps
    print(f"copy bandwidth: {copy:.0f} GB/s")
    cases = [("token", dt.bfloat16, (16384, 7168)), ("token", dt.bfloat16, (4096, 7168)),
             ("token", dt.float32, (8192, 7168)), ("block", dt.bfloat16, (7168, 16384)),
             ("block", dt.bfloat16, (24576, 1536)), ("block", dt.float32, (7168, 16384))]
    variants = {"token": [(256, 4, 0), (256, 4, 1), (256, 4, 2), (256, 4, 4), (512, 4, 1), (256, 8, 1)],
                "block": [(256, 4, 0), (512, 4, 0)]}
    rows = []
    for kind, dtype, (m, k) in cases:
        host = rng.standard_normal((m, k), dtype=np.float32).astype(dtype.numpy)
        nbytes = m * k * (dtype.itemsize + 1)
        n = sets_beyond_l2(nbytes)
        xs = [DeviceArray.from_numpy(host) for _ in range(n)]
        outs = [outputs(kind, m, k) for _ in range(n)]
        for threads, unroll, waves in variants[kind]:
            ok = correct(kind, dtype, threads, unroll, rng)
            us = time_us(lambda i: run(kind, dtype, threads, unroll, xs[i], *outs[i], waves), n)
            gbps = nbytes / us / 1e3
            rows.append(f"| {kind} | {dtype.name} {m}x{k} | {threads} | {unroll} | {waves or '-'} | "
                        f"{'ok' if ok else 'WRONG'} | {us:.1f} | {gbps:.0f} | {100 * gbps / copy:.0f}% |")
        xs = outs = None  # free this shape's buffers before the next
    print("| kernel | shape | threads | unroll | waves | bits | us | GB/s | % copy |\n"
          "|---|---|---:|---:|---:|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
