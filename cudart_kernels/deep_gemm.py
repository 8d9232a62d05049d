"""DeepGEMM's Python API on cudart_kernels' kernels: `import cudart_kernels.deep_gemm as deep_gemm`.

The calls, argument names and defaults follow DeepGEMM as shipped in `sgl-deep-gemm` 0.1.5.post1, for what runs on
Hopper with FP32 scales:

- `fp8_gemm_nt` (and `_nn` / `_tn` / `_tt`): D = C + A @ B^T. The default recipe (1, 128, 128) (sA per 1x128
  group of a row, sB per 128x128 block) writes a bf16 D and takes no C; recipe (1, 1, 128) (1x128 groups on
  both sides) accumulates into an fp32 D, as DeepGEMM's SM90 kernels do.
- `m_grouped_fp8_gemm_nt_contiguous` (per-row expert ids with -1 for padding, or `use_psum_layout`),
  `m_grouped_fp8_gemm_nt_masked`, and `k_grouped_fp8_gemm_nt_contiguous` (the MoE weight gradient).
- `bf16_gemm_nt` / `_nn` / `_tn` / `_tt`, the FP8 casts of `deep_gemm.utils` (`per_token_cast_to_fp8`,
  `per_block_cast_to_fp8`, `per_channel_cast_to_fp8`), the scale-layout helpers, and the runtime settings.

Everything runs on torch's current stream for torch tensors, as DeepGEMM does (the ops' stream=None), and writes
the given outputs in place. What differs: padding rows of the contiguous layout (-1) and rows past masked_m are left
as they were (DeepGEMM writes the products of the padding rows that share a block with real rows); scales may come
in any layout; the K-grouped GEMM runs one launch per non-empty group. Features DeepGEMM has only on SM100 (UE8M0
scales, FP4, MN-major operands, 32-wide K groups) raise NotImplementedError naming them; DeepGEMM functions this
module does not provide raise AttributeError saying so. Imports no torch until a call needs it.
"""
from __future__ import annotations

import math
from dataclasses import replace

from .ops.gemm import TUNING as _GEMM_TUNING
from .ops.gemm import gemm
from .ops.gemm_fp8 import TUNING as _FP8_TUNING
from .ops.gemm_fp8 import gemm_fp8, gemm_fp8_grouped_contiguous, gemm_fp8_grouped_masked, gemm_fp8_wgrad
from .ops.quantize import mmajor_stride, quantize_fp8_per_block, quantize_fp8_per_token

_BLOCK_B = (1, 128, 128)  # sA 1x128 per token, sB 128x128 per block: the default
_ROW_B = (1, 1, 128)      # 1x128 groups on both sides: the accumulating fp32 GEMM, the weight gradient
_ALIGNMENTS = (64, 128, 256)  # segment alignments the contiguous kernel takes
_settings = {"mk_alignment": 128, "fp8": _FP8_TUNING, "bf16": _GEMM_TUNING}


# ---- small helpers on any array type (torch in practice) ------------------------------------------------------

def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    return ceil_div(x, y) * y


def _dtype(x) -> str:
    """'float32', 'bfloat16', 'float8_e4m3fn', ... for torch, numpy and cupy arrays alike."""
    return str(getattr(x, "dtype", type(x).__name__)).rsplit(".", 1)[-1]


