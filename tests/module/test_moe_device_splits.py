"""FP8FlowMoE with ``device_splits=True``: per-expert counts stay on the device, no host sync, and the
whole block (forward + backward) captured in one CUDA graph replays other routings bitwise as eager."""

import pytest
import torch

from conftest import CUDA, KERNEL_DEVICE, assert_no_host_sync, requires_cuda
from transformer_engine_moe.dispatch import LocalTokenDispatcher, get_dispatcher
from transformer_engine_moe.module import FP8FlowMoE
from utils import cuda_graph  # benchmarks/utils.py

T, H, FFN, E, K = 256, 512, 128, 4, 2  # H 512 / ffn 128 / 4 experts: the shapes tests/kernels compiles
BACKEND = "triton" if CUDA else "auto"  # one launch per GEMM with device splits; the reference on CPU


def routing(seed, case="random", t=T):
    """``(ids [t, K] int64, probs [t, K] float32)``: random top-k; "one-expert": every token on expert 0
    and nothing else (the others empty); "ragged": a skewed router with unused (-1) slots."""
    g = torch.Generator().manual_seed(seed)
    probs, ids = torch.softmax(torch.randn(t, E, generator=g), -1).topk(K)
    if case == "one-expert":
        ids = torch.stack([torch.zeros(t, dtype=torch.long), torch.full((t,), -1)], 1)
    elif case == "ragged":
        ids[:, 0] = torch.where(torch.rand(t, generator=g) < 0.8, 1, ids[:, 0])
        ids[:, 1] = torch.where((ids[:, 1] == 1) | (torch.rand(t, generator=g) < 0.3), -1, ids[:, 1])
    probs = torch.where(ids >= 0, probs, torch.zeros(()))
    return ids.to(KERNEL_DEVICE), probs.to(KERNEL_DEVICE)


def blocks(**kw):
    """Two blocks with the same parameters: host counts (default) and device counts."""
    torch.manual_seed(0)
    host = FP8FlowMoE(E, H, FFN, K, gemm_backend=BACKEND, device=KERNEL_DEVICE, **kw)
    dev = FP8FlowMoE(E, H, FFN, K, gemm_backend=BACKEND, device=KERNEL_DEVICE, device_splits=True, **kw)
    dev.load_state_dict(host.state_dict())
    return host, dev


def eager_step(block, x, ids, probs, dy):
    """``(y, dx, dprobs, *weight grads)`` of one forward + backward from fresh leaves."""
    block.zero_grad(set_to_none=True)
    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y = block.forward_topk(xi, ids, pi)
    y.backward(dy)
    return [y.detach(), xi.grad, pi.grad] + [p.grad.clone() for p in block.parameters()]


def inputs(seed, t=T):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).bfloat16().to(KERNEL_DEVICE)
    return x, torch.randn(t, H, generator=g).bfloat16().to(KERNEL_DEVICE)


