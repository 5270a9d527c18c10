"""benchmarks/baselines.py: the BF16 grouped_mm block every speedup is measured against computes the same
block as FP8FlowMoE's BF16 reference path (same parameters), with and without slots routed elsewhere."""

import sys
from pathlib import Path

import pytest
import torch

from transformer_engine_moe import FP8FlowMoE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from baselines import BF16GroupedMMBlock  # noqa: E402


def relerr(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("elsewhere", [False, True], ids=["all_local", "some_slots_elsewhere"])
def test_bf16_grouped_mm_block_matches_the_bf16_reference_block(elsewhere):
    torch.manual_seed(0)
    ref = FP8FlowMoE(4, 256, 128, 2, precision="bf16")
    base = BF16GroupedMMBlock.from_block(ref)
    x = torch.randn(96, 256, dtype=torch.bfloat16)
    logits = torch.randn(96, 4)
    logits[:, 2] += 4  # expert 2 crowded, the others ragged
    probs, ids = torch.softmax(logits, -1).topk(2)
    if elsewhere:
        ids[::3, 1] = -1  # routed to another rank (after an EP dispatch)
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
