"""TransformerEngine's path, the one users take (issue 38, item 4): ``megatron_patches.apply()`` with TE installed.

A 2-layer MoE GPT from Megatron's TE layer spec (``get_gpt_layer_with_transformer_engine_spec``: TE's
LayerNorm-linears and TE's fused attention through ``TEDotProductAttention``) whose MoE layers
``fp8_flow_layer_spec`` turns into FP8FlowMoELayer (the FP8FlowMoE block), trained as Megatron-LM trains it:
Megatron's no-pipelining schedule, DDP (overlapped gradient reduction, FP32 main_grad buffers),
``finalize_model_grads`` and Megatron's mixed-precision optimizer over TE's FusedAdam. With
``gradient_accumulation_fusion`` TE's linears and FP8-Flow's experts add their weight gradients into
``main_grad`` in their GEMMs (``grad_added_to_main_grad``, TE's contract); without it autograd's BF16 ``.grad``
is added there by DDP's hooks. Both from one initial model: the same main_grads.

Needs a CUDA GPU, ``transformer_engine.pytorch`` and megatron-core's TE extension; skipped otherwise (a CPU
machine only collects it). Written against TE 2.20.0.dev0 (main d0067d0) and megatron-core 0.19.2 (0.16.1 read
too).

No output layer (``post_process=False``; the loss is the squared norm of the last layer's hidden states):
Megatron's output layer is its own ``ColumnParallelLinear``, which raises at construction when
``gradient_accumulation_fusion`` is set and Apex's ``fused_weight_gradient_mlp_cuda`` does not import
(``tensor_parallel/layers.py``, 0.16.1 and 0.19.2 alike; TE fuses only its own linears), and the GPU machines
have no Apex. Every linear left is TE's or FP8-Flow's (the test checks that no Megatron linear is built).
"""

import collections
import dataclasses
import math

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.19.2)")

import torch

from conftest import CUDA, relerr
from test_cuda_graph import _config

pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: TransformerEngine's fused attention and "
                                                 "FusedAdam and the FP8-Flow kernels run there")

S, B, MICRO_BATCHES, STEPS = 256, 2, 2, 3  # sequence, micro-batch size; 512 tokens per micro-batch
HIDDEN, HEADS, EXPERTS, FFN, VOCAB = 512, 8, 8, 256, 256
# Adam's first steps move every weight by about LR whatever its gradient (sign descent): small enough that three
# of them do not overshoot hidden states of about 0.04 per element (embeddings and residual branches initialised at
# std 0.02 and 0.01), large enough to change BF16 weights of about 0.02 (ULP 1.2e-4) in three steps. This harness on
# the CPU (local spec, torch AdamW on FP32 copies; the model otherwise this one) fell 0.845 -> 0.794 -> 0.699, and
# fell at 5e-6 and 1e-4 as well.
LR = 2e-5
DENSE = {"dense_bf16": {}, "dense_te_blockwise": {"fp8": "e4m3"}}  # TE's blockwise FP8 for the dense layers too
RECOMPUTE = {"no_recompute": {}, "moe_expert": {"recompute_granularity": "selective",
                                                "recompute_modules": ["moe_expert"]}}


@pytest.fixture(scope="module")
def te():
    """``transformer_engine.pytorch``, skipping where it or megatron-core's TE extension is missing."""
    te = pytest.importorskip("transformer_engine.pytorch", reason="TransformerEngine not installed "
                                                                  "(transformer_engine.pytorch)")
    extension = pytest.importorskip("megatron.core.extensions.transformer_engine",
                                    reason="megatron-core's TransformerEngine extension does not import")
    if not getattr(extension, "HAVE_TE", False):
        pytest.skip("megatron-core's TransformerEngine extension found no TransformerEngine (HAVE_TE False)")
    return te


def _te_config(fuse: bool, dense: str, recompute: str):
    """The test_cuda_graph config (2 layers, SwiGLU experts without bias, top-2, FP8-Flow E4M3 blockwise, no
    dropout) at this file's sizes, BF16, built on the GPU, eager (no FP8-Flow CUDA graphs)."""
    return _config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN,
                   use_cpu_initialization=False, bf16=True, params_dtype=torch.bfloat16,
                   moe_fp8_flow_cuda_graph=False, gradient_accumulation_fusion=fuse, **DENSE[dense],
                   **RECOMPUTE[recompute])


