"""benchmarks/bench_megatron_loss.py on the CPU: its runs' command lines (qwen3_moe_like with fewer layers on the
standard library's bytes; the same seed and model for the BF16 stand-in and FP8-Flow + moe_expert, the control on
the next seed, FP8-Flow flags valid, every iteration logged, Megatron's evaluation on), how many runs share a GPU,
the parse of Megatron's evaluation lines, the training-loss tail, the table against the 0.25% target on the final
evaluation loss and the results PNG."""

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_megatron_loss as bench  # noqa: E402
import bench_megatron_pretrain as pretrain  # noqa: E402

FLOW = "fp8_flow_single_weight_moe_expert"


def _flag(cmd, name):
    """The value of ``name``'s last occurrence, as Megatron's argparse reads a repeated flag."""
    return cmd[len(cmd) - 1 - cmd[::-1].index(name) + 1]


def _evaluation(prefix, loss):
    """Megatron's evaluation report (megatron/training/training.py, evaluate_and_print_results)."""
    string = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {2.718 ** loss:.6E} | "
    return "\n".join(["-" * (len(string) + 1), string, "-" * (len(string) + 1)]) + "\n"


def _log(iters, train, evals):
    """A run's log: an iteration line per iteration at loss ``train(i)``, and ``evals`` (prefix -> loss)."""
    lines = [f" [2026-11-27 15:00:00] iteration {i:8d}/ {iters:8d} | consumed samples: {2 * i} | elapsed time per "
             f"iteration (ms): 90.0 | learning rate: 3.0E-04 | lm loss: {train(i):.6E} | loss scale: 1.0 |\n"
             for i in range(1, iters + 1)]
    return "".join(lines) + "".join(_evaluation(p, loss) for p, loss in evals.items())


def test_runs_share_model_and_seed_except_the_control():
    cmds = {run: bench.command(run, iters=500, layers=2, micro_batch_size=2) for run in bench.RUNS}
    for run, cmd in cmds.items():
        assert cmd[:3] == ["torchrun", "--nproc_per_node", "1"] and cmd[5].endswith("megatron_bench_entry.py")
        assert (_flag(cmd, "--train-iters"), _flag(cmd, "--num-layers"), _flag(cmd, "--micro-batch-size")) == (
            "500", "2", "2")
        assert (_flag(cmd, "--global-batch-size"), _flag(cmd, "--hidden-size"), _flag(cmd, "--num-experts")) == (
            "2", "2048", "128")  # one micro-batch per iteration, qwen3_moe_like's layer
        assert "--mock-data" not in cmd and "--vocab-size" not in cmd  # the standard library's bytes
        assert (_flag(cmd, "--lr"), _flag(cmd, "--log-interval")) == ("3e-4", "1")
        assert (_flag(cmd, "--eval-iters"), _flag(cmd, "--eval-interval")) == (str(bench.EVAL_ITERS), "100")
        assert _flag(cmd, "--seed") == ("1235" if run == "bf16_grouped_mm_seed_control" else "1234")
        assert _flag(bench.command(run, 10, 2, 2, seed=7), "--seed") == ("8" if run.endswith("control") else "7")
        assert ("--moe-fp8-flow" in cmd) == run.startswith("fp8_flow")
        assert ("--bench-grouped-mm" in cmd) == run.startswith("bf16") and "--bench-probe-memory" not in cmd
    flow = cmds[FLOW]
    assert _flag(flow, "--recompute-modules") == "moe_expert" and _flag(flow, "--moe-fp8-flow-format") == "e4m3"
    assert [a for a in cmds["bf16_grouped_mm"] if a.startswith("--") and a != "--master_port"] == [
        a for a in cmds["bf16_grouped_mm_seed_control"] if a.startswith("--") and a != "--master_port"]
    with pytest.raises(ValueError, match="run must be one of"):
        bench.command("fp8", 10, 2, 2)
    with pytest.raises(ValueError, match="eval_iters must be >= 1"):
        bench.command(FLOW, 10, 2, 2, eval_iters=0)


def test_evaluation_flags_override_the_throughput_runs_ones():
    parser = argparse.ArgumentParser()  # Megatron's flags are plain argparse stores: the last occurrence wins
    for name in ("--eval-iters", "--eval-interval", "--log-interval"):
        parser.add_argument(name, type=int)
    args, _ = parser.parse_known_args(bench.command(FLOW, 300, 2, 2, eval_iters=8)[6:])
    assert (args.eval_iters, args.eval_interval, args.log_interval) == (8, 60, 1)
    assert bench.eval_interval(500) == 100 and bench.eval_interval(3) == 1


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
    # an H200 fits four: a seed's runs with the repeat
    assert (bench.runs_per_gpu(2, 2, h100), bench.runs_per_gpu(2, 2, h200)) == (2, 4)
    assert bench.runs_per_gpu(8, 2, h100) == 1 and bench.runs_per_gpu(1, 1, 1e12) == len(bench.RUNS)


