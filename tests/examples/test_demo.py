"""The demo tells the truth about speed: its summary says the CPU runs the plain-PyTorch reference path and where
FP8-Flow's speed is measured; the expert-path line says which backends run the experts, on a CPU and on a GPU."""

import pathlib

import pytest
import torch

from examples import demo
from examples.expert_path import CPU_PATH, gemm_backends

SUMMARY = {"steps": 120, "final_loss_window": 10, "final_loss": {"bf16_experts": 2.7314, "fp8_flow_moe_expert": 2.7504},
           "relative_deviation": 0.0070, "within_1_percent": True,
           "runs": {"bf16_experts": {"tokens_per_s": 4000.0, "peak_memory_bytes": 881 << 20, "wall_s": 60.0,
                                     "expert_path": "experts: Megatron's SequentialMLP on cpu (plain torch matmuls)"},
                    "fp8_flow_moe_expert": {"tokens_per_s": 1100.0, "peak_memory_bytes": 920 << 20, "wall_s": 220.0,
                                            "expert_path": f"experts: FP8-Flow on cpu: {CPU_PATH}"}}}


def test_summary_says_the_cpu_runs_the_reference_path_and_where_speed_is_measured():
    text = demo.report(SUMMARY, pathlib.Path("demo_results"))
    flat = " ".join(text.split())
    assert "+0.70% (within 1%)" in flat and "1,100" in flat
    assert "this demo runs on the CPU, where the FP8-Flow experts run the plain-PyTorch reference path" in flat
    assert "not FP8 against BF16" in flat and "FP8-Flow's speed is measured on GPUs" in flat
    assert "benchmarks/results/bench_moe_layer.md" in flat and "benchmarks/results/bench_megatron_pretrain.md" in flat
    assert "fp8_flow_moe_expert: experts: FP8-Flow on cpu: the plain-PyTorch reference ops" in flat


def test_on_a_gpu_machine_the_demo_points_to_the_gpu_benchmark(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="benchmarks/bench_megatron_pretrain.py") as exit_:
        demo.main(["--out", str(tmp_path)])
    assert "which GEMM backends" in str(exit_.value.code) and not list(tmp_path.iterdir())


def test_gemm_backends_on_cpu_and_gpu(monkeypatch):
    from transformer_engine_moe.kernels import cublaslt, grouped_gemm_deepgemm

    assert gemm_backends(torch.device("cpu")) == CPU_PATH
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(grouped_gemm_deepgemm, "available", lambda device: True)
    monkeypatch.setattr(cublaslt, "available", lambda device: True)
    assert gemm_backends(cuda) == (
        "Triton kernels; grouped GEMMs 'auto', per call the first that can run it: fprop/dgrad DeepGEMM > cuBLAS "
        "(experts of >= 2048 rows and >= 2048 x 14.7M multiply-adds) > Triton; wgrad cuBLAS (experts of >= 512 "
        "rows and >= 512 x 14.7M multiply-adds) > Triton; wgrad into main_grad cuBLAS (experts of >= 512 rows and "
        ">= 512 x 14.7M multiply-adds) > DeepGEMM (main_grad as one [G, N, K]) > Triton")
    monkeypatch.setattr(grouped_gemm_deepgemm, "available", lambda device: False)
    text = gemm_backends(cuda)
    assert "fprop/dgrad cuBLAS (experts of >= 2048 rows and >= 2048 x 14.7M multiply-adds) > Triton" in text and "DeepGEMM not importable" in text
    monkeypatch.setattr(cublaslt, "available", lambda device: False)
    text = gemm_backends(cuda)
    assert "wgrad Triton; wgrad into main_grad Triton" in text and "cuBLAS needs cuBLASLt >= 12.9" in text
    assert "fprop/dgrad Triton;" in text  # cuBLAS's fprop/dgrad is cuBLASLt's too
    assert gemm_backends(cuda, "triton") == "Triton kernels; grouped GEMMs 'triton'"
