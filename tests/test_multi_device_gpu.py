"""Several GPUs (skipped unless two are visible): every op on device 1 while the thread's current device (and
torch's) is 0, and the reverse, against float64 references, leaving the caller's device current; two threads
driving two GPUs at once; arrays on two devices refused; CUDA graph capture on device 1. Run on a machine with
two or more Hopper GPUs: python -m pytest -q tests/test_multi_device_gpu.py (the CPU side, with a fake driver:
tests/test_multi_device.py)."""
import threading

import numpy as np
import pytest
from cuda.bindings import driver as cu

import cudart_kernels as ck
from cudart_kernels import reference as ref
from cudart_kernels.ops.quantize import mmajor_stride
from cudart_kernels.runtime.driver import device_count, primary_context, use_device
from cudart_kernels.runtime.interop import DeviceArray
from cudart_kernels.runtime.scratch import SCRATCH
from conftest import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(device_count() < 2, reason="needs two GPUs")]


def _torch():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("torch sees fewer than two GPUs")
    return torch


def _rel(got, want) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _current_context() -> int:
    ctx = cu.cuCtxGetCurrent()[1]
    return int(ctx) if ctx is not None else 0


def _make_current(torch, dev) -> int:
    """torch's current device set to `dev` with its context current on this thread (torch.cuda.set_device alone
    leaves a thread that never touched the GPU without one); returns that context."""
    torch.cuda.set_device(dev)
    torch.zeros(1, device=f"cuda:{dev}")
    ctx = _current_context()
    assert ctx == int(primary_context(dev))
    return ctx


def _bf16(torch, dev, *shape):
    return (torch.randn(*shape, device=f"cuda:{dev}") * 0.5).to(torch.bfloat16)


def _deq_rows(x, s):
    return x.double() * s.double().repeat_interleave(128, dim=-1)[..., :x.shape[-1]]


def _deq_blocks(x, s):
    n, k = x.shape[-2:]
    return x.double() * s.double().repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k]


def _fp8_pair(torch, dev, rows, k, per_block=False):
    """(e4m3, fp32 scales) of random data on `dev`, quantized by the library."""
    x = torch.randn(rows, k, device=f"cuda:{dev}", dtype=torch.bfloat16)
    return ck.quantize_fp8_per_block(x) if per_block else ck.quantize_fp8_per_token(x)


@pytest.fixture(params=[(1, 0), (0, 1)], ids=["data-on-1-current-0", "data-on-0-current-1"])
def devices(request):
    """(the arrays' device, the thread's current device): torch's current device is set to the second, and after
    each op both torch's device and the driver's current context must still be that one."""
    torch = _torch()
    data, current = request.param
    caller = _make_current(torch, current)

    def unchanged():
        assert torch.cuda.current_device() == current and _current_context() == caller

    yield data, unchanged
    torch.cuda.synchronize(data)
    torch.cuda.set_device(0)


# ---- each op on the other device -----------------------------------------------------------------------------

@pytest.mark.parametrize("shape,split_k", [((130, 264, 2000), 5), ((256, 1024, 8192), None), ((16, 1280, 4096), None)],
                         ids=["forced-split", "split-k", "decode"])
def test_gemm(devices, shape, split_k):
    torch = _torch()
    dev, unchanged = devices
    m, n, k = shape
    a, b = _bf16(torch, dev, m, k), _bf16(torch, dev, n, k)
    out = torch.full((m, n), float("nan"), device=f"cuda:{dev}", dtype=torch.bfloat16)
    ck.gemm(a, b, out=out, split_k=split_k)
    unchanged()
    d32 = ck.gemm(a, b, out_dtype="float32", split_k=split_k, deterministic=True)
    unchanged()
    assert d32.device == a.device
    want = a.double() @ b.double().T
    assert _rel(out, want) < 1e-2 and _rel(d32, want) < 1e-4


def test_quantize(devices, rng):
    torch = _torch()
    dev, unchanged = devices
    m, k = 203, 640
    x_h = ref.random_activations(rng, m, k, np.float32)
    x = torch.from_numpy(x_h).to(f"cuda:{dev}")
    q, s = ck.quantize_fp8_per_token(x)
    unchanged()
    qw, sw = ck.quantize_fp8_per_block(x)
    unchanged()
    assert q.device == x.device and s.device == x.device and tuple(s.stride()) == (1, mmajor_stride(m))
    eq, es = ref.quantize_per_token(x_h)
    assert np.array_equal(q.view(torch.uint8).cpu().numpy(), eq.view(np.uint8)) and np.array_equal(s.cpu().numpy(), es)
    ew, ews = ref.quantize_per_block(x_h)
    assert np.array_equal(qw.view(torch.uint8).cpu().numpy(), ew.view(np.uint8))
    assert np.array_equal(sw.cpu().numpy(), ews)


