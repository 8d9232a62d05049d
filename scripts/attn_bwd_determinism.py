"""Attention backward determinism on the GPU: deterministic=True must give bitwise-identical dq, dk, dv over 20 runs
(a causal GQA case at S 4096 and a varlen case); the default mode's run-to-run differences and the deterministic
mode's cost (graph-timed, same rounds) are reported. Usage: python scripts/attn_bwd_determinism.py"""
import numpy as np
import torch

from cudart_kernels import attention, attention_backward
from cudart_kernels.bench import graph_times_us

RUNS = 20


def case(name, q, k, v, do, **kw):
    out, lse = attention(q, k, v, return_lse=True, **kw)
    grads = [torch.empty_like(x) for x in (q, k, v)]

    def run(det):
        attention_backward(do, q, k, v, out, lse, deterministic=det, dq=grads[0], dk=grads[1], dv=grads[2],
                           stream=torch.cuda.current_stream(), **kw)
        return [g.clone() for g in grads]

    ref = run(True)
    same = all(all(torch.equal(a, b) for a, b in zip(ref, run(True))) for _ in range(RUNS - 1))
    base = run(False)
    diffs = [max((a.float() - b.float()).abs().max().item() for a, b in zip(base, run(False))) for _ in range(RUNS - 1)]
    differing = sum(d > 0 for d in diffs)
    scale = max(g.float().abs().max().item() for g in base)
    times = graph_times_us(torch, [lambda i, st: attention_backward(do, q, k, v, out, lse, dq=grads[0], dk=grads[1],
                                                                    dv=grads[2], stream=st, **kw),
                                   lambda i, st: attention_backward(do, q, k, v, out, lse, deterministic=True,
                                                                    dq=grads[0], dk=grads[1], dv=grads[2], stream=st,
                                                                    **kw)], 1, iters=10)
    print(f"| {name} | {'yes' if same else 'NO'} | {differing} of {RUNS - 1} | {max(diffs):.3g} (max |grad| "
          f"{scale:.3g}) | {times[0]:.0f} | {times[1]:.0f} | {times[1] / times[0]:.2f} |", flush=True)
    return same


def main():
    torch.manual_seed(0)
    print("| case | deterministic: 20 runs bitwise equal | default: runs differing from the first | default: max "
          "abs difference | default us | deterministic us | cost |")
    print("|---|---|---|---|---:|---:|---:|")
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    ok = case("S 4096 D 128 causal GQA 32/8, batch 2", mk(2, 4096, 32, 128), mk(2, 4096, 8, 128),
              mk(2, 4096, 8, 128), mk(2, 4096, 32, 128), causal=True)
    lens = [1, 4096, 777, 2048, 3000, 129, 1]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), device="cuda", dtype=torch.int32)
    n = sum(lens)
    ok &= case(f"varlen {len(lens)} seqs 1..4096 ({n} tokens) D 128 causal GQA 16/4", mk(n, 16, 128),
               mk(n, 4, 128), mk(n, 4, 128), mk(n, 16, 128), causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
               max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    ok &= case("S 4096 D 64, batch 4, 32 heads", mk(4, 4096, 32, 64), mk(4, 4096, 32, 64), mk(4, 4096, 32, 64),
               mk(4, 4096, 32, 64))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
