"""Megatron's distributed checkpoint (``dist_checkpointing``) of the FP8-Flow experts: saved at EP=2 by two
spawned gloo ranks, loaded at EP=1 into the FP8-Flow block and into Megatron's own ``SequentialMLP`` experts
(the sharded keys are theirs), and a stock checkpoint loaded into the FP8-Flow block; each FP8-Flow side also
with ``moe_fp8_flow_single_grouped_weight`` (one [experts, N, K] weight, the same per-expert keys)."""

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")
pytest.importorskip("psutil", reason="megatron's torch_dist checkpoint writer needs psutil")

import os

import torch
import torch.multiprocessing as mp

from conftest import free_port

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="spawns CPU ranks over gloo")

L, E = 2, 4  # local experts at EP=2, global experts


def _model(flow: bool, ep: int, seed: int, single: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches.experts import fp8_flow_layer_spec

    config = TransformerConfig(
        num_layers=2, hidden_size=128, num_attention_heads=4, num_moe_experts=E, moe_router_topk=2,
        moe_ffn_hidden_size=128, add_bias_linear=False, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, use_cpu_initialization=True, moe_fp8_flow=flow,
        moe_fp8_flow_format="e4m3", fp8_recipe="blockwise", moe_grouped_gemm=flow,
        moe_token_dispatcher_type="alltoall", expert_model_parallel_size=ep,
        moe_fp8_flow_single_grouped_weight=single)
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=fp8_flow_layer_spec(
        get_gpt_layer_local_spec(num_experts=E), config), vocab_size=256, max_sequence_length=32)


def _global_experts(model, ep_rank: int = 0) -> dict:
    """``{(layer, global expert, 'fc1'|'fc2'): weight}`` from either expert implementation."""
    out = {}
    for layer, block in enumerate(m.mlp.experts for m in model.decoder.layers):
        if hasattr(block, "local_experts"):  # Megatron's SequentialMLP
            weights = [(e.linear_fc1.weight, e.linear_fc2.weight) for e in block.local_experts]
        else:
            weights = list(zip(block.linear_fc1.weights, block.linear_fc2.weights))
        for i, (fc1, fc2) in enumerate(weights):
            out[layer, ep_rank * len(weights) + i, "fc1"] = fc1.detach().clone()
            out[layer, ep_rank * len(weights) + i, "fc2"] = fc2.detach().clone()
    return out


def _rank(rank, world, port, ep, job, root):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    import megatron_patches
    from megatron_patches.cpu_shims import apply_cpu_shims

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    megatron_patches.apply()
    apply_cpu_shims()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    if job == "save_flow":  # the same draws with either weight layout
        for name, single in (("flow", False), ("flow_single", True)):
            model = _model(True, ep, seed=7, single=single)
            dist_checkpointing.save(model.sharded_state_dict(), f"{root}/{name}")
        torch.save(_global_experts(model, parallel_state.get_expert_model_parallel_rank()), f"{root}/saved{rank}.pt")
    else:  # load the FP8-Flow checkpoints into both implementations; save a stock one and load it back
        loaded = {}
        for name, flow, single, source in (("flow", True, False, "flow"), ("stock", False, False, "flow"),
                                           ("flow single", True, True, "flow"),
                                           ("single -> flow", True, False, "flow_single")):
            model = _model(flow, ep, seed=11, single=single)
            model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), f"{root}/{source}"))
            loaded[name] = _global_experts(model)
        stock = _model(False, ep, seed=13)
        dist_checkpointing.save(stock.sharded_state_dict(), f"{root}/stock")
        for name, single in (("stock -> flow", False), ("stock -> flow single", True)):
            flow = _model(True, ep, seed=17, single=single)
            flow.load_state_dict(dist_checkpointing.load(flow.sharded_state_dict(), f"{root}/stock"))
            loaded[name] = (_global_experts(stock), _global_experts(flow))
        torch.save(loaded, f"{root}/loaded.pt")
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_ep2_checkpoint_loads_at_ep1_into_fp8_flow_and_megatron_experts(tmp_path):
    for name in ("flow", "flow_single", "stock"):
        (tmp_path / name).mkdir()
    mp.start_processes(_rank, args=(2, free_port(), 2, "save_flow", str(tmp_path)), nprocs=2, start_method="spawn")
    mp.start_processes(_rank, args=(1, free_port(), 1, "load", str(tmp_path)), nprocs=1, start_method="spawn")
    saved = {**torch.load(tmp_path / "saved0.pt"), **torch.load(tmp_path / "saved1.pt")}
    assert len(saved) == 2 * E * 2  # layers x global experts x (fc1, fc2)
    assert not torch.equal(saved[0, 0, "fc1"], saved[0, L, "fc1"])  # the two ranks' experts differ
    loaded = torch.load(tmp_path / "loaded.pt")
    for name in ("flow", "stock", "flow single", "single -> flow"):
        assert loaded[name].keys() == saved.keys()
        for key, weight in saved.items():
            assert torch.equal(loaded[name][key], weight), (name, key)
    for name in ("stock -> flow", "stock -> flow single"):
        stock, flow = loaded[name]
        assert all(torch.equal(flow[key], stock[key]) for key in stock) and len(stock) == len(saved), name
