"""Time attention tile / schedule variants against cuDNN in the same graph-timed rounds (how AttnTuning and
AttnBwdTuning were fitted).

    python scripts/attn_sweep.py --d 128 --s 4096 16384 --causal 0 1 --variant base \
        --variant "bn176:noncausal_tiles=((128,(128,176,2)),)" --variant "noob:o_buffer=False"
    python scripts/attn_sweep.py --bwd --d 256 --s 4096 --variant base --variant "exp:+SOME_DEFINE=1"

A variant is NAME[:ITEM[;ITEM...]] over the default tuning (AttnTuning, or AttnBwdTuning with --bwd):
FIELD=PYTHON_VALUE sets a tuning field; +NAME=VALUE adds a compile-time define to the kernel (for experiments on
its source). Prints one row per shape: TFLOP/s of cuDNN (its backward with --bwd) and of each variant, with the
variant's speed against cuDNN (cuDNN time / ours). 16384 tokens, hidden 2048 (the bench grid); --gqa H_Q/H_KV
for grouped heads.
"""
from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass, replace

from cudart_kernels.bench import (ATTN_HIDDEN, ATTN_TOKENS, _sdpa, attention_flops, graph_times_us,
                                  sdpa_backward_run, torch_or_none)
from cudart_kernels.ops import attention as fwd
from cudart_kernels.ops import attention_bwd as bwd


@dataclass(frozen=True)
class FwdSweep(fwd.AttnTuning):
    defines: tuple = ()  # extra kernel defines: part of the plan key through the tuning


@dataclass(frozen=True)
class BwdSweep(bwd.AttnBwdTuning):
    defines: tuple = ()


def _route_defines(module, defines_fn: str, plan_fn: str = "_plan"):
    """Add the tuning's `defines` to the kernel defines `module.defines_fn` returns while `module.plan_fn` (which
    gets the tuning as its last argument) builds a plan."""
    plan, make_defines = getattr(module, plan_fn), getattr(module, defines_fn)
    current = {}

    def planned(*args):
        current.clear()
        current.update(getattr(args[-1], "defines", ()))
        try:
            return plan(*args)
        finally:
            current.clear()

    setattr(module, plan_fn, planned)
    setattr(module, defines_fn, lambda *a: {**make_defines(*a), **current})


def parse_variant(text: str, base):
    name, _, rest = text.partition(":")
    fields, defines = {}, {}
    for item in filter(None, rest.split(";")):
        k, _, v = item.partition("=")
        if k.startswith("+"):
            defines[k[1:].strip()] = v.strip()
        else:
            fields[k.strip()] = ast.literal_eval(v.strip())
    return name, replace(base, **fields, defines=tuple(sorted(defines.items())))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bwd", action="store_true", help="the backward (default: the forward)")
    ap.add_argument("--d", type=int, nargs="+", default=[128])
    ap.add_argument("--s", type=int, nargs="+", default=[4096])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--gqa", default="", help="H_Q/H_KV (default: H = 2048 / D, no grouping)")
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if args.bwd:
        _route_defines(bwd, "_main_defines")
    else:
        _route_defines(fwd, "_defines")
    torch = torch_or_none()
    from torch.nn.attention import SDPBackend
    cudnn = _sdpa(torch, SDPBackend.CUDNN_ATTENTION)
    variants = [parse_variant(v, BwdSweep() if args.bwd else FwdSweep()) for v in (args.variant or ["base"])]
    print("| D | S | causal | cuDNN TF/s | " + " | ".join(f"{n} TF/s (x cuDNN)" for n, _ in variants) + " |")
    print("|---" * (4 + len(variants)) + "|")
    for d in args.d:
        for s in args.s:
            for causal in map(bool, args.causal):
                b = ATTN_TOKENS // s
                hq, hkv = map(int, args.gqa.split("/")) if args.gqa else (ATTN_HIDDEN // d,) * 2
                mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
                q, k, v, do = mk(hq), mk(hkv), mk(hkv), mk(hq)
                if args.bwd:
                    out, lse = fwd.attention(q, k, v, causal=causal, return_lse=True)
                    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                    runs = [sdpa_backward_run(torch, cudnn, q, k, v, do, causal, hq != hkv)]
                    runs += [lambda i, st, t=t: bwd.attention_backward(do, q, k, v, out, lse, causal=causal, dq=dq,
                                                                       dk=dk, dv=dv, stream=st, tuning=t)
                             for _, t in variants]
                else:
                    runs = [lambda i, st: cudnn(q, k, v, causal, hq != hkv)]
                    runs += [lambda i, st, t=t: fwd.attention(q, k, v, causal=causal, out=do, stream=st, tuning=t)
                             for _, t in variants]
                times = graph_times_us(torch, runs, 1, iters=args.iters)
                fl = (2.5 if args.bwd else 1.0) * attention_flops(b, hq, s, s, d, causal) / 1e12
                cells = [f"{fl / (us * 1e-6):.0f} ({times[0] / us:.3f})" for us in times[1:]]
                print(f"| {d} | {s} | {int(causal)} | {fl / (times[0] * 1e-6):.0f} | " + " | ".join(cells) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