def _te_gpt(config):
    """Megatron's TE layer spec through ``fp8_flow_layer_spec``, as examples.pretrain_gpt passes Megatron's spec;
    no output layer (the module docstring says why): forward returns the hidden states ``[S, B, H]``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_patches.experts import fp8_flow_layer_spec

    spec = fp8_flow_layer_spec(get_gpt_layer_with_transformer_engine_spec(num_experts=EXPERTS, moe_grouped_gemm=True),
                               config)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=S,
                    post_process=False)


def _fused(name: str) -> bool:
    """The weights whose wgrad GEMMs add into main_grad under gradient_accumulation_fusion: the experts'
    (FP8-Flow's GroupedLinears) and the attention's (TE's LayerNormLinear and Linear)."""
    return ".mlp.experts." in name or name.endswith(("linear_qkv.weight", "linear_proj.weight"))


def _check_te_path(gpt, fuse: bool, recompute: str) -> collections.Counter:
    """Assert the model is TE's path with the FP8-Flow block (no Megatron linear, so no Apex needed); return a
    counter of the block's and TE's attention backends' forward calls, which hooks fill in from now on."""
    from megatron.core.extensions.transformer_engine import (
        TEDotProductAttention,
        TELayerNormColumnParallelLinear,
        TERowParallelLinear,
    )
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_patches.experts import FP8FlowMoELayer
    from transformer_engine_moe import FP8FlowMoE

    calls = collections.Counter()
    count = lambda what: lambda *_: calls.update([what])
    assert not any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in gpt.modules())
    for layer in gpt.decoder.layers:
        attention = layer.self_attention
        assert isinstance(attention.linear_qkv, TELayerNormColumnParallelLinear)
        assert isinstance(attention.linear_proj, TERowParallelLinear)
        assert all(linear.fuse_wgrad_accumulation is fuse for linear in (attention.linear_qkv, attention.linear_proj))
        assert isinstance(attention.core_attention, TEDotProductAttention)
        for backend in ("fused_attention", "flash_attention", "unfused_attention"):  # TE's DotProductAttention's
            getattr(attention.core_attention, backend).register_forward_hook(count(backend))
        assert type(layer.mlp) is FP8FlowMoELayer and layer.mlp.token_dispatcher is None
        assert layer.mlp.cuda_graph is None  # eager: the block itself runs
        block = layer.mlp.experts
        assert isinstance(block, FP8FlowMoE) and block.num_local_experts == EXPERTS
        assert block.recompute == ("moe_expert" if recompute == "moe_expert" else None)
        assert block.linear_fc1.fuse_wgrad_accumulation is fuse and block.linear_fc2.fuse_wgrad_accumulation is fuse
        block.register_forward_hook(count("fp8_flow_block"))
    return calls


def _forward_step(data_iterator, model):
    """Megatron's forward_step_func: tokens ``[B, S]`` -> hidden states ``[S, B, H]`` and their loss, the mean
    over tokens of the squared norm (FP32: Float16Module returns the last stage's output in FP32)."""
    tokens = next(data_iterator)
    hidden = model(tokens, torch.arange(S, device=tokens.device).expand(B, -1), None)

    def loss(output):
        value = output.float().pow(2).sum(-1).mean()
        return value, {"loss": value.detach()}

    return hidden, loss


@dataclasses.dataclass
class _Run:
    losses: list  # per step: the mean of its micro-batches' losses
    main_grads: list  # per step: {name: FP32 main_grad after the step's last backward} of the _fused weights
    added: list  # per step: {name: grad_added_to_main_grad} of every parameter
    moved: dict  # name -> whether the BF16 weight changed over the steps
    calls: collections.Counter
    initial: dict  # name -> the parameter before training


def _train(ddp, gpt, optimizer, config, batches):
    """``STEPS`` steps as Megatron-LM's train_step runs them, each over the same ``batches`` (one per
    micro-batch): zero the grad buffers, the no-pipelining schedule (DDP's no_sync on all but the last
    micro-batch, ``set_is_first_microbatch`` on the first, ``finalize_model_grads`` at the end), the optimizer
    step. -> (losses, main_grads, added) as ``_Run`` holds them."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    losses, main_grads, added = [], [], []
    for _ in range(STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        store = forward_backward_no_pipelining(forward_step_func=_forward_step, data_iterator=iter(batches),
                                               model=ddp, num_microbatches=len(batches), seq_length=S,
                                               micro_batch_size=B)
        losses.append(sum(float(d["loss"]) for d in store) / len(store))
        main_grads.append({n: p.main_grad.clone() for n, p in gpt.named_parameters() if _fused(n)})
        added.append({n: p.grad_added_to_main_grad for n, p in gpt.named_parameters()})
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful and math.isfinite(float(grad_norm)), grad_norm
    return losses, main_grads, added


def _run(fuse: bool, dense: str, recompute: str, initial=None) -> _Run:
    """Build the model (from ``initial``'s parameters when given), wrap it as Megatron-LM does (Float16Module,
    DDP with overlapped reduction into FP32 buffers, Megatron's optimizer: TE's FusedAdam over FP32 copies of
    the BF16 weights, main_grad as their gradient) and train it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from transformer_engine.pytorch.optimizers import FusedAdam

    config = _te_config(fuse, dense, recompute)
    assert config.gradient_accumulation_fusion is fuse and not config.moe_fp8_flow_gradient_accumulation_fusion
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    gpt = _te_gpt(config).cuda()  # drawn on the GPU; moved there as Megatron's get_model moves it
    if initial is not None:  # the same model both times
        with torch.no_grad():
            for name, p in gpt.named_parameters():
                p.copy_(initial[name])
    initial = {name: p.detach().clone() for name, p in gpt.named_parameters()}
    calls = _check_te_path(gpt, fuse, recompute)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                        overlap_grad_reduce=True),
                                  Float16Module(config, gpt))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, bf16=True,
                                                       params_dtype=torch.bfloat16), [ddp])
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    assert inner and all(isinstance(o, FusedAdam) for o in inner), inner
    generator = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, VOCAB, (B, S), generator=generator).cuda() for _ in range(MICRO_BATCHES)]
    losses, main_grads, added = _train(ddp, gpt, optimizer, config, batches)
    moved = {name: not torch.equal(p, initial[name]) for name, p in gpt.named_parameters()}
    return _Run(losses, main_grads, added, moved, calls, initial)


