"""The demo picks its runs from where it runs and tells the truth about speed: on the CPU (and with CUDA but without
``megatron.training``) the compact loop as before, saying the CPU runs the plain-PyTorch reference path; on a GPU
Megatron's pretrain with BF16 grouped experts against FP8-Flow, its summary naming the GPU, the path, the experts'
backends and what a small model's speed means. The runs are stand-ins here (no training); the expert-path line
says which backends run the experts, on a CPU and on a GPU."""

import json
import os
import pathlib
import sys

import pytest
import torch

from examples import demo
from examples.expert_path import CPU_PATH, gemm_backends

SUMMARY = {"steps": 120, "final_loss_window": 10, "final_loss": {"bf16_experts": 2.7314, "fp8_flow_moe_expert": 2.7504},
           "relative_deviation": 0.0070, "within_1_percent": True,
           "runs": {"bf16_experts": {"tokens_per_s": 4000.0, "peak_memory_bytes": 881 << 20, "wall_s": 60.0,
                                     "expert_path": "experts: Megatron's SequentialMLP on cpu (plain torch matmuls)"},
                    "fp8_flow_moe_expert": {"tokens_per_s": 1100.0, "peak_memory_bytes": 920 << 20, "wall_s": 220.0,
                                            "expert_path": f"experts: FP8-Flow on cpu: {CPU_PATH}"}},
           "speed_note": demo.SPEED_NOTE}
GPU = "NVIDIA H100 80GB HBM3"
FP8_EXPERTS = "experts: FP8-Flow on cuda:0: Triton kernels; grouped GEMMs 'auto', per call the first that can run it"
BF16_EXPERTS = "experts: Megatron's SequentialMLP on cuda:0 (plain torch matmuls)"


def megatron_line(i: int, ms: float, loss: float, iters: int = 30) -> str:
    """One of Megatron 0.19's iteration log lines (``training_log``), MoE metrics included."""
    return (f" [2026-11-28 10:00:00.000000] iteration {i:8d}/{iters:8d} | consumed samples: {8 * i:12d} | elapsed "
            f"time per iteration (ms): {ms:.1f} | learning rate: 3.000000E-04 | global batch size:     8 | lm loss: "
            f"{loss:.6E} | load_balancing_loss: 1.000123E+00 | loss scale: 1.0 | grad norm: 1.234 | number of "
            "skipped iterations:   0 | number of nan iterations:   0 |\n")


def megatron_log(experts: str, iters: int = 30) -> list[str]:
    """A run's output: the experts line, ``iters`` iterations (the first 5 s, the rest 100 ms), the memory reports."""
    lines = [f"{experts}\n"] + [megatron_line(i, 5000.0 if i == 1 else 100.0, 5.0 - i / 100, iters)
                                for i in range(1, iters + 1)]
    return lines + ["[Rank 0] (after 1 iterations) memory (MB) | allocated: 900.0 | max allocated: 4096.00 | "
                    "reserved: 5000.0 | max reserved: 5000.0\n",
                    "allocator (rank 0): retries 0, reserved peak 5120.0 MiB\n"]


class FakeRuns:
    """Stands in for ``subprocess.Popen``: records each command and environment; a compact-loop run writes its
    ``--summary-json``, a Megatron run prints ``megatron_log``."""

    def __init__(self):
        self.cmds, self.envs = [], []

    def __call__(self, cmd, stdout, stderr, text, env):
        self.cmds.append(cmd)
        self.envs.append(env)
        fp8 = "--moe-fp8-flow" in cmd
        if "--summary-json" in cmd:
            pathlib.Path(cmd[cmd.index("--summary-json") + 1]).write_text(json.dumps(
                {"loss_curve": [5.0, 4.0], "tokens_per_s": 1000.0, "peak_memory_bytes": 800 << 20, "seq_length": 256,
                 "global_batch_size": 8, "expert_path": SUMMARY["runs"]["fp8_flow_moe_expert" if fp8 else
                                                                         "bf16_experts"]["expert_path"]}))
            self.stdout = ["step     2/2 | loss 4.0000\n"]
        else:
            self.stdout = megatron_log(FP8_EXPERTS if fp8 else BF16_EXPERTS)
        self.returncode = 0
        return self

    def wait(self):
        return self.returncode


@pytest.fixture
def runs(monkeypatch):
    fake = FakeRuns()
    monkeypatch.setattr(demo.subprocess, "Popen", fake)
    monkeypatch.setattr(demo, "plot", lambda results, path: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPU)
    return fake