def _strides(x) -> tuple:
    """Strides in elements."""
    s = getattr(x, "stride", None)
    return tuple(s()) if callable(s) else tuple(b // x.itemsize for b in x.strides)


def _ptr(x) -> int:
    if hasattr(x, "data_ptr"):
        return x.data_ptr()
    for attr in ("__cuda_array_interface__", "__array_interface__"):
        iface = getattr(x, attr, None)
        if iface:
            return iface["data"][0]
    return id(x)


def _is_torch(x) -> bool:
    return type(x).__module__.partition(".")[0] == "torch"


def _swap(x):
    """The last two dimensions swapped (a view)."""
    return x.swapaxes(-2, -1)


def _shape(x, ndim: int, name: str) -> tuple:
    shape = tuple(x.shape)
    if len(shape) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {shape}")
    return shape


def _pair(x, name: str):
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
        raise TypeError(f"{name}: pass a (tensor, scales) pair; FP8 operands without block scales (per-tensor "
                        "scaling) are not supported")
    data, sf = x
    if _dtype(data) in ("int8", "uint8", "float4_e2m1fn_x2"):
        raise NotImplementedError(f"{name}: packed FP4 operands ({_dtype(data)}) are DeepGEMM's SM100 FP8xFP4 "
                                  "GEMM; these SM90 kernels take float8_e4m3fn")
    if _dtype(sf) in ("int32", "int"):
        raise NotImplementedError(f"{name}: packed UE8M0 scales (int32) are DeepGEMM's SM100 format; these SM90 "
                                  "kernels take float32 scales")
    return data, sf


def _unit_k_stride(x) -> bool:
    return x.shape[-1] <= 1 or math.prod(x.shape) == 0 or _strides(x)[-1] == 1


def _k_major(x, name: str) -> None:
    if not _unit_k_stride(x):
        raise NotImplementedError(f"{name} is not K-major (strides {_strides(x)}): the SM90 FP8 GEMMs read A and B "
                                  "with unit stride along K, as DeepGEMM's SM90 kernels do (MN-major operands, "
                                  "the nn / tn / tt forms of contiguous tensors, are SM100 features)")


def _recipe(recipe, recipe_a, recipe_b) -> tuple:
    """The (A rows, B rows, K) scale granularity of a call, checked against what runs on SM90."""
    if recipe_a is not None or recipe_b is not None:
        if recipe is not None or recipe_a is None or recipe_b is None:
            raise ValueError("pass either recipe or both recipe_a and recipe_b")
        if recipe_a[1] != recipe_b[1]:
            raise NotImplementedError(f"different K groups for A and B (recipe_a={tuple(recipe_a)}, "
                                      f"recipe_b={tuple(recipe_b)}) are an SM100 feature")
        recipe = (recipe_a[0], recipe_b[0], recipe_a[1])
    recipe = _BLOCK_B if recipe is None else tuple(recipe)
    if recipe not in (_BLOCK_B, _ROW_B):
        raise NotImplementedError(f"recipe {recipe}: SM90 FP32 scales come as (1, 128, 128) (1x128 per token for "
                                  "A, 128x128 per block for B) or (1, 1, 128) (1x128 for both)")
    return recipe


def _same_memory(c, d) -> bool:
    if c is not d and _ptr(c) != _ptr(d):
        return False
    if tuple(c.shape) != tuple(d.shape) or _strides(c) != _strides(d):
        raise ValueError("c and d share memory but differ in shape or strides")
    return True


def _check_c(c, d) -> None:
    if _dtype(d) != "float32" or (c is not None and _dtype(c) != "float32"):
        raise NotImplementedError(f"accumulation needs an fp32 d and c (got d {_dtype(d)}"
                                  f"{'' if c is None else ', c ' + _dtype(c)})")
    if c is not None and tuple(c.shape) != tuple(d.shape):
        raise ValueError(f"c has shape {tuple(c.shape)} but d has {tuple(d.shape)}")


def _start_from(d, c) -> None:
    """d = c (zeros when c is None), on the framework's current stream: the kernels then add to d."""
    if c is None:
        d[...] = 0
    elif not _same_memory(c, d):
        d[...] = c


def _trivial(m: int, n: int, k: int, d, c) -> bool:
    """DeepGEMM's empty problems: nothing to do when M or N is 0; D = C (or zeros) when K is 0."""
    if m == 0 or n == 0:
        return True
    if k == 0:
        _start_from(d, c)
        return True
    return False


# ---- dense FP8 GEMMs ------------------------------------------------------------------------------------------

def fp8_gemm_nt(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="",
                disable_ue8m0_cast=False) -> None:
    """D = C + A @ B^T with A = (a [M, K] e4m3, sA fp32) and B = (b [N, K] e4m3, sB fp32), both K-major.

    recipe (1, 128, 128) (the default): sA [M, ceil(K/128)], sB [ceil(N/128), ceil(K/128)], d [M, N] bf16, no c.
    recipe (1, 1, 128): sA [M, K/128], sB [N, K/128], d [M, N] fp32, D = C + A @ B^T (c None: D = A @ B^T; c may
    be d itself), K a multiple of 128. Scales in any layout. `compiled_dims` and `disable_ue8m0_cast` are
    accepted and have no effect here (the kernels are compiled per tile configuration; SM90 scales stay fp32).
    """
    (a, sa), (b, sb) = _pair(a, "a"), _pair(b, "b")
    recipe = _recipe(recipe, recipe_a, recipe_b)
    _k_major(a, "a")
    _k_major(b, "b")
    m, k = _shape(a, 2, "a")
    n, _ = _shape(b, 2, "b")
    if _shape(d, 2, "d") != (m, n):
        raise ValueError(f"d: expected shape {(m, n)}, got {tuple(d.shape)}")
    if recipe == _BLOCK_B:
        if c is not None or _dtype(d) != "bfloat16":
            raise NotImplementedError("with recipe (1, 128, 128) the SM90 GEMM writes a bf16 d and takes no c; "
                                      "pass recipe=(1, 1, 128) with 1x128 scales for B to accumulate into fp32")
        if not _trivial(m, n, k, d, None):
            gemm_fp8(a, sa, b, sb, out=d, tuning=_settings["fp8"])
        return
    _check_c(c, d)
    if k % 128:
        raise ValueError(f"recipe (1, 1, 128): K must be a multiple of 128, got {k}")
    _check_row_scales(((a, sa, m, "a"), (b, sb, n, "b")), k)
    if not _trivial(m, n, k, d, c):
        _start_from(d, c)
        gemm_fp8_wgrad(a, sa, b, sb, d[None], [k], tuning=_settings["fp8"])


def _check_row_scales(operands, k: int) -> None:
    """What the accumulating kernel would reject, checked before d is touched: e4m3 data, [rows, K/128] scales."""
    for x, sx, rows, name in operands:
        if _dtype(x) != "float8_e4m3fn":
            raise TypeError(f"{name}: expected float8_e4m3fn, got {_dtype(x)}")
        if tuple(sx.shape) != (rows, k // 128) or _dtype(sx) != "float32":
            raise ValueError(f"{name}'s scales: expected float32 of shape {(rows, k // 128)}, got {_dtype(sx)} of "
                             f"shape {tuple(sx.shape)}")


def fp8_gemm_nn(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="",
                disable_ue8m0_cast=False) -> None:
    """D = C + A @ B with B given as [K, N] (and sB transposed): B must be K-major, i.e. a transposed view."""
    b, sb = _pair(b, "b")
    fp8_gemm_nt(a, (_swap(b), _swap(sb)), d, c, recipe, recipe_a, recipe_b, compiled_dims, disable_ue8m0_cast)


def fp8_gemm_tn(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="",
                disable_ue8m0_cast=False) -> None:
    """D = C + A^T @ B with A [K, M] and B [K, N]: both must be K-major, i.e. transposed views."""
    (a, sa), (b, sb) = _pair(a, "a"), _pair(b, "b")
    fp8_gemm_nt((_swap(a), _swap(sa)), (_swap(b), _swap(sb)), d, c, recipe, recipe_a, recipe_b, compiled_dims,
                disable_ue8m0_cast)


def fp8_gemm_tt(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="",
                disable_ue8m0_cast=False) -> None:
    """D = C + A^T @ B^T with A [K, M]: A must be K-major, i.e. a transposed view."""
    a, sa = _pair(a, "a")
    fp8_gemm_nt((_swap(a), _swap(sa)), b, d, c, recipe, recipe_a, recipe_b, compiled_dims, disable_ue8m0_cast)


# ---- grouped FP8 GEMMs ----------------------------------------------------------------------------------------

def _block_recipe_only(recipe, recipe_a, recipe_b, what: str) -> None:
    if _recipe(recipe, recipe_a, recipe_b) != _BLOCK_B:
        raise NotImplementedError(f"{what} takes recipe (1, 128, 128) on SM90 (128x128 scales for B)")


def m_grouped_fp8_gemm_nt_contiguous(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None,
                                     compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
                                     ensure_zero_padding=True, expected_m_for_psum_layout=None) -> None:
    """MoE prefill: d[r] = a[r] @ b[g]^T for the rows r of expert g, bf16.

    a: ([M, K] e4m3, [M, ceil(K/128)] fp32), b: ([G, N, K] e4m3, [G, ceil(N/128), ceil(K/128)] fp32), d [M, N]
    bf16. grouped_layout: [M] int32 on the GPU, each row's expert or -1 for padding, every expert's segment starting
    at a multiple of get_mk_alignment_for_contiguous_layout(); or with use_psum_layout, [G] int32 where expert g's
    rows end at grouped_layout[g] and start at grouped_layout[g - 1] rounded up to that alignment (converted on
    the GPU, no host sync). Padding rows of d are not written. `ensure_zero_padding` and the expected M are
    performance hints that have no effect here.
    """
    (a, sa), (b, sb) = _pair(a, "a"), _pair(b, "b")
    _block_recipe_only(recipe, recipe_a, recipe_b, "the m-grouped contiguous GEMM")
    _k_major(a, "a")
    _k_major(b, "b")
    if expected_m_for_psum_layout is not None and not use_psum_layout:
        raise ValueError("expected_m_for_psum_layout is for use_psum_layout=True only")
    m, _ = _shape(a, 2, "a")
    groups, _, _ = _shape(b, 3, "b")
    if m == 0:
        return
    alignment = _settings["mk_alignment"]
    if use_psum_layout:
        if tuple(grouped_layout.shape) != (groups,):
            raise ValueError(f"use_psum_layout: grouped_layout must be [G] = [{groups}], got "
                             f"{tuple(grouped_layout.shape)}")
        grouped_layout = _psum_to_m_indices(grouped_layout, m, alignment)
    gemm_fp8_grouped_contiguous(a, sa, b, sb, grouped_layout, out=d, alignment=alignment, tuning=_settings["fp8"])


def m_grouped_fp8_gemm_nn_contiguous(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None,
                                     compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
                                     ensure_zero_padding=True) -> None:
    """The contiguous GEMM with b given as [G, K, N]: B must be K-major, i.e. a transposed view."""
    b, sb = _pair(b, "b")
    m_grouped_fp8_gemm_nt_contiguous(a, (_swap(b), _swap(sb)), d, grouped_layout, recipe, recipe_a, recipe_b,
                                     compiled_dims, disable_ue8m0_cast, use_psum_layout, ensure_zero_padding)


def _psum_to_m_indices(psum, m: int, alignment: int):
    """DeepGEMM's psum layout as the per-row expert ids the kernel reads (-1: a row of no expert), on psum's
    device."""
    if not _is_torch(psum):
        raise TypeError("use_psum_layout needs torch tensors")
    import torch
    ends = psum.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), (ends[:-1] + alignment - 1) // alignment * alignment])
    rows = torch.arange(m, device=psum.device)
    group = torch.searchsorted(ends, rows, right=True)  # the first expert whose rows end past this row
    inside = (group < len(ends)) & (rows >= starts[group.clamp(max=len(ends) - 1)])
    return torch.where(inside, group, -1).to(torch.int32)


def m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m, recipe=None, recipe_a=None, recipe_b=None,
                                 compiled_dims="nk", disable_ue8m0_cast=False) -> None:
    """MoE decode: d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g]^T, bf16.

    a: ([G, M, K] e4m3, [G, M, ceil(K/128)] fp32), b: ([G, N, K] e4m3, [G, ceil(N/128), ceil(K/128)] fp32),
    d [G, M, N] bf16, masked_m [G] int32 on the GPU (read by the kernel: no host sync). Rows past masked_m[g]
    are not written. expected_m (a host hint, must be positive: the rows a group typically holds) picks the tiles.
    sA in DeepGEMM's per-group layout is copied into one whose groups follow each other (one small copy).
    """
    (a, sa), (b, sb) = _pair(a, "a"), _pair(b, "b")
    _block_recipe_only(recipe, recipe_a, recipe_b, "the m-grouped masked GEMM")
    _k_major(a, "a")
    _k_major(b, "b")
    if int(expected_m) <= 0:
        raise ValueError(f"expected_m must be positive, got {expected_m}")
    gemm_fp8_grouped_masked(a, _groups_back_to_back(sa), b, sb, masked_m, out=d, expected_m=int(expected_m),
                            tuning=_settings["fp8"])


