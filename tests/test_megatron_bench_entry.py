"""benchmarks/megatron_bench_entry.py on the CPU: its flags come off the command line before Megatron parses it,
the layer spec it builds (SDPA core attention, then the stand-in's experts or FP8-Flow's layers), how it names
the optimizer that ran, and the profiled iteration (a fake ``train_step`` under torch.profiler: one call profiled,
its optimizer step in the optimizer's range, the profile written or its error reported). (Its hooks into
Megatron's ``train`` need megatron.training, and the kernels a GPU: the GPU runs.)"""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import megatron_bench_entry as entry  # noqa: E402


def test_bench_flags_come_off_the_command_line():
    bench, rest = entry.parse_bench_args(["--bench-grouped-mm", "--num-layers", "4", "--bench-probe-memory",
                                          "--bench-max-micro-batch-cap", "64", "--bf16"])
    assert rest == ["--num-layers", "4", "--bf16"]
    assert bench.bench_grouped_mm and bench.bench_probe_memory and not bench.bench_sdpa_attention
    assert bench.bench_max_micro_batch_cap == 64
    assert entry.parse_bench_args(["--bf16"])[0].bench_max_micro_batch_cap == 0  # no search by default
    assert not bench.bench_no_fp8_weight_cache
    with pytest.raises(ValueError, match="exclude each other"):
        entry.parse_bench_args(["--bench-grouped-mm", "--moe-fp8-flow"])
    with pytest.raises(ValueError, match="must be >= 0"):
        entry.parse_bench_args(["--bench-max-micro-batch-cap", "-1"])


def test_profile_flags():
    bench, rest = entry.parse_bench_args(["--bench-profile-iteration", "4", "--bf16", "--bench-profile-out", "p.json"])
    assert (bench.bench_profile_iteration, bench.bench_profile_out, rest) == (4, "p.json", ["--bf16"])
    assert entry.parse_bench_args([])[0].bench_profile_iteration == 0  # no profile by default
    with pytest.raises(ValueError, match="go together"):
        entry.parse_bench_args(["--bench-profile-iteration", "4"])
    with pytest.raises(ValueError, match="go together"):
        entry.parse_bench_args(["--bench-profile-out", "p.json"])
    with pytest.raises(ValueError, match="--bench-profile-iteration must be >= 0"):
        entry.parse_bench_args(["--bench-profile-iteration", "-1", "--bench-profile-out", "p.json"])


@pytest.mark.parametrize("grouped, fp8_flow", [(True, False), (False, True), (False, False)],
                         ids=["stand_in", "fp8_flow", "megatron_experts"])
def test_layer_spec(grouped, fp8_flow, world_of_one):
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_grouped_mm import GroupedMMExperts
    from megatron_patches.experts import FP8FlowMoELayer
    from sdpa_attention import SDPACoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=4, num_moe_experts=4,
                               moe_ffn_hidden_size=128, moe_router_topk=2, add_bias_linear=False,
                               gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               moe_grouped_gemm=True, moe_fp8_flow=fp8_flow,
                               fp8_recipe="blockwise", moe_fp8_flow_format="e4m3" if fp8_flow else None,
                               moe_token_dispatcher_type="alltoall", use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True)
    for sdpa in (True, False):
        bench, _ = entry.parse_bench_args((["--bench-grouped-mm"] if grouped else [])
                                          + (["--bench-sdpa-attention"] if sdpa else []))
        built = entry.layer_spec(bench)(spec, config).submodules
        assert built.self_attention.submodules.core_attention is (SDPACoreAttention if sdpa else DotProductAttention)
        mlp = built.mlp
        experts = mlp.keywords["submodules"].experts if hasattr(mlp, "keywords") else mlp.submodules.experts
        layer_class = mlp.func if hasattr(mlp, "func") else mlp.module
        assert (experts is GroupedMMExperts) == grouped and (layer_class is FP8FlowMoELayer) == fp8_flow
    assert not config.disable_parameter_transpose_cache
    entry.layer_spec(entry.parse_bench_args(["--bench-no-fp8-weight-cache"])[0])(spec, config)
    assert config.disable_parameter_transpose_cache  # the config the model's layers share


class Float16OptimizerWithFloat16Params:
    def __init__(self, inner):
        self.optimizer = inner


class ChainedOptimizer:
    def __init__(self, *parts):
        self.chained_optimizers = list(parts)


