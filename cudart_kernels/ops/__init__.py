"""One module per kernel family. VARIANTS lists, per op name, every kernel variant the library can launch for its
benchmark shape sets (what `cudart-kernels compile` builds and the CPU tests check)."""
from . import attention, attention_bwd, gemm, gemm_fp8, quantize

VARIANTS = {"quant": quantize.variants, "gemm": gemm.variants, "gemm_fp8": gemm_fp8.variants,
            "attention": attention.variants, "attention_bwd": attention_bwd.variants}