def _groups_back_to_back(sa):
    """[G, M, KB] scales whose groups do not follow each other in memory (DeepGEMM's per-group M-major layout)
    copied into [G * M, KB] M-major with 16-byte aligned columns, the layout the masked kernel reads in place."""
    shape = tuple(sa.shape)
    if len(shape) != 3 or shape[0] < 2 or _strides(sa)[0] == shape[1] * _strides(sa)[1] or not _is_torch(sa):
        return sa
    g, m, kb = shape
    import torch
    out = torch.empty_strided(shape, (m, 1, mmajor_stride(g * m)), dtype=sa.dtype, device=sa.device)
    out.copy_(sa)
    return out


# ---- the K-grouped weight gradient ----------------------------------------------------------------------------

def k_grouped_fp8_gemm_nt_contiguous(a, b, d, ks, grouped_layout, c=None, recipe=(1, 1, 128), compiled_dims="mn",
                                     use_psum_layout=False) -> None:
    """MoE weight gradient: d[g] = c[g] + A_g @ B_g^T in fp32, where group g has ks[g] columns of K.

    a: (flat e4m3 of sum(ks) x M values, group g's [M, ks[g]] row-major block after the previous groups' blocks;
    [M, sum(ks)/128] fp32 scales, group g's columns after the previous groups'), b likewise with N; d [G, M, N]
    fp32; c [G, M, N] fp32 (may be d itself; None: D = A_g @ B_g^T); ks: the host list, each a multiple of 128
    (0 allowed). grouped_layout (the device copy of ks) is not read. One launch per non-empty group.
    """
    (a, sa), (b, sb) = _pair(a, "a"), _pair(b, "b")
    if tuple(recipe) != _ROW_B:
        raise NotImplementedError(f"recipe {tuple(recipe)}: the SM90 K-grouped GEMM takes (1, 1, 128)")
    if use_psum_layout:
        raise NotImplementedError("use_psum_layout for the K-grouped GEMM is an SM100 feature")
    ks = [int(x) for x in ks]
    groups, m, n = _shape(d, 3, "d")
    _check_c(c, d)
    if len(ks) != groups:
        raise ValueError(f"ks has {len(ks)} groups but d has {groups}")
    if any(x < 0 or x % 128 for x in ks):
        raise ValueError(f"ks: each group's K must be a non-negative multiple of 128, got {ks}")
    total = sum(ks)
    for x, rows, name in ((a, m, "a"), (b, n, "b")):
        if math.prod(x.shape) != total * rows:
            raise ValueError(f"{name} holds {math.prod(x.shape)} values, not sum(ks) x {rows} = {total * rows}")
        if any(s != math.prod(x.shape[i + 1:]) for i, s in enumerate(_strides(x)) if x.shape[i] > 1):
            raise ValueError(f"{name} must be contiguous, got strides {_strides(x)}")
    _check_row_scales(((a, sa, m, "a"), (b, sb, n, "b")), total)
    if _trivial(m, n, total, d, c):
        return
    _start_from(d, c)
    a, b = a.reshape(-1), b.reshape(-1)
    start, tuning = 0, _settings["fp8"]
    for g, kg in enumerate(ks):
        if kg:
            cols = slice(start // 128, (start + kg) // 128)
            gemm_fp8_wgrad(a[start * m:(start + kg) * m].reshape(m, kg), sa[:, cols],
                           b[start * n:(start + kg) * n].reshape(n, kg), sb[:, cols], d[g:g + 1], [kg],
                           tuning=tuning)
        start += kg


def k_grouped_fp8_gemm_tn_contiguous(a, b, d, ks, grouped_layout, c=None, recipe=(1, 1, 128), compiled_dims="mn",
                                     use_psum_layout=False) -> None:
    """DeepGEMM's SM100 form of the K-grouped GEMM (MN-major operands): not supported on SM90."""
    raise NotImplementedError("k_grouped_fp8_gemm_tn_contiguous (MN-major A and B) is DeepGEMM's SM100 form; on "
                              "SM90 use k_grouped_fp8_gemm_nt_contiguous with K-major groups")


# ---- BF16 dense GEMMs -----------------------------------------------------------------------------------------

def bf16_gemm_nt(a, b, d, c=None, compiled_dims="") -> None:
    """D = C + A @ B^T, a [M, K] and b [N, K] bf16, d [M, N] bf16 or fp32 (c [M, N], may be d). A must be
    K-major; B either K-major or N-major (a transposed view of a [K, N] tensor)."""
    if not _unit_k_stride(a):
        raise NotImplementedError(f"a is not K-major (strides {_strides(a)}): the BF16 GEMM reads A with unit "
                                  "stride along K (M-major A, the tn / tt forms of contiguous tensors, is not "
                                  "supported)")
    m, k = _shape(a, 2, "a")
    n, _ = _shape(b, 2, "b")
    b_layout = "nk"
    if not _unit_k_stride(b):
        b, b_layout = _swap(b), "kn"  # an N-major B is a row-major [K, N]
    if not _trivial(m, n, k, d, c):
        gemm(a, b, out=d, c=c, b_layout=b_layout, tuning=_settings["bf16"])


def bf16_gemm_nn(a, b, d, c=None, compiled_dims="") -> None:
    """D = C + A @ B with b [K, N]."""
    bf16_gemm_nt(a, _swap(b), d, c)


def bf16_gemm_tn(a, b, d, c=None, compiled_dims="") -> None:
    """D = C + A^T @ B with a [K, M] (must be a transposed view) and b [K, N]."""
    bf16_gemm_nt(_swap(a), _swap(b), d, c)


def bf16_gemm_tt(a, b, d, c=None, compiled_dims="") -> None:
    """D = C + A^T @ B^T with a [K, M] (must be a transposed view) and b [N, K]."""
    bf16_gemm_nt(_swap(a), b, d, c)


# ---- scale layouts --------------------------------------------------------------------------------------------

def get_tma_aligned_size(mn: int, element_size: int) -> int:
    """mn rounded up so that a column of that many elements is a multiple of 16 bytes (TMA)."""
    if 16 % element_size:
        raise ValueError(f"element_size must divide 16, got {element_size}")
    return align(mn, 16 // element_size)


def mn_major_strides(shape: tuple, element_size: int = 4) -> tuple:
    """Strides of [MN, KB] or [G, MN, KB] scales laid out MN-major with TMA-aligned columns."""
    *lead, mn, kb = shape
    col = get_tma_aligned_size(mn, element_size)
    return ((col * kb,) if lead else ()) + (1, col)


def get_mn_major_tma_aligned_tensor(sf):
    """sf ([MN, KB] or [G, MN, KB] fp32) in the MN-major TMA-aligned layout (mn_major_strides): itself when it
    already is, else a copy (torch or numpy)."""
    shape = tuple(sf.shape)
    if len(shape) not in (2, 3):
        raise ValueError(f"sf: expected 2 or 3 dimensions, got shape {shape}")
    strides = mn_major_strides(shape, sf.itemsize)
    if all(s == t or n == 1 for s, t, n in zip(_strides(sf), strides, shape)):
        return sf
    if _is_torch(sf):
        import torch
        out = torch.empty_strided(shape, strides, dtype=sf.dtype, device=sf.device)
    else:
        import numpy as np
        span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        out = np.lib.stride_tricks.as_strided(np.empty(span, sf.dtype), shape,
                                              tuple(s * sf.itemsize for s in strides))
    out[...] = sf
    return out


def transform_sf_into_required_layout(sf, mn, k, recipe, num_groups=None, is_sfa=None, disable_ue8m0_cast=False):
    """Scales as the SM90 kernels read them: 1x128 groups MN-major and TMA-aligned, 128x128 blocks as they are.
    recipe is (MN, K) granularity, or (A rows, B rows, K) with is_sfa saying which side sf is."""
    recipe = tuple(recipe)
    if len(recipe) == 3:
        if is_sfa is None:
            raise ValueError("a 3-element recipe needs is_sfa")
        gran = (recipe[0] if is_sfa else recipe[1], recipe[2])
    elif is_sfa is not None:
        raise ValueError("is_sfa goes with a 3-element recipe only")
    else:
        gran = recipe
    if _dtype(sf) != "float32" or gran not in ((1, 128), (128, 128)):
        raise NotImplementedError(f"scales of {_dtype(sf)} with granularity {gran}: SM90 takes float32 scales "
                                  "per 1x128 or 128x128 (UE8M0 and 32-wide K groups are SM100 formats)")
    want = ((num_groups,) if num_groups is not None else ()) + (ceil_div(mn, gran[0]), ceil_div(k, gran[1]))
    if tuple(sf.shape) != want:
        raise ValueError(f"sf: expected shape {want}, got {tuple(sf.shape)}")
    return get_mn_major_tma_aligned_tensor(sf) if gran[0] == 1 else sf


def get_mk_alignment_for_contiguous_layout() -> int:
    return _settings["mk_alignment"]


def set_mk_alignment_for_contiguous_layout(new_value: int) -> None:
    """The row alignment of the contiguous layout's segments: 64, 128 (the default) or 256 (at 64 the kernel runs
    128-row tiles, at 128 and 256 up to 256 rows)."""
    if new_value not in _ALIGNMENTS:
        raise ValueError(f"alignment {new_value}: the contiguous kernel takes {', '.join(map(str, _ALIGNMENTS))}")
    _settings["mk_alignment"] = int(new_value)


def get_theoretical_mk_alignment_for_contiguous_layout(expected_m=None) -> int:
    return 128  # DeepGEMM's SM90 value


get_m_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout
get_k_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout


# ---- FP8 casts (deep_gemm.utils) ------------------------------------------------------------------------------

def _cast_options(use_ue8m0: bool, gran_k: int, packed: bool = False) -> None:
    if use_ue8m0 or packed:
        raise NotImplementedError("UE8M0 (power-of-two) scales: the quantizer writes plain fp32 scales")
    if gran_k != 128:
        raise NotImplementedError(f"gran_k={gran_k}: the quantizer makes 128-wide groups only")


def per_token_cast_to_fp8(x, use_ue8m0, gran_k=128, use_packed_ue8m0=False):
    """x [M, K] (bf16, fp16, fp32) -> (e4m3 [M, K], fp32 [M, ceil(K/128)] M-major), one scale per 1x128 group."""
    _cast_options(use_ue8m0, gran_k, use_packed_ue8m0)
    return quantize_fp8_per_token(x)


def per_block_cast_to_fp8(x, use_ue8m0, gran_k=128):
    """x [N, K] -> (e4m3 [N, K], fp32 [ceil(N/128), ceil(K/128)]), one scale per 128x128 block."""
    _cast_options(use_ue8m0, gran_k)
    return quantize_fp8_per_block(x)


def per_channel_cast_to_fp8(x, use_ue8m0, gran_k=128):
    """x [K, N] (K a multiple of 128, torch) -> (e4m3 [K, N], fp32 [K/128, N]): one scale per 128 rows of a
    column (the per-token cast of x^T, through one transposing copy each way)."""
    _cast_options(use_ue8m0, gran_k)
    if not _is_torch(x):
        raise TypeError("per_channel_cast_to_fp8 needs a torch tensor")
    k, _ = _shape(x, 2, "x")
    if k % 128:
        raise ValueError(f"x: rows must be a multiple of 128, got {k}")
    q, s = per_token_cast_to_fp8(_swap(x).contiguous(), False)
    return _swap(q).contiguous(), _swap(s)


# ---- runtime settings -----------------------------------------------------------------------------------------

def _device() -> int:
    import sys
    torch = sys.modules.get("torch")
    return torch.cuda.current_device() if torch is not None and torch.cuda.is_available() else 0


def get_num_sms() -> int:
    from .runtime.driver import device_properties, require_gpu
    require_gpu()
    return device_properties(_device()).sm_count


def set_num_sms(new_num_sms: int) -> None:
    if int(new_num_sms) != get_num_sms():
        raise NotImplementedError(f"set_num_sms({new_num_sms}): the kernels' persistent grids use every SM "
                                  f"({get_num_sms()}); limiting them is not supported")


def get_pdl() -> bool:
    return _settings["fp8"].pdl


def set_pdl(new_value: bool) -> None:
    """Programmatic dependent launch (on by default here): a kernel's set-up overlaps the previous one's tail."""
    _settings["fp8"] = replace(_settings["fp8"], pdl=bool(new_value))
    _settings["bf16"] = replace(_settings["bf16"], pdl=bool(new_value))


def set_ignore_compile_dims(new_value: bool) -> None:
    """Accepted for compatibility: kernels here are compiled per tile configuration, not per shape."""


# ---- DeepGEMM's other names: FP4-era aliases and the first API's ---------------------------------------------

fp8_fp4_gemm_nt, fp8_fp4_gemm_nn, fp8_fp4_gemm_tn, fp8_fp4_gemm_tt = fp8_gemm_nt, fp8_gemm_nn, fp8_gemm_tn, fp8_gemm_tt
m_grouped_fp8_fp4_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
m_grouped_fp8_fp4_gemm_nn_contiguous = m_grouped_fp8_gemm_nn_contiguous
m_grouped_fp8_fp4_gemm_nt_masked = fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
get_col_major_tma_aligned_tensor = get_mn_major_tma_aligned_tensor


def gemm_fp8_fp8_bf16_nt(lhs, rhs, out) -> None:
    fp8_gemm_nt(lhs, rhs, out)


def m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(lhs, rhs, out, m_indices) -> None:
    m_grouped_fp8_gemm_nt_contiguous(lhs, rhs, out, m_indices)


def m_grouped_gemm_fp8_fp8_bf16_nt_masked(lhs, rhs, out, masked_m, expected_m) -> None:
    m_grouped_fp8_gemm_nt_masked(lhs, rhs, out, masked_m, expected_m)


def wgrad_gemm_fp8_fp8_fp32_nt(lhs, rhs, out) -> None:
    fp8_gemm_nt(lhs, rhs, out, c=out, recipe=_ROW_B)


# ---- what DeepGEMM has and this module does not ---------------------------------------------------------------

_NOT_PROVIDED = {
    **dict.fromkeys(("cublaslt_gemm_nt", "cublaslt_gemm_nn", "cublaslt_gemm_tn", "cublaslt_gemm_tt"),
                    "cuBLASLt wrappers: use torch.matmul or cudart_kernels.gemm"),
    **dict.fromkeys(("m_grouped_bf16_gemm_nt_contiguous", "m_grouped_bf16_gemm_nn_contiguous",
                     "m_grouped_bf16_gemm_nt_masked", "bf16_m_grouped_gemm_nt_masked",
                     "k_grouped_bf16_gemm_tn_contiguous"), "grouped BF16 GEMMs"),
    **dict.fromkeys(("einsum", "fp8_einsum", "fp8_gemm_nt_skip_head_mid"), "einsum-style GEMMs"),
    **dict.fromkeys(("fp8_mqa_logits", "fp8_paged_mqa_logits", "fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits",
                     "get_paged_mqa_logits_metadata"), "MQA logits for the indexer"),
    "tf32_hc_prenorm_gemm": "HyperConnection GEMM",
    **dict.fromkeys(("SymmBuffer", "SM90SymmBuffer", "get_symm_buffer_for_mega_moe",
                     "get_symm_buffer_for_sm90_mega_moe", "transform_weights_for_mega_moe",
                     "transform_weights_for_mega_moe_sm90", "fp8_fp4_mega_moe", "fp8_mega_moe", "bf16_mega_moe",
                     "mega_moe_pre_dispatch", "mega_moe_pre_dispatch_sm90"), "Mega MoE"),
    **dict.fromkeys(("get_mn_major_tma_aligned_packed_ue8m0_tensor",
                     "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor", "ceil_to_ue8m0", "pack_ue8m0_to_int",
                     "unpack_ue8m0_from_int"), "UE8M0 scales, an SM100 format"),
    **dict.fromkeys(("per_token_cast_to_fp4", "cast_back_from_fp4", "transpose_packed_fp4"), "FP4, an SM100 format"),
    "per_custom_dims_cast_to_fp8": "casts over arbitrary dimensions",
    "k_grouped_wgrad_gemm_fp8_fp8_fp32_nt": "the older K-grouped weight gradient (use "
                                            "k_grouped_fp8_gemm_nt_contiguous)",
    **dict.fromkeys(("set_tc_util", "get_tc_util", "set_block_size_multiple_of", "set_compile_mode",
                     "get_compile_mode"), "JIT tuning knobs"),
    **dict.fromkeys(("init_dist", "uneven_all_gather", "bench", "bench_kineto", "calc_diff", "count_bytes"),
                    "test and distributed utilities"),
}


def __getattr__(name: str):
    if name in _NOT_PROVIDED:
        raise AttributeError(f"cudart_kernels.deep_gemm does not provide DeepGEMM's {name} ({_NOT_PROVIDED[name]}); "
                             "it provides the FP8 GEMMs (dense, m-grouped contiguous and masked, K-grouped), the "
                             "dense BF16 GEMM and their scale-layout helpers")
    raise AttributeError(f"module 'cudart_kernels.deep_gemm' has no attribute {name!r}")
