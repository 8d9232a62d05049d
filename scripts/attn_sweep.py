"""Time attention tile / schedule variants against cuDNN in the same graph-timed rounds (how AttnTuning was fitted).

    python scripts/attn_sweep.py --d 128 --s 4096 16384 --causal 0 1 --variant base \
        --variant "bn176:noncausal_tiles=((128,(128,176,2)),)" --variant "noob:o_buffer=False"

A variant is NAME[:FIELD=PYTHON_VALUE[;FIELD=...]] over the default AttnTuning. Prints one row per shape: TFLOP/s
of each variant and cuDNN, and each variant's speed against cuDNN. 16384 tokens, hidden 2048 (the bench grid).
"""
from __future__ import annotations

import argparse
import ast
from dataclasses import replace

from cudart_kernels.bench import ATTN_HIDDEN, ATTN_TOKENS, _sdpa, attention_flops, graph_times_us, torch_or_none
from cudart_kernels.ops import attention as attn


def parse_variant(text: str):
    name, _, rest = text.partition(":")
    fields = {}
    for item in filter(None, rest.split(";")):
        k, _, v = item.partition("=")
        fields[k.strip()] = ast.literal_eval(v.strip())
    return name, replace(attn.TUNING, **fields)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="+", default=[128])
    ap.add_argument("--s", type=int, nargs="+", default=[4096])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    torch = torch_or_none()
    from torch.nn.attention import SDPBackend
    cudnn = _sdpa(torch, SDPBackend.CUDNN_ATTENTION)
    variants = [parse_variant(v) for v in (args.variant or ["base"])]
    print("| D | S | causal | cuDNN TF/s | " + " | ".join(f"{n} TF/s (x cuDNN)" for n, _ in variants) + " |")
    print("|---" * (4 + len(variants)) + "|")
    for d in args.d:
        for s in args.s:
            for causal in map(bool, args.causal):
                b, h = ATTN_TOKENS // s, ATTN_HIDDEN // d
                q, k, v, o = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                runs = [lambda i, st: cudnn(q, k, v, causal)]
                for _, t in variants:
                    runs.append(lambda i, st, t=t: attn.attention(q, k, v, causal=causal, out=o, stream=st, tuning=t))
                times = graph_times_us(torch, runs, 1, iters=args.iters)
                fl = attention_flops(b, h, s, s, d, causal) / 1e12
                cells = [f"{fl / (us * 1e-6):.0f} ({times[0] / us:.3f})" for us in times[1:]]
                print(f"| {d} | {s} | {int(causal)} | {fl / (times[0] * 1e-6):.0f} | " + " | ".join(cells) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
