"""benchmarks/bench_step_memory.py on the CPU: the live-bytes count on a known sequence of tensors, the command line,
and its rows at toy size with the launches faked (the GPU mode needs a GPU)."""

import pytest
import torch

import bench_step_memory as bench


def test_live_bytes_counts_the_tensors_made_while_they_live():
    """Storages made inside are counted until freed, views add nothing, tensors from before are not counted."""
    before = torch.zeros(1 << 20, dtype=torch.uint8)
    with bench.LiveBytes() as live:
        a = torch.zeros(1 << 20, dtype=torch.uint8)
        b = torch.ones(2 << 20, dtype=torch.uint8)
        view = b[: 1 << 10].view(torch.int32)
        c = before + 1  # a new 1 MiB storage
        same = before.view(torch.int32)  # a view of one from before: not counted
        assert live.now == 4 << 20 and same.untyped_storage().nbytes() == 1 << 20
        del a, c
        d = torch.empty(1 << 19, dtype=torch.uint8)
    assert (live.peak, live.now) == (4 << 20, (2 << 20) + (1 << 19))
    assert view.untyped_storage().nbytes() == b.untyped_storage().nbytes() and d.numel() == 1 << 19


def test_arguments():
    args = bench.parse_args([])
    assert args.config == ["qwen3_moe_like", "dsv3_ep8_rank"] and args.tokens == 16384 and not args.cpu_faked
    assert bench.CONFIGS["dsv3_ep8_rank"] == dict(experts=32, hidden=7168, ffn=2048, topk=8, tokens=(16384,))
    assert bench.parse_args(["--cpu-faked", "--tokens", "256"]).tokens == 256
    with pytest.raises(SystemExit):
        bench.parse_args(["--tokens", "0"])


def test_cpu_faked_rows_at_toy_size(monkeypatch):
    """FP8-Flow's three blocks with launches faked: a positive peak at least what the forward saves, the same
    activations with one weight or one per expert, and ``moe_expert``'s forward keeping less than either."""
    monkeypatch.setitem(bench.CONFIGS, "toy", dict(experts=4, hidden=256, ffn=128, topk=2, tokens=(512,)))
    rows = {r["block"]: r for r in bench.rows_for("toy", 512, "cpu")}
    assert list(rows) == ["fp8_flow_single_weight", "fp8_flow", "fp8_flow_single_weight_moe_expert"]
    assert all(0 < r["saved_mib"] <= r["peak_mib"] for r in rows.values())
    assert rows["fp8_flow"]["saved_mib"] == rows["fp8_flow_single_weight"]["saved_mib"]
    assert rows["fp8_flow_single_weight_moe_expert"]["saved_mib"] < rows["fp8_flow_single_weight"]["saved_mib"]
