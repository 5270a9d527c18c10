"""``--moe-fp8-flow-cuda-graph`` / ``moe_fp8_flow_cuda_graph``: the flag, its rules (each refusal by name), the
plumbing into FP8FlowMoELayer (a GraphedFP8FlowMoE over a device-splits block, one memory pool per model); on the
GPU a small Megatron GPT trained through Megatron's schedule and DDP with the graphs as without them."""

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

import argparse

import torch

from conftest import CUDA, requires_cuda

FLAG = "--moe-fp8-flow-cuda-graph"
VALID = dict(moe_fp8_flow=True, fp8="e4m3", fp8_recipe="blockwise", num_experts=4, moe_grouped_gemm=True,
             moe_token_dispatcher_type="alltoall", swiglu=True, add_bias_linear=False, recompute_granularity=None,
             recompute_modules=None, moe_fp8_flow_cuda_graph=True)


def _validate(**changes):
    from megatron_patches.arguments import validate_fp8_flow_args

    validate_fp8_flow_args(argparse.Namespace(**{**VALID, **changes}))


def test_flag_parses_and_the_compact_cpu_loop_refuses_it(capsys):
    from examples.compact_loop import parse_args
    from megatron_patches.arguments import add_fp8_flow_args

    parser = add_fp8_flow_args(argparse.ArgumentParser())
    assert parser.parse_args([FLAG]).moe_fp8_flow_cuda_graph and not parser.parse_args([]).moe_fp8_flow_cuda_graph
    assert "CUDA graphs" in parser._option_string_actions[FLAG].help
    with pytest.raises(SystemExit):
        parse_args(("--num-layers 1 --hidden-size 128 --num-attention-heads 4 --seq-length 32 --num-experts 4 "
                    "--moe-ffn-hidden-size 128 --micro-batch-size 2 --train-iters 2 --swiglu --disable-bias-linear "
                    f"--fp8-format e4m3 --fp8-recipe blockwise --moe-fp8-flow --moe-grouped-gemm {FLAG}").split())
    assert f"{FLAG} replays CUDA graphs: the compact loop is the CPU path" in capsys.readouterr().err


REFUSED = {  # setting -> (value, the flag and value named, why)
    "expert_model_parallel_size": (2, "--expert-model-parallel-size (got 2; expected 1)", "host counts"),
    "pipeline_model_parallel_size": (2, "--pipeline-model-parallel-size (got 2; expected 1)", "one micro-batch"),
    "recompute_granularity": ("full", "--recompute-granularity (got 'full'; expected 'selective' or unset)",
                              "out of the order"),
    "cuda_graph_impl": ("local", "--cuda-graph-impl (got 'local'; expected 'none')", "Megatron's own CUDA graphs"),
    "enable_cuda_graph": (True, "--enable-cuda-graph (got True; expected it unset)", "one or the other"),
    "external_cuda_graph": (True, "--external-cuda-graph (got True; expected it unset)", "one or the other"),
    "cpu_offloading": (True, "--cpu-offloading (got True; expected it unset)", "moves saved tensors to the host"),
    "fine_grained_activation_offloading": (True, "--fine-grained-activation-offloading (got True; expected it "
                                                 "unset)", "moves saved tensors to the host"),
    "overlap_param_gather": (True, "--overlap-param-gather (got True; expected it unset)", "forward pre-hooks"),
}


@pytest.mark.parametrize("setting", REFUSED, ids=REFUSED)
def test_what_the_graphs_cannot_run_with_is_refused_by_flag(setting):
    value, named, why = REFUSED[setting]
    with pytest.raises(ValueError, match="invalid FP8-Flow settings") as error:
        _validate(**{setting: value})
    assert f"{FLAG} does not support {named}: " in str(error.value) and why in str(error.value)


def test_graphs_need_fp8_flow_and_refuse_moe_recompute_but_take_moe_expert():
    with pytest.raises(ValueError, match=f"{FLAG} replays the FP8-Flow expert block from CUDA graphs: it requires "
                                         "--moe-fp8-flow"):
        _validate(moe_fp8_flow=False)
    with pytest.raises(ValueError, match=f"{FLAG} does not support 'moe' in --recompute-modules: .* 'moe_expert' "
                                         "works with the graphs"):
        _validate(recompute_granularity="selective", recompute_modules=["moe"])
    _validate(recompute_granularity="selective", recompute_modules=["moe_expert"], cuda_graph_impl="none",
              expert_model_parallel_size=1, pipeline_model_parallel_size=1, overlap_param_gather=False)


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_patches

    megatron_patches.apply()
    settings = dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
                    moe_ffn_hidden_size=128, add_bias_linear=False, gated_linear_unit=True,
                    activation_func=torch.nn.functional.silu, use_cpu_initialization=True, moe_fp8_flow=True,
                    moe_fp8_flow_format="e4m3", fp8_recipe="blockwise", moe_grouped_gemm=True,
                    moe_token_dispatcher_type="alltoall", moe_fp8_flow_cuda_graph=True, hidden_dropout=0.0,
                    attention_dropout=0.0)
    settings.update(overrides)
    return TransformerConfig(**settings)


