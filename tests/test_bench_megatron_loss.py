"""benchmarks/bench_megatron_loss.py on the CPU: its runs' command lines (qwen3_moe_like with fewer layers on the
standard library's bytes; the same seed and model for the BF16 stand-in and FP8-Flow + moe_expert, the control on
the next seed, FP8-Flow flags valid), how many runs share a GPU, the deviation curve, the table against the 0.25%
target and the results PNG."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_megatron_loss as bench  # noqa: E402
import bench_megatron_pretrain as pretrain  # noqa: E402


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_runs_share_model_and_seed_except_the_control():
    cmds = {run: bench.command(run, iters=500, layers=2, micro_batch_size=2) for run in bench.RUNS}
    for run, cmd in cmds.items():
        assert cmd[:3] == ["torchrun", "--nproc_per_node", "1"] and cmd[5].endswith("megatron_bench_entry.py")
        assert (_flag(cmd, "--train-iters"), _flag(cmd, "--num-layers"), _flag(cmd, "--micro-batch-size")) == (
            "500", "2", "2")
        assert (_flag(cmd, "--global-batch-size"), _flag(cmd, "--hidden-size"), _flag(cmd, "--num-experts")) == (
            "2", "2048", "128")  # one micro-batch per iteration, qwen3_moe_like's layer
        assert "--mock-data" not in cmd and "--vocab-size" not in cmd  # the standard library's bytes
        assert (_flag(cmd, "--lr"), _flag(cmd, "--log-interval")) == ("3e-4", str(bench.LOG_INTERVAL))
        assert _flag(cmd, "--seed") == ("1235" if run == "bf16_grouped_mm_seed_control" else "1234")
        assert _flag(bench.command(run, 10, 2, 2, seed=7), "--seed") == ("8" if run.endswith("control") else "7")
        assert ("--moe-fp8-flow" in cmd) == run.startswith("fp8_flow")
        assert ("--bench-grouped-mm" in cmd) == run.startswith("bf16") and "--bench-probe-memory" not in cmd
    flow = cmds["fp8_flow_single_weight_moe_expert"]
    assert _flag(flow, "--recompute-modules") == "moe_expert" and _flag(flow, "--moe-fp8-flow-format") == "e4m3"
    assert [a for a in cmds["bf16_grouped_mm"] if a.startswith("--") and a != "--master_port"] == [
        a for a in cmds["bf16_grouped_mm_seed_control"] if a.startswith("--") and a != "--master_port"]
    with pytest.raises(ValueError, match="run must be one of"):
        bench.command("fp8", 10, 2, 2)


@pytest.mark.parametrize("run", [r for r in bench.RUNS if r.startswith("fp8_flow")])
def test_fp8_flow_runs_pass_fp8_flow_validation(run):
    pytest.importorskip("megatron.core", reason="the compact loop's parser needs megatron-core")
    from examples.compact_loop import build_parser
    from megatron_patches.arguments import validate_fp8_flow_args

    args, _ = build_parser().parse_known_args(bench.command(run, 10, 2, 2)[6:])
    validate_fp8_flow_args(args)
    assert args.moe_fp8_flow and args.recompute_modules == ["moe_expert"]


def test_runs_per_gpu_follow_the_memory_model():
    h100, h200 = 81559 * 2**20, 143771 * 2**20
    assert (bench.runs_per_gpu(2, 2, h100), bench.runs_per_gpu(2, 2, h200)) == (2, 3)
    assert bench.runs_per_gpu(8, 2, h100) == 1 and bench.runs_per_gpu(1, 1, 1e12) == len(bench.RUNS)


def test_deviation():
    assert bench.deviation([2.0, 1.1, 0.5], [2.0, 1.0]) == [0.0, pytest.approx(0.1)]


def test_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    drawn = []
    import matplotlib.axes

    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, x, y, **kw: drawn.append((list(x), list(y), kw["label"])))
    flow = "fp8_flow_single_weight_moe_expert"
    rows = [dict(base_seed=1, run="bf16_grouped_mm", curve=[4.0, 2.0], curve_iters=[10, 20]),
            dict(base_seed=1, run=flow, curve=[4.0, 2.2], curve_iters=[10, 20]),
            dict(base_seed=1, run="bf16_grouped_mm_seed_control", status="timed out"),
            dict(base_seed=5, run="bf16_grouped_mm", curve=[3.0], curve_iters=[10]),
            dict(base_seed=5, run=flow, curve=[3.3], curve_iters=[10])]
    bench.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    assert drawn[2] == ([10, 20], [0.0, pytest.approx(10.0)], flow)
    assert drawn[5] == ([10], [pytest.approx(10.0)], flow)  # against its own seed's baseline


def test_runs_get_their_extra_environment():
    code = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    assert pretrain.run([sys.executable, "-c", code], 30, {"CUDA_VISIBLE_DEVICES": "3"}) == ("ok", "3\n")


def test_main_compares_against_the_baseline_and_the_target(tmp_path, monkeypatch):
    losses = {"bf16_grouped_mm": 2.0, "fp8_flow_single_weight_moe_expert": 2.004, "bf16_grouped_mm_seed_control": 2.01}
    launched = []

    def fake_run(cmd, timeout, extra_env):
        run = next(r for r in bench.RUNS if bench.command(r, 500, 2, 2)[6:] == cmd[6:])
        launched.append((run, extra_env["CUDA_VISIBLE_DEVICES"]))
        return "ok", f"iteration {500}/ 500 | elapsed time per iteration (ms): 90.0 | lm loss: {losses[run]} |\n"

    monkeypatch.setattr(pretrain, "run", fake_run)
    monkeypatch.setattr(pretrain, "gpu_facts", lambda: {"device": "H100", "gpu_memory_mib": 81559})
    monkeypatch.setattr(pretrain, "transformer_engine_version", lambda: None)
    monkeypatch.setattr(pretrain.utils, "free_port", lambda: 29500)  # equal commands across calls
    monkeypatch.setattr(bench.utils, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(bench.utils, "environment", lambda device: dict(device))
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 1)
    bench.main([])
    assert sorted(launched) == sorted((r, "0") for r in bench.RUNS)
    text = (tmp_path / "bench_megatron_loss_qwen3_moe_like.md").read_text()
    assert "| 1234 | fp8_flow_single_weight_moe_expert | 1234 | ok | 2.0040 | +0.20% | True |" in text
    assert "| 1234 | bf16_grouped_mm_seed_control | 1235 | ok | 2.0100 | +0.50% | False |" in text
    assert "runs_per_gpu: 2" in text and (tmp_path / "bench_megatron_loss_qwen3_moe_like.png").exists()
