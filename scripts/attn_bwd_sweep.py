"""Time attention backward variants against cuDNN's backward in the same graph-timed rounds (how AttnBwdTuning was
fitted).

    python scripts/attn_bwd_sweep.py --d 128 --s 4096 16384 --causal 0 1 --variant base \
        --variant "st3:tiles=((64,(128,128,2)),(128,(64,128,3)),(256,(64,64,2)))" --variant "exp:+SOME_DEFINE=1"

A variant is NAME[:ITEM[;ITEM...]] over the default AttnBwdTuning: FIELD=PYTHON_VALUE sets a tuning field,
+NAME=VALUE adds a compile-time define to the main kernel (for experiments on the kernel source). Prints one row
per shape: TFLOP/s of cuDNN and of each variant, with its speed against cuDNN (cuDNN time / ours). 16384 tokens,
hidden 2048 (the bench grid); --gqa H_Q/H_KV for grouped heads.
"""
from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass, replace

from cudart_kernels.bench import (ATTN_HIDDEN, ATTN_TOKENS, _sdpa, attention_flops, graph_stream, graph_times_us,
                                  torch_or_none)
from cudart_kernels.ops import attention as attn
from cudart_kernels.ops import attention_bwd as bwd


@dataclass(frozen=True)
class SweepTuning(bwd.AttnBwdTuning):
    defines: tuple = ()  # extra main-kernel defines, part of the plan key through the tuning


def _install_defines_hook():
    """Route SweepTuning.defines into the main kernel's compile defines (the plan is built with the tuning)."""
    plan, main_defines = bwd._plan, bwd._main_defines
    current = {}

    def _plan(arrays, dims, causal, scale, deterministic, tuning):
        current.clear()
        current.update(getattr(tuning, "defines", ()))
        try:
            return plan(arrays, dims, causal, scale, deterministic, tuning)
        finally:
            current.clear()

    bwd._plan = _plan
    bwd._main_defines = lambda *a: {**main_defines(*a), **current}


def parse_variant(text: str):
    name, _, rest = text.partition(":")
    fields, defines = {}, {}
    for item in filter(None, rest.split(";")):
        k, _, v = item.partition("=")
        if k.startswith("+"):
            defines[k[1:].strip()] = v.strip()
        else:
            fields[k.strip()] = ast.literal_eval(v.strip())
    return name, replace(SweepTuning(), **fields, defines=tuple(sorted(defines.items())))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="+", default=[128])
    ap.add_argument("--s", type=int, nargs="+", default=[4096])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--gqa", default="", help="H_Q/H_KV (default: H = 2048 / D, no grouping)")
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-peer", action="store_true", help="skip cuDNN (e.g. under a profiler)")
    args = ap.parse_args()
    _install_defines_hook()
    torch = torch_or_none()
    from torch.nn.attention import SDPBackend
    cudnn = _sdpa(torch, SDPBackend.CUDNN_ATTENTION)
    variants = [parse_variant(v) for v in (args.variant or ["base"])]
    print("| D | S | causal | cuDNN TF/s | " + " | ".join(f"{n} TF/s (x cuDNN)" for n, _ in variants) + " |")
    print("|---" * (4 + len(variants)) + "|")
    for d in args.d:
        for s in args.s:
            for causal in map(bool, args.causal):
                b = ATTN_TOKENS // s
                hq, hkv = map(int, args.gqa.split("/")) if args.gqa else (ATTN_HIDDEN // d,) * 2
                mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
                q, k, v, do = mk(hq), mk(hkv), mk(hkv), mk(hq)
                out, lse = attn.attention(q, k, v, causal=causal, return_lse=True)
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                runs = []
                if not args.no_peer:
                    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                    graph_stream(torch).wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(graph_stream(torch)):
                        og = cudnn(qg, kg, vg, causal, hq != hkv)
                    torch.cuda.synchronize()
                    dog = do.transpose(1, 2)
                    runs.append(lambda i, st: torch.autograd.grad(og, (qg, kg, vg), dog, retain_graph=True))
                for _, t in variants:
                    runs.append(lambda i, st, t=t: bwd.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                                          dq=dq, dk=dk, dv=dv, stream=st, tuning=t))
                times = graph_times_us(torch, runs, 1, iters=args.iters)
                if args.no_peer:
                    times = [float("nan")] + times
                fl = 2.5 * attention_flops(b, hq, s, s, d, causal) / 1e12
                cells = [f"{fl / (us * 1e-6):.0f} ({times[0] / us:.3f})" for us in times[1:]]
                print(f"| {d} | {s} | {int(causal)} | {fl / (times[0] * 1e-6):.0f} | " + " | ".join(cells) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
