"""cudart-kernels: hand-written Hopper kernels, compiled with NVRTC and launched through the CUDA driver API."""
__version__ = "0.1.0"

from .runtime.dtypes import bfloat16, float16, float32, float8_e4m3, float8_e5m2, int32, int64  # noqa: E402
from .runtime.compiler import CompileError  # noqa: E402
from .runtime.driver import CudaError, NoDeviceError  # noqa: E402
from .runtime.interop import DeviceArray, HostArrayError, as_array  # noqa: E402
from .ops.attention import attention  # noqa: E402
from .ops.attention_bwd import attention_backward  # noqa: E402
from .ops.gemm import gemm  # noqa: E402
from .ops.gemm_fp8 import (gemm_fp8, gemm_fp8_grouped_contiguous, gemm_fp8_grouped_masked,  # noqa: E402
                           gemm_fp8_wgrad)
from .ops.quantize import quantize_fp8_per_block, quantize_fp8_per_token  # noqa: E402

__all__ = [
    "__version__", "DeviceArray", "as_array", "CompileError", "CudaError", "HostArrayError", "NoDeviceError",
    "attention", "attention_backward", "gemm", "gemm_fp8", "gemm_fp8_grouped_contiguous", "gemm_fp8_grouped_masked",
    "gemm_fp8_wgrad",
    "quantize_fp8_per_token", "quantize_fp8_per_block",
    "float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2", "int32", "int64",
]
