"""benchmarks/bench_megatron_loss.py on the CPU: its runs' command lines (same seed and model for BF16 and
FP8-Flow, the control on the next seed, FP8-Flow flags valid), the deviation curve and the results PNG."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_megatron_loss as bench  # noqa: E402
import bench_megatron_pretrain as pretrain  # noqa: E402


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_runs_share_model_and_seed_except_the_control():
    cmds = {run: bench.command(run, iters=600, port=29500 + i) for i, run in enumerate(bench.RUNS)}
    model = bench.MODEL.split()
    for run, cmd in cmds.items():
        assert cmd[:6] == ["torchrun", "--nproc_per_node", "1", "--master_port", cmd[4], "-m"]
        assert cmd[6] == "examples.pretrain_gpt" and cmd[7:7 + len(model)] == model
        assert _flag(cmd, "--train-iters") == "600"
        assert _flag(cmd, "--seed") == ("1235" if run == "bf16_seed_control" else "1234")
        assert _flag(bench.command(run, 600, 29500, seed=7), "--seed") == ("8" if run == "bf16_seed_control" else "7")
        assert ("--moe-fp8-flow" in cmd) == run.startswith("fp8_flow")
    assert len({cmd[4] for cmd in cmds.values()}) == len(cmds)
    assert _flag(cmds["fp8_flow_e4m3_moe_expert"], "--fp8-format") == "e4m3"
    assert _flag(cmds["fp8_flow_hybrid_moe_expert"], "--fp8-format") == "hybrid"
    with pytest.raises(ValueError, match="run must be one of"):
        bench.command("fp8", 10, 29500)


@pytest.mark.parametrize("run", [r for r in bench.RUNS if r.startswith("fp8_flow")])
def test_fp8_flow_runs_pass_fp8_flow_validation(run):
    pytest.importorskip("megatron.core", reason="the compact loop's parser needs megatron-core")
    from examples.compact_loop import build_parser
    from megatron_patches.arguments import validate_fp8_flow_args

    args, _ = build_parser().parse_known_args(bench.command(run, 10, 29500)[7:])
    validate_fp8_flow_args(args)
    assert args.moe_fp8_flow and args.recompute_modules == ["moe_expert"]


def test_deviation():
    assert bench.deviation([2.0, 1.1, 0.5], [2.0, 1.0]) == [0.0, pytest.approx(0.1)]


def test_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    drawn = []
    import matplotlib.axes

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, x, y, **kw: drawn.append((list(x), list(y), kw["label"])))
    rows = [dict(base_seed=1, run="bf16", curve=[4.0, 2.0], curve_iters=[10, 20]),
            dict(base_seed=1, run="fp8_flow_e4m3_moe_expert", curve=[4.0, 2.2], curve_iters=[10, 20]),
            dict(base_seed=1, run="bf16_seed_control", status="timed out"),
            dict(base_seed=5, run="bf16", curve=[3.0], curve_iters=[10]),
            dict(base_seed=5, run="fp8_flow_hybrid_moe_expert", curve=[3.3], curve_iters=[10])]
    bench.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    assert drawn[2] == ([10, 20], [0.0, pytest.approx(10.0)], "fp8_flow_e4m3_moe_expert")
    assert drawn[5] == ([10], [pytest.approx(10.0)], "fp8_flow_hybrid_moe_expert")  # against its own seed's bf16


def test_runs_get_their_extra_environment():
    code = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    assert pretrain.run([sys.executable, "-c", code], 30, {"CUDA_VISIBLE_DEVICES": "3"}) == ("ok", "3\n")


def test_write_gives_losses_to_four_decimals_and_deviation_in_percent(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(bench.utils, "RESULTS_DIR", tmp_path)
    rows = [dict(base_seed=1, run="bf16", iters=600, final_loss=2.28734, vs_bf16=0.0, curve=[2.3], curve_iters=[10]),
            dict(base_seed=1, run="fp8_flow_e4m3_moe_expert", iters=600, final_loss=2.29053, vs_bf16=0.0013948,
                 curve=[2.31], curve_iters=[10])]
    text = bench.write(rows, {"device": "H100"}).read_text()
    assert "| 1 | bf16 | " in text and "| 2.2873 | +0.00% |" in text and "| 2.2905 | +0.14% |" in text
    assert text.count("600 iterations") == 1 and (tmp_path / "bench_megatron_loss.png").exists()
