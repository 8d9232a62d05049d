"""cudart_kernels.torch: attention as torch custom ops with autograd, against torch SDPA's gradients, trained for a
few steps under torch.compile(fullgraph=True) and replayed inside a CUDA graph; the GEMM and FP8 ops in a compiled
MLP, and gemm's gradients."""
import copy

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

import cudart_kernels.torch as ckt  # noqa: E402


class Block(torch.nn.Module):
    """x -> qkv projection -> causal GQA attention -> output projection."""

    def __init__(self, dim=256, heads=4, kv_heads=2, head_dim=64, use_ours=True):
        super().__init__()
        self.h, self.hkv, self.d, self.use_ours = heads, kv_heads, head_dim, use_ours
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.proj = torch.nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = q.reshape(b, s, self.h, self.d)
        k = k.reshape(b, s, self.hkv, self.d)
        v = v.reshape(b, s, self.hkv, self.d)
        if self.use_ours:
            o = ckt.attention(q, k, v, causal=True)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True).transpose(1, 2)
        return self.proj(o.reshape(b, s, self.h * self.d))


def _make(seed=0):
    torch.manual_seed(seed)
    ours = Block().cuda().to(torch.bfloat16)
    ref = copy.deepcopy(ours)
    ref.use_ours = False
    return ours, ref


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_gradients_match_sdpa():
    ours, ref = _make()
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16)
    for m in (ours, ref):
        m(x).float().square().mean().backward()
    for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert _rel(p.grad, p_ref.grad) < 2e-2, (name, _rel(p.grad, p_ref.grad))


def test_training_under_torch_compile_matches_sdpa():
    ours, ref = _make(1)
    compiled = torch.compile(ours, fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ours, ref)]
    torch.manual_seed(2)
    xs = [torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    for x in xs:
        for model, opt in zip((compiled, ref), opts):
            opt.zero_grad()
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
        for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters()):
            assert _rel(p.grad, p_ref.grad) < 3e-2, (name, _rel(p.grad, p_ref.grad))
    for p, p_ref in zip(ours.parameters(), ref.parameters()):
        assert _rel(p, p_ref) < 1e-2


def test_forward_and_backward_replay_in_a_cuda_graph():
    ours, _ = _make(3)
    x = torch.randn(1, 130, 256, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up: compile the kernels, create the scratch buffers
            ours.zero_grad(set_to_none=False)
            ours(x).float().sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    eager = [p.grad.clone() for p in ours.parameters()]
    graph = torch.cuda.CUDAGraph()
    ours.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        ours(x).float().sum().backward()
    for _ in range(2):
        for p in ours.parameters():
            p.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for g, e in zip((p.grad for p in ours.parameters()), eager):
            assert torch.equal(g, e) or _rel(g, e) < 1e-3


def test_varlen_gradients_match_per_sequence_sdpa():
    torch.manual_seed(4)
    lens = [5, 130, 64]
    cu = torch.tensor([0, 5, 135, 199], device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(199, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    ckt.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=130,
                  max_seqlen_k=130).float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    outs, start = [], 0
    for n in lens:
        sl = [t[start:start + n].transpose(0, 1) for t in (q, k, v)]
        outs.append(torch.nn.functional.scaled_dot_product_attention(*sl, is_causal=True).transpose(0, 1))
        start += n
    torch.cat(outs).float().square().sum().backward()
    for g, t in zip(grads, (q, k, v)):
        assert _rel(g, t.grad) < 2e-2


def test_fp8_mlp_under_torch_compile_matches_eager_and_the_reference():
    """quantize -> gemm_fp8 -> gelu -> gemm as cudart_kernels.torch ops, compiled with fullgraph=True (no graph break)
    against the same ops eagerly and against float64."""
    torch.manual_seed(5)
    w1 = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) / 16
    qw, sw = ckt.quantize_fp8_per_block(w1)

    def mlp(x):
        q, s = ckt.quantize_fp8_per_token(x)
        h = torch.nn.functional.gelu(ckt.gemm_fp8(q, s, qw, sw))
        return ckt.gemm(h, w2)

    x = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16)
    eager = mlp(x)
    compiled = torch.compile(mlp, fullgraph=True)(x)
    assert compiled.shape == (200, 256) and compiled.dtype == torch.bfloat16
    assert _rel(compiled, eager) < 1e-2
    ref = torch.nn.functional.gelu(x.double() @ w1.double().t()) @ w2.double().t()
    assert _rel(compiled, ref) < 5e-2  # (FP8 inputs)


def test_gemm_gradients_match_torch():
    torch.manual_seed(6)
    for layout in ("nk", "kn"):
        a = torch.randn(130, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(*((96, 256) if layout == "nk" else (256, 96)), device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        ckt.gemm(a, b, b_layout=layout).float().square().mean().backward()
        ga, gb = a.grad.clone(), b.grad.clone()
        a.grad = b.grad = None
        ((a @ (b.t() if layout == "nk" else b)).float().square().mean()).backward()
        assert _rel(ga, a.grad) < 2e-2 and _rel(gb, b.grad) < 2e-2, layout
