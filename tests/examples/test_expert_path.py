"""``expert_path``'s line for Megatron's own experts names what computes them: TransformerEngine's GroupedLinear
for ``TEGroupedMLP`` (a results table once called it "plain torch matmuls"), plain torch for the others."""

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from examples.expert_path import expert_path


class _Layer(MoELayer):
    def __init__(self, experts):  # only what expert_path reads: the experts' class and a parameter's device
        torch.nn.Module.__init__(self)
        self.experts = experts


def _model(experts_class_name):
    experts = type(experts_class_name, (torch.nn.Module,), {})()
    experts.weight = torch.nn.Parameter(torch.zeros(1))
    return torch.nn.Sequential(_Layer(experts))


def test_transformer_engines_grouped_experts_are_named_as_such():
    assert expert_path(_model("TEGroupedMLP")) == (
        "experts: Megatron's TEGroupedMLP on cpu (TransformerEngine's GroupedLinear)")
    assert expert_path(_model("SequentialMLP")) == "experts: Megatron's SequentialMLP on cpu (plain torch matmuls)"