def test_gemm_fp8(devices):
    torch = _torch()
    dev, unchanged = devices
    m, n, k = 200, 392, 1008
    (a, sa), (b, sb) = _fp8_pair(torch, dev, m, k), _fp8_pair(torch, dev, n, k, per_block=True)
    out = ck.gemm_fp8(a, sa, b, sb)
    unchanged()
    assert out.device == a.device
    assert _rel(out, _deq_rows(a, sa) @ _deq_blocks(b, sb).T) < 1e-2


def test_grouped_contiguous_and_masked(devices):
    torch = _torch()
    dev, unchanged = devices
    n, k = 264, 1040
    ids = []
    for e, tokens in enumerate([100, 0, 257, 1]):
        ids += [e] * tokens + [-1] * (-tokens % 128)
    ids = torch.tensor(ids, device=f"cuda:{dev}", dtype=torch.int32)
    m, groups = ids.numel(), 4
    a, sa = _fp8_pair(torch, dev, m, k)
    pairs = [_fp8_pair(torch, dev, n, k, per_block=True) for _ in range(groups)]
    b, sb = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    out = ck.gemm_fp8_grouped_contiguous(a, sa, b, sb, ids)
    unchanged()
    for g in (0, 2, 3):
        rows = ids == g
        assert _rel(out[rows], _deq_rows(a[rows], sa[rows]) @ _deq_blocks(b[g], sb[g]).T) < 1e-2, g

    mm = 128
    masked = torch.tensor([100, 37, 0, 128], device=f"cuda:{dev}", dtype=torch.int32)
    am, sam = _fp8_pair(torch, dev, groups * mm, k)
    sam = sam.contiguous()  # [G * M, KB] row-major: the groups follow each other
    out = ck.gemm_fp8_grouped_masked(am.view(groups, mm, k), sam.view(groups, mm, -1), b, sb, masked)
    unchanged()
    for g, rows in enumerate(masked.tolist()):
        want = _deq_rows(am[g * mm:(g + 1) * mm], sam[g * mm:(g + 1) * mm]) @ _deq_blocks(b[g], sb[g]).T
        if rows:
            assert _rel(out[g, :rows], want[:rows]) < 1e-2, g


def test_wgrad(devices):
    torch = _torch()
    dev, unchanged = devices
    ks, m, n = [128, 256, 0, 128], 136, 256
    a, sa = _fp8_pair(torch, dev, m, sum(ks))
    b, sb = _fp8_pair(torch, dev, n, sum(ks))
    d = torch.zeros(len(ks), m, n, device=f"cuda:{dev}")
    assert ck.gemm_fp8_wgrad(a, sa, b, sb, d, ks) is d
    unchanged()
    da, db = _deq_rows(a, sa), _deq_rows(b, sb)
    start = 0
    for g, kg in enumerate(ks):
        if kg:
            assert _rel(d[g], da[:, start:start + kg] @ db[:, start:start + kg].T) < 1e-2, g
        else:
            assert not d[g].any()
        start += kg


@pytest.mark.parametrize("causal", [False, True])
def test_attention_forward_and_backward(devices, rng, causal):
    torch = _torch()
    dev, unchanged = devices
    b, s, hq, hkv, d = 2, 300, 4, 2, 64
    q_h, do_h = (rng.standard_normal((b, s, hq, d)).astype(np.float32) for _ in range(2))
    k_h, v_h = (rng.standard_normal((b, s, hkv, d)).astype(np.float32) for _ in range(2))
    q, k, v, do = (torch.from_numpy(x).to(f"cuda:{dev}", torch.bfloat16) for x in (q_h, k_h, v_h, do_h))
    out, lse = ck.attention(q, k, v, causal=causal, return_lse=True)
    unchanged()
    dq, dk, dv = ck.attention_backward(do, q, k, v, out, lse, causal=causal)
    unchanged()
    assert all(x.device == q.device for x in (out, lse, dq, dk, dv))
    host = [x.float().cpu().numpy() for x in (q, k, v, do)]
    o_ref, lse_ref = ref.attention(*host[:3], causal)
    assert _rel(out.cpu(), torch.from_numpy(o_ref)) < 1e-2
    fin = np.isfinite(lse_ref)
    assert np.abs(lse.cpu().numpy()[fin] - lse_ref[fin]).max() < 1e-3
    wants = ref.attention_backward(host[3], *host[:3], causal)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), wants):
        assert _rel(got.cpu(), torch.from_numpy(want)) < 2e-2, name


