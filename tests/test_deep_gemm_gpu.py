"""cudart_kernels.deep_gemm on the GPU: DeepGEMM's call sequence (cast to FP8, then the GEMM into a given output)
for the dense GEMM, the m-grouped contiguous and masked GEMMs and the K-grouped weight gradient, on fresh random
data with outputs poisoned with NaN, against a float64 reference. Where `import deep_gemm` works (the real
DeepGEMM; scripts/deepgemm_compat.py installs it), the same calls on it must give the same results.
CK_REQUIRE_DEEPGEMM=1 makes a failed `import deep_gemm` an error instead of a skipped comparison."""
import ctypes
import glob
import os
import random

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

import cudart_kernels.deep_gemm as ours  # noqa: E402

TOL = 5e-3    # relative Frobenius error against float64 (as the FP8 op tests)
AGREE = 1e-2  # ours against DeepGEMM: both round to bf16, and may round a few elements differently


def _preload_cuda_libs():
    """deep_gemm's _C.so links libcudart / libnvrtc / libcublas(Lt) of CUDA 13; load torch's copies first where
    torch has not already."""
    loaded = open("/proc/self/maps").read()
    site = os.path.dirname(os.path.dirname(torch.__file__))
    dirs = glob.glob(os.path.join(site, "nvidia", "*", "lib")) + ["/usr/local/cuda/lib64"]
    for lib in ("libcudart.so.13", "libnvrtc.so.13", "libcublasLt.so.13", "libcublas.so.13"):
        for d in dirs:
            if lib not in loaded and os.path.exists(os.path.join(d, lib)):
                ctypes.CDLL(os.path.join(d, lib), mode=ctypes.RTLD_GLOBAL)
                break


@pytest.fixture(scope="module")
def real():
    """The real DeepGEMM module, or None where it cannot be imported."""
    try:
        _preload_cuda_libs()
        import deep_gemm
    except Exception as e:  # noqa: BLE001 (any failure to load it means: no comparison)
        if os.environ.get("CK_REQUIRE_DEEPGEMM") == "1":
            pytest.fail(f"import deep_gemm failed: {type(e).__name__}: {e}")
        return None
    assert deep_gemm.get_mk_alignment_for_contiguous_layout() == ours.get_mk_alignment_for_contiguous_layout()
    return deep_gemm


@pytest.fixture
def seed(rng):
    s = int(rng.integers(1 << 31))
    torch.manual_seed(s)
    random.seed(s)
    return s


def _poison(*shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _rel(got, ref) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _deq_rows(q, s):
    """q [..., R, K] e4m3 with one scale per 1x128 group of a row."""
    return q.double() * s.double().repeat_interleave(128, -1)[..., :q.shape[-1]]


def _deq_blocks(q, s):
    """q [..., N, K] e4m3 with one scale per 128x128 block."""
    n, k = q.shape[-2:]
    return q.double() * s.double().repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k]


