"""`cudart-kernels selftest`: each op on fresh random data against the host reference, as a pass/fail table."""
from __future__ import annotations

import numpy as np

from .reference import quantize_per_block as ref_block
from .reference import quantize_per_token as ref_token
from .reference import random_activations
from .runtime.interop import DeviceArray


def _quant_case(fn, ref, m, k, dtype, rng, **kw):
    x = random_activations(rng, m, k, dtype)
    q, s = fn(DeviceArray.from_numpy(x), **kw)
    rq, rs = ref(x)
    q_ok = np.array_equal(q.numpy().view(np.uint8), rq.view(np.uint8))
    s_ok = np.array_equal(s.numpy(), rs)
    return q_ok and s_ok, f"q {'==' if q_ok else '!='} ref, scales {'==' if s_ok else '!='} ref"


def cases():
    from .ops.quantize import quantize_fp8_per_block, quantize_fp8_per_token

    out = []
    for dtype in ("bfloat16", "float16", "float32"):
        for m, k in ((1, 128), (77, 7168 + 8 * (dtype != "float32") + 4 * (dtype == "float32")), (4096, 1536)):
            out.append((f"quantize_fp8_per_token {dtype} {m}x{k}",
                        lambda rng, m=m, k=k, d=dtype: _quant_case(quantize_fp8_per_token, ref_token, m, k, d, rng)))
        for m, k in ((130, 264), (1024, 2048)):
            out.append((f"quantize_fp8_per_block {dtype} {m}x{k}",
                        lambda rng, m=m, k=k, d=dtype: _quant_case(quantize_fp8_per_block, ref_block, m, k, d, rng)))
    out.append(("quantize_fp8_per_token row-major scales 300x1000",
                lambda rng: _quant_case(quantize_fp8_per_token, ref_token, 300, 1000, "bfloat16", rng,
                                        scale_layout="rowmajor")))
    return out


def run() -> bool:
    rng = np.random.default_rng()
    results = []
    for name, case in cases():
        try:
            ok, detail = case(rng)
        except Exception as e:  # report and keep going
            ok, detail = False, f"{type(e).__name__}: {e}"
        results.append((name, ok, detail))
    width = max(len(n) for n, _, _ in results)
    print(f"{'case'.ljust(width)}  result  detail")
    for name, ok, detail in results:
        print(f"{name.ljust(width)}  {'PASS' if ok else 'FAIL'}    {detail}")
    passed = sum(ok for _, ok, _ in results)
    print(f"\n{passed} passed, {len(results) - passed} failed")
    return passed == len(results)