def test_config_rules_name_the_fields():
    with pytest.raises(ValueError, match=r"moe_fp8_flow_cuda_graph does not support expert_model_parallel_size "
                                         r"\(got 2; expected 1\)"):
        _config(expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="moe_fp8_flow_cuda_graph does not support 'moe' in recompute_modules"):
        _config(recompute_granularity="selective", recompute_modules=["moe"])
    with pytest.raises(ValueError, match="moe_fp8_flow_cuda_graph replays the FP8-Flow expert block from CUDA "
                                         "graphs: it requires moe_fp8_flow"):
        _config(moe_fp8_flow=False, moe_grouped_gemm=False)
    assert _config(recompute_granularity="selective", recompute_modules=["moe_expert"]).moe_fp8_flow_cuda_graph


def _gpt(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_patches.experts import fp8_flow_layer_spec

    spec = fp8_flow_layer_spec(get_gpt_layer_local_spec(num_experts=4), config)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=256, max_sequence_length=64)


@pytest.mark.skipif(CUDA, reason="CPU layers (use_cpu_initialization, gloo)")
def test_layers_replay_their_block_from_graphs_sharing_one_pool(world_of_one):
    """With the setting each FP8FlowMoELayer routes training forwards through a GraphedFP8FlowMoE over its block
    (device splits, gradients into DDP's main_grad), all of one model's layers in one memory pool; on the CPU a
    training forward is refused by name, evaluation runs the block eagerly; DDP's finish_grad_sync makes the
    next micro-batch requantize the weights. Without the setting, no graphs."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from transformer_engine_moe import GraphedFP8FlowMoE

    config = _config()
    model = _gpt(config)
    layers = [layer.mlp for layer in model.decoder.layers]
    graphs = [layer.cuda_graph for layer in layers]
    assert all(isinstance(g, GraphedFP8FlowMoE) and g.block is layer.experts and layer.experts.device_splits
               and g.accumulate_into_main_grad for g, layer in zip(graphs, layers))
    assert graphs[0].pool is graphs[1].pool is config._fp8_flow_graph_pool
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight0" in model.state_dict()  # no second copy of the block
    tokens = torch.randint(0, 256, (2, 64))
    run = lambda: model(tokens, torch.arange(64).expand(2, -1), None, labels=tokens)
    with pytest.raises(ValueError, match="replays CUDA graphs: hidden must be a CUDA tensor, got cpu"):
        run()
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(run()).all()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    for g in graphs:
        g._weights_current = True
    ddp.finish_grad_sync()
    assert not any(g._weights_current for g in graphs)
    plain = _gpt(_config(moe_fp8_flow_cuda_graph=False))
    assert plain.decoder.layers[0].mlp.cuda_graph is None and not plain.decoder.layers[0].mlp.experts.device_splits


@pytest.mark.skipif(CUDA, reason="CPU layer (use_cpu_initialization, FP32 parameters)")
def test_megatron_phases_run_the_block_eagerly_with_device_counts(world_of_one):
    """Megatron's phase-by-phase callers get the device-splits block eagerly (dispatch hands a device tensor of
    counts to routed_experts_compute): the same output and gradients as the block's own forward, bit for bit."""
    from test_phases import _forward, _layer, _phases, _run

    layer = _layer(_config(recompute_granularity="selective", recompute_modules=["moe_expert"]))
    layer.cuda_graph = None  # the eager block (a training forward through the graphs needs a GPU)
    x = torch.randn(32, 2, 128)
    dy = torch.randn_like(x)
    by_forward, by_phases = (_run(layer, x, dy, how) for how in (_forward, _phases))
    assert torch.equal(by_phases[0], by_forward[0]) and torch.equal(by_phases[1], by_forward[1])
    assert by_phases[2].keys() == by_forward[2].keys() and all(
        torch.equal(by_phases[2][n], g) for n, g in by_forward[2].items())


