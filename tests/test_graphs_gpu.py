"""Every op inside a CUDA graph: warmed up on one stream, captured by `torch.cuda.graph` on its own fresh capture
stream (and by cupy) with preallocated outputs, replayed on new inputs and checked; scratch memory (split-K
partials and counters, re-laid-out scales, K-group offsets) comes from inside the capture. A capture that fails
leaves the library usable."""
import numpy as np
import pytest

import cudart_kernels as ck
from cudart_kernels import reference as ref
from conftest import capture_graph

pytestmark = pytest.mark.gpu


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def _rel(got, want):
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _capture_and_replay(torch, run, refill, check, replays=2):
    """Warm `run(stream)` on a side stream, capture it with torch.cuda.graph, then `replays` times: new inputs
    (`refill`), poison and replay, `check`."""
    g, _ = capture_graph(torch, lambda: run(torch.cuda.current_stream()))
    for _ in range(replays):
        refill()
        g.replay()
        torch.cuda.synchronize()
        check()
    return g


def _bf16(torch, *shape):
    return (torch.randn(*shape, device="cuda") * 0.5).to(torch.bfloat16)


@pytest.mark.parametrize("shape,split_k", [((200, 2048, 8192), None), ((256, 1024, 8192), None),
                                          ((16, 1280, 4096), None), ((130, 264, 2000), 5)],
                         ids=["split-k-pairs", "split-k", "decode", "forced-split"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gemm(shape, split_k, deterministic):
    torch = _torch()
    m, n, k = shape
    cfg = ck.ops.gemm.pick_config(m, n, k, 2, ck.ops.gemm.device_properties(0), split_k)
    decode = ck.ops.gemm.pick_decode(m, n, k, ck.ops.gemm.device_properties(0), split_k) is not None
    assert decode or cfg.splits > 1  # the shapes that need scratch or run the decode kernel
    a, b = _bf16(torch, m, k), _bf16(torch, n, k)
    d = torch.empty(m, n, device="cuda", dtype=torch.float32)

    def refill():
        a.copy_(_bf16(torch, m, k))
        b.copy_(_bf16(torch, n, k))
        d.fill_(float("nan"))

    def check():
        assert torch.isfinite(d).all()
        assert _rel(d, a.double() @ b.double().T) <= 1e-4

    _capture_and_replay(torch, lambda s: ck.gemm(a, b, out=d, split_k=split_k, deterministic=deterministic,
                                                 stream=s), refill, check)


def test_gemm_accumulate_in_place():
    torch = _torch()
    m, n, k = 200, 136, 4096
    a, b = _bf16(torch, m, k), _bf16(torch, n, k)
    d = torch.zeros(m, n, device="cuda", dtype=torch.float32)
    g = _capture_and_replay(torch, lambda s: ck.gemm(a, b, out=d, c=d, split_k=4, deterministic=True, stream=s),
                            lambda: None, lambda: None, replays=0)
    d.zero_()
    for i in range(1, 4):
        g.replay()
        torch.cuda.synchronize()
        assert _rel(d, i * (a.double() @ b.double().T)) <= 1e-4


def _fp8(torch, *shape):
    return (torch.randn(*shape, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)


def _scales(torch, *shape):
    return torch.rand(*shape, device="cuda") * (1.5 / 448) + 0.5 / 448


def _deq_rows(x, s):
    return x.double() * s.double().repeat_interleave(128, dim=-1)[..., :x.shape[-1]]


def _deq_blocks(x, s):
    n, k = x.shape[-2:]
    return x.double() * s.double().repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k]


@pytest.mark.parametrize("sa_layout", ["rowmajor", "mmajor"])
def test_gemm_fp8(sa_layout):
    torch = _torch()
    m, n, k = 300, 520, 1040
    kb = -(-k // 128)
    a, b = _fp8(torch, m, k), _fp8(torch, n, k)
    sa = _scales(torch, m, kb) if sa_layout == "rowmajor" else _scales(torch, kb, ck.ops.quantize.mmajor_stride(m))[
        :, :m].T
    sb = _scales(torch, -(-n // 128), kb)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def refill():
        a.copy_(_fp8(torch, m, k))
        sa.copy_(_scales(torch, m, kb))
        out.fill_(float("nan"))

    def check():
        assert _rel(out, _deq_rows(a, sa) @ _deq_blocks(b, sb).T) <= 5e-3

    _capture_and_replay(torch, lambda s: ck.gemm_fp8(a, sa, b, sb, out, stream=s), refill, check)


def test_grouped_contiguous_and_masked():
    torch = _torch()
    n, k, kb = 264, 1040, 9
    tokens = [100, 0, 257, 1]
    ids = []
    for e, t in enumerate(tokens):
        ids += [e] * t + [-1] * (-t % 128)
    ids = torch.tensor(ids, device="cuda", dtype=torch.int32)
    m, groups = ids.numel(), len(tokens)
    a, sa = _fp8(torch, m, k), _scales(torch, m, kb)
    b, sb = _fp8(torch, groups, n, k), _scales(torch, groups, 3, kb)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    mm = 200
    am, sam = _fp8(torch, groups, mm, k), _scales(torch, groups, mm, kb)
    masked = torch.tensor([0, 200, 57, 1], device="cuda", dtype=torch.int32)
    outm = torch.empty(groups, mm, n, device="cuda", dtype=torch.bfloat16)

    def run(s):
        ck.gemm_fp8_grouped_contiguous(a, sa, b, sb, ids, out, stream=s)
        ck.gemm_fp8_grouped_masked(am, sam, b, sb, masked, outm, stream=s)

    def refill():
        a.copy_(_fp8(torch, m, k))
        am.copy_(_fp8(torch, groups, mm, k))
        masked.copy_(torch.randint(0, mm + 1, (groups,), device="cuda", dtype=torch.int32))
        out.fill_(float("nan"))
        outm.fill_(float("nan"))

    def check():
        for e in range(groups):
            rows = ids == e
            if rows.any():
                assert _rel(out[rows], _deq_rows(a[rows], sa[rows]) @ _deq_blocks(b[e], sb[e]).T) <= 5e-3
            c = int(masked[e])
            assert torch.isnan(outm[e, c:].float()).all()
            if c:
                want = _deq_rows(am[e, :c], sam[e, :c]) @ _deq_blocks(b[e], sb[e]).T
                assert _rel(outm[e, :c], want) <= 5e-3
        assert torch.isnan(out[ids < 0].float()).all()

    _capture_and_replay(torch, run, refill, check)


def test_wgrad():
    torch = _torch()
    m, n, ks = 200, 264, (256, 0, 384)
    k = sum(ks)
    a, sa = _fp8(torch, m, k), _scales(torch, m, k // 128)  # row-major scales: copied M-major in the graph
    b, sb = _fp8(torch, n, k), _scales(torch, n, k // 128)
    d = torch.zeros(len(ks), m, n, device="cuda", dtype=torch.float32)
    g = _capture_and_replay(torch, lambda s: ck.gemm_fp8_wgrad(a, sa, b, sb, d, ks, stream=s), lambda: None,
                            lambda: None, replays=0)
    a.copy_(_fp8(torch, m, k))
    d.zero_()
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    da, db = _deq_rows(a, sa), _deq_rows(b, sb)
    start = 0
    for e, ke in enumerate(ks):
        if ke == 0:
            assert (d[e] == 0).all()
        else:
            assert _rel(d[e] / 2, da[:, start:start + ke] @ db[:, start:start + ke].T) <= 5e-3
        start += ke


def test_quantize():
    torch = _torch()
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 1024, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(300, 1024, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty_strided((300, 8), (1, 300), device="cuda", dtype=torch.float32)
    qw = torch.empty(384, 1024, device="cuda", dtype=torch.float8_e4m3fn)
    sw = torch.empty(3, 8, device="cuda", dtype=torch.float32)

    def run(st):
        ck.quantize_fp8_per_token(x, out=q, out_scales=s, stream=st)
        ck.quantize_fp8_per_block(w, out=qw, out_scales=sw, stream=st)

    def refill():
        x.copy_(torch.randn_like(x))
        w.copy_(torch.randn_like(w))
        q.fill_(0)

    def check():
        eq, es = ref.quantize_per_token(x.float().cpu().numpy().astype(ck.bfloat16.numpy))
        assert np.array_equal(q.view(torch.uint8).cpu().numpy(), eq.view(np.uint8))
        assert np.array_equal(s.cpu().numpy(), es)
        ew, esw = ref.quantize_per_block(w.float().cpu().numpy().astype(ck.bfloat16.numpy))
        assert np.array_equal(qw.view(torch.uint8).cpu().numpy(), ew.view(np.uint8))
        assert np.array_equal(sw.cpu().numpy(), esw)

    _capture_and_replay(torch, run, refill, check)


def test_graph_beside_eager_work_on_other_streams():
    """A replay and eager calls of the same split-K shape on two streams at once: each has its own scratch."""
    torch = _torch()
    m, n, k = 200, 2048, 8192
    a, b = _bf16(torch, m, k), _bf16(torch, n, k)
    d_graph = torch.empty(m, n, device="cuda", dtype=torch.float32)
    g = _capture_and_replay(torch, lambda s: ck.gemm(a, b, out=d_graph, stream=s), lambda: None, lambda: None,
                            replays=0)
    other = torch.cuda.Stream()
    d_eager = torch.empty(m, n, device="cuda", dtype=torch.float32)
    want = a.double() @ b.double().T
    torch.cuda.synchronize()
    for _ in range(5):
        d_graph.fill_(float("nan"))
        d_eager.fill_(float("nan"))
        torch.cuda.synchronize()
        g.replay()
        ck.gemm(a, b, out=d_eager, stream=other)
        torch.cuda.synchronize()
        assert _rel(d_graph, want) <= 1e-4 and _rel(d_eager, want) <= 1e-4


def test_failed_capture_leaves_the_library_usable():
    torch = _torch()
    m, n, k = 200, 2048, 8192
    a, b = _bf16(torch, m, k), _bf16(torch, n, k)
    da, db = ck.as_array(a), ck.as_array(b)  # DeviceArrays: their results are ours (torch's would be capture-safe)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(Exception) as info:
        with torch.cuda.graph(g):
            ck.gemm(da, db, stream=torch.cuda.current_stream())  # no out=: allocating inside a capture
    text = f"{info.value} {info.value.__context__}"
    assert "capturing" in text, text
    d = torch.empty(m, n, device="cuda", dtype=torch.float32)
    for s in (torch.cuda.Stream(), torch.cuda.current_stream()):
        d.fill_(float("nan"))
        ck.gemm(a, b, out=d, stream=s)
        torch.cuda.synchronize()
        assert _rel(d, a.double() @ b.double().T) <= 1e-4
    def check():
        assert _rel(d, a.double() @ b.double().T) <= 1e-4

    _capture_and_replay(torch, lambda s: ck.gemm(a, b, out=d, stream=s), lambda: d.fill_(float("nan")), check)


def test_cupy_graph_capture():
    cp = pytest.importorskip("cupy")
    m, n, k = 200, 2048, 8192
    rng = np.random.default_rng()
    a = cp.asarray((rng.standard_normal((m, k)) * 0.5).astype(np.float16))  # (cupy has no bfloat16)
    b = cp.asarray((rng.standard_normal((n, k)) * 0.5).astype(np.float16))
    d = cp.empty((m, n), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        ck.gemm(a, b, out=d, stream=stream)  # warm-up
        stream.begin_capture()
        ck.gemm(a, b, out=d, stream=stream)
        graph = stream.end_capture()
    for _ in range(2):
        new_a = (rng.standard_normal((m, k)) * 0.5).astype(np.float16)
        with stream:  # (a non-blocking stream is not ordered after the legacy default stream's fill)
            a.set(new_a)
            d.fill(cp.nan)
        graph.launch(stream)
        stream.synchronize()
        want = new_a.astype(np.float64) @ cp.asnumpy(b).astype(np.float64).T
        got = cp.asnumpy(d).astype(np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-4


def test_graph_scratch_is_the_graphs_own_and_freed_with_it():
    """Driver-level capture of a split-K call: the graph holds kernels and one memory-node pair, no memset (its
    zeroed scratch was zeroed once, outside), cannot be instantiated twice (so no two copies share that scratch),
    replays correctly, and its scratch is freed once the graph is destroyed."""
    import gc
    import time

    from cuda.bindings import driver as cu

    from cudart_kernels.runtime.driver import check
    from cudart_kernels.runtime.scratch import SCRATCH

    m, n, k = 200, 2048, 8192
    rng = np.random.default_rng()
    a_host = (rng.standard_normal((m, k)) * 0.5).astype(np.float16)
    b_host = (rng.standard_normal((n, k)) * 0.5).astype(np.float16)
    a, b = ck.DeviceArray.from_numpy(a_host), ck.DeviceArray.from_numpy(b_host)
    d = ck.DeviceArray.empty((m, n), "float32")
    stream = int(check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)))
    before = SCRATCH.graph_captures()
    check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    ck.gemm(a, b, out=d, stream=stream)
    ck.gemm(a, b, out=d, stream=stream)  # a second call on the stream shares the graph's buffers
    graph = check(cu.cuStreamEndCapture(stream))
    ours = SCRATCH.graph_captures() - before
    assert len(ours) == 1
    nodes, count = check(cu.cuGraphGetNodes(graph, 64))
    kinds = [check(cu.cuGraphNodeGetType(x)) for x in nodes[:count]]
    T = cu.CUgraphNodeType
    assert kinds.count(T.CU_GRAPH_NODE_TYPE_KERNEL) == 2 and T.CU_GRAPH_NODE_TYPE_MEMSET not in kinds
    assert kinds.count(T.CU_GRAPH_NODE_TYPE_MEM_ALLOC) == 1 and kinds.count(T.CU_GRAPH_NODE_TYPE_MEM_FREE) == 1
    exe = check(cu.cuGraphInstantiate(graph, 0))
    err = cu.cuGraphInstantiate(graph, 0)[0]
    assert err != cu.CUresult.CUDA_SUCCESS  # one executable copy at a time
    want = a_host.astype(np.float64) @ b_host.astype(np.float64).T
    for _ in range(3):
        d.fill_bytes(0xFF)
        check(cu.cuGraphLaunch(exe, stream))
        check(cu.cuStreamSynchronize(stream))
        got = d.numpy().astype(np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-4
    check(cu.cuGraphExecDestroy(exe))
    check(cu.cuGraphDestroy(graph))
    check(cu.cuStreamDestroy(stream))
    for _ in range(50):  # the driver runs the user object's destructor on its own thread
        gc.collect()
        SCRATCH.release()
        if not ours & SCRATCH.graph_captures():
            break
        time.sleep(0.01)
    assert not ours & SCRATCH.graph_captures()


@pytest.mark.parametrize("varlen", [False, True])
def test_attention(varlen):
    """Causal and varlen attention hand units out through a counter in scratch memory (zeroed once, reset by the
    kernel): every replay must see it at zero again."""
    torch = _torch()
    h, hkv, d = 4, 2, 128
    if varlen:
        lens = [300, 1, 0, 517]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), device="cuda", dtype=torch.int32)
        q, k, v = (_bf16(torch, sum(lens), n, d) for n in (h, hkv, hkv))
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
        lse = torch.empty(h, sum(lens), device="cuda")
    else:
        q, k, v = (_bf16(torch, 2, 700, n, d) for n in (h, hkv, hkv))
        kw = {}
        lse = torch.empty(2, h, 700, device="cuda")
    out = torch.empty_like(q)

    def run(stream):
        ck.attention(q, k, v, causal=True, out=out, lse=lse, stream=stream, **kw)

    def refill():
        for x in (q, k, v):
            x.copy_(torch.randn_like(x, dtype=torch.float32) * 0.5)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))

    def check():
        cu_np = None if not varlen else kw["cu_seqlens_q"].cpu().numpy()
        o_ref, lse_ref = ref.attention(q.float().cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy(),
                                       True, None, cu_np, cu_np)
        got = out.double().cpu().numpy()
        assert np.isfinite(got).all()
        assert np.linalg.norm(got - o_ref) / np.linalg.norm(o_ref) < 1e-2
        fin = np.isfinite(lse_ref)
        assert np.abs(lse.cpu().numpy()[fin] - lse_ref[fin]).max() < 1e-3

    _capture_and_replay(torch, run, refill, check, replays=3)
