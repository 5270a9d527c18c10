"""FP8FlowMoELayer's Megatron MoE phases (route -> preprocess -> dispatch -> routed_experts_compute -> combine ->
postprocess, as Megatron's phase-by-phase callers run them) against its forward, bit for bit, with the MoE
options that meet the swap: moe_expert recompute, shared experts, router dtype, token dropping, aux and z
losses, moe_layer_freq; the options it cannot honour refused by name."""

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

import argparse

import torch

from conftest import CUDA

pytestmark = pytest.mark.skipif(CUDA, reason="CPU layer (use_cpu_initialization, FP32 parameters)")

E, T = 4, 64  # experts; tokens = sequence 32 x batch 2


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_moe_experts=E, moe_router_topk=2,
                    moe_ffn_hidden_size=128, add_bias_linear=False, gated_linear_unit=True,
                    activation_func=torch.nn.functional.silu, use_cpu_initialization=True, moe_fp8_flow=True,
                    moe_fp8_flow_format="e4m3", fp8_recipe="blockwise", moe_grouped_gemm=True,
                    moe_token_dispatcher_type="alltoall")
    settings.update(overrides)
    return TransformerConfig(**settings)


def _layer(config):
    """The FP8-Flow MoE layer Megatron's local GPT layer spec builds after ``fp8_flow_layer_spec``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_patches.experts import FP8FlowMoELayer, fp8_flow_layer_spec

    torch.manual_seed(0)
    layer = build_module(fp8_flow_layer_spec(get_gpt_layer_local_spec(num_experts=E), config).submodules.mlp,
                         config=config)
    assert type(layer) is FP8FlowMoELayer and layer.token_dispatcher is None
    layer.set_layer_number(1)
    return layer


def _forward(layer, x):
    return layer(x)[0]


def _phases(layer, x):
    """Megatron's phase sequence (MoELayer.forward's and the EP-overlap callables')."""
    shared = layer.shared_experts_compute(x)
    probs, routing_map = layer.route(x)
    tokens, probs = layer.preprocess(x, probs, routing_map)
    tokens, probs = layer.dispatch(tokens, probs)
    output, bias = layer.routed_experts_compute(tokens, probs)
    assert bias is None
    return layer.postprocess(layer.combine(output), shared)


def _run(layer, x, dy, how):
    """``how(layer, x)`` forward and backward from a fresh step: (output, dx, parameter gradients)."""
    layer.zero_grad(set_to_none=True)
    layer.is_first_microbatch = True
    x = x.clone().requires_grad_()
    out = how(layer, x)
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}


OPTIONS = {
    "plain": {},
    "moe_expert": dict(recompute_granularity="selective", recompute_modules=["moe_expert"]),
    "shared_experts": dict(moe_shared_expert_intermediate_size=256),
    "router_fp64": dict(moe_router_dtype="fp64"),
    "token_dropping": dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs"),
    "aux_and_z_loss": dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                           moe_router_load_balancing_type="seq_aux_loss"),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_phases_in_sequence_equal_forward_bitwise(world_of_one, options, dtype):
    layer = _layer(_config(**options)).to(dtype)
    x = torch.randn(32, 2, 128, dtype=dtype)
    dy = torch.randn_like(x)
    by_forward, by_phases = (_run(layer, x, dy, how) for how in (_forward, _phases))
    assert torch.equal(by_phases[0], by_forward[0]) and torch.equal(by_phases[1], by_forward[1])
    assert by_phases[2].keys() == by_forward[2].keys() and "experts.linear_fc1.weight0" in by_forward[2]
    for name, grad in by_forward[2].items():
        assert torch.equal(by_phases[2][name], grad), name
    assert layer._phase is None  # postprocess released the routing state