S, B, MICRO_BATCHES, STEPS = 64, 2, 3, 3


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    out = model(tokens, torch.arange(S, device=tokens.device).expand(B, -1), None, labels=tokens)

    def loss(output):
        value = output.float().mean()
        return value, {"lm loss": value.detach()}

    return out, loss


def train(ddp, config, steps=STEPS):
    """``steps`` steps of ``MICRO_BATCHES`` micro-batches through Megatron's no-pipelining schedule (DDP's
    no_sync on all but the last, is_first_microbatch on the first), each followed by DDP's finish_grad_sync and
    SGD written through ``.data`` moving every weight by 5%: ``(losses, expert main_grads per step)``."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    config.no_sync_func = ddp.no_sync
    experts = [(n, p) for n, p in ddp.module.named_parameters() if ".mlp.experts." in n]
    losses, grads = [], []
    for s in range(steps):
        gen = torch.Generator().manual_seed(s)
        batches = [torch.randint(0, 256, (B, S), generator=gen).cuda() for _ in range(MICRO_BATCHES)]
        ddp.zero_grad_buffer()
        store = forward_backward_no_pipelining(forward_step_func=_forward_step, data_iterator=iter(batches),
                                               model=ddp, num_microbatches=MICRO_BATCHES, seq_length=S,
                                               micro_batch_size=B)
        ddp.finish_grad_sync()
        losses += [float(d["lm loss"]) for d in store]
        grads.append({n: p.main_grad.clone() for n, p in experts})
        with torch.no_grad():
            for p in ddp.module.parameters():
                if p.main_grad.norm() > 0:
                    p.data.sub_(p.main_grad.to(p.dtype), alpha=0.05 * p.norm().item() / p.main_grad.norm().item())
    return losses, grads


@requires_cuda
@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap_grad_reduce"])
@pytest.mark.parametrize("fuse", [False, True], ids=["main_grad_added", "wgrad_fusion"])
def test_gpu_tiny_gpt_trains_with_cuda_graphs_as_eager(world_of_one, fuse, overlap):
    """A 2-layer BF16 MoE GPT (4 experts, top-2) through Megatron's schedule and DDP (with and without overlapped
    gradient reduction: DDP keeps the parameters' AccumulateGrad nodes, which the graphs' own leaves keep out of
    the backward capture, ``graphed_moe._weight_leaves``), three optimizer steps of
    three micro-batches: with the graphs and with the same blocks eager (``cuda_graph = None``), the losses and
    the experts' main_grads agree (Megatron's own GPU kernels leave run-to-run rounding: the tolerances),
    while the steps move every weight by 5%, which a graph reading stale weights would show. ``wgrad_fusion``:
    ``moe_fp8_flow_gradient_accumulation_fusion`` (Megatron's own ``gradient_accumulation_fusion`` off), the
    graphs' wgrad GEMMs add into main_grad themselves."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    runs = []
    for graphs in (True, False):
        config = _config(hidden_size=512, use_cpu_initialization=False, bf16=True,
                         moe_fp8_flow_gradient_accumulation_fusion=fuse)
        torch.manual_seed(3)
        model_parallel_cuda_manual_seed(3)
        model = _gpt(config).cuda()  # drawn on the GPU; moved there as Megatron's get_model moves it
        if runs:  # the same model both times
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(runs[0][2][name])
        state = {name: p.detach().clone() for name, p in model.named_parameters()}
        for layer in model.decoder.layers:
            assert layer.mlp.experts.linear_fc1.fuse_wgrad_accumulation is fuse
            if not graphs:
                layer.mlp.cuda_graph = None
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                            overlap_grad_reduce=overlap),
                                      Float16Module(config, model))
        losses, grads = train(ddp, config)
        assert all(layer.mlp.cuda_graph is None or layer.mlp.cuda_graph.captured for layer in model.decoder.layers)
        runs.append((losses, grads, state))
    (losses, grads, _), (want_losses, want_grads, _) = runs
    assert len(losses) == STEPS * MICRO_BATCHES and all(torch.isfinite(torch.tensor(losses)))
    for got, want in zip(losses, want_losses):
        assert abs(got - want) <= 1e-4 * abs(want), (losses, want_losses)
    for step_grads, step_want in zip(grads, want_grads):
        # the steps can collapse this tiny model's routers: an expert no token chose in a step has a zero gradient
        # in both runs (the bound then asks the graphs' for exactly zero); most experts were chosen in every step
        assert sum(bool(want.norm() > 0) for want in step_want.values()) >= len(step_want) * 3 // 4
        for name, want in step_want.items():
            assert (step_grads[name] - want).norm() <= 1e-3 * want.norm(), name
