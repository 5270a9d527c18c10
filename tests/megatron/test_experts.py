"""The expert swap: FP8FlowMoELayer in place of Megatron's MoELayer, driven through the adapter
interface by a plain BF16 block (the FP8FlowMoE block plugs in the same way)."""

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

import torch

from conftest import CUDA, requires_cuda

DEVICE = "cuda" if CUDA else "cpu"


class _ReferenceBlock(torch.nn.Module):
    """Local SwiGLU experts with TE's parameter names, EP=1 only: [T, H] -> [T, H]."""

    def __init__(self, config, num_local_experts, pg_collection):
        super().__init__()
        h, f = config.hidden_size, config.moe_ffn_hidden_size
        self.linear_fc1 = torch.nn.Module()
        self.linear_fc2 = torch.nn.Module()
        for i in range(num_local_experts):
            self.linear_fc1.register_parameter(f"weight{i}", torch.nn.Parameter(0.02 * torch.randn(2 * f, h)))
            self.linear_fc2.register_parameter(f"weight{i}", torch.nn.Parameter(0.02 * torch.randn(h, f)))

    def forward(self, hidden_states, probs, routing_map, is_first_microbatch=None):
        out = torch.zeros_like(hidden_states)
        for e in range(routing_map.shape[1]):
            rows = routing_map[:, e].nonzero().squeeze(1)
            a, b = (hidden_states[rows] @ getattr(self.linear_fc1, f"weight{e}").t()).chunk(2, -1)
            y = (torch.nn.functional.silu(a) * b) @ getattr(self.linear_fc2, f"weight{e}").t()
            out.index_add_(0, rows, y * probs[rows, e, None].to(y.dtype))
        return out


class _RecordingBlock(_ReferenceBlock):
    """Records the ``is_first_microbatch`` flag of each call."""

    def __init__(self, *args):
        super().__init__(*args)
        self.flags = []

    def forward(self, hidden_states, probs, routing_map, is_first_microbatch=None):
        self.flags.append(is_first_microbatch)
        return super().forward(hidden_states, probs, routing_map)


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_moe_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=128, add_bias_linear=False,
                    gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                    use_cpu_initialization=True, moe_fp8_flow=True, moe_fp8_flow_format="e4m3",
                    fp8_recipe="blockwise", moe_grouped_gemm=True,
                    moe_token_dispatcher_type="alltoall", recompute_granularity="selective",
                    recompute_modules=["moe"])
    settings.update(overrides)
    return TransformerConfig(**settings)


def _model(config, block_builder):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_patches.experts import fp8_flow_layer_spec

    spec = fp8_flow_layer_spec(get_gpt_layer_local_spec(num_experts=4), config, block_builder)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=256,
                    max_sequence_length=32).to(DEVICE)


def test_swapped_layer_trains_with_te_parameter_names(world_of_one):
    from megatron_patches.experts import FP8FlowMoELayer

    model = _model(_config(), _ReferenceBlock)
    layer = model.decoder.layers[0].mlp
    assert type(layer) is FP8FlowMoELayer and layer.token_dispatcher is None
    assert isinstance(layer.experts, _ReferenceBlock)
    names = set(model.state_dict())
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in names
    assert "decoder.layers.0.mlp.router.weight" in names
    tokens = torch.randint(0, 256, (2, 32), device=DEVICE)
    loss = model(tokens, torch.arange(32, device=DEVICE).expand(2, -1), None, labels=tokens).mean()
    loss.backward()
    assert layer.experts.linear_fc2.weight0.grad is not None and layer.router.weight.grad is not None


def test_production_builder_makes_the_fp8_flow_block(world_of_one):
    from megatron_patches.experts import build_fp8_flow_block
    from transformer_engine_moe import FP8FlowMoE, Format

    model = _model(_config(hidden_size=128, moe_ffn_hidden_size=128, moe_fp8_flow_format="hybrid",
                           recompute_modules=["moe_expert"]), build_fp8_flow_block)
    block = model.decoder.layers[0].mlp.experts
    assert isinstance(block, FP8FlowMoE) and block.recompute == "moe_expert"
    assert block.recipe.fp8_format is Format.HYBRID and block.num_local_experts == 4
    assert "decoder.layers.1.mlp.experts.linear_fc2.weight3" in model.state_dict()


