"""The mixture-of-experts MLP (models/moe.py): the Rust kernel path equals the torch path and an
explicit per-token reference, a token's output does not depend on its batch, routing follows
the checkpoint's normalization, and the kernel is the path CPU float models take."""
import pytest
import torch
import torch.nn.functional as F

from specinfer.models.moe import SparseMoE

H, I, E, K = 64, 48, 6, 2


def _moe(dtype=torch.float32, norm=True, seed=0, shared=0):
    g = torch.Generator().manual_seed(seed)

    def param(*shape):
        return torch.nn.Parameter((torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype), requires_grad=False)

    return SparseMoE(H, I, E, K, norm, lambda n, k: param(n, k), param, shared)


def _reference(moe, h):
    """Per token, per chosen expert, in float64: sum_j w_j * down_j(silu(gate_j h) * up_j h)."""
    probs = torch.softmax(h.double() @ moe.router.double().T, -1)
    w, ex = probs.topk(K, -1)
    if moe.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros(h.shape[0], H, dtype=torch.float64)
    for t in range(h.shape[0]):
        for j in range(K):
            e = int(ex[t, j])
            gu = moe.w_gate_up[e].double() @ h[t].double()
            out[t] += w[t, j] * (moe.w_down[e].double() @ (F.silu(gu[:I]) * gu[I:]))
    return out


@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("norm", [True, False])
def test_kernel_and_torch_paths_match_the_reference(T, norm):
    moe = _moe(norm=norm)
    h = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    assert moe._kernel_takes(h)
    with torch.inference_mode():
        kernel = moe(h, F.linear, F.silu)
        moe._kernel_takes = lambda h: False
        torch_path = moe(h, F.linear, F.silu)
    want = _reference(moe, h)
    torch.testing.assert_close(kernel.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(torch_path.double(), want, atol=2e-5, rtol=2e-5)


def test_a_tokens_output_is_the_same_bits_in_any_batch():
    moe = _moe()
    h = torch.randn(24, H, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        batch = moe(h, F.linear, F.silu)
        for t in (0, 7, 23):
            assert torch.equal(moe(h[t:t + 1], F.linear, F.silu)[0], batch[t])
            assert torch.equal(moe(h[t:t + 5], F.linear, F.silu)[0], batch[t])


def test_bfloat16_experts_and_a_shared_expert():
    moe = _moe(torch.bfloat16, shared=32)
    h = torch.randn(9, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert moe._kernel_takes(h)
    with torch.inference_mode():
        kernel = moe(h, F.linear, F.silu).float()
        moe._kernel_takes = lambda h: False
        torch_path = moe(h, F.linear, F.silu).float()
    torch.testing.assert_close(kernel, torch_path, atol=3e-2, rtol=3e-2)  # bf16 roundings differ by path


def test_routing_renormalizes_only_when_asked():
    h = torch.randn(4, H, generator=torch.Generator().manual_seed(5))
    w, _ = _moe(norm=True).route(h)
    torch.testing.assert_close(w.sum(-1), torch.ones(4))
    w, _ = _moe(norm=False).route(h)
    assert bool((w.sum(-1) < 1).all())


def test_verification_activates_more_experts_than_a_decode():
    moe = _moe()
    h = torch.randn(8, H, generator=torch.Generator().manual_seed(6))
    assert moe.active_experts(h[:1]) == K < moe.active_experts(h)


def test_triton_fused_moe_matches_the_reference():
    """The CUDA path's Triton kernels, under the interpreter on CPU (conftest sets TRITON_INTERPRET)."""
    from specinfer.kernels.triton.fused_moe import align_by_expert

    moe = _moe(shared=32)
    h = torch.randn(21, H, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        want = moe(h, F.linear, F.silu)  # the CPU kernel path
        weights, experts = moe.route(h)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        got = moe._run_triton(h, order // K, weights.flatten()[order], counts, F.silu)
        gate, up = F.linear(h, moe.shared_gate_up).chunk(2, dim=-1)
        got = got + torch.sigmoid(F.linear(h, moe.shared_gate)) * F.linear(F.silu(gate) * up, moe.shared_down)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    rows, position, tiles = align_by_expert(order // K, counts)
    assert rows.shape[0] % 16 == 0 and int((rows >= 0).sum()) == h.shape[0] * K
    assert torch.equal(rows[position], order // K) and tiles.shape[0] == rows.shape[0] // 16