def test_numpy_only_on_device_1(rng):
    """DeviceArrays on device 1 while the driver's current context is device 0's: results on device 1, the
    context left as it was."""
    use_device(0)
    caller = _current_context()
    a_h = rng.standard_normal((200, 512)).astype(np.float32)
    b_h = rng.standard_normal((264, 512)).astype(np.float32)
    a, b = DeviceArray.from_numpy(a_h, "bf16", device=1), DeviceArray.from_numpy(b_h, "bf16", device=1)
    assert _current_context() == caller
    d = ck.gemm(a, b)
    q, s = ck.quantize_fp8_per_token(a)
    y = ck.gemm_fp8(q, s, *ck.quantize_fp8_per_block(b))
    assert (d.device, q.device, s.device, y.device) == (1, 1, 1, 1) and _current_context() == caller
    a64, b64 = a.numpy().astype(np.float64), b.numpy().astype(np.float64)
    want = a64 @ b64.T
    assert np.linalg.norm(d.numpy().astype(np.float64) - want) / np.linalg.norm(want) < 1e-2
    assert np.linalg.norm(y.numpy().astype(np.float64) - want) / np.linalg.norm(want) < 0.06
    assert _current_context() == caller


# ---- two threads, two GPUs -------------------------------------------------------------------------------------

class _Work:
    """One device's inputs, preallocated outputs and float64-made references for gemm with split-K, gemm_fp8,
    the contiguous grouped GEMM and causal attention. `step()` poisons the outputs, runs the four ops and
    queues their relative errors (no host sync)."""

    def __init__(self, torch, dev):
        self.torch, self.dev = torch, dev
        cuda = f"cuda:{dev}"
        m, n, k = 130, 264, 2000
        self.a, self.b = _bf16(torch, dev, m, k), _bf16(torch, dev, n, k)
        self.d = torch.empty(m, n, device=cuda, dtype=torch.bfloat16)
        self.d_want = (self.a.double() @ self.b.double().T).float()
        (self.qa, self.sa), (self.qb, self.sb) = _fp8_pair(torch, dev, 200, 640), _fp8_pair(torch, dev, 384, 640, True)
        self.y = torch.empty(200, 384, device=cuda, dtype=torch.bfloat16)
        self.y_want = (_deq_rows(self.qa, self.sa) @ _deq_blocks(self.qb, self.sb).T).float()
        ids = [0] * 100 + [-1] * 28 + [2] * 256
        self.ids = torch.tensor(ids, device=cuda, dtype=torch.int32)
        self.ga, self.gsa = _fp8_pair(torch, dev, len(ids), 512)
        pairs = [_fp8_pair(torch, dev, 256, 512, per_block=True) for _ in range(3)]
        self.gb, self.gsb = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        self.g = torch.empty(len(ids), 256, device=cuda, dtype=torch.bfloat16)
        self.g_rows = torch.nonzero(self.ids >= 0).squeeze(1)  # (the rows written: padding rows are not)
        want = torch.zeros(len(ids), 256, device=cuda, dtype=torch.float64)
        for e in (0, 2):
            sel = self.ids == e
            want[sel] = _deq_rows(self.ga[sel], self.gsa[sel]) @ _deq_blocks(self.gb[e], self.gsb[e]).T
        self.g_want = want[self.g_rows].float()
        self.q, self.k, self.v = (_bf16(torch, dev, 1, 256, h, 64) for h in (4, 2, 2))
        self.o = torch.empty_like(self.q)
        o_ref, _ = ref.attention(*(x.float().cpu().numpy() for x in (self.q, self.k, self.v)), True)
        self.o_want = torch.from_numpy(o_ref).to(cuda, torch.float32)
        self.errors = []

    def step(self):
        torch = self.torch
        for x in (self.d, self.y, self.g, self.o):
            x.fill_(float("nan"))
        ck.gemm(self.a, self.b, out=self.d, split_k=5)
        ck.gemm_fp8(self.qa, self.sa, self.qb, self.sb, out=self.y)
        ck.gemm_fp8_grouped_contiguous(self.ga, self.gsa, self.gb, self.gsb, self.ids, out=self.g)
        ck.attention(self.q, self.k, self.v, causal=True, out=self.o)
        rows = self.g.index_select(0, self.g_rows)  # (no host sync, unlike a boolean mask)
        for got, want in ((self.d, self.d_want), (self.y, self.y_want), (rows, self.g_want), (self.o, self.o_want)):
            self.errors.append(torch.linalg.vector_norm(got.float() - want) / torch.linalg.vector_norm(want))

    def worst(self) -> float:
        self.torch.cuda.synchronize(self.dev)
        return float(self.torch.stack(self.errors).max())


