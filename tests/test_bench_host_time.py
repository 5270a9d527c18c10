"""benchmarks/bench_host_time.py on the CPU: its configurations, command line, blocks stepped at toy size with the
host timing loop, the cProfile rows of ``--profile-host`` and the idle accounting of ``--gpu-idle`` on a made-up
trace (the torch-profiler part needs a GPU)."""

import pytest

import bench_host_time as bench
import utils


def test_configurations():
    q = bench.CONFIGS["qwen3_moe_like"]
    assert q == dict(experts=128, hidden=2048, ffn=768, topk=8, tokens=(16384, 4096))
    assert bench.CONFIGS["deepseek_small"] == dict(experts=64, hidden=2048, ffn=1024, topk=8, tokens=(4096,))
    assert bench.CONFIGS["dsv3_ep8_rank"] == dict(experts=32, hidden=7168, ffn=2048, topk=8, tokens=(16384,))


def test_arguments():
    args = bench.parse_args(["--config", "qwen3_moe_like", "deepseek_small", "--profile-host", "--gpu-idle"])
    assert args.config == ["qwen3_moe_like", "deepseek_small"] and args.profile_host and args.tokens is None
    assert args.gpu_idle and not bench.parse_args([]).gpu_idle
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
    assert list(blocks) == ["bf16_grouped_mm", "fp8_flow_single_weight", "fp8_flow",
                            "fp8_flow_single_weight_moe_expert"]
    assert (blocks["fp8_flow_single_weight_moe_expert"].recompute, blocks["fp8_flow_single_weight"].recompute) == (
        "moe_expert", None)
    for name, block in blocks.items():
        step = utils.moe_step(block, *inputs, fp8_weights="cached")
        host, wall = utils.host_and_wall_ms(step, 2, lambda: None)
        assert 0 < host <= wall, name
        assert all(p.grad is not None for p in block.parameters()), name
    rows = bench.host_profile(step, 2, lambda: None, top=5)
    assert len(rows) == 5 and rows == sorted(rows, key=lambda r: -r["own_ms"])
    assert all(r["calls"] > 0 and 0 <= r["own_ms"] <= r["cumulative_ms"] + 1e-9 for r in rows)
    assert all(":" in r["function"] and "(" in r["function"] for r in rows)


def test_gpu_idle_finds_where_the_gpu_waits():
    """``gpu_idle`` on a made-up trace of five steps, each opened by a marker: a 10 us kernel, 50 us of idle, a
    100 us kernel with a 30 us one overlapping it (another stream), 5 us of idle before the next marker; the
    first and last steps differ and are dropped. Medians per step and the kernels with the most idle before them."""
    mark = f"void at::native::vectorized_elementwise_kernel<4, {bench.STEP_MARKER}>"
    trace, t = [], 0.0
    for i in range(5):
        first = 400.0 if i in (0, 4) else 50.0  # the dropped steps idle longer
        trace += [(t, t + 1, mark), (t + 1, t + 11, "quantize"), (t + 11 + first, t + 111 + first, "gemm"),
                  (t + 20 + first, t + 50 + first, "copy")]
        t += 116 + first
    trace.append((t, t + 1, mark))
    res = bench.gpu_idle(reversed(trace), top=2)
    assert res["steps"] == 3 and res["kernels"] == 3
    assert res["step_us"] == 166 and res["kernel_us"] == 140 and res["idle_us"] == 55  # 0 + 50 + 0 (overlap) + 5
    assert res["idle_before"] == [dict(position=2, kernel="gemm", idle_us=50.0),
                                  dict(position=1, kernel="quantize", idle_us=0.0)]
    with pytest.raises(ValueError, match="gpu_idle needs 4 or more"):
        bench.gpu_idle(trace[:9])


def test_cpu_faked_mode_arguments(capsys):
    assert bench.parse_args(["--cpu-faked", "--tokens", "256"]).cpu_faked and not bench.parse_args([]).cpu_faked
    with pytest.raises(SystemExit):
        bench.parse_args(["--cpu-faked", "--gpu-idle"])
    assert "--cpu-faked measures the CPU alone" in capsys.readouterr().err


def test_cpu_faked_rows_time_the_host_path_and_put_every_launcher_back():
    """``--cpu-faked`` at toy size: a row per FP8-Flow block (the BF16 block's ops have no fakes), positive times,
    the least at most the median; inside ``faked_launches`` the launchers are replaced, the routing's still computing
    what the original does (its time counted), and outside every launcher and ``routed_experts`` are the originals."""
    import torch
    from transformer_engine_moe import backend
    from transformer_engine_moe.module.moe import FP8FlowMoE

    originals = {name: getattr(backend.REFERENCE, name) for name in ("grouped_gemm", "permute", "topk_routing")}
    routed = FP8FlowMoE.routed_experts
    shape = dict(config="toy", experts=4, hidden=128, ffn=128, topk=2, tokens=16)
    rows = bench.cpu_faked_rows(shape, steps=3)
    assert [r["block"] for r in rows] == ["fp8_flow_single_weight", "fp8_flow", "fp8_flow_single_weight_moe_expert"]
    for r in rows:
        assert 0 < r["host_us_min"] <= r["host_us"] and 0 < r["experts_us_min"] <= r["experts_us"], r
    with bench.faked_launches() as clock:
        assert backend.REFERENCE.grouped_gemm is not originals["grouped_gemm"]
        assert backend.REFERENCE.permute is not originals["permute"] and FP8FlowMoE.routed_experts is not routed
        assert clock == {"kept_s": 0.0, "experts_s": 0.0, "entered": None}
        idx, w = torch.tensor([[0, 1], [2, -1]]), torch.rand(2, 2)
        got, want = backend.REFERENCE.topk_routing(idx, w, 4), originals["topk_routing"](idx, w, 4)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and clock["kept_s"] > 0
    assert all(getattr(backend.REFERENCE, name) is fn for name, fn in originals.items())
    assert FP8FlowMoE.routed_experts is routed