def machine(monkeypatch, cuda: bool, modules=()):
    """This machine as the demo sees it: CUDA or not, and which of the modules ``plan`` asks about import."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    plan = demo.plan
    monkeypatch.setattr(demo, "plan", lambda cuda: plan(cuda, lambda module: module in modules))


def test_summary_says_the_cpu_runs_the_reference_path_and_where_speed_is_measured():
    text = demo.report(SUMMARY, pathlib.Path("demo_results"))
    flat = " ".join(text.split())
    assert "+0.70% (within 1%)" in flat and "1,100" in flat
    assert "this demo runs on the CPU, where the FP8-Flow experts run the plain-PyTorch reference path" in flat
    assert "not FP8 against BF16" in flat and "FP8-Flow's speed is measured on GPUs" in flat
    assert "benchmarks/results/bench_moe_layer.md" in flat and "benchmarks/results/bench_megatron_pretrain.md" in flat
    assert "fp8_flow_moe_expert: experts: FP8-Flow on cpu: the plain-PyTorch reference ops" in flat
    assert "device:" not in flat and "reserved peak" not in flat


def test_on_the_cpu_the_demo_runs_the_compact_loop_as_before(monkeypatch, runs, tmp_path, capsys):
    machine(monkeypatch, cuda=False, modules={"megatron.training"})  # the compact loop whatever Megatron has
    summary = demo.main(["--train-iters", "2", "--out", str(tmp_path)])
    assert runs.cmds == [[sys.executable, "-m", "examples.pretrain_gpt", *demo.MODEL, "--train-iters", "2", *flags,
                          "--summary-json", str(tmp_path / f"{name}.json")] for name, flags in demo.RUNS.items()]
    assert runs.envs == [dict(os.environ)] * 2  # nothing added: the GPU stays as it is
    assert set(summary) == {"steps", "final_loss_window", "final_loss", "relative_deviation", "within_1_percent",
                            "runs", "speed_note"}
    assert set(summary["runs"]["bf16_experts"]) == {"tokens_per_s", "peak_memory_bytes", "wall_s", "seq_length",
                                                    "global_batch_size", "expert_path"}
    assert summary["speed_note"] == demo.SPEED_NOTE and summary["final_loss"]["bf16_experts"] == 4.5
    out = capsys.readouterr().out
    assert "  step     2/2 | loss 4.0000" in out and "device:" not in out
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_gpu_plan_runs_megatrons_bf16_grouped_experts_against_fp8_flow():
    here = demo.plan(True, lambda module: module == "megatron.training")
    assert here.gpu and here.train_iters == 500 and not here.env
    assert here.launch == (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           "-m", "examples.pretrain_gpt")
    model = " ".join(here.model)
    assert "--hidden-size 1024" in model and "--seq-length 1024" in model and "--num-experts 8" in model
    assert "--bf16" in model and "--log-interval 1" in model and " ".join(demo.LOCAL) in model
    assert here.runs["bf16_experts"] == ["--moe-grouped-gemm"]  # Megatron's own: no stand-in, no FP8-Flow
    fp8 = " ".join(here.runs["fp8_flow_moe_expert"])
    assert "--moe-fp8-flow --moe-fp8-flow-format e4m3 --fp8-recipe blockwise --moe-grouped-gemm" in fp8
    assert "--recompute-granularity selective --recompute-modules moe_expert" in fp8
    assert "--fp8-format" not in fp8  # with TE it would make the dense layers FP8 too
    assert not any(a.startswith("--bench-") for a in here.model + here.runs["fp8_flow_moe_expert"])
    assert "Megatron's pretrain" in here.path and "--transformer-impl local" in here.path


@pytest.mark.parametrize("apex", [False, True], ids=["without_apex", "with_apex"])
def test_gpu_plan_takes_transformer_engines_path_where_it_imports(apex):
    modules = {"megatron.training", "transformer_engine"} | ({"fused_weight_gradient_mlp_cuda"} if apex else set())
    here = demo.plan(True, lambda module: module in modules)
    assert "--transformer-impl transformer_engine" in " ".join(here.model) and "local" not in here.model
    assert ("--no-gradient-accumulation-fusion" in here.model) is not apex
    assert "TransformerEngine's attention and dense layers" in here.path


def test_with_cuda_but_no_megatron_training_the_compact_loop_runs_with_the_gpu_hidden():
    here = demo.plan(True, lambda module: False)
    assert not here.gpu and here.runs == demo.RUNS and here.model == demo.MODEL and here.train_iters == 120
    assert here.env == {"CUDA_VISIBLE_DEVICES": ""}
    assert "megatron.training is not importable" in here.path and "megatron-core >= 0.19" in here.path


def test_on_a_gpu_the_summary_names_the_device_the_path_and_the_backends(monkeypatch, runs, tmp_path, capsys):
    machine(monkeypatch, cuda=True, modules={"megatron.training"})
    summary = demo.main(["--train-iters", "30", "--out", str(tmp_path), "--", "--seq-length", "2048"])
    assert [cmd[:8] for cmd in runs.cmds] == [[sys.executable, *demo.TORCHRUN]] * 2
    assert all("--summary-json" not in cmd and cmd[-2:] == ["--seq-length", "2048"] for cmd in runs.cmds)
    assert summary["device"] == GPU and "Megatron's pretrain" in summary["path"]
    fp8 = summary["runs"]["fp8_flow_moe_expert"]
    # iterations 21-30 timed (the first 20 are warm-up): 8 x 2048 tokens per 100 ms
    assert fp8["tokens_per_s"] == pytest.approx(8 * 2048 / 0.1) and fp8["timed_iters"] == 10
    assert fp8["peak_memory_bytes"] == 4096 << 20 and fp8["reserved_peak_bytes"] == 5120 << 20
    assert fp8["expert_path"] == FP8_EXPERTS and summary["runs"]["bf16_experts"]["expert_path"] == BF16_EXPERTS
    assert summary["final_loss"]["bf16_experts"] == pytest.approx(sum(5.0 - i / 100 for i in range(21, 31)) / 10)
    assert json.loads((tmp_path / "fp8_flow_moe_expert.json").read_text())["loss_curve"][0] == 4.99
    flat = " ".join(capsys.readouterr().out.split())
    assert f"device: {GPU}; path: Megatron's pretrain" in flat
    assert f"fp8_flow_moe_expert: {FP8_EXPERTS}" in flat and f"bf16_experts: {BF16_EXPERTS}" in flat
    assert "iteration 25 | 100.0 ms | lm loss 4.7500" in flat and "reserved peak 5,120 MiB" in flat
    assert "after the first 20" in flat and "benchmarks/results/bench_megatron_pretrain_*.md" in flat
    assert "its speed ratio is not FP8-Flow's at scale" in flat
    assert "without TransformerEngine --moe-grouped-gemm falls back to one matmul per expert" in flat


def test_with_cuda_but_no_megatron_training_the_summary_says_the_gpu_was_not_used(monkeypatch, runs, tmp_path):
    machine(monkeypatch, cuda=True)
    summary = demo.main(["--train-iters", "2", "--out", str(tmp_path)])
    assert [env["CUDA_VISIBLE_DEVICES"] for env in runs.envs] == ["", ""]
    assert summary["device"] == f"cpu (this machine's {GPU} hidden from the runs)"
    assert "megatron-core >= 0.19" in summary["path"] and summary["speed_note"] == demo.SPEED_NOTE


def test_megatron_result_times_the_iterations_after_the_warm_up():
    log = "".join(megatron_log(FP8_EXPERTS, iters=3))
    result = demo.megatron_result(log, 1024, warmup=1)
    assert result["loss_curve"] == [4.99, 4.98, 4.97] and result["timed_iters"] == 2
    assert result["tokens_per_s"] == pytest.approx(8 * 1024 / 0.1) and result["seconds_per_step"] == pytest.approx(0.1)
    everything = demo.megatron_result(log, 1024, warmup=20)  # fewer iterations than the warm-up: all are timed
    assert everything["timed_iters"] == 3 and everything["seconds_per_step"] == pytest.approx(5.2 / 3)
    with pytest.raises(ValueError, match="no 'iteration ... lm loss' lines"):
        demo.megatron_result("experts: x\n", 1024)


def test_gemm_backends_on_cpu_and_gpu(monkeypatch):
    from transformer_engine_moe.kernels import cublaslt, grouped_gemm_deepgemm, grouped_gemm_gluon

    assert gemm_backends(torch.device("cpu")) == CPU_PATH
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(grouped_gemm_deepgemm, "available", lambda device: True)
    monkeypatch.setattr(cublaslt, "available", lambda device: True)
    monkeypatch.setattr(grouped_gemm_gluon, "available", lambda device: True)
    assert gemm_backends(cuda) == (
        "Triton kernels; grouped GEMMs 'auto', per call the first that can run it: fprop/dgrad DeepGEMM > cuBLAS "
        "(experts of >= 2048 rows and >= 2048 x 14.7M multiply-adds) > Gluon (N a multiple of 256) > Triton; wgrad "
        "cuBLAS (experts of >= 512 rows and >= 512 x 14.7M multiply-adds) > DeepGEMM (experts of >= 8192 rows) > "
        "Gluon (groups of multiples of 16) > Triton; wgrad into main_grad cuBLAS (experts "
        "of >= 512 rows and >= 512 x 14.7M multiply-adds) > DeepGEMM (main_grad as one [G, N, K]) > Triton")
    monkeypatch.setattr(grouped_gemm_deepgemm, "available", lambda device: False)
    monkeypatch.setattr(grouped_gemm_gluon, "available", lambda device: False)
    text = gemm_backends(cuda)
    assert "fprop/dgrad cuBLAS (experts of >= 2048 rows and >= 2048 x 14.7M multiply-adds) > Triton" in text and "DeepGEMM not importable" in text
    monkeypatch.setattr(cublaslt, "available", lambda device: False)
    text = gemm_backends(cuda)
    assert "wgrad Triton; wgrad into main_grad Triton" in text and "cuBLAS needs cuBLASLt >= 12.9" in text
    assert "fprop/dgrad Triton;" in text  # cuBLAS's fprop/dgrad is cuBLASLt's too
    assert gemm_backends(cuda, "triton") == "Triton kernels; grouped GEMMs 'triton'"