def test_single_grouped_weight_setting_reaches_the_block(world_of_one):
    """``moe_fp8_flow_single_grouped_weight``: each GroupedLinear holds one [experts, N, K] weight, the model
    trains, and the state dict names it ``linear_fc1.weight``."""
    from megatron_patches.experts import build_fp8_flow_block

    model = _model(_config(moe_fp8_flow_single_grouped_weight=True, recompute_modules=["moe_expert"]),
                   build_fp8_flow_block)
    block = model.decoder.layers[0].mlp.experts
    assert block.linear_fc1.single_grouped_weight and block.linear_fc2.weight.shape == (4, 128, 128)
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight" in model.state_dict()
    tokens = torch.randint(0, 256, (2, 32), device=DEVICE)
    model(tokens, torch.arange(32, device=DEVICE).expand(2, -1), None, labels=tokens).mean().backward()
    assert block.linear_fc1.weight.grad.shape == (4, 256, 128) and block.linear_fc1.weight.grad.abs().sum() > 0


def test_compact_loop_passes_every_fp8_flow_flag_to_the_config(world_of_one):
    """The compact CPU loop builds its TransformerConfig by hand: every FP8-Flow flag reaches it (the
    single-grouped-weight flag was once parsed and dropped there)."""
    from examples.compact_loop import build_model, parse_args

    args = parse_args(("--num-layers 1 --hidden-size 128 --num-attention-heads 4 --seq-length 32 --num-experts 4 "
                       "--moe-ffn-hidden-size 128 --micro-batch-size 2 --train-iters 2 --swiglu --disable-bias-linear "
                       "--fp8-format e4m3 --fp8-recipe blockwise --moe-fp8-flow --moe-grouped-gemm "
                       "--moe-token-dispatcher-type alltoall --moe-fp8-flow-single-grouped-weight").split())
    block = build_model(args, 256).decoder.layers[0].mlp.experts
    assert block.linear_fc1.single_grouped_weight and block.recipe.fp8_format.name == "E4M3"


