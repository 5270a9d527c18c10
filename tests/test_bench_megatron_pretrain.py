"""benchmarks/bench_megatron_pretrain.py on the CPU: the command lines of its runs (EP = GPU count, the two
DeepSeek-shaped configurations, every variant's flags valid for FP8-Flow), Megatron's log parsed into a row, and a
run past its time limit killed with its children."""

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_megatron_pretrain as bench  # noqa: E402


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_deepseek_small_on_four_gpus():
    cmd = bench.command("deepseek_small", "fp8_flow_deepep_moe_expert", gpus=4, iters=40)
    assert cmd[:4] == ["torchrun", "--nproc_per_node", "4", "--master_port"] and 0 < int(cmd[4]) < 65536
    assert cmd[5:7] == ["-m", "examples.pretrain_gpt"]
    assert _flag(cmd, "--expert-model-parallel-size") == "4" and _flag(cmd, "--global-batch-size") == str(4 * bench.MICRO_BATCHES)
    assert int(_flag(cmd, "--num-layers")) >= 4 and int(_flag(cmd, "--hidden-size")) >= 2048
    assert int(_flag(cmd, "--num-experts")) >= 64 and _flag(cmd, "--moe-router-topk") == "8"
    assert {"--moe-grouped-gemm", "--mock-data", "--moe-fp8-flow"} <= set(cmd)
    assert _flag(cmd, "--moe-token-dispatcher-type") == "flex" and _flag(cmd, "--recompute-modules") == "moe_expert"


@pytest.mark.parametrize("gpus, layers, experts", [(1, "1", "64"), (2, "1", "256"), (4, "1", "256"), (8, "2", "256")])
def test_deepseek_v3_slice_shapes(gpus, layers, experts):
    cmd = bench.command("deepseek_v3_slice", "megatron_bf16", gpus=gpus, iters=40)
    assert (_flag(cmd, "--hidden-size"), _flag(cmd, "--moe-ffn-hidden-size"), _flag(cmd, "--num-experts")) == (
        "7168", "2048", experts)
    assert _flag(cmd, "--num-layers") == layers and _flag(cmd, "--expert-model-parallel-size") == str(gpus)
    assert "--moe-fp8-flow" not in cmd and _flag(cmd, "--moe-token-dispatcher-type") == "alltoall"


def test_variants():
    grouped = bench.command("deepseek_small", "bf16_grouped_mm", gpus=2, iters=10)
    assert grouped[5].endswith("benchmarks/megatron_grouped_mm.py") and "--moe-fp8-flow" not in grouped
    assert _flag(bench.command("deepseek_small", "megatron_bf16_seed_control", 2, 10), "--seed") == "1235"
    assert _flag(bench.command("deepseek_small", "fp8_flow_alltoall", 2, 10), "--seed") == "1234"
    with pytest.raises(ValueError, match="variant one of"):
        bench.command("deepseek_small", "fp8", 2, 10)


@pytest.mark.parametrize("config", bench.CONFIGS)
@pytest.mark.parametrize("variant", [v for v in bench.VARIANTS if v.startswith("fp8_flow")])
def test_fp8_flow_runs_pass_fp8_flow_validation(config, variant):
    pytest.importorskip("megatron.core", reason="the compact loop's parser needs megatron-core")
    from examples.compact_loop import build_parser
    from megatron_patches.arguments import validate_fp8_flow_args

    cmd = bench.command(config, variant, gpus=4, iters=40)
    args, _ = build_parser().parse_known_args(cmd[5:])
    validate_fp8_flow_args(args)
    assert args.moe_fp8_flow and args.hidden_size % 128 == 0


LOG = """\
experts: FP8-Flow on cuda:0: Triton kernels; grouped GEMMs 'auto', per call the first that can run it: fprop/dgrad DeepGEMM
 [2026-11-23 10:00:00] iteration        5/      20 | consumed samples: 20 | elapsed time per iteration (ms): 900.0 | lm loss: 1.050000E+01 |
[Rank 0] (after 5 iterations) memory (MB) | allocated: 9000.0 | max allocated: 14100.5 | reserved: 15000.0
 [2026-11-23 10:00:05] iteration       10/      20 | consumed samples: 40 | elapsed time per iteration (ms): 150.0 | lm loss: 9.000000E+00 |
 [2026-11-23 10:00:06] iteration       15/      20 | consumed samples: 60 | elapsed time per iteration (ms): 140.0 | lm loss: 8.000000E+00 |
 [2026-11-23 10:00:07] iteration       20/      20 | consumed samples: 80 | elapsed time per iteration (ms): 160.0 | lm loss: 7.000000E+00 |
allocator (rank 1): retries 37, reserved peak 137141.2 MiB
allocator (rank 0): retries 35, reserved peak 137145.0 MiB
"""