def _ep2_rank(rank, port, out):
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    import megatron_patches
    from megatron_patches.cpu_shims import apply_cpu_shims

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    megatron_patches.apply()
    apply_cpu_shims()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    layer = _layer(_config(expert_model_parallel_size=2, **OPTIONS["moe_expert"]))
    x = torch.randn(32, 2, 128, generator=torch.Generator().manual_seed(rank))
    runs = [_run(layer, x, torch.ones_like(x), how) for how in (_forward, _phases)]
    torch.save({"dispatcher": type(layer.experts.dispatcher).__name__, "runs": runs}, f"{out}/rank{rank}.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_phases_equal_forward_at_expert_parallel_2(tmp_path):
    """EP=2 over gloo (two spawned ranks, FP8 all-to-all): dispatch hands the layer local expert ids and the
    handle combine needs; each rank's phases equal its forward bit for bit."""
    import torch.multiprocessing as mp

    from conftest import free_port

    mp.start_processes(_ep2_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert saved["dispatcher"] == "AllToAllTokenDispatcher"
        (out, dx, grads), (out_p, dx_p, grads_p) = saved["runs"]
        assert torch.equal(out_p, out) and torch.equal(dx_p, dx) and grads_p.keys() == grads.keys()
        assert all(torch.equal(grads_p[n], g) for n, g in grads.items())


def test_moe_expert_recompute_wraps_the_experts_phase(world_of_one, monkeypatch):
    """routed_experts_compute runs the block's expert MLP twice (forward, then the moe_expert rerun in
    backward), the rerun reusing the FP8 weights the forward cached; both on the dispatch's map and layout, the
    rerun with the probs made again from the ids (the forward's are not kept)."""
    layer = _layer(_config(**OPTIONS["moe_expert"]))
    calls, mlp = [], layer.experts._mlp
    monkeypatch.setattr(layer.experts, "_mlp", lambda *a, **kw: calls.append((a[-1], kw)) or mlp(*a, **kw))
    _run(layer, torch.randn(32, 2, 128), torch.randn(32, 2, 128), _phases)
    assert [(first, sorted(kw)) for first, kw in calls] == [(True, ["routing"]), (False, ["rerun", "routing"])]
    (map, probs, layout), (rmap, rprobs, rlayout) = calls[0][1]["routing"], calls[1][1]["routing"]
    assert layout is not None and rlayout is layout and rmap is map and rprobs is not probs and calls[1][1]["rerun"]
    assert torch.equal(rprobs, probs)


def test_the_experts_phase_takes_the_dispatch_routing_for_its_tokens(world_of_one, monkeypatch):
    """routed_experts_compute hands the block the dispatch's routing (the local dispatcher's map and permute layout,
    so the permute does not convert the ids and lay out the map again), but only with the tokens and probs that
    dispatch returned: a caller passing others gets them converted from the ids."""
    layer = _layer(_config())
    seen, experts = [], layer.experts.experts
    monkeypatch.setattr(layer.experts, "experts",
                        lambda *a, routing: seen.append(routing) or experts(*a, routing=routing))
    x = torch.randn(32, 2, 128)
    probs, routing_map = layer.route(x)
    tokens, probs = layer.dispatch(*layer.preprocess(x, probs, routing_map))
    layer.routed_experts_compute(tokens, probs)
    layer.routed_experts_compute(tokens, probs.clone())
    assert seen[0] is layer._phase.routing and seen[0][0].dtype == torch.bool and seen[1] is None


def test_token_dropping_drops_tokens(world_of_one):
    layer = _layer(_config(**OPTIONS["token_dropping"]))
    probs, routing_map = layer.route(torch.randn(32, 2, 128))
    assert int(routing_map.sum()) < T * 2  # capacity 0.5: some of the T x top-2 slots dropped
    assert torch.isfinite(_phases(layer, torch.randn(32, 2, 128))).all()


def test_aux_and_z_losses_reach_the_router_only(world_of_one):
    """The router attaches its losses to its outputs: through the FP8-Flow block they change the router's
    gradient (and are logged), not the experts'."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    x, dy = torch.randn(32, 2, 128), torch.randn(32, 2, 128)
    clear_aux_losses_tracker()
    with_losses = _run(_layer(_config(**OPTIONS["aux_and_z_loss"])), x, dy, _forward)[2]
    tracker = get_moe_layer_wise_logging_tracker()
    assert float(tracker["seq_load_balancing_loss"]["values"][0]) > 0 and float(tracker["z_loss"]["values"][0]) > 0
    without = _run(_layer(_config(moe_router_load_balancing_type="seq_aux_loss")), x, dy, _forward)[2]
    assert not torch.equal(with_losses["router.weight"], without["router.weight"])
    assert all(torch.equal(with_losses[n], without[n]) for n in without if n.startswith("experts."))


def test_moe_layer_freq_swaps_only_the_moe_layers(world_of_one):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.mlp import MLP

    from megatron_patches.experts import FP8FlowMoELayer, fp8_flow_layer_spec

    config = _config(moe_layer_freq=[1, 0])
    spec = fp8_flow_layer_spec(get_gpt_decoder_block_spec(config, use_transformer_engine=False), config)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=256, max_sequence_length=32)
    assert [type(layer.mlp) for layer in model.decoder.layers] == [FP8FlowMoELayer, MLP]
    tokens = torch.randint(0, 256, (2, 32))
    model(tokens, torch.arange(32).expand(2, -1), None, labels=tokens).mean().backward()
    assert model.decoder.layers[0].mlp.experts.linear_fc1.weight0.grad is not None


def test_phases_need_the_order_and_the_blocks_phases(world_of_one):
    layer = _layer(_config())
    with pytest.raises(RuntimeError, match="FP8FlowMoELayer.dispatch: run the phases in Megatron's order"):
        layer.dispatch(torch.zeros(T, 128), torch.zeros(T, 2))
    layer.experts = torch.nn.Linear(1, 1)
    with pytest.raises(TypeError, match=r"Linear lacks \['quantize', 'dispatch', 'routed_experts', 'combine'\]"):
        layer.preprocess(torch.zeros(T, 128), torch.zeros(T, E), torch.zeros(T, E, dtype=torch.bool))


REFUSED = {
    "overlap_moe_expert_parallel_comm": ("--overlap-moe-expert-parallel-comm", "EP-overlap schedule"),
    "delay_wgrad_compute": ("--delay-wgrad-compute", "no backward_dw"),
    "moe_shared_expert_overlap": ("--moe-shared-expert-overlap", "token dispatcher, which FP8-Flow replaces"),
    "moe_pad_expert_input_to_capacity": ("--moe-pad-expert-input-to-capacity", "not to the capacity"),
    "moe_router_padding_for_fp8": ("--moe-router-padding-for-fp8", "more than top-k experts"),
    "moe_apply_probs_on_input": ("--moe-apply-probs-on-input", "fused SwiGLU"),
    "moe_latent_size": ("--moe-latent-size", "latent projections"),
}


@pytest.mark.parametrize("setting", REFUSED, ids=REFUSED)
def test_unsupported_options_are_refused_by_flag_at_argument_validation(setting):
    """As Megatron's parser (megatron.training) leaves them in args: validate_fp8_flow_args names the flag, the
    value, what is expected and why."""
    from megatron_patches.arguments import validate_fp8_flow_args

    args = argparse.Namespace(moe_fp8_flow=True, fp8="e4m3", fp8_recipe="blockwise", num_experts=E,
                              moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall", swiglu=True,
                              add_bias_linear=False, recompute_granularity=None, recompute_modules=None,
                              **{setting: 512 if setting == "moe_latent_size" else True})
    flag, why = REFUSED[setting]
    value = 512 if setting == "moe_latent_size" else True
    with pytest.raises(ValueError, match="invalid FP8-Flow settings") as error:
        validate_fp8_flow_args(args)
    assert f"--moe-fp8-flow does not support {flag} (got {value}; expected it unset)" in str(error.value)
    assert why in str(error.value)


def test_overlap_and_other_flex_backends_are_refused_in_the_config():
    with pytest.raises(ValueError, match="does not support overlap_moe_expert_parallel_comm .*EP-overlap"):
        _config(overlap_moe_expert_parallel_comm=True, expert_model_parallel_size=2, bf16=True)
    with pytest.raises(ValueError, match="moe_flex_dispatcher_backend must be 'deepep' \\(got 'hybridep'\\)"):
        _config(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")