@pytest.mark.parametrize("megatron, experts", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["unfused", "megatron", "experts_only", "both"])
def test_block_follows_gradient_accumulation_fusion(world_of_one, megatron, experts):
    """Megatron's ``gradient_accumulation_fusion`` (for all its linears; TE's grouped experts take it as
    ``fuse_wgrad_accumulation``) or ``--moe-fp8-flow-gradient-accumulation-fusion`` (the experts alone, Megatron's
    flag off: parsed, then copied into the config as Megatron-LM copies its flags) reaches both GroupedLinears:
    with either, wgrad goes into the ``main_grad`` Megatron's DDP attaches as float32 sums; without, rounded to the
    weights' dtype first (``accumulate_into_main_grad``: the sums DDP's hook would add from ``.grad``)."""
    import argparse

    from megatron_patches.arguments import add_fp8_flow_args
    from megatron_patches.experts import _fp8_flow_block
    from megatron_patches.settings import fp8_flow_fields
    from transformer_engine_moe import module

    fusion = megatron or experts
    args = add_fp8_flow_args(argparse.ArgumentParser()).parse_args(
        ["--moe-fp8-flow", "--moe-fp8-flow-format", "e4m3"] + ["--moe-fp8-flow-gradient-accumulation-fusion"] * experts)
    config = _config(**fp8_flow_fields(args), gradient_accumulation_fusion=megatron)
    block = _fp8_flow_block(module, config, None, ep_size=1, device=DEVICE)
    assert block.linear_fc1.fuse_wgrad_accumulation is fusion and block.linear_fc2.fuse_wgrad_accumulation is fusion
    weights = block.linear_fc1.weights + block.linear_fc2.weights
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=DEVICE)
    x = torch.randn(64, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.rand(64, 4, device=DEVICE).argsort(dim=1)[:, :2]
    block.forward_topk(x, ids, torch.rand(64, 2, device=DEVICE)).sum().backward()
    assert all(bool(w.main_grad.abs().sum() > 0) for w in weights)
    assert all(getattr(w, "grad_added_to_main_grad", False) for w in weights)
    assert all(lin.add_wgrad_into_main_grad is not fusion for lin in (block.linear_fc1, block.linear_fc2))


def test_spec_unchanged_without_fp8_flow(world_of_one):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_patches.experts import fp8_flow_layer_spec

    spec = get_gpt_layer_local_spec(num_experts=4)
    config = _config(moe_fp8_flow=False, recompute_modules=None, recompute_granularity=None)
    assert fp8_flow_layer_spec(spec, config) is spec
    with pytest.raises(ValueError, match="no MoELayer"):
        fp8_flow_layer_spec(get_gpt_layer_local_spec(), _config())


def test_is_first_microbatch_follows_megatron_schedules(world_of_one):
    """Megatron's schedules call ``set_is_first_microbatch`` on a step's first micro-batch; stock resets only
    TE modules and only when ``config.fp8`` is set, patched it also resets the FP8-Flow layers with ``fp8``
    None (TE absent): the block gets True once per step (FP8 weights quantized), then False (reused).
    ``disable_parameter_transpose_cache``: None (quantized every call)."""
    config = _config(recompute_modules=None, recompute_granularity=None)
    assert config.fp8 is None
    model = _model(config, _RecordingBlock)
    tokens = torch.randint(0, 256, (2, 32), device=DEVICE)
    run = lambda: model(tokens, torch.arange(32, device=DEVICE).expand(2, -1), None, labels=tokens)
    block = model.decoder.layers[0].mlp.experts
    run(), run(), model.set_is_first_microbatch(), run(), run()
    assert block.flags == [True, False, True, False]
    config.disable_parameter_transpose_cache = True
    model.set_is_first_microbatch(), run()
    assert block.flags[4:] == [None]


def test_ddp_finish_grad_sync_drops_the_fp8_weight_cache(world_of_one):
    """Megatron's DDP ``finish_grad_sync`` (once per step, before the optimizer step) drops each FP8-Flow
    block's cached FP8 weights, so they are not alive through the optimizer step; the step's other
    micro-batches reused them before, and a later micro-batch saying False quantizes again."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_patches.experts import build_fp8_flow_block

    config = _config(recompute_modules=None, recompute_granularity=None)
    model = _model(config, build_fp8_flow_block)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    tokens = torch.randint(0, 256, (2, 32), device=DEVICE)
    step = lambda: ddp(tokens, torch.arange(32, device=DEVICE).expand(2, -1), None, labels=tokens).mean().backward()
    linears = [lin for layer in model.decoder.layers for lin in (layer.mlp.experts.linear_fc1,
                                                                 layer.mlp.experts.linear_fc2)]
    model.set_is_first_microbatch(), step()
    cached = [lin._cache for lin in linears]
    assert all(c is not None for c in cached)
    step()  # the step's second micro-batch reuses the cache
    assert all(lin._cache is c for lin, c in zip(linears, cached))
    ddp.finish_grad_sync()
    assert all(lin._cache is None for lin in linears)
    step()  # False without a cache: quantized again, and cached for the step's later micro-batches
    assert all(lin._cache is not None for lin in linears)


@pytest.mark.parametrize("single", [False, True], ids=["per_expert", "single_weight"])
def test_ddp_drops_the_wgrad_placeholders_of_main_grad_fusion(world_of_one, monkeypatch, single):
    """Under ``main_grad`` fusion the experts' ``.grad`` is a placeholder DDP's hooks drop at once, kept one per
    shape: per-expert weights share one dense zero ``[N, K]`` (as TE's dummies); a grouped weight gets an empty
    sparse ``[G, N, K]``, an exact zero of no bytes (a dense one held fc1's and fc2's 2.8 GB at ``dsv3_ep8_rank``).
    With ``zero_out_wgrad`` Megatron adds it into ``main_grad``: the wgrads there are then the same."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import transformer_engine_moe.module.grouped_linear as grouped_linear
    from megatron_patches.experts import build_fp8_flow_block

    made = []
    monkeypatch.setattr(grouped_linear, "_placeholder_wgrad",
                        lambda w, real=grouped_linear._placeholder_wgrad: made.append(real(w)) or made[-1])
    monkeypatch.setattr(grouped_linear, "_PLACEHOLDERS", {})
    config = _config(recompute_modules=None, recompute_granularity=None, moe_fp8_flow_single_grouped_weight=single,
                     moe_fp8_flow_gradient_accumulation_fusion=True, hidden_dropout=0.0, attention_dropout=0.0)
    model = _model(config, build_fp8_flow_block)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    tokens = torch.randint(0, 256, (2, 32), device=DEVICE)
    step = lambda: ddp(tokens, torch.arange(32, device=DEVICE).expand(2, -1), None, labels=tokens).mean().backward()
    weights = [w for layer in model.decoder.layers for lin in (layer.mlp.experts.linear_fc1,
                                                              layer.mlp.experts.linear_fc2) for w in lin.weight_params]
    model.set_is_first_microbatch(), step()
    assert len(made) == len(weights) and all(w.grad is None and w.grad_added_to_main_grad for w in weights)
    assert {k[0] for k in grouped_linear._PLACEHOLDERS} == {tuple(w.shape) for w in weights}
    for p in grouped_linear._PLACEHOLDERS.values():
        assert p.is_sparse == single and (p._nnz() == 0 if single else torch.count_nonzero(p) == 0)
    wgrads = [w.main_grad.clone() for w in weights]
    ddp.zero_grad_buffer()
    for w in weights:
        w.zero_out_wgrad = True
    model.set_is_first_microbatch(), step()  # no dropout: the same wgrads, plus the placeholders' zeros
    assert all(torch.equal(w.main_grad, g) for w, g in zip(weights, wgrads))
    assert any(g.abs().sum() > 0 for g in wgrads)


@pytest.mark.parametrize("single", [False, True], ids=["per_expert", "single_weight"])
def test_ddp_main_grad_fusion_writes_expert_wgrads_in_place(world_of_one, monkeypatch, single):
    """With gradient-accumulation fusion (Megatron's default with TE; here on the expert GEMMs alone,
    ``moe_fp8_flow_gradient_accumulation_fusion``: the CPU has no Apex for Megatron's own linears, so
    ``gradient_accumulation_fusion`` stays off) the expert wgrads go straight into Megatron DDP's grad buffer:
    per-expert weights, which DDP lays out in reverse order, through a list of their main_grads, a single
    grouped weight as one [G, N, K]. The main_grads equal, bit for bit (on the GPU: within run-to-run
    atomics), those of the same step without the fusion: autograd's .grad, added by DDP's hooks (the block's
    ``accumulate_into_main_grad`` off), or each gradient rounded to the weights' dtype and added in the wgrad GEMMs
    (on, as the patch builds the block: the same sums)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import transformer_engine_moe.module.grouped_linear as grouped_linear
    from megatron_patches.experts import build_fp8_flow_block

    outs, real = [], grouped_linear.grouped_gemm_wgrad
    monkeypatch.setattr(grouped_linear, "grouped_gemm_wgrad",
                        lambda *a, **kw: (outs.append(type(kw.get("out"))), real(*a, **kw))[1])
    grads = []
    for mode in ("hook", "rounded", "fused"):  # .grad added by DDP's hook; the hook's sums added in the GEMMs; fused
        fuse = mode == "fused"
        torch.manual_seed(0)
        config = _config(recompute_modules=None, recompute_granularity=None, hidden_dropout=0.0,
                         attention_dropout=0.0, moe_fp8_flow_single_grouped_weight=single,  # no dropout masks
                         moe_fp8_flow_gradient_accumulation_fusion=fuse)
        assert not config.gradient_accumulation_fusion
        model = _model(config, build_fp8_flow_block)
        for layer in model.decoder.layers:
            assert layer.mlp.experts.accumulate_into_main_grad  # as the patch builds it
            layer.mlp.experts.accumulate_into_main_grad = mode != "hook"
        linears = [lin for layer in model.decoder.layers for lin in (layer.mlp.experts.linear_fc1,
                                                                     layer.mlp.experts.linear_fc2)]
        for lin in linears:
            assert lin.fuse_wgrad_accumulation is fuse
            if CUDA:  # one GEMM backend for every run (auto could take DeepGEMM for one [G, N, K] main_grad only)
                lin.backend = "triton"
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        outs.clear()
        ddp(tokens, torch.arange(32, device=DEVICE).expand(2, -1), None, labels=tokens).mean().backward()
        assert outs == [type(None) if mode == "hook" else torch.Tensor if single else list] * len(linears)
        assert all(lin.add_wgrad_into_main_grad is (mode == "rounded") for lin in linears)
        grads.append([w.main_grad.clone() for lin in linears for w in lin.weight_params])
    assert all(g.abs().sum() > 0 for g in grads[0])
    for other in grads[1:]:
        if CUDA:  # atomics upstream (Megatron's and the unpermute's backward) order sums differently run to run
            errors = [((a - b).norm() / b.norm()).item() for a, b in zip(grads[0], other)]
            assert max(errors) < 1e-2, errors
        else:
            assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


@requires_cuda
def test_gpu_initialisation_matches_megatron_experts(world_of_one):
    """On the GPU the FP8-Flow block draws its weights as Megatron's SequentialMLP experts do, so a stock
    model and an FP8-Flow model built from one seed are identical, experts included."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_patches.experts import build_fp8_flow_block

    sizes = dict(hidden_size=128, moe_ffn_hidden_size=128, use_cpu_initialization=False,
                 params_dtype=torch.bfloat16, recompute_modules=None, recompute_granularity=None)
    models = []
    for flow in (False, True):
        torch.manual_seed(5)
        model_parallel_cuda_manual_seed(5)
        config = _config(**sizes, moe_fp8_flow=flow, moe_grouped_gemm=flow)
        models.append(_model(config, build_fp8_flow_block) if flow else GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4), vocab_size=256,
            max_sequence_length=32).cuda())
    stock, flow = (dict(m.named_parameters()) for m in models)
    for name, param in flow.items():
        if ".mlp.experts." in name:  # decoder.layers.{l}.mlp.experts.linear_fc{1,2}.weight{i}
            prefix, fc, weight = name.rsplit(".", 2)
            name = f"{prefix}.local_experts.{weight[len('weight'):]}.{fc}.weight"
        assert torch.equal(param, stock[name]), name
    assert len(flow) == len(stock)