def test_parse_log():
    row = bench.parse_log(LOG, tokens_per_iter=4 * 4096, gpus=4)
    assert row["iter_ms"] == 150.0  # iterations 15 and 20: past the warm-up
    assert row["tokens_per_s_per_gpu"] == pytest.approx(4096 / 0.150)
    assert row["max_allocated_mib"] == 14100.5 and row["final_loss"] == 7.0 and row["curve"] == [10.5, 9.0, 8.0, 7.0]
    assert row["curve_iters"] == [5, 10, 15, 20]
    assert row["experts"].startswith("experts: FP8-Flow on cuda:0")
    assert row["alloc_retries"] == 37 and row["reserved_peak_mib"] == 137145.0  # the most of any rank
    unreported = bench.parse_log(LOG.split("allocator")[0], tokens_per_iter=4 * 4096, gpus=4)
    assert unreported["alloc_retries"] is None and unreported["reserved_peak_mib"] is None
    with pytest.raises(ValueError, match="no 'iteration"):
        bench.parse_log("Traceback ...", 1, 1)


TORCHRUN_REPORT = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
examples.pretrain_gpt FAILED
"""


def test_outcome_keeps_a_failed_runs_log_tail_and_root_cause_with_what_it_logged():
    ok = bench.outcome("ok", LOG, 4 * 4096, 4)
    assert "log_tail" not in ok and "error" not in ok and ok["iter_ms"] == 150.0
    oom = "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 7.00 GiB"
    failed = bench.outcome("exit 1", LOG + "Traceback (most recent call last):\n" + oom + "\n" + TORCHRUN_REPORT,
                           4 * 4096, 4)
    assert failed["final_loss"] == 7.0 and failed["log_tail"].endswith("FAILED\n")
    assert failed["error"] == oom  # the root cause, not torchrun's ChildFailedError
    assert failed["tokens_per_s_per_gpu"] is None and failed["iter_ms"] is None  # not a measurement
    assert bench.outcome("ok", "no iterations", 1, 1) == {"log_tail": "no iterations", "error": ""}


def test_plot_draws_every_config_and_run(tmp_path, monkeypatch):
    """The results PNG: per config, the loss curves and tokens/s of its runs (a row without a curve is left
    out, e.g. a run that timed out; a failed run's curve is drawn without a tokens/s bar)."""
    pytest.importorskip("matplotlib")
    drawn = []
    import matplotlib.axes

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, x, y, **kw: drawn.append((list(x), y, kw["label"])))
    bars = []
    monkeypatch.setattr(matplotlib.axes.Axes, "barh", lambda self, labels, widths: bars.append(list(widths)))
    row = dict(bench.parse_log(LOG, 4 * 4096, 4), device="H100", micro_batches=8)
    oom = bench.outcome("exit 1", LOG + "torch.OutOfMemoryError: CUDA out of memory", 4 * 4096, 4)
    rows = [dict(row, config="deepseek_small", variant="fp8_flow_alltoall"),
            dict(row, config="deepseek_small", variant="bf16_grouped_mm", curve=[11.0, 9.5, 8.5, 7.5]),
            dict(row, config="deepseek_v3_slice", variant="megatron_bf16"),
            dict(oom, config="deepseek_v3_slice", variant="bf16_grouped_mm", status="exit 1"),
            dict(config="deepseek_v3_slice", variant="fp8_flow_deepep", status="timed out")]
    bench.plot(rows, tmp_path / "p.png", gpus=4)
    assert (tmp_path / "p.png").stat().st_size > 0
    labels = ["fp8_flow_alltoall", "bf16_grouped_mm", "megatron_bf16", "bf16_grouped_mm"]
    assert [label for *_, label in drawn] == labels
    assert drawn[1][:2] == ([5, 10, 15, 20], [11.0, 9.5, 8.5, 7.5])
    speed = row["tokens_per_s_per_gpu"]
    assert bars == [[speed, speed], [speed]]  # the failed run's curve is drawn, it gets no tokens/s bar