def _randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def _grouped_per_block(w):
    """[G, N, K] -> (e4m3 [G, N, K], fp32 [G, ceil(N/128), ceil(K/128)]), cast group by group as DeepGEMM's tests
    do."""
    g, n, k = w.shape
    q = torch.empty(g, n, k, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty(g, -(-n // 128), -(-k // 128), device="cuda")
    for i in range(g):
        q[i], s[i] = ours.per_block_cast_to_fp8(w[i], use_ue8m0=False)
    return q, s


def _both(real, call, make_out):
    """Run `call(lib, d)` on ours and, where available, on DeepGEMM, each into a fresh output; returns both."""
    d = make_out()
    call(ours, d)
    d_real = None
    if real is not None:
        d_real = make_out()
        call(real, d_real)
    torch.cuda.synchronize()
    return d, d_real


# ---- dense -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mnk", [(1, 2112, 7168), (128, 576, 7168), (300, 7168, 2048), (4096, 4096, 7168),
                                 (77, 264, 1040)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("sa_layout", ["mmajor", "rowmajor"])
def test_fp8_gemm_nt(seed, real, mnk, sa_layout):
    m, n, k = mnk
    if real is not None and k % 128:
        real = None  # (K tails are ours to test; DeepGEMM's shapes have whole 128-wide groups)
    a = ours.per_token_cast_to_fp8(_randn(m, k), use_ue8m0=False)
    if sa_layout == "rowmajor":
        a = (a[0], a[1].contiguous())
    b = ours.per_block_cast_to_fp8(_randn(n, k), use_ue8m0=False)
    ref = _deq_rows(*a) @ _deq_blocks(*b).T
    d, d_real = _both(real, lambda lib, d: lib.fp8_gemm_nt(a, b, d), lambda: _poison(m, n))
    assert _rel(d, ref) <= TOL, seed
    if d_real is not None:
        assert _rel(d_real, ref) <= TOL, seed
        assert _rel(d, d_real) <= AGREE, seed


@pytest.mark.parametrize("c_kind", ["same", "separate"])
def test_fp8_gemm_nt_accumulates_in_fp32(seed, real, c_kind):
    """recipe (1, 1, 128): 1x128 scales on both sides and D = C + A @ B^T in fp32 (DeepGEMM's wgrad form)."""
    m, n, k = 384, 2112, 4096
    a = ours.per_token_cast_to_fp8(_randn(m, k), use_ue8m0=False)
    b = ours.per_token_cast_to_fp8(_randn(n, k), use_ue8m0=False)
    c = torch.randn(m, n, device="cuda") * 32
    product = _deq_rows(*a) @ _deq_rows(*b).T

    def call(lib, d):
        lib.fp8_gemm_nt(a, b, d, c=d if c_kind == "same" else c, recipe=(1, 1, 128))
    d, d_real = _both(real, call, lambda: c.clone() if c_kind == "same" else _poison(m, n, dtype=torch.float32))
    assert _rel(d - c, product) <= TOL, seed
    if d_real is not None:
        assert _rel(d_real - c, product) <= TOL and _rel(d - c, d_real - c) <= AGREE, seed


@pytest.mark.parametrize("form", ["nt", "nn", "nt_fp32_accumulate"])
def test_bf16_gemm(seed, real, form):
    m, n, k = 300, 2112, 1024
    a, b = _randn(m, k), _randn(n, k)
    c = torch.randn(m, n, device="cuda")
    ref = a.double() @ b.double().T
    if form == "nt":
        d, d_real = _both(real, lambda lib, d: lib.bf16_gemm_nt(a, b, d), lambda: _poison(m, n))
    elif form == "nn":
        b_kn = b.T.contiguous()
        d, d_real = _both(real, lambda lib, d: lib.bf16_gemm_nn(a, b_kn, d), lambda: _poison(m, n))
    else:  # D = C + A @ B^T in place: compare the product part
        d, d_real = _both(real, lambda lib, d: lib.bf16_gemm_nt(a, b, d, c=d), c.clone)
        d, d_real = d - c, None if d_real is None else d_real - c
    assert _rel(d, ref) <= TOL, seed
    if d_real is not None:
        assert _rel(d, d_real) <= AGREE, seed


# ---- m-grouped contiguous (MoE prefill) -----------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(4, 512, 4096, 7168), (8, 200, 2048, 1024)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("psum", [False, True], ids=["m_indices", "psum"])
def test_m_grouped_contiguous(seed, real, shape, psum):
    groups, expected_m, n, k = shape
    alignment = ours.get_mk_alignment_for_contiguous_layout()
    rows = [int(expected_m * random.uniform(0.7, 1.3)) for _ in range(groups)]
    rows[1] = 0  # an expert without tokens
    starts, m = [], 0
    for r in rows:
        starts.append(m)
        m += -(-r // alignment) * alignment
    x = _randn(m, k)
    m_indices = torch.full((m,), -1, dtype=torch.int32)
    for g, (s, r) in enumerate(zip(starts, rows)):
        m_indices[s:s + r] = g
        x[s + r:s + -(-r // alignment) * alignment] = 0  # padding rows zero, as DeepGEMM's usage has them
    psum_m = torch.tensor([s + r for s, r in zip(starts, rows)], dtype=torch.int32, device="cuda")
    layout = psum_m if psum else m_indices.cuda()
    a = ours.per_token_cast_to_fp8(x, use_ue8m0=False)
    b = _grouped_per_block(_randn(groups, n, k))
    kw = {"use_psum_layout": True} if psum else {}
    d, d_real = _both(real, lambda lib, d: lib.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout, **kw),
                      lambda: _poison(m, n))
    for g, (s, r) in enumerate(zip(starts, rows)):
        if r:
            ref = _deq_rows(a[0][s:s + r], a[1][s:s + r]) @ _deq_blocks(b[0][g], b[1][g]).T
            assert _rel(d[s:s + r], ref) <= TOL, (seed, g)
            if d_real is not None:
                assert _rel(d_real[s:s + r], ref) <= TOL and _rel(d[s:s + r], d_real[s:s + r]) <= AGREE, (seed, g)


# ---- m-grouped masked (MoE decode) ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(6, 256, 4096, 2048), (4, 192, 7168, 4096)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("sa_layout", ["contiguous", "deepgemm_per_group"])
def test_m_grouped_masked(seed, real, shape, sa_layout):
    groups, max_m, n, k = shape
    expected_m = max_m // 2
    masked = [min(max_m, int(expected_m * random.uniform(0.7, 1.3))) for _ in range(groups)]
    masked[0], masked[-1] = 0, max_m
    x = _randn(groups, max_m, k)
    q = torch.empty(groups, max_m, k, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty(groups, max_m, -(-k // 128), device="cuda")
    for g in range(groups):
        q[g], s[g] = ours.per_token_cast_to_fp8(x[g], use_ue8m0=False)
    if sa_layout == "deepgemm_per_group":
        s = ours.get_mn_major_tma_aligned_tensor(s)  # each group M-major on its own
    a, b = (q, s), _grouped_per_block(_randn(groups, n, k))
    masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
    d, d_real = _both(real, lambda lib, d: lib.fp8_m_grouped_gemm_nt_masked(a, b, d, masked_m, expected_m),
                      lambda: _poison(groups, max_m, n))
    for g, r in enumerate(masked):
        if r:
            ref = _deq_rows(q[g, :r], s[g, :r]) @ _deq_blocks(b[0][g], b[1][g]).T
            assert _rel(d[g, :r], ref) <= TOL, (seed, g)
            if d_real is not None:
                assert _rel(d_real[g, :r], ref) <= TOL and _rel(d[g, :r], d_real[g, :r]) <= AGREE, (seed, g)


# ---- K-grouped weight gradient --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(4, 512, 1024, 1024), (3, 256, 2112, 768)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("c_kind", ["same", "separate"])
def test_k_grouped_wgrad(seed, real, shape, c_kind):
    """d[g] = c[g] + dY_g^T-like A_g @ B_g^T over each group's tokens: the tokens are K, cast per 128 tokens of a
    channel, each group's [M, k_g] block K-major after the previous groups' (DeepGEMM's SM90 layout)."""
    groups, m, n, expected_k = shape
    ks = [-(-int(expected_k * random.uniform(0.7, 1.3)) // 128) * 128 for _ in range(groups)]
    ks[1] = 0  # a group without tokens
    total = sum(ks)

    def cast(rows):
        """Tokens [total, rows] -> (flat e4m3 of the groups' [rows, k_g] blocks, [rows, total / 128] scales laid
        out as DeepGEMM's per-channel cast leaves them (M-major))."""
        x = _randn(total, rows)
        flat = torch.empty(total * rows, device="cuda", dtype=torch.float8_e4m3fn)
        scales = torch.empty(total // 128, rows, device="cuda").T
        start = 0
        for kg in ks:
            if kg:
                q, sc = ours.per_token_cast_to_fp8(x[start:start + kg].T.contiguous(), use_ue8m0=False)
                flat[start * rows:(start + kg) * rows] = q.flatten()
                scales[:, start // 128:(start + kg) // 128] = sc
            start += kg
        return flat, scales

    a, b = cast(m), cast(n)
    c = torch.randn(groups, m, n, device="cuda") * 32
    ks_tensor = torch.tensor(ks, dtype=torch.int32, device="cuda")

    def call(lib, d):
        lib.k_grouped_fp8_gemm_nt_contiguous(a, b, d, ks, ks_tensor, d if c_kind == "same" else c,
                                             recipe=(1, 1, 128))
    d, d_real = _both(real, call, lambda: c.clone() if c_kind == "same" else _poison(groups, m, n,
                                                                                      dtype=torch.float32))
    start = 0
    for g, kg in enumerate(ks):
        if kg == 0:
            assert torch.equal(d[g], c[g]), (seed, g)
        else:
            ag = a[0][start * m:(start + kg) * m].view(m, kg), a[1][:, start // 128:(start + kg) // 128]
            bg = b[0][start * n:(start + kg) * n].view(n, kg), b[1][:, start // 128:(start + kg) // 128]
            product = _deq_rows(*ag) @ _deq_rows(*bg).T
            assert _rel(d[g] - c[g], product) <= TOL, (seed, g)
            if d_real is not None:
                assert _rel(d_real[g] - c[g], product) <= TOL, (seed, g)
                assert _rel(d[g] - c[g], d_real[g] - c[g]) <= AGREE, (seed, g)
        start += kg


# ---- helpers against DeepGEMM's -------------------------------------------------------------------------------

def test_layout_helpers_match_deepgemm(real):
    if real is None:
        pytest.skip("DeepGEMM not importable")
    for mn, size in ((4097, 4), (4096, 4), (5, 2), (3, 1)):
        assert ours.get_tma_aligned_size(mn, size) == real.get_tma_aligned_size(mn, size)
    for shape in ((130, 7), (3, 130, 7), (4096, 56)):
        sf = torch.rand(shape, device="cuda")
        mine, theirs = ours.get_mn_major_tma_aligned_tensor(sf), real.get_mn_major_tma_aligned_tensor(sf)
        assert mine.stride() == theirs.stride() and torch.equal(mine, theirs), shape
    sf = torch.rand(300, 56, device="cuda")
    mine = ours.transform_sf_into_required_layout(sf, 300, 7168, (1, 128, 128), is_sfa=True)
    theirs = real.transform_sf_into_required_layout(sf, 300, 7168, (1, 128, 128), is_sfa=True)
    assert mine.stride() == theirs.stride() and torch.equal(mine, theirs)


def test_casts_match_deepgemms(real):
    if real is None:
        pytest.skip("DeepGEMM not importable")
    x = _randn(300, 7168) * 3
    for name in ("per_token_cast_to_fp8", "per_block_cast_to_fp8"):
        (q, s), (q_real, s_real) = getattr(ours, name)(x, False), getattr(real, name)(x, False)
        assert q.shape == q_real.shape and s.shape == s_real.shape, name
        assert torch.allclose(s, s_real, rtol=1e-6, atol=0), name
        deq, deq_real = (_deq_rows(q, s), _deq_rows(q_real, s_real)) if name == "per_token_cast_to_fp8" else \
            (_deq_blocks(q, s), _deq_blocks(q_real, s_real))
        # The same scales; the e4m3 values may round apart where x * 448 / amax and x / (amax / 448) differ in
        # the last fp32 bit at a rounding tie (H100, 2026-11-27: 1.3e-3 relative for the per-token cast). Each
        # must be within e4m3 rounding of x, and the two close to each other.
        assert _rel(deq, x.double()) <= 0.06 and _rel(deq_real, x.double()) <= 0.06, name
        assert _rel(deq, deq_real) <= 5e-3, name
