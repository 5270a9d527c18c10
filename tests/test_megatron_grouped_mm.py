"""benchmarks/megatron_grouped_mm.py: the BF16 grouped-GEMM stand-in for TEGroupedMLP, as the experts of Megatron's
own MoELayer (its router and all-to-all dispatcher), computes what Megatron's SequentialMLP experts compute with the
same weights, forward and backward."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

import torch

from conftest import CUDA

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from megatron_grouped_mm import GroupedMMExperts, grouped_mm_layer_spec  # noqa: E402

pytestmark = pytest.mark.skipif(CUDA, reason="CPU layers (use_cpu_initialization, FP32 parameters)")


def _moe_layer(grouped: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                               moe_router_topk=2, moe_ffn_hidden_size=32, add_bias_linear=False,
                               gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               use_cpu_initialization=True, moe_token_dispatcher_type="alltoall")
    spec = get_gpt_layer_local_spec(num_experts=4)
    if grouped:
        spec = grouped_mm_layer_spec(spec, config)
    torch.manual_seed(0)
    return build_module(spec.submodules.mlp, config=config)


def test_grouped_mm_experts_match_megatrons_sequential_experts(world_of_one):
    stock, grouped = _moe_layer(False), _moe_layer(True)
    assert isinstance(grouped.experts, GroupedMMExperts) and type(grouped) is type(stock)
    with torch.no_grad():
        grouped.router.weight.copy_(stock.router.weight)
        for i, expert in enumerate(stock.experts.local_experts):
            grouped.experts.fc1[i].copy_(expert.linear_fc1.weight)
            grouped.experts.fc2[i].copy_(expert.linear_fc2.weight)
    x = torch.randn(16, 2, 64)
    dy = torch.randn_like(x)
    outs, grads = [], []
    for layer in (stock, grouped):
        xi = x.clone().requires_grad_()
        out = layer(xi)[0]
        out.backward(dy)
        outs.append(out)
        grads.append(xi.grad)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    fc1 = torch.stack([e.linear_fc1.weight.grad for e in stock.experts.local_experts])
    torch.testing.assert_close(grouped.experts.fc1.grad, fc1, rtol=1e-5, atol=1e-6)
    assert grouped.experts.fc1.allreduce  # EP=1: reduced over data parallelism like any parameter