def test_a_run_past_its_time_limit_is_killed_with_its_children(tmp_path):
    marker = tmp_path / "child_alive"
    began = time.perf_counter()
    status, _ = bench.run(["bash", "-c", f"(sleep 3; touch {marker}) & sleep 30"], timeout=1)
    assert status == "timed out" and time.perf_counter() - began < 10
    time.sleep(3)
    assert not marker.exists()  # the background child went with the group
    assert bench.run([sys.executable, "-c", "print('iteration')"], timeout=30) == ("ok", "iteration\n")
    assert bench.run([sys.executable, "-c", "raise SystemExit(3)"], timeout=30)[0] == "exit 3"


def test_an_interrupted_benchmark_kills_the_running_group(tmp_path, monkeypatch):
    """SIGTERM (an outer ``timeout``) becomes SystemExit in ``main``; ``run`` then kills torchrun's group, so no
    worker keeps the rendezvous port for the next run."""
    marker = tmp_path / "child_alive"

    def interrupted(self, timeout=None):
        raise SystemExit(143)

    monkeypatch.setattr(bench.subprocess.Popen, "communicate", interrupted)
    with pytest.raises(SystemExit):
        bench.run(["bash", "-c", f"(sleep 2; touch {marker}) & sleep 30"], timeout=60)
    time.sleep(3)
    assert not marker.exists()


def test_repeats_interleave_the_variants_and_rows_take_the_median(tmp_path, monkeypatch):
    """``--repeats 3``: the variants run in turn three times (a slow spell of the machine hits every variant),
    each row gives the median tokens/s and iteration time of its finished runs with their spread; a failed run
    counts in ``repeats`` and ``tokens_per_s_runs`` but not in the median."""
    order, speeds = [], {"bf16_grouped_mm": [100.0, 120.0, 110.0], "fp8_flow_alltoall": [90.0, None, 130.0]}

    def fake_run(cmd, timeout):
        variant = "fp8_flow_alltoall" if "--moe-fp8-flow" in cmd else "bf16_grouped_mm"
        order.append(variant)
        speed = speeds[variant][len([v for v in order if v == variant]) - 1]
        return ("ok" if speed else "exit 1"), speed

    def fake_outcome(status, speed, tokens_per_iter, gpus):
        return dict(tokens_per_s_per_gpu=speed, iter_ms=1e3 / speed if speed else None, final_loss=1.0)

    written = []
    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench, "outcome", fake_outcome)
    monkeypatch.setattr(bench, "write", lambda rows, *a: written.append(rows) or tmp_path / "r.md")
    monkeypatch.setattr(bench.utils, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(bench.utils, "environment", lambda: {"device": "stub"})
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 2)
    (tmp_path / "r.md").write_text("")
    monkeypatch.setattr(sys, "argv", ["bench", "--variants", "bf16_grouped_mm", "fp8_flow_alltoall", "--repeats", "3"])
    bench.main()
    assert order == ["bf16_grouped_mm", "fp8_flow_alltoall"] * 3
    bf16, fp8 = written[-1]
    assert (bf16["repeats"], bf16["tokens_per_s_per_gpu"]) == (3, 110.0)
    assert bf16["tokens_per_s_runs"] == [100.0, 120.0, 110.0]
    assert bf16["tokens_per_s_spread"] == pytest.approx(20 / 110) and bf16["iter_ms"] == pytest.approx(1e3 / 110)
    assert (fp8["repeats"], fp8["tokens_per_s_per_gpu"], fp8["tokens_per_s_runs"]) == (3, 110.0, [90.0, None, 130.0])
    assert fp8["status"] == "ok" and fp8["tokens_per_s_spread"] == pytest.approx(40 / 110)
    assert bench.combine([dict(tokens_per_s_per_gpu=None, status="timed out")]) == dict(
        tokens_per_s_per_gpu=None, status="timed out", repeats=1, tokens_per_s_runs=[None])