@pytest.mark.parametrize("recompute", RECOMPUTE, ids=RECOMPUTE)
@pytest.mark.parametrize("dense", DENSE, ids=DENSE)
def test_gpu_te_path_trains_with_wgrads_fused_into_main_grad(te, world_of_one, dense, recompute):
    """Three optimizer steps of two micro-batches on one repeated batch, with gradient_accumulation_fusion and
    without it from the same initial model.

    Each run: TE's fused attention (cuDNN, TE's choice on Hopper) and the FP8-Flow block ran every forward;
    the losses are finite and fall step by step; every expert weight's main_grad is nonzero after every step's
    backward; every fused weight (experts, TE's attention linears) moved. Fused: those weights report
    ``grad_added_to_main_grad`` after each backward; unfused: no parameter does.

    Between the runs, first step (same weights, same batches): the fused weights' main_grads agree within 1e-2
    of their norm (relerr). The unfused run rounds each micro-batch's wgrad to BF16 before DDP adds it into the
    FP32 main_grad (2^-9 of each element, about 1e-3 of the norm), the fused GEMMs accumulate in FP32; the rest is
    run-to-run atomics upstream (the FP8-Flow unpermute's backward, the router's, cuDNN's attention backward),
    whose reordered sums can move an element across an FP8 rounding boundary of the tensors the expert GEMMs
    quantize: the bound test_experts' GPU fusion test takes. The first losses agree within 1e-3 (the forwards
    are the same up to such atomics); later ones within 1e-2: Adam moves each weight by about LR whatever the
    size of its gradient, so the runs' weights differ only where a gradient near zero changed sign."""
    if dense == "dense_te_blockwise":
        ok, why = te.is_fp8_block_scaling_available(return_reason=True)
        if not ok:
            pytest.skip(f"TransformerEngine's blockwise FP8 is unavailable here: {why}")
    fused = _run(True, dense, recompute)
    unfused = _run(False, dense, recompute, initial=fused.initial)

    forwards = STEPS * MICRO_BATCHES * 2  # per run, 2 layers
    for run in (fused, unfused):
        assert run.calls == {"fp8_flow_block": forwards, "fused_attention": forwards}, run.calls
        assert all(math.isfinite(x) for x in run.losses) and all(
            later < earlier for earlier, later in zip(run.losses, run.losses[1:])), run.losses
        for step in run.main_grads:
            assert all(g.norm() > 0 for n, g in step.items() if ".mlp.experts." in n)
        assert all(run.moved[n] for n in run.main_grads[0]), [n for n in run.main_grads[0] if not run.moved[n]]
    for step in fused.added:
        assert all(step[n] is True for n in fused.main_grads[0]), [n for n in fused.main_grads[0] if not step[n]]
    assert not any(flag for step in unfused.added for flag in step.values())

    errors = {n: relerr(g, unfused.main_grads[0][n]) for n, g in fused.main_grads[0].items()}
    assert max(errors.values()) < 1e-2, errors
    assert abs(fused.losses[0] - unfused.losses[0]) <= 1e-3 * unfused.losses[0], (fused.losses, unfused.losses)
    for got, want in zip(fused.losses, unfused.losses):
        assert abs(got - want) <= 1e-2 * want, (fused.losses, unfused.losses)
