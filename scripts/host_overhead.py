"""Where the host time of one op call goes (cached config): raw cuLaunchKernelEx, our prepared Launcher, the
whole op with DeviceArray and with torch operands. Median of batch means, several rounds to show the spread."""
import numpy as np
from cuda.bindings import driver as cu

import cudart_kernels as ck
from cudart_kernels.bench import host_overhead_us
from cudart_kernels.ops import quantize as qm
from cudart_kernels.runtime.driver import use_device
from cudart_kernels.runtime.interop import DeviceArray


def main():
    rng = np.random.default_rng(0)
    x = DeviceArray.from_numpy(rng.standard_normal((128, 7168), dtype=np.float32), "bf16")
    q, s = ck.quantize_fp8_per_token(x)
    key = next(iter(qm._plans))
    launch, grid, args = qm._plans[key]
    cfg, fn, addr = launch._slots.config, launch._handle, launch._slots.address
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cases = {
        "cuLaunchKernelEx (prepared config + params)": lambda: cu.cuLaunchKernelEx(cfg, fn, addr, 0),
        "use_device (cuCtxGetCurrent)": lambda: use_device(0),
        "Launcher.__call__": lambda: launch(grid, 0, x.ptr, args[0], q.ptr, args[1], s.ptr, *args[2:]),
        "quantize_fp8_per_token, DeviceArray in/out": lambda: ck.quantize_fp8_per_token(x, out=q, out_scales=s),
    }
    try:
        import torch
        tx, tq, ts = (torch.from_dlpack(a) for a in (x, q, s))
        cases["quantize_fp8_per_token, torch in/out"] = lambda: ck.quantize_fp8_per_token(tx, out=tq, out_scales=ts)
        cases["as_array(torch tensor)"] = lambda: ck.as_array(tx)
    except ImportError:
        pass
    rounds = {name: [host_overhead_us(f) for _ in range(3)] for name, f in cases.items()}
    print("| call | median us (3 rounds) |\n|---|---|")
    for name, r in rounds.items():
        print(f"| {name} | {' / '.join(f'{v:.2f}' for v in r)} |")


if __name__ == "__main__":
    use_device(0)
    main()