def test_optimizer_description_names_torchs_mode_inside_megatrons_wrappers():
    params = [torch.nn.Parameter(torch.zeros(2))]
    default, fused = torch.optim.AdamW(params), torch.optim.AdamW(params, foreach=False, fused=False)
    chained = ChainedOptimizer(Float16OptimizerWithFloat16Params(default), Float16OptimizerWithFloat16Params(default))
    assert entry.optimizer_description(chained) == \
        "torch.optim.adamw.AdamW (foreach) in Float16OptimizerWithFloat16Params"  # the two parts are one kind
    assert entry.optimizer_description(Float16OptimizerWithFloat16Params(fused)).startswith(
        "torch.optim.adamw.AdamW (for-loop)")

    class FusedAdam(torch.optim.Optimizer):  # stands for TE's or Apex's
        __module__ = "transformer_engine.pytorch.optimizers.fused_adam"

    te = FusedAdam(params, {})
    assert entry.optimizer_description(Float16OptimizerWithFloat16Params(te)) == \
        "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam in Float16OptimizerWithFloat16Params"


def test_a_failing_measurement_is_reported_not_raised(capsys):
    import bench_megatron_pretrain

    entry.report_safely("max_micro_batch", lambda: {"max_micro_batch": 12})
    entry.report_safely("max_micro_batch", lambda: 1 / 0)
    assert bench_megatron_pretrain.bench_lines(capsys.readouterr().out) == {
        "max_micro_batch": 12, "max_micro_batch_error": "ZeroDivisionError: division by zero"}


def _fake_train_step(calls):
    """Megatron's ``train_step`` contract on a toy model: a forward and backward, then ``optimizer.step()``."""
    def train_step(forward_step_func, data_iterator, model, optimizer, *args, iteration=None):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        calls.append(iteration)
        return iteration

    return train_step


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_the_profiled_iteration_runs_under_the_profiler_with_its_optimizer_step_scoped(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(entry.torch.cuda, "synchronize", lambda: None)
    seen = []

    def kernel_sites(events, steps):  # the CPU has no kernels: the sites the profiler would give on a GPU
        seen.extend((e.name, e.cpu_parent.name if e.cpu_parent else None) for e in events)
        return {}, {("gemm", "aten::mm"): [2.0, 3.0], ("adam", "Optimizer.step#SGD.step"): [5.0, 1.0]}

    monkeypatch.setattr(entry.kernel_profile, "kernel_sites", kernel_sites)
    model = torch.nn.Linear(4, 4)
    optimizer, calls, out = torch.optim.SGD(model.parameters(), lr=0.1), [], tmp_path / "profile.json"
    step = entry.profiled_train_step(_fake_train_step(calls), 2, str(out))
    assert [step(None, None, model, optimizer, iteration=i) for i in range(3)] == [0, 1, 2] and calls == [0, 1, 2]
    assert ("Optimizer.step#SGD.step", entry.kernel_profile.OPTIMIZER_SCOPE) in seen  # the second call only
    assert seen.count((entry.kernel_profile.OPTIMIZER_SCOPE, None)) == 1
    assert "step" not in vars(optimizer)  # the optimizer's own step again
    profile = json.loads(out.read_text())
    assert profile["iteration"] == 2 and profile["wall_ms"] > 0
    assert profile["kernels"] == [dict(kernel="adam", launched_by="Optimizer.step#SGD.step", ms=5.0, launches=1.0),
                                  dict(kernel="gemm", launched_by="aten::mm", ms=2.0, launches=3.0)]
    import bench_megatron_pretrain

    facts = bench_megatron_pretrain.bench_lines(capsys.readouterr().out)
    assert (facts["profile_iteration"], facts["profile_out"], facts["profile_kernels"]) == (2, str(out), 2)


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_profile_that_cannot_be_written_is_reported_and_the_step_stands(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(entry.torch.cuda, "synchronize", lambda: None)
    model = torch.nn.Linear(4, 4)
    calls = []
    step = entry.profiled_train_step(_fake_train_step(calls), 1, str(tmp_path / "missing" / "profile.json"))
    assert step(None, None, model, torch.optim.SGD(model.parameters(), lr=0.1), iteration=7) == 7
    assert capsys.readouterr().out.startswith('bench: {"profile_error": "FileNotFoundError')
