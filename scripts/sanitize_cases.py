"""One small, tail-heavy case per kernel, for compute-sanitizer (memcheck, racecheck, synccheck)."""
import numpy as np

import cudart_kernels as ck
from cudart_kernels import reference as ref
from cudart_kernels.runtime.interop import DeviceArray

rng = np.random.default_rng(1)
for dtype in (ck.bfloat16, ck.float32):
    x = ref.random_activations(rng, 67, 264 if dtype is ck.bfloat16 else 260, dtype.numpy)
    q, s = ck.quantize_fp8_per_token(DeviceArray.from_numpy(x))
    assert np.array_equal(s.numpy(), ref.quantize_per_token(x)[1])
    w = ref.random_activations(rng, 131, 264, dtype.numpy)
    qw, sw = ck.quantize_fp8_per_block(DeviceArray.from_numpy(w))
    assert np.array_equal(sw.numpy(), ref.quantize_per_block(w)[1])
print("sanitize cases ran")