@pytest.mark.parametrize("case", ["random", "one-expert", "ragged"])
def test_device_splits_equal_host_splits(case):
    """Same outputs and gradients, bitwise: the extra rows are a trailing weightless group after the
    experts' padded counts, which the GEMMs write as zeros and wgrad never reads."""
    host, dev = blocks()
    x, dy = inputs(1)
    ids, probs = routing(2, case)
    for a, b in zip(eager_step(host, x, ids, probs, dy), eager_step(dev, x, ids, probs, dy)):
        assert torch.equal(a, b)
    res = dev.dispatch(dev.quantize(x), ids, probs)
    rows, m_splits = dev._permute(res.hidden, res.topk_ids, res.topk_probs, res.tokens_per_expert)[::4]
    assert rows.shape[0] == -(-(T * K + E * 127) // 128) * 128 and isinstance(m_splits, torch.Tensor)
    assert (m_splits % 128 == 0).all() and m_splits.sum() == rows.shape[0] and m_splits.numel() == E + 1
    counts = res.tokens_per_expert.tolist()
    assert m_splits[:E].tolist() == [-(-c // 128) * 128 for c in counts]  # the experts' own padded rows


def test_device_splits_with_no_tokens():
    host, dev = blocks()
    x, dy = inputs(1, t=0)
    ids, probs = routing(2, t=0)
    out = eager_step(dev, x, ids, probs, dy)
    assert out[0].shape == (0, H) and all((g == 0).all() for g in out[3:])


def test_local_dispatcher_device_counts():
    ids, probs = routing(3, "ragged")
    x = torch.randn(T, H, device=KERNEL_DEVICE).bfloat16()
    on_host = LocalTokenDispatcher(E).dispatch(x, ids, probs).tokens_per_expert
    on_device = get_dispatcher("local", num_experts=E, host_counts=False).dispatch(x, ids, probs).tokens_per_expert
    assert isinstance(on_host, list) and isinstance(on_device, torch.Tensor)
    assert on_device.device == x.device and on_device.tolist() == on_host


@pytest.mark.parametrize("make, exc, match", [
    (lambda: FP8FlowMoE(E, H, FFN, K, dispatcher="alltoall", device_splits=True), ValueError,
     "device_splits=True needs the 'local' dispatcher, got 'alltoall'"),
    (lambda: FP8FlowMoE(E, H, FFN, K, device_splits=1), TypeError, "device_splits must be a bool, got 1"),
    (lambda: LocalTokenDispatcher(E, host_counts="no"), TypeError, "host_counts must be a bool"),
    (lambda: get_dispatcher("local", num_experts=E, num_nvl_bytes=1), ValueError,
     r"its options are host_counts and align_size, got \['num_nvl_bytes'\]"),
    (lambda: LocalTokenDispatcher(E, align_size=0), ValueError, "align_size must be None or a positive int .* got 0"),
    (lambda: LocalTokenDispatcher(E, align_size=True), ValueError, "align_size must be None or a positive int"),
], ids=["alltoall", "not-bool", "dispatcher-not-bool", "dispatcher-option", "align-zero", "align-bool"])
def test_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@requires_cuda
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_gpu_whole_block_has_no_host_sync(backend):
    """dispatch -> quantize -> permute -> fc1 -> SwiGLU -> fc2 -> unpermute -> combine and the backward:
    no host sync anywhere (``auto``: DeepGEMM fprop/dgrad where installed, Triton wgrad)."""
    torch.manual_seed(0)
    block = FP8FlowMoE(E, H, FFN, K, gemm_backend=backend, device="cuda", device_splits=True)
    x, dy = inputs(1)
    ids, probs = routing(2, "ragged")
    assert_no_host_sync(lambda: eager_step(block, x, ids, probs, dy))


def _capture(block, x, ids, probs, dy):
    """One CUDA graph of forward + backward on static buffers (``utils.cuda_graph``: after a warm-up):
    ``(graph, x, probs, [y, dx, dprobs, *weight grads])``, the outputs as the graph writes them."""
    xs, ps = x.clone().requires_grad_(), probs.clone().requires_grad_()
    outs = []

    def step():
        block.zero_grad(set_to_none=True)
        xs.grad = ps.grad = None
        y = block.forward_topk(xs, ids, ps)
        y.backward(dy)
        outs[:] = [y, xs.grad, ps.grad] + [p.grad for p in block.parameters()]

    return cuda_graph(step), xs, ps, outs


@requires_cuda
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_gpu_cuda_graph_replays_other_routings_bitwise(backend):
    """Captured once, replayed with routings whose per-expert counts differ (balanced, all on one expert,
    skewed with empty slots) and new tokens: every output and gradient equals an eager step bitwise."""
    torch.manual_seed(0)
    block = FP8FlowMoE(E, H, FFN, K, gemm_backend=backend, device="cuda", device_splits=True)
    eager = FP8FlowMoE(E, H, FFN, K, gemm_backend=backend, device="cuda", device_splits=True)
    eager.load_state_dict(block.state_dict())
    x, dy = inputs(1)
    ids, probs = routing(2)
    graph, xs, ps, outs = _capture(block, x, ids, probs, dy)
    for seed, case in [(3, "one-expert"), (4, "ragged"), (5, "random")]:
        x_new, dy_new = inputs(seed)
        ids_new, probs_new = routing(seed, case)
        xs.detach().copy_(x_new)
        ps.detach().copy_(probs_new)
        ids.copy_(ids_new)
        dy.copy_(dy_new)
        graph.replay()
        want = eager_step(eager, x_new, ids_new, probs_new, dy_new)
        for i, (got, ref) in enumerate(zip(outs, want)):
            assert torch.equal(got, ref), (case, i)
