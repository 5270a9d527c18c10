"""bench_graphed_moe's steps at toy size on the CPU (timing and the graphs need a GPU): the eager variants step
forward and backward under Megatron DDP's gradient contract, their weights' main_grad filled by DDP's hook; the
graphed ones refuse the CPU by name."""

from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_eager_variants_step_and_graphed_ones_need_a_gpu(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_graphed_moe as bench

    assert list(bench.VARIANTS) == ["fp8_flow_single_weight", "fp8_flow_device_splits_single_weight",
                                    "fp8_flow_graph_single_weight", "fp8_flow_graph",
                                    "fp8_flow_single_weight_moe_expert", "fp8_flow_graph_single_weight_moe_expert"]
    assert bench.NO_DEEPGEMM == {"fp8_flow_graph_single_weight_no_deepgemm": "fp8_flow_graph_single_weight"}
    runs = {**{name: name for name in bench.VARIANTS}, **bench.NO_DEEPGEMM}
    for name, runs_as in runs.items():
        _, graphed, _, recompute = bench.VARIANTS[runs_as]
        step, block = bench.make_step(name, 4, 128, 128, 2, 16, False, "cpu")
        if graphed:
            with pytest.raises(ValueError, match="must be a CUDA tensor, got cpu"):
                step()
            continue
        step(), step()
        assert block.recompute == recompute, name
        assert all(p.grad is None and p.main_grad.abs().sum() > 0 for p in block.parameters()), name


def test_baseline_is_the_bf16_block_over_the_same_experts(monkeypatch):
    """``bf16_grouped_mm``: the BF16 grouped_mm block with the single-weight block's experts, stepped through
    ``forward_topk`` under the same gradient contract (main_grad filled, .grad dropped)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_graphed_moe as bench
    from baselines import BF16GroupedMMBlock

    step, block = bench.make_step(bench.BASELINE, 4, 128, 128, 2, 16, False, "cpu")
    _, fp8 = bench.make_step("fp8_flow_single_weight", 4, 128, 128, 2, 16, False, "cpu")
    assert isinstance(block, BF16GroupedMMBlock) and bench.BASELINE not in bench.VARIANTS
    assert torch.equal(block.fc1, torch.stack(fp8.linear_fc1.weights))
    step(), step()
    assert all(p.grad is None and p.main_grad.abs().sum() > 0 for p in block.parameters())


def test_results_name_takes_the_config_then_the_suffix(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_graphed_moe as bench

    assert bench.results_tail("qwen3_moe_like") == ""
    assert bench.results_tail("dsv3_ep8_rank") == "_dsv3_ep8_rank"
    assert bench.results_tail("dsv3_ep8_rank", "_unfused") == "_dsv3_ep8_rank_unfused"