def test_two_threads_drive_two_gpus():
    torch = _torch()
    _make_current(torch, 0)
    work = {dev: _Work(torch, dev) for dev in (0, 1)}
    start = threading.Barrier(2)
    failures = []

    def drive(dev):
        try:
            caller = _make_current(torch, 1 - dev)  # the thread works on the other device: the arrays decide
            start.wait()
            for _ in range(300):
                work[dev].step()
            assert _current_context() == caller and torch.cuda.current_device() == 1 - dev
        except BaseException as e:  # (re-raised below, in the test's thread)
            failures.append((dev, e))

    threads = [threading.Thread(target=drive, args=(dev,)) for dev in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    for dev, w in work.items():
        assert len(w.errors) == 4 * 300
        assert w.worst() < 1e-2, dev


# ---- arrays on two devices ------------------------------------------------------------------------------------

def test_two_devices_refused():
    torch = _torch()
    a, b = _bf16(torch, 0, 128, 256), _bf16(torch, 1, 64, 256)
    with pytest.raises(ValueError, match="b is on cuda:1 but a is on cuda:0"):
        ck.gemm(a, b)
    with pytest.raises(ValueError, match="b is on cuda:1 but a is on cuda:0"):
        ck.gemm(a, b, stream=torch.cuda.Stream(device=0))  # (no stream ordering across the two either)
    out = torch.empty(128, 64, device="cuda:1", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out is on cuda:1 but a is on cuda:0"):
        ck.gemm(a, _bf16(torch, 0, 64, 256), out=out)
    with pytest.raises(ValueError, match="out_scales is on cuda:1 but x is on cuda:0"):
        ck.quantize_fp8_per_token(a, out_scales=torch.empty(128, 2, device="cuda:1"))
    q, k = _bf16(torch, 0, 1, 64, 2, 64), _bf16(torch, 1, 1, 64, 2, 64)
    with pytest.raises(ValueError, match="k is on cuda:1 but q is on cuda:0"):
        ck.attention(q, k, q)
    qa, sa = _fp8_pair(torch, 0, 128, 256)
    qb, sb = _fp8_pair(torch, 1, 64, 256, per_block=True)
    with pytest.raises(ValueError, match="b is on cuda:1 but a is on cuda:0"):
        ck.gemm_fp8(qa, sa, qb, sb)


# ---- CUDA graphs on device 1 -----------------------------------------------------------------------------------

def test_graph_capture_on_device_1():
    """gemm with split-K (scratch from inside the capture), quantize and gemm_fp8 on device-1 tensors captured by
    torch.cuda.graph under torch.cuda.device(1) while device 0 is current outside; replayed on new inputs."""
    torch = _torch()
    _make_current(torch, 0)
    dev, cuda = 1, "cuda:1"
    m, n, k = 200, 2048, 8192
    a, b = _bf16(torch, dev, m, k), _bf16(torch, dev, n, k)
    x = _bf16(torch, dev, m, k)
    wq, ws = _fp8_pair(torch, dev, n, k, per_block=True)
    d = torch.empty(m, n, device=cuda, dtype=torch.bfloat16)
    xq = torch.empty(m, k, device=cuda, dtype=torch.float8_e4m3fn)
    xs = torch.empty_strided((m, k // 128), (1, mmajor_stride(m)), device=cuda, dtype=torch.float32)
    y = torch.empty(m, n, device=cuda, dtype=torch.bfloat16)

    def run():
        ck.gemm(a, b, out=d, split_k=4)
        ck.quantize_fp8_per_token(x, out=xq, out_scales=xs)
        ck.gemm_fp8(xq, xs, wq, ws, out=y)

    before = SCRATCH.graph_captures()
    with torch.cuda.device(dev):
        g, _ = capture_graph(torch, run)
    assert torch.cuda.current_device() == 0
    new = SCRATCH.graph_captures() - before
    assert new and all(SCRATCH._graphs[c][0] == dev for c in new)  # the split-K scratch lives on device 1
    for _ in range(2):
        a.copy_(_bf16(torch, dev, m, k))
        x.copy_(_bf16(torch, dev, m, k))
        d.fill_(float("nan"))
        y.fill_(float("nan"))
        with torch.cuda.device(dev):
            g.replay()
        torch.cuda.synchronize(dev)
        assert _rel(d, a.double() @ b.double().T) < 1e-2
        xq_want, xs_want = ck.quantize_fp8_per_token(x)
        assert torch.equal(xq.view(torch.uint8), xq_want.view(torch.uint8)) and torch.equal(xs, xs_want)
        assert _rel(y, _deq_rows(xq, xs) @ _deq_blocks(wq, ws).T) < 1e-2
    assert torch.cuda.current_device() == 0
