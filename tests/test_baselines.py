"""benchmarks/baselines.py: the blocks every speedup is measured against. The BF16 grouped_mm block computes
the same block as the BF16 per-expert block (same parameters), with and without slots routed elsewhere; the
blockwise-casts block is within FP8 tolerance of it; both FP8FlowMoE subclasses share the block they are made
from and keep their tokens BF16 (no quantize phase)."""

import pytest
import torch

from baselines import BF16GroupedMMBlock, BF16LoopMoE, BlockwiseCastsMoE
from conftest import relerr
from transformer_engine_moe import FP8FlowMoE, Float8BlockwiseQTensor


def routed(t=96, e=4, elsewhere=False):
    x = torch.randn(t, 256, dtype=torch.bfloat16)
    logits = torch.randn(t, e)
    logits[:, 2] += 4  # expert 2 crowded, the others ragged
    probs, ids = torch.softmax(logits, -1).topk(2)
    if elsewhere:
        ids[::3, 1] = -1  # routed to another rank (after an EP dispatch)
    return x, ids, probs


@pytest.mark.parametrize("elsewhere", [False, True], ids=["all_local", "some_slots_elsewhere"])
def test_bf16_grouped_mm_block_matches_the_bf16_reference_block(elsewhere):
    torch.manual_seed(0)
    ref = BF16LoopMoE(4, 256, 128, 2)
    base = BF16GroupedMMBlock.from_block(ref)
    x, ids, probs = routed(elsewhere=elsewhere)
    dy = torch.randn_like(x)
    num_routed = int((ids >= 0).sum()) if elsewhere else None
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [ref.forward_topk(xs[0], ids, probs), base.forward_topk(xs[1], ids, probs, num_routed=num_routed)]
    for y in outs:
        y.backward(dy)
    assert relerr(outs[1], outs[0]) < 1e-2 and relerr(xs[1].grad, xs[0].grad) < 1e-2
    fc1 = torch.stack([w.grad for w in ref.linear_fc1.weights])
    fc2 = torch.stack([w.grad for w in ref.linear_fc2.weights])
    assert relerr(base.fc1.grad, fc1) < 1e-2 and relerr(base.fc2.grad, fc2) < 1e-2
    if elsewhere:  # without the count, rows past grouped_mm's last offset would be undefined: refused
        with pytest.raises(RuntimeError, match="pass num_routed"):
            base.forward_topk(x, ids, probs)


def test_blockwise_casts_block_is_close_to_the_bf16_block():
    """Within FP8 tolerance (each GEMM quantizes its operands, as FP8-Flow; test_moe.py's bound), and not
    the BF16 block itself."""
    torch.manual_seed(0)
    fp8 = FP8FlowMoE(4, 256, 128, 2)
    x, ids, probs = routed()
    outs = [cls.from_block(fp8).forward_topk(x, ids, probs) for cls in (BlockwiseCastsMoE, BF16LoopMoE)]
    assert 0 < relerr(outs[0], outs[1]) < 0.1


@pytest.mark.parametrize("cls", [BF16LoopMoE, BlockwiseCastsMoE])
def test_from_block_shares_the_experts_and_keeps_tokens_bf16(cls):
    fp8 = FP8FlowMoE(4, 256, 128, 2, recompute="moe_expert")
    twin = cls.from_block(fp8)
    assert isinstance(twin, FP8FlowMoE) and twin.linear_fc1 is fp8.linear_fc1 and twin.dispatcher is fp8.dispatcher
    assert twin.recompute is None and fp8.recompute == "moe_expert"
    x, ids, probs = routed()
    assert twin.quantize(x) is x and isinstance(fp8.quantize(x), Float8BlockwiseQTensor)
    built = cls(4, 256, 128, 2)  # the same block built and loaded: bitwise the same output
    built.load_state_dict(fp8.state_dict())
    assert torch.equal(twin.forward_topk(x, ids, probs), built.forward_topk(x, ids, probs))
