"""benchmarks/bench_host_time.py on the CPU: its configurations, command line, blocks stepped at toy size with the
host timing loop, and the cProfile rows of ``--profile-host`` (the torch-profiler part needs a GPU)."""

import pytest

import bench_host_time as bench
import utils


def test_configurations():
    q = bench.CONFIGS["qwen3_moe_like"]
    assert q == dict(experts=128, hidden=2048, ffn=768, topk=8, tokens=(16384, 4096))
    assert bench.CONFIGS["deepseek_small"] == dict(experts=64, hidden=2048, ffn=1024, topk=8, tokens=(4096,))


def test_arguments():
    args = bench.parse_args(["--config", "qwen3_moe_like", "deepseek_small", "--profile-host"])
    assert args.config == ["qwen3_moe_like", "deepseek_small"] and args.profile_host and args.tokens is None
    assert bench.parse_args([]).config == ["deepseek_small"] and not bench.parse_args([]).profile_host
    assert bench.parse_args(["--tokens", "8192"]).tokens == [8192]


@pytest.mark.parametrize("argv, message", [(["--config", "qwen3"], "invalid choice"),
                                           (["--steps", "0"], "--steps must be"),
                                           (["--tokens", "0"], "--tokens must be positive")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_every_block_steps_with_cached_weights_on_the_cpu():
    """The blocks, inputs and timing loop at toy size: every block steps forward and backward, its weights get
    gradients, the times are positive and ordered; then cProfile's rows of the same steps."""
    inputs = bench.make_inputs(16, 128, 4, 2, "cpu")
    blocks = bench.make_blocks(4, 128, 128, 2, "cpu")
    assert list(blocks) == ["bf16_grouped_mm", "fp8_flow_single_weight", "fp8_flow"]
    for name, block in blocks.items():
        step = utils.moe_step(block, *inputs, fp8_weights="cached")
        host, wall = utils.host_and_wall_ms(step, 2, lambda: None)
        assert 0 < host <= wall, name
        assert all(p.grad is not None for p in block.parameters()), name
    rows = bench.host_profile(step, 2, lambda: None, top=5)
    assert len(rows) == 5 and rows == sorted(rows, key=lambda r: -r["own_ms"])
    assert all(r["calls"] > 0 and 0 <= r["own_ms"] <= r["cumulative_ms"] + 1e-9 for r in rows)
    assert all(":" in r["function"] and "(" in r["function"] for r in rows)
