"""A BF16 grouped-GEMM stand-in for TransformerEngine's ``TEGroupedMLP`` in Megatron runs (benchmark only).

What a TransformerEngine user's BF16 run does: Megatron's ``MoELayer`` with its own token dispatcher and
router, and experts that run the local experts' SwiGLU MLPs as grouped GEMMs on stacked weights
(``baselines.grouped_swiglu``: two ``torch._grouped_mm``) instead of ``SequentialMLP``'s per-expert loop.
``grouped_mm_layer_spec`` puts it into Megatron's layer spec (``megatron_patches.experts.replace_moe_experts``);
``megatron_bench_entry.py --bench-grouped-mm`` runs Megatron's ``pretrain`` with it.
"""

from __future__ import annotations

import torch
from torch import nn

from baselines import grouped_swiglu


class GroupedMMExperts(nn.Module):
    """Megatron's experts interface: ``forward(permuted_local_hidden_states [M, H], tokens_per_expert [L]
    (host or device ints), permuted_probs [M]) -> ([M, H], None)``, the rows grouped by local expert as
    Megatron's dispatcher permutes them. Parameters ``fc1 [L, 2F, H]`` (gate rows, then up), ``fc2 [L, H, F]``.

    On the GPU each expert's slices are drawn as Megatron's ``SequentialMLP`` draws its experts (same order,
    expert-parallel CUDA RNG), so one seed gives the same initial experts in every run of the benchmark; with
    ``use_cpu_initialization`` they are drawn by the init methods directly. ``allreduce = False`` at EP > 1:
    Megatron's DDP reduces them over the expert data-parallel group.
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None, **kwargs):
        super().__init__()
        from megatron.core.tensor_parallel.layers import _initialize_affine_weight_gpu

        h, f = config.hidden_size, config.moe_ffn_hidden_size
        gpu = torch.cuda.is_available() and not config.use_cpu_initialization
        device = torch.cuda.current_device() if gpu else "cpu"
        self.fc1 = nn.Parameter(torch.empty(num_local_experts, 2 * f, h, dtype=config.params_dtype, device=device))
        self.fc2 = nn.Parameter(torch.empty(num_local_experts, h, f, dtype=config.params_dtype, device=device))
        with torch.no_grad():
            for i in range(num_local_experts):
                if gpu:
                    _initialize_affine_weight_gpu(self.fc1[i], config.init_method, partition_dim=0, stride=2,
                                                  is_expert=True)
                    _initialize_affine_weight_gpu(self.fc2[i], config.output_layer_init_method, partition_dim=1,
                                                  is_expert=True)
                else:
                    config.init_method(self.fc1[i])
                    config.output_layer_init_method(self.fc2[i])
        ep_size = torch.distributed.get_world_size(pg_collection.ep) if pg_collection is not None else 1
        for param in (self.fc1, self.fc2):
            param.allreduce = ep_size <= 1

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, **kwargs):
        offs = torch.as_tensor(tokens_per_expert, device=self.fc1.device).cumsum(0, dtype=torch.int32)
        return grouped_swiglu(permuted_local_hidden_states, permuted_probs, self.fc1, self.fc2, offs), None


def grouped_mm_layer_spec(spec, config):
    """Megatron's layer (or block) spec with ``GroupedMMExperts`` as the MoE layers' experts."""
    from megatron_patches.experts import replace_moe_experts

    return replace_moe_experts(spec, GroupedMMExperts)