def test_evaluations_average_the_final_models_evaluations():
    log = _log(4, lambda i: 3.0, {"iteration 2": 2.5, "iteration 4": 2.0, "iteration 4 on validation set": 2.2,
                                   "iteration 4 on test set": 2.3})
    final = pytest.approx((2.0 + 2.2 + 2.3) / 3)  # the loop's evaluation at 4, the validation and test ones after
    assert bench.evaluations(log, 4) == dict(eval_curve_iters=[2, 4], eval_curve=[2.5, final], final_evals=3,
                                             final_eval_loss=final)
    stopped = bench.evaluations(_log(4, lambda i: 3.0, {"iteration 2": 2.5}), 4)  # the run ended before iteration 4
    assert (stopped["eval_curve"], stopped["final_evals"], stopped["final_eval_loss"]) == ([2.5], 0, None)
    assert bench.evaluations("no evaluation", 4)["eval_curve_iters"] == []


def test_train_loss_averages_the_last_iterations():
    iters = list(range(1, 201))
    assert bench.train_loss(iters, [float(i) for i in iters], 200) == pytest.approx(150.5)  # iterations 101..200
    assert bench.train_loss(iters[:50], [1.0] * 50, 200) is None and bench.train_loss([], [], 200) is None


def test_deviation():
    assert bench.deviation([2.0, 1.1, 0.5], [2.0, 1.0]) == [0.0, pytest.approx(0.1)]


def test_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    drawn = []
    import matplotlib.axes

    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, x, y, **kw: drawn.append((list(x), list(y), kw["label"])))
    rows = [dict(base_seed=1, run="bf16_grouped_mm", curve=[4.0, 2.0], curve_iters=[1, 2], eval_curve=[3.0, 2.0],
                 eval_curve_iters=[1, 2]),
            dict(base_seed=1, run=FLOW, curve=[4.0, 2.2], curve_iters=[1, 2], eval_curve=[3.0, 2.2],
                 eval_curve_iters=[1, 2]),
            dict(base_seed=1, run="bf16_grouped_mm_seed_control", status="timed out"),
            dict(base_seed=5, run="bf16_grouped_mm", curve=[3.0], curve_iters=[1], eval_curve=[3.0],
                 eval_curve_iters=[1]),
            dict(base_seed=5, run=FLOW, curve=[3.3], curve_iters=[1], eval_curve=[3.3], eval_curve_iters=[1])]
    bench.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    assert drawn[1] == ([1, 2], [3.0, 2.0], "bf16_grouped_mm (eval)")
    assert drawn[4] == ([1, 2], [0.0, pytest.approx(10.0)], FLOW)  # the evaluation against the baseline's
    assert drawn[9] == ([1], [pytest.approx(10.0)], FLOW)  # against its own seed's baseline


def test_runs_get_their_extra_environment():
    code = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    assert pretrain.run([sys.executable, "-c", code], 30, {"CUDA_VISIBLE_DEVICES": "3"}) == ("ok", "3\n")


def _fake_machine(monkeypatch, tmp_path, fake_run):
    """``main``'s machine: ``fake_run`` for its runs (``pretrain.run``'s signature), one H100 without TE, equal
    ports across calls, results under ``tmp_path``; no ``CUDA_VISIBLE_DEVICES`` (a GPU runner's own would move
    the runs to its devices)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(pretrain, "run", fake_run)
    monkeypatch.setattr(pretrain, "gpu_facts", lambda: {"device": "H100", "gpu_memory_mib": 81559})
    monkeypatch.setattr(pretrain, "transformer_engine_version", lambda: None)
    monkeypatch.setattr(pretrain.utils, "free_port", lambda: 29500)
    monkeypatch.setattr(bench.utils, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(bench.utils, "environment", lambda device: dict(device))
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 1)


def test_main_compares_the_final_evaluation_against_the_baseline_and_the_target(tmp_path, monkeypatch):
    evals = {"bf16_grouped_mm": 2.0, FLOW: 2.004, "bf16_grouped_mm_seed_control": 2.01}
    launched = []

    def fake_run(cmd, timeout, extra_env):
        seed, run = next((s, r) for s in (1234, 1236) for r in bench.RUNS
                         if bench.command(r, 500, 2, 2, seed=s)[6:] == cmd[6:])
        launched.append((seed, run, extra_env["CUDA_VISIBLE_DEVICES"]))
        # the final model: the loop's evaluation and the two after training average to `loss`
        loss = evals[run] * (1 if seed == 1234 else 1.5)
        finals = {"iteration 500": loss - 0.01, "iteration 500 on validation set": loss,
                  "iteration 500 on test set": loss + 0.01}
        return "ok", _log(500, lambda i: 1.0 if i <= 400 else 2 * loss, {"iteration 100": 3.0, **finals})

    _fake_machine(monkeypatch, tmp_path, fake_run)
    old = dict(run="bf16_grouped_mm", base_seed=7, seed=7, iters=500, final_loss=1.0)  # before evaluations: dropped
    other = dict(run="bf16_grouped_mm", base_seed=9, seed=9, status="ok", iters=500, layers=2, micro_batch_size=2,
                 eval_iters=32, eval_interval=100, final_eval_loss=1.5, data=bench.DATA)  # another seed, alike: kept
    in_order = dict(other, base_seed=11, seed=11)  # evaluated on the windows in file order: dropped
    del in_order["data"]
    (tmp_path / "bench_megatron_loss_qwen3_moe_like.json").write_text(json.dumps({"results": [old, other, in_order]}))
    bench.main(["--seed", "1234", "1236"])
    assert sorted(launched) == sorted((s, r, "0") for s in (1234, 1236) for r in bench.RUNS if r != bench.REPEAT)
    text = (tmp_path / "bench_megatron_loss_qwen3_moe_like.md").read_text()
    assert "| 1234 | bf16_grouped_mm | 1234 | ok | 2.0000 | +0.00% | True | 3 | 4.0000 | +0.00% |" in text
    assert f"| 1234 | {FLOW} | 1234 | ok | 2.0040 | +0.20% | True | 3 | 4.0080 | +0.20% |" in text
    assert "| 1234 | bf16_grouped_mm_seed_control | 1235 | ok | 2.0100 | +0.50% | False | 3 | 4.0200 | +0.50% |" in text
    assert "| 9 | bf16_grouped_mm | 9 | ok | 1.5000 |" in text and "| 7 |" not in text and "| 11 |" not in text
    assert "| 1236 | bf16_grouped_mm_seed_control | 1237 | ok | 3.0150 | +0.50% |" in text
    assert (f"{FLOW} +0.20% (sd 0.00%, range +0.20% to +0.20%, 2 seeds); bf16_grouped_mm_seed_control +0.50% (sd "
            "0.00%, range +0.50% to +0.50%, 2 seeds)") in text
    assert "runs_per_gpu: 2" in text and (tmp_path / "bench_megatron_loss_qwen3_moe_like.png").exists()
    row = json.loads((tmp_path / "bench_megatron_loss_qwen3_moe_like.json").read_text())["results"][2]
    assert row["data"] == bench.DATA and row["device"] == "H100"
    assert (row["run"], row["eval_curve_iters"], row["final_evals"], len(row["curve"])) == (FLOW, [100, 500], 3, 500)
    assert "final_loss" not in row


def test_repeat_run_is_the_baselines_command_added_to_measured_seeds(tmp_path, monkeypatch):
    """``--runs bf16_grouped_mm_repeat`` runs the baseline's command again (its port aside: the same seed, model
    and data) for seeds already measured, keeps their stored rows and compares the new one with their baseline;
    stored rows of other settings stop the call before it runs anything."""
    base, repeat = (bench.command(r, 500, 2, 2, seed=5) for r in (bench.BASELINE, bench.REPEAT))
    port = base.index("--master_port") + 1
    assert base[:port] + base[port + 1:] == repeat[:port] + repeat[port + 1:]
    assert bench.REPEAT not in bench.DEFAULT_RUNS
    commands = []

    def fake_run(cmd, timeout, extra_env):
        commands.append(cmd)
        finals = {f"iteration 500{s}": 2.02 for s in ("", " on validation set", " on test set")}
        return "ok", _log(500, lambda i: 1.0, finals)

    _fake_machine(monkeypatch, tmp_path, fake_run)
    monkeypatch.setattr(bench, "plot", lambda rows, path: None)
    stored = [dict(run=run, base_seed=5, seed=5 + bench.RUNS[run][0], status="ok", data=bench.DATA, iters=500,
                   layers=2, micro_batch_size=2, eval_iters=32, eval_interval=100, final_eval_loss=loss)
              for run, loss in zip(bench.DEFAULT_RUNS, (2.0, 2.01, 2.05))]
    path = tmp_path / "bench_megatron_loss_qwen3_moe_like.json"
    path.write_text(json.dumps({"results": stored}))
    with pytest.raises(SystemExit):
        bench.main(["--seed", "5", "--runs", bench.REPEAT, "--train-iters", "400"])
    assert commands == []
    bench.main(["--seed", "5", "--runs", bench.REPEAT])
    rows = json.loads(path.read_text())["results"]
    assert len(commands) == 1 and [r["run"] for r in rows] == list(bench.RUNS)
    assert [r["final_eval_loss"] for r in rows[:3]] == [2.0, 2.01, 2.05]
    assert rows[3]["seed"] == 5 and rows[3]["eval_vs_bf16"] == pytest.approx(0.01)
    assert rows[1]["eval_vs_bf16"] == pytest.approx(0.005)


def test_main_needs_more_iterations_than_the_training_tail():
    with pytest.raises(SystemExit):
        bench.main(["--train-iters", str(bench.TRAIN_TAIL)])


def test_runs_land_on_the_callers_gpus(monkeypatch):
    """Started with CUDA_VISIBLE_DEVICES=3, the runs go to GPU 3: a bare "0" put them on the machine's GPU 0 beside
    another job (2026-11-27: the block benchmark there ran 3.6x slow)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert bench.visible_devices(1) == ["3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")
    assert bench.visible_devices(2) == ["2", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert bench.visible_devices(2) == ["0", "1"]
